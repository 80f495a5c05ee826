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
  bool speculate = true;  // false: this request opts out of speculative decoding
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

  // True when this rule always picks the argmax (temperature 0 or top_k 1).
  bool greedy() const { return p_.temperature == 0.0f || p_.top_k == 1; }
  // The distribution sample() draws from, as (id, probability) pairs summing to 1: the tokens
  // that survive temperature, top-k, top-p and min-p (one pair, probability 1, when greedy).
  // Speculative sampling compares the target's and the drafter's distributions through it.
  void distribution(std::span<const float> logits, std::vector<std::pair<int32_t, double>>& out);
  // One draw from (id, weight) pairs with weights >= 0 and a positive sum (not necessarily 1),
  // and one uniform number in [0, 1), both from this sampler's random stream (seeded requests
  // repeat exactly).
  int32_t draw(std::span<const std::pair<int32_t, double>> weighted);
  double uniform();

 private:
  // Fills scratch_ with the candidates and returns how many of its first entries the filters
  // keep; the kept entries' probabilities are exp(logit - max) / total (see sample()).
  size_t filter(std::span<const float> logits, double& total, float& max_logit);

  SamplingParams p_;
  uint64_t seed_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

}  // namespace kvq
