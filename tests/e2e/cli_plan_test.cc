// `kvq plan` and `kvq backends` as a user runs them: output, JSON, and every bad input
// giving one line on stderr and exit code 2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "e2e/cli_test_util.h"
#include "support/fixtures.h"
#include "support/source_dir.h"

namespace kvq::test {
namespace {

using nlohmann::json;

const std::string kShared = ::kvq::test::source_dir() + "/../shared";
const std::string kStories = kShared + "/models/stories260K";

#define SKIP_WITHOUT_SHARED()                              \
  if (!std::filesystem::exists(kStories + "/config.json")) \
  GTEST_SKIP() << "../shared/models/stories260K is absent; skipping"

void expect_one_line_error(const CommandResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  ASSERT_FALSE(r.err.empty());
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "expected one line: " << r.err;
  EXPECT_EQ(r.err.rfind("kvq: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "missing '" << needle << "' in: " << r.err;
}

TEST(CliPlan, Stories260KFp8SkippingLayerZero) {
  SKIP_WITHOUT_SHARED();
  const auto r = run_kvq({"plan", "--model", kStories, "--kv-cache-dtype", "fp8",
                          "--kv-cache-dtype-skip-layers", "0", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j["layers"].size(), 5u);
  EXPECT_EQ(j["layers"][0]["k"]["dtype"], "float32");
  EXPECT_EQ(j["layers"][0]["k"]["provenance"], "skip_rule");
  for (int i = 1; i < 5; ++i) {
    EXPECT_EQ(j["layers"][i]["k"]["dtype"], "fp8_e4m3");
    EXPECT_EQ(j["layers"][i]["v"]["provenance"], "user_flag");
    EXPECT_EQ(j["layers"][i]["k"]["scale"]["source"], "default_one");
    // head_dim 8 is not whitelisted by the fast CPU backend: the oracle runs it, with the reason.
    EXPECT_EQ(j["layers"][i]["attention_backend"]["name"], "cpu_reference");
    EXPECT_FALSE(j["layers"][i]["attention_backend"]["passed_over"].empty());
  }
  // 8 query / 4 kv heads, head_dim 8: fp8 layers 64 bytes/token, fp32 layer 0 256.
  EXPECT_EQ(j["totals"]["kv_bytes_per_token"], 256 + 4 * 64);
  EXPECT_NE(r.err.find("warning"), std::string::npos) << "scale 1.0 must be warned about";
}

TEST(CliPlan, TableAndMemoryBudget) {
  SKIP_WITHOUT_SHARED();
  const auto r = run_kvq({"plan", "--model", kStories, "-ctk", "int8_per_token_head", "-ctv",
                          "bf16", "--kv-cache-memory", "1MiB"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("int8_per_token_head"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("-ctk int8_per_token_head"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("-ctv bf16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tokens"), std::string::npos);
  EXPECT_NE(r.out.find("memory: 1MiB = 1048576 bytes"), std::string::npos) << r.out;
}

TEST(CliPlanBadInput, FlagsAndFiles) {
  const std::string good =
      make_model_dir(llama_config(4, 8, 2, 64), {f32_tensor("w", {2}, {1.f, 2.f})});
  expect_one_line_error(run_kvq({"plan", "--model", good, "--kv-cache-dtype", "fp9"}),
                        "--kv-cache-dtype: unknown KV cache dtype 'fp9'; accepted: auto");
  expect_one_line_error(run_kvq({"plan", "--model", good, "-ctk", "fp8_inc"}),
                        "kvq does not support");
  expect_one_line_error(run_kvq({"plan", "--model", good, "--kv-cache-dtype-skip-layers", "1-x"}),
                        "--kv-cache-dtype-skip-layers: cannot parse range '1-x'");
  expect_one_line_error(run_kvq({"plan", "--model", good, "--kv-cache-dtype-skip-layers", "9"}),
                        "layer 9 is out of range; the model has 4 layers (0-3)");
  expect_one_line_error(run_kvq({"plan", "--model", good, "--kv-cache-memory", "lots"}),
                        "--kv-cache-memory: cannot parse 'lots'");
  expect_one_line_error(run_kvq({"plan", "--model", good, "--attention-backend", "flashinfer"}),
                        "cpu_reference");
  expect_one_line_error(run_kvq({"plan", "--model", good, "--device", "tpu"}), "--device");
  expect_one_line_error(run_kvq({"plan", "--model", good, "--block-size", "0"}), "--block-size");
  expect_one_line_error(run_kvq({"plan"}), "--model");
  expect_one_line_error(run_kvq({}), "subcommand");
  expect_one_line_error(run_kvq({"plan", "--model", "/nonexistent/model"}), "not a directory");

  const std::string no_config = fresh_dir("noconfig");
  expect_one_line_error(run_kvq({"plan", "--model", no_config}), "config.json: missing");
  const std::string bad_json = fresh_dir("badjson");
  write_text(bad_json + "/config.json", "{\"num_hidden_layers\": ");
  expect_one_line_error(run_kvq({"plan", "--model", bad_json}), "not valid JSON");
  json no_layers = llama_config();
  no_layers.erase("num_hidden_layers");
  expect_one_line_error(run_kvq({"plan", "--model", make_model_dir(no_layers)}),
                        "missing required field 'num_hidden_layers'");
}

TEST(CliPlanBadInput, BrokenSafetensorsHeaders) {
  struct Case {
    std::string header;
    uint64_t declared;
    size_t data;
    std::string expect;
  } cases[] = {
      {"{}", 1 << 20, 0, "(truncated)"},
      {"{}", (100ull << 20) + 1, 0, "oversized"},
      {"not json", UINT64_MAX, 0, "not valid JSON"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
       UINT64_MAX, 12, "overlap"},
      {R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", UINT64_MAX, 4,
       "runs past the data section"},
  };
  for (const auto& c : cases) {
    const std::string dir = make_model_dir(llama_config(), {}, /*with_weights=*/false);
    write_raw_safetensors(dir + "/model.safetensors", c.header, std::vector<uint8_t>(c.data),
                          c.declared);
    const auto r = run_kvq({"plan", "--model", dir});
    expect_one_line_error(r, c.expect);
    EXPECT_NE(r.err.find("model.safetensors"), std::string::npos) << r.err;
  }
}

TEST(CliPlanBadInput, ForcedBackendThatCannotRunALayer) {
  SKIP_WITHOUT_SHARED();
  const auto r = run_kvq({"plan", "--model", kStories, "--attention-backend", "cpu_avx512"});
  expect_one_line_error(r, "cpu_avx512");
  EXPECT_NE(r.err.find("head_dim 8"), std::string::npos) << r.err;
}

// The CPU kernels' A/B switches refuse a value they do not take (it used to run the default
// silently), before any work, with a one-line error naming the variable and the values.
TEST(CliBadInput, CpuKernelEnvironmentSwitches) {
  struct Case {
    const char* name;
    const char* bad;
    const char* good;
    const char* accepted;
  };
  std::vector<Case> cases = {Case{"KVQ_CPU_ISA", "avx3", "avx2", "portable"},
                             Case{"KVQ_CPU_INT_DOT", "yes", "maddubs", "maddubs"}};
#ifdef KVQ_WITH_CUDA
  cases.push_back(Case{"KVQ_PREFILL_KERNEL", "fast", "mma", "auto, mma, wgmma, verify"});
  cases.push_back(Case{"KVQ_PREFILL_STAGING", "on", "off", "auto, off, force"});
  cases.push_back(Case{"KVQ_GEMV", "on", "0", "auto, 0, force"});
  cases.push_back(Case{"KVQ_GEMV_SILU", "yes", "0", "1, 0"});
  cases.push_back(Case{"KVQ_GEMV_RING", "17", "16", "0 .. 16"});
  cases.push_back(Case{"KVQ_GEMV_RING_PDL", "early", "wait", "serial, wait, prefetch"});
  cases.push_back(Case{"KVQ_GEMV_NORM", "on", "0", "0 .. 4"});
  cases.push_back(Case{"KVQ_L2_PREFETCH", "on", "0", "1, 0"});
  cases.push_back(Case{"KVQ_FP8_HELD", "yes", "1", "1, 0"});
  cases.push_back(Case{"KVQ_FP8_W8A16", "on", "0", "0 .. 16"});
  cases.push_back(Case{"KVQ_VERIFY_Q_BUCKETS", "all", "coarse", "fine, coarse"});
  cases.push_back(Case{"KVQ_PDL_EARLY", "8", "0", "0 .. 7"});
  cases.push_back(Case{"KVQ_DECODE_TINY_MAX_TILES", "lots", "64", "from 1"});
  cases.push_back(Case{"KVQ_DECODE_CLUSTER", "on", "force", "auto, 0, force"});
  cases.push_back(Case{"KVQ_DECODE_CLUSTER_MAX_TILES", "0", "8", "from 1"});
  cases.push_back(Case{"KVQ_DECODE_CLUSTER_BLOCKS", "32", "16", "8, 16"});
#endif
  for (const Case& c : cases) {
    // Restored afterwards, whatever it was (CI may set it for the whole run).
    const char* before = std::getenv(c.name);
    const std::string saved = before != nullptr ? before : "";
    setenv(c.name, c.bad, 1);
    const CommandResult bad = run_kvq({"backends"});
    setenv(c.name, c.good, 1);
    const CommandResult good = run_kvq({"backends"});
    if (before != nullptr)
      setenv(c.name, saved.c_str(), 1);
    else
      unsetenv(c.name);
    EXPECT_EQ(bad.exit_code, 2) << c.name;
    EXPECT_NE(bad.err.find(std::string(c.name) + "=" + c.bad), std::string::npos) << bad.err;
    EXPECT_NE(bad.err.find(c.accepted), std::string::npos) << bad.err;
    EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << bad.err;
    EXPECT_TRUE(bad.out.empty());
    EXPECT_EQ(good.exit_code, 0) << c.name << "=" << c.good << ": " << good.err;
  }
}

TEST(CliBackends, JsonListsEveryBackendInPriorityOrder) {
  const auto r = run_kvq({"backends", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_GE(j["backends"].size(), 2u);
  int last = 1 << 30;
  bool has_reference = false;
  for (const auto& b : j["backends"]) {
    EXPECT_LE(b["priority"].get<int>(), last);
    last = b["priority"].get<int>();
    has_reference |= b["name"] == "cpu_reference";
  }
  EXPECT_TRUE(has_reference);
  const auto text = run_kvq({"backends"});
  EXPECT_EQ(text.exit_code, 0);
  EXPECT_NE(text.out.find("cpu_reference"), std::string::npos);
}

}  // namespace
// --tensor-parallel-size / -tp: each rank's heads and KV bytes per token, the group's capacity
// for a per-GPU budget; a size the heads do not split over is one line, before any table.
TEST(CliPlan, TensorParallelSplitsHeadsAndCache) {
  const std::string model = source_dir() + "/models/kvq-code-tiny";  // 4 q / 2 kv
  const auto r = run_kvq({"plan", "--model", model, "-tp", "2", "--kv-cache-dtype", "fp8",
                          "--kv-cache-memory", "1MiB", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  const json& tp = j["tensor_parallel"];
  EXPECT_EQ(tp["size"], 2);
  EXPECT_EQ(tp["q_heads_per_rank"], 2);
  EXPECT_EQ(tp["kv_heads_per_rank"], 1);
  EXPECT_EQ(tp["kv_head_replicas"], 1);
  EXPECT_EQ(tp["ranks"][1]["kv_heads"], json::array({1}));
  // Half the heads, half the bytes: 6 layers x (K + V) x 1 head x 64 fp8 values.
  EXPECT_EQ(tp["kv_bytes_per_token_per_rank"], 6 * 2 * 64);
  EXPECT_EQ(j["totals"]["kv_bytes_per_token"], 6 * 2 * 2 * 64);
  // A rank's blocks are half the bytes, so the same per-GPU budget holds (at least) twice the
  // tokens of one GPU: whole blocks of 16 tokens in 1 MiB.
  const int64_t half_block = j["memory"]["bytes_per_block_all_layers"].get<int64_t>() / 2;
  EXPECT_EQ(tp["memory"]["tokens"].get<int64_t>(), (int64_t{1} << 20) / half_block * 16);
  EXPECT_GE(tp["memory"]["tokens"].get<int64_t>(), 2 * j["memory"]["tokens"].get<int64_t>());

  const auto t = run_kvq({"plan", "--model", model, "--tensor-parallel-size", "4"});
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("tensor parallel: 4 ranks"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("replicated on 2 ranks"), std::string::npos) << t.out;

  const auto bad = run_kvq({"plan", "--model", model, "-tp", "3"});
  expect_one_line_error(bad, "--tensor-parallel-size 3");
  EXPECT_EQ(bad.out, "") << "nothing is printed before the error";
}

}  // namespace kvq::test
