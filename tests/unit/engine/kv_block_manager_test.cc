// The engine's block manager: prefix hashing (token content and layer plan), sharing of full
// blocks, LRU eviction of cached blocks nobody owns, and block accounting.
#include "engine/kv_block_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "kvq/core/error.h"

namespace kvq {
namespace {

uint32_t fresh_seed() {
  return std::random_device{}();
}

KvPlan small_plan(KvDtype dtype, int block_tokens) {
  KvPlan plan;
  plan.model.dir = "/nowhere/model";
  for (int l = 0; l < 2; ++l) {
    LayerKvSpec s;
    s.layer = l;
    s.k_dtype = s.v_dtype = dtype;
    s.num_q_heads = 2;
    s.num_kv_heads = 1;
    s.head_dim_k = s.head_dim_v = 16;
    s.block_tokens = block_tokens;
    if (traits(dtype).uses_tensor_scale) {
      s.k_scale.kind = s.v_scale.kind = ScaleSourceKind::kDefaultOne;
      s.k_scale.values = s.v_scale.values = {1.0f};
    }
    plan.layers.push_back(s);
  }
  return plan;
}

std::vector<int32_t> random_tokens(std::mt19937& rng, int n) {
  std::uniform_int_distribution<int32_t> u(0, 50);  // small vocabulary: prefixes repeat
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = u(rng);
  return t;
}

TEST(PrefixHash, DependsOnPlanAndWholePrefix) {
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  const KvPlan bf16 = small_plan(KvDtype::kBFloat16, 16), fp8 = small_plan(KvDtype::kFp8E4M3, 16);
  EXPECT_EQ(kv_plan_hash(bf16), kv_plan_hash(small_plan(KvDtype::kBFloat16, 16)));
  EXPECT_NE(kv_plan_hash(bf16), kv_plan_hash(fp8));
  KvPlan one_layer_fp8 = bf16;
  one_layer_fp8.layers[1].k_dtype = KvDtype::kFp8E4M3;  // only layer 1's K differs
  EXPECT_NE(kv_plan_hash(bf16), kv_plan_hash(one_layer_fp8));
  KvPlan scaled = fp8;
  scaled.layers[0].v_scale.values = {0.5f};
  EXPECT_NE(kv_plan_hash(fp8), kv_plan_hash(scaled));
  EXPECT_NE(kv_plan_hash(bf16), kv_plan_hash(small_plan(KvDtype::kBFloat16, 8)));

  const auto a = random_tokens(rng, 16);
  auto b = a;
  b[static_cast<size_t>(std::uniform_int_distribution<int>(0, 15)(rng))] += 1;
  const uint64_t root = kv_plan_hash(bf16);
  EXPECT_EQ(block_hash(root, a), block_hash(root, a));
  EXPECT_NE(block_hash(root, a), block_hash(root, b)) << "seed " << seed;
  EXPECT_NE(block_hash(root, a), block_hash(kv_plan_hash(fp8), a));
  EXPECT_NE(block_hash(block_hash(root, a), a), block_hash(block_hash(root, b), a));
}

// Managers under different plans publish identical tokens under different hashes, so a block
// published under one plan is never found under the other.
TEST(PrefixHash, DifferentPlansNeverShare) {
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  KvBlockManager bf16(small_plan(KvDtype::kBFloat16, 4), 8, true),
      fp8(small_plan(KvDtype::kFp8E4M3, 4), 8, true);
  const auto tokens = random_tokens(rng, 12);
  bf16.add_sequence(1, tokens, {});
  ASSERT_EQ(bf16.append(1, 12).size(), 12u);
  bf16.publish_full_blocks(1, tokens, 12);
  EXPECT_EQ(bf16.match_prefix(tokens, 3).size(), 3u);
  EXPECT_TRUE(fp8.match_prefix(tokens, 3).empty());
  const uint64_t fp8_root = kv_plan_hash(small_plan(KvDtype::kFp8E4M3, 4));
  const uint64_t bf16_root = kv_plan_hash(small_plan(KvDtype::kBFloat16, 4));
  EXPECT_NE(block_hash(fp8_root, std::span(tokens).first(4)),
            block_hash(bf16_root, std::span(tokens).first(4)));
}

TEST(KvBlockManager, PublishesOnlyFullBlocksAndEvictsLeastRecentlyUsed) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  KvBlockManager m(small_plan(KvDtype::kBFloat16, 4), 6, true);
  const auto t1 = random_tokens(rng, 10);
  m.add_sequence(1, t1, {});
  ASSERT_EQ(m.append(1, 10).size(), 10u);
  const std::vector<int32_t> b1(m.cache().blocks(1).begin(), m.cache().blocks(1).end());
  m.publish_full_blocks(1, t1, 7);  // K/V of 7 tokens: one full block
  EXPECT_EQ(m.match_prefix(t1, 3), std::vector<int32_t>{b1[0]});
  m.publish_full_blocks(1, t1, 10);
  EXPECT_EQ(m.match_prefix(t1, 3), (std::vector<int32_t>{b1[0], b1[1]}))
      << "the partial block stays private";
  EXPECT_EQ(m.match_prefix(t1, 1), std::vector<int32_t>{b1[0]});
  EXPECT_EQ(m.num_used(), 3);
  m.free_sequence(1);
  EXPECT_EQ(m.num_used(), 0);
  EXPECT_EQ(m.num_cached_free(), 2);
  EXPECT_EQ(m.num_available(), 6);

  // A sequence sharing the first block takes it out of the LRU list.
  auto t2 = t1;
  t2[5] += 1;
  const auto p2 = m.match_prefix(t2, 2);
  ASSERT_EQ(p2, std::vector<int32_t>{b1[0]});
  EXPECT_EQ(m.count_unowned(p2), 1);
  m.add_sequence(2, t2, p2);
  EXPECT_EQ(m.cache().allocator().refcount(b1[0]), 2);  // sequence 2 and the cache
  EXPECT_EQ(m.num_cached_free(), 1);
  EXPECT_EQ(m.num_available(), 5);
  // Five more blocks: every free one, then the LRU one (b1[1]) is evicted; b1[0] is owned.
  ASSERT_EQ(m.append(2, 20).size(), 20u);
  EXPECT_EQ(m.num_cached_free(), 0);
  EXPECT_EQ(m.num_available(), 0);
  EXPECT_EQ(m.match_prefix(t1, 3), std::vector<int32_t>{b1[0]}) << "b1[1] was evicted";
  EXPECT_TRUE(m.append(2, 1).empty()) << "no block left";
  m.free_sequence(2);
  EXPECT_EQ(m.num_used(), 0);
  EXPECT_EQ(m.num_available(), 6);
}

TEST(KvBlockManager, TailBlocksAreEvictedFirst) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  KvBlockManager m(small_plan(KvDtype::kBFloat16, 4), 4, true);
  const auto t = random_tokens(rng, 16);
  m.add_sequence(1, t, {});
  ASSERT_EQ(m.append(1, 16).size(), 16u);
  m.publish_full_blocks(1, t, 16);
  m.free_sequence(1);
  EXPECT_EQ(m.num_cached_free(), 4);
  // Each new block evicts the tail of the cached chain, so the shared prefix lasts longest.
  m.add_sequence(2, {}, {});
  for (int k = 1; k <= 4; ++k) {
    ASSERT_EQ(m.append(2, 4).size(), 4u);
    EXPECT_EQ(m.match_prefix(t, 4).size(), static_cast<size_t>(4 - k));
  }
  m.free_sequence(2);
}

TEST(KvBlockManager, DisabledCachingSharesNothing) {
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  KvBlockManager m(small_plan(KvDtype::kBFloat16, 4), 4, false);
  const auto t = random_tokens(rng, 8);
  m.add_sequence(1, t, {});
  ASSERT_EQ(m.append(1, 8).size(), 8u);
  m.publish_full_blocks(1, t, 8);
  EXPECT_TRUE(m.match_prefix(t, 2).empty());
  m.free_sequence(1);
  EXPECT_EQ(m.num_cached_free(), 0);
  EXPECT_EQ(m.cache().allocator().num_free(), 4);
}

// Random sequences over a tiny vocabulary (so prefixes repeat): every shared block holds the
// tokens asked for, shared blocks are never written, and the block accounting always adds up.
TEST(KvBlockManager, RandomSharingKeepsContentAndAccounting) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int bt = std::uniform_int_distribution<int>(1, 4)(rng);
  const int32_t num_blocks = 24;
  KvBlockManager m(small_plan(KvDtype::kBFloat16, bt), num_blocks, true);
  std::map<int64_t, int32_t> slot_token;  // what was written to each slot (last write wins)
  struct Seq {
    std::vector<int32_t> tokens;
    int32_t computed = 0;
  };
  std::map<SequenceId, Seq> seqs;
  SequenceId next = 1;
  std::uniform_int_distribution<int32_t> tok(0, 2);  // three tokens: plenty of repeats
  for (int op = 0; op < 600; ++op) {
    const int kind = std::uniform_int_distribution<int>(0, 2)(rng);
    if (kind == 0 || seqs.empty()) {
      std::vector<int32_t> t(
          static_cast<size_t>(std::uniform_int_distribution<int>(1, 4 * bt)(rng)));
      for (auto& x : t) x = tok(rng);
      const auto prefix =
          m.match_prefix(t, static_cast<int32_t>((t.size() - 1) / static_cast<size_t>(bt)));
      for (size_t b = 0; b < prefix.size(); ++b)
        for (int i = 0; i < bt; ++i)
          ASSERT_EQ(slot_token.at(static_cast<int64_t>(prefix[b]) * bt + i),
                    t[b * static_cast<size_t>(bt) + static_cast<size_t>(i)])
              << "a shared block holds other tokens";
      if (static_cast<int64_t>((t.size() + static_cast<size_t>(bt) - 1) / static_cast<size_t>(bt)) -
              static_cast<int64_t>(prefix.size()) >
          m.num_available() - m.count_unowned(prefix))
        continue;
      m.add_sequence(next, t, prefix);
      seqs[next] = {t, static_cast<int32_t>(prefix.size()) * bt};
      ++next;
    } else {
      auto it = seqs.begin();
      std::advance(it, std::uniform_int_distribution<size_t>(0, seqs.size() - 1)(rng));
      Seq& s = it->second;
      if (kind == 1) {
        // Compute what is not computed yet, then "sample" one more token.
        const int32_t n = static_cast<int32_t>(s.tokens.size()) - s.computed;
        const auto slots = m.append(it->first, n);  // throws if it would write a shared block
        if (slots.empty()) continue;
        for (int32_t i = 0; i < n; ++i)
          slot_token[slots[static_cast<size_t>(i)]] = s.tokens[static_cast<size_t>(s.computed + i)];
        s.computed += n;
        m.publish_full_blocks(it->first, s.tokens, s.computed);
        s.tokens.push_back(tok(rng));
      } else {
        m.free_sequence(it->first);
        seqs.erase(it);
      }
    }
    // Accounting: owned + cached-unowned + free = all blocks.
    std::set<int32_t> owned;
    for (const auto& [id, s] : seqs)
      for (int32_t b : m.cache().blocks(id)) owned.insert(b);
    ASSERT_EQ(static_cast<int32_t>(owned.size()), m.num_used());
    ASSERT_EQ(m.num_used() + m.num_cached_free() + m.cache().allocator().num_free(), num_blocks);
  }
  for (const auto& [id, s] : seqs) m.free_sequence(id);
  EXPECT_EQ(m.num_used(), 0);
}

}  // namespace
}  // namespace kvq
