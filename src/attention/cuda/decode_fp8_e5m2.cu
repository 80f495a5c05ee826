// Decode kernels for a fp8_e5m2 K/V cache (head_dim 64, 128, 256): one dtype per file keeps
// each compilation unit small.
#include "attention/cuda/decode_kernel.cuh"

namespace kvq::cuda {
template DecodeMainKernel decode_main_kernel_for<KvDtype::kFp8E5M2, KvDtype::kFp8E5M2>(int, bool);
}  // namespace kvq::cuda
