// Speculative decoding on the GPU: greedy speculation (ngram, draft_model and dflash, the
// drafters on the GPU with their own device caches, quantized like the target) gives the ids of
// plain greedy decoding with the same CUDA model, up to near ties (the verification pass runs the
// prefill attention over k + 1 query rows where plain decoding runs the decode kernel, and bf16
// arithmetic may then move a near tie). Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvq/cache/device_kv_cache.h"
#include "kvq/engine/generator.h"
#include "kvq/engine/speculative.h"
#include "kvq/model/cuda_model.h"
#include "kvq/plan/speculative_config.h"
#include "kvq/tokenizer/tokenizer.h"
#include "support/source_dir.h"

namespace kvq {
namespace {

const std::string kTiny = ::kvq::test::source_dir() + "/models/kvq-code-tiny";
const std::string kDraft = ::kvq::test::source_dir() + "/models/kvq-code-tiny-draft";
const std::string kDflash = ::kvq::test::source_dir() + "/models/kvq-code-tiny-dflash";

CudaModelOptions options(bool graphs = true) {
  CudaModelOptions o;
  o.cuda_graphs = graphs;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 512;
  o.gpu_memory_utilization = 0.4f;
  return o;
}

KvPlanOptions flags(KvDtype kv) {
  KvPlanOptions o;
  o.kv = DtypeFlag{kv, "--kv-cache-dtype " + std::string(traits(kv).name)};
  return o;
}

class CudaSpeculation : public ::testing::TestWithParam<KvDtype> {};

TEST_P(CudaSpeculation, GreedyIdsEqualPlainGreedyUpToNearTies) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!std::filesystem::exists(kDraft + "/model.safetensors")) GTEST_SKIP() << kDraft << " absent";
  if (!std::filesystem::exists(kDflash + "/model.safetensors"))
    GTEST_SKIP() << kDflash << " absent";
  const KvDtype kv = GetParam();
  const KvPlan plan = make_kv_plan(load_model_config(kTiny), flags(kv));
  std::shared_ptr<const Model> target = CudaModel::load(plan, options());
  // Plain greedy with graphs off: decode steps replayed from graphs must give the same ids, also
  // across generate() calls that each make a cache of another size.
  std::shared_ptr<const Model> eager = CudaModel::load(plan, options(false));
  SpeculativeConfig sc;
  sc.method = SpecMethod::kDraftModel;
  sc.model = kDraft;
  const KvPlan dplan = make_drafter_kv_plan(load_model_config(kDraft), flags(kv), sc);
  std::shared_ptr<const Model> drafter = CudaModel::load(dplan, options());
  for (const auto& l : drafter->plan().layers) EXPECT_EQ(l.k_dtype, kv);
  // The block-diffusion drafter on the target's device, its non-causal layers quantized alike.
  sc.method = SpecMethod::kDflash;
  sc.model = kDflash;
  std::shared_ptr<const Model> dflash = CudaModel::load_dflash_drafter(
      make_drafter_kv_plan(load_model_config(kDflash), flags(kv), sc), *target, options());
  for (const auto& l : dflash->plan().layers) {
    EXPECT_EQ(l.k_dtype, kv);
    EXPECT_EQ(l.attention, AttentionKind::kNonCausal);
  }
  const Tokenizer tok = Tokenizer::load(kTiny);
  std::ifstream f(kTiny + "/heldout.txt");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> ids = tok.encode(text.substr(0, 40000), false);
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 48;
  p.ignore_eos = true;
  int compared = 0, identical = 0, near_ties = 0;
  SpecCounters total, by_method[3];
  const char* names[3] = {"ngram", "draft_model", "dflash"};
  for (int method = 0; method < 3; ++method) {
    for (int k : {2, 4, 8}) {
      std::unique_ptr<Proposer> proposer = method == 0   ? make_ngram_proposer(1, 3)
                                           : method == 1 ? make_draft_model_proposer(drafter, 64)
                                                         : make_dflash_proposer(dflash, 64);
      GeneratorOptions o;
      o.proposer = proposer.get();
      o.num_speculative_tokens = k;
      for (int t = 0; t < 3; ++t) {
        const size_t at = std::uniform_int_distribution<size_t>(0, ids.size() - 200)(rng);
        const std::vector<int32_t> prompt(
            ids.begin() + static_cast<std::ptrdiff_t>(at),
            ids.begin() + static_cast<std::ptrdiff_t>(at) + 40 + t * 50);
        const GenerationResult want = generate(*target, tok, prompt, p, {});
        EXPECT_EQ(generate(*eager, tok, prompt, p, {}).output_ids, want.output_ids)
            << "plain greedy differs with graphs off; seed " << seed;
        const GenerationResult got = generate(*target, tok, prompt, p, o);
        total.add(got.spec);
        by_method[method].add(got.spec);
        ++compared;
        ASSERT_EQ(got.output_ids.size(), want.output_ids.size());
        size_t n = 0;
        while (n < want.output_ids.size() && want.output_ids[n] == got.output_ids[n]) ++n;
        if (n == want.output_ids.size()) {
          ++identical;
          continue;
        }
        // Where they part, the plain path's logits of the two tokens must be a near tie.
        std::vector<int32_t> prefix = prompt;
        prefix.insert(prefix.end(), want.output_ids.begin(),
                      want.output_ids.begin() + static_cast<std::ptrdiff_t>(n));
        std::vector<float> last;
        score_tokens(*target, prefix, 512, [&](int32_t pos, std::span<const float> l) {
          if (pos + 1 == static_cast<int32_t>(prefix.size())) last.assign(l.begin(), l.end());
        });
        const float a = last[static_cast<size_t>(want.output_ids[n])];
        const float b = last[static_cast<size_t>(got.output_ids[n])];
        std::fprintf(stderr, "note: %s k=%d parts at token %zu, logits %g vs %g\n", names[method],
                     k, n, a, b);
        EXPECT_LE(std::abs(a - b), 0.08f * (1.0f + std::abs(a))) << "not a near tie; seed " << seed;
        ++near_ties;
      }
    }
  }
  std::fprintf(stderr,
               "%s: %d/%d identical, %d near ties; drafted %lld accepted %lld, mean accepted "
               "length %.2f\n",
               traits(kv).name.data(), identical, compared, near_ties,
               static_cast<long long>(total.drafted), static_cast<long long>(total.accepted),
               total.mean_accepted_length());
  EXPECT_GT(identical, 0) << "seed " << seed;
  for (int m = 0; m < 3; ++m) {
    std::fprintf(stderr, "  %s: mean accepted length %.2f\n", names[m],
                 by_method[m].mean_accepted_length());
    EXPECT_GT(by_method[m].accepted, 0) << names[m] << " never helped; seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, CudaSpeculation,
                         ::testing::Values(KvDtype::kBFloat16, KvDtype::kFp8E4M3,
                                           KvDtype::kInt8PerTokenHead, KvDtype::kInt4PerTokenHead),
                         [](const auto& param_info) {
                           return std::string(traits(param_info.param).name);
                         });

}  // namespace
}  // namespace kvq
