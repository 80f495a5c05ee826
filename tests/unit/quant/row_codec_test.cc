// encode_row / decode_row for every concrete dtype: per-element round-trip bounds on fresh
// gaussian and outlier-heavy rows, measured relative RMS errors, zero / constant / extreme
// rows, byte layout, and rejection of impossible calls.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/core/error.h"
#include "kvq/core/kv_dtype.h"
#include "kvq/quant/codec.h"
#include "quant_test_util.h"
#include "row_codec_util.h"

namespace kvq::quant {
namespace {

using testing::EncodedRow;
using testing::kConcreteDtypes;
using testing::SeededRng;

constexpr int kRows = 48;

std::span<const float> row_of(const std::vector<float>& rows, int r, int n) {
  return std::span<const float>(rows).subspan(static_cast<size_t>(r) * n, static_cast<size_t>(n));
}

// Encodes each row, decodes it, and checks every element against its format bound (in
// decode_row's space) and, for rotated dtypes, the unrotated round trip in norm.
void check_rows_within_bounds(KvDtype d, const std::vector<float>& rows, int n, float t,
                              const std::string& what) {
  int failures = 0;
  for (int r = 0; r < static_cast<int>(rows.size()) / n && failures < 5; ++r) {
    const auto x = row_of(rows, r, n);
    const EncodedRow e = testing::encode(d, x, t);
    const std::vector<float> got = testing::decode(d, e, t, x.size(), false);
    const testing::RowBounds rb = testing::row_bounds(d, x, t, e);
    double err2 = 0;
    double bound2 = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double err = std::fabs(got[i] - rb.reference[i]);
      err2 += err * err;
      bound2 += rb.bound[i] * rb.bound[i];
      if (!(err <= rb.bound[i])) {
        ++failures;
        ADD_FAILURE() << to_string(d) << " head_dim=" << n << " " << what << " row " << r
                      << " element " << i << ": value " << rb.reference[i] << " decoded " << got[i]
                      << " error " << err << " > bound " << rb.bound[i];
        break;
      }
    }
    if (traits(d).rotated) {
      const std::vector<float> back = testing::decode(d, e, t, x.size(), true);
      double back_err2 = 0;
      double x2 = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        back_err2 += (back[i] - double{x[i]}) * (back[i] - double{x[i]});
        x2 += double{x[i]} * x[i];
      }
      // The rotation is orthonormal: the error norm carries over (up to fp32 rounding).
      EXPECT_NEAR(std::sqrt(back_err2), std::sqrt(err2), 1e-5 * std::sqrt(x2) + 1e-6)
          << to_string(d) << " " << what << " row " << r;
      EXPECT_LE(std::sqrt(back_err2), std::sqrt(bound2) * (1 + 1e-5) + 1e-6 * std::sqrt(x2));
    }
  }
}

TEST(RowCodecRoundTrip, EveryElementWithinItsFormatBoundOnGaussianAndOutlierRows) {
  SeededRng rng;
  SCOPED_TRACE(rng.seed_note());
  std::uniform_real_distribution<float> miscalibration(0.5f, 2.0f);
  for (KvDtype d : kConcreteDtypes) {
    for (int n : {64, 128, 256}) {
      for (int kind = 0; kind < 2; ++kind) {
        const std::vector<float> rows = kind == 0 ? testing::gaussian_rows(rng.gen, kRows, n)
                                                  : testing::outlier_rows(rng.gen, kRows, n);
        // A tensor scale off from calibration by up to 2x either way, so saturation is
        // exercised too (ignored by dtypes without a tensor scale).
        const float t = testing::calibrated_tensor_scale(d, rows) * miscalibration(rng.gen);
        check_rows_within_bounds(d, rows, n, t, kind == 0 ? "gaussian" : "outliers");
      }
    }
  }
}

// Ceilings for the measured relative RMS error: a relative-rounding format cannot exceed
// its unit roundoff; the scaled integer / fp4 formats get a generous multiple of their step
// relative to the data (int8 on outlier rows: the outliers set the row scale, ~0.02).
double rel_rms_ceiling(KvDtype d) {
  switch (d) {
    case KvDtype::kFloat32:
      return 0;
    case KvDtype::kFloat16:
      return 0x1p-11;
    case KvDtype::kBFloat16:
      return 0x1p-8;
    case KvDtype::kFp8E4M3:
    case KvDtype::kFp8PerTokenHead:
      return 0x1p-4;
    case KvDtype::kFp8E5M2:
      return 0x1p-3;
    case KvDtype::kInt8PerTokenHead:
      return 0.05;
    case KvDtype::kInt4PerTokenHead:
      return 0.2;
    case KvDtype::kNvfp4:
      return 0.2;
    case KvDtype::kAuto:
      break;
  }
  return 0;
}

// Relative RMS error sqrt(sum err^2 / sum x^2) of the full round trip (original space) at
// head_dim 128 with calibrated tensor scales: printed for the docs and checked against a
// ceiling from each format's precision.
TEST(RowCodecRoundTrip, RelativeRmsErrorAtHeadDim128) {
  SeededRng rng;
  SCOPED_TRACE(rng.seed_note());
  constexpr int n = 128;
  constexpr int rows = 512;
  const std::vector<float> gauss = testing::gaussian_rows(rng.gen, rows, n);
  const std::vector<float> outl = testing::outlier_rows(rng.gen, rows, n);
  std::ostringstream table;
  table << std::setprecision(3) << std::scientific;
  for (KvDtype d : kConcreteDtypes) {
    double rel[2];
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<float>& data = kind == 0 ? gauss : outl;
      const float t = testing::calibrated_tensor_scale(d, data);
      double e2 = 0;
      double x2 = 0;
      for (int r = 0; r < rows; ++r) {
        const auto x = row_of(data, r, n);
        const std::vector<float> y = testing::decode(d, testing::encode(d, x, t), t, n, true);
        for (int i = 0; i < n; ++i) {
          const double err = double{y[static_cast<size_t>(i)]} - x[static_cast<size_t>(i)];
          e2 += err * err;
          x2 += double{x[static_cast<size_t>(i)]} * x[static_cast<size_t>(i)];
        }
      }
      rel[kind] = std::sqrt(e2 / x2);
    }
    table << "  " << std::left << std::setw(20) << to_string(d) << " gaussian " << rel[0]
          << "  outliers " << rel[1] << "\n";
    ::testing::Test::RecordProperty(std::string(to_string(d)) + "_rel_rms_gaussian",
                                    std::to_string(rel[0]));
    ::testing::Test::RecordProperty(std::string(to_string(d)) + "_rel_rms_outliers",
                                    std::to_string(rel[1]));
    const double ceiling = rel_rms_ceiling(d);
    EXPECT_LE(rel[0], ceiling) << to_string(d) << " gaussian";
    EXPECT_LE(rel[1], ceiling) << to_string(d) << " outliers";
  }
  std::cout << "relative RMS round-trip error, head_dim " << n << ", " << rows
            << " rows (outliers: 4 channels x20-50):\n"
            << table.str();
}

TEST(RowCodec, ZeroRowsDecodeToExactZerosWithZeroScales) {
  for (KvDtype d : kConcreteDtypes) {
    for (int n : {64, 128}) {
      for (float z : {0.0f, -0.0f}) {
        const std::vector<float> x(static_cast<size_t>(n), z);
        const EncodedRow e = testing::encode(d, x, 1.0f);
        for (bool unrot : {false, true}) {
          const std::vector<float> y = testing::decode(d, e, 1.0f, x.size(), unrot);
          for (float v : y) ASSERT_EQ(v, 0.0f) << to_string(d) << " n=" << n;
        }
        if (d == KvDtype::kInt8PerTokenHead || d == KvDtype::kFp8PerTokenHead) {
          EXPECT_EQ(testing::meta_f32(e), 0.0f) << to_string(d);
        }
        if (d == KvDtype::kInt4PerTokenHead) {
          EXPECT_EQ(testing::meta_f16(e, 0), 0.0f);
          EXPECT_EQ(testing::meta_f16(e, 2), 0.0f);
        }
        if (d == KvDtype::kNvfp4) {
          for (size_t b = 0; b < static_cast<size_t>(n) / 16; ++b)
            EXPECT_EQ(e.data[static_cast<size_t>(n) / 2 + b], std::byte{0}) << "block scale";
        }
      }
    }
  }
}

TEST(RowCodec, ConstantRowsRoundTripWithinBounds) {
  SeededRng rng;
  SCOPED_TRACE(rng.seed_note());
  std::uniform_real_distribution<float> mant(-2.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-12, 12);
  for (KvDtype d : kConcreteDtypes) {
    for (int n : {64, 128}) {
      for (int trial = 0; trial < 8; ++trial) {
        const float c = std::ldexp(mant(rng.gen), expo(rng.gen));
        const std::vector<float> x(static_cast<size_t>(n), c);
        const float t = testing::calibrated_tensor_scale(d, x);
        check_rows_within_bounds(d, x, n, t, "constant " + std::to_string(c));
      }
    }
  }
}

// int4's range is taken after the rotation. A one-hot row rotates to an exactly constant row
// (every output is +-x0 plus zeros, times 1/sqrt(n)): max == min, so the scale is 0, every
// code is 0 and the row decodes to its fp16 zero point, with no division by zero.
TEST(RowCodec, Int4RowThatIsConstantAfterRotationDecodesToItsZeroPoint) {
  SeededRng rng;
  std::uniform_real_distribution<float> mag(-100.0f, 100.0f);
  for (int n : {2, 64, 128, 256}) {
    std::vector<float> x(static_cast<size_t>(n), 0.0f);
    x[0] = mag(rng.gen);
    std::vector<float> r = x;
    hadamard_rotate(r);
    for (float v : r) ASSERT_EQ(v, r[0]) << "rotated one-hot row is constant";
    const EncodedRow e = testing::encode(KvDtype::kInt4PerTokenHead, x, 1.0f);
    EXPECT_EQ(testing::meta_f16(e, 0), 0.0f) << "scale";
    const float z = testing::meta_f16(e, 2);
    EXPECT_EQ(z, fp16_bits_to_float(float_to_fp16_bits(r[0])));
    const std::vector<float> y =
        testing::decode(KvDtype::kInt4PerTokenHead, e, 1.0f, x.size(), false);
    for (float v : y) EXPECT_EQ(v, z) << rng.seed_note();
    const std::vector<float> back =
        testing::decode(KvDtype::kInt4PerTokenHead, e, 1.0f, x.size(), true);
    for (size_t i = 0; i < x.size(); ++i)
      EXPECT_NEAR(back[i], x[i], 0x1p-10 * std::fabs(x[0]) + 1e-6) << rng.seed_note();
  }
}

// Finite inputs never decode to NaN or inf, whatever their range: huge, tiny (float32
// subnormals, whose per-row scale underflows to 0), mixed, and a tensor scale far too small.
TEST(RowCodec, FiniteInputsNeverDecodeToNaNOrInf) {
  SeededRng rng;
  SCOPED_TRACE(rng.seed_note());
  constexpr int n = 64;
  const float fmax = std::numeric_limits<float>::max();
  const float dmin = std::numeric_limits<float>::denorm_min();
  std::vector<std::vector<float>> rows;
  rows.push_back(std::vector<float>(n, fmax));
  rows.push_back(std::vector<float>(n, -fmax));
  rows.push_back(std::vector<float>(n, dmin));
  rows.push_back(std::vector<float>(n, 3 * dmin));
  std::vector<float> mixed = testing::gaussian_rows(rng.gen, 1, n);
  mixed[1] = fmax;
  mixed[2] = -fmax;
  mixed[3] = dmin;
  mixed[4] = 1e30f;
  mixed[5] = -1e-30f;
  rows.push_back(mixed);
  std::vector<float> wide = testing::gaussian_rows(rng.gen, 1, n);
  for (size_t i = 0; i < wide.size(); ++i)
    wide[i] = std::ldexp(wide[i], static_cast<int>(i % 200) - 100);
  rows.push_back(wide);
  for (KvDtype d : kConcreteDtypes) {
    for (const auto& x : rows) {
      for (float t : {1.0f, 1e-30f, 1e30f}) {
        const EncodedRow e = testing::encode(d, x, t);
        for (bool unrot : {false, true}) {
          const std::vector<float> y = testing::decode(d, e, t, x.size(), unrot);
          for (size_t i = 0; i < y.size(); ++i)
            ASSERT_TRUE(std::isfinite(y[i])) << to_string(d) << " t=" << t << " element " << i
                                             << " x=" << x[i] << " -> " << y[i];
        }
      }
    }
  }
}

TEST(RowCodec, NonFiniteInputsEncodeDeterministicallyWithoutTouchingOtherElements) {
  // NaN / inf are skipped when choosing per-row scales, so the finite elements of such a
  // row still round-trip within their usual bound (non-rotated dtypes only: a rotation
  // spreads a NaN over the whole row).
  SeededRng rng;
  SCOPED_TRACE(rng.seed_note());
  constexpr int n = 64;
  std::vector<float> x = testing::gaussian_rows(rng.gen, 1, n);
  std::vector<float> clean = x;
  x[7] = std::numeric_limits<float>::quiet_NaN();
  x[9] = std::numeric_limits<float>::infinity();
  clean[7] = 0.0f;
  clean[9] = 0.0f;
  for (KvDtype d : {KvDtype::kInt8PerTokenHead, KvDtype::kFp8PerTokenHead}) {
    const EncodedRow e = testing::encode(d, x, 1.0f);
    const EncodedRow ec = testing::encode(d, clean, 1.0f);
    EXPECT_EQ(e.meta, ec.meta) << to_string(d) << ": the scale ignores NaN and inf";
    const EncodedRow e2 = testing::encode(d, x, 1.0f);
    EXPECT_EQ(e.data, e2.data) << "deterministic";
    for (size_t i = 0; i < x.size(); ++i)
      if (i != 7 && i != 9) {
        EXPECT_EQ(e.data[i], ec.data[i]) << to_string(d) << " element " << i;
      }
  }
}

// ---- byte layout -----------------------------------------------------------------------

TEST(RowCodecLayout, Int8AndFp8PerTokenHeadStoreCodesInOrderAndAnFp32Scale) {
  constexpr int n = 64;
  std::vector<float> x(n, 0.0f);
  x[5] = 127.0f;  // absmax 127: the int8 scale is exactly 1, so the ties below are exact
  x[6] = -63.5f;
  x[7] = 62.5f;
  const EncodedRow i8 = testing::encode(KvDtype::kInt8PerTokenHead, x, 1.0f);
  EXPECT_EQ(testing::meta_f32(i8), 1.0f);
  EXPECT_EQ(static_cast<int8_t>(i8.data[5]), 127);
  EXPECT_EQ(static_cast<int8_t>(i8.data[6]), -64) << "-63.5 ties to even -64";
  EXPECT_EQ(static_cast<int8_t>(i8.data[7]), 62) << "62.5 ties to even 62";
  EXPECT_EQ(static_cast<int8_t>(i8.data[0]), 0);
  const EncodedRow f8 = testing::encode(KvDtype::kFp8PerTokenHead, x, 1.0f);
  EXPECT_EQ(testing::meta_f32(f8), 127.0f / 448.0f);
  EXPECT_EQ(static_cast<uint8_t>(f8.data[5]), 0x7E) << "absmax maps to e4m3 max";
  EXPECT_EQ(static_cast<uint8_t>(f8.data[6]), 0xF6) << "-224 = -1.75 * 2^7";
  EXPECT_EQ(static_cast<uint8_t>(f8.data[0]), 0x00);
}

TEST(RowCodecLayout, Int4PacksEvenElementsInTheLowNibbleAfterScaleThenZero) {
  constexpr int n = 8;
  std::vector<std::byte> data(row_data_bytes(KvDtype::kInt4PerTokenHead, n));
  std::vector<std::byte> meta(4);
  const uint16_t scale = float_to_fp16_bits(0.5f);
  const uint16_t zero = float_to_fp16_bits(-3.0f);
  std::memcpy(meta.data(), &scale, 2);
  std::memcpy(meta.data() + 2, &zero, 2);
  for (size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<std::byte>((2 * i) | ((2 * i + 1) << 4));  // element k has code k
  std::vector<float> out(n);
  decode_row(KvDtype::kInt4PerTokenHead, data.data(), meta.data(), 1.0f, out);
  for (int k = 0; k < n; ++k) EXPECT_EQ(out[static_cast<size_t>(k)], 0.5f * k - 3.0f) << k;
}

TEST(RowCodecLayout, Nvfp4StoresPackedValuesThenOneE4M3ScalePerBlock) {
  constexpr int n = 32;
  ASSERT_EQ(row_data_bytes(KvDtype::kNvfp4, n), 18u);
  std::vector<float> x(n, 0.0f);
  x[0] = 6.0f;   // block 0 absmax 6 with tensor scale 0.5 -> block scale 2
  x[1] = -1.0f;  // -1 / (2 * 0.5) = -1 -> code 0xA
  const EncodedRow e = testing::encode(KvDtype::kNvfp4, x, 0.5f);
  EXPECT_EQ(static_cast<uint8_t>(e.data[0]), 0x7 | (0xA << 4));
  for (int i = 1; i < 16; ++i) EXPECT_EQ(e.data[static_cast<size_t>(i)], std::byte{0}) << i;
  EXPECT_EQ(static_cast<uint8_t>(e.data[16]), fp8_e4m3_encode(2.0f)) << "block 0 scale";
  EXPECT_EQ(e.data[17], std::byte{0}) << "block 1 (all zero) has scale code 0";
  const std::vector<float> y = testing::decode(KvDtype::kNvfp4, e, 0.5f, n, false);
  EXPECT_EQ(y[0], 6.0f);
  EXPECT_EQ(y[1], -1.0f);
}

TEST(RowCodecLayout, SixteenBitStorageIsLittleEndianPerElementAndSaturatesFiniteValues) {
  const std::vector<float> x = {1.0f, -2.0f, 1e6f, -std::numeric_limits<float>::infinity()};
  const EncodedRow h = testing::encode(KvDtype::kFloat16, x, 1.0f);
  const uint16_t want_h[] = {0x3C00, 0xC000, 0x7BFF, 0xFC00};
  const EncodedRow b = testing::encode(KvDtype::kBFloat16, x, 1.0f);
  const uint16_t want_b[] = {0x3F80, 0xC000, float_to_bf16_bits(1e6f), 0xFF80};
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(static_cast<uint16_t>(static_cast<uint8_t>(h.data[2 * i]) |
                                    (static_cast<uint8_t>(h.data[2 * i + 1]) << 8)),
              want_h[i])
        << i;
    EXPECT_EQ(static_cast<uint16_t>(static_cast<uint8_t>(b.data[2 * i]) |
                                    (static_cast<uint8_t>(b.data[2 * i + 1]) << 8)),
              want_b[i])
        << i;
  }
  const std::vector<float> big(2, std::numeric_limits<float>::max());
  const EncodedRow bb = testing::encode(KvDtype::kBFloat16, big, 1.0f);
  EXPECT_EQ(static_cast<uint8_t>(bb.data[1]), 0x7F);
  EXPECT_EQ(static_cast<uint8_t>(bb.data[0]), 0x7F) << "FLT_MAX saturates to the largest bf16";
}

// ---- impossible calls -----------------------------------------------------------------

TEST(RowCodec, RejectsAutoUnstorableHeadDimsMissingScalesAndBadTensorScales) {
  std::vector<float> x(64, 1.0f);
  std::vector<std::byte> data(1024);
  std::vector<std::byte> meta(16);
  std::vector<float> out(64);
  EXPECT_THROW(encode_row(KvDtype::kAuto, x, 1.0f, data.data(), meta.data()), InternalError);
  EXPECT_THROW(decode_row(KvDtype::kAuto, data.data(), meta.data(), 1.0f, out), InternalError);
  EXPECT_THROW(decode_row_unrotated(KvDtype::kAuto, data.data(), meta.data(), 1.0f, out),
               InternalError);
  std::vector<float> x40(40, 1.0f);
  EXPECT_THROW(encode_row(KvDtype::kNvfp4, x40, 1.0f, data.data(), nullptr), InternalError);
  std::vector<float> x96(96, 1.0f);
  EXPECT_THROW(encode_row(KvDtype::kInt4PerTokenHead, x96, 1.0f, data.data(), meta.data()),
               InternalError);
  EXPECT_THROW(encode_row(KvDtype::kInt8PerTokenHead, x, 1.0f, data.data(), nullptr),
               InternalError);
  EXPECT_THROW(encode_row(KvDtype::kFp8E4M3, x, 0.0f, data.data(), nullptr), InternalError);
  EXPECT_THROW(encode_row(KvDtype::kNvfp4, x, std::nanf(""), data.data(), nullptr), InternalError);
  EXPECT_NO_THROW(encode_row(KvDtype::kInt8PerTokenHead, x, 0.0f, data.data(), meta.data()))
      << "the tensor scale is ignored by dtypes that do not use one";
}

}  // namespace
}  // namespace kvq::quant
