#include "kvq/plan/layer_kv_spec.h"

#include <string>

namespace kvq {

namespace {
constexpr size_t align16(size_t n) { return (n + 15) & ~size_t{15}; }
}  // namespace

KvSideLayout KvSideLayout::make(KvDtype dtype, int num_kv_heads, int head_dim, int block_tokens) {
  KvSideLayout l;
  l.dtype = dtype;
  l.num_kv_heads = num_kv_heads;
  l.head_dim = head_dim;
  l.block_tokens = block_tokens;
  l.row_data_bytes = kvq::row_data_bytes(dtype, head_dim);
  l.row_scale_bytes = kvq::row_scale_bytes(dtype);
  l.values_bytes = align16(static_cast<size_t>(block_tokens) * l.row_data_bytes);
  l.head_stride = l.values_bytes + align16(static_cast<size_t>(block_tokens) * l.row_scale_bytes);
  l.block_bytes = static_cast<size_t>(num_kv_heads) * l.head_stride;
  return l;
}

size_t LayerKvSpec::bytes_per_token() const {
  auto side = [&](KvSide s) {
    return static_cast<size_t>(num_kv_heads) *
           (row_data_bytes(dtype(s), head_dim(s)) + row_scale_bytes(dtype(s)));
  };
  return side(KvSide::kK) + side(KvSide::kV);
}

std::vector<std::string> LayerKvSpec::validation_errors() const {
  std::vector<std::string> errors;
  const std::string where = "layer " + std::to_string(layer) + ": ";
  if (num_kv_heads <= 0 || num_q_heads <= 0)
    errors.push_back(where + "head counts must be positive");
  else if (num_q_heads % num_kv_heads != 0)
    errors.push_back(where + "num_q_heads " + std::to_string(num_q_heads) +
                     " is not a multiple of num_kv_heads " + std::to_string(num_kv_heads));
  if (block_tokens <= 0) errors.push_back(where + "block_tokens must be positive");
  if (attention == AttentionKind::kSlidingWindow && sliding_window <= 0)
    errors.push_back(where + "sliding window layer without a positive window");
  for (KvSide s : {KvSide::kK, KvSide::kV}) {
    const KvDtype d = dtype(s);
    const auto& t = traits(d);
    if (!t.concrete) {
      errors.push_back(where + std::string(to_string(s)) + " dtype is unresolved (auto)");
      continue;
    }
    if (s == KvSide::kK ? !t.valid_as_k : !t.valid_as_v)
      errors.push_back(where + std::string(t.name) + " is not valid as " +
                       std::string(to_string(s)));
    if (auto r = head_dim_unsupported_reason(d, head_dim(s)); !r.empty())
      errors.push_back(where + std::string(to_string(s)) + ": " + r);
    const ScaleSource& sc = scale(s);
    if (t.uses_tensor_scale && sc.values.size() != 1 &&
        sc.values.size() != static_cast<size_t>(num_kv_heads))
      errors.push_back(where + std::string(to_string(s)) +
                       " needs 1 or num_kv_heads per-tensor scales");
  }
  return errors;
}

}  // namespace kvq
