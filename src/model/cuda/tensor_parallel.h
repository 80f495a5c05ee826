// Tensor parallelism of the CUDA model (--tensor-parallel-size N, issue #17), inside one
// process: one CudaDecoderModel per GPU (rank r on device r), each holding its slice of every
// projection (q|k|v and gate|up by output rows, o and down by input columns, as vLLM's
// ColumnParallelLinear / RowParallelLinear), its kv heads' share of the paged cache
// (slice_kv_plan), and a replicated embedding, norms and LM head. After o and down each rank
// holds a partial product; an NCCL all-reduce (sum, fp32, in place on the residual stream)
// gives every rank the same residual, so every rank computes the same logits and samples the
// same ids (rank 0's are returned). One worker thread per rank runs each call; the scheduler
// runs once, so block tables are identical everywhere. docs/ARCHITECTURE.md has the design.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kvq/model/cuda_model.h"
#include "kvq/plan/kv_plan.h"
#include "kvq/plan/tensor_parallel.h"

namespace kvq::cuda_model {

class PeerAllReduce;

// One rank of a group (size 1: no tensor parallelism).
struct TpRank {
  int rank = 0;
  int size = 1;
  TensorParallelSplit split;
  void* comm = nullptr;  // the rank's ncclComm_t (size > 1)
  // The group's one-shot peer-memory all-reduce for messages it fits (peer_all_reduce.h);
  // nullptr: NCCL for every size.
  const PeerAllReduce* peer = nullptr;
  // KVQ_TP_ALLREDUCE=off: a timing diagnostic that skips the all-reduces (the results are
  // wrong), so a benchmark can measure their share of the step.
  bool skip_all_reduce = false;
  bool active() const { return size > 1; }
};

// Whether this build has NCCL (tensor parallelism above 1).
bool tensor_parallel_available();

// Sum-all-reduce of n floats in place on `stream` (no-op when !tp.active()): the group's
// peer-memory all-reduce for the messages it fits, else NCCL over the rank's communicator.
// Graph-capturable.
void all_reduce_sum(const TpRank& tp, float* x, size_t n, cudaStream_t stream);

// all_reduce_sum of T rows of H floats fused with the RMSNorm that follows (out = the rows'
// rms_norm_rows with weight w, bf16 or fp32), where the group's peer all-reduce fits them;
// false, with nothing done, otherwise (then all_reduce_sum and rms_norm_rows), under
// KVQ_TP_ALLREDUCE=off, and unless KVQ_TP_FUSED_NORM=1 (opt-in: measured slower so far).
// Graph-capturable.
bool all_reduce_rms_norm(const TpRank& tp, float* x, int T, int H, const float* w, float eps,
                         void* out, bool bf16, cudaStream_t stream);

// All-gather: recv[r][0..n) = rank r's send[0..n) on every rank (the vocabulary-parallel LM
// head's logits). Graph-capturable.
void all_gather(const TpRank& tp, const float* send, size_t n, float* recv, cudaStream_t stream);

// Loads rank `tp.rank`'s model on the current device (the group sets it first).
using RankLoader = std::function<std::unique_ptr<CudaModel>(const TpRank& tp)>;

// A group of options.tensor_parallel_size ranks on devices 0..N-1 of `plan` (the whole
// model's plan; each rank gets slice_kv_plan's). InputError when the heads or the MLP do not
// split, fewer devices are visible, or the build has no NCCL.
std::unique_ptr<CudaModel> make_tensor_parallel_model(const KvPlan& plan,
                                                      const CudaModelOptions& options,
                                                      const RankLoader& load);

}  // namespace kvq::cuda_model
