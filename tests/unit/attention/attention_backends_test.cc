// Every CPU backend (and each kernel of cpu_avx512: AVX-512, AVX2, portable) x every dtype pair
// with K == V
// plus mixed pairs x attention kind x head dim x ragged batches, against exact float64
// attention over the dequantized K/V. The kernels forced here (AVX2, portable) decode every K
// to fp32; the backend as dispatched takes int8/int4 K through its integer Q·K, checked with
// the tolerance that quantizing q allows (AttnProblem::check_int_q; its own tests are in
// cpu_int_dot_test.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attention/cpu_avx512/kernel.h"
#include "attention_harness.h"
#include "kvq/attention/backend.h"
#include "kvq/quant/codec.h"

namespace kvq {
namespace {

using test::AttnCase;
using test::AttnProblem;
using test::SeqShape;

// kAvx512: the cpu_avx512 backend as dispatched on this CPU (its best kernel); kAvx2 and
// kPortable: those kernels forced (kAvx2 skips on CPUs without AVX2).
enum class Impl { kReference, kAvx512, kAvx2, kPortable };

std::string impl_name(Impl impl) {
  switch (impl) {
    case Impl::kReference:
      return "cpu_reference";
    case Impl::kAvx512:
      return "cpu_avx512";
    case Impl::kAvx2:
      return "cpu_avx512_avx2";
    case Impl::kPortable:
      return "cpu_avx512_portable";
  }
  return "?";
}

void run(Impl impl, const LayerKvSpec& spec, const AttentionArgs& args) {
  switch (impl) {
    case Impl::kReference:
      find_attention_backend("cpu_reference")->run(spec, args);
      return;
    case Impl::kAvx512:
      find_attention_backend("cpu_avx512")->run(spec, args);
      return;
    case Impl::kAvx2:
    case Impl::kPortable:
      // The kernels take the same specs as the backend (its whitelist is the backend's).
      ASSERT_TRUE(find_attention_backend("cpu_avx512")->reasons_unsupported(spec).empty());
      cpu_attn::run_tiled(spec, args,
                          impl == Impl::kAvx2 ? cpu_attn::Isa::kAvx2 : cpu_attn::Isa::kPortable,
                          cpu_attn::KDot::kFloat);
      return;
  }
}

// Whether `impl` computes Q·K for K dtype k with integer dot products (the backend's default).
bool int_dot(Impl impl, KvDtype k) {
  return impl == Impl::kAvx512 &&
         cpu_attn::default_k_dot(cpu_attn::best_isa(), k) != cpu_attn::KDot::kFloat;
}

::testing::AssertionResult check(const test::AttnProblem& problem, Impl impl, KvDtype k,
                                 double tol) {
  return int_dot(impl, k) ? problem.check_int_q(tol) : problem.check(tol);
}

// Error allowed per element, relative to the largest |V| of the (sequence, kv head).
// The expected values use the same dequantized K/V, so quantization error does not enter:
// what remains is each implementation's arithmetic. cpu_reference accumulates in float64
// (float only in decoding); cpu_avx512 accumulates in fp32 with a polynomial exp. Rotated
// dtypes add the fp32 Hadamard rotation of Q (rotated K) and of the output (rotated V).
double tolerance(Impl impl, KvDtype k, KvDtype v) {
  double tol = impl == Impl::kReference ? 2e-6 : 2e-5;
  if (traits(k).rotated) tol *= 4;
  if (traits(v).rotated) tol *= 4;
  return tol;
}

std::vector<int> head_dims(Impl impl) {
  if (impl == Impl::kReference) return {8, 48, 64, 128, 256};
  return {64, 128, 256};
}

std::vector<int> block_sizes(Impl impl) {
  if (impl == Impl::kReference) return {5, 16, 32};
  return {16, 32};
}

bool storable(KvDtype d, int head_dim) {
  return head_dim_unsupported_reason(d, head_dim).empty();
}

struct Param {
  Impl impl;
  KvDtype k, v;
};

void PrintTo(const Param& p, std::ostream* os) {
  *os << impl_name(p.impl) << " K " << to_string(p.k) << " V " << to_string(p.v);
}

class AttentionBackendGrid : public ::testing::TestWithParam<Param> {};

TEST_P(AttentionBackendGrid, MatchesExactAttentionOverDequantizedKv) {
  const Param prm = GetParam();
  if (prm.impl == Impl::kAvx2 && !cpu_attn::cpu_has_avx2()) GTEST_SKIP() << "no AVX2 here";
  const unsigned seed = test::fresh_seed();
  const std::vector<AttentionKind> kinds = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                            AttentionKind::kNonCausal};
  const std::vector<int> blocks = block_sizes(prm.impl);
  const int ratios[] = {1, 2, 4, 8, 3};
  int index = 0;
  for (int hd : head_dims(prm.impl)) {
    if (!storable(prm.k, hd) || !storable(prm.v, hd)) continue;
    for (AttentionKind kind : kinds) {
      AttnCase c;
      c.k = prm.k;
      c.v = prm.v;
      c.kind = kind;
      c.window = index % 2 ? 7 : 20;
      c.head_dim_k = c.head_dim_v = hd;
      c.ratio = ratios[index % 5];
      c.num_kv_heads = 2;
      c.block_tokens = blocks[static_cast<size_t>(index) % blocks.size()];
      c.soft_cap = index % 3 == 2 ? 4.0f : 0.0f;
      // Ragged: a 1-token sequence, decode, a short prefill chunk, a whole prompt crossing
      // blocks, a sequence with no new queries; now and then a long prefill that spans
      // several work items.
      c.seqs = {{1, 1}, {37, 1}, {70, 5}, {33, 33}, {20, 0}};
      if (index % 4 == 0) c.seqs.push_back({150, 70});
      ++index;

      const unsigned case_seed = seed + static_cast<unsigned>(index);
      AttnProblem problem(c, case_seed);
      run(prm.impl, problem.spec(), problem.args());
      EXPECT_TRUE(check(problem, prm.impl, c.k, tolerance(prm.impl, c.k, c.v)))
          << impl_name(prm.impl) << ": " << c.describe() << ", seed " << case_seed;
    }
  }
  EXPECT_GT(index, 0) << "no head dim of this backend can store these dtypes";
}

std::vector<Param> grid() {
  std::vector<std::pair<KvDtype, KvDtype>> pairs;
  for (const auto& t : kKvDtypeTraits)
    if (t.concrete) pairs.push_back({t.dtype, t.dtype});
  // Mixed pairs: rotated K with plain V and the reverse, and a few cross-format mixes.
  pairs.push_back({KvDtype::kInt4PerTokenHead, KvDtype::kBFloat16});
  pairs.push_back({KvDtype::kBFloat16, KvDtype::kInt4PerTokenHead});
  pairs.push_back({KvDtype::kFp8E4M3, KvDtype::kInt8PerTokenHead});
  pairs.push_back({KvDtype::kNvfp4, KvDtype::kFloat16});
  pairs.push_back({KvDtype::kFloat32, KvDtype::kNvfp4});
  pairs.push_back({KvDtype::kInt8PerTokenHead, KvDtype::kFp8E5M2});
  pairs.push_back({KvDtype::kFp8PerTokenHead, KvDtype::kInt4PerTokenHead});
  std::vector<Param> params;
  for (Impl impl : {Impl::kReference, Impl::kAvx512, Impl::kAvx2, Impl::kPortable})
    for (const auto& [k, v] : pairs) params.push_back({impl, k, v});
  return params;
}

INSTANTIATE_TEST_SUITE_P(All, AttentionBackendGrid, ::testing::ValuesIn(grid()),
                         [](const ::testing::TestParamInfo<Param>& p) {
                           return impl_name(p.param.impl) + "_" +
                                  std::string(to_string(p.param.k)) + "_" +
                                  std::string(to_string(p.param.v));
                         });

// K and V with different head dims, and a long context (many tiles of online softmax).
TEST(AttentionBackends, DifferentKvHeadDimsAndLongContext) {
  const unsigned seed = test::fresh_seed();
  struct Shape {
    KvDtype k, v;
    int hk, hv;
    std::vector<SeqShape> seqs;
  };
  const std::vector<Shape> shapes = {
      {KvDtype::kInt4PerTokenHead, KvDtype::kBFloat16, 128, 64, {{45, 3}, {17, 1}}},
      {KvDtype::kFloat16, KvDtype::kNvfp4, 64, 256, {{30, 30}, {50, 2}}},
      {KvDtype::kBFloat16, KvDtype::kFp8E4M3, 128, 128, {{700, 1}, {600, 24}}},
  };
  int n = 0;
  for (Impl impl : {Impl::kReference, Impl::kAvx512, Impl::kAvx2, Impl::kPortable}) {
    if (impl == Impl::kAvx2 && !cpu_attn::cpu_has_avx2()) continue;
    for (const Shape& s : shapes)
      for (AttentionKind kind : {AttentionKind::kCausal, AttentionKind::kSlidingWindow}) {
        AttnCase c;
        c.k = s.k;
        c.v = s.v;
        c.head_dim_k = s.hk;
        c.head_dim_v = s.hv;
        c.kind = kind;
        c.window = 100;
        c.ratio = 4;
        c.num_kv_heads = 1;
        c.seqs = s.seqs;
        const unsigned case_seed = seed + static_cast<unsigned>(++n);
        AttnProblem problem(c, case_seed);
        run(impl, problem.spec(), problem.args());
        EXPECT_TRUE(check(problem, impl, c.k, tolerance(impl, c.k, c.v)))
            << impl_name(impl) << ": " << c.describe() << ", seed " << case_seed;
      }
  }
}

// Long kv ranges split into pieces with their own softmax state, merged at the end: forced
// here (the backend splits only when there are fewer units of work than cores). Integer K
// runs every Q·K the kernel has on this CPU.
TEST(CpuAvx512SplitKv, PiecesMergeToExactAttention) {
  const unsigned seed = test::fresh_seed();
  const std::vector<std::pair<KvDtype, KvDtype>> pairs = {
      {KvDtype::kBFloat16, KvDtype::kBFloat16},
      {KvDtype::kInt4PerTokenHead, KvDtype::kInt4PerTokenHead},
      {KvDtype::kInt8PerTokenHead, KvDtype::kBFloat16},
      {KvDtype::kFp8E4M3, KvDtype::kNvfp4},
      {KvDtype::kFp8E5M2, KvDtype::kFp8E4M3}};
  int n = 0;
  for (cpu_attn::Isa isa :
       {cpu_attn::Isa::kAvx512, cpu_attn::Isa::kAvx2, cpu_attn::Isa::kPortable}) {
    if (isa == cpu_attn::Isa::kAvx512 && !cpu_attn::cpu_has_avx512()) continue;
    if (isa == cpu_attn::Isa::kAvx2 && !cpu_attn::cpu_has_avx2()) continue;
    for (const auto& [k, v] : pairs)
      for (cpu_attn::KDot k_dot :
           {cpu_attn::KDot::kFloat, cpu_attn::KDot::kVnni, cpu_attn::KDot::kMaddubs}) {
        if (!cpu_attn::k_dot_supported(isa, k_dot)) continue;
        if (k_dot != cpu_attn::KDot::kFloat && !cpu_attn::integer_k(k)) continue;
        for (AttentionKind kind :
             {AttentionKind::kCausal, AttentionKind::kSlidingWindow, AttentionKind::kNonCausal}) {
          AttnCase c;
          c.k = k;
          c.v = v;
          c.kind = kind;
          c.window = 300;
          c.head_dim_k = c.head_dim_v = 64;
          c.ratio = 2;
          c.num_kv_heads = 2;
          c.soft_cap = n % 2 ? 6.0f : 0.0f;
          c.seqs = {{900, 1}, {517, 3}, {40, 1}};
          const unsigned case_seed = seed + static_cast<unsigned>(++n);
          AttnProblem problem(c, case_seed);
          cpu_attn::run_tiled(problem.spec(), problem.args(), isa, k_dot, /*min_tasks=*/64);
          const double tol = tolerance(Impl::kAvx512, k, v);
          EXPECT_TRUE(k_dot == cpu_attn::KDot::kFloat ? problem.check(tol)
                                                      : problem.check_int_q(tol))
              << cpu_attn::isa_name(isa) << " " << cpu_attn::k_dot_name(k_dot) << ": "
              << c.describe() << ", seed " << case_seed;
        }
      }
  }
}

// The AVX-512 and AVX2 tile decoders reproduce the reference codecs bit for bit, on encoded
// rows of random data and on random bytes (every code, NaN codes included). AVX2 has no nvfp4
// decoder (the generic one runs).
void check_decoders(cpu_attn::Isa isa) {
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_int_distribution<int> byte(0, 255);
  for (const auto& t : kKvDtypeTraits) {
    if (!t.concrete) continue;
    for (int dim : {64, 128, 256}) {
      const cpu_attn::DecodeTileFn fast = isa == cpu_attn::Isa::kAvx512
                                              ? cpu_attn::avx512_decoder(t.dtype, dim)
                                              : cpu_attn::avx2_decoder(t.dtype, dim);
      ASSERT_NE(fast, nullptr) << t.name << " " << cpu_attn::isa_name(isa);
      constexpr int kRows = 16;
      const size_t rdb = row_data_bytes(t.dtype, dim), rsb = row_scale_bytes(t.dtype);
      std::vector<std::byte> values(kRows * rdb), scales(kRows * rsb + 4);
      const float ts = 0.037f;
      for (int i = 0; i < kRows; ++i) {
        if (i % 2 == 0) {
          std::vector<float> x(static_cast<size_t>(dim));
          for (float& e : x) e = normal(rng);
          quant::encode_row(t.dtype, x, ts, values.data() + i * rdb, scales.data() + i * rsb);
        } else {
          for (size_t b = 0; b < rdb; ++b) values[i * rdb + b] = std::byte(byte(rng));
          for (size_t b = 0; b < rsb; ++b) scales[i * rsb + b] = std::byte(byte(rng));
          if (i == 1 && rsb == 4) {  // a huge per-row scale: no folding of constants into it
            const float huge = 3.0e38f;
            std::memcpy(&scales[i * rsb], &huge, sizeof huge);
          }
          if (t.dtype == KvDtype::kNvfp4)  // the encoder never writes a NaN block scale
            for (size_t b = static_cast<size_t>(dim) / 2; b < rdb; ++b)
              if ((static_cast<int>(values[i * rdb + b]) & 0x7F) == 0x7F)
                values[i * rdb + b] = std::byte{0x3A};
        }
      }
      cpu_attn::TileSource src{values.data(), scales.data(), rdb, rsb, dim, ts, t.dtype};
      std::vector<float> want(static_cast<size_t>(kRows) * dim), got(want.size());
      cpu_attn::decode_tile_generic(src, kRows, want.data());
      fast(src, kRows, got.data());
      for (size_t e = 0; e < want.size(); ++e) {
        const bool same = std::bit_cast<uint32_t>(got[e]) == std::bit_cast<uint32_t>(want[e]) ||
                          (std::isnan(got[e]) && std::isnan(want[e]));
        ASSERT_TRUE(same) << cpu_attn::isa_name(isa) << " " << t.name << " dim " << dim << " row "
                          << e / dim << " elem " << e % dim << ": got " << got[e] << ", want "
                          << want[e] << ", seed " << seed;
      }
    }
  }
}

TEST(CpuAvx512Decoders, MatchReferenceDecodeBitForBit) {
  if (!cpu_attn::cpu_has_avx512()) GTEST_SKIP() << "this CPU has no AVX-512";
  check_decoders(cpu_attn::Isa::kAvx512);
}

TEST(CpuAvx2Decoders, MatchReferenceDecodeBitForBit) {
  if (!cpu_attn::cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2/FMA/F16C";
  check_decoders(cpu_attn::Isa::kAvx2);
}

// The unscaled fp8 decoders (kernel.h: unscaled_factor): raw * factor is the reference decode
// bit for bit, for every code (NaN codes included: a row with one takes the patched path, a
// row without the shift path), and the factor is 0 where it is not a normal float.
void check_unscaled_decoders(cpu_attn::Isa isa) {
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> log_scale(-12.0f, 12.0f);
  for (KvDtype dtype : {KvDtype::kFp8E4M3, KvDtype::kFp8E5M2}) {
    EXPECT_EQ(cpu_attn::unscaled_factor(dtype, 0.0f), 0.0f);
    if (dtype == KvDtype::kFp8E4M3) {
      EXPECT_EQ(cpu_attn::unscaled_factor(dtype, 3.0e38f), 0.0f);
    }
    for (int dim : {64, 128, 256}) {
      const cpu_attn::DecodeTileFn raw = isa == cpu_attn::Isa::kAvx512
                                             ? cpu_attn::avx512_unscaled_decoder(dtype, dim)
                                             : cpu_attn::avx2_unscaled_decoder(dtype, dim);
      ASSERT_NE(raw, nullptr) << to_string(dtype) << " " << cpu_attn::isa_name(isa);
      constexpr int kRows = 16;
      std::vector<std::byte> values(static_cast<size_t>(kRows) * dim), scales(4);
      for (int i = 0; i < kRows; ++i)
        for (int e = 0; e < dim; ++e) {
          int code = i < 4 ? (i * dim + e) % 256 : byte(rng);  // rows 0-3: every code in order
          if (i >= 4 && i % 2 == 0 && (code & 0x7F) == 0x7F) code = 0x7E;  // rows without NaN
          values[static_cast<size_t>(i) * dim + static_cast<size_t>(e)] = std::byte(code);
        }
      const float ts = std::exp2(log_scale(rng));
      const float factor = cpu_attn::unscaled_factor(dtype, ts);
      ASSERT_NE(factor, 0.0f);
      cpu_attn::TileSource src{values.data(), scales.data(), static_cast<size_t>(dim), 0, dim, ts,
                               dtype};
      std::vector<float> want(static_cast<size_t>(kRows) * dim), got(want.size());
      cpu_attn::decode_tile_generic(src, kRows, want.data());
      raw(src, kRows, got.data());
      for (size_t e = 0; e < want.size(); ++e) {
        const float scaled = got[e] * factor;
        const bool same = std::bit_cast<uint32_t>(scaled) == std::bit_cast<uint32_t>(want[e]) ||
                          (std::isnan(scaled) && std::isnan(want[e]));
        ASSERT_TRUE(same) << cpu_attn::isa_name(isa) << " " << to_string(dtype) << " dim " << dim
                          << " code " << static_cast<int>(values[e]) << ": raw " << got[e] << " x "
                          << factor << " = " << scaled << ", want " << want[e] << ", seed " << seed;
      }
    }
  }
}

TEST(CpuFp8UnscaledDecoders, TimesTheFactorAreTheReferenceBitForBit) {
  int ran = 0;
  for (cpu_attn::Isa isa : {cpu_attn::Isa::kAvx512, cpu_attn::Isa::kAvx2}) {
    if (isa == cpu_attn::Isa::kAvx512 ? !cpu_attn::cpu_has_avx512() : !cpu_attn::cpu_has_avx2())
      continue;
    check_unscaled_decoders(isa);
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512";
}

// The kernels with the scale applied after the products (logits, output) against the same
// kernels scaling as they decode: the same outputs within fp32 rounding, and a NaN code in K or
// V makes exactly the same outputs NaN, those of the queries of its kv head that see the token
// (the exact attention's NaNs).
TEST(CpuFp8ScaleAfter, MatchesScalingInTheDecoderNanCodesIncluded) {
  const unsigned seed = test::fresh_seed();
  int ran = 0;
  for (cpu_attn::Isa isa : {cpu_attn::Isa::kAvx512, cpu_attn::Isa::kAvx2}) {
    if (isa == cpu_attn::Isa::kAvx512 ? !cpu_attn::cpu_has_avx512() : !cpu_attn::cpu_has_avx2())
      continue;
    ++ran;
    for (KvDtype dtype : {KvDtype::kFp8E4M3, KvDtype::kFp8E5M2}) {
      for (KvSide nan_side : {KvSide::kK, KvSide::kV}) {
        AttnCase c;
        c.k = c.v = dtype;
        c.kind = AttentionKind::kCausal;
        c.head_dim_k = c.head_dim_v = 64;
        c.ratio = 2;
        c.num_kv_heads = 2;
        c.block_tokens = 16;
        c.seqs = {{37, 1}, {33, 33}, {900, 1}};  // 900: split into pieces with min_tasks 64
        const unsigned case_seed = seed + static_cast<unsigned>(ran * 4) +
                                   (dtype == KvDtype::kFp8E5M2 ? 2u : 0u) +
                                   (nan_side == KvSide::kV ? 1u : 0u);
        AttnProblem problem(c, case_seed);
        AttentionArgs args = problem.args();
        // A NaN code in element 3 of token 9 of sequence 1, kv head 1 (e4m3: 0x7F; e5m2: 0x7F
        // is NaN too: exponent 11111, mantissa 11).
        const KvSideLayout& layout = args.cache.layout(nan_side);
        const int32_t block =
            args.block_table.indices[args.block_table.indptr[1] + 9 / c.block_tokens];
        std::byte* base = const_cast<std::byte*>(args.cache.base(nan_side));
        base[static_cast<size_t>(block) * layout.block_bytes +
             layout.value_offset(1, 9 % c.block_tokens) + 3] = std::byte{0x7F};
        cpu_attn::run_tiled(problem.spec(), args, isa, cpu_attn::KDot::kFloat, 0, false);
        const std::vector<float> want = problem.out();
        args = problem.args();
        cpu_attn::run_tiled(problem.spec(), args, isa, cpu_attn::KDot::kFloat, 64, true);
        const std::vector<float>& got = problem.out();
        float amax = 0.0f;
        for (float x : want)
          if (std::isfinite(x)) amax = std::max(amax, std::abs(x));
        int nans = 0;
        for (size_t e = 0; e < want.size(); ++e) {
          nans += std::isnan(want[e]) ? 1 : 0;
          ASSERT_EQ(std::isnan(got[e]), std::isnan(want[e]))
              << cpu_attn::isa_name(isa) << " " << to_string(dtype) << " element " << e << ", seed "
              << case_seed;
          if (!std::isnan(want[e])) {
            ASSERT_NEAR(got[e], want[e], 1e-5 * amax)
                << cpu_attn::isa_name(isa) << " " << to_string(dtype) << " element " << e
                << ", seed " << case_seed;
          }
        }
        // Sequence 1's positions 9..32 of both q heads of kv head 1: a NaN logit makes every
        // element of those rows NaN, a NaN in V element 3 of them.
        EXPECT_EQ(nans, 24 * 2 * (nan_side == KvSide::kK ? 64 : 1))
            << cpu_attn::isa_name(isa) << " " << to_string(dtype) << ", seed " << case_seed;
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512";
}

}  // namespace
}  // namespace kvq
