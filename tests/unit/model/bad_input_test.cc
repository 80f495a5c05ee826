// Checkpoints and configs kvq cannot run fail at load with one line naming what is wrong.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <functional>

#include "kvq/io/safetensors.h"
#include "model_test_util.h"

namespace kvq::test {
namespace {

// The message of the InputError `f` throws ("" and a test failure when it throws none).
std::string input_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << "multi-line message: " << m;
    return m;
  }
  ADD_FAILURE() << "no InputError";
  return "";
}

// A tiny llama's tensors as F32 fixtures, for editing before they are written.
struct Checkpoint {
  nlohmann::json config;
  std::vector<FixtureTensor> tensors;

  static Checkpoint tiny(std::mt19937& rng) {
    TinySpec s;
    s.layers = 2;
    s.head_dim = 32;
    const TinyModel m = make_tiny_model(s, rng);
    const auto files = CheckpointFiles::open(m.dir);
    Checkpoint c{m.config, {}};
    for (const auto& [name, vals] : m.w)
      c.tensors.push_back(f32_tensor(name, files.find(name).second->shape,
                                     std::vector<float>(vals.begin(), vals.end())));
    return c;
  }
  FixtureTensor& at(const std::string& name) {
    for (auto& t : tensors)
      if (t.name == name) return t;
    throw std::runtime_error("no fixture tensor " + name);
  }
  void erase(const std::string& name) {
    std::erase_if(tensors, [&](const FixtureTensor& t) { return t.name == name; });
  }
  std::string load_error() const {
    const std::string dir = make_model_dir(config, tensors);
    return input_error([&] { Model::load(plan_for(dir)); });
  }
};

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

TEST_F(BadInput, MissingTensorIsNamed) {
  Checkpoint c = Checkpoint::tiny(rng_);
  c.erase("model.layers.1.mlp.up_proj.weight");
  const std::string m = c.load_error();
  EXPECT_NE(m.find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << m;
}

TEST_F(BadInput, WrongShapeIsNamedWithBothShapes) {
  Checkpoint c = Checkpoint::tiny(rng_);
  FixtureTensor& t = c.at("model.layers.0.self_attn.k_proj.weight");  // [64, 128]
  t.shape = {128, 64};
  const std::string m = c.load_error();
  EXPECT_NE(m.find("model.layers.0.self_attn.k_proj.weight"), std::string::npos) << m;
  EXPECT_NE(m.find("[128, 64]"), std::string::npos) << m;
  EXPECT_NE(m.find("[64, 128]"), std::string::npos) << m;
}

TEST_F(BadInput, QuantizedWeightsAreRefused) {
  for (const char* dtype : {"F8_E4M3", "I8"}) {
    Checkpoint c = Checkpoint::tiny(rng_);
    FixtureTensor& t = c.at("model.layers.1.self_attn.q_proj.weight");
    t.dtype = dtype;
    t.bytes.resize(t.bytes.size() / 4);  // one byte per element
    const std::string m = c.load_error();
    EXPECT_NE(m.find("model.layers.1.self_attn.q_proj.weight"), std::string::npos) << m;
    EXPECT_NE(m.find(dtype), std::string::npos) << m;
  }
}

TEST_F(BadInput, UnsupportedArchitectureListsSupportedOnes) {
  Checkpoint c = Checkpoint::tiny(rng_);
  c.config["architectures"] = {"GPTNeoXForCausalLM"};
  const std::string m = c.load_error();
  EXPECT_NE(m.find("GPTNeoXForCausalLM"), std::string::npos) << m;
  for (const char* a :
       {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
    EXPECT_NE(m.find(a), std::string::npos) << m;
}

TEST_F(BadInput, UnsupportedConfigFields) {
  Checkpoint c = Checkpoint::tiny(rng_);
  c.config["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  std::string m = c.load_error();
  EXPECT_NE(m.find("yarn"), std::string::npos) << m;
  EXPECT_NE(m.find("llama3"), std::string::npos) << m;

  c = Checkpoint::tiny(rng_);
  c.config["hidden_act"] = "gelu";
  m = c.load_error();
  EXPECT_NE(m.find("gelu"), std::string::npos) << m;

  c = Checkpoint::tiny(rng_);
  c.config.erase("intermediate_size");
  m = c.load_error();
  EXPECT_NE(m.find("intermediate_size"), std::string::npos) << m;
}

TEST_F(BadInput, NoWeightsFile) {
  Checkpoint c = Checkpoint::tiny(rng_);
  const std::string dir = make_model_dir(c.config, {}, /*with_weights=*/false);
  const std::string m = input_error([&] { Model::load(plan_for(dir)); });
  EXPECT_NE(m.find("model.safetensors"), std::string::npos) << m;
}

TEST_F(BadInput, TokenOutsideVocabulary) {
  Checkpoint c = Checkpoint::tiny(rng_);
  const std::string dir = make_model_dir(c.config, c.tensors);
  Runner run(Model::load(plan_for(dir)), 4);
  const std::string m = input_error([&] { run.step({1}, {{3, 211}}); });
  EXPECT_NE(m.find("211"), std::string::npos) << m;
}

// A bad CPU kernel switch fails the load with its one-line error, rather than every request
// later on an engine thread. In a fresh process (the switches are read once per process); the
// check comes before the plan is read, so the empty plan creates nothing.
TEST(BadCpuSwitchDeathTest, FailsTheLoad) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (const char* var : {"KVQ_CPU_ISA", "KVQ_CPU_INT_DOT", "KVQ_CPU_FP8_SCALE_AFTER"}) {
    EXPECT_EXIT(
        {
          setenv(var, "avx9000", 1);
          try {
            (void)Model::load(KvPlan{});
          } catch (const InputError& e) {
            const std::string m = e.what();
            std::fprintf(stderr, "%s\n", m.c_str());
            std::exit(m.find(var) != std::string::npos && m.find('\n') == std::string::npos ? 0
                                                                                            : 1);
          }
          std::exit(2);
        },
        ::testing::ExitedWithCode(0), var);
  }
}

TEST_F(BadInput, ForcedBackend) {
  Checkpoint c = Checkpoint::tiny(rng_);  // head_dim 32: cpu_avx512 runs 64, 128, 256
  const std::string dir = make_model_dir(c.config, c.tensors);
  const std::string m = input_error([&] { Model::load(plan_for(dir), "cpu_avx512"); });
  EXPECT_NE(m.find("cpu_avx512"), std::string::npos) << m;
  const auto model = Model::load(plan_for(dir), "cpu_reference");
  for (const AttentionBackend* b : model->layer_backends()) EXPECT_EQ(b->name(), "cpu_reference");
}

TEST(Architecture, ParsesTransformers4And5Spellings) {
  TinySpec s;
  s.family = "qwen2";
  s.theta = 123456.0;
  s.rope_scaling = {{"type", "linear"}, {"factor", 3.0}};
  ArchitectureConfig a = parse_architecture(parse_model_config(tiny_config(s), "config.json"));
  EXPECT_EQ(a.family, ModelFamily::kQwen2);
  EXPECT_TRUE(a.qkv_bias);
  EXPECT_FALSE(a.o_bias);
  EXPECT_FLOAT_EQ(a.rope_theta, 123456.0f);
  EXPECT_EQ(a.rope_scaling.kind, RopeScaling::Kind::kLinear);
  EXPECT_FLOAT_EQ(a.rope_scaling.factor, 3.0f);

  s = {};
  s.family = "qwen3";
  s.rope_parameters = true;
  s.theta = 5e5;
  s.rope_scaling = {{"rope_type", "llama3"},
                    {"factor", 32.0},
                    {"low_freq_factor", 2.0},
                    {"high_freq_factor", 8.0},
                    {"original_max_position_embeddings", 4096}};
  a = parse_architecture(parse_model_config(tiny_config(s), "config.json"));
  EXPECT_TRUE(a.qk_norm);
  EXPECT_FALSE(a.qkv_bias);
  EXPECT_FLOAT_EQ(a.rope_theta, 5e5f);
  EXPECT_EQ(a.rope_scaling.kind, RopeScaling::Kind::kLlama3);
  EXPECT_FLOAT_EQ(a.rope_scaling.factor, 32.0f);
  EXPECT_FLOAT_EQ(a.rope_scaling.low_freq_factor, 2.0f);
  EXPECT_FLOAT_EQ(a.rope_scaling.high_freq_factor, 8.0f);
  EXPECT_EQ(a.rope_scaling.original_max_position_embeddings, 4096);
}

}  // namespace
}  // namespace kvq::test
