// A projection's weights on the CPU and how they are multiplied: W is [rows][cols] (a PyTorch
// Linear weight, out x in), stored as fp32 or as bf16. A bf16 checkpoint stays bf16 (half the
// bytes that every decode step reads; the values are the checkpoint's exactly); products
// accumulate in fp32 either way.
//
// Which product runs (apply): fp32 weights go to OpenBLAS sgemm; bf16 weights go to an
// AVX2/FMA kernel that widens bf16 in registers (Debian's OpenBLAS 0.3.21 has no bf16 GEMM)
// for any number of rows, so a row's result never depends on the batch it is in (a solo run
// and a batched or speculative step give the same logits, bit for bit); CPUs without AVX2
// convert slices of W to fp32 scratch per thread and run sgemm on them.
#pragma once

#include <cstdint>

#include "model/kernels.h"

namespace kvq::model {

class Linear {
 public:
  enum class Storage : uint8_t { kFloat32, kBFloat16 };

  Linear() = default;
  // `values` [rows][cols]; with kBFloat16 they are rounded to bf16 (exact for values that came
  // from a bf16 checkpoint).
  Linear(FloatArray values, int rows, int cols, Storage storage);

  int rows() const { return rows_; }
  int cols() const { return cols_; }
  Storage storage() const { return storage_; }
  bool empty() const { return rows_ == 0; }
  size_t bytes() const;

  // out[i][j] = sum_c in[i][c] * W[r0 + j][c] + beta * out[i][j] for i < m, j < n
  // (n < 0: every row from r0). Rows of `in` are lda floats apart, rows of `out` ldc apart;
  // with beta == 0, out is not read. Split over the OpenMP threads when large enough.
  void apply(int m, const float* in, int lda, float* out, int ldc, float beta, int r0 = 0,
             int n = -1) const;
  // Row r of W as fp32 (an embedding lookup).
  void row(int r, float* dst) const;

 private:
  Storage storage_ = Storage::kFloat32;
  int rows_ = 0, cols_ = 0;
  FloatArray f32_;
  AlignedArray<uint16_t> bf16_;
};

// True when the CPU has AVX2 and FMA (the bf16 kernel's instructions).
bool cpu_has_avx2_fma();

// The bf16 kernel: out[i][j] = in[i] . w[j] + beta * out[i][j], i < m, j < n, w bf16
// [n][k]. Only call when cpu_has_avx2_fma(). `scratch` (32-byte aligned, bf16_gemv_scratch(k)
// floats, or null) holds 4 rows of W widened to fp32 for batches of 3 or more rows; the
// result is the same with or without it.
void bf16_gemv_avx2(int m, int n, int k, const float* in, int lda, const uint16_t* w, float* out,
                    int ldc, float beta, float* scratch = nullptr);
// The same with 16 lanes; only call when cpu_has_avx512f(). Its last bits differ from the
// AVX2 kernel's, so Linear picks one kernel per process (linear_kernel()).
void bf16_gemv_avx512(int m, int n, int k, const float* in, int lda, const uint16_t* w,
                      float* out, int ldc, float beta, float* scratch = nullptr);
bool cpu_has_avx512f();
// The bf16 kernel Linear runs: "avx512", "avx2" or "portable" (fp32 slices + sgemm).
// KVQ_CPU_ISA=avx2 or portable picks a narrower one (for A/B measurements; the attention
// backend cpu_avx512 reads it too).
const char* linear_kernel();
inline size_t bf16_gemv_scratch(int k) {
  return 4 * static_cast<size_t>(k > 8 ? k : 8);
}

}  // namespace kvq::model
