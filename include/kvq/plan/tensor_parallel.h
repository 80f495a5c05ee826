// Tensor parallelism's split of the attention heads (and so of the KV cache) over the ranks of
// a group, as vLLM and SGLang split them:
//   - query heads: rank r holds [r * nq / N, (r + 1) * nq / N) (nq must divide by N);
//   - kv heads, nkv >= N: rank r holds [r * nkv / N, (r + 1) * nkv / N) (nkv must divide by N);
//   - kv heads, nkv < N: every rank holds one kv head, head r / (N / nkv): each head is
//     replicated on N / nkv ranks (N must divide by nkv), so the group holds N heads' worth of
//     cache where the model has nkv.
// A rank's query heads always read kv heads it holds (the GQA groups stay whole).
//
// One plan serves the whole group: every rank runs the same per-layer LayerKvSpecs (dtypes,
// skip rules, provenance) over its own heads, with per-head k/v scales sliced with the heads.
// Block tables are identical on every rank (the scheduler runs once), so a block id means the
// same tokens everywhere and the group's capacity in tokens is one rank's.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvq/plan/kv_plan.h"
#include "kvq/plan/model_config.h"

namespace kvq {

struct TensorParallelSplit {
  int size = 1;                // N, ranks in the group
  int q_heads_per_rank = 0;    // nq / N
  int kv_heads_per_rank = 0;   // max(1, nkv / N)
  int kv_head_replicas = 1;    // ranks that hold each kv head (N / nkv when nkv < N)
  std::vector<std::string> notes;

  // The model's kv heads that `rank` holds, in order.
  std::vector<int> kv_heads_of(int rank) const;
  // The first of the model's query heads that `rank` holds (q_heads_per_rank of them).
  int first_q_head(int rank) const { return rank * q_heads_per_rank; }

  int num_kv_heads = 0;  // the model's
};

// The split of `config`'s heads over `size` ranks. InputError (one line naming
// --tensor-parallel-size, the model's head counts and the sizes that work) when the heads do
// not split: nq % N != 0, or neither nkv % N == 0 nor N % nkv == 0; or size < 1.
TensorParallelSplit split_heads(const ModelConfig& config, int size);

// A rank's share of one projection's weight [n][k] (or of its 1-D bias [n]):
//   column-parallel (q|k|v, gate|up): ranges (first, count) of output rows: the rank's query
//     heads' rows of q, its kv heads' rows of k and of v; its slice of gate and of up;
//   row-parallel (o, down): one range [col0, col0 + cols) of input columns: its query heads'
//     columns of o, its slice of down's intermediate columns.
struct TpShard {
  std::vector<std::pair<int64_t, int64_t>> rows;
  int64_t col0 = 0, cols = 0;
  int64_t num_rows() const {
    int64_t n = 0;
    for (const auto& r : rows) n += r.second;
    return n;
  }
};
//   vocabulary-parallel (the LM head): output rows [r V/N, (r+1) V/N).
enum class TpMatrix : uint8_t { kQkv, kGateUp, kO, kDown, kVocab };

// The shard of `m` for `rank`; `config` the whole model's (head_dim, heads) and
// `intermediate` its MLP width, `vocab` its vocabulary. InputError (naming
// --tensor-parallel-size) when the MLP width or (kVocab) the vocabulary does not divide by
// split.size.
TpShard tp_shard(TpMatrix m, const TensorParallelSplit& split, const ModelConfig& config,
                 int intermediate, int rank, int vocab = 0);

// The sizes in 1..max that split_heads accepts for `config` (for error messages).
std::vector<int> tensor_parallel_sizes(const ModelConfig& config, int max = 16);

// One rank's plan: every layer's spec with the rank's head counts and its kv heads' scales
// (per-head scale lists sliced; per-tensor scales kept); dtypes, kinds, provenance, warnings
// and notes as in `plan`. `model` stays the whole model's config.
KvPlan slice_kv_plan(const KvPlan& plan, const TensorParallelSplit& split, int rank);

}  // namespace kvq
