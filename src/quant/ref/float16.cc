// IEEE half and bfloat16 conversions (16-bit KV storage and the int4 metadata).
//
// float -> 16 bit rounds to nearest, ties to even, by integer arithmetic (independent of
// the FP environment), overflowing to inf as IEEE does (like CUDA's __float2half_rn /
// __float2bfloat16_rn). NaN stays NaN with its sign and its top payload bits, and is made
// quiet (a payload that would truncate to zero could otherwise turn into inf).
// 16 bit -> float is exact; NaN comes back quiet.
#include <bit>
#include <cstdint>

#include "kvq/quant/codec.h"
#include "quant/ref/minifloat.h"

namespace kvq::quant {

uint16_t float_to_bf16_bits(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if ((bits & 0x7FFFFFFFu) > detail::kF32InfBits)
    return static_cast<uint16_t>((bits >> 16) | 0x40u);
  // bf16 is the top half of a float32, so RNE is: add 0x7FFF plus the lowest kept bit, then
  // truncate. This is exact for subnormals too (they share float32's exponent range), and a
  // carry out of the largest finite values gives exactly the inf pattern 0x7F80.
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

float bf16_bits_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  if ((bits & 0x7FFFFFFFu) > detail::kF32InfBits) bits |= 0x00400000u;
  return std::bit_cast<float>(bits);
}

uint16_t float_to_fp16_bits(float x) {
  const uint32_t sign = detail::sign_bit(x) << 15;
  const uint32_t a = detail::abs_bits(x);
  if (a > detail::kF32InfBits)
    return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // 0x7E00: quiet NaN
  if (a == detail::kF32InfBits) return static_cast<uint16_t>(sign | 0x7C00u);
  uint32_t mag = detail::round_to_code_magnitude(a, detail::kF16);
  if (mag > 0x7C00u) mag = 0x7C00u;  // past the exponent range: inf
  return static_cast<uint16_t>(sign | mag);
}

float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h >> 15) << 31;
  const uint32_t mag = h & 0x7FFFu;
  if (mag >= 0x7C00u) {
    uint32_t bits = sign | detail::kF32InfBits | ((mag & 0x3FFu) << 13);
    if ((mag & 0x3FFu) != 0) bits |= 0x00400000u;
    return std::bit_cast<float>(bits);
  }
  return detail::with_sign(detail::decode_code_magnitude(mag, detail::kF16), sign);
}

}  // namespace kvq::quant
