#include "kvq/plan/model_config.h"

#include <filesystem>
#include <fstream>

#include "kvq/core/error.h"
#include "kvq/core/json_text.h"

namespace kvq {

namespace {

using nlohmann::json;

// A positive integer field, or `fallback` when absent/null (nullopt: required).
int get_int(const json& j, const char* key, const std::string& src, std::optional<int> fallback) {
  if (!j.contains(key) || j[key].is_null()) {
    if (fallback) return *fallback;
    throw InputError(src + ": missing required field '" + key + "' (a positive integer)");
  }
  const json& v = j[key];
  if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > (1 << 30))
    throw InputError(src + ": field '" + key + "' must be a positive integer, got " + v.dump());
  return v.get<int>();
}

}  // namespace

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> kArchs = {"LlamaForCausalLM", "MistralForCausalLM",
                                                  "Qwen2ForCausalLM", "Qwen3ForCausalLM"};
  return kArchs;
}

ModelConfig parse_model_config(const json& j, const std::string& src) {
  if (!j.is_object()) throw InputError(src + ": expected a JSON object");
  ModelConfig c;
  c.raw = j;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string())
    c.architecture = j["architectures"][0].get<std::string>();
  if (j.contains("model_type") && j["model_type"].is_string())
    c.model_type = j["model_type"].get<std::string>();

  c.num_layers = get_int(j, "num_hidden_layers", src, std::nullopt);
  // Every layer gets a plan entry (and a spec per backend check): refuse counts no model has
  // before they cost seconds or gigabytes (a fuzzed config.json with 4096 layers took a second
  // to plan under the sanitizers; 2^30 would allocate gigabytes).
  if (c.num_layers > kMaxModelLayers)
    throw InputError(src + ": num_hidden_layers " + std::to_string(c.num_layers) +
                     " is over kvq's limit of " + std::to_string(kMaxModelLayers) + " layers");
  c.num_q_heads = get_int(j, "num_attention_heads", src, std::nullopt);
  c.num_kv_heads = get_int(j, "num_key_value_heads", src, c.num_q_heads);
  c.hidden_size = get_int(j, "hidden_size", src, 0);
  c.vocab_size = get_int(j, "vocab_size", src, 0);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", src, 0);
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    c.head_dim = get_int(j, "head_dim", src, std::nullopt);
  } else {
    if (c.hidden_size == 0)
      throw InputError(src + ": needs 'head_dim' or 'hidden_size' to know the head dimension");
    if (c.hidden_size % c.num_q_heads != 0)
      throw InputError(src + ": hidden_size " + std::to_string(c.hidden_size) +
                       " is not divisible by num_attention_heads " + std::to_string(c.num_q_heads) +
                       "; give 'head_dim'");
    c.head_dim = c.hidden_size / c.num_q_heads;
  }
  if (c.num_q_heads % c.num_kv_heads != 0)
    throw InputError(src + ": num_attention_heads " + std::to_string(c.num_q_heads) +
                     " is not a multiple of num_key_value_heads " + std::to_string(c.num_kv_heads));

  // transformers 5 writes "dtype", 4 writes "torch_dtype".
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (j.contains(key) && j[key].is_string()) {
      c.torch_dtype = j[key].get<std::string>();
      break;
    }
  }
  if (c.torch_dtype.empty()) {
    c.torch_dtype = "float32";
    c.warnings.push_back(src +
                         ": no 'dtype'/'torch_dtype'; assuming float32 (transformers' default)");
  }
  auto md = kv_dtype_from_torch_dtype(c.torch_dtype);
  if (!md)
    throw InputError(src + ": dtype '" + c.torch_dtype +
                     "' is not a model dtype kvq runs; accepted: float32, float16, bfloat16");
  c.model_dtype = *md;

  // Sliding-window layers. layer_types wins; else the family's own switches.
  if (j.contains("sliding_window") && !j["sliding_window"].is_null()) {
    const json& w = j["sliding_window"];
    if (!w.is_number_integer() || w.get<int64_t>() <= 0)
      throw InputError(src + ": 'sliding_window' must be a positive integer or null, got " +
                       w.dump());
    c.sliding_window = w.get<int>();
  }
  c.layer_attention.assign(static_cast<size_t>(c.num_layers), AttentionKind::kCausal);
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const json& lt = j["layer_types"];
    if (!lt.is_array() || lt.size() != static_cast<size_t>(c.num_layers))
      throw InputError(src + ": 'layer_types' must list one type per layer (" +
                       std::to_string(c.num_layers) + ")");
    for (size_t i = 0; i < lt.size(); ++i) {
      const std::string t = lt[i].is_string() ? lt[i].get<std::string>() : lt[i].dump();
      if (t == "full_attention") continue;
      if (t == "sliding_attention") {
        c.layer_attention[i] = AttentionKind::kSlidingWindow;
        continue;
      }
      throw InputError(src + ": layer_types[" + std::to_string(i) + "] is '" + t +
                       "'; accepted: full_attention, sliding_attention");
    }
  } else if (c.sliding_window > 0) {
    const bool qwen =
        c.model_type == "qwen2" || c.model_type == "qwen3" || c.architecture.rfind("Qwen", 0) == 0;
    const bool mistral = c.model_type == "mistral" || c.architecture == "MistralForCausalLM";
    if (qwen) {
      // Qwen2/Qwen3: layers at index >= max_window_layers slide, when use_sliding_window.
      const json& u = j.contains("use_sliding_window") ? j["use_sliding_window"] : json();
      if (!u.is_null() && !u.is_boolean())
        throw InputError(src + ": use_sliding_window should be true or false, got " + u.dump());
      const bool use = u.is_boolean() && u.get<bool>();
      const int max_window_layers = get_int(j, "max_window_layers", src, c.num_layers);
      if (use)
        for (int i = max_window_layers; i < c.num_layers; ++i)
          c.layer_attention[static_cast<size_t>(i)] = AttentionKind::kSlidingWindow;
    } else if (mistral) {
      c.layer_attention.assign(static_cast<size_t>(c.num_layers), AttentionKind::kSlidingWindow);
    }
  }
  // A block-diffusion drafter's layers attend non-causally (a block sees itself whole).
  if (c.architecture == "KvqDFlashDrafter") {
    for (auto k : c.layer_attention)
      if (k != AttentionKind::kCausal)
        throw InputError(src + ": a KvqDFlashDrafter's layer_types must all be full_attention");
    c.layer_attention.assign(static_cast<size_t>(c.num_layers), AttentionKind::kNonCausal);
  }
  bool any_sliding = false;
  for (auto k : c.layer_attention) any_sliding |= k == AttentionKind::kSlidingWindow;
  if (any_sliding && c.sliding_window <= 0)
    throw InputError(src +
                     ": layer_types has sliding_attention layers but 'sliding_window' is not set");
  if (!any_sliding) c.sliding_window = 0;
  return c;
}

ModelConfig load_model_config(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir))
    throw InputError("--model " + dir + ": not a directory (expected a Hugging Face model folder)");
  const fs::path path = fs::path(dir) / "config.json";
  if (!fs::exists(path))
    throw InputError(path.string() + ": missing (expected the model's Hugging Face config.json)");
  const json j = parse_json_file(path.string());
  ModelConfig c = parse_model_config(j, path.string());
  c.dir = dir;
  return c;
}

}  // namespace kvq
