// kvq bench: offline batch throughput. A batch of random prompts is prefilled (packed into steps
// of at most --max-num-batched-tokens tokens), then every sequence decodes --output-len tokens
// greedily, all sequences in every step (EOS ignored). Prints prefill tokens/s, decode tokens/s,
// ms per decode step, the KV capacity and the device memory use; --json for scripts.
//
// --prefill-sequences K < --batch prefills only K sequences for real and copies their cache
// blocks to the others (the copies hold exactly the K/V the model computed for the same prompt),
// so a large batch at a long context can be measured without minutes of prefill; the prefill
// rate is then measured on the K real ones.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "kvq/core/error.h"
#include "kvq/core/log.h"
#include "kvq/engine/llm_engine.h"
#include "kvq/model/cuda_model.h"
#include "kvq/plan/tensor_parallel.h"
#include "model_flags.h"
#ifdef KVQ_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kvq::cli {

namespace {

using Clock = std::chrono::steady_clock;

// Passes of the speculative bench's workload; the last is timed (see run() below).
constexpr int kSpecBenchPasses = 3;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Device-to-device copy bandwidth (bytes read + written per second), the decode floor's
// denominator; 0 when not on a CUDA device.
double measure_copy_bandwidth() {
#ifdef KVQ_WITH_CUDA
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess) return 0.0;
  if (cudaMalloc(&b, bytes) != cudaSuccess) {
    (void)cudaFree(a);
    return 0.0;
  }
  (void)cudaMemset(a, 1, bytes);
  cudaEvent_t e0, e1;
  (void)cudaEventCreate(&e0);
  (void)cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    (void)cudaEventRecord(e0);
    (void)cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice);
    (void)cudaEventRecord(e1);
    (void)cudaEventSynchronize(e1);
    float t = 0;
    (void)cudaEventElapsedTime(&t, e0, e1);
    if (i >= 2) ms.push_back(t);
  }
  (void)cudaEventDestroy(e0);
  (void)cudaEventDestroy(e1);
  (void)cudaFree(a);
  (void)cudaFree(b);
  if (cudaGetLastError() != cudaSuccess || ms.empty()) return 0.0;
  std::sort(ms.begin(), ms.end());
  return 2.0 * static_cast<double>(bytes) / (ms[ms.size() / 2] * 1e-3);
#else
  return 0.0;
#endif
}

struct Step {
  std::vector<int32_t> tokens, positions, q_indptr{0}, logit_rows;
  std::vector<int64_t> slots;
  std::vector<SequenceId> ids;
};

// Next token of every logit row: sampled on the device for a CUDA model (greedy), else the
// host argmax of the logits.
void run_step(const Model& model, PagedKvCache& cache, const Step& s, std::vector<int32_t>& next) {
  PagedKvCache::BlockTableStorage storage;
  ForwardBatch b;
  b.tokens = s.tokens;
  b.positions = s.positions;
  b.q_indptr = s.q_indptr;
  b.slots = s.slots;
  b.block_table = cache.block_table(s.ids, storage);
  b.logit_rows = s.logit_rows;
  next.assign(s.logit_rows.size(), 0);
#ifdef KVQ_WITH_CUDA
  if (const auto* cm = dynamic_cast<const CudaModel*>(&model)) {
    const DeviceSampling greedy;
    cm->forward_sample(b, cache, std::span<const DeviceSampling>(&greedy, 1), next);
    return;
  }
#endif
  const size_t vocab = static_cast<size_t>(model.vocab_size());
  std::vector<float> logits(s.logit_rows.size() * vocab);
  model.forward(b, cache, logits);
  for (size_t r = 0; r < s.logit_rows.size(); ++r) {
    const float* row = logits.data() + r * vocab;
    next[r] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
  }
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// kvq bench --speculative-config: the same greedy workload (B prompts cut from --dataset, each
// generating --output-len tokens, EOS ignored) through LlmEngine twice, plain and speculative,
// in one process on the same weights; tokens/s of both, the speedup, and the acceptance.
int speculative_bench(const ModelFlags& flags, const std::string& dataset, int B, int N, int L,
                      int M, int64_t seed, bool json) {
  if (dataset.empty())
    throw InputError(
        "--speculative-config in kvq bench needs --dataset FILE (a text file the "
        "prompts are cut from: drafts of random tokens are never accepted)");
  if (!flags.plan.synthetic.empty())
    throw InputError(
        "--speculative-config in kvq bench needs --model (a real model and its "
        "tokenizer), not --synthetic; --verify-tokens times verification steps there");
  std::ifstream f(dataset, std::ios::binary);
  if (!f) throw InputError("--dataset: cannot read '" + dataset + "'");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  LoadedModel lm = flags.load();
  const std::optional<Speculation> spec = flags.load_speculation(*lm.model, *lm.tokenizer);
  const std::vector<int32_t> ids = lm.tokenizer->encode(text, /*add_special_tokens=*/false);
  if (static_cast<int64_t>(ids.size()) < static_cast<int64_t>(L) + 1)
    throw InputError("--dataset: '" + dataset + "' has " + std::to_string(ids.size()) +
                     " tokens, fewer than --input-len " + std::to_string(L));
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  std::uniform_int_distribution<size_t> at(0, ids.size() - static_cast<size_t>(L));
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(std::max(N, B)));
  for (auto& p : prompts) {
    const size_t a = at(rng);
    p.assign(ids.begin() + static_cast<std::ptrdiff_t>(a),
             ids.begin() + static_cast<std::ptrdiff_t>(a + static_cast<size_t>(L)));
  }
  const int32_t bt = lm.model->plan().layers.front().block_tokens;
  const int k = spec->config.num_speculative_tokens;
  const int64_t per_seq = (static_cast<int64_t>(L) + M + k + 1 + bt - 1) / bt;
  const int64_t num_blocks = per_seq * B + B;  // B sequences at a time (max_num_seqs = B)

  struct Run {
    double seconds = 0.0;
    int64_t tokens = 0;
    SpecCounters spec;
    int64_t steps = 0;             // engine steps of the timed pass
    double draft_seconds = 0.0;    // of which drafting
    double forward_seconds = 0.0;  // and the target's forward pass with verification
    int64_t skipped = 0;           // steps that auto_disable ran without drafts
    std::vector<std::vector<int32_t>> outputs;
  };
  auto run = [&](bool speculate) {
    EngineConfig config;
    config.num_blocks = num_blocks;
    config.max_num_seqs = B;
    config.max_num_batched_tokens = std::max(flags.max_num_batched_tokens, B * (k + 1));
    config.enable_prefix_caching = false;
    if (speculate) {
      config.proposer =
          spec->proposer(static_cast<int32_t>(num_blocks), flags.max_num_batched_tokens);
      config.num_speculative_tokens = k;
      config.speculative_disable_by_batch_size = spec->config.disable_by_batch_size;
      config.speculative_auto_disable = spec->config.auto_disable;
    }
    // Prefix caching is off, so every pass computes everything again.
    LlmEngine engine(lm.model->with_plan(lm.model->plan(), flags.attention_backend),
                     std::make_unique<Tokenizer>(Tokenizer::load(flags.plan.model)), config);
    Run r;
    r.outputs.resize(prompts.size());
    std::mutex mu;
    std::condition_variable cv;
    size_t finished = 0;
    SamplingParams p;
    p.temperature = 0.0f;
    p.max_tokens = M;
    p.ignore_eos = true;
    // The whole workload runs three times; the last pass is timed. A step shape (batch bucket,
    // Q bucket, context bucket) runs eagerly the first time it is seen and is captured as a
    // CUDA graph the second time, so a shape met once in pass 1 (as sequences finish, batches
    // shrink; near max_tokens, k does) would be captured inside a second, timed pass; two
    // warm-up passes leave every shape captured and every GEMM picked, as in a long-running
    // server.
    SpecCounters before;
    EngineStats before_stats;
    Clock::time_point t0;
    for (int pass = 0; pass < kSpecBenchPasses; ++pass) {
      for (auto& o : r.outputs) o.clear();
      finished = 0;
      before_stats = engine.stats();
      before = before_stats.spec;
      t0 = Clock::now();
      // All at once: the engine's first step sees every prompt in every pass, so the passes
      // run the same step shapes (one by one, the first steps' batches followed the threads'
      // timing, and a shape new in the timed pass paid its graph capture there).
      std::vector<LlmEngine::NewRequest> batch;
      for (size_t i = 0; i < prompts.size(); ++i)
        batch.push_back({prompts[i], p, [&, i](const RequestOutput& o) {
                           std::lock_guard lock(mu);
                           r.outputs[i].insert(r.outputs[i].end(), o.token_ids.begin(),
                                               o.token_ids.end());
                           if (o.finished) {
                             ++finished;
                             cv.notify_all();
                           }
                         }});
      engine.add_requests(std::move(batch));
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return finished == prompts.size(); });
    }
    r.seconds = seconds_since(t0);
    for (const auto& o : r.outputs) r.tokens += static_cast<int64_t>(o.size());
    const EngineStats after = engine.stats();
    r.steps = after.steps - before_stats.steps;
    r.draft_seconds = after.draft_seconds - before_stats.draft_seconds;
    r.forward_seconds = after.forward_seconds - before_stats.forward_seconds;
    r.skipped = after.spec_steps_skipped - before_stats.spec_steps_skipped;
    r.spec = after.spec;
    r.spec.drafted -= before.drafted;
    r.spec.accepted -= before.accepted;
    r.spec.verify_steps -= before.verify_steps;
    r.spec.emitted -= before.emitted;
    return r;
  };
  const Run plain = run(false);
  const Run specd = run(true);
  int same = 0;
  for (size_t i = 0; i < prompts.size(); ++i) same += plain.outputs[i] == specd.outputs[i];
  const double plain_tps = plain.tokens / plain.seconds, spec_tps = specd.tokens / specd.seconds;
  nlohmann::json j;
  j["model"] = flags.plan.model;
  j["device"] = flags.device;
  j["plan"] = summarize_kv_plan(lm.model->plan());
  j["speculative"] = spec->summary();
  j["method"] = to_string(spec->config.method);
  j["num_speculative_tokens"] = k;
  j["dataset"] = dataset;
  j["batch"] = B;
  j["num_prompts"] = prompts.size();
  j["timed_pass"] = kSpecBenchPasses;  // earlier passes warm up (graphs, GEMM choices)
  j["input_len"] = L;
  j["output_len"] = M;
  j["plain_tokens_per_s"] = plain_tps;
  j["speculative_tokens_per_s"] = spec_tps;
  j["speedup"] = spec_tps / plain_tps;
  j["drafted"] = specd.spec.drafted;
  j["accepted"] = specd.spec.accepted;
  j["verify_steps"] = specd.spec.verify_steps;
  j["acceptance_rate"] = specd.spec.acceptance_rate();
  j["mean_accepted_length"] = specd.spec.mean_accepted_length();
  j["greedy_outputs_identical"] = same;
  // Where a step's time goes (ms per engine step of the timed pass): drafting, the target's
  // forward pass (verification included), and the rest (scheduling, callbacks, waiting).
  auto per_step = [](const Run& r, double s) { return r.steps > 0 ? 1e3 * s / r.steps : 0.0; };
  j["plain_steps"] = plain.steps;
  j["plain_ms_per_step"] = per_step(plain, plain.seconds);
  j["plain_forward_ms_per_step"] = per_step(plain, plain.forward_seconds);
  j["spec_steps"] = specd.steps;
  j["spec_ms_per_step"] = per_step(specd, specd.seconds);
  j["spec_draft_ms_per_step"] = per_step(specd, specd.draft_seconds);
  j["spec_forward_ms_per_step"] = per_step(specd, specd.forward_seconds);
  j["auto_disable"] = spec->config.auto_disable;
  j["spec_steps_without_drafts"] = specd.skipped;
  if (json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf("model: %s on %s | KV plan: %s\nspeculative: %s\n", flags.plan.model.c_str(),
              flags.device.c_str(), j["plan"].get<std::string>().c_str(), spec->summary().c_str());
  std::printf("%zu prompts of %d tokens from %s, %d at a time, %d generated each (greedy)\n",
              prompts.size(), L, dataset.c_str(), B, M);
  std::printf("plain:       %.1f tokens/s (%.2f s)\n", plain_tps, plain.seconds);
  std::printf("speculative: %.1f tokens/s (%.2f s), speedup %.2fx\n", spec_tps, specd.seconds,
              spec_tps / plain_tps);
  std::printf(
      "drafted %lld, accepted %lld (%.1f%%), mean accepted length %.2f tokens per verify "
      "step; greedy outputs identical %d/%d\n",
      static_cast<long long>(specd.spec.drafted), static_cast<long long>(specd.spec.accepted),
      100.0 * specd.spec.acceptance_rate(), specd.spec.mean_accepted_length(), same,
      static_cast<int>(prompts.size()));
  std::printf(
      "per engine step: plain %.3f ms (forward %.3f) over %lld steps; speculative %.3f ms "
      "(drafting %.3f, forward and verification %.3f) over %lld steps, %lld of them "
      "without drafts (auto_disable)\n",
      per_step(plain, plain.seconds), per_step(plain, plain.forward_seconds),
      static_cast<long long>(plain.steps), per_step(specd, specd.seconds),
      per_step(specd, specd.draft_seconds), per_step(specd, specd.forward_seconds),
      static_cast<long long>(specd.steps), static_cast<long long>(specd.skipped));
  return 0;
}

}  // namespace

Action add_bench_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "bench", "offline batch throughput: prefill a batch of random prompts, then decode");
  struct State {
    ModelFlags model;
    int batch = 1;
    int input_len = 512;
    int output_len = 128;
    int prefill_sequences = 0;
    int64_t seed = 0;
    bool json = false;
    int verify_tokens = 0;
    int num_prompts = 0;
    std::string dataset;
  };
  auto st = std::make_shared<State>();
  st->model.add_to(*sub, /*with_synthetic=*/true);
  st->model.plan.add_speculative_to(*sub);
  sub->add_option("--dataset", st->dataset,
                  "with --speculative-config: a text file the prompts are cut from (speculation "
                  "needs real text; random tokens are never accepted)");
  sub->add_option("--num-prompts", st->num_prompts,
                  "with --speculative-config: prompts run, --batch at a time (default: --batch)")
      ->check(CLI::Range(0, 1 << 16));
  sub->add_option("--verify-tokens", st->verify_tokens,
                  "time verification steps: each decode step runs 1 + N query tokens per sequence "
                  "(random drafts, all rows sampled, the N rolled back) instead of 1 (default 0)")
      ->check(CLI::Range(0, kMaxSpeculativeTokens));
  sub->add_option("--batch", st->batch, "sequences decoded together (default 1)")
      ->check(CLI::Range(1, 1 << 16));
  sub->add_option("--input-len", st->input_len, "prompt tokens per sequence (default 512)")
      ->check(CLI::Range(1, 1 << 24));
  sub->add_option("--output-len", st->output_len,
                  "tokens generated per sequence, the first by the prefill (default 128)")
      ->check(CLI::Range(2, 1 << 24));
  sub->add_option("--prefill-sequences", st->prefill_sequences,
                  "prefill only this many sequences and copy their KV blocks to the rest "
                  "(default: all)")
      ->check(CLI::Range(0, 1 << 16));
  sub->add_option("--max-num-seqs", st->model.max_num_seqs,
                  "most sequences in one step (default 256)")
      ->check(CLI::Range(1, 4096));
  sub->add_option("--max-num-batched-tokens", st->model.max_num_batched_tokens,
                  "most new tokens in one prefill step (default 8192)")
      ->check(CLI::Range(16, 1 << 20));
  sub->add_option("--seed", st->seed, "seed of the random prompts (default 0)");
  sub->add_flag("--json", st->json, "print the results as JSON");
  return [st]() {
    if (!st->model.plan.speculative_config.empty())
      return speculative_bench(st->model, st->dataset, st->batch, st->num_prompts, st->input_len,
                               st->output_len, st->seed, st->json);
    if (!st->dataset.empty())
      throw InputError(
          "--dataset is for --speculative-config runs (the plain bench uses random "
          "prompts)");
    const int B = st->batch, L = st->input_len, M = st->output_len;
    const int V = st->verify_tokens;
    const int P = st->prefill_sequences == 0 ? B : st->prefill_sequences;
    if (P > B)
      throw InputError("--prefill-sequences " + std::to_string(P) + " exceeds --batch " +
                       std::to_string(B));
    if (P < B && st->model.device != "cuda")
      throw InputError("--prefill-sequences below --batch needs --device cuda");
    const KvPlan plan = st->model.make_plan(st->model.plan.options());
    for (const auto& w : plan.warnings) log_warning(w);
    const int32_t ctx = plan.model.max_position_embeddings;
    if (ctx > 0 && L + M > ctx)
      throw InputError("--input-len + --output-len = " + std::to_string(L + M) +
                       " tokens exceeds the model's context (" + std::to_string(ctx) + ")");
    const double bandwidth = st->model.device == "cuda" ? measure_copy_bandwidth() : 0.0;
    const auto t_load = Clock::now();
    const std::unique_ptr<Model> model = st->model.load_model(plan);
    const double load_s = seconds_since(t_load);

    const int32_t bt = plan.layers.front().block_tokens;
    const int64_t per_seq = (static_cast<int64_t>(L) + M + V + bt - 1) / bt;
    int64_t max_blocks = model->max_cache_blocks();
    if (max_blocks < 0 && !st->model.plan.kv_cache_memory.empty())
      max_blocks = blocks_for_budget(
          plan.layers, parse_byte_size(st->model.plan.kv_cache_memory, "--kv-cache-memory"));
    const int64_t largest_batch = max_blocks < 0 ? -1 : max_blocks / per_seq;
    if (largest_batch >= 0 && B > largest_batch)
      throw InputError("--batch " + std::to_string(B) + " at " + std::to_string(L + M) +
                       " tokens per sequence needs " + std::to_string(B * per_seq) +
                       " KV blocks; " + std::to_string(max_blocks) + " fit, so at most " +
                       std::to_string(largest_batch) +
                       " sequences (raise --gpu-memory-utilization or lower the batch or lengths)");
    // The memory picture before the cache takes its share (kv_budget is what is left).
    nlohmann::json mem = nullptr;
    size_t weight_bytes = 0;
#ifdef KVQ_WITH_CUDA
    if (const auto* cm = dynamic_cast<const CudaModel*>(model.get())) {
      const CudaMemoryReport r = cm->memory();
      weight_bytes = r.weights_read_per_step;
      mem = {{"device_total", r.device_total},
             {"free_at_load", r.free_at_load},
             {"weights", r.weights},
             {"weights_read_per_step", r.weights_read_per_step},
             {"weight_dtype", to_string(cm->weight_precision())},
             {"activations", r.activations},
             {"kv_budget", r.kv_budget}};
    }
#endif
    const std::unique_ptr<PagedKvCache> cache =
        model->create_cache(static_cast<int32_t>(B * per_seq));
    if (!mem.is_null()) mem["kv_allocated"] = cache->bytes_allocated();

    std::mt19937_64 rng(static_cast<uint64_t>(st->seed));
    std::uniform_int_distribution<int32_t> pick(0, model->vocab_size() - 1);
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(P));
    for (auto& p : prompts) {
      p.resize(static_cast<size_t>(L));
      for (auto& t : p) t = pick(rng);
    }

    // Warm-up (library handles, module loading): one short sequence, then freed.
    {
      Step w;
      const SequenceId wid = -1;
      cache->add_sequence(wid);
      w.ids = {wid};
      const int n = std::min(L, 16);
      w.slots = cache->append(wid, n);
      for (int i = 0; i < n; ++i) {
        w.tokens.push_back(prompts[0][static_cast<size_t>(i)]);
        w.positions.push_back(i);
      }
      w.q_indptr.push_back(n);
      w.logit_rows = {n - 1};
      std::vector<int32_t> next;
      run_step(*model, *cache, w, next);
      cache->free_sequence(wid);
    }

    // Prefill: sequences packed into steps of at most max_num_batched_tokens new tokens (a
    // prompt longer than that is split into chunks).
    const int budget = std::max(1, st->model.max_num_batched_tokens);
    std::vector<int32_t> last(static_cast<size_t>(B), 0);
    std::vector<int32_t> done(static_cast<size_t>(P), 0);
    for (int i = 0; i < P; ++i) cache->add_sequence(i);
    const auto t_prefill = Clock::now();
    int next_seq = 0;
    while (next_seq < P) {
      Step s;
      int room = budget;
      std::vector<int> finishing;
      while (next_seq < P && room > 0 && static_cast<int>(s.ids.size()) < st->model.max_num_seqs) {
        const int i = next_seq;
        const int n = std::min(room, L - done[static_cast<size_t>(i)]);
        const auto slots = cache->append(i, n);
        KVQ_CHECK(static_cast<int>(slots.size()) == n, "bench: the cache ran out of blocks");
        s.ids.push_back(i);
        for (int j = 0; j < n; ++j) {
          const int pos = done[static_cast<size_t>(i)] + j;
          s.tokens.push_back(prompts[static_cast<size_t>(i)][static_cast<size_t>(pos)]);
          s.positions.push_back(pos);
        }
        s.slots.insert(s.slots.end(), slots.begin(), slots.end());
        s.q_indptr.push_back(static_cast<int32_t>(s.tokens.size()));
        done[static_cast<size_t>(i)] += n;
        room -= n;
        if (done[static_cast<size_t>(i)] == L) {
          s.logit_rows.push_back(static_cast<int32_t>(s.tokens.size()) - 1);
          finishing.push_back(i);
          ++next_seq;
        }
      }
      std::vector<int32_t> next;
      run_step(*model, *cache, s, next);
      for (size_t r = 0; r < finishing.size(); ++r)
        last[static_cast<size_t>(finishing[r])] = next[r];
    }
    const double prefill_s = seconds_since(t_prefill);

    // The other sequences get copies of the prefilled ones' blocks.
    if (P < B) {
#ifdef KVQ_WITH_CUDA
      const auto* cm = dynamic_cast<const CudaModel*>(model.get());
      if (cm == nullptr) throw InputError("--prefill-sequences below --batch needs --device cuda");
      std::vector<std::pair<int32_t, int32_t>> pairs;
      for (int i = P; i < B; ++i) {
        cache->add_sequence(i);
        KVQ_CHECK(static_cast<int>(cache->append(i, L).size()) == L,
                  "bench: the cache ran out of blocks");
        const auto src = cache->blocks(i % P);
        const auto dst = cache->blocks(i);
        for (size_t k = 0; k < dst.size(); ++k) pairs.emplace_back(src[k], dst[k]);
        last[static_cast<size_t>(i)] = last[static_cast<size_t>(i % P)];
      }
      cm->copy_blocks(*cache, pairs);
#else
      throw InputError("--prefill-sequences below --batch needs --device cuda");
#endif
    }

    // Decode: every sequence in every step; the first two steps (graph capture) are not timed.
    std::vector<double> step_ms;
    Step d;
    for (int i = 0; i < B; ++i) d.ids.push_back(i);
    for (int step = 1; step < M; ++step) {
      d.tokens.clear();
      d.positions.clear();
      d.slots.clear();
      d.q_indptr.assign(1, 0);
      d.logit_rows.clear();
      for (int i = 0; i < B; ++i) {
        const auto slot = cache->append(i, 1 + V);
        KVQ_CHECK(slot.size() == static_cast<size_t>(1 + V), "bench: the cache ran out of blocks");
        d.tokens.push_back(last[static_cast<size_t>(i)]);
        for (int v = 0; v < V; ++v) d.tokens.push_back(pick(rng));
        for (int v = 0; v <= V; ++v) {
          d.positions.push_back(L + step - 1 + v);
          d.slots.push_back(slot[static_cast<size_t>(v)]);
          d.logit_rows.push_back(i * (1 + V) + v);
        }
        d.q_indptr.push_back((i + 1) * (1 + V));
      }
      const auto t0 = Clock::now();
      std::vector<int32_t> next;
      run_step(*model, *cache, d, next);
      step_ms.push_back(seconds_since(t0) * 1e3);
      for (int i = 0; i < B; ++i) {
        last[static_cast<size_t>(i)] = next[static_cast<size_t>(i * (1 + V))];
        if (V > 0) cache->truncate(i, L + step);  // the drafts are rolled back
      }
    }
    const size_t skip = step_ms.size() > 4 ? 2 : 0;
    std::vector<double> timed(step_ms.begin() + static_cast<std::ptrdiff_t>(skip), step_ms.end());
    const double decode_s = std::accumulate(timed.begin(), timed.end(), 0.0) / 1e3;
    std::vector<double> sorted = timed;
    std::sort(sorted.begin(), sorted.end());
    const double median_ms = sorted.empty() ? 0.0 : sorted[sorted.size() / 2];
    const double decode_tps = decode_s > 0 ? static_cast<double>(B) * timed.size() / decode_s : 0.0;
    const double prefill_tps = prefill_s > 0 ? static_cast<double>(P) * L / prefill_s : 0.0;

    // The decode floor: weights + the KV bytes a step reads (mean context of the timed steps)
    // over the measured copy bandwidth; per GPU under tensor parallelism (one rank's weights,
    // from the model's memory report, and one rank's kv heads).
    const int tp = st->model.tensor_parallel_size;
    const double kv_token_bytes = static_cast<double>(
        tp > 1 ? slice_kv_plan(plan, split_heads(plan.model, tp), 0).bytes_per_token()
               : plan.bytes_per_token());
    const double mean_ctx = L + (skip + 1 + static_cast<double>(step_ms.size())) / 2.0;
    const double kv_read = static_cast<double>(B) * mean_ctx * kv_token_bytes;
    const double floor_ms =
        bandwidth > 0 ? (static_cast<double>(weight_bytes) + kv_read) / bandwidth * 1e3 : 0.0;

    nlohmann::json j;
    j["model"] = st->model.plan.synthetic.empty() ? st->model.plan.model
                                                  : "synthetic " + st->model.plan.synthetic;
    j["device"] = st->model.device;
    j["plan"] = summarize_kv_plan(plan);
    j["kv_bytes_per_token"] = plan.bytes_per_token();
    j["batch"] = B;
    j["input_len"] = L;
    j["output_len"] = M;
    j["verify_tokens"] = V;
    j["prefill_sequences"] = P;
    j["load_seconds"] = load_s;
    j["prefill_tokens_per_s"] = prefill_tps;
    j["decode_tokens_per_s"] = decode_tps;
    j["decode_step_ms_mean"] = timed.empty() ? 0.0 : decode_s * 1e3 / timed.size();
    j["decode_step_ms_median"] = median_ms;
    j["kv_capacity_tokens"] = max_blocks < 0 ? -1 : max_blocks * bt;
    j["largest_batch"] = largest_batch;
    j["copy_bandwidth_bytes_per_s"] = bandwidth;
    j["decode_floor_ms"] = floor_ms;
    j["tensor_parallel_size"] = st->model.tensor_parallel_size;
    j["memory"] = mem;
    if (st->json) {
      std::cout << j.dump(2) << "\n";
      return 0;
    }
    std::printf("model: %s on %s | KV plan: %s\n", j["model"].get<std::string>().c_str(),
                st->model.device.c_str(), summarize_kv_plan(plan).c_str());
    std::printf(
        "batch %d, input %d, output %d tokens (%d prefilled for real)%s\n", B, L, M, P,
        V > 0
            ? (", verification steps of 1 + " + std::to_string(V) + " tokens per sequence").c_str()
            : "");
    std::printf("prefill: %.0f tokens/s (%.2f s)\n", prefill_tps, prefill_s);
    std::printf(
        "decode:  %.0f tokens/s, %.3f ms/step mean, %.3f ms/step median (%zu steps timed)\n",
        decode_tps, timed.empty() ? 0.0 : decode_s * 1e3 / timed.size(), median_ms, timed.size());
    if (floor_ms > 0)
      std::printf(
          "floor:   %.3f ms/step (%s weights + %s KV read at %.2f TB/s copy bandwidth); "
          "step / floor = %.2f\n",
          floor_ms, gib(static_cast<double>(weight_bytes)).c_str(), gib(kv_read).c_str(),
          bandwidth / 1e12, median_ms / floor_ms);
    if (max_blocks >= 0)
      std::printf("KV capacity: %lld tokens; largest batch at %d tokens per sequence: %lld\n",
                  static_cast<long long>(max_blocks * bt), L + M,
                  static_cast<long long>(largest_batch));
    if (!mem.is_null())
      std::printf(
          "memory: device %s, weights %s (%s), activations %s, KV allocated %s of %s budget\n",
          gib(mem["device_total"].get<double>()).c_str(), gib(mem["weights"].get<double>()).c_str(),
          mem["weight_dtype"].get<std::string>().c_str(),
          gib(mem["activations"].get<double>()).c_str(),
          gib(mem["kv_allocated"].get<double>()).c_str(),
          gib(mem["kv_budget"].get<double>()).c_str());
    return 0;
  };
}

}  // namespace kvq::cli
