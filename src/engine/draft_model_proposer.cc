// The draft_model proposer: a small causal model with its own paged KV cache (planned like the
// target's). Per step and sequence it (1) rolls its cache back to the longest prefix it shares
// with the sequence, (2) catches up on the rest (at least the last token, whose logits give the
// first draft), (3) drafts one token at a time; every sequence of the step rides in one forward
// pass per token. Greedy drafting runs the last catch-up pass and every drafting pass in one
// call of the drafter (Model::forward_greedy_chain: on CUDA one host round trip, or none when
// the drafts stay on the device for the target's verification).
#include <algorithm>
#include <limits>
#include <unordered_map>

#include "deferred_drafts.h"
#include "kvq/core/error.h"
#include "kvq/engine/speculative.h"

namespace kvq {

namespace {

class DraftModelProposer final : public Proposer {
 public:
  DraftModelProposer(std::shared_ptr<const Model> drafter, int32_t num_blocks, int32_t max_step)
      : drafter_(std::move(drafter)),
        cache_(drafter_->create_cache(num_blocks)),
        max_step_(std::max(1, max_step)) {}

  SpecMethod method() const override { return SpecMethod::kDraftModel; }

  void release(uint64_t seq) override {
    const SequenceId id = static_cast<SequenceId>(seq);
    if (cache_->has_sequence(id)) cache_->free_sequence(id);
    cached_.erase(seq);
  }

  const Model* token_source() const override { return deferred_.source(); }
  void collect(std::span<Draft* const> drafts) override {
    deferred_.collect(drafts, [&](std::span<const int32_t> ids) {
      // The drafts the chain ran through the drafter's cache, in place of their placeholders.
      for (const Unknown& u : unknown_) {
        auto it = cached_.find(u.seq);
        if (it == cached_.end() || it->second.size() < u.at + static_cast<size_t>(u.n)) continue;
        for (int32_t j = 0; j < u.n; ++j)
          it->second[u.at + static_cast<size_t>(j)] =
              ids[static_cast<size_t>(j) * u.stride + static_cast<size_t>(u.row)];
      }
      unknown_.clear();
    });
  }

  void propose(std::span<const DraftRequest> requests, std::span<Draft> out) override {
    KVQ_CHECK(out.size() == requests.size(), "DraftModelProposer: one draft per request");
    // Drafts never collected: their placeholders in cached_ (-1) match no token, so the
    // sequences' caches are cut back before them below.
    deferred_.reset();
    unknown_.clear();
    std::vector<Active> active;
    for (size_t r = 0; r < requests.size(); ++r) {
      out[r] = Draft{};
      const DraftRequest& q = requests[r];
      if (q.max_drafts <= 0 || q.tokens.empty()) continue;
      const SequenceId id = static_cast<SequenceId>(q.seq);
      std::vector<int32_t>& cached = cached_[q.seq];
      if (!cache_->has_sequence(id)) {
        cache_->add_sequence(id);
        cached.clear();
      }
      // Keep the longest prefix the cache shares with the sequence, and always rerun the last
      // token: its logits give the first draft.
      const size_t common = static_cast<size_t>(
          std::mismatch(cached.begin(), cached.end(), q.tokens.begin(), q.tokens.end()).first -
          cached.begin());
      const size_t keep = std::min(common, q.tokens.size() - 1);
      cache_->truncate(id, static_cast<int32_t>(keep));
      cached.resize(keep);
      active.push_back({r, static_cast<int32_t>(q.tokens.size() - keep)});
    }
    if (active.empty()) return;

    // Long catch-ups (a new sequence's prompt) first run in chunks without logits, so that no
    // pass holds more than max_step_ tokens; each sequence keeps at least one token for the
    // pass that yields its first draft.
    auto total_pending = [&] {
      int64_t n = 0;
      for (const Active& a : active) n += a.pending;
      return n;
    };
    while (total_pending() > max_step_) {
      Batch b;
      b.with_logits = false;
      int32_t budget = max_step_;
      for (Active& a : active) {
        if (a.pending <= 1 || budget <= 0) continue;
        const DraftRequest& q = requests[a.r];
        std::vector<int32_t>& cached = cached_[q.seq];
        const int32_t n = std::min(budget, a.pending - 1);
        const auto from = q.tokens.begin() + static_cast<std::ptrdiff_t>(cached.size());
        const std::vector<int32_t> run(from, from + n);
        if (!b.add(*cache_, q.seq, run, static_cast<int32_t>(cached.size()))) {
          a.pending = 0;  // no blocks in the drafter's cache: no drafts this step
          continue;
        }
        cached.insert(cached.end(), run.begin(), run.end());
        a.pending -= n;
        budget -= n;
      }
      if (b.ids.empty()) break;
      drafter_->forward(b.view(*cache_), *cache_, std::span<float>());
    }
    // Final catch-up round (with logits) and then the drafts, one token per pass.
    std::vector<Active*> live;
    for (Active& a : active)
      if (a.pending > 0) live.push_back(&a);
    bool greedy = true;
    for (Active* a : live) greedy = greedy && requests[a->r].sampler->greedy();
    if (greedy) return greedy_chain(requests, out, live);
    bool first = true;
    std::vector<float> logits;
    while (!live.empty()) {
      // Reserve the slots of this pass; a sequence without blocks stops drafting.
      Batch b;
      std::vector<Active*> ran;
      for (Active* a : live) {
        const DraftRequest& q = requests[a->r];
        std::vector<int32_t>& cached = cached_[q.seq];
        std::vector<int32_t> run;
        if (first) {
          run.assign(q.tokens.begin() + static_cast<std::ptrdiff_t>(cached.size()), q.tokens.end());
        } else {
          run = {a->next};
        }
        if (!b.add(*cache_, q.seq, run, static_cast<int32_t>(cached.size()))) continue;
        cached.insert(cached.end(), run.begin(), run.end());
        ran.push_back(a);
      }
      first = false;
      if (ran.empty()) break;
      const size_t vocab = static_cast<size_t>(drafter_->vocab_size());
      bool all_greedy = true;
      for (Active* a : ran) all_greedy = all_greedy && requests[a->r].sampler->greedy();
      std::vector<int32_t> ids(ran.size());
      const ForwardBatch fb = b.view(*cache_);
      if (all_greedy && drafter_->samples_on_device()) {
        const DeviceSampling greedy_rule{};
        drafter_->forward_sample(fb, *cache_, std::span<const DeviceSampling>(&greedy_rule, 1),
                                 ids);
      } else {
        logits.resize(ran.size() * vocab);
        drafter_->forward(fb, *cache_, logits);
      }
      std::vector<Active*> next_live;
      for (size_t i = 0; i < ran.size(); ++i) {
        Active* a = ran[i];
        const DraftRequest& q = requests[a->r];
        Draft& d = out[a->r];
        Sampler& s = *q.sampler;
        int32_t tok = ids[i];
        if (!(all_greedy && drafter_->samples_on_device())) {
          const std::span<const float> row(logits.data() + i * vocab, vocab);
          if (s.greedy()) {
            tok = s.sample(row);
          } else {
            SparseDist dist;
            s.distribution(row, dist);
            tok = s.draw(dist);
            d.q.push_back(std::move(dist));
          }
        }
        d.tokens.push_back(tok);
        a->next = tok;
        if (static_cast<int32_t>(d.tokens.size()) < q.max_drafts) next_live.push_back(a);
      }
      live.swap(next_live);
    }
  }

 private:
  struct Active {
    size_t r;             // index into requests / out
    int32_t pending = 0;  // catch-up tokens still to run (from cached_ size on)
    int32_t next = -1;    // the token to run next (after catch-up: the latest draft)
  };

  // The last catch-up pass and every drafting pass of greedy requests, in one call.
  void greedy_chain(std::span<const DraftRequest> requests, std::span<Draft> out,
                    std::span<Active* const> live) {
    int32_t steps = 0;
    for (Active* a : live) steps = std::max(steps, requests[a->r].max_drafts);
    // Every sequence runs every pass: one that would pass the drafter's context (a short k near
    // the end of it, next to a longer k) drafts nothing this step.
    const int64_t context = drafter_->plan().model.max_position_embeddings > 0
                                ? drafter_->plan().model.max_position_embeddings
                                : std::numeric_limits<int64_t>::max();
    Batch b;
    std::vector<std::vector<int64_t>> later;  // per sequence: its slots of passes 1..steps-1
    std::vector<Active*> ran;
    for (Active* a : live) {
      const DraftRequest& q = requests[a->r];
      std::vector<int32_t>& cached = cached_[q.seq];
      const std::vector<int32_t> run(q.tokens.begin() + static_cast<std::ptrdiff_t>(cached.size()),
                                     q.tokens.end());
      if (static_cast<int64_t>(q.tokens.size()) + steps - 1 > context) continue;
      std::vector<int64_t> more;
      if (!b.add(*cache_, q.seq, run, static_cast<int32_t>(cached.size()), steps - 1, &more))
        continue;  // no blocks in the drafter's cache: no drafts this step
      cached.insert(cached.end(), run.begin(), run.end());
      later.push_back(std::move(more));
      ran.push_back(a);
    }
    if (ran.empty()) return;
    const size_t S = ran.size(), passes = static_cast<size_t>(steps);
    std::vector<int64_t> next_slots((passes - 1) * S);
    for (size_t i = 0; i < S; ++i)
      for (size_t j = 1; j < passes; ++j) next_slots[(j - 1) * S + i] = later[i][j - 1];
    const ForwardBatch fb = b.view(*cache_);
    // The block tables hold every pass's slots; the first pass's lengths are steps - 1 shorter.
    for (int32_t& len : b.storage.seq_lens) len -= steps - 1;
    const bool defer = DeferredDrafts::allowed(*drafter_, requests);
    std::vector<int32_t> ids(defer ? 0 : passes * S);
    drafter_->forward_greedy_chain(fb, *cache_, steps, next_slots, ids, defer);
    if (defer) deferred_.start(drafter_.get(), static_cast<int>(passes * S));
    for (size_t i = 0; i < S; ++i) {
      const DraftRequest& q = requests[ran[i]->r];
      Draft& d = out[ran[i]->r];
      std::vector<int32_t>& cached = cached_[q.seq];
      const size_t k = static_cast<size_t>(std::min(q.max_drafts, steps));
      if (defer) {
        d.tokens.assign(k, 0);
        d.on_device = true;
        d.device_row = static_cast<int32_t>(i);
        d.device_stride = static_cast<int32_t>(S);
        unknown_.push_back({q.seq, cached.size(), steps - 1, static_cast<int32_t>(i), S});
        cached.resize(cached.size() + passes - 1, -1);
        continue;
      }
      for (size_t j = 0; j < k; ++j) d.tokens.push_back(ids[j * S + i]);
      for (size_t j = 0; j + 1 < passes; ++j) cached.push_back(ids[j * S + i]);
    }
  }

  // The tokens of one forward pass of the drafter.
  struct Batch {
    std::vector<int32_t> tokens, positions, q_indptr{0}, rows;
    std::vector<int64_t> slots;
    std::vector<SequenceId> ids;
    PagedKvCache::BlockTableStorage storage;
    bool with_logits = true;

    // Appends `run` at positions from `first_pos` (the sequence's cached length), and reserves
    // `extra` more slots after it into *more; false (and nothing changed) when the drafter's
    // cache has no blocks for them.
    bool add(PagedKvCache& cache, uint64_t seq, std::span<const int32_t> run, int32_t first_pos,
             int32_t extra = 0, std::vector<int64_t>* more = nullptr) {
      if (run.empty()) return false;
      const SequenceId id = static_cast<SequenceId>(seq);
      std::vector<int64_t> s = cache.append(id, static_cast<int32_t>(run.size()) + extra);
      if (s.empty()) return false;
      if (more != nullptr)
        more->assign(s.begin() + static_cast<std::ptrdiff_t>(run.size()), s.end());
      s.resize(run.size());
      slots.insert(slots.end(), s.begin(), s.end());
      tokens.insert(tokens.end(), run.begin(), run.end());
      for (size_t i = 0; i < run.size(); ++i)
        positions.push_back(first_pos + static_cast<int32_t>(i));
      q_indptr.push_back(static_cast<int32_t>(tokens.size()));
      if (with_logits) rows.push_back(static_cast<int32_t>(tokens.size()) - 1);
      ids.push_back(id);
      return true;
    }
    ForwardBatch view(const PagedKvCache& cache) {
      const BlockTableView table = cache.block_table(ids, storage);
      return ForwardBatch{tokens, positions, q_indptr, slots, table, rows};
    }
  };

  std::shared_ptr<const Model> drafter_;
  std::unique_ptr<PagedKvCache> cache_;
  int32_t max_step_;
  std::unordered_map<uint64_t, std::vector<int32_t>> cached_;  // tokens in the drafter's cache
  // Drafts left on the device; cached_[seq][at + j] (j < n) waits for row j * stride + row.
  struct Unknown {
    uint64_t seq;
    size_t at;
    int32_t n;
    int32_t row;
    size_t stride;
  };
  std::vector<Unknown> unknown_;
  DeferredDrafts deferred_;
};

}  // namespace

std::unique_ptr<Proposer> make_draft_model_proposer(std::shared_ptr<const Model> drafter,
                                                    int32_t num_blocks, int32_t max_step_tokens) {
  KVQ_CHECK(drafter != nullptr && num_blocks > 0, "make_draft_model_proposer: bad arguments");
  return std::make_unique<DraftModelProposer>(std::move(drafter), num_blocks, max_step_tokens);
}

}  // namespace kvq
