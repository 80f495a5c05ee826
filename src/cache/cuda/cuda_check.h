// Checked CUDA runtime calls. Every failure becomes a kvq::InternalError naming the call,
// file:line and cudaGetErrorString; nothing aborts. Kernel launches are followed by
// KVQ_CUDA_CHECK_LAUNCH(), which reports launch-configuration errors at once (execution
// errors surface at the next synchronizing call, which is checked too).
#pragma once

#include <cuda_runtime.h>

namespace kvq::cuda {

[[noreturn]] void throw_cuda_error(const char* file, int line, const char* expr, cudaError_t err);

}  // namespace kvq::cuda

#define KVQ_CUDA_CHECK(expr)                                                   \
  do {                                                                         \
    const cudaError_t kvq_cuda_err_ = (expr);                                  \
    if (kvq_cuda_err_ != cudaSuccess)                                          \
      ::kvq::cuda::throw_cuda_error(__FILE__, __LINE__, #expr, kvq_cuda_err_); \
  } while (0)

#define KVQ_CUDA_CHECK_LAUNCH() KVQ_CUDA_CHECK(cudaGetLastError())
