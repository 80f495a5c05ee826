// LayerKvSpec: everything below the planner knows about one attention layer's
// KV cache. There is no global cache dtype: a cache, a backend, a kernel only
// ever sees the spec of the layer it works on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/core/kv_dtype.h"

namespace kvq {

enum class KvSide : uint8_t { kK = 0, kV = 1 };
constexpr std::string_view to_string(KvSide s) { return s == KvSide::kK ? "K" : "V"; }

enum class AttentionKind : uint8_t {
  kCausal,         // full causal attention
  kSlidingWindow,  // causal, each query sees the last `sliding_window` positions (itself included)
  kNonCausal,      // new queries see the whole cache and each other (block-diffusion drafters)
};
constexpr std::string_view to_string(AttentionKind k) {
  switch (k) {
    case AttentionKind::kCausal: return "causal";
    case AttentionKind::kSlidingWindow: return "sliding_window";
    case AttentionKind::kNonCausal: return "non_causal";
  }
  return "?";
}

enum class ScaleSourceKind : uint8_t {
  kNone,        // unquantized, or the scale is stored per group (nvfp4's block scales)
  kCheckpoint,  // per-tensor (or per-head) scales read from the checkpoint
  kDefaultOne,  // per-tensor scale 1.0 because the checkpoint had none (a warning was issued)
  kDynamic,     // computed per (token, kv head) when written
};
constexpr std::string_view to_string(ScaleSourceKind k) {
  switch (k) {
    case ScaleSourceKind::kNone: return "none";
    case ScaleSourceKind::kCheckpoint: return "checkpoint";
    case ScaleSourceKind::kDefaultOne: return "default_one";
    case ScaleSourceKind::kDynamic: return "dynamic";
  }
  return "?";
}

struct ScaleSource {
  ScaleSourceKind kind = ScaleSourceKind::kNone;
  std::string tensor;         // checkpoint tensor name (kCheckpoint only)
  std::vector<float> values;  // per-tensor scale: 1 value, or 1 per kv head; empty if unused

  // The dequantization scale for kv head `h` (1.0 where the source has none).
  float for_head(int h) const {
    if (values.empty()) return 1.0f;
    return values.size() == 1 ? values[0] : values[static_cast<size_t>(h)];
  }
};

// Byte layout of one side (K or V) of one layer within one cache block.
// A block holds `block_tokens` tokens of every kv head, head-major:
//   for each kv head h, at h * head_stride:
//     values:  block_tokens rows of row_data_bytes   (rows contiguous)
//     metadata at values_bytes: block_tokens rows of row_scale_bytes (per-token-head scales)
// Both regions start 16-byte aligned, so kernels can use 16-byte loads.
struct KvSideLayout {
  KvDtype dtype = KvDtype::kFloat32;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 0;
  size_t row_data_bytes = 0;
  size_t row_scale_bytes = 0;
  size_t values_bytes = 0;  // aligned size of one head's value rows
  size_t head_stride = 0;   // bytes from one kv head to the next within a block
  size_t block_bytes = 0;   // bytes of this side of one block

  static KvSideLayout make(KvDtype dtype, int num_kv_heads, int head_dim, int block_tokens);

  size_t value_offset(int head, int token_in_block) const {
    return static_cast<size_t>(head) * head_stride +
           static_cast<size_t>(token_in_block) * row_data_bytes;
  }
  size_t scale_offset(int head, int token_in_block) const {
    return static_cast<size_t>(head) * head_stride + values_bytes +
           static_cast<size_t>(token_in_block) * row_scale_bytes;
  }
};

struct LayerKvSpec {
  int layer = 0;  // index among the model's decoder layers
  KvDtype k_dtype = KvDtype::kBFloat16;
  KvDtype v_dtype = KvDtype::kBFloat16;
  ScaleSource k_scale;
  ScaleSource v_scale;
  AttentionKind attention = AttentionKind::kCausal;
  int sliding_window = 0;  // tokens, for kSlidingWindow
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim_k = 0;
  int head_dim_v = 0;
  int block_tokens = 16;
  KvDtype model_dtype = KvDtype::kBFloat16;  // the model's activation dtype (float16/bfloat16/float32)

  KvDtype dtype(KvSide s) const { return s == KvSide::kK ? k_dtype : v_dtype; }
  const ScaleSource& scale(KvSide s) const { return s == KvSide::kK ? k_scale : v_scale; }
  int head_dim(KvSide s) const { return s == KvSide::kK ? head_dim_k : head_dim_v; }
  int gqa_ratio() const { return num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0; }

  KvSideLayout layout(KvSide s) const {
    return KvSideLayout::make(dtype(s), num_kv_heads, head_dim(s), block_tokens);
  }
  // Exact bytes one token occupies in this layer (K + V, per-token-head metadata included,
  // block alignment padding excluded).
  size_t bytes_per_token() const;
  // Bytes of one cache block of this layer (K side + V side, padding included).
  size_t block_bytes() const { return layout(KvSide::kK).block_bytes + layout(KvSide::kV).block_bytes; }

  // Empty when the spec is internally consistent; otherwise what is wrong.
  std::vector<std::string> validation_errors() const;
};

}  // namespace kvq
