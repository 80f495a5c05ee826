// kvq quantize as a user runs it: the default model to FP8 weights (compressed-tensors layout)
// with per-head k/v scales calibrated on held-out text; the output's weights are the originals
// within e4m3's rounding with scales at each row's max / 448, kvq plan shows the checkpoint's
// scheme and scales, the scales are the K/V maxima the quantized model writes over the
// calibration tokens, and kvq generate runs it. Bad requests: one line, exit 2.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <regex>

#include "e2e/cli_test_util.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/io/safetensors.h"
#include "kvq/model/model.h"
#include "kvq/plan/kv_plan.h"
#include "kvq/plan/model_config.h"
#include "kvq/quant/codec.h"
#include "kvq/tokenizer/tokenizer.h"
#include "support/source_dir.h"

namespace kvq::test {
namespace {

using nlohmann::json;

const std::string kTiny = ::kvq::test::source_dir() + "/models/kvq-code-tiny";

TEST(CliQuantize, Fp8WeightsAndCalibratedKvScalesRoundTrip) {
  if (!std::filesystem::exists(kTiny + "/model.safetensors")) GTEST_SKIP() << "no default model";
  const std::string out = make_temp_dir("quantize") + "/fp8";
  const int kTokens = 600;
  const auto r = run_kvq({"quantize", "--model", kTiny, "--out", out, "--kv-cache-dtype", "fp8",
                          "--kv-scales", "head", "--calibration-text", kTiny + "/heldout.txt",
                          "--calibration-tokens", std::to_string(kTokens)});
  ASSERT_EQ(r.exit_code, 0) << r.err;

  // config.json declares what other engines read.
  std::ifstream cf(out + "/config.json");
  const json cfg = json::parse(cf);
  const json& q = cfg["quantization_config"];
  EXPECT_EQ(q["quant_method"], "compressed-tensors");
  EXPECT_EQ(q["config_groups"]["group_0"]["weights"]["strategy"], "channel");
  EXPECT_EQ(q["config_groups"]["group_0"]["weights"]["num_bits"], 8);
  EXPECT_EQ(q["kv_cache_scheme"]["strategy"], "attn_head");
  EXPECT_EQ(q["ignore"], json::array({"lm_head"}));
  EXPECT_TRUE(std::filesystem::exists(out + "/tokenizer.json"));

  // Every projection: F8_E4M3 codes x per-row scale = the original within e4m3's rounding, the
  // scale = the row's largest |w| / 448; other tensors byte-identical in dtype and shape.
  const CheckpointFiles in = CheckpointFiles::open(kTiny), got = CheckpointFiles::open(out);
  const std::regex proj(R"(model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight)");
  int projections = 0;
  for (const SafetensorsFile& f : in.files())
    for (const TensorInfo& t : f.tensors()) {
      auto [gf, gt] = got.find(t.name);
      ASSERT_NE(gt, nullptr) << t.name;
      EXPECT_EQ(gt->shape, t.shape) << t.name;
      if (!std::regex_match(t.name, proj)) {
        EXPECT_EQ(gt->dtype, t.dtype) << t.name;
        continue;
      }
      ++projections;
      ASSERT_EQ(gt->dtype, TensorDtype::kF8E4M3) << t.name;
      auto [sf, st] = got.find(t.name + "_scale");
      ASSERT_NE(st, nullptr) << t.name;
      const std::vector<float> w = f.read_floats(t), scale = sf->read_floats(*st);
      const int64_t rows = t.shape[0], cols = t.shape[1];
      ASSERT_EQ(scale.size(), static_cast<size_t>(rows));
      std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
      std::ifstream bin(gf->path(), std::ios::binary);
      bin.seekg(static_cast<std::streamoff>(gf->data_offset() + gt->begin));
      bin.read(reinterpret_cast<char*>(codes.data()), static_cast<std::streamsize>(codes.size()));
      for (int64_t row = 0; row < rows; ++row) {
        float amax = 0.0f;
        for (int64_t c = 0; c < cols; ++c)
          amax = std::max(amax, std::abs(w[static_cast<size_t>(row * cols + c)]));
        EXPECT_EQ(scale[static_cast<size_t>(row)], amax / 448.0f) << t.name << " row " << row;
        for (int64_t c = 0; c < cols; ++c) {
          const size_t i = static_cast<size_t>(row * cols + c);
          const double deq = static_cast<double>(quant::fp8_e4m3_decode(codes[i])) *
                             scale[static_cast<size_t>(row)];
          // Half a step of 3 mantissa bits, or half the smallest subnormal (2^-9) x scale.
          const double tol = std::max(std::abs(static_cast<double>(w[i])) / 16.0,
                                      std::ldexp(1.0, -10) * scale[static_cast<size_t>(row)]);
          ASSERT_LE(std::abs(deq - w[i]), tol * 1.0001)
              << t.name << " [" << row << "][" << c << "]";
        }
      }
    }
  EXPECT_EQ(projections, 6 * 7);

  // kvq plan: the checkpoint's fp8 scheme, a scale per kv head from the checkpoint.
  const auto p = run_kvq({"plan", "--model", out, "--json"});
  ASSERT_EQ(p.exit_code, 0) << p.err;
  const json plan = json::parse(p.out);
  for (const auto& l : plan["layers"]) {
    EXPECT_EQ(l["k"]["dtype"], "fp8_e4m3") << l.dump();
    EXPECT_EQ(l["k"]["provenance"], "checkpoint_scheme") << l.dump();
  }
  // ... and names the weight scheme (and what each device runs).
  EXPECT_EQ(plan["weights"]["fp8"], true) << plan["weights"].dump();
  EXPECT_NE(plan["weights"]["stored"].get<std::string>().find("compressed-tensors"),
            std::string::npos)
      << plan["weights"].dump();
  const auto pt = run_kvq({"plan", "--model", out});
  ASSERT_EQ(pt.exit_code, 0) << pt.err;
  EXPECT_NE(pt.out.find("weights: compressed-tensors float-quantized, FP8 weights with "
                        "per-channel scales, dynamic activations"),
            std::string::npos)
      << pt.out;
  const auto pb = run_kvq({"plan", "--model", kTiny, "--json"});
  ASSERT_EQ(pb.exit_code, 0) << pb.err;
  EXPECT_EQ(json::parse(pb.out)["weights"]["fp8"], false);

  // The scales are the largest |K| / |V| per layer and kv head that the quantized model writes
  // over the calibration tokens (recomputed here from its float32 cache), / 448.
  {
    std::ifstream tf(kTiny + "/heldout.txt", std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(tf)), std::istreambuf_iterator<char>());
    std::vector<int32_t> tokens = Tokenizer::load(kTiny).encode(text, true);
    tokens.resize(kTokens);
    KvPlanOptions o;
    o.kv = DtypeFlag{KvDtype::kFloat32, "test"};
    const KvPlan f32 = make_kv_plan(load_model_config(out), o);
    const auto model = Model::load(f32);
    const int bt = f32.layers.front().block_tokens;
    auto cache = model->create_cache((kTokens + bt - 1) / bt);
    cache->add_sequence(1);
    std::vector<int32_t> pos(kTokens);
    for (int i = 0; i < kTokens; ++i) pos[static_cast<size_t>(i)] = i;
    const std::vector<int64_t> slots = cache->append(1, kTokens);
    const int32_t qi[2] = {0, kTokens};
    const SequenceId ids[1] = {1};
    PagedKvCache::BlockTableStorage bst;
    model->forward({tokens, pos, qi, slots, cache->block_table(ids, bst), {}}, *cache, {});
    const KvPlan fp8 = make_kv_plan(load_model_config(out), KvPlanOptions{});
    const auto blocks = cache->blocks(1);
    for (size_t l = 0; l < f32.layers.size(); ++l) {
      const LayerCacheView v = cache->layer_view(l);
      for (KvSide side : {KvSide::kK, KvSide::kV}) {
        const KvSideLayout& lay = v.layout(side);
        const ScaleSource& src = side == KvSide::kK ? fp8.layers[l].k_scale : fp8.layers[l].v_scale;
        ASSERT_EQ(src.values.size(), static_cast<size_t>(lay.num_kv_heads));
        for (int h = 0; h < lay.num_kv_heads; ++h) {
          float mx = 0.0f;
          for (int t = 0; t < kTokens; ++t) {
            const auto* row = reinterpret_cast<const float*>(
                v.block(side, blocks[static_cast<size_t>(t / bt)]) + lay.value_offset(h, t % bt));
            for (int d = 0; d < lay.head_dim; ++d) mx = std::max(mx, std::abs(row[d]));
          }
          // (the tool prefills in chunks, this in one pass: rounding-level differences)
          EXPECT_NEAR(src.values[static_cast<size_t>(h)], mx / 448.0f, 1e-4f * mx / 448.0f)
              << "layer " << l << " " << to_string(side) << " head " << h;
        }
      }
    }
  }

  const auto g =
      run_kvq({"generate", "--model", out, "--prompt", "def add(a, b):", "--max-tokens", "8"});
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_NE(g.err.find("fp8_e4m3"), std::string::npos) << g.err;
}

TEST(CliQuantize, BadRequestsAreOneLine) {
  if (!std::filesystem::exists(kTiny + "/model.safetensors")) GTEST_SKIP() << "no default model";
  const std::string dir = make_temp_dir("quantize-bad");
  std::filesystem::create_directories(dir + "/full");
  std::ofstream(dir + "/full/x") << "x";
  struct Case {
    std::vector<std::string> args;
    std::string mention;
  };
  const std::vector<Case> cases = {
      {{"--out", dir + "/a", "--kv-cache-dtype", "fp8"}, "--calibration-text"},
      {{"--out", dir + "/full"}, "not an empty directory"},
      {{"--out", dir + "/b", "--weights", "int4"}, "--weights int4"},
      {{"--out", dir + "/c", "--kv-scales", "token"}, "--kv-scales token"},
      {{"--out", dir + "/d", "--weights", "none"}, "nothing to do"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"quantize", "--model", kTiny};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const auto r = run_kvq(args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(c.mention), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  // An already quantized model is refused.
  const auto ok = run_kvq({"quantize", "--model", kTiny, "--out", dir + "/q"});
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  const auto again = run_kvq({"quantize", "--model", dir + "/q", "--out", dir + "/q2"});
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_NE(again.err.find("already quantized"), std::string::npos) << again.err;
}

}  // namespace
}  // namespace kvq::test
