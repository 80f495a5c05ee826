// Greedy drafts a proposer leaves on its drafter's device for the target's next pass to read
// there (Draft::on_device, ForwardBatch::token_source): drafting and verification then run back
// to back on the device with one host round trip for both. Shared by the model-based proposers.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <span>
#include <string_view>
#include <vector>

#include "kvq/engine/speculative.h"

namespace kvq {

class DeferredDrafts {
 public:
  // Whether this propose() may leave greedy drafts on `drafter`'s device: the requests name a
  // target that reads them there, and KVQ_SPEC_DEFER is not 0 (an A/B switch for benchmarks).
  static bool allowed(const Model& drafter, std::span<const DraftRequest> requests) {
    static const bool on = [] {
      const char* e = std::getenv("KVQ_SPEC_DEFER");
      return e == nullptr || std::string_view(e) != "0";
    }();
    if (!on || requests.empty() || requests.front().target == nullptr) return false;
    for (const DraftRequest& r : requests)
      if (r.target != requests.front().target || !r.sampler->greedy()) return false;
    return requests.front().target->accepts_tokens_from(drafter);
  }

  // A propose() starts: drafts of an earlier one that were never collected (an exception
  // between propose and collect) are given up, after their work is done (it may still read
  // the target's buffers, and the target's next pass would not wait for it).
  void reset() {
    if (source_ != nullptr) source_->drop_deferred();
    source_ = nullptr, n_ = 0;
  }
  // `n` ids were deferred on `drafter` (forward_sample_deferred, a deferred greedy chain).
  void start(const Model* drafter, int n) { source_ = drafter, n_ = n; }
  const Model* source() const { return source_; }

  // Proposer::collect: the deferred ids into every on-device draft, then `each(ids)` with all
  // of them for the caller's own bookkeeping.
  template <typename Each>
  void collect(std::span<Draft* const> drafts, Each&& each) {
    if (source_ == nullptr) return;
    ids_.resize(static_cast<size_t>(n_));
    const Model* source = source_;
    source_ = nullptr, n_ = 0;
    source->collect_sampled(ids_);
    for (Draft* d : drafts) {
      if (d == nullptr || !d->on_device) continue;
      for (size_t j = 0; j < d->tokens.size(); ++j)
        d->tokens[j] =
            ids_.at(static_cast<size_t>(d->device_row) + j * static_cast<size_t>(d->device_stride));
      d->on_device = false;
    }
    each(std::span<const int32_t>(ids_));
  }

 private:
  const Model* source_ = nullptr;
  int n_ = 0;
  std::vector<int32_t> ids_;
};

}  // namespace kvq
