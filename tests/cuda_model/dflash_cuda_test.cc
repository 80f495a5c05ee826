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
#include <string>
#include <vector>

#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/model/cuda_model.h"
#include "kvq/plan/speculative_config.h"

namespace kvq {
namespace {

const std::string kTiny = std::string(KVQ_SOURCE_DIR) + "/models/kvq-code-tiny";
const std::string kDflash = std::string(KVQ_SOURCE_DIR) + "/models/kvq-code-tiny-dflash";
const std::string kGoldens = std::string(KVQ_SOURCE_DIR) + "/tests/fixtures/goldens/";

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

}  // namespace
}  // namespace kvq
