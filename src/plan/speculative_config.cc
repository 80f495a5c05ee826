#include "kvq/plan/speculative_config.h"

#include <nlohmann/json.hpp>
#include <set>

#include "kvq/core/error.h"

namespace kvq {

std::string_view to_string(SpecMethod m) {
  switch (m) {
    case SpecMethod::kNgram: return "ngram";
    case SpecMethod::kDraftModel: return "draft_model";
    case SpecMethod::kDflash: return "dflash";
  }
  return "?";
}

namespace {

constexpr const char* kAcceptedKeys =
    "method, model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
    "kv_cache_dtype, kv_cache_dtype_skip_layers, disable_by_batch_size, auto_disable";

int get_int(const nlohmann::json& j, const char* key, const std::string& where, int lo, int hi) {
  const nlohmann::json& v = j.at(key);
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
    throw InputError(where + ": \"" + key + "\" must be an integer in " + std::to_string(lo) +
                     ".." + std::to_string(hi) + ", got " + v.dump());
  return v.get<int>();
}

std::string get_string(const nlohmann::json& j, const char* key, const std::string& where) {
  const nlohmann::json& v = j.at(key);
  if (!v.is_string()) throw InputError(where + ": \"" + key + "\" must be a string, got " + v.dump());
  return v.get<std::string>();
}

}  // namespace

SpeculativeConfig parse_speculative_config(std::string_view text, std::string_view flag) {
  const std::string where(flag);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    throw InputError(where + ": not valid JSON: '" + std::string(text) +
                     "'; expected e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4}");
  }
  if (!j.is_object())
    throw InputError(where + ": expected a JSON object such as {\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4}, got " + j.dump());
  for (const auto& [key, value] : j.items()) {
    (void)value;
    static const std::set<std::string> kKeys = {"method",
                                                "model",
                                                "num_speculative_tokens",
                                                "prompt_lookup_min",
                                                "prompt_lookup_max",
                                                "kv_cache_dtype",
                                                "kv_cache_dtype_skip_layers",
                                                "disable_by_batch_size",
                                                "auto_disable"};
    if (!kKeys.contains(key))
      throw InputError(where + ": unknown key \"" + key + "\"; accepted: " + kAcceptedKeys);
  }
  SpeculativeConfig c;
  if (!j.contains("method"))
    throw InputError(where + ": \"method\" is required; accepted: ngram, draft_model, dflash");
  const std::string method = get_string(j, "method", where);
  if (method == "ngram") {
    c.method = SpecMethod::kNgram;
  } else if (method == "draft_model") {
    c.method = SpecMethod::kDraftModel;
  } else if (method == "dflash") {
    c.method = SpecMethod::kDflash;
  } else {
    throw InputError(where + ": unknown method \"" + method +
                     "\"; accepted: ngram, draft_model, dflash");
  }
  if (!j.contains("num_speculative_tokens"))
    throw InputError(where + ": \"num_speculative_tokens\" is required (an integer in 1.." +
                     std::to_string(kMaxSpeculativeTokens) + ")");
  c.num_speculative_tokens = get_int(j, "num_speculative_tokens", where, 1, kMaxSpeculativeTokens);
  if (j.contains("model")) c.model = get_string(j, "model", where);
  if (c.method == SpecMethod::kNgram) {
    if (!c.model.empty())
      throw InputError(where + ": method \"ngram\" takes no \"model\" (it drafts from the "
                               "sequence's own tokens); for a drafter use draft_model or dflash");
  } else if (c.model.empty()) {
    throw InputError(where + ": method \"" + method +
                     "\" needs \"model\": the drafter's directory (config.json + safetensors)");
  }
  const bool has_ngram_keys = j.contains("prompt_lookup_min") || j.contains("prompt_lookup_max");
  if (has_ngram_keys && c.method != SpecMethod::kNgram)
    throw InputError(where + ": prompt_lookup_min / prompt_lookup_max apply to method \"ngram\" "
                             "only, not \"" + method + "\"");
  if (j.contains("prompt_lookup_max"))
    c.prompt_lookup_max = get_int(j, "prompt_lookup_max", where, 1, 64);
  if (j.contains("prompt_lookup_min"))
    c.prompt_lookup_min = get_int(j, "prompt_lookup_min", where, 1, 64);
  else if (c.prompt_lookup_min > c.prompt_lookup_max)
    c.prompt_lookup_min = c.prompt_lookup_max;
  if (c.prompt_lookup_min > c.prompt_lookup_max)
    throw InputError(where + ": prompt_lookup_min (" + std::to_string(c.prompt_lookup_min) +
                     ") must be <= prompt_lookup_max (" + std::to_string(c.prompt_lookup_max) +
                     ")");
  if (j.contains("kv_cache_dtype")) {
    if (c.method == SpecMethod::kNgram)
      throw InputError(where + ": \"kv_cache_dtype\" sets the drafter's cache; method \"ngram\" "
                               "has no drafter model");
    const std::string name = get_string(j, "kv_cache_dtype", where);
    c.kv_cache_dtype = DtypeFlag{parse_kv_dtype_or_throw(name, where + " kv_cache_dtype"),
                                 where + " kv_cache_dtype=" + name};
  }
  if (j.contains("kv_cache_dtype_skip_layers")) {
    c.kv_cache_dtype_skip_layers = get_string(j, "kv_cache_dtype_skip_layers", where);
    c.skip_layers_given = true;
  }
  if (j.contains("disable_by_batch_size"))
    c.disable_by_batch_size = get_int(j, "disable_by_batch_size", where, 0, 1 << 20);
  if (j.contains("auto_disable")) {
    if (!j["auto_disable"].is_boolean())
      throw InputError(where + ": \"auto_disable\" must be true or false, got " +
                       j["auto_disable"].dump());
    c.auto_disable = j["auto_disable"].get<bool>();
  }
  return c;
}

KvPlanOptions drafter_plan_options(const KvPlanOptions& target, const SpeculativeConfig& spec) {
  KvPlanOptions o = target;
  if (spec.kv_cache_dtype) {
    o.kv = spec.kv_cache_dtype;
    o.k.reset();
    o.v.reset();
  }
  if (spec.skip_layers_given) o.skip_layers = spec.kv_cache_dtype_skip_layers;
  return o;
}

KvPlan make_drafter_kv_plan(const ModelConfig& drafter, const KvPlanOptions& target,
                            const SpeculativeConfig& spec) {
  const KvPlanOptions o = drafter_plan_options(target, spec);
  if (!spec.skip_layers_given && !o.skip_layers.empty()) {
    try {
      (void)parse_skip_layers(o.skip_layers, drafter);
    } catch (const InputError& e) {
      throw InputError(std::string("the drafter (") + drafter.dir + ", " +
                       std::to_string(drafter.num_layers) +
                       " layers) cannot take the target's --kv-cache-dtype-skip-layers: " +
                       e.what() +
                       "; give the drafter its own with \"kv_cache_dtype_skip_layers\" in "
                       "--speculative-config");
    }
  }
  KvPlan plan = make_kv_plan(drafter, o);
  plan.notes.push_back(std::string("drafter (") + std::string(to_string(spec.method)) +
                       ") planned with the target's flags" +
                       (spec.kv_cache_dtype ? ", KV dtype from " + spec.kv_cache_dtype->flag
                                            : std::string()));
  return plan;
}

}  // namespace kvq
