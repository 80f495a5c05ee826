// Paged KV cache: per-layer storage sized by each layer's own LayerKvSpec
// (layers of different dtypes have different block sizes in bytes; nothing is
// padded to the largest), one BlockAllocator shared by all layers, per-sequence
// block tables, and slot mapping for writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvq/cache/block_allocator.h"
#include "kvq/plan/layer_kv_spec.h"

namespace kvq {

// Block tables of a batch in CSR form, passed to kernels by value.
// Sequence i owns blocks indices[indptr[i] .. indptr[i+1]) and holds seq_lens[i] tokens.
struct BlockTableView {
  const int32_t* indptr = nullptr;    // num_seqs + 1
  const int32_t* indices = nullptr;   // block ids
  const int32_t* seq_lens = nullptr;  // tokens in the cache per sequence
  int32_t num_seqs = 0;
  int32_t block_tokens = 0;
};

// One layer's storage, passed to kernels by value. Block b of side s starts at
// base(s) + b * layout(s).block_bytes.
struct LayerCacheView {
  std::byte* k_base = nullptr;
  std::byte* v_base = nullptr;
  KvSideLayout k_layout;
  KvSideLayout v_layout;
  int32_t num_blocks = 0;  // blocks in each side's storage (valid ids are 0 .. num_blocks-1)

  std::byte* base(KvSide s) const { return s == KvSide::kK ? k_base : v_base; }
  const KvSideLayout& layout(KvSide s) const { return s == KvSide::kK ? k_layout : v_layout; }
  std::byte* block(KvSide s, int32_t b) const {
    return base(s) + static_cast<size_t>(b) * layout(s).block_bytes;
  }
};

// Parses a byte size: "4GiB", "512MiB", "64KiB", "2GB", "1.5GiB", "4 GiB", "123" (bytes).
// Units: B, KB, MB, GB, TB (powers of 1000, any letter case) and KiB, MiB, GiB, TiB (powers
// of 1024, spelled exactly so). A fractional byte count is rounded down. Zero, negative,
// overflowing or malformed input throws InputError naming `what` with the accepted forms.
size_t parse_byte_size(std::string_view text, std::string_view what);

// Blocks that fit in `budget_bytes` for these layers: floor(budget / sum of block_bytes()).
// Each layer counts its own block bytes (no padding to the largest). The specs must be
// non-empty and share block_tokens (InternalError otherwise).
int64_t blocks_for_budget(std::span<const LayerKvSpec> layers, size_t budget_bytes);

using SequenceId = int64_t;

// CPU-resident paged cache (the CUDA backend keeps the same layout in device memory).
class PagedKvCache {
 public:
  // All specs must share block_tokens. Allocates num_blocks blocks per layer, 64-byte
  // aligned, filled with 0xFF bytes: every dtype decodes an unwritten row to NaN (its values
  // or its scales are NaN), so a read of a slot nobody wrote cannot pass for real data.
  PagedKvCache(std::vector<LayerKvSpec> layers, int32_t num_blocks);

  // A cache whose storage lives elsewhere (a CUDA model's device memory): this object does
  // the bookkeeping (blocks, sequences, tables, slots) and layer_view() returns `views`, one
  // per layer, whose bases it never dereferences. `owner` keeps the storage alive as long as
  // the cache. Each view must match its spec's layouts and hold num_blocks blocks.
  static PagedKvCache with_external_storage(std::vector<LayerKvSpec> layers, int32_t num_blocks,
                                            std::vector<LayerCacheView> views,
                                            std::shared_ptr<void> owner);
  // True when the storage is not host memory owned by this object (see above).
  bool external_storage() const { return owner_ != nullptr; }

  int32_t block_tokens() const { return block_tokens_; }
  size_t num_layers() const { return layers_.size(); }
  const LayerKvSpec& spec(size_t layer_slot) const { return layers_[layer_slot]; }
  LayerCacheView layer_view(size_t layer_slot);
  const BlockAllocator& allocator() const { return allocator_; }
  // Bytes allocated for one side of one layer: num_blocks * layout(side).block_bytes.
  size_t storage_bytes(size_t layer_slot, KvSide side) const;
  // Sum of storage_bytes over every layer and side.
  size_t bytes_allocated() const;

  // Registers an empty sequence. Throws InternalError if the id exists.
  void add_sequence(SequenceId id);
  // Registers a sequence that starts with `shared_full_blocks` (prefix sharing): each block, in
  // use elsewhere, gains this sequence as an owner, and the sequence holds
  // num_tokens == shared_full_blocks.size() * block_tokens() tokens. Only full blocks can be
  // shared, so later appends go to fresh blocks and a shared block is never written.
  // Throws InternalError if the id exists, a block is free, or num_tokens does not match.
  void add_sequence_with_blocks(SequenceId id, std::span<const int32_t> shared_full_blocks,
                                int32_t num_tokens);
  // An owner outside any sequence (a prefix cache keeping a block for reuse): retain adds one,
  // release drops one (the block is freed at count 0). Same checks as BlockAllocator.
  void retain_block(int32_t block);
  void release_block(int32_t block);
  bool has_sequence(SequenceId id) const;
  int32_t seq_len(SequenceId id) const;
  // Reserves n more tokens and returns their slots (block * block_tokens + offset), or an
  // empty vector (and changes nothing) when not enough blocks are free. Throws InternalError
  // when the tokens would land in a partly filled block that another owner shares.
  std::vector<int64_t> append(SequenceId id, int32_t n);
  // Shrinks the sequence to its first new_len tokens (a speculative step's rejected tail):
  // blocks past the new end are released; slots past it in the last kept block are left as
  // they are (nothing reads past seq_len, and the next append overwrites them). Throws
  // InternalError when new_len exceeds the length, is negative, or would leave the sequence
  // ending inside a block another owner shares (its next append would write into it).
  void truncate(SequenceId id, int32_t new_len);
  // Releases every block the sequence holds and forgets it.
  void free_sequence(SequenceId id);
  // The sequence's block ids in order.
  std::span<const int32_t> blocks(SequenceId id) const;

  // CSR block tables for `ids`, in that order; the arrays live in `storage`.
  struct BlockTableStorage {
    std::vector<int32_t> indptr, indices, seq_lens;
  };
  BlockTableView block_table(std::span<const SequenceId> ids, BlockTableStorage& storage) const;

 private:
  struct Sequence {
    std::vector<int32_t> blocks;
    int32_t len = 0;
  };
  std::vector<LayerKvSpec> layers_;
  int32_t block_tokens_ = 0;
  BlockAllocator allocator_;
  struct AlignedDelete {
    std::align_val_t align{64};  // what the storage was allocated with
    void operator()(std::byte* p) const { ::operator delete[](p, align); }
  };
  using Storage = std::unique_ptr<std::byte[], AlignedDelete>;
  std::vector<Storage> k_storage_, v_storage_;
  std::vector<size_t> k_bytes_, v_bytes_;       // what was allocated, per layer
  std::vector<LayerCacheView> external_views_;  // with_external_storage only
  std::shared_ptr<void> owner_;
  std::unordered_map<SequenceId, Sequence> seqs_;
};

// Writes n tokens of K and V into one layer at `slots` with the reference codecs
// (quantizing per the spec: per-tensor scales from spec.k_scale / v_scale, dynamic
// per-token-head scales computed here). k: [n][num_kv_heads][head_dim_k],
// v: [n][num_kv_heads][head_dim_v], row-major fp32. A slot outside the view's blocks, or a
// view whose layouts do not match the spec, throws InternalError.
void write_kv_reference(const LayerKvSpec& spec, const LayerCacheView& cache,
                        std::span<const int64_t> slots, const float* k, const float* v);

}  // namespace kvq
