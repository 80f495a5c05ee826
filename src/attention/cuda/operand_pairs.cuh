// KV codes -> 16-bit MMA operand pairs, and the small warp helpers around them: the one
// definition of each that the decode kernels (decode_kernel.cuh) and the prefill / verification
// kernels (prefill_kernel.cuh, prefill_verify_kernel.cuh, prefill_wgmma_kernel.cuh) use.
//
// A pair is a 32-bit register of two fp16 / bf16 operands, the lower element in the low half.
// Every conversion here is exact: 8-bit and 4-bit codes are small integers or minifloats that
// fp16 holds exactly; scales are applied by the kernels, not here (nvfp4's block scales, powers
// of two times an E4M3 value, excepted: hmul2 by them is exact in fp16's range).
//
// The "biased" forms leave the fp16 exponent trick's constant in the operand (1024 + code): a
// kernel that takes it out after the products (a logit corrected by bias x the sum of its Q
// operands) saves the HSUB2 a pair. and_or / and_xor take the exponent bits from a register
// (`magic`, from opaque_const) so ptxas emits one LOP3 a pair, not two: a LOP3 has one
// immediate operand (docs/notes/decode-tuning.md version 24b).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cache/cuda/kv_codec_device.cuh"  // kFullMask

namespace kvq::cuda::operand_pairs {

__device__ __forceinline__ uint32_t hsub2_bits(uint32_t a, float b) {
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a), __float2half2_rn(b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, uint32_t b) {
  const __half2 r =
      __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// a * b + c on f16x2 bit patterns (one HFMA2).
__device__ __forceinline__ uint32_t hfma2_bits(uint32_t a, uint32_t b, uint32_t c) {
  const __half2 r =
      __hfma2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b),
              *reinterpret_cast<const __half2*>(&c));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// Two fp32 bit patterns -> bf16x2 (round to nearest even).
__device__ __forceinline__ uint32_t f32x2_to_bf16x2(uint32_t lo, uint32_t hi) {
  const __nv_bfloat162 r = __floats2bfloat162_rn(__uint_as_float(lo), __uint_as_float(hi));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// Two floats -> a bf16x2 (kBf16) or f16x2 pair (round to nearest even).
template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kBf16) {
    const __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&r);
  } else {
    const __half2 r = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&r);
  }
}

// A 32-bit value the compiler cannot see through (a shuffle of itself): keeps a constant in a
// register where ptxas would otherwise fold it back into an immediate.
__device__ __forceinline__ uint32_t opaque_const(uint32_t v) {
  return __shfl_sync(kFullMask, v, 0);
}
// The exponent bits of the int4 pairs (half 1024 in both halves) in a register.
__device__ __forceinline__ uint32_t int4_magic() {
  return opaque_const(0x64006400u);
}

// (t & kMask) | magic as one LOP3 (`magic` in a register).
template <uint32_t kMask>
__device__ __forceinline__ uint32_t and_or(uint32_t t, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(t), "n"(kMask), "r"(magic));
  return d;
}
// (x & kMask) ^ magic as one LOP3 (the int8 pairs: magic 0x64806480).
template <uint32_t kMask>
__device__ __forceinline__ uint32_t and_xor(uint32_t x, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(d) : "r"(x), "n"(kMask), "r"(magic));
  return d;
}

// int8 codes in bytes 0 and 2 of x -> half2 of q + 1152 (1024 + (q + 128)); int8_pair: of q.
__device__ __forceinline__ uint32_t int8_pair_biased(uint32_t x) {
  return (x & 0x00FF00FFu) ^ 0x64806480u;
}
__device__ __forceinline__ uint32_t int8_pair(uint32_t x) {
  return hsub2_bits(int8_pair_biased(x), 1152.0f);
}
// 4-bit codes in bits 0-3 and 16-19 of t -> half2 of code + 1024; uint4_pair: of the code.
__device__ __forceinline__ uint32_t uint4_pair_biased(uint32_t t) {
  return (t & 0x000F000Fu) | 0x64006400u;
}
__device__ __forceinline__ uint32_t uint4_pair(uint32_t t) {
  return hsub2_bits(uint4_pair_biased(t), 1024.0f);
}
// E2M1 codes in bits 0-3 and 16-19 of t -> half2 of their values: the code's bits land in the
// half's exponent / mantissa as value x 2^-14, then one exact scaling by 2^14.
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t t) {
  const uint32_t bits = ((t << 9) & 0x0E000E00u) | ((t << 12) & 0x80008000u);
  return hmul2_bits(bits, 0x74007400u);  // 0x7400 = 16384.0 in half
}

// E2M1 codes in bits 0-3 and 16-19 of t times s2 (a half2 of e4m3 block scales x 2^7,
// nvfp4_scale2_x128) -> half2 of value x scale x 2^-7 in one HMUL2 after the bits: exact in
// fp16 (a 2-bit times a 4-bit significand, >= 2^-17 where not 0, <= 6 x 448 x 2^-7 = 21). The
// caller gives the 2^7 back (the logit factor, the output scale).
__device__ __forceinline__ uint32_t e2m1_pair_scaled(uint32_t t, uint32_t s2) {
  return hmul2_bits(((t << 9) & 0x0E000E00u) | ((t << 12) & 0x80008000u), s2);
}

// Two fp8 codes (bits 0-15 of w) -> half2.
template <bool kE5M2>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t w) {
  uint32_t r;
  if constexpr (kE5M2)
    asm("{.reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e5m2x2 %0, t;}\n" : "=r"(r) : "r"(w));
  else
    asm("{.reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;}\n" : "=r"(r) : "r"(w));
  return r;
}
// One fp8 code pair (the low or high 16-bit half of w) -> half2. The half is split off with a
// vector mov, not masked or shifted first: ptxas then reads it in place (decode-tuning v23).
template <bool kE5M2>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t w, int high_half) {
  uint32_t r;
  if (high_half) {
    if constexpr (kE5M2)
      asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e5m2x2 %0, h;}\n"
          : "=r"(r)
          : "r"(w));
    else
      asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;}\n"
          : "=r"(r)
          : "r"(w));
  } else {
    if constexpr (kE5M2)
      asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e5m2x2 %0, l;}\n"
          : "=r"(r)
          : "r"(w));
    else
      asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;}\n"
          : "=r"(r)
          : "r"(w));
  }
  return r;
}
// Two e4m3 scale codes (bits 0-15 of w) -> half2 of each x 2^7 (<= 448 x 128 = 57344: exact).
__device__ __forceinline__ uint32_t nvfp4_scale2_x128(uint32_t w) {
  return hmul2_bits(fp8x2_to_f16x2<false>(w), 0x58005800u);  // 0x5800 = 128 in half
}

// The 8 x 8 matrix of 16-bit pairs a warp holds as a C fragment (lane: row lane / 4, columns
// 2 (lane % 4), + 1), transposed in place of the same layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// Over the 4 lanes of a C-fragment row (same lane / 4).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
  return fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(kFullMask, v, 1);
  return v + __shfl_xor_sync(kFullMask, v, 2);
}
// Over the 8 lanes of a C-fragment column (same lane % 4): the transposed products hold a
// column's kv tokens in lanes g = 0..7.
__device__ __forceinline__ float col_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 4));
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 8));
  return fmaxf(v, __shfl_xor_sync(kFullMask, v, 16));
}
__device__ __forceinline__ float col_sum(float v) {
  v += __shfl_xor_sync(kFullMask, v, 4);
  v += __shfl_xor_sync(kFullMask, v, 8);
  return v + __shfl_xor_sync(kFullMask, v, 16);
}

}  // namespace kvq::cuda::operand_pairs
