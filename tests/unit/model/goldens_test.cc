// kvq against Hugging Face transformers (float32, eager attention, no KV cache): the logits
// and greedy continuations in tests/fixtures/goldens (written by tools/make_goldens.py) for
// stories260K and kvq-code-tiny, run here with a float32 KV cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "model_test_util.h"
#include "support/source_dir.h"

namespace kvq::test {
namespace {

const std::string kGoldens = ::kvq::test::source_dir() + "/tests/fixtures/goldens/";

nlohmann::json read_index(const std::string& model) {
  std::ifstream in(kGoldens + "model_" + model + ".json");
  EXPECT_TRUE(in.good()) << "no golden index for " << model;
  return nlohmann::json::parse(in);
}

std::vector<float> read_floats(const std::string& path, size_t n) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::vector<float> v(n);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  EXPECT_EQ(static_cast<size_t>(in.gcount()), n * sizeof(float)) << path << " is short";
  return v;  // little-endian fp32: this machine's order
}

class Goldens : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    index_ = read_index(GetParam());
    dir_ = ::kvq::test::source_dir() + "/" + index_["model_path"].get<std::string>();
    if (!std::filesystem::exists(dir_ + "/model.safetensors"))
      GTEST_SKIP() << "model folder " << dir_ << " is absent; skipping its golden comparison";
    model_ = Model::load(plan_for(dir_, KvDtype::kFloat32));
  }
  int32_t blocks_for(size_t tokens) const { return static_cast<int32_t>(tokens / 16 + 4); }

  nlohmann::json index_;
  std::string dir_;
  std::shared_ptr<const Model> model_;
};

TEST_P(Goldens, LogitsMatchTransformers) {
  const int V = model_->vocab_size();
  for (const auto& e : index_["logits"]) {
    const auto ids = e["prompt_ids"].get<std::vector<int32_t>>();
    const auto positions = e["positions"].get<std::vector<int32_t>>();
    ASSERT_EQ(e["shape"][1].get<int>(), V);
    const auto want = read_floats(kGoldens + e["file"].get<std::string>(), positions.size() * V);
    Runner run(model_, blocks_for(ids.size()));
    const auto got = run.step({1}, {ids});
    double max_abs = 0;
    int argmax_diff = 0;
    for (size_t r = 0; r < positions.size(); ++r) {
      const float* g = got.data() + static_cast<size_t>(positions[r]) * V;
      const float* w = want.data() + r * V;
      for (int i = 0; i < V; ++i) {
        const double err = std::abs(static_cast<double>(g[i]) - w[i]);
        max_abs = std::max(max_abs, err);
        // Both sides are fp32; summation orders differ (BLAS vs PyTorch, online vs two-pass
        // softmax). Measured max errors are 4e-6 to 3e-5 on logits up to ~21.
        ASSERT_LE(err, 5e-4 + 5e-5 * std::abs(w[i]))
            << e["name"] << " position " << positions[r] << " logit " << i;
      }
      argmax_diff += argmax(g, V) != e["argmax"][r].get<int>();
    }
    std::printf("[ %s/%s ] %zu tokens, %zu rows: max abs logit error vs transformers %.3g\n",
                GetParam().c_str(), e["name"].get<std::string>().c_str(), ids.size(),
                positions.size(), max_abs);
    EXPECT_EQ(argmax_diff, 0) << e["name"] << ": argmax differs from transformers'";
  }
}

TEST_P(Goldens, GreedyContinuationsMatchTransformers) {
  const int V = model_->vocab_size();
  for (const auto& g : index_["greedy"]) {
    const auto prompt = g["prompt_ids"].get<std::vector<int32_t>>();
    const auto want = g["ids"].get<std::vector<int32_t>>();
    if (GetParam() == "stories260K" && g["name"] == "bos") {  // the fixture tells the known story
      EXPECT_EQ(g["text"].get<std::string>().rfind(
                    "Once upon a time, there was a little girl named Lily.", 0),
                0u);
    }
    Runner run(model_, blocks_for(prompt.size() + want.size()));
    std::vector<float> logits = run.step({1}, {prompt});
    std::vector<int32_t> got;
    for (size_t i = 0; i < want.size(); ++i) {
      got.push_back(argmax(logits.data() + logits.size() - V, V));
      logits = run.step({1}, {{got.back()}});
    }
    EXPECT_EQ(got, want) << GetParam() << "/" << g["name"]
                         << " (transformers' text: " << g["text"].get<std::string>() << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Models, Goldens, ::testing::Values("stories260K", "kvq-code-tiny"),
                         [](const auto& p) {
                           std::string n = p.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace kvq::test
