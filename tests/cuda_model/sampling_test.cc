// Device sampling against the CPU sampler's rules: greedy equals the host argmax (ties, NaNs);
// sampled tokens follow the exact filtered distribution (chi-square over ~20000 draws) for
// temperature / top-k / top-p / min-p settings on both kernel paths; draws repeat for the
// same (seed, step). Every test skips without a CUDA device.
#include "model/cuda/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"

namespace kvq::test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The CPU sampler's greedy loop (src/engine/sampler.cc) as written.
int32_t cpu_greedy(const float* l, int n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (l[i] > l[best]) best = i;
  return best;
}

// Greedy as specified: the largest non-NaN logit, lowest id on ties, 0 when all are NaN.
int32_t reference_greedy(const float* l, int n) {
  int32_t best = -1;
  for (int32_t i = 0; i < n; ++i)
    if (!std::isnan(l[i]) && (best < 0 || l[i] > l[best])) best = i;
  return best < 0 ? 0 : best;
}

// The exact probability of each token under the CPU sampler's rules (sort by logit /
// temperature, ties lower id first; top-k, softmax, top-p, min-p; draw in proportion).
std::vector<double> reference_distribution(const std::vector<float>& logits,
                                           const DeviceSampling& p) {
  std::vector<std::pair<float, int32_t>> c;
  for (int32_t i = 0; i < static_cast<int32_t>(logits.size()); ++i)
    if (!std::isnan(logits[i])) c.push_back({logits[i] / p.temperature, i});
  std::sort(c.begin(), c.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  size_t keep = c.size();
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < keep) keep = static_cast<size_t>(p.top_k);
  std::vector<double> prob(keep);
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i)
    total += prob[i] = std::exp(static_cast<double>(c[i].first) - c[0].first);
  for (auto& q : prob) q /= total;
  if (p.top_p < 1.0f) {
    double cum = 0.0;
    size_t k = 0;
    while (k < keep) {
      cum += prob[k++];
      if (cum >= static_cast<double>(p.top_p)) break;
    }
    keep = k;
  }
  if (p.min_p > 0.0f) {
    const double floor = static_cast<double>(p.min_p) * prob[0];
    size_t k = 1;
    while (k < keep && prob[k] >= floor) ++k;
    keep = k;
  }
  double kept = 0.0;
  for (size_t i = 0; i < keep; ++i) kept += prob[i];
  std::vector<double> q(logits.size(), 0.0);
  for (size_t i = 0; i < keep; ++i) q[static_cast<size_t>(c[i].second)] = prob[i] / kept;
  return q;
}

// With the workspace, greedy rows are reduced over many blocks first; without it (nullptr), one
// block reads each row.
std::vector<int32_t> sample(const std::vector<float>& logits, int rows, int vocab,
                            const std::vector<DeviceSampling>& params, bool workspace = true) {
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<DeviceSampling> d_params(params);
  DeviceBuffer<int32_t> d_out(static_cast<size_t>(rows));
  d_out.poison();
  DeviceBuffer<unsigned char> ws(cuda::sampling_workspace_bytes(rows, vocab));
  ws.poison();
  cuda::sample_tokens(d_logits.get(), rows, vocab, d_params.get(), d_out.get(),
                      workspace ? ws.get() : nullptr, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d_out.download();
}

std::string describe(const DeviceSampling& p) {
  char b[160];
  std::snprintf(b, sizeof b, "temperature %g top_k %d top_p %g min_p %g", p.temperature, p.top_k,
                p.top_p, p.min_p);
  return b;
}

// Upper quantile of chi-square(df) at z standard deviations (Wilson-Hilferty).
double chi2_quantile(double df, double z) {
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1.0 - a + z * std::sqrt(a), 3.0);
}

TEST(DeviceSampling, GreedyIsTheArgmaxWithTiesAndNaNs) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  std::mt19937 rng(seed);
  for (int vocab : {1, 5, 1000, 4099, 151936}) {
    const int rows = vocab > 10000 ? 64 : 200;
    std::vector<float> logits(static_cast<size_t>(rows) * vocab);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    // Logits on a coarse grid so the maximum is often shared.
    for (auto& x : logits) x = std::round(nd(rng) * 2.0f) / 2.0f;
    std::uniform_int_distribution<int> pos(0, vocab - 1);
    std::vector<DeviceSampling> params(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      float* l = &logits[static_cast<size_t>(r) * vocab];
      const float top = *std::max_element(l, l + vocab) + 0.5f * static_cast<float>(r % 3);
      for (int j = 0; j < 1 + r % 4; ++j) l[pos(rng)] = top;  // planted ties at the maximum
      for (int j = 0; j < r % 5; ++j) l[pos(rng)] = kNaN;
      if (r % 7 == 1) l[pos(rng)] = kNaN;
      if (r % 11 == 2) l[0] = kNaN;
      if (r % 13 == 3) l[pos(rng)] = -kInf;
      if (r == 4) std::fill(l, l + vocab, kNaN);
      if (r == 5) std::fill(l, l + vocab, -kInf);
      // Greedy by temperature 0, and by top_k 1 at any temperature (as on the CPU).
      params[static_cast<size_t>(r)].temperature = r % 2 ? 0.0f : 0.8f;
      params[static_cast<size_t>(r)].top_k = r % 2 ? 0 : 1;
      params[static_cast<size_t>(r)].seed = static_cast<uint64_t>(r);
    }
    // Every other row samples instead (the slices pass skips it; its token is checked
    // elsewhere) in a second batch, so greedy rows share a launch with sampling ones.
    std::vector<DeviceSampling> mixed = params;
    for (int r = 0; r < rows; r += 2) mixed[static_cast<size_t>(r)] = {0.7f, 0, 1.0f, 0.0f, 7, 1};
    const auto out = sample(logits, rows, vocab, params);
    const auto one_block = sample(logits, rows, vocab, params, false);
    const auto out_mixed = sample(logits, rows, vocab, mixed);
    for (int r = 0; r < rows; ++r) {
      const float* l = &logits[static_cast<size_t>(r) * vocab];
      ASSERT_EQ(one_block[static_cast<size_t>(r)], out[static_cast<size_t>(r)])
          << "vocab " << vocab << " row " << r << " seed " << seed;
      if (r % 2 == 1) {
        ASSERT_EQ(out_mixed[static_cast<size_t>(r)], out[static_cast<size_t>(r)])
            << "vocab " << vocab << " row " << r << " seed " << seed;
      }
      ASSERT_EQ(out[static_cast<size_t>(r)], reference_greedy(l, vocab))
          << "vocab " << vocab << " row " << r << " seed " << seed;
      // The CPU loop agrees except when logit 0 is NaN (it then returns 0: NaN compares false).
      if (!std::isnan(l[0])) {
        ASSERT_EQ(out[static_cast<size_t>(r)], cpu_greedy(l, vocab))
            << "vocab " << vocab << " row " << r << " seed " << seed;
      }
    }
  }
}

struct Setting {
  int vocab;
  bool grid;  // logits on a 0.5 grid: many ties, some straddling a cut
  DeviceSampling p;
  float spread = 0.0f;  // logits' standard deviation (0: 1.5, or 2 for vocab > 100)
};

// Draws ~20000 tokens (256 rows x 80 steps, every row its own seed) and compares their counts
// with the exact distribution: nothing outside its support, chi-square below its 1 - 3e-7
// quantile.
void check_distribution(const Setting& s, std::mt19937& rng, unsigned seed) {
  const int rows = 256, steps = 80, vocab = s.vocab;
  std::normal_distribution<float> nd(0.0f, s.spread > 0.0f ? s.spread : vocab > 100 ? 2.0f : 1.5f);
  std::vector<float> one(static_cast<size_t>(vocab));
  for (auto& x : one) x = s.grid ? std::round(nd(rng) * 2.0f) / 2.0f : nd(rng);
  std::uniform_int_distribution<int> pos(0, vocab - 1);
  one[static_cast<size_t>(pos(rng))] = kNaN;
  one[static_cast<size_t>(pos(rng))] = -kInf;
  const std::vector<double> q = reference_distribution(one, s.p);

  std::vector<float> logits;
  for (int r = 0; r < rows; ++r) logits.insert(logits.end(), one.begin(), one.end());
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<int32_t> d_out(rows);
  DeviceBuffer<DeviceSampling> d_params(static_cast<size_t>(rows));
  std::vector<double> count(static_cast<size_t>(vocab), 0.0);
  const uint64_t seed_base = (static_cast<uint64_t>(seed) << 20) + 977;
  for (int step = 0; step < steps; ++step) {
    std::vector<DeviceSampling> params(static_cast<size_t>(rows), s.p);
    for (int r = 0; r < rows; ++r) {
      params[static_cast<size_t>(r)].seed = seed_base + static_cast<uint64_t>(r);
      params[static_cast<size_t>(r)].step = static_cast<uint64_t>(step);
    }
    d_params.upload(params);
    cuda::sample_tokens(d_logits.get(), rows, vocab, d_params.get(), d_out.get(), nullptr, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int32_t tok : d_out.download()) {
      ASSERT_TRUE(tok >= 0 && tok < vocab) << tok;
      ASSERT_GT(q[static_cast<size_t>(tok)], 0.0)
          << "token " << tok << " (logit " << one[static_cast<size_t>(tok)]
          << ") is outside the support; " << describe(s.p) << " seed " << seed;
      count[static_cast<size_t>(tok)] += 1.0;
    }
  }
  const double n = static_cast<double>(rows) * steps;
  // Pool the bins expected to see fewer than 5 draws.
  double chi2 = 0.0, pooled_e = 0.0, pooled_o = 0.0, tv = 0.0;
  int bins = 0, support = 0;
  for (int i = 0; i < vocab; ++i) {
    const double e = n * q[static_cast<size_t>(i)], o = count[static_cast<size_t>(i)];
    tv += std::abs(o - e) / n / 2.0;
    if (e == 0.0) continue;
    ++support;
    if (e < 5.0) {
      pooled_e += e;
      pooled_o += o;
      continue;
    }
    chi2 += (o - e) * (o - e) / e;
    ++bins;
  }
  if (pooled_e > 0.0) {
    chi2 += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
    ++bins;
  }
  if (bins < 2) {  // one token carries everything: it must be the only one drawn
    EXPECT_EQ(support, 1) << describe(s.p);
    return;
  }
  const double limit = chi2_quantile(bins - 1, 5.0);
  EXPECT_LT(chi2, limit) << describe(s.p) << " vocab " << vocab << (s.grid ? " (grid)" : "")
                         << ": support " << support << ", " << bins << " bins, TV " << tv
                         << ", seed " << seed;
  std::printf("  %-56s vocab %5d%s support %4d chi2 %8.1f (limit %8.1f, df %d) TV %.4f\n",
              describe(s.p).c_str(), vocab, s.grid ? " grid" : "     ", support, chi2, limit,
              bins - 1, tv);
}

DeviceSampling params(float temperature, int top_k, float top_p, float min_p) {
  DeviceSampling p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  return p;
}

TEST(DeviceSampling, DrawsFollowTheFilteredDistribution) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  std::mt19937 rng(seed);
  const std::vector<Setting> settings = {
      // top_k <= 512: candidates ranked in shared memory.
      {64, false, params(0.8f, 10, 1.0f, 0.0f)},
      {64, false, params(1.2f, 40, 0.7f, 0.0f)},
      {64, false, params(1.0f, 50, 1.0f, 0.08f)},
      {64, false, params(0.7f, 30, 0.9f, 0.02f)},
      {64, true, params(1.0f, 12, 0.8f, 0.0f)},
      {2048, false, params(1.0f, 300, 0.6f, 0.01f)},
      // Flat logits: too many within the smallest distance of the max for the shared-memory
      // gather, so the radix select finds the cut.
      {4096, false, params(1.0f, 100, 0.9f, 0.0f), 1e-3f},
      // No top_k (or top_k > 512): radix selects over the whole row.
      {64, false, params(1.0f, 0, 1.0f, 0.0f)},
      {64, false, params(1.5f, 0, 0.6f, 0.0f)},
      {64, false, params(1.0f, 0, 1.0f, 0.05f)},
      {64, false, params(0.9f, 0, 0.85f, 0.01f)},
      {64, true, params(1.0f, 0, 0.3f, 0.0f)},
      {64, false, params(1.0f, 64, 1.0f, 0.0f)},  // top_k == vocab: off
      {2048, false, params(0.8f, 1100, 0.5f, 0.0f)},
      {2048, false, params(2.0f, 1500, 1.0f, 0.3f)},
      {2048, true, params(1.0f, 1100, 1.0f, 0.0f)},
      {2048, true, params(1.0f, 0, 0.2f, 0.0f)},
      {2048, true, params(1.0f, 1300, 0.9f, 0.0f)},
  };
  for (const auto& s : settings) {
    SCOPED_TRACE(describe(s.p) + " vocab " + std::to_string(s.vocab));
    check_distribution(s, rng, seed);
    if (HasFatalFailure()) return;
  }
}

// A 152k vocabulary: every draw lies in the exact support of its row.
TEST(DeviceSampling, LargeVocabularyDrawsStayInTheSupport) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  std::mt19937 rng(seed);
  const int rows = 48, vocab = 151936;
  std::vector<float> logits(static_cast<size_t>(rows) * vocab);
  std::normal_distribution<float> nd(0.0f, 2.5f);
  for (auto& x : logits) x = nd(rng);
  // Every fourth row flat (logits within ~1e-3): small top_k takes the radix fallback there.
  for (int r = 3; r < rows; r += 4)
    for (int i = 0; i < vocab; ++i) logits[static_cast<size_t>(r) * vocab + i] *= 4e-4f;
  const std::vector<DeviceSampling> kinds = {
      params(1.0f, 50, 0.9f, 0.0f),    params(0.7f, 0, 0.95f, 0.0f), params(1.0f, 0, 1.0f, 0.1f),
      params(0.6f, 2000, 0.8f, 0.05f), params(1.0f, 1, 1.0f, 0.0f),  params(0.9f, 20, 1.0f, 0.0f)};
  std::vector<DeviceSampling> ps(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    ps[static_cast<size_t>(r)] = kinds[static_cast<size_t>(r) % kinds.size()];
    ps[static_cast<size_t>(r)].seed = seed + static_cast<uint64_t>(r);
  }
  for (int step = 0; step < 3; ++step) {
    for (auto& p : ps) p.step = static_cast<uint64_t>(step);
    const auto out = sample(logits, rows, vocab, ps);
    for (int r = 0; r < rows; ++r) {
      const std::vector<float> row(logits.begin() + static_cast<ptrdiff_t>(r) * vocab,
                                   logits.begin() + static_cast<ptrdiff_t>(r + 1) * vocab);
      const auto q = reference_distribution(row, ps[static_cast<size_t>(r)]);
      const int32_t tok = out[static_cast<size_t>(r)];
      ASSERT_TRUE(tok >= 0 && tok < vocab) << tok;
      EXPECT_GT(q[static_cast<size_t>(tok)], 0.0)
          << "row " << r << " " << describe(ps[static_cast<size_t>(r)]) << " seed " << seed;
    }
  }
}

TEST(DeviceSampling, SameSeedAndStepGiveTheSameToken) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  std::mt19937 rng(seed);
  const int rows = 128, vocab = 32000;
  std::vector<float> one(static_cast<size_t>(vocab));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : one) x = nd(rng);
  std::vector<float> logits;
  for (int r = 0; r < rows; ++r) logits.insert(logits.end(), one.begin(), one.end());
  const std::vector<DeviceSampling> kinds = {
      params(1.0f, 0, 1.0f, 0.0f), params(1.0f, 40, 0.9f, 0.0f), params(1.0f, 0, 0.9f, 0.0f),
      params(1.0f, 3000, 1.0f, 0.01f)};
  for (const auto& kind : kinds) {
    SCOPED_TRACE(describe(kind));
    // Rows in pairs: rows 2j and 2j+1 share (seed j, step 7); all rows differ in seed by pair.
    std::vector<DeviceSampling> ps(static_cast<size_t>(rows), kind);
    for (int r = 0; r < rows; ++r) {
      ps[static_cast<size_t>(r)].seed = seed + static_cast<uint64_t>(r / 2);
      ps[static_cast<size_t>(r)].step = 7;
    }
    const auto a = sample(logits, rows, vocab, ps);
    const auto b = sample(logits, rows, vocab, ps);
    EXPECT_EQ(a, b) << "seed " << seed;
    std::set<int32_t> distinct;
    for (int r = 0; r < rows; r += 2) {
      EXPECT_EQ(a[static_cast<size_t>(r)], a[static_cast<size_t>(r) + 1]) << "row " << r;
      distinct.insert(a[static_cast<size_t>(r)]);
    }
    // 64 seeds over a spread distribution: the draws must not all coincide.
    EXPECT_GT(distinct.size(), 8u) << "seed " << seed;
    // Another step of the same seeds draws differently.
    for (auto& p : ps) p.step = 8;
    const auto c = sample(logits, rows, vocab, ps);
    int same = 0;
    for (int r = 0; r < rows; ++r) same += a[static_cast<size_t>(r)] == c[static_cast<size_t>(r)];
    EXPECT_LT(same, rows / 2) << "seed " << seed;
  }
}

// Time per call at 256 rows x 152k (printed for the benchmarks); every token in range.
TEST(DeviceSampling, TimingAtFullVocabulary) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  std::mt19937 rng(seed);
  const int rows = 256, vocab = 151936;
  std::vector<float> logits(static_cast<size_t>(rows) * vocab);
  std::normal_distribution<float> nd(0.0f, 2.5f);
  for (auto& x : logits) x = nd(rng);
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<int32_t> d_out(rows);
  DeviceBuffer<DeviceSampling> d_params(static_cast<size_t>(rows));
  const std::vector<std::pair<const char*, DeviceSampling>> kinds = {
      {"greedy", params(0.0f, 0, 1.0f, 0.0f)},
      {"temperature", params(0.8f, 0, 1.0f, 0.0f)},
      {"top_k 50", params(0.8f, 50, 1.0f, 0.0f)},
      {"top_k 50 top_p 0.9", params(0.8f, 50, 0.9f, 0.0f)},
      {"top_p 0.9", params(0.8f, 0, 0.9f, 0.0f)},
      {"min_p 0.05", params(0.8f, 0, 1.0f, 0.05f)},
      {"top_k 2000 top_p 0.9 min_p 0.05", params(0.8f, 2000, 0.9f, 0.05f)}};
  cudaEvent_t e0, e1;
  ASSERT_EQ(cudaEventCreate(&e0), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&e1), cudaSuccess);
  for (const auto& [name, kind] : kinds) {
    std::vector<DeviceSampling> ps(static_cast<size_t>(rows), kind);
    for (int r = 0; r < rows; ++r) ps[static_cast<size_t>(r)].seed = static_cast<uint64_t>(r);
    d_params.upload(ps);
    const int iters = 20;
    cuda::sample_tokens(d_logits.get(), rows, vocab, d_params.get(), d_out.get(), nullptr, nullptr);
    ASSERT_EQ(cudaEventRecord(e0), cudaSuccess);
    for (int i = 0; i < iters; ++i)
      cuda::sample_tokens(d_logits.get(), rows, vocab, d_params.get(), d_out.get(), nullptr,
                          nullptr);
    ASSERT_EQ(cudaEventRecord(e1), cudaSuccess);
    ASSERT_EQ(cudaEventSynchronize(e1), cudaSuccess);
    float ms = 0.0f;
    ASSERT_EQ(cudaEventElapsedTime(&ms, e0, e1), cudaSuccess);
    const double us = 1000.0 * ms / iters;
    std::printf("  %-34s %d x %d: %8.1f us/call (%.0f GB/s of logits per pass-equivalent)\n", name,
                rows, vocab, us, rows * static_cast<double>(vocab) * 4.0 / (us * 1e3));
    for (int32_t tok : d_out.download()) ASSERT_TRUE(tok >= 0 && tok < vocab) << tok;
  }
  (void)cudaEventDestroy(e0);
  (void)cudaEventDestroy(e1);
}

}  // namespace
}  // namespace kvq::test
