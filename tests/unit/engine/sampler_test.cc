#include "kvq/engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace kvq {
namespace {

std::vector<float> random_logits(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(Sampler, GreedyIsArgmaxWithLowestIdOnTies) {
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  SamplingParams p;
  p.temperature = 0.0f;
  Sampler s(p);
  for (int t = 0; t < 50; ++t) {
    auto l = random_logits(rng, 97);
    const auto want = std::max_element(l.begin(), l.end()) - l.begin();
    EXPECT_EQ(s.sample(l), want) << "seed " << seed;
  }
  std::vector<float> tie = {1.0f, 3.0f, 3.0f, 2.0f};
  EXPECT_EQ(s.sample(tie), 1);
  // NaN logits never win, wherever they sit (id 0 included).
  for (int t = 0; t < 50; ++t) {
    auto l = random_logits(rng, 31);
    std::vector<float> clean = l;
    for (size_t i = 0; i < l.size(); ++i)
      if (rng() % 3 == 0 || i == 0) {
        l[i] = std::nanf("");
        clean[i] = -INFINITY;
      }
    const auto want = std::max_element(clean.begin(), clean.end()) - clean.begin();
    if (clean[static_cast<size_t>(want)] == -INFINITY) continue;
    EXPECT_EQ(s.sample(l), want) << "seed " << seed;
  }
}

TEST(Sampler, TopKOnlyReturnsTheKBest) {
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  SamplingParams p;
  p.temperature = 5.0f;  // flat: every allowed token is likely to appear
  p.top_k = 3;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.seed = seed;
  Sampler s(p);
  auto l = random_logits(rng, 50);
  std::vector<int> order(50);
  for (int i = 0; i < 50; ++i) order[static_cast<size_t>(i)] = i;
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return l[static_cast<size_t>(a)] > l[static_cast<size_t>(b)]; });
  const std::set<int> allowed(order.begin(), order.begin() + 3);
  std::set<int> seen;
  for (int t = 0; t < 400; ++t) {
    const int id = s.sample(l);
    EXPECT_TRUE(allowed.count(id)) << id << " seed " << seed;
    seen.insert(id);
  }
  EXPECT_EQ(seen, allowed) << "seed " << seed;
}

TEST(Sampler, TopPKeepsTheSmallestNucleus) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (logits are their logs).
  std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 0;
  p.min_p = 0.0f;
  p.top_p = 0.75f;  // 0.5 + 0.3 >= 0.75: tokens 0 and 1 only
  p.seed = std::random_device{}();
  Sampler s(p);
  std::map<int, int> count;
  const int n = 4000;
  for (int t = 0; t < n; ++t) ++count[s.sample(l)];
  EXPECT_EQ(count.size(), 2u);
  // Renormalised: 0.625 / 0.375. 5 sigma of a binomial with n = 4000 is ~0.038.
  EXPECT_NEAR(count[0] / static_cast<double>(n), 0.625, 0.04) << "seed " << *p.seed;
}

TEST(Sampler, TopPAndMinPOnALargeVocabularyMatchAFullSort) {
  // The sampler sorts only the prefix its filters read, growing it as needed: on a flat
  // 3000-token distribution the nucleus holds hundreds of tokens, past the first prefix. Every
  // draw must come from the nucleus a full sort gives, in its renormalised proportions.
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.8f);
  const int V = 3000;
  std::vector<float> l(V);
  for (auto& x : l) x = nd(rng);
  l[10] = std::numeric_limits<float>::quiet_NaN();
  for (const auto& [top_p, min_p, top_k] :
       {std::tuple{0.6f, 0.0f, 0}, std::tuple{1.0f, 0.05f, 0}, std::tuple{0.9f, 0.02f, 700}}) {
    SCOPED_TRACE("top_p " + std::to_string(top_p) + " min_p " + std::to_string(min_p) + " top_k " +
                 std::to_string(top_k) + ", seed " + std::to_string(seed));
    SamplingParams p;
    p.temperature = 0.9f;
    p.top_p = top_p;
    p.min_p = min_p;
    p.top_k = top_k;
    p.seed = seed;
    // The reference nucleus: full sort, then the filters in order.
    std::vector<std::pair<double, int>> c;
    for (int i = 0; i < V; ++i)
      if (!std::isnan(l[i])) c.push_back({double(l[i] / 0.9f), i});
    std::sort(c.begin(), c.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    size_t keep = top_k > 0 ? static_cast<size_t>(top_k) : c.size();
    std::vector<double> pr(keep);
    double total = 0.0;
    for (size_t i = 0; i < keep; ++i) total += pr[i] = std::exp(c[i].first - c[0].first);
    for (auto& x : pr) x /= total;
    if (top_p < 1.0f) {
      double cum = 0.0;
      size_t k = 0;
      while (k < keep && (cum += pr[k++]) < top_p) {
      }
      keep = k;
    }
    if (min_p > 0.0f) {
      size_t k = 1;
      while (k < keep && pr[k] >= min_p * pr[0]) ++k;
      keep = k;
    }
    ASSERT_GT(keep, 64u) << "the nucleus must outgrow the first sorted prefix";
    std::map<int, double> want;
    double kept = 0.0;
    for (size_t i = 0; i < keep; ++i) kept += pr[i];
    for (size_t i = 0; i < keep; ++i) want[c[i].second] = pr[i] / kept;
    Sampler s(p);
    const int n = 6000;
    std::map<int, int> got;
    for (int t = 0; t < n; ++t) ++got[s.sample(l)];
    for (const auto& [id, count] : got) ASSERT_TRUE(want.count(id)) << "token " << id << " drawn";
    // Chi-square over 10 groups of the nucleus (by rank), each with its summed probability.
    const int groups = 10;
    std::vector<double> e(groups, 0.0), o(groups, 0.0);
    for (size_t i = 0; i < keep; ++i) {
      const size_t g = i * groups / keep;
      e[g] += n * want[c[i].second];
      o[g] += got.count(c[i].second) ? got[c[i].second] : 0;
    }
    double chi2 = 0.0;
    for (int g = 0; g < groups; ++g) chi2 += (o[g] - e[g]) * (o[g] - e[g]) / e[g];
    EXPECT_LT(chi2, 9.0 + 6.0 * std::sqrt(18.0));
  }
}

TEST(Sampler, MinPDropsUnlikelyTokens) {
  std::vector<float> l = {std::log(0.6f), std::log(0.3f), std::log(0.07f), std::log(0.03f)};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.1f;  // threshold 0.06: tokens 0, 1, 2
  p.seed = std::random_device{}();
  Sampler s(p);
  std::set<int> seen;
  for (int t = 0; t < 3000; ++t) seen.insert(s.sample(l));
  EXPECT_EQ(seen, (std::set<int>{0, 1, 2})) << "seed " << *p.seed;
}

TEST(Sampler, SameSeedSameTokens) {
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  auto l = random_logits(rng, 300);
  SamplingParams p;
  p.seed = seed;
  Sampler a(p), b(p);
  for (int t = 0; t < 100; ++t) EXPECT_EQ(a.sample(l), b.sample(l));
}

TEST(Sampler, DistributionFollowsTemperature) {
  // Two tokens with logit gap 1 at temperature 0.5: p0 = 1 / (1 + e^-2) = 0.8808.
  std::vector<float> l = {1.0f, 0.0f};
  SamplingParams p;
  p.temperature = 0.5f;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.seed = std::random_device{}();
  Sampler s(p);
  int zeros = 0;
  const int n = 5000;
  for (int t = 0; t < n; ++t) zeros += s.sample(l) == 0;
  EXPECT_NEAR(zeros / static_cast<double>(n), 0.8808, 0.025) << "seed " << *p.seed;
}

TEST(Sampler, TemperatureOnlyDrawsTheSoftmax) {
  // The unfiltered path (no top-k / top-p / min-p) draws without sorting: chi-square of the
  // draws against softmax(logits / T), NaN logits never drawn.
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  const int V = 40;
  std::vector<float> l(V);
  for (auto& x : l) x = nd(rng);
  l[3] = l[17] = std::numeric_limits<float>::quiet_NaN();
  SamplingParams p;
  p.temperature = 0.7f;
  p.seed = seed;
  Sampler s(p);
  std::vector<double> want(V, 0.0);
  double mx = -1e30, total = 0.0;
  for (int i = 0; i < V; ++i)
    if (!std::isnan(l[i])) mx = std::max(mx, double(l[i]) / 0.7);
  for (int i = 0; i < V; ++i)
    if (!std::isnan(l[i])) total += want[i] = std::exp(double(l[i]) / 0.7 - mx);
  const int n = 40000;
  std::vector<int> got(V, 0);
  for (int t = 0; t < n; ++t) ++got[s.sample(l)];
  EXPECT_EQ(got[3] + got[17], 0) << "NaN logits drawn, seed " << seed;
  // Bins with an expected count >= 5; the rest pooled.
  double chi2 = 0.0, pooled_want = 0.0, pooled_got = 0.0;
  int bins = 0;
  for (int i = 0; i < V; ++i) {
    const double e = n * want[i] / total;
    if (e >= 5.0) {
      chi2 += (got[i] - e) * (got[i] - e) / e;
      ++bins;
    } else {
      pooled_want += e;
      pooled_got += got[i];
    }
  }
  if (pooled_want >= 5.0) {
    chi2 += (pooled_got - pooled_want) * (pooled_got - pooled_want) / pooled_want;
    ++bins;
  }
  const double dof = bins - 1;
  ASSERT_GE(dof, 3) << "seed " << seed;
  // Mean dof, sd sqrt(2 dof): 6 sd above the mean fails about once in 10^8 runs.
  EXPECT_LT(chi2, dof + 6.0 * std::sqrt(2.0 * dof)) << "seed " << seed;
}

TEST(SamplingParams, InvalidValuesAreNamed) {
  auto first_error = [](SamplingParams p) {
    auto e = sampling_param_errors(p);
    return e.empty() ? std::string() : e.front();
  };
  SamplingParams p;
  EXPECT_TRUE(sampling_param_errors(p).empty());
  p.temperature = -1.0f;
  EXPECT_EQ(first_error(p).rfind("temperature must be", 0), 0u);
  p = {};
  p.temperature = NAN;
  EXPECT_EQ(first_error(p).rfind("temperature", 0), 0u);
  p = {};
  p.top_p = 0.0f;
  EXPECT_EQ(first_error(p).rfind("top_p must be in (0, 1]", 0), 0u);
  p = {};
  p.top_k = -2;
  EXPECT_EQ(first_error(p).rfind("top_k", 0), 0u);
  p = {};
  p.min_p = 1.5f;
  EXPECT_EQ(first_error(p).rfind("min_p", 0), 0u);
  p = {};
  p.max_tokens = 0;
  EXPECT_EQ(first_error(p).rfind("max_tokens", 0), 0u);
  p = {};
  p.stop = {""};
  EXPECT_NE(first_error(p).find("stop"), std::string::npos);
}

}  // namespace
}  // namespace kvq
