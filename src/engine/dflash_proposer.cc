// The dflash proposer (docs/notes/dflash.md): context K/V written from the target's features as
// the target keeps positions; each step one drafter pass over every sequence's block
// [last token, mask x k] at positions s..s+k (non-causal), whose rows 1..k are the drafts; the
// block's slots are rolled back after the pass.
#include <algorithm>
#include <unordered_map>

#include "kvq/core/error.h"
#include "kvq/engine/speculative.h"

namespace kvq {

namespace {

class DflashProposer final : public Proposer {
 public:
  DflashProposer(std::shared_ptr<const Model> drafter, int32_t num_blocks)
      : drafter_(std::move(drafter)), cache_(drafter_->create_cache(num_blocks)) {
    const auto& dc = drafter_->arch().dflash;
    KVQ_CHECK(dc.has_value(), "make_dflash_proposer: the model is not a DFlash drafter");
    layers_ = dc->target_layer_ids;
    feature_size_ = layers_.size() * static_cast<size_t>(dc->target_hidden_size);
    max_k_ = dc->max_speculative_tokens;
  }

  SpecMethod method() const override { return SpecMethod::kDflash; }
  std::span<const int32_t> target_layers() const override { return layers_; }

  void release(uint64_t seq) override {
    const SequenceId id = static_cast<SequenceId>(seq);
    if (cache_->has_sequence(id)) cache_->free_sequence(id);
    state_.erase(seq);
  }

  void on_target_features(uint64_t seq, int32_t first, int32_t n,
                          std::span<const float> features) override {
    if (n <= 0) return;
    KVQ_CHECK(features.size() == static_cast<size_t>(n) * feature_size_,
              "DflashProposer: features of the wrong size");
    State& st = state_[seq];
    if (first != st.context + st.pending) {
      st.broken = true;  // a gap (prefix-cache hit) or a repeat: no drafts for this sequence
      return;
    }
    st.features.insert(st.features.end(), features.begin(), features.end());
    st.pending += n;
  }

  void propose(std::span<const DraftRequest> requests, std::span<Draft> out) override {
    KVQ_CHECK(out.size() == requests.size(), "DflashProposer: one draft per request");
    // 1. Context K/V of the positions the target kept since the last step, all sequences at once.
    std::vector<float> features;
    std::vector<int32_t> positions;
    std::vector<int64_t> slots;
    std::vector<size_t> active;
    for (size_t r = 0; r < requests.size(); ++r) {
      out[r].tokens.clear();
      out[r].q.clear();
      const DraftRequest& q = requests[r];
      auto it = state_.find(q.seq);
      if (q.max_drafts <= 0 || it == state_.end() || it->second.broken) continue;
      State& st = it->second;
      const SequenceId id = static_cast<SequenceId>(q.seq);
      if (!cache_->has_sequence(id)) cache_->add_sequence(id);
      // Every position before the last token needs its features.
      if (static_cast<size_t>(st.context + st.pending) + 1 != q.tokens.size()) continue;
      if (st.pending > 0) {
        std::vector<int64_t> s = cache_->append(id, st.pending);
        if (s.empty()) continue;  // no blocks: no drafts this step (the features wait)
        slots.insert(slots.end(), s.begin(), s.end());
        for (int32_t p = 0; p < st.pending; ++p) positions.push_back(st.context + p);
        features.insert(features.end(), st.features.begin(), st.features.end());
        st.context += st.pending;
        st.pending = 0;
        st.features.clear();
      }
      active.push_back(r);
    }
    if (!positions.empty()) drafter_->write_feature_kv(features, positions, slots, *cache_);

    // 2. One pass over every block.
    std::vector<int32_t> tokens, pos, q_indptr{0}, rows;
    std::vector<int64_t> block_slots;
    std::vector<SequenceId> ids;
    std::vector<size_t> ran;
    for (size_t r : active) {
      const DraftRequest& q = requests[r];
      const State& st = state_[q.seq];
      const int32_t k = std::min(q.max_drafts, max_k_);
      const SequenceId id = static_cast<SequenceId>(q.seq);
      std::vector<int64_t> s = cache_->append(id, k + 1);
      if (s.empty()) continue;
      block_slots.insert(block_slots.end(), s.begin(), s.end());
      const int32_t row0 = static_cast<int32_t>(tokens.size());
      tokens.push_back(q.tokens.back());
      for (int32_t j = 1; j <= k; ++j) tokens.push_back(kMaskToken);
      for (int32_t j = 0; j <= k; ++j) pos.push_back(st.context + j);
      for (int32_t j = 1; j <= k; ++j) rows.push_back(row0 + j);
      q_indptr.push_back(static_cast<int32_t>(tokens.size()));
      ids.push_back(id);
      ran.push_back(r);
    }
    if (ran.empty()) return;
    PagedKvCache::BlockTableStorage storage;
    const ForwardBatch fb{tokens, pos, q_indptr, block_slots, cache_->block_table(ids, storage),
                          rows};
    const size_t vocab = static_cast<size_t>(drafter_->vocab_size());
    // All greedy on a device that samples: only the argmax ids cross to the host.
    bool all_greedy = drafter_->samples_on_device();
    for (size_t r : ran) all_greedy = all_greedy && requests[r].sampler->greedy();
    if (all_greedy) {
      ids_.resize(rows.size());
      const DeviceSampling argmax[1] = {DeviceSampling{}};
      drafter_->forward_sample(fb, *cache_, argmax, ids_);
    } else {
      logits_.resize(rows.size() * vocab);
      drafter_->forward(fb, *cache_, logits_);
    }
    size_t row = 0;
    for (size_t i = 0; i < ran.size(); ++i) {
      const DraftRequest& q = requests[ran[i]];
      Draft& d = out[ran[i]];
      const int32_t k = q_indptr[i + 1] - q_indptr[i] - 1;
      for (int32_t j = 0; j < k; ++j, ++row) {
        if (all_greedy) {
          d.tokens.push_back(ids_[row]);
          continue;
        }
        const std::span<const float> l(logits_.data() + row * vocab, vocab);
        if (q.sampler->greedy()) {
          d.tokens.push_back(q.sampler->sample(l));
        } else {
          SparseDist dist;
          q.sampler->distribution(l, dist);
          d.tokens.push_back(q.sampler->draw(dist));
          d.q.push_back(std::move(dist));
        }
      }
      // The block's slots are scratch: back to the context.
      cache_->truncate(ids[i], state_[q.seq].context);
    }
  }

 private:
  struct State {
    int32_t context = 0;          // positions whose context K/V are in the drafter's cache
    int32_t pending = 0;          // kept positions whose features wait in `features`
    std::vector<float> features;  // [pending][feature_size_]
    bool broken = false;
  };

  std::shared_ptr<const Model> drafter_;
  std::unique_ptr<PagedKvCache> cache_;
  std::vector<int32_t> layers_;
  size_t feature_size_ = 0;
  int32_t max_k_ = 0;
  std::unordered_map<uint64_t, State> state_;
  std::vector<float> logits_;
  std::vector<int32_t> ids_;
};

}  // namespace

std::unique_ptr<Proposer> make_dflash_proposer(std::shared_ptr<const Model> drafter,
                                               int32_t num_blocks) {
  KVQ_CHECK(drafter != nullptr && num_blocks > 0, "make_dflash_proposer: bad arguments");
  return std::make_unique<DflashProposer>(std::move(drafter), num_blocks);
}

}  // namespace kvq
