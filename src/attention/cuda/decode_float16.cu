// Decode kernels for a float16 K/V cache (head_dim 64, 128, 256): one dtype per file keeps
// each compilation unit small.
#include "attention/cuda/decode_kernel.cuh"

namespace kvq::cuda {
template void launch_decode_main<KvDtype::kFloat16, KvDtype::kFloat16>(const DecodeKernelParams&,
                                                                       int, dim3, cudaStream_t);
}  // namespace kvq::cuda
