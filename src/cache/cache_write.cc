// Reference cache write: quantizes K/V rows with the scalar codecs and stores them at
// their slots. The ground truth that faster writers (CPU SIMD, CUDA) must match bit for bit.
#include <string>

#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/quant/codec.h"

namespace kvq {

void write_kv_reference(const LayerKvSpec& spec, const LayerCacheView& cache,
                        std::span<const int64_t> slots, const float* k, const float* v) {
  const int block_tokens = spec.block_tokens;
  KVQ_CHECK(block_tokens > 0, "write_kv_reference: block_tokens must be positive");
  for (KvSide s : {KvSide::kK, KvSide::kV}) {
    const KvSideLayout& l = cache.layout(s);
    KVQ_CHECK(l.dtype == spec.dtype(s) && l.num_kv_heads == spec.num_kv_heads &&
                  l.head_dim == spec.head_dim(s) && l.block_tokens == block_tokens,
              "write_kv_reference: layer " + std::to_string(spec.layer) + " " +
                  std::string(to_string(s)) + " view layout does not match the spec");
  }
  const int64_t num_slots = static_cast<int64_t>(cache.num_blocks) * block_tokens;
  for (size_t t = 0; t < slots.size(); ++t) {
    const int64_t slot = slots[t];
    KVQ_CHECK(slot >= 0 && slot < num_slots,
              "write_kv_reference: slot " + std::to_string(slot) + " of token " +
                  std::to_string(t) + " out of range (" + std::to_string(num_slots) + " slots)");
    const auto block = static_cast<int32_t>(slot / block_tokens);
    const auto off = static_cast<int>(slot % block_tokens);
    for (KvSide s : {KvSide::kK, KvSide::kV}) {
      const KvSideLayout& l = cache.layout(s);
      const float* src = s == KvSide::kK ? k : v;
      std::byte* block_base = cache.block(s, block);
      for (int h = 0; h < spec.num_kv_heads; ++h) {
        const float* row =
            src + (t * static_cast<size_t>(spec.num_kv_heads) + static_cast<size_t>(h)) *
                      static_cast<size_t>(l.head_dim);
        std::byte* meta = l.row_scale_bytes == 0 ? nullptr : block_base + l.scale_offset(h, off);
        quant::encode_row(l.dtype, std::span<const float>(row, static_cast<size_t>(l.head_dim)),
                          spec.scale(s).for_head(h), block_base + l.value_offset(h, off), meta);
      }
    }
  }
}

}  // namespace kvq
