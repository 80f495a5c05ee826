#include "model/kernels.h"

#include <cblas.h>

#include <cmath>
#include <cstdlib>
#include <new>
#include <numbers>

namespace kvq::model {

FloatArray::FloatArray(size_t n) : n_(n) {
  if (n == 0) return;
  const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (!p) throw std::bad_alloc();
  p_.reset(static_cast<float*>(p));
}

void FloatArray::Free::operator()(float* p) const {
  std::free(p);
}

void matmul_wt(int m, int n, int k, const float* in, int lda, const float* w, float* out, int ldc,
               float beta) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, in, lda, w, k, beta, out,
              ldc);
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
