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
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "attention/cuda/cuda_prefill.h"
#include "attention/cuda/kv_pairs.h"
#include "cuda_test_util.h"
#include "kvq/attention/backend.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/quant/codec.h"

namespace kvq {
namespace {

using test::DeviceBuffer;

struct PrefillCase {
  KvDtype k_dtype = KvDtype::kBFloat16;
  KvDtype v_dtype = KvDtype::kBFloat16;
  int head_dim = 128;
  int block_tokens = 16;
  int num_kv_heads = 1;
  int ratio = 4;
  AttentionKind kind = AttentionKind::kCausal;
  int window = 0;
  float soft_cap = 0.0f;
  bool outliers = false;
  std::vector<int> q_lens, kv_lens;

  std::string describe() const {
    std::ostringstream os;
    os << "K " << to_string(k_dtype) << " / V " << to_string(v_dtype) << ", head_dim " << head_dim
       << ", block " << block_tokens << ", kv heads " << num_kv_heads << " x ratio " << ratio
       << ", " << to_string(kind);
    if (kind == AttentionKind::kSlidingWindow) os << " W=" << window;
    os << ", soft_cap " << soft_cap << (outliers ? ", outlier-heavy" : "") << ", (q_len/kv_len):";
    for (size_t i = 0; i < q_lens.size(); ++i) os << " " << q_lens[i] << "/" << kv_lens[i];
    return os.str();
  }
};

void set_scale(ScaleSource& sc, KvDtype d, int num_kv_heads) {
  const auto& t = traits(d);
  if (t.uses_tensor_scale) {
    sc.kind = ScaleSourceKind::kCheckpoint;
    const float base = d == KvDtype::kNvfp4 ? 0.004f : 0.02f;
    for (int h = 0; h < num_kv_heads; ++h) sc.values.push_back(base * (1.0f + 0.5f * h));
  } else if (t.scale_kind == ScaleKind::kPerTokenHead) {
    sc.kind = ScaleSourceKind::kDynamic;
  }
}

LayerKvSpec spec_for(const PrefillCase& c) {
  LayerKvSpec s;
  s.layer = 1;
  s.k_dtype = c.k_dtype;
  s.v_dtype = c.v_dtype;
  s.attention = c.kind;
  s.sliding_window = c.window;
  s.num_kv_heads = c.num_kv_heads;
  s.num_q_heads = c.num_kv_heads * c.ratio;
  s.head_dim_k = s.head_dim_v = c.head_dim;
  s.block_tokens = c.block_tokens;
  set_scale(s.k_scale, c.k_dtype, c.num_kv_heads);
  set_scale(s.v_scale, c.v_dtype, c.num_kv_heads);
  return s;
}

// Error allowed per element, relative to the largest |V| of the (sequence, kv head): the
// decode test's bounds (the same operand types and fp32 accumulation), by the coarser side,
// plus a term for large logits (see check()).
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

class PrefillProblem {
 public:
  PrefillProblem(const PrefillCase& c, unsigned seed) : case_(c), spec_(spec_for(c)), rng_(seed) {
    const int bt = c.block_tokens, hd = c.head_dim, nkv = c.num_kv_heads;
    int needed = 0;
    for (int len : c.kv_lens) needed += (len + bt - 1) / bt;
    num_blocks_ = needed + 2;
    std::vector<int32_t> pool(static_cast<size_t>(num_blocks_));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng_);
    const KvSideLayout vl = spec_.layout(KvSide::kV);
    const KvSideLayout kl = spec_.layout(KvSide::kK);
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
      std::vector<float> k(static_cast<size_t>(len) * nkv * hd), v(k.size());
      for (int t = 0; t < len; ++t) {
        slots[t] = static_cast<int64_t>(indices_[indptr_[i] + t / bt]) * bt + t % bt;
        for (int h = 0; h < nkv; ++h) {
          for (float* dst : {&k[(static_cast<size_t>(t) * nkv + h) * hd],
                             &v[(static_cast<size_t>(t) * nkv + h) * hd]}) {
            const float sigma = spread(rng_);
            for (int d = 0; d < hd; ++d) dst[d] = sigma * normal(rng_);
            if (coin(rng_) == 0) dst[coin(rng_) % hd] *= outlier;
          }
        }
      }
      write_kv_reference(spec_, host_view_, slots, k.data(), v.data());
      std::vector<float> row(static_cast<size_t>(hd));
      for (int t = 0; t < len; ++t) {
        const int32_t block = indices_[indptr_[i] + t / bt];
        for (int h = 0; h < nkv; ++h) {
          const std::byte* base = host_view_.block(KvSide::kV, block);
          quant::decode_row_unrotated(c.v_dtype, base + vl.value_offset(h, t % bt),
                                      base + vl.scale_offset(h, t % bt), spec_.v_scale.for_head(h),
                                      row);
          double& m = vmax_[i * nkv + h];
          for (float x : row) m = std::max(m, static_cast<double>(std::fabs(x)));
          const std::byte* kbase = host_view_.block(KvSide::kK, block);
          quant::decode_row_unrotated(c.k_dtype, kbase + kl.value_offset(h, t % bt),
                                      kbase + kl.scale_offset(h, t % bt), spec_.k_scale.for_head(h),
                                      row);
          double n2 = 0.0;
          for (float x : row) n2 += static_cast<double>(x) * x;
          knorm_[i * nkv + h] = std::max(knorm_[i * nkv + h], std::sqrt(n2));
        }
      }
    }
    q_.resize(static_cast<size_t>(q_indptr_.back()) * spec_.num_q_heads * hd);
    for (float& x : q_) {
      x = 2.5f * normal(rng_);
      if (c.outliers && coin(rng_) == 0) x *= 6.0f;
    }
  }

  const LayerKvSpec& spec() const { return spec_; }
  float softmax_scale() const { return 1.0f / std::sqrt(static_cast<float>(case_.head_dim)); }
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

  std::vector<float> reference() const {
    std::vector<float> out(q_.size(), std::numeric_limits<float>::quiet_NaN());
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

  void upload(const DeviceKvCache& dev) const {
    const LayerCacheView v = dev.layer_view(0);
    EXPECT_EQ(cudaMemcpy(v.k_base, hk_.data(), hk_.size(), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.v_base, hv_.data(), hv_.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }

  double worst() const { return worst_; }

  ::testing::AssertionResult check(const std::vector<float>& got,
                                   const std::vector<float>& want) const {
    const int hd = case_.head_dim, nq = spec_.num_q_heads;
    const double tol = tolerance(case_.k_dtype, case_.v_dtype);
    // Q (and a float32 K) are rounded to 16-bit MMA operands, so a logit carries an error of
    // about u * |logit terms|: with outlier-heavy K and Q, logits reach hundreds and that
    // error moves the softmax weights. Allowed: 2 u scale |q| max|k| / sqrt(head_dim) more
    // (|q| |k| bounds the logit terms; rounding errors add up like sqrt(head_dim) terms).
    double u = bf16_k(case_.k_dtype) ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    if (case_.k_dtype == KvDtype::kFloat32) u *= 2.0;
    int bad = 0;
    worst_ = 0.0;
    std::ostringstream msg;
    for (size_t i = 0; i + 1 < q_indptr_.size(); ++i)
      for (int qi = q_indptr_[i]; qi < q_indptr_[i + 1]; ++qi)
        for (int h = 0; h < nq; ++h) {
          const size_t g = i * case_.num_kv_heads + h / case_.ratio;
          const double vmax = vmax_[g];
          double qn = 0.0;
          for (int d = 0; d < hd; ++d) {
            const double x = q_[(static_cast<size_t>(qi) * nq + h) * hd + d];
            qn += x * x;
          }
          const double logit_tol =
              2.0 * u * softmax_scale() * std::sqrt(qn) * knorm_[g] / std::sqrt(double(hd));
          const double allowed = (tol + logit_tol) * vmax;
          for (int d = 0; d < hd; ++d) {
            const size_t e = (static_cast<size_t>(qi) * nq + h) * hd + d;
            const double err = std::fabs(static_cast<double>(got[e]) - want[e]);
            if (err / allowed > worst_) worst_ = err / allowed;
            if (!(err <= allowed)) {
              if (++bad <= 5)
                msg << "\n  seq " << i << " query " << qi - q_indptr_[i] << " of "
                    << q_indptr_[i + 1] - q_indptr_[i] << " (kv_len " << seq_lens_[i] << ") head "
                    << h << " dim " << d << ": got " << got[e] << ", want " << want[e] << " (tol "
                    << tol * vmax << ")";
            }
          }
        }
    if (bad == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << bad << " of " << got.size() << " elements out of tolerance:" << msg.str();
  }

 private:
  PrefillCase case_;
  LayerKvSpec spec_;
  std::mt19937 rng_;
  int32_t num_blocks_ = 0;
  std::vector<std::byte> hk_, hv_;
  LayerCacheView host_view_;
  std::vector<int32_t> indptr_, indices_, seq_lens_, q_indptr_;
  std::vector<double> vmax_, knorm_;  // per (sequence, kv head): max |V|, max ||K row||
  std::vector<float> q_;
  mutable double worst_ = 0.0;
};

// The "cuda" backend (device q / out / cache, host tables), output poisoned first.
std::vector<float> run_backend(const PrefillProblem& p, float soft_cap) {
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

// run_prefill directly, every table on the device, on a stream.
std::vector<float> run_device_api(const PrefillProblem& p, float soft_cap) {
  DeviceKvCache dev({p.spec()}, p.num_blocks());
  p.upload(dev);
  DeviceBuffer<float> q(p.q());
  DeviceBuffer<float> out(p.q().size());
  DeviceBuffer<int32_t> q_indptr(p.q_indptr()), indptr(p.indptr()), indices(p.indices()),
      seq_lens(p.seq_lens());
  const cuda::PrefillPlan plan = cuda::plan_prefill(p.spec(), p.q_indptr(), p.seq_lens());
  DeviceBuffer<std::byte> ws(plan.workspace_bytes);
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  out.poison();
  cuda::PrefillArgs a;
  a.q = q.get();
  a.out = out.get();
  a.q_indptr = q_indptr.get();
  a.block_table = p.host_table();
  a.block_table.indptr = indptr.get();
  a.block_table.indices = indices.get();
  a.block_table.seq_lens = seq_lens.get();
  a.cache = dev.layer_view(0);
  a.softmax_scale = p.softmax_scale();
  a.logit_soft_cap = soft_cap;
  a.workspace = ws.get();
  cuda::run_prefill(p.spec(), plan, a, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  return out.download();
}

std::vector<std::pair<KvDtype, KvDtype>> supported_pairs() {
  std::vector<std::pair<KvDtype, KvDtype>> out;
  for (const auto& t : kKvDtypeTraits)
    if (t.concrete) out.push_back({t.dtype, t.dtype});
  for (const auto& p : cuda::kCudaMixedKvPairs) out.push_back(p);
  return out;
}

std::string pair_name(const std::pair<KvDtype, KvDtype>& p) {
  if (p.first == p.second) return std::string(to_string(p.first));
  return std::string(to_string(p.first)) + "__" + std::string(to_string(p.second));
}

// A ragged batch: a pure prefill, a chunk after a cached prefix, a single query, a short pure
// prefill and a second chunk.
void ragged_batch(PrefillCase& c, std::mt19937& rng) {
  auto uni = [&](int a, int b) { return std::uniform_int_distribution<int>(a, b)(rng); };
  const int pure = uni(100, 300);
  const int chunk = uni(2, 64);
  const int chunk2 = uni(65, 160);
  c.q_lens = {pure, chunk, 1, uni(1, 20), chunk2};
  c.kv_lens = {pure, chunk + uni(1, 400), uni(1, 200), 0, chunk2 + uni(20, 200)};
  c.kv_lens[3] = c.q_lens[3];
  std::vector<size_t> order(c.q_lens.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  PrefillCase d = c;
  for (size_t i = 0; i < order.size(); ++i) {
    c.q_lens[i] = d.q_lens[order[i]];
    c.kv_lens[i] = d.kv_lens[order[i]];
  }
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
      PrefillCase c;
      c.k_dtype = kd;
      c.v_dtype = vd;
      c.head_dim = hd;
      c.block_tokens = rep == 0 ? 16 : 32;
      c.ratio = ratios[(index + static_cast<int>(seed % 3)) % 3];
      c.num_kv_heads = c.ratio == 1 ? 2 : 1;
      c.kind = kinds[index % 3];
      c.window = std::uniform_int_distribution<int>(8, 200)(rng);
      c.soft_cap = index % 2 == 1 ? 5.0f : 0.0f;
      c.outliers = (index / 2) % 2 == 1;
      ragged_batch(c, rng);
      const unsigned case_seed = seed + static_cast<unsigned>(index) + 1;
      const PrefillProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      const std::vector<float> got =
          index % 3 == 2 ? run_device_api(problem, c.soft_cap) : run_backend(problem, c.soft_cap);
      EXPECT_TRUE(problem.check(got, want))
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
      PrefillCase c;
      c.k_dtype = kd;
      c.v_dtype = vd;
      c.head_dim = 128;
      c.ratio = index % 2 == 0 ? 12 : 3;
      c.num_kv_heads = 1;
      c.kind = kind;
      c.window = 333;
      c.q_lens = {700, 250};
      c.kv_lens = {1500, 250};
      const PrefillProblem problem(c, seed + static_cast<unsigned>(index++));
      EXPECT_TRUE(problem.check(run_backend(problem, 0.0f), problem.reference()))
          << c.describe() << ", seed " << seed;
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
    PrefillCase c;
    c.k_dtype = kd;
    c.v_dtype = vd;
    c.head_dim = 64;
    c.ratio = 4;
    c.kind = index == 1 ? AttentionKind::kSlidingWindow : AttentionKind::kCausal;
    c.window = 40;
    c.q_lens = {40, 1};
    c.kv_lens = {150, 20};
    const PrefillProblem problem(c, seed + static_cast<unsigned>(index++));
    EXPECT_TRUE(problem.check(run_device_api(problem, 0.0f), problem.reference()))
        << c.describe() << ", seed " << seed;
  }
}

TEST(CudaPrefill, PlanRejectsBadBatches) {
  PrefillCase c;
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
  PrefillCase c;
  LayerKvSpec spec = spec_for(c);
  if (cuda_device_count() > 0) {
    EXPECT_TRUE(b->reasons_unsupported(spec, Device::kCuda).empty());
  }
  LayerKvSpec unlisted = spec;
  unlisted.k_dtype = KvDtype::kNvfp4;
  unlisted.v_dtype = KvDtype::kFp8E5M2;
  set_scale(unlisted.k_scale, KvDtype::kNvfp4, 1);
  set_scale(unlisted.v_scale, KvDtype::kFp8E5M2, 1);
  EXPECT_FALSE(b->reasons_unsupported(unlisted).empty());
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
