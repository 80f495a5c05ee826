// The write path of every dtype, bit for bit, against its documented arithmetic (the
// comments in src/quant/ref/*.cc), re-derived here from the element codecs (tested on their
// own) and std::nearbyint. This pins the choices a SIMD or GPU writer must copy: x / scale
// (not x * (1 / scale)), where the fp16 roundings happen, NaN-free zero rows, nibble order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "kvq/core/kv_dtype.h"
#include "kvq/quant/codec.h"
#include "quant_test_util.h"
#include "row_codec_util.h"

namespace kvq::quant {
namespace {

using testing::EncodedRow;
using testing::SeededRng;

constexpr float kFltMax = std::numeric_limits<float>::max();

float absmax_of(std::span<const float> x) {
  float m = 0;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}

int rne_clamped(float v, int lo, int hi) {
  return static_cast<int>(
      std::clamp(std::nearbyint(v), static_cast<float>(lo), static_cast<float>(hi)));
}

void put_u16(std::vector<std::byte>& out, size_t at, uint16_t v) {
  out[at] = static_cast<std::byte>(v & 0xFF);
  out[at + 1] = static_cast<std::byte>(v >> 8);
}
void put_f32(std::vector<std::byte>& out, size_t at, float f) {
  uint32_t v;
  std::memcpy(&v, &f, 4);
  for (int k = 0; k < 4; ++k)
    out[at + static_cast<size_t>(k)] = static_cast<std::byte>((v >> (8 * k)) & 0xFF);
}

// The documented encoding of one row, written out independently.
EncodedRow documented_encoding(KvDtype d, std::span<const float> x, float t) {
  const size_t n = x.size();
  EncodedRow e;
  e.data.assign(row_data_bytes(d, static_cast<int>(n)), std::byte{0});
  e.meta.assign(row_scale_bytes(d), std::byte{0});
  switch (d) {
    case KvDtype::kFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h = float_to_fp16_bits(x[i]);
        if (std::isfinite(x[i]) && (h & 0x7FFF) == 0x7C00) h = (h & 0x8000) | 0x7BFF;
        put_u16(e.data, 2 * i, h);
      }
      break;
    case KvDtype::kBFloat16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b = float_to_bf16_bits(x[i]);
        if (std::isfinite(x[i]) && (b & 0x7FFF) == 0x7F80) b = (b & 0x8000) | 0x7F7F;
        put_u16(e.data, 2 * i, b);
      }
      break;
    case KvDtype::kFloat32:
      for (size_t i = 0; i < n; ++i) put_f32(e.data, 4 * i, x[i]);
      break;
    case KvDtype::kFp8E4M3:
      for (size_t i = 0; i < n; ++i) e.data[i] = static_cast<std::byte>(fp8_e4m3_encode(x[i] / t));
      break;
    case KvDtype::kFp8E5M2:
      for (size_t i = 0; i < n; ++i) e.data[i] = static_cast<std::byte>(fp8_e5m2_encode(x[i] / t));
      break;
    case KvDtype::kInt8PerTokenHead: {
      const float s = std::min(absmax_of(x) / 127.0f, kFltMax / 128.0f);
      put_f32(e.meta, 0, s);
      for (size_t i = 0; i < n; ++i)
        e.data[i] = static_cast<std::byte>(
            static_cast<uint8_t>(s == 0 ? 0 : rne_clamped(x[i] / s, -127, 127)));
      break;
    }
    case KvDtype::kFp8PerTokenHead: {
      const float s = std::min(absmax_of(x) / 448.0f, kFltMax / 512.0f);
      put_f32(e.meta, 0, s);
      for (size_t i = 0; i < n; ++i)
        e.data[i] = static_cast<std::byte>(s == 0 ? 0 : fp8_e4m3_encode(x[i] / s));
      break;
    }
    case KvDtype::kInt4PerTokenHead: {
      std::vector<float> r(x.begin(), x.end());
      hadamard_rotate(r);
      const float lo = *std::min_element(r.begin(), r.end());
      const float hi = *std::max_element(r.begin(), r.end());
      const uint16_t sb = float_to_fp16_bits(std::min((hi - lo) / 15.0f, 65504.0f));
      const uint16_t zb = float_to_fp16_bits(std::max(lo, -65504.0f));
      put_u16(e.meta, 0, sb);
      put_u16(e.meta, 2, zb);
      const float s = fp16_bits_to_float(sb);
      const float z = fp16_bits_to_float(zb);
      for (size_t i = 0; i < n; ++i) {
        const int q = s == 0 ? 0 : rne_clamped((r[i] - z) / s, 0, 15);
        e.data[i / 2] |= static_cast<std::byte>(i % 2 == 0 ? q : q << 4);
      }
      break;
    }
    case KvDtype::kNvfp4: {
      const float d6 = 6.0f * t;
      for (size_t b = 0; b < n / 16; ++b) {
        const uint8_t sc = fp8_e4m3_encode(absmax_of(x.subspan(16 * b, 16)) / d6);
        e.data[n / 2 + b] = static_cast<std::byte>(sc);
        const float eff = fp8_e4m3_decode(sc) * t;
        for (size_t i = 16 * b; i < 16 * b + 16; ++i) {
          const uint8_t c = eff == 0 ? 0 : fp4_e2m1_encode(x[i] / eff);
          e.data[i / 2] |= static_cast<std::byte>(i % 2 == 0 ? c : c << 4);
        }
      }
      break;
    }
    case KvDtype::kAuto:
      ADD_FAILURE();
      break;
  }
  return e;
}

// Rows built to hit exact ties. Even rows: multiples of S/2 with S = 255/256 and absmax
// 127 * S, so the int8 scale is exactly S and every odd multiple is an exact tie of x / S,
// which x * (1 / S) would round away from the even neighbour (fl(1/S) is off by ~2^-24). Odd rows:
// multiples of 0.25 with block absmax 6, so with tensor scale 1 the nvfp4 effective scale is
// exactly 1 and fp4 ties are exact.
constexpr float kTieScale = 255.0f / 256.0f;

std::vector<float> tie_heavy_rows(std::mt19937& gen, int rows, int n) {
  std::uniform_int_distribution<int> half_steps(-254, 254);
  std::uniform_int_distribution<int> quarter_steps(-24, 24);
  std::vector<float> v(static_cast<size_t>(rows) * n);
  for (int r = 0; r < rows; ++r) {
    const bool even = r % 2 == 0;
    for (int i = 0; i < n; ++i)
      v[static_cast<size_t>(r) * n + i] =
          even ? kTieScale / 2 * static_cast<float>(half_steps(gen)) : 0.25f * quarter_steps(gen);
    for (int b = 0; b < n / 16; ++b)
      v[static_cast<size_t>(r) * n + 16 * b] = even ? 127 * kTieScale : 6.0f;
  }
  return v;
}

TEST(RowCodecExact, EncodingMatchesTheDocumentedArithmeticBitForBit) {
  SeededRng rng;
  SCOPED_TRACE(rng.seed_note());
  std::uniform_real_distribution<float> miscalibration(0.5f, 2.0f);
  for (KvDtype d : testing::kConcreteDtypes) {
    for (int n : {64, 128}) {
      for (int kind = 0; kind < 3; ++kind) {
        const std::vector<float> rows = kind == 0   ? testing::gaussian_rows(rng.gen, 16, n)
                                        : kind == 1 ? testing::outlier_rows(rng.gen, 16, n)
                                                    : tie_heavy_rows(rng.gen, 16, n);
        const float t =
            kind == 2 ? 1.0f : testing::calibrated_tensor_scale(d, rows) * miscalibration(rng.gen);
        for (int r = 0; r < 16; ++r) {
          const auto x = std::span<const float>(rows).subspan(static_cast<size_t>(r) * n, n);
          const EncodedRow got = testing::encode(d, x, t);
          const EncodedRow want = documented_encoding(d, x, t);
          ASSERT_EQ(got.meta, want.meta)
              << to_string(d) << " n=" << n << " kind " << kind << " row " << r;
          for (size_t i = 0; i < want.data.size(); ++i)
            ASSERT_EQ(got.data[i], want.data[i])
                << to_string(d) << " n=" << n << " kind " << kind << " row " << r << " byte " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvq::quant
