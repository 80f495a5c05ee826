// Decode kernels for K bfloat16 over V int8_per_token_head (head_dim 64, 128, 256): one (K, V) pair
// per file keeps each compilation unit small.
#include "attention/cuda/decode_kernel.cuh"

namespace kvq::cuda {
template void launch_decode_main<KvDtype::kBFloat16, KvDtype::kInt8PerTokenHead>(
    const DecodeKernelParams&, int, dim3, cudaStream_t);
}  // namespace kvq::cuda
