// Helpers shared by the quant tests: seeded randomness, realistic rows, and an independent
// double-precision model of "round to a binary float format, ties to even".
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace kvq::quant::testing {

// A generator seeded from std::random_device; tests put seed_note() in their messages so a
// failure can be replayed.
struct SeededRng {
  uint32_t seed;
  std::mt19937 gen;
  SeededRng() : seed(std::random_device{}()), gen(seed) {}
  std::string seed_note() const { return "seed=" + std::to_string(seed); }
};

// `rows` rows of `n` N(0, 1) values.
inline std::vector<float> gaussian_rows(std::mt19937& gen, int rows, int n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows) * static_cast<size_t>(n));
  for (float& x : v) x = d(gen);
  return v;
}

// Like real attention keys: gaussian rows in which a few fixed channels (the same for every
// row) are 20-50x larger.
inline std::vector<float> outlier_rows(std::mt19937& gen, int rows, int n, int outliers = 4) {
  std::vector<float> v = gaussian_rows(gen, rows, n);
  // Distinct channels, so no channel is scaled twice.
  std::vector<int> channels(static_cast<size_t>(n));
  for (int c = 0; c < n; ++c) channels[static_cast<size_t>(c)] = c;
  std::shuffle(channels.begin(), channels.end(), gen);
  std::uniform_real_distribution<float> gain(20.0f, 50.0f);
  for (int k = 0; k < std::min(outliers, n); ++k) {
    const int c = channels[static_cast<size_t>(k)];
    const float g = gain(gen);
    for (int r = 0; r < rows; ++r) v[static_cast<size_t>(r) * n + c] *= g;
  }
  return v;
}

// x rounded to the nearest value with `mant_bits` fraction bits and minimum normal exponent
// `emin` (unbounded above), ties to the even significand, computed in double without any
// integer bit tricks. Exact for every float input.
inline double ref_round(double x, int mant_bits, int emin) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e = 0;
  (void)std::frexp(std::fabs(x), &e);  // |x| = f * 2^e, f in [0.5, 1)
  const int exp = std::max(e - 1, emin);
  const double quantum = std::ldexp(1.0, exp - mant_bits);
  const double q = std::fabs(x) / quantum;  // exact: division by a power of two
  double fl = std::floor(q);
  const double frac = q - fl;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(fl, 2.0) == 1.0)) fl += 1.0;
  return std::copysign(fl * quantum, x);
}

// A float with a uniformly random bit pattern (every exponent, NaN and inf included).
inline float random_bits_float(std::mt19937& gen) {
  const uint32_t b = static_cast<uint32_t>(gen());
  float f;
  static_assert(sizeof f == sizeof b);
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// A float of random sign with exponent uniform in [lo_exp, hi_exp] and a random mantissa:
// dense coverage of a small format's range, its subnormals and just beyond.
inline float random_in_exponent_range(std::mt19937& gen, int lo_exp, int hi_exp) {
  std::uniform_int_distribution<int> e(lo_exp, hi_exp);
  std::uniform_real_distribution<double> m(1.0, 2.0);
  std::bernoulli_distribution neg(0.5);
  const double v = std::ldexp(m(gen), e(gen));
  return static_cast<float>(neg(gen) ? -v : v);
}

}  // namespace kvq::quant::testing
