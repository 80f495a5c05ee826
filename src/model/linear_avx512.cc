// The bf16 product of model::Linear for AVX-512F CPUs: the AVX2 kernel's design
// (linear_avx2.cc) with 16 lanes. Called only after cpu_has_avx512f(). Everything compiled for
// AVX-512 here has internal linkage or a unique name and uses intrinsics and raw pointers only
// (see kernel_avx512.cc for why).
//
// Batches of 1-2 rows widen 4 W rows from bf16 per pass (16-bit shift) and multiply them with
// each input row; batches of 3 or more widen the 4 W rows once into an fp32 panel (`scratch`)
// and read it in passes of 4 input rows (16 accumulators). Every output element is the same
// sequence of operations either way (16-lane partial sums fused-multiply-added in k order,
// one reduction, the same tail), so a row's result does not depend on its batch. It differs
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

// One output: the 16 lanes reduced, then the k tail in order, then beta.
void finish(__m512 acc, const uint16_t* wr, const float* x, int k16, int k, float beta,
            float* o) {
  float s = _mm512_reduce_add_ps(acc);
  for (int c = k16; c < k; ++c) s += widen1_512(wr[c]) * x[c];
  *o = beta == 0.0f ? s : s + beta * *o;
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
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < nr; ++j)
      finish(acc[i][j], r[j], in + static_cast<size_t>(i) * lda, k16, k, beta,
             out + static_cast<size_t>(i) * ldc + j);
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
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < nr; ++j)
      finish(acc[i][j], wr[j], in + static_cast<size_t>(i) * lda, k16, k, beta,
             out + static_cast<size_t>(i) * ldc + j);
}

}  // namespace

void bf16_gemv_avx512(int m, int n, int k, const float* in, int lda, const uint16_t* w,
                      float* out, int ldc, float beta, float* scratch) {
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
      if (m - i == 3) {
        block512_panel<3>(nr, k, kp, in + static_cast<size_t>(i) * lda, lda, scratch, wj,
                          oj + static_cast<size_t>(i) * ldc, ldc, beta);
        i += 3;
      }
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
