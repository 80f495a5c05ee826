// The fixed randomized Hadamard rotation of int4_per_token_head (part of the storage format:
// changing anything here changes what every stored int4 row means).
//
//   rotate:   y = H_n * diag(s) * x / sqrt(n)
//   unrotate: x = diag(s) * H_n * y / sqrt(n)      (H_n symmetric, H_n * H_n = n * I)
//
// Signs: s_i is the sign of output number i + 1 (counting from 1) of a splitmix64 generator
// seeded with kHadamardSeed, i.e. bit 63 of mix(kHadamardSeed + (i + 1) * 0x9E3779B97F4A7C15);
// bit set -> -1. s_i depends on i only (not on n), so every head_dim uses a prefix of one
// sequence and a GPU kernel can compute it per element or bake a table.
//
// Arithmetic, fixed so SIMD/GPU code can reproduce it bit for bit:
//  * applying a sign is a negation (exact);
//  * the unnormalized fast Walsh-Hadamard transform runs in log2(n) in-place stages with
//    h = 1, 2, 4, ..., n/2 in that order; each stage maps every pair (x[j], x[j+h]) with
//    (j & h) == 0 to (x[j] + x[j+h], x[j] - x[j+h]), one fp32 rounding each;
//  * the result is multiplied by inv_sqrt_n (one fp32 rounding): n = 2^k, k even ->
//    2^(-k/2) exactly; k odd -> 2^(-(k-1)/2) * 0x1.6a09e6p-1f (the float nearest sqrt(1/2)).
#include <bit>
#include <cstdint>
#include <span>
#include <string>

#include "kvq/core/error.h"
#include "kvq/quant/codec.h"
#include "quant/ref/minifloat.h"

namespace kvq::quant {
namespace {

constexpr uint64_t kHadamardSeed = 0x4B56515F524F5431ull;  // "KVQ_ROT1"
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

constexpr uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr bool sign_is_negative(size_t i) {
  return (splitmix64_mix(kHadamardSeed + (static_cast<uint64_t>(i) + 1) * kGolden) >> 63) != 0;
}

void check_length(size_t n) {
  if (n == 0 || !std::has_single_bit(n))
    throw_internal(__FILE__, __LINE__,
                   "hadamard rotation needs a power-of-two length, got " + std::to_string(n));
}

float inv_sqrt_n(size_t n) {
  const int k = std::countr_zero(n);
  if (k % 2 == 0) return detail::pow2f(-k / 2);
  return detail::pow2f(-(k - 1) / 2) * std::bit_cast<float>(0x3F3504F3u);  // exact: power of two
}

void fwht(std::span<float> x) {
  const size_t n = x.size();
  for (size_t h = 1; h < n; h <<= 1) {
    for (size_t i = 0; i < n; i += 2 * h) {
      for (size_t j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

}  // namespace

float hadamard_sign(size_t index) {
  return sign_is_negative(index) ? -1.0f : 1.0f;
}

void hadamard_rotate(std::span<float> x) {
  check_length(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    if (sign_is_negative(i)) x[i] = -x[i];
  fwht(x);
  const float c = inv_sqrt_n(x.size());
  for (float& v : x) v *= c;
}

void hadamard_unrotate(std::span<float> x) {
  check_length(x.size());
  fwht(x);
  const float c = inv_sqrt_n(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] *= c;
    if (sign_is_negative(i)) x[i] = -x[i];
  }
}

}  // namespace kvq::quant
