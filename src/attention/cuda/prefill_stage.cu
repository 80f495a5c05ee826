// The staging of a cache for the wgmma prefill (PrefillPlan::staged_blocks, PrefillStageKind):
// the step's cache blocks converted once to a 16-bit copy (fp8 codes exactly as fp16, or every
// dtype dequantized to bf16), read by the kernel as a float16 / bfloat16 cache
// (docs/notes/prefill-tuning.md v14).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "attention/cuda/prefill_kernel.cuh"  // cvt8_pair01
#include "attention/cuda/prefill_params.h"
#include "cache/cuda/cuda_check.h"
#include "cache/cuda/kv_codec_device.cuh"
#include "cache/cuda/kv_row_decode.cuh"

namespace kvq::cuda {
namespace {

constexpr int kTableThreads = 1024;

// One block: s_indptr[i] = sum of ceil(seq_lens[j] / block_tokens) over j < i (a block scan in
// chunks of 1024 sequences), then s_indices[e] = e for every staged block (clamped to the
// plan's capacity: a table of the plan's step never exceeds it).
__global__ void __launch_bounds__(kTableThreads) stage_table_kernel(PrefillStage s) {
  __shared__ int32_t warp_sums[kTableThreads / 32];
  __shared__ int32_t carry;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    carry = 0;
    s.s_indptr[0] = 0;
  }
  __syncthreads();
  for (int base = 0; base < s.num_seqs; base += kTableThreads) {
    const int i = base + tid;
    int32_t v = i < s.num_seqs ? (s.seq_lens[i] + s.block_tokens - 1) / s.block_tokens : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t n = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += n;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int32_t w = warp_sums[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t n = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += n;
      }
      warp_sums[lane] = w;  // inclusive
    }
    __syncthreads();
    const int32_t incl = carry + v + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (i < s.num_seqs) s.s_indptr[i + 1] = incl;
    __syncthreads();
    if (tid == kTableThreads - 1) carry = incl;
    __syncthreads();
  }
  for (int e = tid; e < s.blocks; e += kTableThreads) s.s_indices[e] = e;
}

// The cache block staged as block e (sequence seq's j-th block: indices[indptr[seq] + j]), or
// -1 past the step's staged blocks.
__device__ __forceinline__ int staged_source(const PrefillStage& s, int e) {
  if (e >= s.s_indptr[s.num_seqs]) return -1;
  int lo = 0, hi = s.num_seqs - 1;  // the last sequence with s_indptr[seq] <= e
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s.s_indptr[mid] <= e)
      lo = mid;
    else
      hi = mid - 1;
  }
  return s.indices[s.indptr[lo] + e - s.s_indptr[lo]];
}

// kBf16, block (e, side): one warp per (kv head, token) row; lane l decodes dims [l E, l E + E)
// with the row's scales (the reference codecs' arithmetic), the warp un-rotates a rotated row
// (bit-identical to the reference's hadamard_unrotate), and the values are rounded to bf16.
template <int E>
__global__ void __launch_bounds__(256) stage_rows_bf16_kernel(PrefillStage s) {
  const int e = static_cast<int>(blockIdx.x);
  const int src_block = staged_source(s, e);
  if (src_block < 0) return;
  const bool v_side = blockIdx.y == 1;
  const PrefillSide& in = v_side ? s.v : s.k;
  const PrefillStage::Rows rows = v_side ? s.v_rows : s.k_rows;
  const KvDtype d = v_side ? s.v_dtype : s.k_dtype;
  const bool rotated = (v_side ? s.v_rotated : s.k_rotated) != 0;
  constexpr int HD = 32 * E;
  const uint8_t* src = in.base + static_cast<size_t>(src_block) * in.block_bytes;
  uint8_t* dst = (v_side ? s.v_out : s.k_out) + static_cast<size_t>(e) * s.out_block_bytes;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warps = static_cast<int>(blockDim.x) / 32;
  for (int r = static_cast<int>(threadIdx.x) / 32; r < s.num_kv_heads * s.block_tokens;
       r += warps) {
    const int h = r / s.block_tokens, t = r - h * s.block_tokens;
    const uint8_t* head = src + static_cast<size_t>(h) * in.head_stride;
    const float2 m = row_meta_rt(
        d, head + in.values_bytes + static_cast<size_t>(t) * rows.scale_bytes, in.tensor_scale[h]);
    const uint8_t* row = head + static_cast<size_t>(t) * rows.data_bytes;
    float x[E];
#pragma unroll
    for (int i = 0; i < E; ++i) x[i] = element_rt(d, row, HD, lane * E + i, m);
    if (rotated) warp_hadamard_unrotate<E>(x, lane, s.signs);
    uint32_t packed[E / 2];
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
      packed[i] = *reinterpret_cast<const uint32_t*>(&b);
    }
    uint8_t* out = dst + static_cast<size_t>(h) * s.out_head_stride +
                   static_cast<size_t>(t) * HD * 2 + static_cast<size_t>(lane) * E * 2;
    if constexpr (E == 4)
      *reinterpret_cast<uint2*>(out) = make_uint2(packed[0], packed[1]);
    else
      *reinterpret_cast<uint32_t*>(out) = packed[0];
  }
}

// Sixteen fp8 codes (dims in order) -> sixteen fp16 values (exact), as two 16-byte chunks.
template <KvDtype D>
__device__ __forceinline__ void fp8x16_to_f16(const uint4 w, uint4& lo, uint4& hi) {
  using prefill_detail::cvt8_pair01;
  lo = make_uint4(cvt8_pair01<D>(w.x), cvt8_pair01<D>(w.x >> 16), cvt8_pair01<D>(w.y),
                  cvt8_pair01<D>(w.y >> 16));
  hi = make_uint4(cvt8_pair01<D>(w.z), cvt8_pair01<D>(w.z >> 16), cvt8_pair01<D>(w.w),
                  cvt8_pair01<D>(w.w >> 16));
}

// kFp16, block (e, side): staged block e <- its fp8 block, 16 codes a thread step, each row
// (kv head, token) in the same order.
__global__ void __launch_bounds__(256) stage_blocks_kernel(PrefillStage s) {
  const int e = static_cast<int>(blockIdx.x);
  const int src_block = staged_source(s, e);
  if (src_block < 0) return;
  const bool v_side = blockIdx.y == 1;
  const PrefillSide& in = v_side ? s.v : s.k;
  const bool e5m2 = (v_side ? s.v_dtype : s.k_dtype) == KvDtype::kFp8E5M2;
  const uint8_t* src = in.base + static_cast<size_t>(src_block) * in.block_bytes;
  uint8_t* dst = (v_side ? s.v_out : s.k_out) + static_cast<size_t>(e) * s.out_block_bytes;
  const int per_row = s.head_dim / 16;
  const int per_head = s.block_tokens * per_row;
  const int chunks = s.num_kv_heads * per_head;
  for (int c = static_cast<int>(threadIdx.x); c < chunks; c += static_cast<int>(blockDim.x)) {
    const int h = c / per_head, r = c - h * per_head;  // r: token x per_row + chunk
    const uint4 w = *reinterpret_cast<const uint4*>(src + static_cast<size_t>(h) * in.head_stride +
                                                    static_cast<size_t>(r) * 16);
    uint4 lo4, hi4;
    if (e5m2)
      fp8x16_to_f16<KvDtype::kFp8E5M2>(w, lo4, hi4);
    else
      fp8x16_to_f16<KvDtype::kFp8E4M3>(w, lo4, hi4);
    uint4* out = reinterpret_cast<uint4*>(dst + static_cast<size_t>(h) * s.out_head_stride +
                                          static_cast<size_t>(r) * 32);
    out[0] = lo4;
    out[1] = hi4;
  }
}

}  // namespace

void launch_prefill_stage(const PrefillStage& s, cudaStream_t stream) {
  KVQ_CHECK(s.head_dim % 16 == 0 && s.blocks > 0 && s.num_seqs > 0, "prefill staging: bad shape");
  stage_table_kernel<<<1, kTableThreads, 0, stream>>>(s);
  KVQ_CUDA_CHECK_LAUNCH();
  const dim3 grid(static_cast<unsigned>(s.blocks), 2);
  if (s.bf16 == 0)
    stage_blocks_kernel<<<grid, 256, 0, stream>>>(s);
  else if (s.head_dim == 128)
    stage_rows_bf16_kernel<4><<<grid, 256, 0, stream>>>(s);
  else if (s.head_dim == 64)
    stage_rows_bf16_kernel<2><<<grid, 256, 0, stream>>>(s);
  else
    KVQ_CHECK(false, "prefill staging: head_dim " + std::to_string(s.head_dim) + " not 64 / 128");
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace kvq::cuda
