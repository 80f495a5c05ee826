// Accuracy of KV cache dtypes on a text: perplexity of each candidate plan and, against an
// unquantized reference run of the same weights in the same process, mean KL divergence,
// top-1 agreement and the change in perplexity.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvq/model/model.h"

namespace kvq {

struct EvalOptions {
  int32_t context = 512;        // tokens per window (each window starts fresh)
  int64_t max_tokens = 0;       // 0: every token of the text
  int32_t prefill_chunk = 512;
  std::optional<int32_t> bos;   // prepended to every window when set
};

struct EvalRow {
  std::string label;            // e.g. "fp8_e4m3"
  std::string plan_summary;     // summarize_kv_plan()
  size_t kv_bytes_per_token = 0;
  double ratio_to_bf16 = 0.0;
  double ppl = 0.0;
  double delta_ppl = 0.0;       // ppl - reference ppl
  double mean_kl = 0.0;         // mean over predicted positions of KL(reference || candidate), nats
  double top1_agreement = 0.0;  // fraction of positions whose argmax equals the reference's
  std::string unsupported;      // non-empty: this candidate could not run, and why
};

struct EvalReport {
  std::string reference_label;
  double reference_ppl = 0.0;
  int64_t predicted_tokens = 0;
  int32_t windows = 0;
  std::vector<EvalRow> rows;
};

struct EvalCandidate {
  std::string label;
  const Model* model = nullptr;  // null with `unsupported` set: reported, not run
  std::string unsupported;
};

EvalReport evaluate_kv_dtypes(const Model& reference, std::span<const EvalCandidate> candidates,
                              std::span<const int32_t> tokens, const EvalOptions& options);

}  // namespace kvq
