// Dtypes with a dynamic scale per (token, kv head) row, stored in the row's metadata bytes
// (little-endian, like every multi-byte value kvq stores).
//
// Shared rules, fixed so SIMD/GPU writers can match bit for bit:
//  * absmax / min / max are taken over the finite elements only (NaN and +-inf skipped);
//  * a value is brought to the code grid by ONE correctly rounded fp32 division by the
//    stored scale, x / scale (GPU: __fdiv_rn, never x * (1 / scale): the reciprocal of a
//    subnormal scale overflows, and the extra rounding would differ);
//  * a row whose scale is 0 (all finite elements zero, or a scale that underflowed) stores
//    scale 0 and all-zero codes and decodes to exactly 0 (int4: to its zero point), so no
//    division by zero and no NaN.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "kvq/quant/codec.h"
#include "quant/ref/row_formats.h"

namespace kvq::quant::detail {
namespace {

static_assert(std::endian::native == std::endian::little, "kvq stores little-endian metadata");

float load_f32(const std::byte* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
void store_f32(std::byte* p, float v) {
  std::memcpy(p, &v, sizeof v);
}
uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
void store_u16(std::byte* p, uint16_t v) {
  std::memcpy(p, &v, sizeof v);
}

}  // namespace

// Caps on the per-row scales so that decoding (127 * scale, 448 * scale) cannot overflow to
// inf. FLT_MAX / 128 and FLT_MAX / 512 are exact (power-of-two divisions); they only bite
// for rows whose absmax exceeds ~0.99 * FLT_MAX (int8) or ~0.87 * FLT_MAX (fp8), far beyond
// anything a bf16 / fp16 model produces; such rows saturate instead.
constexpr float kInt8MaxScale = std::numeric_limits<float>::max() / 128.0f;
constexpr float kFp8MaxScale = std::numeric_limits<float>::max() / 512.0f;

// ---- int8_per_token_head ----------------------------------------------------------------
// scale = min(absmax / 127.0f, FLT_MAX / 128) (fp32 division), metadata = scale as fp32;
// q = clamp(round_half_even(x / scale), -127, 127) as int8 (-128 is never written);
// decoded value = float(q) * scale (one fp32 rounding).
void encode_int8_per_token_head(std::span<const float> x, std::byte* data, std::byte* scale) {
  const float s = std::min(finite_absmax(x) / 127.0f, kInt8MaxScale);
  store_f32(scale, s);
  for (size_t i = 0; i < x.size(); ++i) {
    const int q = s == 0.0f ? 0 : round_half_even_clamped(x[i] / s, -127, 127);
    data[i] = static_cast<std::byte>(static_cast<uint8_t>(static_cast<int8_t>(q)));
  }
}

void decode_int8_per_token_head(const std::byte* data, const std::byte* scale,
                                std::span<float> out) {
  const float s = load_f32(scale);
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(data[i]))) * s;
}

// ---- fp8_per_token_head -----------------------------------------------------------------
// scale = min(absmax / 448.0f, FLT_MAX / 512) (fp32 division), metadata = scale as fp32;
// code = fp8_e4m3_encode(x / scale) (RNE, saturating); decoded = e4m3 value * scale.
void encode_fp8_per_token_head(std::span<const float> x, std::byte* data, std::byte* scale) {
  const float s = std::min(finite_absmax(x) / kFp8E4M3Max, kFp8MaxScale);
  store_f32(scale, s);
  for (size_t i = 0; i < x.size(); ++i)
    data[i] = static_cast<std::byte>(s == 0.0f ? uint8_t{0} : fp8_e4m3_encode(x[i] / s));
}

void decode_fp8_per_token_head(const std::byte* data, const std::byte* scale,
                               std::span<float> out) {
  const float s = load_f32(scale);
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = fp8_e4m3_decode(static_cast<uint8_t>(data[i])) * s;
}

// ---- int4_per_token_head ----------------------------------------------------------------
// r = hadamard_rotate(x) (see hadamard.cc for its exact arithmetic); over the finite r:
//   lo = min, hi = max (0 and 0 if there is none);
//   scale = fp16(min((hi - lo) / 15.0f, 65504)), zero = fp16(max(lo, -65504)): fp32
//     subtraction and division, then RNE to fp16 saturated to the finite range;
//   metadata bytes 0-1 = scale, 2-3 = zero (fp16 bits);
//   with S, Z the fp16 values as floats: q = clamp(round_half_even((r - Z) / S), 0, 15)
//     (fp32 subtraction, then fp32 division), q = 0 for every element when S == 0;
//   packing: byte i = q[2i] | q[2i+1] << 4 (even element in the low nibble).
// decoded (rotated space) = float(q) * S + Z. float(q) * S is exact (4 x 11 significant
// bits), so this equals fmaf(q, S, Z): one rounding whether or not the compiler contracts.
void encode_int4_per_token_head(std::span<const float> x, std::byte* data, std::byte* scale) {
  std::vector<float> r(x.begin(), x.end());
  hadamard_rotate(r);
  bool any = false;
  float lo = 0.0f;
  float hi = 0.0f;
  for (float v : r) {
    if (!std::isfinite(v)) continue;
    if (!any || v < lo) lo = v;
    if (!any || v > hi) hi = v;
    any = true;
  }
  const uint16_t s_bits = float_to_fp16_bits_satfinite((hi - lo) / 15.0f, true);
  const uint16_t z_bits = float_to_fp16_bits_satfinite(lo, true);
  store_u16(scale, s_bits);
  store_u16(scale + 2, z_bits);
  const float s = fp16_bits_to_float(s_bits);
  const float z = fp16_bits_to_float(z_bits);
  for (size_t i = 0; i < r.size(); i += 2) {
    int q[2] = {0, 0};
    if (s != 0.0f) {
      q[0] = round_half_even_clamped((r[i] - z) / s, 0, 15);
      q[1] = round_half_even_clamped((r[i + 1] - z) / s, 0, 15);
    }
    data[i / 2] = static_cast<std::byte>(q[0] | (q[1] << 4));
  }
}

void decode_int4_per_token_head(const std::byte* data, const std::byte* scale,
                                std::span<float> out) {
  const float s = fp16_bits_to_float(load_u16(scale));
  const float z = fp16_bits_to_float(load_u16(scale + 2));
  for (size_t i = 0; i < out.size(); i += 2) {
    const auto b = static_cast<uint8_t>(data[i / 2]);
    out[i] = static_cast<float>(b & 0xF) * s + z;
    out[i + 1] = static_cast<float>(b >> 4) * s + z;
  }
}

}  // namespace kvq::quant::detail
