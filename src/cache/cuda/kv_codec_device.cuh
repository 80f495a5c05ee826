// Device-side pieces of the KV codecs, shared by the cache-write kernel and the attention
// kernels: the element encoders (the integer rounding of quant/ref/minifloat.h, used as is, so
// the GPU and the reference share one definition), warp reductions, and the randomized
// Hadamard rotation of a head_dim row spread over one warp.
//
// Bit-exactness with the reference codecs rests on: IEEE fp32 operations with round to
// nearest even and no flush to zero (kvq never builds CUDA code with fast math), explicit
// __fdiv_rn / __fmul_rn / __fadd_rn / __fsub_rn where the reference does one operation (so
// nothing is contracted into an FMA), and the same operation order (see each codec's file in
// src/quant/ref/).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "quant/ref/minifloat.h"

namespace kvq::cuda {

namespace mf = kvq::quant::detail;

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr uint32_t kF32Inf = 0x7F800000u;

// Sign pattern of the Hadamard rotation for indices 0..255, built on the host from
// kvq::quant::hadamard_sign (the one definition), passed to kernels by value.
struct HadamardSigns {
  uint32_t bits[8];  // bit i set: element i is negated before the transform
};
constexpr int kMaxRotatedDim = 256;
// Host: the table from kvq::quant::hadamard_sign (defined in cache_write.cu).
HadamardSigns make_hadamard_signs();

__device__ __forceinline__ bool hadamard_negative(const HadamardSigns& s, int i) {
  return ((s.bits[i >> 5] >> (i & 31)) & 1u) != 0;
}

// ---- element encoders (bit patterns of the reference, see fp8.cc / fp4.cc / float16.cc) ----

__device__ __forceinline__ uint32_t enc_e4m3(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t sign = (bits >> 31) << 7;
  const uint32_t a = bits & 0x7FFFFFFFu;
  if (a > kF32Inf) return sign | 0x7Fu;
  if (a == kF32Inf) return sign | 0x7Eu;
  uint32_t mag = mf::round_to_code_magnitude(a, mf::kE4M3);
  if (mag > 0x7Eu) mag = 0x7Eu;
  return sign | mag;
}

__device__ __forceinline__ uint32_t enc_e5m2(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t sign = (bits >> 31) << 7;
  const uint32_t a = bits & 0x7FFFFFFFu;
  if (a > kF32Inf) return sign | 0x7Eu;
  if (a == kF32Inf) return sign | 0x7Bu;
  uint32_t mag = mf::round_to_code_magnitude(a, mf::kE5M2);
  if (mag > 0x7Bu) mag = 0x7Bu;
  return sign | mag;
}

__device__ __forceinline__ uint32_t enc_e2m1(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t a = bits & 0x7FFFFFFFu;
  if (a > kF32Inf) return 0u;  // E2M1 has no NaN: +0
  const uint32_t sign = (bits >> 31) << 3;
  if (a == kF32Inf) return sign | 0x7u;
  uint32_t mag = mf::round_to_code_magnitude(a, mf::kE2M1);
  if (mag > 0x7u) mag = 0x7u;
  return sign | mag;
}

// e4m3 code -> float, exact (NaN for 0x7F / 0xFF).
__device__ __forceinline__ float dec_e4m3(uint32_t code) {
  const uint32_t mag = code & 0x7Fu;
  float v = mag == 0x7Fu ? __uint_as_float(0x7FC00000u) : mf::decode_code_magnitude(mag, mf::kE4M3);
  return (code & 0x80u) != 0 ? -v : v;
}

// float -> IEEE half bits, RNE, overflow to inf, NaN quieted with its top payload bits.
__device__ __forceinline__ uint32_t f32_to_f16_bits(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t sign = (bits >> 31) << 15;
  const uint32_t a = bits & 0x7FFFFFFFu;
  if (a > kF32Inf) return sign | 0x7E00u | ((a >> 13) & 0x3FFu);
  if (a == kF32Inf) return sign | 0x7C00u;
  uint32_t mag = mf::round_to_code_magnitude(a, mf::kF16);
  if (mag > 0x7C00u) mag = 0x7C00u;
  return sign | mag;
}

// float16 storage / int4 metadata: finite values past 65504 saturate; with saturate_inf an
// infinite input saturates too.
__device__ __forceinline__ uint32_t f32_to_f16_bits_satfinite(float x, bool saturate_inf) {
  uint32_t h = f32_to_f16_bits(x);
  const bool finite = (__float_as_uint(x) & 0x7FFFFFFFu) < kF32Inf;
  if ((h & 0x7FFFu) == 0x7C00u && (saturate_inf || finite)) h = (h & 0x8000u) | 0x7BFFu;
  return h;
}

__device__ __forceinline__ uint32_t f32_to_bf16_bits_satfinite(float x) {
  const uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7FFFFFFFu) > kF32Inf) return ((bits >> 16) | 0x40u) & 0xFFFFu;
  const uint32_t lsb = (bits >> 16) & 1u;
  uint32_t b = ((bits + 0x7FFFu + lsb) >> 16) & 0xFFFFu;
  const bool finite = (bits & 0x7FFFFFFFu) < kF32Inf;
  if ((b & 0x7FFFu) == 0x7F80u && finite) b = (b & 0x8000u) | 0x7F7Fu;
  return b;
}

__device__ __forceinline__ float f16_bits_to_f32(uint32_t h) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

__device__ __forceinline__ bool is_finite_f32(float x) {
  return (__float_as_uint(x) & 0x7FFFFFFFu) < kF32Inf;
}

// round_half_even_clamped of row_formats.h: NaN -> 0 (clamped), saturating, RNE (rintf is
// cvt.rni, round to nearest even).
__device__ __forceinline__ int round_half_even_clamped(float v, int lo, int hi) {
  if (v != v) return lo > 0 ? lo : (hi < 0 ? hi : 0);
  if (v <= static_cast<float>(lo)) return lo;
  if (v >= static_cast<float>(hi)) return hi;
  return static_cast<int>(rintf(v));
}

// ---- warp reductions -----------------------------------------------------------------------

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// The largest finite |x[e]| over a lane's E values and the whole warp (0 where there is none):
// the scale search of the per-token-head codecs and of Q's fp16 operands.
template <int E>
__device__ __forceinline__ float warp_finite_amax(const float (&x)[E]) {
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float a = fabsf(x[e]);
    if (is_finite_f32(a) && a > amax) amax = a;
  }
  return warp_max(amax);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// ---- Hadamard rotation over one warp ----------------------------------------------------------
// A row of n = 32 * E values, lane l holding elements [l*E, l*E + E). The stages run in the
// reference's order (h = 1, 2, 4, ...; in-register stages first, then across lanes), each
// pair (a, b) -> (a + b, a - b) with one fp32 rounding, so the result is bit-identical to
// hadamard_rotate / hadamard_unrotate.

template <int E>
__device__ __forceinline__ void warp_fwht(float (&x)[E], int lane) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if ((e & h) == 0) {
        const float a = x[e], b = x[e + h];
        x[e] = __fadd_rn(a, b);
        x[e + h] = __fsub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int lm = 1; lm < 32; lm <<= 1) {
    const bool upper = (lane & lm) != 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float other = __shfl_xor_sync(kFullMask, x[e], lm);
      x[e] = upper ? __fsub_rn(other, x[e]) : __fadd_rn(x[e], other);
    }
  }
}

// 1/sqrt(n) as the reference computes it (hadamard.cc: inv_sqrt_n), n = 2^k.
__device__ __forceinline__ float hadamard_inv_sqrt(int k) {
  if (k % 2 == 0) return __uint_as_float(static_cast<uint32_t>(127 - k / 2) << 23);
  // 2^(-(k-1)/2) * 0x1.6a09e6p-1f: exact, so only the exponent changes.
  return __uint_as_float(0x3F3504F3u - (static_cast<uint32_t>((k - 1) / 2) << 23));
}

template <int E>
__device__ __forceinline__ void warp_hadamard_rotate(float (&x)[E], int lane,
                                                     const HadamardSigns& signs) {
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (hadamard_negative(signs, lane * E + e)) x[e] = -x[e];
  warp_fwht<E>(x, lane);
  const float c = hadamard_inv_sqrt(__ffs(32 * E) - 1);
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = __fmul_rn(x[e], c);
}

template <int E>
__device__ __forceinline__ void warp_hadamard_unrotate(float (&x)[E], int lane,
                                                       const HadamardSigns& signs) {
  warp_fwht<E>(x, lane);
  const float c = hadamard_inv_sqrt(__ffs(32 * E) - 1);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    x[e] = __fmul_rn(x[e], c);
    if (hadamard_negative(signs, lane * E + e)) x[e] = -x[e];
  }
}

}  // namespace kvq::cuda
