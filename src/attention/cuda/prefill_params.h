// Kernel parameters of the prefill kernels (private to src/attention/cuda): cuda_prefill.cu
// fills them, the prefill_<k>[__<v>].cu files instantiate the kernels.
#pragma once

#include <cuda.h>  // CUtensorMap (the struct only; no driver call is linked)
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/cuda/cuda_prefill.h"
#include "cache/cuda/kv_codec_device.cuh"
#include "kvq/core/kv_dtype.h"

namespace kvq::cuda {

struct PrefillSide {
  const uint8_t* base;
  uint64_t block_bytes, head_stride, values_bytes;
  float tensor_scale[kPrefillMaxKvHeads];  // per kv head (1 where unused)
};

struct PrefillKernelParams {
  PrefillSide k, v;
  const float* q;
  float* out;
  const int32_t* q_indptr;
  const int32_t* indptr;
  const int32_t* indices;
  const int32_t* seq_lens;
  int num_q_heads, num_kv_heads, ratio, block_tokens, attention_kind, window;
  int rows_per_block;  // the plan's block shape (picks the kernel; its Cfg has it too)
  int wgmma;           // 1: the warpgroup-MMA kernel (PrefillPlan::wgmma)
                       // (rows_per_block == prefill_verify_rows(): the verification kernel)
  // KVQ_PREFILL_LAB (timing experiments only, bits): 1 the wgmma producer copies nothing, 2 its
  // consumers skip the softmax, 4 no ping-pong, 8 two tiles in flight for 16-bit caches
  // instead of three (8-bit sides always keep two), 16 no TMA; 0 in use.
  int lab;
  // wgmma kernel: tensor maps of the two cache sides (dims: head dim, token in block, kv head,
  // block; 16-bit sides in boxes of 64 dims x 16 tokens in the 128-byte swizzle, 8-bit sides in
  // boxes of 16 whole rows) for bulk-tensor (TMA) copies of the kv tiles wholly inside a block's
  // visible range; tma 0: cp.async only.
  int tma;
  CUtensorMap k_map, v_map;
  float softmax_scale, soft_cap;  // soft_cap 0: off
  HadamardSigns signs;
  // Split-KV (PrefillPlan::num_splits > 1): grid.x = q tiles x num_splits; block (split, q tile)
  // takes its share of the q tile's kv tiles and writes, per query row (token x head, the index
  // of `out`), the unnormalized output to part_o[split][row][HD] and (max in log2 units, sum)
  // to part_ml[split][row]; rows with nothing visible in the share get sum 0.
  int num_splits;
  int part_rows;  // rows per split in part_o / part_ml (total_q x num_q_heads of the plan)
  float* part_o;
  float2* part_ml;
};

// The staging of a cache (PrefillPlan::staged_blocks, PrefillStageKind): the step's blocks, in
// block-table order, converted to 16-bit blocks of the same (kv head, token, dim) order.
struct PrefillStage {
  PrefillSide k, v;  // the cache sides
  int bf16;          // PrefillStageKind: 1 kBf16 (dequantized), 0 kFp16 (fp8 codes exactly)
  KvDtype k_dtype, v_dtype;
  struct Rows {
    uint64_t data_bytes, scale_bytes;  // KvSideLayout::row_data_bytes / row_scale_bytes
  } k_rows, v_rows;
  int k_rotated, v_rotated;  // 1: that side's rows are stored Hadamard-rotated
  HadamardSigns signs;       // rotated rows are un-rotated (kBf16)
  const int32_t* indptr;     // the step's block table
  const int32_t* indices;
  const int32_t* seq_lens;
  int num_seqs, block_tokens, num_kv_heads, head_dim;
  int blocks;          // the plan's staged blocks (the capacity of s_indices, k_out, v_out)
  int32_t* s_indptr;   // written: ceil(seq_len / block_tokens) prefix sums (num_seqs + 1)
  int32_t* s_indices;  // written: 0, 1, 2, ... (the staged table's block ids)
  uint8_t* k_out;      // written: blocks x out_block_bytes each
  uint8_t* v_out;
  uint64_t out_block_bytes, out_head_stride;
};
// Two launches on `stream`: the staged table, then the conversion of every staged block.
void launch_prefill_stage(const PrefillStage& s, cudaStream_t stream);

// Combines the split partials of rows [0, q_indptr[num_seqs] x num_q_heads) into out.
void launch_prefill_merge(const PrefillKernelParams& p, int head_dim, int num_seqs,
                          cudaStream_t stream);

// One instantiation per (K, V) pair, for head_dim 64, 128 and 256, defined in
// prefill_<k>.cu (K == V) or prefill_<k>__<v>.cu.
template <KvDtype DK, KvDtype DV>
void launch_prefill(const PrefillKernelParams& p, int head_dim, dim3 grid, cudaStream_t stream);

}  // namespace kvq::cuda
