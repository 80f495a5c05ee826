// Paged KV storage in CUDA device memory (built only with KVQ_CUDA).
//
// Each layer's K and V storage is one cudaMalloc allocation with exactly the byte layout of
// the CPU cache (KvSideLayout): a LayerCacheView of this cache differs from PagedKvCache's
// only in that its base pointers are device pointers, so block ids, BlockTableView and every
// offset computation are shared. Block allocation and sequences stay on the host
// (BlockAllocator / PagedKvCache bookkeeping); this class only owns device bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/cache/paged_kv_cache.h"
#include "kvq/plan/layer_kv_spec.h"

struct CUstream_st;  // cudaStream_t without including the CUDA runtime here

namespace kvq {

// Number of CUDA devices usable by this process; 0 (never an exception) when there is no
// device or no driver.
int cuda_device_count();

class DeviceKvCache {
 public:
  // All specs must share block_tokens. Allocates num_blocks blocks per layer and side with
  // cudaMalloc and fills them with 0xFF bytes (the CPU cache's poison: every dtype decodes an
  // unwritten row to NaN). Throws InternalError on a bad spec or a CUDA failure.
  DeviceKvCache(std::vector<LayerKvSpec> layers, int32_t num_blocks);
  ~DeviceKvCache();
  DeviceKvCache(const DeviceKvCache&) = delete;
  DeviceKvCache& operator=(const DeviceKvCache&) = delete;

  size_t num_layers() const { return layers_.size(); }
  const LayerKvSpec& spec(size_t layer_slot) const { return layers_[layer_slot]; }
  int32_t num_blocks() const { return num_blocks_; }
  int32_t block_tokens() const { return block_tokens_; }
  // The view of one layer; k_base / v_base are device pointers.
  LayerCacheView layer_view(size_t layer_slot) const;
  // Bytes allocated for one side of one layer: num_blocks * layout(side).block_bytes.
  size_t storage_bytes(size_t layer_slot, KvSide side) const;
  size_t bytes_allocated() const;

 private:
  void release() noexcept;

  std::vector<LayerKvSpec> layers_;
  int32_t num_blocks_ = 0;
  int32_t block_tokens_ = 0;
  std::vector<std::byte*> k_storage_, v_storage_;
  std::vector<size_t> k_bytes_, v_bytes_;
};

// The device twin of write_kv_reference: quantizes n tokens of K and V (fp32, device memory,
// [n][num_kv_heads][head_dim]) into `cache` (a device view) at `slots` (device memory),
// bit-identical to the reference codecs. A negative slot is skipped (padding); slots past
// the view's blocks are skipped too, so a bad slot can never write outside the storage.
// Where write_kv_reference throws on such a slot, a kernel cannot: pass `bad_token` (device
// memory for one uint64_t) and the call resets it on `stream` and records the lowest token
// whose slot was out of range; check_write_kv_cuda then reports it. Asynchronous on `stream`.
// head_dim must be 64, 128 or 256 on both sides.
void write_kv_cuda(const LayerKvSpec& spec, const LayerCacheView& cache, const int64_t* slots,
                   int64_t n, const float* k, const float* v, CUstream_st* stream = nullptr,
                   uint64_t* bad_token = nullptr);

// Synchronizes `stream` and throws InternalError (like write_kv_reference: slots come from
// the host's own bookkeeping) naming the slot and token, if the write_kv_cuda call that was
// given `bad_token` skipped an out-of-range slot. `slots` is that call's device array.
void check_write_kv_cuda(const LayerCacheView& cache, const int64_t* slots,
                         const uint64_t* bad_token, CUstream_st* stream = nullptr);

}  // namespace kvq
