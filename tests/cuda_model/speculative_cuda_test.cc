// Speculative decoding on the GPU: greedy speculation (ngram, draft_model and dflash, the
// drafters on the GPU with their own device caches, quantized like the target) gives the ids of
// plain greedy decoding with the same CUDA model, up to near ties (the verification pass runs the
// prefill attention over k + 1 query rows where plain decoding runs the decode kernel, and bf16
// arithmetic may then move a near tie). Skips without a CUDA device.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "kvq/cache/device_kv_cache.h"
#include "kvq/engine/generator.h"
#include "kvq/engine/llm_engine.h"
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

// The first 40,000 characters of the default model's held-out text, tokenized.
std::vector<int32_t> heldout_ids(const Tokenizer& tok) {
  std::ifstream f(kTiny + "/heldout.txt");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return tok.encode(text.substr(0, 40000), false);
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
  const std::vector<int32_t> ids = heldout_ids(tok);
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

// The CUDA greedy chain (the first pass, then one-token passes advanced on the device and
// replayed from one graph) gives the ids of the base class's pass-by-pass chain
// (forward_sample per pass), bit for bit, deferred or not; over several sequences, first passes
// of many tokens and of one, across block boundaries, on fresh caches of the same plan.
TEST(CudaGreedyChain, EqualsPassByPassGreedy) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!std::filesystem::exists(kDraft + "/model.safetensors")) GTEST_SKIP() << kDraft << " absent";
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  SpeculativeConfig sc;
  sc.method = SpecMethod::kDraftModel;
  sc.model = kDraft;
  const KvPlan plan =
      make_drafter_kv_plan(load_model_config(kDraft), flags(KvDtype::kInt8PerTokenHead), sc);
  const std::unique_ptr<CudaModel> model = CudaModel::load(plan, options());
  const int vocab = model->vocab_size();
  const int S = 3;
  // The three ways, each on its own cache: 0 chain, 1 deferred chain, 2 pass by pass.
  std::unique_ptr<PagedKvCache> caches[3];
  for (auto& c : caches) {
    c = model->create_cache(64);
    for (int i = 0; i < S; ++i) c->add_sequence(static_cast<SequenceId>(i));
  }
  std::vector<std::vector<int32_t>> run(S);  // each sequence's tokens for the next first pass
  std::vector<int32_t> len(S, 0);            // tokens in the cache
  for (int i = 0; i < S; ++i)
    for (int t = std::uniform_int_distribution<int>(5, 40)(rng); t > 0; --t)
      run[static_cast<size_t>(i)].push_back(std::uniform_int_distribution<int>(0, vocab - 1)(rng));
  for (int round = 0; round < 4; ++round) {
    const int steps = round == 0 ? 5 : 3 + round;
    std::vector<int32_t> out[3];
    for (int way = 0; way < 3; ++way) {
      PagedKvCache& cache = *caches[way];
      std::vector<int32_t> tokens, positions, q_indptr{0}, rows;
      std::vector<int64_t> slots, next_slots(static_cast<size_t>((steps - 1) * S));
      std::vector<SequenceId> ids;
      for (int i = 0; i < S; ++i) {
        const auto& r = run[static_cast<size_t>(i)];
        const std::vector<int64_t> got =
            cache.append(static_cast<SequenceId>(i), static_cast<int32_t>(r.size()) + steps - 1);
        ASSERT_EQ(got.size(), r.size() + static_cast<size_t>(steps - 1));
        slots.insert(slots.end(), got.begin(), got.begin() + static_cast<std::ptrdiff_t>(r.size()));
        for (int j = 1; j < steps; ++j)
          next_slots[static_cast<size_t>((j - 1) * S + i)] =
              got[r.size() + static_cast<size_t>(j - 1)];
        tokens.insert(tokens.end(), r.begin(), r.end());
        for (size_t t = 0; t < r.size(); ++t)
          positions.push_back(len[static_cast<size_t>(i)] + static_cast<int32_t>(t));
        q_indptr.push_back(static_cast<int32_t>(tokens.size()));
        rows.push_back(static_cast<int32_t>(tokens.size()) - 1);
        ids.push_back(static_cast<SequenceId>(i));
      }
      PagedKvCache::BlockTableStorage storage;
      const ForwardBatch b{tokens, positions, q_indptr, slots, cache.block_table(ids, storage),
                           rows};
      for (int32_t& l : storage.seq_lens) l -= steps - 1;
      out[way].resize(static_cast<size_t>(steps * S));
      if (way == 0) {
        model->forward_greedy_chain(b, cache, steps, next_slots, out[way]);
      } else if (way == 1) {
        model->forward_greedy_chain(b, cache, steps, next_slots, {}, true);
        model->collect_sampled(out[way]);
      } else {
        model->Model::forward_greedy_chain(b, cache, steps, next_slots, out[way]);
      }
    }
    EXPECT_EQ(out[0], out[2]) << "round " << round << ", seed " << seed;
    EXPECT_EQ(out[1], out[2]) << "round " << round << ", seed " << seed;
    // Next round: the last pass's ids are the one new token of each sequence (a first pass of
    // one token per sequence); in round 2, a few more tokens for sequence 0.
    for (int i = 0; i < S; ++i) {
      len[static_cast<size_t>(i)] +=
          static_cast<int32_t>(run[static_cast<size_t>(i)].size()) + steps - 1;
      run[static_cast<size_t>(i)] = {out[2][static_cast<size_t>((steps - 1) * S + i)]};
    }
    if (round == 1) run[0].insert(run[0].end(), {1, 2, 3});
  }
}

// A draft model's drafts left on the device (for a target that reads them there) are, once
// collected, the drafts it gives on the host: several sequences with different k, their rows
// interleaved pass by pass, across rollbacks.
TEST(CudaDraftModelProposer, DraftsOnTheDeviceEqualDraftsOnTheHost) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!std::filesystem::exists(kDraft + "/model.safetensors")) GTEST_SKIP() << kDraft << " absent";
  const KvDtype kv = KvDtype::kFp8E4M3;
  const std::unique_ptr<CudaModel> target =
      CudaModel::load(make_kv_plan(load_model_config(kTiny), flags(kv)), options());
  SpeculativeConfig sc;
  sc.method = SpecMethod::kDraftModel;
  sc.model = kDraft;
  std::shared_ptr<const Model> drafter =
      CudaModel::load(make_drafter_kv_plan(load_model_config(kDraft), flags(kv), sc), options());
  ASSERT_TRUE(target->accepts_tokens_from(*drafter));
  const std::unique_ptr<Proposer> on_device = make_draft_model_proposer(drafter, 64);
  const std::unique_ptr<Proposer> on_host = make_draft_model_proposer(drafter, 64);
  const Tokenizer tok = Tokenizer::load(kTiny);
  const std::vector<int32_t> ids = heldout_ids(tok);
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> seqs;
  for (int i = 0; i < 3; ++i) {
    const size_t at = std::uniform_int_distribution<size_t>(0, ids.size() - 200)(rng);
    seqs.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(at),
                      ids.begin() + static_cast<std::ptrdiff_t>(at) + 20 + 15 * i);
  }
  SamplingParams p;
  p.temperature = 0.0f;
  std::vector<Sampler> samplers(seqs.size(), Sampler(p));
  for (int round = 0; round < 3; ++round) {
    std::vector<DraftRequest> device_requests, host_requests;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int32_t k = 4 - static_cast<int32_t>((i + static_cast<size_t>(round)) % 3);
      device_requests.push_back({i + 1, seqs[i], k, &samplers[i], target.get()});
      host_requests.push_back({i + 1, seqs[i], k, &samplers[i]});
    }
    std::vector<Draft> got(seqs.size()), want(seqs.size());
    on_device->propose(device_requests, got);
    ASSERT_EQ(on_device->token_source(), drafter.get());
    std::vector<Draft*> pending;
    for (Draft& d : got) {
      EXPECT_TRUE(d.on_device);
      pending.push_back(&d);
    }
    on_device->collect(pending);
    EXPECT_EQ(on_device->token_source(), nullptr);
    on_host->propose(host_requests, want);
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_FALSE(want[i].on_device);
      EXPECT_EQ(got[i].tokens, want[i].tokens)
          << "round " << round << ", sequence " << i << ", seed " << seed;
      const size_t accept = std::min(want[i].tokens.size(), static_cast<size_t>(round));
      seqs[i].insert(seqs[i].end(), want[i].tokens.begin(),
                     want[i].tokens.begin() + static_cast<std::ptrdiff_t>(accept));
      seqs[i].push_back(std::uniform_int_distribution<int32_t>(3, 200)(rng));
    }
  }
}

// Token ids and final events of an engine's requests, waited for on the test thread.
class Outputs {
 public:
  OutputCallback callback() {
    return [this](const RequestOutput& o) {
      std::lock_guard lock(mu_);
      auto& ids = ids_[o.id];
      ids.insert(ids.end(), o.token_ids.begin(), o.token_ids.end());
      if (o.finished) {
        ++finished_;
        cv_.notify_all();
      }
    };
  }
  bool wait(int finished) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::minutes(2), [&] { return finished_ >= finished; });
  }
  std::vector<int32_t> ids(RequestId id) {
    std::lock_guard lock(mu_);
    return ids_[id];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<RequestId, std::vector<int32_t>> ids_;
  int finished_ = 0;
};

// Drafts left on the drafter's device for the verification to read there
// (EngineConfig::speculative_drafts_on_device) give the ids of drafts brought to the host first,
// bit for bit: requests one at a time run the same kernels on the same inputs either way. Then
// a concurrent batch (several sequences' drafts in one pass, their rows interleaved for the
// draft model's chain) matches the one-at-a-time ids up to near ties, and frees every block.
TEST(CudaEngineSpeculation, DraftsOnTheDeviceGiveTheIdsOfDraftsOnTheHost) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!std::filesystem::exists(kDraft + "/model.safetensors")) GTEST_SKIP() << kDraft << " absent";
  if (!std::filesystem::exists(kDflash + "/model.safetensors"))
    GTEST_SKIP() << kDflash << " absent";
  const Tokenizer tok = Tokenizer::load(kTiny);
  const std::vector<int32_t> ids = heldout_ids(tok);
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 5; ++i) {
    const size_t at = std::uniform_int_distribution<size_t>(0, ids.size() - 200)(rng);
    const size_t n = std::uniform_int_distribution<size_t>(20, 150)(rng);
    prompts.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(at),
                         ids.begin() + static_cast<std::ptrdiff_t>(at + n));
  }
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 40;
  p.ignore_eos = true;
  const KvDtype kv = KvDtype::kFp8E4M3;
  const KvPlan plan = make_kv_plan(load_model_config(kTiny), flags(kv));
  for (SpecMethod method : {SpecMethod::kDraftModel, SpecMethod::kDflash}) {
    SpeculativeConfig sc;
    sc.method = method;
    sc.model = method == SpecMethod::kDflash ? kDflash : kDraft;
    const KvPlan dplan = make_drafter_kv_plan(load_model_config(sc.model), flags(kv), sc);
    std::vector<std::vector<int32_t>> solo[2];
    for (int on = 0; on < 2; ++on) {
      std::unique_ptr<Model> target = CudaModel::load(plan, options());
      std::shared_ptr<const Model> drafter =
          method == SpecMethod::kDflash
              ? std::shared_ptr<const Model>(
                    CudaModel::load_dflash_drafter(dplan, *target, options()))
              : std::shared_ptr<const Model>(CudaModel::load(dplan, options()));
      EngineConfig c;
      c.num_blocks = 256;
      c.max_num_seqs = 8;
      c.max_num_batched_tokens = 512;
      c.num_speculative_tokens = method == SpecMethod::kDflash ? 8 : 4;
      c.proposer = method == SpecMethod::kDflash
                       ? std::shared_ptr<Proposer>(make_dflash_proposer(drafter, 256))
                       : std::shared_ptr<Proposer>(make_draft_model_proposer(drafter, 256));
      c.speculative_drafts_on_device = on == 1;
      // The concurrent batch repeats the prompts: no prefix-cache hits (a DFlash drafter has no
      // features for cached positions, so it would draft nothing).
      c.enable_prefix_caching = false;
      Outputs out;
      LlmEngine engine(std::move(target), std::make_unique<Tokenizer>(Tokenizer::load(kTiny)), c);
      int finished = 0;
      for (const auto& prompt : prompts) {
        const RequestId id = engine.add_request(prompt, p, out.callback());
        ASSERT_TRUE(out.wait(++finished)) << "seed " << seed;
        solo[on].push_back(out.ids(id));
      }
      const EngineStats one = engine.stats();
      EXPECT_GT(one.spec.accepted, 0) << "seed " << seed;
      if (on == 0) continue;
      // Concurrently, drafts on the device.
      std::vector<RequestId> batch;
      for (const auto& prompt : prompts)
        batch.push_back(engine.add_request(prompt, p, out.callback()));
      ASSERT_TRUE(out.wait(finished + static_cast<int>(prompts.size()))) << "seed " << seed;
      std::unique_ptr<Model> scorer = CudaModel::load(plan, options());
      int near_ties = 0;
      for (size_t i = 0; i < prompts.size(); ++i) {
        const std::vector<int32_t> got = out.ids(batch[i]), want = solo[1][i];
        ASSERT_EQ(got.size(), want.size());
        size_t n = 0;
        while (n < want.size() && want[n] == got[n]) ++n;
        if (n == want.size()) continue;
        std::vector<int32_t> prefix = prompts[i];
        prefix.insert(prefix.end(), want.begin(), want.begin() + static_cast<std::ptrdiff_t>(n));
        std::vector<float> last;
        score_tokens(*scorer, prefix, 512, [&](int32_t pos, std::span<const float> l) {
          if (pos + 1 == static_cast<int32_t>(prefix.size())) last.assign(l.begin(), l.end());
        });
        const float a = last[static_cast<size_t>(want[n])], b = last[static_cast<size_t>(got[n])];
        EXPECT_LE(std::abs(a - b), 0.08f * (1.0f + std::abs(a)))
            << to_string(method) << " request " << i << " parts at " << n
            << ", not a near tie; seed " << seed;
        ++near_ties;
      }
      EXPECT_LE(near_ties, 2) << "seed " << seed;
      const EngineStats all = engine.stats();
      EXPECT_GT(all.spec.accepted, one.spec.accepted);
      EXPECT_EQ(all.blocks_used, 0) << "blocks still held after every request ended";
    }
    for (size_t i = 0; i < prompts.size(); ++i)
      EXPECT_EQ(solo[1][i], solo[0][i]) << to_string(method) << " request " << i
                                        << ": drafts on the device changed the ids; seed " << seed;
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
