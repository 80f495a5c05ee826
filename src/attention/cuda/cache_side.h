// The per-side (K or V) cache description the CUDA attention kernels take, filled from a
// layer's cache view: one definition for the decode, prefill and generic kernels' side structs
// (each carries the fields its kernel reads; the optional ones are filled when present).
#pragma once

#include <cstdint>

#include "kvq/cache/paged_kv_cache.h"
#include "kvq/plan/layer_kv_spec.h"

namespace kvq::cuda {

template <class Side>
Side make_cache_side(const LayerKvSpec& spec, const LayerCacheView& cache, KvSide s) {
  const KvSideLayout& l = cache.layout(s);
  Side d{};
  d.base = reinterpret_cast<const uint8_t*>(cache.base(s));
  d.block_bytes = l.block_bytes;
  d.head_stride = l.head_stride;
  d.values_bytes = l.values_bytes;
  if constexpr (requires { d.row_bytes; }) {
    d.row_bytes = l.row_data_bytes;
    d.row_scale_bytes = l.row_scale_bytes;
  }
  if constexpr (requires { d.head_dim; }) d.head_dim = l.head_dim;
  const bool tensor_scaled = traits(l.dtype).uses_tensor_scale;
  for (int h = 0; h < spec.num_kv_heads; ++h)
    d.tensor_scale[h] = tensor_scaled ? spec.scale(s).for_head(h) : 1.0f;
  return d;
}

}  // namespace kvq::cuda
