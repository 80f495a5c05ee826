// Token sampling: greedy, temperature, top-k, top-p, min-p, with a seed.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvq/model/model.h"

namespace kvq {

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off
  std::optional<uint64_t> seed;
  int max_tokens = 256;
  std::vector<std::string> stop;        // stop strings (not included in the output)
  std::vector<int32_t> stop_token_ids;  // extra stop tokens (the tokenizer's EOS ids stop too)
  bool ignore_eos = false;
};

// Problems with `p`, each "<field> must be ..., got ...", with fields spelled as the OpenAI API
// does (temperature, top_p, top_k, min_p, max_tokens); empty when valid. Callers prefix the
// flag or request field syntax they use.
std::vector<std::string> sampling_param_errors(const SamplingParams& p);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // Picks a token from logits (fp32, vocab-sized). Greedy picks the lowest id among ties.
  int32_t sample(std::span<const float> logits);
  // The same rule for a model that samples where its logits are (Model::forward_sample):
  // temperature 0 or top_k 1 is greedy; the draw of token `step` is reproducible from the
  // request's seed (or, without one, a seed drawn once per Sampler). The device's random
  // stream differs from this class's, so seeded draws match run to run, not CPU to GPU.
  DeviceSampling device_rule(uint64_t step) const;

 private:
  SamplingParams p_;
  uint64_t seed_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

}  // namespace kvq
