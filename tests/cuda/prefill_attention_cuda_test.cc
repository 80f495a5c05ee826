// CUDA prefill (the "cuda" backend with q_len > 1, and run_prefill with device tables) against
// the cpu_reference backend (float64 softmax over the same cached bytes): every supported
// (K, V) pair x head_dim 64 / 128 / 256 x causal / sliding window / non-causal, ragged batches
// (pure prefill q_len == kv_len, chunked q_len < kv_len, single queries), GQA ratios 1, 4, 8,
// soft-cap on / off, block 16 / 32, fresh random and outlier-heavy inputs; outputs poisoned
// with NaN before each run, every element checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention/cuda/cuda_generic.h"
#include "attention/cuda/cuda_prefill.h"
#include "attention/cuda/kv_pairs.h"
#include "cuda_attention_harness.h"
#include "kvq/attention/backend.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"

namespace kvq {
namespace {

using test::CudaAttnCase;
using test::CudaAttnProblem;
using test::DeviceBuffer;
using test::pair_name;
using test::spec_for;
using test::supported_pairs;

// Error allowed per element, relative to the largest |V| of the (sequence, kv head): the
// decode test's bounds (the same operand types and fp32 accumulation), by the coarser side,
// plus a term for large logits (see prefill_tolerance()).
bool bf16_k(KvDtype d) {
  return d == KvDtype::kBFloat16 || d == KvDtype::kFloat32;
}

double tolerance(KvDtype k, KvDtype v) {
  auto one = [](KvDtype d) {
    double tol = (d == KvDtype::kBFloat16 || d == KvDtype::kFloat32) ? 3e-2 : 5e-3;
    if (traits(d).rotated) tol *= 2.5;
    return tol;
  };
  return std::max(one(k), one(v));
}

// Q (and a float32 K) are rounded to 16-bit MMA operands, so a logit carries an error of
// about u * |logit terms|: with outlier-heavy K and Q, logits reach hundreds and that
// error moves the softmax weights. Allowed: 2 u scale |q| max|k| / sqrt(head_dim) more
// (|q| |k| bounds the logit terms; rounding errors add up like sqrt(head_dim) terms).
test::Tolerance prefill_tolerance(const CudaAttnCase& c) {
  double u = bf16_k(c.k_dtype) ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  if (c.k_dtype == KvDtype::kFloat32) u *= 2.0;
  return {tolerance(c.k_dtype, c.v_dtype), 2.0 * u, std::sqrt(double(c.head_dim_k))};
}

// run_prefill directly, every table on the device, on a stream (split-KV by `options`).
std::vector<float> run_device_api(const CudaAttnProblem& p, float soft_cap,
                                  const cuda::PrefillOptions& options = {},
                                  int* num_splits = nullptr) {
  test::DeviceBatch dev(p);
  const cuda::PrefillPlan plan = cuda::plan_prefill(p.spec(), p.q_indptr(), p.seq_lens(), options);
  if (num_splits != nullptr) *num_splits = plan.num_splits;
  EXPECT_LE(plan.workspace_bytes, cuda::kPrefillSplitWorkspaceBytes);
  EXPECT_LE(plan.staging_bytes, options.staging_capacity);
  DeviceBuffer<std::byte> ws(plan.workspace_bytes);
  DeviceBuffer<std::byte> staging(plan.staging_bytes);
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  dev.out.poison();
  cuda::PrefillArgs a;
  a.q = dev.q.get();
  a.out = dev.out.get();
  a.q_indptr = dev.q_indptr.get();
  a.block_table = dev.device_table();
  a.cache = dev.cache.layer_view(0);
  a.softmax_scale = p.softmax_scale();
  a.logit_soft_cap = soft_cap;
  a.workspace = ws.get();
  a.staging = staging.get();
  cuda::run_prefill(p.spec(), plan, a, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  return dev.out.download();
}

// A ragged batch: a pure prefill, a chunk after a cached prefix, a single query, a short pure
// prefill and a second chunk.
void ragged_batch(CudaAttnCase& c, std::mt19937& rng) {
  test::ragged_batch(c, rng,
                     {.pure_lo = 100,
                      .pure_hi = 300,
                      .chunk_hi = 64,
                      .prefix_hi = 400,
                      .chunk2_lo = 65,
                      .chunk2_hi = 160,
                      .prefix2_hi = 200});
}

class CudaPrefillGrid : public ::testing::TestWithParam<std::pair<KvDtype, KvDtype>> {};

TEST_P(CudaPrefillGrid, MatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const auto [kd, vd] = GetParam();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  const int ratios[] = {1, 4, 8};
  double worst = 0.0;
  int index = 0;
  for (int hd : {64, 128, 256}) {
    for (int rep = 0; rep < 2; ++rep, ++index) {
      CudaAttnCase c;
      c.k_dtype = kd;
      c.v_dtype = vd;
      c.set_head_dim(hd);
      c.block_tokens = rep == 0 ? 16 : 32;
      c.ratio = ratios[(index + static_cast<int>(seed % 3)) % 3];
      c.num_kv_heads = c.ratio == 1 ? 2 : 1;
      c.kind = kinds[index % 3];
      c.window = std::uniform_int_distribution<int>(8, 200)(rng);
      c.soft_cap = index % 2 == 1 ? 5.0f : 0.0f;
      c.outliers = (index / 2) % 2 == 1;
      ragged_batch(c, rng);
      const unsigned case_seed = seed + static_cast<unsigned>(index) + 1;
      const CudaAttnProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      const std::vector<float> got = index % 3 == 2 ? run_device_api(problem, c.soft_cap)
                                                    : test::run_cuda_backend(problem, c.soft_cap);
      EXPECT_TRUE(problem.check(got, want, prefill_tolerance(c)))
          << c.describe() << ", seed " << seed << " (case seed " << case_seed << ")";
      worst = std::max(worst, problem.worst());
    }
  }
  std::printf("  %s: largest |error| / allowed error over the grid %.2f (base tolerance %.1e)\n",
              pair_name(GetParam()).c_str(), worst, tolerance(kd, vd));
}

INSTANTIATE_TEST_SUITE_P(EveryPair, CudaPrefillGrid, ::testing::ValuesIn(supported_pairs()),
                         [](const ::testing::TestParamInfo<std::pair<KvDtype, KvDtype>>& p) {
                           return pair_name(p.param);
                         });

// Split-KV, the speculative verification shape: many sequences of 1-17 queries at the end of
// contexts up to 1500 tokens, planned as a graph plan is (for longer sequences than these),
// every pair x head_dim x mask kind; some splits of a block see nothing (short sequences).
TEST(CudaPrefill, SplitKvForSmallQueryBatchesMatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  const int ratios[] = {1, 4, 8};
  cuda::PrefillOptions o;
  o.num_sms = 132;
  o.max_kv_len = 2048;
  int index = 0;
  double worst = 0.0;
  for (const auto& [kd, vd] : supported_pairs()) {
    for (int hd : {64, 128, 256}) {
      CudaAttnCase c;
      c.k_dtype = kd;
      c.v_dtype = vd;
      c.set_head_dim(hd);
      c.block_tokens = index % 2 == 0 ? 16 : 32;
      c.ratio = ratios[index % 3];
      c.num_kv_heads = c.ratio == 1 ? 2 : 1;
      c.kind = kinds[(index / 3) % 3];
      c.window = std::uniform_int_distribution<int>(8, 300)(rng);
      c.soft_cap = index % 4 == 1 ? 5.0f : 0.0f;
      c.outliers = index % 5 == 2;
      c.q_lens.clear();
      c.kv_lens.clear();
      const int n = 1 + index % 6;
      for (int i = 0; i < n; ++i) {
        const int q = std::uniform_int_distribution<int>(1, 17)(rng);
        c.q_lens.push_back(q);
        c.kv_lens.push_back(std::uniform_int_distribution<int>(q, i == 0 ? 1500 : 400)(rng));
      }
      const unsigned case_seed = seed + static_cast<unsigned>(index++) + 1;
      const CudaAttnProblem problem(c, case_seed);
      int splits = 0;
      const std::vector<float> got = run_device_api(problem, c.soft_cap, o, &splits);
      EXPECT_GT(splits, 1) << c.describe();
      EXPECT_TRUE(problem.check(got, problem.reference(), prefill_tolerance(c)))
          << c.describe() << ", " << splits << " splits, seed " << seed << " (case seed "
          << case_seed << ")";
      worst = std::max(worst, problem.worst());
    }
  }
  std::printf("  split-KV: largest |error| / allowed error %.2f over %d cases\n", worst, index);
}

// The small-q block shape (prefill_small_q_rows: one 16-row MMA tile per warp) that the plan
// picks when every sequence's rows (q_len x GQA group) fit one such block, against the default
// shape on the same problem and both against cpu_reference: every pair x head_dim 64 / 128 x
// mask kind, with and without split-KV.
TEST(CudaPrefill, SmallQueryBlockShapeMatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  int index = 0;
  for (const auto& [kd, vd] : supported_pairs()) {
    for (int hd : {64, 128}) {
      CudaAttnCase c;
      c.k_dtype = kd;
      c.v_dtype = vd;
      c.set_head_dim(hd);
      c.block_tokens = index % 2 == 0 ? 16 : 32;
      c.ratio = index % 2 == 0 ? 4 : 2;
      c.num_kv_heads = 2;
      c.kind = kinds[index % 3];
      c.window = std::uniform_int_distribution<int>(8, 300)(rng);
      c.soft_cap = index % 4 == 1 ? 5.0f : 0.0f;
      c.outliers = index % 5 == 2;
      c.q_lens.clear();
      c.kv_lens.clear();
      const int n = 1 + index % 5;
      const int max_q = cuda::prefill_small_q_rows(hd) / c.ratio;
      for (int i = 0; i < n; ++i) {
        // One sequence fills the block exactly; the others are shorter.
        const int q = i == 0 ? max_q : std::uniform_int_distribution<int>(1, max_q)(rng);
        c.q_lens.push_back(q);
        c.kv_lens.push_back(std::uniform_int_distribution<int>(q, i == 0 ? 900 : 300)(rng));
      }
      const unsigned case_seed = seed + static_cast<unsigned>(index++) + 1;
      const CudaAttnProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      for (int split = 0; split < 2; ++split) {
        for (bool small : {true, false}) {
          cuda::PrefillOptions o;
          o.small_q = small;
          // The small-q block is the mma.sync kernel's; where the wgmma kernel is built it
          // takes these batches unless the mma.sync kernel is asked for.
          if (small) o.kernel = cuda::PrefillOptions::Kernel::kMma;
          if (split == 1) {
            o.num_sms = 132;
            o.max_kv_len = 2048;
          }
          const cuda::PrefillPlan plan =
              cuda::plan_prefill(problem.spec(), problem.q_indptr(), problem.seq_lens(), o);
          EXPECT_EQ(plan.rows_per_block,
                    small ? cuda::prefill_small_q_rows(hd) : cuda::prefill_rows_per_block(hd));
          EXPECT_EQ(plan.max_q_tiles, 1);
          EXPECT_TRUE(
              problem.check(run_device_api(problem, c.soft_cap, o), want, prefill_tolerance(c)))
              << c.describe() << (small ? ", small-q" : ", default") << " block"
              << (split ? ", split-KV" : "") << ", seed " << seed << " (case seed " << case_seed
              << ")";
        }
      }
    }
  }
}

// Long sequences: thousands of kv tiles skipped / masked per block, a sliding window that
// starts inside a tile, GQA ratio 12 (row tiles that split a token's heads).
TEST(CudaPrefill, LongSequencesAndOddGroups) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  const std::pair<KvDtype, KvDtype> pairs[] = {
      {KvDtype::kFp8E4M3, KvDtype::kFp8E4M3},
      {KvDtype::kInt4PerTokenHead, KvDtype::kInt4PerTokenHead}};
  int index = 0;
  for (const auto& [kd, vd] : pairs) {
    for (AttentionKind kind : {AttentionKind::kCausal, AttentionKind::kSlidingWindow}) {
      CudaAttnCase c;
      c.k_dtype = kd;
      c.v_dtype = vd;
      c.set_head_dim(128);
      c.ratio = index % 2 == 0 ? 12 : 3;
      c.num_kv_heads = 1;
      c.kind = kind;
      c.window = 333;
      c.q_lens = {700, 250};
      c.kv_lens = {1500, 250};
      const CudaAttnProblem problem(c, seed + static_cast<unsigned>(index++));
      EXPECT_TRUE(problem.check(test::run_cuda_backend(problem, 0.0f), problem.reference(),
                                prefill_tolerance(c)))
          << c.describe() << ", seed " << seed;
    }
  }
}

// Case c (fresh data from case_seed) on `kernel` (kWgmma or kVerify; the plan must take it),
// unsplit and split over the kv range (planned for sequences of max_kv_len), against
// cpu_reference; `must_split`: the second run splits. Counts the runs and keeps the largest
// error ratio.
void check_kernel(const CudaAttnCase& c, cuda::PrefillOptions::Kernel kernel, unsigned seed,
                  unsigned case_seed, bool must_split, int max_kv_len, double& worst, int& cases) {
  const bool wgmma = kernel == cuda::PrefillOptions::Kernel::kWgmma;
  const char* name = wgmma ? "wgmma" : "verify";
  const CudaAttnProblem problem(c, case_seed);
  const std::vector<float> want = problem.reference();
  for (int split = 0; split < 2; ++split) {
    cuda::PrefillOptions o;
    o.kernel = kernel;
    if (split == 1) {
      o.num_sms = 132;
      o.max_kv_len = max_kv_len;
    }
    const cuda::PrefillPlan plan =
        cuda::plan_prefill(problem.spec(), problem.q_indptr(), problem.seq_lens(), o);
    EXPECT_STREQ(plan.kernel_name(), name) << plan.kernel_reason;
    int splits = 0;
    EXPECT_TRUE(
        problem.check(run_device_api(problem, c.soft_cap, o, &splits), want, prefill_tolerance(c)))
        << c.describe() << ", " << name << ", " << splits << " splits, seed " << seed
        << " (case seed " << case_seed << ")";
    if (split == 1 && must_split) {
      EXPECT_GT(splits, 1) << c.describe();
    }
    worst = std::max(worst, problem.worst());
    ++cases;
  }
}
void check_wgmma(const CudaAttnCase& c, unsigned seed, unsigned case_seed, bool must_split,
                 double& worst, int& cases) {
  check_kernel(c, cuda::PrefillOptions::Kernel::kWgmma, seed, case_seed, must_split, 2048, worst,
               cases);
}

// The warpgroup-MMA kernel (PrefillOptions::Kernel::kWgmma) on every pair and head dim it is
// built for x mask kind x GQA ratio, soft-cap on / off, with and without split-KV, on sequences
// long enough for many kv tiles and several row blocks (a pure prefill, chunks after cached
// prefixes, a single query, a row block of one token's heads only), against cpu_reference.
TEST(CudaPrefillWgmma, MatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  const int ratios[] = {1, 4, 8, 3};
  int index = 0, cases = 0;
  double worst = 0.0;
  for (const auto& [kd, vd] : supported_pairs()) {
    for (int hd : {64, 128}) {
      if (!cuda::prefill_wgmma_pair(kd, vd, hd)) continue;
      for (int rep = 0; rep < 3; ++rep, ++index) {
        CudaAttnCase c;
        c.k_dtype = kd;
        c.v_dtype = vd;
        c.set_head_dim(hd);
        c.block_tokens = index % 2 == 0 ? 16 : 32;
        c.ratio = ratios[(index + static_cast<int>(seed % 4)) % 4];
        c.num_kv_heads = c.ratio == 1 ? 2 : 1;
        c.kind = kinds[rep];
        c.window = std::uniform_int_distribution<int>(8, 300)(rng);
        c.soft_cap = index % 2 == 1 ? 5.0f : 0.0f;
        c.outliers = index % 3 == 2;
        const int pure = std::uniform_int_distribution<int>(300, 700)(rng);
        const int chunk = std::uniform_int_distribution<int>(65, 200)(rng);
        c.q_lens = {pure, chunk, 1, 33};
        c.kv_lens = {pure, chunk + std::uniform_int_distribution<int>(1, 900)(rng), 77,
                     33 + std::uniform_int_distribution<int>(0, 150)(rng)};
        check_wgmma(c, seed, seed + static_cast<unsigned>(index) + 1, true, worst, cases);
      }
    }
  }
  EXPECT_GT(cases, 0);
  std::printf("  wgmma: largest |error| / allowed error %.2f over %d runs\n", worst, cases);
}

// The verification shape on the wgmma kernel, which the plan now gives it: each sequence's
// rows (8 query tokens x a GQA group of 2, 4 or 8) within one consumer's 64, the other idle;
// odd and even tile counts, a one-tile sequence, narrow sliding windows, soft-cap, with and
// without split-KV, against cpu_reference.
TEST(CudaPrefillWgmma, VerificationShapeMatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  int index = 0, cases = 0;
  double worst = 0.0;
  for (const auto& [kd, vd] : supported_pairs()) {
    for (int hd : {64, 128}) {
      if (!cuda::prefill_wgmma_pair(kd, vd, hd)) continue;
      for (int rep = 0; rep < 3; ++rep, ++index) {
        CudaAttnCase c;
        c.k_dtype = kd;
        c.v_dtype = vd;
        c.set_head_dim(hd);
        c.block_tokens = index % 2 == 0 ? 16 : 32;
        const int ratios[] = {8, 4, 2};
        c.ratio = ratios[(index + static_cast<int>(seed % 3)) % 3];
        c.num_kv_heads = 8 / c.ratio;
        c.kind = kinds[rep];
        c.window = std::uniform_int_distribution<int>(3, 90)(rng);
        c.soft_cap = index % 2 == 1 ? 5.0f : 0.0f;
        c.outliers = index % 4 == 3;
        std::uniform_int_distribution<int> len(65, 1400);
        c.q_lens = {8, 8, 8, 8, 8, 8};
        c.kv_lens = {len(rng),
                     len(rng),
                     64 * std::uniform_int_distribution<int>(2, 9)(rng) + 1,
                     std::uniform_int_distribution<int>(8, 64)(rng),
                     64 * 3,
                     len(rng)};
        check_wgmma(c, seed, seed + static_cast<unsigned>(index) + 1, false, worst, cases);
      }
    }
  }
  EXPECT_GT(cases, 0);
  std::printf("  wgmma verification rows: largest |error| / allowed error %.2f over %d runs\n",
              worst, cases);
}

// The verification kernel (tokens as MMA rows, a sequence's <= 32 query rows as its columns) on
// every pair and head dim it is built for: 1-32 query tokens x GQA 8 / 4 / 2 / 1 (ragged within
// a batch, some blocks with unused columns), sequences of one slice to 1500 tokens (edge slices
// at both ends of sliding windows), every mask, narrow windows, soft-cap, outliers, with and
// without split-KV, against cpu_reference.
TEST(CudaPrefillVerify, MatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  int index = 0, cases = 0;
  double worst = 0.0;
  for (const auto& [kd, vd] : supported_pairs()) {
    for (int hd : {64, 128}) {
      if (!cuda::prefill_verify_pair(kd, vd, hd)) continue;
      for (int rep = 0; rep < 3; ++rep, ++index) {
        CudaAttnCase c;
        c.k_dtype = kd;
        c.v_dtype = vd;
        c.set_head_dim(hd);
        c.block_tokens = index % 2 == 0 ? 16 : 32;
        const int ratios[] = {8, 4, 2, 1};
        c.ratio = ratios[(index + static_cast<int>(seed % 4)) % 4];
        c.num_kv_heads = c.ratio == 1 ? 3 : 8 / c.ratio;
        c.kind = kinds[rep];
        c.window = std::uniform_int_distribution<int>(3, 90)(rng);
        c.soft_cap = index % 2 == 1 ? 5.0f : 0.0f;
        c.outliers = index % 4 == 3;
        const int max_q = 32 / c.ratio;
        std::uniform_int_distribution<int> ql(1, max_q), len(65, 1500);
        c.q_lens = {max_q, ql(rng), 1, max_q, ql(rng), max_q};
        c.kv_lens = {len(rng),
                     len(rng),
                     64 * std::uniform_int_distribution<int>(2, 9)(rng) + 1,
                     std::uniform_int_distribution<int>(max_q, 64)(rng),
                     64 * 3,
                     len(rng)};
        for (size_t i = 0; i < c.q_lens.size(); ++i)
          c.kv_lens[i] = std::max(c.kv_lens[i], c.q_lens[i]);
        check_kernel(c, cuda::PrefillOptions::Kernel::kVerify, seed,
                     seed + static_cast<unsigned>(index) + 1, true, 4096, worst, cases);
      }
    }
  }
  EXPECT_GT(cases, 0);
  std::printf("  verify kernel: largest |error| / allowed error %.2f over %d runs\n", worst, cases);
}

// Small shapes of the verification kernel for compute-sanitizer memcheck / racecheck: each
// warp's ring reused, edge slices, the merge, split-KV with empty splits.
TEST(CudaPrefillVerify, SmallForSanitizers) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  struct Pair {
    KvDtype k, v;
    int head_dim;
  };
  // The 4-bit pairs (codes as 16-bit units, nvfp4's rows not a multiple of 16 bytes) at both
  // head dims.
  const Pair pairs[] = {{KvDtype::kBFloat16, KvDtype::kBFloat16, 64},
                        {KvDtype::kFp8E4M3, KvDtype::kFp8E4M3, 128},
                        {KvDtype::kInt8PerTokenHead, KvDtype::kBFloat16, 64},
                        {KvDtype::kFp8PerTokenHead, KvDtype::kFp8PerTokenHead, 128},
                        {KvDtype::kInt4PerTokenHead, KvDtype::kInt4PerTokenHead, 64},
                        {KvDtype::kFp8E4M3, KvDtype::kInt4PerTokenHead, 128},
                        {KvDtype::kInt4PerTokenHead, KvDtype::kInt4PerTokenHead, 128},
                        {KvDtype::kNvfp4, KvDtype::kNvfp4, 64},
                        {KvDtype::kNvfp4, KvDtype::kNvfp4, 128}};
  int index = 0;
  for (const Pair& p : pairs) {
    CudaAttnCase c;
    c.k_dtype = p.k;
    c.v_dtype = p.v;
    c.set_head_dim(p.head_dim);
    c.ratio = 4;
    c.kind = index == 1 ? AttentionKind::kSlidingWindow : AttentionKind::kCausal;
    c.window = 40;
    c.q_lens = {8, 3};
    c.kv_lens = {390, 20};  // 7 tiles: every warp's ring reused
    const CudaAttnProblem problem(c, seed + static_cast<unsigned>(index++));
    for (int split = 0; split < 2; ++split) {
      cuda::PrefillOptions o;
      o.kernel = cuda::PrefillOptions::Kernel::kVerify;
      if (split == 1) {
        o.num_sms = 132;
        o.max_kv_len = 2048;
      }
      EXPECT_TRUE(problem.check(run_device_api(problem, 0.0f, o), problem.reference(),
                                prefill_tolerance(c)))
          << c.describe() << (split ? ", split" : "") << ", seed " << seed;
    }
  }
}

// Which kernel a plan takes, and why (no device needed): wgmma for the pairs and head dims it
// is built for, the mma.sync kernel for the rest, when asked, and for small-q batches.
TEST(CudaPrefillWgmma, PlanChoosesTheKernelWithAReason) {
  CudaAttnCase c;
  c.k_dtype = c.v_dtype = KvDtype::kBFloat16;
  const std::vector<int32_t> q_indptr = {0, 300}, seq_lens = {300};
  const std::vector<int32_t> small_q = {0, 8}, small_len = {1000};
  const LayerKvSpec bf16 = spec_for(c);
  const cuda::PrefillPlan auto_plan = cuda::plan_prefill(bf16, q_indptr, seq_lens);
  EXPECT_TRUE(auto_plan.wgmma);
  EXPECT_STREQ(auto_plan.kernel_name(), "wgmma");
  EXPECT_EQ(auto_plan.rows_per_block, cuda::prefill_rows_per_block(128));
  cuda::PrefillOptions mma;
  mma.kernel = cuda::PrefillOptions::Kernel::kMma;
  const cuda::PrefillPlan mma_plan = cuda::plan_prefill(bf16, q_indptr, seq_lens, mma);
  EXPECT_FALSE(mma_plan.wgmma);
  EXPECT_NE(mma_plan.kernel_reason.find("asked"), std::string::npos) << mma_plan.kernel_reason;
  // A small-q batch (8 queries x 4 heads = 32 rows): the verification kernel where it is built
  // and a side is 8-bit or int4, the wgmma kernel for 16-bit caches, when asked, or past 32 rows
  // (where it is built), the small-q block of the mma.sync kernel when that is asked for or for
  // fp32 caches.
  const cuda::PrefillPlan small = cuda::plan_prefill(bf16, small_q, small_len);
  EXPECT_TRUE(small.wgmma);
  EXPECT_NE(small.kernel_reason.find("small-q"), std::string::npos) << small.kernel_reason;
  EXPECT_STREQ(cuda::plan_prefill(bf16, small_q, small_len, mma).kernel_name(), "mma small-q");
  {
    CudaAttnCase f8 = c;
    f8.k_dtype = f8.v_dtype = KvDtype::kFp8E4M3;
    const cuda::PrefillPlan vp = cuda::plan_prefill(spec_for(f8), small_q, small_len);
    EXPECT_STREQ(vp.kernel_name(), "verify") << vp.kernel_reason;
    EXPECT_EQ(vp.rows_per_block, cuda::prefill_verify_rows());
    EXPECT_NE(vp.kernel_reason.find("verification kernel"), std::string::npos) << vp.kernel_reason;
    const std::vector<int32_t> q9 = {0, 9};  // 36 rows
    const cuda::PrefillPlan p9 = cuda::plan_prefill(spec_for(f8), q9, small_len);
    EXPECT_TRUE(p9.wgmma);
    EXPECT_NE(p9.kernel_reason.find("small-q"), std::string::npos) << p9.kernel_reason;
    CudaAttnCase i8 = c;
    i8.k_dtype = i8.v_dtype = KvDtype::kInt8PerTokenHead;
    EXPECT_STREQ(cuda::plan_prefill(spec_for(i8), small_q, small_len).kernel_name(), "verify");
    EXPECT_STREQ(cuda::plan_prefill(spec_for(i8), q9, small_len).kernel_name(), "mma small-q");
    CudaAttnCase i4 = c;
    i4.k_dtype = i4.v_dtype = KvDtype::kInt4PerTokenHead;
    EXPECT_STREQ(cuda::plan_prefill(spec_for(i4), small_q, small_len).kernel_name(), "verify");
    CudaAttnCase f4 = c;
    f4.k_dtype = f4.v_dtype = KvDtype::kNvfp4;
    EXPECT_STREQ(cuda::plan_prefill(spec_for(f4), small_q, small_len).kernel_name(), "verify");
    cuda::PrefillOptions verify;
    verify.kernel = cuda::PrefillOptions::Kernel::kVerify;
    EXPECT_STREQ(cuda::plan_prefill(spec_for(f4), small_q, small_len, verify).kernel_name(),
                 "verify");
    CudaAttnCase f32 = c;
    f32.k_dtype = f32.v_dtype = KvDtype::kFloat32;
    EXPECT_STREQ(cuda::plan_prefill(spec_for(f32), small_q, small_len, verify).kernel_name(),
                 "mma small-q");
    EXPECT_STREQ(cuda::plan_prefill(spec_for(i8), small_q, small_len, verify).kernel_name(),
                 "verify");
    EXPECT_STREQ(cuda::plan_prefill(bf16, small_q, small_len, verify).kernel_name(), "verify");
  }
  cuda::PrefillOptions force;
  force.kernel = cuda::PrefillOptions::Kernel::kWgmma;
  EXPECT_TRUE(cuda::plan_prefill(bf16, small_q, small_len, force).wgmma);
  for (KvDtype d : {KvDtype::kInt4PerTokenHead, KvDtype::kInt8PerTokenHead, KvDtype::kFloat32}) {
    c.k_dtype = c.v_dtype = d;
    const cuda::PrefillPlan plan = cuda::plan_prefill(spec_for(c), q_indptr, seq_lens, force);
    EXPECT_FALSE(plan.wgmma) << to_string(d);
    EXPECT_NE(plan.kernel_reason.find("not built"), std::string::npos) << plan.kernel_reason;
  }
  c.k_dtype = c.v_dtype = KvDtype::kFp8E4M3;
  c.set_head_dim(256);
  EXPECT_FALSE(cuda::plan_prefill(spec_for(c), q_indptr, seq_lens, force).wgmma);
  c.set_head_dim(64);
  EXPECT_TRUE(cuda::plan_prefill(spec_for(c), q_indptr, seq_lens).wgmma);
}

// Staging (PrefillPlan::staged_blocks): a per-tensor fp8 cache expanded to fp16 and read as a
// float16 cache gives the very bits of the kernel that converts the codes in its producer (the
// same fp16 operands, scales and order of operations), on ragged batches whose tables are
// shuffled, every mask, GQA ratios, both head dims, with and without split-KV; and cpu_reference
// agrees with it.
TEST(CudaPrefillStaging, StagedFp8CachesGiveTheBitsOfTheConvertingKernel) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  int index = 0;
  for (KvDtype d : {KvDtype::kFp8E4M3, KvDtype::kFp8E5M2}) {
    for (int hd : {64, 128}) {
      for (int rep = 0; rep < 3; ++rep, ++index) {
        CudaAttnCase c;
        c.k_dtype = c.v_dtype = d;
        c.set_head_dim(hd);
        c.block_tokens = index % 2 == 0 ? 16 : 32;
        c.ratio = (index + static_cast<int>(seed % 3)) % 3 == 0 ? 1 : 4;
        c.num_kv_heads = c.ratio == 1 ? 3 : 2;
        c.kind = kinds[rep];
        c.window = std::uniform_int_distribution<int>(8, 300)(rng);
        c.soft_cap = index % 2 == 1 ? 5.0f : 0.0f;
        c.outliers = index % 3 == 2;
        const int pure = std::uniform_int_distribution<int>(200, 600)(rng);
        const int chunk = std::uniform_int_distribution<int>(65, 200)(rng);
        c.q_lens = {pure, 1, chunk, 17};
        c.kv_lens = {pure, 90, chunk + std::uniform_int_distribution<int>(1, 700)(rng),
                     17 + std::uniform_int_distribution<int>(0, 40)(rng)};
        const unsigned case_seed = seed + static_cast<unsigned>(index) + 1;
        const CudaAttnProblem problem(c, case_seed);
        const std::vector<float> want = problem.reference();
        for (int split = 0; split < 2; ++split) {
          cuda::PrefillOptions o;
          o.kernel = cuda::PrefillOptions::Kernel::kWgmma;
          if (split == 1) o.num_sms = 132;
          o.staging = cuda::PrefillOptions::Staging::kOff;
          const std::vector<float> converted = run_device_api(problem, c.soft_cap, o);
          o.staging = cuda::PrefillOptions::Staging::kForce;
          o.staging_capacity = size_t{1} << 30;
          const cuda::PrefillPlan plan =
              cuda::plan_prefill(problem.spec(), problem.q_indptr(), problem.seq_lens(), o);
          EXPECT_GT(plan.staged_blocks, 0) << plan.staging_reason;
          const std::vector<float> staged = run_device_api(problem, c.soft_cap, o);
          ASSERT_EQ(staged.size(), converted.size());
          size_t differ = 0;
          for (size_t i = 0; i < staged.size(); ++i)
            differ += std::memcmp(&staged[i], &converted[i], sizeof(float)) != 0;
          EXPECT_EQ(differ, 0u) << c.describe() << (split ? ", split" : "") << ", seed " << seed;
          EXPECT_TRUE(problem.check(staged, want, prefill_tolerance(c)))
              << c.describe() << ", staged" << (split ? ", split" : "") << ", seed " << seed;
        }
      }
    }
  }
}

// Where a plan stages (no device needed): long prefills and chunks over a long context of a
// per-tensor fp8 cache with a buffer that holds them; not verification-sized steps (each kv tile
// is converted about once either way), not without a buffer or with one too small, not other
// dtypes, not plans for later steps; kForce and kOff as asked; the bytes the plan takes.
TEST(CudaPrefillStaging, PlanStagesWhereConversionsRepeat) {
  CudaAttnCase c;
  c.k_dtype = c.v_dtype = KvDtype::kFp8E4M3;
  c.num_kv_heads = 8;
  c.ratio = 4;
  const LayerKvSpec fp8 = spec_for(c);
  cuda::PrefillOptions o;
  o.staging_capacity = size_t{1} << 30;
  o.staging = cuda::PrefillOptions::Staging::kAuto;
  const std::vector<int32_t> pure_q = {0, 8192}, pure_len = {8192};
  const cuda::PrefillPlan pure = cuda::plan_prefill(fp8, pure_q, pure_len, o);
  EXPECT_EQ(pure.staged_blocks, 8192 / c.block_tokens) << pure.staging_reason;
  EXPECT_EQ(pure.staging_bytes, cuda::prefill_staging_bytes(fp8, pure.staged_blocks, 1));
  // fp16 K and V blocks: at least 2 x 2 bytes per cached value.
  EXPECT_GE(pure.staging_bytes, size_t{8192} * 8 * 128 * 4);
  // A 1k prefill converts each tile about 17 times: fewer than the staging's fixed cost repays.
  const std::vector<int32_t> short_q = {0, 1024}, short_len = {1024};
  const cuda::PrefillPlan short_plan = cuda::plan_prefill(fp8, short_q, short_len, o);
  EXPECT_EQ(short_plan.staged_blocks, 0) << short_plan.staging_reason;
  EXPECT_GT(cuda::plan_prefill(fp8, std::vector<int32_t>{0, 4096}, std::vector<int32_t>{4096}, o)
                .staged_blocks,
            0);
  const std::vector<int32_t> chunk_q = {0, 2048}, chunk_len = {8192};
  EXPECT_GT(cuda::plan_prefill(fp8, chunk_q, chunk_len, o).staged_blocks, 0);
  // Verification: 32 sequences x 8 queries over 4k.
  std::vector<int32_t> vq = {0}, vlen;
  for (int i = 0; i < 32; ++i) vq.push_back(vq.back() + 8), vlen.push_back(4096);
  cuda::PrefillOptions wg = o;
  wg.kernel = cuda::PrefillOptions::Kernel::kWgmma;
  const cuda::PrefillPlan verify = cuda::plan_prefill(fp8, vq, vlen, wg);
  EXPECT_EQ(verify.staged_blocks, 0);
  EXPECT_NE(verify.staging_reason.find("no gain"), std::string::npos) << verify.staging_reason;
  wg.staging = cuda::PrefillOptions::Staging::kForce;
  EXPECT_GT(cuda::plan_prefill(fp8, vq, vlen, wg).staged_blocks, 0);
  cuda::PrefillOptions off = o;
  off.staging = cuda::PrefillOptions::Staging::kOff;
  EXPECT_EQ(cuda::plan_prefill(fp8, pure_q, pure_len, off).staged_blocks, 0);
  cuda::PrefillOptions small = o;
  small.staging_capacity = pure.staging_bytes - 1;
  const cuda::PrefillPlan too_small = cuda::plan_prefill(fp8, pure_q, pure_len, small);
  EXPECT_EQ(too_small.staged_blocks, 0);
  EXPECT_NE(too_small.staging_reason.find("buffer holds"), std::string::npos)
      << too_small.staging_reason;
  EXPECT_EQ(cuda::plan_prefill(fp8, pure_q, pure_len).staged_blocks, 0);  // no buffer
  cuda::PrefillOptions later = o;
  later.max_kv_len = 8192;
  EXPECT_EQ(cuda::plan_prefill(fp8, pure_q, pure_len, later).staged_blocks, 0);
  // 16-bit caches are read as they are; the converting kernel's mixed pairs too.
  for (auto [kd, vd] : {std::pair{KvDtype::kBFloat16, KvDtype::kBFloat16},
                        std::pair{KvDtype::kBFloat16, KvDtype::kFp8E4M3}}) {
    c.k_dtype = kd;
    c.v_dtype = vd;
    const cuda::PrefillPlan plan = cuda::plan_prefill(spec_for(c), pure_q, pure_len, o);
    EXPECT_EQ(plan.staged_blocks, 0) << to_string(kd);
    EXPECT_EQ(cuda::prefill_stage_kind(spec_for(c)), cuda::PrefillStageKind::kNone);
  }
  // Pairs the wgmma kernel is not built for stage to bf16 and run it, from shorter prompts (the
  // mma.sync kernel is the alternative); not verification-sized steps, not at head_dim 256, not
  // when the mma.sync kernel is asked for.
  for (KvDtype d : {KvDtype::kInt8PerTokenHead, KvDtype::kFp8PerTokenHead,
                    KvDtype::kInt4PerTokenHead, KvDtype::kNvfp4, KvDtype::kFloat32}) {
    c.k_dtype = c.v_dtype = d;
    c.set_head_dim(128);
    const LayerKvSpec spec = spec_for(c);
    EXPECT_EQ(cuda::prefill_stage_kind(spec), cuda::PrefillStageKind::kBf16) << to_string(d);
    const cuda::PrefillPlan plan = cuda::plan_prefill(spec, short_q, short_len, o);
    EXPECT_GT(plan.staged_blocks, 0) << to_string(d) << ": " << plan.staging_reason;
    EXPECT_TRUE(plan.wgmma) << plan.kernel_reason;
    EXPECT_NE(plan.kernel_reason.find("bf16 staging"), std::string::npos) << plan.kernel_reason;
    EXPECT_FALSE(cuda::plan_prefill(spec, vq, vlen, o).wgmma) << to_string(d);
    cuda::PrefillOptions mma = o;
    mma.kernel = cuda::PrefillOptions::Kernel::kMma;
    EXPECT_FALSE(cuda::plan_prefill(spec, pure_q, pure_len, mma).wgmma) << to_string(d);
    EXPECT_FALSE(cuda::plan_prefill(spec, pure_q, pure_len).wgmma) << "no buffer";
    c.set_head_dim(256);
    EXPECT_EQ(cuda::prefill_stage_kind(spec_for(c)), cuda::PrefillStageKind::kNone);
  }
}

// The bf16 staging of the pairs the wgmma kernel is not built for (per-token-head scales, int4
// zero points and its Hadamard rotation, nvfp4 block scales, fp32, mixed pairs): every value
// dequantized and rounded to bf16, then the wgmma kernel, against cpu_reference within a bf16
// cache's bounds, on ragged batches, every mask, GQA ratios, both head dims, split-KV.
TEST(CudaPrefillStaging, Bf16StagingOfTheOtherPairsMatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  int index = 0, cases = 0;
  double worst = 0.0;
  for (const auto& [kd, vd] : supported_pairs()) {
    for (int hd : {64, 128}) {
      CudaAttnCase c;
      c.k_dtype = kd;
      c.v_dtype = vd;
      c.set_head_dim(hd);
      if (cuda::prefill_stage_kind(spec_for(c)) != cuda::PrefillStageKind::kBf16) continue;
      c.block_tokens = index % 2 == 0 ? 16 : 32;
      c.ratio = (index + static_cast<int>(seed % 3)) % 3 == 0 ? 1 : 4;
      c.num_kv_heads = c.ratio == 1 ? 2 : 1;
      c.kind = kinds[index % 3];
      c.window = std::uniform_int_distribution<int>(8, 300)(rng);
      c.soft_cap = index % 2 == 1 ? 5.0f : 0.0f;
      c.outliers = index % 4 == 3;
      const int pure = std::uniform_int_distribution<int>(150, 500)(rng);
      const int chunk = std::uniform_int_distribution<int>(65, 200)(rng);
      c.q_lens = {pure, 1, chunk};
      c.kv_lens = {pure, 70, chunk + std::uniform_int_distribution<int>(1, 500)(rng)};
      const unsigned case_seed = seed + static_cast<unsigned>(index) + 1;
      ++index;
      const CudaAttnProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      CudaAttnCase as_bf16 = c;  // the staged operands are a bf16 cache's
      as_bf16.k_dtype = as_bf16.v_dtype = KvDtype::kBFloat16;
      for (int split = 0; split < 2; ++split) {
        cuda::PrefillOptions o;
        if (split == 1) o.num_sms = 132;
        o.staging = cuda::PrefillOptions::Staging::kForce;
        o.staging_capacity = size_t{1} << 30;
        const cuda::PrefillPlan plan =
            cuda::plan_prefill(problem.spec(), problem.q_indptr(), problem.seq_lens(), o);
        EXPECT_GT(plan.staged_blocks, 0) << plan.staging_reason;
        EXPECT_TRUE(plan.wgmma) << plan.kernel_reason;
        EXPECT_TRUE(
            problem.check(run_device_api(problem, c.soft_cap, o), want, prefill_tolerance(as_bf16)))
            << c.describe() << ", bf16 staging" << (split ? ", split" : "") << ", seed " << seed
            << " (case seed " << case_seed << ")";
        worst = std::max(worst, problem.worst());
        ++cases;
      }
    }
  }
  EXPECT_GT(cases, 0);
  std::printf("  bf16 staging: largest |error| / allowed error %.2f over %d runs\n", worst, cases);
}

// Small shapes of the wgmma kernel for compute-sanitizer memcheck / racecheck: the producer's
// ring, the staged 8-bit conversion, a warpgroup with no rows, split-KV.
TEST(CudaPrefillWgmma, SmallForSanitizers) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  // The e5m2 pair is causal over 6 kv tiles: both sides staged, the ring's 4 stages and the 3
  // staging buffers each reused (kSplit).
  // The last two run only staged (bf16, the int4 rows un-rotated).
  const std::pair<KvDtype, KvDtype> pairs[] = {
      {KvDtype::kBFloat16, KvDtype::kBFloat16},
      {KvDtype::kFp8E4M3, KvDtype::kFp8E4M3},
      {KvDtype::kBFloat16, KvDtype::kFp8E4M3},
      {KvDtype::kFp8E5M2, KvDtype::kFp8E5M2},
      {KvDtype::kInt4PerTokenHead, KvDtype::kInt4PerTokenHead},
      {KvDtype::kInt8PerTokenHead, KvDtype::kInt8PerTokenHead}};
  int index = 0;
  for (const auto& [kd, vd] : pairs) {
    CudaAttnCase c;
    c.k_dtype = kd;
    c.v_dtype = vd;
    c.set_head_dim(64);
    c.ratio = 4;
    c.kind = index == 1 ? AttentionKind::kSlidingWindow : AttentionKind::kCausal;
    c.window = 40;
    c.q_lens = {40, 1};
    c.kv_lens = {330, 20};
    const CudaAttnProblem problem(c, seed + static_cast<unsigned>(index++));
    const bool bf16_staged =
        cuda::prefill_stage_kind(problem.spec()) == cuda::PrefillStageKind::kBf16;
    CudaAttnCase as_bf16 = c;
    if (bf16_staged) as_bf16.k_dtype = as_bf16.v_dtype = KvDtype::kBFloat16;
    for (int split = 0; split < 3; ++split) {
      if (bf16_staged && split < 2) continue;
      cuda::PrefillOptions o;
      o.kernel = cuda::PrefillOptions::Kernel::kWgmma;
      if (split == 1) {
        o.num_sms = 132;
        o.max_kv_len = 2048;
      }
      if (split == 2) {  // staged where the cache is per-tensor fp8
        if (!cuda::prefill_stageable(problem.spec())) continue;
        o.staging = cuda::PrefillOptions::Staging::kForce;
        o.staging_capacity = size_t{64} << 20;
      }
      EXPECT_TRUE(problem.check(run_device_api(problem, 0.0f, o), problem.reference(),
                                prefill_tolerance(as_bf16)))
          << c.describe() << (split ? ", split" : "") << ", seed " << seed;
    }
  }
}

// Small shapes for compute-sanitizer racecheck (shared-memory staging, the un-rotation
// epilogue, a mixed pair).
TEST(CudaPrefill, SmallForSanitizers) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  const std::pair<KvDtype, KvDtype> pairs[] = {
      {KvDtype::kFp8E4M3, KvDtype::kFp8E4M3},
      {KvDtype::kInt4PerTokenHead, KvDtype::kInt4PerTokenHead},
      {KvDtype::kFp8E4M3, KvDtype::kInt4PerTokenHead}};
  int index = 0;
  for (const auto& [kd, vd] : pairs) {
    CudaAttnCase c;
    c.k_dtype = kd;
    c.v_dtype = vd;
    c.set_head_dim(64);
    c.ratio = 4;
    c.kind = index == 1 ? AttentionKind::kSlidingWindow : AttentionKind::kCausal;
    c.window = 40;
    c.q_lens = {40, 1};
    c.kv_lens = {150, 20};
    const CudaAttnProblem problem(c, seed + static_cast<unsigned>(index++));
    EXPECT_TRUE(
        problem.check(run_device_api(problem, 0.0f), problem.reference(), prefill_tolerance(c)))
        << c.describe() << ", seed " << seed;
    // And split over the kv range (partials and the merge kernel), planned for longer
    // sequences so that some splits of a block are empty.
    cuda::PrefillOptions o;
    o.num_sms = 132;
    o.max_kv_len = 2048;
    int splits = 0;
    EXPECT_TRUE(problem.check(run_device_api(problem, 0.0f, o, &splits), problem.reference(),
                              prefill_tolerance(c)))
        << c.describe() << ", split, seed " << seed;
    EXPECT_GT(splits, 1);
    // The small-q block shape: 16 + 3 queries x 4 heads fit one 64-row block (the mma.sync
    // kernel's; the fp8 pair would otherwise take the wgmma kernel).
    c.q_lens = {16, 3};
    const CudaAttnProblem small(c, seed + static_cast<unsigned>(index++));
    o.kernel = cuda::PrefillOptions::Kernel::kMma;
    EXPECT_EQ(
        cuda::plan_prefill(small.spec(), small.q_indptr(), small.seq_lens(), o).rows_per_block,
        cuda::prefill_small_q_rows(64));
    EXPECT_TRUE(
        small.check(run_device_api(small, 0.0f, o), small.reference(), prefill_tolerance(c)))
        << c.describe() << ", small-q split, seed " << seed;
  }
}

// The small-q grid's split count fills whole waves of resident blocks (a plan only, no device).
// Llama-3-8B verification at batch 8: 8 sequences x 8 kv heads of 8 queries x 4 heads (32 rows:
// one small-q block each) = 64 blocks; 132 SMs x 3 blocks = 396 slots. 6 splits make 384 blocks
// (one wave of 6 tiles each at 1k); the older rule's 8 made 512 (two waves of 4).
TEST(CudaPrefill, SmallQSplitsFillWholeWaves) {
  CudaAttnCase c;
  c.num_kv_heads = 8;
  c.ratio = 4;
  const LayerKvSpec spec = spec_for(c);
  std::vector<int32_t> q_indptr = {0}, seq_lens;
  for (int s = 0; s < 8; ++s) {
    q_indptr.push_back(q_indptr.back() + 8);
    seq_lens.push_back(1024);
  }
  cuda::PrefillOptions o;
  o.num_sms = 132;
  o.kernel = cuda::PrefillOptions::Kernel::kMma;  // the small-q block (bf16 is wgmma-built)
  const cuda::PrefillPlan plan = cuda::plan_prefill(spec, q_indptr, seq_lens, o);
  EXPECT_EQ(plan.rows_per_block, cuda::prefill_small_q_rows(128));
  EXPECT_EQ(plan.num_splits, 6);
  // Batch 1: 8 blocks; the most splits the tiles allow (32 tiles / 4 = 8), as before.
  const std::vector<int32_t> one_q = {0, 8}, one_len = {1024};
  EXPECT_EQ(cuda::plan_prefill(spec, one_q, one_len, o).num_splits, 8);
  // A grid beyond one wave unsplit (batch 64: 512 blocks) keeps the older rule: 2 splits.
  std::vector<int32_t> big_q = {0}, big_len;
  for (int s = 0; s < 64; ++s) {
    big_q.push_back(big_q.back() + 8);
    big_len.push_back(1024);
  }
  EXPECT_EQ(cuda::plan_prefill(spec, big_q, big_len, o).num_splits, 2);
  // The wgmma kernel (one block an SM, 132 slots) on the same batches: batch 8 (64 blocks,
  // 32 kv tiles) 2 splits (one wave of 16-tile blocks; 4 splits would make two waves of 8);
  // batch 64 (512 blocks) and batch 32 (256) unsplit; batch 1 (8 blocks) 8 splits.
  cuda::PrefillOptions w;
  w.num_sms = 132;
  w.kernel = cuda::PrefillOptions::Kernel::kWgmma;
  const cuda::PrefillPlan wplan = cuda::plan_prefill(spec, q_indptr, seq_lens, w);
  EXPECT_TRUE(wplan.wgmma);
  EXPECT_EQ(wplan.num_splits, 2);
  EXPECT_EQ(cuda::plan_prefill(spec, big_q, big_len, w).num_splits, 1);
  std::vector<int32_t> q32(big_q.begin(), big_q.begin() + 33), len32(32, 4096);
  EXPECT_EQ(cuda::plan_prefill(spec, q32, len32, w).num_splits, 1);
  EXPECT_EQ(cuda::plan_prefill(spec, one_q, one_len, w).num_splits, 8);
  // The verification kernel (two blocks an SM, 264 slots, 64-token tiles): batch 8 x 1k (64
  // blocks, 16 tiles) 4 splits, the most its tiles allow (one wave of 4-tile blocks); batch 32
  // x 4k (256 blocks) unsplit; batch 1 x 1k 4.
  cuda::PrefillOptions v;
  v.num_sms = 132;
  v.kernel = cuda::PrefillOptions::Kernel::kVerify;
  const cuda::PrefillPlan vplan = cuda::plan_prefill(spec, q_indptr, seq_lens, v);
  EXPECT_STREQ(vplan.kernel_name(), "verify");
  EXPECT_EQ(vplan.num_splits, 4);
  EXPECT_EQ(cuda::plan_prefill(spec, q32, len32, v).num_splits, 1);
  EXPECT_EQ(cuda::plan_prefill(spec, one_q, one_len, v).num_splits, 4);
  // Batch 1 x 8k (128 tiles): at most 16 splits, where the other kernels take up to 32.
  const std::vector<int32_t> one_8k = {8192};
  EXPECT_EQ(cuda::plan_prefill(spec, one_q, one_8k, v).num_splits, 16);
  // Batch 64 (512 blocks, two waves unsplit): unsplit, where the older rule made 2 splits (four
  // waves; H100 fp8 64 x 4k at 2 splits: 302.9 us, 1.47x the decode kernel).
  EXPECT_EQ(cuda::plan_prefill(spec, big_q, big_len, v).num_splits, 1);
}

TEST(CudaPrefill, PlanRejectsBadBatches) {
  CudaAttnCase c;
  const LayerKvSpec spec = spec_for(c);
  const std::vector<int32_t> q_indptr = {0, 5, 9};
  EXPECT_THROW(cuda::plan_prefill(spec, q_indptr, std::vector<int32_t>{5, 3}), InputError);
  EXPECT_THROW(cuda::plan_prefill(spec, q_indptr, std::vector<int32_t>{5}), InputError);
  const cuda::PrefillPlan plan = cuda::plan_prefill(spec, q_indptr, std::vector<int32_t>{5, 300});
  EXPECT_EQ(plan.num_seqs, 2);
  EXPECT_EQ(plan.max_q_tiles, 1);  // 5 queries x 4 heads = 20 rows
  LayerKvSpec odd = spec;
  odd.k_dtype = KvDtype::kNvfp4;
  odd.v_dtype = KvDtype::kFp8E5M2;
  EXPECT_FALSE(cuda::prefill_unsupported_reasons(odd).empty());
}

TEST(CudaBackend, RegisteredWithHonestWhitelists) {
  EXPECT_EQ(find_attention_backend("cuda_decode"), nullptr);
  const AttentionBackend* b = find_attention_backend("cuda");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->capabilities().device, Device::kCuda);
  for (const auto& [kd, vd] : supported_pairs()) {
    const bool listed =
        std::find(b->capabilities().kv_dtype_pairs.begin(), b->capabilities().kv_dtype_pairs.end(),
                  std::make_pair(kd, vd)) != b->capabilities().kv_dtype_pairs.end();
    EXPECT_TRUE(listed) << pair_name({kd, vd});
  }
  CudaAttnCase c;
  LayerKvSpec spec = spec_for(c);
  if (cuda_device_count() > 0) {
    EXPECT_TRUE(b->reasons_unsupported(spec, Device::kCuda).empty());
  }
  // A pair outside kv_pairs.h runs on the generic kernel (cuda_generic.h): accepted where a
  // device is.
  c.k_dtype = KvDtype::kNvfp4;
  c.v_dtype = KvDtype::kFp8E5M2;
  const LayerKvSpec unlisted = spec_for(c);
  EXPECT_TRUE(cuda::uses_generic_attention(unlisted));
  EXPECT_EQ(b->reasons_unsupported(unlisted, Device::kCuda).empty(), cuda_device_count() > 0);
  // Head dims other than 64 / 128 / 256 run the generic kernel (cuda_generic.h), up to 256.
  LayerKvSpec odd = spec;
  odd.head_dim_k = odd.head_dim_v = 96;
  if (cuda_device_count() > 0) {
    EXPECT_TRUE(b->reasons_unsupported(odd, Device::kCuda).empty());
  }
  odd.head_dim_k = odd.head_dim_v = 512;
  EXPECT_FALSE(b->reasons_unsupported(odd).empty());
}

}  // namespace
}  // namespace kvq
