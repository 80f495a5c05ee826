// bf16 GEMMs of the CUDA model through cuBLASLt with the algorithm picked by timing.
//
// A decode step's GEMMs are skinny (m = the batch bucket, <= 256 rows) and read whole weight
// matrices, so they should run at HBM bandwidth; cuBLAS's default choice reaches 68-88% of it
// on the 8B shapes (Nsight Compute, docs/BENCHMARKS.md). For each (m, n, k) a decode step uses,
// tune() times cuBLASLt's heuristic candidates over every layer's weight matrix of that shape
// in turn (so each run streams its weights from HBM, as in a step, rather than hitting L2) and
// keeps the fastest. The choice is process-wide (keyed by device and shape), so two models of
// the same shape in one process -- graphs on and off -- run the same algorithms and give
// bit-identical results. For up to kGemvMaxRows rows kvq's skinny kernel (gemv.h; 4 and 8
// warps per block) is one more candidate, timed the same way (GemvUse).
//
// Layout: out[m][n] (fp32, row stride ldc) = in[m][k] (row stride lda) * w[n][k]^T
// (+ beta * out), i.e. column-major out^T = w^T-op * in^T.
//
// Operands are bf16, or FP8 e4m3 with fp32 scales: out[i][j] = in_scale[i] * w_scale[j] *
// sum_c in[i][c] * w[j][c], one scale per token row of `in` and one per output row of `w` (a
// per-tensor scale is that vector with one value). Two ways to apply the scales
// (Fp8Scaling): cuBLASLt's outer-vector scaling in the GEMM's epilogue, or a GEMM with unit
// scales followed by kvq's scaling kernel (fp8_scale_product). On an H100 cuBLASLt offers one
// 128x128-tile kernel for outer-vector scaling, which reads a decode step's weights at
// 1.0-1.5 TB/s, and 7-8 candidates (split-K, small tiles) for unit scales, 1.8-2.7 TB/s
// (bench/cuda_gemm_bench.cu, docs/notes/fp8-gemm.md); tune() times both and keeps the faster.
// Outer-vector scaling runs on sm_90 only in cuBLAS. FP8 shapes nobody tuned (prefill chunks)
// take cuBLASLt's first outer-vector choice instead of a timed one; bf16 ones are refused (the
// model then calls cublasGemmEx).
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

// kW8A16: FP8 weights (e4m3 with their row scales) times bf16 inputs, on kvq's skinny kernel
// only (gemv.h gemv_w8a16; cuBLASLt has no such GEMM): tune() times its variants, and run()
// returns false for a shape without one (the caller then quantizes its input for kFP8).
enum class GemmInput : uint8_t { kBF16, kFP8, kW8A16 };

// How an FP8 GEMM applies its row and column scales: kAuto times both for tuned shapes.
enum class Fp8Scaling : uint8_t { kAuto, kOuterVector, kEpilogue };

// Whether shapes of up to kGemvMaxRows rows may run kvq's skinny kernel (gemv.h; FP8 ones only
// with Fp8Scaling::kAuto, the kernel applying both scale vectors itself): kAuto
// times it beside cuBLASLt's candidates, kNever leaves it out, kForce takes it wherever it
// applies (tests, A/B runs). KVQ_GEMV=auto|0|force sets it at construction.
enum class GemvUse : uint8_t { kAuto, kNever, kForce };
// KVQ_GEMV's setting (auto when unset); InputError naming the variable for another value.
GemvUse gemv_use_from_env();
// KVQ_GEMV_RING=n (1 when unset): the most rows for which the tuner times the skinny kernel's
// ring variant (gemv.h, kGemvRing) beside the others, 0 .. 16; 0 never. One row by default: in
// a step's graph it paid at one row and cost at two, though faster alone there too
// (docs/notes/decode-tuning.md version 19). InputError for another value.
int gemv_ring_from_env();
// The smallest weight (bytes) the ring variant is timed for: the 8B model's o (32 MiB) and one
// tensor-parallel rank's (16 MiB) are in, the default model's products (< 2 MB) out.
inline constexpr size_t kGemvRingMinBytes = size_t{16} << 20;

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
  // `gemv_margin` (>= 1): the skinny kernel is taken where its time is under cuBLASLt's best x
  // the margin, for a caller that saves a launch when it runs (a fused epilogue) which the
  // timing of the product alone does not see.
  double tune(int m, int n, int k, const void* in, int lda, std::span<const void* const> weights,
              float* out, int ldc, double gemv_margin = 1.0);
  // The same for any input type; FP8 needs `in_scale` (m floats, device) and each weight's
  // scale.
  double tune(GemmInput type, int m, int n, int k, const void* in, const float* in_scale, int lda,
              std::span<const GemmWeight> weights, float* out, int ldc, double gemv_margin = 1.0);

  // Runs the GEMM with the tuned algorithm; false (nothing launched) when (m, n, k, lda, ldc)
  // was not tuned or a pointer is less aligned than the tuned algorithm needs.
  bool run(int m, int n, int k, const void* in, int lda, const void* w, float* out, int ldc,
           float beta) const;
  // The same for any input type. FP8 shapes that were not tuned run cuBLASLt's heuristic
  // choice (false only when it has none for the shape, or a pointer is under-aligned). An FP8
  // GEMM scaled by kvq's kernel with beta != 0 writes the product to `scratch` first (at least
  // m * ldc floats; checked).
  // `left_unscaled` (nullable): where the caller applies the scales itself (in the kernel that
  // consumes the product), an FP8 call whose plan scales with kvq's kernel skips that kernel
  // and sets *left_unscaled; the unit-scale product is then in out (beta 0) or in scratch (beta
  // != 0: out is left as it was, for the caller to add beta x the scaled product to).
  bool run(GemmInput type, int m, int n, int k, const void* in, const float* in_scale, int lda,
           const GemmWeight& w, float* out, int ldc, float beta, float* scratch = nullptr,
           size_t scratch_floats = 0, bool* left_unscaled = nullptr);

  // Restricts the FP8 scaling of later tune() / untuned run() calls (tests, A/B runs); kAuto
  // (the default) lets tune() time both. KVQ_FP8_SCALING=outer_vector|epilogue sets it at
  // construction.
  void set_fp8_scaling(Fp8Scaling s) { fp8_scaling_ = s; }
  // Restricts the skinny kernel for later tune() calls (GemvUse).
  void set_gemv_use(GemvUse g) { gemv_ = g; }
  // For bf16 (m, n, k, lda, ldc) after tune(): whether kvq's skinny kernel runs it, and with
  // how many warps per block (0: cuBLASLt runs it, or the shape was not tuned).
  bool uses_gemv(int m, int n, int k, int lda, int ldc) const {
    return gemv_warps(m, n, k, lda, ldc) > 0;
  }
  int gemv_warps(int m, int n, int k, int lda, int ldc) const {
    return gemv_warps(GemmInput::kBF16, m, n, k, lda, ldc);
  }
  int gemv_warps(GemmInput type, int m, int n, int k, int lda, int ldc) const;
  // Whether the caller applies the scales of kvq-scaled FP8 products itself (in the kernels
  // that consume them: run()'s left_unscaled): tune() then times those candidates without
  // kvq's scaling kernel, as they will run. Without it a fused model was given cuBLASLt's
  // scaling at 256 rows for the cost of a kernel it never launches (an 8B verification step
  // of 32 x 8 rows: 13.5 ms instead of 11.3).
  void set_fp8_scales_deferred(bool deferred) { fp8_scales_deferred_ = deferred; }
  // For FP8 (m, n, k, lda, ldc) after tune(): whether kvq's kernel applies the scales.
  bool fp8_epilogue(int m, int n, int k, int lda, int ldc) const;

 private:
  struct Plan;
  // type (with the FP8 scaling or the skinny-kernel restriction: type_key), m, n, k, lda, ldc
  using Key = std::tuple<int, int, int, int, int, int>;
  int type_key(GemmInput type) const {
    return static_cast<int>(type) * 16 +
           (type == GemmInput::kFP8 ? static_cast<int>(fp8_scaling_) * 4 : 0) +
           static_cast<int>(gemv_);
  }
  const Plan* find(const Key& key) const;
  // cuBLASLt's heuristic candidates for a plan (at most 16), for pointers of `align` bytes.
  int candidates(const Plan& plan, uint32_t align, cublasLtMatmulHeuristicResult_t* found) const;
  // FP8: the scale vectors of the next query or call, on the plan's descriptor.
  void set_scale_pointers(const Plan& plan, const float* in_scale, const float* w_scale) const;
  cublasStatus_t launch(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const void* in,
                        const float* in_scale, const GemmWeight& w, float* out, float beta) const;
  // The GEMM with unit scales into `raw` (laid out like out), then kvq's scaling kernel.
  cublasStatus_t launch_epilogue(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const void* in,
                                 const float* in_scale, const GemmWeight& w, float* raw, float* out,
                                 float beta, bool scale = true) const;

  cudaStream_t stream_;
  void* workspace_;
  size_t workspace_bytes_;
  cublasLtHandle_t lt_ = nullptr;
  Fp8Scaling fp8_scaling_ = Fp8Scaling::kAuto;
  bool fp8_scales_deferred_ = false;
  GemvUse gemv_ = GemvUse::kAuto;
  int gemv_ring_ = 1;  // KVQ_GEMV_RING: the most rows the ring variant is timed for
  bool log_ = false;   // KVQ_GEMM_LOG=1: one stderr line per tuned shape
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace kvq::cuda_model
