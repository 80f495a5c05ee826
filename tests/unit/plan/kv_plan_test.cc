// Table-driven planner tests. Each replays a KV-cache bug class other engines shipped
// (../shared/DESIGN.md) and checks kvq resolves it correctly.
#include "kvq/plan/kv_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "kvq/core/error.h"
#include "kvq/plan/tensor_parallel.h"
#include "support/fixtures.h"

namespace kvq {
namespace {

using nlohmann::json;
using test::f32_tensor;
using test::llama_config;
using test::make_model_dir;

KvPlanOptions opts(std::optional<KvDtype> kv, std::string skip = "") {
  KvPlanOptions o;
  if (kv) o.kv = DtypeFlag{*kv, "--kv-cache-dtype " + std::string(to_string(*kv))};
  o.skip_layers = std::move(skip);
  return o;
}

KvPlan plan_for(const json& config, const KvPlanOptions& o,
                const std::vector<test::FixtureTensor>& tensors = {}) {
  const std::string dir = make_model_dir(config, tensors);
  return make_kv_plan(load_model_config(dir), o);
}

// A Qwen3-style model whose odd layers slide.
json sliding_config() {
  json c = llama_config(6, 8, 2, 64, "bfloat16");
  c["architectures"] = {"Qwen3ForCausalLM"};
  c["model_type"] = "qwen3";
  c["sliding_window"] = 128;
  c["layer_types"] = {"full_attention",    "sliding_attention", "full_attention",
                      "sliding_attention", "full_attention",    "sliding_attention"};
  return c;
}

// (a) skip layers on a model with sliding-window layers: skipped layers are unquantized, the
// others fp8, and each layer's own spec (the only thing below the planner) says so.
TEST(KvPlanBugClasses, SkipSlidingWindowLayersKeepsThemUnquantized) {
  const KvPlan p = plan_for(sliding_config(), opts(KvDtype::kFp8E4M3, "sliding_window"));
  ASSERT_EQ(p.layers.size(), 6u);
  for (const auto& s : p.layers) {
    const bool sliding = s.layer % 2 == 1;
    EXPECT_EQ(s.attention, sliding ? AttentionKind::kSlidingWindow : AttentionKind::kCausal);
    EXPECT_EQ(s.sliding_window, sliding ? 128 : 0);
    const KvDtype want = sliding ? KvDtype::kBFloat16 : KvDtype::kFp8E4M3;
    EXPECT_EQ(s.k_dtype, want) << "layer " << s.layer;
    EXPECT_EQ(s.v_dtype, want) << "layer " << s.layer;
    EXPECT_EQ(p.decisions[static_cast<size_t>(s.layer)].k.provenance,
              sliding ? Provenance::kSkipRule : Provenance::kUserFlag);
    // Storage follows the layer's own dtype: 2 bytes/value unquantized, 1 for fp8.
    EXPECT_EQ(s.bytes_per_token(), static_cast<size_t>(2 * 2 * 64 * (sliding ? 2 : 1)));
    EXPECT_EQ(s.k_scale.kind, sliding ? ScaleSourceKind::kNone : ScaleSourceKind::kDefaultOne);
  }
  EXPECT_NE(p.layers[0].block_bytes(), p.layers[1].block_bytes());
}

TEST(KvPlanBugClasses, SkipIndicesRangesAndBoundary) {
  const json c = llama_config(8);
  struct Case {
    std::string spec;
    std::vector<int> skipped;
  } cases[] = {{"0", {0}},
               {"1-3", {1, 2, 3}},
               {"boundary:2", {0, 1, 6, 7}},
               {"0, 5-6", {0, 5, 6}},
               {"boundary:1,3", {0, 3, 7}},
               {"2-2", {2}}};
  for (const auto& tc : cases) {
    const KvPlan p = plan_for(c, opts(KvDtype::kInt8PerTokenHead, tc.spec));
    for (const auto& s : p.layers) {
      const bool skipped =
          std::find(tc.skipped.begin(), tc.skipped.end(), s.layer) != tc.skipped.end();
      EXPECT_EQ(s.k_dtype, skipped ? KvDtype::kBFloat16 : KvDtype::kInt8PerTokenHead)
          << tc.spec << " layer " << s.layer;
      EXPECT_EQ(s.k_scale.kind, skipped ? ScaleSourceKind::kNone : ScaleSourceKind::kDynamic);
    }
  }
}

TEST(KvPlanBadInput, MalformedSkipSpecsNameTheFlag) {
  const ModelConfig c = parse_model_config(llama_config(4), "config.json");
  for (const char* bad :
       {"x", "1-", "-1", "3-1", "boundary:", "boundary:0", "1,,2", "", "1.5", "sliding"}) {
    try {
      parse_skip_layers(bad, c);
      FAIL() << "accepted '" << bad << "'";
    } catch (const InputError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("--kv-cache-dtype-skip-layers"), std::string::npos) << m;
      EXPECT_NE(m.find("accepted"), std::string::npos) << m;
    }
  }
  for (const char* out_of_range : {"4", "2-9", "0,17"}) {
    try {
      parse_skip_layers(out_of_range, c);
      FAIL() << "accepted " << out_of_range;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("out of range; the model has 4 layers (0-3)"),
                std::string::npos)
          << e.what();
    }
  }
}

// (b) explicit bfloat16, float16 and auto all resolve as unquantized.
TEST(KvPlanBugClasses, SixteenBitNamesAndAutoAreUnquantized) {
  const json c = llama_config(3);
  for (const char* name : {"bfloat16", "bf16", "float16", "fp16", "half", "auto", "float32"}) {
    const KvDtype d = parse_kv_dtype_or_throw(name, "--kv-cache-dtype");
    KvPlanOptions o;
    o.kv = DtypeFlag{d, std::string("--kv-cache-dtype ") + name};
    const KvPlan p = plan_for(c, o);
    for (const auto& s : p.layers) {
      EXPECT_FALSE(is_quantized(s.k_dtype)) << name;
      EXPECT_FALSE(is_quantized(s.v_dtype)) << name;
      EXPECT_EQ(s.k_scale.kind, ScaleSourceKind::kNone);
      const KvDtype want = d == KvDtype::kAuto ? KvDtype::kBFloat16 : d;
      EXPECT_EQ(s.k_dtype, want) << name;
      EXPECT_EQ(p.decisions[0].k.provenance,
                d == KvDtype::kAuto ? Provenance::kModelDefault : Provenance::kUserFlag);
    }
    const bool converts = d == KvDtype::kFloat16;
    bool noted = false;
    for (const auto& n : p.notes) noted |= n.find("converted") != std::string::npos;
    EXPECT_EQ(noted, converts) << name;
  }
}

json with_fp8_scheme(json c, const std::string& strategy = "tensor") {
  c["quantization_config"] = {{"quant_method", "compressed-tensors"},
                              {"kv_cache_scheme",
                               {{"num_bits", 8},
                                {"type", "float"},
                                {"strategy", strategy},
                                {"dynamic", false},
                                {"symmetric", true}}}};
  return c;
}

std::vector<test::FixtureTensor> scale_tensors(int layers, std::vector<float>& ks,
                                               std::vector<float>& vs, int per = 1) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> u(0.001f, 0.5f);
  std::vector<test::FixtureTensor> t;
  for (int i = 0; i < layers; ++i) {
    std::vector<float> k(static_cast<size_t>(per)), v(static_cast<size_t>(per));
    for (auto& x : k) x = u(rng);
    for (auto& x : v) x = u(rng);
    ks.insert(ks.end(), k.begin(), k.end());
    vs.insert(vs.end(), v.begin(), v.end());
    const std::vector<int64_t> shape =
        per == 1 ? std::vector<int64_t>{} : std::vector<int64_t>{per};
    t.push_back(f32_tensor("model.layers." + std::to_string(i) + ".self_attn.k_scale", shape, k));
    t.push_back(f32_tensor("model.layers." + std::to_string(i) + ".self_attn.v_scale", shape, v));
  }
  return t;
}

// (c) an explicit bfloat16 beats the checkpoint's scheme; auto takes its fp8 with its scales.
TEST(KvPlanBugClasses, ExplicitChoiceBeatsCheckpointSchemeAutoTakesIt) {
  std::vector<float> ks, vs;
  const auto tensors = scale_tensors(4, ks, vs);
  const json c = with_fp8_scheme(llama_config(4));

  const KvPlan explicit_bf16 = plan_for(c, opts(KvDtype::kBFloat16), tensors);
  for (const auto& s : explicit_bf16.layers) {
    EXPECT_EQ(s.k_dtype, KvDtype::kBFloat16);
    EXPECT_EQ(s.v_dtype, KvDtype::kBFloat16);
  }
  EXPECT_EQ(explicit_bf16.decisions[0].k.provenance, Provenance::kUserFlag);
  ASSERT_FALSE(explicit_bf16.notes.empty());
  EXPECT_NE(explicit_bf16.notes[0].find("not used"), std::string::npos);

  for (auto o : {opts(KvDtype::kAuto), opts(std::nullopt)}) {
    const KvPlan p = plan_for(c, o, tensors);
    for (const auto& s : p.layers) {
      const size_t i = static_cast<size_t>(s.layer);
      EXPECT_EQ(s.k_dtype, KvDtype::kFp8E4M3);
      EXPECT_EQ(s.v_dtype, KvDtype::kFp8E4M3);
      EXPECT_EQ(p.decisions[i].k.provenance, Provenance::kCheckpointScheme);
      EXPECT_NE(p.decisions[i].k.detail.find("kv_cache_scheme"), std::string::npos);
      ASSERT_EQ(s.k_scale.kind, ScaleSourceKind::kCheckpoint);
      EXPECT_EQ(s.k_scale.tensor, "model.layers." + std::to_string(i) + ".self_attn.k_scale");
      ASSERT_EQ(s.k_scale.values.size(), 1u);
      EXPECT_EQ(s.k_scale.values[0], ks[i]);
      EXPECT_EQ(s.v_scale.values[0], vs[i]);
    }
    EXPECT_TRUE(p.warnings.empty());
  }
}

TEST(KvPlanCheckpoint, PerHeadScalesForAttnHeadStrategy) {
  std::vector<float> ks, vs;
  const auto tensors = scale_tensors(2, ks, vs, /*per=*/2);
  const KvPlan p =
      plan_for(with_fp8_scheme(llama_config(2), "attn_head"), opts(std::nullopt), tensors);
  for (const auto& s : p.layers) {
    ASSERT_EQ(s.k_scale.values.size(), 2u);
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(s.k_scale.for_head(h), ks[static_cast<size_t>(s.layer * 2 + h)]);
      EXPECT_EQ(s.v_scale.for_head(h), vs[static_cast<size_t>(s.layer * 2 + h)]);
    }
  }
}

TEST(KvPlanCheckpoint, SingleKvScaleServesBothSides) {
  const std::vector<test::FixtureTensor> t = {
      f32_tensor("model.layers.0.self_attn.kv_scale", {}, {0.125f}),
      f32_tensor("model.layers.1.self_attn.kv_scale", {1}, {0.25f})};
  const KvPlan p = plan_for(llama_config(2), opts(KvDtype::kFp8E4M3), t);
  EXPECT_EQ(p.layers[0].k_scale.values[0], 0.125f);
  EXPECT_EQ(p.layers[0].v_scale.values[0], 0.125f);
  EXPECT_EQ(p.layers[1].v_scale.tensor, "model.layers.1.self_attn.kv_scale");
  EXPECT_EQ(p.layers[1].k_scale.values[0], 0.25f);
}

TEST(KvPlanCheckpoint, ModelOptHfQuantConfig) {
  const std::string dir = make_model_dir(llama_config(2, 8, 2, 64));
  test::write_text(
      dir + "/hf_quant_config.json",
      R"({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}})");
  const KvPlan p = make_kv_plan(load_model_config(dir), opts(std::nullopt));
  EXPECT_EQ(p.layers[0].k_dtype, KvDtype::kNvfp4);
  EXPECT_EQ(p.decisions[0].v.provenance, Provenance::kCheckpointScheme);
}

TEST(KvPlanCheckpoint, MalformedHfQuantConfigIsAnInputError) {
  const std::string dir = make_model_dir(llama_config(2, 8, 2, 64));
  for (const char* text :
       {R"({"quantization": )", R"({"quantization": {"kv_cache_quant_algo": 1e999}})"}) {
    test::write_text(dir + "/hf_quant_config.json", text);
    try {
      make_kv_plan(load_model_config(dir), opts(std::nullopt));
      FAIL() << text;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("hf_quant_config.json: not valid JSON"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(KvPlanCheckpoint, UnsupportedSchemeIsRefusedOnlyWhenUsed) {
  json c = llama_config(2);
  c["quantization_config"] = {
      {"kv_cache_scheme", {{"num_bits", 8}, {"type", "int"}, {"strategy", "tensor"}}}};
  try {
    plan_for(c, opts(std::nullopt));
    FAIL() << "int8 per-tensor scheme accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("not supported by kvq"), std::string::npos) << e.what();
  }
  const KvPlan p = plan_for(c, opts(KvDtype::kInt8PerTokenHead));
  EXPECT_EQ(p.layers[1].v_dtype, KvDtype::kInt8PerTokenHead);
}

// (d) per-tensor fp8 without checkpoint scales: scale 1.0 and a warning.
TEST(KvPlanBugClasses, Fp8WithoutCheckpointScalesGetsOneAndAWarning) {
  for (KvDtype d : {KvDtype::kFp8E4M3, KvDtype::kFp8E5M2}) {
    const KvPlan p = plan_for(llama_config(3), opts(d, "0"));
    for (const auto& s : p.layers) {
      if (s.layer == 0) continue;
      EXPECT_EQ(s.k_scale.kind, ScaleSourceKind::kDefaultOne);
      EXPECT_EQ(s.k_scale.values, std::vector<float>{1.0f});
      EXPECT_EQ(s.v_scale.kind, ScaleSourceKind::kDefaultOne);
    }
    ASSERT_EQ(p.warnings.size(), 2u);  // one for K, one for V
    EXPECT_NE(p.warnings[0].find("layers 1-2"), std::string::npos) << p.warnings[0];
    EXPECT_NE(p.warnings[0].find("1.0"), std::string::npos) << p.warnings[0];
  }
}

TEST(KvPlan, SeparateKAndVFlags) {
  KvPlanOptions o = opts(KvDtype::kFp8E4M3);
  o.k = DtypeFlag{KvDtype::kInt8PerTokenHead, "-ctk int8_per_token_head"};
  const KvPlan p = plan_for(llama_config(2), o);
  EXPECT_EQ(p.layers[0].k_dtype, KvDtype::kInt8PerTokenHead);
  EXPECT_EQ(p.layers[0].v_dtype, KvDtype::kFp8E4M3);
  EXPECT_EQ(p.decisions[0].k.detail, "-ctk int8_per_token_head");
  EXPECT_EQ(p.decisions[0].v.detail, "--kv-cache-dtype fp8_e4m3");
  // K and V only (no --kv-cache-dtype): the other side keeps the model dtype.
  KvPlanOptions only_v;
  only_v.v = DtypeFlag{KvDtype::kNvfp4, "-ctv nvfp4"};
  const KvPlan q = plan_for(llama_config(2), only_v);
  EXPECT_EQ(q.layers[1].k_dtype, KvDtype::kBFloat16);
  EXPECT_EQ(q.layers[1].v_dtype, KvDtype::kNvfp4);
}

TEST(KvPlan, DtypesThatCannotStoreTheHeadDimAreRefusedWithTheReason) {
  try {
    plan_for(llama_config(2, 8, 4, 8), opts(KvDtype::kNvfp4));
    FAIL();
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--kv-cache-dtype nvfp4"), std::string::npos) << m;
    EXPECT_NE(m.find("head_dim 8"), std::string::npos) << m;
  }
  try {
    plan_for(llama_config(2, 4, 2, 96), opts(KvDtype::kInt4PerTokenHead));
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("power of two"), std::string::npos) << e.what();
  }
}

TEST(KvPlan, TotalsAndRatioToBf16) {
  const KvPlan p = plan_for(llama_config(4, 8, 2, 128), opts(KvDtype::kFp8E4M3));
  EXPECT_EQ(p.bf16_bytes_per_token(), 4u * 2 * 2 * 128 * 2);
  EXPECT_EQ(p.bytes_per_token(), p.bf16_bytes_per_token() / 2);
  const json j = kv_plan_to_json(p);
  EXPECT_DOUBLE_EQ(j["totals"]["ratio_to_bf16"].get<double>(), 0.5);
  EXPECT_EQ(j["layers"][3]["k"]["provenance"], "user_flag");
  EXPECT_EQ(j["layers"][3]["k"]["scale"]["source"], "default_one");
}

// Tensor parallelism: for fresh random head counts, every size split_heads accepts gives each
// query head to exactly one rank, the rank holds the kv head of each of its query heads, and
// each kv head is on exactly `kv_head_replicas` ranks; sizes it refuses name the flag and the
// sizes that work.
TEST(TensorParallel, HeadSplitsKeepGqaGroupsWhole) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 40; ++trial) {
    const int nkv = 1 << std::uniform_int_distribution<int>(0, 4)(rng);
    const int nq = nkv * (1 << std::uniform_int_distribution<int>(0, 3)(rng));
    const KvPlan p = make_kv_plan(
        load_model_config(make_model_dir(llama_config(2, nq, nkv, 64), {})), opts(std::nullopt));
    const std::vector<int> ok = tensor_parallel_sizes(p.model, 32);
    SCOPED_TRACE(std::to_string(nq) + " q / " + std::to_string(nkv) + " kv heads");
    for (int n = 1; n <= 32; ++n) {
      const bool valid = std::find(ok.begin(), ok.end(), n) != ok.end();
      EXPECT_EQ(valid, nq % n == 0 && (nkv % n == 0 || n % nkv == 0)) << n;
      if (!valid) {
        try {
          (void)split_heads(p.model, n);
          ADD_FAILURE() << "size " << n << " was accepted";
        } catch (const InputError& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("--tensor-parallel-size " + std::to_string(n)), std::string::npos) << m;
          EXPECT_NE(m.find("accepted: 1"), std::string::npos) << m;
        }
        continue;
      }
      const TensorParallelSplit s = split_heads(p.model, n);
      std::vector<int> q_owner(static_cast<size_t>(nq), 0), kv_holders(static_cast<size_t>(nkv), 0);
      for (int r = 0; r < n; ++r) {
        const std::vector<int> kv = s.kv_heads_of(r);
        ASSERT_EQ(static_cast<int>(kv.size()), s.kv_heads_per_rank);
        for (int h : kv) ++kv_holders[static_cast<size_t>(h)];
        for (int q = s.first_q_head(r); q < s.first_q_head(r) + s.q_heads_per_rank; ++q) {
          ++q_owner[static_cast<size_t>(q)];
          const int group_kv = q / (nq / nkv);
          EXPECT_NE(std::find(kv.begin(), kv.end(), group_kv), kv.end())
              << "rank " << r << " holds query head " << q << " but not its kv head " << group_kv;
        }
        // The rank's own plan: its head counts, and a valid spec per layer.
        const KvPlan rp = slice_kv_plan(p, s, r);
        for (const LayerKvSpec& l : rp.layers) {
          EXPECT_EQ(l.num_q_heads, nq / n);
          EXPECT_EQ(l.num_kv_heads, s.kv_heads_per_rank);
          EXPECT_TRUE(l.validation_errors().empty());
        }
        EXPECT_EQ(rp.bytes_per_token() * static_cast<size_t>(nkv),
                  p.bytes_per_token() * static_cast<size_t>(s.kv_heads_per_rank));
      }
      for (int c : q_owner) EXPECT_EQ(c, 1);
      for (int c : kv_holders) EXPECT_EQ(c, s.kv_head_replicas);
      EXPECT_EQ(s.kv_head_replicas, nkv < n ? n / nkv : 1);
      EXPECT_EQ(s.notes.empty(), nkv >= n);
    }
  }
}

// Per-head k/v scales (compressed-tensors attn_head) go with their heads; the dtypes and
// provenance of every layer are the whole plan's.
TEST(TensorParallel, PerHeadScalesAreSlicedWithTheHeads) {
  std::vector<float> ks, vs;
  const int nkv = 4;
  const auto tensors = scale_tensors(2, ks, vs, /*per=*/nkv);
  const KvPlan p = plan_for(with_fp8_scheme(llama_config(2, 8, nkv, 64), "attn_head"),
                            opts(std::nullopt), tensors);
  for (const int n : {2, 4, 8}) {
    const TensorParallelSplit s = split_heads(p.model, n);
    for (int r = 0; r < n; ++r) {
      const KvPlan rp = slice_kv_plan(p, s, r);
      const std::vector<int> heads = s.kv_heads_of(r);
      for (const LayerKvSpec& l : rp.layers) {
        const size_t li = static_cast<size_t>(l.layer);
        EXPECT_EQ(l.k_dtype, p.layers[li].k_dtype);
        EXPECT_EQ(rp.decisions[li].k.provenance, Provenance::kCheckpointScheme);
        ASSERT_EQ(l.k_scale.values.size(), heads.size());
        for (size_t i = 0; i < heads.size(); ++i) {
          EXPECT_EQ(l.k_scale.for_head(static_cast<int>(i)),
                    ks[li * nkv + static_cast<size_t>(heads[i])]);
          EXPECT_EQ(l.v_scale.for_head(static_cast<int>(i)),
                    vs[li * nkv + static_cast<size_t>(heads[i])]);
        }
      }
    }
  }
}

// The weight shards of tensor parallelism, for fresh random shapes and every accepted size:
// each rank's q|k|v rows are exactly the q rows of its query heads and the k / v rows of its kv
// heads (every q row on one rank, every k / v row on kv_head_replicas ranks); gate|up rows and
// down columns cut the MLP into equal slices that cover it once; o columns are the rank's
// query heads. Checked row by row against the heads each row belongs to.
TEST(TensorParallel, WeightShardsFollowTheHeadsAndTheMlpSlices) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 30; ++trial) {
    const int nkv = 1 << std::uniform_int_distribution<int>(0, 3)(rng);
    const int nq = nkv * (1 << std::uniform_int_distribution<int>(0, 2)(rng));
    const int d = 16 << std::uniform_int_distribution<int>(0, 2)(rng);
    const int inter = 64 * std::uniform_int_distribution<int>(1, 12)(rng);
    const KvPlan p = make_kv_plan(
        load_model_config(make_model_dir(llama_config(2, nq, nkv, d), {})), opts(std::nullopt));
    SCOPED_TRACE(std::to_string(nq) + " q / " + std::to_string(nkv) + " kv heads, head_dim " +
                 std::to_string(d) + ", MLP " + std::to_string(inter));
    for (int n : tensor_parallel_sizes(p.model, 16)) {
      const TensorParallelSplit s = split_heads(p.model, n);
      if (inter % n != 0) {
        EXPECT_THROW((void)tp_shard(TpMatrix::kGateUp, s, p.model, inter, 0), InputError);
        continue;
      }
      const int q_rows = nq * d, kv_rows = nkv * d;
      std::vector<int> qkv_hits(static_cast<size_t>(q_rows + 2 * kv_rows), 0);
      std::vector<int> mlp_hits(static_cast<size_t>(2 * inter), 0), down_hits(inter, 0);
      std::vector<int> o_hits(static_cast<size_t>(q_rows), 0);
      for (int r = 0; r < n; ++r) {
        const std::vector<int> kv = s.kv_heads_of(r);
        const TpShard qkv = tp_shard(TpMatrix::kQkv, s, p.model, inter, r);
        EXPECT_EQ(qkv.cols, 0);
        EXPECT_EQ(qkv.num_rows(), int64_t{s.q_heads_per_rank} * d + 2 * int64_t{s.kv_heads_per_rank} * d);
        int64_t local = 0;
        for (const auto& [first, count] : qkv.rows)
          for (int64_t row = first; row < first + count; ++row, ++local) {
            ++qkv_hits[static_cast<size_t>(row)];
            // Which head of which part the row belongs to, and that the rank holds it in order.
            if (row < q_rows) {
              EXPECT_EQ(row / d, s.first_q_head(r) + local / d) << "rank " << r;
            } else {
              const int64_t kr = (row - q_rows) % kv_rows;
              const int64_t lk = (local - int64_t{s.q_heads_per_rank} * d) % (int64_t{s.kv_heads_per_rank} * d);
              EXPECT_EQ(kr / d, kv[static_cast<size_t>(lk / d)]) << "rank " << r;
            }
          }
        const TpShard gu = tp_shard(TpMatrix::kGateUp, s, p.model, inter, r);
        EXPECT_EQ(gu.num_rows(), 2 * inter / n);
        for (const auto& [first, count] : gu.rows)
          for (int64_t row = first; row < first + count; ++row) ++mlp_hits[static_cast<size_t>(row)];
        // gate and up rows of the same intermediate units, in order.
        ASSERT_EQ(gu.rows.size(), 2u);
        EXPECT_EQ(gu.rows[1].first - gu.rows[0].first, inter);
        const TpShard down = tp_shard(TpMatrix::kDown, s, p.model, inter, r);
        EXPECT_TRUE(down.rows.empty());
        EXPECT_EQ(down.col0, gu.rows[0].first);
        EXPECT_EQ(down.cols, inter / n);
        for (int64_t c = down.col0; c < down.col0 + down.cols; ++c) ++down_hits[static_cast<size_t>(c)];
        const TpShard o = tp_shard(TpMatrix::kO, s, p.model, inter, r);
        EXPECT_EQ(o.col0, int64_t{s.first_q_head(r)} * d);
        EXPECT_EQ(o.cols, int64_t{s.q_heads_per_rank} * d);
        for (int64_t c = o.col0; c < o.col0 + o.cols; ++c) ++o_hits[static_cast<size_t>(c)];
      }
      for (int row = 0; row < q_rows + 2 * kv_rows; ++row)
        EXPECT_EQ(qkv_hits[static_cast<size_t>(row)], row < q_rows ? 1 : s.kv_head_replicas)
            << "size " << n << ", q|k|v row " << row;
      for (int h : mlp_hits) EXPECT_EQ(h, 1) << "size " << n;
      for (int h : down_hits) EXPECT_EQ(h, 1) << "size " << n;
      for (int h : o_hits) EXPECT_EQ(h, 1) << "size " << n;
      // The LM head's vocabulary: consecutive equal shards in rank order.
      const int vocab = n * std::uniform_int_distribution<int>(1, 50)(rng);
      for (int r = 0; r < n; ++r) {
        const TpShard v = tp_shard(TpMatrix::kVocab, s, p.model, inter, r, vocab);
        ASSERT_EQ(v.rows.size(), 1u);
        EXPECT_EQ(v.rows[0].first, int64_t{r} * (vocab / n));
        EXPECT_EQ(v.rows[0].second, vocab / n);
      }
      if (n > 1) {
        EXPECT_THROW((void)tp_shard(TpMatrix::kVocab, s, p.model, inter, 0, vocab + 1), InputError);
      }
    }
  }
}

}  // namespace
}  // namespace kvq
