// Why int4_per_token_head rotates: on outlier-heavy rows (a few channels 20-50x larger, like
// real keys) the per-row [min, max] range is set by the outliers, so without rotation every
// ordinary channel rounds to a handful of levels. The Hadamard rotation spreads the outlier
// energy over all channels first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "kvq/quant/codec.h"
#include "quant_test_util.h"
#include "row_codec_util.h"

namespace kvq::quant {
namespace {

// The int4 scheme without the rotation, written here from its definition: per row
// lo = min, hi = max, fp16 scale (hi - lo) / 15 and zero lo, codes rint((x - zero) / scale)
// clamped to [0, 15], value = code * scale + zero.
std::vector<float> int4_round_trip_without_rotation(std::span<const float> x) {
  const float lo = *std::min_element(x.begin(), x.end());
  const float hi = *std::max_element(x.begin(), x.end());
  const float s = fp16_bits_to_float(float_to_fp16_bits((hi - lo) / 15.0f));
  const float z = fp16_bits_to_float(float_to_fp16_bits(lo));
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double q = s == 0 ? 0.0 : std::clamp(std::nearbyint((x[i] - z) / s), 0.0f, 15.0f);
    y[i] = static_cast<float>(q * s + z);
  }
  return y;
}

TEST(Int4Rotation, MseWithRotationIsAtLeast4xLowerThanWithoutOnOutlierRows) {
  testing::SeededRng rng;
  constexpr int n = 128;
  constexpr int rows = 256;
  const std::vector<float> data = testing::outlier_rows(rng.gen, rows, n);
  double se_rot = 0;
  double se_plain = 0;
  for (int r = 0; r < rows; ++r) {
    const auto x = std::span<const float>(data).subspan(static_cast<size_t>(r) * n, n);
    const auto rot = testing::decode(KvDtype::kInt4PerTokenHead,
                                     testing::encode(KvDtype::kInt4PerTokenHead, x, 1.0f), 1.0f, n,
                                     /*unrotated=*/true);
    const auto plain = int4_round_trip_without_rotation(x);
    for (int i = 0; i < n; ++i) {
      se_rot += std::pow(double{rot[static_cast<size_t>(i)]} - x[static_cast<size_t>(i)], 2);
      se_plain += std::pow(double{plain[static_cast<size_t>(i)]} - x[static_cast<size_t>(i)], 2);
    }
  }
  const double mse_rot = se_rot / (rows * n);
  const double mse_plain = se_plain / (rows * n);
  RecordProperty("int4_mse_with_rotation", std::to_string(mse_rot));
  RecordProperty("int4_mse_without_rotation", std::to_string(mse_plain));
  std::cout << "int4 on outlier rows (head_dim " << n << "): MSE with rotation " << mse_rot
            << ", without rotation " << mse_plain << " (" << mse_plain / mse_rot << "x)\n";
  // The gain on this data is far larger than 4x; 4x leaves room for any seed.
  EXPECT_LT(mse_rot * 4, mse_plain) << rng.seed_note();
}

}  // namespace
}  // namespace kvq::quant
