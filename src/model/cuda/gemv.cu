#include "model/cuda/gemv.h"

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "cache/cuda/cuda_check.h"
#include "cache/cuda/pdl.h"
#include "kvq/core/error.h"
#include "model/cuda/row_ops.cuh"

namespace kvq::cuda_model {

namespace {

constexpr int kRows = 16;  // output features per block (the MMA's M)
// k steps per warp per iteration (and as many in flight): 4, or 3 for e4m3 with two n-tiles
// (84 bytes of spill at 4 under the 128-register bound; bf16 with two n-tiles keeps 4 for an
// 8-byte spill: 3 steps measured 6-12% slower, docs/notes/decode-tuning.md version 14).
template <int NT, bool kFp8>
constexpr int kUnrollOf = NT == 2 && kFp8 ? 3 : 4;

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
template <int kThreads>
__device__ __forceinline__ void normalize_rows(const GemvNorm& nm, int m, int k, uint16_t* xs) {
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
  __syncthreads();
  if (tid < m) {
    double ss = 0.0;
    for (int w = 0; w < kThreads / 32; ++w) ss += part[w][tid];
    inv[tid] = rows::rms_inverse(ss, k, nm.eps);
  }
  __syncthreads();
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
  __syncthreads();
}

// fp8_scale_product's arithmetic (model_kernels.cu): raw x row scale x column scale.
__device__ __forceinline__ float scaled(float raw, float row_scale, float col_scale) {
  return __fmul_rn(__fmul_rn(raw, row_scale), col_scale);
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
// kNorm (bf16, m <= kGemvNormMaxRows): the input is norm's rows RMSNorm'd by every block into
// shared memory (normalize_rows) after the wait, instead of `in`.
template <int NT, int kWarps, bool kSilu, bool kFp8, bool kNorm>
__global__ void __launch_bounds__(kWarps * 32, 16 / kWarps)
    gemv_kernel(const void* __restrict__ in_v, int lda, const float* __restrict__ in_scale,
                const void* __restrict__ w_v, const float* __restrict__ w_scale,
                void* __restrict__ out_v, int m, int n, int k, int ldc, float beta, bool out_bf16,
                bool early, GemvNorm norm) {
  static_assert(!kNorm || (!kFp8 && NT == 1));
  extern __shared__ __align__(16) uint16_t norm_rows[];
  if (early) cuda::allow_next_kernel();
  using E = std::conditional_t<kFp8, uint8_t, uint16_t>;
  constexpr int kUnroll = kUnrollOf<NT, kFp8>;
  constexpr int kPer = 16 / sizeof(E);  // values per 16-byte load
  constexpr int kCols = 4 * kPer;       // columns per warp step
  const E* in = static_cast<const E*>(in_v);
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
    uint4 ca[kUnroll], cb[kUnroll], xv[kUnroll][NT];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      ca[u] = wa[u];
      cb[u] = wb[u];
      const int c = column(it, u);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int i = 8 * j + g;
        if constexpr (kNorm) {
          xv[u][j] = c < k && i < m ? *reinterpret_cast<const uint4*>(
                                          norm_rows + static_cast<int64_t>(i) * (k + kNormPad) + c)
                                    : make_uint4(0, 0, 0, 0);
        } else {
          xv[u][j] =
              c < k && i < m
                  ? __ldg(reinterpret_cast<const uint4*>(in + static_cast<int64_t>(i) * lda + c))
                  : make_uint4(0, 0, 0, 0);
        }
      }
    }
    if (it + 1 < iters) load_w(it + 1);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if constexpr (kFp8) {
          mma_e4m3(acc[j], ca[u].x, cb[u].x, ca[u].y, cb[u].y, xv[u][j].x, xv[u][j].y);
          mma_e4m3(acc[j], ca[u].z, cb[u].z, ca[u].w, cb[u].w, xv[u][j].z, xv[u][j].w);
        } else {
          mma_bf16(acc[j], ca[u].x, cb[u].x, ca[u].y, cb[u].y, xv[u][j].x, xv[u][j].y);
          mma_bf16(acc[j], ca[u].z, cb[u].z, ca[u].w, cb[u].w, xv[u][j].z, xv[u][j].w);
        }
      }
  }
  if (!early) cuda::allow_next_kernel();

  // The warps' partial sums, added in warp order.
  __shared__ float part[kWarps][NT * 4][32];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) part[warp][j * 4 + e][lane] = acc[j][e];
  __syncthreads();
  auto sum = [&](int q, int l) {
    float s = 0.0f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) s += part[v][q][l];
    return s;
  };
  if constexpr (kSilu) {
    // Elements 0 / 1 of n-tile j on lane l are the gate sums of feature 8 b + l / 4 for inputs
    // 8 j + 2 (l % 4) + {0, 1}; elements 2 / 3 the up sums of the same outputs.
    for (int idx = static_cast<int>(threadIdx.x); idx < NT * 2 * 32; idx += kWarps * 32) {
      const int q = idx / 32, l = idx % 32;
      const int j = q / 2, e = q % 2;
      const int f = static_cast<int>(blockIdx.x) * 8 + (l >> 2);
      const int i = 8 * j + 2 * (l & 3) + e;
      if (f < n && i < m) {
        const float gate = sum(j * 4 + e, l), up = sum(j * 4 + 2 + e, l);
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
    for (int idx = static_cast<int>(threadIdx.x); idx < NT * 4 * 32; idx += kWarps * 32) {
      const int q = idx / 32, l = idx % 32;
      // Element e of n-tile j on lane l: feature g + 8 (e / 2), input 8 j + 2 t + e % 2.
      const int j = q / 4, e = q % 4;
      const int row = static_cast<int>(blockIdx.x) * kRows + (l >> 2) + 8 * (e >> 1);
      const int i = 8 * j + 2 * (l & 3) + (e & 1);
      if (row < n && i < m) {
        float s = sum(q, l);
        if constexpr (kFp8) s = scaled(s, in_scale[i], w_scale[row]);
        float* o = out + static_cast<int64_t>(i) * ldc + row;
        *o = beta != 0.0f ? s + beta * *o : s;
      }
    }
  }
}

size_t norm_smem_bytes(int m, int k) {
  return static_cast<size_t>(m) * static_cast<size_t>(k + kNormPad) * 2;
}

template <bool kSilu, bool kFp8>
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
  if constexpr (!kFp8) {
    if (norm != nullptr) {
      if (warps == 4)
        launch(gemv_kernel<1, 4, kSilu, false, true>);
      else
        launch(gemv_kernel<1, 8, kSilu, false, true>);
      return;
    }
  }
  if (m <= 8) {
    if (warps == 4)
      launch(gemv_kernel<1, 4, kSilu, kFp8, false>);
    else
      launch(gemv_kernel<1, 8, kSilu, kFp8, false>);
  } else {
    if (warps == 4)
      launch(gemv_kernel<2, 4, kSilu, kFp8, false>);
    else
      launch(gemv_kernel<2, 8, kSilu, kFp8, false>);
  }
}

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
  KVQ_CHECK(warps == 4 || warps == 8, "gemv_bf16: 4 or 8 warps per block");
  launch_gemv<false, false>(m, n, k, in, lda, nullptr, w, nullptr, out, ldc, beta, false, stream,
                            warps);
}

void gemv_bf16_silu_mul(int m, int n, int k, const void* in, int lda, const void* w_gate_up,
                        void* out, int ldo, bool out_bf16, cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_bf16_silu_mul_fits(m, n, k, in, lda, w_gate_up, out, ldo, out_bf16),
            "gemv_bf16_silu_mul: operands it does not take (m, alignment or strides)");
  KVQ_CHECK(warps == 4 || warps == 8, "gemv_bf16_silu_mul: 4 or 8 warps per block");
  launch_gemv<true, false>(m, n, k, in, lda, nullptr, w_gate_up, nullptr, out, ldo, 0.0f, out_bf16,
                           stream, warps);
}

void gemv_bf16_norm(int m, int n, int k, const GemvNorm& norm, const void* w, float* out, int ldc,
                    float beta, cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_norm_fits(m, k, norm) && gemv_bf16_fits(m, n, k, norm.x, k, w, out, ldc),
            "gemv_bf16_norm: operands it does not take (m, alignment or strides)");
  KVQ_CHECK(warps == 4 || warps == 8, "gemv_bf16_norm: 4 or 8 warps per block");
  launch_gemv<false, false>(m, n, k, nullptr, k, nullptr, w, nullptr, out, ldc, beta, false, stream,
                            warps, &norm);
}

void gemv_bf16_silu_mul_norm(int m, int n, int k, const GemvNorm& norm, const void* w_gate_up,
                             void* out, int ldo, bool out_bf16, cudaStream_t stream, int warps) {
  KVQ_CHECK(gemv_norm_fits(m, k, norm) &&
                gemv_bf16_silu_mul_fits(m, n, k, norm.x, k, w_gate_up, out, ldo, out_bf16),
            "gemv_bf16_silu_mul_norm: operands it does not take (m, alignment or strides)");
  KVQ_CHECK(warps == 4 || warps == 8, "gemv_bf16_silu_mul_norm: 4 or 8 warps per block");
  launch_gemv<true, false>(m, n, k, nullptr, k, nullptr, w_gate_up, nullptr, out, ldo, 0.0f,
                           out_bf16, stream, warps, &norm);
}

void gemv_fp8(int m, int n, int k, const void* in, const float* in_scale, int lda, const void* w,
              const float* w_scale, float* out, int ldc, float beta, cudaStream_t stream,
              int warps) {
  KVQ_CHECK(
      gemv_fp8_fits(m, n, k, in, lda, w, out, ldc) && in_scale != nullptr && w_scale != nullptr,
      "gemv_fp8: operands it does not take (m, alignment, strides or scales)");
  KVQ_CHECK(warps == 4 || warps == 8, "gemv_fp8: 4 or 8 warps per block");
  launch_gemv<false, true>(m, n, k, in, lda, in_scale, w, w_scale, out, ldc, beta, false, stream,
                           warps);
}

}  // namespace kvq::cuda_model
