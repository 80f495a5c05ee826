// `kvq bench` as a user runs it (CPU here; the CUDA runs are in docs/BENCHMARKS.md).
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "e2e/cli_test_util.h"
#include "support/source_dir.h"

namespace kvq::test {
namespace {

using nlohmann::json;

const std::string kCode = ::kvq::test::source_dir() + "/models/kvq-code-tiny";

void expect_error(const CommandResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("kvq: error: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "missing '" << needle << "' in: " << r.err;
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
}

// kvq-code-tiny: 6 layers, 2 KV heads of 64; K and V.
constexpr int kLayers = 6, kKvHeads = 2, kHeadDim = 64;

TEST(CliBench, JsonReportsThroughputAndKvBytesPerDtype) {
  if (!std::filesystem::exists(kCode + "/config.json")) GTEST_SKIP() << "no default model";
  for (const auto& [dtype, bytes_per_value] :
       {std::pair<std::string, int>{"bf16", 2}, {"fp8", 1}}) {
    const auto r = run_kvq({"bench", "--model", kCode, "--batch", "3", "--input-len", "40",
                            "--output-len", "6", "--kv-cache-dtype", dtype, "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["batch"], 3);
    EXPECT_EQ(j["input_len"], 40);
    EXPECT_EQ(j["output_len"], 6);
    EXPECT_EQ(j["prefill_sequences"], 3);
    EXPECT_EQ(j["device"], "cpu");
    EXPECT_EQ(j["kv_bytes_per_token"].get<int>(),
              kLayers * kKvHeads * kHeadDim * 2 * bytes_per_value)
        << dtype;
    EXPECT_GT(j["prefill_tokens_per_s"].get<double>(), 0.0);
    EXPECT_GT(j["decode_tokens_per_s"].get<double>(), 0.0);
    EXPECT_GT(j["decode_step_ms_median"].get<double>(), 0.0);
    EXPECT_EQ(j["largest_batch"], -1);  // host memory only limits a CPU run
  }
}

TEST(CliBench, KvBudgetBoundsTheBatch) {
  if (!std::filesystem::exists(kCode + "/config.json")) GTEST_SKIP() << "no default model";
  // bf16 block of 16 tokens, all layers, K and V; 40 + 6 tokens need 3 blocks per sequence.
  const int block_bytes = kLayers * 2 * 16 * kKvHeads * kHeadDim * 2;
  const int blocks = (1 << 20) / block_bytes;
  const int largest = blocks / 3;
  const std::vector<std::string> base = {"bench", "--model",      kCode, "--input-len",
                                         "40",    "--output-len", "6",   "--kv-cache-memory",
                                         "1MiB",  "--json"};
  auto args = base;
  args.insert(args.end(), {"--batch", std::to_string(largest)});
  const auto ok = run_kvq(args);
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  const json j = json::parse(ok.out);
  EXPECT_EQ(j["largest_batch"], largest);
  EXPECT_EQ(j["kv_capacity_tokens"], blocks * 16);
  args = base;
  args.insert(args.end(), {"--batch", std::to_string(largest + 1)});
  expect_error(run_kvq(args), "at most " + std::to_string(largest) + " sequences");
}

TEST(CliBenchBadInput, EachMistakeIsOneLineAndExitTwo) {
  expect_error(run_kvq({"bench", "--synthetic", "llama3-8b"}), "--synthetic needs --device cuda");
  expect_error(run_kvq({"bench", "--synthetic", "gpt-17"}), "llama3-8b");
  expect_error(run_kvq({"bench", "--batch", "1"}), "--model DIR or --synthetic NAME");
  expect_error(run_kvq({"bench", "--model", kCode, "--batch", "2", "--prefill-sequences", "5"}),
               "exceeds --batch");
  expect_error(run_kvq({"bench", "--model", kCode, "--batch", "4", "--prefill-sequences", "2"}),
               "needs --device cuda");
  expect_error(run_kvq({"bench", "--model", kCode, "--input-len", "2000", "--output-len", "100"}),
               "exceeds the model's context (2048)");
  expect_error(run_kvq({"bench", "--model", kCode, "--dtype", "int3"}), "--dtype");
  const auto both = run_kvq({"bench", "--model", kCode, "--synthetic", "llama3-8b"});
  EXPECT_EQ(both.exit_code, 2) << both.err;
}

TEST(CliBenchBadInput, DeviceCudaWithoutAUsableGpuSaysSo) {
  const auto r = run_kvq({"generate", "--model", kCode, "--prompt", "x", "--device", "cuda"});
  if (r.exit_code == 0) GTEST_SKIP() << "a CUDA device is available here";
  expect_error(r, "--device cuda: ");
}

TEST(CliPlan, SyntheticShapesNeedNoCheckpoint) {
  const auto r = run_kvq({"plan", "--synthetic", "llama3-8b", "--kv-cache-dtype", "fp8", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j["layers"].size(), 32u);
  // 32 layers x 8 KV heads x 128 dims x (K + V) x 1 byte.
  EXPECT_EQ(j["totals"]["kv_bytes_per_token"], 32 * 8 * 128 * 2);
}

}  // namespace
}  // namespace kvq::test
