#include "model/linear.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "kvq/core/error.h"

namespace kvq::model {

namespace {

uint16_t to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

void widen(const uint16_t* src, size_t n, float* dst) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

// Rows [j0, j1) of bf16 W through fp32 slices of at most kSliceFloats and sgemm.
void bf16_sgemm_slices(int m, int j0, int j1, int k, const float* in, int lda, const uint16_t* w,
                       float* out, int ldc, float beta) {
  constexpr size_t kSliceFloats = size_t{1} << 16;  // 256 KiB: stays in L2 while sgemm reads it
  const int slice_rows = std::max(1, static_cast<int>(kSliceFloats / static_cast<size_t>(k)));
  FloatArray scratch(static_cast<size_t>(std::min(slice_rows, j1 - j0)) * k);
  for (int a = j0; a < j1; a += slice_rows) {
    const int b = std::min(j1, a + slice_rows);
    widen(w + static_cast<size_t>(a) * k, static_cast<size_t>(b - a) * k, scratch.data());
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, b - a, k, 1.0f, in, lda, scratch.data(),
                k, beta, out + a, ldc);
  }
}

}  // namespace

bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

bool cpu_has_avx512f() {
  static const bool has = __builtin_cpu_supports("avx512f") && cpu_has_avx2_fma();
  return has;
}

const char* linear_kernel() {
  static const char* k = [] {
    const std::string want = env_choice("KVQ_CPU_ISA", {"avx512", "avx2", "portable"});
    if (want != "avx2" && want != "portable" && cpu_has_avx512f()) return "avx512";
    if (want != "portable" && cpu_has_avx2_fma()) return "avx2";
    return "portable";
  }();
  return k;
}

Linear::Linear(FloatArray values, int rows, int cols, Storage storage)
    : storage_(storage), rows_(rows), cols_(cols) {
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  KVQ_CHECK(rows >= 0 && cols > 0 && values.size() == n,
            "Linear: " + std::to_string(values.size()) + " values for a " + std::to_string(rows) +
                " x " + std::to_string(cols) + " weight");
  if (storage == Storage::kFloat32) {
    f32_ = std::move(values);
    return;
  }
  bf16_ = AlignedArray<uint16_t>(n);
  const float* v = values.data();
  uint16_t* d = bf16_.data();
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (size_t i = 0; i < n; ++i) d[i] = to_bf16_bits(v[i]);
}

size_t Linear::bytes() const {
  return f32_.size() * sizeof(float) + bf16_.size() * sizeof(uint16_t);
}

void Linear::row(int r, float* dst) const {
  const size_t at = static_cast<size_t>(r) * static_cast<size_t>(cols_);
  if (storage_ == Storage::kFloat32) {
    std::copy_n(f32_.data() + at, cols_, dst);
  } else {
    widen(bf16_.data() + at, static_cast<size_t>(cols_), dst);
  }
}

void Linear::apply(int m, const float* in, int lda, float* out, int ldc, float beta, int r0,
                   int n) const {
  if (n < 0) n = rows_ - r0;
  KVQ_CHECK(r0 >= 0 && r0 + n <= rows_, "Linear::apply: rows out of range");
  if (m == 0 || n == 0) return;
  const int k = cols_;
  if (storage_ == Storage::kFloat32) {
    matmul_wt(m, n, k, in, lda, f32_.data() + static_cast<size_t>(r0) * k, out, ldc, beta);
    return;
  }
  const uint16_t* w = bf16_.data() + static_cast<size_t>(r0) * k;
  const std::string_view isa = linear_kernel();
  const bool avx512 = isa == "avx512", avx2 = isa == "avx2";
  auto run = [&](int j0, int j1) {
    if (j1 <= j0) return;
    if (avx2 || avx512) {
      // The widened W panel of batches of 3+ rows: per thread, kept between calls.
      thread_local FloatArray panel;
      float* scratch = nullptr;
      if (m >= 3) {
        if (panel.size() < bf16_gemv_scratch(k)) panel = FloatArray(bf16_gemv_scratch(k));
        scratch = panel.data();
      }
      // Input rows in blocks of kRowBlock, each against every W row of the slice: the kernels
      // stream all their input rows past each 4-row W panel, and a prefill's rows (4096 x 768
      // floats = 12 MiB) would come from L3 for every panel; a block's stays in L2. Each output
      // is the same sequence of operations whatever the blocking (see the kernels).
      constexpr int kRowBlock = 96;
      for (int i0 = 0; i0 < m; i0 += kRowBlock) {
        const int mb = std::min(kRowBlock, m - i0);
        const float* in_b = in + static_cast<size_t>(i0) * lda;
        float* out_b = out + static_cast<size_t>(i0) * ldc + j0;
        const uint16_t* w_b = w + static_cast<size_t>(j0) * k;
        if (avx512)
          bf16_gemv_avx512(mb, j1 - j0, k, in_b, lda, w_b, out_b, ldc, beta, scratch);
        else
          bf16_gemv_avx2(mb, j1 - j0, k, in_b, lda, w_b, out_b, ldc, beta, scratch);
      }
    } else {
      bf16_sgemm_slices(m, j0, j1, k, in, lda, w, out, ldc, beta);
    }
  };
  // As matmul_wt: one OpenMP team, each thread its own slice of W's rows (a multiple of 8, so
  // the kernel's 4-row groups are whole).
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t work = static_cast<int64_t>(m) * n * k;
  const int parts = work < (1 << 16) ? 1 : std::min(threads, std::max(1, n / 8));
  if (parts <= 1) {
    run(0, n);
    return;
  }
#pragma omp parallel num_threads(parts)
  {
    const int p = omp_get_thread_num(), np = omp_get_num_threads();
    const int chunk = ((n + np - 1) / np + 7) / 8 * 8;
    const int j0 = std::min(n, p * chunk), j1 = std::min(n, j0 + chunk);
    run(j0, j1);
  }
}

}  // namespace kvq::model
