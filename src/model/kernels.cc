#include "model/kernels.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>
#include <numbers>

namespace kvq::model {

void* aligned_bytes(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!p) throw std::bad_alloc();
  return p;
}

void free_aligned(void* p) {
  std::free(p);
}

void use_single_threaded_blas() {
  static const bool done = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)done;
}

void matmul_wt(int m, int n, int k, const float* in, int lda, const float* w, float* out, int ldc,
               float beta) {
  if (m == 0 || n == 0) return;
  // One OpenMP team runs everything (attention included); each thread multiplies its own
  // slice with single-threaded sgemm. A second pool (OpenBLAS's pthreads) would fight the
  // spinning OpenMP workers for the same cores.
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t work = static_cast<int64_t>(m) * n * k;
  const int parts = work < (1 << 16) ? 1 : threads;
  if (parts <= 1) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, in, lda, w, k, beta, out,
                ldc);
    return;
  }
  // Slices of output columns (weight rows) keep each thread's weights apart, which is what
  // decode needs; a prefill with few columns per thread splits its rows instead.
  const bool split_n = n / parts >= 64 || m < parts;
#pragma omp parallel num_threads(parts)
  {
    const int p = omp_get_thread_num(), np = omp_get_num_threads();
    if (split_n) {
      const int chunk = (n + np - 1) / np;
      const int n0 = std::min(n, p * chunk), n1 = std::min(n, n0 + chunk);
      if (n1 > n0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n1 - n0, k, 1.0f, in, lda,
                    w + static_cast<size_t>(n0) * k, k, beta, out + n0, ldc);
    } else {
      const int chunk = (m + np - 1) / np;
      const int m0 = std::min(m, p * chunk), m1 = std::min(m, m0 + chunk);
      if (m1 > m0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m1 - m0, n, k, 1.0f,
                    in + static_cast<size_t>(m0) * lda, lda, w, k, beta,
                    out + static_cast<size_t>(m0) * ldc, ldc);
    }
  }
}

void rms_norm(const float* x, const float* weight, int n, float eps, float* y) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = static_cast<float>(1.0 / std::sqrt(ss / n + static_cast<double>(eps)));
  for (int i = 0; i < n; ++i) y[i] = x[i] * r * weight[i];
}

std::vector<double> rope_inv_freq(int head_dim, double theta, const RopeScaling& s) {
  const int half = head_dim / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i)
    f[static_cast<size_t>(i)] = 1.0 / std::pow(theta, 2.0 * i / head_dim);
  if (s.kind == RopeScaling::Kind::kLinear) {
    for (double& x : f) x /= s.factor;
  } else if (s.kind == RopeScaling::Kind::kLlama3) {
    // Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    const double old_len = s.original_max_position_embeddings;
    const double low_wavelen = old_len / s.low_freq_factor;
    const double high_wavelen = old_len / s.high_freq_factor;
    for (double& x : f) {
      const double wavelen = 2.0 * std::numbers::pi / x;
      if (wavelen > low_wavelen) {
        x /= s.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        x = (1.0 - smooth) * x / s.factor + smooth * x;
      }
    }
  }
  return f;
}

void apply_rope(float* x, int head_dim, const float* cos_sin) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float c = cos_sin[2 * i], s = cos_sin[2 * i + 1];
    const float a = x[i], b = x[i + half];
    x[i] = a * c - b * s;
    x[i + half] = b * c + a * s;
  }
}

void silu_mul(const float* gate, const float* up, int n, float* out) {
  for (int i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

}  // namespace kvq::model
