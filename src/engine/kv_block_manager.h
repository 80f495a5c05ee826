// Blocks of the engine's paged KV cache: allocation as sequences grow, and prefix caching.
//
// Prefix caching: a FULL block is published under a hash chained from the start of the
// sequence (hash of the previous block, the block's token ids), seeded with a hash of the layer
// plan, so identical token prefixes under the same plan map to the same blocks and different
// plans never meet. A published block holds one reference of its own (the manager's), so it
// outlives the sequences that used it; while no sequence owns it, it sits in an LRU list and is
// evicted (its reference dropped) when allocation needs blocks. Token ids are stored with each
// published block and compared on lookup, so a hash collision costs a miss, never wrong K/V.
// Only full blocks are shared and a sharing sequence appends into fresh blocks, so a shared
// block is never written.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvq/cache/paged_kv_cache.h"
#include "kvq/plan/kv_plan.h"

namespace kvq {

// Hash of everything in the plan that decides what a cache block holds for a token prefix.
uint64_t kv_plan_hash(const KvPlan& plan);
// Hash of one full block of `tokens` after the blocks whose chained hash is `parent`.
uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens);

class KvBlockManager {
 public:
  KvBlockManager(const KvPlan& plan, int32_t num_blocks, bool prefix_caching);
  // Over a cache made elsewhere (Model::create_cache: host or device storage) for `plan`.
  KvBlockManager(const KvPlan& plan, PagedKvCache cache, bool prefix_caching);

  PagedKvCache& cache() { return cache_; }
  const PagedKvCache& cache() const { return cache_; }
  int32_t block_tokens() const { return cache_.block_tokens(); }
  int32_t num_blocks() const { return cache_.allocator().num_blocks(); }
  // Blocks allocation can use now: free ones plus cached ones no sequence owns.
  int32_t num_available() const;
  // Blocks some sequence owns (published or not).
  int32_t num_used() const;
  // Published blocks no sequence owns (evictable).
  int32_t num_cached_free() const { return static_cast<int32_t>(lru_.size()); }

  // The longest chain of published blocks that starts `tokens` (at most max_blocks blocks).
  std::vector<int32_t> match_prefix(std::span<const int32_t> tokens, int32_t max_blocks) const;
  // How many of `blocks` (published ones) no sequence owns: taking them lowers num_available().
  int32_t count_unowned(std::span<const int32_t> blocks) const;

  // Registers sequence `id` whose token ids start with `tokens`, sharing `prefix` (from
  // match_prefix on the same tokens; may be empty).
  void add_sequence(SequenceId id, std::span<const int32_t> tokens,
                    std::span<const int32_t> prefix);
  // Blocks the sequence must gain to hold n more tokens.
  int32_t blocks_needed(SequenceId id, int32_t n) const;
  // Reserves n more tokens (evicting least recently used unowned blocks as needed) and returns
  // their slots, or an empty vector (changing nothing) when num_available() is too small.
  std::vector<int64_t> append(SequenceId id, int32_t n);
  // Publishes the sequence's full blocks among its first `computed` tokens (K/V written).
  // `tokens` are the sequence's token ids (at least `computed` of them).
  void publish_full_blocks(SequenceId id, std::span<const int32_t> tokens, int32_t computed);
  // Rolls the sequence back to its first new_len tokens (a speculative step's rejected tail):
  // the blocks past the new end return to the free list. Published blocks are never rolled
  // back (InternalError): they hold only tokens the sequence had already kept.
  void truncate(SequenceId id, int32_t new_len);
  // Frees the sequence; its published blocks stay cached (last block evicted first).
  void free_sequence(SequenceId id);
  bool has_sequence(SequenceId id) const { return cache_.has_sequence(id); }

 private:
  struct Published {
    bool published = false;
    uint64_t hash = 0;
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    uint64_t lru_stamp = 0;  // key in lru_ while no sequence owns the block; 0 otherwise
  };
  struct SeqState {
    int32_t hashed_blocks = 0;  // leading full blocks already published or found published
    uint64_t last_hash = 0;     // chained hash after them
  };
  void evict_one();

  PagedKvCache cache_;
  bool prefix_caching_;
  uint64_t plan_hash_;
  std::vector<Published> published_;  // per block id
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::map<uint64_t, int32_t> lru_;  // stamp -> block; lowest stamp is evicted first
  uint64_t next_stamp_ = 1;
  std::unordered_map<SequenceId, SeqState> seqs_;
};

}  // namespace kvq
