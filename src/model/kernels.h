// The forward pass's building blocks on fp32 rows: RMSNorm, RoPE (rotate_half convention),
// SwiGLU, and the one matrix-product entry point (OpenBLAS sgemm).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvq/model/model.h"

namespace kvq::model {

// Uninitialised, 64-byte aligned storage of trivial values (weights and per-call scratch: no
// zero fill).
void* aligned_bytes(size_t bytes);  // 64-byte aligned, bad_alloc on failure
void free_aligned(void* p);

template <typename T>
class AlignedArray {
 public:
  AlignedArray() = default;
  explicit AlignedArray(size_t n) : n_(n) {
    if (n > 0) p_.reset(static_cast<T*>(aligned_bytes(n * sizeof(T))));
  }
  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }

 private:
  struct Free {
    void operator()(T* p) const { free_aligned(p); }
  };
  std::unique_ptr<T[], Free> p_;
  size_t n_ = 0;
};
using FloatArray = AlignedArray<float>;

// Makes OpenBLAS run each call on the calling thread (once per process): kvq parallelises
// matrix products itself, with OpenMP (see matmul_wt).
void use_single_threaded_blas();

// out[m][n] = in[m][k] * w[n][k]^T + beta * out (w is a PyTorch Linear weight, [out][in]).
// Rows of `in` are `lda` floats apart, rows of `out` `ldc` floats apart. Split over the OpenMP
// threads (omp_get_max_threads()) when large enough.
void matmul_wt(int m, int n, int k, const float* in, int lda, const float* w, float* out, int ldc,
               float beta);

// y = x * rsqrt(mean(x^2) + eps) * weight, over `n` elements (x and y may alias).
void rms_norm(const float* x, const float* weight, int n, float eps, float* y);

// The rotary inverse frequencies (head_dim / 2 of them), with linear or llama3 scaling
// applied the way transformers does (_compute_linear_scaling_rope_parameters,
// _compute_llama3_parameters).
std::vector<double> rope_inv_freq(int head_dim, double theta, const RopeScaling& scaling);

// Rotates one head of `head_dim` values in place: pairs (i, i + head_dim/2), angles
// cos_sin[2i], cos_sin[2i+1] for frequency i.
void apply_rope(float* x, int head_dim, const float* cos_sin);

// out[i] = silu(gate[i]) * up[i].
void silu_mul(const float* gate, const float* up, int n, float* out);

}  // namespace kvq::model
