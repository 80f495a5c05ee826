#include "kvq/cache/paged_kv_cache.h"

#include <sys/mman.h>

#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "kvq/core/error.h"

namespace kvq {

namespace {

// Storage of 2 MiB or more is aligned to 2 MiB and advised to take transparent huge pages
// (where the kernel's THP mode is `madvise`, as on Debian): decode attention streams every
// layer's cache each step, and with 4 KiB pages each 16-token tile of a kv head sits on a
// page of its own, a TLB miss per tile (measured: 2-5% of a CPU decode step at batch 8 x 2k).
constexpr size_t kHugePage = size_t{2} << 20;
std::align_val_t storage_alignment(size_t bytes) {
  return std::align_val_t{bytes >= kHugePage ? kHugePage : 64};
}
// 0xFF in every byte is NaN in float32/float16/bfloat16, NaN in both fp8 formats and NaN as
// an fp32 / fp16 / e4m3 scale, so any unwritten row decodes to NaN whatever its dtype.
constexpr unsigned char kPoisonByte = 0xFF;

std::string layer_name(const LayerKvSpec& spec) {
  return "layer " + std::to_string(spec.layer);
}

// What the cache itself needs from a spec (the planner validates the rest, e.g. scales).
void check_storable(const LayerKvSpec& spec, int block_tokens) {
  KVQ_CHECK(spec.block_tokens == block_tokens,
            "PagedKvCache: " + layer_name(spec) + " has block_tokens " +
                std::to_string(spec.block_tokens) + ", the cache uses " +
                std::to_string(block_tokens));
  KVQ_CHECK(spec.num_kv_heads > 0, "PagedKvCache: " + layer_name(spec) + " has no kv heads");
  for (KvSide s : {KvSide::kK, KvSide::kV}) {
    KVQ_CHECK(traits(spec.dtype(s)).concrete, "PagedKvCache: " + layer_name(spec) + " " +
                                                  std::string(to_string(s)) +
                                                  " dtype is unresolved");
    const std::string reason = head_dim_unsupported_reason(spec.dtype(s), spec.head_dim(s));
    KVQ_CHECK(reason.empty(), "PagedKvCache: " + layer_name(spec) + " " +
                                  std::string(to_string(s)) + ": " + reason);
  }
}

size_t side_bytes(const KvSideLayout& layout, int32_t num_blocks) {
  const size_t n = static_cast<size_t>(num_blocks);
  KVQ_CHECK(n == 0 || layout.block_bytes <= std::numeric_limits<size_t>::max() / n,
            "PagedKvCache: storage size overflows");
  return n * layout.block_bytes;
}

}  // namespace

PagedKvCache::PagedKvCache(std::vector<LayerKvSpec> layers, int32_t num_blocks)
    : layers_(std::move(layers)), allocator_(num_blocks) {
  KVQ_CHECK(!layers_.empty(), "PagedKvCache: no layers");
  block_tokens_ = layers_.front().block_tokens;
  KVQ_CHECK(block_tokens_ > 0,
            "PagedKvCache: block_tokens must be positive, got " + std::to_string(block_tokens_));
  k_storage_.reserve(layers_.size());
  v_storage_.reserve(layers_.size());
  k_bytes_.reserve(layers_.size());
  v_bytes_.reserve(layers_.size());
  for (const LayerKvSpec& spec : layers_) {
    check_storable(spec, block_tokens_);
    for (KvSide s : {KvSide::kK, KvSide::kV}) {
      const size_t bytes = side_bytes(spec.layout(s), num_blocks);
      // operator new[] with alignment never returns null for size 0, so views stay non-null.
      const std::align_val_t align = storage_alignment(bytes);
      Storage storage(static_cast<std::byte*>(::operator new[](bytes, align)),
                      AlignedDelete{align});
      if (align == std::align_val_t{kHugePage})  // advice only: an error leaves 4 KiB pages
        (void)::madvise(storage.get(), bytes / kHugePage * kHugePage, MADV_HUGEPAGE);
      std::memset(storage.get(), kPoisonByte, bytes);
      (s == KvSide::kK ? k_storage_ : v_storage_).push_back(std::move(storage));
      (s == KvSide::kK ? k_bytes_ : v_bytes_).push_back(bytes);
    }
  }
}

PagedKvCache PagedKvCache::with_external_storage(std::vector<LayerKvSpec> layers,
                                                 int32_t num_blocks,
                                                 std::vector<LayerCacheView> views,
                                                 std::shared_ptr<void> owner) {
  KVQ_CHECK(owner != nullptr, "PagedKvCache::with_external_storage: no storage owner");
  KVQ_CHECK(views.size() == layers.size(),
            "PagedKvCache::with_external_storage: " + std::to_string(views.size()) + " views for " +
                std::to_string(layers.size()) + " layers");
  // Bookkeeping only: a zero-block host cache of the same specs, then the external views.
  PagedKvCache cache(std::move(layers), 0);
  cache.allocator_ = BlockAllocator(num_blocks);
  for (size_t i = 0; i < views.size(); ++i) {
    const LayerKvSpec& spec = cache.layers_[i];
    const LayerCacheView& v = views[i];
    KVQ_CHECK(v.num_blocks == num_blocks && v.k_base != nullptr && v.v_base != nullptr &&
                  v.k_layout.block_bytes == spec.layout(KvSide::kK).block_bytes &&
                  v.v_layout.block_bytes == spec.layout(KvSide::kV).block_bytes,
              "PagedKvCache::with_external_storage: view " + std::to_string(i) +
                  " does not match its layer spec or the block count");
    cache.k_bytes_[i] = side_bytes(spec.layout(KvSide::kK), num_blocks);
    cache.v_bytes_[i] = side_bytes(spec.layout(KvSide::kV), num_blocks);
  }
  cache.external_views_ = std::move(views);
  cache.owner_ = std::move(owner);
  return cache;
}

LayerCacheView PagedKvCache::layer_view(size_t layer_slot) {
  KVQ_CHECK(layer_slot < layers_.size(), "PagedKvCache::layer_view: layer slot " +
                                             std::to_string(layer_slot) + " out of range (" +
                                             std::to_string(layers_.size()) + " layers)");
  if (owner_) return external_views_[layer_slot];
  const LayerKvSpec& spec = layers_[layer_slot];
  LayerCacheView view;
  view.k_base = k_storage_[layer_slot].get();
  view.v_base = v_storage_[layer_slot].get();
  view.k_layout = spec.layout(KvSide::kK);
  view.v_layout = spec.layout(KvSide::kV);
  view.num_blocks = allocator_.num_blocks();
  return view;
}

size_t PagedKvCache::storage_bytes(size_t layer_slot, KvSide side) const {
  KVQ_CHECK(layer_slot < layers_.size(), "PagedKvCache::storage_bytes: layer slot " +
                                             std::to_string(layer_slot) + " out of range");
  return side == KvSide::kK ? k_bytes_[layer_slot] : v_bytes_[layer_slot];
}

size_t PagedKvCache::bytes_allocated() const {
  size_t total = 0;
  for (size_t i = 0; i < layers_.size(); ++i) total += k_bytes_[i] + v_bytes_[i];
  return total;
}

void PagedKvCache::add_sequence(SequenceId id) {
  const bool inserted = seqs_.try_emplace(id).second;
  KVQ_CHECK(inserted, "PagedKvCache::add_sequence: sequence " + std::to_string(id) + " exists");
}

void PagedKvCache::add_sequence_with_blocks(SequenceId id,
                                            std::span<const int32_t> shared_full_blocks,
                                            int32_t num_tokens) {
  KVQ_CHECK(!seqs_.contains(id),
            "PagedKvCache::add_sequence_with_blocks: sequence " + std::to_string(id) + " exists");
  KVQ_CHECK(static_cast<int64_t>(num_tokens) ==
                static_cast<int64_t>(shared_full_blocks.size()) * block_tokens_,
            "PagedKvCache::add_sequence_with_blocks: " + std::to_string(num_tokens) +
                " tokens in " + std::to_string(shared_full_blocks.size()) +
                " blocks; only full blocks of " + std::to_string(block_tokens_) +
                " tokens can be shared");
  // Check every block before retaining any, so a failure leaves no trace.
  for (int32_t b : shared_full_blocks)
    KVQ_CHECK(allocator_.refcount(b) > 0,
              "PagedKvCache::add_sequence_with_blocks: block " + std::to_string(b) + " is free");
  for (int32_t b : shared_full_blocks) allocator_.retain(b);
  Sequence& seq = seqs_[id];
  seq.blocks.assign(shared_full_blocks.begin(), shared_full_blocks.end());
  seq.len = num_tokens;
}

void PagedKvCache::retain_block(int32_t block) {
  allocator_.retain(block);
}

void PagedKvCache::release_block(int32_t block) {
  allocator_.release(block);
}

bool PagedKvCache::has_sequence(SequenceId id) const {
  return seqs_.contains(id);
}

namespace {
template <typename Map>
auto& find_sequence(Map& seqs, SequenceId id, const char* where) {
  auto it = seqs.find(id);
  KVQ_CHECK(it != seqs.end(),
            std::string("PagedKvCache::") + where + ": unknown sequence " + std::to_string(id));
  return it->second;
}
}  // namespace

int32_t PagedKvCache::seq_len(SequenceId id) const {
  return find_sequence(seqs_, id, "seq_len").len;
}

std::vector<int64_t> PagedKvCache::append(SequenceId id, int32_t n) {
  Sequence& seq = find_sequence(seqs_, id, "append");
  KVQ_CHECK(n >= 0, "PagedKvCache::append: negative token count " + std::to_string(n));
  const int64_t new_len = static_cast<int64_t>(seq.len) + n;
  KVQ_CHECK(new_len <= std::numeric_limits<int32_t>::max(),
            "PagedKvCache::append: sequence length overflows");
  // Writing into a shared block would change what its other owners read.
  KVQ_CHECK(n == 0 || seq.len % block_tokens_ == 0 || allocator_.refcount(seq.blocks.back()) == 1,
            "PagedKvCache::append: sequence " + std::to_string(id) +
                " would write into shared block " + std::to_string(seq.blocks.back()));
  const int64_t blocks_needed = (new_len + block_tokens_ - 1) / block_tokens_;
  const int64_t extra = blocks_needed - static_cast<int64_t>(seq.blocks.size());
  // All or nothing: check before allocating so a failure leaves no trace.
  if (extra > allocator_.num_free()) return {};
  for (int64_t i = 0; i < extra; ++i) {
    const std::optional<int32_t> b = allocator_.allocate();
    KVQ_CHECK(b.has_value(), "PagedKvCache::append: allocator ran dry after reporting free blocks");
    seq.blocks.push_back(*b);
  }
  std::vector<int64_t> slots;
  slots.reserve(static_cast<size_t>(n));
  for (int64_t pos = seq.len; pos < new_len; ++pos) {
    const int64_t block = seq.blocks[static_cast<size_t>(pos / block_tokens_)];
    slots.push_back(block * block_tokens_ + pos % block_tokens_);
  }
  seq.len = static_cast<int32_t>(new_len);
  return slots;
}

void PagedKvCache::truncate(SequenceId id, int32_t new_len) {
  Sequence& seq = find_sequence(seqs_, id, "truncate");
  KVQ_CHECK(new_len >= 0 && new_len <= seq.len,
            "PagedKvCache::truncate: sequence " + std::to_string(id) + " has " +
                std::to_string(seq.len) + " tokens, cannot truncate to " + std::to_string(new_len));
  const size_t keep = static_cast<size_t>((new_len + block_tokens_ - 1) / block_tokens_);
  KVQ_CHECK(new_len % block_tokens_ == 0 || allocator_.refcount(seq.blocks[keep - 1]) == 1,
            "PagedKvCache::truncate: sequence " + std::to_string(id) +
                " would end inside shared block " + std::to_string(seq.blocks[keep - 1]));
  while (seq.blocks.size() > keep) {
    allocator_.release(seq.blocks.back());
    seq.blocks.pop_back();
  }
  seq.len = new_len;
}

void PagedKvCache::free_sequence(SequenceId id) {
  Sequence& seq = find_sequence(seqs_, id, "free_sequence");
  for (int32_t b : seq.blocks) allocator_.release(b);
  seqs_.erase(id);
}

std::span<const int32_t> PagedKvCache::blocks(SequenceId id) const {
  return find_sequence(seqs_, id, "blocks").blocks;
}

BlockTableView PagedKvCache::block_table(std::span<const SequenceId> ids,
                                         BlockTableStorage& storage) const {
  storage.indptr.assign(1, 0);
  storage.indices.clear();
  storage.seq_lens.clear();
  storage.indptr.reserve(ids.size() + 1);
  storage.seq_lens.reserve(ids.size());
  for (SequenceId id : ids) {
    const Sequence& seq = find_sequence(seqs_, id, "block_table");
    storage.indices.insert(storage.indices.end(), seq.blocks.begin(), seq.blocks.end());
    KVQ_CHECK(storage.indices.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
              "PagedKvCache::block_table: too many blocks for int32 indices");
    storage.indptr.push_back(static_cast<int32_t>(storage.indices.size()));
    storage.seq_lens.push_back(seq.len);
  }
  KVQ_CHECK(ids.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
            "PagedKvCache::block_table: too many sequences");
  BlockTableView view;
  view.indptr = storage.indptr.data();
  view.indices = storage.indices.data();
  view.seq_lens = storage.seq_lens.data();
  view.num_seqs = static_cast<int32_t>(ids.size());
  view.block_tokens = block_tokens_;
  return view;
}

}  // namespace kvq
