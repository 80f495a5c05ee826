// kvq's forward pass against an independent float64 re-implementation of the Hugging Face
// semantics, on tiny random models of every supported family (float32 KV cache).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "kvq/io/safetensors.h"
#include "model_test_util.h"

namespace kvq::test {
namespace {

struct Case {
  std::string name;
  TinySpec spec;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

std::vector<Case> cases() {
  std::vector<Case> c;
  TinySpec s;
  c.push_back({"llama", s});
  s = {};
  s.attention_bias = s.mlp_bias = s.tie = true;
  c.push_back({"llama_biases_tied", s});
  s = {};
  s.family = "qwen2";
  s.tie = true;
  c.push_back({"qwen2", s});
  s = {};
  s.family = "qwen3";
  s.q_heads = 8;
  c.push_back({"qwen3", s});
  s.layer_types = {"sliding_attention", "full_attention", "sliding_attention"};
  s.sliding_window = 7;
  s.attention_bias = true;
  c.push_back({"qwen3_sliding_bias", s});
  s = {};
  s.family = "mistral";
  s.layers = 4;
  s.layer_types = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  s.sliding_window = 9;
  c.push_back({"mistral_sliding", s});
  s = {};
  s.rope_scaling = {{"rope_type", "llama3"},
                    {"factor", 8.0},
                    {"low_freq_factor", 1.0},
                    {"high_freq_factor", 4.0},
                    {"original_max_position_embeddings", 16}};
  c.push_back({"llama3_rope", s});
  s.rope_parameters = true;  // the same, in transformers 5's rope_parameters
  s.theta = 500000.0;
  c.push_back({"llama3_rope_parameters", s});
  s = {};
  s.rope_scaling = {{"type", "linear"}, {"factor", 2.5}};
  c.push_back({"linear_rope", s});
  return c;
}

class ReferenceForward : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceForward, LogitsMatchFloat64Reference) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const TinySpec& spec = GetParam().spec;
  const TinyModel m = make_tiny_model(spec, rng);
  std::shared_ptr<const Model> model = Model::load(plan_for(m.dir));
  for (const AttentionBackend* b : model->layer_backends()) EXPECT_EQ(b->name(), "cpu_avx512");

  const int n = 37;
  const auto tokens = random_tokens(n, spec.vocab, rng);
  Runner run(model, 8);
  const std::vector<float> got = run.step({1}, {tokens});
  const auto want = ref_forward(m, tokens);

  double max_abs = 0, max_ref = 0;
  int bad = 0;
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < spec.vocab; ++i) {
      const double r = want[t][i], g = got[static_cast<size_t>(t) * spec.vocab + i];
      const double err = std::abs(g - r);
      max_abs = std::max(max_abs, err);
      max_ref = std::max(max_ref, std::abs(r));
      // fp32 activations and weights vs float64: a few ulps per op over a handful of layers.
      if (!(err <= 2e-4 + 2e-4 * std::abs(r)) && bad++ < 5)
        ADD_FAILURE() << "position " << t << " logit " << i << ": kvq " << g << ", float64 " << r;
    }
  std::printf("[ %s ] max |logit| %.3f, max abs error vs float64 %.3g\n", GetParam().name.c_str(),
              max_ref, max_abs);
  EXPECT_EQ(bad, 0);
}

INSTANTIATE_TEST_SUITE_P(Families, ReferenceForward, ::testing::ValuesIn(cases()),
                         [](const auto& p) { return p.param.name; });

// bf16 / f16 checkpoints convert by value: the same rounded values stored as F32 give
// bit-identical logits for f16 (converted to fp32 at load) and the same logits up to the
// summation order for bf16 (kept as bf16 and multiplied by model::Linear's bf16 kernels).
TEST(WeightConversion, Bf16AndF16MatchTheirF32Values) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const char* dtype : {"BF16", "F16"}) {
    std::mt19937 rng(seed);
    TinySpec s;
    s.family = "qwen3";
    s.layers = 2;
    s.weight_dtype = dtype;
    const TinyModel half = make_tiny_model(s, rng);
    // Rewrite the same values as F32.
    std::vector<FixtureTensor> tensors;
    for (const auto& [name, vals] : half.w) {
      std::vector<float> f(vals.begin(), vals.end());
      tensors.push_back(f32_tensor(name, {static_cast<int64_t>(f.size())}, f));
    }
    // Shapes: read them back from the half-precision checkpoint's header.
    const auto files = CheckpointFiles::open(half.dir);
    for (auto& t : tensors) t.shape = files.find(t.name).second->shape;
    const std::string f32_dir = make_model_dir(half.config, tensors);

    const auto tokens = random_tokens(20, s.vocab, rng);
    Runner a(Model::load(plan_for(half.dir)), 4), b(Model::load(plan_for(f32_dir)), 4);
    const auto la = a.step({1}, {tokens}), lb = b.step({1}, {tokens});
    ASSERT_EQ(la.size(), lb.size());
    const bool bf16 = std::string(dtype) == "BF16";
    for (size_t i = 0; i < la.size(); ++i) {
      if (bf16) {
        ASSERT_NEAR(la[i], lb[i], 2e-5 + 2e-5 * std::abs(lb[i])) << dtype << " logit " << i;
      } else {
        ASSERT_EQ(la[i], lb[i]) << dtype << " logit " << i;
      }
    }
  }
}

// A checkpoint sharded over two files (model.safetensors.index.json) loads the same weights.
TEST(WeightConversion, ShardedCheckpointMatchesSingleFile) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  TinySpec s;
  s.layers = 2;
  const TinyModel m = make_tiny_model(s, rng);
  const auto files = CheckpointFiles::open(m.dir);
  std::vector<FixtureTensor> shard[2];
  nlohmann::json weight_map = nlohmann::json::object();
  int i = 0;
  for (const auto& [name, vals] : m.w) {
    const int which = i++ % 2;
    shard[which].push_back(f32_tensor(name, files.find(name).second->shape,
                                      std::vector<float>(vals.begin(), vals.end())));
    weight_map[name] = "model-0000" + std::to_string(which + 1) + "-of-00002.safetensors";
  }
  const std::string dir = make_model_dir(m.config, {}, /*with_weights=*/false);
  for (int w = 0; w < 2; ++w)
    write_safetensors(dir + "/model-0000" + std::to_string(w + 1) + "-of-00002.safetensors",
                      shard[w]);
  write_text(
      dir + "/model.safetensors.index.json",
      nlohmann::json{{"metadata", nlohmann::json::object()}, {"weight_map", weight_map}}.dump());

  const auto tokens = random_tokens(19, s.vocab, rng);
  Runner a(Model::load(plan_for(m.dir)), 4), b(Model::load(plan_for(dir)), 4);
  ASSERT_EQ(a.step({1}, {tokens}), b.step({1}, {tokens}));
}

}  // namespace
}  // namespace kvq::test
