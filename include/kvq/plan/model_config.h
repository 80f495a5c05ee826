// A Hugging Face model directory's config.json, as the KV planner (and later the
// model builder) needs it. Reads what the Llama, Mistral, Qwen2 and Qwen3 families
// write, in transformers 4 and 5 spellings.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kvq/core/kv_dtype.h"
#include "kvq/plan/layer_kv_spec.h"

namespace kvq {

struct ModelConfig {
  std::string dir;           // model directory
  std::string architecture;  // architectures[0], e.g. "LlamaForCausalLM"
  std::string model_type;
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int hidden_size = 0;
  int vocab_size = 0;
  int max_position_embeddings = 0;
  std::string torch_dtype;  // as written ("bfloat16", ...)
  KvDtype model_dtype = KvDtype::kFloat32;
  int sliding_window = 0;                      // tokens; 0 when no layer slides
  std::vector<AttentionKind> layer_attention;  // per layer: kCausal or kSlidingWindow
  nlohmann::json raw;                          // the whole config.json
  std::vector<std::string> warnings;           // non-fatal oddities found while reading
};

// The most decoder layers a config may declare (the largest public models have ~130).
inline constexpr int kMaxModelLayers = 1024;

// Parses a config.json object; `source` names the file in error messages.
// Throws InputError for missing or malformed fields.
ModelConfig parse_model_config(const nlohmann::json& j, const std::string& source);

// Reads DIR/config.json. Throws InputError when the directory or file is missing or malformed.
ModelConfig load_model_config(const std::string& dir);

// The architectures kvq can run (the planner accepts any config with the usual fields).
const std::vector<std::string>& supported_architectures();

}  // namespace kvq
