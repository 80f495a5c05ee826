// FP4 E2M1 element codec (NVFP4 values) against its definition.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "kvq/quant/codec.h"
#include "small_float_checks.h"

namespace kvq::quant {
namespace {

const testing::SmallFloatFormat kE2M1{
    "e2m1", fp4_e2m1_encode, fp4_e2m1_decode, 4, 1, 0, 6.0, 0x7, false, 0};

TEST(Fp4E2M1, DecodesAll16CodesFromTheirFields) {
  for (int c = 0; c < 16; ++c) {
    const int e = (c >> 1) & 3;
    const int m = c & 1;
    const double mag = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
    const double want = (c & 8) ? -mag : mag;
    const float got = fp4_e2m1_decode(static_cast<uint8_t>(c));
    EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
    EXPECT_EQ(std::signbit(got), c >= 8) << "code " << c;
  }
  // The value set the format is known by.
  const float expected[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(fp4_e2m1_decode(static_cast<uint8_t>(c)), expected[c]);
}

TEST(Fp4E2M1, DecodeIgnoresTheHighNibble) {
  for (int c = 0; c < 16; ++c)
    EXPECT_EQ(fp4_e2m1_decode(static_cast<uint8_t>(c | 0xA0)),
              fp4_e2m1_decode(static_cast<uint8_t>(c)));
}

TEST(Fp4E2M1, EveryCodeRoundTrips) {
  testing::check_finite_codes_round_trip(kE2M1);
}

TEST(Fp4E2M1, MidpointsTieToEvenAndNeighboursGoToTheNearerCode) {
  testing::check_midpoints(kE2M1);
  // Spelled out: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
  const float ties[][2] = {{0.25f, 0.0f}, {0.75f, 1.0f}, {1.25f, 1.0f}, {1.75f, 2.0f},
                           {2.5f, 2.0f},  {3.5f, 4.0f},  {5.0f, 4.0f}};
  for (auto [x, want] : ties) EXPECT_EQ(fp4_e2m1_decode(fp4_e2m1_encode(x)), want) << x;
}

TEST(Fp4E2M1, BeyondMaxAndInfSaturateNaNBecomesZero) {
  testing::check_saturation_and_specials(kE2M1);
}

TEST(Fp4E2M1, SubnormalRangeRoundsExactly) {
  testing::check_subnormals(kE2M1);
}

TEST(Fp4E2M1, RandomInputsMatchTheDoubleReference) {
  testing::check_random_against_reference(kE2M1, 100000);
}

}  // namespace
}  // namespace kvq::quant
