#include "model/cuda/gemv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>

#include "cache/cuda/cuda_check.h"
#include "cache/cuda/mbarrier.cuh"
#include "cache/cuda/pdl.h"
#include "kvq/core/error.h"
#include "model/cuda/row_ops.cuh"

namespace kvq::cuda_model {

namespace {

constexpr int kRows = 16;  // output features per block (the MMA's M)

// The operands of a variant: bf16 weights and inputs (kBf16); e4m3 weights and inputs with a
// scale per input row and per weight row (kFp8); e4m3 weights with a scale per weight row and
// bf16 inputs (kW8: the codes converted to bf16 in registers, exactly, and multiplied in bf16).
enum class Op : int { kBf16, kFp8, kW8 };
template <Op O>
using WeightElem = std::conditional_t<O == Op::kBf16, uint16_t, uint8_t>;
template <Op O>
using InputElem = std::conditional_t<O == Op::kFp8, uint8_t, uint16_t>;
// 16-byte loads of a lane's input row per step: a step is 16 bytes of each weight row, so 32
// bytes of bf16 input for kW8's 16 codes.
template <Op O>
constexpr int kInputLoads = O == Op::kW8 ? 2 : 1;

// k steps per warp per iteration (and as many in flight): 4, or fewer for e4m3 weights with two
// n-tiles: kFp8 3 (84 bytes of spill at 4 under the 128-register bound), kW8 2 (~250 bytes of
// spill at 4; 3 measured no faster, docs/notes/decode-tuning.md version 21); bf16 with two
// n-tiles keeps 4 for an 8-byte spill (3 steps measured 6-12% slower, version 14).
template <int NT, Op O>
constexpr int kUnrollOf = NT == 2 && O != Op::kBf16 ? (O == Op::kW8 ? 2 : 3) : 4;

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_e4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two e4m3 codes (the low byte first) as a bf16 pair (the low half first): exact, every e4m3
// value being a bf16 value (through fp16, which holds them all as normal numbers).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Four e4m3 codes (bytes c..c+3 of a row) as two bf16 pairs (c, c+1) and (c+2, c+3).
__device__ __forceinline__ void e4m3x4_to_bf16(uint32_t four, uint32_t& lo, uint32_t& hi) {
  lo = e4m3x2_to_bf16x2(four);
  hi = e4m3x2_to_bf16x2(four >> 16);
}

// One step of a lane's fragments: a = 16 bytes of weight row g, b of row g + 8, x of input row
// g of the n-tile (kInputLoads 16-byte pieces), fed as MMAs (the k positions permuted alike for
// W and x; see gemv_kernel).
template <Op O>
__device__ __forceinline__ void mma_step(float (&acc)[4], const uint4& a, const uint4& b,
                                         const uint4 (&x)[kInputLoads<O>]) {
  if constexpr (O == Op::kFp8) {
    mma_e4m3(acc, a.x, b.x, a.y, b.y, x[0].x, x[0].y);
    mma_e4m3(acc, a.z, b.z, a.w, b.w, x[0].z, x[0].w);
  } else if constexpr (O == Op::kW8) {
    // Columns c..c+15: pair p of a row is columns c + 2p, c + 2p + 1, as a bf16 step's.
    const uint32_t wa4[4] = {a.x, a.y, a.z, a.w}, wb4[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t a0, a1, b0, b1;
      e4m3x4_to_bf16(wa4[q], a0, a1);
      e4m3x4_to_bf16(wb4[q], b0, b1);
      const uint4& xq = x[q / 2];
      if (q % 2 == 0) {
        mma_bf16(acc, a0, b0, a1, b1, xq.x, xq.y);
      } else {
        mma_bf16(acc, a0, b0, a1, b1, xq.z, xq.w);
      }
    }
  } else {
    mma_bf16(acc, a.x, b.x, a.y, b.y, x[0].x, x[0].y);
    mma_bf16(acc, a.z, b.z, a.w, b.w, x[0].z, x[0].w);
  }
}

// Streamed once per step: do not keep weight lines in L1 (evict-first).
__device__ __forceinline__ uint4 load_weight(const void* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}

// kNorm: the input rows, RMSNorm'd, in shared memory as bf16, each row kNormPad values longer
// than k, so where k is a multiple of 64 the rows of an n-tile start 64 bytes apart modulo 128
// (the 16-byte reads of a quarter warp, two rows, in distinct banks).
constexpr int kNormPad = 32;

// The RMSNorm of rows 0..m-1 of nm.x (k floats each) into xs, with rms_norm_rows' arithmetic
// (a double sum of squares, rows::rms_inverse, x * inv * w rounded once each, then bf16): the
// bits that kernel writes, but each block makes its own copy. Ends with a barrier.
// kBarrier 0: the whole block takes part (__syncthreads); otherwise threads 0..kThreads-1 do, on
// that named barrier (the ring variant's consumers).
template <int kThreads, int kBarrier = 0>
__device__ __forceinline__ void normalize_rows(const GemvNorm& nm, int m, int k, uint16_t* xs) {
  auto sync = [] {
    if constexpr (kBarrier == 0) {
      __syncthreads();
    } else {
      cuda::sm90::named_barrier_sync(kBarrier, kThreads);
    }
  };
  __shared__ double part[kThreads / 32][kGemvNormMaxRows];
  __shared__ float inv[kGemvNormMaxRows];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  for (int i = 0; i < m; ++i) {
    const float* row = nm.x + static_cast<int64_t>(i) * nm.ldx;
    double ss = 0.0;
    for (int c = 4 * tid; c < k; c += 4 * kThreads) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(row + c));
      ss += static_cast<double>(v.x) * v.x + static_cast<double>(v.y) * v.y +
            static_cast<double>(v.z) * v.z + static_cast<double>(v.w) * v.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) part[warp][i] = ss;
  }
  sync();
  if (tid < m) {
    double ss = 0.0;
    for (int w = 0; w < kThreads / 32; ++w) ss += part[w][tid];
    inv[tid] = rows::rms_inverse(ss, k, nm.eps);
  }
  sync();
  for (int i = 0; i < m; ++i) {
    const float* row = nm.x + static_cast<int64_t>(i) * nm.ldx;
    const float s = inv[i];
    uint16_t* dst = xs + static_cast<int64_t>(i) * (k + kNormPad);
    for (int c = 4 * tid; c < k; c += 4 * kThreads) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(row + c));
      const float4 g = __ldg(reinterpret_cast<const float4*>(nm.w + c));
      const __nv_bfloat162 lo = __floats2bfloat162_rn(__fmul_rn(__fmul_rn(v.x, s), g.x),
                                                      __fmul_rn(__fmul_rn(v.y, s), g.y));
      const __nv_bfloat162 hi = __floats2bfloat162_rn(__fmul_rn(__fmul_rn(v.z, s), g.z),
                                                      __fmul_rn(__fmul_rn(v.w, s), g.w));
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&lo);
      packed.y = *reinterpret_cast<const uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(dst + c) = packed;
    }
  }
  sync();
}

// fp8_scale_product's arithmetic (model_kernels.cu): raw x row scale x column scale.
__device__ __forceinline__ float scaled(float raw, float row_scale, float col_scale) {
  return __fmul_rn(__fmul_rn(raw, row_scale), col_scale);
}

// The epilogue of a block's tile: the kWarps warps' partial sums (part[warp][j * 4 + e][lane] =
// accumulator e of n-tile j) added in warp order by threads tid = 0..nthreads-1, then written:
// the product (scaled for kFp8 and kW8; + beta * out), or silu(gate) * up for kSilu (kW8: each
// factor scaled by its weight row's scale first).
template <int NT, int kWarps, bool kSilu, Op O>
__device__ __forceinline__ void store_tile(const float (*part)[NT * 4][32], int tid, int nthreads,
                                           int tile, void* __restrict__ out_v,
                                           const float* __restrict__ in_scale,
                                           const float* __restrict__ w_scale, int m, int n, int ldc,
                                           float beta, bool out_bf16) {
  auto sum = [&](int q, int l) {
    float s = 0.0f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) s += part[v][q][l];
    return s;
  };
  if constexpr (kSilu) {
    // Elements 0 / 1 of n-tile j on lane l are the gate sums of feature 8 b + l / 4 for inputs
    // 8 j + 2 (l % 4) + {0, 1}; elements 2 / 3 the up sums of the same outputs.
    for (int idx = tid; idx < NT * 2 * 32; idx += nthreads) {
      const int q = idx / 32, l = idx % 32;
      const int j = q / 2, e = q % 2;
      const int f = tile * 8 + (l >> 2);
      const int i = 8 * j + 2 * (l & 3) + e;
      if (f < n && i < m) {
        float gate = sum(j * 4 + e, l), up = sum(j * 4 + 2 + e, l);
        if constexpr (O == Op::kW8) {
          gate = __fmul_rn(gate, w_scale[f]);
          up = __fmul_rn(up, w_scale[n + f]);
        }
        const float y = gate / (1.0f + expf(-gate)) * up;  // silu_mul_at's arithmetic
        const int64_t o = static_cast<int64_t>(i) * ldc + f;
        if (out_bf16) {
          static_cast<__nv_bfloat16*>(out_v)[o] = __float2bfloat16_rn(y);
        } else {
          static_cast<float*>(out_v)[o] = y;
        }
      }
    }
  } else {
    float* out = static_cast<float*>(out_v);
    for (int idx = tid; idx < NT * 4 * 32; idx += nthreads) {
      const int q = idx / 32, l = idx % 32;
      // Element e of n-tile j on lane l: feature g + 8 (e / 2), input 8 j + 2 t + e % 2.
      const int j = q / 4, e = q % 4;
      const int row = tile * kRows + (l >> 2) + 8 * (e >> 1);
      const int i = 8 * j + 2 * (l & 3) + (e & 1);
      if (row < n && i < m) {
        float s = sum(q, l);
        if constexpr (O == Op::kFp8) s = scaled(s, in_scale[i], w_scale[row]);
        if constexpr (O == Op::kW8) s = __fmul_rn(s, w_scale[row]);
        float* o = out + static_cast<int64_t>(i) * ldc + row;
        *o = beta != 0.0f ? s + beta * *o : s;
      }
    }
  }
}

// Block b: output features [16 b, 16 b + 16); warp w of kWarps: k steps w, w + kWarps, ... of
// 32 values.
// Lane (g = lane / 4, t = lane % 4) holds, per step s at column c = 32 s + 8 t, the 16 bytes
// W[16 b + g][c..c+8), W[16 b + g + 8][c..c+8) and x[8 j + g][c..c+8) for each n-tile j.
// m16n8k16's A fragment gives lane (g, t) the k positions {2t, 2t+1, 2t+8, 2t+9} of rows g and
// g + 8, and the B fragment the same k positions of column g; mapping them to c + {0, 1, 2, 3}
// (first MMA) and c + {4..7} (second) for both operands covers each column once, so the sum is
// the product's. NT n-tiles of 8 input rows: m <= 8 NT.
//
// kFp8: e4m3 operands and m16n8k32 MMAs: a lane's 16 bytes are 16 values (a step is 64
// columns, c = 64 s + 16 t), the A fragment's k positions {4t..4t+3, 4t+16..4t+19} map to
// c + {0..7} (first MMA) and c + {8..15} (second); the sums are scaled by in_scale[i] and
// w_scale[feature] as fp8_scale_product scales them.
//
// kSilu: w is a gate|up matrix of 2 n rows (gate rows first) and the block's MMA rows are the
// gate and up rows of 8 features [8 b, 8 b + 8): rows g and g + 8 of the tile are gate and up
// of feature 8 b + g, so a lane's accumulators hold both factors of its outputs, and the
// epilogue writes silu(gate) * up ([m][n], bf16 or fp32) instead of the product.
//
// kW8: e4m3 weights as kFp8's (16 codes a lane a step, 64 columns a step) and bf16 input rows,
// 32 bytes of them a lane a step; each weight pair converted to bf16 in registers and fed to
// four m16n8k16 MMAs with bf16's fragment mapping (columns c + 2p, c + 2p + 1 as pair p); the
// sums scaled by w_scale[feature] alone.
//
// kNorm (bf16 inputs, m <= kGemvNormMaxRows): the input is norm's rows RMSNorm'd by every block
// into shared memory (normalize_rows) after the wait, instead of `in`.
template <int NT, int kWarps, bool kSilu, Op O, bool kNorm>
__global__ void __launch_bounds__(kWarps * 32, 16 / kWarps)
    gemv_kernel(const void* __restrict__ in_v, int lda, const float* __restrict__ in_scale,
                const void* __restrict__ w_v, const float* __restrict__ w_scale,
                void* __restrict__ out_v, int m, int n, int k, int ldc, float beta, bool out_bf16,
                bool early, GemvNorm norm) {
  static_assert(!kNorm || (O != Op::kFp8 && NT == 1));
  extern __shared__ __align__(16) uint16_t norm_rows[];
  if (early) cuda::allow_next_kernel();
  using E = WeightElem<O>;
  using X = InputElem<O>;
  constexpr int kX = kInputLoads<O>;
  constexpr int kUnroll = kUnrollOf<NT, O>;
  constexpr int kPer = 16 / sizeof(E);  // weight values per 16-byte load
  constexpr int kCols = 4 * kPer;       // columns per warp step
  const X* in = static_cast<const X*>(in_v);
  const E* w = static_cast<const E*>(w_v);
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int r0 =
      kSilu ? static_cast<int>(blockIdx.x) * 8 + g : static_cast<int>(blockIdx.x) * kRows + g;
  const int r1 = kSilu ? r0 + n : r0 + 8;
  const bool v0 = r0 < n, v1 = kSilu ? v0 : r1 < n;
  const E* w0 = w + static_cast<int64_t>(v0 ? r0 : 0) * k;
  const E* w1 = w + static_cast<int64_t>(v1 ? r1 : 0) * k;
  const int steps = (k + kCols - 1) / kCols;
  const int iters = (steps + kWarps * kUnroll - 1) / (kWarps * kUnroll);
  auto column = [&](int it, int u) {
    return (warp + kWarps * (it * kUnroll + u)) * kCols + kPer * t;
  };

  uint4 wa[kUnroll], wb[kUnroll];
  auto load_w = [&](int it) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = column(it, u);
      const bool ok = c < k;
      wa[u] = ok && v0 ? load_weight(w0 + c) : make_uint4(0, 0, 0, 0);
      wb[u] = ok && v1 ? load_weight(w1 + c) : make_uint4(0, 0, 0, 0);
    }
  };
  // The weights do not depend on the previous kernel: their first loads are in flight while
  // it finishes.
  if (iters > 0) load_w(0);
  cuda::wait_for_previous_kernel();
  if constexpr (kNorm) normalize_rows<kWarps * 32>(norm, m, k, norm_rows);

  float acc[NT][4] = {};
  for (int it = 0; it < iters; ++it) {
    uint4 ca[kUnroll], cb[kUnroll], xv[kUnroll][NT][kX];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      ca[u] = wa[u];
      cb[u] = wb[u];
      const int c = column(it, u);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int i = 8 * j + g;
#pragma unroll
        for (int h = 0; h < kX; ++h) {
          const int ch = c + 8 * h;  // kX > 1: bf16 inputs, 8 a load
          if constexpr (kNorm) {
            xv[u][j][h] = c < k && i < m
                              ? *reinterpret_cast<const uint4*>(
                                    norm_rows + static_cast<int64_t>(i) * (k + kNormPad) + ch)
                              : make_uint4(0, 0, 0, 0);
          } else {
            xv[u][j][h] =
                c < k && i < m
                    ? __ldg(reinterpret_cast<const uint4*>(in + static_cast<int64_t>(i) * lda + ch))
                    : make_uint4(0, 0, 0, 0);
          }
        }
      }
    }
    if (it + 1 < iters) load_w(it + 1);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < NT; ++j) mma_step<O>(acc[j], ca[u], cb[u], xv[u][j]);
  }
  if (!early) cuda::allow_next_kernel();

  // The warps' partial sums, added in warp order.
  __shared__ float part[kWarps][NT * 4][32];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) part[warp][j * 4 + e][lane] = acc[j][e];
  __syncthreads();
  store_tile<NT, kWarps, kSilu, O>(part, static_cast<int>(threadIdx.x), kWarps * 32,
                                   static_cast<int>(blockIdx.x), out_v, in_scale, w_scale, m, n,
                                   ldc, beta, out_bf16);
}

// ---- the ring variant (kGemvRing warps: 8 consumers and a producer) ----------------------------
//
// The same tile, fragments, sums and epilogue as gemv_kernel, fed differently: a block per SM
// (persistent: tiles b, b + gridDim.x, ...) whose producer warp streams each tile's 16 weight
// rows, kRingChunk bytes of each at a time, into a ring of `stages` shared-memory stages by 1-d
// bulk copies (TMA) that complete on the stage's "full" mbarrier; the 8 consumer warps copy the
// input rows into shared memory once (or RMSNorm them there, kNorm), then take their 64-byte
// steps of each stage (warp w: steps w, w + 8, ...) and free the stage on its "empty" mbarrier
// (every consumer thread arrives).
// The stream does not drain between tiles (no wave tail: a 6144-row product is 384 tiles on 132
// SMs, where the register variants run 1.45 waves of blocks), no registers hold the bytes in
// flight, and the producer starts before the programmatic-dependent-launch wait (weights never
// depend on the previous kernel); only the consumers wait. Bulk copies are issued per row, and
// their rate bounds the stream: 1 KB copies reached 3.0 TB/s on an H200, 4 KB ones 4.0
// (docs/notes/decode-tuning.md version 19), hence 4 KB chunks. Rows are kRingChunk + 64 bytes
// apart, so the 16-byte reads of a quarter warp (rows g, g + 1; t = 0..3) fall in distinct banks.
constexpr int kRingConsumers = 8;
constexpr int kRingChunk = 4096;  // bytes of a weight row per stage: 64 steps of 64 bytes
constexpr int kRingMaxStages = 3;
constexpr int kRingRowStride = kRingChunk + 64;
constexpr int kRingStageBytes = kRows * kRingRowStride;
constexpr int kRingBarrier = 1;  // the consumers' named barrier

template <int NT>
__host__ __device__ constexpr size_t ring_part_bytes() {
  return 2u * kRingConsumers * NT * 4 * 32 * sizeof(float);  // double-buffered by tile
}
// Dynamic shared memory: the ring, 2 x kRingMaxStages mbarriers, the partial sums, then the
// input rows (m x (k + kNormPad) values).
__host__ __device__ constexpr size_t ring_head_bytes(int stages) {
  return static_cast<size_t>(stages) * kRingStageBytes + 16u * kRingMaxStages;
}

template <int NT, bool kSilu, Op O, bool kNorm>
__global__ void __launch_bounds__((kRingConsumers + 1) * 32, 1)
    gemv_ring_kernel(const void* __restrict__ in_v, int lda, const float* __restrict__ in_scale,
                     const void* __restrict__ w_v, const float* __restrict__ w_scale,
                     void* __restrict__ out_v, int m, int n, int k, int ldc, float beta,
                     bool out_bf16, bool early, GemvNorm norm, int tiles, int stages,
                     bool producer_waits) {
  static_assert(!kNorm || (O != Op::kFp8 && NT == 1));
  namespace sm90 = cuda::sm90;
  using E = WeightElem<O>;
  using X = InputElem<O>;
  constexpr int kX = kInputLoads<O>;
  constexpr int kPer = 16 / sizeof(E);                // weight values per 16-byte load
  constexpr int kCols = 4 * kPer;                     // columns per 64-byte step
  constexpr int kChunkCols = kRingChunk / sizeof(E);  // columns per stage
  constexpr int kSteps = kRingChunk / 64;             // steps per stage
  constexpr int kPerWarp = kSteps / kRingConsumers;   // steps per consumer warp per stage
  constexpr int kBatch = 2;                           // steps read before their MMAs
  static_assert(kPerWarp % kBatch == 0);
  extern __shared__ __align__(128) unsigned char ring_smem[];
  const uint32_t ring = sm90::smem_addr(ring_smem);
  const uint32_t full0 = ring + stages * kRingStageBytes;
  const uint32_t empty0 = full0 + 8 * kRingMaxStages;
  auto* part =
      reinterpret_cast<float(*)[kRingConsumers][NT * 4][32]>(ring_smem + ring_head_bytes(stages));
  // The input rows (copied, or RMSNorm'd for kNorm), k + kNormPad values apart.
  auto* xs = reinterpret_cast<X*>(ring_smem + ring_head_bytes(stages) + ring_part_bytes<NT>());
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (threadIdx.x == 0) {
    for (int st = 0; st < stages; ++st) {
      sm90::mbar_init(full0 + 8 * st, 1);
      sm90::mbar_init(empty0 + 8 * st, kRingConsumers * 32);
    }
    sm90::mbar_init_fence();
  }
  __syncthreads();
  if (early) cuda::allow_next_kernel();
  const int64_t row_bytes = static_cast<int64_t>(k) * sizeof(E);
  const int chunks = static_cast<int>((row_bytes + kRingChunk - 1) / kRingChunk);

  if (warp == kRingConsumers) {  // the producer
    if (producer_waits) cuda::wait_for_previous_kernel();
    const uint64_t policy = sm90::l2_evict_first();
    const auto* w = static_cast<const unsigned char*>(w_v);
    int slot = 0, issued = 0;
    uint32_t phase = 0;
    for (int tile = static_cast<int>(blockIdx.x); tile < tiles;
         tile += static_cast<int>(gridDim.x)) {
      // Lane r < 16 copies tile row r (gemv_kernel's rows: g and g + 8, or gate and up of
      // feature 8 tile + g); rows past n copy row 0 (their sums are never written).
      int row = 0;
      if (lane < kRows) {
        const int g = lane & 7;
        row = kSilu ? tile * 8 + g : tile * kRows + lane;
        if (kSilu && row < n && lane >= 8) row += n;
        if (kSilu ? tile * 8 + g >= n : row >= n) row = 0;
      }
      const unsigned char* src = w + static_cast<int64_t>(row) * row_bytes;
      for (int c = 0; c < chunks; ++c) {
        const int64_t left = row_bytes - static_cast<int64_t>(c) * kRingChunk;
        const uint32_t bytes = static_cast<uint32_t>(left < kRingChunk ? left : kRingChunk);
        if (lane == 0) {
          if (issued >= stages) sm90::mbar_wait(empty0 + 8 * slot, phase ^ 1u);
          sm90::mbar_arrive_expect_tx(full0 + 8 * slot, kRows * bytes);
        }
        __syncwarp();
        if (lane < kRows)
          sm90::bulk_copy_g2s(ring + slot * kRingStageBytes + lane * kRingRowStride,
                              src + static_cast<int64_t>(c) * kRingChunk, bytes, full0 + 8 * slot,
                              policy);
        ++issued;
        if (++slot == stages) slot = 0, phase ^= 1u;
      }
    }
    return;
  }

  // The consumers.
  const int g = lane >> 2, t = lane & 3;
  cuda::wait_for_previous_kernel();
  if constexpr (kNorm) {
    normalize_rows<kRingConsumers * 32, kRingBarrier>(norm, m, k, xs);
  } else {
    const X* in = static_cast<const X*>(in_v);
    constexpr int kXPer = 16 / sizeof(X);
    for (int i = 0; i < m; ++i)
      for (int c = kXPer * static_cast<int>(threadIdx.x); c < k; c += kXPer * kRingConsumers * 32)
        *reinterpret_cast<uint4*>(xs + static_cast<int64_t>(i) * (k + kNormPad) + c) =
            __ldg(reinterpret_cast<const uint4*>(in + static_cast<int64_t>(i) * lda + c));
    sm90::named_barrier_sync(kRingBarrier, kRingConsumers * 32);
  }
  int slot = 0, buf = 0;
  uint32_t phase = 0;
  for (int tile = static_cast<int>(blockIdx.x); tile < tiles; tile += static_cast<int>(gridDim.x)) {
    float acc[NT][4] = {};
    for (int c = 0; c < chunks; ++c) {
      const unsigned char* stage = ring_smem + slot * kRingStageBytes;
      sm90::mbar_wait(full0 + 8 * slot, phase);
#pragma unroll
      for (int j0 = 0; j0 < kPerWarp; j0 += kBatch) {
        uint4 wa[kBatch], wb[kBatch], xv[kBatch][NT][kX];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int step = warp + kRingConsumers * (j0 + j);
          const int col = c * kChunkCols + step * kCols + kPer * t;
          const int off = step * 64 + 16 * t;
          const bool ok = col < k;  // the ring holds stale bytes past the row's end
          wa[j] = ok ? *reinterpret_cast<const uint4*>(stage + g * kRingRowStride + off)
                     : make_uint4(0, 0, 0, 0);
          wb[j] = ok ? *reinterpret_cast<const uint4*>(stage + (g + 8) * kRingRowStride + off)
                     : make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int jt = 0; jt < NT; ++jt) {
            const int i = 8 * jt + g;
#pragma unroll
            for (int h = 0; h < kX; ++h)
              xv[j][jt][h] = ok && i < m
                                 ? *reinterpret_cast<const uint4*>(
                                       xs + static_cast<int64_t>(i) * (k + kNormPad) + col + 8 * h)
                                 : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j)
#pragma unroll
          for (int jt = 0; jt < NT; ++jt) mma_step<O>(acc[jt], wa[j], wb[j], xv[j][jt]);
      }
      // Every consumer thread releases its own reads of the stage (racecheck does not follow a
      // __syncwarp to one lane's arrive).
      sm90::mbar_arrive(empty0 + 8 * slot);
      if (++slot == stages) slot = 0, phase ^= 1u;
    }
#pragma unroll
    for (int jt = 0; jt < NT; ++jt)
#pragma unroll
      for (int e = 0; e < 4; ++e) part[buf][warp][jt * 4 + e][lane] = acc[jt][e];
    // One barrier a tile: part is double-buffered, and a warp writing part[buf] again (two tiles
    // on) has passed the next tile's barrier, which every reader of this tile reached after
    // its epilogue.
    sm90::named_barrier_sync(kRingBarrier, kRingConsumers * 32);
    store_tile<NT, kRingConsumers, kSilu, O>(part[buf], static_cast<int>(threadIdx.x),
                                             kRingConsumers * 32, tile, out_v, in_scale, w_scale, m,
                                             n, ldc, beta, out_bf16);
    buf ^= 1;
  }
  if (!early) cuda::allow_next_kernel();
}

size_t norm_smem_bytes(int m, int k) {
  return static_cast<size_t>(m) * static_cast<size_t>(k + kNormPad) * 2;
}

// The dynamic shared memory the ring kernels may ask for: sm_90's opt-in 227 KiB per block less
// 1 KiB for their static arrays (normalize_rows' 384 bytes).
constexpr size_t kRingMaxSmem = 232448 - 1024;

// The ring's stages for m rows of k values (esize bytes each): as many as fit, at most
// kRingMaxStages; 0 where fewer than two fit.
int ring_stages(int m, int k, size_t esize) {
  const size_t rest = (m <= 8 ? ring_part_bytes<1>() : ring_part_bytes<2>()) +
                      static_cast<size_t>(m) * static_cast<size_t>(k + kNormPad) * esize;
  for (int s = kRingMaxStages; s >= 2; --s)
    if (ring_head_bytes(s) + rest <= kRingMaxSmem) return s;
  return 0;
}

size_t ring_smem_bytes(int m, int k, size_t esize, int stages) {
  return ring_head_bytes(stages) + (m <= 8 ? ring_part_bytes<1>() : ring_part_bytes<2>()) +
         static_cast<size_t>(m) * static_cast<size_t>(k + kNormPad) * esize;
}

// The SMs of device `dev`; at a kernel's first launch on it, its dynamic shared memory limit
// raised to kRingMaxSmem (the tuner's launches come first, never captured).
int ring_prepare(int dev, const void* kernel) {
  static std::mutex mu;
  static std::map<int, int> sms;
  static std::set<std::pair<int, const void*>> raised;
  std::lock_guard<std::mutex> lock(mu);
  int& n = sms[dev];
  if (n == 0) KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (raised.insert({dev, kernel}).second)
    KVQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kRingMaxSmem)));
  return n;
}

template <bool kSilu, Op O>
void launch_ring(int m, int n, int k, const void* in, int lda, const float* in_scale, const void* w,
                 const float* w_scale, void* out, int ldc, float beta, bool out_bf16,
                 cudaStream_t stream, const GemvNorm& nm, int tiles, bool normed) {
  int dev = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&dev));
  const int stages = ring_stages(m, k, O == Op::kFp8 ? 1 : 2);
  KVQ_CHECK(stages >= 2, "gemv ring variant: the input rows do not fit shared memory");
  const size_t smem = ring_smem_bytes(m, k, O == Op::kFp8 ? 1 : 2, stages);
  auto launch = [&](auto kernel) {
    const int sms = ring_prepare(dev, reinterpret_cast<const void*>(kernel));
    const dim3 grid(static_cast<unsigned>(tiles < sms ? tiles : sms));
    // How it overlaps the kernel before it (gemv_ring_pdl_from_env): by default it may be
    // scheduled early, but its producer waits for that kernel before streaming. Streaming at
    // once took the bandwidth and SM slots of the kernel still running (8B batch 1: down 30 ->
    // 52 us, q|k|v 16.5 -> 10.3; version 19). It never lets the next kernel launch early.
    const int pdl = gemv_ring_pdl_from_env();
    cuda::launch_kernel_smem(kernel, grid, dim3((kRingConsumers + 1) * 32), smem, stream,
                             pdl > 0 && cuda::pdl_enabled() && stream != nullptr, in, lda, in_scale,
                             w, w_scale, out, m, n, k, ldc, beta, out_bf16, false, nm, tiles,
                             stages, pdl == 1);
  };
  if constexpr (O != Op::kFp8) {
    if (normed) {
      launch(gemv_ring_kernel<1, kSilu, O, true>);
      return;
    }
  }
  if (m <= 8) {
    launch(gemv_ring_kernel<1, kSilu, O, false>);
  } else {
    launch(gemv_ring_kernel<2, kSilu, O, false>);
  }
}

template <bool kSilu, Op O>
void launch_gemv(int m, int n, int k, const void* in, int lda, const float* in_scale, const void* w,
                 const float* w_scale, void* out, int ldc, float beta, bool out_bf16,
                 cudaStream_t stream, int warps, const GemvNorm* norm = nullptr) {
  const int per_block = kSilu ? 8 : kRows;
  const dim3 grid(static_cast<unsigned>((n + per_block - 1) / per_block));
  const GemvNorm nm = norm ? *norm : GemvNorm{};
  const size_t smem = norm ? norm_smem_bytes(m, k) : 0;
  auto launch = [&](auto kernel) {
    // smem <= kGemvNormMaxSmem: with the static arrays (~4.4 KB) within the default 48 KiB, so
    // no opt-in attribute (an API call that would also run during graph capture).
    cuda::launch_kernel_smem(kernel, grid, dim3(warps * 32), smem, stream,
                             cuda::pdl_enabled() && stream != nullptr, in, lda, in_scale, w,
                             w_scale, out, m, n, k, ldc, beta, out_bf16, cuda::pdl_early(1), nm);
  };
  if (warps == kGemvRing) {
    launch_ring<kSilu, O>(m, n, k, in, lda, in_scale, w, w_scale, out, ldc, beta, out_bf16, stream,
                          nm, (n + per_block - 1) / per_block, norm != nullptr);
    return;
  }
  if constexpr (O != Op::kFp8) {
    if (norm != nullptr) {
      if (warps == 4)
        launch(gemv_kernel<1, 4, kSilu, O, true>);
      else
        launch(gemv_kernel<1, 8, kSilu, O, true>);
      return;
    }
  }
  if (m <= 8) {
    if (warps == 4)
      launch(gemv_kernel<1, 4, kSilu, O, false>);
    else
      launch(gemv_kernel<1, 8, kSilu, O, false>);
  } else {
    if (warps == 4)
      launch(gemv_kernel<2, 4, kSilu, O, false>);
    else
      launch(gemv_kernel<2, 8, kSilu, O, false>);
  }
}

}  // namespace

int gemv_ring_pdl_from_env() {
  static const int mode = [] {
    const char* e = std::getenv("KVQ_GEMV_RING_PDL");
    const std::string v = e == nullptr ? "wait" : e;
    if (v == "serial") return 0;
    if (v == "wait") return 1;
    if (v == "prefetch") return 2;
    throw InputError("KVQ_GEMV_RING_PDL=" + v + " is not one of: serial, wait, prefetch");
  }();
  return mode;
}

bool gemv_variant_fits(int warps, int m, int k, bool fp8) {
  if (warps == kGemvRing) return m >= 1 && k >= 1 && ring_stages(m, k, fp8 ? 1 : 2) >= 2;
  return warps == 4 || warps == 8;
}

namespace {

bool aligned(const void* p, uintptr_t a) {
  return reinterpret_cast<uintptr_t>(p) % a == 0;
}

// The input side of every variant: rows, k, lda and the two 16-byte streams (`per` values of
// 16 bytes: 8 bf16, 16 e4m3).
bool inputs_fit(int m, int n, int k, const void* in, int lda, const void* w, int per = 8) {
  return m >= 1 && m <= kGemvMaxRows && n >= 1 && k >= per && k % per == 0 && lda >= k &&
         lda % per == 0 && in != nullptr && w != nullptr && aligned(in, 16) && aligned(w, 16);
}

}  // namespace

bool gemv_bf16_fits(int m, int n, int k, const void* in, int lda, const void* w, const float* out,
                    int ldc) {
  return inputs_fit(m, n, k, in, lda, w) && ldc >= n && out != nullptr && aligned(out, 4);
}

bool gemv_bf16_silu_mul_fits(int m, int n, int k, const void* in, int lda, const void* w_gate_up,
                             const void* out, int ldo, bool out_bf16) {
  return n <= (1 << 29) && inputs_fit(m, 2 * n, k, in, lda, w_gate_up) && ldo >= n &&
         out != nullptr && aligned(out, out_bf16 ? 2 : 4);
}

bool gemv_norm_fits(int m, int k, const GemvNorm& norm) {
  return m >= 1 && m <= kGemvNormMaxRows && k >= 8 && k % 8 == 0 && norm.x != nullptr &&
         norm.w != nullptr && norm.ldx >= k && norm.ldx % 4 == 0 && aligned(norm.x, 16) &&
         aligned(norm.w, 16) && norm_smem_bytes(m, k) <= kGemvNormMaxSmem;
}

bool gemv_fp8_fits(int m, int n, int k, const void* in, int lda, const void* w, const float* out,
                   int ldc) {
  return inputs_fit(m, n, k, in, lda, w, 16) && ldc >= n && out != nullptr && aligned(out, 4);
}

void gemv_bf16(int m, int n, int k, const void* in, int lda, const void* w, float* out, int ldc,
               float beta, cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_bf16_fits(m, n, k, in, lda, w, out, ldc),
            "gemv_bf16: operands it does not take (m, alignment or strides)");
  KVQ_CHECK(gemv_variant_fits(warps, m, k, false),
            "gemv_bf16: not a variant (4, 8 or kGemvRing warps) that takes these rows");
  launch_gemv<false, Op::kBf16>(m, n, k, in, lda, nullptr, w, nullptr, out, ldc, beta, false,
                                stream, warps);
}

void gemv_bf16_silu_mul(int m, int n, int k, const void* in, int lda, const void* w_gate_up,
                        void* out, int ldo, bool out_bf16, cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_bf16_silu_mul_fits(m, n, k, in, lda, w_gate_up, out, ldo, out_bf16),
            "gemv_bf16_silu_mul: operands it does not take (m, alignment or strides)");
  KVQ_CHECK(gemv_variant_fits(warps, m, k, false),
            "gemv_bf16_silu_mul: not a variant (4, 8 or kGemvRing warps) that takes these rows");
  launch_gemv<true, Op::kBf16>(m, n, k, in, lda, nullptr, w_gate_up, nullptr, out, ldo, 0.0f,
                               out_bf16, stream, warps);
}

void gemv_bf16_norm(int m, int n, int k, const GemvNorm& norm, const void* w, float* out, int ldc,
                    float beta, cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_norm_fits(m, k, norm) && gemv_bf16_fits(m, n, k, norm.x, k, w, out, ldc),
            "gemv_bf16_norm: operands it does not take (m, alignment or strides)");
  KVQ_CHECK(gemv_variant_fits(warps, m, k, false),
            "gemv_bf16_norm: not a variant (4, 8 or kGemvRing warps) that takes these rows");
  launch_gemv<false, Op::kBf16>(m, n, k, nullptr, k, nullptr, w, nullptr, out, ldc, beta, false,
                                stream, warps, &norm);
}

void gemv_bf16_silu_mul_norm(int m, int n, int k, const GemvNorm& norm, const void* w_gate_up,
                             void* out, int ldo, bool out_bf16, cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_norm_fits(m, k, norm) &&
                gemv_bf16_silu_mul_fits(m, n, k, norm.x, k, w_gate_up, out, ldo, out_bf16),
            "gemv_bf16_silu_mul_norm: operands it does not take (m, alignment or strides)");
  KVQ_CHECK(
      gemv_variant_fits(warps, m, k, false),
      "gemv_bf16_silu_mul_norm: not a variant (4, 8 or kGemvRing warps) that takes these rows");
  launch_gemv<true, Op::kBf16>(m, n, k, nullptr, k, nullptr, w_gate_up, nullptr, out, ldo, 0.0f,
                               out_bf16, stream, warps, &norm);
}

bool gemv_w8a16_fits(int m, int n, int k, const void* in, int lda, const void* w, const float* out,
                     int ldc) {
  return gemv_bf16_fits(m, n, k, in, lda, w, out, ldc) && k % 16 == 0;
}

bool gemv_w8a16_silu_mul_fits(int m, int n, int k, const void* in, int lda, const void* w_gate_up,
                              const void* out, int ldo, bool out_bf16) {
  return gemv_bf16_silu_mul_fits(m, n, k, in, lda, w_gate_up, out, ldo, out_bf16) && k % 16 == 0;
}

void gemv_w8a16(int m, int n, int k, const void* in, int lda, const void* w, const float* w_scale,
                float* out, int ldc, float beta, cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_w8a16_fits(m, n, k, in, lda, w, out, ldc) && w_scale != nullptr,
            "gemv_w8a16: operands it does not take (m, alignment, strides or scales)");
  KVQ_CHECK(gemv_variant_fits(warps, m, k, false),
            "gemv_w8a16: not a variant (4, 8 or kGemvRing warps) that takes these rows");
  launch_gemv<false, Op::kW8>(m, n, k, in, lda, nullptr, w, w_scale, out, ldc, beta, false, stream,
                              warps);
}

void gemv_w8a16_silu_mul(int m, int n, int k, const void* in, int lda, const void* w_gate_up,
                         const float* w_scale, void* out, int ldo, bool out_bf16,
                         cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_w8a16_silu_mul_fits(m, n, k, in, lda, w_gate_up, out, ldo, out_bf16) &&
                w_scale != nullptr,
            "gemv_w8a16_silu_mul: operands it does not take (m, alignment, strides or scales)");
  KVQ_CHECK(gemv_variant_fits(warps, m, k, false),
            "gemv_w8a16_silu_mul: not a variant (4, 8 or kGemvRing warps) that takes these rows");
  launch_gemv<true, Op::kW8>(m, n, k, in, lda, nullptr, w_gate_up, w_scale, out, ldo, 0.0f,
                             out_bf16, stream, warps);
}

void gemv_w8a16_norm(int m, int n, int k, const GemvNorm& norm, const void* w, const float* w_scale,
                     float* out, int ldc, float beta, cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_norm_fits(m, k, norm) && gemv_w8a16_fits(m, n, k, norm.x, k, w, out, ldc) &&
                w_scale != nullptr,
            "gemv_w8a16_norm: operands it does not take (m, alignment, strides or scales)");
  KVQ_CHECK(gemv_variant_fits(warps, m, k, false),
            "gemv_w8a16_norm: not a variant (4, 8 or kGemvRing warps) that takes these rows");
  launch_gemv<false, Op::kW8>(m, n, k, nullptr, k, nullptr, w, w_scale, out, ldc, beta, false,
                              stream, warps, &norm);
}

void gemv_w8a16_silu_mul_norm(int m, int n, int k, const GemvNorm& norm, const void* w_gate_up,
                              const float* w_scale, void* out, int ldo, bool out_bf16,
                              cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_norm_fits(m, k, norm) &&
                gemv_w8a16_silu_mul_fits(m, n, k, norm.x, k, w_gate_up, out, ldo, out_bf16) &&
                w_scale != nullptr,
            "gemv_w8a16_silu_mul_norm: operands it does not take (m, alignment, strides or "
            "scales)");
  KVQ_CHECK(gemv_variant_fits(warps, m, k, false),
            "gemv_w8a16_silu_mul_norm: not a variant (4, 8 or kGemvRing warps) that takes these "
            "rows");
  launch_gemv<true, Op::kW8>(m, n, k, nullptr, k, nullptr, w_gate_up, w_scale, out, ldo, 0.0f,
                             out_bf16, stream, warps, &norm);
}

void gemv_fp8(int m, int n, int k, const void* in, const float* in_scale, int lda, const void* w,
              const float* w_scale, float* out, int ldc, float beta, cudaStream_t stream,
              int warps) {
  KVQ_CHECK(
      gemv_fp8_fits(m, n, k, in, lda, w, out, ldc) && in_scale != nullptr && w_scale != nullptr,
      "gemv_fp8: operands it does not take (m, alignment, strides or scales)");
  KVQ_CHECK(gemv_variant_fits(warps, m, k, true),
            "gemv_fp8: not a variant (4, 8 or kGemvRing warps) that takes these rows");
  launch_gemv<false, Op::kFp8>(m, n, k, in, lda, in_scale, w, w_scale, out, ldc, beta, false,
                               stream, warps);
}

}  // namespace kvq::cuda_model
