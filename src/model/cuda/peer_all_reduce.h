// A one-shot all-reduce over peer memory for the small messages of decode steps under tensor
// parallelism (issue #17). The ranks are one process's GPUs (tensor_parallel.h), so once peer
// access is on, each rank's kernel reads every other rank's buffer directly (NVLink):
// by default (low latency) each rank stores its floats into every peer's receive buffer, each
// pair of floats in one 16-byte store with the call's number beside each float (as NCCL's LL
// protocol does), and every rank sums the values in rank order once their numbers match, so
// every rank gets the same bits. KVQ_TP_PEER_MODE=barrier instead copies x into the rank's own
// buffer, signals and waits on a flag per block and rank, then reads every peer's buffer.
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
  // Makes every kernel waiting for a peer return, now and later (the group's failure path).
  void abort();

 private:
  PeerAllReduce() = default;
  int n_ = 0;
  size_t max_floats_ = 0;
  int blocks_ = 0;
  bool low_latency_ = true;  // KVQ_TP_PEER_MODE=barrier: the copy / flag barrier / read variant
  // Per rank (on its device): the double buffer [2][max_floats], the flags peers write
  // [blocks][n], and the per-block call counters [blocks].
  std::vector<float*> data_;
  std::vector<uint32_t*> flags_;
  std::vector<uint32_t*> epochs_;
  volatile int* abort_ = nullptr;  // mapped, pinned host memory
};

}  // namespace kvq::cuda_model
