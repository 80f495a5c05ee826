#include "kvq/engine/evaluator.h"

#include <algorithm>
#include <cmath>

#include "kvq/core/error.h"
#include "kvq/engine/generator.h"

namespace kvq {

namespace {

// log-softmax of one row, in double.
void log_softmax(std::span<const float> logits, std::vector<double>& out) {
  out.resize(logits.size());
  double m = -INFINITY;
  for (float l : logits) m = std::max(m, static_cast<double>(l));
  double s = 0.0;
  for (float l : logits) s += std::exp(static_cast<double>(l) - m);
  const double lse = m + std::log(s);
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

size_t argmax(std::span<const float> v) {
  return static_cast<size_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

struct Accum {
  double nll = 0.0, kl = 0.0;
  int64_t top1 = 0, n = 0;
};

}  // namespace

EvalReport evaluate_kv_dtypes(const Model& reference, std::span<const EvalCandidate> candidates,
                              std::span<const int32_t> tokens, const EvalOptions& options) {
  const int32_t context = std::min(options.context, model_context_length(reference));
  if (context < 2) throw InputError("--context must be at least 2 tokens");
  std::span<const int32_t> text = tokens;
  if (options.max_tokens > 0 && static_cast<int64_t>(text.size()) > options.max_tokens)
    text = text.first(static_cast<size_t>(options.max_tokens));
  const int32_t body = options.bos ? context - 1 : context;
  if (static_cast<int64_t>(text.size()) < 2)
    throw InputError("the evaluation text has " + std::to_string(text.size()) +
                     " tokens; at least 2 are needed");

  const size_t vocab = static_cast<size_t>(reference.vocab_size());
  EvalReport report;
  report.reference_label = std::string(to_string(reference.plan().layers.front().k_dtype));
  Accum ref;
  std::vector<Accum> acc(candidates.size());
  std::vector<float> ref_logits;
  std::vector<double> lp_ref, lp;

  for (size_t begin = 0; begin < text.size(); begin += static_cast<size_t>(body)) {
    const size_t end = std::min(text.size(), begin + static_cast<size_t>(body));
    std::vector<int32_t> window(text.begin() + static_cast<std::ptrdiff_t>(begin),
                                text.begin() + static_cast<std::ptrdiff_t>(end));
    if (options.bos) window.insert(window.begin(), *options.bos);
    if (window.size() < 2) break;
    ++report.windows;
    const size_t predicted = window.size() - 1;
    ref_logits.assign(predicted * vocab, 0.0f);
    score_tokens(
        reference, window, options.prefill_chunk, [&](int32_t pos, std::span<const float> l) {
          if (static_cast<size_t>(pos) >= predicted) return;
          std::copy(
              l.begin(), l.end(),
              ref_logits.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(pos) * vocab));
          log_softmax(l, lp_ref);
          ref.nll -= lp_ref[static_cast<size_t>(window[static_cast<size_t>(pos) + 1])];
          ++ref.n;
        });
    for (size_t c = 0; c < candidates.size(); ++c) {
      if (!candidates[c].model) continue;
      score_tokens(*candidates[c].model, window, options.prefill_chunk,
                   [&](int32_t pos, std::span<const float> l) {
                     if (static_cast<size_t>(pos) >= predicted) return;
                     const std::span<const float> r(
                         ref_logits.data() + static_cast<size_t>(pos) * vocab, vocab);
                     log_softmax(r, lp_ref);
                     log_softmax(l, lp);
                     double kl = 0.0;
                     for (size_t v = 0; v < vocab; ++v)
                       kl += std::exp(lp_ref[v]) * (lp_ref[v] - lp[v]);
                     Accum& a = acc[c];
                     a.kl += std::max(kl, 0.0);
                     a.nll -= lp[static_cast<size_t>(window[static_cast<size_t>(pos) + 1])];
                     a.top1 += argmax(l) == argmax(r);
                     ++a.n;
                   });
    }
  }
  report.predicted_tokens = ref.n;
  report.reference_ppl = std::exp(ref.nll / static_cast<double>(std::max<int64_t>(ref.n, 1)));
  for (size_t c = 0; c < candidates.size(); ++c) {
    EvalRow row;
    row.label = candidates[c].label;
    row.unsupported = candidates[c].unsupported;
    if (const Model* m = candidates[c].model) {
      const KvPlan& plan = m->plan();
      row.plan_summary = summarize_kv_plan(plan);
      row.kv_bytes_per_token = plan.bytes_per_token();
      row.ratio_to_bf16 = static_cast<double>(plan.bytes_per_token()) /
                          static_cast<double>(std::max<size_t>(plan.bf16_bytes_per_token(), 1));
      const double n = static_cast<double>(std::max<int64_t>(acc[c].n, 1));
      row.ppl = std::exp(acc[c].nll / n);
      row.delta_ppl = row.ppl - report.reference_ppl;
      row.mean_kl = acc[c].kl / n;
      row.top1_agreement = static_cast<double>(acc[c].top1) / n;
    }
    report.rows.push_back(std::move(row));
  }
  return report;
}

}  // namespace kvq
