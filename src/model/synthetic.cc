// Synthetic model shapes for `kvq bench --synthetic NAME`: each name is the config.json of a
// published checkpoint (or, for llama3-8b-dflash5, of a part of one), written out here and
// parsed by the same parse_model_config a real checkpoint goes through, so a synthetic model is
// planned and built exactly like the real one.
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "kvq/core/error.h"
#include "kvq/model/cuda_model.h"

namespace kvq {

namespace {

using nlohmann::json;

// The fields of each model's config.json as published on the Hugging Face Hub (tokenizer ids
// included, so the raw JSON reads like the real file).
const std::vector<std::pair<std::string, json>>& synthetic_configs() {
  static const std::vector<std::pair<std::string, json>> kConfigs = [] {
    std::vector<std::pair<std::string, json>> c = {
      {"llama3-8b",  // meta-llama/Meta-Llama-3-8B
       {{"architectures", json::array({"LlamaForCausalLM"})},
        {"attention_bias", false},
        {"attention_dropout", 0.0},
        {"bos_token_id", 128000},
        {"eos_token_id", 128001},
        {"hidden_act", "silu"},
        {"hidden_size", 4096},
        {"initializer_range", 0.02},
        {"intermediate_size", 14336},
        {"max_position_embeddings", 8192},
        {"model_type", "llama"},
        {"num_attention_heads", 32},
        {"num_hidden_layers", 32},
        {"num_key_value_heads", 8},
        {"pretraining_tp", 1},
        {"rms_norm_eps", 1e-05},
        {"rope_scaling", nullptr},
        {"rope_theta", 500000.0},
        {"tie_word_embeddings", false},
        {"torch_dtype", "bfloat16"},
        {"use_cache", true},
        {"vocab_size", 128256}}},
      {"llama3.1-8b",  // meta-llama/Llama-3.1-8B
       {{"architectures", json::array({"LlamaForCausalLM"})},
        {"attention_bias", false},
        {"attention_dropout", 0.0},
        {"bos_token_id", 128000},
        {"eos_token_id", 128001},
        {"hidden_act", "silu"},
        {"hidden_size", 4096},
        {"initializer_range", 0.02},
        {"intermediate_size", 14336},
        {"max_position_embeddings", 131072},
        {"mlp_bias", false},
        {"model_type", "llama"},
        {"num_attention_heads", 32},
        {"num_hidden_layers", 32},
        {"num_key_value_heads", 8},
        {"pretraining_tp", 1},
        {"rms_norm_eps", 1e-05},
        {"rope_scaling",
         {{"factor", 8.0},
          {"low_freq_factor", 1.0},
          {"high_freq_factor", 4.0},
          {"original_max_position_embeddings", 8192},
          {"rope_type", "llama3"}}},
        {"rope_theta", 500000.0},
        {"tie_word_embeddings", false},
        {"torch_dtype", "bfloat16"},
        {"use_cache", true},
        {"vocab_size", 128256}}},
      {"qwen3-8b",  // Qwen/Qwen3-8B
       {{"architectures", json::array({"Qwen3ForCausalLM"})},
        {"attention_bias", false},
        {"attention_dropout", 0.0},
        {"bos_token_id", 151643},
        {"eos_token_id", 151645},
        {"head_dim", 128},
        {"hidden_act", "silu"},
        {"hidden_size", 4096},
        {"initializer_range", 0.02},
        {"intermediate_size", 12288},
        {"max_position_embeddings", 40960},
        {"max_window_layers", 36},
        {"model_type", "qwen3"},
        {"num_attention_heads", 32},
        {"num_hidden_layers", 36},
        {"num_key_value_heads", 8},
        {"rms_norm_eps", 1e-06},
        {"rope_scaling", nullptr},
        {"rope_theta", 1000000},
        {"sliding_window", nullptr},
        {"tie_word_embeddings", false},
        {"torch_dtype", "bfloat16"},
        {"use_cache", true},
        {"use_sliding_window", false},
        {"vocab_size", 151936}}},
      {"qwen2.5-7b",  // Qwen/Qwen2.5-7B
       {{"architectures", json::array({"Qwen2ForCausalLM"})},
        {"attention_dropout", 0.0},
        {"bos_token_id", 151643},
        {"eos_token_id", 151643},
        {"hidden_act", "silu"},
        {"hidden_size", 3584},
        {"initializer_range", 0.02},
        {"intermediate_size", 18944},
        {"max_position_embeddings", 131072},
        {"max_window_layers", 28},
        {"model_type", "qwen2"},
        {"num_attention_heads", 28},
        {"num_hidden_layers", 28},
        {"num_key_value_heads", 4},
        {"rms_norm_eps", 1e-06},
        {"rope_theta", 1000000.0},
        {"sliding_window", 131072},
        {"tie_word_embeddings", false},
        {"torch_dtype", "bfloat16"},
        {"use_cache", true},
        {"use_mrope", false},
        {"use_sliding_window", false},
        {"vocab_size", 152064}}},
    };
    // Llama-3-70B and Llama-3.1-70B (meta-llama/Meta-Llama-3-70B, meta-llama/Llama-3.1-70B):
    // their 8B configs with the 70B sizes (140 GB in bf16: tensor parallelism).
    auto seventy = [](json j) {
      j["hidden_size"] = 8192;
      j["intermediate_size"] = 28672;
      j["num_attention_heads"] = 64;
      j["num_hidden_layers"] = 80;
      return j;
    };
    c.insert(c.begin() + 2, {{"llama3-70b", seventy(c[0].second)},
                             {"llama3.1-70b", seventy(c[1].second)}});
    // The body of a 5-layer DFlash drafter for Llama-3-8B (the layer count of the published
    // DFlash drafters): Llama-3-8B's decoder layers and LM head, 5 layers; its block pass is this
    // model's verification step of 1 + 15 tokens, plus the fc projection of the target's features
    // (not in it). For timing only (`kvq bench --verify-tokens`).
    json draft5 = c[0].second;
    draft5["num_hidden_layers"] = 5;
    c.push_back({"llama3-8b-dflash5", draft5});
    return c;
  }();
  return kConfigs;
}

}  // namespace

const std::vector<std::string>& synthetic_model_names() {
  static const std::vector<std::string> kNames = [] {
    std::vector<std::string> names;
    for (const auto& [name, config] : synthetic_configs()) names.push_back(name);
    return names;
  }();
  return kNames;
}

ModelConfig synthetic_model_config(std::string_view name, std::string_view flag) {
  for (const auto& [known, config] : synthetic_configs())
    if (known == name) return parse_model_config(config, "synthetic " + known);
  std::string list;
  for (const auto& n : synthetic_model_names()) list += (list.empty() ? "" : ", ") + n;
  throw InputError(std::string(flag) + " '" + std::string(name) +
                   "' is not a known model shape; accepted: " + list);
}

}  // namespace kvq
