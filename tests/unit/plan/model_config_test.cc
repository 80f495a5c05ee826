#include "kvq/plan/model_config.h"

#include <gtest/gtest.h>

#include "kvq/core/error.h"
#include "support/fixtures.h"

namespace kvq {
namespace {

using nlohmann::json;
using test::llama_config;

std::string error_of(const json& j) {
  try {
    parse_model_config(j, "x/config.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(ModelConfig, ReadsLlamaFields) {
  const ModelConfig c = parse_model_config(llama_config(5, 8, 4, 8, "float32"), "config.json");
  EXPECT_EQ(c.num_layers, 5);
  EXPECT_EQ(c.num_q_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.model_dtype, KvDtype::kFloat32);
  EXPECT_EQ(c.sliding_window, 0);
  for (auto k : c.layer_attention) EXPECT_EQ(k, AttentionKind::kCausal);
}

TEST(ModelConfig, HeadDimFromHiddenSizeAndKvHeadsDefault) {
  json j = llama_config(2, 16, 16, 64);
  j.erase("head_dim");
  j.erase("num_key_value_heads");
  j["hidden_size"] = 2048;
  const ModelConfig c = parse_model_config(j, "config.json");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_kv_heads, 16);
  j["head_dim"] = nullptr;  // transformers writes null sometimes
  EXPECT_EQ(parse_model_config(j, "config.json").head_dim, 128);
}

TEST(ModelConfig, Transformers5DtypeSpelling) {
  json j = llama_config();
  j.erase("torch_dtype");
  j["dtype"] = "float16";
  EXPECT_EQ(parse_model_config(j, "c").model_dtype, KvDtype::kFloat16);
  j.erase("dtype");
  const ModelConfig c = parse_model_config(j, "c");
  EXPECT_EQ(c.model_dtype, KvDtype::kFloat32);
  ASSERT_EQ(c.warnings.size(), 1u);
}

TEST(ModelConfig, MistralSlidingWindowAppliesToEveryLayer) {
  json j = llama_config(3);
  j["architectures"] = {"MistralForCausalLM"};
  j["model_type"] = "mistral";
  j["sliding_window"] = 4096;
  const ModelConfig c = parse_model_config(j, "c");
  for (auto k : c.layer_attention) EXPECT_EQ(k, AttentionKind::kSlidingWindow);
  EXPECT_EQ(c.sliding_window, 4096);
  j["sliding_window"] = nullptr;
  for (auto k : parse_model_config(j, "c").layer_attention) EXPECT_EQ(k, AttentionKind::kCausal);
}

TEST(ModelConfig, Qwen2MaxWindowLayers) {
  json j = llama_config(6);
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["model_type"] = "qwen2";
  j["sliding_window"] = 512;
  j["max_window_layers"] = 4;
  j["use_sliding_window"] = false;
  for (auto k : parse_model_config(j, "c").layer_attention) EXPECT_EQ(k, AttentionKind::kCausal);
  j["use_sliding_window"] = true;
  const ModelConfig c = parse_model_config(j, "c");
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(c.layer_attention[static_cast<size_t>(i)],
              i >= 4 ? AttentionKind::kSlidingWindow : AttentionKind::kCausal);
}

TEST(ModelConfig, LayerTypesWin) {
  json j = llama_config(3);
  j["sliding_window"] = 64;
  j["layer_types"] = {"sliding_attention", "full_attention", "sliding_attention"};
  const ModelConfig c = parse_model_config(j, "c");
  EXPECT_EQ(c.layer_attention[0], AttentionKind::kSlidingWindow);
  EXPECT_EQ(c.layer_attention[1], AttentionKind::kCausal);
}

TEST(ModelConfigBadInput, EachMistakeIsNamed) {
  json missing = llama_config();
  missing.erase("num_hidden_layers");
  EXPECT_NE(error_of(missing).find("'num_hidden_layers'"), std::string::npos);
  json negative = llama_config();
  negative["num_attention_heads"] = -4;
  EXPECT_NE(error_of(negative).find("positive integer"), std::string::npos);
  json text = llama_config();
  text["num_key_value_heads"] = "two";
  EXPECT_NE(error_of(text).find("num_key_value_heads"), std::string::npos);
  json gqa = llama_config(2, 8, 3);
  EXPECT_NE(error_of(gqa).find("not a multiple"), std::string::npos);
  json types = llama_config(2);
  types["layer_types"] = {"full_attention"};
  EXPECT_NE(error_of(types).find("one type per layer"), std::string::npos);
  types["layer_types"] = {"full_attention", "linear_attention"};
  EXPECT_NE(error_of(types).find("accepted: full_attention, sliding_attention"), std::string::npos);
  types["layer_types"] = {"full_attention", "sliding_attention"};
  EXPECT_NE(error_of(types).find("'sliding_window' is not set"), std::string::npos);
  json dtype = llama_config();
  dtype["torch_dtype"] = "int8";
  EXPECT_NE(error_of(dtype).find("accepted: float32, float16, bfloat16"), std::string::npos);
  EXPECT_NE(error_of(json::array()).find("JSON object"), std::string::npos);
  // Layer counts no model has are refused before anything is planned per layer (a fuzzed
  // config with 4096 layers took a second to plan; 2^30 would allocate gigabytes).
  for (int layers : {kMaxModelLayers + 1, 1 << 30}) {
    json many = llama_config();
    many["num_hidden_layers"] = layers;
    EXPECT_NE(error_of(many).find("over kvq's limit of 1024 layers"), std::string::npos) << layers;
  }
  json most = llama_config(kMaxModelLayers);
  EXPECT_EQ(parse_model_config(most, "config.json").num_layers, kMaxModelLayers);
}

TEST(ModelConfigBadInput, MissingOrMalformedFiles) {
  try {
    load_model_config("/nonexistent/kvq/model");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("not a directory"), std::string::npos);
  }
  const std::string dir = test::fresh_dir("cfg");
  try {
    load_model_config(dir);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("config.json: missing"), std::string::npos);
  }
  // A syntax error, and a number too large for a double (the parser's out_of_range).
  for (const char* text : {"{\"num_hidden_layers\": 2,", "{\"num_hidden_layers\": 2e99999}"}) {
    test::write_text(dir + "/config.json", text);
    try {
      load_model_config(dir);
      FAIL() << text;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace kvq
