#include <limits>
#include <string>
#include <utility>

#include "cache/cuda/cuda_check.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"

namespace kvq {

namespace {

constexpr int kPoisonByte = 0xFF;

std::string layer_name(const LayerKvSpec& spec) {
  return "layer " + std::to_string(spec.layer);
}

void check_storable(const LayerKvSpec& spec, int block_tokens) {
  KVQ_CHECK(spec.block_tokens == block_tokens,
            "DeviceKvCache: " + layer_name(spec) + " has block_tokens " +
                std::to_string(spec.block_tokens) + ", the cache uses " +
                std::to_string(block_tokens));
  KVQ_CHECK(spec.num_kv_heads > 0, "DeviceKvCache: " + layer_name(spec) + " has no kv heads");
  for (KvSide s : {KvSide::kK, KvSide::kV}) {
    KVQ_CHECK(traits(spec.dtype(s)).concrete, "DeviceKvCache: " + layer_name(spec) + " " +
                                                  std::string(to_string(s)) +
                                                  " dtype is unresolved");
    const std::string reason = head_dim_unsupported_reason(spec.dtype(s), spec.head_dim(s));
    KVQ_CHECK(reason.empty(), "DeviceKvCache: " + layer_name(spec) + " " +
                                  std::string(to_string(s)) + ": " + reason);
  }
}

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error for later calls
    return 0;
  }
  return n;
}

DeviceKvCache::DeviceKvCache(std::vector<LayerKvSpec> layers, int32_t num_blocks)
    : layers_(std::move(layers)), num_blocks_(num_blocks) {
  KVQ_CHECK(!layers_.empty(), "DeviceKvCache: no layers");
  KVQ_CHECK(num_blocks_ >= 0, "DeviceKvCache: negative block count");
  block_tokens_ = layers_.front().block_tokens;
  KVQ_CHECK(block_tokens_ > 0,
            "DeviceKvCache: block_tokens must be positive, got " + std::to_string(block_tokens_));
  try {
    for (const LayerKvSpec& spec : layers_) {
      check_storable(spec, block_tokens_);
      for (KvSide s : {KvSide::kK, KvSide::kV}) {
        const size_t block_bytes = spec.layout(s).block_bytes;
        const auto n = static_cast<size_t>(num_blocks_);
        KVQ_CHECK(n == 0 || block_bytes <= std::numeric_limits<size_t>::max() / n,
                  "DeviceKvCache: storage size overflows");
        const size_t bytes = n * block_bytes;
        void* p = nullptr;
        // cudaMalloc(0) may return null; allocate at least one byte so views stay non-null.
        KVQ_CUDA_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 1));
        (s == KvSide::kK ? k_storage_ : v_storage_).push_back(static_cast<std::byte*>(p));
        (s == KvSide::kK ? k_bytes_ : v_bytes_).push_back(bytes);
        KVQ_CUDA_CHECK(cudaMemset(p, kPoisonByte, bytes));
      }
    }
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (...) {
    release();
    throw;
  }
}

DeviceKvCache::~DeviceKvCache() {
  release();
}

void DeviceKvCache::release() noexcept {
  // Freeing can only fail if the context is already broken; nothing useful to do then.
  for (std::byte* p : k_storage_) (void)cudaFree(p);
  for (std::byte* p : v_storage_) (void)cudaFree(p);
  k_storage_.clear();
  v_storage_.clear();
}

LayerCacheView DeviceKvCache::layer_view(size_t layer_slot) const {
  KVQ_CHECK(layer_slot < layers_.size(), "DeviceKvCache::layer_view: layer slot " +
                                             std::to_string(layer_slot) + " out of range (" +
                                             std::to_string(layers_.size()) + " layers)");
  const LayerKvSpec& spec = layers_[layer_slot];
  LayerCacheView view;
  view.k_base = k_storage_[layer_slot];
  view.v_base = v_storage_[layer_slot];
  view.k_layout = spec.layout(KvSide::kK);
  view.v_layout = spec.layout(KvSide::kV);
  view.num_blocks = num_blocks_;
  return view;
}

size_t DeviceKvCache::storage_bytes(size_t layer_slot, KvSide side) const {
  KVQ_CHECK(layer_slot < layers_.size(), "DeviceKvCache::storage_bytes: layer slot out of range");
  return side == KvSide::kK ? k_bytes_[layer_slot] : v_bytes_[layer_slot];
}

size_t DeviceKvCache::bytes_allocated() const {
  size_t total = 0;
  for (size_t i = 0; i < layers_.size(); ++i) total += k_bytes_[i] + v_bytes_[i];
  return total;
}

}  // namespace kvq
