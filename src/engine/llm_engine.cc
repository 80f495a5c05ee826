#include "kvq/engine/llm_engine.h"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>

#include "kv_block_manager.h"
#include "kvq/core/cpu_threads.h"
#include "kvq/core/error.h"
#include "kvq/engine/generator.h"
#include "text_stream.h"
#include "verify.h"

namespace kvq {

namespace {

struct Request {
  Request(RequestId rid, std::vector<int32_t> prompt, const SamplingParams& p,
          int32_t max_new_tokens, const Tokenizer& tokenizer, OutputCallback cb, bool logprobs,
          int top)
      : id(rid),
        tokens(std::move(prompt)),
        prompt_len(static_cast<int32_t>(tokens.size())),
        max_new(max_new_tokens),
        sampler(p),
        stream(tokenizer, p),
        on_output(std::move(cb)),
        want_logprobs(logprobs),
        top_logprobs(logprobs ? top : 0),
        speculate(p.speculate) {}

  RequestId id;
  std::vector<int32_t> tokens;  // the prompt, then every generated id
  int32_t prompt_len;
  int32_t max_new;  // max_tokens, capped by the context
  Sampler sampler;  // kept across preemption, so a seeded request draws the same numbers
  TextStream stream;
  OutputCallback on_output;
  bool want_logprobs;
  int top_logprobs;  // alternatives per token (with want_logprobs)
  bool speculate;
  Draft draft;        // this step's drafts (decoding sequences only)
  SpecCounters spec;  // this request's speculation so far

  int32_t computed = 0;  // tokens whose K/V are in the cache (while running)
  bool admitted_before = false;
  int32_t cached_prompt_tokens = 0;

  int32_t len() const { return static_cast<int32_t>(tokens.size()); }
  int32_t generated() const { return len() - prompt_len; }
  SequenceId seq() const { return static_cast<SequenceId>(id); }
};

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

struct LlmEngine::Impl {
  Impl(std::unique_ptr<Model> m, std::unique_ptr<Tokenizer> t, EngineConfig c, int32_t num_blocks)
      : model(std::move(m)),
        tokenizer(std::move(t)),
        config(c),
        context(model_context_length(*model)),
        blocks(model->plan(), std::move(*model->create_cache(num_blocks)),
               c.enable_prefix_caching) {}

  struct Event {
    Request* request;
    RequestOutput out;
  };

  void run();
  void step();
  void schedule_and_forward();
  void propose_drafts();
  void preempt(Request& r);
  void finish(Request& r, const std::string& reason);
  void cancel_now(RequestId id);
  void fail_running(const std::string& why);
  void publish_stats();
  void deliver_events();
  RequestOutput base_output(const Request& r) const;

  const std::unique_ptr<Model> model;
  const std::unique_ptr<Tokenizer> tokenizer;
  const EngineConfig config;
  const int32_t context;

  // Shared with callers, under mu.
  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Request>> inbox;
  std::vector<RequestId> cancels;
  bool stopping = false;
  RequestId next_id = 1;
  EngineStats published;

  // Engine thread only.
  KvBlockManager blocks;
  std::deque<std::unique_ptr<Request>> waiting;   // FCFS; preempted requests go to the front
  std::vector<std::unique_ptr<Request>> running;  // by arrival (id), oldest first
  std::vector<std::unique_ptr<Request>> done;     // finished this step, freed after delivery
  std::vector<Event> events;
  EngineStats counters;  // the cumulative fields
  std::vector<float> logits;
  std::vector<float> captured;  // target features for a DFlash proposer
  // speculative_auto_disable: per bucket of decoding sequences (bit width of their count), the
  // wall time and the tokens of recent decode-only steps with and without drafts. A mode's cost
  // per token is its fastest step of the last kSpecWindow over its mean tokens per step of the
  // last kSpecTokenWindow. The minimum time: a step of a shape seen for the first time captures
  // a CUDA graph or tunes a GEMM (10-100x a replayed one), and the rarer mode meets new shapes
  // more often, so a mean or even a median of its few times would keep it looking slow. The
  // mean tokens over a longer window: acceptance comes in bursts, and a per-step minimum of
  // time per token turned a paying drafter off after 7 poor steps in a row (a third of the
  // draft model's steps at batch 1).
  static constexpr int kSpecWindow = 7;
  static constexpr double kSpecPlainMargin = 1.1;
  static constexpr int kSpecTokenWindow = 32;
  struct SpecBucket {
    std::array<double, kSpecWindow> seconds[2] = {};       // [0]: plain, [1]: drafting
    std::array<int64_t, kSpecTokenWindow> tokens[2] = {};  // same
    int64_t samples[2] = {0, 0};
    int64_t decided = 0;
    int probe_left = 0;  // steps of the current probe still to run after this one
    bool probe_drafting = false;
    void add(int m, double s, int64_t emitted) {
      seconds[m][static_cast<size_t>(samples[m] % kSpecWindow)] = s;
      tokens[m][static_cast<size_t>(samples[m] % kSpecTokenWindow)] = emitted;
      ++samples[m];
    }
    double per_token(int m) const {
      const int64_t n = std::min<int64_t>(samples[m], kSpecWindow);
      const int64_t nt = std::min<int64_t>(samples[m], kSpecTokenWindow);
      const double t = *std::min_element(seconds[m].begin(), seconds[m].begin() + n);
      int64_t sum = 0;
      for (int64_t i = 0; i < nt; ++i) sum += tokens[m][static_cast<size_t>(i)];
      return t * static_cast<double>(nt) / static_cast<double>(std::max<int64_t>(sum, 1));
    }
  };
  std::array<SpecBucket, 32> spec_buckets;
  int step_bucket = -1;  // this step's bucket when auto_disable decided it, else -1
  bool step_drafting = false;
  // The last decode step was run without drafts by auto_disable: the next drafting step is
  // the drafter's catch-up (a draft model prefills the tokens it skipped), not a sample.
  bool drafts_skipped = false;
  bool step_catch_up = false;

  std::thread thread;
};

// KVQ_SPEC_TRACE=1: auto_disable's samples and decisions on stderr.
static bool spec_trace() {
  static const bool on = [] {
    const char* e = std::getenv("KVQ_SPEC_TRACE");
    return e != nullptr && std::string_view(e) == "1";
  }();
  return on;
}

RequestOutput LlmEngine::Impl::base_output(const Request& r) const {
  RequestOutput o;
  o.id = r.id;
  o.prompt_tokens = r.prompt_len;
  o.completion_tokens = r.generated();
  o.cached_prompt_tokens = r.cached_prompt_tokens;
  o.spec = r.spec;
  return o;
}

// Moves a running or waiting request to `done` with its final event.
void LlmEngine::Impl::finish(Request& r, const std::string& reason) {
  if (blocks.has_sequence(r.seq())) blocks.free_sequence(r.seq());
  if (config.proposer) config.proposer->release(static_cast<uint64_t>(r.seq()));
  std::unique_ptr<Request> owned;
  if (auto it = std::find_if(running.begin(), running.end(),
                             [&](const auto& p) { return p.get() == &r; });
      it != running.end()) {
    owned = std::move(*it);
    running.erase(it);
  } else if (auto w = std::find_if(waiting.begin(), waiting.end(),
                                   [&](const auto& p) { return p.get() == &r; });
             w != waiting.end()) {
    owned = std::move(*w);
    waiting.erase(w);
  }
  KVQ_CHECK(owned != nullptr, "LlmEngine: finishing request " + std::to_string(r.id) +
                                  " that is neither running nor waiting");
  // The final event of an event-less end (cancellation, failure) flushes held-back text.
  if (events.empty() || events.back().request != &r) {
    RequestOutput o = base_output(r);
    o.text = std::string(r.stream.finish());
    events.push_back({&r, std::move(o)});
  }
  events.back().out.finished = true;
  events.back().out.finish_reason = reason;
  ++counters.requests_finished;
  done.push_back(std::move(owned));
}

void LlmEngine::Impl::cancel_now(RequestId id) {
  for (auto& r : running)
    if (r->id == id) return finish(*r, "cancelled");
  for (auto& r : waiting)
    if (r->id == id) return finish(*r, "cancelled");
}

void LlmEngine::Impl::preempt(Request& r) {
  blocks.free_sequence(r.seq());
  if (config.proposer) config.proposer->release(static_cast<uint64_t>(r.seq()));
  r.draft = Draft{};
  r.computed = 0;
  auto it =
      std::find_if(running.begin(), running.end(), [&](const auto& p) { return p.get() == &r; });
  KVQ_CHECK(it != running.end(), "LlmEngine: preempting a request that is not running");
  waiting.push_front(std::move(*it));
  running.erase(it);
  ++counters.preemptions;
}

void LlmEngine::Impl::fail_running(const std::string& why) {
  (void)why;  // the finish reason carries it; the engine has no logger of its own
  while (!running.empty()) finish(*running.back(), "error");
}

void LlmEngine::Impl::schedule_and_forward() {
  struct Scheduled {
    Request* r;
    int32_t n;
    std::vector<int64_t> slots;  // reserved when scheduled, so later choices see the blocks taken
  };
  std::vector<Scheduled> batch;
  int32_t budget = config.max_num_batched_tokens;
  const int32_t bt = blocks.block_tokens();
  bool preempted = false;
  const auto t_draft = std::chrono::steady_clock::now();
  propose_drafts();
  counters.draft_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_draft).count();
  auto reserve = [&](Request& r, int32_t n) {
    std::vector<int64_t> got = blocks.append(r.seq(), n);
    KVQ_CHECK(static_cast<int32_t>(got.size()) == n,
              "LlmEngine: no blocks for a scheduled chunk of request " + std::to_string(r.id));
    return got;
  };

  // Running sequences, oldest first: decodes take one token each; a prefill chunk takes what
  // the budget leaves after one token for every younger decode.
  for (size_t i = 0; i < running.size() && budget > 0; ++i) {
    Request& r = *running[i];
    const int32_t remaining = r.len() - r.computed;
    int32_t n = 1;
    int32_t younger_decodes = 0;
    if (remaining > 1 || !r.draft.tokens.empty())
      for (size_t j = i + 1; j < running.size(); ++j)
        if (running[j]->len() - running[j]->computed == 1) ++younger_decodes;
    if (remaining == 1 && !r.draft.tokens.empty()) {
      // Drafts take what the budget leaves after one token for every younger decode, and only
      // blocks at hand: nobody is preempted for a draft.
      int32_t d = std::min(static_cast<int32_t>(r.draft.tokens.size()),
                           std::max(0, budget - 1 - younger_decodes));
      while (d > 0 && blocks.blocks_needed(r.seq(), 1 + d) > blocks.num_available()) --d;
      r.draft.tokens.resize(static_cast<size_t>(d));
      if (r.draft.q.size() > static_cast<size_t>(d)) r.draft.q.resize(static_cast<size_t>(d));
      n = 1 + d;
    } else if (remaining > 1) {
      n = std::min(remaining, budget - younger_decodes);
      if (n <= 0) continue;
      // A chunk shrinks to the blocks at hand before anyone is preempted for it.
      const int64_t room =
          (static_cast<int64_t>(blocks.cache().blocks(r.seq()).size()) + blocks.num_available()) *
              bt -
          r.computed;
      if (room >= 1) n = static_cast<int32_t>(std::min<int64_t>(n, room));
    }
    // Out of blocks: the youngest running sequence gives its blocks up (maybe r itself).
    bool self_preempted = false;
    while (blocks.blocks_needed(r.seq(), n) > blocks.num_available()) {
      Request& victim = *running.back();
      self_preempted = &victim == &r;
      preempt(victim);
      preempted = true;
      if (self_preempted) break;
    }
    if (self_preempted) break;
    batch.push_back({&r, n, reserve(r, n)});
    budget -= n;
  }

  // Waiting requests, FCFS, while the whole prompt's blocks fit (so a new sequence does not
  // preempt itself in its next chunk). Not in a step that had to preempt: the cache is full.
  while (!preempted && !waiting.empty() && budget > 0 &&
         static_cast<int32_t>(running.size()) < config.max_num_seqs) {
    Request& r = *waiting.front();
    // At least the last token is computed: its logits give the next token.
    const std::vector<int32_t> prefix = blocks.match_prefix(r.tokens, (r.len() - 1) / bt);
    const int32_t cached = static_cast<int32_t>(prefix.size()) * bt;
    const int64_t need = ceil_div(r.len(), bt) - static_cast<int64_t>(prefix.size());
    if (need > blocks.num_available() - blocks.count_unowned(prefix)) break;
    blocks.add_sequence(r.seq(), r.tokens, prefix);
    r.computed = cached;
    if (!r.admitted_before) {
      r.admitted_before = true;
      r.cached_prompt_tokens = cached;
      counters.prompt_tokens_total += r.prompt_len;
      if (config.enable_prefix_caching) {
        counters.prefix_cache_queries += r.prompt_len;
        counters.prefix_cache_hits += cached;
      }
    }
    const int32_t n = std::min(r.len() - cached, budget);
    std::unique_ptr<Request> owned = std::move(waiting.front());
    waiting.pop_front();
    const auto at = std::upper_bound(running.begin(), running.end(), owned->id,
                                     [](RequestId id, const auto& p) { return id < p->id; });
    running.insert(at, std::move(owned));
    batch.push_back({&r, n, reserve(r, n)});
    budget -= n;
  }
  if (batch.empty()) {
    KVQ_CHECK(running.empty() && waiting.empty(),
              "LlmEngine: a step scheduled nothing with " + std::to_string(running.size()) +
                  " running and " + std::to_string(waiting.size()) + " waiting requests");
    return;
  }

  // One forward pass over every scheduled chunk; a decoding sequence's drafts ride after its
  // last token, each with a logit row.
  std::vector<int32_t> tokens, positions, q_indptr{0}, rows;
  std::vector<int64_t> slots;
  std::vector<SequenceId> ids;
  std::vector<Request*> sampled;
  std::vector<PassSequence> pass;
  std::vector<int32_t> token_rows, token_dst;  // drafts still on the drafter's device
  for (const Scheduled& s : batch) {
    Request& r = *s.r;
    const std::vector<int32_t>& drafts = r.draft.tokens;
    const int32_t own = s.n - static_cast<int32_t>(drafts.size());  // tokens of r.tokens
    slots.insert(slots.end(), s.slots.begin(), s.slots.end());
    tokens.insert(tokens.end(), r.tokens.begin() + r.computed, r.tokens.begin() + r.computed + own);
    if (r.draft.on_device)
      for (size_t d = 0; d < drafts.size(); ++d) {
        token_rows.push_back(r.draft.device_row + static_cast<int32_t>(d) * r.draft.device_stride);
        token_dst.push_back(static_cast<int32_t>(tokens.size() + d));
      }
    tokens.insert(tokens.end(), drafts.begin(), drafts.end());
    for (int32_t p = r.computed; p < r.computed + s.n; ++p) positions.push_back(p);
    q_indptr.push_back(static_cast<int32_t>(tokens.size()));
    ids.push_back(r.seq());
    if (r.computed + own == r.len()) {
      for (size_t d = 0; d <= drafts.size(); ++d)
        rows.push_back(static_cast<int32_t>(tokens.size() - drafts.size() - 1 + d));
      sampled.push_back(&r);
      pass.push_back({&r.sampler, static_cast<uint64_t>(r.generated()), drafts, r.draft.q,
                      r.want_logprobs, r.top_logprobs});
    }
  }
  PagedKvCache::BlockTableStorage storage;
  const BlockTableView table = blocks.cache().block_table(ids, storage);
  ForwardBatch fb{tokens, positions, q_indptr, slots, table, rows};
  // Drafts left on the drafter's device: the pass reads them there (and waits for the drafter
  // even when none of them is in it), and collect() writes them into the requests' drafts
  // before they are verified.
  const Model* token_source = config.proposer ? config.proposer->token_source() : nullptr;
  if (token_source != nullptr) {
    fb.token_source = token_source;
    fb.token_rows = token_rows;
    fb.token_dst = token_dst;
  }
  const auto collect_drafts = [&] {
    if (token_source == nullptr) return;
    std::vector<Draft*> on_device;
    for (auto& r : running)
      if (r->draft.on_device) on_device.push_back(&r->draft);
    config.proposer->collect(on_device);
  };
  // A proposer that drafts from the target's features (DFlash) gets them for every kept token.
  const std::span<const int32_t> capture =
      config.proposer ? config.proposer->target_layers() : std::span<const int32_t>();
  const size_t feature_size = capture.size() * static_cast<size_t>(model->arch().hidden_size);
  const bool capture_on_device = !capture.empty() && model->keeps_captures_on_device() &&
                                 config.proposer->features_on_device(*model);
  if (!capture.empty()) {
    fb.capture_layers = capture;
    fb.capture_on_device = capture_on_device;
    captured.resize(capture_on_device ? 0 : tokens.size() * feature_size);
    fb.captured = captured;
  }
  std::vector<PassResult> results;
  const auto t_forward = std::chrono::steady_clock::now();
  if (!capture.empty()) config.proposer->before_target_pass(*model);
  forward_and_accept(*model, fb, blocks.cache(), pass, results, logits, collect_drafts);
  counters.forward_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_forward).count();
  ++counters.steps;

  // Rejected drafts are rolled back (their blocks freed); only kept tokens are published.
  std::vector<Proposer::KeptRows> kept;
  for (size_t b = 0; b < batch.size(); ++b) {
    const Scheduled& s = batch[b];
    Request& r = *s.r;
    const int32_t own = s.n - static_cast<int32_t>(r.draft.tokens.size());
    const int32_t first = r.computed;
    r.computed += own;
    const auto it = std::find(sampled.begin(), sampled.end(), &r);
    const Verified* v = it == sampled.end()
                            ? nullptr
                            : &results[static_cast<size_t>(it - sampled.begin())].verified;
    const int32_t accepted = v != nullptr ? v->accepted : 0;
    if (!capture.empty() && r.speculate)
      kept.push_back({static_cast<uint64_t>(r.seq()), first, own + accepted, q_indptr[b]});
    if (v == nullptr) {
      blocks.publish_full_blocks(r.seq(), r.tokens, r.computed);
      continue;
    }
    r.computed += accepted;
    blocks.truncate(r.seq(), r.computed);
    const size_t before = r.tokens.size();
    r.tokens.insert(r.tokens.end(), v->tokens.begin(), v->tokens.end());
    blocks.publish_full_blocks(r.seq(), r.tokens, r.computed);
    r.tokens.resize(before);
    if (!r.draft.tokens.empty()) {
      SpecCounters c;
      c.drafted = static_cast<int64_t>(r.draft.tokens.size());
      c.accepted = accepted;
      c.verify_steps = 1;
      c.emitted = static_cast<int64_t>(v->tokens.size());
      r.spec.add(c);
      counters.spec.add(c);
    }
  }
  if (!kept.empty()) {
    const auto t_features = std::chrono::steady_clock::now();
    config.proposer->on_target_features(*model, kept, captured);
    counters.draft_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_features).count();
  }
  if (step_bucket >= 0 && !step_catch_up && !preempted && sampled.size() == batch.size()) {
    // A decode-only step (every scheduled sequence produced tokens): its time per token.
    bool decode_only = true;
    int64_t emitted = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      decode_only =
          decode_only && batch[i].n == 1 + static_cast<int32_t>(batch[i].r->draft.tokens.size());
      emitted += static_cast<int64_t>(results[i].verified.tokens.size());
    }
    if (decode_only && emitted > 0) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t_draft).count();
      if (spec_trace())
        std::fprintf(stderr, "kvq auto_disable: bucket %d %s step %.4f ms, %lld tokens\n",
                     step_bucket, step_drafting ? "drafting" : "plain", seconds * 1e3,
                     static_cast<long long>(emitted));
      spec_buckets[static_cast<size_t>(step_bucket)].add(step_drafting ? 1 : 0, seconds, emitted);
    }
  }
  for (size_t i = 0; i < sampled.size(); ++i) {
    Request& r = *sampled[i];
    const PassResult& res = results[i];
    RequestOutput o = base_output(r);
    bool stop = false, length = false;
    for (size_t t = 0; t < res.verified.tokens.size() && !stop && !length; ++t) {
      const int32_t id = res.verified.tokens[t];
      r.tokens.push_back(id);
      ++counters.generation_tokens_total;
      const TextStream::Step out = r.stream.push(id);
      o.token_ids.push_back(id);
      if (out.has_text) o.text += out.text;
      if (r.want_logprobs)
        o.logprobs.push_back(
            {id, res.logprobs[t],
             t < res.top.size() ? res.top[t] : std::vector<std::pair<int32_t, float>>{}});
      stop = out.stop;
      length = r.generated() >= r.max_new;
    }
    o.completion_tokens = r.generated();
    o.spec = r.spec;
    r.draft = Draft{};
    events.push_back({&r, std::move(o)});
    if (stop) {
      finish(r, "stop");
    } else if (length) {
      events.back().out.text += r.stream.finish();
      finish(r, "length");
    }
  }
}

void LlmEngine::Impl::propose_drafts() {
  step_bucket = -1;
  step_catch_up = false;
  if (!config.proposer || config.num_speculative_tokens <= 0) return;
  for (auto& r : running) {
    r->draft = Draft{};
  }
  if (config.speculative_disable_by_batch_size > 0 &&
      static_cast<int32_t>(running.size()) >= config.speculative_disable_by_batch_size)
    return;
  std::vector<DraftRequest> requests;
  std::vector<Request*> who;
  for (auto& p : running) {
    Request& r = *p;
    // Decoding sequences only (one token not yet in the cache, at least one generated); drafts
    // leave room for the target's own token within max_tokens.
    if (!r.speculate || r.len() - r.computed != 1 || r.generated() == 0) continue;
    const int32_t k = std::min(config.num_speculative_tokens, r.max_new - r.generated() - 1);
    if (k <= 0) continue;
    // Greedy drafts may stay on the device for this step's verification (Draft::on_device).
    requests.push_back({static_cast<uint64_t>(r.seq()), r.tokens, k, &r.sampler,
                        config.speculative_drafts_on_device ? model.get() : nullptr});
    who.push_back(&r);
  }
  if (requests.empty()) return;
  if (config.speculative_auto_disable) {
    // kWarm samples of each mode, then the one with the lower recent time per token, with a
    // probe of the other every kSpecProbeInterval steps.
    constexpr int kWarm = 5;
    step_bucket = std::bit_width(requests.size()) - 1;
    SpecBucket& b = spec_buckets[static_cast<size_t>(step_bucket)];
    if (b.samples[1] < kWarm) {
      step_drafting = true;
    } else if (b.samples[0] < kWarm) {
      step_drafting = false;
    } else if (b.probe_left > 0) {
      --b.probe_left;
      step_drafting = b.probe_drafting;
    } else {
      // Drafting stays on unless plain is kSpecPlainMargin faster: its estimate moves with
      // acceptance and is refreshed only by probes while it is off, so a near tie (a draft
      // model at batch 1: 0.20-0.23 ms per token against plain's 0.22) must not turn it off.
      const bool faster = b.per_token(1) <= b.per_token(0) * kSpecPlainMargin;
      step_drafting = faster;
      if (++b.decided % kSpecProbeInterval == 0) {
        // A probe of the other mode: kSpecProbeSteps steps, as a probe of drafting after a
        // plain stretch starts with the drafter's catch-up, which is not sampled.
        step_drafting = !faster;
        b.probe_drafting = !faster;
        b.probe_left = kSpecProbeSteps - 1;
      }
    }
    step_catch_up = step_drafting && drafts_skipped;
    drafts_skipped = !step_drafting;
    if (spec_trace())  // KVQ_SPEC_TRACE=1: one line per decision, for diagnosing the policy
      std::fprintf(stderr,
                   "kvq auto_disable: bucket %d samples %lld/%lld ms per token plain %.4f "
                   "drafting %.4f -> %s%s\n",
                   step_bucket, static_cast<long long>(b.samples[0]),
                   static_cast<long long>(b.samples[1]), b.samples[0] ? b.per_token(0) * 1e3 : -1.0,
                   b.samples[1] ? b.per_token(1) * 1e3 : -1.0, step_drafting ? "draft" : "plain",
                   step_catch_up ? " (catch-up)" : "");
    if (!step_drafting) {
      ++counters.spec_steps_skipped;
      return;
    }
  }
  std::vector<Draft> drafts(requests.size());
  config.proposer->propose(requests, drafts);
  for (size_t i = 0; i < who.size(); ++i) {
    Draft& d = drafts[i];
    if (d.tokens.size() > static_cast<size_t>(requests[i].max_drafts))
      d.tokens.resize(static_cast<size_t>(requests[i].max_drafts));
    if (d.q.size() > d.tokens.size()) d.q.resize(d.tokens.size());
    who[i]->draft = std::move(d);
  }
}

void LlmEngine::Impl::publish_stats() {
  std::lock_guard lock(mu);
  published = counters;
  published.running = static_cast<int32_t>(running.size());
  published.waiting = static_cast<int32_t>(waiting.size());
  published.blocks_total = blocks.num_blocks();
  published.blocks_used = blocks.num_used();
  published.blocks_cached_free = blocks.num_cached_free();
}

void LlmEngine::Impl::deliver_events() {
  // No lock is held: a callback may call add_request() or cancel().
  for (Event& e : events) {
    try {
      if (e.request->on_output) e.request->on_output(e.out);
    } catch (...) {
      // A throwing callback cancels its request rather than killing the engine thread.
      if (!e.out.finished) {
        std::lock_guard lock(mu);
        cancels.push_back(e.out.id);
      }
    }
  }
  events.clear();
  done.clear();
}

void LlmEngine::Impl::step() {
  std::vector<RequestId> to_cancel;
  {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] {
      return stopping || !inbox.empty() || !cancels.empty() || !waiting.empty() || !running.empty();
    });
    if (stopping) return;
    for (auto& r : inbox) waiting.push_back(std::move(r));
    inbox.clear();
    to_cancel.swap(cancels);
  }
  try {
    for (RequestId id : to_cancel) cancel_now(id);
    schedule_and_forward();
  } catch (const std::exception& e) {
    // Whatever the running sequences held is freed; they end with "error". The engine goes on.
    fail_running(e.what());
  }
  publish_stats();
  deliver_events();
}

void LlmEngine::Impl::run() {
  for (;;) {
    step();
    std::lock_guard lock(mu);
    if (stopping) break;
  }
  // Shutdown: everything unfinished is cancelled, also what callbacks add meanwhile.
  for (;;) {
    {
      std::lock_guard lock(mu);
      for (auto& r : inbox) waiting.push_back(std::move(r));
      inbox.clear();
      cancels.clear();
    }
    if (running.empty() && waiting.empty()) break;
    while (!running.empty()) finish(*running.back(), "cancelled");
    while (!waiting.empty()) finish(*waiting.back(), "cancelled");
    publish_stats();
    deliver_events();
  }
}

LlmEngine::LlmEngine(std::unique_ptr<Model> model, std::unique_ptr<Tokenizer> tokenizer,
                     EngineConfig config) {
  KVQ_CHECK(model != nullptr && tokenizer != nullptr,
            "LlmEngine: model and tokenizer are required");
  if (config.num_blocks <= 0 || config.num_blocks > std::numeric_limits<int32_t>::max())
    throw InputError("engine num_blocks must be in 1.." +
                     std::to_string(std::numeric_limits<int32_t>::max()) + ", got " +
                     std::to_string(config.num_blocks));
  if (config.max_num_seqs < 1)
    throw InputError("engine max_num_seqs must be >= 1, got " +
                     std::to_string(config.max_num_seqs));
  if (config.max_num_batched_tokens < 1)
    throw InputError("engine max_num_batched_tokens must be >= 1, got " +
                     std::to_string(config.max_num_batched_tokens));
  if (config.proposer &&
      (config.num_speculative_tokens < 1 || config.num_speculative_tokens > kMaxSpeculativeTokens))
    throw InputError("num_speculative_tokens must be in 1.." +
                     std::to_string(kMaxSpeculativeTokens) + ", got " +
                     std::to_string(config.num_speculative_tokens));
  const int32_t num_blocks = static_cast<int32_t>(config.num_blocks);
  impl_ = std::make_unique<Impl>(std::move(model), std::move(tokenizer), config, num_blocks);
  impl_->publish_stats();
  // The engine thread runs the CPU kernels with this thread's count, and this thread's idle
  // OpenMP team goes (kvq/core/cpu_threads.h).
  const int cpu_threads = hand_over_cpu_threads();
  impl_->thread = std::thread([impl = impl_.get(), cpu_threads] {
    adopt_cpu_threads(cpu_threads);
    impl->run();
  });
}

LlmEngine::~LlmEngine() {
  {
    std::lock_guard lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
}

const Model& LlmEngine::model() const {
  return *impl_->model;
}
const Tokenizer& LlmEngine::tokenizer() const {
  return *impl_->tokenizer;
}
int32_t LlmEngine::context_length() const {
  return impl_->context;
}

namespace {

// Checks a request before it is queued (add_request's InputErrors); returns max_new.
int32_t check_request(const std::vector<int32_t>& prompt, const SamplingParams& params,
                      int top_logprobs, int32_t vocab, int64_t context, int32_t block_tokens,
                      int32_t num_blocks) {
  if (top_logprobs < 0 || top_logprobs > LlmEngine::kMaxTopLogprobs)
    throw InputError("top_logprobs " + std::to_string(top_logprobs) + " is outside 0.." +
                     std::to_string(LlmEngine::kMaxTopLogprobs));
  if (auto errors = sampling_param_errors(params); !errors.empty())
    throw InputError(errors.front());
  if (prompt.empty()) throw InputError("the prompt is empty (no tokens to start from)");
  for (int32_t id : prompt)
    if (id < 0 || id >= vocab)
      throw InputError("prompt token id " + std::to_string(id) +
                       " is out of range; the vocabulary has " + std::to_string(vocab) +
                       " tokens (0-" + std::to_string(vocab - 1) + ")");
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  if (prompt_len >= context)
    throw InputError("the prompt has " + std::to_string(prompt_len) +
                     " tokens; the model's context is " + std::to_string(context) +
                     " tokens (max_position_embeddings), and generation needs room for one more");
  const int32_t max_new =
      static_cast<int32_t>(std::min<int64_t>(params.max_tokens, context - prompt_len));
  const int64_t need = ceil_div(prompt_len + max_new, block_tokens);
  if (need > num_blocks)
    throw InputError("the prompt (" + std::to_string(prompt_len) + " tokens) plus max_tokens (" +
                     std::to_string(max_new) + ") need " + std::to_string(need) +
                     " KV cache blocks of " + std::to_string(block_tokens) +
                     " tokens; the whole cache has " + std::to_string(num_blocks) + " blocks (" +
                     std::to_string(num_blocks * block_tokens) + " tokens)");
  return max_new;
}

}  // namespace

RequestId LlmEngine::add_request(std::vector<int32_t> prompt, const SamplingParams& params,
                                 OutputCallback on_output, bool want_logprobs, int top_logprobs) {
  std::vector<NewRequest> one;
  one.push_back({std::move(prompt), params, std::move(on_output), want_logprobs, top_logprobs});
  return add_requests(std::move(one)).front();
}

std::vector<RequestId> LlmEngine::add_requests(std::vector<NewRequest> requests) {
  Impl& m = *impl_;
  std::vector<int32_t> max_new;
  for (const NewRequest& r : requests)
    max_new.push_back(check_request(r.prompt, r.params, r.top_logprobs, m.model->vocab_size(),
                                    m.context, m.blocks.block_tokens(), m.config.num_blocks));
  // Built before the lock (a sampler's seeding may throw): nothing is queued unless every
  // request was made; numbered and queued together under the lock.
  std::vector<std::unique_ptr<Request>> made;
  made.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    NewRequest& r = requests[i];
    made.push_back(std::make_unique<Request>(0, std::move(r.prompt), r.params, max_new[i],
                                             *m.tokenizer, std::move(r.on_output), r.want_logprobs,
                                             r.top_logprobs));
  }
  std::vector<RequestId> ids;
  ids.reserve(made.size());
  {
    std::lock_guard lock(m.mu);
    for (auto& r : made) {
      r->id = m.next_id++;
      ids.push_back(r->id);
      m.inbox.push_back(std::move(r));
    }
  }
  m.cv.notify_all();
  return ids;
}

void LlmEngine::cancel(RequestId id) {
  {
    std::lock_guard lock(impl_->mu);
    if (id == 0 || id >= impl_->next_id) return;
    impl_->cancels.push_back(id);
  }
  impl_->cv.notify_all();
}

EngineStats LlmEngine::stats() const {
  std::lock_guard lock(impl_->mu);
  EngineStats s = impl_->published;
  s.waiting += static_cast<int32_t>(impl_->inbox.size());
  return s;
}

}  // namespace kvq
