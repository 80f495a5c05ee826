// The KV planner: flags + config.json + the checkpoint's quantization config ->
// one LayerKvSpec per attention layer, with the provenance of every decision.
//
// Precedence per layer and side (K, V):
//   1. skip rule (--kv-cache-dtype-skip-layers): the model's own dtype, nothing else applies;
//   2. an explicit user dtype (-ctk/-ctv over --kv-cache-dtype) other than `auto`;
//   3. the checkpoint's declared KV scheme, only where the user left `auto`;
//   4. the model's dtype.
// This is the last place that knows about flags; below it only LayerKvSpec exists.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/core/kv_dtype.h"
#include "kvq/plan/layer_kv_spec.h"
#include "kvq/plan/model_config.h"

namespace kvq {

enum class Provenance : uint8_t { kUserFlag, kSkipRule, kCheckpointScheme, kModelDefault };
constexpr std::string_view to_string(Provenance p) {
  switch (p) {
    case Provenance::kUserFlag: return "user_flag";
    case Provenance::kSkipRule: return "skip_rule";
    case Provenance::kCheckpointScheme: return "checkpoint_scheme";
    case Provenance::kModelDefault: return "model_default";
  }
  return "?";
}

// A dtype the user asked for, with the flag spelling it came from (for provenance).
struct DtypeFlag {
  KvDtype dtype = KvDtype::kAuto;
  std::string flag;  // e.g. "--kv-cache-dtype fp8" or "-ctk int8_per_token_head"
};

struct KvPlanOptions {
  std::optional<DtypeFlag> kv;  // --kv-cache-dtype
  std::optional<DtypeFlag> k;   // --k-cache-dtype / -ctk
  std::optional<DtypeFlag> v;   // --v-cache-dtype / -ctv
  std::string skip_layers;      // --kv-cache-dtype-skip-layers, raw text ("" = none)
  int block_tokens = 16;        // --block-size
};

// The KV scheme a checkpoint declares (compressed-tensors kv_cache_scheme in config.json,
// or ModelOpt's kv_cache_quant_algo in hf_quant_config.json / config.json).
struct CheckpointKvScheme {
  KvDtype dtype = KvDtype::kFp8E4M3;
  bool per_head_scales = false;  // compressed-tensors strategy "attn_head"
  std::string description;       // e.g. "config.json quantization_config.kv_cache_scheme (float, 8 bits, tensor)"
  std::string unsupported;       // non-empty: kvq cannot run this scheme, and why
};

// Reads the declared scheme, if any (nullopt: none declared). A scheme kvq cannot run comes
// back with `unsupported` set; the planner refuses it only where a layer left `auto` would use
// it. Throws InputError for a malformed hf_quant_config.json.
std::optional<CheckpointKvScheme> read_checkpoint_kv_scheme(const ModelConfig& config);

struct SideDecision {
  Provenance provenance = Provenance::kModelDefault;
  std::string detail;  // e.g. "--kv-cache-dtype fp8", "model dtype bfloat16"
};

struct LayerDecision {
  SideDecision k, v;
};

struct KvPlan {
  ModelConfig model;
  std::vector<LayerKvSpec> layers;       // one per decoder layer, index = layer
  std::vector<LayerDecision> decisions;  // parallel to layers
  std::vector<std::string> warnings;
  std::vector<std::string> notes;

  size_t bytes_per_token() const;       // all layers, K + V, metadata included
  size_t bf16_bytes_per_token() const;  // the same model with a bfloat16 cache
};

// Layer indices selected by a skip-layers spec: comma-separated indices ("3"), ranges ("0-3"),
// "sliding_window" (every sliding-window layer), "boundary:N" (first and last N layers).
// Throws InputError naming --kv-cache-dtype-skip-layers for malformed items or indices out of
// range. Returns one flag per layer.
std::vector<bool> parse_skip_layers(std::string_view spec, const ModelConfig& config);

// Builds the plan. Reads and validates every safetensors header of the checkpoint (when the
// model has a directory), and the scale tensors of layers that use per-tensor scales; never the
// weights. Throws InputError on bad flags or files.
KvPlan make_kv_plan(const ModelConfig& config, const KvPlanOptions& options);

// `kvq plan --json` (schema in docs/CLI.md) and the human-readable table.
nlohmann::json kv_plan_to_json(const KvPlan& plan);
std::string format_kv_plan(const KvPlan& plan);
// One line: "K/V fp8_e4m3 x5 (layer 0: bfloat16), 1.82 KiB/token (0.50x bf16)".
std::string summarize_kv_plan(const KvPlan& plan);

}  // namespace kvq
