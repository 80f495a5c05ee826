// Decode kernels for K bfloat16 over V fp8_e4m3 (head_dim 64, 128, 256): one (K, V) pair
// per file keeps each compilation unit small.
#include "attention/cuda/decode_kernel.cuh"

namespace kvq::cuda {
template DecodeMainKernel decode_main_kernel_for<KvDtype::kBFloat16, KvDtype::kFp8E4M3>(int, bool);
}  // namespace kvq::cuda
