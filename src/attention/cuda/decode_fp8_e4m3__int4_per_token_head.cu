// Decode kernels for K fp8_e4m3 over V int4_per_token_head (head_dim 64, 128, 256): one (K, V) pair
// per file keeps each compilation unit small.
#include "attention/cuda/decode_kernel.cuh"

namespace kvq::cuda {
template DecodeMainKernel decode_main_kernel_for<KvDtype::kFp8E4M3, KvDtype::kInt4PerTokenHead>(
    int, bool);
}  // namespace kvq::cuda
