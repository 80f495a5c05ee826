// --speculative-config parsing, and the drafter bug class: a drafter is planned by the same
// planner from the same flags as the target, so it is quantized like the target unless the
// speculative config says otherwise, and an explicit dtype beats a checkpoint's scheme for it too.
#include "kvq/plan/speculative_config.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "kvq/core/error.h"
#include "support/fixtures.h"

namespace kvq {
namespace {

using json = nlohmann::json;

// Fixture directories, removed when the test ends.
struct TempDirs {
  std::vector<std::string> dirs;
  std::string add(const json& config, const std::vector<test::FixtureTensor>& tensors = {}) {
    dirs.push_back(test::make_model_dir(config, tensors));
    return dirs.back();
  }
  ~TempDirs() {
    for (const auto& d : dirs) std::filesystem::remove_all(d);
  }
};

void expect_input_error(const std::string& text, const std::string& needle) {
  try {
    (void)parse_speculative_config(text);
    ADD_FAILURE() << text << ": no error";
  } catch (const InputError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--speculative-config"), std::string::npos) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << text << " -> " << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << "one line: " << what;
  }
}

TEST(SpeculativeConfig, ParsesEveryKey) {
  const SpeculativeConfig n = parse_speculative_config(
      R"({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
          "prompt_lookup_max": 6, "disable_by_batch_size": 16, "auto_disable": true})");
  EXPECT_EQ(n.method, SpecMethod::kNgram);
  EXPECT_EQ(n.num_speculative_tokens, 5);
  EXPECT_EQ(n.prompt_lookup_min, 1);
  EXPECT_EQ(n.prompt_lookup_max, 6);
  EXPECT_EQ(n.disable_by_batch_size, 16);
  EXPECT_TRUE(n.auto_disable);
  EXPECT_TRUE(n.model.empty());

  const SpeculativeConfig d = parse_speculative_config(
      R"({"method": "draft_model", "model": "/m", "num_speculative_tokens": 3,
          "kv_cache_dtype": "bf16", "kv_cache_dtype_skip_layers": "0"})");
  EXPECT_EQ(d.method, SpecMethod::kDraftModel);
  EXPECT_EQ(d.model, "/m");
  ASSERT_TRUE(d.kv_cache_dtype.has_value());
  EXPECT_EQ(d.kv_cache_dtype->dtype, KvDtype::kBFloat16);
  EXPECT_TRUE(d.skip_layers_given);
  EXPECT_FALSE(d.auto_disable);  // the default
  EXPECT_EQ(parse_speculative_config(R"({"method":"dflash","model":"x","num_speculative_tokens":8})")
                .method,
            SpecMethod::kDflash);
  // prompt_lookup_min follows a smaller max when not given.
  EXPECT_EQ(parse_speculative_config(
                R"({"method":"ngram","num_speculative_tokens":2,"prompt_lookup_max":1})")
                .prompt_lookup_min,
            1);
}

TEST(SpeculativeConfig, BadInputIsOneLineNamingTheKey) {
  expect_input_error("{", "not valid JSON");
  expect_input_error("[1]", "JSON object");
  expect_input_error(R"({"num_speculative_tokens": 4})", "\"method\" is required");
  expect_input_error(R"({"method": "medusa", "num_speculative_tokens": 4})", "unknown method");
  expect_input_error(R"({"method": "ngram"})", "num_speculative_tokens");
  expect_input_error(R"({"method": "ngram", "num_speculative_tokens": 4, "auto_disable": 1})",
                     "\"auto_disable\" must be true or false");
  expect_input_error(R"({"method": "ngram", "num_speculative_tokens": 0})", "1..16");
  expect_input_error(R"({"method": "ngram", "num_speculative_tokens": 17})", "1..16");
  expect_input_error(R"({"method": "ngram", "num_speculative_tokens": "4"})", "integer");
  expect_input_error(R"({"method": "ngram", "num_speculative_tokens": 4, "model": "x"})",
                     "takes no \"model\"");
  expect_input_error(R"({"method": "draft_model", "num_speculative_tokens": 4})", "needs \"model\"");
  expect_input_error(R"({"method": "ngram", "num_speculative_tokens": 4, "k": 2})",
                     "unknown key \"k\"");
  expect_input_error(
      R"({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 2})",
      "prompt_lookup_min");
  expect_input_error(
      R"({"method": "draft_model", "model": "x", "num_speculative_tokens": 4, "prompt_lookup_max": 2})",
      "ngram");
  expect_input_error(
      R"({"method": "draft_model", "model": "x", "num_speculative_tokens": 4, "kv_cache_dtype": "fp9"})",
      "kv_cache_dtype");
  expect_input_error(R"({"method": "ngram", "num_speculative_tokens": 4, "kv_cache_dtype": "fp8"})",
                     "no drafter model");
}

KvPlanOptions target_flags(std::optional<KvDtype> kv, std::string skip = "") {
  KvPlanOptions o;
  if (kv) o.kv = DtypeFlag{*kv, "--kv-cache-dtype " + std::string(to_string(*kv))};
  o.skip_layers = std::move(skip);
  return o;
}

SpeculativeConfig draft_config(const std::string& dir, const std::string& extra = "") {
  return parse_speculative_config(R"({"method": "draft_model", "model": ")" + dir +
                                  R"(", "num_speculative_tokens": 4)" + extra + "}");
}

// The drafter bug class: with fp8 for the target, every drafter layer is fp8.
TEST(DrafterPlan, IsQuantizedLikeTheTarget) {
  TempDirs dirs;
  const std::string dir = dirs.add(test::llama_config(2, 4, 2, 64, "bfloat16"));
  for (KvDtype kv : {KvDtype::kFp8E4M3, KvDtype::kInt8PerTokenHead, KvDtype::kInt4PerTokenHead,
                     KvDtype::kNvfp4}) {
    const KvPlan p = make_drafter_kv_plan(load_model_config(dir), target_flags(kv),
                                          draft_config(dir));
    ASSERT_EQ(p.layers.size(), 2u);
    for (size_t i = 0; i < p.layers.size(); ++i) {
      EXPECT_EQ(p.layers[i].k_dtype, kv) << to_string(kv) << " layer " << i;
      EXPECT_EQ(p.layers[i].v_dtype, kv) << to_string(kv) << " layer " << i;
      EXPECT_EQ(p.decisions[i].k.provenance, Provenance::kUserFlag);
    }
  }
  // -ctk / -ctv reach the drafter too.
  KvPlanOptions kv_split;
  kv_split.k = DtypeFlag{KvDtype::kInt8PerTokenHead, "-ctk int8_per_token_head"};
  kv_split.v = DtypeFlag{KvDtype::kFp8E4M3, "-ctv fp8"};
  const KvPlan split = make_drafter_kv_plan(load_model_config(dir), kv_split, draft_config(dir));
  for (const auto& l : split.layers) {
    EXPECT_EQ(l.k_dtype, KvDtype::kInt8PerTokenHead);
    EXPECT_EQ(l.v_dtype, KvDtype::kFp8E4M3);
  }
}

TEST(DrafterPlan, SpeculativeConfigOverridesTheDrafterOnly) {
  TempDirs dirs;
  const std::string dir = dirs.add(test::llama_config(2, 4, 2, 64, "bfloat16"));
  const SpeculativeConfig sc = draft_config(dir, R"(, "kv_cache_dtype": "int4_per_token_head")");
  const KvPlan p =
      make_drafter_kv_plan(load_model_config(dir), target_flags(KvDtype::kFp8E4M3), sc);
  for (size_t i = 0; i < p.layers.size(); ++i) {
    EXPECT_EQ(p.layers[i].k_dtype, KvDtype::kInt4PerTokenHead);
    EXPECT_EQ(p.decisions[i].k.provenance, Provenance::kUserFlag);
    EXPECT_NE(p.decisions[i].k.detail.find("--speculative-config kv_cache_dtype"),
              std::string::npos)
        << p.decisions[i].k.detail;
  }
  // The override replaces -ctk/-ctv as well.
  KvPlanOptions split;
  split.k = DtypeFlag{KvDtype::kFp8E4M3, "-ctk fp8"};
  const KvPlan q = make_drafter_kv_plan(load_model_config(dir), split, sc);
  for (const auto& l : q.layers) EXPECT_EQ(l.k_dtype, KvDtype::kInt4PerTokenHead);
}

// A drafter checkpoint that declares an fp8 KV scheme: an explicit bfloat16 (the target's flag)
// wins for the drafter too; with auto the drafter takes its own scheme.
TEST(DrafterPlan, ExplicitDtypeBeatsTheDrafterCheckpointScheme) {
  TempDirs dirs;
  json c = test::llama_config(2, 4, 2, 64, "bfloat16");
  c["quantization_config"] = {
      {"quant_method", "compressed-tensors"},
      {"kv_cache_scheme",
       {{"num_bits", 8}, {"type", "float"}, {"strategy", "tensor"}, {"dynamic", false}}}};
  const std::string dir = dirs.add(c);
  const KvPlan p = make_drafter_kv_plan(load_model_config(dir), target_flags(KvDtype::kBFloat16),
                                        draft_config(dir));
  for (size_t i = 0; i < p.layers.size(); ++i) {
    EXPECT_EQ(p.layers[i].k_dtype, KvDtype::kBFloat16);
    EXPECT_EQ(p.decisions[i].k.provenance, Provenance::kUserFlag);
  }
  const KvPlan via_override = make_drafter_kv_plan(
      load_model_config(dir), target_flags(std::nullopt),
      draft_config(dir, R"(, "kv_cache_dtype": "bfloat16")"));
  for (const auto& l : via_override.layers) EXPECT_EQ(l.k_dtype, KvDtype::kBFloat16);
  const KvPlan autoplan = make_drafter_kv_plan(load_model_config(dir),
                                               target_flags(std::nullopt), draft_config(dir));
  for (size_t i = 0; i < autoplan.layers.size(); ++i) {
    EXPECT_EQ(autoplan.layers[i].k_dtype, KvDtype::kFp8E4M3);
    EXPECT_EQ(autoplan.decisions[i].k.provenance, Provenance::kCheckpointScheme);
  }
}

TEST(DrafterPlan, SkipRulesApplyOrSayHowToGiveTheDrafterItsOwn) {
  TempDirs dirs;
  const std::string dir = dirs.add(test::llama_config(2, 4, 2, 64, "bfloat16"));
  // A target rule that fits the drafter applies to it: layer 0 stays unquantized.
  const KvPlan b = make_drafter_kv_plan(
      load_model_config(dir), target_flags(KvDtype::kFp8E4M3, "0"), draft_config(dir));
  EXPECT_EQ(b.layers[0].k_dtype, KvDtype::kBFloat16);
  EXPECT_EQ(b.decisions[0].k.provenance, Provenance::kSkipRule);
  EXPECT_EQ(b.layers[1].k_dtype, KvDtype::kFp8E4M3);
  // A target rule naming layers the drafter lacks: a clear error with the way out.
  try {
    (void)make_drafter_kv_plan(load_model_config(dir), target_flags(KvDtype::kFp8E4M3, "5"),
                               draft_config(dir));
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("kv_cache_dtype_skip_layers"), std::string::npos)
        << e.what();
  }
  // ... and the drafter's own rule.
  const KvPlan own = make_drafter_kv_plan(
      load_model_config(dir), target_flags(KvDtype::kFp8E4M3, "5"),
      draft_config(dir, R"(, "kv_cache_dtype_skip_layers": "1")"));
  EXPECT_EQ(own.layers[0].k_dtype, KvDtype::kFp8E4M3);
  EXPECT_EQ(own.layers[1].k_dtype, KvDtype::kBFloat16);
}

}  // namespace
}  // namespace kvq
