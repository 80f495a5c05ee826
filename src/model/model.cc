// Model's default cache: host storage over the plan's layers.
#include <memory>

#include "kvq/model/model.h"

namespace kvq {

std::unique_ptr<PagedKvCache> Model::create_cache(int32_t num_blocks) const {
  return std::make_unique<PagedKvCache>(plan().layers, num_blocks);
}

}  // namespace kvq
