// write_kv_cuda against write_kv_reference: every byte of the device storage (written rows,
// metadata, and untouched 0xFF poison) must equal the reference cache's, for every dtype,
// head_dim and block size, on random rows, outlier rows and rows of special values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_attention_harness.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"

namespace kvq {
namespace {

using test::concrete_dtypes;
using test::DeviceBuffer;
using test::first_mismatch;

// K and V of different dtypes (so the two launches are told apart), per-tensor scales per
// head; head 0's scale is a power of two so that rounding ties of x survive x / scale.
LayerKvSpec write_spec(KvDtype k, KvDtype v, int head_dim, int block_tokens) {
  LayerKvSpec s;
  s.layer = 5;
  s.k_dtype = k;
  s.v_dtype = v;
  s.num_kv_heads = 3;
  s.num_q_heads = 6;
  s.head_dim_k = s.head_dim_v = head_dim;
  s.block_tokens = block_tokens;
  for (KvSide side : {KvSide::kK, KvSide::kV}) {
    ScaleSource& sc = side == KvSide::kK ? s.k_scale : s.v_scale;
    const auto& t = traits(s.dtype(side));
    if (t.uses_tensor_scale) {
      sc.kind = ScaleSourceKind::kCheckpoint;
      const float base = s.dtype(side) == KvDtype::kNvfp4 ? 0.004f : 0.02f;
      sc.values = {0.5f, base * 1.7f, base * 3.1f};
    } else if (t.scale_kind == ScaleKind::kPerTokenHead) {
      sc.kind = ScaleSourceKind::kDynamic;
    }
  }
  return s;
}

// Kinds of rows: most random, some with outliers, some special; rounding ties for several
// target formats (bf16, fp16, e4m3, e5m2, e2m1).
std::vector<float> make_row(std::mt19937& rng, int dim, int kind) {
  const test::RowOptions opt{.outliers = 3, .tie_mantissa_bits = {7, 10, 3, 2, 1}};
  return test::make_row(rng, dim, static_cast<test::RowKind>(kind), opt);
}

TEST(CudaCacheWrite, BitIdenticalToReferenceForEveryDtype) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const std::vector<KvDtype> dtypes = concrete_dtypes();
  int index = 0;
  for (KvDtype kd : dtypes) {
    for (int hd : {64, 128, 256}) {
      for (int bt : {16, 32}) {
        // Block 16: V takes the next dtype of the list, so every dtype is also written as V
        // (one launch per side); block 32: V is K's dtype (one launch writes both sides).
        const KvDtype vd = bt == 16 ? dtypes[static_cast<size_t>(index++ + 1) % dtypes.size()] : kd;
        const LayerKvSpec spec = write_spec(kd, vd, hd, bt);
        const int32_t num_blocks = 6;
        const int n = 2 * bt + 7;  // a partial block, tokens spread over random blocks
        std::vector<int64_t> slots(static_cast<size_t>(num_blocks) * bt);
        std::iota(slots.begin(), slots.end(), 0);
        std::shuffle(slots.begin(), slots.end(), rng);
        slots.resize(static_cast<size_t>(n));
        const size_t row_elems = static_cast<size_t>(spec.num_kv_heads) * hd;
        std::vector<float> k(n * row_elems), v(n * row_elems);
        for (int t = 0; t < n; ++t)
          for (int h = 0; h < spec.num_kv_heads; ++h) {
            const int kind = (t * spec.num_kv_heads + h) % 10;
            const auto rk = make_row(rng, hd, kind), rv = make_row(rng, hd, (kind + 3) % 10);
            std::copy(rk.begin(), rk.end(),
                      k.begin() + static_cast<ptrdiff_t>((t * spec.num_kv_heads + h) * hd));
            std::copy(rv.begin(), rv.end(),
                      v.begin() + static_cast<ptrdiff_t>((t * spec.num_kv_heads + h) * hd));
          }

        // Reference: a host cache of the same layout, poisoned like the device one.
        const test::LayerBytes want =
            test::reference_write(spec, num_blocks, slots, k.data(), v.data());
        test::LayerBytes got;
        ASSERT_NO_FATAL_FAILURE(test::cuda_write(spec, num_blocks, slots, k, v, &got));
        for (KvSide side : {KvSide::kK, KvSide::kV}) {
          const std::string bad =
              first_mismatch(got.side(side), want.side(side), spec.layout(side));
          EXPECT_TRUE(bad.empty())
              << to_string(side) << " " << to_string(spec.dtype(side)) << ", head_dim " << hd
              << ", block " << bt << ": " << bad << ", seed " << seed;
        }
      }
    }
  }
}

TEST(CudaCacheWrite, SkipsPaddingAndOutOfRangeSlots) {
  KVQ_REQUIRE_GPU();
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  const LayerKvSpec spec = write_spec(KvDtype::kFp8E4M3, KvDtype::kInt4PerTokenHead, 128, 16);
  const int32_t num_blocks = 2;
  const std::vector<int64_t> slots = {3, -1, 17, 32, 1000, 0};
  const std::vector<int64_t> valid = {3, 17, 0};
  const size_t row_elems = static_cast<size_t>(spec.num_kv_heads) * 128;
  std::vector<float> k(slots.size() * row_elems), v(slots.size() * row_elems);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  std::vector<float> k_valid, v_valid;
  for (size_t t = 0; t < slots.size(); ++t)
    if (slots[t] >= 0 && slots[t] < num_blocks * 16) {
      k_valid.insert(k_valid.end(), k.begin() + static_cast<ptrdiff_t>(t * row_elems),
                     k.begin() + static_cast<ptrdiff_t>((t + 1) * row_elems));
      v_valid.insert(v_valid.end(), v.begin() + static_cast<ptrdiff_t>(t * row_elems),
                     v.begin() + static_cast<ptrdiff_t>((t + 1) * row_elems));
    }
  const test::LayerBytes want =
      test::reference_write(spec, num_blocks, valid, k_valid.data(), v_valid.data());
  test::LayerBytes got;
  ASSERT_NO_FATAL_FAILURE(test::cuda_write(spec, num_blocks, slots, k, v, &got));
  for (KvSide side : {KvSide::kK, KvSide::kV})
    EXPECT_EQ(first_mismatch(got.side(side), want.side(side), spec.layout(side)), "")
        << "seed " << seed;
}

// The optional error report: the lowest token with an out-of-range slot is named (negative
// slots are padding, not errors), and a clean call reports nothing.
TEST(CudaCacheWrite, ReportsOutOfRangeSlotsOnRequest) {
  KVQ_REQUIRE_GPU();
  const LayerKvSpec spec = write_spec(KvDtype::kInt8PerTokenHead, KvDtype::kNvfp4, 64, 16);
  const int32_t num_blocks = 3;
  std::mt19937 rng(test::fresh_seed());
  const int64_t bad_token = std::uniform_int_distribution<int64_t>(1, 6)(rng);
  std::vector<int64_t> slots = {5, -1, 40, 7, 0, 47, 12, 9};
  slots[static_cast<size_t>(bad_token)] = 48 + bad_token;  // past 3 blocks of 16
  slots.back() = 1000;                                     // a second bad one, later
  const size_t row_elems = static_cast<size_t>(spec.num_kv_heads) * 64;
  std::vector<float> k(slots.size() * row_elems, 0.5f), v(k.size(), -0.25f);
  DeviceKvCache cache({spec}, num_blocks);
  DeviceBuffer<int64_t> d_slots(slots);
  DeviceBuffer<float> d_k(k), d_v(v);
  DeviceBuffer<uint64_t> flag(1);
  write_kv_cuda(spec, cache.layer_view(0), d_slots.get(), static_cast<int64_t>(slots.size()),
                d_k.get(), d_v.get(), nullptr, flag.get());
  try {
    check_write_kv_cuda(cache.layer_view(0), d_slots.get(), flag.get());
    ADD_FAILURE() << "no error reported for token " << bad_token;
  } catch (const InternalError& e) {
    const std::string want = "slot " + std::to_string(48 + bad_token) + " of token " +
                             std::to_string(bad_token) + " out of range (48 slots)";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
  slots[static_cast<size_t>(bad_token)] = 1;
  slots.back() = -5;
  d_slots.upload(slots);
  write_kv_cuda(spec, cache.layer_view(0), d_slots.get(), static_cast<int64_t>(slots.size()),
                d_k.get(), d_v.get(), nullptr, flag.get());
  EXPECT_NO_THROW(check_write_kv_cuda(cache.layer_view(0), d_slots.get(), flag.get()));
}

TEST(CudaCacheWrite, DeviceCacheMatchesTheCpuLayout) {
  KVQ_REQUIRE_GPU();
  std::vector<LayerKvSpec> specs = {
      write_spec(KvDtype::kNvfp4, KvDtype::kBFloat16, 64, 32),
      write_spec(KvDtype::kInt8PerTokenHead, KvDtype::kFloat32, 256, 32)};
  specs[1].layer = 6;
  DeviceKvCache dev(specs, 5);
  PagedKvCache cpu(specs, 5);
  EXPECT_EQ(dev.bytes_allocated(), cpu.bytes_allocated());
  for (size_t l = 0; l < specs.size(); ++l) {
    const LayerCacheView a = dev.layer_view(l), b = cpu.layer_view(l);
    for (KvSide s : {KvSide::kK, KvSide::kV}) {
      EXPECT_EQ(dev.storage_bytes(l, s), cpu.storage_bytes(l, s));
      EXPECT_EQ(a.layout(s).block_bytes, b.layout(s).block_bytes);
      EXPECT_EQ(a.layout(s).head_stride, b.layout(s).head_stride);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(a.base(s)) % 256, 0u);
      // Poisoned like the CPU cache.
      std::vector<std::byte> bytes(dev.storage_bytes(l, s));
      ASSERT_EQ(cudaMemcpy(bytes.data(), a.base(s), bytes.size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(),
                              [](std::byte x) { return x == std::byte{0xFF}; }));
    }
    EXPECT_EQ(a.num_blocks, 5);
  }
  LayerKvSpec other = specs[0];
  other.block_tokens = 16;
  EXPECT_THROW(DeviceKvCache({specs[0], other}, 2), InternalError);
}

}  // namespace
}  // namespace kvq
