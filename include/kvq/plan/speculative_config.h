// The speculative-decoding configuration (`--speculative-config JSON`, vLLM's spelling) and
// the drafter's KV plan options. The drafter is planned by the same make_kv_plan as the target,
// from the same flags: `--kv-cache-dtype fp8` quantizes every drafter layer too, unless the
// speculative config names the drafter's own dtype ("kv_cache_dtype").
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "kvq/plan/kv_plan.h"

namespace kvq {

enum class SpecMethod : uint8_t {
  kNgram,       // prompt lookup: drafts copied from an earlier occurrence of the last n tokens
  kDraftModel,  // a small causal model with the target's tokenizer, its own paged cache
  kDflash,      // a block-diffusion drafter fed by the target's hidden states
};
std::string_view to_string(SpecMethod m);

struct SpeculativeConfig {
  SpecMethod method = SpecMethod::kNgram;
  std::string model;               // drafter directory (draft_model, dflash)
  int num_speculative_tokens = 0;  // k: tokens drafted per step, 1..kMaxSpeculativeTokens
  int prompt_lookup_min = 2;       // ngram: shortest n-gram matched
  int prompt_lookup_max = 4;       // ngram: longest n-gram matched (tried first)
  std::optional<DtypeFlag> kv_cache_dtype;  // the drafter's KV dtype, over the target's flags
  std::string kv_cache_dtype_skip_layers;   // the drafter's skip rule ("" = the target's)
  bool skip_layers_given = false;
  // No drafting in a step with at least this many running sequences (0: always draft).
  int disable_by_batch_size = 0;
  // The engine measures time per generated token with and without drafting, per batch size,
  // and drafts only where that pays ("auto_disable", default false).
  bool auto_disable = false;
};

inline constexpr int kMaxSpeculativeTokens = 16;

// Parses the JSON text of `flag`. Keys: method ("ngram", "draft_model", "dflash"), model,
// num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, kv_cache_dtype,
// kv_cache_dtype_skip_layers, disable_by_batch_size, auto_disable. InputError (one line naming the flag, the
// key, what was wrong and what is accepted) for malformed JSON, unknown keys, a missing model
// for a model method, a model for ngram, or numbers out of range.
SpeculativeConfig parse_speculative_config(std::string_view text,
                                           std::string_view flag = "--speculative-config");

// The drafter's plan options: the target's flags (so the drafter is quantized like the target),
// with the speculative config's kv_cache_dtype over them (it replaces --kv-cache-dtype and
// -ctk/-ctv) and its skip rule, if it has one, over the target's.
KvPlanOptions drafter_plan_options(const KvPlanOptions& target, const SpeculativeConfig& spec);

// The drafter's plan: make_kv_plan over the drafter's config with drafter_plan_options. A skip
// rule written for the target that does not fit the drafter's layers fails with a message that
// says how to give the drafter its own ("kv_cache_dtype_skip_layers" in the config).
KvPlan make_drafter_kv_plan(const ModelConfig& drafter, const KvPlanOptions& target,
                            const SpeculativeConfig& spec);

}  // namespace kvq
