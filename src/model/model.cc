// Model's defaults: a cache in host storage over the plan's layers; no device sampling.
#include <memory>

#include "kvq/core/error.h"
#include "kvq/model/model.h"

namespace kvq {

std::unique_ptr<PagedKvCache> Model::create_cache(int32_t num_blocks) const {
  return std::make_unique<PagedKvCache>(plan().layers, num_blocks);
}

void Model::forward_sample(const ForwardBatch&, PagedKvCache&, std::span<const DeviceSampling>,
                           std::span<int32_t>) const {
  throw InternalError("forward_sample called on a model that samples on the host");
}

void Model::write_feature_kv(std::span<const float>, std::span<const int32_t>,
                             std::span<const int64_t>, PagedKvCache&) const {
  throw InternalError("write_feature_kv called on a model that is not a DFlash drafter");
}

void Model::write_feature_kv_from_target(const Model&, std::span<const int32_t>,
                                         std::span<const int32_t>, std::span<const int64_t>,
                                         PagedKvCache&) const {
  throw InternalError(
      "write_feature_kv_from_target called on a model that cannot read its target's features");
}

}  // namespace kvq
