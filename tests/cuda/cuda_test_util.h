// Helpers for the CUDA tests: skip without a GPU, device buffers, seeds.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include "kvq/cache/device_kv_cache.h"

// CI builds this binary on machines without a GPU: every test skips there with a message.
#define KVQ_REQUIRE_GPU()                                                                   \
  do {                                                                                      \
    if (::kvq::cuda_device_count() == 0)                                                    \
      GTEST_SKIP() << "no CUDA device visible: the CUDA tests need a GPU (they only build " \
                      "on this machine)";                                                   \
  } while (0)

namespace kvq::test {

// The same function as in unit/attention/attention_harness.h, which a test may include too.
#ifndef KVQ_TEST_FRESH_SEED_DEFINED
#define KVQ_TEST_FRESH_SEED_DEFINED
inline unsigned fresh_seed() {
  return std::random_device{}();
}
#endif

// A device allocation of n elements of T, freed on destruction.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (cudaMalloc(&p_, sizeof(T) * (n > 0 ? n : 1)) != cudaSuccess) {
      p_ = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << sizeof(T) * n << " bytes failed";
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (p_) (void)cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return static_cast<T*>(p_); }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    EXPECT_EQ(cudaMemcpy(p_, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    EXPECT_EQ(cudaMemcpy(host.data(), p_, sizeof(T) * n_, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  // Every byte 0xFF: NaN as float, so an element nobody wrote cannot pass a check.
  void poison() { EXPECT_EQ(cudaMemset(p_, 0xFF, sizeof(T) * n_), cudaSuccess); }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace kvq::test
