// Helpers shared by the cache tests.
#pragma once

#include <random>
#include <string>

#include "kvq/core/kv_dtype.h"
#include "kvq/plan/layer_kv_spec.h"

namespace kvq::test {

inline unsigned fresh_seed() {
  return std::random_device{}();
}
inline std::string seed_note(unsigned seed) {
  return "seed " + std::to_string(seed);
}

// A valid spec for one layer; per-tensor scales (one per kv head) for dtypes that use them.
inline LayerKvSpec make_spec(int layer, KvDtype k, KvDtype v, int num_kv_heads, int head_dim_k,
                             int head_dim_v, int block_tokens) {
  LayerKvSpec s;
  s.layer = layer;
  s.k_dtype = k;
  s.v_dtype = v;
  s.num_kv_heads = num_kv_heads;
  s.num_q_heads = 2 * num_kv_heads;
  s.head_dim_k = head_dim_k;
  s.head_dim_v = head_dim_v;
  s.block_tokens = block_tokens;
  for (KvSide side : {KvSide::kK, KvSide::kV}) {
    ScaleSource& sc = side == KvSide::kK ? s.k_scale : s.v_scale;
    if (traits(s.dtype(side)).uses_tensor_scale) {
      sc.kind = ScaleSourceKind::kCheckpoint;
      for (int h = 0; h < num_kv_heads; ++h) sc.values.push_back(0.05f + 0.03f * h);
    } else if (traits(s.dtype(side)).scale_kind == ScaleKind::kPerTokenHead) {
      sc.kind = ScaleSourceKind::kDynamic;
    }
  }
  return s;
}

}  // namespace kvq::test
