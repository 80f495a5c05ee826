// End to end through the real cache: PagedKvCache + write_kv_reference, then each layer's
// selected backend (and cpu_reference) reads what was written. Expected values come from
// quantize -> dequantize of the same inputs and exact float64 attention. Where cpu_avx512
// computes Q·K on int8/int4 codes, the tolerance adds what quantizing q allows
// (test::int_q_attention).
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "attention/cpu_avx512/kernel.h"
#include "attention_harness.h"
#include "kvq/attention/backend.h"
#include "kvq/cache/paged_kv_cache.h"

namespace kvq {
namespace {

using test::DeqRows;
using test::SeqShape;

LayerKvSpec layer(int index, KvDtype k, KvDtype v, int num_kv_heads, int ratio, int head_dim) {
  test::AttnCase c;
  c.k = k;
  c.v = v;
  c.num_kv_heads = num_kv_heads;
  c.ratio = ratio;
  c.head_dim_k = c.head_dim_v = head_dim;
  c.block_tokens = 16;
  LayerKvSpec s = test::spec_for(c);
  s.layer = index;
  return s;
}

TEST(PagedCacheAttention, WritesThroughWriteKvReferenceReadBackByEveryLayersBackend) {
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);

  // Per-layer dtypes and shapes differ; head_dim 8 sends one layer to cpu_reference.
  std::vector<LayerKvSpec> specs = {
      layer(0, KvDtype::kInt4PerTokenHead, KvDtype::kBFloat16, 2, 4, 64),
      layer(1, KvDtype::kFp8E4M3, KvDtype::kFp8E4M3, 1, 4, 128),
      layer(2, KvDtype::kNvfp4, KvDtype::kInt8PerTokenHead, 2, 2, 64),
      layer(3, KvDtype::kBFloat16, KvDtype::kBFloat16, 4, 2, 8),
  };
  specs[3].attention = AttentionKind::kSlidingWindow;
  specs[3].sliding_window = 9;
  PagedKvCache cache(specs, 24);

  const std::vector<SequenceId> ids = {7, 3, 11};
  const std::vector<int> prompt = {21, 40, 5};
  for (SequenceId id : ids) cache.add_sequence(id);

  // Inputs and expected dequantized rows, per layer and sequence.
  std::vector<std::vector<std::vector<float>>> k_in(specs.size()), v_in(specs.size());
  std::vector<std::vector<DeqRows>> k_deq(specs.size()), v_deq(specs.size());
  for (size_t l = 0; l < specs.size(); ++l) {
    k_in[l].resize(ids.size());
    v_in[l].resize(ids.size());
    k_deq[l].resize(ids.size());
    v_deq[l].resize(ids.size());
  }

  // Appends n tokens to sequence i and writes them to every layer.
  auto append = [&](size_t i, int n) {
    const std::vector<int64_t> slots = cache.append(ids[i], n);
    ASSERT_EQ(slots.size(), static_cast<size_t>(n));
    for (size_t l = 0; l < specs.size(); ++l) {
      const LayerKvSpec& s = specs[l];
      std::vector<float> k(static_cast<size_t>(n) * s.num_kv_heads * s.head_dim_k);
      std::vector<float> v(static_cast<size_t>(n) * s.num_kv_heads * s.head_dim_v);
      for (float& x : k) x = normal(rng);
      for (float& x : v) x = normal(rng);
      write_kv_reference(s, cache.layer_view(l), slots, k.data(), v.data());
      for (KvSide side : {KvSide::kK, KvSide::kV}) {
        const std::vector<float>& in = side == KvSide::kK ? k : v;
        DeqRows& deq = side == KvSide::kK ? k_deq[l][i] : v_deq[l][i];
        const size_t dim = static_cast<size_t>(s.head_dim(side));
        const size_t old = deq.size();
        deq.resize(old + in.size());
        for (size_t r = 0; r < in.size() / dim; ++r)
          test::quantize_dequantize(
              s.dtype(side), std::span<const float>(in.data() + r * dim, dim),
              s.scale(side).for_head(static_cast<int>(r % static_cast<size_t>(s.num_kv_heads))),
              deq.data() + old + r * dim);
      }
    }
  };

  // Attention over every layer with q_len new tokens per sequence.
  auto attend = [&](const std::vector<int>& q_lens) {
    PagedKvCache::BlockTableStorage storage;
    const BlockTableView bt = cache.block_table(ids, storage);
    std::vector<SeqShape> shapes;
    std::vector<int32_t> q_indptr = {0};
    for (size_t i = 0; i < ids.size(); ++i) {
      shapes.push_back({cache.seq_len(ids[i]), q_lens[i]});
      q_indptr.push_back(q_indptr.back() + q_lens[i]);
    }
    for (size_t l = 0; l < specs.size(); ++l) {
      const LayerKvSpec& s = specs[l];
      std::vector<float> q(static_cast<size_t>(q_indptr.back()) * s.num_q_heads * s.head_dim_k);
      for (float& x : q) x = 2.0f * normal(rng);
      const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim_k));
      const std::vector<double> expected =
          test::exact_attention(s, scale, 0.0f, shapes, k_deq[l], v_deq[l], q.data());
      const BackendChoice choice = select_attention_backend(s, Device::kCpu);
      EXPECT_EQ(choice.backend->name(), s.head_dim_k == 8 ? "cpu_reference" : "cpu_avx512");
      // The integer Q·K's bound, from the K codes as the cache holds them.
      const LayerCacheView view = cache.layer_view(l);
      const KvSideLayout& kl = view.layout(KvSide::kK);
      std::vector<std::vector<test::KRowCodes>> codes(ids.size());
      for (size_t i = 0; i < ids.size(); ++i)
        for (int t = 0; t < shapes[i].kv_len; ++t)
          for (int g = 0; g < s.num_kv_heads; ++g) {
            const int32_t block = bt.indices[bt.indptr[i] + t / bt.block_tokens];
            const std::byte* base = view.block(KvSide::kK, block);
            codes[i].push_back(
                test::k_row_codes_of(s.k_dtype, base + kl.value_offset(g, t % bt.block_tokens),
                                     base + kl.scale_offset(g, t % bt.block_tokens), s.head_dim_k));
          }
      const test::IntQAttention int_q = test::int_q_attention(
          s, scale, 0.0f, shapes, k_deq[l], v_deq[l], q.data(),
          [&](size_t i, int t, int g) -> const test::KRowCodes& {
            return codes[i][static_cast<size_t>(t) * s.num_kv_heads + g];
          },
          [](size_t, size_t, int, int, double) { return 0.0; });
      for (const AttentionBackend* b : {choice.backend, find_attention_backend("cpu_reference")}) {
        std::vector<float> out(expected.size(), std::numeric_limits<float>::quiet_NaN());
        AttentionArgs a;
        a.q = q.data();
        a.out = out.data();
        a.q_indptr = q_indptr.data();
        a.block_table = bt;
        a.cache = cache.layer_view(l);
        a.softmax_scale = scale;
        b->run(s, a);
        const double tol = traits(s.k_dtype).rotated ? 1e-4 : 3e-5;
        const bool int_dot =
            b->name() == "cpu_avx512" &&
            cpu_attn::default_k_dot(cpu_attn::best_isa(), s.k_dtype) != cpu_attn::KDot::kFloat;
        EXPECT_TRUE(test::check_attention(s, shapes, v_deq[l], expected, out.data(), tol,
                                          int_dot ? int_q.bound.data() : nullptr))
            << b->name() << " on layer " << l << ", seed " << seed;
      }
    }
  };

  // Prompts written in interleaved chunks (blocks of different sequences interleave), then
  // prefill attention over whole prompts, then two decode steps.
  for (int done = 0; done < 40; done += 7)
    for (size_t i = 0; i < ids.size(); ++i)
      if (done < prompt[i]) append(i, std::min(7, prompt[i] - done));
  attend(prompt);
  for (int step = 0; step < 2; ++step) {
    for (size_t i = 0; i < ids.size(); ++i) append(i, 1);
    attend({1, 1, 1});
  }
}

}  // namespace
}  // namespace kvq
