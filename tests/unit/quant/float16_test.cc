// IEEE half and bfloat16 conversions against their definitions.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvq/quant/codec.h"
#include "quant_test_util.h"

namespace kvq::quant {
namespace {

using testing::ref_round;
using testing::SeededRng;

constexpr float kInf = std::numeric_limits<float>::infinity();

// RNE to the format with IEEE overflow: a rounded magnitude past max becomes inf.
double ref_fp16(float x) {
  const double r = ref_round(x, 10, -14);
  return std::fabs(r) > 65504.0 ? std::copysign(INFINITY, r) : r;
}
double ref_bf16(float x) {
  const double r = ref_round(x, 7, -126);
  return std::fabs(r) > 0x1.FEp127 ? std::copysign(INFINITY, r) : r;
}

double fp16_from_fields(uint16_t h) {
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  const double mag = e == 0 ? std::ldexp(m / 1024.0, -14) : std::ldexp(1.0 + m / 1024.0, e - 15);
  return (h & 0x8000) ? -mag : mag;
}
double bf16_from_fields(uint16_t b) {
  const int e = (b >> 7) & 0xFF;
  const int m = b & 0x7F;
  const double mag = e == 0 ? std::ldexp(m / 128.0, -126) : std::ldexp(1.0 + m / 128.0, e - 127);
  return (b & 0x8000) ? -mag : mag;
}

TEST(Float16, DecodesAll65536CodesFromTheirFields) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const auto h = static_cast<uint16_t>(c);
    const float got = fp16_bits_to_float(h);
    if ((h & 0x7C00) == 0x7C00) {
      if ((h & 0x3FF) == 0) {
        EXPECT_EQ(got, (h & 0x8000) ? -kInf : kInf);
      } else {
        ASSERT_TRUE(std::isnan(got)) << c;
        EXPECT_EQ(std::signbit(got), (h & 0x8000) != 0);
        EXPECT_NE(std::bit_cast<uint32_t>(got) & 0x00400000u, 0u) << "NaN comes back quiet";
      }
      continue;
    }
    ASSERT_EQ(static_cast<double>(got), fp16_from_fields(h)) << c;
    ASSERT_EQ(std::signbit(got), (h & 0x8000) != 0) << c;
    ASSERT_EQ(float_to_fp16_bits(got), h) << "code " << c << " must round-trip";
  }
}

TEST(BFloat16, DecodesAll65536CodesFromTheirFields) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const auto b = static_cast<uint16_t>(c);
    const float got = bf16_bits_to_float(b);
    if ((b & 0x7F80) == 0x7F80) {
      if ((b & 0x7F) == 0) {
        EXPECT_EQ(got, (b & 0x8000) ? -kInf : kInf);
      } else {
        ASSERT_TRUE(std::isnan(got)) << c;
        EXPECT_EQ(std::signbit(got), (b & 0x8000) != 0);
      }
      continue;
    }
    ASSERT_EQ(static_cast<double>(got), bf16_from_fields(b)) << c;
    ASSERT_EQ(std::signbit(got), (b & 0x8000) != 0) << c;
    ASSERT_EQ(float_to_bf16_bits(got), b) << "code " << c << " must round-trip";
  }
}

TEST(Float16, SpotValuesRoundToNearestEven) {
  const float min_sub = std::ldexp(1.0f, -24);
  struct Case {
    float x;
    uint16_t want;
  };
  const Case cases[] = {
      {1.0f, 0x3C00},
      {-2.0f, 0xC000},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {65504.0f, 0x7BFF},
      {65519.99f, 0x7BFF},  // below the midpoint to 65536: stays finite
      {65520.0f, 0x7C00},   // the midpoint: ties to "even" 65536 = inf
      {1e6f, 0x7C00},       // IEEE overflow
      {kInf, 0x7C00},
      {-kInf, 0xFC00},
      {1.0f + std::ldexp(1.0f, -11), 0x3C00},      // tie between 1 and 1+2^-10: even is 1
      {1.0f + 3 * std::ldexp(1.0f, -11), 0x3C02},  // tie between 0x3C01 and 0x3C02: even
      {std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f), 0x3C01},
      {std::ldexp(1.0f, -14), 0x0400},  // smallest normal
      {min_sub, 0x0001},
      {min_sub / 2, 0x0000},  // tie with zero: even
      {std::nextafter(min_sub / 2, 1.0f), 0x0001},
      {-min_sub / 2, 0x8000},
      {min_sub * 1.5f, 0x0002},  // tie between subnormals 1 and 2
      {std::numeric_limits<float>::denorm_min(), 0x0000},
  };
  for (const auto& c : cases)
    EXPECT_EQ(float_to_fp16_bits(c.x), c.want)
        << "x=" << c.x << " got 0x" << std::hex << float_to_fp16_bits(c.x);
}

TEST(BFloat16, SpotValuesRoundToNearestEven) {
  struct Case {
    float x;
    uint16_t want;
  };
  const Case cases[] = {
      {1.0f, 0x3F80},
      {-0.0f, 0x8000},
      {1.0f + std::ldexp(1.0f, -8), 0x3F80},      // tie: even
      {1.0f + 3 * std::ldexp(1.0f, -8), 0x3F82},  // tie: even
      {std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f), 0x3F81},
      {std::numeric_limits<float>::max(), 0x7F80},  // rounds past the largest bf16: inf
      {0x1.FEp127f, 0x7F7F},
      {std::numeric_limits<float>::denorm_min(), 0x0000},  // tie with 0 in bf16's subnormals
      {std::ldexp(1.0f, -133), 0x0001},                    // smallest bf16 subnormal
      {std::ldexp(3.0f, -134), 0x0002},                    // tie between subnormals 1 and 2
      {-kInf, 0xFF80},
  };
  for (const auto& c : cases)
    EXPECT_EQ(float_to_bf16_bits(c.x), c.want)
        << "x=" << c.x << " got 0x" << std::hex << float_to_bf16_bits(c.x);
}

TEST(Float16AndBFloat16, NaNIsPreservedQuietWithItsSign) {
  const float nans[] = {std::numeric_limits<float>::quiet_NaN(),
                        -std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::signaling_NaN(),
                        std::bit_cast<float>(0x7F800001u),  // payload only in the low bits
                        std::bit_cast<float>(0xFFC12345u)};
  for (float n : nans) {
    const uint16_t h = float_to_fp16_bits(n);
    EXPECT_EQ(h & 0x7C00, 0x7C00);
    EXPECT_NE(h & 0x0200, 0) << "fp16 quiet bit";
    EXPECT_EQ((h & 0x8000) != 0, std::signbit(n));
    EXPECT_TRUE(std::isnan(fp16_bits_to_float(h)));
    const uint16_t b = float_to_bf16_bits(n);
    EXPECT_EQ(b & 0x7F80, 0x7F80);
    EXPECT_NE(b & 0x0040, 0) << "bf16 quiet bit";
    EXPECT_EQ((b & 0x8000) != 0, std::signbit(n));
    EXPECT_TRUE(std::isnan(bf16_bits_to_float(b)));
  }
}

TEST(Float16AndBFloat16, RandomInputsMatchTheDoubleReference) {
  SeededRng rng;
  int failures = 0;
  for (int i = 0; i < 400000 && failures < 10; ++i) {
    const float x = (i % 2 == 0) ? testing::random_in_exponent_range(rng.gen, -27, 17)
                                 : testing::random_bits_float(rng.gen);
    if (std::isnan(x)) continue;  // covered by NaNIsPreservedQuietWithItsSign
    const float h = fp16_bits_to_float(float_to_fp16_bits(x));
    const float b = bf16_bits_to_float(float_to_bf16_bits(x));
    if (static_cast<double>(h) != ref_fp16(x) || static_cast<double>(b) != ref_bf16(x)) ++failures;
    EXPECT_EQ(static_cast<double>(h), ref_fp16(x)) << "fp16 x=" << x << " " << rng.seed_note();
    EXPECT_EQ(static_cast<double>(b), ref_bf16(x)) << "bf16 x=" << x << " " << rng.seed_note();
    EXPECT_EQ(std::signbit(h), std::signbit(x));
    EXPECT_EQ(std::signbit(b), std::signbit(x));
  }
}

// A float16 cache for a bfloat16 model converts values; it never reinterprets bits.
TEST(Float16AndBFloat16, ConvertingBetweenThemGoesThroughValues) {
  SeededRng rng;
  std::normal_distribution<float> d(0.0f, 100.0f);
  for (int i = 0; i < 10000; ++i) {
    const uint16_t b = float_to_bf16_bits(d(rng.gen));
    const float v = bf16_bits_to_float(b);
    const uint16_t h = float_to_fp16_bits(v);
    // Every bf16 of magnitude within fp16's normal range has <= 8 significant bits, so
    // it is exactly representable in fp16.
    if (std::fabs(v) >= std::ldexp(1.0f, -14) && std::fabs(v) <= 65504.0f) {
      EXPECT_EQ(fp16_bits_to_float(h), v) << rng.seed_note();
    }
  }
}

}  // namespace
}  // namespace kvq::quant
