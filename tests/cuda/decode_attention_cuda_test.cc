// The "cuda" backend's decode path against the cpu_reference backend (float64 softmax over
// the same cached bytes):
// every KV dtype x head_dim x block size x GQA ratio, ragged batches (1, block - 1, block + 1,
// several thousand tokens), causal / sliding window / non-causal, with and without a logit
// soft-cap; outputs poisoned with NaN before each run, every element checked. The mixed K/V
// pairs of kv_pairs.h run through the device-level API (run_decode) on the same grid shape.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attention/cuda/cuda_decode.h"
#include "attention/cuda/kv_pairs.h"
#include "cuda_test_util.h"
#include "kvq/attention/backend.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/quant/codec.h"

namespace kvq {
namespace {

using test::DeviceBuffer;

struct DecodeCase {
  KvDtype dtype = KvDtype::kBFloat16;  // K (and V unless v_dtype is set)
  KvDtype v_dtype = KvDtype::kAuto;    // kAuto: same as dtype
  int head_dim = 128;
  int block_tokens = 16;
  int num_kv_heads = 2;
  int ratio = 4;
  AttentionKind kind = AttentionKind::kCausal;
  int window = 0;
  float soft_cap = 0.0f;
  std::vector<int> lens;

  KvDtype vd() const { return v_dtype == KvDtype::kAuto ? dtype : v_dtype; }

  std::string describe() const {
    std::ostringstream os;
    os << to_string(dtype);
    if (vd() != dtype) os << " / " << to_string(vd());
    os << ", head_dim " << head_dim << ", block " << block_tokens << ", kv heads " << num_kv_heads
       << " x ratio " << ratio << ", " << to_string(kind);
    if (kind == AttentionKind::kSlidingWindow) os << " W=" << window;
    os << ", soft_cap " << soft_cap << ", lens:";
    for (int l : lens) os << " " << l;
    return os.str();
  }
};

LayerKvSpec spec_for(const DecodeCase& c) {
  LayerKvSpec s;
  s.layer = 2;
  s.k_dtype = c.dtype;
  s.v_dtype = c.vd();
  s.attention = c.kind;
  s.sliding_window = c.window;
  s.num_kv_heads = c.num_kv_heads;
  s.num_q_heads = c.num_kv_heads * c.ratio;
  s.head_dim_k = s.head_dim_v = c.head_dim;
  s.block_tokens = c.block_tokens;
  for (KvSide side : {KvSide::kK, KvSide::kV}) {
    ScaleSource& sc = side == KvSide::kK ? s.k_scale : s.v_scale;
    const KvDtype d = s.dtype(side);
    const auto& t = traits(d);
    if (t.uses_tensor_scale) {
      sc.kind = ScaleSourceKind::kCheckpoint;
      const float base = d == KvDtype::kNvfp4 ? 0.004f : 0.02f;
      for (int h = 0; h < c.num_kv_heads; ++h) sc.values.push_back(base * (1.0f + 0.5f * h));
    } else if (t.scale_kind == ScaleKind::kPerTokenHead) {
      sc.kind = ScaleSourceKind::kDynamic;
    }
  }
  return s;
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

// One batch in a paged cache: host bytes (for cpu_reference) and the same bytes on the device.
class DecodeProblem {
 public:
  DecodeProblem(const DecodeCase& c, unsigned seed) : case_(c), spec_(spec_for(c)), rng_(seed) {
    const int bt = c.block_tokens, hd = c.head_dim, nkv = c.num_kv_heads;
    int needed = 0;
    for (int len : c.lens) needed += (len + bt - 1) / bt;
    num_blocks_ = needed + 2;
    std::vector<int32_t> pool(static_cast<size_t>(num_blocks_));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng_);
    kl_ = spec_.layout(KvSide::kK);
    vl_ = spec_.layout(KvSide::kV);
    hk_.assign(static_cast<size_t>(num_blocks_) * kl_.block_bytes, std::byte{0xFF});
    hv_.assign(static_cast<size_t>(num_blocks_) * vl_.block_bytes, std::byte{0xFF});
    host_view_ = LayerCacheView{hk_.data(), hv_.data(), kl_, vl_, num_blocks_};

    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> spread(0.3f, 2.0f);
    std::uniform_int_distribution<int> coin(0, 15);
    size_t next = 0;
    indptr_.push_back(0);
    vmax_.assign(c.lens.size() * static_cast<size_t>(nkv), 0.0);
    for (size_t i = 0; i < c.lens.size(); ++i) {
      const int len = c.lens[i];
      const int nb = (len + bt - 1) / bt;
      for (int b = 0; b < nb; ++b) indices_.push_back(pool[next++]);
      indptr_.push_back(static_cast<int32_t>(indices_.size()));
      seq_lens_.push_back(len);
      q_indptr_.push_back(static_cast<int32_t>(i));
      std::vector<int64_t> slots(static_cast<size_t>(len));
      std::vector<float> k(static_cast<size_t>(len) * nkv * hd), v(k.size());
      for (int t = 0; t < len; ++t) {
        slots[t] = static_cast<int64_t>(indices_[indptr_[i] + t / bt]) * bt + t % bt;
        for (int h = 0; h < nkv; ++h) {
          for (float* dst : {&k[(static_cast<size_t>(t) * nkv + h) * hd],
                             &v[(static_cast<size_t>(t) * nkv + h) * hd]}) {
            const float sigma = spread(rng_);
            for (int d = 0; d < hd; ++d) dst[d] = sigma * normal(rng_);
            if (coin(rng_) == 0) dst[coin(rng_) % hd] *= 8.0f;  // an outlier
          }
        }
      }
      write_kv_reference(spec_, host_view_, slots, k.data(), v.data());
      // Largest |V| as the cache holds it (dequantized, model space), per kv head.
      std::vector<float> row(static_cast<size_t>(hd));
      for (int t = 0; t < len; ++t) {
        const int32_t block = indices_[indptr_[i] + t / bt];
        for (int h = 0; h < nkv; ++h) {
          const std::byte* base = host_view_.block(KvSide::kV, block);
          quant::decode_row_unrotated(c.vd(), base + vl_.value_offset(h, t % bt),
                                      base + vl_.scale_offset(h, t % bt), spec_.v_scale.for_head(h),
                                      row);
          double& m = vmax_[i * nkv + h];
          for (float x : row) m = std::max(m, static_cast<double>(std::fabs(x)));
        }
      }
    }
    q_indptr_.push_back(static_cast<int32_t>(c.lens.size()));
    q_.resize(c.lens.size() * static_cast<size_t>(spec_.num_q_heads) * hd);
    for (float& x : q_) x = 2.5f * normal(rng_);
  }

  const LayerKvSpec& spec() const { return spec_; }
  float softmax_scale() const { return 1.0f / std::sqrt(static_cast<float>(case_.head_dim)); }

  BlockTableView host_table() const {
    BlockTableView bt;
    bt.indptr = indptr_.data();
    bt.indices = indices_.data();
    bt.seq_lens = seq_lens_.data();
    bt.num_seqs = static_cast<int32_t>(case_.lens.size());
    bt.block_tokens = case_.block_tokens;
    return bt;
  }
  const std::vector<int32_t>& q_indptr() const { return q_indptr_; }
  const std::vector<int32_t>& indptr() const { return indptr_; }
  const std::vector<int32_t>& indices() const { return indices_; }
  const std::vector<int32_t>& seq_lens() const { return seq_lens_; }
  const std::vector<float>& q() const { return q_; }
  const LayerCacheView& host_view() const { return host_view_; }
  int32_t num_blocks() const { return num_blocks_; }

  std::vector<float> reference() const {
    std::vector<float> out(q_.size() / case_.head_dim * case_.head_dim,
                           std::numeric_limits<float>::quiet_NaN());
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

  // Largest |error| / max |V| of the last check (NaN-free elements only).
  double worst() const { return worst_; }

  ::testing::AssertionResult check(const std::vector<float>& got,
                                   const std::vector<float>& want) const {
    const int hd = case_.head_dim, nq = spec_.num_q_heads;
    const double tol = tolerance(case_.dtype, case_.vd());
    int bad = 0;
    worst_ = 0.0;
    std::ostringstream msg;
    for (size_t i = 0; i < case_.lens.size(); ++i)
      for (int h = 0; h < nq; ++h) {
        const double vmax = vmax_[i * case_.num_kv_heads + h / case_.ratio];
        for (int d = 0; d < hd; ++d) {
          const size_t e = (i * nq + h) * hd + d;
          const double err = std::fabs(static_cast<double>(got[e]) - want[e]);
          if (err / vmax > worst_) worst_ = err / vmax;
          if (!(err <= tol * vmax)) {
            if (++bad <= 5)
              msg << "\n  seq " << i << " (len " << case_.lens[i] << ") head " << h << " dim " << d
                  << ": got " << got[e] << ", want " << want[e] << " (tol " << tol * vmax << ")";
          }
        }
      }
    if (bad == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << bad << " of " << got.size() << " elements out of tolerance:" << msg.str();
  }

 private:
  DecodeCase case_;
  LayerKvSpec spec_;
  std::mt19937 rng_;
  int32_t num_blocks_ = 0;
  KvSideLayout kl_, vl_;
  std::vector<std::byte> hk_, hv_;
  LayerCacheView host_view_;
  std::vector<int32_t> indptr_, indices_, seq_lens_, q_indptr_;
  std::vector<double> vmax_;
  std::vector<float> q_;
  mutable double worst_ = 0.0;
};

// Runs the cuda_decode backend (device q / out / cache, host block table) with a poisoned
// output and returns what it wrote.
std::vector<float> run_backend(const DecodeProblem& p, float soft_cap) {
  DeviceKvCache dev({p.spec()}, p.num_blocks());
  p.upload(dev);
  DeviceBuffer<float> q(p.q());
  DeviceBuffer<float> out(p.q().size());
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

std::vector<KvDtype> concrete_dtypes() {
  std::vector<KvDtype> out;
  for (const auto& t : kKvDtypeTraits)
    if (t.concrete) out.push_back(t.dtype);
  return out;
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
        DecodeCase c;
        c.dtype = dtype;
        c.head_dim = hd;
        c.block_tokens = bt;
        c.ratio = ratio;
        c.num_kv_heads = 2;
        const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                       AttentionKind::kNonCausal};
        c.kind = kinds[index % 3];
        c.window = std::uniform_int_distribution<int>(20, 700)(rng);
        c.soft_cap = index % 4 == 1 ? 5.0f : 0.0f;
        const int long_len = std::uniform_int_distribution<int>(1500, 4500)(rng);
        c.lens = {1, bt - 1, bt + 1, long_len, 37, 3 * bt};
        std::shuffle(c.lens.begin(), c.lens.end(), rng);
        ++index;
        const unsigned case_seed = seed + static_cast<unsigned>(index);
        const DecodeProblem problem(c, case_seed);
        const std::vector<float> want = problem.reference();
        const std::vector<float> got = run_backend(problem, c.soft_cap);
        EXPECT_TRUE(problem.check(got, want))
            << c.describe() << ", seed " << seed << " (case seed " << case_seed << ")";
        worst = std::max(worst, problem.worst());
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

// The device-level API with forced chunking: one tile per work item (hundreds of splits to
// merge) and one work item per sequence (no merge across splits), GQA ratio 12 (two head
// chunks, the second one partial).
TEST(CudaDecode, SplitCountsAndHeadChunksAgree) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  for (KvDtype dtype : {KvDtype::kFp8E4M3, KvDtype::kInt4PerTokenHead, KvDtype::kBFloat16}) {
    DecodeCase c;
    c.dtype = dtype;
    c.head_dim = 128;
    c.block_tokens = 16;
    c.ratio = 12;
    c.num_kv_heads = 1;
    // fp8: causal with 4500 tokens (282 one-tile splits, more than one merge pass);
    // the others: a sliding window that starts inside a tile.
    c.kind = dtype == KvDtype::kFp8E4M3 ? AttentionKind::kCausal : AttentionKind::kSlidingWindow;
    c.window = 1000;
    c.lens = {dtype == KvDtype::kFp8E4M3 ? 4500 : 2500, 5, 999, 1001};
    const DecodeProblem problem(c, seed);
    const std::vector<float> want = problem.reference();
    DeviceKvCache dev({problem.spec()}, problem.num_blocks());
    problem.upload(dev);
    DeviceBuffer<float> q(problem.q());
    DeviceBuffer<float> out(problem.q().size());
    DeviceBuffer<int32_t> indptr(problem.indptr()), indices(problem.indices()),
        seq_lens(problem.seq_lens());
    for (int chunk : {1, 3, 100000}) {
      cuda::DecodeOptions opt;
      opt.chunk_tiles = chunk;
      const cuda::DecodePlan plan = cuda::plan_decode(problem.spec(), problem.seq_lens(), opt);
      DeviceBuffer<std::byte> ws(plan.workspace_bytes);
      cuda::DecodeArgs a;
      a.q = q.get();
      a.out = out.get();
      a.block_table = problem.host_table();
      a.block_table.indptr = indptr.get();
      a.block_table.indices = indices.get();
      a.block_table.seq_lens = seq_lens.get();
      a.cache = dev.layer_view(0);
      a.softmax_scale = problem.softmax_scale();
      a.workspace = ws.get();
      out.poison();
      cuda::run_decode(problem.spec(), plan, a, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(problem.check(out.download(), want))
          << c.describe() << ", chunk " << chunk << " (" << plan.max_splits << " splits), seed "
          << seed;
    }
  }
}

// The mixed (K, V) pairs through the device-level API (plan_decode / run_decode), so they are
// tested whatever the registered backend's whitelist says: the same grid shape as the K == V
// cases (ragged lengths, sliding window, GQA 1 / 4 / 12, soft-cap, outlier rows).
std::vector<float> run_device(const DecodeProblem& p, float soft_cap) {
  DeviceKvCache dev({p.spec()}, p.num_blocks());
  p.upload(dev);
  DeviceBuffer<float> q(p.q());
  DeviceBuffer<float> out(p.q().size());
  DeviceBuffer<int32_t> indptr(p.indptr()), indices(p.indices()), seq_lens(p.seq_lens());
  const cuda::DecodePlan plan = cuda::plan_decode(p.spec(), p.seq_lens());
  DeviceBuffer<std::byte> ws(plan.workspace_bytes);
  cuda::DecodeArgs a;
  a.q = q.get();
  a.out = out.get();
  a.block_table = p.host_table();
  a.block_table.indptr = indptr.get();
  a.block_table.indices = indices.get();
  a.block_table.seq_lens = seq_lens.get();
  a.cache = dev.layer_view(0);
  a.softmax_scale = p.softmax_scale();
  a.logit_soft_cap = soft_cap;
  a.workspace = ws.get();
  out.poison();
  cuda::run_decode(p.spec(), plan, a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return out.download();
}

using KvPair = std::pair<KvDtype, KvDtype>;

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
      DecodeCase c;
      c.dtype = kd;
      c.v_dtype = vd;
      c.head_dim = hd;
      c.block_tokens = index % 2 == 0 ? 16 : 32;
      c.ratio = ratio;
      c.num_kv_heads = 2;
      const AttentionKind kinds[] = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                     AttentionKind::kNonCausal};
      c.kind = kinds[index % 3];
      c.window = std::uniform_int_distribution<int>(20, 700)(rng);
      c.soft_cap = index % 4 == 1 ? 5.0f : 0.0f;
      const int long_len = std::uniform_int_distribution<int>(1500, 4500)(rng);
      c.lens = {1, c.block_tokens - 1, c.block_tokens + 1, long_len, 37, 3 * c.block_tokens};
      std::shuffle(c.lens.begin(), c.lens.end(), rng);
      ++index;
      const unsigned case_seed = seed + static_cast<unsigned>(index);
      const DecodeProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      const std::vector<float> got = run_device(problem, c.soft_cap);
      EXPECT_TRUE(problem.check(got, want))
          << c.describe() << ", seed " << seed << " (case seed " << case_seed << ")";
      worst = std::max(worst, problem.worst());
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
    [](const ::testing::TestParamInfo<KvPair>& p) {
      return std::string(to_string(p.param.first)) + "__" + std::string(to_string(p.param.second));
    });

// decode_unsupported_reasons accepts exactly the pairs of kv_pairs.h, and a refused pair's
// reason names the pair and what is built instead.
TEST(CudaDecode, AcceptsExactlyTheBuiltPairs) {
  const std::vector<KvDtype> all = concrete_dtypes();
  int accepted = 0;
  for (KvDtype k : all) {
    for (KvDtype v : all) {
      DecodeCase c;
      c.dtype = k;
      c.v_dtype = v;
      c.lens = {1};
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
  DecodeCase c;
  c.lens = {1};
  LayerKvSpec spec = spec_for(c);
  if (cuda_device_count() > 0) {
    EXPECT_TRUE(b->reasons_unsupported(spec, Device::kCuda).empty());
  }
  EXPECT_FALSE(b->reasons_unsupported(spec, Device::kCpu).empty());
  LayerKvSpec mixed = spec;
  mixed.v_dtype = KvDtype::kFp8E5M2;  // a pair outside kv_pairs.h
  mixed.v_scale.kind = ScaleSourceKind::kCheckpoint;
  mixed.v_scale.values = {0.02f};
  EXPECT_FALSE(b->reasons_unsupported(mixed).empty());
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

// Batches with q_len > 1 run the prefill kernel: tests/cuda/prefill_attention_cuda_test.cc.

}  // namespace
}  // namespace kvq
