// The KV-cache dtype registry: the one place where dtype names exist.
//
// Everything below the command line switches on `KvDtype`; names and aliases are
// parsed and formatted here only, so an alias can never be forgotten by one
// code path (a bug class seen elsewhere: "bfloat16: unsupported data type").
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kvq {

// Append-only: values are stable and may appear in saved plans.
enum class KvDtype : uint8_t {
  kAuto = 0,  // "use the checkpoint's scheme, else the model's dtype"; resolved by the planner
  kFloat16,
  kBFloat16,
  kFloat32,
  kFp8E4M3,
  kFp8E5M2,
  kInt8PerTokenHead,
  kFp8PerTokenHead,
  kInt4PerTokenHead,
  kNvfp4,
};
inline constexpr int kNumKvDtypes = 10;

enum class ScaleKind : uint8_t {
  kNone,          // values stored as they are
  kPerTensor,     // one fp32 scale per layer and side (optionally one per kv head)
  kPerTokenHead,  // a dynamic scale per (token, kv head), computed when written
  kPerBlock16,    // one fp8 e4m3 scale per 16 elements, plus a per-tensor fp32 scale
};

struct KvDtypeTraits {
  KvDtype dtype;
  std::string_view name;                    // canonical name (vLLM spelling)
  std::array<std::string_view, 2> aliases;  // "" marks an unused slot
  int bits;                                 // bits per stored value (0 for auto)
  // Storage is a sequence of groups along head_dim: `elems_per_group` values in
  // `bytes_per_group` bytes (2 int4 values per byte; 16 fp4 values + 1 e4m3 scale).
  int elems_per_group;
  int bytes_per_group;
  // Bytes of per-(token, kv head) metadata stored beside the values in a block:
  // an fp32 scale (int8 / fp8 per token-head) or fp16 scale + fp16 zero point (int4).
  int row_scale_bytes;
  ScaleKind scale_kind;
  bool uses_tensor_scale;  // dequantization also multiplies by a per-tensor (per-head) scale
  bool quantized;
  bool rotated;  // values are stored after a fixed randomized Hadamard rotation along head_dim
  bool valid_as_k;
  bool valid_as_v;
  bool concrete;  // false only for kAuto
  std::string_view summary;
};

inline constexpr std::array<KvDtypeTraits, kNumKvDtypes> kKvDtypeTraits = {{
    {KvDtype::kAuto, "auto", {"", ""}, 0, 1, 0, 0, ScaleKind::kNone, false, false, false, true,
     true, false, "checkpoint's KV scheme if it declares one, else the model's dtype"},
    {KvDtype::kFloat16, "float16", {"fp16", "half"}, 16, 1, 2, 0, ScaleKind::kNone, false, false,
     false, true, true, true, "IEEE half precision"},
    {KvDtype::kBFloat16, "bfloat16", {"bf16", ""}, 16, 1, 2, 0, ScaleKind::kNone, false, false,
     false, true, true, true, "bfloat16"},
    {KvDtype::kFloat32, "float32", {"fp32", ""}, 32, 1, 4, 0, ScaleKind::kNone, false, false,
     false, true, true, true, "IEEE single precision"},
    {KvDtype::kFp8E4M3, "fp8_e4m3", {"fp8", ""}, 8, 1, 1, 0, ScaleKind::kPerTensor, true, true,
     false, true, true, true, "FP8 E4M3 (OCP, max 448) with a per-tensor scale"},
    {KvDtype::kFp8E5M2, "fp8_e5m2", {"", ""}, 8, 1, 1, 0, ScaleKind::kPerTensor, true, true,
     false, true, true, true, "FP8 E5M2 (max 57344) with a per-tensor scale"},
    {KvDtype::kInt8PerTokenHead, "int8_per_token_head", {"", ""}, 8, 1, 1, 4,
     ScaleKind::kPerTokenHead, false, true, false, true, true, true,
     "INT8 symmetric, dynamic fp32 scale per (token, kv head)"},
    {KvDtype::kFp8PerTokenHead, "fp8_per_token_head", {"", ""}, 8, 1, 1, 4,
     ScaleKind::kPerTokenHead, false, true, false, true, true, true,
     "FP8 E4M3, dynamic fp32 scale per (token, kv head)"},
    {KvDtype::kInt4PerTokenHead, "int4_per_token_head", {"", ""}, 4, 2, 1, 4,
     ScaleKind::kPerTokenHead, false, true, true, true, true, true,
     "INT4 asymmetric (fp16 scale + zero) per (token, kv head), Hadamard-rotated"},
    {KvDtype::kNvfp4, "nvfp4", {"", ""}, 4, 16, 9, 0, ScaleKind::kPerBlock16, true, true, false,
     true, true, true, "FP4 E2M1, e4m3 scale per 16 values, per-tensor fp32 scale"},
}};

constexpr const KvDtypeTraits& traits(KvDtype d) { return kKvDtypeTraits[static_cast<size_t>(d)]; }

// Every table row sits at its enum's index.
constexpr bool kv_dtype_table_is_consistent() {
  for (size_t i = 0; i < kKvDtypeTraits.size(); ++i)
    if (static_cast<size_t>(kKvDtypeTraits[i].dtype) != i) return false;
  return true;
}
static_assert(kv_dtype_table_is_consistent());

constexpr std::string_view to_string(KvDtype d) { return traits(d).name; }
constexpr bool is_quantized(KvDtype d) { return traits(d).quantized; }

// Bytes of one (token, kv head) row of values, scales stored per group included,
// per-row metadata (`row_scale_bytes`) excluded. head_dim must be storable
// (see head_dim_unsupported_reason).
constexpr size_t row_data_bytes(KvDtype d, int head_dim) {
  const auto& t = traits(d);
  return static_cast<size_t>(head_dim / t.elems_per_group) * static_cast<size_t>(t.bytes_per_group);
}
constexpr size_t row_scale_bytes(KvDtype d) { return static_cast<size_t>(traits(d).row_scale_bytes); }

// Empty when `head_dim` can be stored in dtype `d`; otherwise why not.
std::string head_dim_unsupported_reason(KvDtype d, int head_dim);

// Parses a name or alias. Returns nullopt for anything else.
std::optional<KvDtype> parse_kv_dtype(std::string_view name);

// Parses a name or alias, or throws kvq::InputError naming `what` (e.g. "--kv-cache-dtype"),
// the bad value and every accepted name. Names other engines accept but kvq does not
// (fp8_inc, fp8_ds_mla, nvfp4_ds_mla, turboquant_*) get a message saying so.
KvDtype parse_kv_dtype_or_throw(std::string_view name, std::string_view what);

// "auto, float16 (fp16, half), bfloat16 (bf16), ..." built from the table.
std::string accepted_kv_dtype_names();

// The storage dtype that keeps a model's activations unquantized: the model's own
// torch dtype (float16, bfloat16 or float32).
std::optional<KvDtype> kv_dtype_from_torch_dtype(std::string_view torch_dtype);

}  // namespace kvq
