// Prefix sharing in PagedKvCache: sequences that start from another's full blocks, owners
// outside any sequence, and the guard against writing into a shared block.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "cache_test_util.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"

namespace kvq {
namespace {

PagedKvCache make_cache(int block_tokens, int32_t num_blocks) {
  return PagedKvCache(
      {test::make_spec(0, KvDtype::kBFloat16, KvDtype::kBFloat16, 1, 16, 16, block_tokens)},
      num_blocks);
}

TEST(SharedBlocks, SequenceStartsFromAnotherSequencesFullBlocks) {
  const unsigned seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937 rng(seed);
  const int bt = std::uniform_int_distribution<int>(1, 8)(rng);
  const int32_t num_blocks = 40;
  PagedKvCache cache = make_cache(bt, num_blocks);
  const int32_t len_a = std::uniform_int_distribution<int32_t>(bt, 6 * bt)(rng);
  cache.add_sequence(1);
  ASSERT_EQ(static_cast<int32_t>(cache.append(1, len_a).size()), len_a);
  const std::vector<int32_t> a_blocks(cache.blocks(1).begin(), cache.blocks(1).end());
  const int32_t full = len_a / bt;
  const int32_t shared = std::uniform_int_distribution<int32_t>(1, full)(rng);
  const std::vector<int32_t> prefix(a_blocks.begin(), a_blocks.begin() + shared);

  cache.add_sequence_with_blocks(2, prefix, shared * bt);
  EXPECT_EQ(cache.seq_len(2), shared * bt);
  EXPECT_TRUE(
      std::equal(prefix.begin(), prefix.end(), cache.blocks(2).begin(), cache.blocks(2).end()));
  for (int32_t b : prefix) EXPECT_EQ(cache.allocator().refcount(b), 2) << "block " << b;
  const int32_t used_before = cache.allocator().num_used();

  // B's new tokens go to fresh blocks, never into the shared ones.
  const int32_t extra = std::uniform_int_distribution<int32_t>(1, 3 * bt)(rng);
  const auto slots = cache.append(2, extra);
  ASSERT_EQ(static_cast<int32_t>(slots.size()), extra);
  for (int64_t s : slots)
    EXPECT_EQ(std::count(a_blocks.begin(), a_blocks.end(), static_cast<int32_t>(s / bt)), 0)
        << "slot " << s << " lands in one of A's blocks";
  EXPECT_EQ(cache.allocator().num_used(), used_before + (extra + bt - 1) / bt);

  // The block table shows the shared blocks first, then B's own.
  PagedKvCache::BlockTableStorage storage;
  const SequenceId ids[2] = {1, 2};
  const BlockTableView view = cache.block_table(ids, storage);
  EXPECT_EQ(view.seq_lens[1], shared * bt + extra);
  for (int32_t i = 0; i < shared; ++i)
    EXPECT_EQ(view.indices[view.indptr[1] + i], prefix[static_cast<size_t>(i)]);

  // Freeing A leaves the shared blocks to B; freeing B frees everything.
  cache.free_sequence(1);
  for (int32_t b : prefix) EXPECT_EQ(cache.allocator().refcount(b), 1) << "block " << b;
  cache.free_sequence(2);
  EXPECT_EQ(cache.allocator().num_free(), num_blocks);
}

TEST(SharedBlocks, OwnerOutsideSequencesKeepsBlockAlive) {
  PagedKvCache cache = make_cache(4, 8);
  cache.add_sequence(1);
  cache.append(1, 8);
  const int32_t b0 = cache.blocks(1)[0];
  cache.retain_block(b0);
  cache.free_sequence(1);
  EXPECT_EQ(cache.allocator().refcount(b0), 1);
  EXPECT_EQ(cache.allocator().num_free(), 7);
  const int32_t shared[1] = {b0};
  cache.add_sequence_with_blocks(2, shared, 4);
  EXPECT_EQ(cache.allocator().refcount(b0), 2);
  cache.release_block(b0);
  cache.free_sequence(2);
  EXPECT_EQ(cache.allocator().num_free(), 8);
  EXPECT_THROW(cache.release_block(b0), InternalError);
  EXPECT_THROW(cache.retain_block(b0), InternalError);
}

TEST(SharedBlocks, BadSharingIsRefused) {
  PagedKvCache cache = make_cache(4, 8);
  cache.add_sequence(1);
  cache.append(1, 6);
  const int32_t b0 = cache.blocks(1)[0], b1 = cache.blocks(1)[1];
  const int32_t one[1] = {b0};
  EXPECT_THROW(cache.add_sequence_with_blocks(2, one, 3), InternalError);  // not a full block
  EXPECT_THROW(cache.add_sequence_with_blocks(1, one, 4), InternalError);  // id exists
  const int32_t free_block[2] = {b0, 7};
  EXPECT_THROW(cache.add_sequence_with_blocks(2, free_block, 8), InternalError);
  EXPECT_EQ(cache.allocator().refcount(b0), 1) << "a refused call must leave no trace";
  EXPECT_FALSE(cache.has_sequence(2));

  // Another owner of the partly filled last block: appending would overwrite its rows.
  cache.retain_block(b1);
  EXPECT_THROW(cache.append(1, 1), InternalError);
  EXPECT_EQ(cache.seq_len(1), 6);
  cache.release_block(b1);
  EXPECT_EQ(cache.append(1, 1).size(), 1u);
}

}  // namespace
}  // namespace kvq
