// Speculative decoding: a Proposer drafts up to k tokens per sequence; the target verifies
// them all in one forward pass (k + 1 query tokens per sequence, through the same paged
// attention as prefill), keeps the accepted prefix plus one token of its own, and the cache of
// the rejected positions is rolled back. generate() and LlmEngine share everything here.
//
// Acceptance keeps the target's distribution exactly: greedy requests accept the longest
// prefix equal to the target's argmax; sampled requests accept draft x with probability
// min(1, p(x) / q(x)) (p, q: the target's and the drafter's distributions after temperature,
// top-k, top-p and min-p), and on the first rejection draw from normalize(max(0, p - q)); when
// every draft is accepted, a bonus token is drawn from the last row.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/engine/sampler.h"
#include "kvq/model/model.h"
#include "kvq/plan/speculative_config.h"

namespace kvq {

// A probability distribution over token ids: (id, probability) pairs, probabilities summing
// to 1. Empty in a Draft's q means "deterministic": all mass on the drafted token.
using SparseDist = std::vector<std::pair<int32_t, double>>;

struct DraftRequest {
  uint64_t seq = 0;                 // the caller's key for the sequence, stable while it lives
  std::span<const int32_t> tokens;  // every token so far; the last is not yet in the target's cache
  int32_t max_drafts = 0;           // at most this many drafts (may be 0)
  Sampler* sampler = nullptr;       // the request's rule and random stream (draws of drafts)
  // Set: greedy drafts may stay on the device for this target's next pass (Draft::on_device)
  // when it accepts_tokens_from the drafter. The caller then passes token_source() in that
  // pass (ForwardBatch::token_source, with each draft's rows) and calls collect() after it.
  // Every request of one propose() call names the same target or none.
  const Model* target = nullptr;
};

struct Draft {
  std::vector<int32_t> tokens;
  std::vector<SparseDist> q;  // per token, the distribution it was drawn from; empty: one-hot
  // The tokens are placeholders until Proposer::collect(): draft j is row
  // device_row + j * device_stride of the proposer's token_source() deferred ids, on the device.
  bool on_device = false;
  int32_t device_row = 0, device_stride = 1;
};

class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual SpecMethod method() const = 0;
  // Drafts for every request (out has one entry per request; fewer tokens than asked, or none,
  // is always allowed).
  virtual void propose(std::span<const DraftRequest> requests, std::span<Draft> out) = 0;
  // The sequence is gone (finished, cancelled or preempted): drop its state.
  virtual void release(uint64_t seq) { (void)seq; }
  // The model whose deferred ids hold the drafts left on the device (Draft::on_device) by the
  // last propose(), until collect(); nullptr when none are.
  virtual const Model* token_source() const { return nullptr; }
  // After the target's pass that read them: waits for the drafts left on the device and writes
  // their tokens into `drafts` (those of the last propose() still in use; a caller may have
  // shortened them). Does nothing when none were left there.
  virtual void collect(std::span<Draft* const> drafts) { (void)drafts; }
  // Target layers whose outputs this proposer needs for every position the target keeps (a
  // DFlash drafter's features); empty: none. The caller captures them in each target forward.
  virtual std::span<const int32_t> target_layers() const { return {}; }
  // After a target forward pass that captured target_layers(): the positions it kept, and
  // their features, rows of `host` ([pass tokens][target_layers().size()][hidden]) or, when the
  // pass kept them on its device (features_on_device), of target.device_captured().
  struct KeptRows {
    uint64_t seq = 0;
    int32_t first = 0;  // positions [first, first + n) of seq (prefill chunks, accepted tokens)
    int32_t n = 0;
    int32_t row = 0;  // their features are rows [row, row + n) of the pass
  };
  virtual void on_target_features(const Model& target, std::span<const KeptRows> kept,
                                  std::span<const float> host) {
    (void)target, (void)kept, (void)host;
  }
  // Before every forward pass of the target (the callers of on_target_features call it): a
  // proposer that kept on_target_features' device rows to read later (a DFlash drafter fuses
  // them into its next pass) reads them now, as the pass will overwrite them.
  virtual void before_target_pass(const Model& target) { (void)target; }
  // True when `target`'s passes should keep the captured features on its device
  // (ForwardBatch::capture_on_device) because this proposer reads them there.
  virtual bool features_on_device(const Model& target) const {
    (void)target;
    return false;
  }
};

// Prompt lookup: the longest n-gram (prompt_lookup_max down to prompt_lookup_min) that ends the
// sequence and occurred earlier in it; the tokens that followed its latest earlier occurrence are
// the drafts. No model, no cache.
std::unique_ptr<Proposer> make_ngram_proposer(int prompt_lookup_min, int prompt_lookup_max);

// A small causal model with the target's tokenizer, with its own paged cache of `num_blocks`
// blocks (planned by the caller with make_drafter_kv_plan, so quantized like the target's).
// Each step it catches up on the tokens the target accepted and drafts k tokens one at a
// time, all sequences batched into one forward pass per token. A sequence that cannot get
// blocks in the drafter's cache drafts nothing that step.
std::unique_ptr<Proposer> make_draft_model_proposer(std::shared_ptr<const Model> drafter,
                                                    int32_t num_blocks,
                                                    int32_t max_step_tokens = 512);

// A block-diffusion (DFlash) drafter: one forward pass drafts k tokens for every sequence (the
// block [last token, mask x k] attends non-causally to the context K/V that the drafter wrote
// from the target's features into its own paged cache of `num_blocks` blocks). A sequence
// whose context features are incomplete (a prefix-cache hit skipped their computation) drafts
// nothing.
std::unique_ptr<Proposer> make_dflash_proposer(std::shared_ptr<const Model> drafter,
                                               int32_t num_blocks);

// The token count and vocabulary checks for a drafter model next to its target: InputError
// (naming the drafter's directory) when the vocabularies differ.
void check_drafter_vocab(const Model& target, const Model& drafter);

// Verification of one sequence's drafts against the target's logit rows.
struct Verified {
  std::vector<int32_t> tokens;  // accepted drafts, then the target's own token (always >= 1)
  int32_t accepted = 0;         // drafts accepted
};

// rows: drafts.size() + 1 logit rows (row i: the target's logits after drafts [0, i)).
Verified accept_drafts(Sampler& sampler, std::span<const int32_t> drafts,
                       std::span<const SparseDist> q,
                       const std::function<std::span<const float>(size_t row)>& rows);
// Greedy verification from the target's argmax ids of the same rows (a model that samples on
// its device returns only those).
Verified accept_greedy(std::span<const int32_t> drafts, std::span<const int32_t> target_ids);

// Counters of speculation (per request and per engine).
struct SpecCounters {
  int64_t drafted = 0;       // draft tokens verified
  int64_t accepted = 0;      // draft tokens accepted
  int64_t verify_steps = 0;  // sequence-steps that verified at least one draft
  int64_t emitted = 0;       // tokens those steps produced (accepted + the target's own)

  void add(const SpecCounters& o) {
    drafted += o.drafted;
    accepted += o.accepted;
    verify_steps += o.verify_steps;
    emitted += o.emitted;
  }
  double acceptance_rate() const {
    return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0.0;
  }
  // Tokens per verify step (accepted drafts + 1); 0 when nothing was verified.
  double mean_accepted_length() const {
    return verify_steps > 0 ? static_cast<double>(emitted) / static_cast<double>(verify_steps)
                            : 0.0;
  }
};

}  // namespace kvq
