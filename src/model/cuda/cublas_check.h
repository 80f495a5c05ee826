// KVQ_CUBLAS_CHECK: a cuBLAS / cuBLASLt call that fails throws kvq::InternalError naming the
// call, the file and line, and the status (cuBLASLt returns the same cublasStatus_t).
#pragma once

#include <cublas_v2.h>

#include <string>

#include "kvq/core/error.h"

namespace kvq::cuda_model {

[[noreturn]] inline void throw_cublas_error(const char* file, int line, const char* expr,
                                            cublasStatus_t st) {
  throw InternalError(std::string(file) + ":" + std::to_string(line) + ": " + expr + " failed: " +
                      cublasGetStatusName(st) + " (" + cublasGetStatusString(st) + ")");
}

}  // namespace kvq::cuda_model

#define KVQ_CUBLAS_CHECK(expr)                                                          \
  do {                                                                                  \
    const cublasStatus_t kvq_cublas_st_ = (expr);                                       \
    if (kvq_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                        \
      ::kvq::cuda_model::throw_cublas_error(__FILE__, __LINE__, #expr, kvq_cublas_st_); \
  } while (0)
