// Prefill kernels for a fp8_e4m3 K / bfloat16 V cache (head_dim 64, 128, 256): one (K, V) pair per
// file keeps each compilation unit small.
#include "attention/cuda/prefill_launch.cuh"

namespace kvq::cuda {
template void launch_prefill<KvDtype::kFp8E4M3, KvDtype::kBFloat16>(const PrefillKernelParams&, int,
                                                                    dim3, cudaStream_t);
}  // namespace kvq::cuda
