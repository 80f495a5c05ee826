// Prefill kernels for a int8_per_token_head K / bfloat16 V cache (head_dim 64, 128, 256): one (K,
// V) pair per file keeps each compilation unit small.
#include "attention/cuda/prefill_launch.cuh"

namespace kvq::cuda {
template void launch_prefill<KvDtype::kInt8PerTokenHead, KvDtype::kBFloat16>(
    const PrefillKernelParams&, int, dim3, cudaStream_t);
}  // namespace kvq::cuda
