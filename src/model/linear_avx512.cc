// The bf16 product of model::Linear for AVX-512F CPUs: the AVX2 kernel's design
// (linear_avx2.cc) with 16 lanes. Called only after cpu_has_avx512f(). Everything compiled for
// AVX-512 here has internal linkage or a unique name and uses intrinsics and raw pointers only
// (see kernel_avx512.cc for why).
//
// Batches of 1-2 rows widen 4 W rows from bf16 per pass (16-bit shift) and multiply them with
// each input row; batches of 3 or more widen the 4 W rows once into an fp32 panel (`scratch`)
// and read it in passes of 4 input rows (16 accumulators). Every output element is the same
// sequence of operations either way (16-lane partial sums fused-multiply-added in k order,
// the same reduction tree per group of 4 outputs, the same tail), so a row's result does not
// depend on its batch. It differs
// in the last bits from the AVX2 kernel's (8 lanes), which is why one CPU always runs one
// kernel.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>

#include "model/linear.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#endif

namespace kvq::model {

namespace {

__m512 widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

float widen1_512(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// [sum(a), sum(b), sum(c), sum(d)]: each 16-lane accumulator folded to 8 lanes (low half +
// high half), then one horizontal-add tree for the four (4 outputs in 13 instructions, where a
// reduction per output took about 8 each).
__m256 fold512(__m512 x) {
  return _mm256_add_ps(_mm512_castps512_ps256(x),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

__m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
  const auto fold = fold512;
  const __m256 ab = _mm256_hadd_ps(fold(a), fold(b));
  const __m256 cd = _mm256_hadd_ps(fold(c), fold(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// The outputs of a pass: each input row's four accumulators through hsum4_512, the k tail
// (columns k16..k of the bf16 W rows wr[j]) in order, then beta. Shared by both passes, so an
// output is the same sequence of operations whichever pass computed it.
template <int MB>
void finish_rows(const __m512 (&acc)[MB][4], int nr, int k16, int k, const float* in, int lda,
                 const uint16_t* const (&wr)[4], float* out, int ldc, float beta) {
  for (int i = 0; i < MB; ++i) {
    alignas(16) float s[4];
    _mm_store_ps(s, hsum4_512(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    const float* x = in + static_cast<size_t>(i) * lda;
    for (int c = k16; c < k; ++c)
      for (int j = 0; j < 4; ++j) s[j] += widen1_512(wr[j][c]) * x[c];
    float* o = out + static_cast<size_t>(i) * ldc;
    for (int j = 0; j < nr; ++j) o[j] = beta == 0.0f ? s[j] : s[j] + beta * o[j];
  }
}

// Input rows [0, MB) against W rows [0, nr), nr <= 4 (missing rows read row 0 and are not
// stored); W widened inline.
template <int MB>
void block512(int nr, int k, const float* in, int lda, const uint16_t* w, float* out, int ldc,
              float beta) {
  const uint16_t* r[4];
  for (int j = 0; j < 4; ++j) r[j] = w + static_cast<size_t>(j < nr ? j : 0) * k;
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  const int k16 = k & ~15;
  for (int c = 0; c < k16; c += 16) {
    const __m512 w0 = widen16(r[0] + c), w1 = widen16(r[1] + c), w2 = widen16(r[2] + c),
                 w3 = widen16(r[3] + c);
    for (int i = 0; i < MB; ++i) {
      const __m512 x = _mm512_loadu_ps(in + static_cast<size_t>(i) * lda + c);
      acc[i][0] = _mm512_fmadd_ps(w0, x, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w1, x, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(w2, x, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(w3, x, acc[i][3]);
    }
  }
  finish_rows<MB>(acc, nr, k16, k, in, lda, r, out, ldc, beta);
}

// The same against the fp32 panel p (4 rows, stride kp floats).
template <int MB>
void block512_panel(int nr, int k, size_t kp, const float* in, int lda, const float* p,
                    const uint16_t* w, float* out, int ldc, float beta) {
  const float* r[4];
  const uint16_t* wr[4];
  for (int j = 0; j < 4; ++j) {
    r[j] = p + static_cast<size_t>(j < nr ? j : 0) * kp;
    wr[j] = w + static_cast<size_t>(j < nr ? j : 0) * k;
  }
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  const int k16 = k & ~15;
  for (int c = 0; c < k16; c += 16) {
    __m512 x[MB];
    for (int i = 0; i < MB; ++i) x[i] = _mm512_loadu_ps(in + static_cast<size_t>(i) * lda + c);
    for (int j = 0; j < 4; ++j) {
      const __m512 wv = _mm512_load_ps(r[j] + c);
      for (int i = 0; i < MB; ++i) acc[i][j] = _mm512_fmadd_ps(wv, x[i], acc[i][j]);
    }
  }
  finish_rows<MB>(acc, nr, k16, k, in, lda, wr, out, ldc, beta);
}

}  // namespace

void bf16_gemv_avx512(int m, int n, int k, const float* in, int lda, const uint16_t* w, float* out,
                      int ldc, float beta, float* scratch) {
  const int k16 = k & ~15;
  const size_t kp = static_cast<size_t>(k16 > 0 ? k16 : 16);  // 64-byte panel rows
  for (int j = 0; j < n; j += 4) {
    const int nr = n - j < 4 ? n - j : 4;
    const uint16_t* wj = w + static_cast<size_t>(j) * k;
    float* oj = out + j;
    int i = 0;
    if (m >= 3 && scratch != nullptr) {
      for (int r = 0; r < nr; ++r)
        for (int c = 0; c < k16; c += 16)
          _mm512_store_ps(scratch + r * kp + c, widen16(wj + static_cast<size_t>(r) * k + c));
      for (; i + 4 <= m; i += 4)
        block512_panel<4>(nr, k, kp, in + static_cast<size_t>(i) * lda, lda, scratch, wj,
                          oj + static_cast<size_t>(i) * ldc, ldc, beta);
      // The last 1-3 rows read the panel too (the same arithmetic as widening inline).
      const float* in_i = in + static_cast<size_t>(i) * lda;
      float* out_i = oj + static_cast<size_t>(i) * ldc;
      if (m - i == 3) block512_panel<3>(nr, k, kp, in_i, lda, scratch, wj, out_i, ldc, beta);
      if (m - i == 2) block512_panel<2>(nr, k, kp, in_i, lda, scratch, wj, out_i, ldc, beta);
      if (m - i == 1) block512_panel<1>(nr, k, kp, in_i, lda, scratch, wj, out_i, ldc, beta);
      i = m;
    }
    for (; i + 2 <= m; i += 2)
      block512<2>(nr, k, in + static_cast<size_t>(i) * lda, lda, wj,
                  oj + static_cast<size_t>(i) * ldc, ldc, beta);
    if (i < m)
      block512<1>(nr, k, in + static_cast<size_t>(i) * lda, lda, wj,
                  oj + static_cast<size_t>(i) * ldc, ldc, beta);
  }
}

}  // namespace kvq::model

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
