// bf16 GEMMs of the CUDA model through cuBLASLt with the algorithm picked by timing.
//
// A decode step's GEMMs are skinny (m = the batch bucket, <= 256 rows) and read whole weight
// matrices, so they should run at HBM bandwidth; cuBLAS's default choice reaches 68-88% of it
// on the 8B shapes (Nsight Compute, docs/BENCHMARKS.md). For each (m, n, k) a decode step uses,
// tune() times cuBLASLt's heuristic candidates over every layer's weight matrix of that shape
// in turn (so each run streams its weights from HBM, as in a step, rather than hitting L2) and
// keeps the fastest. The choice is process-wide (keyed by device and shape), so two models of
// the same shape in one process -- graphs on and off -- run the same algorithms and give
// bit-identical results.
//
// Layout: out[m][n] (fp32, row stride ldc) = in[m][k] (row stride lda) * w[n][k]^T
// (+ beta * out), i.e. column-major out^T = w^T-op * in^T.
//
// Operands are bf16, or FP8 e4m3 with fp32 scales applied by cuBLASLt's outer-vector scaling
// (Hopper and newer): out[i][j] = in_scale[i] * w_scale[j] * sum_c in[i][c] * w[j][c], one
// scale per token row of `in` and one per output row of `w` (a per-tensor scale is that
// vector with one value). cuBLAS runs outer-vector scaling on sm_90 only. FP8 shapes nobody tuned (prefill chunks) take cuBLASLt's first
// heuristic choice instead of the timed one; bf16 ones are refused (the model then calls
// cublasGemmEx).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <tuple>

namespace kvq::cuda_model {

enum class GemmInput : uint8_t { kBF16, kFP8 };

// One layer's weight: [n][k] values and, for FP8, its n dequantization scales (device).
struct GemmWeight {
  const void* w = nullptr;
  const float* scale = nullptr;
};

class GemmTuner {
 public:
  // `workspace` (device, workspace_bytes) is shared with the caller's cuBLAS handle; both run
  // on `stream`, so their uses never overlap.
  GemmTuner(cudaStream_t stream, void* workspace, size_t workspace_bytes);
  ~GemmTuner();
  GemmTuner(const GemmTuner&) = delete;
  GemmTuner& operator=(const GemmTuner&) = delete;

  // Picks the algorithm for (m, n, k) by timing, unless this process already has one. Every
  // pointer in `weights` is one layer's [n][k] matrix; `in` / `out` are scratch the size of the
  // real operands (their contents are overwritten). Must not run while `stream` is captured.
  // Returns the microseconds per GEMM of the choice (0 when it was known already).
  double tune(int m, int n, int k, const void* in, int lda, std::span<const void* const> weights,
              float* out, int ldc);
  // The same for any input type; FP8 needs `in_scale` (m floats, device) and each weight's
  // scale.
  double tune(GemmInput type, int m, int n, int k, const void* in, const float* in_scale, int lda,
              std::span<const GemmWeight> weights, float* out, int ldc);

  // Runs the GEMM with the tuned algorithm; false (nothing launched) when (m, n, k, lda, ldc)
  // was not tuned or a pointer is less aligned than the tuned algorithm needs.
  bool run(int m, int n, int k, const void* in, int lda, const void* w, float* out, int ldc,
           float beta) const;
  // The same for any input type. FP8 shapes that were not tuned run cuBLASLt's heuristic
  // choice (false only when it has none for the shape, or a pointer is under-aligned).
  bool run(GemmInput type, int m, int n, int k, const void* in, const float* in_scale, int lda,
           const GemmWeight& w, float* out, int ldc, float beta);

 private:
  struct Plan;
  using Key = std::tuple<int, int, int, int, int, int>;  // type, m, n, k, lda, ldc
  const Plan* find(const Key& key) const;
  // cuBLASLt's heuristic candidates for a plan (at most 16), for pointers of `align` bytes.
  int candidates(const Plan& plan, uint32_t align, cublasLtMatmulHeuristicResult_t* found) const;
  // FP8: the scale vectors of the next query or call, on the plan's descriptor.
  void set_scale_pointers(const Plan& plan, const float* in_scale, const float* w_scale) const;
  cublasStatus_t launch(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const void* in,
                        const float* in_scale, const GemmWeight& w, float* out,
                        float beta) const;

  cudaStream_t stream_;
  void* workspace_;
  size_t workspace_bytes_;
  cublasLtHandle_t lt_ = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace kvq::cuda_model
