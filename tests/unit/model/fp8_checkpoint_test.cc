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
#include "model_test_util.h"

namespace kvq::test {
namespace {

enum class Layout { kCompressedTensors, kModelOpt };

struct Fp8Case {
  Layout layout;
  bool per_channel;
  bool static_activations;
  bool ignore_lm_head;  // lm_head stays F32 and is named in the ignore list
};

bool is_projection(const std::string& name) {
  for (const char* p :
       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"})
    if (name.find(p) != std::string::npos && name.ends_with(".weight")) return true;
  return false;
}

// The FP8 checkpoint of `m` and (into `reference_dir`) the same model with every quantized
// weight dequantized in float64 and written as F32.
std::string write_fp8(const TinyModel& m, const Fp8Case& c, std::string& reference_dir,
                      std::mt19937& rng, std::vector<FixtureTensor>* tensors_out = nullptr) {
  const auto files = CheckpointFiles::open(m.dir);
  std::vector<FixtureTensor> fp8, ref;
  std::uniform_real_distribution<double> jitter(0.9, 1.1);
  for (const auto& [name, vals] : m.w) {
    const std::vector<int64_t> shape = files.find(name).second->shape;
    const bool quantize = is_projection(name) && !(c.ignore_lm_head && name == "lm_head.weight");
    if (!quantize) {
      std::vector<float> f(vals.begin(), vals.end());
      fp8.push_back(f32_tensor(name, shape, f));
      ref.push_back(f32_tensor(name, shape, f));
      continue;
    }
    const int64_t rows = shape[0], cols = shape[1];
    std::vector<float> scale(c.per_channel ? static_cast<size_t>(rows) : 1);
    for (size_t r = 0; r < scale.size(); ++r) {
      double amax = 0.0;
      const int64_t r0 = c.per_channel ? static_cast<int64_t>(r) : 0,
                    r1 = c.per_channel ? r0 + 1 : rows;
      for (int64_t i = r0 * cols; i < r1 * cols; ++i)
        amax = std::max(amax, std::abs(vals[static_cast<size_t>(i)]));
      // Not exactly amax / 448: scales with full fp32 mantissas, as calibration gives.
      scale[r] = static_cast<float>(amax / 448.0 * jitter(rng));
    }
    FixtureTensor q{name, "F8_E4M3", shape, std::vector<uint8_t>(static_cast<size_t>(rows * cols))};
    std::vector<float> deq(q.bytes.size());
    for (int64_t i = 0; i < rows * cols; ++i) {
      const double s = scale[c.per_channel ? static_cast<size_t>(i / cols) : 0];
      const uint8_t code =
          quant::fp8_e4m3_encode(static_cast<float>(vals[static_cast<size_t>(i)] / s));
      q.bytes[static_cast<size_t>(i)] = code;
      deq[static_cast<size_t>(i)] =
          static_cast<float>(static_cast<double>(quant::fp8_e4m3_decode(code)) * s);
    }
    fp8.push_back(std::move(q));
    const std::vector<int64_t> sshape =
        c.per_channel ? std::vector<int64_t>{rows, 1} : std::vector<int64_t>{};
    fp8.push_back(f32_tensor(name + "_scale", sshape, scale));
    if (c.static_activations)
      fp8.push_back(f32_tensor(name.substr(0, name.size() - 6) + "input_scale", {}, {0.05f}));
    ref.push_back(f32_tensor(name, shape, deq));
  }
  nlohmann::json config = m.config;
  nlohmann::json ignore =
      c.ignore_lm_head ? nlohmann::json::array({"lm_head"}) : nlohmann::json::array();
  if (c.layout == Layout::kCompressedTensors) {
    nlohmann::json acts =
        c.static_activations
            ? nlohmann::json{{"type", "float"},
                             {"num_bits", 8},
                             {"strategy", "tensor"},
                             {"dynamic", false}}
            : nlohmann::json{
                  {"type", "float"}, {"num_bits", 8}, {"strategy", "token"}, {"dynamic", true}};
    config["quantization_config"] = {{"quant_method", "compressed-tensors"},
                                     {"format", "float-quantized"},
                                     {"config_groups",
                                      {{"group_0",
                                        {{"targets", {"Linear"}},
                                         {"weights",
                                          {{"type", "float"},
                                           {"num_bits", 8},
                                           {"strategy", c.per_channel ? "channel" : "tensor"},
                                           {"dynamic", false},
                                           {"symmetric", true}}},
                                         {"input_activations", acts}}}}},
                                     {"ignore", ignore}};
  } else {
    config["quantization_config"] = {
        {"quant_method", "modelopt"}, {"quant_algo", "FP8"}, {"exclude_modules", ignore}};
  }
  reference_dir = make_model_dir(m.config, ref);
  if (tensors_out != nullptr) *tensors_out = fp8;
  return make_model_dir(config, fp8);
}

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
