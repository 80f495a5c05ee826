// Decode kernels for a int8_per_token_head K/V cache (head_dim 64, 128, 256): one dtype per file
// keeps each compilation unit small.
#include "attention/cuda/decode_kernel.cuh"

namespace kvq::cuda {
template DecodeMainKernel
decode_main_kernel_for<KvDtype::kInt8PerTokenHead, KvDtype::kInt8PerTokenHead>(int, bool);
}  // namespace kvq::cuda
