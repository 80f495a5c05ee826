// Test harness for attention backends: builds a batch of ragged sequences in a paged cache
// of the test's own making (blocks in random order, unwritten bytes poisoned with 0xFF),
// computes the exact attention in float64 from the dequantized K/V (quantize -> dequantize
// -> exact attention, independent of any backend code), and checks every output element.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/attention/backend.h"
#include "kvq/quant/codec.h"

namespace kvq::test {

// Also in tests/cuda/cuda_test_util.h; the CUDA attention tests include both.
#ifndef KVQ_TEST_FRESH_SEED_DEFINED
#define KVQ_TEST_FRESH_SEED_DEFINED
inline unsigned fresh_seed() {
  return std::random_device{}();
}
#endif

struct SeqShape {
  int kv_len = 0;
  int q_len = 0;  // the last q_len cached tokens are the queries' positions
};

struct AttnCase {
  KvDtype k = KvDtype::kBFloat16, v = KvDtype::kBFloat16;
  AttentionKind kind = AttentionKind::kCausal;
  int window = 0;
  int head_dim_k = 64, head_dim_v = 64;
  int num_kv_heads = 2, ratio = 2;
  int block_tokens = 16;
  float soft_cap = 0.0f;
  std::vector<SeqShape> seqs;

  std::string describe() const {
    std::ostringstream os;
    os << "K " << to_string(k) << " V " << to_string(v) << ", " << to_string(kind);
    if (kind == AttentionKind::kSlidingWindow) os << " W=" << window;
    os << ", head_dim " << head_dim_k << "/" << head_dim_v << ", kv heads " << num_kv_heads
       << " x ratio " << ratio << ", block " << block_tokens << ", soft_cap " << soft_cap
       << ", seqs (kv,q):";
    for (const auto& s : seqs) os << " (" << s.kv_len << "," << s.q_len << ")";
    return os.str();
  }
};

inline LayerKvSpec spec_for(const AttnCase& c) {
  LayerKvSpec s;
  s.layer = 3;
  s.k_dtype = c.k;
  s.v_dtype = c.v;
  s.attention = c.kind;
  s.sliding_window = c.window;
  s.num_kv_heads = c.num_kv_heads;
  s.num_q_heads = c.num_kv_heads * c.ratio;
  s.head_dim_k = c.head_dim_k;
  s.head_dim_v = c.head_dim_v;
  s.block_tokens = c.block_tokens;
  for (KvSide side : {KvSide::kK, KvSide::kV}) {
    ScaleSource& sc = side == KvSide::kK ? s.k_scale : s.v_scale;
    const auto& t = traits(s.dtype(side));
    if (t.uses_tensor_scale) {
      // Per-head scales in a range where the values below use most of each format's range.
      sc.kind = ScaleSourceKind::kCheckpoint;
      const float base = s.dtype(side) == KvDtype::kNvfp4 ? 0.004f : 0.02f;
      for (int h = 0; h < c.num_kv_heads; ++h) sc.values.push_back(base * (1.0f + 0.5f * h));
    } else if (t.scale_kind == ScaleKind::kPerTokenHead) {
      sc.kind = ScaleSourceKind::kDynamic;
    }
  }
  return s;
}

// K/V rows of one sequence, dequantized to model space: [kv_len][num_kv_heads][head_dim].
using DeqRows = std::vector<double>;

// The textbook definition, in float64, on the dequantized rows and the unrotated Q.
// q: [total_q][num_q_heads][head_dim_k]; returns [total_q][num_q_heads][head_dim_v].
inline std::vector<double> exact_attention(const LayerKvSpec& spec, float softmax_scale,
                                           float soft_cap, const std::vector<SeqShape>& seqs,
                                           const std::vector<DeqRows>& k_deq,
                                           const std::vector<DeqRows>& v_deq, const float* q_all) {
  const int nkv = spec.num_kv_heads, nq_heads = spec.num_q_heads, ratio = spec.gqa_ratio();
  const int hk = spec.head_dim_k, hv = spec.head_dim_v;
  size_t total_q = 0;
  for (const auto& s : seqs) total_q += static_cast<size_t>(s.q_len);
  std::vector<double> expected(total_q * nq_heads * hv, 0.0);
  size_t q_begin = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int kv_len = seqs[i].kv_len, q_len = seqs[i].q_len;
    for (int j = 0; j < q_len; ++j) {
      const int pos = kv_len - q_len + j;
      std::vector<bool> visible(static_cast<size_t>(kv_len));
      for (int t = 0; t < kv_len; ++t) {
        switch (spec.attention) {
          case AttentionKind::kCausal:
            visible[t] = t <= pos;
            break;
          case AttentionKind::kSlidingWindow:
            visible[t] = t <= pos && t > pos - spec.sliding_window;
            break;
          case AttentionKind::kNonCausal:
            visible[t] = true;
            break;
        }
      }
      const size_t qrow0 = (q_begin + static_cast<size_t>(j)) * nq_heads;
      for (int h = 0; h < nq_heads; ++h) {
        const int g = h / ratio;
        const float* q = q_all + (qrow0 + h) * hk;
        std::vector<double> w(static_cast<size_t>(kv_len), 0.0);
        double mx = -std::numeric_limits<double>::infinity();
        for (int t = 0; t < kv_len; ++t) {
          if (!visible[t]) continue;
          const double* k = &k_deq[i][(static_cast<size_t>(t) * nkv + g) * hk];
          double dot = 0.0;
          for (int d = 0; d < hk; ++d) dot += static_cast<double>(q[d]) * k[d];
          double x = dot * softmax_scale;
          if (soft_cap != 0.0f) x = soft_cap * std::tanh(x / soft_cap);
          w[t] = x;
          mx = std::max(mx, x);
        }
        double sum = 0.0;
        for (int t = 0; t < kv_len; ++t)
          if (visible[t]) sum += (w[t] = std::exp(w[t] - mx));
        double* o = &expected[(qrow0 + h) * hv];
        for (int t = 0; t < kv_len; ++t) {
          if (!visible[t]) continue;
          const double* v = &v_deq[i][(static_cast<size_t>(t) * nkv + g) * hv];
          for (int d = 0; d < hv; ++d) o[d] += w[t] / sum * v[d];
        }
      }
    }
    q_begin += static_cast<size_t>(q_len);
  }
  return expected;
}

// Every output element within tol * (largest |V| of its sequence and kv head), plus extra[e]
// where given; NaN fails. `out` is a backend's output (float) or a simulated one (double).
template <typename T>
::testing::AssertionResult check_attention(const LayerKvSpec& spec,
                                           const std::vector<SeqShape>& seqs,
                                           const std::vector<DeqRows>& v_deq,
                                           const std::vector<double>& expected, const T* out,
                                           double tol, const double* extra = nullptr) {
  const int nkv = spec.num_kv_heads, nq_heads = spec.num_q_heads, ratio = spec.gqa_ratio();
  const int hv = spec.head_dim_v;
  int bad = 0;
  std::ostringstream msg;
  size_t q_begin = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (int h = 0; h < nq_heads; ++h) {
      const int g = h / ratio;
      double vmax = 0.0;
      for (int t = 0; t < seqs[i].kv_len; ++t)
        for (int d = 0; d < hv; ++d)
          vmax = std::max(vmax, std::fabs(v_deq[i][(static_cast<size_t>(t) * nkv + g) * hv + d]));
      for (int j = 0; j < seqs[i].q_len; ++j)
        for (int d = 0; d < hv; ++d) {
          const size_t e = ((q_begin + static_cast<size_t>(j)) * nq_heads + h) * hv + d;
          const double got = out[e], want = expected[e];
          const double allowed = tol * vmax + (extra != nullptr ? extra[e] : 0.0);
          if (!(std::fabs(got - want) <= allowed) && ++bad <= 5)
            msg << "\n  seq " << i << " q " << j << " head " << h << " dim " << d << ": got " << got
                << ", want " << want << " (tol " << allowed << ")";
        }
    }
    q_begin += static_cast<size_t>(seqs[i].q_len);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " elements out of tolerance:" << msg.str();
}

// encode_row then decode_row_unrotated: the value a correct cache read yields, in model space.
inline void quantize_dequantize(KvDtype dtype, std::span<const float> x, float tensor_scale,
                                double* deq) {
  const size_t rdb = row_data_bytes(dtype, static_cast<int>(x.size()));
  std::vector<std::byte> data(rdb), meta(row_scale_bytes(dtype) + 1);
  quant::encode_row(dtype, x, tensor_scale, data.data(), meta.data());
  std::vector<float> back(x.size());
  quant::decode_row_unrotated(dtype, data.data(), meta.data(), tensor_scale, back);
  std::copy(back.begin(), back.end(), deq);
}

// ---- cpu_avx512's integer Q·K (int8/int4_per_token_head K, KDot in its kernel.h) -----------
//
// The kernel quantizes each prepared query q (rotated if K is, times the softmax scale) to
// qq = round(q / s_q), s_q = max|q| / 127, so q_i = s_q qq_i + e_i with |e_i| <= s_q / 2. With
// K row t decoded as S c_i (+ Z for int4), its logit is, for int8,
//   x'_t = s_q S sum(qq_i c_i) = x_t - S sum(e_i c_i),
// and for int4, where the kernel adds back m sum(e_i) (m = 7.5, the middle code; sum(e_i) =
// sum(q_i) - s_q sum(qq_i) is known) and the zero-point term uses the fp32 q,
//   x'_t = S (s_q sum(qq_i c_i) + m sum(e_i)) + Z sum(q_i) = x_t - S sum(e_i (c_i - m)).
// So |x'_t - x_t| <= D_t = s_q / 2 * S * sum|c_i - m| (m = 0 for int8), plus the fp32 rounding
// of those few operations (a relative 1e-4 of D_t and 2e-7 |Z sum(q)| cover it). The soft cap
// is 1-Lipschitz, so D_t still bounds the capped logits. With p the exact softmax weights and
// o = sum_t p_t v_t the exact output, the perturbed weights are p'_t = p_t e^(d_t) / E with
// |d_t| <= D_t and E = sum_s p_s e^(d_s) >= e^(-D), D = max_t D_t; since sum_t p'_t = 1 and
// sum_t p_t (v_t - o) = 0,
//   o' - o = sum_t p'_t (v_t - o) = (1 / E) sum_t p_t (e^(d_t) - 1) (v_t - o),
//   |o'_d - o_d| <= e^D sum_t p_t (e^(D_t) - 1) |v_td - o_d|,
// element by element. A split kv range merges the same logits exactly, so the bound holds
// for the merged output too.

// Per K row: S, Z (0 for int8) and sum|c_i - m| (m: 0 for int8, 7.5 for int4).
struct KRowCodes {
  double scale = 0.0, zero = 0.0, code_l1 = 0.0;
};
// Of a stored row (zeros for dtypes other than int8/int4_per_token_head).
inline KRowCodes k_row_codes_of(KvDtype k, const std::byte* data, const std::byte* meta,
                                int head_dim) {
  KRowCodes r;
  if (k == KvDtype::kInt8PerTokenHead) {
    float s;
    std::memcpy(&s, meta, sizeof s);
    r.scale = s;
    for (int e = 0; e < head_dim; ++e)
      r.code_l1 += std::abs(static_cast<int>(static_cast<int8_t>(data[e])));
  } else if (k == KvDtype::kInt4PerTokenHead) {
    uint16_t s, z;
    std::memcpy(&s, meta, sizeof s);
    std::memcpy(&z, meta + 2, sizeof z);
    r.scale = quant::fp16_bits_to_float(s);
    r.zero = quant::fp16_bits_to_float(z);
    for (int e = 0; e < head_dim / 2; ++e) {
      const auto b = static_cast<unsigned>(data[e]);
      r.code_l1 += std::fabs((b & 0xF) - 7.5) + std::fabs((b >> 4) - 7.5);
    }
  }
  return r;
}

// A query as the kernel prepares it (rotated if K is, times the softmax scale: the same fp32
// operations), its s_q = max|q| / 127 and sum(q).
struct PreparedQ {
  std::vector<float> q;
  double scale = 0.0, sum = 0.0;
};
inline PreparedQ prepare_q(const float* q, int head_dim, bool rotated, float softmax_scale) {
  PreparedQ p;
  p.q.assign(q, q + head_dim);
  if (rotated) quant::hadamard_rotate(p.q);
  float amax = 0.0f;
  for (float& x : p.q) {
    x *= softmax_scale;
    amax = std::max(amax, std::fabs(x));
    p.sum += x;
  }
  p.scale = amax / 127.0f;
  return p;
}

// For every output element ([total_q][num_q_heads][head_dim_v]): `out`, the exact attention
// with logit (sequence i, global query row, query head h, token t) moved to
// x + shift(i, q_row, h, t, x) (x before the soft cap), and `bound`, the bound above around
// the unmoved output. k_codes(i, t, kv head) -> const KRowCodes&.
struct IntQAttention {
  std::vector<double> out, bound;
};
template <typename KCodes, typename Shift>
IntQAttention int_q_attention(const LayerKvSpec& spec, float softmax_scale, float soft_cap,
                              const std::vector<SeqShape>& seqs, const std::vector<DeqRows>& k_deq,
                              const std::vector<DeqRows>& v_deq, const float* q_all, KCodes k_codes,
                              Shift shift) {
  const int nkv = spec.num_kv_heads, nq_heads = spec.num_q_heads, ratio = spec.gqa_ratio();
  const int hk = spec.head_dim_k, hv = spec.head_dim_v;
  const bool rotated = traits(spec.k_dtype).rotated;
  size_t total_q = 0;
  for (const auto& s : seqs) total_q += static_cast<size_t>(s.q_len);
  IntQAttention r;
  r.out.assign(total_q * nq_heads * hv, 0.0);
  r.bound.assign(r.out.size(), 0.0);
  size_t q_begin = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int kv_len = seqs[i].kv_len, q_len = seqs[i].q_len;
    for (int j = 0; j < q_len; ++j) {
      const int pos = kv_len - q_len + j;
      const size_t q_row = q_begin + static_cast<size_t>(j);
      for (int h = 0; h < nq_heads; ++h) {
        const int g = h / ratio;
        const float* q = q_all + (q_row * nq_heads + h) * hk;
        const PreparedQ pq = prepare_q(q, hk, rotated, softmax_scale);
        std::vector<double> x(static_cast<size_t>(kv_len)), xs(x.size()), d(x.size());
        std::vector<bool> seen(x.size());
        double mx = -std::numeric_limits<double>::infinity(), mx_shifted = mx, dmax = 0.0;
        for (int t = 0; t < kv_len; ++t) {
          seen[t] = spec.attention == AttentionKind::kNonCausal ||
                    (t <= pos && (spec.attention != AttentionKind::kSlidingWindow ||
                                  t > pos - spec.sliding_window));
          if (!seen[t]) continue;
          const double* k = &k_deq[i][(static_cast<size_t>(t) * nkv + g) * hk];
          double dot = 0.0;
          for (int e = 0; e < hk; ++e) dot += static_cast<double>(q[e]) * k[e];
          dot *= softmax_scale;
          double moved = dot + shift(i, q_row, h, t, dot);
          if (soft_cap != 0.0f) {
            dot = soft_cap * std::tanh(dot / soft_cap);
            moved = soft_cap * std::tanh(moved / soft_cap);
          }
          x[t] = dot;
          xs[t] = moved;
          mx = std::max(mx, dot);
          mx_shifted = std::max(mx_shifted, moved);
          const KRowCodes& c = k_codes(i, t, g);
          d[t] = 0.5 * pq.scale * c.scale * c.code_l1 * (1.0 + 1e-4) +
                 2e-7 * std::fabs(c.zero * pq.sum);
          dmax = std::max(dmax, d[t]);
        }
        std::vector<double> p(x.size(), 0.0), ps(x.size(), 0.0);
        double sum = 0.0, sum_shifted = 0.0;
        for (int t = 0; t < kv_len; ++t) {
          if (!seen[t]) continue;
          sum += (p[t] = std::exp(x[t] - mx));
          sum_shifted += (ps[t] = std::exp(xs[t] - mx_shifted));
        }
        const size_t base = (q_row * nq_heads + h) * hv;
        std::vector<double> o(static_cast<size_t>(hv), 0.0);
        for (int t = 0; t < kv_len; ++t) {
          if (!seen[t]) continue;
          const double* v = &v_deq[i][(static_cast<size_t>(t) * nkv + g) * hv];
          for (int e = 0; e < hv; ++e) {
            o[e] += p[t] / sum * v[e];
            r.out[base + e] += ps[t] / sum_shifted * v[e];
          }
        }
        for (int t = 0; t < kv_len; ++t) {
          if (!seen[t]) continue;
          const double* v = &v_deq[i][(static_cast<size_t>(t) * nkv + g) * hv];
          const double w = std::exp(dmax) * p[t] / sum * std::expm1(d[t]);
          for (int e = 0; e < hv; ++e) r.bound[base + e] += w * std::fabs(v[e] - o[e]);
        }
      }
    }
    q_begin += static_cast<size_t>(q_len);
  }
  return r;
}

// One batch: cache storage, queries, expected outputs.
class AttnProblem {
 public:
  AttnProblem(const AttnCase& c, unsigned seed) : case_(c), spec_(spec_for(c)) {
    std::mt19937 rng(seed);
    const int bt = c.block_tokens;
    const int hk = c.head_dim_k, hv = c.head_dim_v, nkv = c.num_kv_heads;
    const int nq_heads = nkv * c.ratio;
    k_layout_ = spec_.layout(KvSide::kK);
    v_layout_ = spec_.layout(KvSide::kV);

    // Blocks: every sequence's blocks drawn from a shuffled pool, a few left unused.
    int needed = 0;
    for (const auto& s : c.seqs) needed += (s.kv_len + bt - 1) / bt;
    num_blocks_ = needed + 3;
    std::vector<int32_t> pool(static_cast<size_t>(num_blocks_));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    k_store_.assign(static_cast<size_t>(num_blocks_) * k_layout_.block_bytes, std::byte{0xFF});
    v_store_.assign(static_cast<size_t>(num_blocks_) * v_layout_.block_bytes, std::byte{0xFF});

    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> spread(0.3f, 2.0f);
    std::uniform_int_distribution<int> coin(0, 15);
    auto random_row = [&](int dim) {
      std::vector<float> x(static_cast<size_t>(dim));
      const float sigma = spread(rng);
      for (float& e : x) e = sigma * normal(rng);
      if (coin(rng) == 0) x[static_cast<size_t>(coin(rng)) % x.size()] *= 8.0f;  // an outlier
      return x;
    };

    indptr_.push_back(0);
    q_indptr_.push_back(0);
    size_t next = 0;
    for (const auto& s : c.seqs) {
      const int nb = (s.kv_len + bt - 1) / bt;
      for (int b = 0; b < nb; ++b) indices_.push_back(pool[next++]);
      indptr_.push_back(static_cast<int32_t>(indices_.size()));
      seq_lens_.push_back(s.kv_len);
      q_indptr_.push_back(q_indptr_.back() + s.q_len);
    }
    total_q_ = q_indptr_.back();

    // K/V: encode each row into its slot, keep its dequantized (model-space) value.
    k_deq_.resize(c.seqs.size());
    v_deq_.resize(c.seqs.size());
    k_codes_.resize(c.seqs.size());
    for (size_t i = 0; i < c.seqs.size(); ++i) {
      const int len = c.seqs[i].kv_len;
      k_deq_[i].resize(static_cast<size_t>(len) * nkv * hk);
      v_deq_[i].resize(static_cast<size_t>(len) * nkv * hv);
      for (int t = 0; t < len; ++t) {
        const int32_t block = indices_[static_cast<size_t>(indptr_[i] + t / bt)];
        for (int h = 0; h < nkv; ++h) {
          write_row(KvSide::kK, block, t % bt, h, random_row(hk),
                    &k_deq_[i][(static_cast<size_t>(t) * nkv + h) * hk]);
          k_codes_[i].push_back(row_codes(block, t % bt, h));
          write_row(KvSide::kV, block, t % bt, h, random_row(hv),
                    &v_deq_[i][(static_cast<size_t>(t) * nkv + h) * hv]);
        }
      }
    }
    q_.resize(static_cast<size_t>(total_q_) * nq_heads * hk);
    for (float& x : q_) x = 2.5f * normal(rng);
    out_.resize(static_cast<size_t>(total_q_) * nq_heads * hv);
    compute_expected();
  }

  const LayerKvSpec& spec() const { return spec_; }

  // Arguments for one run; the output is poisoned with NaN so unwritten elements fail.
  AttentionArgs args() {
    std::fill(out_.begin(), out_.end(), std::numeric_limits<float>::quiet_NaN());
    AttentionArgs a;
    a.q = q_.data();
    a.out = out_.data();
    a.q_indptr = q_indptr_.data();
    a.block_table.indptr = indptr_.data();
    a.block_table.indices = indices_.data();
    a.block_table.seq_lens = seq_lens_.data();
    a.block_table.num_seqs = static_cast<int32_t>(case_.seqs.size());
    a.block_table.block_tokens = case_.block_tokens;
    a.cache.k_base = k_store_.data();
    a.cache.v_base = v_store_.data();
    a.cache.k_layout = k_layout_;
    a.cache.v_layout = v_layout_;
    a.cache.num_blocks = num_blocks_;
    a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(case_.head_dim_k));
    a.logit_soft_cap = case_.soft_cap;
    return a;
  }

  // Every output element within tol * (largest |V| of its sequence and kv head).
  ::testing::AssertionResult check(double tol) const {
    return check_attention(spec_, case_.seqs, v_deq_, expected_, out_.data(), tol);
  }

  // ---- cpu_avx512's integer Q·K (see int_q_attention above) --------------------------------

  // The backend's output within tol * (largest |V|) plus the bound of int_q_attention.
  ::testing::AssertionResult check_int_q(double tol) const {
    const IntQAttention bound = int_q(no_shift);
    return check_attention(spec_, case_.seqs, v_deq_, expected_, out_.data(), tol,
                           bound.bound.data());
  }

  // Whether check_int_q would reject an integer path whose logits are x + shift(i, q_row, h,
  // t, x) (see int_q_attention), taking the exact attention with those logits (float64) as its
  // output: how a test shows that the tolerance is tight enough to catch a wrong scale or zero
  // point.
  template <typename Shift>
  bool int_q_check_rejects(double tol, Shift shift) const {
    const IntQAttention bound = int_q(no_shift);
    const IntQAttention wrong = int_q(shift);
    return !check_attention(spec_, case_.seqs, v_deq_, expected_, wrong.out.data(), tol,
                            bound.bound.data());
  }

  // The exact attention with logits x + shift(i, q_row, h, t, x) against the backend's output
  // within tol * (largest |V|): a float64 model of a kernel's logits.
  template <typename Shift>
  ::testing::AssertionResult check_shifted(double tol, Shift shift) const {
    const IntQAttention want = int_q(shift);
    return check_attention(spec_, case_.seqs, v_deq_, want.out, out_.data(), tol);
  }

  // K row (seq, t, kv head h) decoded as the kernels see it (rotated for rotated dtypes).
  std::vector<float> k_row_stored(size_t seq, int t, int h) const {
    const int bt = case_.block_tokens;
    const int32_t block = indices_[static_cast<size_t>(indptr_[seq] + t / bt)];
    const std::byte* base = k_store_.data() + static_cast<size_t>(block) * k_layout_.block_bytes;
    std::vector<float> row(static_cast<size_t>(case_.head_dim_k));
    quant::decode_row(
        case_.k, base + k_layout_.value_offset(h, t % bt),
        k_layout_.row_scale_bytes ? base + k_layout_.scale_offset(h, t % bt) : nullptr,
        spec_.k_scale.for_head(h), row);
    return row;
  }

  // Replaces the queries ([total_q][num_q_heads][head_dim_k]) and recomputes the expected
  // outputs.
  void set_queries(const std::vector<float>& q) {
    q_ = q;
    compute_expected();
  }
  const std::vector<float>& queries() const { return q_; }
  const std::vector<float>& out() const { return out_; }

  const KRowCodes& k_row_codes(size_t seq, int t, int h) const {
    return k_codes_[seq][static_cast<size_t>(t) * case_.num_kv_heads + h];
  }
  PreparedQ prepared_q(size_t q_row, int h) const {
    const int hk = case_.head_dim_k;
    return prepare_q(q_.data() + (q_row * spec_.num_q_heads + h) * hk, hk, traits(case_.k).rotated,
                     1.0f / std::sqrt(static_cast<float>(hk)));
  }

 private:
  KRowCodes row_codes(int32_t block, int in_block, int head) const {
    const std::byte* base = k_store_.data() + static_cast<size_t>(block) * k_layout_.block_bytes;
    return k_row_codes_of(case_.k, base + k_layout_.value_offset(head, in_block),
                          base + k_layout_.scale_offset(head, in_block), case_.head_dim_k);
  }

  void write_row(KvSide side, int32_t block, int in_block, int head, const std::vector<float>& x,
                 double* deq) {
    const KvSideLayout& l = side == KvSide::kK ? k_layout_ : v_layout_;
    std::byte* base = (side == KvSide::kK ? k_store_.data() : v_store_.data()) +
                      static_cast<size_t>(block) * l.block_bytes;
    const float ts = spec_.scale(side).for_head(head);
    std::byte* meta = l.row_scale_bytes ? base + l.scale_offset(head, in_block) : nullptr;
    quant::encode_row(l.dtype, x, ts, base + l.value_offset(head, in_block), meta);
    std::vector<float> back(x.size());
    quant::decode_row_unrotated(l.dtype, base + l.value_offset(head, in_block), meta, ts, back);
    std::copy(back.begin(), back.end(), deq);
  }

  static double no_shift(size_t, size_t, int, int, double) { return 0.0; }
  template <typename Shift>
  IntQAttention int_q(Shift shift) const {
    return int_q_attention(
        spec_, 1.0f / std::sqrt(static_cast<float>(case_.head_dim_k)), case_.soft_cap, case_.seqs,
        k_deq_, v_deq_, q_.data(),
        [this](size_t i, int t, int g) -> const KRowCodes& { return k_row_codes(i, t, g); }, shift);
  }

  void compute_expected() {
    // The softmax scale is the float the backends are given (args()), widened.
    expected_ = exact_attention(spec_, 1.0f / std::sqrt(static_cast<float>(case_.head_dim_k)),
                                case_.soft_cap, case_.seqs, k_deq_, v_deq_, q_.data());
  }

  AttnCase case_;
  LayerKvSpec spec_;
  KvSideLayout k_layout_, v_layout_;
  int32_t num_blocks_ = 0;
  std::vector<std::byte> k_store_, v_store_;
  std::vector<int32_t> indptr_, indices_, seq_lens_, q_indptr_;
  int total_q_ = 0;
  std::vector<DeqRows> k_deq_, v_deq_;
  std::vector<std::vector<KRowCodes>> k_codes_;  // [seq][t * num_kv_heads + h]
  std::vector<float> q_, out_;
  std::vector<double> expected_;
};

}  // namespace kvq::test
