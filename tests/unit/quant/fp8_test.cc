// FP8 e4m3 (OCP E4M3FN) and e5m2 element codecs against their definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "kvq/quant/codec.h"
#include "small_float_checks.h"

namespace kvq::quant {
namespace {

using testing::SmallFloatFormat;

const SmallFloatFormat kE4M3{"e4m3", fp8_e4m3_encode, fp8_e4m3_decode, 8, 3, -6, 448.0, 0x7E, true,
                             0x7F};
const SmallFloatFormat kE5M2{
    "e5m2", fp8_e5m2_encode, fp8_e5m2_decode, 8, 2, -14, 57344.0, 0x7B, true, 0x7E};

// The value of an fp8 code from its fields: sign, exponent field e, mantissa field m.
double fp8_value_from_fields(int code, int exp_bits, int mant_bits, int bias) {
  const int sign = code >> 7;
  const int e = (code >> mant_bits) & ((1 << exp_bits) - 1);
  const int m = code & ((1 << mant_bits) - 1);
  const double frac = static_cast<double>(m) / (1 << mant_bits);
  const double mag = e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1.0 + frac, e - bias);
  return sign ? -mag : mag;
}

TEST(Fp8E4M3, DecodesAll256CodesFromTheirFields) {
  for (int c = 0; c < 256; ++c) {
    const float got = fp8_e4m3_decode(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {  // S.1111.111 is the only NaN; E4M3FN has no inf
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), fp8_value_from_fields(c, 4, 3, 7)) << "code " << c;
    EXPECT_EQ(std::signbit(got), c >= 128) << "code " << c;
  }
  EXPECT_EQ(fp8_e4m3_decode(0x7E), kFp8E4M3Max);
  EXPECT_EQ(fp8_e4m3_decode(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8E5M2, DecodesAll256CodesFromTheirFields) {
  for (int c = 0; c < 256; ++c) {
    const float got = fp8_e5m2_decode(static_cast<uint8_t>(c));
    const int e = (c >> 2) & 0x1F;
    const int m = c & 3;
    if (e == 31 && m == 0) {
      EXPECT_TRUE(std::isinf(got)) << "code " << c;
      EXPECT_EQ(std::signbit(got), c >= 128);
      continue;
    }
    if (e == 31) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), fp8_value_from_fields(c, 5, 2, 15)) << "code " << c;
    EXPECT_EQ(std::signbit(got), c >= 128) << "code " << c;
  }
  EXPECT_EQ(fp8_e5m2_decode(0x7B), kFp8E5M2Max);
  EXPECT_EQ(fp8_e5m2_decode(0x01), std::ldexp(1.0f, -16));
}

TEST(Fp8Encode, EveryFiniteCodeRoundTrips) {
  testing::check_finite_codes_round_trip(kE4M3);
  testing::check_finite_codes_round_trip(kE5M2);
}

TEST(Fp8Encode, MidpointsTieToEvenAndNeighboursGoToTheNearerCode) {
  testing::check_midpoints(kE4M3);
  testing::check_midpoints(kE5M2);
}

TEST(Fp8Encode, BeyondMaxAndInfSaturateNaNStaysNaNZeroKeepsSign) {
  testing::check_saturation_and_specials(kE4M3);
  testing::check_saturation_and_specials(kE5M2);
  EXPECT_EQ(fp8_e4m3_encode(464.0f), 0x7E) << "the e4m3 midpoint above max saturates";
  EXPECT_EQ(fp8_e5m2_encode(61440.0f), 0x7B) << "the e5m2 midpoint above max saturates";
}

TEST(Fp8Encode, SubnormalsRoundExactly) {
  testing::check_subnormals(kE4M3);
  testing::check_subnormals(kE5M2);
}

TEST(Fp8Encode, RandomInputsMatchTheDoubleReference) {
  testing::check_random_against_reference(kE4M3, 200000);
  testing::check_random_against_reference(kE5M2, 200000);
}

}  // namespace
}  // namespace kvq::quant
