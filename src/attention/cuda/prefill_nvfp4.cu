// Prefill kernels for a nvfp4 K/V cache (head_dim 64, 128, 256): one (K, V) pair per file keeps
// each compilation unit small.
#include "attention/cuda/prefill_launch.cuh"

namespace kvq::cuda {
template void launch_prefill<KvDtype::kNvfp4, KvDtype::kNvfp4>(const PrefillKernelParams&, int,
                                                               dim3, cudaStream_t);
}  // namespace kvq::cuda
