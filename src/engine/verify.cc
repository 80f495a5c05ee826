#include "verify.h"

#include <cmath>
#include <limits>

#include "kvq/core/error.h"

namespace kvq {

float logprob_of(std::span<const float> logits, int32_t id) {
  double max = -std::numeric_limits<double>::infinity();
  for (float l : logits) max = std::max(max, static_cast<double>(l));
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max);
  return static_cast<float>(static_cast<double>(logits[static_cast<size_t>(id)]) - max -
                            std::log(sum));
}

void forward_and_accept(const Model& model, const ForwardBatch& batch, PagedKvCache& cache,
                        std::span<const PassSequence> seqs, std::vector<PassResult>& out,
                        std::vector<float>& logits) {
  size_t rows = 0;
  for (const PassSequence& s : seqs) rows += s.drafts.size() + 1;
  KVQ_CHECK(rows == batch.logit_rows.size(),
            "forward_and_accept: " + std::to_string(batch.logit_rows.size()) +
                " logit rows for sequences that need " + std::to_string(rows));
  out.assign(seqs.size(), PassResult{});
  // Ids only when nobody needs host rows: no logprobs, and drafts verified greedily.
  bool on_device = model.samples_on_device();
  for (const PassSequence& s : seqs)
    on_device = on_device && !s.want_logprobs && (s.drafts.empty() || s.sampler->greedy());
  if (on_device) {
    std::vector<DeviceSampling> rules;
    rules.reserve(rows);
    for (const PassSequence& s : seqs) {
      if (s.drafts.empty()) {
        rules.push_back(s.sampler->device_rule(s.step));
      } else {
        for (size_t i = 0; i <= s.drafts.size(); ++i) rules.push_back(DeviceSampling{});
      }
    }
    std::vector<int32_t> ids(rows);
    model.forward_sample(batch, cache, rules, ids);
    size_t row = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const PassSequence& s = seqs[i];
      const std::span<const int32_t> mine(ids.data() + row, s.drafts.size() + 1);
      out[i].verified = accept_greedy(s.drafts, mine);
      row += s.drafts.size() + 1;
    }
    return;
  }
  const size_t vocab = static_cast<size_t>(model.vocab_size());
  logits.resize(rows * vocab);
  model.forward(batch, cache, logits);
  size_t row = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const PassSequence& s = seqs[i];
    const size_t first = row;
    auto row_logits = [&](size_t r) {
      return std::span<const float>(logits.data() + (first + r) * vocab, vocab);
    };
    if (s.drafts.empty()) {
      out[i].verified.tokens = {s.sampler->sample(row_logits(0))};
    } else {
      out[i].verified = accept_drafts(*s.sampler, s.drafts, s.q, row_logits);
    }
    if (s.want_logprobs)
      for (size_t t = 0; t < out[i].verified.tokens.size(); ++t)
        out[i].logprobs.push_back(logprob_of(row_logits(t), out[i].verified.tokens[t]));
    row += s.drafts.size() + 1;
  }
}

}  // namespace kvq
