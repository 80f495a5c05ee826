#include "kvq/cache/block_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "cache_test_util.h"
#include "kvq/core/error.h"

namespace kvq {
namespace {

// Takes every free block, checks each was free in the model and is distinct, then gives
// them back: the allocator's free list holds exactly the model's free blocks, once each.
void check_free_list(BlockAllocator& a, const std::vector<int32_t>& model) {
  const int32_t expected_free = static_cast<int32_t>(std::count(model.begin(), model.end(), 0));
  ASSERT_EQ(a.num_free(), expected_free);
  std::vector<bool> seen(model.size(), false);
  std::vector<int32_t> taken;
  while (auto b = a.allocate()) {
    ASSERT_GE(*b, 0);
    ASSERT_LT(*b, a.num_blocks());
    ASSERT_EQ(model[static_cast<size_t>(*b)], 0) << "allocated block " << *b << " is owned";
    ASSERT_FALSE(seen[static_cast<size_t>(*b)]) << "block " << *b << " on the free list twice";
    seen[static_cast<size_t>(*b)] = true;
    taken.push_back(*b);
  }
  ASSERT_EQ(static_cast<int32_t>(taken.size()), expected_free);
  for (int32_t b : taken) a.release(b);
  ASSERT_EQ(a.num_free(), expected_free);
}

TEST(BlockAllocator, RandomOpsMatchModel) {
  const unsigned seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937 rng(seed);
  const int32_t n = std::uniform_int_distribution<int32_t>(1, 64)(rng);
  BlockAllocator a(n);
  std::vector<int32_t> model(static_cast<size_t>(n), 0);
  std::vector<int32_t> owners;  // one entry per reference held

  for (int op = 0; op < 6000; ++op) {
    const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
    if (kind < 4) {  // allocate
      auto b = a.allocate();
      const bool any_free = std::count(model.begin(), model.end(), 0) > 0;
      ASSERT_EQ(b.has_value(), any_free) << "op " << op;
      if (b) {
        ASSERT_EQ(model[static_cast<size_t>(*b)], 0)
            << "op " << op << ": block " << *b << " handed out while owned";
        model[static_cast<size_t>(*b)] = 1;
        owners.push_back(*b);
      }
    } else if (kind < 6 && !owners.empty()) {  // retain
      const int32_t b = owners[std::uniform_int_distribution<size_t>(0, owners.size() - 1)(rng)];
      a.retain(b);
      ++model[static_cast<size_t>(b)];
      owners.push_back(b);
    } else if (!owners.empty()) {  // release
      const size_t i = std::uniform_int_distribution<size_t>(0, owners.size() - 1)(rng);
      const int32_t b = owners[i];
      owners[i] = owners.back();
      owners.pop_back();
      a.release(b);
      --model[static_cast<size_t>(b)];
      if (model[static_cast<size_t>(b)] == 0) {
        // LIFO: the block just freed is the next one handed out.
        auto again = a.allocate();
        ASSERT_TRUE(again.has_value());
        ASSERT_EQ(*again, b) << "op " << op;
        a.release(*again);
      }
    }
    int32_t used = 0;
    for (int32_t b = 0; b < n; ++b) {
      ASSERT_EQ(a.refcount(b), model[static_cast<size_t>(b)]) << "op " << op << " block " << b;
      used += model[static_cast<size_t>(b)] > 0;
    }
    ASSERT_EQ(a.num_used(), used) << "op " << op;
    ASSERT_EQ(a.num_free() + a.num_used(), a.num_blocks());
    if (op % 97 == 0) {
      check_free_list(a, model);
      if (HasFatalFailure()) return;
    }
  }
  for (int32_t b : owners) a.release(b);
  std::fill(model.begin(), model.end(), 0);
  ASSERT_EQ(a.num_free(), n);
  check_free_list(a, model);
}

TEST(BlockAllocator, InvalidReleaseAndRetainThrow) {
  BlockAllocator a(4);
  const int32_t b = *a.allocate();
  EXPECT_THROW(a.release(-1), InternalError);
  EXPECT_THROW(a.release(4), InternalError);
  EXPECT_THROW(a.retain(4), InternalError);
  EXPECT_THROW(a.refcount(-1), InternalError);
  const int32_t never_allocated = b == 3 ? 2 : 3;
  EXPECT_THROW(a.release(never_allocated), InternalError);
  EXPECT_THROW(a.retain(never_allocated), InternalError);
  a.retain(b);
  a.release(b);
  a.release(b);
  EXPECT_THROW(a.release(b), InternalError);  // double release
  EXPECT_THROW(a.retain(b), InternalError);
  // The failed calls changed nothing.
  EXPECT_EQ(a.num_free(), 4);
  for (int32_t i = 0; i < 4; ++i) EXPECT_EQ(a.refcount(i), 0);
}

TEST(BlockAllocator, EmptyPoolAllocatesNothing) {
  BlockAllocator a(0);
  EXPECT_FALSE(a.allocate().has_value());
  EXPECT_EQ(a.num_free(), 0);
  EXPECT_THROW(BlockAllocator(-1), InternalError);
}

}  // namespace
}  // namespace kvq
