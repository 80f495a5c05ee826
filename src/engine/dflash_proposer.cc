// The dflash proposer (docs/notes/dflash.md): context K/V written from the target's features as
// the target keeps positions; each step one drafter pass over every sequence's block
// [last token, mask x k] at positions s..s+k (non-causal), whose rows 1..k are the drafts; the
// block's slots are rolled back after the pass. With the features on the target's GPU, the
// kept rows of the target's last pass wait for that drafter pass, which writes their context
// K/V in the same device step (one host round trip, one graph); before_target_pass writes
// any that are still waiting on their own.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <unordered_map>

#include "deferred_drafts.h"
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

  ~DflashProposer() override {
    // KVQ_SPEC_PROFILE=1: where the proposer's time went (wall clock, host side), over every
    // call of its life: under `kvq bench` that includes the untimed warm-up pass, whose first
    // uses of each step shape (GEMM tuning, eager first runs, graph captures) dominate at large
    // batches; the bench's own per-step figures are the timed pass alone.
    if (std::getenv("KVQ_SPEC_PROFILE") != nullptr && calls_ > 0)
      std::fprintf(stderr,
                   "kvq dflash profile (all passes, warm-up included): %lld calls, %lld "
                   "sequence-drafts: context K/V %.3f ms/call, block pass %.3f ms/call (%lld left "
                   "on the device, collected in %.3f ms/call), other %.3f ms/call\n",
                   static_cast<long long>(calls_), static_cast<long long>(drafts_),
                   1e3 * context_s_ / calls_, 1e3 * pass_s_ / calls_,
                   static_cast<long long>(deferred_calls_), 1e3 * collect_s_ / calls_,
                   1e3 * other_s_ / calls_);
  }

  SpecMethod method() const override { return SpecMethod::kDflash; }
  std::span<const int32_t> target_layers() const override { return layers_; }

  void release(uint64_t seq) override {
    const SequenceId id = static_cast<SequenceId>(seq);
    // Its waiting rows' slots go back to the cache with its blocks: never write them.
    size_t keep = 0;
    for (size_t i = 0; i < pending_.seqs.size(); ++i)
      if (pending_.seqs[i] != seq) {
        pending_.seqs[keep] = pending_.seqs[i];
        pending_.rows[keep] = pending_.rows[i];
        pending_.positions[keep] = pending_.positions[i];
        pending_.slots[keep] = pending_.slots[i];
        ++keep;
      }
    pending_.resize(keep);
    if (cache_->has_sequence(id)) cache_->free_sequence(id);
    state_.erase(seq);
  }

  void before_target_pass(const Model& target) override {
    if (pending_.rows.empty()) return;
    const auto t0 = std::chrono::steady_clock::now();
    write_pending(target);
    context_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  bool features_on_device(const Model& target) const override {
    return drafter_->reads_features_of(target);
  }

  const Model* token_source() const override { return deferred_.source(); }
  void collect(std::span<Draft* const> drafts) override {
    const auto t0 = std::chrono::steady_clock::now();
    deferred_.collect(drafts, [](std::span<const int32_t>) {});
    collect_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // The context K/V of the kept positions, every sequence at once, as soon as the target has
  // them (its next pass may overwrite the features).
  void on_target_features(const Model& target, std::span<const KeptRows> kept,
                          std::span<const float> host) override {
    const auto t0 = std::chrono::steady_clock::now();
    // Rows of an earlier pass still waiting lost their features to this pass.
    KVQ_CHECK(pending_.rows.empty(),
              "DflashProposer: the target ran a pass before before_target_pass() wrote the "
              "context rows of the previous one");
    std::vector<int32_t> rows, positions;
    std::vector<int64_t> slots;
    std::vector<uint64_t> seqs;
    for (const KeptRows& k : kept) {
      if (k.n <= 0) continue;
      State& st = state_[k.seq];
      if (st.broken) continue;
      const SequenceId id = static_cast<SequenceId>(k.seq);
      if (!cache_->has_sequence(id)) cache_->add_sequence(id);
      std::vector<int64_t> s =
          k.first == st.context ? cache_->append(id, k.n) : std::vector<int64_t>{};
      if (s.empty()) {
        // A gap (a prefix-cache hit skipped positions), a repeat, or no blocks: this sequence
        // drafts nothing from now on.
        st.broken = true;
        continue;
      }
      slots.insert(slots.end(), s.begin(), s.end());
      for (int32_t p = 0; p < k.n; ++p) {
        positions.push_back(k.first + p);
        rows.push_back(k.row + p);
        seqs.push_back(k.seq);
      }
      st.context += k.n;
    }
    if (!positions.empty()) {
      if (host.empty()) {
        // On the device: wait for the next drafter pass (propose), unless these are many rows
        // (a prefill), which the pass's step could not take.
        if (fuse_ && positions.size() <= kMaxWaitingRows) {
          pending_.target = &target;
          pending_.seqs = std::move(seqs);
          pending_.rows = std::move(rows);
          pending_.positions = std::move(positions);
          pending_.slots = std::move(slots);
        } else {
          drafter_->write_feature_kv_from_target(target, rows, positions, slots, *cache_);
        }
      } else {
        KVQ_CHECK(host.size() % feature_size_ == 0, "DflashProposer: features of the wrong size");
        std::vector<float> features(rows.size() * feature_size_);
        for (size_t i = 0; i < rows.size(); ++i) {
          const size_t from = static_cast<size_t>(rows[i]) * feature_size_;
          KVQ_CHECK(from + feature_size_ <= host.size(),
                    "DflashProposer: feature row out of range");
          std::copy_n(host.begin() + static_cast<ptrdiff_t>(from), feature_size_,
                      features.begin() + static_cast<ptrdiff_t>(i * feature_size_));
        }
        drafter_->write_feature_kv(features, positions, slots, *cache_);
      }
    }
    context_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  void propose(std::span<const DraftRequest> requests, std::span<Draft> out) override {
    KVQ_CHECK(out.size() == requests.size(), "DflashProposer: one draft per request");
    using Clock = std::chrono::steady_clock;
    const auto seconds = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    const Clock::time_point t0 = Clock::now();
    deferred_.reset();
    std::vector<size_t> active;
    for (size_t r = 0; r < requests.size(); ++r) {
      out[r] = Draft{};
      const DraftRequest& q = requests[r];
      auto it = state_.find(q.seq);
      if (q.max_drafts <= 0 || it == state_.end() || it->second.broken) continue;
      // Every position before the last token needs its context K/V.
      if (static_cast<size_t>(it->second.context) + 1 != q.tokens.size()) continue;
      active.push_back(r);
    }

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
    ++calls_;
    // Waiting context rows go with the pass when its step can take them (no more rows than the
    // block's tokens), else on their own first.
    if (!pending_.rows.empty() && (ran.empty() || pending_.rows.size() > tokens.size())) {
      const Clock::time_point tw = Clock::now();
      write_pending(*pending_.target);
      context_s_ += seconds(tw, Clock::now());
    }
    if (ran.empty()) {
      other_s_ += seconds(t0, Clock::now());
      return;
    }
    drafts_ += static_cast<int64_t>(ran.size());
    PagedKvCache::BlockTableStorage storage;
    ForwardBatch fb{tokens, pos, q_indptr, block_slots, cache_->block_table(ids, storage), rows};
    if (!pending_.rows.empty()) {
      fb.feature_source = pending_.target;
      fb.feature_rows = pending_.rows;
      fb.feature_positions = pending_.positions;
      fb.feature_slots = pending_.slots;
    }
    const size_t vocab = static_cast<size_t>(drafter_->vocab_size());
    const Clock::time_point t3 = Clock::now();
    // All greedy on a device that samples: only the argmax ids cross to the host, or none
    // (they stay on the device for the target's verification, which reads them there).
    bool all_greedy = drafter_->samples_on_device();
    for (size_t r : ran) all_greedy = all_greedy && requests[r].sampler->greedy();
    const bool defer = all_greedy && DeferredDrafts::allowed(*drafter_, requests);
    if (defer) {
      const DeviceSampling argmax[1] = {DeviceSampling{}};
      drafter_->forward_sample_deferred(fb, *cache_, argmax);
      deferred_.start(drafter_.get(), static_cast<int>(rows.size()));
      ++deferred_calls_;
    } else if (all_greedy) {
      ids_.resize(rows.size());
      const DeviceSampling argmax[1] = {DeviceSampling{}};
      drafter_->forward_sample(fb, *cache_, argmax, ids_);
    } else {
      logits_.resize(rows.size() * vocab);
      drafter_->forward(fb, *cache_, logits_);
    }
    const Clock::time_point t4 = Clock::now();
    pending_.resize(0);
    size_t row = 0;
    for (size_t i = 0; i < ran.size(); ++i) {
      const DraftRequest& q = requests[ran[i]];
      Draft& d = out[ran[i]];
      const int32_t k = q_indptr[i + 1] - q_indptr[i] - 1;
      if (defer) {
        d.tokens.assign(static_cast<size_t>(k), 0);
        d.on_device = true;
        d.device_row = static_cast<int32_t>(row);
        row += static_cast<size_t>(k);
      }
      for (int32_t j = 0; j < k && !defer; ++j, ++row) {
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
    pass_s_ += seconds(t3, t4);
    other_s_ += seconds(t0, t3) + seconds(t4, Clock::now());
  }

 private:
  struct State {
    int32_t context = 0;  // positions whose context K/V are in (or wait for) the drafter's cache
    bool broken = false;
  };
  // Kept rows of the target's last pass whose context K/V wait for the next drafter pass.
  struct Waiting {
    const Model* target = nullptr;
    std::vector<uint64_t> seqs;
    std::vector<int32_t> rows, positions;
    std::vector<int64_t> slots;
    void resize(size_t n) { seqs.resize(n), rows.resize(n), positions.resize(n), slots.resize(n); }
  };
  static constexpr size_t kMaxWaitingRows = 512;
  // KVQ_DFLASH_FUSE=0: every context write on its own (an A/B switch for benchmarks).
  const bool fuse_ = [] {
    const char* e = std::getenv("KVQ_DFLASH_FUSE");
    return e == nullptr || std::string_view(e) != "0";
  }();

  void write_pending(const Model& target) {
    drafter_->write_feature_kv_from_target(target, pending_.rows, pending_.positions,
                                           pending_.slots, *cache_);
    pending_.resize(0);
  }

  std::shared_ptr<const Model> drafter_;
  std::unique_ptr<PagedKvCache> cache_;
  std::vector<int32_t> layers_;
  size_t feature_size_ = 0;
  int32_t max_k_ = 0;
  std::unordered_map<uint64_t, State> state_;
  Waiting pending_;
  DeferredDrafts deferred_;
  std::vector<float> logits_;
  std::vector<int32_t> ids_;
  int64_t calls_ = 0, drafts_ = 0, deferred_calls_ = 0;
  double context_s_ = 0.0, pass_s_ = 0.0, collect_s_ = 0.0, other_s_ = 0.0;
};

}  // namespace

std::unique_ptr<Proposer> make_dflash_proposer(std::shared_ptr<const Model> drafter,
                                               int32_t num_blocks) {
  KVQ_CHECK(drafter != nullptr && num_blocks > 0, "make_dflash_proposer: bad arguments");
  return std::make_unique<DflashProposer>(std::move(drafter), num_blocks);
}

}  // namespace kvq
