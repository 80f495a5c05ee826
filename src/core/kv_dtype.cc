#include "kvq/core/kv_dtype.h"

#include <string>

#include "kvq/core/error.h"

namespace kvq {

namespace {

// Accepted by other engines, refused by kvq with a message that says so.
constexpr std::array<std::string_view, 3> kForeignNames = {"fp8_inc", "fp8_ds_mla",
                                                           "nvfp4_ds_mla"};
constexpr std::string_view kForeignPrefix = "turboquant_";

bool is_foreign_name(std::string_view name) {
  for (auto f : kForeignNames)
    if (name == f) return true;
  return name.substr(0, kForeignPrefix.size()) == kForeignPrefix;
}

constexpr bool is_power_of_two(int v) { return v > 0 && (v & (v - 1)) == 0; }

}  // namespace

std::optional<KvDtype> parse_kv_dtype(std::string_view name) {
  for (const auto& t : kKvDtypeTraits) {
    if (name == t.name) return t.dtype;
    for (auto alias : t.aliases)
      if (!alias.empty() && name == alias) return t.dtype;
  }
  return std::nullopt;
}

std::string accepted_kv_dtype_names() {
  std::string out;
  for (const auto& t : kKvDtypeTraits) {
    if (!out.empty()) out += ", ";
    out += t.name;
    std::string aliases;
    for (auto alias : t.aliases) {
      if (alias.empty()) continue;
      if (!aliases.empty()) aliases += ", ";
      aliases += alias;
    }
    if (!aliases.empty()) out += " (" + aliases + ")";
  }
  return out;
}

KvDtype parse_kv_dtype_or_throw(std::string_view name, std::string_view what) {
  if (auto d = parse_kv_dtype(name)) return *d;
  std::string msg(what);
  if (is_foreign_name(name)) {
    msg += ": '" + std::string(name) +
           "' is a KV cache dtype of other engines that kvq does not support; accepted: ";
  } else {
    msg += ": unknown KV cache dtype '" + std::string(name) + "'; accepted: ";
  }
  msg += accepted_kv_dtype_names();
  throw InputError(msg);
}

std::string head_dim_unsupported_reason(KvDtype d, int head_dim) {
  const auto& t = traits(d);
  if (head_dim <= 0) return "head_dim must be positive, got " + std::to_string(head_dim);
  if (head_dim % t.elems_per_group != 0)
    return std::string(t.name) + " stores head_dim in groups of " +
           std::to_string(t.elems_per_group) + " values; head_dim " + std::to_string(head_dim) +
           " is not a multiple";
  if (t.rotated && !is_power_of_two(head_dim))
    return std::string(t.name) +
           " applies a Hadamard rotation along head_dim, which needs a power of two; head_dim " +
           std::to_string(head_dim) + " is not";
  return {};
}

std::optional<KvDtype> kv_dtype_from_torch_dtype(std::string_view torch_dtype) {
  if (torch_dtype == "bfloat16" || torch_dtype == "torch.bfloat16") return KvDtype::kBFloat16;
  if (torch_dtype == "float16" || torch_dtype == "torch.float16" || torch_dtype == "half")
    return KvDtype::kFloat16;
  if (torch_dtype == "float32" || torch_dtype == "torch.float32" || torch_dtype == "float")
    return KvDtype::kFloat32;
  return std::nullopt;
}

}  // namespace kvq
