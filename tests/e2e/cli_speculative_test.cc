// --speculative-config as a user runs it: kvq plan prints the drafter's table planned from the
// target's flags (JSON too), kvq generate with each proposer prints the ids of plain greedy
// decoding and the speculation summary, and every inconsistent config is one line and exit 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "e2e/cli_test_util.h"
#include "support/source_dir.h"

namespace kvq::test {
namespace {

using nlohmann::json;

const std::string kModels = ::kvq::test::source_dir() + "/models";
const std::string kTiny = kModels + "/kvq-code-tiny";
const std::string kDraft = kModels + "/kvq-code-tiny-draft";
const std::string kDflash = kModels + "/kvq-code-tiny-dflash";

#define SKIP_WITHOUT_MODELS()                                    \
  if (!std::filesystem::exists(kDraft + "/model.safetensors") || \
      !std::filesystem::exists(kDflash + "/model.safetensors"))  \
  GTEST_SKIP() << "the default model's drafters are absent"

std::string spec(const std::string& method, const std::string& model, int k,
                 const std::string& extra = "") {
  std::string s =
      "{\"method\": \"" + method + "\", \"num_speculative_tokens\": " + std::to_string(k);
  if (!model.empty()) s += ", \"model\": \"" + model + "\"";
  return s + extra + "}";
}

TEST(CliSpeculative, PlanShowsTheDrafterQuantizedLikeTheTarget) {
  SKIP_WITHOUT_MODELS();
  for (const auto& [method, dir] :
       {std::pair<std::string, std::string>{"draft_model", kDraft}, {"dflash", kDflash}}) {
    const auto r = run_kvq({"plan", "--model", kTiny, "--kv-cache-dtype", "fp8",
                            "--speculative-config", spec(method, dir, 4), "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const json j = json::parse(r.out);
    ASSERT_TRUE(j.contains("speculative"));
    EXPECT_EQ(j["speculative"]["method"], method);
    const json& d = j["speculative"]["drafter"];
    ASSERT_FALSE(d["layers"].empty());
    for (const auto& l : d["layers"]) {
      EXPECT_EQ(l["k"]["dtype"], "fp8_e4m3") << method;
      EXPECT_EQ(l["k"]["provenance"], "user_flag") << method;
    }
    if (method == "dflash") {
      for (const auto& l : d["layers"]) {
        EXPECT_EQ(l["attention"], "non_causal") << l.dump();
      }
    }
    const auto t =
        run_kvq({"plan", "--model", kTiny, "--kv-cache-dtype", "fp8", "--speculative-config",
                 spec(method, dir, 4, ", \"kv_cache_dtype\": \"bf16\"")});
    ASSERT_EQ(t.exit_code, 0) << t.err;
    EXPECT_NE(t.out.find("drafter (" + method), std::string::npos) << t.out;
    EXPECT_NE(t.out.find("--speculative-config kv_cache_dtype=bf16"), std::string::npos) << t.out;
  }
}

TEST(CliSpeculative, GenerateGivesPlainGreedyIdsWithEveryProposer) {
  SKIP_WITHOUT_MODELS();
  const std::vector<std::string> base = {"generate",
                                         "--model",
                                         kTiny,
                                         "--prompt",
                                         "class Stack:\n    def __init__(self):",
                                         "--temperature",
                                         "0",
                                         "-n",
                                         "48",
                                         "--output-ids",
                                         "--kv-cache-dtype",
                                         "int8_per_token_head"};
  const auto plain = run_kvq(base);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  for (const std::string& s :
       {spec("ngram", "", 4), spec("draft_model", kDraft, 3), spec("dflash", kDflash, 6)}) {
    std::vector<std::string> args = base;
    args.push_back("--speculative-config");
    args.push_back(s);
    const auto r = run_kvq(args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, plain.out) << s;
    EXPECT_NE(r.err.find("kvq: speculative "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("mean accepted length"), std::string::npos) << r.err;
  }
}

TEST(CliSpeculative, InconsistentConfigsAreOneLineAndExitTwo) {
  SKIP_WITHOUT_MODELS();
  const std::string stories = ::kvq::test::source_dir() + "/../shared/models/stories260K";
  std::vector<std::pair<std::string, std::string>> cases = {
      {"{not json", "not valid JSON"},
      {spec("ngram", "", 0), "num_speculative_tokens"},
      {spec("eagle", "", 4), "unknown method"},
      {spec("draft_model", "", 4), "needs \"model\""},
      {spec("draft_model", kModels + "/absent", 4), "absent"},
      {spec("dflash", kDflash, 16), "max_speculative_tokens"},
      {spec("dflash", kDraft, 4), "KvqDFlashDrafter"},
      {spec("draft_model", kDflash, 4), "\"dflash\""},
  };
  if (std::filesystem::exists(stories + "/config.json"))
    cases.push_back({spec("draft_model", stories, 4), "tokenizer"});
  for (const auto& [config, needle] : cases) {
    const auto r = run_kvq(
        {"generate", "--model", kTiny, "--prompt", "x", "-n", "2", "--speculative-config", config});
    EXPECT_EQ(r.exit_code, 2) << config << ": " << r.err;
    ASSERT_FALSE(r.err.empty()) << config;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << config << " -> " << r.err;
  }
}

}  // namespace
}  // namespace kvq::test
