// The timed cuBLASLt GEMMs of the CUDA model (gemm_tuner.h) against an fp64 reference on the
// host: fresh random bf16 operands, every layer's weights, beta 0 and 1, skinny decode shapes;
// untuned shapes and under-aligned pointers are refused (the model then uses cublasGemmEx).
// Skips without a CUDA device.
#include "model/cuda/gemm_tuner.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/cuda_test_util.h"

namespace kvq::test {
namespace {

uint16_t to_bf16(float x) {  // round to nearest even (finite inputs)
  uint32_t b = 0;
  std::memcpy(&b, &x, 4);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
double from_bf16(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float x = 0;
  std::memcpy(&x, &b, 4);
  return x;
}

TEST(GemmTuner, TimedAlgorithmsComputeTheGemm) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  constexpr size_t kWs = 32u << 20;
  DeviceBuffer<std::byte> ws(kWs);
  cuda_model::GemmTuner tuner(stream, ws.get(), kWs);

  struct Shape {
    int m, n, k, layers;
  };
  for (const Shape s : {Shape{1, 384, 256, 3}, Shape{16, 1024, 512, 4}, Shape{64, 768, 1536, 2},
                        Shape{200, 520, 264, 2}}) {
    SCOPED_TRACE("m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                 std::to_string(s.k));
    std::vector<uint16_t> in(static_cast<size_t>(s.m) * s.k);
    for (auto& v : in) v = to_bf16(nd(rng));
    std::vector<std::vector<uint16_t>> w(static_cast<size_t>(s.layers));
    std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> dw;
    std::vector<const void*> wp;
    for (auto& layer : w) {
      layer.resize(static_cast<size_t>(s.n) * s.k);
      for (auto& v : layer) v = to_bf16(nd(rng) / std::sqrt(static_cast<float>(s.k)));
      dw.push_back(std::make_unique<DeviceBuffer<uint16_t>>(layer));
      wp.push_back(dw.back()->get());
    }
    DeviceBuffer<uint16_t> din(in);
    DeviceBuffer<float> dout(static_cast<size_t>(s.m) * s.n);
    const double us = tuner.tune(s.m, s.n, s.k, din.get(), s.k, wp, dout.get(), s.n);
    EXPECT_GT(us, 0.0) << "a fresh shape is timed";
    EXPECT_EQ(tuner.tune(s.m, s.n, s.k, din.get(), s.k, wp, dout.get(), s.n), 0.0)
        << "a known shape is not timed again";

    std::vector<float> base(static_cast<size_t>(s.m) * s.n);
    for (auto& v : base) v = nd(rng);
    for (int l = 0; l < s.layers; ++l) {
      for (const float beta : {0.0f, 1.0f}) {
        dout.upload(base);
        ASSERT_TRUE(tuner.run(s.m, s.n, s.k, din.get(), s.k, wp[static_cast<size_t>(l)], dout.get(),
                              s.n, beta));
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        const std::vector<float> got = dout.download();
        for (int i = 0; i < s.m; ++i)
          for (int j = 0; j < s.n; ++j) {
            double want = 0.0, mag = 0.0;
            for (int t = 0; t < s.k; ++t) {
              const double p =
                  from_bf16(in[static_cast<size_t>(i) * s.k + t]) *
                  from_bf16(w[static_cast<size_t>(l)][static_cast<size_t>(j) * s.k + t]);
              want += p;
              mag += std::abs(p);
            }
            const size_t o = static_cast<size_t>(i) * s.n + j;
            want += beta * base[o];
            // fp32 accumulation over k bf16 products, any summation order.
            const double tol = 1e-6 * s.k * mag + 1e-6 * std::abs(beta * base[o]) + 1e-6;
            ASSERT_NEAR(got[o], want, tol)
                << "layer " << l << " beta " << beta << " row " << i << " col " << j;
          }
      }
    }
    // Shapes nobody tuned, and pointers less aligned than the tuned choice, are refused.
    EXPECT_FALSE(tuner.run(s.m + 1, s.n, s.k, din.get(), s.k, wp[0], dout.get(), s.n, 0.0f));
    EXPECT_FALSE(tuner.run(s.m, s.n, s.k, din.get(), s.k, static_cast<const std::byte*>(wp[0]) + 2,
                           dout.get(), s.n, 0.0f));
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace kvq::test
