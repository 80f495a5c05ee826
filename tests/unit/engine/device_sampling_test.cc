// The engine's path for models that sample where their logits are (Model::samples_on_device,
// a CUDA model): generate() and LlmEngine hand each logit row's rule to forward_sample and use
// the ids it returns. Exercised on the CPU through a wrapper model that samples on the host
// with the same contract: it records every rule it is given.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "engine_test_util.h"
#include "kvq/engine/sampler.h"
#include "kvq/tokenizer/tokenizer.h"

namespace kvq::test {
namespace {

class SamplingProbe final : public Model {
 public:
  explicit SamplingProbe(std::unique_ptr<Model> inner) : inner_(std::move(inner)) {}

  std::unique_ptr<Model> with_plan(const KvPlan& plan, std::string_view backend) const override {
    return std::make_unique<SamplingProbe>(inner_->with_plan(plan, backend));
  }
  const KvPlan& plan() const override { return inner_->plan(); }
  const ArchitectureConfig& arch() const override { return inner_->arch(); }
  int vocab_size() const override { return inner_->vocab_size(); }
  std::vector<const AttentionBackend*> layer_backends() const override {
    return inner_->layer_backends();
  }
  void forward(const ForwardBatch& b, PagedKvCache& cache, std::span<float> logits) const override {
    std::lock_guard lock(mu_);
    ++forward_calls_;
    inner_->forward(b, cache, logits);
  }
  bool samples_on_device() const override { return true; }
  void forward_sample(const ForwardBatch& b, PagedKvCache& cache,
                      std::span<const DeviceSampling> per_row,
                      std::span<int32_t> next) const override {
    const size_t R = b.logit_rows.size(), V = static_cast<size_t>(vocab_size());
    EXPECT_EQ(next.size(), R);
    EXPECT_TRUE(per_row.size() == R || per_row.size() == 1);
    std::vector<float> logits(R * V);
    inner_->forward(b, cache, logits);
    std::lock_guard lock(mu_);
    ++sample_calls_;
    for (size_t i = 0; i < R; ++i) {
      const DeviceSampling& d = per_row[per_row.size() == 1 ? 0 : i];
      rules_.push_back(d);
      // A draw that depends only on (seed, step), as the device's does.
      SamplingParams p;
      p.temperature = d.temperature;
      p.top_k = d.top_k;
      p.top_p = d.top_p;
      p.min_p = d.min_p;
      p.seed = d.seed * 1000003u + d.step;
      next[i] = Sampler(p).sample(std::span<const float>(logits.data() + i * V, V));
    }
  }

  int forward_calls() const {
    std::lock_guard lock(mu_);
    return forward_calls_;
  }
  int sample_calls() const {
    std::lock_guard lock(mu_);
    return sample_calls_;
  }
  std::vector<DeviceSampling> rules() const {
    std::lock_guard lock(mu_);
    return rules_;
  }

 private:
  std::unique_ptr<Model> inner_;
  mutable std::mutex mu_;
  mutable int forward_calls_ = 0;
  mutable int sample_calls_ = 0;
  mutable std::vector<DeviceSampling> rules_;
};

SamplingParams greedy_params(int max_tokens) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

TEST(DeviceSamplingPath, GenerateSamplesThroughTheModelWithStepNumbers) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  SamplingProbe probe(reference_model()->with_plan(default_plan()));
  const std::vector<int32_t> prompt = random_prompt(rng, 40);
  GeneratorOptions options;
  options.prefill_chunk = 16;  // 3 chunks: only the last one samples
  const int n = 12;
  const GenerationResult want =
      generate(*reference_model(), reference_tokenizer(), prompt, greedy_params(n), options);
  const GenerationResult got =
      generate(probe, reference_tokenizer(), prompt, greedy_params(n), options);
  EXPECT_EQ(got.output_ids, want.output_ids) << "seed " << seed;
  EXPECT_EQ(probe.forward_calls(), 2) << "the two earlier prefill chunks need no logits";
  EXPECT_EQ(probe.sample_calls(), n) << "the last prefill chunk and n - 1 decode steps";
  const std::vector<DeviceSampling> rules = probe.rules();
  ASSERT_EQ(rules.size(), static_cast<size_t>(n));
  for (size_t i = 0; i < rules.size(); ++i) {
    EXPECT_EQ(rules[i].temperature, 0.0f);
    EXPECT_EQ(rules[i].step, i);
  }

  // A seeded draw passes the request's seed and rule; the same seed gives the same tokens.
  SamplingParams s;
  s.temperature = 0.8f;
  s.top_k = 20;
  s.top_p = 0.9f;
  s.min_p = 0.01f;
  s.seed = rng();
  s.max_tokens = 10;
  s.ignore_eos = true;
  SamplingProbe a(reference_model()->with_plan(default_plan()));
  SamplingProbe b(reference_model()->with_plan(default_plan()));
  const GenerationResult ra = generate(a, reference_tokenizer(), prompt, s, options);
  const GenerationResult rb = generate(b, reference_tokenizer(), prompt, s, options);
  EXPECT_EQ(ra.output_ids, rb.output_ids) << "seed " << seed;
  for (const DeviceSampling& d : a.rules()) {
    EXPECT_EQ(d.seed, *s.seed);
    EXPECT_EQ(d.temperature, s.temperature);
    EXPECT_EQ(d.top_k, s.top_k);
    EXPECT_EQ(d.top_p, s.top_p);
    EXPECT_EQ(d.min_p, s.min_p);
  }
  // top_k 1 is greedy whatever the temperature.
  SamplingParams k1 = s;
  k1.top_k = 1;
  SamplingProbe c(reference_model()->with_plan(default_plan()));
  const GenerationResult rc = generate(c, reference_tokenizer(), prompt, k1, options);
  EXPECT_EQ(c.rules().front().temperature, 0.0f);
  EXPECT_EQ(std::vector<int32_t>(rc.output_ids.begin(), rc.output_ids.end()),
            std::vector<int32_t>(want.output_ids.begin(), want.output_ids.begin() + 10))
      << "seed " << seed;
}

TEST(DeviceSamplingPath, EngineBatchesSampleThroughTheModel) {
  KVQ_REQUIRE_MODEL();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  EngineConfig config;
  config.num_blocks = 128;
  config.max_num_seqs = 6;
  config.max_num_batched_tokens = 40;
  auto owned = std::make_unique<SamplingProbe>(reference_model()->with_plan(default_plan()));
  const SamplingProbe* probe = owned.get();
  LlmEngine engine(std::move(owned), std::make_unique<Tokenizer>(Tokenizer::load(kModelDir)),
                   config);
  struct Job {
    std::vector<int32_t> prompt;
    SamplingParams params;
    RequestId id = 0;
  };
  std::vector<Job> jobs(10);
  for (size_t i = 0; i < jobs.size(); ++i) {
    jobs[i].prompt = random_prompt(rng, std::uniform_int_distribution<int>(1, 50)(rng));
    jobs[i].params = greedy_params(std::uniform_int_distribution<int>(1, 12)(rng));
    if (i % 2 == 1) {  // seeded samples: their tokens depend only on (seed, step)
      jobs[i].params.temperature = 0.9f;
      jobs[i].params.top_p = 0.95f;
      jobs[i].params.seed = 1000 + i;
    }
  }
  Collector collector;
  for (Job& j : jobs) j.id = engine.add_request(j.prompt, j.params, collector.callback());
  ASSERT_TRUE(collector.wait_finished(jobs.size())) << "seed " << seed;
  EXPECT_EQ(probe->forward_calls(), 0) << "no request asked for logprobs";
  EXPECT_GT(probe->sample_calls(), 0);
  for (const Job& j : jobs) {
    // The same request alone through generate() on the same wrapper: identical ids (greedy
    // ties aside, which compare_greedy accepts; seeded draws are per (seed, step)).
    SamplingProbe solo_probe(reference_model()->with_plan(default_plan()));
    const GenerationResult want =
        generate(solo_probe, reference_tokenizer(), j.prompt, j.params, GeneratorOptions{});
    const Collected got = collector.get(j.id);
    if (!j.params.seed) {
      int near_ties = 0;
      EXPECT_EQ(compare_greedy(j.prompt, want, got, &near_ties), "") << "seed " << seed;
    } else {
      // A near tie in an earlier token changes the rest; the first token must agree.
      ASSERT_FALSE(got.ids.empty());
      EXPECT_EQ(got.ids.front(), want.output_ids.front()) << "seed " << seed;
    }
  }
  // Each request's rules carry its own step numbers 0, 1, 2, ...
  std::map<uint64_t, std::vector<uint64_t>> steps_by_seed;
  for (const DeviceSampling& d : probe->rules())
    if (d.temperature > 0.0f) steps_by_seed[d.seed].push_back(d.step);
  EXPECT_EQ(steps_by_seed.size(), jobs.size() / 2);
  for (const auto& [s, steps] : steps_by_seed)
    for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i], i) << "request seed " << s;

  // A request that wants logprobs needs whole rows: that batch goes through forward().
  const std::vector<int32_t> prompt = random_prompt(rng, 7);
  const RequestId id = engine.add_request(prompt, greedy_params(3), collector.callback(), true);
  ASSERT_TRUE(collector.wait_finished(jobs.size() + 1));
  EXPECT_GT(probe->forward_calls(), 0);
  EXPECT_EQ(collector.get(id).logprobs.size(), 3u);
}

}  // namespace
}  // namespace kvq::test
