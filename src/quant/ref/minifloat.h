// Exact float32 -> small binary float rounding by integer bit manipulation, shared by the
// fp8 (e4m3, e5m2), fp4 (e2m1) and fp16 codecs. Nothing here depends on the FP environment:
// the rounding is done on the integer significand, so the result is the same under any
// rounding mode, with or without FTZ/DAZ on the host, and is what a GPU `cvt.rn` produces.
#pragma once

#include <bit>
#include <cstdint>

namespace kvq::quant::detail {

// A small float format: `mant_bits` stored mantissa bits, exponent bias `bias`; codes are
// sign | exponent | mantissa with subnormals at exponent field 0 (IEEE-style layout).
struct MiniFloat {
  int mant_bits;
  int bias;
};

inline constexpr MiniFloat kE4M3{3, 7};
inline constexpr MiniFloat kE5M2{2, 15};
inline constexpr MiniFloat kE2M1{1, 1};
inline constexpr MiniFloat kF16{10, 15};

// 2^k as a float, for -126 <= k <= 127 (built from bits, so exact and constexpr).
constexpr float pow2f(int k) {
  return std::bit_cast<float>(static_cast<uint32_t>(k + 127) << 23);
}

// The code magnitude (sign excluded) nearest to the float whose bits without sign are
// `abs_bits` (finite, not NaN), ties to the even code. The result is NOT saturated: it may
// exceed the format's largest finite code (the caller decides between saturation and inf).
//
// Method: |x| = sig * 2^(e - 23) with a 24-bit integer significand. The target's quantum at
// that magnitude is 2^(max(e, emin) - mant_bits) (emin = 1 - bias), so the number of quanta
// is sig >> shift with shift = 23 - mant_bits + max(0, emin - e), rounded half to even on the
// shifted-out bits. For normal results the code is ((e - emin) << mant_bits) + quanta: the
// implicit leading 1 lands in the exponent field, and a round-up from mantissa all-ones
// carries into the exponent, which is exactly the next code. For subnormal results the code
// is the quanta count itself (a round-up to 1 << mant_bits is the smallest normal code).
constexpr uint32_t round_to_code_magnitude(uint32_t abs_bits, MiniFloat f) {
  const int e32 = static_cast<int>(abs_bits >> 23);
  // float32 subnormals are < 2^-126, far below half the smallest subnormal of every target
  // format that uses this routine (fp16: 2^-24); they round to zero.
  if (e32 == 0) return 0;
  const uint64_t sig = (abs_bits & 0x7FFFFFu) | 0x800000u;
  const int e = e32 - 127;
  const int emin = 1 - f.bias;
  const int shift = 23 - f.mant_bits + (e < emin ? emin - e : 0);
  // With shift >= 25 the value is below half of the smallest subnormal (sig < 2^24).
  if (shift >= 25) return 0;
  uint64_t q = sig >> shift;
  const uint64_t rem = sig & ((uint64_t{1} << shift) - 1);
  const uint64_t half = uint64_t{1} << (shift - 1);
  if (rem > half || (rem == half && (q & 1u) != 0)) ++q;
  if (e < emin) return static_cast<uint32_t>(q);
  return (static_cast<uint32_t>(e - emin) << f.mant_bits) + static_cast<uint32_t>(q);
}

// The value of a finite code magnitude (sign excluded) of format `f`. Exact.
constexpr float decode_code_magnitude(uint32_t mag, MiniFloat f) {
  const uint32_t e = mag >> f.mant_bits;
  const uint32_t m = mag & ((1u << f.mant_bits) - 1u);
  if (e == 0) {
    // Subnormal: m * 2^(emin - mant_bits); a small integer times a power of two that is a
    // normal float32 for every format here, so the product is exact.
    return static_cast<float>(m) * pow2f(1 - f.bias - f.mant_bits);
  }
  const uint32_t e32 = e - static_cast<uint32_t>(f.bias) + 127u;
  return std::bit_cast<float>((e32 << 23) | (m << (23 - f.mant_bits)));
}

// Sign bit and magnitude bits of a float.
constexpr uint32_t sign_bit(float x) {
  return std::bit_cast<uint32_t>(x) >> 31;
}
constexpr uint32_t abs_bits(float x) {
  return std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu;
}
inline constexpr uint32_t kF32InfBits = 0x7F800000u;

constexpr float with_sign(float magnitude, uint32_t sign) {
  return sign != 0 ? -magnitude : magnitude;
}

}  // namespace kvq::quant::detail
