// The DFlash drafter on the GPU against its PyTorch oracle (tests/fixtures/goldens/
// dflash_kvq-code-tiny.*, made by tools/train_dflash.py), as the CPU drafter is tested in
// tests/unit/engine/dflash_test.cc: the CUDA target captures the features of its chosen layers
// (equal to the CPU target's), the CUDA drafter writes context K/V from them into its device
// cache, and one non-causal block pass gives the oracle's logits and drafts, replayed from a CUDA
// graph with the same result. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/model/cuda_model.h"
#include "kvq/plan/speculative_config.h"
#include "support/source_dir.h"

namespace kvq {
namespace {

const std::string kTiny = ::kvq::test::source_dir() + "/models/kvq-code-tiny";
const std::string kDflash = ::kvq::test::source_dir() + "/models/kvq-code-tiny-dflash";
const std::string kGoldens = ::kvq::test::source_dir() + "/tests/fixtures/goldens/";

KvPlanOptions kv_flags(KvDtype kv) {
  KvPlanOptions o;
  o.kv = DtypeFlag{kv, "--kv-cache-dtype " + std::string(traits(kv).name)};
  return o;
}

KvPlan drafter_plan(KvDtype kv) {
  SpeculativeConfig sc;
  sc.method = SpecMethod::kDflash;
  sc.model = kDflash;
  return make_drafter_kv_plan(load_model_config(kDflash), kv_flags(kv), sc);
}

CudaModelOptions fp32_options(bool graphs) {
  CudaModelOptions o;
  o.weights = WeightPrecision::kFloat32;  // the oracle computes in fp32
  o.cuda_graphs = graphs;
  o.max_num_seqs = 4;
  o.max_num_batched_tokens = 256;
  o.gpu_memory_utilization = 0.3f;
  return o;
}

#define KVQ_REQUIRE_GPU_AND_DFLASH()                                \
  do {                                                              \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
    if (!std::filesystem::exists(kDflash + "/model.safetensors"))   \
      GTEST_SKIP() << kDflash << " absent";                         \
  } while (0)

TEST(DflashCuda, RefusesACpuTargetAndADrafterAlone) {
  KVQ_REQUIRE_GPU_AND_DFLASH();
  const KvPlan tp = make_kv_plan(load_model_config(kTiny), kv_flags(KvDtype::kBFloat16));
  const std::unique_ptr<Model> cpu_target = Model::load(tp);
  EXPECT_THROW(CudaModel::load_dflash_drafter(drafter_plan(KvDtype::kBFloat16), *cpu_target,
                                              fp32_options(true)),
               InputError);
  EXPECT_THROW(CudaModel::load(drafter_plan(KvDtype::kBFloat16), fp32_options(true)), InputError);
}

TEST(DflashCuda, MatchesTheOracleGoldensAndTheCpuFeatures) {
  KVQ_REQUIRE_GPU_AND_DFLASH();
  std::ifstream jf(kGoldens + "dflash_kvq-code-tiny.json");
  ASSERT_TRUE(jf) << "goldens absent";
  const nlohmann::json g = nlohmann::json::parse(jf);
  std::ifstream bf(kGoldens + g["logits_file"].get<std::string>(), std::ios::binary);
  const auto shape = g["logits_shape"].get<std::vector<size_t>>();
  std::vector<float> want(shape[0] * shape[1] * shape[2]);
  bf.read(reinterpret_cast<char*>(want.data()), static_cast<std::streamsize>(want.size() * 4));
  ASSERT_TRUE(bf) << "logits file too short";

  // fp32 weights and a float16 cache on both devices: the CUDA attention multiplies fp16
  // operands for a float16 cache (bf16 ones for a float32 cache, which would cost 4x the
  // tolerance; see cuda_model_test.cc).
  const KvPlan tp = make_kv_plan(load_model_config(kTiny), kv_flags(KvDtype::kFloat16));
  const std::unique_ptr<Model> cpu_target = Model::load(tp);
  for (bool graphs : {false, true}) {
    SCOPED_TRACE(graphs ? "graphs" : "eager");
    const std::unique_ptr<CudaModel> target = CudaModel::load(tp, fp32_options(graphs));
    const std::unique_ptr<CudaModel> drafter = CudaModel::load_dflash_drafter(
        drafter_plan(KvDtype::kFloat16), *target, fp32_options(graphs));
    const std::vector<int32_t> layers = drafter->arch().dflash->target_layer_ids;
    const size_t H = static_cast<size_t>(target->arch().hidden_size), V = shape[2];
    for (const auto& c : g["cases"]) {
      SCOPED_TRACE(c["name"].get<std::string>());
      const auto ctx = c["context_ids"].get<std::vector<int32_t>>();
      const int32_t n = static_cast<int32_t>(ctx.size());
      std::vector<int32_t> pos(static_cast<size_t>(n));
      std::iota(pos.begin(), pos.end(), 0);
      const int32_t qi[2] = {0, n};
      const SequenceId ids[1] = {1};
      const int32_t last_row[1] = {n - 1};
      // The target over the context on both devices, capturing the drafter's layers.
      std::vector<float> features(static_cast<size_t>(n) * layers.size() * H);
      std::vector<float> cpu_features(features.size());
      std::vector<float> logits(V);
      for (const Model* m :
           {static_cast<const Model*>(cpu_target.get()), static_cast<const Model*>(target.get())}) {
        auto tcache = m->create_cache(32);
        tcache->add_sequence(1);
        const std::vector<int64_t> slots = tcache->append(1, n);
        PagedKvCache::BlockTableStorage st;
        ForwardBatch fb{ctx, pos, qi, slots, tcache->block_table(ids, st), last_row};
        fb.capture_layers = layers;
        fb.captured =
            m == target.get() ? std::span<float>(features) : std::span<float>(cpu_features);
        std::fill(fb.captured.begin(), fb.captured.end(), std::nanf(""));
        m->forward(fb, *tcache, logits);
      }
      // Per element, against the largest magnitude of its hidden row (elements near 0 carry
      // the row's rounding, not their own).
      double worst_feature = 0.0;
      int bad_features = 0;
      for (size_t r = 0; r < features.size() / H; ++r) {
        double row_max = 0.0;
        for (size_t e = 0; e < H; ++e)
          row_max = std::max(row_max, static_cast<double>(std::abs(cpu_features[r * H + e])));
        const double tol = 1e-3 * (1.0 + row_max);
        for (size_t e = 0; e < H; ++e) {
          const double d = std::abs(features[r * H + e] - cpu_features[r * H + e]);
          worst_feature = std::max(worst_feature, d / tol);
          if (d > tol && ++bad_features <= 5)
            ADD_FAILURE() << "feature differs by " << d << " > " << tol << ": token "
                          << r / layers.size() << " capture " << r % layers.size() << " element "
                          << e;
        }
      }
      std::fprintf(stderr, "%s (%s): worst feature error %.3f of the tolerance\n",
                   c["name"].get<std::string>().c_str(), graphs ? "graphs" : "eager",
                   worst_feature);
      if (::testing::Test::HasFailure()) return;
      const int32_t bonus =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      EXPECT_EQ(bonus, c["bonus_id"].get<int32_t>());

      // Context K/V from the CUDA features, then the block [bonus, mask x k], three times (the
      // first eager, the next ones from a graph when graphs are on): the same logits each time.
      auto dcache = drafter->create_cache(32);
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
      std::vector<float> first;
      for (int rep = 0; rep < 3; ++rep) {
        const std::vector<int64_t> bslots = dcache->append(1, k + 1);
        const int32_t bqi[2] = {0, k + 1};
        PagedKvCache::BlockTableStorage bst;
        const ForwardBatch bb{block, bpos, bqi, bslots, dcache->block_table(ids, bst), rows};
        std::vector<float> got(static_cast<size_t>(k) * V, std::nanf(""));
        drafter->forward(bb, *dcache, got);
        dcache->truncate(1, n);
        if (rep > 0) {
          ASSERT_EQ(got, first) << "repeat " << rep;
          continue;
        }
        first = got;
        const size_t base = c["logits_bin_index"].get<size_t>() * shape[1] * V;
        // Per element against the row's largest logit (as cuda_model_test.cc bounds the model):
        // fp16 K/V and the GPU's summation order move a logit near 0 by a few 1e-3.
        double worst = 0.0;
        int bad_logits = 0;
        for (size_t r = 0; r < static_cast<size_t>(k); ++r) {
          double row_max = 0.0;
          for (size_t e = 0; e < V; ++e)
            row_max = std::max(row_max, std::abs(static_cast<double>(want[base + r * V + e])));
          const double tol = 2e-3 * (1.0 + row_max);
          for (size_t e = 0; e < V; ++e) {
            const double w = want[base + r * V + e], d = std::abs(got[r * V + e] - w);
            worst = std::max(worst, d / tol);
            if (d > tol && ++bad_logits <= 5)
              ADD_FAILURE() << "logit differs from the oracle's " << w << " by " << d << ": row "
                            << r + 1 << " id " << e;
          }
        }
        std::vector<int32_t> drafts;
        for (int j = 0; j < k; ++j) {
          const float* r = got.data() + static_cast<size_t>(j) * V;
          drafts.push_back(static_cast<int32_t>(std::max_element(r, r + V) - r));
        }
        EXPECT_EQ(drafts, c["draft_ids"].get<std::vector<int32_t>>());
        std::fprintf(stderr, "%s (%s): worst logit error %.3f of the tolerance\n",
                     c["name"].get<std::string>().c_str(), graphs ? "graphs" : "eager", worst);
      }
      // The greedy rule on the device gives the same drafts as the host argmax.
      const std::vector<int64_t> bslots = dcache->append(1, k + 1);
      const int32_t bqi[2] = {0, k + 1};
      PagedKvCache::BlockTableStorage bst;
      const ForwardBatch bb{block, bpos, bqi, bslots, dcache->block_table(ids, bst), rows};
      std::vector<int32_t> device_drafts(static_cast<size_t>(k));
      const DeviceSampling argmax[1] = {DeviceSampling{}};
      drafter->forward_sample(bb, *dcache, argmax, device_drafts);
      EXPECT_EQ(device_drafts, c["draft_ids"].get<std::vector<int32_t>>());
    }
  }
}

// The speculative engine's path on the GPU: the context rows the target kept in its last pass
// ride in the drafter's next block pass (ForwardBatch::feature_rows, one device step), for the
// drafting sequence and for another one; the block logits equal those after a separate
// write_feature_kv_from_target, eager and replayed from graphs, with a quantized cache.
TEST(DflashCuda, ContextRowsFusedIntoTheBlockPassEqualASeparateWrite) {
  KVQ_REQUIRE_GPU_AND_DFLASH();
  uint32_t seed = std::random_device{}();
  if (const char* e = std::getenv("KVQ_TEST_SEED"); e != nullptr && *e != '\0')
    seed = static_cast<uint32_t>(std::stoul(e));
  SCOPED_TRACE("KVQ_TEST_SEED=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const KvPlan tp = make_kv_plan(load_model_config(kTiny), kv_flags(KvDtype::kFp8E4M3));
  for (bool graphs : {false, true}) {
    SCOPED_TRACE(graphs ? "graphs" : "eager");
    const std::unique_ptr<CudaModel> target = CudaModel::load(tp, fp32_options(graphs));
    const std::unique_ptr<CudaModel> drafter = CudaModel::load_dflash_drafter(
        drafter_plan(KvDtype::kFp8E4M3), *target, fp32_options(graphs));
    const int V = target->vocab_size();
    const int32_t n = 24 + static_cast<int32_t>(rng() % 40);  // context tokens
    const int32_t m = 1 + static_cast<int32_t>(rng() % 9);    // the last pass's kept rows
    const int k = 8;
    std::vector<int32_t> ctx(static_cast<size_t>(n)), pos(static_cast<size_t>(n));
    for (int32_t& t : ctx) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(V));
    std::iota(pos.begin(), pos.end(), 0);
    // The target's pass over the whole context, its features kept on the device.
    auto tcache = target->create_cache(32);
    tcache->add_sequence(1);
    const std::vector<int64_t> tslots = tcache->append(1, n);
    const int32_t qi[2] = {0, n};
    const SequenceId one[1] = {1};
    const int32_t last_row[1] = {n - 1};
    PagedKvCache::BlockTableStorage tst;
    ForwardBatch tb{ctx, pos, qi, tslots, tcache->block_table(one, tst), last_row};
    const std::vector<int32_t> layers = drafter->arch().dflash->target_layer_ids;
    tb.capture_layers = layers;
    tb.capture_on_device = true;
    std::vector<float> tlogits(static_cast<size_t>(V));
    target->forward(tb, *tcache, tlogits);
    std::vector<int32_t> all_rows(static_cast<size_t>(n));
    std::iota(all_rows.begin(), all_rows.end(), 0);

    std::vector<int32_t> block{static_cast<int32_t>(rng() % static_cast<uint32_t>(V))}, bpos{n},
        rows;
    for (int j = 1; j <= k; ++j) {
      block.push_back(kMaskToken);
      bpos.push_back(n + j);
      rows.push_back(j);
    }
    const int32_t bqi[2] = {0, k + 1};
    auto block_pass = [&](PagedKvCache& cache, SequenceId id, const ForwardBatch* features) {
      const SequenceId ids[1] = {id};
      const std::vector<int64_t> bslots = cache.append(id, k + 1);
      PagedKvCache::BlockTableStorage bst;
      ForwardBatch bb{block, bpos, bqi, bslots, cache.block_table(ids, bst), rows};
      if (features != nullptr) {
        bb.feature_source = features->feature_source;
        bb.feature_rows = features->feature_rows;
        bb.feature_positions = features->feature_positions;
        bb.feature_slots = features->feature_slots;
      }
      std::vector<float> got(static_cast<size_t>(k) * V, std::nanf(""));
      drafter->forward(bb, cache, got);
      cache.truncate(id, n);
      return got;
    };

    // Reference: every context row written on its own, then the block pass.
    auto ref_cache = drafter->create_cache(32);
    ref_cache->add_sequence(1);
    const std::vector<int64_t> ref_slots = ref_cache->append(1, n);
    drafter->write_feature_kv_from_target(*target, all_rows, pos, ref_slots, *ref_cache);
    const std::vector<float> want = block_pass(*ref_cache, 1, nullptr);

    // Fused: the first n - m rows before, the last m (sequence 1) and all n (sequence 2, not
    // drafting) in the block pass of sequence 1; then sequence 2's own pass.
    auto cache = drafter->create_cache(64);
    cache->add_sequence(1);
    cache->add_sequence(2);
    const std::vector<int64_t> s1 = cache->append(1, n - m);
    drafter->write_feature_kv_from_target(
        *target, std::span<const int32_t>(all_rows).first(static_cast<size_t>(n - m)),
        std::span<const int32_t>(pos).first(static_cast<size_t>(n - m)), s1, *cache);
    std::vector<int64_t> fslots = cache->append(1, m);
    std::vector<int32_t> frows(all_rows.end() - m, all_rows.end()), fpos = frows;
    const std::vector<int64_t> s2 = cache->append(2, n);
    fslots.insert(fslots.end(), s2.begin(), s2.end());
    frows.insert(frows.end(), all_rows.begin(), all_rows.end());
    fpos.insert(fpos.end(), pos.begin(), pos.end());
    ForwardBatch features{};
    features.feature_source = target.get();
    features.feature_rows = frows;
    features.feature_positions = fpos;
    features.feature_slots = fslots;
    // Three times (eager, captured, replayed with graphs on): the rows are rewritten unchanged.
    std::vector<float> first;
    for (int rep = 0; rep < 3; ++rep) {
      const std::vector<float> got = block_pass(*cache, 1, &features);
      if (rep == 0) {
        first = got;
      } else {
        ASSERT_EQ(got, first) << "repeat " << rep;
      }
    }
    const std::vector<float> second = block_pass(*cache, 2, nullptr);
    for (const std::vector<float>* got :
         {static_cast<const std::vector<float>*>(&first), &second}) {
      double worst = 0.0;
      int bad = 0;
      for (int r = 0; r < k; ++r) {
        double row_max = 0.0;
        for (int e = 0; e < V; ++e)
          row_max = std::max(row_max, std::abs(static_cast<double>(want[size_t(r) * V + e])));
        // The fused rows' K/V come out of a q|k|v product of C + T rows (they ride ahead of the
        // block's), the reference's out of one of n rows: cuBLAS may sum in another order, and a
        // last-bit difference can move an fp8 cache code by one step. Seen: 1.04 x 1e-4
        // (1 + max|logit|) on one seed, and 2.2 x 1e-3 (1 + max|logit|) with graphs on seed
        // 3979461096 (0.0-0.4 x 1e-3 on seven others); a wrong row, slot or position costs O(1).
        const double tol = 5e-3 * (1.0 + row_max);
        for (int e = 0; e < V; ++e) {
          const double d = std::abs((*got)[size_t(r) * V + e] - want[size_t(r) * V + e]);
          worst = std::max(worst, d / tol);
          if (!(d <= tol) && ++bad <= 5)
            ADD_FAILURE() << (got == &first ? "sequence 1" : "sequence 2") << ": row " << r + 1
                          << " id " << e << " differs by " << d << " > " << tol;
        }
      }
      std::fprintf(stderr,
                   "fused context rows (%s, n %d, m %d): worst error %.3f of the "
                   "tolerance\n",
                   graphs ? "graphs" : "eager", n, m, worst);
    }
    // Rows whose positions do not match them, or from a model that captured nothing, are
    // refused before anything runs.
    ForwardBatch bad = features;
    bad.feature_positions = std::span<const int32_t>(fpos).first(fpos.size() - 1);
    EXPECT_THROW(block_pass(*cache, 1, &bad), InternalError);
    bad = features;
    bad.feature_source = drafter.get();
    EXPECT_THROW(block_pass(*cache, 1, &bad), InternalError);
  }
}

}  // namespace
}  // namespace kvq
