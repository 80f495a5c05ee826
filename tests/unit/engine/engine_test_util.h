// Helpers for the LlmEngine tests: the default model, solo reference runs, and a thread-safe
// collector of every request's events.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "kvq/engine/generator.h"
#include "kvq/engine/llm_engine.h"
#include "kvq/plan/kv_plan.h"
#include "support/source_dir.h"

namespace kvq::test {

inline const std::string kModelDir = ::kvq::test::source_dir() + "/models/kvq-code-tiny";

// Sanitizer builds (10x slower) run the same cases on less work.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kUnderSanitizer = true;
#else
inline constexpr bool kUnderSanitizer = false;
#endif

// A fresh random seed per call; KVQ_TEST_SEED=N replays a failure (tests print their seed).
inline uint32_t fresh_seed() {
  if (const char* env = std::getenv("KVQ_TEST_SEED"); env != nullptr && *env != '\0')
    return static_cast<uint32_t>(std::strtoul(env, nullptr, 10));
  return std::random_device{}();
}

KvPlan default_plan(std::optional<KvDtype> kv = std::nullopt);
// The default model (loaded once) or nullptr when its files are absent.
const Model* reference_model();
const Tokenizer& reference_tokenizer();
// A model for an engine: the reference weights under `plan`.
std::unique_ptr<Model> engine_model(const KvPlan& plan);
std::unique_ptr<LlmEngine> make_engine(const EngineConfig& config,
                                       const KvPlan& plan = default_plan());

#define KVQ_REQUIRE_MODEL()                                                    \
  do {                                                                         \
    if (::kvq::test::reference_model() == nullptr)                             \
      GTEST_SKIP() << "default model not found at " << ::kvq::test::kModelDir; \
  } while (0)

std::vector<int32_t> random_prompt(std::mt19937& rng, int len);

// What one request produced, assembled from its events, with protocol checks.
struct Collected {
  std::vector<int32_t> ids;
  std::string text;
  std::vector<float> logprobs;
  std::vector<std::vector<std::pair<int32_t, float>>> top;  // per token, when asked
  std::string finish_reason;
  int events = 0;
  int finished_events = 0;
  int events_after_final = 0;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_prompt_tokens = 0;
  bool counts_consistent = true;  // completion_tokens always equal to the ids received so far
};

class Collector {
 public:
  // A callback that records into this collector; `also` (optional) runs after recording,
  // without the collector's lock.
  OutputCallback callback(std::function<void(const RequestOutput&)> also = {});
  // Waits until `n` requests have finished; false after `timeout`.
  bool wait_finished(size_t n, std::chrono::seconds timeout = std::chrono::seconds(120));
  // Waits until request `id` has received at least `tokens` token ids; false after `timeout`.
  bool wait_tokens(RequestId id, size_t tokens,
                   std::chrono::seconds timeout = std::chrono::seconds(120));
  Collected get(RequestId id);
  size_t num_finished();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<RequestId, Collected> results_;
  size_t finished_ = 0;
};

// The output generate() gives for the prompt alone (with `model`, default the reference).
GenerationResult solo(const std::vector<int32_t>& prompt, const SamplingParams& params,
                      const Model* model = nullptr);

// Greedy outputs agree when the ids are equal, or when they part at a near tie: the model's
// logits are not bit-identical across batch shapes (summation order), so two tokens whose
// logits differ by less than the model's consistency tolerance may swap. Returns a
// description of the first real difference ("" when none); `near_ties` counts accepted ties.
// `rel_tol`: how close the two logits must be to count as a tie (a cache quantized per token can
// turn a last-bit difference of K/V into a level of the codec, so those tests pass more).
std::string compare_greedy(const std::vector<int32_t>& prompt, const GenerationResult& want,
                           const Collected& got, int* near_ties, const Model* model = nullptr,
                           float rel_tol = 1e-3f);

}  // namespace kvq::test
