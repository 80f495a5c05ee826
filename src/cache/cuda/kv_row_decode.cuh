// Exact device decoders of one stored cache row, every dtype (the reference codecs' arithmetic,
// src/quant/ref/): the row's (scale, zero) metadata and its elements as fp32, for a dtype known
// at compile time or at run time. Shared by the generic attention kernel and the prefill's
// staging (values of rotated dtypes stay in the rotated space; callers un-rotate).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "cache/cuda/kv_codec_device.cuh"
#include "kvq/core/kv_dtype.h"

namespace kvq::cuda {

__device__ __forceinline__ float dec_e5m2(uint32_t code) {
  const uint32_t mag = code & 0x7Fu;
  float v;
  if (mag == 0x7Cu)
    v = __uint_as_float(kF32Inf);
  else if (mag > 0x7Cu)
    v = __uint_as_float(0x7FC00000u);
  else
    v = mf::decode_code_magnitude(mag, mf::kE5M2);
  return (code & 0x80u) != 0 ? -v : v;
}

__device__ __forceinline__ float dec_e2m1(uint32_t code) {
  const float v = mf::decode_code_magnitude(code & 0x7u, mf::kE2M1);
  return (code & 0x8u) != 0 ? -v : v;
}

// Per-row metadata as (scale, zero): the per-token scale (int4: fp16 scale and zero point),
// or the per-tensor scale for tensor-scaled dtypes.
template <KvDtype D>
__device__ __forceinline__ float2 row_meta(const uint8_t* meta, float tensor_scale) {
  if constexpr (D == KvDtype::kInt8PerTokenHead || D == KvDtype::kFp8PerTokenHead) {
    return make_float2(*reinterpret_cast<const float*>(meta), 0.0f);
  } else if constexpr (D == KvDtype::kInt4PerTokenHead) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(meta);
    return make_float2(f16_bits_to_f32(w & 0xFFFFu), f16_bits_to_f32(w >> 16));
  } else {
    return make_float2(tensor_scale, 0.0f);
  }
}

// Element d of a row of head_dim hd (values in the rotated space for rotated dtypes).
template <KvDtype D>
__device__ __forceinline__ float element(const uint8_t* row, int hd, int d, float2 m) {
  if constexpr (D == KvDtype::kFloat32) {
    return reinterpret_cast<const float*>(row)[d];
  } else if constexpr (D == KvDtype::kFloat16) {
    return f16_bits_to_f32(reinterpret_cast<const uint16_t*>(row)[d]);
  } else if constexpr (D == KvDtype::kBFloat16) {
    return __uint_as_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(row)[d]) << 16);
  } else if constexpr (D == KvDtype::kFp8E4M3 || D == KvDtype::kFp8PerTokenHead) {
    return __fmul_rn(dec_e4m3(row[d]), m.x);
  } else if constexpr (D == KvDtype::kFp8E5M2) {
    return __fmul_rn(dec_e5m2(row[d]), m.x);
  } else if constexpr (D == KvDtype::kInt8PerTokenHead) {
    return __fmul_rn(static_cast<float>(static_cast<int8_t>(row[d])), m.x);
  } else if constexpr (D == KvDtype::kInt4PerTokenHead) {
    const uint32_t q = (row[d >> 1] >> (4 * (d & 1))) & 0xFu;
    return __fadd_rn(__fmul_rn(static_cast<float>(q), m.x), m.y);
  } else {
    static_assert(D == KvDtype::kNvfp4);
    const uint32_t c = (row[d >> 1] >> (4 * (d & 1))) & 0xFu;
    const float bs = dec_e4m3(row[hd / 2 + d / 16]);
    return __fmul_rn(__fmul_rn(dec_e2m1(c), bs), m.x);
  }
}

// The same for a dtype known at run time (the any-pair kernel): one uniform branch per call.
__device__ __forceinline__ float2 row_meta_rt(KvDtype d, const uint8_t* meta, float tensor_scale) {
  switch (d) {
    case KvDtype::kInt8PerTokenHead:
      return row_meta<KvDtype::kInt8PerTokenHead>(meta, tensor_scale);
    case KvDtype::kFp8PerTokenHead:
      return row_meta<KvDtype::kFp8PerTokenHead>(meta, tensor_scale);
    case KvDtype::kInt4PerTokenHead:
      return row_meta<KvDtype::kInt4PerTokenHead>(meta, tensor_scale);
    default:
      return row_meta<KvDtype::kFloat32>(meta, tensor_scale);  // the tensor scale
  }
}
__device__ __forceinline__ float element_rt(KvDtype d, const uint8_t* row, int hd, int i,
                                            float2 m) {
  switch (d) {
    case KvDtype::kFloat32:
      return element<KvDtype::kFloat32>(row, hd, i, m);
    case KvDtype::kFloat16:
      return element<KvDtype::kFloat16>(row, hd, i, m);
    case KvDtype::kBFloat16:
      return element<KvDtype::kBFloat16>(row, hd, i, m);
    case KvDtype::kFp8E4M3:
      return element<KvDtype::kFp8E4M3>(row, hd, i, m);
    case KvDtype::kFp8PerTokenHead:
      return element<KvDtype::kFp8PerTokenHead>(row, hd, i, m);
    case KvDtype::kFp8E5M2:
      return element<KvDtype::kFp8E5M2>(row, hd, i, m);
    case KvDtype::kInt8PerTokenHead:
      return element<KvDtype::kInt8PerTokenHead>(row, hd, i, m);
    case KvDtype::kInt4PerTokenHead:
      return element<KvDtype::kInt4PerTokenHead>(row, hd, i, m);
    default:
      return element<KvDtype::kNvfp4>(row, hd, i, m);
  }
}
}  // namespace kvq::cuda
