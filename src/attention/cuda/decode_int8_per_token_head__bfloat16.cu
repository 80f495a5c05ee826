// Decode kernels for K int8_per_token_head over V bfloat16 (head_dim 64, 128, 256): one (K, V) pair
// per file keeps each compilation unit small.
#include "attention/cuda/decode_kernel.cuh"

namespace kvq::cuda {
template DecodeMainKernel decode_main_kernel_for<KvDtype::kInt8PerTokenHead, KvDtype::kBFloat16>(
    int, bool);
}  // namespace kvq::cuda
