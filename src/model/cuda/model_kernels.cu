#include <cuda_bf16.h>

#include <cfloat>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cache/cuda/cuda_check.h"
#include "cache/cuda/kv_codec_device.cuh"
#include "cache/cuda/pdl.h"
#include "kvq/core/error.h"
#include "model/cuda/model_kernels.h"
#include "model/cuda/row_ops.cuh"

namespace kvq::cuda_model {

using cuda::allow_next_kernel;
using cuda::launch_pdl;
using cuda::wait_for_previous_kernel;

namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n, int threads = kThreads) {
  const int64_t g = (n + threads - 1) / threads;
  return static_cast<unsigned>(g < 65535 * 16 ? (g > 0 ? g : 1) : 65535 * 16);
}

using rows::block_sum;
using rows::load;
using rows::store;

__global__ void embed_kernel(const void* embed, bool bf16, const float* mask, const int32_t* tokens,
                             int H, float* x) {
  const int t = static_cast<int>(blockIdx.x);
  const int32_t tok = tokens[t];
  float* row = x + static_cast<int64_t>(t) * H;
  if (tok < 0) {  // kMaskToken: a DFlash drafter's mask vector (stage() admits it only there)
    for (int i = static_cast<int>(threadIdx.x); i < H; i += blockDim.x) row[i] = mask[i];
    return;
  }
  const int64_t base = static_cast<int64_t>(tok) * H;
  for (int i = static_cast<int>(threadIdx.x); i < H; i += blockDim.x)
    row[i] = load(embed, base + i, bf16);
}

// x[r][i] += add[r][i] (x row_scale[r] x col_scale[i] when col_scale is set: fp8_scale_product's
// arithmetic with beta 1) over the row's columns this thread owns, then the sum of their squares.
// Every later read of the row by this thread sees its own writes.
__device__ __forceinline__ double add_residual_and_square(float* row, const ResidualAdd& ra, int r,
                                                          int H) {
  const float rs = ra.row_scale ? ra.row_scale[r] : 1.0f;
  const float* a = ra.add + static_cast<int64_t>(r) * H;
  double ss = 0.0;
  for (int i = static_cast<int>(threadIdx.x); i < H; i += blockDim.x) {
    const float p = ra.col_scale ? __fmul_rn(__fmul_rn(a[i], rs), ra.col_scale[i]) : a[i];
    const float v = __fadd_rn(p, row[i]);
    row[i] = v;
    ss += static_cast<double>(v) * v;
  }
  return ss;
}

__global__ void rms_norm_kernel(const float* x, const int32_t* rows, int H, const float* w,
                                float eps, void* out, bool bf16, ResidualAdd ra) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  __shared__ double scratch[32];
  const int r = static_cast<int>(blockIdx.x);
  const float* row = x + static_cast<int64_t>(rows ? rows[r] : r) * H;
  double ss = 0.0;
  if (ra.add != nullptr) {
    ss = add_residual_and_square(const_cast<float*>(row), ra, r, H);
  } else {
    for (int i = static_cast<int>(threadIdx.x); i < H; i += blockDim.x)
      ss += static_cast<double>(row[i]) * row[i];
  }
  ss = block_sum(ss, scratch);
  rows::store_normed_row(out, r, H, row, rows::rms_inverse(ss, H, eps), w, bf16);
}

__global__ void rope_table_kernel(const int32_t* positions, int T, const double* inv_freq, int half,
                                  float* cs) {
  const int64_t n = static_cast<int64_t>(T) * half;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / half;
    const int f = static_cast<int>(i - t * half);
    const double a = positions[t] * inv_freq[f];
    cs[2 * i] = static_cast<float>(cos(a));
    cs[2 * i + 1] = static_cast<float>(sin(a));
  }
}

// One warp per (token, head) of q, k or v.
// An FP8 product's value with its row and column scales, as fp8_scale_product computes it.
__device__ __forceinline__ float scaled(float raw, float row_scale, float col_scale) {
  return __fmul_rn(__fmul_rn(raw, row_scale), col_scale);
}

__global__ void qkv_post_kernel(const float* qkv, const float* row_scale, const float* col_scale,
                                const float* bias, const float* q_norm, const float* k_norm,
                                const float* cs, int T, int nq, int nkv, int d, float eps, float* q,
                                float* k, float* v) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int heads = nq + 2 * nkv;
  const int64_t item = blockIdx.x * int64_t{blockDim.x >> 5} + (threadIdx.x >> 5);
  if (item >= static_cast<int64_t>(T) * heads) return;
  const int64_t t = item / heads;
  const int hh = static_cast<int>(item - t * heads);
  const int qkv_dim = heads * d;
  const float* raw = qkv + t * qkv_dim + static_cast<int64_t>(hh) * d;
  const float* b = bias ? bias + static_cast<int64_t>(hh) * d : nullptr;
  // Deferred FP8 scales (gemm_tuner.h): the product's values are raw x row x column scale.
  const float rs = row_scale ? row_scale[t] : 1.0f;
  const float* csc = col_scale ? col_scale + static_cast<int64_t>(hh) * d : nullptr;
  auto src = [&](int i) { return csc ? scaled(raw[i], rs, csc[i]) : raw[i]; };
  if (hh >= nq + nkv) {  // v: bias only
    float* dst = v + (t * nkv + (hh - nq - nkv)) * d;
    for (int i = lane; i < d; i += 32) dst[i] = b ? __fadd_rn(src(i), b[i]) : src(i);
    return;
  }
  const bool is_q = hh < nq;
  const float* nw = is_q ? q_norm : k_norm;
  float* dst = is_q ? q + (t * nq + hh) * d : k + (t * nkv + (hh - nq)) * d;
  float inv = 1.0f;
  if (nw) {
    double ss = 0.0;
    for (int i = lane; i < d; i += 32) {
      const float x = b ? __fadd_rn(src(i), b[i]) : src(i);
      ss += static_cast<double>(x) * x;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    inv = rows::rms_inverse(ss, d, eps);
  }
  const int half = d / 2;
  const float* c = cs + t * d;
  for (int i = lane; i < half; i += 32) {
    float a = b ? __fadd_rn(src(i), b[i]) : src(i);
    float bb = b ? __fadd_rn(src(i + half), b[i + half]) : src(i + half);
    if (nw) {
      a = __fmul_rn(__fmul_rn(a, inv), nw[i]);
      bb = __fmul_rn(__fmul_rn(bb, inv), nw[i + half]);
    }
    const float co = c[2 * i], si = c[2 * i + 1];
    dst[i] = __fsub_rn(__fmul_rn(a, co), __fmul_rn(bb, si));
    dst[i + half] = __fadd_rn(__fmul_rn(bb, co), __fmul_rn(a, si));
  }
}

__global__ void add_bias_kernel(float* x, const float* bias, int64_t total, int n) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x)
    x[i] += bias[i % n];
}

// silu(gate + bg) * (up + bu) of row t, column j of gu [T][2I] (deferred FP8 scales applied
// first when row_scale is set).
__device__ __forceinline__ float silu_mul_at(const float* gu, float rs, const float* col_scale,
                                             const float* bias, int64_t t, int j, int I) {
  float g = gu[t * 2 * I + j], u = gu[t * 2 * I + I + j];
  if (col_scale) g = scaled(g, rs, col_scale[j]), u = scaled(u, rs, col_scale[I + j]);
  if (bias) g += bias[j], u += bias[I + j];
  return g / (1.0f + expf(-g)) * u;
}

__global__ void silu_mul_kernel(const float* gu, const float* row_scale, const float* col_scale,
                                const float* bias, int64_t total, int I, void* out, bool bf16) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / I;
    const int j = static_cast<int>(i - t * I);
    store(out, i,
          silu_mul_at(gu, row_scale ? row_scale[t] : 1.0f, row_scale ? col_scale : nullptr, bias, t,
                      j, I),
          bf16);
  }
}

__global__ void gather_rows_kernel(const float* src, const int32_t* rows, int64_t total, int F,
                                   float* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / F;
    out[i] = src[int64_t{rows[r]} * F + (i - r * F)];
  }
}

__global__ void to_bf16_kernel(const float* in, int64_t n, __nv_bfloat16* out) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

// A row's FP8 scale, the same in every quantizing kernel: kDynamic takes the block's max of
// the threads' partial |x| maxima (amax) / 448, or 1 for an all-zero row; kStatic the tensor's
// scale, kGiven the row's own. Stored to scale[r] unless given. Every thread gets it.
__device__ float row_fp8_scale(float amax, int r, Fp8Scale mode, const float* scale_in,
                               float* scale) {
  __shared__ float mx[32];
  float s = 1.0f;
  if (mode == Fp8Scale::kDynamic) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
    if (lane == 0) mx[warp] = amax;
    __syncthreads();
    amax = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) amax = fmaxf(amax, mx[w]);
    s = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
  } else {
    s = mode == Fp8Scale::kStatic ? scale_in[0] : scale[r];
  }
  if (mode != Fp8Scale::kGiven && threadIdx.x == 0) scale[r] = s;
  return s;
}

// One block quantizes row r of values val(c): the row's scale (row_fp8_scale), then each value
// divided by it and encoded; a zero (or negative, or NaN) given or static scale dequantizes
// everything to 0: codes 0, not the NaN codes x / 0 would give. The fused callers pass values
// already rounded to bf16, as the unfused path stores them, so all paths give the same bits.
template <class Val>
__device__ void quantize_row_fp8(const Val& val, int r, int cols, Fp8Scale mode,
                                 const float* scale_in, uint8_t* codes, float* scale) {
  float amax = 0.0f;
  if (mode == Fp8Scale::kDynamic)
    for (int c = static_cast<int>(threadIdx.x); c < cols; c += blockDim.x)
      amax = fmaxf(amax, fabsf(val(c)));
  const float s = row_fp8_scale(amax, r, mode, scale_in, scale);
  const bool dead = !(s > 0.0f);
  uint8_t* out = codes + static_cast<int64_t>(r) * cols;
  for (int c = static_cast<int>(threadIdx.x); c < cols; c += blockDim.x)
    out[c] = dead ? uint8_t{0} : static_cast<uint8_t>(kvq::cuda::enc_e4m3(__fdiv_rn(val(c), s)));
}

// quantize_row_fp8 of values the thread already holds: v[k] is column threadIdx.x + k *
// blockDim.x (those < cols). One memory round trip per row instead of one per pass (the one-row
// kernels of a batch-1 FP8 step were 5-9 us each; docs/notes/decode-tuning.md version 20); the
// same max, division and encoder per element, so the same codes and scale.
template <int kPer>
__device__ void quantize_held_row_fp8(const float (&v)[kPer], int r, int cols, Fp8Scale mode,
                                      const float* scale_in, uint8_t* codes, float* scale) {
  const int tid = static_cast<int>(threadIdx.x), step = static_cast<int>(blockDim.x);
  float amax = 0.0f;
  if (mode == Fp8Scale::kDynamic) {
#pragma unroll
    for (int k = 0; k < kPer; ++k)
      if (tid + k * step < cols) amax = fmaxf(amax, fabsf(v[k]));
  }
  const float s = row_fp8_scale(amax, r, mode, scale_in, scale);
  const bool dead = !(s > 0.0f);
  uint8_t* out = codes + static_cast<int64_t>(r) * cols;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int c = tid + k * step;
    if (c < cols)
      out[c] = dead ? uint8_t{0} : static_cast<uint8_t>(kvq::cuda::enc_e4m3(__fdiv_rn(v[k], s)));
  }
}

// KVQ_FP8_HELD=0 (A/B): the FP8 row quantizers re-read their row per pass, as before version 20.
bool held_fp8_rows(int held) {
  static const bool on = [] {
    const char* e = std::getenv("KVQ_FP8_HELD");
    return e == nullptr || std::string(e) != "0";  // other values fail in check_cuda_model_env
  }();
  return held < 0 ? on : held > 0;
}

// Values per thread for a held row of n columns over `threads` threads: 1, 2, 4 or 8, or 0 where
// more are needed (the kernels that re-read the row run instead).
int held_per_thread(int64_t n, int threads) {
  const int64_t per = (n + threads - 1) / threads;
  return per <= 1 ? 1 : per <= 2 ? 2 : per <= 4 ? 4 : per <= 8 ? 8 : 0;
}

template <class F>
void with_held(int per, F&& f) {
  switch (per) {
    case 1:
      f(std::integral_constant<int, 1>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    default:
      f(std::integral_constant<int, 8>{});
      break;
  }
}

__global__ void quantize_fp8_kernel(const void* x, bool bf16, int cols, int64_t ldx, Fp8Scale mode,
                                    const float* scale_in, uint8_t* codes, float* scale) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  const int r = static_cast<int>(blockIdx.x);
  const int64_t base = static_cast<int64_t>(r) * ldx;
  quantize_row_fp8([&](int c) { return load(x, base + c, bf16); }, r, cols, mode, scale_in, codes,
                   scale);
}

// The same for bf16 rows whose columns come in 16-byte chunks (cols and ldx multiples of 8,
// x 16-byte aligned): each thread loads whole chunks, all of its loads in flight at once, so a
// decode step's one-row call costs one memory round trip per pass instead of one per element
// (the scalar kernel took ~12 us for a 4096-wide row on an H100). Same codes and scales as
// The largest |value| of 8 bf16 values (one 16-byte chunk), and the chunk's e4m3 codes at scale
// s (zeros for a dead row): the re-reading and the held bf16x8 quantizers share both.
__device__ __forceinline__ float bf16x8_amax(const uint4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(h[e]);
    amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  return amax;
}
__device__ __forceinline__ uint2 bf16x8_to_e4m3(const uint4& v, float s, bool dead) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  uint32_t packed[2] = {0u, 0u};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(h[e]);
    const uint32_t lo = dead ? 0u : kvq::cuda::enc_e4m3(__fdiv_rn(f.x, s));
    const uint32_t hi = dead ? 0u : kvq::cuda::enc_e4m3(__fdiv_rn(f.y, s));
    packed[e >> 1] |= (lo | (hi << 8)) << (16 * (e & 1));
  }
  return make_uint2(packed[0], packed[1]);
}

// quantize_fp8_kernel: the same max, the same division and the same encoder per element.
__global__ void quantize_fp8_bf16x8_kernel(const __nv_bfloat16* x, int cols, int64_t ldx,
                                           Fp8Scale mode, const float* scale_in, uint8_t* codes,
                                           float* scale) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  const int r = static_cast<int>(blockIdx.x);
  const uint4* row = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(r) * ldx);
  const int chunks = cols / 8;
  float amax = 0.0f;
  if (mode == Fp8Scale::kDynamic) {
#pragma unroll 4
    for (int c = static_cast<int>(threadIdx.x); c < chunks; c += blockDim.x) {
      const uint4 v = row[c];
      amax = fmaxf(amax, bf16x8_amax(v));
    }
  }
  const float s = row_fp8_scale(amax, r, mode, scale_in, scale);
  const bool dead = !(s > 0.0f);
  uint2* out = reinterpret_cast<uint2*>(codes + static_cast<int64_t>(r) * cols);
#pragma unroll 4
  for (int c = static_cast<int>(threadIdx.x); c < chunks; c += blockDim.x) {
    const uint4 v = row[c];
    out[c] = bf16x8_to_e4m3(v, s, dead);
  }
}

__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

__global__ void rms_norm_fp8_kernel(float* x, int H, const float* w, float eps, Fp8Scale mode,
                                    const float* scale_in, uint8_t* codes, float* scale,
                                    ResidualAdd ra) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  __shared__ double scratch[32];
  const int r = static_cast<int>(blockIdx.x);
  float* row = x + static_cast<int64_t>(r) * H;
  double ss = 0.0;
  // The residual's row scale is read here, before quantize_row_fp8 writes this row's new scale
  // (the same buffer: act_scale_); block_sum's barrier orders the two.
  if (ra.add != nullptr) {
    ss = add_residual_and_square(row, ra, r, H);
  } else {
    for (int i = static_cast<int>(threadIdx.x); i < H; i += blockDim.x)
      ss += static_cast<double>(row[i]) * row[i];
  }
  ss = block_sum(ss, scratch);
  const float inv = rows::rms_inverse(ss, H, eps);
  quantize_row_fp8([&](int i) { return round_bf16(__fmul_rn(__fmul_rn(row[i], inv), w[i])); }, r, H,
                   mode, scale_in, codes, scale);
}

__global__ void quantize_fp8_rounded_kernel(const float* x, int cols, int64_t ldx, Fp8Scale mode,
                                            const float* scale_in, uint8_t* codes, float* scale) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  const int r = static_cast<int>(blockIdx.x);
  const float* row = x + static_cast<int64_t>(r) * ldx;
  quantize_row_fp8([&](int c) { return round_bf16(row[c]); }, r, cols, mode, scale_in, codes,
                   scale);
}

// quantize_fp8_bf16x8_kernel with the thread's chunks held in registers (kPer chunks a thread).
template <int kPer>
__global__ void quantize_fp8_bf16x8_held_kernel(const __nv_bfloat16* x, int cols, int64_t ldx,
                                                Fp8Scale mode, const float* scale_in,
                                                uint8_t* codes, float* scale) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  const int r = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x), step = static_cast<int>(blockDim.x);
  const uint4* row = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(r) * ldx);
  const int chunks = cols / 8;
  uint4 v[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    v[k] = tid + k * step < chunks ? row[tid + k * step] : make_uint4(0, 0, 0, 0);
  float amax = 0.0f;
  if (mode == Fp8Scale::kDynamic) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      amax = fmaxf(amax, bf16x8_amax(v[k]));
    }
  }
  const float s = row_fp8_scale(amax, r, mode, scale_in, scale);
  const bool dead = !(s > 0.0f);
  uint2* out = reinterpret_cast<uint2*>(codes + static_cast<int64_t>(r) * cols);
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (tid + k * step >= chunks) continue;
    out[tid + k * step] = bf16x8_to_e4m3(v[k], s, dead);
  }
}

// rms_norm_fp8_kernel with the thread's columns held in registers (kPer a thread).
template <int kPer>
__global__ void rms_norm_fp8_held_kernel(float* x, int H, const float* w, float eps, Fp8Scale mode,
                                         const float* scale_in, uint8_t* codes, float* scale,
                                         ResidualAdd ra) {
  __shared__ double scratch[32];
  const int r = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x), step = static_cast<int>(blockDim.x);
  // The norm's weights and the residual's column scales (a projection's weight scales) do not
  // depend on the kernel before: loaded while it finishes.
  float wv[kPer], cv[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int i = tid + k * step;
    wv[k] = i < H ? w[i] : 0.0f;
    cv[k] = i < H && ra.col_scale ? ra.col_scale[i] : 0.0f;
  }
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  float* row = x + static_cast<int64_t>(r) * H;
  // The residual's row scale is read here, before the quantizer writes this row's new scale
  // (the same buffer: act_scale_); block_sum's barrier orders the two.
  const float rs = ra.add != nullptr && ra.row_scale ? ra.row_scale[r] : 1.0f;
  const float* a = ra.add != nullptr ? ra.add + static_cast<int64_t>(r) * H : nullptr;
  float v[kPer];
  double ss = 0.0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int i = tid + k * step;
    v[k] = 0.0f;
    if (i >= H) continue;
    float val = row[i];
    if (a != nullptr) {  // add_residual_and_square's arithmetic
      const float p = ra.col_scale ? __fmul_rn(__fmul_rn(a[i], rs), cv[k]) : a[i];
      val = __fadd_rn(p, val);
      row[i] = val;
    }
    v[k] = val;
    ss += static_cast<double>(val) * val;
  }
  ss = block_sum(ss, scratch);
  const float inv = rows::rms_inverse(ss, H, eps);
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int i = tid + k * step;
    if (i < H) v[k] = round_bf16(__fmul_rn(__fmul_rn(v[k], inv), wv[k]));
  }
  quantize_held_row_fp8<kPer>(v, r, H, mode, scale_in, codes, scale);
}

// quantize_fp8_rounded_kernel with the thread's columns held in registers (kPer a thread).
template <int kPer>
__global__ void quantize_fp8_rounded_held_kernel(const float* x, int cols, int64_t ldx,
                                                 Fp8Scale mode, const float* scale_in,
                                                 uint8_t* codes, float* scale) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  const int r = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x), step = static_cast<int>(blockDim.x);
  const float* row = x + static_cast<int64_t>(r) * ldx;
  float v[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    v[k] = tid + k * step < cols ? round_bf16(row[tid + k * step]) : 0.0f;
  quantize_held_row_fp8<kPer>(v, r, cols, mode, scale_in, codes, scale);
}

__global__ void fp8_scale_product_kernel(const float* raw, int m, int n, int ld,
                                         const float* row_scale, const float* col_scale, float beta,
                                         float* out) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  const int64_t total = static_cast<int64_t>(m) * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / n;
    const int c = static_cast<int>(i - r * n);
    const int64_t o = r * ld + c;
    const float v = scaled(raw[o], row_scale[r], col_scale[c]);
    out[o] = beta == 0.0f ? v : v + beta * out[o];
  }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void fill_random_kernel(__nv_bfloat16* w, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t h = splitmix64(seed * 0x100000001B3ull ^ static_cast<uint64_t>(i));
    // Uniform on [-sqrt(3), sqrt(3)): unit variance.
    const float u = (static_cast<float>(h >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * 1.7320508f;
    w[i] = __float2bfloat16_rn(u * scale);
  }
}

__global__ void fill_f32_kernel(float* w, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    w[i] = value;
}

__global__ void interleave_shards_kernel(const float* parts, int shards, int n, int vs,
                                         float* out) {
  wait_for_previous_kernel();
  allow_next_kernel();
  const int64_t total = static_cast<int64_t>(shards) * n * vs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = i % vs, r = (i / vs) % n, p = i / (int64_t{vs} * n);
    out[(r * shards + p) * vs + c] = parts[i];
  }
}

__global__ void argmax_kernel(const float* logits, int vocab, int32_t* out) {
  wait_for_previous_kernel();  // PDL (cache/cuda/pdl.h)
  allow_next_kernel();
  __shared__ float sv[32];
  __shared__ int si[32];
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  float best = -FLT_MAX;
  int idx = 0x7fffffff;
  for (int i = static_cast<int>(threadIdx.x); i < vocab; i += blockDim.x) {
    const float x = row[i];
    if (x > best || (x == best && i < idx)) best = x, idx = i;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float b2 = __shfl_xor_sync(0xffffffffu, best, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
    if (b2 > best || (b2 == best && i2 < idx)) best = b2, idx = i2;
  }
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  if (lane == 0) sv[warp] = best, si[warp] = idx;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w)
      if (sv[w] > best || (sv[w] == best && si[w] < idx)) best = sv[w], idx = si[w];
    out[blockIdx.x] = idx == 0x7fffffff ? 0 : idx;
  }
}

__global__ void scatter_tokens_kernel(const int32_t* ids, const int32_t* rows, const int32_t* dst,
                                      int n, int32_t* tokens) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) tokens[dst[i]] = ids[rows[i]];
}

__global__ void advance_decode_kernel(const int32_t* ids, const int64_t* next_slots, int n,
                                      int32_t* tokens, int32_t* positions, int32_t* seq_lens,
                                      int64_t* slots) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  tokens[i] = ids[i];
  positions[i] += 1;
  seq_lens[i] += 1;
  slots[i] = next_slots[i];
}

}  // namespace

void embed_gather(const void* embed, bool bf16, const float* mask, const int32_t* tokens, int T,
                  int H, float* x, cudaStream_t stream) {
  if (T == 0) return;
  embed_kernel<<<T, kThreads, 0, stream>>>(embed, bf16, mask, tokens, H, x);
  KVQ_CUDA_CHECK_LAUNCH();
}

void rms_norm_rows(const float* x, const int32_t* rows, int n, int H, const float* w, float eps,
                   void* out, bool bf16, cudaStream_t stream) {
  if (n == 0) return;
  // One block per row: wide rows get 1024 threads so each thread has few loads in flight
  // (256 threads left a 64-row decode batch latency-bound, 11.5 us per call at H = 4096).
  const int threads = H >= 2048 ? 1024 : kThreads;
  launch_pdl(rms_norm_kernel, n, threads, stream, x, rows, H, w, eps, out, bf16, ResidualAdd{});
  KVQ_CUDA_CHECK_LAUNCH();
}

void rope_table(const int32_t* positions, int T, const double* inv_freq, int half, float* cs,
                cudaStream_t stream) {
  if (T == 0) return;
  rope_table_kernel<<<grid_for(int64_t{T} * half), kThreads, 0, stream>>>(positions, T, inv_freq,
                                                                          half, cs);
  KVQ_CUDA_CHECK_LAUNCH();
}

void qkv_post(const float* qkv, const float* bias, const float* q_norm, const float* k_norm,
              const float* cs, int T, int nq, int nkv, int d, float eps, float* q, float* k,
              float* v, cudaStream_t stream, const float* row_scale, const float* col_scale) {
  if (T == 0) return;
  const int64_t warps = int64_t{T} * (nq + 2 * nkv);
  launch_pdl(qkv_post_kernel, static_cast<unsigned>((warps + 3) / 4), 128, stream, qkv, row_scale,
             col_scale, bias, q_norm, k_norm, cs, T, nq, nkv, d, eps, q, k, v);
  KVQ_CUDA_CHECK_LAUNCH();
}

void add_bias_rows(float* x, const float* bias, int T, int n, cudaStream_t stream) {
  const int64_t total = int64_t{T} * n;
  if (total == 0) return;
  launch_pdl(add_bias_kernel, grid_for(total), kThreads, stream, x, bias, total, n);
  KVQ_CUDA_CHECK_LAUNCH();
}

void silu_mul(const float* gu, const float* bias, int T, int I, void* out, bool bf16,
              cudaStream_t stream, const float* row_scale, const float* col_scale) {
  const int64_t total = int64_t{T} * I;
  if (total == 0) return;
  launch_pdl(silu_mul_kernel, grid_for(total), kThreads, stream, gu, row_scale, col_scale, bias,
             total, I, out, bf16);
  KVQ_CUDA_CHECK_LAUNCH();
}

void add_rms_norm_rows(float* x, const ResidualAdd& ra, int n, int H, const float* w, float eps,
                       void* out, bool bf16, cudaStream_t stream) {
  if (n == 0) return;
  launch_pdl(rms_norm_kernel, n, H >= 2048 ? 1024 : kThreads, stream, x, nullptr, H, w, eps, out,
             bf16, ra);
  KVQ_CUDA_CHECK_LAUNCH();
}

void rms_norm_rows_fp8(float* x, int n, int H, const float* w, float eps, Fp8Scale mode,
                       const float* scale_in, uint8_t* codes, float* scale, cudaStream_t stream,
                       const ResidualAdd& ra, int held) {
  if (n == 0) return;
  const int threads = H >= 2048 ? 1024 : kThreads;
  if (const int per = held_fp8_rows(held) ? held_per_thread(H, threads) : 0; per > 0) {
    with_held(per, [&](auto k) {
      launch_pdl(rms_norm_fp8_held_kernel<decltype(k)::value>, n, threads, stream, x, H, w, eps,
                 mode, scale_in, codes, scale, ra);
    });
  } else {
    launch_pdl(rms_norm_fp8_kernel, n, threads, stream, x, H, w, eps, mode, scale_in, codes, scale,
               ra);
  }
  KVQ_CUDA_CHECK_LAUNCH();
}

void quantize_rows_fp8_rounded(const float* x, int rows, int cols, int64_t ldx, Fp8Scale mode,
                               const float* scale_in, uint8_t* codes, float* scale,
                               cudaStream_t stream, int held) {
  if (rows == 0 || cols == 0) return;
  const int threads = cols >= 2048 ? 1024 : kThreads;
  if (const int per = held_fp8_rows(held) ? held_per_thread(cols, threads) : 0; per > 0) {
    with_held(per, [&](auto k) {
      launch_pdl(quantize_fp8_rounded_held_kernel<decltype(k)::value>, rows, threads, stream, x,
                 cols, ldx, mode, scale_in, codes, scale);
    });
  } else {
    launch_pdl(quantize_fp8_rounded_kernel, rows, threads, stream, x, cols, ldx, mode, scale_in,
               codes, scale);
  }
  KVQ_CUDA_CHECK_LAUNCH();
}

// One cp.async.bulk.prefetch.L2 of up to 16 KB per thread and step: the lines come into L2
// while the thread goes on; nothing is written. 16 KB requests from 8 warps brought 32 MiB in
// ~20 us (1.6 TB/s) beside the attention chain; 4 KB and 64 KB requests, 16 warps, or
// prefetch.global.L2 per line were no faster in the step (docs/notes/decode-tuning.md version 20).
__global__ void l2_prefetch_kernel(const std::byte* p, size_t bytes) {
  constexpr size_t kChunk = 16384;
  const size_t threads = size_t{gridDim.x} * blockDim.x;
  for (size_t off = (size_t{blockIdx.x} * blockDim.x + threadIdx.x) * kChunk; off < bytes;
       off += threads * kChunk) {
    const auto n = static_cast<unsigned>(bytes - off < kChunk ? bytes - off : kChunk);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
  }
}

void l2_prefetch(const void* p, size_t bytes, int warps, cudaStream_t stream) {
  KVQ_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "l2_prefetch: address not 16-byte aligned");
  bytes &= ~size_t{15};
  if (bytes == 0 || warps <= 0) return;
  l2_prefetch_kernel<<<static_cast<unsigned>(warps), 32, 0, stream>>>(
      static_cast<const std::byte*>(p), bytes);
  KVQ_CUDA_CHECK_LAUNCH();
}

void gather_rows(const float* src, const int32_t* rows, int n, int F, float* out,
                 cudaStream_t stream) {
  const int64_t total = int64_t{n} * F;
  if (total == 0) return;
  gather_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(src, rows, total, F, out);
  KVQ_CUDA_CHECK_LAUNCH();
}

void to_bf16(const float* in, int64_t n, void* out, cudaStream_t stream) {
  if (n == 0) return;
  launch_pdl(to_bf16_kernel, grid_for(n), kThreads, stream, in, n,
             static_cast<__nv_bfloat16*>(out));
  KVQ_CUDA_CHECK_LAUNCH();
}

void fill_random_bf16(void* w, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  fill_random_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(w), n, seed,
                                                           scale);
  KVQ_CUDA_CHECK_LAUNCH();
}

void fill_f32(float* w, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  fill_f32_kernel<<<grid_for(n), kThreads, 0, stream>>>(w, n, value);
  KVQ_CUDA_CHECK_LAUNCH();
}

void quantize_rows_fp8(const void* x, bool bf16, int rows, int cols, int64_t ldx, Fp8Scale mode,
                       const float* scale_in, uint8_t* codes, float* scale, cudaStream_t stream,
                       int held) {
  if (rows == 0 || cols == 0) return;
  const int threads = cols >= 2048 ? 512 : 128;
  if (bf16 && cols % 8 == 0 && ldx % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(codes) % 8 == 0) {
    if (const int per = held_fp8_rows(held) ? held_per_thread(cols / 8, threads) : 0; per > 0) {
      with_held(per, [&](auto k) {
        launch_pdl(quantize_fp8_bf16x8_held_kernel<decltype(k)::value>, rows, threads, stream,
                   static_cast<const __nv_bfloat16*>(x), cols, ldx, mode, scale_in, codes, scale);
      });
    } else {
      launch_pdl(quantize_fp8_bf16x8_kernel, rows, threads, stream,
                 static_cast<const __nv_bfloat16*>(x), cols, ldx, mode, scale_in, codes, scale);
    }
  } else {
    launch_pdl(quantize_fp8_kernel, rows, threads, stream, x, bf16, cols, ldx, mode, scale_in,
               codes, scale);
  }
  KVQ_CUDA_CHECK_LAUNCH();
}

void fp8_scale_product(const float* raw, int m, int n, int ld, const float* row_scale,
                       const float* col_scale, float beta, float* out, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(m) * n;
  if (total == 0) return;
  launch_pdl(fp8_scale_product_kernel, grid_for(total), kThreads, stream, raw, m, n, ld, row_scale,
             col_scale, beta, out);
  KVQ_CUDA_CHECK_LAUNCH();
}

void interleave_shards(const float* parts, int shards, int n, int vs, float* out,
                       cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(shards) * n * vs;
  if (total == 0) return;
  launch_pdl(interleave_shards_kernel, grid_for(total), kThreads, stream, parts, shards, n, vs,
             out);
}

void argmax_rows(const float* logits, int rows, int vocab, int32_t* out, cudaStream_t stream) {
  if (rows == 0) return;
  launch_pdl(argmax_kernel, rows, kThreads, stream, logits, vocab, out);
  KVQ_CUDA_CHECK_LAUNCH();
}

void scatter_tokens(const int32_t* ids, const int32_t* rows, const int32_t* dst, int n,
                    int32_t* tokens, cudaStream_t stream) {
  if (n == 0) return;
  scatter_tokens_kernel<<<grid_for(n), kThreads, 0, stream>>>(ids, rows, dst, n, tokens);
  KVQ_CUDA_CHECK_LAUNCH();
}

void advance_decode_step(const int32_t* ids, const int64_t* next_slots, int n, int32_t* tokens,
                         int32_t* positions, int32_t* seq_lens, int64_t* slots,
                         cudaStream_t stream) {
  if (n == 0) return;
  advance_decode_kernel<<<grid_for(n), kThreads, 0, stream>>>(ids, next_slots, n, tokens, positions,
                                                              seq_lens, slots);
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace kvq::cuda_model
