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
// GCC 12's AVX-512 headers self-initialize "undefined" vectors (`__m512 __Y = __Y;`), which
// -Wuninitialized flags at every use (GCC bug 105593, fixed in 12.3); the warning is keyed to
// the header's lines, so silencing it around the include leaves this file's own code checked.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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
// e4m3 value / 2^8 for normals and subnormals alike; * 2^8 is exact. (Folding the 2^8 into
// the scale would overflow for scales near FLT_MAX where the reference does not.)
// The one e4m3 NaN magnitude (0x7F) would land on a finite fp16, so it is patched.
__m512 e4m3x16(__m128i codes) {
  const __m256i u = _mm256_cvtepu8_epi16(codes);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8);
  const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi16(0x7F));
  const __m256i h = _mm256_or_si256(sign, _mm256_slli_epi16(mag, 7));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7F));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
  return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(__builtin_nanf("")));
}

// 16 4-bit codes from 8 bytes, element 2i in the low nibble of byte i.
__m512i nibbles_x16(const std::byte* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
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

void decode_e4m3(const TileSource& s, int n, float* out) {
  const __m512 k = _mm512_set1_ps(s.tensor_scale);
  for_each_chunk(s, n, out, [k](const std::byte* row, const std::byte*, int chunks, float* o) {
    for (int c = 0; c < chunks; ++c) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c));
      _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(e4m3x16(b), k));
    }
  });
}

void decode_e5m2(const TileSource& s, int n, float* out) {
  const __m512 k = _mm512_set1_ps(s.tensor_scale);
  for_each_chunk(s, n, out, [k](const std::byte* row, const std::byte*, int chunks, float* o) {
    for (int c = 0; c < chunks; ++c) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c));
      const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
      _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_cvtph_ps(h), k));
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
    const __m512 k = _mm512_set1_ps(load_f32(meta));
    for (int c = 0; c < chunks; ++c) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c));
      _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(e4m3x16(b), k));
    }
  });
}

void decode_int4_pth(const TileSource& s, int n, float* out) {
  for_each_chunk(s, n, out, [](const std::byte* row, const std::byte* meta, int chunks, float* o) {
    const __m512 scale = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(load_u16(meta))));
    const __m512 zero = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(load_u16(meta + 2))));
    for (int c = 0; c < chunks; ++c) {
      const __m512 q = _mm512_cvtepi32_ps(nibbles_x16(row + 8 * c));
      _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(q, scale, zero));
    }
  });
}

void decode_nvfp4(const TileSource& s, int n, float* out) {
  // E2M1 values by 4-bit code (bit 3 is the sign).
  const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                    -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  const __m512 t = _mm512_set1_ps(s.tensor_scale);
  const int dim = s.dim;
  for_each_chunk(s, n, out, [&](const std::byte* row, const std::byte*, int chunks, float* o) {
    const std::byte* block_scales = row + dim / 2;
    for (int c = 0; c < chunks; ++c) {
      const __m512 v = _mm512_permutexvar_ps(nibbles_x16(row + 8 * c), lut);
      const __m512 bs = _mm512_set1_ps(kE4m3.v[static_cast<uint8_t>(block_scales[c])]);
      _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_mul_ps(v, bs), t));
    }
  });
}

// ---- math ---------------------------------------------------------------------------------

// e^x, about 1 ulp (Cephes expf polynomial, scalef for the 2^n step: no overflow tricks).
__m512 exp16(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
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
__m512 reduce16(const __m512* a) {
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

// ---- the work item ------------------------------------------------------------------------

template <int DK, int DV>
void run_item_t(const WorkItem& item) {
  constexpr int CK = DK / 16, CV = DV / 16;
  const int nq = item.num_pos * item.ratio;
  const float neg_inf = -__builtin_inff();
  for (int i = 0; i < nq * DV; i += 16) _mm512_storeu_ps(item.acc + i, _mm512_setzero_ps());
  for (int i = 0; i < nq; ++i) {
    item.m[i] = neg_inf;
    item.l[i] = 0.0f;
  }
  int first = item.lo[0], last = item.hi[0];
  for (int j = 1; j < item.num_pos; ++j) {
    first = imin(first, item.lo[j]);
    last = imax(last, item.hi[j]);
  }

  for (int t0 = first - first % kTile; t0 < last; t0 += kTile) {
    const int n = imin(kTile, last - t0);
    bool decoded = false;
    for (int j = 0; j < item.num_pos; ++j) {
      const int a = imax(item.lo[j], t0) - t0, b = imin(item.hi[j], t0 + n) - t0;
      if (a >= b) continue;  // this position sees nothing of the tile
      if (!decoded) {
        item.k.decode(tile_source(item.k, item, t0), n, item.k_tile);
        item.v.decode(tile_source(item.v, item, t0), n, item.v_tile);
        decoded = true;
      }
      const __mmask16 lanes = static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u));
      for (int r = 0; r < item.ratio; ++r) {
        const int qi = j * item.ratio + r;
        const float* q = item.q + static_cast<size_t>(qi) * DK;
        // Logits of the 16 rows (rows outside [a, b) are computed on stale data and masked).
        __m512 qv[CK];
        for (int c = 0; c < CK; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
        __m512 dots[kTile];
        for (int t = 0; t < kTile; ++t) {
          const float* k = item.k_tile + t * DK;
          __m512 s0 = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
          __m512 s1 = _mm512_setzero_ps();
          for (int c = 1; c < CK; c += 2) {
            s1 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), s1);
            if (c + 1 < CK) s0 = _mm512_fmadd_ps(qv[c + 1], _mm512_loadu_ps(k + 16 * (c + 1)), s0);
          }
          dots[t] = _mm512_add_ps(s0, s1);
        }
        __m512 logits = reduce16(dots);
        if (item.soft_cap != 0.0f) logits = soft_cap16(logits, item.soft_cap);

        const float m_old = item.m[qi];
        const float m_new = fmax1(m_old, _mm512_mask_reduce_max_ps(lanes, logits));
        const __m512 p =
            _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(logits, _mm512_set1_ps(m_new))));
        _mm512_storeu_ps(item.p, p);
        const float corr = m_old == neg_inf ? 0.0f : __builtin_expf(m_old - m_new);
        item.l[qi] = item.l[qi] * corr + _mm512_reduce_add_ps(p);
        item.m[qi] = m_new;

        float* acc_row = item.acc + static_cast<size_t>(qi) * DV;
        __m512 acc[CV];
        const __m512 cv = _mm512_set1_ps(corr);
        for (int c = 0; c < CV; ++c) acc[c] = _mm512_mul_ps(_mm512_loadu_ps(acc_row + 16 * c), cv);
        for (int t = a; t < b; ++t) {
          const __m512 w = _mm512_set1_ps(item.p[t]);
          const float* v = item.v_tile + t * DV;
          for (int c = 0; c < CV; ++c)
            acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * c), acc[c]);
        }
        for (int c = 0; c < CV; ++c) _mm512_storeu_ps(acc_row + 16 * c, acc[c]);
      }
    }
  }

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

DecodeTileFn avx512_decoder(KvDtype dtype) {
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
      return decode_e5m2;
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
