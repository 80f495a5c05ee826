// The DFlash drafter against its PyTorch oracle (tests/fixtures/goldens/dflash_kvq-code-tiny.*,
// made by tools/train_dflash.py): target features captured in the target's forward pass, context
// K/V written from them, one non-causal block pass; per-element logits and the greedy drafts.
// Then the proposer in the speculative loop: greedy ids equal plain decoding for every KV dtype.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "engine_test_util.h"
#include "kvq/core/error.h"
#include "kvq/engine/speculative.h"
#include "kvq/plan/speculative_config.h"
#include "support/source_dir.h"

namespace kvq::test {
namespace {

const std::string kDflashDir = ::kvq::test::source_dir() + "/models/kvq-code-tiny-dflash";
const std::string kGoldens = ::kvq::test::source_dir() + "/tests/fixtures/goldens/";

KvPlanOptions kv_flags(KvDtype kv) {
  KvPlanOptions o;
  o.kv = DtypeFlag{kv, "--kv-cache-dtype " + std::string(traits(kv).name)};
  return o;
}

std::shared_ptr<const Model> dflash_drafter(const Model& target, KvDtype kv) {
  SpeculativeConfig sc;
  sc.method = SpecMethod::kDflash;
  sc.model = kDflashDir;
  return std::shared_ptr<const Model>(Model::load_dflash_drafter(
      make_drafter_kv_plan(load_model_config(kDflashDir), kv_flags(kv), sc), target));
}

#define KVQ_REQUIRE_DFLASH()                                         \
  do {                                                               \
    KVQ_REQUIRE_MODEL();                                             \
    if (!std::filesystem::exists(kDflashDir + "/model.safetensors")) \
      GTEST_SKIP() << kDflashDir << " absent";                       \
  } while (0)

TEST(DflashDrafter, PlansNonCausalLayersQuantizedLikeTheTarget) {
  KVQ_REQUIRE_DFLASH();
  SpeculativeConfig sc;
  sc.method = SpecMethod::kDflash;
  sc.model = kDflashDir;
  const KvPlan p =
      make_drafter_kv_plan(load_model_config(kDflashDir), kv_flags(KvDtype::kFp8E4M3), sc);
  ASSERT_FALSE(p.layers.empty());
  for (const LayerKvSpec& l : p.layers) {
    EXPECT_EQ(l.attention, AttentionKind::kNonCausal);
    EXPECT_EQ(l.k_dtype, KvDtype::kFp8E4M3);
    EXPECT_EQ(l.v_dtype, KvDtype::kFp8E4M3);
    EXPECT_TRUE(select_attention_backend(l, Device::kCpu, "").backend != nullptr);
  }
  // A drafter alone cannot run: it needs its target's embedding.
  EXPECT_THROW(Model::load(p), InputError);
}

TEST(DflashDrafter, MatchesTheOracleGoldens) {
  KVQ_REQUIRE_DFLASH();
  std::ifstream jf(kGoldens + "dflash_kvq-code-tiny.json");
  ASSERT_TRUE(jf) << "goldens absent";
  const nlohmann::json g = nlohmann::json::parse(jf);
  std::ifstream bf(kGoldens + g["logits_file"].get<std::string>(), std::ios::binary);
  const auto shape = g["logits_shape"].get<std::vector<size_t>>();
  std::vector<float> want(shape[0] * shape[1] * shape[2]);
  bf.read(reinterpret_cast<char*>(want.data()), static_cast<std::streamsize>(want.size() * 4));
  ASSERT_TRUE(bf) << "logits file too short";

  // Unquantized caches (the oracle keeps K/V in fp32).
  const std::unique_ptr<Model> target = engine_model(default_plan(KvDtype::kFloat32));
  const std::shared_ptr<const Model> drafter = dflash_drafter(*target, KvDtype::kFloat32);
  const std::vector<int32_t> layers = drafter->arch().dflash->target_layer_ids;
  const size_t H = static_cast<size_t>(target->arch().hidden_size), V = shape[2];
  for (const auto& c : g["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const auto ctx = c["context_ids"].get<std::vector<int32_t>>();
    const int32_t n = static_cast<int32_t>(ctx.size());
    // The target over the context: features of every position, and its next token (the bonus).
    auto tcache = target->create_cache(64);
    tcache->add_sequence(1);
    std::vector<int64_t> slots = tcache->append(1, n);
    std::vector<int32_t> pos(static_cast<size_t>(n));
    std::iota(pos.begin(), pos.end(), 0);
    const int32_t qi[2] = {0, n};
    const SequenceId ids[1] = {1};
    PagedKvCache::BlockTableStorage st;
    const int32_t last_row[1] = {n - 1};
    ForwardBatch fb{ctx, pos, qi, slots, tcache->block_table(ids, st), last_row};
    std::vector<float> features(static_cast<size_t>(n) * layers.size() * H);
    fb.capture_layers = layers;
    fb.captured = features;
    std::vector<float> logits(V);
    target->forward(fb, *tcache, logits);
    const int32_t bonus =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ(bonus, c["bonus_id"].get<int32_t>());

    // Context K/V from the features, then the block [bonus, mask x 8].
    auto dcache = drafter->create_cache(64);
    dcache->add_sequence(1);
    const std::vector<int64_t> dslots = dcache->append(1, n);
    drafter->write_feature_kv(features, pos, dslots, *dcache);
    const int k = c["k"].get<int>();
    std::vector<int32_t> block{c["bonus_id"].get<int32_t>()}, bpos{n}, rows;
    for (int j = 1; j <= k; ++j) {
      block.push_back(kMaskToken);
      bpos.push_back(n + j);
      rows.push_back(j);
    }
    const std::vector<int64_t> bslots = dcache->append(1, k + 1);
    const int32_t bqi[2] = {0, k + 1};
    PagedKvCache::BlockTableStorage bst;
    const ForwardBatch bb{block, bpos, bqi, bslots, dcache->block_table(ids, bst), rows};
    std::vector<float> got(static_cast<size_t>(k) * V);
    drafter->forward(bb, *dcache, got);
    const size_t base = c["logits_bin_index"].get<size_t>() * shape[1] * V;
    double worst = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double w = want[base + i], d = std::abs(got[i] - w);
      worst = std::max(worst, d / (1e-3 * (1.0 + std::abs(w))));
      ASSERT_LE(d, 1e-3 * (1.0 + std::abs(w))) << "row " << i / V + 1 << " id " << i % V;
    }
    std::vector<int32_t> drafts;
    for (int j = 0; j < k; ++j) {
      const float* r = got.data() + static_cast<size_t>(j) * V;
      drafts.push_back(static_cast<int32_t>(std::max_element(r, r + V) - r));
    }
    EXPECT_EQ(drafts, c["draft_ids"].get<std::vector<int32_t>>());
    std::fprintf(stderr, "%s: worst logit error %.3f of the tolerance\n",
                 c["name"].get<std::string>().c_str(), worst);
  }
}

class DflashGreedy : public ::testing::TestWithParam<KvDtype> {};

TEST_P(DflashGreedy, GenerateGivesPlainGreedyIdsWithBothCachesQuantized) {
  KVQ_REQUIRE_DFLASH();
  const KvDtype kv = GetParam();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  const std::unique_ptr<Model> target = engine_model(default_plan(kv));
  const std::shared_ptr<const Model> drafter = dflash_drafter(*target, kv);
  for (const auto& l : drafter->plan().layers) EXPECT_EQ(l.k_dtype, kv);
  std::ifstream f(kModelDir + "/heldout.txt");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> ids = reference_tokenizer().encode(text.substr(0, 30000), false);
  SpecCounters total;
  int near_ties = 0;
  for (int k : {2, 8}) {
    if (kUnderSanitizer && k == 2) continue;
    auto proposer = make_dflash_proposer(drafter, 64);
    GeneratorOptions o;
    o.proposer = proposer.get();
    o.num_speculative_tokens = k;
    o.prefill_chunk = 32;  // features arrive over several prefill chunks
    for (int t = 0; t < 2; ++t) {
      const size_t at = std::uniform_int_distribution<size_t>(0, ids.size() - 200)(rng);
      const std::vector<int32_t> prompt(ids.begin() + static_cast<std::ptrdiff_t>(at),
                                        ids.begin() + static_cast<std::ptrdiff_t>(at) + 70);
      SamplingParams p;
      p.temperature = 0.0f;
      p.max_tokens = kUnderSanitizer ? 16 : 40;
      p.ignore_eos = true;
      GeneratorOptions plain;
      plain.prefill_chunk = o.prefill_chunk;
      const GenerationResult want = generate(*target, reference_tokenizer(), prompt, p, plain);
      const GenerationResult got = generate(*target, reference_tokenizer(), prompt, p, o);
      Collected c;
      c.ids = got.output_ids;
      c.text = got.text;
      c.finish_reason = got.finish_reason;
      const float tie = traits(kv).scale_kind == ScaleKind::kPerTokenHead ? 5e-3f : 1e-3f;
      EXPECT_EQ(compare_greedy(prompt, want, c, &near_ties, target.get(), tie), "")
          << "seed " << seed;
      // The same proposer serves both calls (generate() releases its sequence at the end).
      EXPECT_GT(got.spec.drafted, 0) << "call " << t << " with k " << k << " drafted nothing";
      total.add(got.spec);
    }
  }
  EXPECT_LE(near_ties, 1);
  EXPECT_GT(total.accepted, 0) << "the drafter never helped; seed " << seed;
  std::fprintf(stderr, "%s: mean accepted length %.2f\n", traits(kv).name.data(),
               total.mean_accepted_length());
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, DflashGreedy,
                         ::testing::Values(KvDtype::kBFloat16, KvDtype::kFp8E4M3,
                                           KvDtype::kInt8PerTokenHead, KvDtype::kInt4PerTokenHead),
                         [](const auto& param_info) {
                           return std::string(traits(param_info.param).name);
                         });

TEST(DflashEngine, BatchWithPrefixHitsAndPreemptionGivesSoloIds) {
  KVQ_REQUIRE_DFLASH();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  const KvPlan plan = default_plan(KvDtype::kFp8E4M3);
  EngineConfig config;
  config.num_blocks = 14;  // tight: preemption
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 64;
  config.num_speculative_tokens = 4;
  const std::unique_ptr<Model> solo_model = engine_model(plan);
  config.proposer = make_dflash_proposer(dflash_drafter(*solo_model, KvDtype::kFp8E4M3), 64);
  Collector collector;  // outlives the engine and its callbacks
  auto engine = make_engine(config, plan);
  std::ifstream f(kModelDir + "/heldout.txt");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> ids = reference_tokenizer().encode(text.substr(0, 30000), false);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<RequestId> rid;
  std::vector<GenerationResult> want;
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = kUnderSanitizer ? 14 : 30;
  p.ignore_eos = true;
  const std::vector<int32_t> head(ids.begin(), ids.begin() + 34);  // shared: prefix-cache hits
  for (int i = 0; i < 8; ++i) {
    const size_t at = std::uniform_int_distribution<size_t>(100, ids.size() - 100)(rng);
    std::vector<int32_t> pr = head;
    pr.insert(pr.end(), ids.begin() + static_cast<std::ptrdiff_t>(at),
              ids.begin() + static_cast<std::ptrdiff_t>(at) + 10);
    prompts.push_back(pr);
    want.push_back(generate(*solo_model, reference_tokenizer(), pr, p, {}));
  }
  for (const auto& pr : prompts) rid.push_back(engine->add_request(pr, p, collector.callback()));
  ASSERT_TRUE(collector.wait_finished(prompts.size()));
  int near_ties = 0;
  for (size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(
        compare_greedy(prompts[i], want[i], collector.get(rid[i]), &near_ties, solo_model.get()),
        "")
        << "request " << i << ", seed " << seed;
  EXPECT_LE(near_ties, 2);
  const EngineStats s = engine->stats();
  EXPECT_GT(s.spec.drafted, 0);
  EXPECT_EQ(s.blocks_used, 0);
}

// The features of a batched step reach their own sequences: every request of an engine batch
// (prefill chunks of several prompts in one step, then batched verify steps) drafts as well as
// the same request alone through generate(). Greedy ids are lossless whatever the drafts are,
// so this is what catches features of one sequence handed to another (acceptance collapses).
TEST(DflashEngine, BatchedFeaturesReachTheirSequences) {
  KVQ_REQUIRE_DFLASH();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  const KvPlan plan = default_plan(KvDtype::kBFloat16);
  const std::unique_ptr<Model> solo_model = engine_model(plan);
  const std::shared_ptr<const Model> drafter = dflash_drafter(*solo_model, KvDtype::kBFloat16);
  std::ifstream f(kModelDir + "/heldout.txt");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> ids = reference_tokenizer().encode(text.substr(0, 30000), false);
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = kUnderSanitizer ? 16 : 32;
  p.ignore_eos = true;
  const int k = 4;
  std::vector<std::vector<int32_t>> prompts;
  SpecCounters solo;
  for (int i = 0; i < 6; ++i) {
    const size_t at = std::uniform_int_distribution<size_t>(0, ids.size() - 200)(rng);
    prompts.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(at),
                         ids.begin() + static_cast<std::ptrdiff_t>(at) + 24 + 8 * i);
    auto proposer = make_dflash_proposer(drafter, 64);
    GeneratorOptions o;
    o.proposer = proposer.get();
    o.num_speculative_tokens = k;
    solo.add(generate(*solo_model, reference_tokenizer(), prompts.back(), p, o).spec);
  }
  EngineConfig config;
  config.num_blocks = 256;
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 128;  // several prompts' chunks share a step
  config.num_speculative_tokens = k;
  config.enable_prefix_caching = false;
  config.proposer = make_dflash_proposer(drafter, 256);
  Collector collector;  // outlives the engine and its callbacks
  auto engine = make_engine(config, plan);
  for (const auto& pr : prompts) engine->add_request(pr, p, collector.callback());
  ASSERT_TRUE(collector.wait_finished(prompts.size()));
  const EngineStats s = engine->stats();
  ASSERT_GT(solo.accepted, 0) << "seed " << seed;
  std::fprintf(stderr, "batched: accepted %lld of %lld drafts; alone: %lld of %lld\n",
               static_cast<long long>(s.spec.accepted), static_cast<long long>(s.spec.drafted),
               static_cast<long long>(solo.accepted), static_cast<long long>(solo.drafted));
  // The same drafter and target on the same tokens: equal up to near ties that move a
  // continuation; features of the wrong sequence would accept a small fraction.
  EXPECT_GE(static_cast<double>(s.spec.accepted), 0.7 * static_cast<double>(solo.accepted))
      << "engine accepted " << s.spec.accepted << " of " << s.spec.drafted << ", alone "
      << solo.accepted << " of " << solo.drafted << "; seed " << seed;
  EXPECT_EQ(s.blocks_used, 0);
}

}  // namespace
}  // namespace kvq::test
