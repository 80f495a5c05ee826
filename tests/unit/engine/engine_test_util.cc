#include "engine_test_util.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "kvq/plan/model_config.h"
#include "kvq/tokenizer/tokenizer.h"

namespace kvq::test {

namespace {

struct Loaded {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

const Loaded& loaded() {
  static const Loaded l = [] {
    Loaded r;
    if (!std::filesystem::exists(kModelDir + "/model.safetensors")) return r;
    r.model = Model::load(default_plan());
    r.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(kModelDir));
    return r;
  }();
  return l;
}

std::string ids_text(const std::vector<int32_t>& ids) {
  std::ostringstream s;
  for (size_t i = 0; i < ids.size(); ++i) s << (i ? " " : "") << ids[i];
  return s.str();
}

}  // namespace

KvPlan default_plan(std::optional<KvDtype> kv) {
  KvPlanOptions options;
  if (kv) options.kv = DtypeFlag{*kv, "--kv-cache-dtype " + std::string(traits(*kv).name)};
  return make_kv_plan(load_model_config(kModelDir), options);
}

const Model* reference_model() {
  return loaded().model.get();
}

const Tokenizer& reference_tokenizer() {
  return *loaded().tokenizer;
}

std::unique_ptr<Model> engine_model(const KvPlan& plan) {
  return reference_model()->with_plan(plan);
}

std::unique_ptr<LlmEngine> make_engine(const EngineConfig& config, const KvPlan& plan) {
  return std::make_unique<LlmEngine>(
      engine_model(plan), std::make_unique<Tokenizer>(Tokenizer::load(kModelDir)), config);
}

std::vector<int32_t> random_prompt(std::mt19937& rng, int len) {
  std::uniform_int_distribution<int32_t> u(0, reference_model()->vocab_size() - 1);
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (auto& t : p) t = u(rng);
  return p;
}

OutputCallback Collector::callback(std::function<void(const RequestOutput&)> also) {
  return [this, also = std::move(also)](const RequestOutput& o) {
    {
      std::lock_guard lock(mu_);
      Collected& c = results_[o.id];
      if (c.finished_events > 0) ++c.events_after_final;
      ++c.events;
      c.ids.insert(c.ids.end(), o.token_ids.begin(), o.token_ids.end());
      for (const auto& lp : o.logprobs) {
        c.logprobs.push_back(lp.logprob);
        if (!lp.top.empty()) c.top.push_back(lp.top);
      }
      c.text += o.text;
      c.prompt_tokens = o.prompt_tokens;
      c.completion_tokens = o.completion_tokens;
      c.cached_prompt_tokens = o.cached_prompt_tokens;
      if (o.completion_tokens != static_cast<int32_t>(c.ids.size())) c.counts_consistent = false;
      if (o.finished) {
        ++c.finished_events;
        c.finish_reason = o.finish_reason;
        ++finished_;
      }
      // Under the lock: a waiter that wakes may destroy the collector right after.
      cv_.notify_all();
    }
    if (also) also(o);
  };
}

bool Collector::wait_finished(size_t n, std::chrono::seconds timeout) {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return finished_ >= n; });
}

bool Collector::wait_tokens(RequestId id, size_t tokens, std::chrono::seconds timeout) {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, timeout, [&] {
    const auto it = results_.find(id);
    return it != results_.end() &&
           (it->second.ids.size() >= tokens || it->second.finished_events > 0);
  });
}

Collected Collector::get(RequestId id) {
  std::lock_guard lock(mu_);
  return results_[id];
}

size_t Collector::num_finished() {
  std::lock_guard lock(mu_);
  return finished_;
}

GenerationResult solo(const std::vector<int32_t>& prompt, const SamplingParams& params,
                      const Model* model) {
  return generate(model ? *model : *reference_model(), reference_tokenizer(), prompt, params,
                  GeneratorOptions{});
}

std::string compare_greedy(const std::vector<int32_t>& prompt, const GenerationResult& want,
                           const Collected& got, int* near_ties, const Model* model,
                           float rel_tol) {
  if (got.ids == want.output_ids) {
    if (got.text != want.text)
      return "same ids, different text: '" + got.text + "' vs '" + want.text + "'";
    if (got.finish_reason != want.finish_reason)
      return "finish_reason " + got.finish_reason + " vs " + want.finish_reason;
    return "";
  }
  const std::string both =
      "\n engine: " + ids_text(got.ids) + "\n   solo: " + ids_text(want.output_ids);
  size_t k = 0;
  while (k < got.ids.size() && k < want.output_ids.size() && got.ids[k] == want.output_ids[k]) ++k;
  if (k == got.ids.size() || k == want.output_ids.size())
    return "one output is a prefix of the other" + both;
  // Logits at the parting position, from the solo path.
  std::vector<int32_t> tokens = prompt;
  tokens.insert(tokens.end(), want.output_ids.begin(),
                want.output_ids.begin() + static_cast<std::ptrdiff_t>(k));
  std::vector<float> last;
  score_tokens(model ? *model : *reference_model(), tokens, 512,
               [&](int32_t pos, std::span<const float> l) {
                 if (pos + 1 == static_cast<int32_t>(tokens.size()))
                   last.assign(l.begin(), l.end());
               });
  const float a = last[static_cast<size_t>(want.output_ids[k])];
  const float b = last[static_cast<size_t>(got.ids[k])];
  if (std::abs(a - b) <= rel_tol * (1.0f + std::abs(a))) {
    ++*near_ties;
    std::fprintf(stderr, "note: greedy outputs part at a near tie (token %zu, logits %g vs %g)\n",
                 k, a, b);
    return "";
  }
  return "outputs part at token " + std::to_string(k) + " (logits " + std::to_string(a) + " vs " +
         std::to_string(b) + ")" + both;
}

}  // namespace kvq::test
