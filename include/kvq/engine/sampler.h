// Token sampling: greedy, temperature, top-k, top-p, min-p, with a seed.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

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

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

}  // namespace kvq
