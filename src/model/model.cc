// Model's defaults: a cache in host storage over the plan's layers; no device sampling; greedy
// chains pass by pass.
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "kvq/core/error.h"
#include "kvq/model/model.h"

namespace kvq {

int32_t greedy_argmax(std::span<const float> logits) {
  // NaN never wins (comparisons with NaN are false, so a NaN at id 0 must not seed it).
  int32_t best = -1;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = logits[i];
    if (!std::isnan(l) && (best < 0 || l > logits[static_cast<size_t>(best)]))
      best = static_cast<int32_t>(i);
  }
  return best < 0 ? 0 : best;
}

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

void check_greedy_chain(const ForwardBatch& batch, int steps, size_t next_slots, size_t out,
                        bool defer) {
  const BlockTableView& bt = batch.block_table;
  const int S = bt.num_seqs;
  KVQ_CHECK(steps >= 1 && S >= 1, "forward_greedy_chain: no steps or no sequences");
  KVQ_CHECK(batch.logit_rows.size() == static_cast<size_t>(S) &&
                batch.q_indptr.size() == static_cast<size_t>(S) + 1,
            "forward_greedy_chain: one logit row per sequence");
  for (int i = 0; i < S; ++i)
    KVQ_CHECK(
        batch.logit_rows[static_cast<size_t>(i)] == batch.q_indptr[static_cast<size_t>(i) + 1] - 1,
        "forward_greedy_chain: a logit row is not its sequence's last token");
  const size_t n = static_cast<size_t>(steps) * static_cast<size_t>(S);
  KVQ_CHECK(next_slots == n - static_cast<size_t>(S) && out == (defer ? 0 : n),
            "forward_greedy_chain: next_slots or out of the wrong size");
  for (int i = 0; i < S; ++i)
    KVQ_CHECK(static_cast<int64_t>(bt.indptr[i + 1] - bt.indptr[i]) * bt.block_tokens >=
                  bt.seq_lens[i] + steps - 1,
              "forward_greedy_chain: a block table does not hold the chain's slots");
}

void Model::forward_sample_deferred(const ForwardBatch&, PagedKvCache&,
                                    std::span<const DeviceSampling>) const {
  throw InternalError("forward_sample_deferred called on a model that cannot defer its ids");
}

void Model::collect_sampled(std::span<int32_t>) const {
  throw InternalError("collect_sampled called on a model that cannot defer its ids");
}

void Model::forward_greedy_chain(const ForwardBatch& batch, PagedKvCache& cache, int steps,
                                 std::span<const int64_t> next_slots, std::span<int32_t> out,
                                 bool defer) const {
  const BlockTableView& bt = batch.block_table;
  const int S = bt.num_seqs;
  KVQ_CHECK(!defer, "forward_greedy_chain: this model cannot defer its ids");
  check_greedy_chain(batch, steps, next_slots.size(), out.size(), defer);
  std::vector<int32_t> ids(static_cast<size_t>(S));
  std::vector<float> logits;
  const DeviceSampling greedy[1] = {DeviceSampling{}};
  auto pass = [&](const ForwardBatch& b) {
    if (samples_on_device()) {
      forward_sample(b, cache, greedy, ids);
      return;
    }
    const size_t V = static_cast<size_t>(vocab_size());
    logits.resize(static_cast<size_t>(S) * V);
    forward(b, cache, logits);
    for (size_t i = 0; i < ids.size(); ++i)
      ids[i] = greedy_argmax(std::span<const float>(logits.data() + i * V, V));
  };
  pass(batch);
  std::copy(ids.begin(), ids.end(), out.begin());
  // Passes 1..steps-1: one token per sequence at the next position.
  std::vector<int32_t> positions(static_cast<size_t>(S)), q_indptr(static_cast<size_t>(S) + 1),
      seq_lens(bt.seq_lens, bt.seq_lens + S);
  std::iota(q_indptr.begin(), q_indptr.end(), 0);
  for (int i = 0; i < S; ++i)
    positions[static_cast<size_t>(i)] =
        batch.positions[static_cast<size_t>(batch.q_indptr[static_cast<size_t>(i) + 1] - 1)];
  for (int j = 1; j < steps; ++j) {
    for (int i = 0; i < S; ++i) {
      ++positions[static_cast<size_t>(i)];
      ++seq_lens[static_cast<size_t>(i)];
    }
    BlockTableView table = bt;
    table.seq_lens = seq_lens.data();
    const std::span<const int64_t> slots = next_slots.subspan(
        static_cast<size_t>(j - 1) * static_cast<size_t>(S), static_cast<size_t>(S));
    const std::vector<int32_t> tokens = ids;
    const std::span<const int32_t> rows(q_indptr.data(), static_cast<size_t>(S));
    pass(ForwardBatch{tokens, positions, q_indptr, slots, table, rows});
    std::copy(ids.begin(), ids.end(), out.begin() + static_cast<std::ptrdiff_t>(j) * S);
  }
}

}  // namespace kvq
