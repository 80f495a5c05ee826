// Host side of the CUDA prefill: support checks, plan, and the launch (dispatch over the
// (K, V) pairs of kv_pairs.h, each instantiated in its own prefill_*.cu file).
#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include <cudaTypedefs.h>

#include "attention/cuda/cache_side.h"
#include "attention/cuda/cuda_prefill.h"
#include "attention/cuda/kv_pairs.h"
#include "attention/cuda/prefill_params.h"
#include "cache/cuda/cuda_check.h"
#include "kvq/core/error.h"

namespace kvq::cuda {

std::vector<std::string> prefill_unsupported_reasons(const LayerKvSpec& spec) {
  std::vector<std::string> r;
  if (!traits(spec.k_dtype).concrete || !traits(spec.v_dtype).concrete)
    r.push_back("K / V dtype is unresolved (auto)");
  else if (!cuda_kv_pair_supported(spec.k_dtype, spec.v_dtype))
    r.push_back("the CUDA prefill kernels are not built for K " +
                std::string(to_string(spec.k_dtype)) + " with V " +
                std::string(to_string(spec.v_dtype)) +
                " (built: K == V, and the mixed pairs of kv_pairs.h)");
  if (spec.head_dim_k != spec.head_dim_v)
    r.push_back("K head_dim " + std::to_string(spec.head_dim_k) + " differs from V head_dim " +
                std::to_string(spec.head_dim_v));
  if (spec.head_dim_k != 64 && spec.head_dim_k != 128 && spec.head_dim_k != 256)
    r.push_back("head_dim " + std::to_string(spec.head_dim_k) + " not in {64, 128, 256}");
  if (spec.block_tokens <= 0 || spec.block_tokens % 16 != 0)
    r.push_back("block_tokens " + std::to_string(spec.block_tokens) + " is not a multiple of 16");
  if (spec.num_kv_heads > kPrefillMaxKvHeads)
    r.push_back("num_kv_heads " + std::to_string(spec.num_kv_heads) + " exceeds " +
                std::to_string(kPrefillMaxKvHeads));
  return r;
}

namespace {
// The value of a switch `name` among `choices` (unset: the first), parsed once per process
// by the caller's static; an InputError names the accepted values.
template <class E, size_t N>
E env_choice(const char* name, const std::pair<const char*, E> (&choices)[N]) {
  const char* e = std::getenv(name);
  const std::string v = e == nullptr ? choices[0].first : e;
  std::string accepted;
  for (const auto& [text, value] : choices) {
    if (v == text) return value;
    accepted += (accepted.empty() ? "" : ", ") + std::string(text);
  }
  throw InputError(std::string(name) + "=" + v + " is not one of: " + accepted);
}

// KVQ_PREFILL_KERNEL=auto (default) | mma | wgmma | verify: the PrefillOptions::Kernel of plans
// made with kAuto (an A/B switch for whole-model runs).
PrefillOptions::Kernel env_kernel() {
  using K = PrefillOptions::Kernel;
  static const K k = env_choice<K>(
      "KVQ_PREFILL_KERNEL",
      {{"auto", K::kAuto}, {"mma", K::kMma}, {"wgmma", K::kWgmma}, {"verify", K::kVerify}});
  return k;
}

// KVQ_PREFILL_STAGING=auto (default) | off | force: the PrefillOptions::Staging of plans made
// with kAuto (an A/B switch for whole-model runs).
PrefillOptions::Staging env_staging() {
  using S = PrefillOptions::Staging;
  static const S k = env_choice<S>("KVQ_PREFILL_STAGING",
                                   {{"auto", S::kAuto}, {"off", S::kOff}, {"force", S::kForce}});
  return k;
}

// Kernel-lab switches (integers; 0 when unset): timing experiments, never needed for results.
int lab_env(const char* name) {
  const char* e = std::getenv(name);
  return e == nullptr ? 0 : std::atoi(e);
}

// The driver's cuTensorMapEncodeTiled, found through the runtime (no link to libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    KVQ_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                    cudaEnableDefault, &q));
    KVQ_CHECK(f != nullptr && q == cudaDriverEntryPointSuccess,
              "cuda prefill: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A cache side as a 4-d tensor (head dim, token in block, kv head, block) for the wgmma kernel's
// TMA copies: 16-bit sides in boxes of 64 dims x 16 tokens in the 128-byte swizzle (its operand
// layout), 8-bit sides in boxes of 16 whole rows, unswizzled (its staging layout).
CUtensorMap cache_side_map(const LayerCacheView& cache, KvSide side) {
  const KvSideLayout& l = cache.layout(side);
  const bool wide = traits(l.dtype).bits == 16;
  CUtensorMap m{};
  const cuuint64_t dims[4] = {
      static_cast<cuuint64_t>(l.head_dim), static_cast<cuuint64_t>(l.block_tokens),
      static_cast<cuuint64_t>(l.num_kv_heads), static_cast<cuuint64_t>(cache.num_blocks)};
  const cuuint64_t strides[3] = {l.row_data_bytes, l.head_stride, l.block_bytes};
  const cuuint32_t box[4] = {wide ? 64u : static_cast<cuuint32_t>(l.head_dim), 16, 1, 1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      &m, wide ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 4,
      cache.base(side), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
      wide ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  KVQ_CHECK(r == CUDA_SUCCESS, "cuda prefill: cuTensorMapEncodeTiled failed (" +
                                   std::to_string(static_cast<int>(r)) + ")");
  return m;
}

// KVQ_PREFILL_SPLIT_RULE=blocks: the small-q grids' splits by the older rule (about four blocks
// per SM) instead of whole waves (an A/B switch).
bool split_by_waves() {
  static const bool waves = [] {
    const char* e = std::getenv("KVQ_PREFILL_SPLIT_RULE");
    return e == nullptr || std::string(e) != "blocks";
  }();
  return waves;
}
}  // namespace

void check_prefill_kernel_env() {
  (void)env_kernel();
  (void)env_staging();
}

bool prefill_staging_enabled() {
  return env_staging() != PrefillOptions::Staging::kOff;
}

PrefillStageKind prefill_stage_kind(const LayerKvSpec& spec) {
  auto fp8 = [](KvDtype d) { return d == KvDtype::kFp8E4M3 || d == KvDtype::kFp8E5M2; };
  const int hd = spec.head_dim_k;
  if (spec.head_dim_v != hd || (hd != 64 && hd != 128)) return PrefillStageKind::kNone;
  if (!traits(spec.k_dtype).concrete || !traits(spec.v_dtype).concrete)
    return PrefillStageKind::kNone;
  if (fp8(spec.k_dtype) && fp8(spec.v_dtype)) return PrefillStageKind::kFp16;
  if (!prefill_wgmma_pair(spec.k_dtype, spec.v_dtype, hd)) return PrefillStageKind::kBf16;
  return PrefillStageKind::kNone;
}

namespace {
constexpr size_t kStageAlign = 1024;
size_t stage_align(size_t n) {
  return (n + kStageAlign - 1) / kStageAlign * kStageAlign;
}
// The staging buffer: [indptr (num_seqs + 1)][indices (blocks)][K blocks][V blocks], each part
// 1024-byte aligned (TMA wants 16).
struct StageLayout {
  size_t indices = 0, k = 0, v = 0, bytes = 0;
  KvSideLayout side;
};
StageLayout stage_layout(const LayerKvSpec& spec, int64_t blocks, int64_t num_seqs) {
  StageLayout l;
  l.side = KvSideLayout::make(
      prefill_stage_kind(spec) == PrefillStageKind::kBf16 ? KvDtype::kBFloat16 : KvDtype::kFloat16,
      spec.num_kv_heads, spec.head_dim_k, spec.block_tokens);
  l.indices = stage_align(static_cast<size_t>(num_seqs + 1) * 4);
  l.k = l.indices + stage_align(static_cast<size_t>(blocks) * 4);
  l.v = l.k + stage_align(static_cast<size_t>(blocks) * l.side.block_bytes);
  l.bytes = l.v + stage_align(static_cast<size_t>(blocks) * l.side.block_bytes);
  return l;
}
}  // namespace

size_t prefill_staging_bytes(const LayerKvSpec& spec, int64_t blocks, int64_t num_seqs) {
  return stage_layout(spec, blocks, num_seqs).bytes;
}

namespace {
// Staging (PrefillPlan::staged_blocks): each row block of the wgmma kernel converts every kv tile
// it sees, so a tile is converted once per row block that sees it; staged, each block's bytes
// are converted once (a read of the codes and a write of twice their bytes) and the kernel runs
// at the 16-bit cache's speed. Lab (H200, 32 / 8 heads, docs/notes/prefill-tuning.md v14): a
// 64-token tile conversion in the kernel costs about 3 ns of GPU time (3.1-3.5 at 4k-8k causal),
// staging about 45 ns per staged 64-token tile of one kv head plus about 15 us (two launches;
// 1k causal: 19 us, a loss): stage where conversions >= 15 x staged tiles + 4800 (all heads).
// A bf16 staging moves the layer from the mma.sync kernel to the wgmma one, about 22 ns of GPU
// time per (row block, kv tile) at 1k causal (118 -> 70 us for bf16): stage where conversions
// >= 2 x staged tiles + 700.
// `bf16_ok`: the plan's shape and kernel choice allow the wgmma kernel over a bf16 staging.
void plan_staging(PrefillPlan& plan, const LayerKvSpec& spec, std::span<const int32_t> q_indptr,
                  std::span<const int32_t> seq_lens, const PrefillOptions& options, bool bf16_ok) {
  PrefillOptions::Staging mode = options.staging;
  if (mode == PrefillOptions::Staging::kAuto) mode = env_staging();
  auto no = [&](std::string why) { plan.staging_reason = "not staged: " + why; };
  const PrefillStageKind kind = prefill_stage_kind(spec);
  if (kind == PrefillStageKind::kNone)
    return no("the wgmma kernel reads this cache as it is (or not at this head_dim)");
  if (kind == PrefillStageKind::kFp16 && !plan.wgmma) return no("not the wgmma kernel");
  if (kind == PrefillStageKind::kBf16 && !bf16_ok)
    return no("the small-q block or the mma.sync kernel was chosen");
  if (mode == PrefillOptions::Staging::kOff) return no("staging is off");
  if (options.max_kv_len > 0) return no("a plan for later, longer steps");
  if (options.staging_capacity == 0) return no("no staging buffer");
  const int64_t bt = spec.block_tokens, ratio = spec.gqa_ratio(), rows = plan.rows_per_block;
  int64_t blocks = 0, staged_tiles = 0, conversions = 0;
  for (size_t i = 0; i < seq_lens.size(); ++i) {
    const int64_t kv = seq_lens[i], q = int64_t{q_indptr[i + 1]} - q_indptr[i];
    blocks += (kv + bt - 1) / bt;
    staged_tiles += (kv + 63) / 64;
    for (int64_t r0 = 0; r0 < q * ratio; r0 += rows) {
      const int64_t first = kv - q + r0 / ratio;  // positions of the block's first / last token
      const int64_t last = kv - q + std::min(q - 1, (r0 + rows - 1) / ratio);
      int64_t lo = 0, hi = kv;
      if (spec.attention != AttentionKind::kNonCausal) hi = last + 1;
      if (spec.attention == AttentionKind::kSlidingWindow)
        lo = std::max<int64_t>(0, first - spec.sliding_window + 1);
      conversions += (hi + 63) / 64 - lo / 64;
    }
  }
  const size_t bytes = prefill_staging_bytes(spec, blocks, plan.num_seqs);
  if (bytes > options.staging_capacity)
    return no("the step's " + std::to_string(blocks) + " blocks need " + std::to_string(bytes) +
              " bytes of staging, the buffer holds " + std::to_string(options.staging_capacity));
  const bool gain = kind == PrefillStageKind::kFp16
                        ? conversions >= 15 * staged_tiles + 4800 / spec.num_kv_heads
                        : conversions >= 2 * staged_tiles + 700 / spec.num_kv_heads;
  if (mode == PrefillOptions::Staging::kAuto && !gain)
    return no(std::to_string(conversions) + " tile conversions per kv head against " +
              std::to_string(staged_tiles) + " staged tiles: no gain");
  plan.staged_blocks = static_cast<int32_t>(blocks);
  plan.staging_bytes = bytes;
  plan.staging_reason = "staged: " + std::to_string(conversions) +
                        " tile conversions per kv head become " + std::to_string(staged_tiles);
  if (kind == PrefillStageKind::kBf16) {
    plan.wgmma = true;
    plan.kernel_reason =
        "warpgroup MMA over a bf16 staging of the cache (" + plan.kernel_reason + ")";
  }
}
}  // namespace

PrefillPlan plan_prefill(const LayerKvSpec& spec, std::span<const int32_t> q_indptr,
                         std::span<const int32_t> seq_lens, const PrefillOptions& options) {
  const auto reasons = prefill_unsupported_reasons(spec);
  KVQ_CHECK(reasons.empty(), "plan_prefill: unsupported layer: " + reasons.front());
  KVQ_CHECK(spec.num_kv_heads > 0 && spec.num_q_heads % spec.num_kv_heads == 0,
            "plan_prefill: bad head counts");
  if (q_indptr.size() != seq_lens.size() + 1)
    throw InputError("plan_prefill: q_indptr has " + std::to_string(q_indptr.size()) +
                     " entries for " + std::to_string(seq_lens.size()) +
                     " sequences; expected num_seqs + 1");
  PrefillPlan plan;
  plan.num_seqs = static_cast<int32_t>(seq_lens.size());
  const int64_t ratio = spec.gqa_ratio();
  int64_t max_rows = 0, max_kv = options.max_kv_len;
  for (size_t i = 0; i < seq_lens.size(); ++i) {
    max_kv = std::max<int64_t>(max_kv, seq_lens[i]);
    const int64_t q_len = static_cast<int64_t>(q_indptr[i + 1]) - q_indptr[i];
    if (q_len < 0 || q_len > seq_lens[i])
      throw InputError("plan_prefill: sequence " + std::to_string(i) + " has " +
                       std::to_string(q_len) + " queries for " + std::to_string(seq_lens[i]) +
                       " cached tokens; expected 0 <= q_len <= kv_len");
    max_rows = std::max(max_rows, q_len * ratio);
  }
  // Every sequence's rows fit one small-q block: that kernel (each block reads its K/V once
  // either way, and the small one keeps more warps busy per SM).
  PrefillOptions::Kernel choice = options.kernel;
  if (choice == PrefillOptions::Kernel::kAuto) choice = env_kernel();
  const bool wgmma_built = prefill_wgmma_pair(spec.k_dtype, spec.v_dtype, spec.head_dim_k) &&
                           spec.head_dim_v == spec.head_dim_k;
  // Where the wgmma kernel is built for the layer it also takes the small-q batches (the
  // verification shape): measured faster than the small-q mma.sync block at batch >= 8, about
  // even at batch 1 (docs/notes/prefill-tuning.md v16); KVQ_PREFILL_KERNEL=mma keeps small-q.
  // Every sequence's rows within the verification kernel's 32, where it is built: that kernel
  // (each K / V value converted once for all the rows), except for 16-bit caches, which the
  // wgmma kernel reads without conversions and measured faster (H100, batch 1-64 x 1k-8k:
  // 3-25%; docs/notes/prefill-tuning.md v17). kVerify takes it wherever it is built.
  const bool verify_built = prefill_verify_pair(spec.k_dtype, spec.v_dtype, spec.head_dim_k) &&
                            spec.head_dim_v == spec.head_dim_k;
  const bool sixteen = traits(spec.k_dtype).bits == 16 && traits(spec.v_dtype).bits == 16;
  const bool verify = options.small_q && max_rows <= prefill_verify_rows() && verify_built &&
                      (choice == PrefillOptions::Kernel::kVerify ||
                       (choice == PrefillOptions::Kernel::kAuto && !(sixteen && wgmma_built)));
  const bool wgmma_auto = choice == PrefillOptions::Kernel::kAuto && wgmma_built;
  const int small = options.small_q && choice != PrefillOptions::Kernel::kWgmma && !wgmma_auto
                        ? prefill_small_q_rows(spec.head_dim_k)
                        : 0;
  const int64_t rows_per_block = verify ? prefill_verify_rows()
                                 : small > 0 && max_rows <= small
                                     ? small
                                     : prefill_rows_per_block(spec.head_dim_k);
  plan.rows_per_block = static_cast<int32_t>(rows_per_block);
  if (verify) {
    plan.kernel_reason =
        "every sequence's rows fit the verification kernel's " +
        std::to_string(prefill_verify_rows()) +
        " (tokens as MMA rows, each K / V value converted once for all query rows)";
  } else if (rows_per_block == small) {
    plan.kernel_reason = "every sequence's rows fit one small-q block";
  } else if (choice == PrefillOptions::Kernel::kMma) {
    plan.kernel_reason = "the mma.sync kernel was asked for";
  } else if (!wgmma_built) {
    plan.kernel_reason =
        "the wgmma kernel is not built for K " + std::string(to_string(spec.k_dtype)) + " / V " +
        std::string(to_string(spec.v_dtype)) + " at head_dim " + std::to_string(spec.head_dim_k) +
        " (built: 16-bit and per-tensor fp8 sides, head_dim 64 / 128)";
  } else {
    plan.wgmma = true;
    plan.kernel_reason = "warpgroup MMA: the wgmma kernel is built for this layer";
    if (wgmma_auto && options.small_q && max_rows <= prefill_small_q_rows(spec.head_dim_k))
      plan.kernel_reason += " (also for small-q batches: faster than the small-q block)";
  }
  const int64_t max_tiles = (max_rows + rows_per_block - 1) / rows_per_block;
  KVQ_CHECK(max_tiles < (int64_t{1} << 31), "plan_prefill: too many queries in one sequence");
  plan_staging(plan, spec, q_indptr, seq_lens, options,
               !verify && rows_per_block != small && choice != PrefillOptions::Kernel::kMma);
  plan.max_q_tiles = static_cast<int32_t>(max_tiles);
  plan.total_q = q_indptr.empty() ? 0 : q_indptr.back();
  plan.workspace_bytes = 0;
  if (options.num_sms > 0 && max_tiles > 0 && plan.total_q > 0) {
    // Each split at least 4 kv tiles of the longest sequence, at most 32 splits, and the
    // partials within kPrefillSplitWorkspaceBytes; within that, about four blocks per SM (a few
    // waves, so no long tail), or for a small-q grid that fits two waves of resident blocks, the
    // count that minimizes (waves) x (kv tiles per split), fewer splits on ties (less to merge):
    // those blocks are latency-bound, so a block takes about its tile count, and a launch of 1.1
    // waves takes as long as 2 (Llama-3-8B verification, batch 8 x 8 queries x 8 kv heads: 9
    // splits made 576 blocks for 396 slots; 6 make one wave; docs/notes/prefill-tuning.md).
    const int64_t blocks = max_tiles * spec.num_kv_heads * plan.num_seqs;
    const int64_t kv_tile = verify || spec.head_dim_k <= 64 ? 64 : 32;
    const int64_t kv_tiles = (max_kv + kv_tile - 1) / kv_tile;
    const int64_t per_split = int64_t{plan.total_q} * spec.num_q_heads * (spec.head_dim_v * 4 + 8);
    // The verification kernel at most 16 (each split's warps fill their rings once; H100 fp8
    // batch 1 x 8k: 16 splits 32.0 us, 32 splits 36.8; docs/notes/prefill-tuning.md v18).
    const int64_t cap =
        std::min({verify ? int64_t{16} : int64_t{32} /* prefill_merge_kernel: a split a lane */,
                  kv_tiles / 4, static_cast<int64_t>(kPrefillSplitWorkspaceBytes) / per_split});
    const int64_t slots =
        int64_t{options.num_sms} *
        prefill_blocks_per_sm(spec.head_dim_k, static_cast<int>(rows_per_block), plan.wgmma);
    int64_t splits = (4 * int64_t{options.num_sms} + blocks - 1) / blocks;
    // The same for the wgmma kernel (one block an SM) where every sequence is one row block,
    // over grids of up to two waves or the unsplit grid (verification at batch 32 x 4k: 256
    // blocks, 1 split, where the older rule's 3 made 6 waves of blocks that each pay the
    // pipeline's fill: 196.7 -> 172.3 us; docs/notes/prefill-tuning.md v16).
    const bool wgmma_waves = plan.wgmma && max_tiles == 1;
    if (((rows_per_block == small && blocks <= slots) || wgmma_waves || verify) &&
        split_by_waves()) {
      splits = 1;
      int64_t best = -1;
      for (int64_t s = 1; s <= cap && (s == 1 || blocks * s <= 2 * slots); ++s) {
        const int64_t cost = (blocks * s + slots - 1) / slots * ((kv_tiles + s - 1) / s);
        if (best < 0 || cost < best) best = cost, splits = s;
      }
    }
    // Kernel lab: KVQ_PREFILL_SPLITS_LAB=n forces n splits (within the caps) on wgmma and
    // verification plans.
    static const int forced = lab_env("KVQ_PREFILL_SPLITS_LAB");
    if (forced > 0 && (plan.wgmma || verify)) splits = forced;
    splits = std::min(splits, cap);
    if (splits > 1) {
      plan.num_splits = static_cast<int32_t>(splits);
      plan.workspace_bytes = static_cast<size_t>(splits * per_split);
    }
  }
  return plan;
}

namespace {

// One warp per query row: out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s over the splits
// that saw anything (l_s > 0). Lane s holds split s's (m, l) (at most 32 splits), so the weights
// take one load and a few shuffles, and the loop over the splits' O rows has no load that waits
// on another (batch-1 verification has up to 32 splits, whose serial loads cost ~0.8 us each).
__global__ void prefill_merge_kernel(PrefillKernelParams p, int head_dim, int num_seqs) {
  const int rows = min(p.q_indptr[num_seqs] * p.num_q_heads, p.part_rows);
  const int warps = static_cast<int>(blockDim.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
  for (int row = static_cast<int>(blockIdx.x) * warps + static_cast<int>(threadIdx.x) / 32;
       row < rows; row += static_cast<int>(gridDim.x) * warps) {
    float2 ml = make_float2(-__int_as_float(0x7f800000), 0.0f);
    if (lane < p.num_splits) ml = p.part_ml[static_cast<size_t>(lane) * p.part_rows + row];
    const bool seen = ml.y > 0.0f;
    float mx = seen ? ml.x : -__int_as_float(0x7f800000);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
    const float w_lane = seen ? exp2f(ml.x - mx) : 0.0f;
    float sum = w_lane * (seen ? ml.y : 0.0f);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
#pragma unroll 4
    for (int sp = 0; sp < p.num_splits; ++sp) {
      const float w = __shfl_sync(0xffffffffu, w_lane, sp);
      // A split that saw nothing may not have written its row: its values are never used.
      const float* src = p.part_o + (static_cast<size_t>(sp) * p.part_rows + row) * head_dim;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (32 * e < head_dim) {
          const float x = src[lane + 32 * e];
          acc[e] = w != 0.0f ? fmaf(w, x, acc[e]) : acc[e];
        }
    }
    const float inv = 1.0f / sum;
    float* dst = p.out + static_cast<size_t>(row) * head_dim;
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (32 * e < head_dim) dst[lane + 32 * e] = acc[e] * inv;
  }
}

}  // namespace

void launch_prefill_merge(const PrefillKernelParams& p, int head_dim, int num_seqs,
                          cudaStream_t stream) {
  constexpr int kWarps = 8;
  const int blocks = std::max(1, std::min((p.part_rows + kWarps - 1) / kWarps, 4096));
  prefill_merge_kernel<<<blocks, kWarps * 32, 0, stream>>>(p, head_dim, num_seqs);
  KVQ_CUDA_CHECK_LAUNCH();
}

void run_prefill(const LayerKvSpec& spec, const PrefillPlan& plan, const PrefillArgs& args,
                 cudaStream_t stream) {
  const auto reasons = prefill_unsupported_reasons(spec);
  KVQ_CHECK(reasons.empty(), "run_prefill: unsupported layer: " + reasons.front());
  const BlockTableView& bt = args.block_table;
  KVQ_CHECK(bt.num_seqs == plan.num_seqs, "run_prefill: the plan was made for " +
                                              std::to_string(plan.num_seqs) + " sequences, got " +
                                              std::to_string(bt.num_seqs));
  KVQ_CHECK(bt.block_tokens == spec.block_tokens, "run_prefill: block table block_tokens differs");
  if (plan.num_seqs == 0 || plan.max_q_tiles == 0) return;
  KVQ_CHECK(plan.num_seqs <= 65535, "run_prefill: at most 65535 sequences per call");
  KVQ_CHECK(args.q && args.out && args.q_indptr && bt.indptr && bt.indices && bt.seq_lens &&
                args.cache.k_base && args.cache.v_base,
            "run_prefill: null pointer");

  PrefillKernelParams kp{};
  kp.k = make_cache_side<PrefillSide>(spec, args.cache, KvSide::kK);
  kp.v = make_cache_side<PrefillSide>(spec, args.cache, KvSide::kV);
  kp.q = args.q;
  kp.out = args.out;
  kp.q_indptr = args.q_indptr;
  kp.indptr = bt.indptr;
  kp.indices = bt.indices;
  kp.seq_lens = bt.seq_lens;
  // Staged: the 16-bit copy of the step's blocks, read as a float16 / bfloat16 cache through its
  // own table (fp16: with the fp8 sides' per-tensor scales).
  LayerCacheView staged_view;
  if (plan.staged_blocks > 0) {
    const PrefillStageKind kind = prefill_stage_kind(spec);
    KVQ_CHECK(plan.wgmma && kind != PrefillStageKind::kNone,
              "run_prefill: a staged plan for this layer");
    KVQ_CHECK(args.staging != nullptr, "run_prefill: a staged plan needs its staging buffer");
    KVQ_CHECK(kind != PrefillStageKind::kFp16 ||
                  (args.cache.k_layout.row_data_bytes == static_cast<size_t>(spec.head_dim_k) &&
                   args.cache.v_layout.row_data_bytes == static_cast<size_t>(spec.head_dim_v)),
              "run_prefill: staging expects rows of one byte per dim");
    const StageLayout l = stage_layout(spec, plan.staged_blocks, plan.num_seqs);
    auto* base = static_cast<std::byte*>(args.staging);
    PrefillStage st{};
    st.k = kp.k;
    st.v = kp.v;
    st.bf16 = kind == PrefillStageKind::kBf16 ? 1 : 0;
    st.k_dtype = spec.k_dtype;
    st.v_dtype = spec.v_dtype;
    st.k_rows = {args.cache.k_layout.row_data_bytes, args.cache.k_layout.row_scale_bytes};
    st.v_rows = {args.cache.v_layout.row_data_bytes, args.cache.v_layout.row_scale_bytes};
    st.k_rotated = traits(spec.k_dtype).rotated ? 1 : 0;
    st.v_rotated = traits(spec.v_dtype).rotated ? 1 : 0;
    st.signs = make_hadamard_signs();
    st.indptr = bt.indptr;
    st.indices = bt.indices;
    st.seq_lens = bt.seq_lens;
    st.num_seqs = plan.num_seqs;
    st.block_tokens = spec.block_tokens;
    st.num_kv_heads = spec.num_kv_heads;
    st.head_dim = spec.head_dim_k;
    st.blocks = plan.staged_blocks;
    st.s_indptr = reinterpret_cast<int32_t*>(base);
    st.s_indices = reinterpret_cast<int32_t*>(base + l.indices);
    st.k_out = reinterpret_cast<uint8_t*>(base + l.k);
    st.v_out = reinterpret_cast<uint8_t*>(base + l.v);
    st.out_block_bytes = l.side.block_bytes;
    st.out_head_stride = l.side.head_stride;
    launch_prefill_stage(st, stream);
    staged_view.k_base = base + l.k;
    staged_view.v_base = base + l.v;
    staged_view.k_layout = staged_view.v_layout = l.side;
    staged_view.num_blocks = plan.staged_blocks;
    // fp16: the fp8 sides' per-tensor scales stay with the kernel; bf16: applied in the staging.
    for (PrefillSide* side : {&kp.k, &kp.v}) {
      const PrefillSide scaled = *side;
      *side =
          make_cache_side<PrefillSide>(spec, staged_view, side == &kp.k ? KvSide::kK : KvSide::kV);
      if (kind == PrefillStageKind::kFp16)
        std::copy(std::begin(scaled.tensor_scale), std::end(scaled.tensor_scale),
                  std::begin(side->tensor_scale));
    }
    kp.indptr = st.s_indptr;
    kp.indices = st.s_indices;
  }
  const LayerCacheView& kv_view = plan.staged_blocks > 0 ? staged_view : args.cache;
  kp.num_q_heads = spec.num_q_heads;
  kp.num_kv_heads = spec.num_kv_heads;
  kp.ratio = spec.gqa_ratio();
  kp.rows_per_block = plan.rows_per_block;
  kp.wgmma = plan.wgmma ? 1 : 0;
  if (plan.wgmma && kv_view.num_blocks > 0) {
    kp.tma = 1;
    kp.k_map = cache_side_map(kv_view, KvSide::kK);
    kp.v_map = cache_side_map(kv_view, KvSide::kV);
  }
  kp.lab = lab_env("KVQ_PREFILL_LAB");
  kp.block_tokens = spec.block_tokens;
  kp.attention_kind = static_cast<int>(spec.attention);
  kp.window = spec.sliding_window;
  kp.softmax_scale = args.softmax_scale;
  kp.soft_cap = args.logit_soft_cap;
  kp.signs = make_hadamard_signs();
  kp.num_splits = std::max(1, plan.num_splits);
  if (kp.num_splits > 1) {
    KVQ_CHECK(args.workspace != nullptr, "run_prefill: a split plan needs its workspace");
    kp.part_rows = plan.total_q * spec.num_q_heads;
    kp.part_o = static_cast<float*>(args.workspace);
    kp.part_ml = reinterpret_cast<float2*>(kp.part_o + static_cast<size_t>(kp.num_splits) *
                                                           kp.part_rows * spec.head_dim_v);
  }
  const dim3 grid(static_cast<unsigned>(plan.max_q_tiles * kp.num_splits),
                  static_cast<unsigned>(spec.num_kv_heads), static_cast<unsigned>(plan.num_seqs));
  if (plan.staged_blocks == 0) {
    const bool launched = with_cuda_kv_pair(spec.k_dtype, spec.v_dtype, [&](auto k, auto v) {
      launch_prefill<decltype(k)::value, decltype(v)::value>(kp, spec.head_dim_k, grid, stream);
    });
    KVQ_CHECK(launched, "run_prefill: no kernel for this (K, V) pair");
  } else if (staged_view.k_layout.dtype == KvDtype::kBFloat16) {
    launch_prefill<KvDtype::kBFloat16, KvDtype::kBFloat16>(kp, spec.head_dim_k, grid, stream);
  } else {
    launch_prefill<KvDtype::kFloat16, KvDtype::kFloat16>(kp, spec.head_dim_k, grid, stream);
  }
  if (kp.num_splits > 1) launch_prefill_merge(kp, spec.head_dim_v, plan.num_seqs, stream);
}

}  // namespace kvq::cuda
