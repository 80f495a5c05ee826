// Attention backends and the selector.
//
// A backend declares what it runs as whitelists (AttentionCapabilities). One
// function, reasons_unsupported(), answers both "can you run this layer?" (empty)
// and "why not?" (the reasons); the selector uses it and only ever hands a
// backend specs it accepted.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/cache/paged_kv_cache.h"
#include "kvq/plan/layer_kv_spec.h"

namespace kvq {

enum class Device : uint8_t { kCpu, kCuda };
constexpr std::string_view to_string(Device d) {
  return d == Device::kCpu ? "cpu" : "cuda";
}

struct AttentionCapabilities {
  Device device = Device::kCpu;
  int priority = 0;  // higher wins when several backends can run a layer
  std::vector<std::pair<KvDtype, KvDtype>> kv_dtype_pairs;  // (K, V) pairs
  std::vector<int> head_dims;                               // empty: any head dim
  std::vector<int> block_tokens;                            // empty: any block size
  std::vector<AttentionKind> attention_kinds;
  std::vector<int> gqa_ratios;  // empty: any ratio
  bool logit_soft_cap = true;
};

// One attention call over a batch of sequences whose new tokens' K/V are already
// written to the cache. Sequence i has q_len_i = q_indptr[i+1] - q_indptr[i] new
// queries; they are the last q_len_i of its kv_len_i = block_table.seq_lens[i]
// cached tokens (query j sits at position kv_len_i - q_len_i + j).
//   causal:         query at position p sees kv positions <= p
//   sliding window: query at position p sees kv positions in (p - W, p]
//   non-causal:     every query sees all kv_len_i positions
// Decode is the case q_len_i == 1 for every sequence.
struct AttentionArgs {
  const float* q = nullptr;  // [total_q][num_q_heads][head_dim_k], model space (not rotated)
  float* out = nullptr;      // [total_q][num_q_heads][head_dim_v]
  const int32_t* q_indptr = nullptr;  // num_seqs + 1
  BlockTableView block_table;
  LayerCacheView cache;
  float softmax_scale = 1.0f;
  float logit_soft_cap = 0.0f;  // 0: off; else logits = cap * tanh(logits / cap)
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual std::string_view name() const = 0;
  virtual const AttentionCapabilities& capabilities() const = 0;

  // Empty when this backend can run `spec`; otherwise every reason it cannot.
  // Checks the capability whitelists, then extra_reasons().
  std::vector<std::string> reasons_unsupported(const LayerKvSpec& spec) const;
  // The same, plus a reason when the backend does not run on `device`.
  std::vector<std::string> reasons_unsupported(const LayerKvSpec& spec, Device device) const;

  // Runs attention for one layer. Only called with a spec reasons_unsupported accepted
  // (throws InternalError otherwise).
  void run(const LayerKvSpec& spec, const AttentionArgs& args) const;

 protected:
  // Constraints a whitelist cannot express (e.g. a CPU feature missing at run time).
  virtual std::vector<std::string> extra_reasons(const LayerKvSpec&) const { return {}; }
  virtual void run_impl(const LayerKvSpec& spec, const AttentionArgs& args) const = 0;
};

// Every backend built into this binary, in priority order (highest first).
std::span<const AttentionBackend* const> all_attention_backends();
const AttentionBackend* find_attention_backend(std::string_view name);

struct BackendChoice {
  const AttentionBackend* backend = nullptr;
  // For each backend that was passed over: its name and reasons (or "lower priority").
  std::vector<std::pair<std::string, std::vector<std::string>>> passed_over;
};

// Picks the highest-priority backend on `device` that can run `spec`, or the one named
// `forced` (empty: choose). Throws InputError listing every candidate's reasons when none can
// (or when `forced` is unknown, listing valid names, or cannot run the layer, with its reasons).
BackendChoice select_attention_backend(const LayerKvSpec& spec, Device device,
                                       std::string_view forced = {});

}  // namespace kvq
