// The AVX2 (+FMA, F16C) work-item kernel of cpu_avx512 and its tile decoders: what CPUs
// without AVX-512 run (the portable kernel stays for others and as the tests' second opinion).
//
// As in kernel_avx512.cc, everything below the target pragma has internal linkage or a unique
// name and uses intrinsics and raw pointers only, so no AVX2 code can leak into generic code
// through a shared inline function or template. The driver calls in only after
// cpu_has_avx2().
//
// Decoders reproduce the reference codecs bit for bit (the same arithmetic as the AVX-512
// ones, eight lanes at a time): fp8 through fp16, int8 as float(q) * scale, int4 as
// fma(q, S, Z), nvfp4 as (fp4 * block scale) * T through two 8-entry tables.
//
// The item: per chunk of kChunk tokens, K and V rows are decoded once into fp32 scratch (fp8
// without its scale: Side::post_scale); the queries of the GQA group, two at a time, share
// every K and V vector they load: logits of 4 tokens into 4 accumulators per query, merged
// by hadd into one vector of 8 tokens, one online-softmax step per chunk on those vectors
// (exp8), and the chunk's V rows accumulated 16 output dims at a time, the accumulators in
// registers across the chunk's tokens.
//
// Integer Q·K (int8/int4_per_token_head K, see KDot in kernel.h): int_dot_avx2.inc, compiled
// twice: with vpmaddubsw + vpmaddwd under this file's target, and with the VEX vpdpbusd in a
// region of its own at the end of the file whose target adds avxvnni.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "attention/cpu_avx512/kernel.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace kvq::cpu_attn {

namespace {

int imin2(int a, int b) {
  return a < b ? a : b;
}
int imax2(int a, int b) {
  return a > b ? a : b;
}

float load_f32_avx2(const std::byte* p) {
  float v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
uint16_t load_u16_avx2(const std::byte* p) {
  uint16_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// 16 e4m3 codes -> two vectors of 8 values times `scale` (see e4m3x32 in kernel_avx512.cc).
void e4m3x16(__m128i codes, float scale, __m256& lo, __m256& hi) {
  const __m256i u = _mm256_cvtepu8_epi16(codes);
  __m256i h = _mm256_slli_epi16(u, 7);  // magnitude at bits 7-13, sign at bit 14
  h = _mm256_add_epi16(h, _mm256_and_si256(h, _mm256_set1_epi16(0x4000)));  // sign to bit 15
  const __m256i nan =
      _mm256_cmpeq_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7F));
  h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), nan);
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  const float folded = 256.0f * scale;
  if (__builtin_isinf(folded) && !__builtin_isinf(scale)) {
    lo = _mm256_mul_ps(_mm256_mul_ps(lo, _mm256_set1_ps(256.0f)), _mm256_set1_ps(scale));
    hi = _mm256_mul_ps(_mm256_mul_ps(hi, _mm256_set1_ps(256.0f)), _mm256_set1_ps(scale));
  } else {
    lo = _mm256_mul_ps(lo, _mm256_set1_ps(folded));
    hi = _mm256_mul_ps(hi, _mm256_set1_ps(folded));
  }
}

// ---- tile decoders: rows [0, n) of src to out[n][dim], dim a multiple of 32 ------------

const std::byte* row_values(const TileSource& s, int i) {
  return s.values + static_cast<size_t>(i) * s.row_data_bytes;
}
const std::byte* row_meta(const TileSource& s, int i) {
  return s.scales + static_cast<size_t>(i) * s.row_scale_bytes;
}

void decode_f32_avx2(const TileSource& s, int n, float* out) {
  for (int i = 0; i < n; ++i) {
    const float* r = reinterpret_cast<const float*>(row_values(s, i));
    float* o = out + static_cast<size_t>(i) * s.dim;
    for (int c = 0; c < s.dim; c += 8) _mm256_storeu_ps(o + c, _mm256_loadu_ps(r + c));
  }
}

void decode_f16_avx2(const TileSource& s, int n, float* out) {
  for (int i = 0; i < n; ++i) {
    const std::byte* r = row_values(s, i);
    float* o = out + static_cast<size_t>(i) * s.dim;
    for (int c = 0; c < s.dim; c += 8)
      _mm256_storeu_ps(
          o + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * c))));
  }
}

void decode_bf16_avx2(const TileSource& s, int n, float* out) {
  for (int i = 0; i < n; ++i) {
    const std::byte* r = row_values(s, i);
    float* o = out + static_cast<size_t>(i) * s.dim;
    for (int c = 0; c < s.dim; c += 8) {
      const __m256i w =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * c)));
      _mm256_storeu_ps(o + c, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
}

void e4m3_row(const std::byte* r, float scale, int dim, float* o) {
  for (int c = 0; c < dim; c += 16) {
    __m256 lo, hi;
    e4m3x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + c)), scale, lo, hi);
    _mm256_storeu_ps(o + c, lo);
    _mm256_storeu_ps(o + c + 8, hi);
  }
}

void decode_e4m3_avx2(const TileSource& s, int n, float* out) {
  for (int i = 0; i < n; ++i)
    e4m3_row(row_values(s, i), s.tensor_scale, s.dim, out + static_cast<size_t>(i) * s.dim);
}

void decode_fp8_pth_avx2(const TileSource& s, int n, float* out) {
  for (int i = 0; i < n; ++i)
    e4m3_row(row_values(s, i), load_f32_avx2(row_meta(s, i)), s.dim,
             out + static_cast<size_t>(i) * s.dim);
}

// e5m2 is the top byte of an fp16: the value, times the tensor scale unless kScaled is false
// (the unscaled decoder, kernel.h: unscaled_factor).
template <bool kScaled>
void decode_e5m2_avx2_t(const TileSource& s, int n, float* out) {
  const __m256 k = _mm256_set1_ps(s.tensor_scale);
  for (int i = 0; i < n; ++i) {
    const std::byte* r = row_values(s, i);
    float* o = out + static_cast<size_t>(i) * s.dim;
    for (int c = 0; c < s.dim; c += 16) {
      const __m256i h = _mm256_slli_epi16(
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + c))), 8);
      __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
      __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
      if constexpr (kScaled) {
        lo = _mm256_mul_ps(lo, k);
        hi = _mm256_mul_ps(hi, k);
      }
      _mm256_storeu_ps(o + c, lo);
      _mm256_storeu_ps(o + c + 8, hi);
    }
  }
}

// ---- unscaled fp8 decoders (kernel.h: unscaled_factor; as in kernel_avx512.cc) -----------

bool e4m3_row_has_nan_avx2(const std::byte* r, int dim) {
  __m256i nan = _mm256_setzero_si256();
  for (int c = 0; c < dim; c += 32) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + c));
    nan = _mm256_or_si256(
        nan, _mm256_cmpeq_epi8(_mm256_or_si256(x, _mm256_set1_epi8(static_cast<char>(0x80))),
                               _mm256_set1_epi8(-1)));
  }
  return !_mm256_testz_si256(nan, nan);
}

void decode_e4m3_unscaled_avx2(const TileSource& s, int n, float* out) {
  for (int i = 0; i < n; ++i) {
    const std::byte* r = row_values(s, i);
    float* o = out + static_cast<size_t>(i) * s.dim;
    if (e4m3_row_has_nan_avx2(r, s.dim)) {
      e4m3_row(r, 1.0f / 256, s.dim, o);
      continue;
    }
    for (int c = 0; c < s.dim; c += 16) {
      const __m256i u =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + c)));
      const __m256i h =
          _mm256_and_si256(_mm256_slli_epi16(u, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
      _mm256_storeu_ps(o + c, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
      _mm256_storeu_ps(o + c + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
  }
}

void decode_int8_pth_avx2(const TileSource& s, int n, float* out) {
  for (int i = 0; i < n; ++i) {
    const std::byte* r = row_values(s, i);
    const __m256 k = _mm256_set1_ps(load_f32_avx2(row_meta(s, i)));
    float* o = out + static_cast<size_t>(i) * s.dim;
    for (int c = 0; c < s.dim; c += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + c));
      _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), k));
    }
  }
}

// Element 2i in the low nibble of byte i: 16 elements from 8 bytes as two vectors of 8 ints.
void nibbles_x16(const std::byte* p, __m256i& a, __m256i& b) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(x, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(x, 4), mask);
  const __m128i e = _mm_unpacklo_epi8(lo, hi);  // elements 0..15 in order
  a = _mm256_cvtepu8_epi32(e);
  b = _mm256_cvtepu8_epi32(_mm_srli_si128(e, 8));
}

void decode_int4_pth_avx2(const TileSource& s, int n, float* out) {
  for (int i = 0; i < n; ++i) {
    const std::byte* r = row_values(s, i);
    const std::byte* meta = row_meta(s, i);
    const __m256 scale = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(load_u16_avx2(meta))));
    const __m256 zero =
        _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(load_u16_avx2(meta + 2))));
    float* o = out + static_cast<size_t>(i) * s.dim;
    for (int c = 0; c < s.dim; c += 16) {
      __m256i a, b;
      nibbles_x16(r + c / 2, a, b);
      _mm256_storeu_ps(o + c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), scale, zero));
      _mm256_storeu_ps(o + c + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), scale, zero));
    }
  }
}

// nvfp4: 16-element blocks, each with an e4m3 block scale after the row's codes; value =
// (fp4 * block scale) * T, the two products of the reference in its order (the first exact).
// The fp4 code's magnitude picks from an 8-entry table (vpermps uses the index's low 3 bits),
// its sign bit (bit 3) chooses the negative table.
void decode_nvfp4_avx2(const TileSource& s, int n, float* out) {
  const __m256 pos = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 neg = _mm256_setr_ps(-0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  const __m256 t = _mm256_set1_ps(s.tensor_scale);
  const int blocks = s.dim / 16;  // <= 16 (head_dim <= 256)
  for (int i = 0; i < n; ++i) {
    const std::byte* r = row_values(s, i);
    // The block scales (copied: a 16-byte load could pass the row's end), decoded exactly.
    alignas(16) std::byte codes[16] = {};
    __builtin_memcpy(codes, r + s.dim / 2, static_cast<size_t>(blocks));
    __m256 lo, hi;
    e4m3x16(_mm_load_si128(reinterpret_cast<const __m128i*>(codes)), 1.0f, lo, hi);
    alignas(32) float bs[16];
    _mm256_store_ps(bs, lo);
    _mm256_store_ps(bs + 8, hi);
    float* o = out + static_cast<size_t>(i) * s.dim;
    for (int b = 0; b < blocks; ++b) {
      const __m256 k = _mm256_set1_ps(bs[b]);
      const __m256 tp = _mm256_mul_ps(_mm256_mul_ps(pos, k), t);
      const __m256 tn = _mm256_mul_ps(_mm256_mul_ps(neg, k), t);
      __m256i idx[2];
      nibbles_x16(r + 8 * b, idx[0], idx[1]);
      for (int h = 0; h < 2; ++h) {
        const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(idx[h], 28));  // bit 3 -> 31
        _mm256_storeu_ps(o + 16 * b + 8 * h,
                         _mm256_blendv_ps(_mm256_permutevar8x32_ps(tp, idx[h]),
                                          _mm256_permutevar8x32_ps(tn, idx[h]), sign));
      }
    }
  }
}

// ---- the work item ------------------------------------------------------------------------

float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Lane t of the result is the sum of the lanes of a[t] (integer adds: exact).
inline __attribute__((always_inline)) __m256i reduce8_epi32(const __m256i* a) {
  // hadd(x, y) per 128-bit lane: x0+x1, x2+x3, y0+y1, y2+y3.
  const __m256i h01 = _mm256_hadd_epi32(a[0], a[1]), h23 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i h45 = _mm256_hadd_epi32(a[4], a[5]), h67 = _mm256_hadd_epi32(a[6], a[7]);
  // Lane L of h0123: the sums of a[0..3] over lane L; of h4567: of a[4..7].
  const __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                          _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

// The fp16 scale S (low half) and zero Z (high half) of 8 int4 rows' 4-byte metadata.
inline __attribute__((always_inline)) void int4_meta8(const std::byte* meta, __m256& scale,
                                                      __m256& zero) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta));
  // Per 128-bit lane: S0..S3 then Z0..Z3 (every value fits: no saturation).
  const __m256i packed =
      _mm256_packus_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(x, 16));
  const __m256i ordered = _mm256_permute4x64_epi64(packed, 0xD8);  // S0..S7, Z0..Z7
  scale = _mm256_cvtph_ps(_mm256_castsi256_si128(ordered));
  zero = _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1));
}

TileSource tile_source_avx2(const Side& s, const WorkItem& item, int t0) {
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

// e^x, 8 lanes: exp16's Cephes polynomial (kernel_avx512.cc), 2^n built in the exponent
// field, so x is clamped to [-87, 88] to keep n a normal exponent (below e^-87 a softmax weight
// is far under the resolution of a sum that holds a 1, and is taken as 0). x goes second into
// min/max, which return their second operand for a NaN: a NaN stays NaN.
__m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  // At the lower clamp the weight is 0, as e^x rounds to there (a -inf logit among them); a
  // NaN compares unordered and is kept.
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)),
                       _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLE_UQ));
}

float hmax8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// Four tokens' dot-product vectors -> per 128-bit lane L, lane t = token t's sum over lane L.
inline __attribute__((always_inline)) __m256 merge4(const __m256* a) {
  return _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
}

// Queries qi0 .. qi0 + Q - 1 (one position) against chunk tokens [a, b) (decoded at k_tile /
// v_tile, or their raw logits in item.logits from the integer Q·K): one online-softmax step
// per query. The queries share every K and V vector they load; logits go 8 tokens to a
// vector (no horizontal sum per token), and the softmax runs on those vectors.
template <int Q>
void attend_chunk_avx2(const WorkItem& item, int qi0, int a, int b) {
  const int dk = item.k.dim, dv = item.v.dim;
  const int g_first = a / 8, g_end = (b - 1) / 8 + 1;
  constexpr int kGroups = kChunk / 8;
  __m256 logits[Q][kGroups];
  for (int g = g_first; g < g_end; ++g) {
    if (item.k_logits != nullptr) {
      for (int i = 0; i < Q; ++i)
        logits[i][g] = _mm256_loadu_ps(item.logits + (qi0 % item.ratio + i) * kChunk + 8 * g);
    } else {
      __m256 half[Q][2];
      for (int h = 0; h < 2; ++h) {
        const float* k = item.k_tile + static_cast<size_t>(8 * g + 4 * h) * dk;
        __m256 dots[Q][4];
        for (int i = 0; i < Q; ++i)
          for (int t = 0; t < 4; ++t) dots[i][t] = _mm256_setzero_ps();
        for (int c = 0; c < dk; c += 8) {
          __m256 qv[Q];
          for (int i = 0; i < Q; ++i)
            qv[i] = _mm256_loadu_ps(item.q + static_cast<size_t>(qi0 + i) * dk + c);
          for (int t = 0; t < 4; ++t) {
            const __m256 kv = _mm256_loadu_ps(k + static_cast<size_t>(t) * dk + c);
            for (int i = 0; i < Q; ++i) dots[i][t] = _mm256_fmadd_ps(qv[i], kv, dots[i][t]);
          }
        }
        for (int i = 0; i < Q; ++i) half[i][h] = merge4(dots[i]);
      }
      for (int i = 0; i < Q; ++i) {
        logits[i][g] = _mm256_add_ps(_mm256_permute2f128_ps(half[i][0], half[i][1], 0x20),
                                     _mm256_permute2f128_ps(half[i][0], half[i][1], 0x31));
        if (item.k.post_scale != 1.0f)
          logits[i][g] = _mm256_mul_ps(logits[i][g], _mm256_set1_ps(item.k.post_scale));
      }
    }
    if (item.soft_cap != 0.0f)
      for (int i = 0; i < Q; ++i) {
        alignas(32) float x[8];
        _mm256_store_ps(x, logits[i][g]);
        for (float& e : x) e = item.soft_cap * __builtin_tanhf(e / item.soft_cap);
        logits[i][g] = _mm256_load_ps(x);
      }
  }

  // Lanes of group g inside [a, b).
  __m256 lanes[kGroups];
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int g = g_first; g < g_end; ++g) {
    const __m256i t = _mm256_add_epi32(iota, _mm256_set1_epi32(8 * g));
    lanes[g] = _mm256_castsi256_ps(_mm256_andnot_si256(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(a), t), _mm256_cmpgt_epi32(_mm256_set1_epi32(b), t)));
  }
  const __m256 neg_inf = _mm256_set1_ps(-__builtin_inff());
  float* p[Q];
  __m256 w_corr[Q];
  for (int i = 0; i < Q; ++i) {
    const int qi = qi0 + i;
    __m256 cmax = neg_inf;
    for (int g = g_first; g < g_end; ++g)
      cmax = _mm256_max_ps(cmax, _mm256_blendv_ps(neg_inf, logits[i][g], lanes[g]));
    const float m_old = item.m[qi];
    const float c = hmax8(cmax);
    const float m_new = m_old > c ? m_old : c;
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 psum = _mm256_setzero_ps();
    p[i] = item.p + i * kChunk;
    for (int g = g_first; g < g_end; ++g) {
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(logits[i][g], mv)), lanes[g]);
      _mm256_storeu_ps(p[i] + 8 * g, e);
      psum = _mm256_add_ps(psum, e);
    }
    const float corr = m_old == -__builtin_inff() ? 0.0f : __builtin_expf(m_old - m_new);
    item.l[qi] = item.l[qi] * corr + hsum8(psum);
    item.m[qi] = m_new;
    w_corr[i] = _mm256_set1_ps(corr);
  }

  for (int c = 0; c < dv; c += 16) {
    __m256 acc[Q][2];
    for (int i = 0; i < Q; ++i) {
      const float* row = item.acc + static_cast<size_t>(qi0 + i) * dv + c;
      acc[i][0] = _mm256_mul_ps(_mm256_loadu_ps(row), w_corr[i]);
      acc[i][1] = _mm256_mul_ps(_mm256_loadu_ps(row + 8), w_corr[i]);
    }
    for (int t = a; t < b; ++t) {
      const float* v = item.v_tile + static_cast<size_t>(t) * dv + c;
      const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
      for (int i = 0; i < Q; ++i) {
        const __m256 w = _mm256_broadcast_ss(p[i] + t);
        acc[i][0] = _mm256_fmadd_ps(w, v0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(w, v1, acc[i][1]);
      }
    }
    for (int i = 0; i < Q; ++i) {
      float* row = item.acc + static_cast<size_t>(qi0 + i) * dv + c;
      _mm256_storeu_ps(row, acc[i][0]);
      _mm256_storeu_ps(row + 8, acc[i][1]);
    }
  }
}

// ---- integer Q·K with vpmaddubsw + vpmaddwd (AVX2) -----------------------------------------

namespace maddubs {

// int8 codes: |c| is the unsigned operand and q takes c's sign (vpsignb). A pair of products
// is at most 2 * 128 * 127 = 32512, inside vpmaddubsw's int16. 4-bit codes go in directly.
struct Dot {
  struct K8 {
    __m256i abs, codes;
  };
  static K8 prep8(__m256i codes) { return {_mm256_abs_epi8(codes), codes}; }
  static __m256i dot8(__m256i acc, const K8& k, __m256i qq) {
    return _mm256_add_epi32(
        acc, _mm256_madd_epi16(_mm256_maddubs_epi16(k.abs, _mm256_sign_epi8(qq, k.codes)),
                               _mm256_set1_epi16(1)));
  }
  static constexpr int kOffset8 = 0;
  static __m256i dot4(__m256i acc, __m256i codes, __m256i qq) {
    return _mm256_add_epi32(
        acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, qq), _mm256_set1_epi16(1)));
  }
};

#include "attention/cpu_avx512/int_dot_avx2.inc"

}  // namespace maddubs

}  // namespace

void run_item_avx2(const WorkItem& item) {
  const int dk = item.k.dim, dv = item.v.dim;
  const int nq = item.num_pos * item.ratio;
  for (int i = 0; i < nq * dv; i += 8) _mm256_storeu_ps(item.acc + i, _mm256_setzero_ps());
  for (int i = 0; i < nq; ++i) {
    item.m[i] = -__builtin_inff();
    item.l[i] = 0.0f;
  }
  int first = item.lo[0], last = item.hi[0];
  for (int j = 1; j < item.num_pos; ++j) {
    first = imin2(first, item.lo[j]);
    last = imax2(last, item.hi[j]);
  }
  const int begin = first - first % kTile;
  for (int c0 = begin; c0 < last; c0 += kChunk) {
    const int cn = imin2(kChunk, last - c0);
    bool decoded = false;
    for (int j = 0; j < item.num_pos; ++j) {
      const int a = imax2(item.lo[j], c0) - c0, b = imin2(item.hi[j], c0 + cn) - c0;
      if (a >= b) continue;  // this position sees nothing of the chunk
      if (!decoded) {
        for (int t = 0; t < cn; t += kTile) {
          const int n = imin2(kTile, cn - t);
          if (item.k_logits == nullptr)
            item.k.decode(tile_source_avx2(item.k, item, c0 + t), n,
                          item.k_tile + static_cast<size_t>(t) * dk);
          item.v.decode(tile_source_avx2(item.v, item, c0 + t), n,
                        item.v_tile + static_cast<size_t>(t) * dv);
        }
        decoded = true;
      }
      if (item.k_logits != nullptr)  // the position's queries against the tiles it sees
        for (int sub = a / kTile; sub <= (b - 1) / kTile; ++sub)
          item.k_logits(tile_source_avx2(item.k, item, c0 + sub * kTile), item, j * item.ratio,
                        item.ratio, item.logits + sub * kTile);
      int r = 0;
      for (; r + 2 <= item.ratio; r += 2) attend_chunk_avx2<2>(item, j * item.ratio + r, a, b);
      if (r < item.ratio) attend_chunk_avx2<1>(item, j * item.ratio + r, a, b);
    }
  }
  if (item.v.post_scale != 1.0f)
    for (int i = 0; i < nq * dv; i += 8)
      _mm256_storeu_ps(item.acc + i, _mm256_mul_ps(_mm256_loadu_ps(item.acc + i),
                                                   _mm256_set1_ps(item.v.post_scale)));
  if (!item.normalize) return;
  for (int j = 0; j < item.num_pos; ++j)
    for (int r = 0; r < item.ratio; ++r) {
      const int qi = j * item.ratio + r;
      const __m256 inv = _mm256_set1_ps(1.0f / item.l[qi]);
      float* o =
          item.out + static_cast<size_t>(j) * item.out_pos_stride + static_cast<size_t>(r) * dv;
      const float* acc = item.acc + static_cast<size_t>(qi) * dv;
      for (int c = 0; c < dv; c += 8)
        _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(acc + c), inv));
    }
}

DecodeTileFn avx2_unscaled_decoder(KvDtype dtype, int dim) {
  if (dim % 32 != 0) return nullptr;
  if (dtype == KvDtype::kFp8E4M3) return decode_e4m3_unscaled_avx2;
  if (dtype == KvDtype::kFp8E5M2) return decode_e5m2_avx2_t<false>;
  return nullptr;
}

DecodeTileFn avx2_decoder(KvDtype dtype, int dim) {
  if (dim % 32 != 0) return nullptr;  // the decoders step 16 values at a time, 8 per vector
  switch (dtype) {
    case KvDtype::kFloat32:
      return decode_f32_avx2;
    case KvDtype::kFloat16:
      return decode_f16_avx2;
    case KvDtype::kBFloat16:
      return decode_bf16_avx2;
    case KvDtype::kFp8E4M3:
      return decode_e4m3_avx2;
    case KvDtype::kFp8E5M2:
      return decode_e5m2_avx2_t<true>;
    case KvDtype::kInt8PerTokenHead:
      return decode_int8_pth_avx2;
    case KvDtype::kFp8PerTokenHead:
      return decode_fp8_pth_avx2;
    case KvDtype::kInt4PerTokenHead:
      return decode_int4_pth_avx2;
    case KvDtype::kNvfp4:
      return decode_nvfp4_avx2;
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

// ---- integer Q·K with the VEX vpdpbusd (AVX-VNNI): called only after cpu_has_avx_vnni() -----

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif

namespace kvq::cpu_attn {
namespace {
namespace avx_vnni {

// int8 codes go in as c + 128 (c xor 0x80, unsigned); the 128 * sum(qq) this adds is taken
// off after the dot (kOffset8). 4-bit codes go in directly.
struct Dot {
  using K8 = __m256i;
  static K8 prep8(__m256i codes) {
    return _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  static __m256i dot8(__m256i acc, K8 k, __m256i qq) { return _mm256_dpbusd_avx_epi32(acc, k, qq); }
  static constexpr int kOffset8 = 128;
  static __m256i dot4(__m256i acc, __m256i codes, __m256i qq) {
    return _mm256_dpbusd_avx_epi32(acc, codes, qq);
  }
};

#include "attention/cpu_avx512/int_dot_avx2.inc"

}  // namespace avx_vnni
}  // namespace
}  // namespace kvq::cpu_attn

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kvq::cpu_attn {

// Generic code: only picks a function pointer.
KLogitsFn avx2_k_logits(KDot k_dot, KvDtype dtype, int dim) {
  switch (k_dot) {
    case KDot::kVnni:
      return avx_vnni::logits_for(dtype, dim);
    case KDot::kMaddubs:
      return maddubs::logits_for(dtype, dim);
    case KDot::kFloat:
      break;
  }
  return nullptr;
}

}  // namespace kvq::cpu_attn
