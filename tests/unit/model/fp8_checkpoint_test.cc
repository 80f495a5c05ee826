// FP8-weight checkpoints as they are published (compressed-tensors float-quantized, ModelOpt
// FP8): the tests write them from a random tiny model (each projection quantized to e4m3 with
// per-tensor or per-channel scales), and the loaded model must give the same logits as that
// model with the weights dequantized in float64 and stored as F32. Every other weight scheme and
// every malformed FP8 file is refused with one line naming it.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kvq/io/safetensors.h"
#include "model/weight_quant.h"
#include "fp8_checkpoint_fixture.h"
#include "model_test_util.h"

namespace kvq::test {
namespace {

class Fp8Checkpoint : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(Fp8Checkpoint, LogitsEqualTheFloat64DequantizedModel) {
  const Fp8Case c = GetParam();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  TinySpec s;
  s.layers = 2;
  s.family = "qwen3";
  const TinyModel m = make_tiny_model(s, rng);
  std::string ref_dir;
  const std::string dir = write_fp8(m, c, ref_dir, rng);
  const auto tokens = random_tokens(23, s.vocab, rng);
  Runner a(Model::load(plan_for(dir)), 4), b(Model::load(plan_for(ref_dir)), 4);
  const std::vector<float> got = a.step({1}, {tokens}), want = b.step({1}, {tokens});
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], want[i]) << "logit " << i;  // the same fp32 weights: the same logits
  // And FP8 is not a no-op: the dequantized weights differ from the originals.
  Runner orig(Model::load(plan_for(m.dir)), 4);
  EXPECT_NE(orig.step({1}, {tokens}), want);
}

INSTANTIATE_TEST_SUITE_P(Layouts, Fp8Checkpoint,
                         ::testing::Values(Fp8Case{Layout::kCompressedTensors, false, false, false},
                                           Fp8Case{Layout::kCompressedTensors, true, false, true},
                                           Fp8Case{Layout::kCompressedTensors, true, true, false},
                                           Fp8Case{Layout::kModelOpt, false, true, true}),
                         [](const auto& param_info) {
                           const Fp8Case& c = param_info.param;
                           return std::string(c.layout == Layout::kModelOpt
                                                  ? "modelopt"
                                                  : "compressed_tensors") +
                                  (c.per_channel ? "_channel" : "_tensor") +
                                  (c.static_activations ? "_static" : "_dynamic") +
                                  (c.ignore_lm_head ? "_ignore_lm_head" : "");
                         });

// One line naming the problem, for every scheme kvq does not load and every broken FP8 file.
TEST(Fp8Checkpoint, OtherSchemesAndBrokenFilesAreRefused) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  TinySpec s;
  s.layers = 1;
  s.family = "qwen3";
  const TinyModel m = make_tiny_model(s, rng);
  std::string ref_dir;
  std::vector<FixtureTensor> tensors;
  const std::string good =
      write_fp8(m, {Layout::kCompressedTensors, true, false, false}, ref_dir, rng, &tensors);
  const nlohmann::json good_config = nlohmann::json::parse(std::ifstream(good + "/config.json"));
  auto error_of = [&](const std::string& dir) {
    try {
      (void)Model::load(plan_for(dir));
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  auto with_config = [&](const nlohmann::json& q) {
    nlohmann::json cfg = good_config;
    cfg["quantization_config"] = q;
    write_text(good + "/config.json", cfg.dump());
    return error_of(good);
  };
  const nlohmann::json q = good_config["quantization_config"];
  struct Bad {
    nlohmann::json q;
    std::string mention;
  };
  std::vector<Bad> bad;
  bad.push_back({{{"quant_method", "gptq"}, {"bits", 4}}, "quant_method 'gptq'"});
  bad.push_back({{{"quant_method", "awq"}}, "quant_method 'awq'"});
  bad.push_back(
      {{{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}}, "weight_block_size"});
  bad.push_back({{{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}}, "quant_algo 'NVFP4'"});
  nlohmann::json b = q;
  b["format"] = "pack-quantized";
  bad.push_back({b, "format 'pack-quantized'"});
  b = q;
  b["config_groups"]["group_0"]["weights"]["type"] = "int";
  b["config_groups"]["group_0"]["weights"]["num_bits"] = 4;
  bad.push_back({b, "type int with 4 bits"});
  b = q;
  b["config_groups"]["group_0"]["weights"]["strategy"] = "block";
  b["config_groups"]["group_0"]["weights"]["block_structure"] = {128, 128};
  bad.push_back({b, "strategy 'block' [128,128]"});
  b = q;
  b["config_groups"]["group_0"]["weights"]["strategy"] = "tensor";  // scales are per channel
  bad.push_back({b, "weight_scale"});
  for (const Bad& x : bad) {
    const std::string e = with_config(x.q);
    EXPECT_NE(e.find(x.mention), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // The good config again: it loads.
  write_text(good + "/config.json", good_config.dump());
  EXPECT_EQ(error_of(good), "(loaded)");

  // A missing scale; an F8 tensor of the wrong byte size; an F8 tensor in a checkpoint that
  // declares no FP8 weights.
  const std::string q_proj = "model.layers.0.self_attn.q_proj.weight";
  {
    std::vector<FixtureTensor> t;
    for (const FixtureTensor& x : tensors)
      if (x.name != q_proj + "_scale") t.push_back(x);
    const std::string e = error_of(make_model_dir(good_config, t));
    EXPECT_NE(e.find(q_proj + "_scale"), std::string::npos) << e;
  }
  {
    std::vector<FixtureTensor> t = tensors;
    for (FixtureTensor& x : t)
      if (x.name == q_proj) x.bytes.resize(x.bytes.size() / 2);
    const std::string e = error_of(make_model_dir(good_config, t));
    EXPECT_NE(e.find(q_proj), std::string::npos) << e;
  }
  {
    nlohmann::json cfg = good_config;
    cfg.erase("quantization_config");
    write_text(good + "/config.json", cfg.dump());
    const std::string e = error_of(good);
    EXPECT_NE(e.find("F8_E4M3"), std::string::npos) << e;
    EXPECT_NE(e.find("declares none"), std::string::npos) << e;
  }
}

// The ignore list as checkpoints write it: bare module names, dotted names, "re:" patterns
// (literals, escapes, '.', '.*'; other regex syntax is refused, never run by a regex engine).
TEST(Fp8Checkpoint, IgnoreListMatchesModules) {
  model::WeightQuantization q;
  q.fp8 = true;
  q.ignore = {"lm_head", "model.layers.0.mlp.down_proj", "re:.*self_attn\\.k_proj",
              "re:model\\.layers\\.1.\\..*"};
  EXPECT_FALSE(q.quantizes("lm_head.weight"));
  EXPECT_FALSE(q.quantizes("model.layers.0.mlp.down_proj.weight"));
  EXPECT_TRUE(q.quantizes("model.layers.1.mlp.down_proj.weight"));
  EXPECT_FALSE(q.quantizes("model.layers.3.self_attn.k_proj.weight"));
  EXPECT_TRUE(q.quantizes("model.layers.3.self_attn.q_proj.weight"));
  EXPECT_FALSE(q.quantizes("model.layers.12.mlp.up_proj.weight"));  // "1." then "2"
  EXPECT_TRUE(q.quantizes("model.layers.2.mlp.up_proj.weight"));
  q.ignore = {"re:(a+)+$"};
  try {
    (void)q.quantizes("lm_head.weight");
    ADD_FAILURE() << "a regex group was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("re:(a+)+$"), std::string::npos) << e.what();
  }
  q.fp8 = false;
  EXPECT_FALSE(q.quantizes("model.layers.0.mlp.up_proj.weight"));  // nothing is quantized
}

}  // namespace
}  // namespace kvq::test
