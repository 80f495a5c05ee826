// Decode kernels for a int4_per_token_head K/V cache (head_dim 64, 128, 256): one dtype per file
// keeps each compilation unit small.
#include "attention/cuda/decode_kernel.cuh"

namespace kvq::cuda {
template void launch_decode_main<KvDtype::kInt4PerTokenHead, KvDtype::kInt4PerTokenHead>(
    const DecodeKernelParams&, int, dim3, cudaStream_t);
}  // namespace kvq::cuda
