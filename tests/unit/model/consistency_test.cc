// The same tokens give the same logits however they are fed: one prefill, chunks of varying
// sizes, token-by-token decode, or batched with another sequence (float32 cache).
#include <gtest/gtest.h>

#include <omp.h>
#include <algorithm>

#include <cstdio>

#include "model_test_util.h"

namespace kvq::test {
namespace {

// Per element: |a - b| <= 1e-4 * (1 + |b|) (only summation order differs between the runs).
void expect_close(const float* a, const float* b, size_t n, const std::string& what) {
  int bad = 0;
  double max_err = 0;
  for (size_t i = 0; i < n; ++i) {
    const double err = std::abs(static_cast<double>(a[i]) - b[i]);
    max_err = std::max(max_err, err);
    if (!(err <= 1e-4 * (1.0 + std::abs(b[i]))) && bad++ < 5)
      ADD_FAILURE() << what << " element " << i << ": " << a[i] << " vs " << b[i];
  }
  EXPECT_EQ(bad, 0) << what << " (max error " << max_err << ")";
}

TinySpec sliding_qwen3() {
  TinySpec s;
  s.family = "qwen3";
  s.layers = 3;
  s.q_heads = 8;
  s.layer_types = {"sliding_attention", "full_attention", "sliding_attention"};
  s.sliding_window = 11;
  return s;
}

TEST(Consistency, PrefillChunksAndDecodeAgree) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const TinySpec s = sliding_qwen3();
  const TinyModel m = make_tiny_model(s, rng);
  std::shared_ptr<const Model> model = Model::load(plan_for(m.dir));
  const int n = 45;  // crosses block boundaries (16) and the window (11)
  const auto tokens = random_tokens(n, s.vocab, rng);
  const size_t V = static_cast<size_t>(s.vocab);

  Runner whole(model, 8);
  const auto want = whole.step({1}, {tokens});

  // Chunks of random sizes 1..17.
  Runner chunked(model, 8);
  std::vector<float> got;
  std::uniform_int_distribution<int> size(1, 17);
  for (int at = 0; at < n;) {
    const int len = std::min(size(rng), n - at);
    const auto part = chunked.step({1}, {{tokens.begin() + at, tokens.begin() + at + len}});
    got.insert(got.end(), part.begin(), part.end());
    at += len;
  }
  expect_close(got.data(), want.data(), want.size(), "chunked prefill");

  // A short prefill, then one token at a time.
  Runner decode(model, 8);
  got = decode.step({1}, {{tokens.begin(), tokens.begin() + 3}});
  for (int t = 3; t < n; ++t) {
    const auto part = decode.step({1}, {{tokens[static_cast<size_t>(t)]}});
    got.insert(got.end(), part.begin(), part.end());
  }
  ASSERT_EQ(got.size(), n * V);
  expect_close(got.data(), want.data(), want.size(), "token-by-token decode");
}

TEST(Consistency, BatchedSequencesMatchEachAlone) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const TinySpec s = sliding_qwen3();
  const TinyModel m = make_tiny_model(s, rng);
  std::shared_ptr<const Model> model = Model::load(plan_for(m.dir));
  const size_t V = static_cast<size_t>(s.vocab);
  const auto a = random_tokens(29, s.vocab, rng), b = random_tokens(18, s.vocab, rng);

  Runner ra(model, 8), rb(model, 8), both(model, 16);
  const auto la = ra.step({1}, {a}), lb = rb.step({2}, {b});
  // Prefill both in one batch, then a mixed step: a decodes one token while b prefills 5.
  const auto lab = both.step({1, 2}, {a, b});
  expect_close(lab.data(), la.data(), la.size(), "sequence a in a batch");
  expect_close(lab.data() + la.size(), lb.data(), lb.size(), "sequence b in a batch");

  const auto a2 = random_tokens(1, s.vocab, rng), b2 = random_tokens(5, s.vocab, rng);
  const auto la2 = ra.step({1}, {a2}), lb2 = rb.step({2}, {b2});
  const auto lab2 = both.step({2, 1}, {b2, a2});  // order swapped on purpose
  ASSERT_EQ(lab2.size(), 6 * V);
  expect_close(lab2.data(), lb2.data(), lb2.size(), "b's chunk in a mixed batch");
  expect_close(lab2.data() + 5 * V, la2.data(), la2.size(), "a's decode in a mixed batch");
}

// Matrix products split over threads by output columns (few threads) or rows (many): the
// logits do not depend on the thread count.
TEST(Consistency, ThreadCountDoesNotChangeLogits) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const TinySpec s = sliding_qwen3();
  const TinyModel m = make_tiny_model(s, rng);
  std::shared_ptr<const Model> model = Model::load(plan_for(m.dir));
  const auto tokens = random_tokens(40, s.vocab, rng);
  const int saved = omp_get_max_threads();
  std::vector<std::vector<float>> runs;
  for (int threads : {1, 3, 8}) {
    omp_set_num_threads(threads);
    Runner r(model, 4);
    runs.push_back(r.step({1}, {tokens}));
    auto d = r.step({1}, {{tokens[0]}});  // a decode step too
    runs.back().insert(runs.back().end(), d.begin(), d.end());
  }
  omp_set_num_threads(saved);
  for (size_t i = 1; i < runs.size(); ++i)
    expect_close(runs[i].data(), runs[0].data(), runs[0].size(),
                 "threads run " + std::to_string(i));
}

// The weights shared by with_plan give the same logits as a fresh load.
TEST(Consistency, WithPlanSharesWeights) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  TinySpec s;
  s.layers = 2;
  const TinyModel m = make_tiny_model(s, rng);
  std::shared_ptr<const Model> bf16 = Model::load(plan_for(m.dir, KvDtype::kBFloat16));
  std::shared_ptr<const Model> f32 = bf16->with_plan(plan_for(m.dir, KvDtype::kFloat32));
  EXPECT_EQ(f32->plan().layers[0].k_dtype, KvDtype::kFloat32);
  std::shared_ptr<const Model> fresh = Model::load(plan_for(m.dir, KvDtype::kFloat32));
  const auto tokens = random_tokens(21, s.vocab, rng);
  Runner r1(f32, 4), r2(fresh, 4);
  const auto l1 = r1.step({1}, {tokens}), l2 = r2.step({1}, {tokens});
  ASSERT_EQ(l1, l2);

  TinySpec other = s;
  other.layers = 3;
  const TinyModel m3 = make_tiny_model(other, rng);
  EXPECT_THROW(bf16->with_plan(plan_for(m3.dir)), InputError);
}

}  // namespace
}  // namespace kvq::test
