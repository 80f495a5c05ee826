// CUDA decode attention over the paged cache (split-KV flash-decoding on tensor cores).
//
// The device-level entry points behind the "cuda" backend (decode batches), for callers that
// keep the block table on the device (benchmarks, a future graph-captured engine step):
//   plan_decode  host-side scheduling from the host copy of the sequence lengths;
//   run_decode   three launches on `stream`: Q preparation, the split-KV kernel, the merge
//                (the last two with programmatic dependent launch, to overlap launch gaps);
//                two where the plan merges inside the split-KV kernel (DecodePlan::cluster).
//
// Work split: one warp owns (sequence, kv head, 8 or 16 query rows of its GQA group, a
// contiguous range of 16-token tiles); a row is a query head of the group or, for several
// queries per sequence (speculative verification, a DFlash block), a (query token, head) pair
// with its own causal / window limit. Per tile it issues 16-byte loads of K and V straight
// from the paged cache into registers (one-query warps of the 4-bit pairs instead stream
// their tiles through a per-warp shared-memory ring that lane 0 fills with bulk copies four
// tiles ahead, and take two tiles a trip for int4_per_token_head), dequantizes into fp16
// (bf16 for bfloat16 / float32 caches) mma operands, and runs S = Q K^T and O += P V as m16n8k16 tensor-core MMAs with
// fp32 accumulation and an fp32 online softmax. Q is kept as fp16 with a per-head power-of-two
// scale (bf16 for bf16 / fp32 K); P is fp16 (bf16 for bf16 / fp32 V); nothing is fp8. K and V
// may differ (the mixed pairs of kv_pairs.h): the S = Q K^T side (Q's operand type, fragment
// order and rotation) follows K, the O += P V side (P's type, V scales, un-rotation) follows V.
// Scales are applied in fp32: per-tensor K scales fold into the logit factor, per-token K
// scales multiply the logits, per-token V scales multiply P (normalized by the running
// maximum scale of the warp's range so fp16 P cannot underflow), int4 zero points add
// z * sum(q) to a logit and sum(p * z) to an output. Each warp writes an (o, m, l) partial
// (or, for a sequence with a single split and unrotated V, its final output); the merge
// kernel combines the splits of a query head and un-rotates rotated V. The grid is 1-D over
// (sequence, kv head, work item), so blocks are always full. Where the grid is small and the
// contexts short (DecodePlan::cluster), a cluster of 8 blocks owns a (sequence, kv head): its
// warps write their partials to shared memory, and after a cluster barrier each warp merges
// rows by reading every split's partial through distributed shared memory, so no merge
// kernel runs and no partial goes through global memory.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvq/cache/paged_kv_cache.h"
#include "kvq/plan/layer_kv_spec.h"

namespace kvq::cuda {

inline constexpr int kDecodeTileTokens = 16;
inline constexpr int kDecodeMaxKvHeads = 128;
inline constexpr int kDecodeMaxSplits = 1024;

// What the kernels cannot run (empty: supported). The (K, V) dtype pairs of kv_pairs.h
// (cuda_kv_pair_supported), head_dim 64 / 128 / 256 (K and V equal), block_tokens a multiple
// of 16, at most 128 kv heads.
std::vector<std::string> decode_unsupported_reasons(const LayerKvSpec& spec);

// Query tokens per sequence the kernels take at most (speculative verification: 1 + 16
// drafts; a DFlash block of k + 1 tokens).
inline constexpr int kDecodeMaxQueries = 17;

struct DecodeOptions {
  int chunk_tiles = 0;  // tiles per work item; 0: chosen from the kernel's occupancy
  int num_sms = 0;      // 0: read from the current device
  // Query tokens per sequence the plan is made for (1 .. kDecodeMaxQueries): the rows of a
  // (sequence, kv head) are (query token x the group's query heads), token-major, in warps
  // of rows_per_warp rows, so every warp of the group reads the same K/V tiles.
  int q_per_seq = 1;
  // The cluster merge (kDecodeClusterBlocks blocks per (sequence, kv head), the splits
  // merged through distributed shared memory inside the split-KV kernel, no merge launch):
  // -1 by the plan's rule where chunk_tiles is 0 (every block on an SM of its own and at most
  // 8 tiles of 16 tokens per warp: one query up to 4k tokens; KVQ_DECODE_CLUSTER=0 turns it
  // off, =force takes it wherever it can run), 0 never, 1 wherever it can run.
  int cluster = -1;
  // Blocks per cluster: 0 by the rule (kDecodeClusterBlocksMax where it gives a warp fewer tiles
  // and that many clusters can be resident at once, else kDecodeClusterBlocks;
  // KVQ_DECODE_CLUSTER_BLOCKS=8|16 sets it), or 8 / 16.
  int cluster_blocks = 0;
};

// Blocks per cluster of the cluster merge: the portable cluster size, and the largest (a
// non-portable size on Hopper: 16 blocks of a GPC), taken for several head chunks, whose
// warps then walk half the tiles.
inline constexpr int kDecodeClusterBlocks = 8;
inline constexpr int kDecodeClusterBlocksMax = 16;
// Splits of one (sequence, kv head, head chunk) the cluster merge takes at most (one per lane).
inline constexpr int kDecodeClusterMaxSplits = 32;

struct DecodePlan {
  int32_t num_seqs = 0;
  int32_t chunk_tiles = 0;    // minimum tiles per work item
  int32_t max_splits = 0;     // work items per (sequence, kv head, head chunk), at most
  int32_t head_chunks = 0;    // ceil(q_per_seq * gqa_ratio / rows_per_warp)
  int32_t q_per_seq = 1;      // query tokens per sequence, at most
  int32_t rows_per_warp = 8;  // decode_rows_per_warp: 16 (all MMA rows live) for q_per_seq > 1
  // Blocks per cluster where the splits are merged inside the split-KV kernel (one cluster per
  // (sequence, kv head), max_splits x head_chunks <= 4 warps x cluster, max_splits <= 32; 8 or
  // 16 blocks), 0: the merge kernel.
  int32_t cluster = 0;
  size_t workspace_bytes = 0;
};

// Visible kv positions [lo, hi) of query t (0 .. q_len - 1) of a sequence whose q_len new
// queries sit at its last positions (AttentionArgs semantics: query t at kv_len - q_len + t).
__host__ __device__ inline void decode_query_range(int kv_len, int q_len, int t, int attention_kind,
                                                   int window, int& lo, int& hi) {
  const int p = kv_len - q_len + t;
  hi = attention_kind == static_cast<int>(AttentionKind::kNonCausal) ? kv_len : p + 1;
  lo = 0;
  if (attention_kind == static_cast<int>(AttentionKind::kSlidingWindow) && p + 1 > window)
    lo = p + 1 - window;
}

// Visible kv positions [lo, hi) of the decode query (the last position) of a sequence.
__host__ __device__ inline void decode_visible_range(int kv_len, int attention_kind, int window,
                                                     int& lo, int& hi) {
  decode_query_range(kv_len, 1, 0, attention_kind, window, lo, hi);
}

// Tiles per work item and the number of work items of a sequence with `tiles` visible tiles:
// every item gets at least chunk_tiles, and no sequence more than max_splits items.
__host__ __device__ inline int decode_num_splits(int tiles, int chunk_tiles, int max_splits,
                                                 int& chunk) {
  chunk = chunk_tiles;
  if (max_splits > 0 && (tiles + chunk - 1) / chunk > max_splits)
    chunk = (tiles + max_splits - 1) / max_splits;
  return tiles <= 0 ? 0 : (tiles + chunk - 1) / chunk;
}

// The tiles any of a sequence's q_len queries sees (from its first query's lo to kv_len):
// the work items split this range, the same for every head chunk of the sequence.
__host__ __device__ inline int decode_visible_tiles(int kv_len, int q_len, int attention_kind,
                                                    int window, int& first_tile) {
  int lo = 0, hi = 0;
  decode_query_range(kv_len, q_len < 1 ? 1 : q_len, 0, attention_kind, window, lo, hi);
  hi = kv_len;
  first_tile = lo / kDecodeTileTokens;
  return hi <= lo ? 0 : (hi + kDecodeTileTokens - 1) / kDecodeTileTokens - first_tile;
}

// Host-side scheduling. `seq_lens` is the host copy of block_table.seq_lens (each >= 1).
DecodePlan plan_decode(const LayerKvSpec& spec, std::span<const int32_t> seq_lens,
                       const DecodeOptions& options = {});

// Everything in device memory. q: [rows][num_q_heads][head_dim] fp32 (model space, not
// rotated); out: the same shape. Without q_indptr row i is the query of sequence i at position
// seq_lens[i] - 1; with it, sequence i's queries are rows q_indptr[i] .. q_indptr[i + 1] (at
// most plan.q_per_seq of them; 0 allowed) at its last positions, as in PrefillArgs.
// block_table arrays and the cache view are device pointers; workspace holds
// plan.workspace_bytes (256-byte aligned).
struct DecodeArgs {
  const float* q = nullptr;
  float* out = nullptr;
  const int32_t* q_indptr = nullptr;  // device, num_seqs + 1; null: one query per sequence
  BlockTableView block_table;
  LayerCacheView cache;
  float softmax_scale = 1.0f;
  float logit_soft_cap = 0.0f;
  void* workspace = nullptr;
};

// Launches the decode on `stream` (asynchronous). The spec must pass
// decode_unsupported_reasons; the plan must come from plan_decode for the same spec and
// sequence lengths.
void run_decode(const LayerKvSpec& spec, const DecodePlan& plan, const DecodeArgs& args,
                cudaStream_t stream);

}  // namespace kvq::cuda
