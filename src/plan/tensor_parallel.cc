#include "kvq/plan/tensor_parallel.h"

#include <string>

#include "kvq/core/error.h"

namespace kvq {

namespace {

bool splits(int nq, int nkv, int n) {
  return n >= 1 && nq > 0 && nkv > 0 && nq % n == 0 && (nkv % n == 0 || n % nkv == 0);
}

}  // namespace

std::vector<int> tensor_parallel_sizes(const ModelConfig& config, int max) {
  std::vector<int> out;
  for (int n = 1; n <= max; ++n)
    if (splits(config.num_q_heads, config.num_kv_heads, n)) out.push_back(n);
  return out;
}

TensorParallelSplit split_heads(const ModelConfig& config, int size) {
  const int nq = config.num_q_heads, nkv = config.num_kv_heads;
  if (!splits(nq, nkv, size)) {
    std::string ok;
    for (int n : tensor_parallel_sizes(config)) ok += (ok.empty() ? "" : ", ") + std::to_string(n);
    throw InputError("--tensor-parallel-size " + std::to_string(size) + ": the model's " +
                     std::to_string(nq) + " query / " + std::to_string(nkv) +
                     " kv heads do not split over " + std::to_string(size) +
                     " ranks (query heads must divide by it, and kv heads divide by it or it by "
                     "them); accepted: " +
                     (ok.empty() ? std::string("none") : ok));
  }
  TensorParallelSplit s;
  s.size = size;
  s.num_kv_heads = nkv;
  s.q_heads_per_rank = nq / size;
  if (nkv >= size) {
    s.kv_heads_per_rank = nkv / size;
  } else {
    s.kv_heads_per_rank = 1;
    s.kv_head_replicas = size / nkv;
    s.notes.push_back("the model has " + std::to_string(nkv) + " kv head(s) for " +
                      std::to_string(size) + " ranks: each kv head is replicated on " +
                      std::to_string(s.kv_head_replicas) +
                      " ranks, so the group stores its cache " +
                      std::to_string(s.kv_head_replicas) + " times");
  }
  return s;
}

std::vector<int> TensorParallelSplit::kv_heads_of(int rank) const {
  KVQ_CHECK(rank >= 0 && rank < size, "kv_heads_of: rank out of range");
  std::vector<int> heads;
  if (kv_head_replicas > 1) {
    heads.push_back(rank / kv_head_replicas);
  } else {
    for (int h = 0; h < kv_heads_per_rank; ++h) heads.push_back(rank * kv_heads_per_rank + h);
  }
  return heads;
}

TpShard tp_shard(TpMatrix m, const TensorParallelSplit& split, const ModelConfig& config,
                 int intermediate, int rank, int vocab) {
  KVQ_CHECK(rank >= 0 && rank < split.size, "tp_shard: rank out of range");
  KVQ_CHECK(split.num_kv_heads == config.num_kv_heads, "tp_shard: the split is of another model");
  const int n = split.size;
  if ((m == TpMatrix::kGateUp || m == TpMatrix::kDown) && intermediate % n != 0) {
    std::string ok;
    for (int k : tensor_parallel_sizes(config))
      if (intermediate % k == 0) ok += (ok.empty() ? "" : ", ") + std::to_string(k);
    throw InputError("--tensor-parallel-size " + std::to_string(n) + ": the model's MLP width " +
                     std::to_string(intermediate) + " does not divide by it; accepted: " +
                     (ok.empty() ? std::string("1") : ok));
  }
  const int64_t d = config.head_dim;
  const int64_t q_rows = static_cast<int64_t>(config.num_q_heads) * d;
  const int64_t kv_rows = static_cast<int64_t>(config.num_kv_heads) * d;
  const int64_t q0 = static_cast<int64_t>(split.first_q_head(rank)) * d;
  const int64_t qn = static_cast<int64_t>(split.q_heads_per_rank) * d;
  if (m == TpMatrix::kVocab && (vocab <= 0 || vocab % n != 0))
    throw InputError("--tensor-parallel-size " + std::to_string(n) + ": the vocabulary of " +
                     std::to_string(vocab) + " tokens does not divide by it");
  const int64_t slice = intermediate / n;
  TpShard s;
  switch (m) {
    case TpMatrix::kQkv: {
      const std::vector<int> kv = split.kv_heads_of(rank);  // consecutive heads
      const int64_t k0 = static_cast<int64_t>(kv.front()) * d;
      const int64_t kn = static_cast<int64_t>(kv.size()) * d;
      s.rows = {{q0, qn}, {q_rows + k0, kn}, {q_rows + kv_rows + k0, kn}};
      break;
    }
    case TpMatrix::kGateUp:
      s.rows = {{rank * slice, slice}, {intermediate + rank * slice, slice}};
      break;
    case TpMatrix::kO:
      s.col0 = q0;
      s.cols = qn;
      break;
    case TpMatrix::kDown:
      s.col0 = rank * slice;
      s.cols = slice;
      break;
    case TpMatrix::kVocab:
      s.rows = {{static_cast<int64_t>(rank) * (vocab / n), vocab / n}};
      break;
  }
  return s;
}

KvPlan slice_kv_plan(const KvPlan& plan, const TensorParallelSplit& split, int rank) {
  KVQ_CHECK(split.num_kv_heads == plan.model.num_kv_heads,
            "slice_kv_plan: the split was made for another model");
  const std::vector<int> heads = split.kv_heads_of(rank);
  KvPlan out = plan;
  for (LayerKvSpec& s : out.layers) {
    s.num_q_heads = split.q_heads_per_rank;
    s.num_kv_heads = split.kv_heads_per_rank;
    for (ScaleSource* sc : {&s.k_scale, &s.v_scale}) {
      if (sc->values.size() <= 1) continue;  // none, or one for the whole tensor
      KVQ_CHECK(sc->values.size() == static_cast<size_t>(split.num_kv_heads),
                "slice_kv_plan: layer " + std::to_string(s.layer) + " has " +
                    std::to_string(sc->values.size()) + " scales for " +
                    std::to_string(split.num_kv_heads) + " kv heads");
      std::vector<float> mine;
      for (int h : heads) mine.push_back(sc->values[static_cast<size_t>(h)]);
      sc->values = std::move(mine);
    }
  }
  for (const std::string& n : split.notes) out.notes.push_back(n);
  return out;
}

}  // namespace kvq
