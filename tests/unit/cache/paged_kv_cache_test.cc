#include "kvq/cache/paged_kv_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "cache_test_util.h"
#include "kvq/core/error.h"

namespace kvq {
namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

struct ModelSeq {
  int32_t len = 0;
  std::vector<int64_t> slots;  // every slot handed out to it, in token order
};

// Every invariant the cache promises, checked against the model.
void check_invariants(const PagedKvCache& cache, const std::map<SequenceId, ModelSeq>& model) {
  const int32_t bt = cache.block_tokens();
  std::set<int32_t> owned;
  std::set<int64_t> live_slots;
  for (const auto& [id, m] : model) {
    ASSERT_TRUE(cache.has_sequence(id));
    ASSERT_EQ(cache.seq_len(id), m.len) << "sequence " << id;
    const auto blocks = cache.blocks(id);
    ASSERT_EQ(static_cast<int64_t>(blocks.size()), ceil_div(m.len, bt)) << "sequence " << id;
    for (int32_t b : blocks) {
      ASSERT_TRUE(owned.insert(b).second) << "block " << b << " owned twice";
      ASSERT_EQ(cache.allocator().refcount(b), 1) << "block " << b;
    }
    ASSERT_EQ(static_cast<int32_t>(m.slots.size()), m.len);
    for (int32_t pos = 0; pos < m.len; ++pos) {
      const int64_t slot = m.slots[static_cast<size_t>(pos)];
      // Slots map back to the sequence's own blocks, in order.
      ASSERT_EQ(slot / bt, blocks[static_cast<size_t>(pos / bt)]) << "sequence " << id;
      ASSERT_EQ(slot % bt, pos % bt) << "sequence " << id;
      ASSERT_TRUE(live_slots.insert(slot).second) << "slot " << slot << " handed out twice";
    }
  }
  ASSERT_EQ(static_cast<int32_t>(owned.size()) + cache.allocator().num_free(),
            cache.allocator().num_blocks());
}

TEST(PagedKvCache, RandomAddAppendFreeKeepsInvariants) {
  const unsigned seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937 rng(seed);
  const int bt = std::array{1, 3, 4, 16}[std::uniform_int_distribution<int>(0, 3)(rng)];
  const int32_t num_blocks = std::uniform_int_distribution<int32_t>(4, 24)(rng);
  SCOPED_TRACE("block_tokens " + std::to_string(bt) + ", blocks " + std::to_string(num_blocks));
  PagedKvCache cache({test::make_spec(0, KvDtype::kBFloat16, KvDtype::kBFloat16, 1, 8, 8, bt)},
                     num_blocks);
  std::map<SequenceId, ModelSeq> model;
  SequenceId next_id = 100;
  int failures = 0, successes = 0;

  for (int op = 0; op < 3000; ++op) {
    SCOPED_TRACE("op " + std::to_string(op));
    const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
    if (kind == 0 || model.empty()) {
      cache.add_sequence(next_id);
      model[next_id];
      ++next_id;
    } else {
      auto it = model.begin();
      std::advance(it, std::uniform_int_distribution<size_t>(0, model.size() - 1)(rng));
      const SequenceId id = it->first;
      ModelSeq& m = it->second;
      if (kind <= 7) {
        const int32_t n = std::uniform_int_distribution<int32_t>(0, 2 * bt + 3)(rng);
        const int64_t extra = ceil_div(m.len + n, bt) - ceil_div(m.len, bt);
        const int32_t free_before = cache.allocator().num_free();
        const std::vector<int32_t> blocks_before(cache.blocks(id).begin(), cache.blocks(id).end());
        const auto slots = cache.append(id, n);
        if (extra > free_before) {
          ++failures;
          ASSERT_TRUE(slots.empty());
          // All or nothing: a failed append changes nothing.
          ASSERT_EQ(cache.allocator().num_free(), free_before);
          ASSERT_EQ(cache.seq_len(id), m.len);
          ASSERT_TRUE(std::ranges::equal(cache.blocks(id), blocks_before));
        } else {
          ++successes;
          ASSERT_EQ(static_cast<int32_t>(slots.size()), n);
          ASSERT_EQ(cache.allocator().num_free(), free_before - extra);
          // Blocks already held stay in place; new ones are appended.
          ASSERT_TRUE(
              std::equal(blocks_before.begin(), blocks_before.end(), cache.blocks(id).begin()));
          m.slots.insert(m.slots.end(), slots.begin(), slots.end());
          m.len += n;
        }
      } else {
        cache.free_sequence(id);
        ASSERT_FALSE(cache.has_sequence(id));
        model.erase(it);
      }
    }
    check_invariants(cache, model);
    if (HasFatalFailure()) return;
  }
  // Both outcomes of append were exercised (the pool is small on purpose).
  EXPECT_GT(failures, 0);
  EXPECT_GT(successes, 0);
  for (const auto& [id, m] : model) cache.free_sequence(id);
  EXPECT_EQ(cache.allocator().num_free(), num_blocks);
}

TEST(PagedKvCache, BlockTableIsCsrInTheGivenOrder) {
  const unsigned seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937 rng(seed);
  const int bt = 4;
  PagedKvCache cache({test::make_spec(0, KvDtype::kFloat16, KvDtype::kFloat16, 2, 16, 16, bt)}, 64);
  std::vector<SequenceId> ids;
  for (SequenceId id = 0; id < 6; ++id) {
    cache.add_sequence(id * 7);
    ids.push_back(id * 7);
  }
  // Interleaved appends so block ids of a sequence are not contiguous.
  for (int round = 0; round < 5; ++round)
    for (SequenceId id : ids)
      ASSERT_FALSE(cache.append(id, std::uniform_int_distribution<int32_t>(1, 5)(rng)).empty());
  cache.add_sequence(1000);  // empty sequence: zero blocks
  ids.push_back(1000);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.push_back(ids.front());  // a repeated id is exported twice

  PagedKvCache::BlockTableStorage storage;
  const BlockTableView view = cache.block_table(ids, storage);
  ASSERT_EQ(view.num_seqs, static_cast<int32_t>(ids.size()));
  EXPECT_EQ(view.block_tokens, bt);
  EXPECT_EQ(view.indptr[0], 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto blocks = cache.blocks(ids[i]);
    ASSERT_EQ(view.indptr[i + 1] - view.indptr[i], static_cast<int32_t>(blocks.size()));
    for (size_t j = 0; j < blocks.size(); ++j)
      EXPECT_EQ(view.indices[view.indptr[i] + static_cast<int32_t>(j)], blocks[j]);
    EXPECT_EQ(view.seq_lens[i], cache.seq_len(ids[i]));
  }
  // Reusing the storage for a smaller batch replaces, not appends.
  const std::vector<SequenceId> one = {ids[1]};
  const BlockTableView v1 = cache.block_table(one, storage);
  ASSERT_EQ(v1.num_seqs, 1);
  EXPECT_EQ(v1.indptr[0], 0);
  EXPECT_EQ(v1.indptr[1], static_cast<int32_t>(cache.blocks(ids[1]).size()));
  EXPECT_EQ(storage.indices.size(), cache.blocks(ids[1]).size());
}

TEST(PagedKvCache, MisuseThrowsInternalError) {
  const auto spec = test::make_spec(0, KvDtype::kBFloat16, KvDtype::kBFloat16, 1, 8, 8, 4);
  PagedKvCache cache({spec}, 4);
  cache.add_sequence(1);
  EXPECT_THROW(cache.add_sequence(1), InternalError);
  EXPECT_THROW(cache.append(2, 1), InternalError);
  EXPECT_THROW(cache.append(1, -1), InternalError);
  EXPECT_THROW(cache.seq_len(2), InternalError);
  EXPECT_THROW(cache.blocks(2), InternalError);
  EXPECT_THROW(cache.free_sequence(2), InternalError);
  EXPECT_THROW(cache.layer_view(1), InternalError);
  PagedKvCache::BlockTableStorage storage;
  const std::vector<SequenceId> unknown = {1, 2};
  EXPECT_THROW(cache.block_table(unknown, storage), InternalError);

  auto other = spec;
  other.layer = 1;
  other.block_tokens = 8;
  EXPECT_THROW(PagedKvCache({spec, other}, 4), InternalError);
  EXPECT_THROW(PagedKvCache({}, 4), InternalError);
  auto unresolved = spec;
  unresolved.v_dtype = KvDtype::kAuto;
  EXPECT_THROW(PagedKvCache({unresolved}, 4), InternalError);
}

TEST(PagedKvCache, AppendFillsTheLastPartialBlockFirst) {
  PagedKvCache cache({test::make_spec(0, KvDtype::kBFloat16, KvDtype::kBFloat16, 1, 8, 8, 4)}, 8);
  cache.add_sequence(1);
  const auto a = cache.append(1, 3);
  const auto b = cache.append(1, 3);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  const auto blocks = cache.blocks(1);
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(b[0], int64_t{blocks[0]} * 4 + 3);  // the 4th slot of the first block
  EXPECT_EQ(b[1], int64_t{blocks[1]} * 4 + 0);
  EXPECT_EQ(b[2], int64_t{blocks[1]} * 4 + 1);
  // Filling the partial block needs no new block even when none is free.
  cache.add_sequence(2);
  ASSERT_EQ(cache.append(2, 6 * 4).size(), 24u);
  EXPECT_EQ(cache.allocator().num_free(), 0);
  EXPECT_TRUE(cache.append(1, 3).empty());
  EXPECT_EQ(cache.append(1, 2).size(), 2u);
  EXPECT_EQ(cache.seq_len(1), 8);
}

// Layers of different dtypes get storage sized by their own block bytes.
TEST(PagedKvCache, PerLayerStorageIsNotPaddedToTheLargest) {
  const int heads = 2, dim = 128, bt = 16;
  std::vector<LayerKvSpec> specs = {
      test::make_spec(0, KvDtype::kBFloat16, KvDtype::kBFloat16, heads, dim, dim, bt),
      test::make_spec(1, KvDtype::kFp8E4M3, KvDtype::kFp8E4M3, heads, dim, dim, bt),
      test::make_spec(2, KvDtype::kInt4PerTokenHead, KvDtype::kNvfp4, heads, dim, dim, bt),
  };
  // Block bytes worked out by hand from the formats (per side: heads * aligned rows):
  //   bf16: 16 rows * 256 B = 4096 per head; fp8: 16 * 128 = 2048 per head;
  //   int4: 16 * 64 values + 16 * 4 scale bytes = 1088 per head; nvfp4: 16 * (8 groups * 9) = 1152.
  const size_t hand_k[] = {2 * 4096, 2 * 2048, 2 * 1088};
  const size_t hand_v[] = {2 * 4096, 2 * 2048, 2 * 1152};
  const int32_t num_blocks = 7;
  PagedKvCache cache(specs, num_blocks);
  size_t sum = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE("layer " + std::to_string(i));
    ASSERT_EQ(specs[i].layout(KvSide::kK).block_bytes, hand_k[i]);
    ASSERT_EQ(specs[i].layout(KvSide::kV).block_bytes, hand_v[i]);
    EXPECT_EQ(cache.storage_bytes(i, KvSide::kK), num_blocks * hand_k[i]);
    EXPECT_EQ(cache.storage_bytes(i, KvSide::kV), num_blocks * hand_v[i]);
    const LayerCacheView view = cache.layer_view(i);
    EXPECT_EQ(view.num_blocks, num_blocks);
    EXPECT_EQ(view.k_layout.block_bytes, hand_k[i]);
    EXPECT_EQ(view.v_layout.block_bytes, hand_v[i]);
    for (KvSide s : {KvSide::kK, KvSide::kV}) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(view.base(s)) % 64, 0u);
      // The whole extent is readable and poisoned (ASan flags a short allocation here).
      const size_t bytes = cache.storage_bytes(i, s);
      EXPECT_TRUE(std::all_of(view.base(s), view.base(s) + bytes,
                              [](std::byte b) { return b == std::byte{0xFF}; }));
    }
    sum += cache.storage_bytes(i, KvSide::kK) + cache.storage_bytes(i, KvSide::kV);
  }
  EXPECT_NE(cache.storage_bytes(0, KvSide::kK), cache.storage_bytes(1, KvSide::kK));
  EXPECT_NE(cache.storage_bytes(1, KvSide::kK), cache.storage_bytes(2, KvSide::kK));
  EXPECT_NE(cache.storage_bytes(2, KvSide::kK), cache.storage_bytes(2, KvSide::kV));
  EXPECT_EQ(cache.bytes_allocated(), sum);
  EXPECT_LT(cache.bytes_allocated(), specs.size() * num_blocks * specs[0].block_bytes());
}

// A cache over storage it does not own (a CUDA model's device memory): bookkeeping works the
// same, layer_view returns exactly the given views, and a view that does not match is refused.
TEST(PagedKvCache, ExternalStorageReturnsTheGivenViews) {
  const int32_t blocks = 12;
  std::vector<LayerKvSpec> specs = {
      test::make_spec(0, KvDtype::kBFloat16, KvDtype::kBFloat16, 2, 64, 64, 16),
      test::make_spec(1, KvDtype::kFp8E4M3, KvDtype::kInt4PerTokenHead, 2, 64, 64, 16)};
  auto owner = std::make_shared<std::vector<std::vector<std::byte>>>();
  std::vector<LayerCacheView> views;
  for (const auto& s : specs) {
    LayerCacheView v;
    v.k_layout = s.layout(KvSide::kK);
    v.v_layout = s.layout(KvSide::kV);
    v.num_blocks = blocks;
    owner->emplace_back(v.k_layout.block_bytes * blocks);
    v.k_base = owner->back().data();
    owner->emplace_back(v.v_layout.block_bytes * blocks);
    v.v_base = owner->back().data();
    views.push_back(v);
  }
  PagedKvCache cache = PagedKvCache::with_external_storage(specs, blocks, views, owner);
  EXPECT_TRUE(cache.external_storage());
  EXPECT_EQ(cache.allocator().num_blocks(), blocks);
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(cache.layer_view(i).k_base, views[i].k_base);
    EXPECT_EQ(cache.layer_view(i).v_base, views[i].v_base);
    EXPECT_EQ(cache.storage_bytes(i, KvSide::kK), views[i].k_layout.block_bytes * blocks);
  }
  cache.add_sequence(7);
  const auto slots = cache.append(7, 40);
  ASSERT_EQ(slots.size(), 40u);
  EXPECT_EQ(cache.blocks(7).size(), 3u);
  EXPECT_TRUE(cache.append(7, 16 * 10).empty());  // only 9 blocks left

  views[1].num_blocks = blocks + 1;
  EXPECT_THROW(PagedKvCache::with_external_storage(specs, blocks, views, owner), InternalError);
  views[1].num_blocks = blocks;
  EXPECT_THROW(PagedKvCache::with_external_storage(specs, blocks, views, nullptr), InternalError);
}

}  // namespace
}  // namespace kvq
