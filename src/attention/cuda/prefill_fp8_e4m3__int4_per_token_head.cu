// Prefill kernels for a fp8_e4m3 K / int4_per_token_head V cache (head_dim 64, 128, 256): one (K,
// V) pair per file keeps each compilation unit small.
#include "attention/cuda/prefill_launch.cuh"

namespace kvq::cuda {
template void launch_prefill<KvDtype::kFp8E4M3, KvDtype::kInt4PerTokenHead>(
    const PrefillKernelParams&, int, dim3, cudaStream_t);
}  // namespace kvq::cuda
