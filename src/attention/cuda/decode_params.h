// Kernel parameters and the register layouts shared by the decode kernels (private to
// src/attention/cuda).
//
// MMA fragments (m16n8k16, lane = 4 * g + c): the A operand's rows are the query heads of the
// warp (g = 0..7; rows 8..15 are zero), the B operand of S = Q K^T is K^T with one token per
// n index. A lane of quad position c holds, for its token, one quarter of the row's values:
// chunks c, c + 4, c + 8, ... of kChunkBytes bytes. Because the dot product does not care
// about the order of the head dimension, each dtype emits its values in whatever order its
// unpacking makes cheapest (4-bit codes come out as nibble pairs (k, k + 4) of each word),
// and Q is stored in that same order: k_dim_of() is the one definition of that order.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "cache/cuda/kv_codec_device.cuh"
#include "cache/cuda/pdl.h"  // wait_for_previous_kernel, allow_next_kernel
#include "kvq/core/kv_dtype.h"

namespace kvq::cuda {

inline constexpr int kDecodeWarps = 4;  // warps per block of the split-KV kernel

__host__ __device__ constexpr int kv_value_bits(KvDtype d) {
  switch (d) {
    case KvDtype::kFloat32:
      return 32;
    case KvDtype::kFloat16:
    case KvDtype::kBFloat16:
      return 16;
    case KvDtype::kFp8E4M3:
    case KvDtype::kFp8E5M2:
    case KvDtype::kInt8PerTokenHead:
    case KvDtype::kFp8PerTokenHead:
      return 8;
    case KvDtype::kInt4PerTokenHead:
    case KvDtype::kNvfp4:
      return 4;
    default:
      return 0;
  }
}

// Bytes of one row's codes (nvfp4's block scales excluded: they follow the codes).
__host__ __device__ constexpr int kv_code_bytes(KvDtype d, int hd) {
  return hd * kv_value_bits(d) / 8;
}
__host__ __device__ constexpr int kv_row_bytes(KvDtype d, int hd) {
  return d == KvDtype::kNvfp4 ? hd / 16 * 9 : kv_code_bytes(d, hd);
}
// Widest aligned load within a row: rows start at multiples of the row size.
__host__ __device__ constexpr int kv_load_align(KvDtype d, int hd) {
  const int r = kv_row_bytes(d, hd);
  const int p = r & -r;
  return p < 16 ? p : 16;
}
__host__ __device__ constexpr int cmin(int a, int b) {
  return a < b ? a : b;
}
__host__ __device__ constexpr int cmax(int a, int b) {
  return a > b ? a : b;
}
// Operand type of the tensor-core MMAs for a dtype: bf16 where fp16 could not hold the
// values (bfloat16, float32), fp16 everywhere else (every quantized code is exact in fp16).
__host__ __device__ constexpr bool kv_bf16_operands(KvDtype d) {
  return d == KvDtype::kBFloat16 || d == KvDtype::kFloat32;
}

// K side: bytes a lane loads at once, and the physical dim of the lane's v-th value
// (v = 0 .. hd/4 - 1) for quad position c.
__host__ __device__ constexpr int k_chunk_bytes(KvDtype d, int hd) {
  return cmin(cmin(16, kv_code_bytes(d, hd) / 4), kv_load_align(d, hd));
}
__host__ __device__ constexpr int k_dim_of(KvDtype d, int hd, int c, int v) {
  const int bits = kv_value_bits(d);
  const int epb = k_chunk_bytes(d, hd) * 8 / bits;
  const int j = v / epb, e = v % epb;
  int off = e;
  if (bits == 4) {
    const int r = e % 8;
    off = (e / 8) * 8 + (r >> 1) + 4 * (r & 1);
  }
  return (c + 4 * j) * epb + off;
}
// V side (B operand of O = P V): lane g holds dims [g * hd/8, (g+1) * hd/8) of its four
// tokens; n-tile j of the output is dim g * hd/8 + j of lane g.
__host__ __device__ constexpr int v_part_bytes(KvDtype d, int hd) {
  return kv_code_bytes(d, hd) / 8;
}
__host__ __device__ constexpr int v_load_bytes(KvDtype d, int hd) {
  return cmin(cmin(16, v_part_bytes(d, hd)), kv_load_align(d, hd));
}

struct DecodeSide {
  const uint8_t* base;
  uint64_t block_bytes, head_stride, values_bytes, row_bytes, row_scale_bytes;
  float tensor_scale[128];  // per kv head (1 where unused)
};

// Rows of a (sequence, kv head): r = hc * R + row = t * ratio + h for query token t (of the
// sequence's q_len) and group head h, R = rows per warp (8: row = g; 16: row = g, g + 8);
// rows with t >= q_len are zero and never written.
// Workspace layouts (H = R / 8):
//   qfrag [num_seqs][num_kv_heads][head_chunks][hd/16][32 lanes][H] uint2 (A-operand regs
//         0, 2 of row g, then 1, 3 of row g + 8)
//   qmeta [num_seqs][num_kv_heads][head_chunks][R] float2 (logit factor, sum of Q operands)
//   part rows r = (((seq * max_splits + split) * num_kv_heads + kvh) * head_chunks + hc) * R
//     + row: part_o [r][hd] fp32 (normalized), part_ml [r] float2 (max in log2 units, sum)
struct DecodeKernelParams {
  DecodeSide k, v;
  const int32_t* indptr;
  const int32_t* indices;
  const int32_t* seq_lens;
  const int32_t* q_indptr;  // null: one query per sequence (row = sequence)
  const uint2* qfrag;
  const float2* qmeta;
  float* part_o;
  float2* part_ml;
  float* out;  // non-null: a sequence with one split writes its output here directly
  int num_seqs, num_q_heads, num_kv_heads, ratio, head_chunks, block_tokens;
  int chunk_tiles, max_splits, attention_kind, window;
  float soft_cap;  // 0: off
  bool early;      // pdl_early(): let the next kernel be scheduled at once
  // The cluster merge (DecodePlan::cluster): blocks per cluster (0: off; then `out` gets
  // every final row, un-rotated with `signs` where `unrotate`) and the dynamic shared memory
  // layout of decode_cluster_smem_bytes.
  int cluster;
  bool unrotate;
  HadamardSigns signs;
};

// Dynamic shared memory of a split-KV block in the cluster merge: each warp's partial rows
// ([rows][head_dim + 4] fp32, padded so the rows start in different banks) and their (max, sum).
__host__ __device__ constexpr int decode_cluster_row_stride(int head_dim) {
  return head_dim + 4;
}
__host__ __device__ constexpr size_t decode_cluster_smem_bytes(int head_dim, int rows_per_warp) {
  return static_cast<size_t>(kDecodeWarps) * rows_per_warp *
         (decode_cluster_row_stride(head_dim) * sizeof(float) + 2 * sizeof(float));
}

// The first query row and the query count of a sequence.
__device__ __forceinline__ void decode_queries(const int32_t* q_indptr, int seq, int& q0,
                                               int& q_len) {
  if (q_indptr == nullptr) {
    q0 = seq;
    q_len = 1;
  } else {
    q0 = q_indptr[seq];
    q_len = q_indptr[seq + 1] - q0;
  }
}

// Rows per warp of the split-KV kernel: 8 for one query per sequence (rows 8..15 of the MMA
// tiles are zero), 16 for several where the registers allow (head_dim <= 128).
__host__ __device__ constexpr int decode_rows_per_warp(int head_dim, bool multi_query) {
  return multi_query && head_dim <= 128 ? 16 : 8;
}

// The one-query split-KV kernels of the 4-bit pairs (int4_per_token_head, nvfp4) at head_dim
// <= 128 stream their tiles through a per-warp shared-memory ring filled by bulk copies
// (decode_kernel.cuh, Ring; docs/notes/decode-tuning.md version 24). Those kernels, and the
// prep and merge kernels launched around them, take the largest shared-memory carveout: a
// different carveout between dependent kernels costs the overlap of programmatic dependent
// launch (4-8 us at small batches). KVQ_DECODE_RING=0 (a compile definition): no ring.
#ifndef KVQ_DECODE_RING
#define KVQ_DECODE_RING 1
#endif
__host__ __device__ constexpr bool decode_ring_pair(KvDtype k, KvDtype v, int head_dim) {
  return KVQ_DECODE_RING != 0 && head_dim <= 128 && kv_value_bits(k) == 4 && kv_value_bits(v) == 4;
}
// Tiles a trip of the ring's loop: two for int4_per_token_head (one softmax update and one
// rescale of o per 32 tokens; 3-5% faster than one), one for nvfp4 (two take it from 122 to
// 153 registers and 3 blocks an SM: 3% slower).
__host__ __device__ constexpr int decode_ring_trip(KvDtype k, KvDtype v) {
  return k == KvDtype::kInt4PerTokenHead && v == KvDtype::kInt4PerTokenHead ? 2 : 1;
}

// The split-KV kernel of one (K, V) pair of kv_pairs.h for head_dim 64 / 128 / 256 (nullptr
// for another head_dim), for one query per sequence or several (q_indptr): the instantiations
// of a pair are defined in decode_<dtype>.cu (K == V) or decode_<k>__<v>.cu (mixed). The host
// launches it (with programmatic dependent launch) and reads its occupancy for the work split.
using DecodeMainKernel = void (*)(DecodeKernelParams);
// Sets kernel `f`'s preferred shared-memory carveout to the largest, and its dynamic shared
// memory limit to `max_dynamic_smem` bytes, once per device (`done`: a bit per device id).
void prefer_max_shared_once(const void* f, std::atomic<uint64_t>& done, size_t max_dynamic_smem);
template <KvDtype DK, KvDtype DV>
DecodeMainKernel decode_main_kernel_for(int head_dim, bool multi_query);

}  // namespace kvq::cuda
