// Device helpers for row-wise kernels, shared by the model's kernels (model_kernels.cu) and the
// tensor-parallel all-reduce that also normalizes its rows (peer_all_reduce.cu), so a row is
// normalized by one definition of RMSNorm wherever it runs.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace kvq::cuda_model::rows {

__device__ __forceinline__ void store(void* out, int64_t i, float v, bool bf16) {
  if (bf16)
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  else
    static_cast<float*>(out)[i] = v;
}

__device__ __forceinline__ float load(const void* in, int64_t i, bool bf16) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(in)[i])
              : static_cast<const float*>(in)[i];
}

// The sum of v over the block (every thread gets it); scratch holds a value per warp. A second
// call on the same scratch needs a __syncthreads() between.
template <typename T>
__device__ T block_sum(T v, T* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T s = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += scratch[w];
  return s;
}

// RMSNorm of one row of H floats whose sum of squares (over the block) is ss: out row r =
// row x inv_rms x w, written by the block's threads.
__device__ __forceinline__ float rms_inverse(double ss, int H, float eps) {
  return static_cast<float>(1.0 / sqrt(ss / H + static_cast<double>(eps)));
}
__device__ __forceinline__ void store_normed_row(void* out, int64_t r, int H, const float* row,
                                                 float inv, const float* w, bool bf16) {
  for (int i = static_cast<int>(threadIdx.x); i < H; i += blockDim.x)
    store(out, r * H + i, __fmul_rn(__fmul_rn(row[i], inv), w[i]), bf16);
}

}  // namespace kvq::cuda_model::rows
