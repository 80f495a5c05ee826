// cpu_avx512's integer Q·K for int8/int4_per_token_head K (KDot in
// src/attention/cpu_avx512/kernel.h): every variant this CPU runs (AVX-512 and AVX2 kernels,
// vpdpbusd and vpmaddubsw), against
//  - exact float64 attention over the dequantized cache, within the error that quantizing q
//    allows (AttnProblem::check_int_q, whose comment derives the bound);
//  - a float64 model of the integer path itself (q quantized the kernel's way), within the
//    fp32 tolerance: the kernel computes what it is specified to, to fp32 precision;
// and shows that the bound is tight enough to reject a wrong zero point, scale or offset.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention/cpu_avx512/kernel.h"
#include "attention_harness.h"

namespace kvq {
namespace {

using cpu_attn::Isa;
using cpu_attn::KDot;
using test::AttnCase;
using test::AttnProblem;

// The fp32 tolerance of the attention_backends_test kernels (rotated sides x4 each).
double fp32_tolerance(KvDtype k, KvDtype v) {
  double tol = 2e-5;
  if (traits(k).rotated) tol *= 4;
  if (traits(v).rotated) tol *= 4;
  return tol;
}

struct Variant {
  Isa isa;
  KDot k_dot;
  std::string name() const {
    return std::string(cpu_attn::isa_name(isa)) + "/" + cpu_attn::k_dot_name(k_dot);
  }
};

// The integer Q·K variants this CPU runs.
std::vector<Variant> variants() {
  std::vector<Variant> out;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2})
    for (KDot k_dot : {KDot::kVnni, KDot::kMaddubs})
      if (cpu_attn::k_dot_supported(isa, k_dot)) out.push_back({isa, k_dot});
  return out;
}

// qq = round(q / s_q) of a prepared query, as the driver computes it (same fp32 operations).
std::vector<int> quantize(const test::PreparedQ& p) {
  std::vector<int> qq(p.q.size());
  const float s = static_cast<float>(p.scale);
  for (size_t i = 0; i < qq.size(); ++i)
    qq[i] = static_cast<int>(std::fmax(-127.0f, std::fmin(127.0f, std::nearbyint(p.q[i] / s))));
  return qq;
}

// A problem of the grid: index picks the attention kind, the V dtype, soft cap and seqs.
AttnCase grid_case(KvDtype k, int head_dim, int ratio, bool soft_cap, int index) {
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
  c.soft_cap = soft_cap ? 5.0f : 0.0f;
  // Decode of short and long contexts, a prefill chunk (several positions per work item), a
  // whole prompt, and a long one that a forced split cuts into pieces.
  c.seqs = {{1, 1}, {37, 1}, {70, 5}, {33, 33}, {600, 2}};
  return c;
}

TEST(CpuIntDot, MatchesExactAttentionWithinTheQuantizedQBound) {
  const std::vector<Variant> vs = variants();
  if (vs.empty()) GTEST_SKIP() << "this CPU runs no integer Q·K (no AVX2)";
  const unsigned seed = test::fresh_seed();
  int index = 0;
  for (const Variant& var : vs)
    for (KvDtype k : {KvDtype::kInt8PerTokenHead, KvDtype::kInt4PerTokenHead})
      for (int hd : {64, 128, 256})
        for (int ratio : {1, 2, 4})
          for (bool soft_cap : {false, true}) {
            const AttnCase c = grid_case(k, hd, ratio, soft_cap, index);
            const int min_tasks = index % 2 ? 64 : 0;  // 64: split kv ranges, merged
            const unsigned case_seed = seed + static_cast<unsigned>(++index);
            AttnProblem problem(c, case_seed);
            cpu_attn::run_tiled(problem.spec(), problem.args(), var.isa, var.k_dot, min_tasks);
            EXPECT_TRUE(problem.check_int_q(fp32_tolerance(c.k, c.v)))
                << var.name() << ": " << c.describe() << ", min_tasks " << min_tasks << ", seed "
                << case_seed;
          }
}

// The float64 model of the integer path with the stored (rotated) K row k = S c + Z and the
// kernel's qq: int8 logit = sum_i (s_q qq_i) k_i; int4 logit = S (s_q sum_i qq_i c_i +
// 7.5 sum_i e_i) + Z sum_i q_i with e = q - s_q qq; i.e. the exact logit plus
// sum_i (s_q qq_i - q_i)(k_i - Z - 7.5 S) (Z = 0 and no 7.5 S for int8).
TEST(CpuIntDot, ComputesTheQuantizedQLogitsToFp32Precision) {
  const std::vector<Variant> vs = variants();
  if (vs.empty()) GTEST_SKIP() << "this CPU runs no integer Q·K (no AVX2)";
  const unsigned seed = test::fresh_seed();
  int index = 0;
  for (const Variant& var : vs)
    for (KvDtype k : {KvDtype::kInt8PerTokenHead, KvDtype::kInt4PerTokenHead})
      for (int hd : {64, 128, 256}) {
        const int ratio = 1 << (index % 3);
        const AttnCase c = grid_case(k, hd, ratio, index % 2 == 1, index);
        const unsigned case_seed = seed + static_cast<unsigned>(++index);
        AttnProblem problem(c, case_seed);
        cpu_attn::run_tiled(problem.spec(), problem.args(), var.isa, var.k_dot, index % 2 ? 64 : 0);
        auto model = [&](size_t i, size_t q_row, int h, int t, double) {
          const test::PreparedQ p = problem.prepared_q(q_row, h);
          const std::vector<int> qq = quantize(p);
          const std::vector<float> row = problem.k_row_stored(i, t, h / c.ratio);
          const auto& codes = problem.k_row_codes(i, t, h / c.ratio);
          const double mid = k == KvDtype::kInt4PerTokenHead ? codes.zero + 7.5 * codes.scale : 0.0;
          double shift = 0.0;
          for (size_t e = 0; e < row.size(); ++e)
            shift += (p.scale * qq[e] - p.q[e]) * (row[e] - mid);
          return shift;
        };
        EXPECT_TRUE(problem.check_shifted(fp32_tolerance(c.k, c.v), model))
            << var.name() << ": " << c.describe() << ", seed " << case_seed;
      }
}

// The bound of check_int_q takes every rounding error of q at its worst, where most of them
// cancel, so this shows that it is still tight enough to reject the mistakes an integer Q·K can
// make: the int4 zero-point term dropped, the scale S of the neighbouring row, the int8 offset
// (c + 128) not taken off. Each mistake is the exact attention with the mistaken logits,
// checked as check_int_q checks a kernel; decode rows of few tokens show any logit error in
// the output. (Measured on single draws: none of 2000 runs missed one; without the int4 centre
// term of QuantizedQ the bound is about 3x looser and missed a dropped zero point in about a
// third of the runs, at head_dim 256.)
TEST(CpuIntDot, TheBoundRejectsAWrongZeroPointScaleOrOffset) {
  const unsigned seed = test::fresh_seed();
  int index = 0;
  for (KvDtype k : {KvDtype::kInt8PerTokenHead, KvDtype::kInt4PerTokenHead})
    for (int hd : {64, 128, 256}) {
      AttnCase c = grid_case(k, hd, 2, false, 0);
      c.v = k;
      c.kind = AttentionKind::kCausal;
      c.seqs = {{2, 1}, {5, 1}, {12, 1}, {37, 1}, {70, 5}};
      // Each mistake on three fresh problems, rejected on at least two: a rare draw whose
      // mistake hides inside the bound does not fail the test, a bound too loose to catch the
      // mistake does.
      int no_zero_point_rejected = 0, neighbour_rejected = 0, offset_rejected = 0;
      std::string seeds;
      for (int draw = 0; draw < 3; ++draw) {
        const unsigned case_seed = seed + static_cast<unsigned>(++index);
        seeds += " " + std::to_string(case_seed);
        const AttnProblem problem(c, case_seed);
        const double tol = fp32_tolerance(c.k, c.v);
        if (k == KvDtype::kInt4PerTokenHead) {
          auto no_zero_point = [&](size_t i, size_t q_row, int h, int t, double) {
            return -problem.k_row_codes(i, t, h / c.ratio).zero * problem.prepared_q(q_row, h).sum;
          };
          no_zero_point_rejected += problem.int_q_check_rejects(tol, no_zero_point) ? 1 : 0;
        }
        // S of row t + 1 (t - 1 for the last row): logit x S_neighbour / S_t, minus the
        // zero-point term's share for int4, which a wrong S does not touch.
        auto neighbour_scale = [&](size_t i, size_t q_row, int h, int t, double x) {
          const int kv_len = c.seqs[i].kv_len;
          const int u = t + 1 < kv_len ? t + 1 : t - 1;
          if (u < 0) return 0.0;
          const auto& row = problem.k_row_codes(i, t, h / c.ratio);
          const double scaled = x - row.zero * problem.prepared_q(q_row, h).sum;
          return scaled * (problem.k_row_codes(i, u, h / c.ratio).scale / row.scale - 1.0);
        };
        neighbour_rejected += problem.int_q_check_rejects(tol, neighbour_scale) ? 1 : 0;
        if (k == KvDtype::kInt8PerTokenHead) {
          auto offset_kept = [&](size_t i, size_t q_row, int h, int t, double) {
            const test::PreparedQ p = problem.prepared_q(q_row, h);
            double qq_sum = 0.0;
            for (int v : quantize(p)) qq_sum += v;
            return 128.0 * p.scale * problem.k_row_codes(i, t, h / c.ratio).scale * qq_sum;
          };
          offset_rejected += problem.int_q_check_rejects(tol, offset_kept) ? 1 : 0;
        }
      }
      const std::string where = c.describe() + ", seeds" + seeds;
      if (k == KvDtype::kInt4PerTokenHead) {
        EXPECT_GE(no_zero_point_rejected, 2) << "dropped zero point, " << where;
      }
      EXPECT_GE(neighbour_rejected, 2) << "neighbour's scale, " << where;
      if (k == KvDtype::kInt8PerTokenHead) {
        EXPECT_GE(offset_rejected, 2) << "offset kept, " << where;
      }
    }
}

// All-zero queries give logits of exactly 0, so the fp32 kernel's outputs bit for bit; a work
// item with a non-finite query element runs the fp32 path, so its other query's output (the
// first sequence's first token has one work item per kv head: query heads 0 and 1 of kv head
// 0) is the fp32 kernel's bit for bit too, and the poisoned query's NaN where that has NaN.
TEST(CpuIntDot, ZeroOrNonFiniteQueriesMatchFp32) {
  const std::vector<Variant> vs = variants();
  if (vs.empty()) GTEST_SKIP() << "this CPU runs no integer Q·K (no AVX2)";
  const unsigned seed = test::fresh_seed();
  int index = 0;
  for (const Variant& var : vs)
    for (KvDtype k : {KvDtype::kInt8PerTokenHead, KvDtype::kInt4PerTokenHead})
      for (float poison : {0.0f, std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::infinity()}) {
        const AttnCase c = grid_case(k, 64, 2, false, 0);
        const unsigned case_seed = seed + static_cast<unsigned>(++index);
        AttnProblem problem(c, case_seed);
        std::vector<float> q = problem.queries();
        // Zero: every query. NaN / inf: element 5 of the first query row only, so the other
        // rows of its item must still come out (finite, and equal to fp32's).
        for (size_t e = 0; e < q.size(); ++e)
          if (poison == 0.0f || e == 5) q[e] = poison;
        problem.set_queries(q);
        cpu_attn::run_tiled(problem.spec(), problem.args(), var.isa, KDot::kFloat);
        const std::vector<float> want = problem.out();
        cpu_attn::run_tiled(problem.spec(), problem.args(), var.isa, var.k_dot);
        const std::vector<float>& got = problem.out();
        ASSERT_EQ(got.size(), want.size());
        // Zero: every output; NaN / inf: the poisoned query's work item (its output rows come
        // first), the second row finite.
        const size_t checked =
            poison == 0.0f ? got.size() : static_cast<size_t>(c.ratio) * c.head_dim_v;
        ASSERT_TRUE(poison == 0.0f || std::isfinite(want[checked - 1]))
            << var.name() << ", seed " << case_seed;
        // Only the poisoned query's rows may be NaN: most of the outputs are finite numbers.
        ASSERT_GT(static_cast<size_t>(std::count_if(want.begin(), want.end(),
                                                    [](float x) { return std::isfinite(x); })),
                  want.size() / 2)
            << var.name() << ", seed " << case_seed;
        for (size_t e = 0; e < checked; ++e)
          ASSERT_TRUE(std::memcmp(&got[e], &want[e], sizeof(float)) == 0 ||
                      (std::isnan(got[e]) && std::isnan(want[e])))
              << var.name() << " query element " << poison << ", output " << e << ": got " << got[e]
              << ", want " << want[e] << "; " << c.describe() << ", seed " << case_seed;
      }
}

}  // namespace
}  // namespace kvq
