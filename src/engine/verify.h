// One forward pass of the target and the tokens it yields, shared by generate() and LlmEngine:
// plain rows are sampled, speculative rows verified (accept_drafts / accept_greedy). A model
// that samples on its device returns only ids when no request in the pass needs whole rows on
// the host (log-probabilities, or sampled verification, which compares p with q).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "kvq/engine/speculative.h"

namespace kvq {

// One sequence's logit rows in a pass: drafts.size() + 1 consecutive rows (one for a plain
// sequence), in the order of the batch's logit_rows.
struct PassSequence {
  Sampler* sampler = nullptr;
  uint64_t step = 0;  // tokens the request has generated (the device rule's step)
  std::span<const int32_t> drafts;
  std::span<const SparseDist> q;
  bool want_logprobs = false;
  int top_logprobs = 0;  // with want_logprobs: alternatives per token
};

struct PassResult {
  Verified verified;            // tokens to emit (>= 1) and accepted drafts
  std::vector<float> logprobs;  // per token, when asked: the target's log-softmax at its row
  // per token, when top_logprobs > 0: that many most likely (id, logprob), most likely first
  std::vector<std::vector<std::pair<int32_t, float>>> top;
};

// Runs `batch` (whose logit_rows are the sequences' rows, in order) and fills out[i] for
// seqs[i]. `logits` is scratch. `after_forward` (when set) runs between the pass and the
// verification: drafts that were on the device (ForwardBatch::token_source) are collected into
// the spans of seqs[i].drafts there.
void forward_and_accept(const Model& model, const ForwardBatch& batch, PagedKvCache& cache,
                        std::span<const PassSequence> seqs, std::vector<PassResult>& out,
                        std::vector<float>& logits,
                        const std::function<void()>& after_forward = {});

// log-softmax of `logits` at `id`.
float logprob_of(std::span<const float> logits, int32_t id);
// log-softmax of `logits` at `id`, and the n most likely (id, logprob) into `top` (most likely
// first, ties by lower id; NaN logits never among them).
float logprob_and_top(std::span<const float> logits, int32_t id, int n,
                      std::vector<std::pair<int32_t, float>>& top);

}  // namespace kvq
