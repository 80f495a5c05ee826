#include "kvq/cache/block_allocator.h"

#include <string>

#include "kvq/core/error.h"

namespace kvq {

BlockAllocator::BlockAllocator(int32_t num_blocks) {
  KVQ_CHECK(num_blocks >= 0, "BlockAllocator: negative block count " + std::to_string(num_blocks));
  refcount_.assign(static_cast<size_t>(num_blocks), 0);
  free_.reserve(static_cast<size_t>(num_blocks));
  // Pushed in reverse so a fresh allocator hands out 0, 1, 2, ... (easier to read in dumps).
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

std::optional<int32_t> BlockAllocator::allocate() {
  if (free_.empty()) return std::nullopt;
  const int32_t b = free_.back();
  free_.pop_back();
  KVQ_CHECK(refcount_[static_cast<size_t>(b)] == 0,
            "BlockAllocator: block " + std::to_string(b) + " on the free list is in use");
  refcount_[static_cast<size_t>(b)] = 1;
  return b;
}

void BlockAllocator::retain(int32_t block) {
  KVQ_CHECK(block >= 0 && block < num_blocks(),
            "BlockAllocator::retain: block id " + std::to_string(block) + " out of range");
  int32_t& rc = refcount_[static_cast<size_t>(block)];
  KVQ_CHECK(rc > 0, "BlockAllocator::retain: block " + std::to_string(block) + " is free");
  ++rc;
}

void BlockAllocator::release(int32_t block) {
  KVQ_CHECK(block >= 0 && block < num_blocks(),
            "BlockAllocator::release: block id " + std::to_string(block) + " out of range");
  int32_t& rc = refcount_[static_cast<size_t>(block)];
  KVQ_CHECK(rc > 0, "BlockAllocator::release: block " + std::to_string(block) +
                        " is already free (double release)");
  if (--rc == 0) free_.push_back(block);
}

int32_t BlockAllocator::refcount(int32_t block) const {
  KVQ_CHECK(block >= 0 && block < num_blocks(),
            "BlockAllocator::refcount: block id " + std::to_string(block) + " out of range");
  return refcount_[static_cast<size_t>(block)];
}

}  // namespace kvq
