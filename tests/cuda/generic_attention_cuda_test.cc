// The generic CUDA attention (cuda_generic.h: head dims the tensor-core kernels do not take)
// against the cpu_reference backend (float64 softmax over the same cached bytes): every
// (K, V) pair of kv_pairs.h x head_dim 8 / 16 / 32 (48 and K/V head dims that differ where the
// dtypes store them) x causal / sliding window / non-causal, ragged batches (pure prefill,
// chunked prefill, single queries, decode-only batches), GQA ratios 1, 2, 4, soft-cap on / off,
// block 16 / 32; through the "cuda" backend and through run_generic with device tables. Outputs
// are poisoned with NaN before each run and every element is checked. Also: write_kv_cuda at
// small head dims is byte-identical to write_kv_reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention/cuda/cuda_generic.h"
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
using test::storable;
using test::supported_pairs;

// Defaults of this file's cases: float32 activations, layer 2.
CudaAttnCase generic_case() {
  CudaAttnCase c;
  c.layer = 2;
  c.model_dtype = KvDtype::kFloat32;
  c.k_dtype = c.v_dtype = KvDtype::kFloat32;
  c.set_head_dim(8);
  c.ratio = 2;
  return c;
}

// fp32 arithmetic over exactly decoded values: the error is rounding only. Allowed per element,
// relative to the largest |V| of the (sequence, kv head): a small base, plus the logit error of
// an fp32 dot product (a few units of 2^-24 of scale |q| max|k|), which moves softmax weights.
constexpr double kBaseTol = 1e-4;

test::Tolerance tolerance(KvDtype v) {
  return {kBaseTol * (traits(v).rotated ? 4.0 : 1.0), 16.0 * std::ldexp(1.0, -24)};
}

// run_generic directly, every table on the device, on a stream; `decode` passes no q_indptr
// (the batch must have one query per sequence).
std::vector<float> run_device_api(const CudaAttnProblem& p, float soft_cap, bool decode) {
  test::DeviceBatch dev(p);
  const auto n = static_cast<int32_t>(p.seq_lens().size());
  const cuda::GenericPlan plan =
      decode ? cuda::plan_generic_decode(p.spec(), n)
             : cuda::plan_generic_prefill(p.spec(), p.q_indptr(), p.seq_lens());
  EXPECT_EQ(plan.workspace_bytes, 0u);
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  dev.out.poison();
  cuda::GenericArgs a;
  a.q = dev.q.get();
  a.out = dev.out.get();
  a.q_indptr = decode ? nullptr : dev.q_indptr.get();
  a.block_table = dev.device_table();
  a.cache = dev.cache.layer_view(0);
  a.softmax_scale = p.softmax_scale();
  a.logit_soft_cap = soft_cap;
  cuda::run_generic(p.spec(), plan, a, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  return dev.out.download();
}

// A ragged batch: a pure prefill, a chunk after a cached prefix, a single query, a short pure
// prefill and a second chunk, shuffled.
void ragged_batch(CudaAttnCase& c, std::mt19937& rng) {
  test::ragged_batch(c, rng,
                     {.pure_lo = 40,
                      .pure_hi = 150,
                      .chunk_hi = 40,
                      .prefix_hi = 200,
                      .chunk2_lo = 33,
                      .chunk2_hi = 90,
                      .prefix2_hi = 100});
}

void decode_batch(CudaAttnCase& c, std::mt19937& rng) {
  auto uni = [&](int a, int b) { return std::uniform_int_distribution<int>(a, b)(rng); };
  c.q_lens.assign(4, 1);
  c.kv_lens = {1, uni(2, 40), uni(41, 300), uni(1, 600)};
}

class CudaGenericGrid : public ::testing::TestWithParam<std::pair<KvDtype, KvDtype>> {};

TEST_P(CudaGenericGrid, MatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const auto [kd, vd] = GetParam();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  const int ratios[] = {1, 2, 4};
  // (K head_dim, V head_dim): the small powers of two, a non-power of two, and a pair that
  // differs; the ones a dtype cannot store are skipped.
  const std::pair<int, int> dims[] = {{8, 8}, {16, 16}, {32, 32}, {48, 48}, {16, 32}};
  double worst = 0.0;
  int index = 0, ran = 0;
  for (const auto& [dk, dv] : dims) {
    if (!storable(kd, dk) || !storable(vd, dv)) continue;
    for (int rep = 0; rep < 2; ++rep, ++index) {
      CudaAttnCase c = generic_case();
      c.k_dtype = kd;
      c.v_dtype = vd;
      c.head_dim_k = dk;
      c.head_dim_v = dv;
      c.block_tokens = rep == 0 ? 16 : 32;
      c.ratio = ratios[(index + static_cast<int>(seed % 3)) % 3];
      c.num_kv_heads = c.ratio == 1 ? 3 : 2;
      c.kind = kinds[index % 3];
      c.window = std::uniform_int_distribution<int>(4, 120)(rng);
      c.soft_cap = index % 2 == 1 ? 5.0f : 0.0f;
      c.outliers = (index / 2) % 2 == 1;
      const int mode = index % 3;  // 0: backend, 1: device API prefill, 2: device API decode
      if (mode == 2)
        decode_batch(c, rng);
      else
        ragged_batch(c, rng);
      const unsigned case_seed = seed + static_cast<unsigned>(index) + 1;
      const CudaAttnProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      const std::vector<float> got = mode == 0 ? test::run_cuda_backend(problem, c.soft_cap)
                                               : run_device_api(problem, c.soft_cap, mode == 2);
      EXPECT_TRUE(problem.check(got, want, tolerance(vd)))
          << c.describe() << ", seed " << seed << " (case seed " << case_seed << ")";
      worst = std::max(worst, problem.worst());
      ++ran;
    }
  }
  EXPECT_GT(ran, 0);
  std::printf("  %s: %d cases, largest |error| / allowed error %.3f (base tolerance %.0e)\n",
              pair_name(GetParam()).c_str(), ran, worst, kBaseTol);
}

INSTANTIATE_TEST_SUITE_P(EveryPair, CudaGenericGrid, ::testing::ValuesIn(supported_pairs()),
                         [](const ::testing::TestParamInfo<std::pair<KvDtype, KvDtype>>& p) {
                           return pair_name(p.param);
                         });

// Small and quick, for compute-sanitizer: a ragged batch per rotated / unrotated pair.
TEST(CudaGeneric, SmallForSanitizers) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  for (const auto& [kd, vd] : {std::pair{KvDtype::kFloat32, KvDtype::kFloat32},
                               std::pair{KvDtype::kInt8PerTokenHead, KvDtype::kInt4PerTokenHead},
                               std::pair{KvDtype::kNvfp4, KvDtype::kNvfp4}}) {
    CudaAttnCase c = generic_case();
    c.k_dtype = kd;
    c.v_dtype = vd;
    c.set_head_dim(kd == KvDtype::kNvfp4 ? 16 : 8);
    c.num_kv_heads = 2;
    c.ratio = 2;
    c.q_lens = {5, 1, 3};
    c.kv_lens = {5, 37, 20};
    const CudaAttnProblem problem(c, seed);
    EXPECT_TRUE(
        problem.check(test::run_cuda_backend(problem, 0.0f), problem.reference(), tolerance(vd)))
        << c.describe() << ", seed " << seed;
  }
}

// The backend takes head dims the tensor-core kernels do not, up to 256, and names the limit.
TEST(CudaGeneric, BackendReasons) {
  LayerKvSpec s;
  s.k_dtype = s.v_dtype = KvDtype::kFloat32;
  s.num_q_heads = 8;
  s.num_kv_heads = 4;
  s.block_tokens = 16;
  for (int hd : {8, 16, 32, 48, 80, 256}) {
    s.head_dim_k = s.head_dim_v = hd;
    EXPECT_TRUE(cuda::generic_unsupported_reasons(s).empty()) << hd;
  }
  s.head_dim_k = s.head_dim_v = 64;
  EXPECT_FALSE(cuda::uses_generic_attention(s));
  s.head_dim_k = s.head_dim_v = 8;
  EXPECT_TRUE(cuda::uses_generic_attention(s));
  s.head_dim_k = s.head_dim_v = 512;
  ASSERT_FALSE(cuda::generic_unsupported_reasons(s).empty());
  EXPECT_NE(cuda::generic_unsupported_reasons(s).front().find("1..256"), std::string::npos);
  s.head_dim_k = s.head_dim_v = 8;
  s.k_dtype = KvDtype::kFp8E5M2;  // a mixed pair outside kv_pairs.h: the any-pair kernel
  EXPECT_TRUE(cuda::generic_unsupported_reasons(s).empty());
  s.head_dim_k = s.head_dim_v = 64;  // the tensor-core head dims, but not their pairs
  EXPECT_TRUE(cuda::uses_generic_attention(s));
  s.v_dtype = KvDtype::kFp8E5M2;
  EXPECT_FALSE(cuda::uses_generic_attention(s));
  s.v_dtype = KvDtype::kFloat32;
  s.head_dim_k = s.head_dim_v = 8;
  if (cuda_device_count() == 0) return;
  s.k_dtype = KvDtype::kFloat32;
  EXPECT_TRUE(find_attention_backend("cuda")->reasons_unsupported(s, Device::kCuda).empty());
}

// Every concrete (K, V) pair outside kv_pairs.h (the any-pair kernel, which decodes each side by
// its run-time dtype) at the tensor-core head dims 64 and 128: a ragged prefill batch through
// the "cuda" backend and a decode batch through run_generic, causal / sliding window /
// non-causal, GQA 2 and 4, soft-cap on and off.
std::vector<std::pair<KvDtype, KvDtype>> unlisted_pairs() {
  std::vector<std::pair<KvDtype, KvDtype>> r;
  for (const auto& k : kKvDtypeTraits)
    for (const auto& v : kKvDtypeTraits)
      if (k.concrete && v.concrete && k.valid_as_k && v.valid_as_v &&
          !cuda::cuda_kv_pair_supported(k.dtype, v.dtype))
        r.push_back({k.dtype, v.dtype});
  return r;
}

class CudaAnyPair : public ::testing::TestWithParam<std::pair<KvDtype, KvDtype>> {};

TEST_P(CudaAnyPair, MatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const auto [kd, vd] = GetParam();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  int index = 0;
  for (int hd : {64, 128}) {
    for (int mode = 0; mode < 2; ++mode, ++index) {
      CudaAttnCase c = generic_case();
      c.k_dtype = kd;
      c.v_dtype = vd;
      c.set_head_dim(hd);
      c.block_tokens = index % 2 == 0 ? 16 : 32;
      c.ratio = index % 2 == 0 ? 2 : 4;
      c.num_kv_heads = 2;
      c.kind = kinds[(index + static_cast<int>(seed % 3)) % 3];
      c.window = std::uniform_int_distribution<int>(4, 120)(rng);
      c.soft_cap = index % 3 == 1 ? 5.0f : 0.0f;
      if (mode == 0)
        ragged_batch(c, rng);
      else
        decode_batch(c, rng);
      ASSERT_TRUE(cuda::uses_generic_attention(test::spec_for(c))) << c.describe();
      const unsigned case_seed = seed + static_cast<unsigned>(index) + 1;
      const CudaAttnProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      const std::vector<float> got = mode == 0 ? test::run_cuda_backend(problem, c.soft_cap)
                                               : run_device_api(problem, c.soft_cap, true);
      EXPECT_TRUE(problem.check(got, want, tolerance(vd)))
          << c.describe() << ", seed " << seed << " (case seed " << case_seed << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryUnlistedPair, CudaAnyPair, ::testing::ValuesIn(unlisted_pairs()),
                         [](const ::testing::TestParamInfo<std::pair<KvDtype, KvDtype>>& p) {
                           return pair_name(p.param);
                         });

// ---- write_kv_cuda at small head dims ---------------------------------------------------

// Nine kinds of rows: random, one outlier, zeros, NaN / infinities, huge, tiny, rounding ties
// at 1..10 mantissa bits, int grid ties, random again.
std::vector<float> make_row(std::mt19937& rng, int dim, int kind) {
  using test::RowKind;
  const RowKind kinds[] = {RowKind::kRandom, RowKind::kOutliers,     RowKind::kZeros,
                           RowKind::kNanInf, RowKind::kHuge,         RowKind::kTiny,
                           RowKind::kTies,   RowKind::kHalfIntegers, RowKind::kRandom};
  return test::make_row(rng, dim, kinds[kind], test::RowOptions{});
}

TEST(CudaGeneric, CacheWriteBitIdenticalAtSmallHeadDims) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const std::vector<KvDtype> dtypes = test::concrete_dtypes();
  int index = 0;
  for (KvDtype kd : dtypes) {
    for (int hd : {2, 8, 16, 24, 32, 48, 96}) {
      const KvDtype vd = dtypes[static_cast<size_t>(index++ + 1) % dtypes.size()];
      if (!storable(kd, hd) || !storable(vd, hd)) continue;
      CudaAttnCase c;
      c.layer = 4;
      c.k_dtype = kd;
      c.v_dtype = vd;
      c.num_kv_heads = 3;
      c.ratio = 2;
      c.set_head_dim(hd);
      c.block_tokens = index % 2 == 0 ? 16 : 32;
      const LayerKvSpec spec = test::spec_for(c);
      const int bt = spec.block_tokens;
      const int32_t num_blocks = 5;
      const int n = bt + 9;
      std::vector<int64_t> slots(static_cast<size_t>(num_blocks) * bt);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      slots.resize(static_cast<size_t>(n));
      slots[3] = -1;  // padding: skipped by both
      const size_t row_elems = static_cast<size_t>(spec.num_kv_heads) * hd;
      std::vector<float> k(n * row_elems), v(n * row_elems);
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < spec.num_kv_heads; ++h) {
          const int kind = (t * spec.num_kv_heads + h) % 9;
          const auto rk = make_row(rng, hd, kind), rv = make_row(rng, hd, (kind + 4) % 9);
          std::copy(rk.begin(), rk.end(), k.begin() + (t * spec.num_kv_heads + h) * hd);
          std::copy(rv.begin(), rv.end(), v.begin() + (t * spec.num_kv_heads + h) * hd);
        }
      std::vector<int64_t> valid_slots;
      std::vector<float> kv_k, kv_v;
      for (int t = 0; t < n; ++t) {
        if (slots[t] < 0) continue;
        valid_slots.push_back(slots[t]);
        kv_k.insert(kv_k.end(), k.begin() + t * row_elems, k.begin() + (t + 1) * row_elems);
        kv_v.insert(kv_v.end(), v.begin() + t * row_elems, v.begin() + (t + 1) * row_elems);
      }
      const test::LayerBytes want =
          test::reference_write(spec, num_blocks, valid_slots, kv_k.data(), kv_v.data());
      test::LayerBytes got;
      ASSERT_NO_FATAL_FAILURE(test::cuda_write(spec, num_blocks, slots, k, v, &got));
      for (KvSide side : {KvSide::kK, KvSide::kV}) {
        const std::string bad =
            test::first_mismatch(got.side(side), want.side(side), spec.layout(side));
        EXPECT_TRUE(bad.empty()) << to_string(side) << " " << to_string(spec.dtype(side))
                                 << ", head_dim " << hd << ", block " << bt << ": " << bad
                                 << ", seed " << seed;
      }
    }
  }
}

}  // namespace
}  // namespace kvq
