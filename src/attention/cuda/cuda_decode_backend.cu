// "cuda_decode": the CUDA decode attention (cuda_decode.h) behind the AttentionBackend
// interface.
//
// Pointer contract of AttentionArgs for this backend: q, out and the cache view's bases are
// DEVICE pointers; q_indptr and the block table's arrays are HOST pointers (run() validates
// them on the host before run_impl; this backend uploads them). run() is synchronous: it
// returns after the kernels finished, like the CPU backends.
//
// Decode only: every sequence must have exactly one query (q_len == 1). The whitelist
// interface has no field for "decode only" (reasons_unsupported sees the spec, not the
// problem), so a prefill call reaches run() and fails there with InternalError.
#include <cuda_runtime.h>

#include <mutex>
#include <string>
#include <vector>

#include "attention/backends.h"
#include "attention/cuda/cuda_decode.h"
#include "cache/cuda/cuda_check.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"

namespace kvq {

namespace {

class CudaDecodeBackend final : public AttentionBackend {
 public:
  CudaDecodeBackend() {
    caps_.device = Device::kCuda;
    caps_.priority = 100;
    for (const auto& t : kKvDtypeTraits)
      if (t.concrete && t.valid_as_k && t.valid_as_v)
        caps_.kv_dtype_pairs.push_back({t.dtype, t.dtype});
    caps_.head_dims = {64, 128, 256};
    caps_.block_tokens = {16, 32};
    // A decode query is the last position: causal and non-causal see the same keys.
    caps_.attention_kinds = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                             AttentionKind::kNonCausal};
    caps_.logit_soft_cap = true;
  }
  ~CudaDecodeBackend() override {
    if (buffer_) (void)cudaFree(buffer_);
  }
  std::string_view name() const override { return "cuda_decode"; }
  const AttentionCapabilities& capabilities() const override { return caps_; }

 protected:
  std::vector<std::string> extra_reasons(const LayerKvSpec& spec) const override {
    std::vector<std::string> r;
    if (spec.head_dim_k != spec.head_dim_v)
      r.push_back("K head_dim " + std::to_string(spec.head_dim_k) + " differs from V head_dim " +
                  std::to_string(spec.head_dim_v));
    if (spec.num_kv_heads > cuda::kDecodeMaxKvHeads)
      r.push_back("num_kv_heads " + std::to_string(spec.num_kv_heads) + " exceeds " +
                  std::to_string(cuda::kDecodeMaxKvHeads));
    static const int devices = cuda_device_count();
    if (devices == 0) r.push_back("no CUDA device is available");
    return r;
  }

  void run_impl(const LayerKvSpec& spec, const AttentionArgs& args) const override {
    const BlockTableView& bt = args.block_table;
    const int32_t n = bt.num_seqs;
    if (n == 0) return;
    for (int32_t i = 0; i < n; ++i)
      KVQ_CHECK(args.q_indptr[i + 1] - args.q_indptr[i] == 1,
                "cuda_decode runs decode only (one query per sequence); sequence " +
                    std::to_string(i) + " has " +
                    std::to_string(args.q_indptr[i + 1] - args.q_indptr[i]) + " queries");
    const size_t num_indices = static_cast<size_t>(bt.indptr[n]);
    const cuda::DecodePlan plan =
        cuda::plan_decode(spec, std::span<const int32_t>(bt.seq_lens, static_cast<size_t>(n)));

    // One device buffer: the block table followed by the kernels' workspace.
    const size_t table_bytes = (static_cast<size_t>(2 * n + 1) + num_indices) * sizeof(int32_t);
    const size_t ws_offset = (table_bytes + 255) / 256 * 256;
    std::lock_guard<std::mutex> lock(mu_);
    if (capacity_ < ws_offset + plan.workspace_bytes) {
      if (buffer_) KVQ_CUDA_CHECK(cudaFree(buffer_));
      buffer_ = nullptr;
      capacity_ = 0;
      KVQ_CUDA_CHECK(cudaMalloc(&buffer_, ws_offset + plan.workspace_bytes));
      capacity_ = ws_offset + plan.workspace_bytes;
    }
    auto* table = static_cast<int32_t*>(buffer_);
    int32_t* d_indptr = table;
    int32_t* d_seq_lens = table + n + 1;
    int32_t* d_indices = table + 2 * n + 1;
    cudaStream_t stream = nullptr;
    KVQ_CUDA_CHECK(cudaMemcpyAsync(d_indptr, bt.indptr, sizeof(int32_t) * (n + 1),
                                   cudaMemcpyHostToDevice, stream));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(d_seq_lens, bt.seq_lens, sizeof(int32_t) * n,
                                   cudaMemcpyHostToDevice, stream));
    if (num_indices > 0)
      KVQ_CUDA_CHECK(cudaMemcpyAsync(d_indices, bt.indices, sizeof(int32_t) * num_indices,
                                     cudaMemcpyHostToDevice, stream));
    cuda::DecodeArgs d;
    d.q = args.q;
    d.out = args.out;
    d.block_table = bt;
    d.block_table.indptr = d_indptr;
    d.block_table.indices = d_indices;
    d.block_table.seq_lens = d_seq_lens;
    d.cache = args.cache;
    d.softmax_scale = args.softmax_scale;
    d.logit_soft_cap = args.logit_soft_cap;
    d.workspace = static_cast<std::byte*>(buffer_) + ws_offset;
    cuda::run_decode(spec, plan, d, stream);
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

 private:
  AttentionCapabilities caps_;
  mutable std::mutex mu_;
  mutable void* buffer_ = nullptr;
  mutable size_t capacity_ = 0;
};

}  // namespace

const AttentionBackend& cuda_decode_backend() {
  static const CudaDecodeBackend backend;
  return backend;
}

}  // namespace kvq
