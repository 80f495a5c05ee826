#include "kvq/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "kvq/core/error.h"

namespace kvq {

namespace {
std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}
}  // namespace

std::vector<std::string> sampling_param_errors(const SamplingParams& p) {
  std::vector<std::string> e;
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f)
    e.push_back("temperature must be a finite number >= 0 (0 = greedy), got " + num(p.temperature));
  if (p.top_k < 0) e.push_back("top_k must be >= 0 (0 = off), got " + std::to_string(p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    e.push_back("top_p must be in (0, 1], got " + num(p.top_p));
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f))
    e.push_back("min_p must be in [0, 1], got " + num(p.min_p));
  if (p.max_tokens < 1) e.push_back("max_tokens must be >= 1, got " + std::to_string(p.max_tokens));
  for (const auto& s : p.stop)
    if (s.empty()) e.push_back("stop strings must not be empty");
  return e;
}

Sampler::Sampler(const SamplingParams& p)
    : p_(p),
      seed_(p.seed ? *p.seed : (uint64_t{std::random_device{}()} << 32 | std::random_device{}())),
      rng_(seed_) {}

DeviceSampling Sampler::device_rule(uint64_t step) const {
  DeviceSampling d;
  const bool argmax = greedy();
  d.temperature = argmax ? 0.0f : p_.temperature;
  d.top_k = argmax ? 0 : p_.top_k;
  d.top_p = p_.top_p;
  d.min_p = p_.min_p;
  d.seed = seed_;
  d.step = step;
  return d;
}

size_t Sampler::filter(std::span<const float> logits, double& total, float& max_logit) {
  const int32_t n = static_cast<int32_t>(logits.size());
  // Candidates in logit order, descending (ties: lower id first), truncated by top-k, top-p
  // and min-p, in that order, as vLLM and transformers do. Only the prefix the filters look
  // at is sorted, growing 4x at a time (a peaked distribution's nucleus is a few dozen
  // tokens; sorting a whole vocabulary per token is what made the host sampler slow).
  auto& c = scratch_;
  c.clear();
  for (int32_t i = 0; i < n; ++i) {
    const float l = logits[static_cast<size_t>(i)];
    if (!std::isnan(l)) c.push_back({l / p_.temperature, i});
  }
  if (c.empty()) return 0;
  auto desc = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t sorted = 0;  // c[0, sorted) holds the largest candidates in order
  auto ensure_sorted = [&](size_t k) {
    if (k <= sorted) return;
    const size_t target = std::min(c.size(), std::max({k, 4 * sorted, size_t{64}}));
    std::partial_sort(c.begin() + static_cast<std::ptrdiff_t>(sorted),
                      c.begin() + static_cast<std::ptrdiff_t>(target), c.end(), desc);
    sorted = target;
  };
  size_t keep = c.size();
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < keep) {
    keep = static_cast<size_t>(p_.top_k);
    ensure_sorted(keep);
  }
  ensure_sorted(1);
  max_logit = c.front().first;
  total = 0.0;
  for (size_t i = 0; i < keep; ++i) total += std::exp(static_cast<double>(c[i].first - max_logit));
  auto prob = [&](size_t i) {
    return std::exp(static_cast<double>(c[i].first - max_logit)) / total;
  };
  if (p_.top_p < 1.0f) {
    double cum = 0.0;
    size_t k = 0;
    while (k < keep) {
      ensure_sorted(k + 1);
      cum += prob(k++);
      if (cum >= static_cast<double>(p_.top_p)) break;
    }
    keep = k;
  }
  if (p_.min_p > 0.0f) {
    const double floor = static_cast<double>(p_.min_p) * prob(0);
    size_t k = 1;
    while (k < keep) {
      ensure_sorted(k + 1);
      if (prob(k) < floor) break;
      ++k;
    }
    keep = k;
  }
  return keep;
}

int32_t Sampler::sample(std::span<const float> logits) {
  const int32_t n = static_cast<int32_t>(logits.size());
  if (p_.temperature == 0.0f || p_.top_k == 1) return greedy_argmax(logits);
  if (p_.top_k == 0 && p_.top_p >= 1.0f && p_.min_p == 0.0f) {
    // Temperature alone: one pass for the maximum, one for the sum, one to draw, in id
    // order. No sort: the distribution is the same, and a full sort of a large vocabulary
    // per token was most of a serving step's host time.
    float max_l = -std::numeric_limits<float>::infinity();
    for (float l : logits)
      if (!std::isnan(l)) max_l = std::max(max_l, l / p_.temperature);
    if (max_l == -std::numeric_limits<float>::infinity()) {
      // Every logit NaN or -inf: like the sorted path, the first non-NaN id (0 if none).
      for (int32_t i = 0; i < n; ++i)
        if (!std::isnan(logits[static_cast<size_t>(i)])) return i;
      return 0;
    }
    double total = 0.0;
    for (float l : logits)
      if (!std::isnan(l)) total += std::exp(static_cast<double>(l / p_.temperature - max_l));
    std::uniform_real_distribution<double> u(0.0, total);
    double r = u(rng_);
    int32_t last = 0;
    for (int32_t i = 0; i < n; ++i) {
      const float l = logits[static_cast<size_t>(i)];
      if (std::isnan(l)) continue;
      const double q = std::exp(static_cast<double>(l / p_.temperature - max_l));
      if (q > 0.0) last = i;
      r -= q;
      if (r < 0.0) return i;
    }
    return last;  // rounding left r >= 0: the last token with weight
  }
  double total = 0.0;
  float max_logit = 0.0f;
  const size_t keep = filter(logits, total, max_logit);
  if (keep == 0) return 0;
  const auto& c = scratch_;
  auto prob = [&](size_t i) {
    return std::exp(static_cast<double>(c[i].first - max_logit)) / total;
  };
  // The kept set is c[0, keep) (sorted or not: the draw needs no order).
  double kept_total = 0.0;
  for (size_t i = 0; i < keep; ++i) kept_total += prob(i);
  std::uniform_real_distribution<double> u(0.0, kept_total);
  double r = u(rng_);
  for (size_t i = 0; i < keep; ++i) {
    r -= prob(i);
    if (r < 0.0) return c[i].second;
  }
  return c[keep - 1].second;
}

void Sampler::distribution(std::span<const float> logits,
                           std::vector<std::pair<int32_t, double>>& out) {
  out.clear();
  if (greedy()) {
    out.push_back({sample(logits), 1.0});
    return;
  }
  double total = 0.0;
  float max_logit = 0.0f;
  const size_t keep = filter(logits, total, max_logit);
  if (keep == 0) {
    out.push_back({0, 1.0});
    return;
  }
  double kept = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    const double p = std::exp(static_cast<double>(scratch_[i].first - max_logit)) / total;
    out.push_back({scratch_[i].second, p});
    kept += p;
  }
  for (auto& e : out) e.second /= kept;
}

int32_t Sampler::draw(std::span<const std::pair<int32_t, double>> weighted) {
  double total = 0.0;
  for (const auto& e : weighted) total += e.second;
  KVQ_CHECK(!weighted.empty() && total > 0.0, "Sampler::draw: no weight to draw from");
  std::uniform_real_distribution<double> u(0.0, total);
  double r = u(rng_);
  int32_t last = weighted.front().first;
  for (const auto& e : weighted) {
    if (e.second > 0.0) last = e.first;
    r -= e.second;
    if (r < 0.0 && e.second > 0.0) return e.first;
  }
  return last;
}

double Sampler::uniform() {
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
}

}  // namespace kvq
