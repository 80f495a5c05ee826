#include "cache/cuda/cuda_check.h"

#include <string>

#include "kvq/core/error.h"

namespace kvq::cuda {

void throw_cuda_error(const char* file, int line, const char* expr, cudaError_t err) {
  throw_internal(
      file, line,
      std::string(expr) + " failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

}  // namespace kvq::cuda
