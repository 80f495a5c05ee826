// Fixed-size block allocator for the paged KV cache: a free list plus a
// reference count per block (blocks shared by prefix caching have count > 1).
// One block id addresses the same slot in every layer's storage.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace kvq {

class BlockAllocator {
 public:
  explicit BlockAllocator(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(refcount_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_blocks() - num_free(); }

  // A free block with reference count 1, or nullopt when none is free.
  std::optional<int32_t> allocate();
  // Adds an owner to a block in use (prefix sharing). Throws InternalError on a free block.
  void retain(int32_t block);
  // Drops one owner; the block returns to the free list at count 0.
  // Throws InternalError on a free block (double free) or an id out of range.
  void release(int32_t block);
  int32_t refcount(int32_t block) const;

 private:
  std::vector<int32_t> refcount_;
  std::vector<int32_t> free_;  // LIFO: recently freed blocks are reused first (warm in cache)
};

}  // namespace kvq
