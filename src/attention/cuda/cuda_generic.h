// Generic CUDA attention over the paged cache, for what the tensor-core kernels
// (cuda_decode.h, cuda_prefill.h: head_dim 64 / 128 / 256, K and V equal, the (K, V) pairs of
// kv_pairs.h) do not take: any head_dim from 1 to 256, K and V head dims may differ (e.g.
// stories260K's head_dim 8), and any (K, V) dtype pair.
//
// Simple over fast: one warp per (query token, query head). Q (rotated for a rotated K, in
// the reference's operation order) sits in shared memory; per chunk of 32 kv positions each
// lane computes one logit (an fp32 dot product over K elements decoded with the exact
// decoders of the reference codecs), the warp updates an fp32 online softmax, and each lane
// accumulates its output dims (d = lane, lane + 32, ...) over the chunk's 32 V rows. A rotated
// V's output is un-rotated in shared memory before it is written. Handles decode (one query per
// sequence) and prefill / chunked prefill (any q_len, q_indptr) in one kernel, causal / sliding
// window / non-causal, soft-cap, GQA, any block_tokens; the pairs of kv_pairs.h compiled per
// pair, every other pair through one kernel that decodes each side by its run-time dtype.
// No workspace; the launch is asynchronous, allocation-free and graph-capturable.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "attention/cuda/kv_pairs.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/plan/layer_kv_spec.h"

namespace kvq::cuda {

inline constexpr int kGenericMaxHeadDim = 256;
inline constexpr int kGenericMaxKvHeads = 128;

// True when the tensor-core kernels (cuda_decode.h / cuda_prefill.h) take the layer's head
// dims (K == V, 64 / 128 / 256).
constexpr bool fast_attention_head_dims(const LayerKvSpec& spec) {
  return spec.head_dim_k == spec.head_dim_v &&
         (spec.head_dim_k == 64 || spec.head_dim_k == 128 || spec.head_dim_k == 256);
}
// The tensor-core kernels take the layer (its head dims and its (K, V) pair of kv_pairs.h);
// everything else runs the generic path. Unresolved (auto) dtypes count as fast: their
// reasons come from the tensor-core kernels' checks.
constexpr bool fast_attention(const LayerKvSpec& spec) {
  const bool concrete = spec.k_dtype != KvDtype::kAuto && spec.v_dtype != KvDtype::kAuto;
  return fast_attention_head_dims(spec) &&
         (!concrete || cuda_kv_pair_supported(spec.k_dtype, spec.v_dtype));
}
constexpr bool uses_generic_attention(const LayerKvSpec& spec) {
  return !fast_attention(spec);
}

// Empty when the generic kernel can run `spec`: any concrete (K, V) pair, head dims 1..256
// that the dtypes can store, at most 128 kv heads, positive block_tokens.
std::vector<std::string> generic_unsupported_reasons(const LayerKvSpec& spec);

struct GenericPlan {
  int32_t num_seqs = 0;
  int32_t total_q = 0;         // query rows the launch covers (rows past q_indptr[num_seqs] idle)
  size_t workspace_bytes = 0;  // always 0
};

// Decode: one query per sequence. Prefill: q_indptr (num_seqs + 1) and seq_lens are host
// copies; every sequence needs 0 <= q_len <= kv_len (InputError otherwise).
GenericPlan plan_generic_decode(const LayerKvSpec& spec, int32_t num_seqs);
GenericPlan plan_generic_prefill(const LayerKvSpec& spec, std::span<const int32_t> q_indptr,
                                 std::span<const int32_t> seq_lens);

// Everything in device memory. q: [total_q][num_q_heads][head_dim_k] fp32 (model space);
// out: [total_q][num_q_heads][head_dim_v]. q_indptr null: row i is sequence i's single query
// (decode); else sequence i's queries are rows q_indptr[i] .. q_indptr[i+1] at the last q_len
// of its seq_lens[i] positions (AttentionArgs semantics). A query that sees no position (a
// padding sequence with seq_len 0) gets zeros.
struct GenericArgs {
  const float* q = nullptr;
  float* out = nullptr;
  const int32_t* q_indptr = nullptr;
  BlockTableView block_table;
  LayerCacheView cache;
  float softmax_scale = 1.0f;
  float logit_soft_cap = 0.0f;  // 0: off
};

// Launches on `stream` (asynchronous). The spec must pass generic_unsupported_reasons.
void run_generic(const LayerKvSpec& spec, const GenericPlan& plan, const GenericArgs& args,
                 cudaStream_t stream);

}  // namespace kvq::cuda
