// The "cuda" backend's decode path against the cpu_reference backend (float64 softmax over
// the same cached bytes):
// every KV dtype x head_dim x block size x GQA ratio, ragged batches (1, block - 1, block + 1,
// several thousand tokens), causal / sliding window / non-causal, with and without a logit
// soft-cap; outputs poisoned with NaN before each run, every element checked. The mixed K/V
// pairs of kv_pairs.h run through the device-level API (run_decode) on the same grid shape.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention/cuda/cuda_decode.h"
#include "attention/cuda/cuda_generic.h"
#include "attention/cuda/kv_pairs.h"
#include "cuda_attention_harness.h"
#include "kvq/attention/backend.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"

namespace kvq {
namespace {

using test::concrete_dtypes;
using test::CudaAttnCase;
using test::CudaAttnProblem;
using test::DeviceBuffer;
using test::spec_for;
using KvPair = std::pair<KvDtype, KvDtype>;

// A decode batch (one query per sequence) of K and V dtype `dtype`, layer 2, 2 kv heads.
CudaAttnCase decode_case(KvDtype dtype, std::vector<int> lens) {
  CudaAttnCase c;
  c.layer = 2;
  c.k_dtype = c.v_dtype = dtype;
  c.num_kv_heads = 2;
  c.q_lens.assign(lens.size(), 1);
  c.kv_lens = std::move(lens);
  return c;
}

// Error allowed per element, relative to the largest |V| of the (sequence, kv head). The
// reference reads the same bytes, so what remains is the kernel's arithmetic: Q and P as fp16
// MMA operands (bf16 for bfloat16 / float32 caches, 8x coarser), fp32 accumulation. Measured
// on an H100 with |q| ~ 2.5 sigma: worst 1.3e-3 (fp16 operands), 3.6e-3 (int4, rotated
// twice), 7.7e-3 (bf16 operands; test Q is fp32, a bf16 model's Q is exact in bf16). The
// bounds keep about 4x headroom; layout or scale bugs show as errors of order 0.1 to 1.
double tolerance(KvDtype d) {
  double tol = (d == KvDtype::kBFloat16 || d == KvDtype::kFloat32) ? 3e-2 : 5e-3;
  if (traits(d).rotated) tol *= 2.5;
  return tol;
}
// A mixed pair: the coarser side's bound (each side's error enters the output once).
double tolerance(KvDtype k, KvDtype v) {
  return std::max(tolerance(k), tolerance(v));
}
test::Tolerance decode_tolerance(const CudaAttnCase& c) {
  return {.base = tolerance(c.k_dtype, c.v_dtype)};
}

class CudaDecodeGrid : public ::testing::TestWithParam<KvDtype> {};

TEST_P(CudaDecodeGrid, MatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const KvDtype dtype = GetParam();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  int index = 0;
  double worst = 0.0;
  for (int hd : {64, 128, 256}) {
    for (int bt : {16, 32}) {
      for (int ratio : {1, 4, 8}) {
        CudaAttnCase c = decode_case(dtype, {});
        c.set_head_dim(hd);
        c.block_tokens = bt;
        c.ratio = ratio;
        const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                       AttentionKind::kNonCausal};
        c.kind = kinds[index % 3];
        c.window = std::uniform_int_distribution<int>(20, 700)(rng);
        c.soft_cap = index % 4 == 1 ? 5.0f : 0.0f;
        const int long_len = std::uniform_int_distribution<int>(1500, 4500)(rng);
        c.kv_lens = {1, bt - 1, bt + 1, long_len, 37, 3 * bt};
        c.q_lens.assign(c.kv_lens.size(), 1);
        std::shuffle(c.kv_lens.begin(), c.kv_lens.end(), rng);
        ++index;
        const unsigned case_seed = seed + static_cast<unsigned>(index);
        const CudaAttnProblem problem(c, case_seed);
        const std::vector<float> want = problem.reference();
        const std::vector<float> got = test::run_cuda_backend(problem, c.soft_cap);
        EXPECT_TRUE(problem.check(got, want, decode_tolerance(c)))
            << c.describe() << ", seed " << seed << " (case seed " << case_seed << ")";
        worst = std::max(worst, problem.worst_over_vmax());
      }
    }
  }
  std::printf("  %s: largest |error| / max|V| over the grid %.2e (tolerance %.1e)\n",
              std::string(to_string(dtype)).c_str(), worst, tolerance(dtype));
}

INSTANTIATE_TEST_SUITE_P(EveryDtype, CudaDecodeGrid, ::testing::ValuesIn(concrete_dtypes()),
                         [](const ::testing::TestParamInfo<KvDtype>& p) {
                           return std::string(to_string(p.param));
                         });

// run_decode through the device-level API on dev's batch (output poisoned first), planned with
// `opt`; with q_indptr where the plan takes several queries per sequence. The workspace starts
// as garbage, and the plan runs twice on it (as a replayed graph does): the second output must
// be the same bits. The output and the plan's split count.
struct DeviceRun {
  std::vector<float> out;
  int splits = 0;
};
DeviceRun run_device(const CudaAttnProblem& p, test::DeviceBatch& dev, float soft_cap,
                     const cuda::DecodeOptions& opt = {}) {
  const cuda::DecodePlan plan = cuda::plan_decode(p.spec(), p.seq_lens(), opt);
  DeviceBuffer<std::byte> ws(plan.workspace_bytes);
  cuda::DecodeArgs a;
  a.q = dev.q.get();
  a.out = dev.out.get();
  a.q_indptr = opt.q_per_seq > 1 ? dev.q_indptr.get() : nullptr;
  a.block_table = dev.device_table();
  a.cache = dev.cache.layer_view(0);
  a.softmax_scale = p.softmax_scale();
  a.logit_soft_cap = soft_cap;
  a.workspace = ws.get();
  EXPECT_EQ(cudaMemset(ws.get(), 0xA5, plan.workspace_bytes), cudaSuccess);
  dev.out.poison();
  cuda::run_decode(p.spec(), plan, a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  DeviceRun r{dev.out.download(), plan.max_splits};
  dev.out.poison();
  cuda::run_decode(p.spec(), plan, a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> again = dev.out.download();
  EXPECT_EQ(std::memcmp(again.data(), r.out.data(), again.size() * sizeof(float)), 0)
      << "a second run of the same plan gave other bits (" << r.splits << " splits)";
  return r;
}

// The device-level API with forced chunking: one tile per work item (hundreds of splits to
// merge) and one work item per sequence (no merge across splits), GQA ratio 12 (two head
// chunks, the second one partial).
TEST(CudaDecode, SplitCountsAndHeadChunksAgree) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  for (KvDtype dtype : {KvDtype::kFp8E4M3, KvDtype::kInt4PerTokenHead, KvDtype::kBFloat16}) {
    // fp8: causal with 4500 tokens (282 one-tile splits, more than one merge pass);
    // the others: a sliding window that starts inside a tile. int4 in blocks of 32 tokens:
    // one-item splits that start in the middle of a block and walk more than 32 blocks (the
    // one-query ring's block-id reloads).
    CudaAttnCase c = decode_case(dtype, {dtype == KvDtype::kFp8E4M3 ? 4500 : 2500, 5, 999, 1001});
    c.set_head_dim(128);
    c.block_tokens = dtype == KvDtype::kInt4PerTokenHead ? 32 : 16;
    c.ratio = 12;
    c.num_kv_heads = 1;
    c.kind = dtype == KvDtype::kFp8E4M3 ? AttentionKind::kCausal : AttentionKind::kSlidingWindow;
    c.window = 1000;
    const CudaAttnProblem problem(c, seed);
    const std::vector<float> want = problem.reference();
    test::DeviceBatch dev(problem);
    for (int chunk : {1, 3, 100000}) {
      cuda::DecodeOptions opt;
      opt.chunk_tiles = chunk;
      const DeviceRun r = run_device(problem, dev, 0.0f, opt);
      EXPECT_TRUE(problem.check(r.out, want, decode_tolerance(c)))
          << c.describe() << ", chunk " << chunk << " (" << r.splits << " splits), seed " << seed;
    }
  }
}

// A padding sequence (seq_len 0, as the CUDA model pads a graph step's batch to its bucket)
// gets zeros, not NaN, from either merge (one-tile items: 44 splits, the block merge; 8-tile
// items: 6 splits, the warp merge), and the other sequence is unaffected. (A plan of one item
// per sequence runs no merge and leaves a padding row as it was.)
TEST(CudaDecode, PaddingSequenceGetsZeros) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  CudaAttnCase c = decode_case(KvDtype::kFp8E4M3, {700, 700});
  c.set_head_dim(128);
  c.block_tokens = 16;
  c.ratio = 4;
  const CudaAttnProblem problem(c, seed);
  std::vector<float> want = problem.reference();
  const size_t half = want.size() / 2;  // [sequence][query head][head_dim]: sequence 1's rows
  std::fill(want.begin() + static_cast<ptrdiff_t>(half), want.end(), 0.0f);
  // chunk 64: one split (44 tiles), so no merge runs and the split-KV kernel writes the zeros.
  for (int chunk : {1, 8, 64}) {
    test::DeviceBatch dev(problem);
    const int32_t zero = 0;
    ASSERT_EQ(cudaMemcpy(dev.seq_lens.get() + 1, &zero, sizeof zero, cudaMemcpyHostToDevice),
              cudaSuccess);
    cuda::DecodeOptions opt;
    opt.chunk_tiles = chunk;
    const DeviceRun r = run_device(problem, dev, 0.0f, opt);
    for (size_t i = half; i < r.out.size(); ++i)
      ASSERT_EQ(r.out[i], 0.0f) << "padding row element " << i - half << ", chunk " << chunk << " ("
                                << r.splits << " splits), seed " << seed;
    EXPECT_TRUE(problem.check(r.out, want, decode_tolerance(c)))
        << "chunk " << chunk << " (" << r.splits << " splits), seed " << seed;
  }
}

// The mixed (K, V) pairs through the device-level API (plan_decode / run_decode), so they are
// tested whatever the registered backend's whitelist says: the same grid shape as the K == V
// cases (ragged lengths, sliding window, GQA 1 / 4 / 12, soft-cap, outlier rows).
std::vector<float> run_device(const CudaAttnProblem& p, float soft_cap) {
  test::DeviceBatch dev(p);
  return run_device(p, dev, soft_cap).out;
}

class CudaDecodeMixedPairs : public ::testing::TestWithParam<KvPair> {};

TEST_P(CudaDecodeMixedPairs, MatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const auto [kd, vd] = GetParam();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  int index = 0;
  double worst = 0.0;
  for (int hd : {64, 128, 256}) {
    for (int ratio : {1, 4, 12}) {
      CudaAttnCase c = decode_case(kd, {});
      c.v_dtype = vd;
      c.set_head_dim(hd);
      c.block_tokens = index % 2 == 0 ? 16 : 32;
      c.ratio = ratio;
      const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                     AttentionKind::kNonCausal};
      c.kind = kinds[index % 3];
      c.window = std::uniform_int_distribution<int>(20, 700)(rng);
      c.soft_cap = index % 4 == 1 ? 5.0f : 0.0f;
      const int long_len = std::uniform_int_distribution<int>(1500, 4500)(rng);
      c.kv_lens = {1, c.block_tokens - 1, c.block_tokens + 1, long_len, 37, 3 * c.block_tokens};
      c.q_lens.assign(c.kv_lens.size(), 1);
      std::shuffle(c.kv_lens.begin(), c.kv_lens.end(), rng);
      ++index;
      const unsigned case_seed = seed + static_cast<unsigned>(index);
      const CudaAttnProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      const std::vector<float> got = run_device(problem, c.soft_cap);
      EXPECT_TRUE(problem.check(got, want, decode_tolerance(c)))
          << c.describe() << ", seed " << seed << " (case seed " << case_seed << ")";
      worst = std::max(worst, problem.worst_over_vmax());
    }
  }
  std::printf("  %s / %s: largest |error| / max|V| over the grid %.2e (tolerance %.1e)\n",
              std::string(to_string(kd)).c_str(), std::string(to_string(vd)).c_str(), worst,
              tolerance(kd, vd));
}

INSTANTIATE_TEST_SUITE_P(
    EveryMixedPair, CudaDecodeMixedPairs,
    ::testing::ValuesIn(std::vector<KvPair>(std::begin(cuda::kCudaMixedKvPairs),
                                            std::end(cuda::kCudaMixedKvPairs))),
    [](const ::testing::TestParamInfo<KvPair>& p) { return test::pair_name(p.param); });

// decode_unsupported_reasons accepts exactly the pairs of kv_pairs.h, and a refused pair's
// reason names the pair and what is built instead.
TEST(CudaDecode, AcceptsExactlyTheBuiltPairs) {
  const std::vector<KvDtype> all = concrete_dtypes();
  int accepted = 0;
  for (KvDtype k : all) {
    for (KvDtype v : all) {
      CudaAttnCase c = decode_case(k, {1});
      c.v_dtype = v;
      const std::vector<std::string> r = cuda::decode_unsupported_reasons(spec_for(c));
      const std::string pair = std::string(to_string(k)) + "/" + std::string(to_string(v));
      if (cuda::cuda_kv_pair_supported(k, v)) {
        EXPECT_TRUE(r.empty()) << pair << ": " << (r.empty() ? "" : r.front());
        ++accepted;
      } else {
        ASSERT_EQ(r.size(), 1u) << pair;
        EXPECT_NE(r.front().find(pair), std::string::npos) << r.front();
        EXPECT_NE(r.front().find("bfloat16/fp8_e4m3"), std::string::npos) << r.front();
      }
    }
  }
  EXPECT_EQ(accepted, static_cast<int>(all.size() + std::size(cuda::kCudaMixedKvPairs)));
}

TEST(CudaDecodeBackend, RegisteredWithHonestWhitelists) {
  const AttentionBackend* b = find_attention_backend("cuda");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->capabilities().device, Device::kCuda);
  CudaAttnCase c = decode_case(KvDtype::kBFloat16, {1});
  LayerKvSpec spec = spec_for(c);
  if (cuda_device_count() > 0) {
    EXPECT_TRUE(b->reasons_unsupported(spec, Device::kCuda).empty());
  }
  EXPECT_FALSE(b->reasons_unsupported(spec, Device::kCpu).empty());
  LayerKvSpec mixed = spec;
  mixed.v_dtype = KvDtype::kFp8E5M2;  // a pair outside kv_pairs.h: the generic kernel runs it
  mixed.v_scale.kind = ScaleSourceKind::kCheckpoint;
  mixed.v_scale.values = {0.02f};
  EXPECT_TRUE(cuda::uses_generic_attention(mixed));
  EXPECT_EQ(b->reasons_unsupported(mixed, Device::kCuda).empty(), cuda_device_count() > 0);
  const auto& pairs = b->capabilities().kv_dtype_pairs;
  EXPECT_NE(std::find(pairs.begin(), pairs.end(), std::pair{mixed.k_dtype, mixed.v_dtype}),
            pairs.end());
  // Head dims other than 64 / 128 / 256 run the generic kernel (cuda_generic.h), up to 256.
  LayerKvSpec odd = spec;
  odd.head_dim_k = odd.head_dim_v = 96;
  if (cuda_device_count() > 0) {
    EXPECT_TRUE(b->reasons_unsupported(odd, Device::kCuda).empty());
  }
  odd.head_dim_k = odd.head_dim_v = 512;
  EXPECT_FALSE(b->reasons_unsupported(odd).empty());
  LayerKvSpec small_blocks = spec;
  small_blocks.block_tokens = 8;
  EXPECT_FALSE(b->reasons_unsupported(small_blocks).empty());
}

// A case of the K/V pair (kd, vd) at head_dim hd and GQA ratio `ratio` (1 kv head at 12, else
// 2) whose mask, window and soft-cap vary with `index` (causal / sliding window / non-causal in
// turn, soft-cap 5 on every fourth); contexts and queries are the caller's.
CudaAttnCase varied_case(KvDtype kd, KvDtype vd, int hd, int ratio, int block_tokens, int index,
                         std::mt19937& rng) {
  CudaAttnCase c = decode_case(kd, {});
  c.v_dtype = vd;
  c.set_head_dim(hd);
  c.block_tokens = block_tokens;
  c.ratio = ratio;
  c.num_kv_heads = ratio == 12 ? 1 : 2;
  const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                 AttentionKind::kNonCausal};
  c.kind = kinds[index % 3];
  c.window = std::uniform_int_distribution<int>(20, 300)(rng);
  c.soft_cap = index % 4 == 1 ? 5.0f : 0.0f;
  return c;
}

// Several queries per sequence through the decode kernel (speculative verification, a DFlash
// block): ragged q_len 0 .. kDecodeMaxQueries at the end of ragged contexts, causal / sliding
// window / non-causal, GQA 1 / 2 / 4 / 12 (rows of several query tokens in one warp, and a
// query's heads across two warps), forced one-tile splits (rows whose queries see none of a
// split) and the plan's own split; every K/V pair of kv_pairs.h.

class CudaDecodeMultiQuery : public ::testing::TestWithParam<KvPair> {};

TEST_P(CudaDecodeMultiQuery, MatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const auto [kd, vd] = GetParam();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  int index = 0;
  for (int hd : {64, 128, 256}) {
    for (int ratio : {1, 2, 4, 12}) {
      CudaAttnCase c = varied_case(kd, vd, hd, ratio, index % 2 == 0 ? 16 : 32, index, rng);
      const int q_max = index % 2 == 0 ? cuda::kDecodeMaxQueries : 9;
      c.kv_lens = {1,
                   q_max,
                   c.block_tokens + 1,
                   std::uniform_int_distribution<int>(600, 2500)(rng),
                   37,
                   3 * c.block_tokens};
      std::shuffle(c.kv_lens.begin(), c.kv_lens.end(), rng);
      c.q_lens.clear();
      for (int len : c.kv_lens)
        c.q_lens.push_back(std::uniform_int_distribution<int>(0, std::min(len, q_max))(rng));
      // One sequence with as many queries as the plan takes (or as it has tokens).
      const size_t full = static_cast<size_t>(index) % c.q_lens.size();
      c.q_lens[full] = std::min(c.kv_lens[full], q_max);
      ++index;
      const unsigned case_seed = seed + static_cast<unsigned>(index);
      const CudaAttnProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      test::DeviceBatch dev(problem);
      for (int chunk : {1, 0}) {
        cuda::DecodeOptions opt;
        opt.chunk_tiles = chunk;
        opt.q_per_seq = q_max;
        const DeviceRun r = run_device(problem, dev, c.soft_cap, opt);
        EXPECT_TRUE(problem.check(r.out, want, decode_tolerance(c)))
            << c.describe() << ", chunk " << chunk << " (" << r.splits << " splits), seed " << seed
            << " (case seed " << case_seed << ")";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryPair, CudaDecodeMultiQuery,
                         ::testing::ValuesIn(test::supported_pairs()),
                         [](const ::testing::TestParamInfo<KvPair>& p) {
                           return test::pair_name(p.param);
                         });

TEST(CudaDecode, RefusesMoreQueriesThanItTakes) {
  CudaAttnCase c = decode_case(KvDtype::kBFloat16, {40});
  cuda::DecodeOptions opt;
  opt.num_sms = 132;
  opt.chunk_tiles = 8;
  opt.q_per_seq = cuda::kDecodeMaxQueries + 1;
  const std::vector<int32_t> lens{40};
  EXPECT_THROW(cuda::plan_decode(spec_for(c), lens, opt), InternalError);
  opt.q_per_seq = 0;
  EXPECT_THROW(cuda::plan_decode(spec_for(c), lens, opt), InternalError);
  opt.q_per_seq = 9;
  c.set_head_dim(128);
  const cuda::DecodePlan plan = cuda::plan_decode(spec_for(c), lens, opt);
  EXPECT_EQ(plan.q_per_seq, 9);
  EXPECT_EQ(plan.rows_per_warp, 16);  // several queries: every row of the MMA tiles
  EXPECT_EQ(plan.head_chunks, (9 * c.ratio + 15) / 16);
  c.set_head_dim(256);  // 16-row accumulators do not fit: 8-row warps
  const cuda::DecodePlan wide = cuda::plan_decode(spec_for(c), lens, opt);
  EXPECT_EQ(wide.rows_per_warp, 8);
  EXPECT_EQ(wide.head_chunks, (9 * c.ratio + 7) / 8);
  opt.q_per_seq = 1;
  EXPECT_EQ(cuda::plan_decode(spec_for(c), lens, opt).rows_per_warp, 8);
}

// The cluster merge (DecodePlan::cluster: a cluster of 8 or 16 blocks per (sequence, kv head),
// the splits merged through distributed shared memory), forced for every pair of kv_pairs.h: one
// query and several per sequence (rows of a query across two head chunks at GQA 12), head_dim
// 64 / 128 / 256, ragged contexts up to 2500 tokens (up to 5 tiles per warp with one query,
// more with several: fewer splits per head chunk), every mask,
// soft-cap; then a padding sequence (seq_len 0 on the device) gets zeros and the others keep
// their values.
class CudaDecodeCluster : public ::testing::TestWithParam<KvPair> {};

TEST_P(CudaDecodeCluster, MatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const auto [kd, vd] = GetParam();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  int index = 0;
  for (int hd : {64, 128, 256}) {
    for (int ratio : {1, 4, 12}) {
      const bool multi = index % 2 == 1;
      CudaAttnCase c = varied_case(kd, vd, hd, ratio, index % 3 == 0 ? 32 : 16, index, rng);
      const int q_max = multi ? (index % 4 == 1 ? cuda::kDecodeMaxQueries : 9) : 1;
      c.kv_lens = {1, 17, c.block_tokens + 1, std::uniform_int_distribution<int>(600, 2500)(rng),
                   3 * c.block_tokens};
      std::shuffle(c.kv_lens.begin(), c.kv_lens.end(), rng);
      c.q_lens.clear();
      for (int len : c.kv_lens)
        c.q_lens.push_back(multi ? std::uniform_int_distribution<int>(0, std::min(len, q_max))(rng)
                                 : 1);
      if (multi) c.q_lens[static_cast<size_t>(index) % c.q_lens.size()] = 1;
      // Both cluster sizes, each with one query and with several.
      const int blocks = index % 4 < 2 ? cuda::kDecodeClusterBlocks : cuda::kDecodeClusterBlocksMax;
      ++index;
      const unsigned case_seed = seed + static_cast<unsigned>(index);
      const CudaAttnProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      test::DeviceBatch dev(problem);
      cuda::DecodeOptions opt;
      opt.q_per_seq = q_max;
      opt.cluster = 1;
      opt.cluster_blocks = blocks;
      const cuda::DecodePlan plan = cuda::plan_decode(problem.spec(), problem.seq_lens(), opt);
      ASSERT_EQ(plan.cluster, blocks) << c.describe();
      ASSERT_LE(plan.max_splits * plan.head_chunks, 4 * plan.cluster) << c.describe();
      const DeviceRun r = run_device(problem, dev, c.soft_cap, opt);
      EXPECT_TRUE(problem.check(r.out, want, decode_tolerance(c)))
          << c.describe() << ", cluster merge (" << r.splits << " splits), seed " << seed
          << " (case seed " << case_seed << ")";
      // Sequence 1 as a padding sequence of a graph step (seq_len 0, its queries kept):
      // zeros in its query rows; the rest unchanged.
      const int32_t zero = 0;
      ASSERT_EQ(cudaMemcpy(dev.seq_lens.get() + 1, &zero, sizeof zero, cudaMemcpyHostToDevice),
                cudaSuccess);
      const DeviceRun z = run_device(problem, dev, c.soft_cap, opt);
      const size_t row = static_cast<size_t>(c.num_kv_heads * ratio * hd);  // one query token
      const size_t pad_lo = static_cast<size_t>(c.q_lens[0]) * row;
      const size_t pad_hi = pad_lo + static_cast<size_t>(c.q_lens[1]) * row;
      for (size_t i = 0; i < z.out.size(); ++i) {
        if (i >= pad_lo && i < pad_hi)
          ASSERT_EQ(z.out[i], 0.0f) << "padding row element " << i - pad_lo << ", " << c.describe();
        else
          ASSERT_EQ(z.out[i], r.out[i]) << "element " << i << ", " << c.describe();
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryPair, CudaDecodeCluster, ::testing::ValuesIn(test::supported_pairs()),
                         [](const ::testing::TestParamInfo<KvPair>& p) {
                           return test::pair_name(p.param);
                         });

// The plan's rule for the cluster merge (132 SMs given): taken for a small grid of short
// contexts, not for long ones, grids larger than the SMs, or a caller's own chunking; the
// option forces it on or off; the workspace holds no partial rows then.
TEST(CudaDecode, ClusterPlanRule) {
  KVQ_REQUIRE_GPU();  // the plan reads the kernel's occupancy
  for (const char* v :
       {"KVQ_DECODE_CLUSTER", "KVQ_DECODE_CLUSTER_MAX_TILES", "KVQ_DECODE_CLUSTER_BLOCKS"})
    if (const char* e = std::getenv(v); e != nullptr && *e != '\0')
      GTEST_SKIP() << v << " is set: the rule under test is the default one";
  CudaAttnCase c = decode_case(KvDtype::kFp8E4M3, {1024});
  c.set_head_dim(128);
  c.ratio = 4;
  c.num_kv_heads = 8;
  cuda::DecodeOptions opt;
  opt.num_sms = 132;
  const LayerKvSpec spec = spec_for(c);
  const std::vector<int32_t> one{1024}, long_one{16384}, four(4, 1024);
  const cuda::DecodePlan small = cuda::plan_decode(spec, one, opt);
  EXPECT_EQ(small.cluster, cuda::kDecodeClusterBlocks);
  EXPECT_EQ(small.max_splits, 32);  // 4 warps x 8 blocks, one head chunk
  EXPECT_EQ(cuda::plan_decode(spec, long_one, opt).cluster, 0);  // 32 tiles per warp
  EXPECT_EQ(cuda::plan_decode(spec, four, opt).cluster, 0);      // 256 blocks > 132 SMs
  cuda::DecodeOptions chunked = opt;
  chunked.chunk_tiles = 8;  // the caller's split: the merge kernel
  EXPECT_EQ(cuda::plan_decode(spec, one, chunked).cluster, 0);
  opt.cluster = 0;
  const cuda::DecodePlan off = cuda::plan_decode(spec, one, opt);
  EXPECT_EQ(off.cluster, 0);
  EXPECT_GT(off.workspace_bytes, small.workspace_bytes);  // partial rows in global memory
  opt.cluster = 1;
  EXPECT_EQ(cuda::plan_decode(spec, long_one, opt).cluster, cuda::kDecodeClusterBlocks);
  opt.cluster_blocks = cuda::kDecodeClusterBlocks;
  opt.q_per_seq = 9;  // 9 x 4 rows: 3 head chunks of 16, 10 splits
  const cuda::DecodePlan mq = cuda::plan_decode(spec, one, opt);
  EXPECT_EQ(mq.head_chunks, 3);
  EXPECT_EQ(mq.max_splits, 10);
  opt.cluster_blocks = cuda::kDecodeClusterBlocksMax;  // 64 warps: 21 splits of 3 chunks
  const cuda::DecodePlan mq16 = cuda::plan_decode(spec, one, opt);
  EXPECT_EQ(mq16.cluster, cuda::kDecodeClusterBlocksMax);
  EXPECT_EQ(mq16.max_splits, 21);
  opt.q_per_seq = 8;  // 2 chunks: 32 splits, the most the merge takes
  EXPECT_EQ(cuda::plan_decode(spec, one, opt).max_splits, cuda::kDecodeClusterMaxSplits);
  // Several queries by the rule: up to 16 tiles a warp (one query: 8).
  opt.cluster = -1;
  opt.cluster_blocks = cuda::kDecodeClusterBlocks;
  opt.q_per_seq = 16;  // 4 head chunks, 8 splits
  const std::vector<int32_t> ctx2k{2048}, ctx2k1{2064};
  const cuda::DecodePlan mq2k = cuda::plan_decode(spec, ctx2k, opt);  // 128 tiles: 16 a warp
  EXPECT_EQ(mq2k.cluster, cuda::kDecodeClusterBlocks);
  EXPECT_EQ(mq2k.max_splits, 8);
  EXPECT_EQ(cuda::plan_decode(spec, ctx2k1, opt).cluster, 0);  // 129 tiles: 17 a warp
  // The size by the rule: 16 blocks (16 splits of 4 chunks) where the device holds 8 such
  // clusters at once (an H100 / H200 does), else 8.
  opt.cluster_blocks = 0;
  const cuda::DecodePlan mq_rule = cuda::plan_decode(spec, ctx2k1, opt);
  if (mq_rule.cluster == cuda::kDecodeClusterBlocksMax) {
    EXPECT_EQ(mq_rule.max_splits, 16);  // 9 tiles a warp
  } else {
    EXPECT_EQ(mq_rule.cluster, 0);
  }
  // One query: one head chunk takes 32 splits in 8 blocks; 16 would add none.
  opt.q_per_seq = 1;
  EXPECT_EQ(cuda::plan_decode(spec, std::vector<int32_t>{4096}, opt).cluster,
            cuda::kDecodeClusterBlocks);                                           // 8 tiles a warp
  EXPECT_EQ(cuda::plan_decode(spec, std::vector<int32_t>{4112}, opt).cluster, 0);  // 9
}

// Larger q_len runs the prefill kernel: tests/cuda/prefill_attention_cuda_test.cc.

}  // namespace
}  // namespace kvq
