// The AVX-512 (F, BW, VL) work-item kernel of cpu_avx512 and its tile decoders.
//
// Everything below the target pragma is either in an anonymous namespace or uniquely named,
// and uses intrinsics and raw pointers only: a std template instantiated here could be
// merged by the linker with the generic copy and run AVX-512 code on a CPU without it.
// The driver calls in only after cpu_has_avx512().
//
// Decoders reproduce the reference codecs' arithmetic (src/quant/ref) bit for bit:
// fp8 goes through fp16 (e5m2 is the top byte of an fp16; e4m3 shifted into an fp16 is its
// value / 256, an exact power-of-two step), int4 is fma(q, S, Z), nvfp4 is
// (fp4 * block scale) * T.
// Integer Q·K (int8/int4_per_token_head K, see KDot in kernel.h): int_dot_avx512.inc, compiled
// twice: with vpmaddubsw + vpmaddwd under this file's target, and with vpdpbusd in a region of
// its own at the end of the file whose target adds avx512vnni, so no VNNI instruction can
// reach a CPU without it.
// GCC 12's AVX-512 headers self-initialize "undefined" vectors (`__m512 __Y = __Y;`), which
// -Wuninitialized flags at every use (GCC bug 105593, fixed in 12.3); the warning is keyed to
// the header's lines, so silencing it around the include leaves this file's own code checked.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>

#include "attention/cpu_avx512/kernel.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#endif

namespace kvq::cpu_attn {

namespace {

// ---- small helpers (no std templates here, see above) ------------------------------------

int imin(int a, int b) {
  return a < b ? a : b;
}
int imax(int a, int b) {
  return a > b ? a : b;
}
float fmax1(float a, float b) {
  return a > b ? a : b;
}

float load_f32(const std::byte* p) {
  float v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// e4m3 magnitude bits placed in an fp16 (exponent 0EEEE, mantissa MMM0000000) give the
// e4m3 value / 2^8 for normals and subnormals alike, so value * scale = fp16 * (2^8 * scale),
// exactly, while 2^8 * scale is finite (else the 2^8 goes on separately). The one e4m3 NaN
// magnitude (0x7F) would land on a finite fp16, so it is patched to an fp16 NaN.
// 32 codes -> two vectors of 16 values.
void e4m3x32(__m256i codes, float scale, __m512& lo, __m512& hi) {
  const __m512i u = _mm512_cvtepu8_epi16(codes);
  __m512i h = _mm512_slli_epi16(u, 7);  // magnitude at bits 7-13, sign at bit 14
  h = _mm512_add_epi16(h, _mm512_and_si512(h, _mm512_set1_epi16(0x4000)));  // sign to bit 15
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(u, _mm512_set1_epi16(0x7F)),
                                                _mm512_set1_epi16(0x7F));
  h = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7E00));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  const float folded = 256.0f * scale;
  if (__builtin_isinf(folded) && !__builtin_isinf(scale)) {
    lo = _mm512_mul_ps(lo, _mm512_set1_ps(256.0f));
    hi = _mm512_mul_ps(hi, _mm512_set1_ps(256.0f));
    lo = _mm512_mul_ps(lo, _mm512_set1_ps(scale));
    hi = _mm512_mul_ps(hi, _mm512_set1_ps(scale));
  } else {
    lo = _mm512_mul_ps(lo, _mm512_set1_ps(folded));
    hi = _mm512_mul_ps(hi, _mm512_set1_ps(folded));
  }
}

// 64 4-bit codes from 32 bytes (element 2i in the low nibble of byte i) as four vectors of
// 16 lane indices: idx[k] holds elements 16k .. 16k + 15.
void nibbles_x64(const std::byte* p, __m512i idx[4]) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(x, mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
  // Within each 128-bit lane: unpacklo interleaves bytes 0-7 (elements 0-15 of the lane's
  // 32), unpackhi bytes 8-15 (elements 16-31).
  const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
  idx[0] = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(a));
  idx[1] = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(b));
  idx[2] = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(a, 1));
  idx[3] = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1));
}

constexpr float e4m3_value(unsigned code) {
  const unsigned mag = code & 0x7F;
  const int e = static_cast<int>(mag >> 3);
  const float m = static_cast<float>(mag & 7) / 8.0f;
  float v = e == 0 ? m : 1.0f + m;  // subnormal: 0.m * 2^-6; normal: 1.m * 2^(e-7)
  for (int i = 0; i < (e == 0 ? 6 : 7 - e); ++i) v /= 2.0f;
  for (int i = 0; i < e - 7; ++i) v *= 2.0f;
  return (code & 0x80) ? -v : v;
}
struct E4m3Table {
  float v[256];
};
constexpr E4m3Table make_e4m3_table() {
  E4m3Table t{};
  for (unsigned c = 0; c < 256; ++c) t.v[c] = e4m3_value(c);
  return t;
}
// Block scales of nvfp4 are finite e4m3 codes (the encoder saturates); NaN codes (0x7F, 0xFF)
// cannot occur, the table holds 480 for them.
constexpr E4m3Table kE4m3 = make_e4m3_table();
static_assert(kE4m3.v[0x7E] == 448.0f && kE4m3.v[0x01] == 0.001953125f && kE4m3.v[0xB8] == -1.0f);

// ---- tile decoders: rows [0, n) of src to out[n][dim] ------------------------------------

template <typename ChunkFn>
inline void for_each_chunk(const TileSource& s, int n, float* out, ChunkFn fn) {
  const int chunks = s.dim / 16;
  for (int i = 0; i < n; ++i) {
    const std::byte* row = s.values + static_cast<size_t>(i) * s.row_data_bytes;
    const std::byte* meta = s.scales + static_cast<size_t>(i) * s.row_scale_bytes;
    float* o = out + static_cast<size_t>(i) * s.dim;
    fn(row, meta, chunks, o);
  }
}

void decode_f32(const TileSource& s, int n, float* out) {
  for_each_chunk(s, n, out, [](const std::byte* row, const std::byte*, int chunks, float* o) {
    for (int c = 0; c < chunks; ++c)
      _mm512_storeu_ps(o + 16 * c, _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 16 * c));
  });
}

void decode_f16(const TileSource& s, int n, float* out) {
  for_each_chunk(s, n, out, [](const std::byte* row, const std::byte*, int chunks, float* o) {
    for (int c = 0; c < chunks; ++c)
      _mm512_storeu_ps(
          o + 16 * c,
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c))));
  });
}

void decode_bf16(const TileSource& s, int n, float* out) {
  for_each_chunk(s, n, out, [](const std::byte* row, const std::byte*, int chunks, float* o) {
    for (int c = 0; c < chunks; ++c) {
      const __m512i w =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
      _mm512_storeu_ps(o + 16 * c, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
  });
}

// fp8 rows in steps of 32 values (head dims are multiples of 32 here: 64, 128, 256).
void decode_e4m3(const TileSource& s, int n, float* out) {
  const float k = s.tensor_scale;
  for_each_chunk(s, n, out, [k](const std::byte* row, const std::byte*, int chunks, float* o) {
    for (int c = 0; c < chunks; c += 2) {
      __m512 lo, hi;
      e4m3x32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c)), k, lo, hi);
      _mm512_storeu_ps(o + 16 * c, lo);
      _mm512_storeu_ps(o + 16 * c + 16, hi);
    }
  });
}

// ---- unscaled fp8 decoders (kernel.h: unscaled_factor) ------------------------------------

// Whether any of the row's dim codes (dim a multiple of 64) is an e4m3 NaN (magnitude 0x7F).
bool e4m3_row_has_nan(const std::byte* row, int dim) {
  const __m512i m = _mm512_set1_epi8(0x7F);
  __mmask64 nan = 0;
  for (int c = 0; c < dim; c += 64)
    nan |= _mm512_testn_epi8_mask(_mm512_xor_si512(_mm512_loadu_si512(row + c), m), m);
  return nan != 0;
}

// The codes sign-extended to 16 bits and shifted left by 7 put the magnitude at bits 7-13 and
// the sign at bits 14 and up; clearing bit 14 leaves the fp16 of value / 256. A row with a NaN
// code (a NaN in the model) takes e4m3x32, whose factor 256 * (1 / 256) is exactly 1.
void decode_e4m3_unscaled(const TileSource& s, int n, float* out) {
  for_each_chunk(s, n, out, [](const std::byte* row, const std::byte*, int chunks, float* o) {
    if (e4m3_row_has_nan(row, 16 * chunks)) {
      for (int c = 0; c < chunks; c += 2) {
        __m512 lo, hi;
        e4m3x32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c)), 1.0f / 256, lo,
                hi);
        _mm512_storeu_ps(o + 16 * c, lo);
        _mm512_storeu_ps(o + 16 * c + 16, hi);
      }
      return;
    }
    for (int c = 0; c < chunks; c += 2) {
      const __m512i u =
          _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c)));
      const __m512i h =
          _mm512_and_si512(_mm512_slli_epi16(u, 7), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
      _mm512_storeu_ps(o + 16 * c, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
      _mm512_storeu_ps(o + 16 * c + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
    }
  });
}

// e5m2 is the top byte of an fp16: the value, times the tensor scale unless kScaled is false
// (the unscaled decoder, kernel.h: unscaled_factor).
template <bool kScaled>
void decode_e5m2_t(const TileSource& s, int n, float* out) {
  const __m512 k = _mm512_set1_ps(s.tensor_scale);
  for_each_chunk(s, n, out, [k](const std::byte* row, const std::byte*, int chunks, float* o) {
    for (int c = 0; c < chunks; c += 2) {
      const __m512i h = _mm512_slli_epi16(
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c))),
          8);
      __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
      __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
      if constexpr (kScaled) {
        lo = _mm512_mul_ps(lo, k);
        hi = _mm512_mul_ps(hi, k);
      }
      _mm512_storeu_ps(o + 16 * c, lo);
      _mm512_storeu_ps(o + 16 * c + 16, hi);
    }
  });
}

void decode_int8_pth(const TileSource& s, int n, float* out) {
  for_each_chunk(s, n, out, [](const std::byte* row, const std::byte* meta, int chunks, float* o) {
    const __m512 k = _mm512_set1_ps(load_f32(meta));
    for (int c = 0; c < chunks; ++c) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c));
      _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), k));
    }
  });
}

void decode_fp8_pth(const TileSource& s, int n, float* out) {
  for_each_chunk(s, n, out, [](const std::byte* row, const std::byte* meta, int chunks, float* o) {
    const float k = load_f32(meta);
    for (int c = 0; c < chunks; c += 2) {
      __m512 lo, hi;
      e4m3x32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c)), k, lo, hi);
      _mm512_storeu_ps(o + 16 * c, lo);
      _mm512_storeu_ps(o + 16 * c + 16, hi);
    }
  });
}

// int4: each row's 16 possible values fma(q, S, Z) go in a table once, then every element is
// a lane permute of it (the reference computes the same fma per element).
void decode_int4_pth(const TileSource& s, int n, float* out) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for_each_chunk(
      s, n, out, [iota](const std::byte* row, const std::byte* meta, int chunks, float* o) {
        const __m512 scale = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(load_u16(meta))));
        const __m512 zero =
            _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(load_u16(meta + 2))));
        const __m512 table = _mm512_fmadd_ps(iota, scale, zero);
        for (int c = 0; c < chunks; c += 4) {
          __m512i idx[4];
          nibbles_x64(row + 8 * c, idx);
          for (int k = 0; k < 4; ++k)
            _mm512_storeu_ps(o + 16 * (c + k), _mm512_permutexvar_ps(idx[k], table));
        }
      });
}

// nvfp4: per 16-value block, a table of the 16 E2M1 values times the block scale, times T
// (the reference's order of the two multiplications), then lane permutes.
void decode_nvfp4(const TileSource& s, int n, float* out) {
  const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                    -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  const __m512 t = _mm512_set1_ps(s.tensor_scale);
  const int dim = s.dim;
  for_each_chunk(s, n, out, [&](const std::byte* row, const std::byte*, int chunks, float* o) {
    const std::byte* block_scales = row + dim / 2;
    for (int c = 0; c < chunks; c += 4) {
      __m512i idx[4];
      nibbles_x64(row + 8 * c, idx);
      for (int k = 0; k < 4; ++k) {
        const __m512 bs = _mm512_set1_ps(kE4m3.v[static_cast<uint8_t>(block_scales[c + k])]);
        const __m512 table = _mm512_mul_ps(_mm512_mul_ps(lut, bs), t);
        _mm512_storeu_ps(o + 16 * (c + k), _mm512_permutexvar_ps(idx[k], table));
      }
    }
  });
}

// ---- math ---------------------------------------------------------------------------------

// e^x, about 1 ulp (Cephes expf polynomial, scalef for the 2^n step: no overflow tricks).
// x goes second into min/max, which return their second operand for a NaN: a NaN logit (a NaN
// or unwritten K row) stays NaN instead of becoming e^88.7.
__m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.7f), x);
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(x / cap), tanh(y) = sign(y) * (1 - e) / (1 + e) with e = e^(-2|y|).
__m512 soft_cap16(__m512 x, float cap) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.0f / cap));
  const __m512i sign =
      _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 e = exp16(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 signed_t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
  return _mm512_mul_ps(signed_t, _mm512_set1_ps(cap));
}

// Lane t of the result is the sum of the lanes of a[t]: four rounds of pairwise merging
// (within 128-bit lanes, then across them), 45 shuffles/adds for 16 dot products.
inline __attribute__((always_inline)) __m512 reduce16(const __m512* a) {
  __m512 s1[8];
  for (int i = 0; i < 8; ++i)
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                          _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  // s1[i] per 128-bit lane: (a2i, a2i+1, a2i, a2i+1) partial sums.
  __m512 s2[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(s1[2 * i]), y = _mm512_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // s2[i] 128-bit lane L: sums of a[4i .. 4i+3] over lane L.
  __m512 s3[2];
  for (int i = 0; i < 2; ++i)
    s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
  // s3[i] = [s2[2i].L0+L1, s2[2i].L2+L3, s2[2i+1].L0+L1, s2[2i+1].L2+L3]
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88),
                       _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
}

// Integer Q·K: the per-token int32 vectors of a tile reduced as in reduce16, the first round
// (two tokens) as soon as they are computed, which keeps 8 vectors per query live instead
// of 16. merge_token_pair(a[2i], a[2i+1]) -> s1[i]; reduce_token_pairs(s1): lane t = token t's
// sum (exact: integer adds).
inline __attribute__((always_inline)) __m512i merge_token_pair(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
inline __attribute__((always_inline)) __m512i reduce_token_pairs(const __m512i* s1) {
  __m512i s2[4];
  for (int i = 0; i < 4; ++i)
    s2[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(s1[2 * i], s1[2 * i + 1]),
                             _mm512_unpackhi_epi64(s1[2 * i], s1[2 * i + 1]));
  __m512i s3[2];
  for (int i = 0; i < 2; ++i)
    s3[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                             _mm512_shuffle_i32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(s3[0], s3[1], 0x88),
                          _mm512_shuffle_i32x4(s3[0], s3[1], 0xDD));
}

// The 4-bit codes of one int4 row as CK vectors of 64 codes, vector c holding elements
// 64c .. 64c + 63 as [the 32 even ones | the 32 odd ones] (QuantizedQ's int4 order): the low
// and high nibbles of the row's bytes 32c .. 32c + 31.
template <int CK>
inline __attribute__((always_inline)) void nibble_vectors(const std::byte* row, __m512i* out) {
  if constexpr (CK == 1) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(x, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
    out[0] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < CK; c += 2) {
      const __m512i x = _mm512_loadu_si512(row + 32 * c);
      const __m512i lo = _mm512_and_si512(x, mask);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), mask);
      out[c] = _mm512_shuffle_i64x2(lo, hi, 0x44);      // 128-bit lanes lo.0 lo.1 hi.0 hi.1
      out[c + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);  // lo.2 lo.3 hi.2 hi.3
    }
  }
}

TileSource tile_source(const Side& s, const WorkItem& item, int t0) {
  const int32_t block = item.blocks[t0 / item.block_tokens];
  const size_t in_block = static_cast<size_t>(t0 % item.block_tokens);
  const std::byte* b = s.base + static_cast<size_t>(block) * s.block_bytes;
  TileSource src;
  src.values = b + s.value_offset + in_block * s.row_data_bytes;
  src.scales = b + s.scale_offset + in_block * s.row_scale_bytes;
  src.row_data_bytes = s.row_data_bytes;
  src.row_scale_bytes = s.row_scale_bytes;
  src.dim = s.dim;
  src.tensor_scale = s.tensor_scale;
  src.dtype = s.dtype;
  return src;
}

// Requests tile t0's rows and per-row scales of one side. A (kv head, tile) region is 1-8 KiB
// and the next one is a block's worth of other heads away, often on another page, where the
// hardware prefetchers stop.
void prefetch_tile(const Side& s, const WorkItem& item, int t0, int n) {
  const TileSource src = tile_source(s, item, t0);
  const char* v = reinterpret_cast<const char*>(src.values);
  const size_t value_bytes = static_cast<size_t>(n) * src.row_data_bytes;
  for (size_t off = 0; off < value_bytes; off += 64) _mm_prefetch(v + off, _MM_HINT_T0);
  const char* sc = reinterpret_cast<const char*>(src.scales);
  const size_t scale_bytes = static_cast<size_t>(n) * src.row_scale_bytes;
  for (size_t off = 0; off < scale_bytes; off += 64) _mm_prefetch(sc + off, _MM_HINT_T0);
}

void prefetch_chunk(const WorkItem& item, int c0, int last) {
  for (int t0 = c0; t0 < c0 + kChunk && t0 < last; t0 += kTile) {
    prefetch_tile(item.k, item, t0, imin(kTile, last - t0));
    prefetch_tile(item.v, item, t0, imin(kTile, last - t0));
  }
}

// GCC folds a load into every FMA that uses it, loading a vector shared by two queries twice;
// loads, not FMAs, bound these loops, so the shared vectors are pinned to registers.
inline __attribute__((always_inline)) void keep_in_register(__m512& v) {
  asm("" : "+v"(v));
}

// ---- the work item ------------------------------------------------------------------------
//
// Tokens go in chunks of kChunk (kChunkTiles tiles of 16): the chunk's K and V rows are
// decoded once into fp32 scratch (L1-resident), then the queries of each position, two at a
// time, compute their logits of the chunk (16 dot products per tile, reduced into one
// vector by reduce16), take one online-softmax step for the chunk and accumulate its V rows.
// Pairing the queries halves the loads per FMA (each K or V vector loaded feeds both), which
// is what bounds this loop; one softmax step per chunk keeps its serial chain (max, exp,
// rescale) short relative to the FMAs.

// Queries qi0 .. qi0 + Q - 1 (one position, so one mask) against chunk tokens [a, b).
template <int DK, int DV, int Q>
void attend_chunk(const WorkItem& item, int qi0, int a, int b, const __mmask16* lanes) {
  constexpr int CK = DK / 16, CV = DV / 16;
  const float neg_inf = -__builtin_inff();
  const int s_first = a / kTile, s_end = (b - 1) / kTile + 1;

  __m512 logits[Q][kChunkTiles];
  if (item.k_logits != nullptr) {  // integer Q·K: run_item_t left them in item.logits
    const int r = qi0 % item.ratio;
    for (int sub = s_first; sub < s_end; ++sub)
      for (int i = 0; i < Q; ++i) {
        logits[i][sub] = _mm512_loadu_ps(item.logits + (r + i) * kChunk + sub * kTile);
        if (item.soft_cap != 0.0f) logits[i][sub] = soft_cap16(logits[i][sub], item.soft_cap);
      }
  }
  for (int sub = s_first; item.k_logits == nullptr && sub < s_end; ++sub) {
    __m512 dots[Q][kTile];
    for (int t = 0; t < kTile; ++t) {
      const float* k = item.k_tile + (sub * kTile + t) * DK;
      __m512 s0[Q], s1[Q];
      for (int i = 0; i < Q; ++i) {
        s0[i] = _mm512_setzero_ps();
        s1[i] = _mm512_setzero_ps();
      }
      for (int c = 0; c < CK; c += 2) {
        __m512 k0 = _mm512_loadu_ps(k + 16 * c);
        __m512 k1 = _mm512_loadu_ps(k + 16 * (c + 1));
        if constexpr (Q > 1) {
          keep_in_register(k0);
          keep_in_register(k1);
        }
        for (int i = 0; i < Q; ++i) {
          const float* q = item.q + static_cast<size_t>(qi0 + i) * DK;
          s0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), k0, s0[i]);
          s1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * (c + 1)), k1, s1[i]);
        }
      }
      for (int i = 0; i < Q; ++i) dots[i][t] = _mm512_add_ps(s0[i], s1[i]);
    }
    for (int i = 0; i < Q; ++i) {
      logits[i][sub] = reduce16(dots[i]);
      if (item.k.post_scale != 1.0f)
        logits[i][sub] = _mm512_mul_ps(logits[i][sub], _mm512_set1_ps(item.k.post_scale));
      if (item.soft_cap != 0.0f) logits[i][sub] = soft_cap16(logits[i][sub], item.soft_cap);
    }
  }

  float* p[Q];
  __m512 w_corr[Q];
  for (int i = 0; i < Q; ++i) {
    const int qi = qi0 + i;
    __m512 cmax = _mm512_set1_ps(neg_inf);
    for (int sub = s_first; sub < s_end; ++sub)
      cmax = _mm512_mask_max_ps(cmax, lanes[sub], cmax, logits[i][sub]);
    const float m_old = item.m[qi];
    const float m_new = fmax1(m_old, _mm512_reduce_max_ps(cmax));
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 psum = _mm512_setzero_ps();
    p[i] = item.p + i * kChunk;
    for (int sub = s_first; sub < s_end; ++sub) {
      const __m512 e = _mm512_maskz_mov_ps(lanes[sub], exp16(_mm512_sub_ps(logits[i][sub], mv)));
      _mm512_storeu_ps(p[i] + sub * kTile, e);
      psum = _mm512_add_ps(psum, e);
    }
    // exp(-inf - m_new) would be 0 too, but only by way of exp16's clamping.
    const float corr =
        m_old == neg_inf ? 0.0f : _mm512_cvtss_f32(exp16(_mm512_set1_ps(m_old - m_new)));
    item.l[qi] = item.l[qi] * corr + _mm512_reduce_add_ps(psum);
    item.m[qi] = m_new;
    w_corr[i] = _mm512_set1_ps(corr);
  }

  __m512 acc[Q][CV];
  for (int i = 0; i < Q; ++i)
    for (int c = 0; c < CV; ++c)
      acc[i][c] = _mm512_mul_ps(
          _mm512_loadu_ps(item.acc + static_cast<size_t>(qi0 + i) * DV + 16 * c), w_corr[i]);
  for (int t = a; t < b; ++t) {
    const float* v = item.v_tile + t * DV;
    __m512 w[Q];
    for (int i = 0; i < Q; ++i) w[i] = _mm512_set1_ps(p[i][t]);
    for (int c = 0; c < CV; ++c) {
      __m512 vc = _mm512_loadu_ps(v + 16 * c);
      if constexpr (Q > 1) keep_in_register(vc);
      for (int i = 0; i < Q; ++i) acc[i][c] = _mm512_fmadd_ps(w[i], vc, acc[i][c]);
    }
  }
  for (int i = 0; i < Q; ++i)
    for (int c = 0; c < CV; ++c)
      _mm512_storeu_ps(item.acc + static_cast<size_t>(qi0 + i) * DV + 16 * c, acc[i][c]);
}

template <int DK, int DV>
void run_item_t(const WorkItem& item) {
  constexpr int CV = DV / 16;
  const int nq = item.num_pos * item.ratio;
  for (int i = 0; i < nq * DV; i += 16) _mm512_storeu_ps(item.acc + i, _mm512_setzero_ps());
  for (int i = 0; i < nq; ++i) {
    item.m[i] = -__builtin_inff();
    item.l[i] = 0.0f;
  }
  int first = item.lo[0], last = item.hi[0];
  for (int j = 1; j < item.num_pos; ++j) {
    first = imin(first, item.lo[j]);
    last = imax(last, item.hi[j]);
  }

  const int begin = first - first % kTile;
  prefetch_chunk(item, begin, last);
  for (int c0 = begin; c0 < last; c0 += kChunk) {
    const int cn = imin(kChunk, last - c0);
    prefetch_chunk(item, c0 + kChunk, last);
    bool decoded = false;
    for (int j = 0; j < item.num_pos; ++j) {
      // This position sees chunk tokens [a, b).
      const int a = imax(item.lo[j], c0) - c0, b = imin(item.hi[j], c0 + cn) - c0;
      if (a >= b) continue;
      if (!decoded) {
        for (int t = 0; t < cn; t += kTile) {
          const int n = imin(kTile, cn - t);
          if (item.k_logits == nullptr)
            item.k.decode(tile_source(item.k, item, c0 + t), n, item.k_tile + t * DK);
          item.v.decode(tile_source(item.v, item, c0 + t), n, item.v_tile + t * DV);
        }
        decoded = true;
      }
      const int qi0 = j * item.ratio;
      __mmask16 lanes[kChunkTiles];
      for (int sub = a / kTile; sub <= (b - 1) / kTile; ++sub) {
        const int la = imax(a - sub * kTile, 0), lb = imin(b - sub * kTile, kTile);
        lanes[sub] = static_cast<__mmask16>(((1u << lb) - 1u) & ~((1u << la) - 1u));
        if (item.k_logits != nullptr)
          item.k_logits(tile_source(item.k, item, c0 + sub * kTile), item, qi0, item.ratio,
                        item.logits + sub * kTile);
      }
      int r = 0;
      for (; r + 2 <= item.ratio; r += 2) attend_chunk<DK, DV, 2>(item, qi0 + r, a, b, lanes);
      if (r < item.ratio) attend_chunk<DK, DV, 1>(item, qi0 + r, a, b, lanes);
    }
  }

  if (item.v.post_scale != 1.0f)
    for (int i = 0; i < nq * DV; i += 16)
      _mm512_storeu_ps(item.acc + i, _mm512_mul_ps(_mm512_loadu_ps(item.acc + i),
                                                   _mm512_set1_ps(item.v.post_scale)));
  if (!item.normalize) return;
  for (int j = 0; j < item.num_pos; ++j)
    for (int r = 0; r < item.ratio; ++r) {
      const int qi = j * item.ratio + r;
      const __m512 inv = _mm512_set1_ps(1.0f / item.l[qi]);
      float* o =
          item.out + static_cast<size_t>(j) * item.out_pos_stride + static_cast<size_t>(r) * DV;
      const float* acc_row = item.acc + static_cast<size_t>(qi) * DV;
      for (int c = 0; c < CV; ++c)
        _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc_row + 16 * c), inv));
    }
}

template <int DK>
void run_item_dk(const WorkItem& item) {
  switch (item.v.dim) {
    case 64:
      return run_item_t<DK, 64>(item);
    case 128:
      return run_item_t<DK, 128>(item);
    case 256:
      return run_item_t<DK, 256>(item);
  }
  // Unreachable: run_tiled checks the head dims before any item runs.
}

// ---- integer Q·K with vpmaddubsw + vpmaddwd (AVX-512BW) -----------------------------------

namespace bw {

// int8 codes: |c| is the unsigned operand and q takes c's sign (a masked negation: AVX-512 has
// no vpsignb). A pair of products is at most 2 * 128 * 127 = 32512, inside vpmaddubsw's int16.
// 4-bit codes (0..15) go in directly: a pair is at most 2 * 15 * 127.
struct Dot {
  struct K8 {
    __m512i abs;
    __mmask64 negative;
  };
  static K8 prep8(__m512i codes) { return {_mm512_abs_epi8(codes), _mm512_movepi8_mask(codes)}; }
  static __m512i dot8(__m512i acc, const K8& k, __m512i qq) {
    const __m512i signed_q = _mm512_mask_sub_epi8(qq, k.negative, _mm512_setzero_si512(), qq);
    return _mm512_add_epi32(
        acc, _mm512_madd_epi16(_mm512_maddubs_epi16(k.abs, signed_q), _mm512_set1_epi16(1)));
  }
  static constexpr int kOffset8 = 0;
  static __m512i dot4(__m512i acc, __m512i codes, __m512i qq) {
    return _mm512_add_epi32(
        acc, _mm512_madd_epi16(_mm512_maddubs_epi16(codes, qq), _mm512_set1_epi16(1)));
  }
};

#include "attention/cpu_avx512/int_dot_avx512.inc"

}  // namespace bw

}  // namespace

void run_item_avx512(const WorkItem& item) {
  switch (item.k.dim) {
    case 64:
      return run_item_dk<64>(item);
    case 128:
      return run_item_dk<128>(item);
    case 256:
      return run_item_dk<256>(item);
  }
  // Unreachable: run_tiled checks the head dims before any item runs.
}

DecodeTileFn avx512_unscaled_decoder(KvDtype dtype, int dim) {
  if (dim % 64 != 0) return nullptr;
  if (dtype == KvDtype::kFp8E4M3) return decode_e4m3_unscaled;
  if (dtype == KvDtype::kFp8E5M2) return decode_e5m2_t<false>;
  return nullptr;
}

DecodeTileFn avx512_decoder(KvDtype dtype, int dim) {
  if (dim % 64 != 0) return nullptr;  // the decoders step 32 or 64 values at a time
  switch (dtype) {
    case KvDtype::kFloat32:
      return decode_f32;
    case KvDtype::kFloat16:
      return decode_f16;
    case KvDtype::kBFloat16:
      return decode_bf16;
    case KvDtype::kFp8E4M3:
      return decode_e4m3;
    case KvDtype::kFp8E5M2:
      return decode_e5m2_t<true>;
    case KvDtype::kInt8PerTokenHead:
      return decode_int8_pth;
    case KvDtype::kFp8PerTokenHead:
      return decode_fp8_pth;
    case KvDtype::kInt4PerTokenHead:
      return decode_int4_pth;
    case KvDtype::kNvfp4:
      return decode_nvfp4;
    case KvDtype::kAuto:
      break;
  }
  return nullptr;
}

}  // namespace kvq::cpu_attn

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---- integer Q·K with vpdpbusd (AVX512-VNNI): called only after cpu_has_avx512_vnni() -----

#if defined(__clang__)
#pragma clang attribute push( \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")
#endif

namespace kvq::cpu_attn {
namespace {
namespace vnni {

// int8 codes go in as c + 128 (c xor 0x80, unsigned); the 128 * sum(qq) this adds is taken
// off after the dot (kOffset8). 4-bit codes go in directly.
struct Dot {
  using K8 = __m512i;
  static K8 prep8(__m512i codes) {
    return _mm512_xor_si512(codes, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  static __m512i dot8(__m512i acc, K8 k, __m512i qq) { return _mm512_dpbusd_epi32(acc, k, qq); }
  static constexpr int kOffset8 = 128;
  static __m512i dot4(__m512i acc, __m512i codes, __m512i qq) {
    return _mm512_dpbusd_epi32(acc, codes, qq);
  }
};

#include "attention/cpu_avx512/int_dot_avx512.inc"

}  // namespace vnni
}  // namespace
}  // namespace kvq::cpu_attn

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kvq::cpu_attn {

// Generic code: only picks a function pointer.
KLogitsFn avx512_k_logits(KDot k_dot, KvDtype dtype, int dim) {
  switch (k_dot) {
    case KDot::kVnni:
      return vnni::logits_for(dtype, dim);
    case KDot::kMaddubs:
      return bw::logits_for(dtype, dim);
    case KDot::kFloat:
      break;
  }
  return nullptr;
}

}  // namespace kvq::cpu_attn
