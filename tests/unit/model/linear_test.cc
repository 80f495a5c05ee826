// model::Linear against a float64 product of the same (bf16-rounded) values: every path
// (the AVX2 kernel; the fp32-slice sgemm path on CPUs without AVX2; fp32 storage), row ranges, beta
// 0 (the output is not read: poisoned with NaN) and beta 1, shapes with tails.
#include <gtest/gtest.h>

#include <bit>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <vector>

#include "model/linear.h"
#include "model_test_util.h"

namespace kvq::test {
namespace {

using model::FloatArray;
using model::Linear;

float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

struct Shape {
  int m, n, k;
};

void check(const Linear& lin, const std::vector<float>& w, const Shape& s, int r0, int n,
           float beta, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int lda = s.k + 3, ldc = n + 5;
  std::vector<float> in(static_cast<size_t>(s.m) * lda), out(static_cast<size_t>(s.m) * ldc);
  for (float& x : in) x = nd(rng);
  for (float& x : out) x = beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : nd(rng);
  const std::vector<float> before = out;
  lin.apply(s.m, in.data(), lda, out.data(), ldc, beta, r0, n);
  for (int i = 0; i < s.m; ++i)
    for (int j = 0; j < n; ++j) {
      double ref = 0.0, mag = 0.0;
      for (int c = 0; c < s.k; ++c) {
        const double p = static_cast<double>(in[static_cast<size_t>(i) * lda + c]) *
                         w[static_cast<size_t>(r0 + j) * s.k + c];
        ref += p;
        mag += std::abs(p);
      }
      const size_t o = static_cast<size_t>(i) * ldc + j;
      if (beta != 0.0f) {
        ref += beta * static_cast<double>(before[o]);
        mag += std::abs(before[o]);
      }
      ASSERT_NEAR(out[o], ref, 2e-6 * mag + 1e-30)
          << "m " << s.m << " n " << n << " k " << s.k << " r0 " << r0 << " beta " << beta
          << " at (" << i << ", " << j << ")";
    }
  // Nothing outside the n columns was written.
  for (int i = 0; i < s.m; ++i)
    for (int j = n; j < ldc; ++j) {
      const size_t o = static_cast<size_t>(i) * ldc + j;
      if (beta == 0.0f) {
        ASSERT_TRUE(std::isnan(out[o])) << "column " << j << " written";
      } else {
        ASSERT_EQ(out[o], before[o]) << "column " << j << " written";
      }
    }
}

TEST(Linear, MatchesFloat64ForEveryPathAndShape) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.5f);
  const Shape shapes[] = {{1, 1, 8},    {1, 13, 64},  {2, 4, 13},  {3, 21, 100},
                          {5, 64, 256}, {16, 37, 72}, {17, 40, 9}, {40, 130, 256}};
  for (const Shape& s : shapes)
    for (auto storage : {Linear::Storage::kBFloat16, Linear::Storage::kFloat32}) {
      std::vector<float> w(static_cast<size_t>(s.n) * s.k);
      for (float& x : w) x = round_bf16(nd(rng));
      FloatArray values(w.size());
      std::copy(w.begin(), w.end(), values.data());
      const Linear lin(std::move(values), s.n, s.k, storage);
      EXPECT_EQ(lin.bytes(), w.size() * (storage == Linear::Storage::kBFloat16 ? 2 : 4));
      for (float beta : {0.0f, 1.0f}) {
        check(lin, w, s, 0, s.n, beta, rng);
        if (s.n > 3) check(lin, w, s, 1, s.n - 3, beta, rng);  // a range of rows
      }
      std::vector<float> r(static_cast<size_t>(s.k));
      lin.row(s.n - 1, r.data());
      for (int c = 0; c < s.k; ++c)
        ASSERT_EQ(r[static_cast<size_t>(c)], w[static_cast<size_t>(s.n - 1) * s.k + c]);
    }
}

// Linear::apply on a prefill-sized batch (its input rows go to the kernel in blocks, the last
// of 1-2 rows here): every row the same bits as that row alone.
TEST(Linear, PrefillBatchRowsEqualTheRowsAlone) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.5f);
  const int n = 72, k = 136;
  FloatArray values(static_cast<size_t>(n) * k);
  for (size_t i = 0; i < values.size(); ++i) values.data()[i] = round_bf16(nd(rng));
  const Linear lin(std::move(values), n, k, Linear::Storage::kBFloat16);
  for (int m : {193, 290}) {
    std::vector<float> in(static_cast<size_t>(m) * k), out(static_cast<size_t>(m) * n),
        solo(static_cast<size_t>(n));
    for (float& x : in) x = nd(rng);
    lin.apply(m, in.data(), k, out.data(), n, 0.0f);
    for (int i = 0; i < m; ++i) {
      lin.apply(1, in.data() + static_cast<size_t>(i) * k, k, solo.data(), n, 0.0f);
      for (int j = 0; j < n; ++j)
        ASSERT_EQ(std::bit_cast<uint32_t>(out[static_cast<size_t>(i) * n + j]),
                  std::bit_cast<uint32_t>(solo[static_cast<size_t>(j)]))
            << "m " << m << " row " << i << " column " << j;
    }
  }
}

// One bf16 kernel directly (Linear::apply picks it on CPUs that have its instructions): with
// the panel, without it and one row at a time the same bits (a row's result does not depend on
// its batch), and every output within fp32 accumulation of the float64 product.
using Kernel = void (*)(int, int, int, const float*, int, const uint16_t*, float*, int, float,
                        float*);
void check_kernel(Kernel kernel, std::initializer_list<Shape> shapes) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const Shape& s : shapes) {
    std::vector<uint16_t> w(static_cast<size_t>(s.n) * s.k);
    std::vector<float> wf(w.size()), in(static_cast<size_t>(s.m) * s.k);
    for (size_t i = 0; i < w.size(); ++i) {
      wf[i] = round_bf16(nd(rng));
      uint32_t u;
      std::memcpy(&u, &wf[i], 4);
      w[i] = static_cast<uint16_t>(u >> 16);
    }
    for (float& x : in) x = nd(rng);
    std::vector<float> out(static_cast<size_t>(s.m) * s.n, std::numeric_limits<float>::quiet_NaN());
    FloatArray panel(model::bf16_gemv_scratch(s.k));
    kernel(s.m, s.n, s.k, in.data(), s.k, w.data(), out.data(), s.n, 0.0f, panel.data());
    // Without the panel, and one row at a time: the same bits (a row's result does not
    // depend on its batch).
    std::vector<float> plain(out.size()), solo(out.size());
    kernel(s.m, s.n, s.k, in.data(), s.k, w.data(), plain.data(), s.n, 0.0f, nullptr);
    for (int i = 0; i < s.m; ++i)
      kernel(1, s.n, s.k, in.data() + static_cast<size_t>(i) * s.k, s.k, w.data(),
             solo.data() + static_cast<size_t>(i) * s.n, s.n, 0.0f, nullptr);
    ASSERT_EQ(plain, out);
    ASSERT_EQ(solo, out);
    for (int i = 0; i < s.m; ++i)
      for (int j = 0; j < s.n; ++j) {
        double ref = 0.0, mag = 0.0;
        for (int c = 0; c < s.k; ++c) {
          const double p = static_cast<double>(in[static_cast<size_t>(i) * s.k + c]) *
                           wf[static_cast<size_t>(j) * s.k + c];
          ref += p;
          mag += std::abs(p);
        }
        ASSERT_NEAR(out[static_cast<size_t>(i) * s.n + j], ref, 2e-6 * mag);
      }
  }
}

TEST(Linear, Avx2KernelMatchesFloat64) {
  if (!model::cpu_has_avx2_fma()) GTEST_SKIP() << "this CPU has no AVX2/FMA";
  check_kernel(model::bf16_gemv_avx2, {Shape{1, 7, 19}, Shape{4, 9, 64}, Shape{7, 5, 33},
                                       Shape{9, 13, 200}, Shape{3, 4, 5}, Shape{11, 17, 768}});
}

TEST(Linear, Avx512KernelMatchesFloat64) {
  if (!model::cpu_has_avx512f()) GTEST_SKIP() << "this CPU has no AVX-512F";
  check_kernel(model::bf16_gemv_avx512,
               {Shape{1, 7, 19}, Shape{4, 9, 64}, Shape{7, 5, 33}, Shape{9, 13, 200},
                Shape{3, 4, 5}, Shape{11, 17, 768}, Shape{4, 6, 16}, Shape{6, 5, 47}});
}

}  // namespace
}  // namespace kvq::test
