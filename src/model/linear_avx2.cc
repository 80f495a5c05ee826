// The bf16 product of model::Linear, for AVX2 + FMA (every batch size). Called only after
// cpu_has_avx2_fma(). Everything compiled for AVX2 here has internal linkage or a unique name
// and uses intrinsics and raw pointers only, so no inline function or template shared with
// generic code can be merged by the linker into an AVX2 copy (see kernel_avx512.cc).
//
// Each pass takes 4 rows of W and up to 2 input rows: 8 fp32 accumulators, the 4 W vectors
// widened from bf16 by a 16-bit shift, one input vector; the 4 x 2 sums leave through one
// horizontal-add tree per input row. With 3 or more input rows the 4 W rows are widened once
// into an fp32 panel (`scratch`, L1/L2-resident) and passes of 3 input rows read it: 12
// accumulators, the widening paid once per W row instead of once per pair of input rows.
// Every output element is the same sequence of operations either way (8-lane partial sums
// fused-multiply-added in k order, the same horizontal tree, the same tail), so a row's
// result does not depend on the batch it is in.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "model/linear.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace kvq::model {

namespace {

__m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

float widen1(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// [sum(a), sum(b), sum(c), sum(d)]
__m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b);
  const __m256 cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// The outputs of a pass: each accumulator's 8 lanes through the same horizontal tree, the
// k tail (columns k8..k of bf16 W rows r[j]) in order, then beta. Shared by both passes, so an
// output is the same sequence of operations whichever pass computed it.
template <int MB>
void finish_rows(const __m256 (&acc)[MB][4], int nr, int k8, int k, const float* in, int lda,
                 const uint16_t* const (&r)[4], float* out, int ldc, float beta) {
  for (int i = 0; i < MB; ++i) {
    alignas(16) float s[4];
    _mm_store_ps(s, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    const float* x = in + static_cast<size_t>(i) * lda;
    for (int c = k8; c < k; ++c)
      for (int j = 0; j < 4; ++j) s[j] += widen1(r[j][c]) * x[c];
    float* o = out + static_cast<size_t>(i) * ldc;
    for (int j = 0; j < nr; ++j) o[j] = beta == 0.0f ? s[j] : s[j] + beta * o[j];
  }
}

// out[i][0..nr) for input rows i < MB (MB 1 or 2) against W rows w[0..nr), nr <= 4 (missing
// rows read row 0 again and are not stored).
template <int MB>
void block(int nr, int k, const float* in, int lda, const uint16_t* w, float* out, int ldc,
           float beta) {
  const uint16_t* r[4];
  for (int j = 0; j < 4; ++j) r[j] = w + static_cast<size_t>(j < nr ? j : 0) * k;
  __m256 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  const int k8 = k & ~7;
  for (int c = 0; c < k8; c += 8) {
    const __m256 w0 = widen8(r[0] + c), w1 = widen8(r[1] + c), w2 = widen8(r[2] + c),
                 w3 = widen8(r[3] + c);
    for (int i = 0; i < MB; ++i) {
      const __m256 x = _mm256_loadu_ps(in + static_cast<size_t>(i) * lda + c);
      acc[i][0] = _mm256_fmadd_ps(w0, x, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w1, x, acc[i][1]);
      acc[i][2] = _mm256_fmadd_ps(w2, x, acc[i][2]);
      acc[i][3] = _mm256_fmadd_ps(w3, x, acc[i][3]);
    }
  }
  finish_rows<MB>(acc, nr, k8, k, in, lda, r, out, ldc, beta);
}

// The same as block<MB> for MB input rows against 4 fp32 panel rows p[j][k] (row j of W
// widened; missing rows are copies of row 0 and are not stored).
template <int MB>
void block_panel(int nr, int k, const float* in, int lda, const float* p, const uint16_t* w,
                 float* out, int ldc, float beta) {
  const int k8 = k & ~7;
  const size_t kp = static_cast<size_t>(k8 > 0 ? k8 : 8);
  const float* r[4];
  for (int j = 0; j < 4; ++j) r[j] = p + static_cast<size_t>(j < nr ? j : 0) * kp;
  __m256 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int c = 0; c < k8; c += 8) {
    __m256 x[MB];
    for (int i = 0; i < MB; ++i) x[i] = _mm256_loadu_ps(in + static_cast<size_t>(i) * lda + c);
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = _mm256_load_ps(r[j] + c);
      for (int i = 0; i < MB; ++i) acc[i][j] = _mm256_fmadd_ps(wv, x[i], acc[i][j]);
    }
  }
  const uint16_t* wr[4];
  for (int j = 0; j < 4; ++j) wr[j] = w + static_cast<size_t>(j < nr ? j : 0) * k;
  finish_rows<MB>(acc, nr, k8, k, in, lda, wr, out, ldc, beta);
}

}  // namespace

void bf16_gemv_avx2(int m, int n, int k, const float* in, int lda, const uint16_t* w, float* out,
                    int ldc, float beta, float* scratch) {
  const int k8 = k & ~7;
  const size_t kp = static_cast<size_t>(k8 > 0 ? k8 : 8);  // panel row stride (32-byte rows)
  for (int j = 0; j < n; j += 4) {
    const int nr = n - j < 4 ? n - j : 4;
    const uint16_t* wj = w + static_cast<size_t>(j) * k;
    int i = 0;
    if (m >= 3 && scratch != nullptr) {
      for (int r = 0; r < nr; ++r)
        for (int c = 0; c < k8; c += 8)
          _mm256_store_ps(scratch + r * kp + c, widen8(wj + static_cast<size_t>(r) * k + c));
      for (; i + 3 <= m; i += 3)
        block_panel<3>(nr, k, in + static_cast<size_t>(i) * lda,
                       lda, scratch, wj, out + static_cast<size_t>(i) * ldc + j, ldc, beta);
    }
    for (; i + 2 <= m; i += 2)
      block<2>(nr, k, in + static_cast<size_t>(i) * lda, lda, wj,
               out + static_cast<size_t>(i) * ldc + j, ldc, beta);
    if (i < m)
      block<1>(nr, k, in + static_cast<size_t>(i) * lda, lda, wj,
               out + static_cast<size_t>(i) * ldc + j, ldc, beta);
  }
}

}  // namespace kvq::model

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
