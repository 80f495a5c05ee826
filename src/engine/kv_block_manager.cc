#include "kv_block_manager.h"

#include <algorithm>
#include <bit>
#include <string>
#include <utility>

#include "kvq/core/error.h"

namespace kvq {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t combine(uint64_t h, uint64_t v) {
  return mix(h ^ mix(v));
}

uint64_t combine(uint64_t h, const std::string& s) {
  h = combine(h, s.size());
  for (unsigned char c : s) h = combine(h, c);
  return h;
}

uint64_t combine(uint64_t h, const ScaleSource& s) {
  h = combine(h, static_cast<uint64_t>(s.kind));
  h = combine(h, s.values.size());
  for (float v : s.values) h = combine(h, std::bit_cast<uint32_t>(v));
  return h;
}

}  // namespace

uint64_t kv_plan_hash(const KvPlan& plan) {
  uint64_t h = combine(0x6b76712d70726566ull, plan.model.dir);  // "kvq-pref"
  h = combine(h, plan.model.architecture);
  h = combine(h, plan.layers.size());
  for (const LayerKvSpec& l : plan.layers) {
    for (uint64_t v : {static_cast<uint64_t>(l.layer), static_cast<uint64_t>(l.k_dtype),
                       static_cast<uint64_t>(l.v_dtype), static_cast<uint64_t>(l.attention),
                       static_cast<uint64_t>(l.sliding_window),
                       static_cast<uint64_t>(l.num_q_heads), static_cast<uint64_t>(l.num_kv_heads),
                       static_cast<uint64_t>(l.head_dim_k), static_cast<uint64_t>(l.head_dim_v),
                       static_cast<uint64_t>(l.block_tokens), static_cast<uint64_t>(l.model_dtype)})
      h = combine(h, v);
    h = combine(h, l.k_scale);
    h = combine(h, l.v_scale);
  }
  return h;
}

uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens) {
  uint64_t h = combine(parent, tokens.size());
  for (int32_t t : tokens) h = combine(h, static_cast<uint32_t>(t));
  return h;
}

KvBlockManager::KvBlockManager(const KvPlan& plan, int32_t num_blocks, bool prefix_caching)
    : KvBlockManager(plan, PagedKvCache(plan.layers, num_blocks), prefix_caching) {}

KvBlockManager::KvBlockManager(const KvPlan& plan, PagedKvCache cache, bool prefix_caching)
    : cache_(std::move(cache)),
      prefix_caching_(prefix_caching),
      plan_hash_(kv_plan_hash(plan)),
      published_(static_cast<size_t>(cache_.allocator().num_blocks())) {}

int32_t KvBlockManager::num_available() const {
  return cache_.allocator().num_free() + num_cached_free();
}

int32_t KvBlockManager::num_used() const {
  return cache_.allocator().num_used() - num_cached_free();
}

std::vector<int32_t> KvBlockManager::match_prefix(std::span<const int32_t> tokens,
                                                  int32_t max_blocks) const {
  std::vector<int32_t> found;
  if (!prefix_caching_) return found;
  const size_t bt = static_cast<size_t>(block_tokens());
  const size_t limit = std::min(static_cast<size_t>(std::max(max_blocks, 0)), tokens.size() / bt);
  uint64_t h = plan_hash_;
  for (size_t b = 0; b < limit; ++b) {
    const auto block_tokens = tokens.subspan(b * bt, bt);
    const uint64_t parent = h;
    h = block_hash(parent, block_tokens);
    const auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    const Published& p = published_[static_cast<size_t>(it->second)];
    if (p.parent != parent ||
        !std::equal(p.tokens.begin(), p.tokens.end(), block_tokens.begin(), block_tokens.end()))
      break;  // a hash collision: treat as a miss
    found.push_back(it->second);
  }
  return found;
}

int32_t KvBlockManager::count_unowned(std::span<const int32_t> blocks) const {
  int32_t n = 0;
  for (int32_t b : blocks)
    if (published_[static_cast<size_t>(b)].lru_stamp != 0) ++n;
  return n;
}

void KvBlockManager::add_sequence(SequenceId id, std::span<const int32_t> tokens,
                                  std::span<const int32_t> prefix) {
  const int32_t bt = block_tokens();
  KVQ_CHECK(prefix.size() * static_cast<size_t>(bt) <= tokens.size(),
            "KvBlockManager::add_sequence: prefix longer than the tokens");
  SeqState st;
  st.last_hash = plan_hash_;
  for (int32_t b : prefix) {
    Published& p = published_[static_cast<size_t>(b)];
    KVQ_CHECK(p.published, "KvBlockManager::add_sequence: block " + std::to_string(b) +
                               " is not a published block");
    if (p.lru_stamp != 0) {
      lru_.erase(p.lru_stamp);
      p.lru_stamp = 0;
    }
    st.last_hash = p.hash;
  }
  st.hashed_blocks = static_cast<int32_t>(prefix.size());
  if (prefix.empty())
    cache_.add_sequence(id);
  else
    cache_.add_sequence_with_blocks(id, prefix, static_cast<int32_t>(prefix.size()) * bt);
  seqs_[id] = st;
}

int32_t KvBlockManager::blocks_needed(SequenceId id, int32_t n) const {
  const int64_t bt = block_tokens();
  const int64_t len = static_cast<int64_t>(cache_.seq_len(id)) + n;
  return static_cast<int32_t>((len + bt - 1) / bt - static_cast<int64_t>(cache_.blocks(id).size()));
}

void KvBlockManager::evict_one() {
  const auto it = lru_.begin();
  const int32_t b = it->second;
  lru_.erase(it);
  Published& p = published_[static_cast<size_t>(b)];
  by_hash_.erase(p.hash);
  p = Published{};
  cache_.release_block(b);
}

std::vector<int64_t> KvBlockManager::append(SequenceId id, int32_t n) {
  const int32_t need = blocks_needed(id, n);
  if (need > num_available()) return {};
  while (cache_.allocator().num_free() < need) evict_one();
  std::vector<int64_t> slots = cache_.append(id, n);
  KVQ_CHECK(static_cast<int32_t>(slots.size()) == n,
            "KvBlockManager::append: the cache refused blocks it had free");
  return slots;
}

void KvBlockManager::publish_full_blocks(SequenceId id, std::span<const int32_t> tokens,
                                         int32_t computed) {
  if (!prefix_caching_) return;
  const auto it = seqs_.find(id);
  KVQ_CHECK(it != seqs_.end(),
            "KvBlockManager::publish_full_blocks: unknown sequence " + std::to_string(id));
  SeqState& st = it->second;
  const size_t bt = static_cast<size_t>(block_tokens());
  KVQ_CHECK(computed <= cache_.seq_len(id) && static_cast<size_t>(computed) <= tokens.size(),
            "KvBlockManager::publish_full_blocks: more computed tokens than the sequence holds");
  const auto blocks = cache_.blocks(id);
  while ((static_cast<size_t>(st.hashed_blocks) + 1) * bt <= static_cast<size_t>(computed)) {
    const size_t b = static_cast<size_t>(st.hashed_blocks);
    const auto block_tokens = tokens.subspan(b * bt, bt);
    const uint64_t h = block_hash(st.last_hash, block_tokens);
    // Content already published under another block (computed twice): keep the first.
    if (!by_hash_.contains(h)) {
      const int32_t block = blocks[b];
      Published& p = published_[static_cast<size_t>(block)];
      KVQ_CHECK(!p.published,
                "KvBlockManager: block " + std::to_string(block) + " is published twice");
      p.published = true;
      p.hash = h;
      p.parent = st.last_hash;
      p.tokens.assign(block_tokens.begin(), block_tokens.end());
      by_hash_[h] = block;
      cache_.retain_block(block);
    }
    st.last_hash = h;
    ++st.hashed_blocks;
  }
}

void KvBlockManager::truncate(SequenceId id, int32_t new_len) {
  const auto it = seqs_.find(id);
  KVQ_CHECK(it != seqs_.end(), "KvBlockManager::truncate: unknown sequence " + std::to_string(id));
  KVQ_CHECK(static_cast<int64_t>(new_len) >=
                static_cast<int64_t>(it->second.hashed_blocks) * block_tokens(),
            "KvBlockManager::truncate: sequence " + std::to_string(id) +
                " would lose a published block (truncate to " + std::to_string(new_len) + ")");
  cache_.truncate(id, new_len);
}

void KvBlockManager::free_sequence(SequenceId id) {
  const auto span = cache_.blocks(id);
  const std::vector<int32_t> blocks(span.begin(), span.end());
  cache_.free_sequence(id);
  seqs_.erase(id);
  // The tail of a sequence is the least likely to be shared again: it goes first.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    Published& p = published_[static_cast<size_t>(*it)];
    if (p.published && p.lru_stamp == 0 && cache_.allocator().refcount(*it) == 1) {
      p.lru_stamp = next_stamp_++;
      lru_[p.lru_stamp] = *it;
    }
  }
}

}  // namespace kvq
