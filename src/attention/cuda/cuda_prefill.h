// CUDA prefill / chunked-prefill attention over the paged, quantized cache (tensor cores).
//
// The device-level entry points behind the "cuda" backend for sequences with more than one
// new query, for callers that keep the block table on the device (the CUDA model runner,
// benchmarks):
//   prefill_unsupported_reasons  what the kernels cannot run (empty: supported);
//   plan_prefill                 host-side sizing from the host copies of q_indptr / seq_lens;
//   run_prefill                  one launch on `stream`: asynchronous, no host sync, no
//                                allocation (graph-capturable).
//
// Work split (flash-attention-2 style): a block of 4 warps owns (sequence, kv head, 128 query
// rows; 64 at head_dim 256), where the rows are (query token x query heads of the GQA group),
// row-major, so one K/V tile serves the whole group. Each warp owns 32 rows (16 at head_dim
// 256), so each K / V fragment it reads from shared memory serves two MMA row tiles. Per tile
// of 32 kv tokens (64 at head_dim 64) the block stages the raw cache bytes of K and V (and their
// per-token scales) in shared memory with cp.async (2-3 stages, one barrier per tile); 16-bit
// sides are ldmatrix'ed straight from the staged rows, 8-bit sides are ldmatrix'ed as bytes and
// converted to fp16 in registers (head dim permuted to make that cheap), fp32 / 4-bit sides
// are dequantized into a 16-bit tile first. S = Q K^T and O += P V run as m16n8k16 MMAs
// with fp32 accumulation and an fp32 online softmax.
// Tiles wholly outside every row's visible range are skipped (causal / sliding window); only
// the boundary tiles are masked per element.
//
// Scales as in the decode kernels: per-tensor K scales fold into the per-row logit factor,
// per-token K scales multiply the logits, per-token V scales multiply P (normalized by the
// running maximum V scale of the block so fp16 P cannot underflow), int4 zero points add
// z * sum(q) to a logit and sum(p * z) to an output, nvfp4 block scales are applied while
// dequantizing (e2m1 x e4m3 is exact in fp16), a rotated K gets a rotated Q (in the kernel),
// and a rotated V's output is un-rotated before it is written. Q and P are fp16 (Q with a
// per-row power-of-two scale) or bf16, never fp8.
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

// Query rows (token x group head) per block: 4 warps of two 16-row MMA tiles each, one at
// head_dim 256 (its accumulators take twice the registers).
constexpr int prefill_rows_per_block(int head_dim) {
  return head_dim <= 128 ? 128 : 64;
}
// Query rows per block of the small-q kernel (4 warps of one 16-row MMA tile each), for batches
// whose sequences have at most that many rows (q_len x GQA group: speculative verification,
// short chunks): fewer registers and more blocks per SM where a big block would have few live
// warps. 0: none at this head_dim.
constexpr int prefill_small_q_rows(int head_dim) {
  return head_dim <= 128 ? 64 : 0;
}
// Query rows per block of the verification kernel (prefill_verify_kernel.cuh): every
// sequence's rows (q_len x GQA group) within 32, the speculative verification shape; the kv
// tokens are its MMA rows and the 32 query rows its columns.
constexpr int prefill_verify_rows() {
  return 32;
}
// Blocks per SM the kernel is built for (its launch bounds; shared memory fits them too): the
// mma.sync kernel 3 for the small-q block, 2 for the full one, 1 at head_dim 256; the wgmma
// kernel 1, the verification kernel 2. The split planner counts waves with it.
constexpr int prefill_blocks_per_sm(int head_dim, int rows_per_block, bool wgmma = false) {
  if (wgmma) return 1;
  if (rows_per_block == prefill_verify_rows()) return 2;
  return head_dim == 256 ? 1 : (rows_per_block < prefill_rows_per_block(head_dim) ? 3 : 2);
}
inline constexpr int kPrefillMaxKvHeads = 128;

// The (K, V) pairs and head dims the warpgroup-MMA (wgmma, sm_90a) prefill kernel is built for:
// 16-bit and per-tensor-scaled fp8 sides, head_dim 64 / 128. Other layers (per-token-head and
// 4-bit scales, fp32, head_dim 256) run the mma.sync kernel.
constexpr bool prefill_wgmma_side(KvDtype d) {
  return d == KvDtype::kBFloat16 || d == KvDtype::kFloat16 || d == KvDtype::kFp8E4M3 ||
         d == KvDtype::kFp8E5M2;
}
constexpr bool prefill_wgmma_pair(KvDtype k, KvDtype v, int head_dim) {
  return prefill_wgmma_side(k) && prefill_wgmma_side(v) && (head_dim == 64 || head_dim == 128);
}

// The (K, V) pairs and head dims the verification kernel is built for: 16-bit, 8-bit
// (per-tensor or per-token-head scales) and int4_per_token_head sides, and nvfp4 / nvfp4,
// head_dim 64 / 128. fp32 caches keep the small-q block of the mma.sync kernel.
constexpr bool prefill_verify_side(KvDtype d) {
  return d == KvDtype::kBFloat16 || d == KvDtype::kFloat16 || d == KvDtype::kFp8E4M3 ||
         d == KvDtype::kFp8E5M2 || d == KvDtype::kInt8PerTokenHead ||
         d == KvDtype::kFp8PerTokenHead || d == KvDtype::kInt4PerTokenHead || d == KvDtype::kNvfp4;
}
constexpr bool prefill_verify_pair(KvDtype k, KvDtype v, int head_dim) {
  return prefill_verify_side(k) && prefill_verify_side(v) &&
         (k == KvDtype::kNvfp4) == (v == KvDtype::kNvfp4) && (head_dim == 64 || head_dim == 128);
}

// Reads KVQ_PREFILL_KERNEL (auto | mma | wgmma | verify) and KVQ_PREFILL_STAGING (auto | off |
// force): an InputError for any other value. The command line calls it first, so a typo fails
// before any work.
void check_prefill_kernel_env();

// Empty when the kernels can run `spec`: a (K, V) pair of kv_pairs.h, head_dim 64 / 128 / 256
// (K and V equal), block_tokens a multiple of 16, at most 128 kv heads.
std::vector<std::string> prefill_unsupported_reasons(const LayerKvSpec& spec);

struct PrefillPlan {
  int32_t num_seqs = 0;
  int32_t max_q_tiles = 0;     // blocks per (sequence, kv head) in the grid, at most
  int32_t rows_per_block = 0;  // prefill_rows_per_block or prefill_small_q_rows
  // Split-KV for small-q batches (speculative verification, short chunks after a long
  // context): each block's kv tiles are divided among num_splits blocks, which write
  // unnormalized partial outputs and their (max, sum) to the workspace; a merge kernel combines
  // them. 1: no split, no workspace.
  int32_t num_splits = 1;
  int32_t total_q = 0;         // query rows the workspace holds (tokens)
  size_t workspace_bytes = 0;  // num_splits > 1: the partials; else 0
  // The warp-specialized warpgroup-MMA kernel (rows_per_block is then its 128 rows) instead of
  // the mma.sync one; kernel_reason says why this kernel was chosen.
  bool wgmma = false;
  std::string kernel_reason;
  // > 0: the step's cache blocks (this many) are first expanded to a 16-bit copy in the
  // caller's staging buffer (staging_bytes of it), which the wgmma kernel then reads as a
  // float16 or bfloat16 cache (PrefillStageKind): a long prefill converts each kv tile once
  // instead of once per row block, and layers the wgmma kernel is not built for run it
  // (docs/notes/prefill-tuning.md v14). staging_reason says why or why not.
  int32_t staged_blocks = 0;
  size_t staging_bytes = 0;
  std::string staging_reason;
  // "wgmma", "verify", "mma" or "mma small-q".
  const char* kernel_name() const {
    return wgmma                                     ? "wgmma"
           : rows_per_block == prefill_verify_rows() ? "verify"
           : rows_per_block == 64                    ? "mma small-q"
                                                     : "mma";
  }
};

// Workspace a split plan may take at most (plan_prefill lowers num_splits to stay under it).
inline constexpr size_t kPrefillSplitWorkspaceBytes = size_t{32} << 20;

struct PrefillOptions {
  // > 0: split the kv range when the grid would not fill this many SMs twice (0: never split).
  int num_sms = 0;
  // Plan for sequences up to this long (a plan replayed from a CUDA graph on later, longer
  // steps); 0: the longest of seq_lens. The kernel divides each block's own tiles among the
  // splits, so a plan made for longer sequences stays correct on shorter ones.
  int32_t max_kv_len = 0;
  // Allow the small-q block shape (prefill_small_q_rows) where every sequence fits one block;
  // false keeps the default shape (benchmarks compare the two).
  bool small_q = true;
  // Which kernel runs the default (non-small-q) shape: kAuto takes the wgmma kernel where it is
  // built for the layer (prefill_wgmma_pair) unless KVQ_PREFILL_KERNEL=mma says otherwise;
  // kMma never does; kWgmma takes it wherever it is built, also instead of the small-q block.
  // Small-q batches whose rows fit the verification kernel's 32 (prefill_verify_rows) take it
  // under kAuto where it is built (prefill_verify_pair), and under kVerify; kMma and kWgmma
  // never do.
  enum class Kernel { kAuto, kMma, kWgmma, kVerify };
  Kernel kernel = Kernel::kAuto;
  // Bytes of the staging buffer the caller passes to run_prefill (PrefillArgs::staging); 0:
  // none, never stage. kAuto stages where the plan predicts a gain and the kernel choice allows
  // the wgmma kernel (not kMma) (KVQ_PREFILL_STAGING=off |
  // force overrides it for A/B runs), kOff never, kForce wherever it applies and fits. Plans
  // for later, longer steps (max_kv_len > 0) never stage.
  size_t staging_capacity = 0;
  enum class Staging { kAuto, kOff, kForce };
  Staging staging = Staging::kAuto;
};

// How a layer's cache can be staged for the wgmma kernel (head_dim 64 / 128):
//   kFp16   both sides per-tensor fp8 (e4m3 / e5m2): the codes exactly as fp16, the per-tensor
//           scales applied by the kernel as on the fp8 cache (the same result bits);
//   kBf16   a pair the wgmma kernel is not built for (per-token-head scales, 4-bit, fp32, and
//           the mixed pairs of those): every value dequantized (scales, zero points, un-rotated)
//           and rounded to bf16, as a bf16 cache would hold it, so the layer runs the wgmma
//           kernel instead of the mma.sync one;
//   kNone   everything else (16-bit pairs, the converting kernel's mixed pairs, head_dim 256).
enum class PrefillStageKind { kNone, kFp16, kBf16 };
PrefillStageKind prefill_stage_kind(const LayerKvSpec& spec);
inline bool prefill_stageable(const LayerKvSpec& spec) {
  return prefill_stage_kind(spec) != PrefillStageKind::kNone;
}
// False under KVQ_PREFILL_STAGING=off: callers need not allocate a staging buffer.
bool prefill_staging_enabled();
// Bytes of staging a plan takes for `blocks` cache blocks of `num_seqs` sequences of this
// layer (the 16-bit K and V blocks and the staged block table); a caller sizes its buffer with it.
size_t prefill_staging_bytes(const LayerKvSpec& spec, int64_t blocks, int64_t num_seqs);

// Host-side sizing. q_indptr (num_seqs + 1) and seq_lens (num_seqs) are the host copies of
// what run_prefill gets on the device; every sequence needs 0 <= q_len <= kv_len. Throws
// InputError on a bad batch, InternalError on an unsupported spec.
PrefillPlan plan_prefill(const LayerKvSpec& spec, std::span<const int32_t> q_indptr,
                         std::span<const int32_t> seq_lens, const PrefillOptions& options = {});

// Everything in device memory. q: [total_q][num_q_heads][head_dim] fp32, model space (not
// rotated); out: the same shape. Sequence i's queries are rows q_indptr[i] .. q_indptr[i+1]
// and sit at the last q_len_i of its seq_lens[i] cached positions (AttentionArgs semantics).
struct PrefillArgs {
  const float* q = nullptr;
  float* out = nullptr;
  const int32_t* q_indptr = nullptr;  // device, num_seqs + 1
  BlockTableView block_table;         // device arrays
  LayerCacheView cache;               // device bases
  float softmax_scale = 1.0f;
  float logit_soft_cap = 0.0f;  // 0: off
  void* workspace = nullptr;    // plan.workspace_bytes (may be null while that is 0)
  void* staging = nullptr;      // plan.staging_bytes (may be null while staged_blocks is 0)
};

// Launches the prefill on `stream` (asynchronous). The spec must pass
// prefill_unsupported_reasons; the plan must come from plan_prefill for the same spec and
// batch (a plan for a batch whose q_len are all at least as large also works).
void run_prefill(const LayerKvSpec& spec, const PrefillPlan& plan, const PrefillArgs& args,
                 cudaStream_t stream);

}  // namespace kvq::cuda
