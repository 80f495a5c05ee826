// Host side of the CUDA decode (plan, launches) plus the two small kernels around the
// split-KV kernel: Q preparation (rotation, operand conversion, fragment order) and the merge
// of the splits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "attention/cuda/cache_side.h"
#include "attention/cuda/cuda_decode.h"
#include "attention/cuda/decode_params.h"
#include "attention/cuda/kv_pairs.h"
#include "cache/cuda/cuda_check.h"
#include "cache/cuda/dispatch.h"
#include "cache/cuda/kv_codec_device.cuh"
#include "kvq/core/error.h"

namespace kvq::cuda {

namespace {

// The fewest tiles per work item (a partial row of 8 heads costs 4 KB to write and read
// back; 8 tiles of fp8 K/V at head_dim 128 are 32 KB). A warp spends about 1 us per tile
// whatever the grid, so where the grid is tiny items go down to 2 tiles: the launch shortens
// more than the extra partial rows cost. One query per sequence: sequences x kv heads <= 16
// (default model, batch 1: 0.238-0.245 -> 0.218-0.224 ms per plain step; larger grids
// measured 1-3.5% slower with the small floor, and an 8B step at 1k plans for 96 tiles). Several
// queries (verification, DFlash blocks), whose warps hold 16 rows: sequences x kv heads <= 8 (batch
// 8 of the default model measured slower). At most 96 tiles for one query, 64 for several
// (docs/notes/decode-tuning.md versions 8 and 15). KVQ_DECODE_MIN_CHUNK_TILES /
// KVQ_DECODE_MQ_MIN_CHUNK_TILES=n (1..64) override the small floor of one-query / multi-query
// plans (A/B switches).
constexpr int kMinChunkTiles = 8;
constexpr int kMinChunkTilesTinyGrid = 2;
constexpr int kTinyGridMaxTiles = 96;

int env_floor(const char* name) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return kMinChunkTilesTinyGrid;
  const int n = std::atoi(e);
  return n >= 1 && n <= 64 ? n : kMinChunkTilesTinyGrid;
}

int min_chunk_tiles(int q_per_seq, int64_t seqs_x_kv_heads, int max_tiles) {
  if (q_per_seq > 1) {
    static const int multi = env_floor("KVQ_DECODE_MQ_MIN_CHUNK_TILES");
    return seqs_x_kv_heads <= 8 && max_tiles <= 64 ? multi : kMinChunkTiles;
  }
  // One query: up to 96 tiles (a context bucket of 1536 tokens; 8B batch 1 x 1k, H200: floor
  // 2 4.78-4.81 ms per step against 4.98-4.99 with 8, fp8 KV 4.88 vs 4.92-4.96, but at 4k
  // and 8k floor 2 was 1-3% slower; docs/notes/decode-tuning.md version 15).
  // KVQ_DECODE_TINY_MAX_TILES=n moves that limit (A/B).
  static const int tiny_max_tiles = [] {
    const char* e = std::getenv("KVQ_DECODE_TINY_MAX_TILES");
    return e == nullptr || *e == '\0' ? kTinyGridMaxTiles : std::max(1, std::atoi(e));
  }();
  static const int one = env_floor("KVQ_DECODE_MIN_CHUNK_TILES");
  return seqs_x_kv_heads <= 16 && max_tiles <= tiny_max_tiles ? one : kMinChunkTiles;
}

// The cluster merge (DecodePlan::cluster): where the plan's rule takes it. A cluster of 8
// blocks per (sequence, kv head), taken where every block has an SM of its own (sequences x
// kv heads x 8 <= SMs: the 8B shape at batch 1-2, the default model's 2 kv heads up to
// batch 8) and each warp walks at most
// kClusterMaxTiles tiles (one query, 32 splits: contexts up to 4k tokens; H200 kernel lab at
// batch 1, bf16 / fp8 / int4: faster than the split-KV kernel and its merge launch from 256 to
// 4k tokens, 15-20% slower at 8k with 16 tiles a warp; docs/notes/decode-tuning.md version
// 17). KVQ_DECODE_CLUSTER=0 | force and KVQ_DECODE_CLUSTER_MAX_TILES=n are the A/B switches.
constexpr int kClusterMaxTiles = 8;
// Several queries per sequence (verification, a DFlash block): the merge kernel they would
// otherwise need costs more (16-row partials), and the cluster won at up to 16 tiles a warp
// (8B verification at batch 1 x 1k, H200: 1 + 15 tokens, 4 warps of rows, 8 splits of 12
// tiles: 5.66 ms against 6.01 with the merge kernel; docs/notes/decode-tuning.md version 18).
constexpr int kClusterMaxTilesMulti = 16;

enum class ClusterUse { kAuto, kOff, kForce };

ClusterUse cluster_use_from_env() {
  static const ClusterUse use = [] {
    const char* e = std::getenv("KVQ_DECODE_CLUSTER");
    const std::string v = e == nullptr ? "" : e;
    if (v == "0") return ClusterUse::kOff;
    if (v == "force") return ClusterUse::kForce;
    return ClusterUse::kAuto;  // unset, empty, auto (other values fail in check_cuda_model_env)
  }();
  return use;
}

// KVQ_DECODE_CLUSTER_MAX_TILES=n sets both limits (A/B).
int cluster_max_tiles(bool multi_query) {
  static const int n = [] {
    const char* e = std::getenv("KVQ_DECODE_CLUSTER_MAX_TILES");
    return e == nullptr || *e == '\0' ? 0 : std::max(1, std::atoi(e));
  }();
  return n > 0 ? n : multi_query ? kClusterMaxTilesMulti : kClusterMaxTiles;
}

// KVQ_DECODE_CLUSTER_BLOCKS=8|16 (A/B; unset or empty: the rule).
int cluster_blocks_from_env() {
  static const int n = [] {
    const char* e = std::getenv("KVQ_DECODE_CLUSTER_BLOCKS");
    const int v = e == nullptr || *e == '\0' ? 0 : std::atoi(e);
    return v == kDecodeClusterBlocks || v == kDecodeClusterBlocksMax ? v : 0;
  }();
  return n;
}

// Clusters of `blocks` blocks of `kernel` (kDecodeWarps warps, `smem` bytes of dynamic shared
// memory each) that can be resident at once on the current device; 0 where such a cluster
// cannot launch (e.g. a partitioned device). Asked once per (device, kernel, size, bytes): the
// answer does not change, and the model plans inside graph capture too. Sizes past the portable
// 8 need the kernel's opt-in attribute, which is per device (tensor-parallel ranks plan on
// theirs), set here before the first query or launch there.
int max_active_clusters(DecodeMainKernel kernel, int blocks, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, size_t>, int> known;
  int dev = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev, reinterpret_cast<const void*>(kernel), blocks, smem);
  if (const auto it = known.find(key); it != known.end()) return it->second;
  if (blocks > kDecodeClusterBlocks)
    KVQ_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                        cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(kDecodeWarps * 32);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(blocks);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, reinterpret_cast<const void*>(kernel), &cfg) !=
      cudaSuccess) {
    (void)cudaGetLastError();  // not launchable here: the plan keeps the merge kernel
    n = 0;
  }
  known.emplace(key, n);
  return n;
}

constexpr size_t kAlign = 256;

size_t align_up(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

struct WorkspaceLayout {
  size_t qfrag = 0, qmeta = 0, part_o = 0, part_ml = 0, total = 0;
};

WorkspaceLayout workspace_layout(const LayerKvSpec& spec, const DecodePlan& plan) {
  const size_t hd = static_cast<size_t>(spec.head_dim_k);
  const size_t R = static_cast<size_t>(plan.rows_per_warp);
  const size_t groups = static_cast<size_t>(plan.num_seqs) * spec.num_kv_heads * plan.head_chunks;
  // The cluster merge keeps its partials in shared memory.
  const size_t rows = plan.cluster > 0 ? 0 : groups * static_cast<size_t>(plan.max_splits) * R;
  WorkspaceLayout w;
  w.qfrag = 0;
  w.qmeta = align_up(w.qfrag + groups * (hd / 16) * 32 * (R / 8) * sizeof(uint2));
  w.part_o = align_up(w.qmeta + groups * R * sizeof(float2));
  w.part_ml = align_up(w.part_o + rows * hd * sizeof(float));
  w.total = align_up(w.part_ml + rows * sizeof(float2));
  return w;
}

struct PrepParams {
  const float* q;
  const int32_t* q_indptr;  // null: one query per sequence
  uint2* qfrag;
  float2* qmeta;
  int num_q_heads, num_kv_heads, ratio, head_chunks, rows;  // rows: per warp (8 or 16)
  KvDtype k_dtype;
  bool rotate, bf16;
  float softmax_scale;
  HadamardSigns signs;
  float k_tensor_scale[kDecodeMaxKvHeads];
};

// One warp per (sequence, kv head, head chunk, row of the chunk): rotates Q for rotated K, converts
// it to the MMA operand type (fp16 with a power-of-two scale a so |q a| < 2, or bf16), and scatters
// it into the fragment order of decode_params.h. Rows past the sequence's queries (t >= q_len)
// become zeros.
// kRingSide: the same kernel with its own carveout (launch_by_dim's `ring`).
template <int HD, bool kRingSide>
__global__ void __launch_bounds__(32) decode_prep_kernel(const __grid_constant__ PrepParams p) {
  constexpr int E = HD / 32;
  __shared__ uint16_t row[HD];
  const int lane = static_cast<int>(threadIdx.x);
  const int r = static_cast<int>(blockIdx.x);
  const int seq = static_cast<int>(blockIdx.y);
  wait_for_previous_kernel();   // q comes from the kernel before (PDL, cache/cuda/pdl.h)
  allow_next_kernel();          // the split-KV kernel waits for this grid's writes before reading Q
  const int rloc = r % p.rows;  // row g + 8 * half of the chunk
  const int g = rloc % 8, half = rloc / 8;
  const int hc = (r / p.rows) % p.head_chunks;
  const int kvh = r / (p.rows * p.head_chunks);
  int q0 = 0, q_len = 0;
  decode_queries(p.q_indptr, seq, q0, q_len);
  const int rr = hc * p.rows + rloc;  // = t * ratio + h
  const int t = rr / p.ratio, hin = rr - t * p.ratio;
  const bool valid = t < q_len;
  float x[E];
  const float* src =
      p.q + (static_cast<size_t>(q0 + t) * p.num_q_heads + kvh * p.ratio + hin) * HD + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = valid ? src[e] : 0.0f;
  if (p.rotate) warp_hadamard_rotate<E>(x, lane, p.signs);
  const float amax = warp_finite_amax(x);
  float a = 1.0f;
  if (!p.bf16 && amax > 0.0f) a = ldexpf(1.0f, -ilogbf(amax));
  float qs = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float y = x[e] * a;  // exact: a is a power of two
    if (p.bf16) {
      const __nv_bfloat16 b = __float2bfloat16_rn(y);
      row[lane * E + e] = __bfloat16_as_ushort(b);
      qs += __bfloat162float(b);
    } else {
      const __half h = __float2half_rn(y);
      row[lane * E + e] = __half_as_ushort(h);
      qs += __half2float(h);
    }
  }
  const float qsum = warp_sum(qs);
  __syncwarp();
  const size_t group = (static_cast<size_t>(seq) * p.num_kv_heads + kvh) * p.head_chunks + hc;
  const int H = p.rows / 8;
  uint16_t* frag = reinterpret_cast<uint16_t*>(p.qfrag + group * (HD / 16) * 32 * H);
  for (int idx = lane; idx < HD; idx += 32) {
    const int c = idx / (HD / 4), v = idx % (HD / 4);
    const int s = v / 4, i = v % 4;
    frag[(((s * 32 + g * 4 + c) * H + half) * 2 + (i >> 1)) * 2 + (i & 1)] =
        row[k_dim_of(p.k_dtype, HD, c, v)];
  }
  if (lane == 0)
    p.qmeta[group * p.rows + rloc] =
        make_float2(valid ? p.softmax_scale * p.k_tensor_scale[kvh] / a : 0.0f, qsum);
}

struct MergeParams {
  const float* part_o;
  const float2* part_ml;
  const int32_t* seq_lens;
  const int32_t* q_indptr;  // null: one query per sequence
  int q_per_seq;            // gridDim.y = num_seqs * q_per_seq
  float* out;
  int num_q_heads, num_kv_heads, ratio, head_chunks, rows;  // rows: per warp (8 or 16)
  int chunk_tiles, max_splits, attention_kind, window;
  bool unrotate;
  bool early;  // pdl_early()
  HadamardSigns signs;
};

constexpr int kMergeThreads = 256;
constexpr int kMergeWarpMaxSplits = 8;

// The partial rows of one query row (a query token's head, decode_params.h's part row order):
// the row of split 0 and the distance between the rows of consecutive splits, plus the
// sequence's split count, the output row, and whether the query exists (t < q_len).
struct MergeRows {
  size_t row0, split_stride, out_row;
  int nsplit;
  bool valid;
};

// blockIdx.y = seq * q_per_seq + t.
__device__ __forceinline__ MergeRows merge_rows(const MergeParams& p, int qh) {
  const int seq = static_cast<int>(blockIdx.y) / p.q_per_seq;
  const int t = static_cast<int>(blockIdx.y) - seq * p.q_per_seq;
  int q0 = 0, q_len = 0;
  decode_queries(p.q_indptr, seq, q0, q_len);
  MergeRows r;
  r.valid = t < q_len;
  const int kvh = qh / p.ratio, hin = qh % p.ratio;
  const int rr = t * p.ratio + hin;
  const int hc = rr / p.rows, rloc = rr % p.rows;
  int first_tile = 0, chunk = 0;
  const int tiles =
      decode_visible_tiles(p.seq_lens[seq], q_len, p.attention_kind, p.window, first_tile);
  r.nsplit = decode_num_splits(tiles, p.chunk_tiles, p.max_splits, chunk);
  r.row0 = ((static_cast<size_t>(seq) * p.max_splits * p.num_kv_heads + kvh) * p.head_chunks + hc) *
               p.rows +
           rloc;
  r.split_stride = static_cast<size_t>(p.num_kv_heads) * p.head_chunks * p.rows;
  r.out_row = static_cast<size_t>(q0 + t);
  return r;
}

__device__ __forceinline__ float block_reduce(float v, bool is_max, float* scratch) {
  v = is_max ? warp_max(v) : warp_sum(v);
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  __syncthreads();  // scratch may still be read from a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kMergeThreads / 32; ++w) v = is_max ? fmaxf(v, scratch[w]) : v + scratch[w];
  return v;
}

// One block per (query head, sequence): every split's weight l * 2^(m - M) into shared
// memory, then kMergeThreads / HD groups of threads walk the splits (one dim per thread,
// several loads in flight), a sum over the groups, and the un-rotation of rotated V.
template <int HD, bool kRingSide>
__global__ void __launch_bounds__(kMergeThreads)
    decode_merge_kernel(const __grid_constant__ MergeParams p) {
  constexpr int kGroups = kMergeThreads / HD;
  constexpr int E = HD / 32;
  __shared__ float weight[kDecodeMaxSplits];
  __shared__ float partial[kMergeThreads];
  __shared__ float scratch[kMergeThreads / 32];
  const int tid = static_cast<int>(threadIdx.x);
  const int qh = static_cast<int>(blockIdx.x);
  wait_for_previous_kernel();  // the split-KV kernel's partials
  if (p.early) allow_next_kernel();
  const MergeRows mr = merge_rows(p, qh);
  const int nsplit = mr.nsplit;
  const size_t row0 = mr.row0, split_stride = mr.split_stride;
  if (!mr.valid) return;                   // no such query
  if (nsplit == 1 && !p.unrotate) return;  // the split-KV kernel wrote this head's output

  float mx = -__uint_as_float(kF32Inf);
  for (int s = tid; s < nsplit; s += kMergeThreads)
    mx = fmaxf(mx, p.part_ml[row0 + s * split_stride].x);
  mx = block_reduce(mx, true, scratch);
  float wsum = 0.0f;
  for (int s = tid; s < nsplit; s += kMergeThreads) {
    const float2 ml = p.part_ml[row0 + s * split_stride];
    const float w = ml.y * exp2f(ml.x - mx);
    weight[s] = w;
    wsum += w;
  }
  wsum = block_reduce(wsum, false, scratch);  // its barriers also publish weight[]

  const int d = tid % HD, grp = tid / HD;
  float acc = 0.0f;
  const float* src = p.part_o + row0 * HD + d;
#pragma unroll 8
  for (int s = grp; s < nsplit; s += kGroups)
    acc = fmaf(weight[s], src[s * split_stride * HD], acc);
  partial[tid] = acc;
  __syncthreads();
  if (tid < HD) {
    float o = 0.0f;
#pragma unroll
    for (int k = 0; k < kGroups; ++k) o += partial[k * HD + tid];
    // No split saw a key (a padding sequence of a graph step, seq_len 0): zeros, not 0 / 0.
    partial[tid] = wsum > 0.0f ? o / wsum : 0.0f;
  }
  __syncthreads();
  float* dst = p.out + (mr.out_row * p.num_q_heads + qh) * HD;
  if (p.unrotate) {
    if (tid < 32) {
      float x[E];
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = partial[tid * E + e];
      warp_hadamard_unrotate<E>(x, tid, p.signs);
#pragma unroll
      for (int e = 0; e < E; ++e) dst[tid * E + e] = x[e];
    }
  } else if (tid < HD) {
    dst[tid] = partial[tid];
  }
}

// For few splits: one warp per (sequence, query head), four heads per block.
template <int HD, bool kRingSide>
__global__ void __launch_bounds__(128)
    decode_merge_warp_kernel(const __grid_constant__ MergeParams p) {
  constexpr int E = HD / 32;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int qh = static_cast<int>(blockIdx.x) * 4 + static_cast<int>(threadIdx.x >> 5);
  if (qh >= p.num_q_heads) return;
  wait_for_previous_kernel();  // the split-KV kernel's partials
  if (p.early) allow_next_kernel();
  const MergeRows mr = merge_rows(p, qh);
  const int nsplit = mr.nsplit;
  const size_t row0 = mr.row0, split_stride = mr.split_stride;
  if (!mr.valid) return;                   // no such query
  if (nsplit == 1 && !p.unrotate) return;  // the split-KV kernel wrote this head's output
  float mx = -__uint_as_float(kF32Inf);
  for (int s = lane; s < nsplit; s += 32) mx = fmaxf(mx, p.part_ml[row0 + s * split_stride].x);
  mx = warp_max(mx);
  float wsum = 0.0f;
  for (int s = lane; s < nsplit; s += 32) {
    const float2 ml = p.part_ml[row0 + s * split_stride];
    wsum += ml.y * exp2f(ml.x - mx);
  }
  wsum = warp_sum(wsum);
  const float inv = 1.0f / wsum;
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.0f;
    // No split saw a key (a padding sequence of a graph step, seq_len 0): the output stays zeros.
#pragma unroll 4
  for (int s = 0; s < (wsum > 0.0f ? nsplit : 0); ++s) {
    const size_t row = row0 + s * split_stride;
    const float2 ml = p.part_ml[row];
    const float w = ml.y * exp2f(ml.x - mx) * inv;
    const float* src = p.part_o + row * HD + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = fmaf(w, src[e], acc[e]);
  }
  if (p.unrotate) warp_hadamard_unrotate<E>(acc, lane, p.signs);
  float* dst = p.out + (mr.out_row * p.num_q_heads + qh) * HD + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) dst[e] = acc[e];
}

// Which kernel launch_prep_merge starts.
enum class Aux { kPrep, kMergeWarp, kMergeBlock };

// Launches `kernel` on `stream`; `dependent`: with programmatic dependent launch, so it can
// be scheduled while the previous kernel (which must allow it) finishes.
template <typename Params>
void launch(void (*kernel)(Params), dim3 grid, unsigned threads, const Params& params,
            bool dependent, cudaStream_t stream) {
  launch_kernel(kernel, grid, dim3(threads), stream, dependent, params);
}

// `ring`: the split-KV kernel is a ring's (decode_ring_pair): the variants of the prep and
// merge kernels with the largest shared-memory carveout, as the ring's kernel has.
void launch_by_dim(int hd, Aux which, const PrepParams& pp, const MergeParams& mp, dim3 grid,
                   cudaStream_t stream, bool ring) {
  const bool known = with_head_dim(hd, [&](auto dim) {
    constexpr int HD = decltype(dim)::value;
    auto go = [&](auto c, auto kernel, unsigned threads, const auto& params, bool dependent) {
      if constexpr (decltype(c)::value) {
        static std::atomic<uint64_t> done{0};
        prefer_max_shared_once(reinterpret_cast<const void*>(kernel), done, 0);
      }
      launch(kernel, grid, threads, params, dependent, stream);
    };
    auto pick = [&](auto c) {
      constexpr bool kRingSide = decltype(c)::value;
      switch (which) {
        case Aux::kPrep:
          go(c, decode_prep_kernel<HD, kRingSide>, 32, pp, pdl_enabled());
          break;
        case Aux::kMergeWarp:
          go(c, decode_merge_warp_kernel<HD, kRingSide>, 128, mp, true);
          break;
        case Aux::kMergeBlock:
          go(c, decode_merge_kernel<HD, kRingSide>, kMergeThreads, mp, true);
          break;
      }
    };
    if (ring)
      pick(std::true_type{});
    else
      pick(std::false_type{});
  });
  KVQ_CHECK(known, "cuda decode: head_dim " + std::to_string(hd) + " unsupported");
}

DecodeMainKernel main_kernel(KvDtype k, KvDtype v, int hd, bool multi_query) {
  DecodeMainKernel f = nullptr;
  with_cuda_kv_pair(k, v, [&](auto kd, auto vd) {
    f = decode_main_kernel_for<decltype(kd)::value, decltype(vd)::value>(hd, multi_query);
  });
  KVQ_CHECK(f != nullptr, "cuda decode: no kernel for the K/V pair " + std::string(to_string(k)) +
                              " / " + std::string(to_string(v)) + " at head_dim " +
                              std::to_string(hd));
  return f;
}

// Tiles per work item. A warp of the split-KV kernel is latency-bound: its time per tile
// depends little on how many others run (ncu on an H100: a launch whose last round of blocks
// was 60% full took as long as 3 full rounds, docs/notes/decode-tuning.md), so a launch takes
// about (rounds of resident blocks) x (tiles per item). Pick the chunk that minimizes that
// product (the model overrates rounds of mostly idle warps, which run faster); near ties go to
// the larger chunk (fewer rounds and partial rows to merge).
int choose_chunk_tiles(std::span<const int> tiles, int kv_heads, int head_chunks,
                       int64_t resident_blocks, int min_chunk) {
  int max_tiles = 0;
  for (int t : tiles) max_tiles = std::max(max_tiles, t);
  if (max_tiles <= min_chunk || resident_blocks <= 0) return min_chunk;
  // Warps of a launch with chunk c, in blocks of kDecodeWarps (the grid is 1-D over every
  // (sequence, kv head, item), so blocks are full).
  auto blocks = [&](int c) {
    int64_t items = 0;
    for (int t : tiles) {
      int chunk = 0;
      items += decode_num_splits(t, c, kDecodeMaxSplits, chunk);
    }
    return (items * head_chunks * kv_heads + kDecodeWarps - 1) / kDecodeWarps;
  };
  auto cost = [&](int c) {
    const int64_t rounds = (blocks(c) + resident_blocks - 1) / resident_blocks;
    return rounds * std::max(c, (max_tiles + kDecodeMaxSplits - 1) / kDecodeMaxSplits);
  };
  // The best chunk overall, and the best one whose sequences need at most
  // kMergeWarpMaxSplits splits (the cheap warp-per-head merge).
  const int warp_merge_min =
      std::max(min_chunk, (max_tiles + kMergeWarpMaxSplits - 1) / kMergeWarpMaxSplits);
  int best = max_tiles, best_warp = max_tiles;
  int64_t best_cost = cost(max_tiles), best_warp_cost = best_cost;
  for (int64_t rounds = 1; rounds <= 8; ++rounds) {
    // The smallest chunk whose blocks fit in `rounds` rounds (blocks fall as the chunk grows).
    if (blocks(max_tiles) > rounds * resident_blocks) continue;
    int lo = min_chunk, hi = max_tiles;
    while (lo < hi) {
      const int mid = lo + (hi - lo) / 2;
      if (blocks(mid) <= rounds * resident_blocks)
        hi = mid;
      else
        lo = mid + 1;
    }
    // More rounds (smaller chunks) must win by more than 5%: each round and each extra split
    // costs time the model does not count (B 8 x ctx 16k: 2 rounds x 21 tiles, cost 42, ran
    // 6% slower than 1 round x 43, docs/notes/decode-tuning.md).
    const int64_t c = cost(lo);
    if (c * 20 < best_cost * 19) best = lo, best_cost = c;
    const int w = std::max(lo, warp_merge_min);
    const int64_t cw = cost(w);
    if (cw * 20 < best_warp_cost * 19) best_warp = w, best_warp_cost = cw;
  }
  // The block-per-head merge costs more than the model counts where there are many heads
  // (B 128 x 64 query heads, 12 splits: 8192 merge blocks; measured 16% slower than 4
  // splits at fp8, docs/notes/decode-tuning.md): prefer the warp merge within 10%.
  return best_warp_cost * 10 <= best_cost * 11 ? best_warp : best;
}

}  // namespace

std::vector<std::string> decode_unsupported_reasons(const LayerKvSpec& spec) {
  std::vector<std::string> r;
  const bool concrete = traits(spec.k_dtype).concrete && traits(spec.v_dtype).concrete;
  if (concrete && !cuda_kv_pair_supported(spec.k_dtype, spec.v_dtype)) {
    std::string accepted;
    for (const auto& [k, v] : kCudaMixedKvPairs)
      accepted += std::string(accepted.empty() ? "" : ", ") + std::string(to_string(k)) + "/" +
                  std::string(to_string(v));
    r.push_back("K/V dtype pair " + std::string(to_string(spec.k_dtype)) + "/" +
                std::string(to_string(spec.v_dtype)) +
                " has no CUDA decode kernel; built: K == V, and the mixed pairs (K/V) " + accepted);
  }
  if (spec.head_dim_k != spec.head_dim_v)
    r.push_back("K head_dim " + std::to_string(spec.head_dim_k) + " differs from V head_dim " +
                std::to_string(spec.head_dim_v));
  if (spec.head_dim_k != 64 && spec.head_dim_k != 128 && spec.head_dim_k != 256)
    r.push_back("head_dim " + std::to_string(spec.head_dim_k) + " not in {64, 128, 256}");
  if (spec.block_tokens <= 0 || spec.block_tokens % kDecodeTileTokens != 0)
    r.push_back("block_tokens " + std::to_string(spec.block_tokens) + " is not a multiple of 16");
  if (spec.num_kv_heads > kDecodeMaxKvHeads)
    r.push_back("num_kv_heads " + std::to_string(spec.num_kv_heads) + " exceeds " +
                std::to_string(kDecodeMaxKvHeads));
  if (!traits(spec.k_dtype).concrete) r.push_back("K dtype is unresolved (auto)");
  if (!traits(spec.v_dtype).concrete) r.push_back("V dtype is unresolved (auto)");
  return r;
}

DecodePlan plan_decode(const LayerKvSpec& spec, std::span<const int32_t> seq_lens,
                       const DecodeOptions& options) {
  const auto reasons = decode_unsupported_reasons(spec);
  KVQ_CHECK(reasons.empty(), "plan_decode: unsupported layer: " + reasons.front());
  KVQ_CHECK(spec.num_kv_heads > 0 && spec.num_q_heads % spec.num_kv_heads == 0,
            "plan_decode: bad head counts");
  KVQ_CHECK(options.q_per_seq >= 1 && options.q_per_seq <= kDecodeMaxQueries,
            "plan_decode: q_per_seq " + std::to_string(options.q_per_seq) + " outside 1.." +
                std::to_string(kDecodeMaxQueries));
  DecodePlan plan;
  plan.num_seqs = static_cast<int32_t>(seq_lens.size());
  plan.q_per_seq = options.q_per_seq;
  // Several queries: 16-row warps (every row of the MMAs live, each K/V tile converted once
  // for twice the rows) where their registers allow (head_dim <= 128).
  plan.rows_per_warp = decode_rows_per_warp(spec.head_dim_k, plan.q_per_seq > 1);
  plan.head_chunks =
      (options.q_per_seq * spec.gqa_ratio() + plan.rows_per_warp - 1) / plan.rows_per_warp;
  int num_sms = options.num_sms;
  if (num_sms <= 0) {
    int dev = 0;
    KVQ_CUDA_CHECK(cudaGetDevice(&dev));
    KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  }
  const int kind = static_cast<int>(spec.attention);
  std::vector<int> tiles;
  tiles.reserve(seq_lens.size());
  for (int32_t len : seq_lens) {
    KVQ_CHECK(len >= 1, "plan_decode: a decode sequence needs at least one cached token, got " +
                            std::to_string(len));
    int first = 0;
    tiles.push_back(decode_visible_tiles(len, plan.q_per_seq, kind, spec.sliding_window, first));
  }
  if (options.chunk_tiles > 0) {
    plan.chunk_tiles = options.chunk_tiles;
  } else {
    int per_sm = 0;
    KVQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, main_kernel(spec.k_dtype, spec.v_dtype, spec.head_dim_k, plan.q_per_seq > 1),
        kDecodeWarps * 32, 0));
    const int max_tiles = tiles.empty() ? 0 : *std::max_element(tiles.begin(), tiles.end());
    const int min_chunk = min_chunk_tiles(
        plan.q_per_seq, static_cast<int64_t>(tiles.size()) * spec.num_kv_heads, max_tiles);
    plan.chunk_tiles = choose_chunk_tiles(tiles, spec.num_kv_heads, plan.head_chunks,
                                          static_cast<int64_t>(num_sms) * per_sm, min_chunk);
  }
  plan.max_splits = 1;
  for (int32_t len : seq_lens) {
    int first = 0, chunk = 0;
    const int tiles = decode_visible_tiles(len, plan.q_per_seq, kind, spec.sliding_window, first);
    plan.max_splits = std::max(plan.max_splits,
                               decode_num_splits(tiles, plan.chunk_tiles, kDecodeMaxSplits, chunk));
  }
  // The cluster merge: every warp of a cluster is an item (4 x 8 = 32 per (sequence, kv
  // head) in a cluster of 8 blocks, 64 in one of 16), as many splits as the head chunks leave (at
  // most 32), each taking ceil(tiles / splits) tiles. The rule applies where the plan chooses
  // the work split; a caller's own chunk_tiles keeps the merge kernel unless the cluster merge
  // is forced. The cluster size: 16 where it gives more splits (two head chunks or more) and the
  // device holds every (sequence, kv head)'s cluster at once, else 8.
  ClusterUse use = options.cluster == 0   ? ClusterUse::kOff
                   : options.cluster == 1 ? ClusterUse::kForce
                                          : cluster_use_from_env();
  if (use == ClusterUse::kAuto && options.chunk_tiles > 0) use = ClusterUse::kOff;
  if (use != ClusterUse::kOff && !tiles.empty()) {
    const DecodeMainKernel kernel =
        main_kernel(spec.k_dtype, spec.v_dtype, spec.head_dim_k, plan.q_per_seq > 1);
    const size_t smem = decode_cluster_smem_bytes(spec.head_dim_k, plan.rows_per_warp);
    const int64_t groups = static_cast<int64_t>(tiles.size()) * spec.num_kv_heads;
    const int max_tiles = *std::max_element(tiles.begin(), tiles.end());
    auto splits_of = [&](int size) {
      return std::min(kDecodeClusterMaxSplits, kDecodeWarps * size / plan.head_chunks);
    };
    // Every cluster resident at once, on SMs of its own, and the device takes the size.
    auto fits = [&](int size) {
      return groups * size <= num_sms && max_active_clusters(kernel, size, smem) >= groups;
    };
    const int want =
        options.cluster_blocks != 0 ? options.cluster_blocks : cluster_blocks_from_env();
    KVQ_CHECK(want == 0 || want == kDecodeClusterBlocks || want == kDecodeClusterBlocksMax,
              "plan_decode: cluster_blocks " + std::to_string(want) + " is not 0, 8 or 16");
    int size = want;
    if (size == 0)
      size = splits_of(kDecodeClusterBlocksMax) > splits_of(kDecodeClusterBlocks) &&
                     fits(kDecodeClusterBlocksMax)
                 ? kDecodeClusterBlocksMax
                 : kDecodeClusterBlocks;
    const int cl_splits = splits_of(size);
    bool take = cl_splits >= 1 && use == ClusterUse::kForce;
    if (!take && cl_splits >= 1)
      take = fits(size) &&
             (max_tiles + cl_splits - 1) / cl_splits <= cluster_max_tiles(plan.q_per_seq > 1);
    if (take) {
      plan.cluster = size;
      plan.max_splits = cl_splits;
      plan.chunk_tiles = 1;
    }
  }
  plan.workspace_bytes = workspace_layout(spec, plan).total;
  return plan;
}

void run_decode(const LayerKvSpec& spec, const DecodePlan& plan, const DecodeArgs& args,
                cudaStream_t stream) {
  const auto reasons = decode_unsupported_reasons(spec);
  KVQ_CHECK(reasons.empty(), "run_decode: unsupported layer: " + reasons.front());
  const BlockTableView& bt = args.block_table;
  KVQ_CHECK(bt.num_seqs == plan.num_seqs, "run_decode: the plan was made for " +
                                              std::to_string(plan.num_seqs) + " sequences, got " +
                                              std::to_string(bt.num_seqs));
  KVQ_CHECK(bt.block_tokens == spec.block_tokens, "run_decode: block table block_tokens differs");
  if (plan.num_seqs == 0) return;
  KVQ_CHECK(static_cast<int64_t>(plan.num_seqs) * plan.q_per_seq <= 65535,
            "run_decode: at most 65535 sequences x queries per call");
  KVQ_CHECK(args.q && args.out && args.workspace && bt.indptr && bt.indices && bt.seq_lens &&
                args.cache.k_base && args.cache.v_base,
            "run_decode: null pointer");
  KVQ_CHECK(plan.q_per_seq > 1 || args.q_indptr == nullptr,
            "run_decode: q_indptr needs a plan made for several queries per sequence (q_per_seq)");
  const int hd = spec.head_dim_k;
  const WorkspaceLayout w = workspace_layout(spec, plan);
  KVQ_CHECK(w.total == plan.workspace_bytes, "run_decode: the plan does not match the spec");
  auto* ws = static_cast<std::byte*>(args.workspace);
  auto* qfrag = reinterpret_cast<uint2*>(ws + w.qfrag);
  auto* qmeta = reinterpret_cast<float2*>(ws + w.qmeta);
  auto* part_o = reinterpret_cast<float*>(ws + w.part_o);
  auto* part_ml = reinterpret_cast<float2*>(ws + w.part_ml);
  const HadamardSigns signs = make_hadamard_signs();

  PrepParams pp{};
  pp.q = args.q;
  pp.q_indptr = args.q_indptr;
  pp.qfrag = qfrag;
  pp.qmeta = qmeta;
  pp.num_q_heads = spec.num_q_heads;
  pp.num_kv_heads = spec.num_kv_heads;
  pp.ratio = spec.gqa_ratio();
  pp.head_chunks = plan.head_chunks;
  pp.rows = plan.rows_per_warp;
  pp.k_dtype = spec.k_dtype;
  pp.rotate = traits(spec.k_dtype).rotated;
  pp.bf16 = kv_bf16_operands(spec.k_dtype);
  pp.softmax_scale = args.softmax_scale;
  pp.signs = signs;
  const bool k_tensor_scaled = traits(spec.k_dtype).uses_tensor_scale;
  for (int h = 0; h < spec.num_kv_heads; ++h)
    pp.k_tensor_scale[h] = k_tensor_scaled ? spec.k_scale.for_head(h) : 1.0f;

  MergeParams mp{};
  mp.part_o = part_o;
  mp.part_ml = part_ml;
  mp.seq_lens = bt.seq_lens;
  mp.q_indptr = args.q_indptr;
  mp.q_per_seq = plan.q_per_seq;
  mp.out = args.out;
  mp.num_q_heads = spec.num_q_heads;
  mp.num_kv_heads = spec.num_kv_heads;
  mp.ratio = spec.gqa_ratio();
  mp.head_chunks = plan.head_chunks;
  mp.rows = plan.rows_per_warp;
  mp.chunk_tiles = plan.chunk_tiles;
  mp.max_splits = plan.max_splits;
  mp.attention_kind = static_cast<int>(spec.attention);
  mp.window = spec.sliding_window;
  mp.unrotate = traits(spec.v_dtype).rotated;
  mp.early = pdl_early(4);
  mp.signs = signs;

  DecodeKernelParams kp{};
  kp.k = make_cache_side<DecodeSide>(spec, args.cache, KvSide::kK);
  kp.v = make_cache_side<DecodeSide>(spec, args.cache, KvSide::kV);
  kp.indptr = bt.indptr;
  kp.indices = bt.indices;
  kp.seq_lens = bt.seq_lens;
  kp.q_indptr = args.q_indptr;
  kp.qfrag = qfrag;
  kp.qmeta = qmeta;
  kp.part_o = part_o;
  kp.part_ml = part_ml;
  kp.out = mp.unrotate ? nullptr : args.out;
  kp.num_q_heads = spec.num_q_heads;
  kp.num_seqs = plan.num_seqs;
  kp.num_kv_heads = spec.num_kv_heads;
  kp.ratio = spec.gqa_ratio();
  kp.head_chunks = plan.head_chunks;
  kp.block_tokens = spec.block_tokens;
  kp.chunk_tiles = plan.chunk_tiles;
  kp.max_splits = plan.max_splits;
  kp.attention_kind = static_cast<int>(spec.attention);
  kp.window = spec.sliding_window;
  kp.soft_cap = args.logit_soft_cap;
  kp.early = pdl_early(2);
  kp.cluster = plan.cluster;
  const DecodeMainKernel kernel = main_kernel(spec.k_dtype, spec.v_dtype, hd, plan.q_per_seq > 1);
  kp.unrotate = mp.unrotate;
  kp.signs = signs;
  if (plan.cluster > 0) {
    KVQ_CHECK(plan.cluster <= kDecodeClusterBlocksMax && plan.max_splits <= kDecodeClusterMaxSplits,
              "run_decode: a cluster plan of " + std::to_string(plan.cluster) + " blocks and " +
                  std::to_string(plan.max_splits) + " splits (at most " +
                  std::to_string(kDecodeClusterBlocksMax) + " and " +
                  std::to_string(kDecodeClusterMaxSplits) + ")");
    if (plan.cluster > kDecodeClusterBlocks)  // the opt-in attribute, for a plan made elsewhere
      (void)max_active_clusters(kernel, plan.cluster,
                                decode_cluster_smem_bytes(hd, plan.rows_per_warp));
    KVQ_CHECK(static_cast<int64_t>(plan.max_splits) * plan.head_chunks <=
                  static_cast<int64_t>(kDecodeWarps) * plan.cluster,
              "run_decode: a cluster plan with more items than the cluster's warps");
    kp.out = args.out;  // every row is final (the merge un-rotates)
  }

  // KVQ_DECODE_LAB (timing experiments only: the outputs are wrong), bits: 1 no Q prep,
  // 2 no merge. The step's time without a launch is its cost.
  static const int lab = [] {
    const char* e = std::getenv("KVQ_DECODE_LAB");
    return e == nullptr ? 0 : std::atoi(e);
  }();
  const auto seqs = static_cast<unsigned>(plan.num_seqs);
  const bool ring = plan.q_per_seq == 1 && decode_ring_pair(spec.k_dtype, spec.v_dtype, hd);
  if (!(lab & 1))
    launch_by_dim(
        hd, Aux::kPrep, pp, mp,
        dim3(static_cast<unsigned>(spec.num_kv_heads * plan.head_chunks * plan.rows_per_warp),
             seqs),
        stream, ring);
  if (plan.cluster > 0) {
    // One cluster per (sequence, kv head); the splits merge inside it.
    const int64_t blocks = static_cast<int64_t>(plan.num_seqs) * spec.num_kv_heads * plan.cluster;
    KVQ_CHECK(blocks <= 0x7FFFFFFF, "run_decode: grid too large");
    launch_kernel_cluster(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kDecodeWarps * 32),
                          decode_cluster_smem_bytes(hd, plan.rows_per_warp),
                          static_cast<unsigned>(plan.cluster), stream, true, kp);
    return;
  }
  const int64_t warps =
      static_cast<int64_t>(plan.max_splits) * plan.head_chunks * spec.num_kv_heads * plan.num_seqs;
  KVQ_CHECK((warps + kDecodeWarps - 1) / kDecodeWarps <= 0x7FFFFFFF, "run_decode: grid too large");
  launch(kernel, dim3(static_cast<unsigned>((warps + kDecodeWarps - 1) / kDecodeWarps)),
         kDecodeWarps * 32, kp, true, stream);
  // Sequences with a single split were written by the split-KV kernel (unless V is rotated);
  // the merge handles the rest: a warp per head for a few splits, a block for many.
  if ((plan.max_splits == 1 && !mp.unrotate) || (lab & 2)) return;
  const auto query_rows = static_cast<unsigned>(plan.num_seqs * plan.q_per_seq);
  if (plan.max_splits <= kMergeWarpMaxSplits)
    launch_by_dim(hd, Aux::kMergeWarp, pp, mp,
                  dim3(static_cast<unsigned>((spec.num_q_heads + 3) / 4), query_rows), stream,
                  ring);
  else
    launch_by_dim(hd, Aux::kMergeBlock, pp, mp,
                  dim3(static_cast<unsigned>(spec.num_q_heads), query_rows), stream, ring);
}

void prefer_max_shared_once(const void* f, std::atomic<uint64_t>& done, size_t max_dynamic_smem) {
  int dev = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t{1} << (dev & 63);
  if ((done.load(std::memory_order_acquire) & bit) != 0) return;
  KVQ_CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared));
  if (max_dynamic_smem > 0)
    KVQ_CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(max_dynamic_smem)));
  done.fetch_or(bit, std::memory_order_acq_rel);
}

}  // namespace kvq::cuda
