// FP8 element codecs.
//
// e4m3 is OCP E4M3FN: bias 7, no infinities, the only NaN magnitude is 0x7F (S.1111.111), so
// the largest finite value is 0x7E = 1.75 * 2^8 = 448. e5m2 is IEEE-like: bias 15,
// exponent 31 holds inf (mantissa 0) and NaN, largest finite 0x7B = 1.75 * 2^15 = 57344.
//
// Encoding rounds to nearest, ties to even (on the code, i.e. the even mantissa), by integer
// arithmetic (minifloat.h). Finite values beyond the largest finite value, and +-inf,
// saturate to +-max (the "satfinite" conversion of CUDA's __nv_cvt_float_to_fp8 with
// __NV_SATFINITE); a finite input never becomes NaN or inf. NaN keeps its sign.
#include <cstdint>
#include <limits>

#include "kvq/quant/codec.h"
#include "quant/ref/minifloat.h"

namespace kvq::quant {
namespace {

constexpr uint32_t kE4M3MaxMag = 0x7E;
constexpr uint32_t kE4M3NanMag = 0x7F;
constexpr uint32_t kE5M2MaxMag = 0x7B;
constexpr uint32_t kE5M2InfMag = 0x7C;
constexpr uint32_t kE5M2NanMag = 0x7E;

static_assert(detail::decode_code_magnitude(kE4M3MaxMag, detail::kE4M3) == kFp8E4M3Max);
static_assert(detail::decode_code_magnitude(kE5M2MaxMag, detail::kE5M2) == kFp8E5M2Max);

template <uint32_t kMaxMag, uint32_t kNanMag>
uint8_t encode_fp8(float x, detail::MiniFloat f) {
  const uint32_t sign = detail::sign_bit(x) << 7;
  const uint32_t a = detail::abs_bits(x);
  if (a > detail::kF32InfBits) return static_cast<uint8_t>(sign | kNanMag);
  if (a == detail::kF32InfBits) return static_cast<uint8_t>(sign | kMaxMag);
  uint32_t mag = detail::round_to_code_magnitude(a, f);
  if (mag > kMaxMag) mag = kMaxMag;
  return static_cast<uint8_t>(sign | mag);
}

}  // namespace

uint8_t fp8_e4m3_encode(float x) {
  return encode_fp8<kE4M3MaxMag, kE4M3NanMag>(x, detail::kE4M3);
}

float fp8_e4m3_decode(uint8_t code) {
  const uint32_t mag = code & 0x7Fu;
  const uint32_t sign = code >> 7;
  if (mag == kE4M3NanMag) return detail::with_sign(std::numeric_limits<float>::quiet_NaN(), sign);
  return detail::with_sign(detail::decode_code_magnitude(mag, detail::kE4M3), sign);
}

uint8_t fp8_e5m2_encode(float x) {
  return encode_fp8<kE5M2MaxMag, kE5M2NanMag>(x, detail::kE5M2);
}

float fp8_e5m2_decode(uint8_t code) {
  const uint32_t mag = code & 0x7Fu;
  const uint32_t sign = code >> 7;
  if (mag == kE5M2InfMag) return detail::with_sign(std::numeric_limits<float>::infinity(), sign);
  if (mag > kE5M2InfMag) return detail::with_sign(std::numeric_limits<float>::quiet_NaN(), sign);
  return detail::with_sign(detail::decode_code_magnitude(mag, detail::kE5M2), sign);
}

}  // namespace kvq::quant
