// FP4 E2M1 element codec (the value format of NVFP4): bias 1, one mantissa bit, no inf or
// NaN. Magnitudes by code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
//
// Same rounding as fp8 (round to nearest, ties to the even code, integer arithmetic);
// finite values beyond 6 and +-inf saturate to +-6. E2M1 has no NaN, so NaN encodes as +0:
// a NaN in the KV cache would poison every attention output that reads it.
#include <cstdint>

#include "kvq/quant/codec.h"
#include "quant/ref/minifloat.h"

namespace kvq::quant {
namespace {
constexpr uint32_t kE2M1MaxMag = 0x7;
static_assert(detail::decode_code_magnitude(kE2M1MaxMag, detail::kE2M1) == kFp4E2M1Max);
}  // namespace

uint8_t fp4_e2m1_encode(float x) {
  const uint32_t a = detail::abs_bits(x);
  if (a > detail::kF32InfBits) return 0;
  const uint32_t sign = detail::sign_bit(x) << 3;
  if (a == detail::kF32InfBits) return static_cast<uint8_t>(sign | kE2M1MaxMag);
  uint32_t mag = detail::round_to_code_magnitude(a, detail::kE2M1);
  if (mag > kE2M1MaxMag) mag = kE2M1MaxMag;
  return static_cast<uint8_t>(sign | mag);
}

float fp4_e2m1_decode(uint8_t code) {
  return detail::with_sign(detail::decode_code_magnitude(code & 0x7u, detail::kE2M1),
                           (code >> 3) & 1u);
}

}  // namespace kvq::quant
