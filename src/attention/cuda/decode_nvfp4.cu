// Decode kernels for a nvfp4 K/V cache (head_dim 64, 128, 256): one dtype per file keeps
// each compilation unit small.
#include "attention/cuda/decode_kernel.cuh"

namespace kvq::cuda {
template DecodeMainKernel decode_main_kernel_for<KvDtype::kNvfp4, KvDtype::kNvfp4>(int, bool);
}  // namespace kvq::cuda
