// Per-dtype row encoders/decoders behind the encode_row / decode_row switch, and the
// small exact helpers they share. Arguments are already checked by row_codec.cc.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

namespace kvq::quant::detail {

// Round v to the nearest integer, ties to even, then clamp to [lo, hi]; NaN gives 0 (then
// clamped), as CUDA's cvt.rni.s32.f32 does. Exact and independent of the rounding mode:
// floor() is exact and |v| - floor(|v|) is exact (Sterbenz), so no rounding happens here.
// Equivalent to __float2int_rn followed by min/max on a GPU.
inline int round_half_even_clamped(float v, int lo, int hi) {
  if (std::isnan(v)) return lo > 0 ? lo : (hi < 0 ? hi : 0);
  if (v <= static_cast<float>(lo)) return lo;
  if (v >= static_cast<float>(hi)) return hi;
  const float a = std::fabs(v);
  const float fl = std::floor(a);
  const float frac = a - fl;
  int i = static_cast<int>(fl);
  if (frac > 0.5f || (frac == 0.5f && (i & 1) != 0)) ++i;
  return v < 0.0f ? -i : i;
}

// Largest |x| over the finite elements (NaN and inf are skipped); 0 for none.
inline float finite_absmax(std::span<const float> x) {
  float m = 0.0f;
  for (float v : x) {
    const float a = std::fabs(v);
    if (std::isfinite(a) && a > m) m = a;
  }
  return m;
}

// float -> fp16 bits, RNE; a finite value beyond 65504 saturates to +-65504 instead of inf.
// With `saturate_inf` an infinite input saturates too (metadata must stay finite).
uint16_t float_to_fp16_bits_satfinite(float x, bool saturate_inf);
// float -> bf16 bits, RNE; a finite value beyond the largest bf16 saturates to it.
uint16_t float_to_bf16_bits_satfinite(float x);

void encode_int8_per_token_head(std::span<const float> x, std::byte* data, std::byte* scale);
void decode_int8_per_token_head(const std::byte* data, const std::byte* scale,
                                std::span<float> out);
void encode_fp8_per_token_head(std::span<const float> x, std::byte* data, std::byte* scale);
void decode_fp8_per_token_head(const std::byte* data, const std::byte* scale, std::span<float> out);
void encode_int4_per_token_head(std::span<const float> x, std::byte* data, std::byte* scale);
void decode_int4_per_token_head(const std::byte* data, const std::byte* scale,
                                std::span<float> out);
void encode_nvfp4(std::span<const float> x, float tensor_scale, std::byte* data);
void decode_nvfp4(const std::byte* data, float tensor_scale, std::span<float> out);

}  // namespace kvq::quant::detail
