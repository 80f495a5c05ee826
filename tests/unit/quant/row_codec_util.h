// Row-codec test helpers: encode/decode into owned buffers, and the per-element error bound
// each dtype's format guarantees (derived from the format, not measured).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "kvq/core/kv_dtype.h"
#include "kvq/quant/codec.h"

namespace kvq::quant::testing {

inline constexpr KvDtype kConcreteDtypes[] = {
    KvDtype::kFloat16,         KvDtype::kBFloat16,         KvDtype::kFloat32,
    KvDtype::kFp8E4M3,         KvDtype::kFp8E5M2,          KvDtype::kInt8PerTokenHead,
    KvDtype::kFp8PerTokenHead, KvDtype::kInt4PerTokenHead, KvDtype::kNvfp4};

struct EncodedRow {
  std::vector<std::byte> data;
  std::vector<std::byte> meta;
};

inline EncodedRow encode(KvDtype d, std::span<const float> x, float tensor_scale) {
  EncodedRow e;
  e.data.assign(row_data_bytes(d, static_cast<int>(x.size())), std::byte{0xEE});
  e.meta.assign(row_scale_bytes(d), std::byte{0xEE});
  encode_row(d, x, tensor_scale, e.data.data(), e.meta.empty() ? nullptr : e.meta.data());
  return e;
}

inline std::vector<float> decode(KvDtype d, const EncodedRow& e, float tensor_scale, size_t n,
                                 bool unrotated) {
  std::vector<float> out(n, std::nanf(""));  // poisoned: every element must be written
  const std::byte* meta = e.meta.empty() ? nullptr : e.meta.data();
  if (unrotated)
    decode_row_unrotated(d, e.data.data(), meta, tensor_scale, out);
  else
    decode_row(d, e.data.data(), meta, tensor_scale, out);
  return out;
}

inline float meta_f32(const EncodedRow& e) {
  float v;
  std::memcpy(&v, e.meta.data(), sizeof v);
  return v;
}
inline float meta_f16(const EncodedRow& e, size_t byte_offset) {
  uint16_t v;
  std::memcpy(&v, e.meta.data() + byte_offset, sizeof v);
  return fp16_bits_to_float(v);
}

// |x - decoded| for a value coded as y = x / T in a float format with `mant_bits`, smallest
// normal 2^emin and largest finite `maxv` (saturating), decoded as code * T: half an ulp of
// y (relative 2^-(mant_bits+1) in the normal range, half the subnormal step below it), or the
// distance to maxv when saturated, plus the two fp32 roundings of x / T and code * T.
inline double float_code_bound(double x, double t, int mant_bits, int emin, double maxv) {
  const double y = std::fabs(x) / t;
  double b;
  if (y > maxv)
    b = y - maxv;
  else if (y >= std::ldexp(1.0, emin))
    b = y * std::ldexp(1.0, -(mant_bits + 1));
  else
    b = std::ldexp(1.0, emin - mant_bits - 1);
  return b * t * (1 + 0x1p-20) + 0x1p-22 * std::fabs(x);
}

inline double fp4_half_step(double u) {  // u = |x| / E, E the effective block scale
  const double v = u * (1 + 0x1p-20);    // the larger step right at a boundary
  return v <= 2.0 ? 0.25 : (v <= 4.0 ? 0.5 : 1.0);
}

// Per-element error bounds in decode_row's output space, plus that space's exact values
// (the rotated row for int4, `x` itself otherwise). Also checks, with EXPECTs, that the
// stored metadata follows the format's definition.
struct RowBounds {
  std::vector<double> reference;
  std::vector<double> bound;
};

inline RowBounds row_bounds(KvDtype d, std::span<const float> x, float t, const EncodedRow& e) {
  const size_t n = x.size();
  RowBounds rb;
  rb.reference.assign(x.begin(), x.end());
  rb.bound.assign(n, 0.0);
  double absmax = 0;
  for (float v : x) absmax = std::max(absmax, std::fabs(static_cast<double>(v)));
  switch (d) {
    case KvDtype::kFloat32:
      break;
    case KvDtype::kFloat16:
      for (size_t i = 0; i < n; ++i) rb.bound[i] = float_code_bound(x[i], 1, 10, -14, 65504);
      break;
    case KvDtype::kBFloat16:
      for (size_t i = 0; i < n; ++i) rb.bound[i] = float_code_bound(x[i], 1, 7, -126, 0x1.FEp127);
      break;
    case KvDtype::kFp8E4M3:
      for (size_t i = 0; i < n; ++i) rb.bound[i] = float_code_bound(x[i], t, 3, -6, 448);
      break;
    case KvDtype::kFp8E5M2:
      for (size_t i = 0; i < n; ++i) rb.bound[i] = float_code_bound(x[i], t, 2, -14, 57344);
      break;
    case KvDtype::kInt8PerTokenHead: {
      const float s = meta_f32(e);
      EXPECT_EQ(s, static_cast<float>(absmax) / 127.0f) << "int8 scale = absmax / 127";
      // |x/s - q| <= 1/2 plus the roundings of x / s and q * s (each <= 2^-24 * 128).
      for (size_t i = 0; i < n; ++i) rb.bound[i] = s == 0 ? std::fabs(x[i]) : s * (0.5 + 0x1p-16);
      break;
    }
    case KvDtype::kFp8PerTokenHead: {
      const float s = meta_f32(e);
      EXPECT_EQ(s, static_cast<float>(absmax) / 448.0f) << "fp8 scale = absmax / 448";
      for (size_t i = 0; i < n; ++i)
        rb.bound[i] = s == 0 ? std::fabs(x[i]) : float_code_bound(x[i], s, 3, -6, 448);
      break;
    }
    case KvDtype::kInt4PerTokenHead: {
      std::vector<float> r(x.begin(), x.end());
      hadamard_rotate(r);
      rb.reference.assign(r.begin(), r.end());
      const double lo = *std::min_element(r.begin(), r.end());
      const double hi = *std::max_element(r.begin(), r.end());
      const double s = meta_f16(e, 0);
      const double z = meta_f16(e, 2);
      // fp16 RNE: relative 2^-11 in the normal range, 2^-25 absolute below it.
      EXPECT_LE(std::fabs(s - (hi - lo) / 15), 0x1p-11 * (hi - lo) / 15 + 0x1p-25)
          << "int4 scale = fp16((max - min) / 15)";
      EXPECT_LE(std::fabs(z - lo), 0x1p-11 * std::fabs(lo) + 0x1p-25) << "int4 zero = fp16(min)";
      for (size_t i = 0; i < n; ++i) {
        const double ri = r[i];
        rb.bound[i] = s * 0.5 + std::max(0.0, z - ri) + std::max(0.0, ri - (z + 15 * s)) +
                      s * 0x1p-17 + 0x1p-22 * (std::fabs(ri) + std::fabs(z));
      }
      break;
    }
    case KvDtype::kNvfp4: {
      for (size_t b = 0; b < n / 16; ++b) {
        double amax = 0;
        for (size_t i = 16 * b; i < 16 * b + 16; ++i)
          amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
        const float bs = fp8_e4m3_decode(static_cast<uint8_t>(e.data[n / 2 + b]));
        const double a = amax / (6.0 * t);
        EXPECT_LE(std::fabs(bs - a), float_code_bound(a, 1, 3, -6, 448) + 1e-6 * a)
            << "nvfp4 block scale = e4m3(absmax / (6 * tensor_scale))";
        const double eff = static_cast<double>(bs) * t;
        for (size_t i = 16 * b; i < 16 * b + 16; ++i) {
          const double ax = std::fabs(static_cast<double>(x[i]));
          const double slop = 0x1p-20 * (ax + 6 * eff);
          if (eff == 0)
            rb.bound[i] = ax;
          else if (ax / eff > 6)
            rb.bound[i] = ax - 6 * eff + slop;
          else
            rb.bound[i] = fp4_half_step(ax / eff) * eff + slop;
        }
      }
      break;
    }
    case KvDtype::kAuto:
      ADD_FAILURE() << "auto is not a storage dtype";
      break;
  }
  return rb;
}

// The per-tensor scale a calibration would pick for this data: absmax maps to the
// format's largest value (nvfp4: largest fp4 value times largest block scale); 0 if unused.
inline float calibrated_tensor_scale(KvDtype d, std::span<const float> all) {
  double absmax = 0;
  for (float v : all) absmax = std::max(absmax, std::fabs(static_cast<double>(v)));
  switch (d) {
    case KvDtype::kFp8E4M3:
      return static_cast<float>(absmax / 448.0);
    case KvDtype::kFp8E5M2:
      return static_cast<float>(absmax / 57344.0);
    case KvDtype::kNvfp4:
      return static_cast<float>(absmax / (448.0 * 6.0));
    default:
      return 1.0f;
  }
}

}  // namespace kvq::quant::testing
