// Synthetic model shapes: every name parses like a real checkpoint, builds a KV plan of the
// real model's size, and an unknown name is an InputError listing the known ones.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kvq/core/error.h"
#include "kvq/model/cuda_model.h"
#include "kvq/model/model.h"
#include "kvq/plan/kv_plan.h"

namespace kvq {
namespace {

// The published shapes, written out here independently of src/model/synthetic.cc.
struct Shape {
  std::string name;
  ModelFamily family;
  int layers, hidden, q_heads, kv_heads, head_dim, inter, vocab, max_pos;
  float rope_theta, eps;
  bool qkv_bias, qk_norm;
  RopeScaling::Kind rope;
};

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> k = {
      {"llama3-8b", ModelFamily::kLlama, 32, 4096, 32, 8, 128, 14336, 128256, 8192, 500000.0f,
       1e-5f, false, false, RopeScaling::Kind::kNone},
      {"llama3.1-8b", ModelFamily::kLlama, 32, 4096, 32, 8, 128, 14336, 128256, 131072, 500000.0f,
       1e-5f, false, false, RopeScaling::Kind::kLlama3},
      {"llama3-70b", ModelFamily::kLlama, 80, 8192, 64, 8, 128, 28672, 128256, 8192, 500000.0f,
       1e-5f, false, false, RopeScaling::Kind::kNone},
      {"llama3.1-70b", ModelFamily::kLlama, 80, 8192, 64, 8, 128, 28672, 128256, 131072, 500000.0f,
       1e-5f, false, false, RopeScaling::Kind::kLlama3},
      {"qwen3-8b", ModelFamily::kQwen3, 36, 4096, 32, 8, 128, 12288, 151936, 40960, 1e6f, 1e-6f,
       false, true, RopeScaling::Kind::kNone},
      {"qwen2.5-7b", ModelFamily::kQwen2, 28, 3584, 28, 4, 128, 18944, 152064, 131072, 1e6f, 1e-6f,
       true, false, RopeScaling::Kind::kNone},
      // Llama-3-8B's layers, 5 of them: the body of a DFlash drafter for it (timing only).
      {"llama3-8b-dflash5", ModelFamily::kLlama, 5, 4096, 32, 8, 128, 14336, 128256, 8192,
       500000.0f, 1e-5f, false, false, RopeScaling::Kind::kNone},
  };
  return k;
}

KvPlanOptions fp8_options() {
  KvPlanOptions o;
  o.kv = DtypeFlag{*parse_kv_dtype("fp8"), "--kv-cache-dtype fp8"};
  return o;
}

TEST(Synthetic, NamesAreExactlyTheKnownShapes) {
  std::vector<std::string> expected;
  for (const auto& s : shapes()) expected.push_back(s.name);
  EXPECT_EQ(synthetic_model_names(), expected);
}

TEST(Synthetic, EveryNameParsesWithTheRealShape) {
  for (const auto& s : shapes()) {
    SCOPED_TRACE(s.name);
    const ModelConfig c = synthetic_model_config(s.name);
    EXPECT_TRUE(c.dir.empty());
    EXPECT_EQ(c.torch_dtype, "bfloat16");
    EXPECT_EQ(c.model_dtype, KvDtype::kBFloat16);
    EXPECT_EQ(c.num_layers, s.layers);
    EXPECT_EQ(c.num_q_heads, s.q_heads);
    EXPECT_EQ(c.num_kv_heads, s.kv_heads);
    EXPECT_EQ(c.head_dim, s.head_dim);
    EXPECT_EQ(c.hidden_size, s.hidden);
    EXPECT_EQ(c.vocab_size, s.vocab);
    EXPECT_EQ(c.max_position_embeddings, s.max_pos);
    EXPECT_EQ(c.sliding_window, 0);
    for (auto k : c.layer_attention) EXPECT_EQ(k, AttentionKind::kCausal);
    EXPECT_TRUE(c.warnings.empty()) << c.warnings.front();

    const ArchitectureConfig a = parse_architecture(c);
    EXPECT_EQ(a.family, s.family);
    EXPECT_EQ(a.hidden_size, s.hidden);
    EXPECT_EQ(a.intermediate_size, s.inter);
    EXPECT_EQ(a.vocab_size, s.vocab);
    EXPECT_EQ(a.rope_theta, s.rope_theta);
    EXPECT_EQ(a.rms_norm_eps, s.eps);
    EXPECT_FALSE(a.tie_word_embeddings);
    EXPECT_EQ(a.qkv_bias, s.qkv_bias);
    EXPECT_FALSE(a.o_bias);
    EXPECT_FALSE(a.mlp_bias);
    EXPECT_EQ(a.qk_norm, s.qk_norm);
    EXPECT_EQ(a.rope_scaling.kind, s.rope);
    if (s.rope == RopeScaling::Kind::kLlama3) {
      EXPECT_EQ(a.rope_scaling.factor, 8.0f);
      EXPECT_EQ(a.rope_scaling.low_freq_factor, 1.0f);
      EXPECT_EQ(a.rope_scaling.high_freq_factor, 4.0f);
      EXPECT_EQ(a.rope_scaling.original_max_position_embeddings, 8192);
    }
  }
}

TEST(Synthetic, Fp8PlanHasTheModelsLayersAndBytesPerToken) {
  for (const auto& s : shapes()) {
    SCOPED_TRACE(s.name);
    const KvPlan p = make_kv_plan(synthetic_model_config(s.name), fp8_options());
    ASSERT_EQ(p.layers.size(), static_cast<size_t>(s.layers));
    for (const auto& l : p.layers) {
      EXPECT_EQ(l.k_dtype, KvDtype::kFp8E4M3);
      EXPECT_EQ(l.v_dtype, KvDtype::kFp8E4M3);
      EXPECT_EQ(l.num_kv_heads, s.kv_heads);
      EXPECT_EQ(l.head_dim_k, s.head_dim);
      EXPECT_EQ(l.head_dim_v, s.head_dim);
    }
    // K + V, every layer, every kv head: 1 byte per element in fp8 (per-tensor scales add
    // nothing per token), 2 in bfloat16. llama3-8b bf16: 2 * 32 * 8 * 128 * 2 = 131072 B.
    const size_t elems = size_t{2} * s.layers * s.kv_heads * s.head_dim;
    EXPECT_EQ(p.bytes_per_token(), elems * 1);
    EXPECT_EQ(p.bf16_bytes_per_token(), elems * 2);
  }
  EXPECT_EQ(make_kv_plan(synthetic_model_config("llama3-8b"), {}).bytes_per_token(), 131072u);
}

// dir is empty: the planner must not look for checkpoint files relative to the working
// directory. Run it inside a directory full of broken ones.
TEST(Synthetic, PlanReadsNoFilesFromTheWorkingDirectory) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("kvq_synthetic_cwd_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const char* f :
       {"config.json", "hf_quant_config.json", "model.safetensors", "model.safetensors.index.json"})
    std::ofstream(dir / f) << "{ not json";
  const fs::path old = fs::current_path();
  fs::current_path(dir);
  try {
    for (const auto& name : synthetic_model_names()) {
      SCOPED_TRACE(name);
      KvPlan p;
      EXPECT_NO_THROW(p = make_kv_plan(synthetic_model_config(name), fp8_options()));
      EXPECT_EQ(p.layers.size(), static_cast<size_t>(synthetic_model_config(name).num_layers));
    }
  } catch (...) {
    fs::current_path(old);
    throw;
  }
  fs::current_path(old);
  fs::remove_all(dir);
}

TEST(Synthetic, UnknownNameIsAnInputErrorListingTheNames) {
  try {
    synthetic_model_config("llama3-405b", "--synthetic");
    FAIL() << "no InputError";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--synthetic"), std::string::npos) << m;
    EXPECT_NE(m.find("llama3-70b"), std::string::npos) << m;
    for (const auto& n : synthetic_model_names()) EXPECT_NE(m.find(n), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_THROW(synthetic_model_config("", "--synthetic"), InputError);
  EXPECT_THROW(synthetic_model_config("LLAMA3-8B", "--synthetic"), InputError);
}

}  // namespace
}  // namespace kvq
