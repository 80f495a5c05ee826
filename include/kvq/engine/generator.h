// Single-request generation and token scoring on top of a Model and its paged cache:
// chunked prefill, then decode; stop tokens and stop strings; streaming text.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/engine/sampler.h"
#include "kvq/engine/speculative.h"
#include "kvq/model/model.h"
#include "kvq/tokenizer/tokenizer.h"

namespace kvq {

struct GenerationResult {
  std::vector<int32_t> output_ids;  // generated ids (a stop token that ended it included)
  std::string text;                 // decoded output, stop string excluded
  std::string finish_reason;        // "stop" (EOS, stop token, stop string) or "length"
  int32_t prompt_tokens = 0;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  size_t kv_bytes_used = 0;  // bytes of the cache blocks the sequence held at the end
  SpecCounters spec;         // speculative decoding (all zero without a proposer)
};

struct GeneratorOptions {
  int32_t prefill_chunk = 512;  // tokens per prefill step
  std::optional<int64_t> num_blocks;  // cache blocks; unset: exactly what prompt + max tokens need
  // Speculative decoding: each step drafts up to num_speculative_tokens tokens with the proposer
  // and verifies them in one forward pass (no proposer, k = 0, or params.speculate false: plain).
  Proposer* proposer = nullptr;
  int32_t num_speculative_tokens = 0;
};

// Called with each newly final piece of text (complete UTF-8, stop strings held back until
// they can be ruled out) and the token id that produced it; return false to stop early.
using TokenCallback = std::function<bool(std::string_view text, int32_t id)>;

// Context length a model accepts (max_position_embeddings; 0 in the config means unlimited).
int32_t model_context_length(const Model& model);

// Generates from `prompt` (ids, BOS already included if wanted). Throws InputError when the prompt
// is empty, longer than the model's context, or the sampling parameters are invalid (naming them
// with `flag_prefix`, e.g. "--" for the command line).
GenerationResult generate(const Model& model, const Tokenizer& tokenizer,
                          std::span<const int32_t> prompt, const SamplingParams& params,
                          const GeneratorOptions& options, const TokenCallback& on_token = {});

// Runs `tokens` through the model in chunks and calls `on_logits(position, logits)` for every
// position in order (logits predict token position + 1).
void score_tokens(const Model& model, std::span<const int32_t> tokens, int32_t prefill_chunk,
                  const std::function<void(int32_t position, std::span<const float> logits)>& on_logits);

}  // namespace kvq
