// LlmEngine against generate() run alone: continuous batching, chunked prefill, preemption,
// prefix caching, cancellation, stop conditions, seeded sampling and input errors.
#include "kvq/engine/llm_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <future>
#include <thread>

#include "engine_test_util.h"
#include "kvq/core/error.h"
#include "kvq/tokenizer/tokenizer.h"

namespace kvq::test {
namespace {

SamplingParams greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  return p;
}

struct Job {
  std::vector<int32_t> prompt;
  SamplingParams params;
  RequestId id = 0;
  GenerationResult want;
};

// Submits every job from `threads` threads at once, waits for all, and checks each against its
// solo run and the event protocol.
void run_and_compare(LlmEngine& engine, std::vector<Job>& jobs, uint32_t seed, int threads,
                     Collector& collector, int* near_ties, const Model* solo_model = nullptr) {
  for (Job& j : jobs) j.want = solo(j.prompt, j.params, solo_model);
  const size_t finished_before = collector.num_finished();
  std::vector<std::thread> submitters;
  for (int t = 0; t < threads; ++t)
    submitters.emplace_back([&, t] {
      for (size_t i = static_cast<size_t>(t); i < jobs.size(); i += static_cast<size_t>(threads))
        jobs[i].id = engine.add_request(jobs[i].prompt, jobs[i].params, collector.callback());
    });
  for (auto& s : submitters) s.join();
  ASSERT_TRUE(collector.wait_finished(finished_before + jobs.size()))
      << "requests did not finish; seed " << seed;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Collected got = collector.get(jobs[i].id);
    SCOPED_TRACE("request " + std::to_string(i) + " (prompt " +
                 std::to_string(jobs[i].prompt.size()) + " tokens, max_tokens " +
                 std::to_string(jobs[i].params.max_tokens) + "), seed " + std::to_string(seed));
    EXPECT_EQ(got.finished_events, 1);
    EXPECT_EQ(got.events_after_final, 0);
    EXPECT_TRUE(got.counts_consistent);
    EXPECT_EQ(got.prompt_tokens, static_cast<int32_t>(jobs[i].prompt.size()));
    EXPECT_EQ(got.completion_tokens, static_cast<int32_t>(got.ids.size()));
    const std::string diff =
        compare_greedy(jobs[i].prompt, jobs[i].want, got, near_ties, solo_model);
    EXPECT_EQ(diff, "");
  }
}

void expect_idle(LlmEngine& engine) {
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.waiting, 0);
  EXPECT_EQ(s.blocks_used, 0) << "blocks still held after every request ended";
  EXPECT_LE(s.blocks_cached_free, s.blocks_total);
}

TEST(LlmEngine, ConcurrentGreedyRequestsMatchSoloRuns) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 256;
  config.max_num_seqs = 12;            // some requests wait
  config.max_num_batched_tokens = 48;  // long prompts are prefilled in chunks
  auto engine = make_engine(config);
  std::vector<Job> jobs(32);
  for (Job& j : jobs) {
    j.prompt = random_prompt(rng, std::uniform_int_distribution<int>(1, 70)(rng));
    j.params = greedy(std::uniform_int_distribution<int>(1, 20)(rng));
  }
  Collector collector;
  int near_ties = 0;
  run_and_compare(*engine, jobs, seed, 4, collector, &near_ties);
  EXPECT_LE(near_ties, 2) << "seed " << seed;
  const EngineStats s = engine->stats();
  EXPECT_EQ(s.requests_finished, 32);
  int64_t prompt_total = 0, generated_total = 0;
  for (const Job& j : jobs) {
    prompt_total += static_cast<int64_t>(j.prompt.size());
    generated_total += collector.get(j.id).completion_tokens;
  }
  EXPECT_EQ(s.prompt_tokens_total, prompt_total);
  EXPECT_EQ(s.generation_tokens_total, generated_total);
  EXPECT_EQ(s.preemptions, 0) << "a roomy cache needs no preemption";
  expect_idle(*engine);
}

class Preemption : public ::testing::TestWithParam<bool> {};

TEST_P(Preemption, TinyCacheStillGivesSoloOutputs) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 10;  // 160 tokens; each request alone needs up to 4 blocks
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 40;
  config.enable_prefix_caching = GetParam();
  auto engine = make_engine(config);
  std::vector<Job> jobs(8);
  for (Job& j : jobs) {
    j.prompt = random_prompt(rng, std::uniform_int_distribution<int>(8, 30)(rng));
    j.params = greedy(std::uniform_int_distribution<int>(20, 30)(rng));
    j.params.ignore_eos = true;  // every sequence grows to its full length
  }
  Collector collector;
  int near_ties = 0;
  run_and_compare(*engine, jobs, seed, 1, collector, &near_ties);
  EXPECT_LE(near_ties, 1) << "seed " << seed;
  for (const Job& j : jobs) {
    const Collected got = collector.get(j.id);
    EXPECT_EQ(got.finish_reason, "length");
    EXPECT_EQ(static_cast<int>(got.ids.size()), j.params.max_tokens) << "a request was truncated";
  }
  EXPECT_GT(engine->stats().preemptions, 0) << "the cache was meant to be too small; seed " << seed;
  expect_idle(*engine);
}

INSTANTIATE_TEST_SUITE_P(PrefixCaching, Preemption, ::testing::Bool());

// Under a bfloat16 and a quantized (fp8, per-tensor scale) cache.
class SharedPrefix : public ::testing::TestWithParam<KvDtype> {};

TEST_P(SharedPrefix, IsServedFromCacheWithSoloOutputs) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 128;
  const KvPlan plan = default_plan(GetParam());
  auto engine = make_engine(config, plan);
  const std::unique_ptr<Model> solo_model = engine_model(plan);
  const int bt = engine->model().plan().layers.front().block_tokens;
  const int full_blocks = 3;
  const std::vector<int32_t> common = random_prompt(rng, full_blocks * bt + 5);
  const int n = 6;
  std::vector<Job> jobs(n);
  for (int i = 0; i < n; ++i) {
    jobs[static_cast<size_t>(i)].prompt = common;
    // Distinct first suffix tokens: the requests share exactly the common full blocks.
    jobs[static_cast<size_t>(i)].prompt.push_back(100 + i);
    const auto tail = random_prompt(rng, std::uniform_int_distribution<int>(0, 20)(rng));
    jobs[static_cast<size_t>(i)].prompt.insert(jobs[static_cast<size_t>(i)].prompt.end(),
                                               tail.begin(), tail.end());
    jobs[static_cast<size_t>(i)].params = greedy(std::uniform_int_distribution<int>(4, 12)(rng));
  }
  Collector collector;
  int near_ties = 0;
  std::vector<Job> first(jobs.begin(), jobs.begin() + 1), rest(jobs.begin() + 1, jobs.end());
  run_and_compare(*engine, first, seed, 1, collector, &near_ties, solo_model.get());
  const EngineStats before = engine->stats();
  EXPECT_EQ(collector.get(first[0].id).cached_prompt_tokens, 0);
  EXPECT_EQ(before.prefix_cache_hits, 0);
  EXPECT_EQ(before.prefix_cache_queries, static_cast<int64_t>(first[0].prompt.size()));
  EXPECT_GE(before.blocks_cached_free, full_blocks) << "the finished request's blocks stay cached";

  run_and_compare(*engine, rest, seed, 2, collector, &near_ties, solo_model.get());
  EXPECT_LE(near_ties, 1) << "seed " << seed;
  const EngineStats after = engine->stats();
  int64_t queried = 0;
  for (const Job& j : rest) {
    EXPECT_EQ(collector.get(j.id).cached_prompt_tokens, full_blocks * bt) << "seed " << seed;
    queried += static_cast<int64_t>(j.prompt.size());
  }
  EXPECT_EQ(after.prefix_cache_hits - before.prefix_cache_hits,
            static_cast<int64_t>(n - 1) * full_blocks * bt);
  EXPECT_EQ(after.prefix_cache_queries - before.prefix_cache_queries, queried);
  expect_idle(*engine);

  // The same prompt again: every full block but the one holding the last token is reused
  // (the last token is computed for its logits), and a follow-up that extends the first
  // request's prompt with its output reuses the blocks filled while generating.
  Job again;
  again.prompt = std::vector<int32_t>(common.begin(), common.begin() + 2 * bt);
  again.params = greedy(3);
  Job follow;
  const Collected first_out = collector.get(first[0].id);
  follow.prompt = first[0].prompt;
  follow.prompt.insert(follow.prompt.end(), first_out.ids.begin(), first_out.ids.end());
  follow.params = greedy(3);
  std::vector<Job> more = {again, follow};
  run_and_compare(*engine, more, seed, 1, collector, &near_ties, solo_model.get());
  EXPECT_EQ(collector.get(more[0].id).cached_prompt_tokens, bt);
  const int follow_len = static_cast<int>(follow.prompt.size());
  // Blocks filled by the first request's K/V: its prompt and all but its last output token.
  const int first_computed = static_cast<int>(first[0].prompt.size() + first_out.ids.size()) - 1;
  EXPECT_EQ(collector.get(more[1].id).cached_prompt_tokens,
            std::min(first_computed, follow_len - 1) / bt * bt);
  expect_idle(*engine);
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, SharedPrefix,
                         ::testing::Values(KvDtype::kBFloat16, KvDtype::kFp8E4M3),
                         [](const auto& p) { return std::string(to_string(p.param)); });

// Everything at once on a tiny cache: shared prefixes, preemption, chunked prefill with a random
// token budget, and cancellations from callbacks at random points. Every request ends exactly
// once, the ones not cancelled give their solo outputs, and no block stays owned.
TEST(LlmEngine, MixedLoadOnTinyCache) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 12;
  config.max_num_seqs = std::uniform_int_distribution<int>(2, 8)(rng);
  config.max_num_batched_tokens = std::uniform_int_distribution<int>(8, 64)(rng);
  SCOPED_TRACE("seed " + std::to_string(seed) + ", max_num_seqs " +
               std::to_string(config.max_num_seqs) + ", max_num_batched_tokens " +
               std::to_string(config.max_num_batched_tokens));
  auto engine = make_engine(config);
  LlmEngine* e = engine.get();
  const std::vector<std::vector<int32_t>> prefixes = {random_prompt(rng, 35),
                                                      random_prompt(rng, 20)};
  const int n = 14;
  std::vector<Job> jobs(static_cast<size_t>(n));
  std::vector<int> cancel_at(static_cast<size_t>(n), -1);
  for (int i = 0; i < n; ++i) {
    Job& j = jobs[static_cast<size_t>(i)];
    j.prompt = prefixes[static_cast<size_t>(i % 2)];
    j.prompt.resize(static_cast<size_t>(
        std::uniform_int_distribution<int>(1, static_cast<int>(j.prompt.size()))(rng)));
    const auto tail = random_prompt(rng, std::uniform_int_distribution<int>(0, 15)(rng));
    j.prompt.insert(j.prompt.end(), tail.begin(), tail.end());
    j.params = greedy(std::uniform_int_distribution<int>(5, 30)(rng));
    j.params.ignore_eos = true;
    if (i % 3 == 1)
      cancel_at[static_cast<size_t>(i)] = std::uniform_int_distribution<int>(1, 4)(rng);
  }
  Collector collector;
  std::vector<RequestId> ids;
  for (int i = 0; i < n; ++i) {
    const int at = cancel_at[static_cast<size_t>(i)];
    ids.push_back(engine->add_request(jobs[static_cast<size_t>(i)].prompt,
                                      jobs[static_cast<size_t>(i)].params,
                                      collector.callback([e, at](const RequestOutput& o) {
                                        if (!o.finished && o.completion_tokens == at)
                                          e->cancel(o.id);
                                      })));
  }
  ASSERT_TRUE(collector.wait_finished(static_cast<size_t>(n)));
  int near_ties = 0;
  for (int i = 0; i < n; ++i) {
    const Collected got = collector.get(ids[static_cast<size_t>(i)]);
    SCOPED_TRACE("request " + std::to_string(i));
    EXPECT_EQ(got.finished_events, 1);
    EXPECT_EQ(got.events_after_final, 0);
    EXPECT_TRUE(got.counts_consistent);
    const int at = cancel_at[static_cast<size_t>(i)];
    if (at >= 0) {
      EXPECT_EQ(got.finish_reason, "cancelled");
      EXPECT_EQ(static_cast<int>(got.ids.size()), at);
    } else {
      const Job& j = jobs[static_cast<size_t>(i)];
      EXPECT_EQ(compare_greedy(j.prompt, solo(j.prompt, j.params), got, &near_ties), "");
    }
  }
  EXPECT_LE(near_ties, 1);
  const EngineStats s = engine->stats();
  EXPECT_EQ(s.requests_finished, n);
  expect_idle(*engine);
}

TEST(LlmEngine, CancelFromAnotherThreadAndFromTheCallback) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 64;
  config.max_num_seqs = 2;
  auto engine = make_engine(config);
  Collector collector;
  SamplingParams long_run = greedy(400);
  long_run.ignore_eos = true;

  // a: cancelled from this thread mid-generation. b: cancels itself from its callback once
  // told to, and records at how many tokens it did.
  const RequestId a = engine->add_request(random_prompt(rng, 20), long_run, collector.callback());
  LlmEngine* e = engine.get();
  std::atomic<bool> b_should_cancel{false};
  std::atomic<int32_t> b_cancelled_at{-1};
  const RequestId b = engine->add_request(
      random_prompt(rng, 12), long_run, collector.callback([&, e](const RequestOutput& o) {
        if (!o.finished && b_should_cancel && b_cancelled_at < 0) {
          b_cancelled_at = o.completion_tokens;
          e->cancel(o.id);
        }
      }));
  ASSERT_TRUE(collector.wait_tokens(a, 2) && collector.wait_tokens(b, 1)) << "seed " << seed;
  // c: waits (a and b fill max_num_seqs) and is cancelled before it ever runs.
  const RequestId c = engine->add_request(random_prompt(rng, 5), long_run, collector.callback());
  engine->cancel(c);
  ASSERT_TRUE(collector.wait_finished(1)) << "seed " << seed;
  EXPECT_EQ(collector.get(c).finish_reason, "cancelled");
  EXPECT_TRUE(collector.get(c).ids.empty());
  engine->cancel(a);
  b_should_cancel = true;
  ASSERT_TRUE(collector.wait_finished(3)) << "seed " << seed;

  // A request finishing normally; cancelling it later (and an unknown id) changes nothing.
  const RequestId d = engine->add_request(random_prompt(rng, 7), greedy(2), collector.callback());
  ASSERT_TRUE(collector.wait_finished(4));
  engine->cancel(d);
  engine->cancel(d + 1000);
  engine->cancel(a);

  for (RequestId id : {a, b, c}) {
    const Collected got = collector.get(id);
    SCOPED_TRACE("request " + std::to_string(id) + ", seed " + std::to_string(seed));
    EXPECT_EQ(got.finish_reason, "cancelled");
    EXPECT_EQ(got.finished_events, 1);
    EXPECT_EQ(got.events_after_final, 0);
    EXPECT_LT(got.ids.size(), 400u);
  }
  EXPECT_GE(collector.get(a).ids.size(), 2u);
  EXPECT_EQ(static_cast<int32_t>(collector.get(b).ids.size()), b_cancelled_at.load())
      << "a cancel from the callback takes effect before the next token";
  // A short round trip through the engine so late cancels would have been processed.
  const RequestId f = engine->add_request(random_prompt(rng, 3), greedy(1), collector.callback());
  ASSERT_TRUE(collector.wait_finished(5));
  EXPECT_EQ(collector.get(d).finish_reason, "length");
  EXPECT_EQ(collector.get(d).finished_events, 1);
  EXPECT_EQ(collector.get(d).events_after_final, 0);
  EXPECT_EQ(collector.get(f).finished_events, 1);
  expect_idle(*engine);
  EXPECT_EQ(engine->stats().requests_finished, 5);
}

// A callback may queue the next request (a chain, as a multi-turn client would), and a callback
// that throws gets its request cancelled instead of killing the engine thread.
TEST(LlmEngine, CallbacksMaySubmitAndThrow) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 64;
  auto engine = make_engine(config);
  LlmEngine* e = engine.get();
  Collector collector;
  std::mutex mu;
  std::vector<RequestId> chain;
  SamplingParams three = greedy(3);
  three.ignore_eos = true;
  std::function<void(const RequestOutput&)> follow = [&](const RequestOutput& o) {
    if (!o.finished) return;
    std::lock_guard lock(mu);
    if (chain.size() < 5)
      chain.push_back(e->add_request({o.token_ids.empty() ? 1 : o.token_ids.back(), 7, 9}, three,
                                     collector.callback(follow)));
  };
  {
    std::lock_guard lock(mu);
    chain.push_back(engine->add_request(random_prompt(rng, 6), three, collector.callback(follow)));
  }
  SamplingParams long_run = greedy(300);
  long_run.ignore_eos = true;
  const RequestId thrower = engine->add_request(random_prompt(rng, 6), long_run,
                                                collector.callback([](const RequestOutput& o) {
                                                  if (o.completion_tokens == 2)
                                                    throw std::runtime_error("client went away");
                                                }));
  ASSERT_TRUE(collector.wait_finished(6)) << "seed " << seed;
  std::lock_guard lock(mu);
  ASSERT_EQ(chain.size(), 5u);
  for (RequestId id : chain) {
    EXPECT_EQ(collector.get(id).finished_events, 1);
    EXPECT_EQ(collector.get(id).ids.size(), 3u);
  }
  EXPECT_EQ(collector.get(thrower).finish_reason, "cancelled");
  EXPECT_EQ(collector.get(thrower).ids.size(), 2u);
  expect_idle(*engine);
}

TEST(LlmEngine, DestructorCancelsUnfinishedRequests) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  Collector collector;
  std::vector<RequestId> ids;
  {
    EngineConfig config;
    config.num_blocks = 64;
    config.max_num_seqs = 2;
    auto engine = make_engine(config);
    SamplingParams p = greedy(500);
    p.ignore_eos = true;
    for (int i = 0; i < 4; ++i)
      ids.push_back(engine->add_request(random_prompt(rng, 10), p, collector.callback()));
    ASSERT_TRUE(collector.wait_tokens(ids[0], 1)) << "seed " << seed;
  }
  EXPECT_EQ(collector.num_finished(), 4u);
  for (RequestId id : ids) {
    const Collected got = collector.get(id);
    EXPECT_EQ(got.finished_events, 1) << "request " << id;
    EXPECT_EQ(got.finish_reason, "cancelled") << "request " << id;
  }
}

// What a request must give, worked out from a free run (ignore_eos, no stops) independently of
// the shared stop logic: the ids up to the stop, the decoded text before it, the reason.
struct Expected {
  std::vector<int32_t> ids;
  std::string text;
  std::string reason;
};

Expected expect_from_free_run(const Tokenizer& tok, const std::vector<int32_t>& free_ids,
                              const SamplingParams& p) {
  std::vector<int32_t> stop_ids = p.stop_token_ids;
  if (!p.ignore_eos)
    for (int32_t id : tok.eos_ids()) stop_ids.push_back(id);
  const auto decode = [&](size_t n) {
    return tok.decode(std::span<const int32_t>(free_ids.data(), n), true);
  };
  for (size_t k = 0; k < free_ids.size() && k < static_cast<size_t>(p.max_tokens); ++k) {
    const std::vector<int32_t> ids(free_ids.begin(),
                                   free_ids.begin() + static_cast<std::ptrdiff_t>(k + 1));
    if (std::find(stop_ids.begin(), stop_ids.end(), free_ids[k]) != stop_ids.end())
      return {ids, decode(k), "stop"};
    const std::string text = decode(k + 1);
    size_t cut = std::string::npos;
    for (const auto& stop : p.stop) cut = std::min(cut, text.find(stop));
    if (cut != std::string::npos) return {ids, text.substr(0, cut), "stop"};
  }
  const size_t n = std::min(free_ids.size(), static_cast<size_t>(p.max_tokens));
  return {std::vector<int32_t>(free_ids.begin(), free_ids.begin() + static_cast<std::ptrdiff_t>(n)),
          decode(n), "length"};
}

TEST(LlmEngine, StopConditionsMatchGenerate) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 256;
  auto engine = make_engine(config);
  const Tokenizer& tok = engine->tokenizer();
  std::vector<Job> jobs;
  std::vector<Expected> expected;
  // Real code prompts give readable (ASCII) text for stop strings.
  for (const char* text : {"def fibonacci(n):", "import os\n\ndef ",
                           "class Stack:\n    def __init__(self):", "for i in range(10):\n    "}) {
    const std::vector<int32_t> prompt = tok.encode(text, true);
    SamplingParams base = greedy(40);
    base.ignore_eos = true;
    const GenerationResult free_run = solo(prompt, base);
    ASSERT_EQ(free_run.output_ids.size(), 40u);
    std::vector<Job> more;
    // A stop string taken from the free-running text (1-3 characters), and one that never occurs.
    if (free_run.text.size() > 8) {
      const size_t at = std::uniform_int_distribution<size_t>(2, free_run.text.size() - 4)(rng);
      Job j{prompt, base, 0, {}};
      j.params.stop = {free_run.text.substr(at, std::uniform_int_distribution<size_t>(1, 3)(rng)),
                       "@@never@@"};
      more.push_back(j);
    }
    // A stop token: one of the generated ids.
    Job t{prompt, base, 0, {}};
    t.params.stop_token_ids = {
        free_run.output_ids[std::uniform_int_distribution<size_t>(0, 9)(rng)]};
    more.push_back(t);
    // EOS honoured (not ignored), and ignore_eos with a short max_tokens.
    more.push_back(Job{prompt, greedy(std::uniform_int_distribution<int>(1, 40)(rng)), 0, {}});
    Job length{prompt, base, 0, {}};
    length.params.max_tokens = std::uniform_int_distribution<int>(1, 15)(rng);
    more.push_back(length);
    for (Job& j : more) {
      expected.push_back(expect_from_free_run(tok, free_run.output_ids, j.params));
      jobs.push_back(std::move(j));
    }
  }
  Collector collector;
  int near_ties = 0;
  run_and_compare(*engine, jobs, seed, 2, collector, &near_ties);
  int stops = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Collected got = collector.get(jobs[i].id);
    stops += got.finish_reason == "stop";
    if (near_ties > 0) continue;  // the free run no longer predicts the output
    SCOPED_TRACE("job " + std::to_string(i) + ", seed " + std::to_string(seed));
    EXPECT_EQ(got.ids, expected[i].ids);
    EXPECT_EQ(got.text, expected[i].text);
    EXPECT_EQ(got.finish_reason, expected[i].reason);
  }
  EXPECT_GT(stops, 0) << "no stop condition fired; seed " << seed;
  expect_idle(*engine);
}

TEST(LlmEngine, ContextLimitEndsWithLength) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 160;
  config.max_num_batched_tokens = 1024;
  auto engine = make_engine(config);
  const int context = engine->context_length();
  SamplingParams p = greedy(50);
  p.ignore_eos = true;
  Collector collector;
  const RequestId id =
      engine->add_request(random_prompt(rng, context - 3), p, collector.callback());
  ASSERT_TRUE(collector.wait_finished(1)) << "seed " << seed;
  const Collected got = collector.get(id);
  EXPECT_EQ(got.finish_reason, "length");
  EXPECT_EQ(got.ids.size(), 3u) << "the sequence may not exceed the context";
  expect_idle(*engine);
}

TEST(LlmEngine, SeededSamplingIsReproducibleInAnyBatch) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 256;
  config.max_num_batched_tokens = 32;
  // A float32 cache: a bfloat16 one can round a K/V element differently after a last-bit
  // difference in a batched matrix product, and a logit moved by 1e-3 can flip a seeded draw
  // that lands near a bucket edge (seen about once in 14 runs). With float32 only the
  // summation order differs, by ~1e-6.
  const KvPlan f32 = default_plan(KvDtype::kFloat32);
  auto engine = make_engine(config, f32);
  const std::unique_ptr<Model> reference = reference_model()->with_plan(f32);
  SamplingParams p;
  p.temperature = 0.9f;
  p.top_p = 0.95f;
  p.top_k = 50;
  p.seed = rng();
  p.max_tokens = 16;
  p.ignore_eos = true;
  const std::vector<int32_t> prompt = random_prompt(rng, 21);
  const GenerationResult want =
      generate(*reference, reference_tokenizer(), prompt, p, GeneratorOptions{});

  Collector collector;
  const RequestId alone = engine->add_request(prompt, p, collector.callback(), true);
  ASSERT_TRUE(collector.wait_finished(1));
  // The same request in the middle of a crowd of others (greedy and sampled).
  std::vector<RequestId> crowd;
  for (int i = 0; i < 6; ++i) {
    SamplingParams q = p;
    q.seed = rng();
    if (i % 2) q.temperature = 0.0f;
    crowd.push_back(engine->add_request(random_prompt(rng, 5 + 7 * i), q, collector.callback()));
    if (i == 2) crowd.push_back(engine->add_request(prompt, p, collector.callback(), true));
  }
  ASSERT_TRUE(collector.wait_finished(8)) << "seed " << seed;
  const Collected a = collector.get(alone), b = collector.get(crowd[3]);
  EXPECT_EQ(a.ids, want.output_ids) << "seed " << seed;
  EXPECT_EQ(b.ids, want.output_ids) << "seed " << seed;
  EXPECT_EQ(b.text, want.text);
  ASSERT_EQ(a.logprobs.size(), a.ids.size());
  ASSERT_EQ(b.logprobs.size(), b.ids.size());
  for (size_t i = 0; i < a.logprobs.size(); ++i) {
    EXPECT_LE(a.logprobs[i], 0.0f);
    EXPECT_NEAR(a.logprobs[i], b.logprobs[i], 1e-3f * (1.0f + std::abs(a.logprobs[i])))
        << "token " << i;
  }
  EXPECT_TRUE(collector.get(crowd[0]).logprobs.empty()) << "logprobs only when asked";
  expect_idle(*engine);
}

TEST(LlmEngine, LogprobsAreTheModelsLogSoftmax) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 32;
  // A float32 cache: only summation order differs from the reference pass.
  const KvPlan f32 = default_plan(KvDtype::kFloat32);
  auto engine = make_engine(config, f32);
  const std::unique_ptr<Model> reference = reference_model()->with_plan(f32);
  const std::vector<int32_t> prompt = random_prompt(rng, 9);
  Collector collector;
  constexpr int kTop = 3;
  const RequestId id = engine->add_request(prompt, greedy(4), collector.callback(), true, kTop);
  ASSERT_TRUE(collector.wait_finished(1));
  const Collected got = collector.get(id);
  ASSERT_EQ(got.logprobs.size(), got.ids.size());
  ASSERT_EQ(got.top.size(), got.ids.size());
  std::vector<int32_t> tokens = prompt;
  tokens.insert(tokens.end(), got.ids.begin(), got.ids.end());
  score_tokens(*reference, tokens, 64, [&](int32_t pos, std::span<const float> l) {
    const int32_t k = pos - static_cast<int32_t>(prompt.size()) + 1;
    if (k < 0 || k >= static_cast<int32_t>(got.ids.size())) return;
    double max = l[0], sum = 0;
    for (float x : l) max = std::max(max, static_cast<double>(x));
    for (float x : l) sum += std::exp(x - max);
    const double z = max + std::log(sum);
    const double want = l[static_cast<size_t>(got.ids[static_cast<size_t>(k)])] - z;
    EXPECT_NEAR(got.logprobs[static_cast<size_t>(k)], want, 1e-3 * (1 + std::abs(want)))
        << "token " << k << ", seed " << seed;
    // The alternatives: the reference's kTop largest, most likely first (greedy: the chosen
    // token leads), each at its log-softmax.
    const auto& top = got.top[static_cast<size_t>(k)];
    ASSERT_EQ(top.size(), static_cast<size_t>(kTop)) << "token " << k;
    EXPECT_EQ(top[0].first, got.ids[static_cast<size_t>(k)]) << "token " << k;
    std::vector<double> sorted(l.begin(), l.end());
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    for (int j = 0; j < kTop; ++j) {
      const auto [tid, lp] = top[static_cast<size_t>(j)];
      EXPECT_NEAR(lp, l[static_cast<size_t>(tid)] - z, 1e-3 * (1 + std::abs(lp)))
          << "token " << k << " alternative " << j;
      // Its logit is the j-th largest (up to the engine's own rounding of near ties).
      EXPECT_NEAR(l[static_cast<size_t>(tid)], sorted[static_cast<size_t>(j)], 1e-3)
          << "token " << k << " alternative " << j;
      if (j > 0) {
        EXPECT_GE(top[static_cast<size_t>(j) - 1].second, lp);
      }
    }
  });
  // More than the engine gives is refused before queueing.
  EXPECT_THROW(engine->add_request(prompt, greedy(2), collector.callback(), true,
                                   LlmEngine::kMaxTopLogprobs + 1),
               InputError);
}

TEST(LlmEngine, BadRequestsAreRefusedBeforeQueueing) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 8;  // 128 tokens
  auto engine = make_engine(config);
  const int context = engine->context_length();
  Collector collector;
  const auto expect_refused = [&](std::vector<int32_t> prompt, const SamplingParams& p,
                                  const std::string& mention) {
    try {
      engine->add_request(std::move(prompt), p, collector.callback());
      ADD_FAILURE() << "accepted; expected an InputError mentioning '" << mention << "'";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(mention), std::string::npos) << e.what();
    }
  };
  expect_refused({}, greedy(4), "empty");
  expect_refused(random_prompt(rng, context), greedy(4), "context");
  expect_refused(random_prompt(rng, 100), greedy(29), "blocks");  // 129 tokens > 8 blocks of 16
  expect_refused({1, 2, engine->model().vocab_size()}, greedy(4), "out of range");
  SamplingParams bad = greedy(4);
  bad.temperature = -1.0f;
  expect_refused({1, 2}, bad, "temperature");
  bad = greedy(4);
  bad.top_p = 0.0f;
  expect_refused({1, 2}, bad, "top_p");
  expect_refused({1, 2}, greedy(0), "max_tokens");
  bad = greedy(4);
  bad.stop = {""};
  expect_refused({1, 2}, bad, "stop");
  // Exactly the whole cache is fine.
  const RequestId ok =
      engine->add_request(random_prompt(rng, 100), greedy(28), collector.callback());
  ASSERT_TRUE(collector.wait_finished(1)) << "seed " << seed;
  EXPECT_EQ(collector.get(ok).finished_events, 1);
  EXPECT_EQ(engine->stats().requests_finished, 1) << "refused requests are never queued";

  EngineConfig broken;
  EXPECT_THROW(make_engine(broken), InputError);  // num_blocks 0
  broken.num_blocks = 4;
  broken.max_num_batched_tokens = 0;
  EXPECT_THROW(make_engine(broken), InputError);
}

// add_requests queues a batch at once: ids in order, the same outputs as solo runs, and an
// invalid request anywhere in the batch queues none of them.
TEST(LlmEngine, AddRequestsQueuesABatchOrNone) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 64;
  auto engine = make_engine(config);
  Collector collector;
  std::vector<LlmEngine::NewRequest> batch;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(random_prompt(rng, std::uniform_int_distribution<int>(1, 40)(rng)));
    batch.push_back({prompts.back(), greedy(8), collector.callback()});
  }
  auto bad = batch;
  bad[1].prompt.clear();
  EXPECT_THROW(engine->add_requests(std::move(bad)), InputError);
  const std::vector<RequestId> ids = engine->add_requests(std::move(batch));
  ASSERT_EQ(ids.size(), 3u);
  // The refused batch took no id: a fresh engine's first ids, in order.
  EXPECT_EQ(ids[0], 1u);
  EXPECT_EQ(ids[1], 2u);
  EXPECT_EQ(ids[2], 3u);
  ASSERT_TRUE(collector.wait_finished(3)) << "seed " << seed;
  for (size_t i = 0; i < 3; ++i) {
    const GenerationResult want =
        generate(engine->model(), engine->tokenizer(), prompts[i], greedy(8), {});
    int near_ties = 0;
    EXPECT_EQ(compare_greedy(prompts[i], want, collector.get(ids[i]), &near_ties, &engine->model()),
              "")
        << "seed " << seed;
  }
  EXPECT_EQ(engine->stats().requests_finished, 3) << "the refused batch queued nothing";
  expect_idle(*engine);
}

}  // namespace
}  // namespace kvq::test
