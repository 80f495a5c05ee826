// Encoding checks shared by the fp8 (e4m3, e5m2) and fp4 (e2m1) element codec tests. Each
// check compares the codec against the format's definition: decoded values of every code,
// and the double-precision ref_round model of round-to-nearest-even.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "quant_test_util.h"

namespace kvq::quant::testing {

struct SmallFloatFormat {
  const char* name;
  uint8_t (*encode)(float);
  float (*decode)(uint8_t);
  int code_bits;  // 8 or 4; the sign is the top bit
  int mant_bits;
  int emin;           // exponent of the smallest normal value
  double max_finite;  // finite values beyond it (and +-inf) saturate to it
  uint8_t max_code;   // code magnitude of max_finite
  bool has_nan;       // false: NaN encodes as +0
  uint8_t nan_code;   // positive NaN code from encode (sign bit added for -NaN)

  uint8_t sign_mask() const { return static_cast<uint8_t>(1u << (code_bits - 1)); }
  // The value the format's definition gives for x: RNE, then saturation.
  double reference(float x) const {
    const double r = ref_round(static_cast<double>(x), mant_bits, emin);
    if (std::fabs(r) > max_finite) return std::copysign(max_finite, r);
    return r;
  }
  // Finite non-negative codes 0..max_code in increasing value order.
  std::vector<uint8_t> positive_codes() const {
    std::vector<uint8_t> c;
    for (int i = 0; i <= max_code; ++i) c.push_back(static_cast<uint8_t>(i));
    return c;
  }
};

inline void expect_same_value(const SmallFloatFormat& f, float x, double want,
                              const std::string& note) {
  const uint8_t code = f.encode(x);
  const float got = f.decode(code);
  EXPECT_EQ(static_cast<double>(got), want)
      << f.name << " x=" << x << " (bits " << std::hex << std::bit_cast<uint32_t>(x) << std::dec
      << ") code=" << int(code) << " " << note;
  if (want == 0.0) {
    EXPECT_EQ(std::signbit(got), std::signbit(x)) << f.name << " sign of zero for x=" << x;
  }
}

inline void check_finite_codes_round_trip(const SmallFloatFormat& f) {
  for (uint8_t c : f.positive_codes()) {
    for (uint8_t code : {c, static_cast<uint8_t>(c | f.sign_mask())}) {
      EXPECT_EQ(f.encode(f.decode(code)), code) << f.name << " code " << int(code);
    }
  }
}

// Midpoints between neighbouring codes go to the even code; one float ulp either side goes
// to the nearer code. Includes the midpoint between 0 and the smallest subnormal.
inline void check_midpoints(const SmallFloatFormat& f) {
  const auto codes = f.positive_codes();
  for (size_t i = 0; i + 1 < codes.size(); ++i) {
    const uint8_t a = codes[i];
    const uint8_t b = codes[i + 1];
    const float va = f.decode(a);
    const float vb = f.decode(b);
    ASSERT_LT(va, vb) << f.name << " codes not increasing at " << int(a);
    const float mid = static_cast<float>((static_cast<double>(va) + vb) / 2.0);
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(va) + vb) / 2.0);
    const uint8_t even = (a % 2 == 0) ? a : b;
    for (int s = 0; s < 2; ++s) {
      const float sg = s == 0 ? 1.0f : -1.0f;
      const uint8_t sm = s == 0 ? 0 : f.sign_mask();
      EXPECT_EQ(f.encode(sg * mid), even | sm) << f.name << " tie at " << sg * mid;
      EXPECT_EQ(f.encode(sg * std::nextafter(mid, 0.0f)), a | sm)
          << f.name << " just below " << sg * mid;
      EXPECT_EQ(f.encode(sg * std::nextafter(mid, 1e30f)), b | sm)
          << f.name << " just above " << sg * mid;
    }
  }
}

inline void check_saturation_and_specials(const SmallFloatFormat& f) {
  const float maxf = static_cast<float>(f.max_finite);
  const float ulp_at_max = maxf - f.decode(static_cast<uint8_t>(f.max_code - 1));
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float x : {maxf, std::nextafter(maxf, inf), maxf + ulp_at_max / 2, maxf + ulp_at_max,
                  maxf * 4, 1e30f, std::numeric_limits<float>::max(), inf}) {
    EXPECT_EQ(f.encode(x), f.max_code) << f.name << " x=" << x;
    EXPECT_EQ(f.encode(-x), f.max_code | f.sign_mask()) << f.name << " x=" << -x;
    EXPECT_FALSE(std::isnan(f.decode(f.encode(x))));
  }
  EXPECT_EQ(f.encode(0.0f), 0);
  EXPECT_EQ(f.encode(-0.0f), f.sign_mask()) << f.name << " negative zero keeps its sign";
  EXPECT_TRUE(std::signbit(f.decode(f.sign_mask())));
  EXPECT_EQ(f.decode(f.sign_mask()), 0.0f);
  if (f.has_nan) {
    EXPECT_EQ(f.encode(nan), f.nan_code);
    EXPECT_EQ(f.encode(-nan), f.nan_code | f.sign_mask());
    EXPECT_TRUE(std::isnan(f.decode(f.encode(nan))));
  } else {
    EXPECT_EQ(f.encode(nan), 0);
    EXPECT_EQ(f.encode(-nan), 0);
  }
}

// Subnormal range: the smallest subnormal, half of it (a tie with 0: rounds to 0), just
// above half (rounds up), 1.5x (a tie between codes 1 and 2: rounds to 2), float32
// subnormals (round to signed zero).
inline void check_subnormals(const SmallFloatFormat& f) {
  const float min_sub = std::ldexp(1.0f, f.emin - f.mant_bits);
  EXPECT_EQ(f.decode(1), min_sub) << f.name;
  for (float sg : {1.0f, -1.0f}) {
    const uint8_t sm = sg > 0 ? 0 : f.sign_mask();
    EXPECT_EQ(f.encode(sg * min_sub), 1 | sm) << f.name;
    EXPECT_EQ(f.encode(sg * min_sub / 2), sm) << f.name << " half the smallest subnormal";
    EXPECT_EQ(f.encode(sg * std::nextafter(min_sub / 2, 1.0f)), 1 | sm) << f.name;
    EXPECT_EQ(f.encode(sg * std::nextafter(min_sub / 2, 0.0f)), sm) << f.name;
    EXPECT_EQ(f.encode(sg * min_sub * 1.5f), 2 | sm) << f.name << " tie 1.5 min subnormal";
    EXPECT_EQ(f.encode(sg * std::numeric_limits<float>::denorm_min()), sm) << f.name;
    EXPECT_EQ(f.encode(sg * std::numeric_limits<float>::min()), sm) << f.name;
  }
}

// Random inputs: dense in the format's range (subnormals to beyond max) and uniformly
// random float bit patterns (every exponent, NaN, inf).
inline void check_random_against_reference(const SmallFloatFormat& f, int count) {
  SeededRng rng;
  const int hi_exp = static_cast<int>(std::log2(f.max_finite)) + 2;
  int failures = 0;
  for (int i = 0; i < count && failures < 10; ++i) {
    const float x = (i % 2 == 0)
                        ? random_in_exponent_range(rng.gen, f.emin - f.mant_bits - 3, hi_exp)
                        : random_bits_float(rng.gen);
    if (std::isnan(x)) {
      const uint8_t code = f.encode(x);
      if (f.has_nan) {
        EXPECT_TRUE(std::isnan(f.decode(code))) << f.name << " " << rng.seed_note();
        EXPECT_EQ(code & f.sign_mask(), std::signbit(x) ? f.sign_mask() : 0) << f.name;
      } else {
        EXPECT_EQ(code, 0) << f.name << " " << rng.seed_note();
      }
      continue;
    }
    const double want = f.reference(x);
    if (static_cast<double>(f.decode(f.encode(x))) != want) ++failures;
    expect_same_value(f, x, want, rng.seed_note());
  }
}

}  // namespace kvq::quant::testing
