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
#include <bit>
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

#include "attention/cuda/cuda_generic.h"
#include "attention/cuda/kv_pairs.h"
#include "cuda_test_util.h"
#include "kvq/attention/backend.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/quant/codec.h"

namespace kvq {
namespace {

using test::DeviceBuffer;

struct GenericCase {
  KvDtype k_dtype = KvDtype::kFloat32;
  KvDtype v_dtype = KvDtype::kFloat32;
  int head_dim_k = 8, head_dim_v = 8;
  int block_tokens = 16;
  int num_kv_heads = 1;
  int ratio = 2;
  AttentionKind kind = AttentionKind::kCausal;
  int window = 0;
  float soft_cap = 0.0f;
  bool outliers = false;
  std::vector<int> q_lens, kv_lens;

  std::string describe() const {
    std::ostringstream os;
    os << "K " << to_string(k_dtype) << " / V " << to_string(v_dtype) << ", head_dim " << head_dim_k
       << "/" << head_dim_v << ", block " << block_tokens << ", kv heads " << num_kv_heads
       << " x ratio " << ratio << ", " << to_string(kind);
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

LayerKvSpec spec_for(const GenericCase& c) {
  LayerKvSpec s;
  s.layer = 2;
  s.k_dtype = c.k_dtype;
  s.v_dtype = c.v_dtype;
  s.attention = c.kind;
  s.sliding_window = c.window;
  s.num_kv_heads = c.num_kv_heads;
  s.num_q_heads = c.num_kv_heads * c.ratio;
  s.head_dim_k = c.head_dim_k;
  s.head_dim_v = c.head_dim_v;
  s.block_tokens = c.block_tokens;
  s.model_dtype = KvDtype::kFloat32;
  set_scale(s.k_scale, c.k_dtype, c.num_kv_heads);
  set_scale(s.v_scale, c.v_dtype, c.num_kv_heads);
  return s;
}

// fp32 arithmetic over exactly decoded values: the error is rounding only. Allowed per element,
// relative to the largest |V| of the (sequence, kv head): a small base, plus the logit error of
// an fp32 dot product (a few units of 2^-24 of scale |q| max|k|), which moves softmax weights.
constexpr double kBaseTol = 1e-4;

class GenericProblem {
 public:
  GenericProblem(const GenericCase& c, unsigned seed) : case_(c), spec_(spec_for(c)), rng_(seed) {
    const int bt = c.block_tokens, dk = c.head_dim_k, dv = c.head_dim_v, nkv = c.num_kv_heads;
    int needed = 0;
    for (int len : c.kv_lens) needed += (len + bt - 1) / bt;
    num_blocks_ = needed + 2;
    std::vector<int32_t> pool(static_cast<size_t>(num_blocks_));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng_);
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
        const float sigma = spread(rng_);
        for (int d = 0; d < n; ++d) dst[d] = sigma * normal(rng_);
        if (coin(rng_) == 0) dst[coin(rng_) % n] *= outlier;
      };
      for (int t = 0; t < len; ++t) {
        slots[t] = static_cast<int64_t>(indices_[indptr_[i] + t / bt]) * bt + t % bt;
        for (int h = 0; h < nkv; ++h) {
          fill(&k[(static_cast<size_t>(t) * nkv + h) * dk], dk);
          fill(&v[(static_cast<size_t>(t) * nkv + h) * dv], dv);
        }
      }
      write_kv_reference(spec_, host_view_, slots, k.data(), v.data());
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
      x = 2.5f * normal(rng_);
      if (c.outliers && coin(rng_) == 0) x *= 6.0f;
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

  void upload(const DeviceKvCache& dev) const {
    const LayerCacheView v = dev.layer_view(0);
    EXPECT_EQ(cudaMemcpy(v.k_base, hk_.data(), hk_.size(), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.v_base, hv_.data(), hv_.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }

  double worst() const { return worst_; }

  ::testing::AssertionResult check(const std::vector<float>& got,
                                   const std::vector<float>& want) const {
    const int dk = case_.head_dim_k, dv = case_.head_dim_v, nq = spec_.num_q_heads;
    const double u = std::ldexp(1.0, -24);
    const double tol = kBaseTol * (traits(case_.v_dtype).rotated ? 4.0 : 1.0);
    int bad = 0;
    worst_ = 0.0;
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
          const double logit_tol = 16.0 * u * softmax_scale() * std::sqrt(qn) * knorm_[g];
          const double allowed = (tol + logit_tol) * vmax_[g];
          for (int d = 0; d < dv; ++d) {
            const size_t e = (static_cast<size_t>(qi) * nq + h) * dv + d;
            const double err = std::fabs(static_cast<double>(got[e]) - want[e]);
            if (err / allowed > worst_) worst_ = err / allowed;
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
  GenericCase case_;
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
std::vector<float> run_backend(const GenericProblem& p, float soft_cap) {
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

// run_generic directly, every table on the device, on a stream; `decode` passes no q_indptr
// (the batch must have one query per sequence).
std::vector<float> run_device_api(const GenericProblem& p, float soft_cap, bool decode) {
  DeviceKvCache dev({p.spec()}, p.num_blocks());
  p.upload(dev);
  DeviceBuffer<float> q(p.q());
  DeviceBuffer<float> out(p.out_size());
  DeviceBuffer<int32_t> q_indptr(p.q_indptr()), indptr(p.indptr()), indices(p.indices()),
      seq_lens(p.seq_lens());
  const auto n = static_cast<int32_t>(p.seq_lens().size());
  const cuda::GenericPlan plan =
      decode ? cuda::plan_generic_decode(p.spec(), n)
             : cuda::plan_generic_prefill(p.spec(), p.q_indptr(), p.seq_lens());
  EXPECT_EQ(plan.workspace_bytes, 0u);
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  out.poison();
  cuda::GenericArgs a;
  a.q = q.get();
  a.out = out.get();
  a.q_indptr = decode ? nullptr : q_indptr.get();
  a.block_table = p.host_table();
  a.block_table.indptr = indptr.get();
  a.block_table.indices = indices.get();
  a.block_table.seq_lens = seq_lens.get();
  a.cache = dev.layer_view(0);
  a.softmax_scale = p.softmax_scale();
  a.logit_soft_cap = soft_cap;
  cuda::run_generic(p.spec(), plan, a, stream);
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

bool storable(KvDtype d, int hd) {
  return head_dim_unsupported_reason(d, hd).empty();
}

// A ragged batch: a pure prefill, a chunk after a cached prefix, a single query, a short pure
// prefill and a second chunk, shuffled.
void ragged_batch(GenericCase& c, std::mt19937& rng) {
  auto uni = [&](int a, int b) { return std::uniform_int_distribution<int>(a, b)(rng); };
  const int pure = uni(40, 150);
  const int chunk = uni(2, 40);
  const int chunk2 = uni(33, 90);
  c.q_lens = {pure, chunk, 1, uni(1, 20), chunk2};
  c.kv_lens = {pure, chunk + uni(1, 200), uni(1, 200), 0, chunk2 + uni(20, 100)};
  c.kv_lens[3] = c.q_lens[3];
  std::vector<size_t> order(c.q_lens.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const GenericCase d = c;
  for (size_t i = 0; i < order.size(); ++i) {
    c.q_lens[i] = d.q_lens[order[i]];
    c.kv_lens[i] = d.kv_lens[order[i]];
  }
}

void decode_batch(GenericCase& c, std::mt19937& rng) {
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
      GenericCase c;
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
      const GenericProblem problem(c, case_seed);
      const std::vector<float> want = problem.reference();
      const std::vector<float> got = mode == 0 ? run_backend(problem, c.soft_cap)
                                               : run_device_api(problem, c.soft_cap, mode == 2);
      EXPECT_TRUE(problem.check(got, want))
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
    GenericCase c;
    c.k_dtype = kd;
    c.v_dtype = vd;
    c.head_dim_k = c.head_dim_v = kd == KvDtype::kNvfp4 ? 16 : 8;
    c.num_kv_heads = 2;
    c.ratio = 2;
    c.q_lens = {5, 1, 3};
    c.kv_lens = {5, 37, 20};
    const GenericProblem problem(c, seed);
    EXPECT_TRUE(problem.check(run_backend(problem, 0.0f), problem.reference()))
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
  s.k_dtype = KvDtype::kFp8E5M2;  // a mixed pair outside kv_pairs.h
  EXPECT_FALSE(cuda::generic_unsupported_reasons(s).empty());
  if (cuda_device_count() == 0) return;
  s.k_dtype = KvDtype::kFloat32;
  EXPECT_TRUE(find_attention_backend("cuda")->reasons_unsupported(s, Device::kCuda).empty());
}

// ---- write_kv_cuda at small head dims ---------------------------------------------------

std::vector<float> make_row(std::mt19937& rng, int dim, int kind) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> spread(0.05f, 3.0f);
  std::uniform_int_distribution<int> pick(0, dim - 1);
  std::vector<float> x(static_cast<size_t>(dim));
  const float sigma = spread(rng);
  for (float& e : x) e = sigma * normal(rng);
  const float inf = std::numeric_limits<float>::infinity();
  switch (kind) {
    case 1:  // outliers
      x[pick(rng)] *= 40.0f;
      break;
    case 2:  // zeros of both signs
      for (size_t i = 0; i < x.size(); ++i) x[i] = i % 3 == 0 ? -0.0f : 0.0f;
      break;
    case 3:  // NaN and infinities
      x[pick(rng)] = std::numeric_limits<float>::quiet_NaN();
      x[pick(rng)] = inf;
      x[pick(rng)] = -inf;
      break;
    case 4:  // huge values (saturation, scale caps)
      for (float& e : x) e *= 1e37f;
      x[pick(rng)] = 3.4e38f;
      break;
    case 5:  // tiny values (subnormal scales)
      for (float& e : x) e *= 1e-39f;
      break;
    case 6:  // rounding ties of the narrow formats
      for (float& e : x) {
        const int m = std::uniform_int_distribution<int>(1, 10)(rng);
        uint32_t b = std::bit_cast<uint32_t>(e);
        b = (b & ~((1u << (23 - m)) - 1u)) | (1u << (22 - m));
        e = std::bit_cast<float>(b);
      }
      break;
    case 7:  // int grid ties
      for (float& e : x)
        e = 0.5f * static_cast<float>(std::uniform_int_distribution<int>(-40, 40)(rng));
      break;
    default:
      break;
  }
  return x;
}

TEST(CudaGeneric, CacheWriteBitIdenticalAtSmallHeadDims) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  std::vector<KvDtype> dtypes;
  for (const auto& t : kKvDtypeTraits)
    if (t.concrete) dtypes.push_back(t.dtype);
  int index = 0;
  for (KvDtype kd : dtypes) {
    for (int hd : {2, 8, 16, 24, 32, 48, 96}) {
      const KvDtype vd = dtypes[static_cast<size_t>(index++ + 1) % dtypes.size()];
      if (!storable(kd, hd) || !storable(vd, hd)) continue;
      LayerKvSpec spec;
      spec.layer = 4;
      spec.k_dtype = kd;
      spec.v_dtype = vd;
      spec.num_kv_heads = 3;
      spec.num_q_heads = 6;
      spec.head_dim_k = spec.head_dim_v = hd;
      spec.block_tokens = index % 2 == 0 ? 16 : 32;
      set_scale(spec.k_scale, kd, 3);
      set_scale(spec.v_scale, vd, 3);
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
      const KvSideLayout kl = spec.layout(KvSide::kK), vl = spec.layout(KvSide::kV);
      std::vector<std::byte> hk(num_blocks * kl.block_bytes, std::byte{0xFF});
      std::vector<std::byte> hv(num_blocks * vl.block_bytes, std::byte{0xFF});
      LayerCacheView host{hk.data(), hv.data(), kl, vl, num_blocks};
      write_kv_reference(spec, host, valid_slots, kv_k.data(), kv_v.data());

      DeviceKvCache cache({spec}, num_blocks);
      DeviceBuffer<int64_t> d_slots(slots);
      DeviceBuffer<float> d_k(k), d_v(v);
      write_kv_cuda(spec, cache.layer_view(0), d_slots.get(), n, d_k.get(), d_v.get());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (KvSide side : {KvSide::kK, KvSide::kV}) {
        const auto& want = side == KvSide::kK ? hk : hv;
        std::vector<std::byte> got(want.size());
        ASSERT_EQ(cudaMemcpy(got.data(), cache.layer_view(0).base(side), got.size(),
                             cudaMemcpyDeviceToHost),
                  cudaSuccess);
        size_t first = want.size();
        for (size_t i = 0; i < want.size() && first == want.size(); ++i)
          if (got[i] != want[i]) first = i;
        EXPECT_EQ(first, want.size())
            << to_string(side) << " " << to_string(spec.dtype(side)) << ", head_dim " << hd
            << ", block " << bt << ": first differing byte " << first << " (got 0x" << std::hex
            << (first < want.size() ? static_cast<int>(got[first]) : 0) << ", want 0x"
            << (first < want.size() ? static_cast<int>(want[first]) : 0) << std::dec << "), seed "
            << seed;
      }
    }
  }
}

}  // namespace
}  // namespace kvq
