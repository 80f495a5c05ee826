// Shared setup of the CUDA attention and cache-write tests: a ragged batch in a paged cache
// (blocks in random order, unwritten bytes 0xFF) written on the host with write_kv_reference
// and copied byte for byte to a DeviceKvCache, the cpu_reference backend as the oracle, a
// per-element check relative to the largest |V| of each (sequence, kv head), and the device
// runs the tests share. The LayerKvSpec (per-head scales) comes from the CPU attention
// harness, so both suites quantize the same way.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "attention/cuda/kv_pairs.h"
#include "cuda_test_util.h"
#include "kvq/attention/backend.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/quant/codec.h"
#include "unit/attention/attention_harness.h"

namespace kvq::test {

// One batch: sequence i has q_lens[i] queries at the last positions of its kv_lens[i] tokens.
struct CudaAttnCase {
  int layer = 1;
  KvDtype k_dtype = KvDtype::kBFloat16;
  KvDtype v_dtype = KvDtype::kBFloat16;
  KvDtype model_dtype = KvDtype::kBFloat16;
  int head_dim_k = 128, head_dim_v = 128;
  int block_tokens = 16;
  int num_kv_heads = 1;
  int ratio = 4;
  AttentionKind kind = AttentionKind::kCausal;
  int window = 0;
  float soft_cap = 0.0f;
  bool outliers = false;  // wider spreads, more and larger outliers in K, V and Q
  std::vector<int> q_lens, kv_lens;

  void set_head_dim(int hd) { head_dim_k = head_dim_v = hd; }

  std::string describe() const {
    std::ostringstream os;
    os << "K " << to_string(k_dtype) << " / V " << to_string(v_dtype) << ", head_dim "
       << head_dim_k;
    if (head_dim_v != head_dim_k) os << "/" << head_dim_v;
    os << ", block " << block_tokens << ", kv heads " << num_kv_heads << " x ratio " << ratio
       << ", " << to_string(kind);
    if (kind == AttentionKind::kSlidingWindow) os << " W=" << window;
    os << ", soft_cap " << soft_cap << (outliers ? ", outlier-heavy" : "") << ", (q_len/kv_len):";
    for (size_t i = 0; i < q_lens.size(); ++i) os << " " << q_lens[i] << "/" << kv_lens[i];
    return os.str();
  }
};

// The CPU harness's spec (per-head checkpoint scales, dynamic per-token-head scales).
inline LayerKvSpec spec_for(const CudaAttnCase& c) {
  AttnCase a;
  a.k = c.k_dtype;
  a.v = c.v_dtype;
  a.kind = c.kind;
  a.window = c.window;
  a.head_dim_k = c.head_dim_k;
  a.head_dim_v = c.head_dim_v;
  a.num_kv_heads = c.num_kv_heads;
  a.ratio = c.ratio;
  a.block_tokens = c.block_tokens;
  LayerKvSpec s = spec_for(a);
  s.layer = c.layer;
  s.model_dtype = c.model_dtype;
  return s;
}

// Error allowed per element: (base + logit * softmax_scale * |q| * max|k| / logit_divisor) *
// max|V| of the (sequence, kv head). The logit term covers rounding in the q.k dot product,
// which moves the softmax weights when logits are large.
struct Tolerance {
  double base = 0.0;
  double logit = 0.0;
  double logit_divisor = 1.0;
};

// Host bytes (for cpu_reference) and the block tables; upload() puts the same bytes on a device.
class CudaAttnProblem {
 public:
  CudaAttnProblem(const CudaAttnCase& c, unsigned seed) : case_(c), spec_(spec_for(c)) {
    std::mt19937 rng(seed);
    const int bt = c.block_tokens, dk = c.head_dim_k, dv = c.head_dim_v, nkv = c.num_kv_heads;
    int needed = 0;
    for (int len : c.kv_lens) needed += (len + bt - 1) / bt;
    num_blocks_ = needed + 2;
    std::vector<int32_t> pool(static_cast<size_t>(num_blocks_));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    const KvSideLayout kl = spec_.layout(KvSide::kK), vl = spec_.layout(KvSide::kV);
    hk_.assign(static_cast<size_t>(num_blocks_) * kl.block_bytes, std::byte{0xFF});
    hv_.assign(static_cast<size_t>(num_blocks_) * vl.block_bytes, std::byte{0xFF});
    host_view_ = LayerCacheView{hk_.data(), hv_.data(), kl, vl, num_blocks_};

    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> spread(c.outliers ? 0.05f : 0.3f,
                                                 c.outliers ? 5.0f : 2.0f);
    std::uniform_int_distribution<int> coin(0, c.outliers ? 3 : 15);
    const float outlier = c.outliers ? 20.0f : 8.0f;
    size_t next = 0;
    indptr_.push_back(0);
    q_indptr_.push_back(0);
    vmax_.assign(c.kv_lens.size() * static_cast<size_t>(nkv), 0.0);
    knorm_.assign(vmax_.size(), 0.0);
    for (size_t i = 0; i < c.kv_lens.size(); ++i) {
      const int len = c.kv_lens[i];
      const int nb = (len + bt - 1) / bt;
      for (int b = 0; b < nb; ++b) indices_.push_back(pool[next++]);
      indptr_.push_back(static_cast<int32_t>(indices_.size()));
      seq_lens_.push_back(len);
      q_indptr_.push_back(q_indptr_.back() + c.q_lens[i]);
      std::vector<int64_t> slots(static_cast<size_t>(len));
      std::vector<float> k(static_cast<size_t>(len) * nkv * dk),
          v(static_cast<size_t>(len) * nkv * dv);
      auto fill = [&](float* dst, int n) {
        const float sigma = spread(rng);
        for (int d = 0; d < n; ++d) dst[d] = sigma * normal(rng);
        if (coin(rng) == 0) dst[coin(rng) % n] *= outlier;
      };
      for (int t = 0; t < len; ++t) {
        slots[t] = static_cast<int64_t>(indices_[indptr_[i] + t / bt]) * bt + t % bt;
        for (int h = 0; h < nkv; ++h) {
          fill(&k[(static_cast<size_t>(t) * nkv + h) * dk], dk);
          fill(&v[(static_cast<size_t>(t) * nkv + h) * dv], dv);
        }
      }
      write_kv_reference(spec_, host_view_, slots, k.data(), v.data());
      // Largest |V| and ||K row|| as the cache holds them (dequantized, model space).
      std::vector<float> krow(static_cast<size_t>(dk)), vrow(static_cast<size_t>(dv));
      for (int t = 0; t < len; ++t) {
        const int32_t block = indices_[indptr_[i] + t / bt];
        for (int h = 0; h < nkv; ++h) {
          const std::byte* vb = host_view_.block(KvSide::kV, block);
          quant::decode_row_unrotated(c.v_dtype, vb + vl.value_offset(h, t % bt),
                                      vb + vl.scale_offset(h, t % bt), spec_.v_scale.for_head(h),
                                      vrow);
          double& m = vmax_[i * nkv + h];
          for (float x : vrow) m = std::max(m, static_cast<double>(std::fabs(x)));
          const std::byte* kb = host_view_.block(KvSide::kK, block);
          quant::decode_row_unrotated(c.k_dtype, kb + kl.value_offset(h, t % bt),
                                      kb + kl.scale_offset(h, t % bt), spec_.k_scale.for_head(h),
                                      krow);
          double n2 = 0.0;
          for (float x : krow) n2 += static_cast<double>(x) * x;
          knorm_[i * nkv + h] = std::max(knorm_[i * nkv + h], std::sqrt(n2));
        }
      }
    }
    q_.resize(static_cast<size_t>(q_indptr_.back()) * spec_.num_q_heads * dk);
    for (float& x : q_) {
      x = 2.5f * normal(rng);
      if (c.outliers && coin(rng) == 0) x *= 6.0f;
    }
  }

  const LayerKvSpec& spec() const { return spec_; }
  size_t out_size() const {
    return static_cast<size_t>(q_indptr_.back()) * spec_.num_q_heads * case_.head_dim_v;
  }
  float softmax_scale() const { return 1.0f / std::sqrt(static_cast<float>(case_.head_dim_k)); }
  BlockTableView host_table() const {
    BlockTableView bt;
    bt.indptr = indptr_.data();
    bt.indices = indices_.data();
    bt.seq_lens = seq_lens_.data();
    bt.num_seqs = static_cast<int32_t>(seq_lens_.size());
    bt.block_tokens = case_.block_tokens;
    return bt;
  }
  const std::vector<int32_t>& q_indptr() const { return q_indptr_; }
  const std::vector<int32_t>& indptr() const { return indptr_; }
  const std::vector<int32_t>& indices() const { return indices_; }
  const std::vector<int32_t>& seq_lens() const { return seq_lens_; }
  const std::vector<float>& q() const { return q_; }
  int32_t num_blocks() const { return num_blocks_; }

  // The cpu_reference backend on the host bytes (output NaN-poisoned first).
  std::vector<float> reference() const {
    std::vector<float> out(out_size(), std::numeric_limits<float>::quiet_NaN());
    AttentionArgs a;
    a.q = q_.data();
    a.out = out.data();
    a.q_indptr = q_indptr_.data();
    a.block_table = host_table();
    a.cache = host_view_;
    a.softmax_scale = softmax_scale();
    a.logit_soft_cap = case_.soft_cap;
    find_attention_backend("cpu_reference")->run(spec_, a);
    return out;
  }

  // Copies the host cache bytes into a device cache of the same layout.
  void upload(const DeviceKvCache& dev) const {
    const LayerCacheView v = dev.layer_view(0);
    EXPECT_EQ(cudaMemcpy(v.k_base, hk_.data(), hk_.size(), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.v_base, hv_.data(), hv_.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }

  // Of the last check, NaN-free elements only: largest |error| / allowed, and |error| / max|V|.
  double worst() const { return worst_; }
  double worst_over_vmax() const { return worst_v_; }

  ::testing::AssertionResult check(const std::vector<float>& got, const std::vector<float>& want,
                                   const Tolerance& tol) const {
    const int dk = case_.head_dim_k, dv = case_.head_dim_v, nq = spec_.num_q_heads;
    int bad = 0;
    worst_ = worst_v_ = 0.0;
    std::ostringstream msg;
    for (size_t i = 0; i + 1 < q_indptr_.size(); ++i)
      for (int qi = q_indptr_[i]; qi < q_indptr_[i + 1]; ++qi)
        for (int h = 0; h < nq; ++h) {
          const size_t g = i * case_.num_kv_heads + h / case_.ratio;
          double qn = 0.0;
          for (int d = 0; d < dk; ++d) {
            const double x = q_[(static_cast<size_t>(qi) * nq + h) * dk + d];
            qn += x * x;
          }
          const double logit_tol =
              tol.logit * softmax_scale() * std::sqrt(qn) * knorm_[g] / tol.logit_divisor;
          const double allowed = (tol.base + logit_tol) * vmax_[g];
          for (int d = 0; d < dv; ++d) {
            const size_t e = (static_cast<size_t>(qi) * nq + h) * dv + d;
            const double err = std::fabs(static_cast<double>(got[e]) - want[e]);
            if (err / allowed > worst_) worst_ = err / allowed;
            if (err / vmax_[g] > worst_v_) worst_v_ = err / vmax_[g];
            if (!(err <= allowed) && ++bad <= 5)
              msg << "\n  seq " << i << " query " << qi - q_indptr_[i] << " of "
                  << q_indptr_[i + 1] - q_indptr_[i] << " (kv_len " << seq_lens_[i] << ") head "
                  << h << " dim " << d << ": got " << got[e] << ", want " << want[e] << " (allowed "
                  << allowed << ")";
          }
        }
    if (bad == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << bad << " of " << got.size() << " elements out of tolerance:" << msg.str();
  }

 private:
  CudaAttnCase case_;
  LayerKvSpec spec_;
  int32_t num_blocks_ = 0;
  std::vector<std::byte> hk_, hv_;
  LayerCacheView host_view_;
  std::vector<int32_t> indptr_, indices_, seq_lens_, q_indptr_;
  std::vector<double> vmax_, knorm_;  // per (sequence, kv head): max |V|, max ||K row||
  std::vector<float> q_;
  mutable double worst_ = 0.0, worst_v_ = 0.0;
};

// A problem on the device: its cache bytes, q, an output and every table.
struct DeviceBatch {
  explicit DeviceBatch(const CudaAttnProblem& p)
      : cache({p.spec()}, p.num_blocks()),
        q(p.q()),
        out(p.out_size()),
        q_indptr(p.q_indptr()),
        indptr(p.indptr()),
        indices(p.indices()),
        seq_lens(p.seq_lens()),
        host_table(p.host_table()) {
    p.upload(cache);
  }
  // The block table with device pointers.
  BlockTableView device_table() const {
    BlockTableView bt = host_table;
    bt.indptr = indptr.get();
    bt.indices = indices.get();
    bt.seq_lens = seq_lens.get();
    return bt;
  }

  DeviceKvCache cache;
  DeviceBuffer<float> q, out;
  DeviceBuffer<int32_t> q_indptr, indptr, indices, seq_lens;
  BlockTableView host_table;
};

// The "cuda" backend (device q / out / cache, host tables), output poisoned first.
inline std::vector<float> run_cuda_backend(const CudaAttnProblem& p, float soft_cap) {
  DeviceKvCache dev({p.spec()}, p.num_blocks());
  p.upload(dev);
  DeviceBuffer<float> q(p.q());
  DeviceBuffer<float> out(p.out_size());
  out.poison();
  AttentionArgs a;
  a.q = q.get();
  a.out = out.get();
  a.q_indptr = p.q_indptr().data();
  a.block_table = p.host_table();
  a.cache = dev.layer_view(0);
  a.softmax_scale = p.softmax_scale();
  a.logit_soft_cap = soft_cap;
  find_attention_backend("cuda")->run(p.spec(), a);
  return out.download();
}

// Lengths of a ragged batch: a pure prefill, a chunk after a cached prefix, a single query, a
// short pure prefill and a second chunk, shuffled. Each [lo, hi] is drawn uniformly.
struct RaggedRanges {
  int pure_lo, pure_hi;  // the pure prefill
  int chunk_hi;          // the first chunk (from 2 queries), after a prefix of 1..prefix_hi
  int prefix_hi;
  int chunk2_lo, chunk2_hi;  // the second chunk, after a prefix of 20..prefix2_hi
  int prefix2_hi;
};

inline void ragged_batch(CudaAttnCase& c, std::mt19937& rng, const RaggedRanges& r) {
  auto uni = [&](int a, int b) { return std::uniform_int_distribution<int>(a, b)(rng); };
  const int pure = uni(r.pure_lo, r.pure_hi);
  const int chunk = uni(2, r.chunk_hi);
  const int chunk2 = uni(r.chunk2_lo, r.chunk2_hi);
  c.q_lens = {pure, chunk, 1, uni(1, 20), chunk2};
  c.kv_lens = {pure, chunk + uni(1, r.prefix_hi), uni(1, 200), 0, chunk2 + uni(20, r.prefix2_hi)};
  c.kv_lens[3] = c.q_lens[3];
  std::vector<size_t> order(c.q_lens.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const CudaAttnCase d = c;
  for (size_t i = 0; i < order.size(); ++i) {
    c.q_lens[i] = d.q_lens[order[i]];
    c.kv_lens[i] = d.kv_lens[order[i]];
  }
}

inline std::vector<KvDtype> concrete_dtypes() {
  std::vector<KvDtype> out;
  for (const auto& t : kKvDtypeTraits)
    if (t.concrete) out.push_back(t.dtype);
  return out;
}

// Every K == V dtype, then the mixed pairs of kv_pairs.h.
inline std::vector<std::pair<KvDtype, KvDtype>> supported_pairs() {
  std::vector<std::pair<KvDtype, KvDtype>> out;
  for (KvDtype d : concrete_dtypes()) out.push_back({d, d});
  for (const auto& p : cuda::kCudaMixedKvPairs) out.push_back(p);
  return out;
}

inline std::string pair_name(const std::pair<KvDtype, KvDtype>& p) {
  if (p.first == p.second) return std::string(to_string(p.first));
  return std::string(to_string(p.first)) + "__" + std::string(to_string(p.second));
}

inline bool storable(KvDtype d, int hd) {
  return head_dim_unsupported_reason(d, hd).empty();
}

// ---- cache writes -------------------------------------------------------------------------

// Kinds of rows for the cache-write tests: most random, some with outliers, some special.
enum class RowKind {
  kRandom,
  kOutliers,      // `outliers` elements x 40
  kZeros,         // all zero, signed zeros included
  kNanInf,        // NaN and infinities among normal values
  kHuge,          // saturation, scale caps
  kTiny,          // subnormal scales and codes
  kTies,          // rounding ties at one of `tie_mantissa_bits` mantissa widths
  kHalfIntegers,  // int8 / int4 grid ties
  kAllNan,
  kSignedZeroMin,  // zeros of both signs as the minimum after a positive rest
};

struct RowOptions {
  int outliers = 1;
  std::vector<int> tie_mantissa_bits = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
};

inline std::vector<float> make_row(std::mt19937& rng, int dim, RowKind kind,
                                   const RowOptions& opt) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> spread(0.05f, 3.0f);
  std::uniform_int_distribution<int> pick(0, dim - 1);
  std::vector<float> x(static_cast<size_t>(dim));
  const float sigma = spread(rng);
  for (float& e : x) e = sigma * normal(rng);
  const float inf = std::numeric_limits<float>::infinity();
  switch (kind) {
    case RowKind::kRandom:
      break;
    case RowKind::kOutliers:
      for (int i = 0; i < opt.outliers; ++i) x[pick(rng)] *= 40.0f;
      break;
    case RowKind::kZeros:
      for (size_t i = 0; i < x.size(); ++i) x[i] = i % 3 == 0 ? -0.0f : 0.0f;
      break;
    case RowKind::kNanInf:
      x[pick(rng)] = std::numeric_limits<float>::quiet_NaN();
      x[pick(rng)] = inf;
      x[pick(rng)] = -inf;
      break;
    case RowKind::kHuge:
      for (float& e : x) e *= 1e37f;
      x[pick(rng)] = 3.4e38f;
      break;
    case RowKind::kTiny:
      for (float& e : x) e *= 1e-39f;
      break;
    case RowKind::kTies: {
      const int n = static_cast<int>(opt.tie_mantissa_bits.size());
      for (float& e : x) {
        const int m = opt.tie_mantissa_bits[std::uniform_int_distribution<int>(0, n - 1)(rng)];
        uint32_t b = std::bit_cast<uint32_t>(e);
        b = (b & ~((1u << (23 - m)) - 1u)) | (1u << (22 - m));
        e = std::bit_cast<float>(b);
      }
      break;
    }
    case RowKind::kHalfIntegers:
      for (float& e : x)
        e = 0.5f * static_cast<float>(std::uniform_int_distribution<int>(-40, 40)(rng));
      break;
    case RowKind::kAllNan:
      for (float& e : x) e = std::numeric_limits<float>::quiet_NaN();
      break;
    case RowKind::kSignedZeroMin:
      for (float& e : x) e = std::fabs(e);
      x[pick(rng)] = -0.0f;
      x[pick(rng)] = 0.0f;
      break;
  }
  return x;
}

// Where two storages of one side first differ (block, head, value or metadata byte); empty if
// they are equal.
inline std::string first_mismatch(const std::vector<std::byte>& got,
                                  const std::vector<std::byte>& want, const KvSideLayout& l) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] == want[i]) continue;
    const size_t block = i / l.block_bytes, in_block = i % l.block_bytes;
    const size_t head = in_block / l.head_stride, in_head = in_block % l.head_stride;
    std::ostringstream os;
    os << "byte " << i << " (block " << block << ", head " << head << ", ";
    if (in_head < l.values_bytes)
      os << "token " << in_head / l.row_data_bytes << " value byte " << in_head % l.row_data_bytes;
    else
      os << "metadata byte " << in_head - l.values_bytes;
    os << "): got 0x" << std::hex << static_cast<int>(got[i]) << ", want 0x"
       << static_cast<int>(want[i]);
    return os.str();
  }
  return {};
}

// One layer's K and V storage bytes.
struct LayerBytes {
  std::vector<std::byte> k, v;
  const std::vector<std::byte>& side(KvSide s) const { return s == KvSide::kK ? k : v; }
};

// write_kv_reference into a host cache of num_blocks blocks, poisoned like the device one.
inline LayerBytes reference_write(const LayerKvSpec& spec, int32_t num_blocks,
                                  std::span<const int64_t> slots, const float* k, const float* v) {
  const KvSideLayout kl = spec.layout(KvSide::kK), vl = spec.layout(KvSide::kV);
  LayerBytes b;
  b.k.assign(num_blocks * kl.block_bytes, std::byte{0xFF});
  b.v.assign(num_blocks * vl.block_bytes, std::byte{0xFF});
  write_kv_reference(spec, LayerCacheView{b.k.data(), b.v.data(), kl, vl, num_blocks}, slots, k, v);
  return b;
}

// write_kv_cuda of every slot (negative: padding) into a fresh device cache; *got receives its
// bytes. Fatal failures on CUDA errors (wrap the call in ASSERT_NO_FATAL_FAILURE).
inline void cuda_write(const LayerKvSpec& spec, int32_t num_blocks,
                       const std::vector<int64_t>& slots, const std::vector<float>& k,
                       const std::vector<float>& v, LayerBytes* got) {
  DeviceKvCache cache({spec}, num_blocks);
  DeviceBuffer<int64_t> d_slots(slots);
  DeviceBuffer<float> d_k(k), d_v(v);
  write_kv_cuda(spec, cache.layer_view(0), d_slots.get(), static_cast<int64_t>(slots.size()),
                d_k.get(), d_v.get());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (KvSide side : {KvSide::kK, KvSide::kV}) {
    std::vector<std::byte>& out = side == KvSide::kK ? got->k : got->v;
    out.resize(num_blocks * spec.layout(side).block_bytes);
    ASSERT_EQ(
        cudaMemcpy(out.data(), cache.layer_view(0).base(side), out.size(), cudaMemcpyDeviceToHost),
        cudaSuccess);
  }
}

}  // namespace kvq::test
