// "cuda": the CUDA attention kernels behind the AttentionBackend interface. A batch whose
// sequences all have one query runs the split-KV decode (cuda_decode.h); anything else runs
// the prefill kernel (cuda_prefill.h), which handles any mix of q_len >= 1.
//
// Pointer contract of AttentionArgs for this backend: q, out and the cache view's bases are
// DEVICE pointers; q_indptr and the block table's arrays are HOST pointers (run() validates
// them on the host before run_impl; this backend uploads them). run() is synchronous: it
// returns after the kernels finished, like the CPU backends.
//
// The whitelist is every concrete (K, V) pair. The tensor-core decode and prefill kernels run
// K == V and the mixed pairs of kv_pairs.h at head_dim 64 / 128 / 256 (K == V); every other
// pair and head dim (up to 256) runs the generic kernel (cuda_generic.h) for decode and prefill
// alike, so a layer the tensor-core kernels cannot take gets the generic kernel's reasons.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "attention/backends.h"
#include "attention/cuda/cuda_decode.h"
#include "attention/cuda/cuda_generic.h"
#include "attention/cuda/cuda_prefill.h"
#include "attention/cuda/kv_pairs.h"
#include "cache/cuda/cuda_check.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"

namespace kvq {

namespace {

class CudaBackend final : public AttentionBackend {
 public:
  CudaBackend() {
    caps_.device = Device::kCuda;
    caps_.priority = 100;
    // Every pair: the fast ones (kv_pairs.h) first, then the rest (the generic kernel).
    for (const auto& pr : cuda::kCudaKvPairs) caps_.kv_dtype_pairs.push_back(pr);
    for (const auto& k : kKvDtypeTraits)
      for (const auto& v : kKvDtypeTraits)
        if (k.concrete && v.concrete && k.valid_as_k && v.valid_as_v &&
            !cuda::cuda_kv_pair_supported(k.dtype, v.dtype))
          caps_.kv_dtype_pairs.push_back({k.dtype, v.dtype});
    caps_.head_dims = {};  // any up to 256: 64 / 128 / 256 on tensor cores, the rest generic
    caps_.block_tokens = {16, 32};
    caps_.attention_kinds = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                             AttentionKind::kNonCausal};
    caps_.logit_soft_cap = true;
  }
  ~CudaBackend() override {
    if (buffer_) (void)cudaFree(buffer_);
  }
  std::string_view name() const override { return "cuda"; }
  const AttentionCapabilities& capabilities() const override { return caps_; }

 protected:
  std::vector<std::string> extra_reasons(const LayerKvSpec& spec) const override {
    std::vector<std::string> r;
    if (cuda::uses_generic_attention(spec)) {
      r = cuda::generic_unsupported_reasons(spec);
    } else {
      // Both paths must run the layer: the union of their reasons, each stated once.
      r = cuda::decode_unsupported_reasons(spec);
      for (std::string& s : cuda::prefill_unsupported_reasons(spec))
        if (std::find(r.begin(), r.end(), s) == r.end()) r.push_back(std::move(s));
    }
    static const int devices = cuda_device_count();
    if (devices == 0) r.push_back("no CUDA device is available");
    return r;
  }

  void run_impl(const LayerKvSpec& spec, const AttentionArgs& args) const override {
    const BlockTableView& bt = args.block_table;
    const int32_t n = bt.num_seqs;
    if (n == 0) return;
    const bool generic = cuda::uses_generic_attention(spec);
    bool decode = true;
    for (int32_t i = 0; i < n && decode; ++i) decode = args.q_indptr[i + 1] - args.q_indptr[i] == 1;
    const std::span<const int32_t> seq_lens(bt.seq_lens, static_cast<size_t>(n));
    cuda::DecodePlan dplan;
    cuda::PrefillPlan pplan;
    cuda::GenericPlan gplan;
    size_t ws_bytes = 0;
    if (generic) {
      gplan = cuda::plan_generic_prefill(
          spec, std::span<const int32_t>(args.q_indptr, static_cast<size_t>(n) + 1), seq_lens);
    } else if (decode) {
      dplan = cuda::plan_decode(spec, seq_lens);
      ws_bytes = dplan.workspace_bytes;
    } else {
      pplan = cuda::plan_prefill(
          spec, std::span<const int32_t>(args.q_indptr, static_cast<size_t>(n) + 1), seq_lens);
      ws_bytes = pplan.workspace_bytes;
    }
    const size_t num_indices = static_cast<size_t>(bt.indptr[n]);

    // One device buffer: the block table and q_indptr, then the kernels' workspace.
    const size_t table_bytes = (static_cast<size_t>(3 * n + 2) + num_indices) * sizeof(int32_t);
    const size_t ws_offset = (table_bytes + 255) / 256 * 256;
    std::lock_guard<std::mutex> lock(mu_);
    if (capacity_ < ws_offset + ws_bytes) {
      if (buffer_) KVQ_CUDA_CHECK(cudaFree(buffer_));
      buffer_ = nullptr;
      capacity_ = 0;
      KVQ_CUDA_CHECK(cudaMalloc(&buffer_, ws_offset + ws_bytes));
      capacity_ = ws_offset + ws_bytes;
    }
    auto* table = static_cast<int32_t*>(buffer_);
    int32_t* d_indptr = table;
    int32_t* d_seq_lens = table + n + 1;
    int32_t* d_q_indptr = table + 2 * n + 1;
    int32_t* d_indices = table + 3 * n + 2;
    cudaStream_t stream = nullptr;
    KVQ_CUDA_CHECK(cudaMemcpyAsync(d_indptr, bt.indptr, sizeof(int32_t) * (n + 1),
                                   cudaMemcpyHostToDevice, stream));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(d_seq_lens, bt.seq_lens, sizeof(int32_t) * n,
                                   cudaMemcpyHostToDevice, stream));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(d_q_indptr, args.q_indptr, sizeof(int32_t) * (n + 1),
                                   cudaMemcpyHostToDevice, stream));
    if (num_indices > 0)
      KVQ_CUDA_CHECK(cudaMemcpyAsync(d_indices, bt.indices, sizeof(int32_t) * num_indices,
                                     cudaMemcpyHostToDevice, stream));
    BlockTableView dbt = bt;
    dbt.indptr = d_indptr;
    dbt.indices = d_indices;
    dbt.seq_lens = d_seq_lens;
    void* workspace = static_cast<std::byte*>(buffer_) + ws_offset;
    if (generic) {
      cuda::GenericArgs ga;
      ga.q = args.q;
      ga.out = args.out;
      ga.q_indptr = d_q_indptr;
      ga.block_table = dbt;
      ga.cache = args.cache;
      ga.softmax_scale = args.softmax_scale;
      ga.logit_soft_cap = args.logit_soft_cap;
      cuda::run_generic(spec, gplan, ga, stream);
    } else if (decode) {
      cuda::DecodeArgs d;
      d.q = args.q;
      d.out = args.out;
      d.block_table = dbt;
      d.cache = args.cache;
      d.softmax_scale = args.softmax_scale;
      d.logit_soft_cap = args.logit_soft_cap;
      d.workspace = workspace;
      cuda::run_decode(spec, dplan, d, stream);
    } else {
      cuda::PrefillArgs pa;
      pa.q = args.q;
      pa.out = args.out;
      pa.q_indptr = d_q_indptr;
      pa.block_table = dbt;
      pa.cache = args.cache;
      pa.softmax_scale = args.softmax_scale;
      pa.logit_soft_cap = args.logit_soft_cap;
      pa.workspace = workspace;
      cuda::run_prefill(spec, pplan, pa, stream);
    }
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
  static const CudaBackend backend;
  return backend;
}

}  // namespace kvq
