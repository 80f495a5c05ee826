// Kernel parameters of the prefill kernels (private to src/attention/cuda): cuda_prefill.cu
// fills them, the prefill_<k>[__<v>].cu files instantiate the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/cuda/cuda_prefill.h"
#include "cache/cuda/kv_codec_device.cuh"
#include "kvq/core/kv_dtype.h"

namespace kvq::cuda {

struct PrefillSide {
  const uint8_t* base;
  uint64_t block_bytes, head_stride, values_bytes;
  float tensor_scale[kPrefillMaxKvHeads];  // per kv head (1 where unused)
};

struct PrefillKernelParams {
  PrefillSide k, v;
  const float* q;
  float* out;
  const int32_t* q_indptr;
  const int32_t* indptr;
  const int32_t* indices;
  const int32_t* seq_lens;
  int num_q_heads, num_kv_heads, ratio, block_tokens, attention_kind, window;
  float softmax_scale, soft_cap;  // soft_cap 0: off
  HadamardSigns signs;
};

// One instantiation per (K, V) pair, for head_dim 64, 128 and 256, defined in
// prefill_<k>.cu (K == V) or prefill_<k>__<v>.cu.
template <KvDtype DK, KvDtype DV>
void launch_prefill(const PrefillKernelParams& p, int head_dim, dim3 grid, cudaStream_t stream);

}  // namespace kvq::cuda
