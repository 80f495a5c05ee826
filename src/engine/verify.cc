#include "verify.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvq/core/error.h"

namespace kvq {

namespace {
// max + log(sum exp(l - max)): the log-softmax normalizer of a row.
double log_normalizer(std::span<const float> logits) {
  double max = -std::numeric_limits<double>::infinity();
  for (float l : logits) max = std::max(max, static_cast<double>(l));
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max);
  return max + std::log(sum);
}
}  // namespace

float logprob_of(std::span<const float> logits, int32_t id) {
  return static_cast<float>(static_cast<double>(logits[static_cast<size_t>(id)]) -
                            log_normalizer(logits));
}

float logprob_and_top(std::span<const float> logits, int32_t id, int n,
                      std::vector<std::pair<int32_t, float>>& top) {
  const double z = log_normalizer(logits);
  top.clear();
  std::vector<int32_t> ids;
  ids.reserve(logits.size());
  for (size_t i = 0; i < logits.size(); ++i)
    if (!std::isnan(logits[i])) ids.push_back(static_cast<int32_t>(i));
  const size_t k = std::min(ids.size(), static_cast<size_t>(std::max(n, 0)));
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(),
                    [&](int32_t a, int32_t b) {
                      const float la = logits[static_cast<size_t>(a)],
                                  lb = logits[static_cast<size_t>(b)];
                      return la > lb || (la == lb && a < b);
                    });
  for (size_t i = 0; i < k; ++i)
    top.emplace_back(ids[i], static_cast<float>(logits[static_cast<size_t>(ids[i])] - z));
  return static_cast<float>(static_cast<double>(logits[static_cast<size_t>(id)]) - z);
}

void forward_and_accept(const Model& model, const ForwardBatch& batch, PagedKvCache& cache,
                        std::span<const PassSequence> seqs, std::vector<PassResult>& out,
                        std::vector<float>& logits, const std::function<void()>& after_forward) {
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
    if (after_forward) after_forward();
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
  if (after_forward) after_forward();
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
      for (size_t t = 0; t < out[i].verified.tokens.size(); ++t) {
        if (s.top_logprobs > 0) {
          out[i].top.emplace_back();
          out[i].logprobs.push_back(logprob_and_top(row_logits(t), out[i].verified.tokens[t],
                                                    s.top_logprobs, out[i].top.back()));
        } else {
          out[i].logprobs.push_back(logprob_of(row_logits(t), out[i].verified.tokens[t]));
        }
      }
    row += s.drafts.size() + 1;
  }
}

}  // namespace kvq
