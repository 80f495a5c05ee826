// config.json -> ArchitectureConfig: the fields the forward pass needs beyond the planner's
// ModelConfig, in transformers 4 and 5 spellings.
#include <cmath>
#include <string>

#include "kvq/core/error.h"
#include "kvq/model/model.h"

namespace kvq {

namespace {

using nlohmann::json;

std::string source_of(const ModelConfig& c) {
  return c.dir.empty() ? std::string("config.json") : c.dir + "/config.json";
}

// A positive integer field (nullopt fallback: required).
int positive_int(const json& j, const char* key, const std::string& src,
                 std::optional<int> fallback) {
  if (!j.contains(key) || j[key].is_null()) {
    if (fallback) return *fallback;
    throw InputError(src + ": missing required field '" + key + "' (a positive integer)");
  }
  const json& v = j[key];
  if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > (1 << 30))
    throw InputError(src + ": field '" + key + "' must be a positive integer, got " + v.dump());
  return v.get<int>();
}

// A positive finite number field; `where` names the object for messages.
float positive_float(const json& j, const char* key, const std::string& where, float fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  const json& v = j[key];
  if (!v.is_number() || !(v.get<double>() > 0.0) || !std::isfinite(v.get<double>()))
    throw InputError(where + ": field '" + key + "' must be a positive number, got " + v.dump());
  return static_cast<float>(v.get<double>());
}

bool get_bool(const json& j, const char* key, const std::string& src, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean())
    throw InputError(src + ": field '" + key + "' must be true or false, got " + j[key].dump());
  return j[key].get<bool>();
}

// Reads rope_type and its parameters from a rope_scaling (transformers 4) or rope_parameters
// (transformers 5) object.
RopeScaling parse_rope_object(const json& r, const std::string& where) {
  RopeScaling s;
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (r.contains(key) && r[key].is_string()) {
      type = r[key].get<std::string>();
      break;
    }
  }
  if (r.contains("partial_rotary_factor") && !r["partial_rotary_factor"].is_null() &&
      r["partial_rotary_factor"] != 1.0)
    throw InputError(where + ": partial_rotary_factor " + r["partial_rotary_factor"].dump() +
                     " is not supported; kvq rotates the whole head (1.0)");
  if (type == "default") return s;
  if (type == "linear") {
    s.kind = RopeScaling::Kind::kLinear;
    s.factor = positive_float(r, "factor", where, 1.0f);
    return s;
  }
  if (type == "llama3") {
    s.kind = RopeScaling::Kind::kLlama3;
    s.factor = positive_float(r, "factor", where, 1.0f);
    s.low_freq_factor = positive_float(r, "low_freq_factor", where, 1.0f);
    s.high_freq_factor = positive_float(r, "high_freq_factor", where, 4.0f);
    s.original_max_position_embeddings =
        positive_int(r, "original_max_position_embeddings", where, 8192);
    if (!(s.high_freq_factor > s.low_freq_factor))
      throw InputError(where + ": llama3 rope needs high_freq_factor > low_freq_factor");
    return s;
  }
  throw InputError(where + ": rope type '" + type +
                   "' is not supported; accepted: default, linear, llama3");
}

}  // namespace

ArchitectureConfig parse_architecture(const ModelConfig& config) {
  const std::string src = source_of(config);
  const json& j = config.raw;
  ArchitectureConfig a;

  const std::string& arch = config.architecture;
  if (arch == "LlamaForCausalLM") {
    a.family = ModelFamily::kLlama;
  } else if (arch == "MistralForCausalLM") {
    a.family = ModelFamily::kMistral;
  } else if (arch == "Qwen2ForCausalLM") {
    a.family = ModelFamily::kQwen2;
  } else if (arch == "Qwen3ForCausalLM") {
    a.family = ModelFamily::kQwen3;
  } else if (arch == "KvqDFlashDrafter") {
    // Qwen3 layers fed by a target's features (docs/notes/dflash.md).
    a.family = ModelFamily::kQwen3;
    const std::string where = src + " dflash_config";
    if (!j.contains("dflash_config") || !j["dflash_config"].is_object())
      throw InputError(where + ": missing (a KvqDFlashDrafter needs target_layer_ids, "
                               "num_target_layers, target_hidden_size, max_speculative_tokens)");
    const json& d = j["dflash_config"];
    DflashConfig dc;
    if (!d.contains("target_layer_ids") || !d["target_layer_ids"].is_array() ||
        d["target_layer_ids"].empty())
      throw InputError(where + ": 'target_layer_ids' must be a non-empty array of layer indices");
    for (const json& v : d["target_layer_ids"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0)
        throw InputError(where + ": 'target_layer_ids' holds " + v.dump() +
                         "; expected layer indices >= 0");
      dc.target_layer_ids.push_back(v.get<int32_t>());
    }
    dc.num_target_layers = positive_int(d, "num_target_layers", where, std::nullopt);
    dc.target_hidden_size = positive_int(d, "target_hidden_size", where, std::nullopt);
    dc.max_speculative_tokens = positive_int(d, "max_speculative_tokens", where, std::nullopt);
    for (int32_t l : dc.target_layer_ids)
      if (l >= dc.num_target_layers)
        throw InputError(where + ": target layer " + std::to_string(l) + " is beyond the " +
                         std::to_string(dc.num_target_layers) + " target layers");
    if (d.contains("mask_token_id") && !d["mask_token_id"].is_null())
      throw InputError(where + ": 'mask_token_id' is not supported; kvq's drafters embed the "
                               "mask as a learned vector ('mask_embedding')");
    a.dflash = std::move(dc);
  } else {
    std::string list;
    for (const auto& s : supported_architectures()) list += (list.empty() ? "" : ", ") + s;
    throw InputError(src + ": architecture '" + (arch.empty() ? "(none given)" : arch) +
                     "' is not supported; supported: " + list);
  }

  a.hidden_size = positive_int(j, "hidden_size", src, std::nullopt);
  a.intermediate_size = positive_int(j, "intermediate_size", src, std::nullopt);
  a.vocab_size = positive_int(j, "vocab_size", src, std::nullopt);
  a.max_position_embeddings = positive_int(j, "max_position_embeddings", src, 0);
  a.rms_norm_eps = positive_float(j, "rms_norm_eps", src, 1e-6f);
  a.tie_word_embeddings = get_bool(j, "tie_word_embeddings", src, false);

  for (const char* key : {"hidden_act", "hidden_activation"}) {
    if (j.contains(key) && !j[key].is_null()) {
      const json& act = j[key];
      if (!act.is_string() || (act != "silu" && act != "swish"))
        throw InputError(src + ": " + key + " " + act.dump() + " is not supported; accepted: silu");
    }
  }

  const bool attention_bias = get_bool(j, "attention_bias", src, false);
  switch (a.family) {
    case ModelFamily::kQwen2:  // q/k/v always carry biases; o_proj never does
      a.qkv_bias = true;
      break;
    case ModelFamily::kMistral:
      break;
    case ModelFamily::kQwen3:
      a.qk_norm = true;
      a.qkv_bias = a.o_bias = attention_bias;
      break;
    case ModelFamily::kLlama:
      a.qkv_bias = a.o_bias = attention_bias;
      a.mlp_bias = get_bool(j, "mlp_bias", src, false);
      break;
  }

  // RoPE: transformers 5 writes rope_parameters (theta inside); 4 writes rope_theta and
  // rope_scaling ("rope_type" or the older "type").
  a.rope_theta = positive_float(j, "rope_theta", src, 10000.0f);
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const json& rp = j["rope_parameters"];
    const std::string where = src + " rope_parameters";
    if (!rp.is_object()) throw InputError(where + ": expected an object, got " + rp.dump());
    const json* params = &rp;
    // Per-layer-type parameters ({"full_attention": {...}, "sliding_attention": {...}}):
    // kvq applies one RoPE to every layer, so they must agree.
    if (!rp.contains("rope_type") && !rp.contains("rope_theta") && !rp.empty() &&
        rp.begin()->is_object()) {
      for (const auto& [k, v] : rp.items())
        if (v != *rp.begin())
          throw InputError(where + ": per-layer-type RoPE parameters differ ('" + k +
                           "'); kvq needs one RoPE for every layer");
      params = &*rp.begin();
    }
    a.rope_theta = positive_float(*params, "rope_theta", where, a.rope_theta);
    a.rope_scaling = parse_rope_object(*params, where);
  } else if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const json& rs = j["rope_scaling"];
    const std::string where = src + " rope_scaling";
    if (!rs.is_object()) throw InputError(where + ": expected an object or null, got " + rs.dump());
    a.rope_scaling = parse_rope_object(rs, where);
  }
  if (j.contains("partial_rotary_factor") && !j["partial_rotary_factor"].is_null() &&
      j["partial_rotary_factor"] != 1.0)
    throw InputError(src + ": partial_rotary_factor " + j["partial_rotary_factor"].dump() +
                     " is not supported; kvq rotates the whole head (1.0)");

  if (config.head_dim % 2 != 0)
    throw InputError(src + ": head_dim " + std::to_string(config.head_dim) +
                     " is odd; RoPE needs an even head dimension");
  return a;
}

}  // namespace kvq
