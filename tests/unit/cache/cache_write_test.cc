#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cache_test_util.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/quant/codec.h"

namespace kvq {
namespace {

constexpr std::byte kTestPoison{0xA5};

std::vector<KvDtype> concrete_dtypes() {
  std::vector<KvDtype> out;
  for (const auto& t : kKvDtypeTraits)
    if (t.concrete) out.push_back(t.dtype);
  return out;
}

// One layer per concrete dtype as K, with the next dtype as V (every dtype on both sides),
// and different head dims for K and V so a swapped side cannot go unnoticed.
std::vector<LayerKvSpec> all_dtype_layers(int heads, int dim_k, int dim_v, int bt) {
  const auto dtypes = concrete_dtypes();
  std::vector<LayerKvSpec> specs;
  for (size_t i = 0; i < dtypes.size(); ++i)
    specs.push_back(test::make_spec(static_cast<int>(i), dtypes[i], dtypes[(i + 1) % dtypes.size()],
                                    heads, dim_k, dim_v, bt));
  return specs;
}

struct WrittenRow {
  size_t layer;
  KvSide side;
  int64_t slot;
  int head;
  std::vector<float> expect;  // encode + decode_row_unrotated done directly
};

// Random K/V for ragged appends across block boundaries, written into every layer with
// write_kv_reference. The storage must equal an image built by encoding each row directly
// into a copy of the poisoned storage: written bytes bit-identical, all others untouched.
TEST(WriteKvReference, MatchesDirectEncodingAndTouchesOnlyItsSlots) {
  const unsigned seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937 rng(seed);
  const int heads = 3, dim_k = 64, dim_v = 32, bt = 5;
  const int32_t num_blocks = 16;
  const auto specs = all_dtype_layers(heads, dim_k, dim_v, bt);
  for (const auto& s : specs)
    ASSERT_TRUE(s.validation_errors().empty()) << s.validation_errors()[0];
  PagedKvCache cache(specs, num_blocks);

  // Poison every layer ourselves; image[layer][side] is what the storage must hold afterwards.
  std::vector<std::array<std::vector<std::byte>, 2>> image(specs.size());
  for (size_t l = 0; l < specs.size(); ++l)
    for (KvSide s : {KvSide::kK, KvSide::kV}) {
      const size_t bytes = cache.storage_bytes(l, s);
      std::memset(cache.layer_view(l).base(s), static_cast<int>(kTestPoison), bytes);
      image[l][static_cast<size_t>(s)].assign(bytes, kTestPoison);
    }

  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_mag(-3.0f, 3.0f);
  std::uniform_int_distribution<int> pct(0, 99);
  auto random_rows = [&](size_t count, int dim) {
    std::vector<float> x(count * static_cast<size_t>(dim));
    for (size_t r = 0; r < count; ++r) {
      const float mag = std::exp(log_mag(rng));  // rows of very different magnitudes
      for (int i = 0; i < dim; ++i) {
        float v = normal(rng) * mag;
        if (pct(rng) == 0) v *= 40.0f;  // outliers
        x[r * static_cast<size_t>(dim) + static_cast<size_t>(i)] = v;
      }
    }
    return x;
  };

  std::vector<WrittenRow> written;
  const SequenceId seqs[] = {1, 2, 3};
  for (SequenceId id : seqs) cache.add_sequence(id);
  int64_t total = 0;
  for (int round = 0; round < 6; ++round) {
    for (SequenceId id : seqs) {
      const int32_t n = std::uniform_int_distribution<int32_t>(1, 2 * bt + 1)(rng);
      if (total + n > int64_t{num_blocks} * bt * 3 / 4) continue;  // leave slots unwritten
      const auto slots = cache.append(id, n);
      ASSERT_EQ(slots.size(), static_cast<size_t>(n));
      total += n;
      for (size_t l = 0; l < specs.size(); ++l) {
        const LayerKvSpec& spec = specs[l];
        const auto k = random_rows(static_cast<size_t>(n) * heads, dim_k);
        const auto v = random_rows(static_cast<size_t>(n) * heads, dim_v);
        const LayerCacheView view = cache.layer_view(l);
        write_kv_reference(spec, view, slots, k.data(), v.data());
        for (KvSide s : {KvSide::kK, KvSide::kV}) {
          const KvSideLayout& lay = view.layout(s);
          const float* src = s == KvSide::kK ? k.data() : v.data();
          for (size_t t = 0; t < slots.size(); ++t)
            for (int h = 0; h < heads; ++h) {
              std::vector<std::byte> data(lay.row_data_bytes, kTestPoison);
              std::vector<std::byte> meta(lay.row_scale_bytes, kTestPoison);
              const float* row = src + (t * heads + static_cast<size_t>(h)) * lay.head_dim;
              const float scale = spec.scale(s).for_head(h);
              quant::encode_row(lay.dtype,
                                std::span<const float>(row, static_cast<size_t>(lay.head_dim)),
                                scale, data.data(), meta.empty() ? nullptr : meta.data());
              const int64_t block = slots[t] / bt;
              const int off = static_cast<int>(slots[t] % bt);
              auto& img = image[l][static_cast<size_t>(s)];
              const size_t base = static_cast<size_t>(block) * lay.block_bytes;
              std::memcpy(img.data() + base + lay.value_offset(h, off), data.data(), data.size());
              if (!meta.empty())
                std::memcpy(img.data() + base + lay.scale_offset(h, off), meta.data(), meta.size());
              WrittenRow w{l, s, slots[t], h, std::vector<float>(lay.head_dim)};
              quant::decode_row_unrotated(lay.dtype, data.data(),
                                          meta.empty() ? nullptr : meta.data(), scale, w.expect);
              written.push_back(std::move(w));
            }
        }
      }
    }
  }
  ASSERT_GT(total, 2 * bt);

  // Byte image: written rows bit-identical, every other byte (unwritten slots, padding,
  // other heads) still poisoned.
  for (size_t l = 0; l < specs.size(); ++l)
    for (KvSide s : {KvSide::kK, KvSide::kV}) {
      const auto& img = image[l][static_cast<size_t>(s)];
      const std::byte* got = cache.layer_view(l).base(s);
      for (size_t i = 0; i < img.size(); ++i)
        if (got[i] != img[i]) {
          const KvSideLayout lay = specs[l].layout(s);
          ADD_FAILURE() << "layer " << l << " (" << to_string(lay.dtype) << ") side "
                        << to_string(s) << ": byte " << i << " (block " << i / lay.block_bytes
                        << ", offset " << i % lay.block_bytes << ") is "
                        << std::to_integer<int>(got[i]) << ", expected "
                        << std::to_integer<int>(img[i]);
          break;
        }
    }

  // Reading each row back out of the block memory gives the direct round trip, bit for bit.
  for (const WrittenRow& w : written) {
    const LayerCacheView view = cache.layer_view(w.layer);
    const KvSideLayout& lay = view.layout(w.side);
    const int32_t block = static_cast<int32_t>(w.slot / bt);
    const int off = static_cast<int>(w.slot % bt);
    const std::byte* blk = view.block(w.side, block);
    std::vector<float> got(static_cast<size_t>(lay.head_dim));
    quant::decode_row_unrotated(lay.dtype, blk + lay.value_offset(w.head, off),
                                lay.row_scale_bytes ? blk + lay.scale_offset(w.head, off) : nullptr,
                                specs[w.layer].scale(w.side).for_head(w.head), got);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(w.expect[i]))
          << to_string(lay.dtype) << " side " << to_string(w.side) << " slot " << w.slot << " head "
          << w.head << " element " << i << ": " << got[i] << " vs " << w.expect[i];
  }
}

// The cache's own poison (0xFF) makes a never-written row decode to NaN in every dtype.
TEST(WriteKvReference, UnwrittenRowsDecodeToNaN) {
  const auto specs = all_dtype_layers(2, 64, 64, 4);
  PagedKvCache cache(specs, 2);
  for (size_t l = 0; l < specs.size(); ++l) {
    const LayerCacheView view = cache.layer_view(l);
    for (KvSide s : {KvSide::kK, KvSide::kV}) {
      const KvSideLayout& lay = view.layout(s);
      std::vector<float> out(static_cast<size_t>(lay.head_dim));
      const std::byte* blk = view.block(s, 1);
      quant::decode_row_unrotated(lay.dtype, blk + lay.value_offset(1, 3),
                                  lay.row_scale_bytes ? blk + lay.scale_offset(1, 3) : nullptr,
                                  specs[l].scale(s).for_head(1), out);
      for (size_t i = 0; i < out.size(); ++i)
        ASSERT_TRUE(std::isnan(out[i]))
            << to_string(lay.dtype) << " element " << i << " = " << out[i];
    }
  }
}

TEST(WriteKvReference, BadSlotsAndMismatchedViewsThrow) {
  const auto spec = test::make_spec(0, KvDtype::kFp8E4M3, KvDtype::kInt8PerTokenHead, 2, 32, 32, 4);
  PagedKvCache cache({spec}, 3);
  const LayerCacheView view = cache.layer_view(0);
  const std::vector<float> k(2 * 32, 0.5f), v(2 * 32, 0.25f);
  const std::vector<int64_t> past_end = {3 * 4};
  const std::vector<int64_t> negative = {-1};
  EXPECT_THROW(write_kv_reference(spec, view, past_end, k.data(), v.data()), InternalError);
  EXPECT_THROW(write_kv_reference(spec, view, negative, k.data(), v.data()), InternalError);
  auto other = spec;
  other.v_dtype = KvDtype::kFp8E4M3;
  const std::vector<int64_t> ok = {3 * 4 - 1};
  EXPECT_THROW(write_kv_reference(other, view, ok, k.data(), v.data()), InternalError);
  write_kv_reference(spec, view, ok, k.data(), v.data());  // the last slot is in range
}

}  // namespace
}  // namespace kvq
