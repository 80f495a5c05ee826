// LlmEngine: many concurrent requests over one model and one paged KV cache.
//
// A background thread runs scheduler steps: continuous batching (chunked prefill mixed with
// decode under a per-step token budget), block allocation as sequences grow, preemption by
// recomputation when the cache is full (the youngest running sequence gives up its blocks and
// is re-queued; requests are delayed, never lost or truncated), and prefix caching (full blocks
// hashed by their token content and the layer plan, shared by reference count, evicted least
// recently used). Thread-safe: add_request / cancel / stats may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvq/engine/sampler.h"
#include "kvq/engine/speculative.h"
#include "kvq/model/model.h"
#include "kvq/tokenizer/tokenizer.h"

namespace kvq {

struct EngineConfig {
  int64_t num_blocks = 0;                // KV cache blocks shared by all requests (> 0)
  int32_t max_num_seqs = 64;             // sequences running at once
  int32_t max_num_batched_tokens = 512;  // tokens per step (prefill chunks + decodes)
  bool enable_prefix_caching = true;
  // Speculative decoding (no proposer: none). Each step, every decoding sequence whose request
  // did not opt out (SamplingParams::speculate) drafts up to num_speculative_tokens tokens,
  // verified in the same forward pass as the other sequences' prefills and decodes. Drafts
  // shrink to the step's token budget and to the free blocks (never preempting for them).
  std::shared_ptr<Proposer> proposer;
  int32_t num_speculative_tokens = 0;
  // No drafts in a step with at least this many running sequences (0: always draft): under
  // load the batch already fills the GPU and verification work would only add cost.
  int32_t speculative_disable_by_batch_size = 0;
  // Drafts only where they pay: per batch-size bucket (the number of decoding sequences, by
  // powers of two) the engine keeps the wall time and the tokens of its recent decode-only
  // steps with drafts and without, measures each (a few steps of each first), then drafts
  // unless plain decoding's time per token is 10% lower (fastest recent step over the mean
  // tokens per step), and re-measures the other mode for kSpecProbeSteps steps in every
  // kSpecProbeInterval. KVQ_SPEC_TRACE=1 prints each decision to stderr.
  bool speculative_auto_disable = false;
  // Greedy drafts of a drafter on the target's GPU stay there for the step's verification,
  // which reads them on the device (ForwardBatch::token_source): drafting and verifying run
  // back to back with one host round trip for both. false (or KVQ_SPEC_DEFER=0): the drafts
  // come to the host first. The ids are the same either way.
  bool speculative_drafts_on_device = true;
};

inline constexpr int kSpecProbeInterval = 32;
// A probe runs this many steps of the other mode; the first drafting step after steps without
// drafts (the drafter catching up on the tokens it did not see) is not timed.
inline constexpr int kSpecProbeSteps = 2;

using RequestId = uint64_t;

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
  // When asked (add_request's top_logprobs): the most likely tokens at this position with
  // their logprobs, most likely first (ties: lower id first).
  std::vector<std::pair<int32_t, float>> top = {};
};

// One event for one request, delivered on the engine thread, in order. The last event of a
// request has `finished` set (and is delivered exactly once, also after cancel()).
struct RequestOutput {
  RequestId id = 0;
  std::string text;                    // new text since the previous event (complete UTF-8)
  std::vector<int32_t> token_ids;      // new token ids since the previous event
  std::vector<TokenLogprob> logprobs;  // per new token: the sampled token's logprob (when asked)
  bool finished = false;
  std::string finish_reason;  // "stop", "length", "cancelled", or "error" (an internal
                              // failure in the request's step; its blocks were freed)
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;     // so far
  int32_t cached_prompt_tokens = 0;  // prompt tokens served from the prefix cache
  SpecCounters spec;                 // the request's speculative decoding so far
};

using OutputCallback = std::function<void(const RequestOutput&)>;

struct EngineStats {
  int32_t running = 0;
  int32_t waiting = 0;
  int64_t preemptions = 0;
  int64_t prefix_cache_queries = 0;  // prompt tokens looked up (once per request, when first
                                     // admitted; re-admission after preemption is not counted)
  int64_t prefix_cache_hits = 0;     // prompt tokens found
  int64_t blocks_total = 0;
  int64_t blocks_used = 0;          // owned by running sequences (a shared block counts once)
  int64_t blocks_cached_free = 0;   // cached prefix blocks with no owner (evictable)
  int64_t prompt_tokens_total = 0;  // prompts of admitted requests (once per request)
  int64_t generation_tokens_total = 0;
  int64_t requests_finished = 0;  // every final event, whatever its reason
  SpecCounters spec;              // speculative decoding, all requests
  // Where the engine thread's time went (wall clock, cumulative): steps that ran a forward
  // pass, the proposer's drafting in them (drafter passes, context writes), and the target's
  // forward pass with verification and sampling.
  int64_t steps = 0;
  double draft_seconds = 0.0;
  double forward_seconds = 0.0;
  // Steps where speculation was on but auto_disable chose plain decoding.
  int64_t spec_steps_skipped = 0;
};

class LlmEngine {
 public:
  LlmEngine(std::unique_ptr<Model> model, std::unique_ptr<Tokenizer> tokenizer,
            EngineConfig config);
  // Stops the engine thread; unfinished requests get a "cancelled" final event. Not from a
  // callback (it joins the engine thread).
  ~LlmEngine();

  LlmEngine(const LlmEngine&) = delete;
  LlmEngine& operator=(const LlmEngine&) = delete;

  const Model& model() const;
  const Tokenizer& tokenizer() const;
  int32_t context_length() const;

  // Queues a request. Throws InputError (before queueing) for an empty prompt, a token id
  // outside the vocabulary, a prompt that does not fit the model's context, a prompt plus
  // max_tokens (capped by the context) that could not fit the whole cache even alone, or invalid
  // sampling parameters. `want_logprobs`: report each sampled token's logprob (log-softmax of
  // the model's logits, before temperature and truncation), and with `top_logprobs` > 0 (at most
  // kMaxTopLogprobs) that many most likely tokens at each position. May be called from a callback.
  RequestId add_request(std::vector<int32_t> prompt, const SamplingParams& params,
                        OutputCallback on_output, bool want_logprobs = false, int top_logprobs = 0);
  static constexpr int kMaxTopLogprobs = 20;
  // Queues several requests at once, as add_request would one by one (ids in order), so the
  // engine's next step sees all of them: none is queued if one is invalid. A benchmark's
  // batch is then the same in every run, whatever the threads' timing.
  struct NewRequest {
    std::vector<int32_t> prompt;
    SamplingParams params;
    OutputCallback on_output;
    bool want_logprobs = false;
    int top_logprobs = 0;
  };
  std::vector<RequestId> add_requests(std::vector<NewRequest> requests);
  // Cancels a request (no-op when it has finished or is unknown): frees everything it holds.
  // Takes effect at the engine's next step, before any further token of that request; the
  // final "cancelled" event follows on the engine thread. May be called from a callback.
  void cancel(RequestId id);
  EngineStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq
