// The timed cuBLASLt GEMMs of the CUDA model (gemm_tuner.h) against an fp64 reference on the
// host: fresh random bf16 operands, every layer's weights, beta 0 and 1, skinny decode shapes;
// untuned shapes and under-aligned pointers are refused (the model then uses cublasGemmEx).
// Skips without a CUDA device.
#include "model/cuda/gemm_tuner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "kvq/core/error.h"
#include "kvq/quant/codec.h"
#include "model/cuda/gemv.h"
#include "model/cuda/model_kernels.h"

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

// A random e4m3 code: every code but the two NaNs.
uint8_t random_e4m3(std::mt19937& rng) {
  const auto c = static_cast<uint8_t>(rng());
  return (c & 0x7f) == 0x7f ? static_cast<uint8_t>(c ^ 0x01) : c;
}

// The FP8 forms' shapes (m, n, k, lda; k a multiple of 16): one row to kGemvMaxRows, ragged n,
// padded input rows (`pad` more values of lda), the ring variant's trips and tiles (3 x 3000 x
// 4112) and, with `large`, a one-row weight of 16 MiB and over; then one random shape (lda 0:
// the caller picks it).
struct Fp8Shape {
  int m, n, k, lda;
};
std::vector<Fp8Shape> fp8_shapes(std::mt19937& rng, int pad, bool large) {
  std::vector<Fp8Shape> s = {{1, 1, 16, 16},       {1, 40, 64, 64 + pad},
                             {5, 100, 1040, 1040}, {8, 520, 2048, 2048 + pad},
                             {9, 33, 4112, 4112},  {16, 129, 336, 336 + pad},
                             {3, 3000, 4112, 4112}};
  if (large) s.push_back({1, 4100, 4096, 4096});
  s.push_back({1 + static_cast<int>(rng() % 16), 1 + static_cast<int>(rng() % 300),
               16 * (1 + static_cast<int>(rng() % 200)), 0});
  return s;
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

// kvq's skinny kernel (gemv.h) against fp64 sums: every row count it takes (both n-tile
// widths), feature counts that do not fill its 16-row blocks, k that does not fill a warp's
// 32-value steps, padded input rows, beta 0 over a NaN-poisoned output (never read) and beta 1.
TEST(GemvBf16, MatchesTheProductForEveryShapeItTakes) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  struct Shape {
    int m, n, k, lda;
  };
  std::vector<Shape> shapes = {{1, 1, 8, 8},
                               {1, 17, 40, 48},
                               {3, 100, 264, 264},
                               {8, 1040, 520, 528},
                               {9, 33, 4104, 4104},
                               {16, 256, 2048, 2056},
                               {5, 4096, 1024, 1024},
                               {13, 70, 136, 144},
                               // Several tiles a block and several trips round the ring
                               // variant's stages, with a row tail of 16 bytes.
                               {2, 6000, 3592, 3592}};
  for (int extra = 0; extra < 4; ++extra)  // fresh random shapes as well
    shapes.push_back({1 + static_cast<int>(rng() % 16), 1 + static_cast<int>(rng() % 300),
                      8 * (1 + static_cast<int>(rng() % 300)), 0});
  for (Shape s : shapes) {
    if (s.lda == 0) s.lda = s.k + 8 * static_cast<int>(rng() % 3);
    SCOPED_TRACE("m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                 std::to_string(s.k) + " lda " + std::to_string(s.lda));
    std::vector<uint16_t> in(static_cast<size_t>(s.m) * s.lda), w(static_cast<size_t>(s.n) * s.k);
    for (auto& v : in) v = to_bf16(nd(rng));
    for (auto& v : w) v = to_bf16(nd(rng));
    DeviceBuffer<uint16_t> din(in), dw(w);
    DeviceBuffer<float> dout(static_cast<size_t>(s.m) * s.n);
    ASSERT_TRUE(
        cuda_model::gemv_bf16_fits(s.m, s.n, s.k, din.get(), s.lda, dw.get(), dout.get(), s.n));
    std::vector<float> base(static_cast<size_t>(s.m) * s.n);
    for (auto& v : base) v = nd(rng);
    for (const int warps : cuda_model::kGemvWarps)
      for (const float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE("warps " + std::to_string(warps));
        if (!cuda_model::gemv_variant_fits(warps, s.m, s.k, false)) continue;
        if (beta == 0.0f) {
          dout.upload(std::vector<float>(base.size(), std::numeric_limits<float>::quiet_NaN()));
        } else {
          dout.upload(base);
        }
        cuda_model::gemv_bf16(s.m, s.n, s.k, din.get(), s.lda, dw.get(), dout.get(), s.n, beta,
                              stream, warps);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        const std::vector<float> got = dout.download();
        for (int i = 0; i < s.m; ++i)
          for (int j = 0; j < s.n; ++j) {
            double want = 0.0, mag = 0.0;
            for (int c = 0; c < s.k; ++c) {
              const double p = from_bf16(in[static_cast<size_t>(i) * s.lda + c]) *
                               from_bf16(w[static_cast<size_t>(j) * s.k + c]);
              want += p;
              mag += std::abs(p);
            }
            const size_t o = static_cast<size_t>(i) * s.n + j;
            want += beta * base[o];
            ASSERT_NEAR(got[o], want, 2e-5 * mag + 1e-6 * std::abs(beta * base[o]) + 1e-6)
                << "beta " << beta << " row " << i << " feature " << j;
          }
      }
  }
  // What it does not take is refused, not run.
  DeviceBuffer<uint16_t> x(64 * 40), wt(64 * 40);
  DeviceBuffer<float> y(64 * 64);
  EXPECT_FALSE(cuda_model::gemv_bf16_fits(17, 8, 32, x.get(), 32, wt.get(), y.get(), 8));
  EXPECT_FALSE(cuda_model::gemv_bf16_fits(1, 8, 36, x.get(), 36, wt.get(), y.get(), 8));
  EXPECT_FALSE(cuda_model::gemv_bf16_fits(1, 8, 32, x.get(), 36, wt.get(), y.get(), 8));
  EXPECT_FALSE(cuda_model::gemv_bf16_fits(1, 8, 32, x.get() + 1, 32, wt.get(), y.get(), 8));
  EXPECT_FALSE(cuda_model::gemv_bf16_fits(1, 8, 32, x.get(), 32, wt.get() + 4, y.get(), 8));
  EXPECT_THROW(cuda_model::gemv_bf16(17, 8, 32, x.get(), 32, wt.get(), y.get(), 8, 0.0f, stream),
               InternalError);
  EXPECT_THROW(cuda_model::gemv_bf16(1, 8, 32, x.get(), 32, wt.get(), y.get(), 8, 0.0f, stream, 5),
               InternalError);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The skinny kernel's FP8 form: e4m3 codes (every finite code) times both scale vectors,
// against fp64 sums of the decoded codes, for every row count, both warp counts, ragged n and
// k, padded input rows, beta 0 over NaN and beta 1; what it does not take is refused.
TEST(GemvFp8, MatchesTheScaledProduct) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-4.0f, 4.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto code = [&]() { return random_e4m3(rng); };
  for (Fp8Shape s : fp8_shapes(rng, 16, false)) {
    if (s.lda == 0) s.lda = s.k + 16 * static_cast<int>(rng() % 2);
    SCOPED_TRACE("m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                 std::to_string(s.k) + " lda " + std::to_string(s.lda));
    std::vector<uint8_t> in(static_cast<size_t>(s.m) * s.lda), w(static_cast<size_t>(s.n) * s.k);
    for (auto& v : in) v = code();
    for (auto& v : w) v = code();
    std::vector<float> in_scale(static_cast<size_t>(s.m)), w_scale(static_cast<size_t>(s.n));
    for (auto& v : in_scale) v = std::exp(mag(rng)) / 448.0f;
    for (auto& v : w_scale) v = std::exp(mag(rng)) / 448.0f;
    DeviceBuffer<uint8_t> din(in), dw(w);
    DeviceBuffer<float> dis(in_scale), dws(w_scale), dout(static_cast<size_t>(s.m) * s.n);
    ASSERT_TRUE(
        cuda_model::gemv_fp8_fits(s.m, s.n, s.k, din.get(), s.lda, dw.get(), dout.get(), s.n));
    std::vector<float> base(static_cast<size_t>(s.m) * s.n);
    for (auto& v : base) v = nd(rng);
    for (const int warps : cuda_model::kGemvWarps)
      for (const float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE("warps " + std::to_string(warps) + " beta " + std::to_string(beta));
        if (!cuda_model::gemv_variant_fits(warps, s.m, s.k, true)) continue;
        dout.upload(beta == 0.0f
                        ? std::vector<float>(base.size(), std::numeric_limits<float>::quiet_NaN())
                        : base);
        cuda_model::gemv_fp8(s.m, s.n, s.k, din.get(), dis.get(), s.lda, dw.get(), dws.get(),
                             dout.get(), s.n, beta, stream, warps);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        const std::vector<float> got = dout.download();
        for (int i = 0; i < s.m; ++i)
          for (int j = 0; j < s.n; ++j) {
            double sum = 0.0, abs_sum = 0.0;
            for (int c = 0; c < s.k; ++c) {
              const double p = static_cast<double>(
                                   quant::fp8_e4m3_decode(in[static_cast<size_t>(i) * s.lda + c])) *
                               quant::fp8_e4m3_decode(w[static_cast<size_t>(j) * s.k + c]);
              sum += p;
              abs_sum += std::abs(p);
            }
            const double sc = static_cast<double>(in_scale[static_cast<size_t>(i)]) *
                              w_scale[static_cast<size_t>(j)];
            const size_t o = static_cast<size_t>(i) * s.n + j;
            const double want = sc * sum + beta * base[o];
            ASSERT_NEAR(got[o], want, 2e-5 * sc * abs_sum + 1e-6 * std::abs(beta * base[o]) + 1e-6)
                << "row " << i << " feature " << j;
          }
      }
  }
  DeviceBuffer<uint8_t> x(64 * 64), wt(64 * 64);
  DeviceBuffer<float> y(64 * 64);
  EXPECT_FALSE(cuda_model::gemv_fp8_fits(1, 8, 24, x.get(), 24, wt.get(), y.get(), 8));
  EXPECT_FALSE(cuda_model::gemv_fp8_fits(1, 8, 32, x.get(), 40, wt.get(), y.get(), 8));
  EXPECT_FALSE(cuda_model::gemv_fp8_fits(17, 8, 32, x.get(), 32, wt.get(), y.get(), 8));
  EXPECT_FALSE(cuda_model::gemv_fp8_fits(1, 8, 32, x.get() + 8, 32, wt.get(), y.get(), 8));
  EXPECT_THROW(cuda_model::gemv_fp8(1, 8, 32, x.get(), nullptr, 32, wt.get(), y.get(), y.get(), 8,
                                    0.0f, stream),
               InternalError);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// W8A16 (gemv_w8a16: e4m3 weights with a scale per row, bf16 inputs, no input quantization):
// against fp64 sums of the decoded codes times the bf16 inputs, for every row count, every
// variant, ragged n and k, padded input rows, beta 0 over NaN and beta 1; its fused forms
// (RMSNorm prologue, SiLU-mul epilogue) against rms_norm_rows / silu_mul around the plain
// kernel, bit for bit; what it does not take is refused.
TEST(GemvW8a16, MatchesTheScaledProductAndItsFusedForms) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-4.0f, 4.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto code = [&]() { return random_e4m3(rng); };
  for (Fp8Shape s : fp8_shapes(rng, 8, true)) {
    if (s.lda == 0) s.lda = s.k + 8 * static_cast<int>(rng() % 2);
    SCOPED_TRACE("m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                 std::to_string(s.k) + " lda " + std::to_string(s.lda));
    std::vector<uint16_t> in(static_cast<size_t>(s.m) * s.lda);
    for (auto& v : in) v = to_bf16(nd(rng));
    std::vector<uint8_t> w(static_cast<size_t>(s.n) * s.k);
    for (auto& v : w) v = code();
    std::vector<float> w_scale(static_cast<size_t>(s.n));
    for (auto& v : w_scale) v = std::exp(mag(rng)) / 448.0f;
    DeviceBuffer<uint16_t> din(in);
    DeviceBuffer<uint8_t> dw(w);
    DeviceBuffer<float> dws(w_scale), dout(static_cast<size_t>(s.m) * s.n);
    ASSERT_TRUE(
        cuda_model::gemv_w8a16_fits(s.m, s.n, s.k, din.get(), s.lda, dw.get(), dout.get(), s.n));
    std::vector<float> base(static_cast<size_t>(s.m) * s.n);
    for (auto& v : base) v = nd(rng);
    std::vector<double> sum(base.size()), abs_sum(base.size());
    for (int i = 0; i < s.m; ++i)
      for (int j = 0; j < s.n; ++j) {
        double a = 0.0, b = 0.0;
        for (int c = 0; c < s.k; ++c) {
          const double p = from_bf16(in[static_cast<size_t>(i) * s.lda + c]) *
                           quant::fp8_e4m3_decode(w[static_cast<size_t>(j) * s.k + c]);
          a += p;
          b += std::abs(p);
        }
        sum[static_cast<size_t>(i) * s.n + j] = a;
        abs_sum[static_cast<size_t>(i) * s.n + j] = b;
      }
    for (const int warps : cuda_model::kGemvWarps)
      for (const float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE("warps " + std::to_string(warps) + " beta " + std::to_string(beta));
        if (!cuda_model::gemv_variant_fits(warps, s.m, s.k, false)) continue;
        dout.upload(beta == 0.0f
                        ? std::vector<float>(base.size(), std::numeric_limits<float>::quiet_NaN())
                        : base);
        cuda_model::gemv_w8a16(s.m, s.n, s.k, din.get(), s.lda, dw.get(), dws.get(), dout.get(),
                               s.n, beta, stream, warps);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        const std::vector<float> got = dout.download();
        for (int i = 0; i < s.m; ++i)
          for (int j = 0; j < s.n; ++j) {
            const size_t o = static_cast<size_t>(i) * s.n + j;
            const double sc = w_scale[static_cast<size_t>(j)];
            const double want = sc * sum[o] + beta * base[o];
            ASSERT_NEAR(got[o], want,
                        2e-5 * sc * abs_sum[o] + 1e-6 * std::abs(beta * base[o]) + 1e-6)
                << "row " << i << " feature " << j;
          }
      }
  }

  // The fused forms: gate|up rows of 2 I codes, the RMSNorm of fp32 rows.
  struct Fused {
    int m, I, k;
  };
  for (const Fused f :
       {Fused{1, 8, 64}, Fused{3, 37, 272}, Fused{4, 700, 1024},
        Fused{1, 2100, 4096},  // the ring variant
        Fused{1 + static_cast<int>(rng() % cuda_model::kGemvNormMaxRows),
              1 + static_cast<int>(rng() % 500), 16 * (1 + static_cast<int>(rng() % 200))}}) {
    SCOPED_TRACE("fused m " + std::to_string(f.m) + " I " + std::to_string(f.I) + " k " +
                 std::to_string(f.k));
    const int ldx = f.k + 4 * static_cast<int>(rng() % 3);
    std::vector<float> x(static_cast<size_t>(f.m) * ldx), g(static_cast<size_t>(f.k));
    for (auto& v : x) v = 3.0f * nd(rng);
    for (auto& v : g) v = 1.0f + 0.5f * nd(rng);
    std::vector<uint8_t> w(static_cast<size_t>(2 * f.I) * f.k);
    for (auto& v : w) v = code();
    std::vector<float> w_scale(static_cast<size_t>(2 * f.I));
    for (auto& v : w_scale) v = std::exp(mag(rng)) / 448.0f / 64.0f;
    DeviceBuffer<float> dx(x), dg(g), dws(w_scale);
    DeviceBuffer<uint8_t> dw(w);
    DeviceBuffer<uint16_t> normed(static_cast<size_t>(f.m) * f.k);
    constexpr float kEps = 1e-5f;
    const cuda_model::GemvNorm nm{dx.get(), ldx, dg.get(), kEps};
    ASSERT_TRUE(cuda_model::gemv_norm_fits(f.m, f.k, nm));
    for (int i = 0; i < f.m; ++i)
      cuda_model::rms_norm_rows(dx.get() + static_cast<size_t>(i) * ldx, nullptr, 1, f.k, dg.get(),
                                kEps, normed.get() + static_cast<size_t>(i) * f.k, true, stream);
    const int n = 2 * f.I;
    for (const int warps : cuda_model::kGemvWarps) {
      SCOPED_TRACE("warps " + std::to_string(warps));
      if (!cuda_model::gemv_variant_fits(warps, f.m, f.k, false)) continue;
      // RMSNorm prologue: the bits of rms_norm_rows + gemv_w8a16.
      DeviceBuffer<float> ref(static_cast<size_t>(f.m) * n), got(static_cast<size_t>(f.m) * n);
      cuda_model::gemv_w8a16(f.m, n, f.k, normed.get(), f.k, dw.get(), dws.get(), ref.get(), n,
                             0.0f, stream, warps);
      cuda_model::gemv_w8a16_norm(f.m, n, f.k, nm, dw.get(), dws.get(), got.get(), n, 0.0f, stream,
                                  warps);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const std::vector<float> prod = ref.download(), b = got.download();
      ASSERT_EQ(std::memcmp(prod.data(), b.data(), prod.size() * sizeof(float)), 0)
          << "gemv_w8a16_norm and rms_norm_rows + gemv_w8a16 differ";
      // SiLU-mul epilogue, with and without the prologue: the bits of gemv_w8a16 + silu_mul.
      DeviceBuffer<uint16_t> sref(static_cast<size_t>(f.m) * f.I),
          sgot(static_cast<size_t>(f.m) * f.I), sgot_norm(static_cast<size_t>(f.m) * f.I);
      for (int i = 0; i < f.m; ++i)
        cuda_model::silu_mul(ref.get() + static_cast<size_t>(i) * n, nullptr, 1, f.I,
                             sref.get() + static_cast<size_t>(i) * f.I, true, stream);
      ASSERT_TRUE(cuda_model::gemv_w8a16_silu_mul_fits(f.m, f.I, f.k, normed.get(), f.k, dw.get(),
                                                       sgot.get(), f.I, true));
      cuda_model::gemv_w8a16_silu_mul(f.m, f.I, f.k, normed.get(), f.k, dw.get(), dws.get(),
                                      sgot.get(), f.I, true, stream, warps);
      cuda_model::gemv_w8a16_silu_mul_norm(f.m, f.I, f.k, nm, dw.get(), dws.get(), sgot_norm.get(),
                                           f.I, true, stream, warps);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const std::vector<uint16_t> sa = sref.download(), sb = sgot.download(),
                                  sc = sgot_norm.download();
      ASSERT_EQ(std::memcmp(sa.data(), sb.data(), sa.size() * 2), 0)
          << "gemv_w8a16_silu_mul and gemv_w8a16 + silu_mul differ";
      ASSERT_EQ(std::memcmp(sa.data(), sc.data(), sa.size() * 2), 0)
          << "gemv_w8a16_silu_mul_norm and rms_norm_rows + gemv_w8a16 + silu_mul differ";
      for (float v : b) ASSERT_TRUE(std::isfinite(v));
    }
  }

  // Refusals: k not a multiple of 16, lda not a multiple of 8, too many rows, misaligned input,
  // no scales.
  DeviceBuffer<uint16_t> x(64 * 64);
  DeviceBuffer<uint8_t> wt(64 * 64);
  DeviceBuffer<float> y(64 * 64);
  EXPECT_FALSE(cuda_model::gemv_w8a16_fits(1, 8, 24, x.get(), 24, wt.get(), y.get(), 8));
  EXPECT_FALSE(cuda_model::gemv_w8a16_fits(1, 8, 32, x.get(), 36, wt.get(), y.get(), 8));
  EXPECT_FALSE(cuda_model::gemv_w8a16_fits(17, 8, 32, x.get(), 32, wt.get(), y.get(), 8));
  EXPECT_FALSE(cuda_model::gemv_w8a16_fits(1, 8, 32, x.get() + 4, 32, wt.get(), y.get(), 8));
  EXPECT_FALSE(
      cuda_model::gemv_w8a16_silu_mul_fits(1, 8, 40, x.get(), 40, wt.get(), y.get(), 8, true));
  EXPECT_THROW(
      cuda_model::gemv_w8a16(1, 8, 32, x.get(), 32, wt.get(), nullptr, y.get(), 8, 0.0f, stream),
      InternalError);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The RMSNorm in the skinny GEMM's prologue (gemv_bf16_norm, gemv_bf16_silu_mul_norm) against
// rms_norm_rows (bf16 rows) followed by the plain kernels: the same bits, for every row count it
// takes, padded input rows, ragged n, both warp counts, beta 0 over NaN and beta 1; and what it
// refuses.
TEST(GemvBf16, NormPrologueIsTheUnfusedBits) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  struct Shape {
    int m, n, k;
  };
  for (const Shape s :
       {Shape{1, 16, 64}, Shape{2, 37, 264}, Shape{3, 700, 1024}, Shape{4, 129, 4096},
        // At the shared-memory limit (4 x (5088 + 32) x 2 bytes = 40 KiB), and a 70B-wide row.
        Shape{4, 21, 5088}, Shape{2, 33, 8192},
        Shape{1 + static_cast<int>(rng() % cuda_model::kGemvNormMaxRows),
              1 + static_cast<int>(rng() % 500), 8 * (1 + static_cast<int>(rng() % 400))}}) {
    SCOPED_TRACE("m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                 std::to_string(s.k));
    const int ldx = s.k + 4 * static_cast<int>(rng() % 3);  // padded rows
    std::vector<float> x(static_cast<size_t>(s.m) * ldx), g(static_cast<size_t>(s.k));
    for (auto& v : x) v = 3.0f * nd(rng);
    for (auto& v : g) v = 1.0f + 0.5f * nd(rng);
    std::vector<uint16_t> w(static_cast<size_t>(2 * s.n) * s.k);
    for (auto& v : w) v = to_bf16(nd(rng) / 8.0f);
    DeviceBuffer<float> dx(x), dg(g);
    DeviceBuffer<uint16_t> dw(w), normed(static_cast<size_t>(s.m) * s.k);
    constexpr float kEps = 1e-5f;
    const cuda_model::GemvNorm nm{dx.get(), ldx, dg.get(), kEps};
    ASSERT_TRUE(cuda_model::gemv_norm_fits(s.m, s.k, nm));
    // The unfused input: rms_norm_rows' bf16 rows (row stride k), one launch per row (its
    // rows are contiguous H-float rows, x's are ldx apart).
    for (int i = 0; i < s.m; ++i)
      cuda_model::rms_norm_rows(dx.get() + static_cast<size_t>(i) * ldx, nullptr, 1, s.k, dg.get(),
                                kEps, normed.get() + static_cast<size_t>(i) * s.k, true, stream);
    for (const int warps : cuda_model::kGemvWarps) {
      SCOPED_TRACE("warps " + std::to_string(warps));
      if (!cuda_model::gemv_variant_fits(warps, s.m, s.k, false)) continue;
      for (const float beta : {0.0f, 1.0f}) {
        std::vector<float> base(static_cast<size_t>(s.m) * s.n);
        for (auto& v : base) v = beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : nd(rng);
        DeviceBuffer<float> ref(base), got(base);
        cuda_model::gemv_bf16(s.m, s.n, s.k, normed.get(), s.k, dw.get(), ref.get(), s.n, beta,
                              stream, warps);
        cuda_model::gemv_bf16_norm(s.m, s.n, s.k, nm, dw.get(), got.get(), s.n, beta, stream,
                                   warps);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        const std::vector<float> a = ref.download(), b = got.download();
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
            << "gemv_bf16_norm and rms_norm_rows + gemv_bf16 differ, beta " << beta;
        for (float v : b) ASSERT_TRUE(std::isfinite(v));
      }
      DeviceBuffer<uint16_t> ref(static_cast<size_t>(s.m) * s.n),
          got(static_cast<size_t>(s.m) * s.n);
      cuda_model::gemv_bf16_silu_mul(s.m, s.n, s.k, normed.get(), s.k, dw.get(), ref.get(), s.n,
                                     true, stream, warps);
      cuda_model::gemv_bf16_silu_mul_norm(s.m, s.n, s.k, nm, dw.get(), got.get(), s.n, true, stream,
                                          warps);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const std::vector<uint16_t> a = ref.download(), b = got.download();
      ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(uint16_t)), 0)
          << "gemv_bf16_silu_mul_norm and rms_norm_rows + gemv_bf16_silu_mul differ";
    }
    // And the normalized rows are RMSNorm's, from fp64 (a bf16 rounding each).
    const std::vector<uint16_t> h = normed.download();
    for (int i = 0; i < s.m; ++i) {
      double ss = 0.0;
      for (int c = 0; c < s.k; ++c)
        ss += static_cast<double>(x[static_cast<size_t>(i) * ldx + c]) *
              x[static_cast<size_t>(i) * ldx + c];
      const double inv = 1.0 / std::sqrt(ss / s.k + kEps);
      for (int c = 0; c < s.k; ++c) {
        const double want = x[static_cast<size_t>(i) * ldx + c] * inv * g[static_cast<size_t>(c)];
        ASSERT_NEAR(from_bf16(h[static_cast<size_t>(i) * s.k + c]), want,
                    4e-3 * std::abs(want) + 1e-6)
            << "row " << i << " column " << c;
      }
    }
  }
  // Refusals: too many rows, k not a multiple of 8, misaligned or short rows, no weight.
  DeviceBuffer<float> x(static_cast<size_t>(8) * 1032), g(1032);
  EXPECT_FALSE(cuda_model::gemv_norm_fits(cuda_model::kGemvNormMaxRows + 1, 1024,
                                          {x.get(), 1024, g.get(), 1e-5f}));
  EXPECT_FALSE(cuda_model::gemv_norm_fits(1, 1028, {x.get(), 1032, g.get(), 1e-5f}));
  EXPECT_FALSE(cuda_model::gemv_norm_fits(1, 1024, {x.get() + 1, 1024, g.get(), 1e-5f}));
  EXPECT_FALSE(cuda_model::gemv_norm_fits(2, 1024, {x.get(), 1000, g.get(), 1e-5f}));
  EXPECT_FALSE(cuda_model::gemv_norm_fits(1, 1024, {x.get(), 1024, nullptr, 1e-5f}));
  EXPECT_FALSE(cuda_model::gemv_norm_fits(4, 16384, {x.get(), 16384, g.get(), 1e-5f}));
  EXPECT_FALSE(cuda_model::gemv_norm_fits(4, 5096, {x.get(), 5096, g.get(), 1e-5f}));
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// gate|up with its SiLU-mul in the skinny kernel's epilogue: the bits of gemv_bf16 followed by
// cuda_model::silu_mul (bf16 and fp32 rows, both warp counts, both n-tile widths, feature counts
// that do not fill its 8-feature blocks, a padded output stride).
TEST(GemvBf16, SiluMulEpilogueIsTheUnfusedBits) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  struct Shape {
    int m, I, k;
  };
  for (const Shape s : {Shape{1, 8, 64}, Shape{3, 37, 264}, Shape{8, 700, 1024},
                        Shape{11, 129, 520}, Shape{16, 64, 2056}, Shape{2, 3000, 3000},
                        Shape{1 + static_cast<int>(rng() % 16), 1 + static_cast<int>(rng() % 500),
                              8 * (1 + static_cast<int>(rng() % 200))}}) {
    SCOPED_TRACE("m " + std::to_string(s.m) + " I " + std::to_string(s.I) + " k " +
                 std::to_string(s.k));
    std::vector<uint16_t> in(static_cast<size_t>(s.m) * s.k), w(static_cast<size_t>(2 * s.I) * s.k);
    for (auto& v : in) v = to_bf16(nd(rng));
    for (auto& v : w) v = to_bf16(nd(rng) / 8.0f);
    DeviceBuffer<uint16_t> din(in), dw(w);
    DeviceBuffer<float> prod(static_cast<size_t>(s.m) * 2 * s.I);
    const int ldo = s.I + 3;
    for (const int warps : cuda_model::kGemvWarps)
      for (const bool bf16 : {true, false}) {
        SCOPED_TRACE("warps " + std::to_string(warps) + (bf16 ? " bf16" : " fp32"));
        if (!cuda_model::gemv_variant_fits(warps, s.m, s.k, false)) continue;
        DeviceBuffer<float> ref(static_cast<size_t>(s.m) * ldo),
            got(static_cast<size_t>(s.m) * ldo);
        const std::vector<float> zeros(static_cast<size_t>(s.m) * ldo, 0.0f);
        ref.upload(zeros);
        got.upload(zeros);
        cuda_model::gemv_bf16(s.m, 2 * s.I, s.k, din.get(), s.k, dw.get(), prod.get(), 2 * s.I,
                              0.0f, stream, warps);
        // silu_mul writes rows of I values; the padded stride is laid out row by row here.
        for (int i = 0; i < s.m; ++i)
          cuda_model::silu_mul(prod.get() + static_cast<size_t>(i) * 2 * s.I, nullptr, 1, s.I,
                               bf16 ? static_cast<void*>(reinterpret_cast<uint16_t*>(ref.get()) +
                                                         static_cast<size_t>(i) * ldo)
                                    : static_cast<void*>(ref.get() + static_cast<size_t>(i) * ldo),
                               bf16, stream);
        ASSERT_TRUE(cuda_model::gemv_bf16_silu_mul_fits(s.m, s.I, s.k, din.get(), s.k, dw.get(),
                                                        got.get(), ldo, bf16));
        cuda_model::gemv_bf16_silu_mul(s.m, s.I, s.k, din.get(), s.k, dw.get(), got.get(), ldo,
                                       bf16, stream, warps);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        const std::vector<float> a = ref.download(), b = got.download();
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
            << "fused and unfused bits differ";
        // And the values are silu(gate) * up of the fp64 products.
        for (int i = 0; i < s.m; ++i)
          for (int f = 0; f < s.I; ++f) {
            double gate = 0.0, up = 0.0, mag = 0.0;
            for (int c = 0; c < s.k; ++c) {
              const double x = from_bf16(in[static_cast<size_t>(i) * s.k + c]);
              gate += x * from_bf16(w[static_cast<size_t>(f) * s.k + c]);
              up += x * from_bf16(w[static_cast<size_t>(s.I + f) * s.k + c]);
              mag += std::abs(x) * (std::abs(from_bf16(w[static_cast<size_t>(f) * s.k + c])) +
                                    std::abs(from_bf16(w[static_cast<size_t>(s.I + f) * s.k + c])));
            }
            const double want = gate / (1.0 + std::exp(-gate)) * up;
            double v = 0.0;
            if (bf16) {
              uint16_t h = 0;
              std::memcpy(
                  &h,
                  reinterpret_cast<const uint16_t*>(b.data()) + static_cast<size_t>(i) * ldo + f,
                  2);
              v = from_bf16(h);
            } else {
              v = b[static_cast<size_t>(i) * ldo + f];
            }
            ASSERT_NEAR(v, want,
                        (bf16 ? 8e-3 : 1e-5) * std::abs(want) +
                            1e-4 * mag * (1.0 + std::abs(up) + std::abs(gate)) + 1e-6)
                << "row " << i << " feature " << f;
          }
      }
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The tuner's use of the skinny kernel: forced, tuned shapes run it (and compute the GEMM through
// run(), beta 1 included); never, they do not; auto keeps whichever it timed faster, and shapes
// above kGemvMaxRows rows never run it.
// The ring variant keeps its input rows in shared memory beside a ring of two or three 66 KB
// stages (227 KiB a block): one bf16 row of the 8B and 70B widths fits, 4 rows of 8192 but not of
// the 8B MLP's 14336, 8 rows of 4096 but not 16 (e4m3 rows are half as long); the register
// variants take any shape.
TEST(GemvRing, VariantFitsRule) {
  using cuda_model::gemv_variant_fits;
  using cuda_model::kGemvRing;
  for (const int k : {8, 4096, 8192, 14336, 28672, 45000})
    EXPECT_TRUE(gemv_variant_fits(kGemvRing, 1, k, false)) << k;
  EXPECT_FALSE(gemv_variant_fits(kGemvRing, 1, 46000, false));
  EXPECT_TRUE(gemv_variant_fits(kGemvRing, 1, 90000, true));  // e4m3: one byte a value
  EXPECT_TRUE(gemv_variant_fits(kGemvRing, 4, 8192, false));
  EXPECT_FALSE(gemv_variant_fits(kGemvRing, 4, 14336, false));
  EXPECT_TRUE(gemv_variant_fits(kGemvRing, 8, 4096, false));
  EXPECT_FALSE(gemv_variant_fits(kGemvRing, 8, 8192, false));
  EXPECT_TRUE(gemv_variant_fits(kGemvRing, 8, 8192, true));
  EXPECT_FALSE(gemv_variant_fits(kGemvRing, 16, 4096, false));
  EXPECT_TRUE(gemv_variant_fits(kGemvRing, 16, 4096, true));
  EXPECT_TRUE(gemv_variant_fits(kGemvRing, 16, 2048, false));
  EXPECT_FALSE(gemv_variant_fits(kGemvRing, 0, 4096, false));
  for (const int warps : {4, 8}) EXPECT_TRUE(gemv_variant_fits(warps, 16, 1 << 20, false));
  EXPECT_FALSE(gemv_variant_fits(5, 1, 4096, false));
}

TEST(GemvBf16, TunerForcedNeverAndAuto) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  constexpr size_t kWs = 32u << 20;
  DeviceBuffer<std::byte> ws(kWs);
  const int m = 1 + static_cast<int>(rng() % 16), n = 528, k = 1024;
  SCOPED_TRACE("m " + std::to_string(m));
  std::vector<uint16_t> in(static_cast<size_t>(m) * k), w(static_cast<size_t>(n) * k);
  for (auto& v : in) v = to_bf16(nd(rng));
  for (auto& v : w) v = to_bf16(nd(rng) / 32.0f);
  DeviceBuffer<uint16_t> din(in), dw(w);
  DeviceBuffer<float> dout(static_cast<size_t>(32) * n);
  const std::vector<const void*> wp = {dw.get()};
  for (const cuda_model::GemvUse use :
       {cuda_model::GemvUse::kForce, cuda_model::GemvUse::kNever, cuda_model::GemvUse::kAuto}) {
    cuda_model::GemmTuner tuner(stream, ws.get(), kWs);
    tuner.set_gemv_use(use);
    EXPECT_GT(tuner.tune(m, n, k, din.get(), k, wp, dout.get(), n), 0.0);
    if (use == cuda_model::GemvUse::kForce) {
      EXPECT_TRUE(tuner.uses_gemv(m, n, k, k, n));
    } else if (use == cuda_model::GemvUse::kNever) {
      EXPECT_FALSE(tuner.uses_gemv(m, n, k, k, n));
    }
    DeviceBuffer<uint16_t> big(static_cast<size_t>(32) * k);
    (void)tuner.tune(32, n, k, big.get(), k, wp, dout.get(), n);
    EXPECT_FALSE(tuner.uses_gemv(32, n, k, k, n));
    std::vector<float> base(static_cast<size_t>(m) * n);
    for (auto& v : base) v = nd(rng);
    dout.upload(base);
    ASSERT_TRUE(tuner.run(m, n, k, din.get(), k, dw.get(), dout.get(), n, 1.0f));
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<float> got = dout.download();
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double want = base[static_cast<size_t>(i) * n + j], mag = 0.0;
        for (int c = 0; c < k; ++c) {
          const double p = from_bf16(in[static_cast<size_t>(i) * k + c]) *
                           from_bf16(w[static_cast<size_t>(j) * k + c]);
          want += p;
          mag += std::abs(p);
        }
        ASSERT_NEAR(got[static_cast<size_t>(i) * n + j], want, 2e-5 * mag + 1e-5)
            << "use " << static_cast<int>(use) << " row " << i << " feature " << j;
      }
  }
  {
    // A margin (a caller's fused epilogue): the skinny kernel is taken unless cuBLASLt is over
    // 1000x faster; a margin below 1 is refused, and kNever still means never. (Plans are kept
    // per process and shape, so these are shapes not tuned above.)
    const int n2 = n + 16, n3 = n + 32;
    cuda_model::GemmTuner tuner(stream, ws.get(), kWs);
    EXPECT_THROW((void)tuner.tune(m, n2, k, din.get(), k, wp, dout.get(), n2, 0.5), InternalError);
    DeviceBuffer<uint16_t> w3(static_cast<size_t>(n3) * k);
    const std::vector<const void*> wp3 = {w3.get()};
    EXPECT_GT(tuner.tune(m, n3, k, din.get(), k, wp3, dout.get(), n3, 1000.0), 0.0);
    EXPECT_TRUE(tuner.uses_gemv(m, n3, k, k, n3));
    cuda_model::GemmTuner never(stream, ws.get(), kWs);
    never.set_gemv_use(cuda_model::GemvUse::kNever);
    EXPECT_GT(never.tune(m, n3, k, din.get(), k, wp3, dout.get(), n3, 1000.0), 0.0);
    EXPECT_FALSE(never.uses_gemv(m, n3, k, k, n3));
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The tuner's W8A16 shapes: only kvq's kernel runs them; tuned, run() computes the scaled
// product (beta 1); never tuned or with the skinny kernel turned off (kNever), run() refuses
// (the model then quantizes its input for the FP8 GEMM).
TEST(GemmTuner, W8a16RunsOnTheSkinnyKernelOrNot) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  constexpr size_t kWs = 32u << 20;
  DeviceBuffer<std::byte> ws(kWs);
  const int m = 1 + static_cast<int>(rng() % 16), n = 544, k = 1040;
  SCOPED_TRACE("m " + std::to_string(m));
  std::vector<uint16_t> in(static_cast<size_t>(m) * k);
  for (auto& v : in) v = to_bf16(nd(rng));
  std::vector<uint8_t> w(static_cast<size_t>(n) * k);
  for (auto& v : w) v = random_e4m3(rng);
  std::vector<float> w_scale(static_cast<size_t>(n));
  for (auto& v : w_scale) v = (0.5f + static_cast<float>(rng() % 100) / 50.0f) / 448.0f;
  DeviceBuffer<uint16_t> din(in);
  DeviceBuffer<uint8_t> dw(w);
  DeviceBuffer<float> dws(w_scale), dout(static_cast<size_t>(m) * n);
  const std::vector<cuda_model::GemmWeight> wp = {{dw.get(), dws.get()}};
  using cuda_model::GemmInput;
  {
    cuda_model::GemmTuner tuner(stream, ws.get(), kWs);
    EXPECT_FALSE(
        tuner.run(GemmInput::kW8A16, m, n, k, din.get(), nullptr, k, wp[0], dout.get(), n, 0.0f))
        << "an untuned W8A16 shape ran";
    EXPECT_GT(tuner.tune(GemmInput::kW8A16, m, n, k, din.get(), nullptr, k, wp, dout.get(), n),
              0.0);
    EXPECT_GT(tuner.gemv_warps(GemmInput::kW8A16, m, n, k, k, n), 0);
    EXPECT_EQ(tuner.gemv_warps(m, n, k, k, n), 0) << "a W8A16 plan taken for a bf16 shape";
    std::vector<float> base(static_cast<size_t>(m) * n);
    for (auto& v : base) v = nd(rng);
    dout.upload(base);
    ASSERT_TRUE(
        tuner.run(GemmInput::kW8A16, m, n, k, din.get(), nullptr, k, wp[0], dout.get(), n, 1.0f));
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<float> got = dout.download();
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double sum = 0.0, mag = 0.0;
        for (int c = 0; c < k; ++c) {
          const double p = from_bf16(in[static_cast<size_t>(i) * k + c]) *
                           quant::fp8_e4m3_decode(w[static_cast<size_t>(j) * k + c]);
          sum += p;
          mag += std::abs(p);
        }
        const double sc = w_scale[static_cast<size_t>(j)];
        const double want = base[static_cast<size_t>(i) * n + j] + sc * sum;
        ASSERT_NEAR(got[static_cast<size_t>(i) * n + j], want, 2e-5 * sc * mag + 1e-5)
            << "row " << i << " feature " << j;
      }
  }
  {
    cuda_model::GemmTuner never(stream, ws.get(), kWs);
    never.set_gemv_use(cuda_model::GemvUse::kNever);
    const int n2 = n + 16;  // a shape no tuner of this process timed
    DeviceBuffer<uint8_t> w2(static_cast<size_t>(n2) * k);
    DeviceBuffer<float> s2(static_cast<size_t>(n2)), out2(static_cast<size_t>(m) * n2);
    const std::vector<cuda_model::GemmWeight> wp2 = {{w2.get(), s2.get()}};
    EXPECT_EQ(never.tune(GemmInput::kW8A16, m, n2, k, din.get(), nullptr, k, wp2, out2.get(), n2),
              0.0);
    EXPECT_EQ(never.gemv_warps(GemmInput::kW8A16, m, n2, k, k, n2), 0);
    EXPECT_FALSE(never.run(GemmInput::kW8A16, m, n2, k, din.get(), nullptr, k, wp2[0], out2.get(),
                           n2, 0.0f));
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Host reference of quantize_rows_fp8: the reference codec on x / scale.
void quantize_host(const std::vector<float>& x, int rows, int cols, std::vector<uint8_t>& codes,
                   std::vector<float>& scale, bool given) {
  codes.resize(x.size());
  scale.resize(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    const float* row = x.data() + static_cast<size_t>(r) * cols;
    if (!given) {
      float amax = 0.0f;
      for (int c = 0; c < cols; ++c) amax = std::max(amax, std::abs(row[c]));
      scale[static_cast<size_t>(r)] = amax > 0.0f ? amax / 448.0f : 1.0f;
    }
    for (int c = 0; c < cols; ++c)
      codes[static_cast<size_t>(r) * cols + c] =
          quant::fp8_e4m3_encode(row[c] / scale[static_cast<size_t>(r)]);
  }
}

bool device_has_fp8() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  (void)minor;
  return major == 9;  // outer-vector FP8 scaling: sm_90 only
}

// The FP8 path of the CUDA model's Linear: rows quantized on the device (bit-equal to the
// reference codec, dynamic / static / given scales), then cuBLASLt's e4m3 GEMM with one scale
// per token row and one per output row -- applied by cuBLASLt (outer vectors) or by kvq's
// kernel after a unit-scale GEMM, or whichever tune() finds faster --, tuned and untuned, beta
// 0 and 1, against fp64 sums of the decoded codes times both scales.
TEST(GemmTuner, Fp8RowsAndOuterVectorScales) {
  KVQ_REQUIRE_GPU();
  if (!device_has_fp8())
    GTEST_SKIP() << "cuBLASLt's outer-vector FP8 GEMMs run on Hopper (sm_90) only";
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-3.0f, 3.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  constexpr size_t kWs = 32u << 20;
  DeviceBuffer<std::byte> ws(kWs);
  using cuda_model::Fp8Scale;
  using cuda_model::Fp8Scaling;
  for (const Fp8Scaling scaling :
       {Fp8Scaling::kOuterVector, Fp8Scaling::kEpilogue, Fp8Scaling::kAuto}) {
    SCOPED_TRACE("scaling " + std::to_string(static_cast<int>(scaling)));
    cuda_model::GemmTuner tuner(stream, ws.get(), kWs);
    tuner.set_fp8_scaling(scaling);

    struct Shape {
      int m, n, k, layers;
      bool tuned;
    };
    for (const Shape s : {Shape{1, 384, 256, 3, true}, Shape{16, 1024, 512, 2, true},
                          Shape{64, 768, 1536, 2, true}, Shape{300, 512, 256, 1, false}}) {
      SCOPED_TRACE("m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                   std::to_string(s.k));
      // Inputs as the model has them: bf16 rows of different magnitudes (a zero row too).
      std::vector<uint16_t> in(static_cast<size_t>(s.m) * s.k);
      std::vector<float> in_f(in.size());
      for (int i = 0; i < s.m; ++i) {
        const float g = i == s.m / 2 && s.m > 1 ? 0.0f : std::exp(mag(rng));
        for (int c = 0; c < s.k; ++c) {
          const size_t o = static_cast<size_t>(i) * s.k + c;
          in[o] = to_bf16(g * nd(rng));
          in_f[o] = static_cast<float>(from_bf16(in[o]));
        }
      }
      DeviceBuffer<uint16_t> din(in);
      DeviceBuffer<uint8_t> dcodes(in.size());
      DeviceBuffer<float> dscale(static_cast<size_t>(s.m));
      cuda_model::quantize_rows_fp8(din.get(), true, s.m, s.k, s.k, Fp8Scale::kDynamic, nullptr,
                                    dcodes.get(), dscale.get(), stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      std::vector<uint8_t> in_codes;
      std::vector<float> in_scale;
      quantize_host(in_f, s.m, s.k, in_codes, in_scale, false);
      ASSERT_EQ(dscale.download(), in_scale) << "dynamic row scales";
      ASSERT_EQ(dcodes.download(), in_codes) << "dynamic codes";

      // Weights: fp32 rows quantized per row on the device (dynamic: what --weight-dtype fp8 and
      // the synthetic models do).
      std::vector<std::vector<uint8_t>> wc(static_cast<size_t>(s.layers));
      std::vector<std::vector<float>> wsc(static_cast<size_t>(s.layers));
      std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> dw;
      std::vector<std::unique_ptr<DeviceBuffer<float>>> dws;
      std::vector<cuda_model::GemmWeight> wp;
      for (int l = 0; l < s.layers; ++l) {
        std::vector<float> w(static_cast<size_t>(s.n) * s.k);
        for (int j = 0; j < s.n; ++j) {
          const float g = std::exp(mag(rng)) / std::sqrt(static_cast<float>(s.k));
          for (int c = 0; c < s.k; ++c) w[static_cast<size_t>(j) * s.k + c] = g * nd(rng);
        }
        DeviceBuffer<float> wf(w);
        dw.push_back(std::make_unique<DeviceBuffer<uint8_t>>(w.size()));
        dws.push_back(std::make_unique<DeviceBuffer<float>>(static_cast<size_t>(s.n)));
        cuda_model::quantize_rows_fp8(wf.get(), false, s.n, s.k, s.k, Fp8Scale::kDynamic, nullptr,
                                      dw.back()->get(), dws.back()->get(), stream);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        quantize_host(w, s.n, s.k, wc[static_cast<size_t>(l)], wsc[static_cast<size_t>(l)], false);
        ASSERT_EQ(dws.back()->download(), wsc[static_cast<size_t>(l)]) << "weight scales";
        ASSERT_EQ(dw.back()->download(), wc[static_cast<size_t>(l)]) << "weight codes";
        wp.push_back({dw.back()->get(), dws.back()->get()});
      }
      DeviceBuffer<float> dout(static_cast<size_t>(s.m) * s.n);
      if (s.tuned) {
        EXPECT_GT(tuner.tune(cuda_model::GemmInput::kFP8, s.m, s.n, s.k, dcodes.get(), dscale.get(),
                             s.k, wp, dout.get(), s.n),
                  0.0);
      }
      if (s.tuned && scaling != Fp8Scaling::kAuto) {
        EXPECT_EQ(tuner.fp8_epilogue(s.m, s.n, s.k, s.k, s.n), scaling == Fp8Scaling::kEpilogue);
      }
      std::vector<float> base(static_cast<size_t>(s.m) * s.n);
      for (auto& v : base) v = nd(rng);
      DeviceBuffer<float> scratch(static_cast<size_t>(s.m) * s.n);
      for (int l = 0; l < s.layers; ++l)
        for (const float beta : {0.0f, 1.0f}) {
          dout.upload(base);
          ASSERT_TRUE(tuner.run(cuda_model::GemmInput::kFP8, s.m, s.n, s.k, dcodes.get(),
                                dscale.get(), s.k, wp[static_cast<size_t>(l)], dout.get(), s.n,
                                beta, scratch.get(), scratch.size()));
          ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
          const std::vector<float> got = dout.download();
          const auto& cw = wc[static_cast<size_t>(l)];
          const auto& sw = wsc[static_cast<size_t>(l)];
          for (int i = 0; i < s.m; ++i)
            for (int j = 0; j < s.n; ++j) {
              double sum = 0.0, mag_sum = 0.0;
              for (int t = 0; t < s.k; ++t) {
                const double p = static_cast<double>(quant::fp8_e4m3_decode(
                                     in_codes[static_cast<size_t>(i) * s.k + t])) *
                                 quant::fp8_e4m3_decode(cw[static_cast<size_t>(j) * s.k + t]);
                sum += p;
                mag_sum += std::abs(p);
              }
              const double sc = static_cast<double>(in_scale[static_cast<size_t>(i)]) *
                                sw[static_cast<size_t>(j)];
              const size_t o = static_cast<size_t>(i) * s.n + j;
              const double want = sum * sc + beta * base[o];
              // Exact products; the tensor cores' accumulation is not plain fp32 (partial sums
              // are promoted every few k steps), so allow 2^-12 of the magnitude.
              const double tol = (mag_sum * sc) / 4096.0 + 1e-6 * std::abs(base[o]) + 1e-6;
              ASSERT_NEAR(got[o], want, tol)
                  << "layer " << l << " beta " << beta << " row " << i << " col " << j;
            }
        }
    }
  }
  // Static and given scales: every row with the one scale, then the rows' own.
  {
    const int rows = 5, cols = 96;
    std::vector<float> x(static_cast<size_t>(rows) * cols);
    for (auto& v : x) v = 4.0f * nd(rng);
    std::vector<float> given(static_cast<size_t>(rows));
    for (auto& g : given) g = std::exp(mag(rng)) / 100.0f;  // small: saturates some values
    const std::vector<float> one{0.02f};
    DeviceBuffer<float> dx(x), dstatic(one), dgiven(given);
    DeviceBuffer<uint8_t> dc(x.size());
    DeviceBuffer<float> dsc(static_cast<size_t>(rows));
    cuda_model::quantize_rows_fp8(dx.get(), false, rows, cols, cols, Fp8Scale::kStatic,
                                  dstatic.get(), dc.get(), dsc.get(), stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<uint8_t> want;
    std::vector<float> sc(static_cast<size_t>(rows), one[0]);
    quantize_host(x, rows, cols, want, sc, true);
    EXPECT_EQ(dc.download(), want) << "static scale codes";
    EXPECT_EQ(dsc.download(), sc) << "the static scale is every row's";
    cuda_model::quantize_rows_fp8(dx.get(), false, rows, cols, cols, Fp8Scale::kGiven, nullptr,
                                  dc.get(), dgiven.get(), stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<float> g2 = given;
    quantize_host(x, rows, cols, want, g2, true);
    EXPECT_EQ(dc.download(), want) << "given scale codes";
    EXPECT_EQ(dgiven.download(), given) << "given scales are not written";
  }
  // bf16 rows through both kernels: 16-byte chunks (cols 96 in rows of stride 104, dynamic and
  // static) and the element-wise one (cols 100, not a multiple of 8).
  for (const int cols : {96, 100}) {
    SCOPED_TRACE("bf16 cols " + std::to_string(cols));
    const int rows = 7, ld = cols + 8;
    std::vector<uint16_t> xb(static_cast<size_t>(rows) * ld);
    std::vector<float> xf(static_cast<size_t>(rows) * cols);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < ld; ++c) {
        const uint16_t b = to_bf16(std::exp(mag(rng)) * nd(rng));
        xb[static_cast<size_t>(r) * ld + c] = b;
        if (c < cols) xf[static_cast<size_t>(r) * cols + c] = static_cast<float>(from_bf16(b));
      }
    DeviceBuffer<uint16_t> dx(xb);
    DeviceBuffer<uint8_t> dc(xf.size());
    DeviceBuffer<float> dsc(static_cast<size_t>(rows));
    cuda_model::quantize_rows_fp8(dx.get(), true, rows, cols, ld, Fp8Scale::kDynamic, nullptr,
                                  dc.get(), dsc.get(), stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<uint8_t> want;
    std::vector<float> sc;
    quantize_host(xf, rows, cols, want, sc, false);
    EXPECT_EQ(dsc.download(), sc) << "dynamic scales";
    EXPECT_EQ(dc.download(), want) << "dynamic codes";
    const std::vector<float> one{0.05f};
    DeviceBuffer<float> dstatic(one);
    cuda_model::quantize_rows_fp8(dx.get(), true, rows, cols, ld, Fp8Scale::kStatic, dstatic.get(),
                                  dc.get(), dsc.get(), stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<float> sc1(static_cast<size_t>(rows), one[0]);
    quantize_host(xf, rows, cols, want, sc1, true);
    EXPECT_EQ(dc.download(), want) << "static codes";
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The FP8 row quantizers that hold a thread's share of the row in registers (one memory round trip
// a row) give the bits of the kernels that re-read it per pass: every value-per-thread count
// (1-8) and the fallback past it, dynamic and static scales, RMSNorm with and without a residual
// add whose row scale is the output's scale buffer (as act_scale_ in the model).
TEST(Fp8RowQuantizers, HeldRowsAreTheRereadBits) {
  KVQ_REQUIRE_GPU();
  using cuda_model::Fp8Scale;
  const unsigned seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-3.0f, 3.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const int rows = 3;
  auto random_rows = [&](size_t n) {
    std::vector<float> x(n);
    for (auto& v : x) v = std::exp(mag(rng)) * nd(rng);
    return x;
  };
  const std::vector<float> one{0.03f};
  DeviceBuffer<float> dstatic(one);
  for (const Fp8Scale mode : {Fp8Scale::kDynamic, Fp8Scale::kStatic}) {
    const float* sin = mode == Fp8Scale::kStatic ? dstatic.get() : nullptr;
    // RMSNorm + quantize (1024 threads from 2048 columns: up to 8 a thread, 9000 falls back).
    for (const int H : {64, 200, 300, 4096, 5000, 8192, 9000}) {
      for (const bool residual : {false, true}) {
        SCOPED_TRACE("rms_norm_rows_fp8 H " + std::to_string(H) + (residual ? " residual" : ""));
        const std::vector<float> x = random_rows(static_cast<size_t>(rows) * H);
        const std::vector<float> add = random_rows(x.size()), w = random_rows(H),
                                 cs = random_rows(H);
        std::vector<float> rs(static_cast<size_t>(rows));
        for (auto& v : rs) v = std::exp(mag(rng));
        std::vector<uint8_t> codes[2];
        std::vector<float> scales[2], xs[2];
        for (const int held : {0, 1}) {
          DeviceBuffer<float> dx(x), dw(w), dadd(add), dcs(cs), dsc(rs);
          DeviceBuffer<uint8_t> dc(x.size());
          cuda_model::ResidualAdd ra;
          if (residual) ra = {dadd.get(), dsc.get(), dcs.get()};
          cuda_model::rms_norm_rows_fp8(dx.get(), rows, H, dw.get(), 1e-5f, mode, sin, dc.get(),
                                        dsc.get(), stream, ra, held);
          ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
          codes[held] = dc.download();
          scales[held] = dsc.download();
          xs[held] = dx.download();
        }
        EXPECT_EQ(codes[1], codes[0]);
        EXPECT_EQ(scales[1], scales[0]);
        EXPECT_EQ(xs[1], xs[0]) << "the residual stream after the add";
      }
    }
    // fp32 rows rounded to bf16, then quantized.
    for (const int cols : {100, 250, 4096, 8192, 9000}) {
      SCOPED_TRACE("quantize_rows_fp8_rounded cols " + std::to_string(cols));
      const int ld = cols + 4;
      const std::vector<float> x = random_rows(static_cast<size_t>(rows) * ld);
      std::vector<uint8_t> codes[2];
      std::vector<float> scales[2];
      for (const int held : {0, 1}) {
        DeviceBuffer<float> dx(x), dsc(static_cast<size_t>(rows));
        DeviceBuffer<uint8_t> dc(static_cast<size_t>(rows) * cols);
        cuda_model::quantize_rows_fp8_rounded(dx.get(), rows, cols, ld, mode, sin, dc.get(),
                                              dsc.get(), stream, held);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        codes[held] = dc.download();
        scales[held] = dsc.download();
      }
      EXPECT_EQ(codes[1], codes[0]);
      EXPECT_EQ(scales[1], scales[0]);
    }
    // bf16 rows in 16-byte chunks (512 threads from 2048 columns: 14336 is 3.5 chunks a thread,
    // 40000 falls back).
    for (const int cols : {96, 4096, 14336, 30000, 40000}) {
      SCOPED_TRACE("quantize_rows_fp8 bf16 cols " + std::to_string(cols));
      const int ld = cols + 8;
      std::vector<uint16_t> xb(static_cast<size_t>(rows) * ld);
      for (auto& b : xb) b = to_bf16(std::exp(mag(rng)) * nd(rng));
      std::vector<uint8_t> codes[2];
      std::vector<float> scales[2];
      for (const int held : {0, 1}) {
        DeviceBuffer<uint16_t> dx(xb);
        DeviceBuffer<float> dsc(static_cast<size_t>(rows));
        DeviceBuffer<uint8_t> dc(static_cast<size_t>(rows) * cols);
        cuda_model::quantize_rows_fp8(dx.get(), true, rows, cols, ld, mode, sin, dc.get(),
                                      dsc.get(), stream, held);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        codes[held] = dc.download();
        scales[held] = dsc.download();
      }
      EXPECT_EQ(codes[1], codes[0]);
      EXPECT_EQ(scales[1], scales[0]);
    }
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace kvq::test
