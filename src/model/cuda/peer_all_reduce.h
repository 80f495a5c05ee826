// A one-shot all-reduce over peer memory for the small messages of decode steps under tensor
// parallelism (issue #17). The ranks are one process's GPUs (tensor_parallel.h), so once peer
// access is on, each rank's kernel reads every other rank's buffer directly (NVLink):
// for small messages (low latency) each rank stores its floats into every peer's receive
// buffer, each pair of floats in one 16-byte store with the call's number beside each float (as
// NCCL's LL protocol does), and every rank sums the values in rank order once their numbers
// match, so every rank gets the same bits. Larger ones (the barrier variant, half the bytes)
// copy x into the rank's own buffer, signal and wait on a flag per block and rank, then read
// every peer's buffer and sum in rank order.
// One kernel, no host work, graph-capturable (measured: docs/notes/tensor-parallel.md).
// A spinning kernel whose peer never comes would hang its stream, so every wait also polls an
// abort word in mapped host memory: abort() (the group's failure path) makes every waiting
// kernel return (its output is then garbage, and the group is stopped anyway).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace kvq::cuda_model {

class PeerAllReduce {
 public:
  // For ranks on devices 0..n-1, messages of up to max_floats floats. nullptr (NCCL then
  // serves every size) when some pair of devices has no peer access, or
  // KVQ_TP_PEER_ALLREDUCE=0. Enables peer access between every pair.
  static std::unique_ptr<PeerAllReduce> create(int n, size_t max_floats);
  ~PeerAllReduce();
  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  int size() const { return n_; }
  // Whether a message of n floats goes this way (else NCCL).
  bool fits(size_t n) const { return n <= max_floats_; }
  // Rank `rank`'s part of a sum-all-reduce of n floats in place (device `rank` current). Every
  // rank must make the same sequence of calls (as with NCCL). Graph-capturable.
  void run(int rank, float* x, size_t n, cudaStream_t stream) const;
  // The same for T rows of H floats, fused with the RMSNorm that follows it (row_ops.cuh's
  // RMSNorm, summing squares in another order than rms_norm_rows): x gets the sum, out (bf16
  // or fp32) its normalized rows with weight w. False, with nothing launched, when the rows do
  // not fit the low-latency variant (then run() and a separate RMSNorm); every rank gets the
  // same answer for the same call.
  bool run_rms_norm(int rank, float* x, int T, int H, const float* w, float eps, void* out,
                    bool bf16, cudaStream_t stream) const;
  // Makes every kernel waiting for a peer return, now and later (the group's failure path).
  void abort();

 private:
  PeerAllReduce() = default;
  int n_ = 0;
  size_t max_floats_ = 0;
  int blocks_ = 0;
  // Messages up to this size take the low-latency variant, larger ones the barrier variant
  // (KVQ_TP_PEER_MODE=ll / barrier: one variant for all; KVQ_TP_PEER_LL_MAX: the bound).
  size_t ll_max_floats_ = 0;
  // Per rank (on its device): the double buffer [2][max_floats], the flags peers write
  // [blocks][n], and the per-block call counters [blocks].
  std::vector<float*> data_;  // the barrier variant's [2][max_floats]
  std::vector<uint4*> ll_;    // the low-latency variant's [2][n][ll_max_floats / 2]
  std::vector<uint32_t*> flags_;
  std::vector<uint32_t*> epochs_;
  volatile int* abort_ = nullptr;  // mapped, pinned host memory
};

}  // namespace kvq::cuda_model
