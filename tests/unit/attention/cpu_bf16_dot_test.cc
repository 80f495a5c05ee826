// cpu_avx512's bf16 Q·K for fp8 K (KDot::kBf16 in src/attention/cpu_avx512/kernel.h, AVX512-BF16
// only): the code-to-bf16 conversion is exact for every code, and the attention it computes is
//  - a float64 model of the path itself (q rounded to bf16 the driver's way, times the exact K
//    values) to fp32 precision;
//  - exact attention over the dequantized cache within the bound that rounding q allows
//    (AttnProblem::check_int_q, which covers fp8 K too);
// and the fp32 path runs where a query has a non-finite element.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention/cpu_avx512/kernel.h"
#include "attention_harness.h"
#include "kvq/quant/codec.h"

namespace kvq {
namespace {

using cpu_attn::Isa;
using cpu_attn::KDot;
using test::AttnCase;
using test::AttnProblem;

bool bf16_dot_here() {
  return cpu_attn::k_dot_supported(Isa::kAvx512, KDot::kBf16);
}

// Round to nearest bf16, ties to even, as the driver does (finite x).
double to_bf16(float x) {
  uint32_t bits = 0;
  std::memcpy(&bits, &x, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  bits &= 0xFFFF0000u;
  float y = 0.0f;
  std::memcpy(&y, &bits, 4);
  return y;
}

AttnCase grid_case(KvDtype k, int head_dim, int ratio, int index) {
  AttnCase c;
  c.k = k;
  c.v = index % 2 ? KvDtype::kBFloat16 : k;
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  c.kind = kinds[index % 3];
  c.window = 24;
  c.head_dim_k = c.head_dim_v = head_dim;
  c.ratio = ratio;
  c.num_kv_heads = 2;
  c.block_tokens = index % 2 ? 32 : 16;
  c.soft_cap = index % 4 == 1 ? 5.0f : 0.0f;
  c.seqs = {{1, 1}, {37, 1}, {70, 5}, {33, 33}, {600, 2}};
  return c;
}

// Every code of the dtype against the reference decoder: a tile whose row t holds the code at
// one position (a different one per row) and zeros elsewhere, and queries of ones (exact in
// bf16), so each logit is that code's value times the tensor scale, which must be the decoded
// value exactly (NaN codes: NaN).
TEST(CpuBf16Dot, EveryCodeBecomesItsExactValue) {
  if (!bf16_dot_here()) GTEST_SKIP() << "this CPU lacks AVX512-BF16";
  for (KvDtype k : {KvDtype::kFp8E4M3, KvDtype::kFp8E5M2})
    for (int dim : {64, 128}) {
      const cpu_attn::KLogitsFn fn = cpu_attn::avx512_k_logits(KDot::kBf16, k, dim);
      ASSERT_NE(fn, nullptr);
      const float tensor_scale = 0.375f;                                      // exact products
      const std::vector<uint16_t> qbf(2 * static_cast<size_t>(dim), 0x3F80);  // 1.0
      std::vector<float> logits(2 * cpu_attn::kChunk);
      for (int code = 0; code < 256; ++code) {
        std::vector<std::byte> tile(static_cast<size_t>(cpu_attn::kTile) * dim);
        for (int t = 0; t < cpu_attn::kTile; ++t)
          tile[static_cast<size_t>(t * dim + (t * 7 + code) % dim)] = static_cast<std::byte>(code);
        cpu_attn::TileSource src;
        src.values = tile.data();
        src.row_data_bytes = static_cast<size_t>(dim);
        src.dim = dim;
        src.tensor_scale = tensor_scale;
        src.dtype = k;
        cpu_attn::WorkItem item;
        item.qq.qbf = qbf.data();
        fn(src, item, 0, 2, logits.data());  // two queries: the kernel's pair path
        const std::byte one = static_cast<std::byte>(code);
        std::vector<float> value(dim);
        std::vector<std::byte> row(static_cast<size_t>(dim), one);
        quant::decode_row(k, row.data(), nullptr, tensor_scale, value);
        const float want = value[0];
        for (int qi = 0; qi < 2; ++qi)
          for (int t = 0; t < cpu_attn::kTile; ++t) {
            const float got = logits[static_cast<size_t>(qi * cpu_attn::kChunk + t)];
            if (std::isnan(want)) {
              EXPECT_TRUE(std::isnan(got)) << to_string(k) << " code " << code;
            } else {
              EXPECT_EQ(got, want) << to_string(k) << " code " << code << ", dim " << dim;
            }
          }
      }
    }
}

// The float64 model: logit = sum_i bf16(q_i) k_i with q prepared the driver's way and k the
// stored row (tensor scale included), against the backend's output at fp32 tolerance.
TEST(CpuBf16Dot, ComputesTheBf16QLogitsToFp32Precision) {
  if (!bf16_dot_here()) GTEST_SKIP() << "this CPU lacks AVX512-BF16";
  const unsigned seed = test::fresh_seed();
  int index = 0;
  for (KvDtype k : {KvDtype::kFp8E4M3, KvDtype::kFp8E5M2})
    for (int hd : {64, 128, 256}) {
      const int ratio = 1 << (index % 3);
      const AttnCase c = grid_case(k, hd, ratio, index);
      const unsigned case_seed = seed + static_cast<unsigned>(++index);
      AttnProblem problem(c, case_seed);
      cpu_attn::run_tiled(problem.spec(), problem.args(), Isa::kAvx512, KDot::kBf16,
                          index % 2 ? 64 : 0);
      auto model = [&](size_t i, size_t q_row, int h, int t, double x) {
        const test::PreparedQ p = problem.prepared_q(q_row, h);
        const std::vector<float> row = problem.k_row_stored(i, t, h / c.ratio);
        double dot = 0.0;
        for (size_t e = 0; e < row.size(); ++e) dot += to_bf16(p.q[e]) * row[e];
        return dot - x;
      };
      EXPECT_TRUE(problem.check_shifted(2e-5, model)) << c.describe() << ", seed " << case_seed;
      // And within the rounding bound of exact attention (what the backend tests check).
      EXPECT_TRUE(problem.check_int_q(2e-5)) << c.describe() << ", seed " << case_seed;
    }
}

// A work item whose query has a non-finite element runs the fp32 path: the poisoned query's
// item is the fp32 kernel's bit for bit.
TEST(CpuBf16Dot, NonFiniteQueriesRunFp32) {
  if (!bf16_dot_here()) GTEST_SKIP() << "this CPU lacks AVX512-BF16";
  const unsigned seed = test::fresh_seed();
  for (float poison :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    const AttnCase c = grid_case(KvDtype::kFp8E4M3, 64, 2, 0);
    AttnProblem problem(c, seed);
    std::vector<float> q = problem.queries();
    q[5] = poison;
    problem.set_queries(q);
    cpu_attn::run_tiled(problem.spec(), problem.args(), Isa::kAvx512, KDot::kFloat);
    const std::vector<float> want = problem.out();
    cpu_attn::run_tiled(problem.spec(), problem.args(), Isa::kAvx512, KDot::kBf16);
    const std::vector<float>& got = problem.out();
    const size_t checked = static_cast<size_t>(c.ratio) * c.head_dim_v;  // the first item
    ASSERT_TRUE(std::isfinite(want[checked - 1])) << "seed " << seed;
    for (size_t e = 0; e < checked; ++e) {
      if (std::isnan(want[e])) {
        EXPECT_TRUE(std::isnan(got[e])) << e << ", seed " << seed;
      } else {
        EXPECT_EQ(got[e], want[e]) << e << ", seed " << seed;
      }
    }
    // Elsewhere the bf16 path ran: the outputs differ from fp32's somewhere.
    size_t differ = 0;
    for (size_t e = checked; e < got.size(); ++e) differ += got[e] != want[e];
    EXPECT_GT(differ, 0u) << "seed " << seed;
  }
}

}  // namespace
}  // namespace kvq
