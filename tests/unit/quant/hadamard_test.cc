// The fixed randomized Hadamard rotation of int4_per_token_head.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kvq/core/error.h"
#include "kvq/quant/codec.h"
#include "quant_test_util.h"

namespace kvq::quant {
namespace {

using testing::SeededRng;

double norm(std::span<const float> x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}
double dot(std::span<const float> a, std::span<const float> b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// The documented sign generator, written out independently: output i + 1 of splitmix64
// seeded with "KVQ_ROT1", bit 63 set -> -1.
float documented_sign(size_t i) {
  uint64_t state = 0x4B56515F524F5431ull;
  uint64_t z = 0;
  for (size_t k = 0; k <= i; ++k) {
    state += 0x9E3779B97F4A7C15ull;
    z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
  }
  return (z >> 63) ? -1.0f : 1.0f;
}

TEST(Hadamard, SignsFollowTheDocumentedGeneratorAndAreBalanced) {
  int negatives = 0;
  for (size_t i = 0; i < 256; ++i) {
    EXPECT_EQ(hadamard_sign(i), documented_sign(i)) << "element " << i;
    negatives += hadamard_sign(i) < 0;
  }
  // A fixed sequence, so this cannot flake; it guards against a degenerate generator.
  EXPECT_GT(negatives, 96);
  EXPECT_LT(negatives, 160);
}

// Against the dense definition in double: y = H diag(s) x / sqrt(n), H[i][j] = (-1)^popcount(i&j).
TEST(Hadamard, RotateMatchesTheDenseDefinition) {
  SeededRng rng;
  for (int n : {1, 2, 8, 64, 128, 256}) {
    std::vector<float> x = testing::gaussian_rows(rng.gen, 1, n);
    std::vector<float> y = x;
    hadamard_rotate(y);
    const double xn = norm(x);
    for (int i = 0; i < n; ++i) {
      double want = 0;
      for (int j = 0; j < n; ++j) {
        const double h = (std::popcount(static_cast<unsigned>(i & j)) % 2) ? -1.0 : 1.0;
        want += h * hadamard_sign(static_cast<size_t>(j)) * x[static_cast<size_t>(j)];
      }
      want /= std::sqrt(static_cast<double>(n));
      EXPECT_NEAR(y[static_cast<size_t>(i)], want, 1e-6 * xn)
          << "n=" << n << " i=" << i << " " << rng.seed_note();
    }
  }
}

TEST(Hadamard, UnrotateInvertsRotate) {
  SeededRng rng;
  for (int n : {2, 64, 128, 256}) {
    for (auto x : {testing::gaussian_rows(rng.gen, 1, n), testing::outlier_rows(rng.gen, 1, n)}) {
      std::vector<float> y = x;
      hadamard_rotate(y);
      hadamard_unrotate(y);
      const double xn = norm(x);
      for (size_t i = 0; i < x.size(); ++i)
        ASSERT_NEAR(y[i], x[i], 1e-6 * xn) << "n=" << n << " i=" << i << " " << rng.seed_note();
      // and the other way round
      std::vector<float> z = x;
      hadamard_unrotate(z);
      hadamard_rotate(z);
      for (size_t i = 0; i < x.size(); ++i)
        ASSERT_NEAR(z[i], x[i], 1e-6 * xn) << "n=" << n << " i=" << i << " " << rng.seed_note();
    }
  }
}

TEST(Hadamard, PreservesNormsAndDotProducts) {
  SeededRng rng;
  for (int n : {64, 128, 256}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> q = testing::gaussian_rows(rng.gen, 1, n);
      std::vector<float> k = testing::outlier_rows(rng.gen, 1, n);
      std::vector<float> rq = q;
      std::vector<float> rk = k;
      hadamard_rotate(rq);
      hadamard_rotate(rk);
      EXPECT_NEAR(norm(rq), norm(q), 1e-6 * norm(q)) << rng.seed_note();
      EXPECT_NEAR(norm(rk), norm(k), 1e-6 * norm(k)) << rng.seed_note();
      EXPECT_NEAR(dot(rq, rk), dot(q, k), 1e-6 * norm(q) * norm(k)) << rng.seed_note();
    }
  }
}

// The signs are part of the storage format: they must not depend on the call, the head_dim
// or any state. Rotating a unit vector e_j reveals s_j: y = s_j * H[:, j] / sqrt(n).
TEST(Hadamard, SignsAreFixedAcrossCallsAndHeadDims) {
  for (int n : {64, 128, 256}) {
    const float inv_sqrt_n = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
    for (int j = 0; j < n; ++j) {
      std::vector<float> e(static_cast<size_t>(n), 0.0f);
      e[static_cast<size_t>(j)] = 1.0f;
      hadamard_rotate(e);
      // Row 0 of H is all ones, so y[0] = s_j / sqrt(n); every |y[i]| is 1 / sqrt(n).
      EXPECT_EQ(e[0], hadamard_sign(static_cast<size_t>(j)) * inv_sqrt_n) << "n=" << n;
      for (float v : e) EXPECT_EQ(std::fabs(v), inv_sqrt_n);
    }
  }
  SeededRng rng;
  const std::vector<float> x = testing::gaussian_rows(rng.gen, 1, 128);
  std::vector<float> a = x;
  std::vector<float> b = x;
  hadamard_rotate(a);
  hadamard_rotate(b);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(std::bit_cast<uint32_t>(a[i]), std::bit_cast<uint32_t>(b[i])) << "bitwise repeatable";
}

// The documented arithmetic, bit for bit (SIMD/GPU code must reproduce it): negate by sign,
// then the butterflies in the order of the recursive definition (transform both halves,
// then combine x[j] +- x[j + n/2]), which is the documented stage order h = 1, 2, ..., n/2,
// then one multiplication by the documented fp32 constant for 1/sqrt(n).
void recursive_fwht(std::span<float> x) {
  const size_t n = x.size();
  if (n == 1) return;
  recursive_fwht(x.first(n / 2));
  recursive_fwht(x.last(n / 2));
  for (size_t j = 0; j < n / 2; ++j) {
    const float a = x[j];
    const float b = x[j + n / 2];
    x[j] = a + b;
    x[j + n / 2] = a - b;
  }
}

float documented_inv_sqrt(size_t n) {
  const int k = std::countr_zero(n);
  return k % 2 == 0 ? std::ldexp(1.0f, -k / 2) : std::ldexp(0x1.6a09e6p-1f, -(k - 1) / 2);
}

TEST(Hadamard, RotateAndUnrotateAreBitExactWithTheDocumentedArithmetic) {
  SeededRng rng;
  for (int n : {2, 4, 64, 128, 256}) {
    const std::vector<float> x = testing::outlier_rows(rng.gen, 1, n);
    std::vector<float> want = x;
    for (size_t i = 0; i < want.size(); ++i)
      if (hadamard_sign(i) < 0) want[i] = -want[i];
    recursive_fwht(want);
    for (float& v : want) v *= documented_inv_sqrt(want.size());
    std::vector<float> got = x;
    hadamard_rotate(got);
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
          << "n=" << n << " i=" << i << " " << rng.seed_note();
    std::vector<float> back = x;
    hadamard_unrotate(back);
    std::vector<float> want_back = x;
    recursive_fwht(want_back);
    for (size_t i = 0; i < x.size(); ++i) {
      want_back[i] *= documented_inv_sqrt(x.size());
      if (hadamard_sign(i) < 0) want_back[i] = -want_back[i];
      ASSERT_EQ(std::bit_cast<uint32_t>(back[i]), std::bit_cast<uint32_t>(want_back[i]))
          << "n=" << n << " i=" << i << " " << rng.seed_note();
    }
  }
}

TEST(Hadamard, RejectsLengthsThatAreNotPowersOfTwo) {
  std::vector<float> x(96, 1.0f);
  EXPECT_THROW(hadamard_rotate(x), InternalError);
  EXPECT_THROW(hadamard_unrotate(x), InternalError);
  std::vector<float> empty;
  EXPECT_THROW(hadamard_rotate(empty), InternalError);
}

}  // namespace
}  // namespace kvq::quant
