// The generic CUDA attention (see cuda_generic.h): one kernel per (K, V) pair of kv_pairs.h,
// head dims at run time.
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <string>
#include <utility>

#include "attention/cuda/cache_side.h"
#include "attention/cuda/cuda_generic.h"
#include "attention/cuda/kv_pairs.h"
#include "cache/cuda/cuda_check.h"
#include "cache/cuda/kv_codec_device.cuh"
#include "cache/cuda/kv_row_decode.cuh"
#include "kvq/core/error.h"

namespace kvq::cuda {

namespace {

constexpr int kWarps = 4;                                 // warps per block
constexpr int kMaxDimsPerLane = kGenericMaxHeadDim / 32;  // output dims a lane accumulates

struct GenericSide {
  const uint8_t* base;
  uint64_t block_bytes, head_stride, values_bytes, row_bytes, row_scale_bytes;
  int head_dim;
  float tensor_scale[kGenericMaxKvHeads];  // per kv head (1 where unused)
};

struct GenericParams {
  GenericSide k, v;
  const float* q;
  float* out;
  const int32_t* q_indptr;  // null: decode (row i = sequence i)
  const int32_t* indptr;
  const int32_t* indices;
  const int32_t* seq_lens;
  int num_seqs, total_q, num_q_heads, ratio, block_tokens, attention_kind, window;
  float softmax_scale, soft_cap;  // soft_cap 0: off
  HadamardSigns signs;
  KvDtype k_dtype, v_dtype;  // read by the any-pair kernel (DK = DV = kAuto) only
};

// A side's metadata and elements: compile-time dtype D, or p's run-time one where D is kAuto.
template <KvDtype D>
__device__ __forceinline__ float2 side_meta(KvDtype rt, const uint8_t* meta, float ts) {
  if constexpr (D == KvDtype::kAuto)
    return row_meta_rt(rt, meta, ts);
  else
    return row_meta<D>(meta, ts);
}
template <KvDtype D>
__device__ __forceinline__ float side_element(KvDtype rt, const uint8_t* row, int hd, int i,
                                              float2 m) {
  if constexpr (D == KvDtype::kAuto)
    return element_rt(rt, row, hd, i, m);
  else
    return element<D>(row, hd, i, m);
}

// In-place fast Walsh-Hadamard transform of n (a power of two) floats in shared memory, by
// one warp, stage by stage in the reference's order (hadamard.cc), so rotations match it bit
// for bit.
__device__ void warp_fwht_shared(float* x, int n, int lane) {
  for (int h = 1; h < n; h <<= 1) {
    __syncwarp();
    for (int i = lane; i < n / 2; i += 32) {
      const int j = (i / h) * 2 * h + (i % h);
      const float a = x[j], b = x[j + h];
      x[j] = __fadd_rn(a, b);
      x[j + h] = __fsub_rn(a, b);
    }
  }
  __syncwarp();
}

template <KvDtype DK, KvDtype DV>
__global__ void __launch_bounds__(kWarps * 32)
    generic_attention_kernel(const __grid_constant__ GenericParams p) {
  // Rotated sides (int4 per token-head); DK / DV kAuto: the any-pair kernel, dtypes from p.
  const bool rot_k = (DK == KvDtype::kAuto ? p.k_dtype : DK) == KvDtype::kInt4PerTokenHead;
  const bool rot_v = (DV == KvDtype::kAuto ? p.v_dtype : DV) == KvDtype::kInt4PerTokenHead;
  __shared__ float s_buf[kWarps][kGenericMaxHeadDim];
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= static_cast<int64_t>(p.total_q) * p.num_q_heads) return;  // whole warp
  const int r = static_cast<int>(item / p.num_q_heads);
  const int h = static_cast<int>(item - static_cast<int64_t>(r) * p.num_q_heads);

  // The sequence of query row r: the last s with q_indptr[s] <= r (empty sequences skipped).
  int seq = r, q_begin = r, q_len = 1;
  if (p.q_indptr != nullptr) {
    if (r >= p.q_indptr[p.num_seqs]) return;
    int lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.q_indptr[mid] <= r)
        lo = mid;
      else
        hi = mid - 1;
    }
    seq = lo;
    q_begin = p.q_indptr[seq];
    q_len = p.q_indptr[seq + 1] - q_begin;
  } else if (r >= p.num_seqs) {
    return;
  }
  const int kv_len = p.seq_lens[seq];
  const int pos = kv_len - q_len + (r - q_begin);
  int vis_lo = 0, vis_hi = pos + 1;
  if (p.attention_kind == static_cast<int>(AttentionKind::kSlidingWindow))
    vis_lo = max(0, pos - p.window + 1);
  if (p.attention_kind == static_cast<int>(AttentionKind::kNonCausal)) vis_hi = kv_len;
  vis_lo = max(vis_lo, 0);
  vis_hi = min(vis_hi, kv_len);

  const int dk = p.k.head_dim, dv = p.v.head_dim;
  const int kvh = h / p.ratio;
  float* buf = s_buf[warp];
  float* out = p.out + (static_cast<size_t>(r) * p.num_q_heads + h) * dv;
  if (vis_hi <= vis_lo) {  // nothing visible (a padding sequence): zeros, not garbage
    for (int d = lane; d < dv; d += 32) out[d] = 0.0f;
    return;
  }

  // Q into shared memory, rotated like the stored K rows.
  const float* q = p.q + (static_cast<size_t>(r) * p.num_q_heads + h) * dk;
  for (int d = lane; d < dk; d += 32) {
    float x = q[d];
    if (rot_k && hadamard_negative(p.signs, d)) x = -x;
    buf[d] = x;
  }
  if (rot_k) {
    warp_fwht_shared(buf, dk, lane);
    const float c = hadamard_inv_sqrt(__ffs(dk) - 1);
    for (int d = lane; d < dk; d += 32) buf[d] = __fmul_rn(buf[d], c);
  }
  __syncwarp();

  const int32_t* blocks = p.indices + p.indptr[seq];
  const uint8_t* k_head = p.k.base + static_cast<uint64_t>(kvh) * p.k.head_stride;
  const uint8_t* v_head = p.v.base + static_cast<uint64_t>(kvh) * p.v.head_stride;
  const float k_ts = p.k.tensor_scale[kvh], v_ts = p.v.tensor_scale[kvh];
  const bool capped = p.soft_cap != 0.0f;

  float m = -__uint_as_float(kF32Inf);  // running max of the logits
  float l = 0.0f;                       // running sum of exp(logit - m)
  float acc[kMaxDimsPerLane];
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; ++i) acc[i] = 0.0f;

  for (int t0 = vis_lo; t0 < vis_hi; t0 += 32) {
    const int t = t0 + lane;
    float x = -__uint_as_float(kF32Inf);
    if (t < vis_hi) {
      const int32_t block = blocks[t / p.block_tokens];
      const int off = t % p.block_tokens;
      const uint8_t* kb = k_head + static_cast<uint64_t>(block) * p.k.block_bytes;
      const uint8_t* row = kb + static_cast<uint64_t>(off) * p.k.row_bytes;
      const float2 mk =
          side_meta<DK>(p.k_dtype, kb + p.k.values_bytes + off * p.k.row_scale_bytes, k_ts);
      float dot = 0.0f;
      for (int d = 0; d < dk; ++d)
        dot = fmaf(buf[d], side_element<DK>(p.k_dtype, row, dk, d, mk), dot);
      x = dot * p.softmax_scale;
      if (capped) x = p.soft_cap * tanhf(x / p.soft_cap);
    }
    const float m_new = fmaxf(m, warp_max(x));
    // m_new is finite unless every logit so far is -inf / NaN; keep exp's argument defined.
    const float m_use = m_new == -__uint_as_float(kF32Inf) ? 0.0f : m_new;
    const float corr = expf(m - m_use);
    const float pr = t < vis_hi ? expf(x - m_use) : 0.0f;
    l = l * corr + warp_sum(pr);
    m = m_new;
#pragma unroll
    for (int i = 0; i < kMaxDimsPerLane; ++i) acc[i] *= corr;
    const int n = min(32, vis_hi - t0);
    for (int j = 0; j < n; ++j) {
      const float pj = __shfl_sync(kFullMask, pr, j);
      const int tj = t0 + j;
      const int32_t block = blocks[tj / p.block_tokens];
      const int off = tj % p.block_tokens;
      const uint8_t* vb = v_head + static_cast<uint64_t>(block) * p.v.block_bytes;
      const uint8_t* row = vb + static_cast<uint64_t>(off) * p.v.row_bytes;
      const float2 mv =
          side_meta<DV>(p.v_dtype, vb + p.v.values_bytes + off * p.v.row_scale_bytes, v_ts);
#pragma unroll
      for (int i = 0; i < kMaxDimsPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < dv) acc[i] = fmaf(pj, side_element<DV>(p.v_dtype, row, dv, d, mv), acc[i]);
      }
    }
  }

  const float inv_l = 1.0f / l;
  if (rot_v) {
    // Normalize, then un-rotate in shared memory (the reference's order: transform, scale,
    // signs).
    __syncwarp();  // every lane is done reading Q from buf
#pragma unroll
    for (int i = 0; i < kMaxDimsPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < dv) buf[d] = acc[i] * inv_l;
    }
    warp_fwht_shared(buf, dv, lane);
    const float c = hadamard_inv_sqrt(__ffs(dv) - 1);
    for (int d = lane; d < dv; d += 32) {
      float y = __fmul_rn(buf[d], c);
      if (hadamard_negative(p.signs, d)) y = -y;
      out[d] = y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kMaxDimsPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < dv) out[d] = acc[i] * inv_l;
    }
  }
}

template <KvDtype DK, KvDtype DV>
void launch(const GenericParams& p, unsigned blocks, cudaStream_t stream) {
  generic_attention_kernel<DK, DV><<<blocks, kWarps * 32, 0, stream>>>(p);
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace

std::vector<std::string> generic_unsupported_reasons(const LayerKvSpec& spec) {
  std::vector<std::string> r;
  const bool concrete = traits(spec.k_dtype).concrete && traits(spec.v_dtype).concrete;
  if (!concrete) r.push_back("K / V dtype is unresolved (auto)");
  for (KvSide s : {KvSide::kK, KvSide::kV}) {
    const int hd = spec.head_dim(s);
    if (hd < 1 || hd > kGenericMaxHeadDim)
      r.push_back(std::string(to_string(s)) + " head_dim " + std::to_string(hd) +
                  " is outside 1..256 (the CUDA attention's largest head_dim)");
    else if (concrete)
      if (std::string why = head_dim_unsupported_reason(spec.dtype(s), hd); !why.empty())
        r.push_back(std::string(to_string(s)) + ": " + why);
  }
  if (spec.block_tokens <= 0) r.push_back("block_tokens must be positive");
  if (spec.num_kv_heads < 1 || spec.num_kv_heads > kGenericMaxKvHeads)
    r.push_back("num_kv_heads " + std::to_string(spec.num_kv_heads) + " is outside 1.." +
                std::to_string(kGenericMaxKvHeads));
  return r;
}

GenericPlan plan_generic_decode(const LayerKvSpec& spec, int32_t num_seqs) {
  const auto reasons = generic_unsupported_reasons(spec);
  KVQ_CHECK(reasons.empty(), "plan_generic_decode: unsupported layer: " + reasons.front());
  KVQ_CHECK(num_seqs >= 0, "plan_generic_decode: negative sequence count");
  GenericPlan plan;
  plan.num_seqs = num_seqs;
  plan.total_q = num_seqs;
  return plan;
}

GenericPlan plan_generic_prefill(const LayerKvSpec& spec, std::span<const int32_t> q_indptr,
                                 std::span<const int32_t> seq_lens) {
  const auto reasons = generic_unsupported_reasons(spec);
  KVQ_CHECK(reasons.empty(), "plan_generic_prefill: unsupported layer: " + reasons.front());
  if (q_indptr.size() != seq_lens.size() + 1)
    throw InputError("plan_generic_prefill: q_indptr has " + std::to_string(q_indptr.size()) +
                     " entries for " + std::to_string(seq_lens.size()) +
                     " sequences; expected num_seqs + 1");
  for (size_t i = 0; i < seq_lens.size(); ++i) {
    const int64_t q_len = static_cast<int64_t>(q_indptr[i + 1]) - q_indptr[i];
    if (q_len < 0 || q_len > seq_lens[i])
      throw InputError("plan_generic_prefill: sequence " + std::to_string(i) + " has " +
                       std::to_string(q_len) + " queries for " + std::to_string(seq_lens[i]) +
                       " cached tokens; expected 0 <= q_len <= kv_len");
  }
  GenericPlan plan;
  plan.num_seqs = static_cast<int32_t>(seq_lens.size());
  plan.total_q = q_indptr.back();
  return plan;
}

void run_generic(const LayerKvSpec& spec, const GenericPlan& plan, const GenericArgs& args,
                 cudaStream_t stream) {
  const auto reasons = generic_unsupported_reasons(spec);
  KVQ_CHECK(reasons.empty(), "run_generic: unsupported layer: " + reasons.front());
  const BlockTableView& bt = args.block_table;
  KVQ_CHECK(bt.num_seqs == plan.num_seqs, "run_generic: the plan was made for " +
                                              std::to_string(plan.num_seqs) + " sequences, got " +
                                              std::to_string(bt.num_seqs));
  KVQ_CHECK(bt.block_tokens == spec.block_tokens, "run_generic: block table block_tokens differs");
  KVQ_CHECK(spec.num_kv_heads > 0 && spec.num_q_heads % spec.num_kv_heads == 0,
            "run_generic: bad head counts");
  const int64_t warps = static_cast<int64_t>(plan.total_q) * spec.num_q_heads;
  if (plan.num_seqs == 0 || warps == 0) return;
  KVQ_CHECK(args.q && args.out && bt.indptr && bt.indices && bt.seq_lens && args.cache.k_base &&
                args.cache.v_base,
            "run_generic: null pointer");
  const int64_t blocks = (warps + kWarps - 1) / kWarps;
  KVQ_CHECK(blocks <= INT32_MAX, "run_generic: too many query rows in one call");

  GenericParams p{};
  p.k = make_cache_side<GenericSide>(spec, args.cache, KvSide::kK);
  p.v = make_cache_side<GenericSide>(spec, args.cache, KvSide::kV);
  p.q = args.q;
  p.out = args.out;
  p.q_indptr = args.q_indptr;
  p.indptr = bt.indptr;
  p.indices = bt.indices;
  p.seq_lens = bt.seq_lens;
  p.num_seqs = plan.num_seqs;
  p.total_q = plan.total_q;
  p.num_q_heads = spec.num_q_heads;
  p.ratio = spec.gqa_ratio();
  p.block_tokens = spec.block_tokens;
  p.attention_kind = static_cast<int>(spec.attention);
  p.window = spec.sliding_window;
  p.softmax_scale = args.softmax_scale;
  p.soft_cap = args.logit_soft_cap;
  p.signs = make_hadamard_signs();
  p.k_dtype = spec.k_dtype;
  p.v_dtype = spec.v_dtype;
  const bool launched = with_cuda_kv_pair(spec.k_dtype, spec.v_dtype, [&](auto k, auto v) {
    launch<decltype(k)::value, decltype(v)::value>(p, static_cast<unsigned>(blocks), stream);
  });
  // Any other pair: the kernel that decodes each side by its run-time dtype.
  if (!launched) launch<KvDtype::kAuto, KvDtype::kAuto>(p, static_cast<unsigned>(blocks), stream);
}

}  // namespace kvq::cuda
