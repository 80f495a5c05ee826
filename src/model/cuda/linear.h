// One projection of the CUDA model (the device counterpart of model/linear.h): its weight
// W [n][k] (a PyTorch Linear weight, out x in) in its own precision, the scales that precision
// needs, and so the GEMM that multiplies it. Every matrix product of the model -- q|k|v,
// o, gate|up, down, the LM head, a DFlash drafter's fc -- goes through one Linear and
// CudaDecoderModel::linear(), so a projection's precision is a property of the projection
// (an FP8 checkpoint's `ignore` list leaves some in bf16), not of the model.
//
// Precisions:
//   kF32:  fp32 weights and fp32 inputs, cublasGemmEx with pedantic fp32 compute (matches the
//          CPU model).
//   kBF16: bf16 weights and bf16 inputs, fp32 accumulation; decode shapes use timed cuBLASLt
//          algorithms or, up to 16 rows, kvq's skinny GEMM where it timed faster
//          (gemm_tuner.h, gemv.h).
//   kFP8:  e4m3 weights with one fp32 dequantization scale per output row (a per-tensor
//          checkpoint scale is that row vector with one value); the bf16 input rows are
//          quantized to e4m3 before the GEMM (quantize_rows_fp8) with a scale per token row
//          (dynamic: the row's max / 448) or the checkpoint's static `input_scale`; the GEMM
//          accumulates in fp32 and both scale vectors are applied by cuBLASLt (outer-vector
//          scaling) or by kvq's kernel after a unit-scale GEMM, or (up to 16 rows) by kvq's
//          skinny GEMM's FP8 form, whichever the tuner timed faster for the shape
//          (gemm_tuner.h, gemv.h).
// Outputs are always fp32 (the residual stream), written or accumulated (beta 1).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq::cuda_model {

struct Linear {
  enum class Dtype : uint8_t { kF32, kBF16, kFP8 };

  Dtype dtype = Dtype::kBF16;
  int n = 0;  // output features (rows of W)
  int k = 0;  // input features
  const void* w = nullptr;
  const float* scale = nullptr;     // kFP8: [n] dequantization scales (device)
  const float* in_scale = nullptr;  // kFP8, static activations: one scale (device); else null

  bool empty() const { return w == nullptr; }
  // Device bytes of the weight alone.
  size_t weight_bytes() const {
    const size_t e = dtype == Dtype::kF32 ? 4 : dtype == Dtype::kBF16 ? 2 : 1;
    return static_cast<size_t>(n) * static_cast<size_t>(k) * e;
  }
  // Device bytes of the weight and its scales.
  size_t bytes() const {
    return weight_bytes() +
           (dtype == Dtype::kFP8 ? static_cast<size_t>(n) * 4 + (in_scale ? 4 : 0) : 0);
  }
};

}  // namespace kvq::cuda_model
