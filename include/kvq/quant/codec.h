// Scalar reference codecs for every concrete KvDtype: the ground truth that
// every faster implementation (CPU SIMD, CUDA) must match bit for bit on writes.
//
// A "row" is one (token, kv head) vector of head_dim values. Encoding writes
// row_data_bytes(dtype, head_dim) bytes of values and row_scale_bytes(dtype)
// bytes of per-row metadata (see KvSideLayout for where they live in a block).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvq/core/kv_dtype.h"

namespace kvq::quant {

// ---- element codecs -------------------------------------------------------
// Round to nearest, ties to even; finite inputs saturate to the largest finite
// value (never become NaN or inf); NaN input encodes as the format's NaN
// (e4m3: 0x7F / 0xFF by sign; e5m2: 0x7E / 0xFE). Inf input saturates.
uint8_t fp8_e4m3_encode(float x);
float fp8_e4m3_decode(uint8_t code);
uint8_t fp8_e5m2_encode(float x);
float fp8_e5m2_decode(uint8_t code);
// FP4 E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), 4-bit code in the low nibble.
// Same rounding and saturation rules; NaN encodes as +0 (E2M1 has no NaN).
uint8_t fp4_e2m1_encode(float x);
float fp4_e2m1_decode(uint8_t code);

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E5M2Max = 57344.0f;
inline constexpr float kFp4E2M1Max = 6.0f;

// ---- rotation (int4_per_token_head) ----------------------------------------
// A fixed randomized Hadamard transform along head_dim (power of two):
// y = H_n * diag(signs) * x / sqrt(n), orthonormal, so <Rq, Rk> = <q, k>.
// The signs come from a fixed seed and never change (they are part of the format).
void hadamard_rotate(std::span<float> x);
void hadamard_unrotate(std::span<float> x);
// The sign s_i (+1 or -1) applied to element `index` before the transform; the same for
// every head_dim (exposed so SIMD/GPU code can build its sign table from the one definition).
float hadamard_sign(size_t index);

// ---- row codecs ------------------------------------------------------------
// `tensor_scale` is the per-tensor (per kv head) dequantization scale for dtypes whose
// traits say uses_tensor_scale (fp8_e4m3, fp8_e5m2, nvfp4); it is ignored for others.
// Stored value = encode(x / tensor_scale); decoded value = decode(code) * tensor_scale.
// For rotated dtypes, encode_row rotates `x` first and decode_row returns values in the
// rotated space (attention rotates Q the same way and un-rotates its output).
// `scale` may be null when row_scale_bytes(dtype) == 0.
// float16 / bfloat16 storage saturates finite values to the largest finite value (an inf in
// the cache would turn attention into NaN); float_to_*_bits below are plain IEEE (inf).
// The exact arithmetic of every dtype is documented in src/quant/ref/*.cc.
void encode_row(KvDtype dtype, std::span<const float> x, float tensor_scale, std::byte* data,
                std::byte* scale);
void decode_row(KvDtype dtype, const std::byte* data, const std::byte* scale, float tensor_scale,
                std::span<float> out);
// decode_row, then undo the rotation for rotated dtypes: the round trip of encode_row.
void decode_row_unrotated(KvDtype dtype, const std::byte* data, const std::byte* scale,
                          float tensor_scale, std::span<float> out);

// Conversions used for 16-bit storage (round to nearest even, NaN preserved).
uint16_t float_to_bf16_bits(float x);
float bf16_bits_to_float(uint16_t b);
uint16_t float_to_fp16_bits(float x);
float fp16_bits_to_float(uint16_t h);

}  // namespace kvq::quant
