// Plans that mix KV dtypes per layer run end to end: finite logits, and the top-1 token
// agrees with the float32-cache run on most positions.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "model_test_util.h"
#include "support/source_dir.h"

namespace kvq::test {
namespace {

void set_side(LayerKvSpec& spec, KvSide side, KvDtype d) {
  (side == KvSide::kK ? spec.k_dtype : spec.v_dtype) = d;
  ScaleSource& src = side == KvSide::kK ? spec.k_scale : spec.v_scale;
  src = {};
  if (traits(d).scale_kind == ScaleKind::kPerTokenHead) {
    src.kind = ScaleSourceKind::kDynamic;
  } else if (traits(d).uses_tensor_scale) {
    src.kind = ScaleSourceKind::kDefaultOne;
    src.values = {1.0f};
  }
}

// Layer i gets (K, V) = dtypes[i % size].
KvPlan mixed_plan(KvPlan plan, const std::vector<std::pair<KvDtype, KvDtype>>& dtypes) {
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    set_side(plan.layers[i], KvSide::kK, dtypes[i % dtypes.size()].first);
    set_side(plan.layers[i], KvSide::kV, dtypes[i % dtypes.size()].second);
    EXPECT_TRUE(plan.layers[i].validation_errors().empty());
  }
  return plan;
}

const std::vector<std::pair<KvDtype, KvDtype>> kMix = {
    {KvDtype::kBFloat16, KvDtype::kBFloat16},
    {KvDtype::kInt8PerTokenHead, KvDtype::kInt8PerTokenHead},
    {KvDtype::kFp8E4M3, KvDtype::kFp8E4M3},
    {KvDtype::kFp8PerTokenHead, KvDtype::kInt4PerTokenHead},
};

struct Agreement {
  int same = 0, total = 0;
  double max_abs = 0;
  double fraction() const { return total ? static_cast<double>(same) / total : 0; }
};

// Runs `prompts` through both models (one prefill each) and compares every position.
Agreement compare(std::shared_ptr<const Model> ref, std::shared_ptr<const Model> quant,
                  const std::vector<std::vector<int32_t>>& prompts) {
  Agreement a;
  const int V = ref->vocab_size();
  for (const auto& p : prompts) {
    const int32_t blocks = static_cast<int32_t>(p.size() / 16 + 2);
    Runner r(ref, blocks), q(quant, blocks);
    const auto lr = r.step({1}, {p}), lq = q.step({1}, {p});
    for (size_t i = 0; i < lq.size(); ++i) {
      EXPECT_TRUE(std::isfinite(lq[i])) << "logit " << i << " is not finite";
      a.max_abs = std::max(a.max_abs, std::abs(static_cast<double>(lq[i]) - lr[i]));
    }
    for (size_t t = 0; t < p.size(); ++t, ++a.total)
      a.same += argmax(lr.data() + t * V, V) == argmax(lq.data() + t * V, V);
  }
  return a;
}

TEST(QuantizedPlans, MixedDtypesPerLayerRunAndAgreeOnTop1) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  TinySpec s;
  s.family = "qwen3";
  s.layers = 4;
  s.q_heads = 8;
  s.layer_types = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  s.sliding_window = 13;
  const TinyModel m = make_tiny_model(s, rng);
  std::shared_ptr<const Model> ref = Model::load(plan_for(m.dir));
  std::shared_ptr<const Model> mixed = ref->with_plan(mixed_plan(ref->plan(), kMix));
  for (size_t i = 0; i < kMix.size(); ++i)
    EXPECT_EQ(mixed->layer_backends()[i]->name(), "cpu_avx512") << "layer " << i;
  std::shared_ptr<const Model> int4 = ref->with_plan(
      mixed_plan(ref->plan(), {{KvDtype::kInt4PerTokenHead, KvDtype::kInt4PerTokenHead}}));

  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 3; ++i) prompts.push_back(random_tokens(48, s.vocab, rng));
  const Agreement am = compare(ref, mixed, prompts), a4 = compare(ref, int4, prompts);
  std::printf(
      "[ random qwen3 ] top-1 agreement with float32 cache: mixed %d/%d (%.1f%%, max abs "
      "logit diff %.3g), int4 everywhere %d/%d (%.1f%%, %.3g)\n",
      am.same, am.total, 100 * am.fraction(), am.max_abs, a4.same, a4.total, 100 * a4.fraction(),
      a4.max_abs);
  // Random weights give flat logits (small top-1 margins), so only a loose bound is robust.
  EXPECT_GE(am.fraction(), 0.75);
  EXPECT_GE(a4.fraction(), 0.6);
}

// The same on the committed default model, on its golden prompts.
TEST(QuantizedPlans, DefaultModelTop1Agreement) {
  const std::string dir = ::kvq::test::source_dir() + "/models/kvq-code-tiny";
  if (!std::filesystem::exists(dir + "/model.safetensors")) GTEST_SKIP() << dir << " is absent";
  std::ifstream in(::kvq::test::source_dir() + "/tests/fixtures/goldens/model_kvq-code-tiny.json");
  const auto index = nlohmann::json::parse(in);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& e : index["logits"])
    if (e["prompt_ids"].size() > 1) prompts.push_back(e["prompt_ids"].get<std::vector<int32_t>>());

  std::shared_ptr<const Model> ref = Model::load(plan_for(dir));
  for (const auto& [name, mix] :
       std::vector<std::pair<std::string, std::vector<std::pair<KvDtype, KvDtype>>>>{
           {"mixed", kMix},
           {"int8_per_token_head", {{KvDtype::kInt8PerTokenHead, KvDtype::kInt8PerTokenHead}}},
           {"fp8_e4m3", {{KvDtype::kFp8E4M3, KvDtype::kFp8E4M3}}},
           {"int4_per_token_head", {{KvDtype::kInt4PerTokenHead, KvDtype::kInt4PerTokenHead}}}}) {
    const Agreement a = compare(ref, ref->with_plan(mixed_plan(ref->plan(), mix)), prompts);
    std::printf(
        "[ kvq-code-tiny %s ] top-1 agreement with float32 cache %d/%d (%.1f%%), max abs "
        "logit diff %.3g\n",
        name.c_str(), a.same, a.total, 100 * a.fraction(), a.max_abs);
    EXPECT_GE(a.fraction(), 0.8) << name;
  }
}

}  // namespace
}  // namespace kvq::test
