// write_kv_cuda: the device twin of write_kv_reference. One warp encodes one (token, kv head)
// row of one side; lane l holds elements [l*E, l*E + E) (E = head_dim / 32), so the row's
// reductions (absmax, min/max, the nvfp4 block maxima) and the Hadamard rotation are warp
// shuffles. Other head dims (up to 256: small models) take one thread per row. Every rounding
// follows src/quant/ref/ (see kv_codec_device.cuh).
#include <cfloat>
#include <climits>
#include <cmath>
#include <string>

#include "cache/cuda/cuda_check.h"
#include "cache/cuda/dispatch.h"
#include "cache/cuda/kv_codec_device.cuh"
#include "cache/cuda/pdl.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/quant/codec.h"

namespace kvq::cuda {

HadamardSigns make_hadamard_signs() {
  HadamardSigns s{};
  for (int i = 0; i < kMaxRotatedDim; ++i)
    if (kvq::quant::hadamard_sign(static_cast<size_t>(i)) < 0.0f) s.bits[i >> 5] |= 1u << (i & 31);
  return s;
}

namespace {

constexpr int kWriteWarps = 4;
constexpr int kWriteMaxKvHeads = 256;
// Caps of per_token_head.cc (FLT_MAX / 128 and FLT_MAX / 512 are exact).
constexpr float kInt8MaxScale = FLT_MAX / 128.0f;
constexpr float kFp8MaxScale = FLT_MAX / 512.0f;

struct WriteSideParams {
  std::byte* base;
  uint64_t block_bytes, head_stride, values_bytes, row_data_bytes, row_scale_bytes;
  const float* src;  // [n][num_kv_heads][head_dim]
  const int64_t* slots;
  unsigned long long* bad_token;  // optional: lowest token whose slot is past the blocks
  int64_t n;
  int64_t num_slots;
  int num_kv_heads;
  int block_tokens;
  HadamardSigns signs;
  float tensor_scale[kWriteMaxKvHeads];
};

// One launch writes one side (gridDim.y 1) or both sides of the same dtype and head_dim
// (gridDim.y 2: blockIdx.y picks K or V), which saves a launch per layer in a decode step.
struct WriteParams {
  WriteSideParams side[2];
};

// Stores NB bytes held in the low bytes of w[] (little-endian) with one aligned store.
template <int NB>
__device__ __forceinline__ void store_bytes(uint8_t* p, const uint32_t* w) {
  if constexpr (NB == 1) {
    *p = static_cast<uint8_t>(w[0]);
  } else if constexpr (NB == 2) {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(w[0]);
  } else if constexpr (NB == 4) {
    *reinterpret_cast<uint32_t*>(p) = w[0];
  } else if constexpr (NB == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    static_assert(NB % 16 == 0);
#pragma unroll
    for (int i = 0; i < NB / 16; ++i)
      reinterpret_cast<uint4*>(p)[i] =
          make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
  }
}

// Packs per-element codes of `bits` bits each into words (element 0 in the lowest bits).
template <int E, int kBits>
__device__ __forceinline__ void pack_codes(const uint32_t (&c)[E], uint32_t* w) {
  constexpr int kPerWord = 32 / kBits;
  constexpr int kWords = (E * kBits + 31) / 32;
#pragma unroll
  for (int i = 0; i < kWords; ++i) w[i] = 0;
#pragma unroll
  for (int e = 0; e < E; ++e) w[e / kPerWord] |= c[e] << ((e % kPerWord) * kBits);
}

template <KvDtype D, int E>
__global__ void __launch_bounds__(kWriteWarps * 32)
    write_side_kernel(const __grid_constant__ WriteParams ps) {
  wait_for_previous_kernel();  // PDL (pdl.h)
  allow_next_kernel();
  const WriteSideParams& p = ps.side[blockIdx.y];
  constexpr int kHd = 32 * E;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWriteWarps + (threadIdx.x >> 5);
  if (row >= p.n * p.num_kv_heads) return;
  const int64_t t = row / p.num_kv_heads;
  const int h = static_cast<int>(row - t * p.num_kv_heads);
  const int64_t slot = p.slots[t];
  if (slot < 0) return;  // padding
  if (slot >= p.num_slots) {
    // Never written (a kernel cannot throw): recorded for check_write_kv_cuda.
    if (p.bad_token != nullptr && lane == 0)
      atomicMin(p.bad_token, static_cast<unsigned long long>(t));
    return;
  }
  const int64_t block = slot / p.block_tokens;
  const int64_t off = slot - block * p.block_tokens;
  uint8_t* head = reinterpret_cast<uint8_t*>(p.base) + block * p.block_bytes + h * p.head_stride;
  uint8_t* vals = head + off * p.row_data_bytes;
  uint8_t* meta = head + p.values_bytes + off * p.row_scale_bytes;

  uint32_t xb[E];  // the input's bits (float32 storage copies them unchanged)
  const float* src = p.src + row * kHd + lane * E;
  if constexpr (E == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    xb[0] = v.x, xb[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < E / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(src)[i];
      xb[4 * i] = v.x, xb[4 * i + 1] = v.y, xb[4 * i + 2] = v.z, xb[4 * i + 3] = v.w;
    }
  }
  float x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = __uint_as_float(xb[e]);

  if constexpr (D == KvDtype::kFloat32) {
    store_bytes<E * 4>(vals + lane * E * 4, xb);
  } else if constexpr (D == KvDtype::kFloat16 || D == KvDtype::kBFloat16) {
    uint32_t c[E];
#pragma unroll
    for (int e = 0; e < E; ++e)
      c[e] = D == KvDtype::kFloat16 ? f32_to_f16_bits_satfinite(x[e], false)
                                    : f32_to_bf16_bits_satfinite(x[e]);
    uint32_t w[E / 2];
    pack_codes<E, 16>(c, w);
    store_bytes<E * 2>(vals + lane * E * 2, w);
  } else if constexpr (D == KvDtype::kFp8E4M3 || D == KvDtype::kFp8E5M2) {
    const float ts = p.tensor_scale[h];
    uint32_t c[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float y = __fdiv_rn(x[e], ts);
      c[e] = D == KvDtype::kFp8E4M3 ? enc_e4m3(y) : enc_e5m2(y);
    }
    uint32_t w[(E + 3) / 4];
    pack_codes<E, 8>(c, w);
    store_bytes<E>(vals + lane * E, w);
  } else if constexpr (D == KvDtype::kInt8PerTokenHead || D == KvDtype::kFp8PerTokenHead) {
    const float amax = warp_finite_amax(x);
    constexpr bool kInt8 = D == KvDtype::kInt8PerTokenHead;
    float s = __fdiv_rn(amax, kInt8 ? 127.0f : 448.0f);
    const float cap = kInt8 ? kInt8MaxScale : kFp8MaxScale;
    if (cap < s) s = cap;  // std::min(s, cap)
    if (lane == 0) *reinterpret_cast<float*>(meta) = s;
    uint32_t c[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if (s == 0.0f) {
        c[e] = 0;
      } else if constexpr (kInt8) {
        c[e] =
            static_cast<uint32_t>(round_half_even_clamped(__fdiv_rn(x[e], s), -127, 127)) & 0xFFu;
      } else {
        c[e] = enc_e4m3(__fdiv_rn(x[e], s));
      }
    }
    uint32_t w[(E + 3) / 4];
    pack_codes<E, 8>(c, w);
    store_bytes<E>(vals + lane * E, w);
  } else if constexpr (D == KvDtype::kInt4PerTokenHead) {
    warp_hadamard_rotate<E>(x, lane, p.signs);
    // lo / hi over the finite values, the first occurrence winning ties (the reference scans
    // in order and replaces only on a strict < / >), so even the sign of a zero matches.
    float lo = __uint_as_float(kF32Inf), hi = -__uint_as_float(kF32Inf);
    int lo_i = INT_MAX, hi_i = INT_MAX;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if (!is_finite_f32(x[e])) continue;
      if (x[e] < lo) lo = x[e], lo_i = lane * E + e;
      if (x[e] > hi) hi = x[e], hi_i = lane * E + e;
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float lo2 = __shfl_xor_sync(kFullMask, lo, o);
      const int lo_i2 = __shfl_xor_sync(kFullMask, lo_i, o);
      const float hi2 = __shfl_xor_sync(kFullMask, hi, o);
      const int hi_i2 = __shfl_xor_sync(kFullMask, hi_i, o);
      if (lo2 < lo || (lo2 == lo && lo_i2 < lo_i)) lo = lo2, lo_i = lo_i2;
      if (hi2 > hi || (hi2 == hi && hi_i2 < hi_i)) hi = hi2, hi_i = hi_i2;
    }
    if (lo_i == INT_MAX) lo = 0.0f, hi = 0.0f;  // no finite value
    const uint32_t s_bits = f32_to_f16_bits_satfinite(__fdiv_rn(__fsub_rn(hi, lo), 15.0f), true);
    const uint32_t z_bits = f32_to_f16_bits_satfinite(lo, true);
    if (lane == 0) *reinterpret_cast<uint32_t*>(meta) = s_bits | (z_bits << 16);
    const float s = f16_bits_to_f32(s_bits);
    const float z = f16_bits_to_f32(z_bits);
    uint32_t c[E];
#pragma unroll
    for (int e = 0; e < E; ++e)
      c[e] = s != 0.0f ? static_cast<uint32_t>(
                             round_half_even_clamped(__fdiv_rn(__fsub_rn(x[e], z), s), 0, 15))
                       : 0u;
    uint32_t w[(E + 7) / 8];
    pack_codes<E, 4>(c, w);
    store_bytes<E / 2>(vals + lane * E / 2, w);
  } else if constexpr (D == KvDtype::kNvfp4) {
    constexpr int kLanesPerBlock = 16 / E;
    const float ts = p.tensor_scale[h];
    const float d = __fmul_rn(6.0f, ts);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float a = fabsf(x[e]);
      if (is_finite_f32(a) && a > amax) amax = a;
    }
#pragma unroll
    for (int o = 1; o < kLanesPerBlock; o <<= 1)
      amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
    const uint32_t sc = enc_e4m3(__fdiv_rn(amax, d));
    const float eff = __fmul_rn(dec_e4m3(sc), ts);
    uint32_t c[E];
#pragma unroll
    for (int e = 0; e < E; ++e) c[e] = eff == 0.0f ? 0u : enc_e2m1(__fdiv_rn(x[e], eff));
    uint32_t w[(E + 7) / 8];
    pack_codes<E, 4>(c, w);
    store_bytes<E / 2>(vals + lane * E / 2, w);
    if (lane % kLanesPerBlock == 0)
      vals[kHd / 2 + lane / kLanesPerBlock] = static_cast<uint8_t>(sc);
  }
}

// Head dims other than 64 / 128 / 256 (up to 256): one thread encodes one row, in the
// reference's element order (src/quant/ref/), so the bytes match it exactly. Slow per row, but
// only small models have such head dims.
constexpr int kSmallMaxHeadDim = 256;
constexpr int kRowThreads = 128;

template <KvDtype D>
__global__ void __launch_bounds__(kRowThreads)
    write_row_kernel(const __grid_constant__ WriteParams ps, int hd) {
  wait_for_previous_kernel();
  allow_next_kernel();
  const WriteSideParams& p = ps.side[blockIdx.y];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x;
  if (row >= p.n * p.num_kv_heads) return;
  const int64_t t = row / p.num_kv_heads;
  const int h = static_cast<int>(row - t * p.num_kv_heads);
  const int64_t slot = p.slots[t];
  if (slot < 0) return;  // padding
  if (slot >= p.num_slots) {
    if (p.bad_token != nullptr) atomicMin(p.bad_token, static_cast<unsigned long long>(t));
    return;
  }
  const int64_t block = slot / p.block_tokens;
  const int64_t off = slot - block * p.block_tokens;
  uint8_t* head = reinterpret_cast<uint8_t*>(p.base) + block * p.block_bytes + h * p.head_stride;
  uint8_t* vals = head + off * p.row_data_bytes;
  uint8_t* meta = head + p.values_bytes + off * p.row_scale_bytes;
  const float* x = p.src + row * hd;

  if constexpr (D == KvDtype::kFloat32) {
    for (int i = 0; i < hd; ++i)
      reinterpret_cast<uint32_t*>(vals)[i] = __float_as_uint(x[i]);  // bits unchanged
  } else if constexpr (D == KvDtype::kFloat16 || D == KvDtype::kBFloat16) {
    for (int i = 0; i < hd; ++i)
      reinterpret_cast<uint16_t*>(vals)[i] =
          static_cast<uint16_t>(D == KvDtype::kFloat16 ? f32_to_f16_bits_satfinite(x[i], false)
                                                       : f32_to_bf16_bits_satfinite(x[i]));
  } else if constexpr (D == KvDtype::kFp8E4M3 || D == KvDtype::kFp8E5M2) {
    const float ts = p.tensor_scale[h];
    for (int i = 0; i < hd; ++i) {
      const float y = __fdiv_rn(x[i], ts);
      vals[i] = static_cast<uint8_t>(D == KvDtype::kFp8E4M3 ? enc_e4m3(y) : enc_e5m2(y));
    }
  } else if constexpr (D == KvDtype::kInt8PerTokenHead || D == KvDtype::kFp8PerTokenHead) {
    float amax = 0.0f;
    for (int i = 0; i < hd; ++i) {
      const float a = fabsf(x[i]);
      if (is_finite_f32(a) && a > amax) amax = a;
    }
    constexpr bool kInt8 = D == KvDtype::kInt8PerTokenHead;
    float s = __fdiv_rn(amax, kInt8 ? 127.0f : 448.0f);
    const float cap = kInt8 ? kInt8MaxScale : kFp8MaxScale;
    if (cap < s) s = cap;  // std::min(s, cap)
    *reinterpret_cast<float*>(meta) = s;
    for (int i = 0; i < hd; ++i) {
      uint32_t c = 0;
      if (s != 0.0f) {
        if constexpr (kInt8)
          c = static_cast<uint32_t>(round_half_even_clamped(__fdiv_rn(x[i], s), -127, 127)) & 0xFFu;
        else
          c = enc_e4m3(__fdiv_rn(x[i], s));
      }
      vals[i] = static_cast<uint8_t>(c);
    }
  } else if constexpr (D == KvDtype::kInt4PerTokenHead) {
    // hadamard_rotate: signs, the transform's stages h = 1, 2, 4, ..., then 1/sqrt(n).
    float r[kSmallMaxHeadDim];
    for (int i = 0; i < hd; ++i) r[i] = hadamard_negative(p.signs, i) ? -x[i] : x[i];
    for (int hh = 1; hh < hd; hh <<= 1)
      for (int i = 0; i < hd; i += 2 * hh)
        for (int j = i; j < i + hh; ++j) {
          const float a = r[j], b = r[j + hh];
          r[j] = __fadd_rn(a, b);
          r[j + hh] = __fsub_rn(a, b);
        }
    const float c = hadamard_inv_sqrt(__ffs(hd) - 1);
    for (int i = 0; i < hd; ++i) r[i] = __fmul_rn(r[i], c);
    bool any = false;
    float lo = 0.0f, hi = 0.0f;
    for (int i = 0; i < hd; ++i) {
      const float v = r[i];
      if (!is_finite_f32(v)) continue;
      if (!any || v < lo) lo = v;
      if (!any || v > hi) hi = v;
      any = true;
    }
    const uint32_t s_bits = f32_to_f16_bits_satfinite(__fdiv_rn(__fsub_rn(hi, lo), 15.0f), true);
    const uint32_t z_bits = f32_to_f16_bits_satfinite(lo, true);
    *reinterpret_cast<uint32_t*>(meta) = s_bits | (z_bits << 16);
    const float s = f16_bits_to_f32(s_bits);
    const float z = f16_bits_to_f32(z_bits);
    for (int i = 0; i < hd; i += 2) {
      uint32_t q0 = 0, q1 = 0;
      if (s != 0.0f) {
        q0 =
            static_cast<uint32_t>(round_half_even_clamped(__fdiv_rn(__fsub_rn(r[i], z), s), 0, 15));
        q1 = static_cast<uint32_t>(
            round_half_even_clamped(__fdiv_rn(__fsub_rn(r[i + 1], z), s), 0, 15));
      }
      vals[i / 2] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  } else if constexpr (D == KvDtype::kNvfp4) {
    const float ts = p.tensor_scale[h];
    const float d = __fmul_rn(6.0f, ts);
    for (int b = 0; b < hd / 16; ++b) {
      const float* blk = x + 16 * b;
      float amax = 0.0f;
      for (int i = 0; i < 16; ++i) {
        const float a = fabsf(blk[i]);
        if (is_finite_f32(a) && a > amax) amax = a;
      }
      const uint32_t sc = enc_e4m3(__fdiv_rn(amax, d));
      vals[hd / 2 + b] = static_cast<uint8_t>(sc);
      const float eff = __fmul_rn(dec_e4m3(sc), ts);
      for (int i = 0; i < 16; i += 2) {
        const uint32_t c0 = eff == 0.0f ? 0u : enc_e2m1(__fdiv_rn(blk[i], eff));
        const uint32_t c1 = eff == 0.0f ? 0u : enc_e2m1(__fdiv_rn(blk[i + 1], eff));
        vals[(16 * b + i) / 2] = static_cast<uint8_t>(c0 | (c1 << 4));
      }
    }
  }
}

// sides: 1 (p.side[0]) or 2 (K and V, same dtype and head_dim).
void launch_write(KvDtype dtype, const WriteParams& p, unsigned sides, int head_dim, int64_t rows,
                  cudaStream_t stream) {
  bool known_dim = true;
  const bool known_dtype = with_kv_dtype(dtype, [&](auto d) {
    known_dim = with_head_dim(head_dim, [&](auto hd) {
      launch_pdl(write_side_kernel<decltype(d)::value, decltype(hd)::value / 32>,
                 dim3(static_cast<unsigned>((rows + kWriteWarps - 1) / kWriteWarps), sides),
                 kWriteWarps * 32, stream, p);
    });
    if (!known_dim && head_dim >= 1 && head_dim <= kSmallMaxHeadDim) {
      launch_pdl(write_row_kernel<decltype(d)::value>,
                 dim3(static_cast<unsigned>((rows + kRowThreads - 1) / kRowThreads), sides),
                 kRowThreads, stream, p, head_dim);
      known_dim = true;
    }
  });
  KVQ_CHECK(known_dtype, "write_kv_cuda: unresolved KV dtype");
  KVQ_CHECK(known_dim,
            "write_kv_cuda: head_dim " + std::to_string(head_dim) + " is outside 1..256");
}

}  // namespace
}  // namespace kvq::cuda

namespace kvq {

void write_kv_cuda(const LayerKvSpec& spec, const LayerCacheView& cache, const int64_t* slots,
                   int64_t n, const float* k, const float* v, CUstream_st* stream,
                   uint64_t* bad_token) {
  using namespace kvq::cuda;
  const int block_tokens = spec.block_tokens;
  KVQ_CHECK(block_tokens > 0, "write_kv_cuda: block_tokens must be positive");
  KVQ_CHECK(n >= 0, "write_kv_cuda: negative token count");
  KVQ_CHECK(spec.num_kv_heads > 0 && spec.num_kv_heads <= kWriteMaxKvHeads,
            "write_kv_cuda: num_kv_heads " + std::to_string(spec.num_kv_heads) + " not in [1, " +
                std::to_string(kWriteMaxKvHeads) + "]");
  for (KvSide s : {KvSide::kK, KvSide::kV}) {
    const KvSideLayout& l = cache.layout(s);
    KVQ_CHECK(l.dtype == spec.dtype(s) && l.num_kv_heads == spec.num_kv_heads &&
                  l.head_dim == spec.head_dim(s) && l.block_tokens == block_tokens,
              "write_kv_cuda: layer " + std::to_string(spec.layer) + " " +
                  std::string(to_string(s)) + " view layout does not match the spec");
    const auto& t = traits(l.dtype);
    KVQ_CHECK(t.concrete, "write_kv_cuda: unresolved KV dtype");
    if (t.uses_tensor_scale)
      for (int h = 0; h < spec.num_kv_heads; ++h) {
        const float ts = spec.scale(s).for_head(h);
        KVQ_CHECK(std::isfinite(ts) && ts > 0.0f,
                  "write_kv_cuda: " + std::string(t.name) +
                      " needs a finite positive tensor scale, got " + std::to_string(ts));
      }
  }
  if (n == 0) return;
  KVQ_CHECK(slots && k && v && cache.k_base && cache.v_base, "write_kv_cuda: null pointer");
  const int64_t rows = n * spec.num_kv_heads;
  const int64_t blocks = (rows + kWriteWarps - 1) / kWriteWarps;
  KVQ_CHECK(blocks <= INT_MAX, "write_kv_cuda: too many tokens in one call");
  const HadamardSigns signs = make_hadamard_signs();
  const auto cs = reinterpret_cast<cudaStream_t>(stream);
  if (bad_token) KVQ_CUDA_CHECK(cudaMemsetAsync(bad_token, 0xFF, sizeof(uint64_t), cs));
  WriteParams wp{};
  for (KvSide s : {KvSide::kK, KvSide::kV}) {
    const KvSideLayout& l = cache.layout(s);
    WriteSideParams& p = wp.side[s == KvSide::kK ? 0 : 1];
    p.base = cache.base(s);
    p.block_bytes = l.block_bytes;
    p.head_stride = l.head_stride;
    p.values_bytes = l.values_bytes;
    p.row_data_bytes = l.row_data_bytes;
    p.row_scale_bytes = l.row_scale_bytes;
    p.src = s == KvSide::kK ? k : v;
    p.slots = slots;
    p.bad_token = reinterpret_cast<unsigned long long*>(bad_token);
    p.n = n;
    p.num_slots = static_cast<int64_t>(cache.num_blocks) * block_tokens;
    p.num_kv_heads = spec.num_kv_heads;
    p.block_tokens = block_tokens;
    p.signs = signs;
    for (int h = 0; h < spec.num_kv_heads; ++h) p.tensor_scale[h] = spec.scale(s).for_head(h);
  }
  const KvSideLayout& kl = cache.layout(KvSide::kK);
  const KvSideLayout& vl = cache.layout(KvSide::kV);
  if (kl.dtype == vl.dtype && kl.head_dim == vl.head_dim) {
    launch_write(kl.dtype, wp, 2, kl.head_dim, rows, cs);
    return;
  }
  launch_write(kl.dtype, wp, 1, kl.head_dim, rows, cs);
  wp.side[0] = wp.side[1];
  launch_write(vl.dtype, wp, 1, vl.head_dim, rows, cs);
}

void check_write_kv_cuda(const LayerCacheView& cache, const int64_t* slots,
                         const uint64_t* bad_token, CUstream_st* stream) {
  KVQ_CHECK(slots && bad_token, "check_write_kv_cuda: null pointer");
  const auto cs = reinterpret_cast<cudaStream_t>(stream);
  uint64_t t = 0;
  KVQ_CUDA_CHECK(cudaMemcpyAsync(&t, bad_token, sizeof t, cudaMemcpyDeviceToHost, cs));
  KVQ_CUDA_CHECK(cudaStreamSynchronize(cs));
  if (t == UINT64_MAX) return;
  int64_t slot = 0;
  KVQ_CUDA_CHECK(cudaMemcpy(&slot, slots + t, sizeof slot, cudaMemcpyDeviceToHost));
  const int64_t num_slots = static_cast<int64_t>(cache.num_blocks) * cache.k_layout.block_tokens;
  KVQ_CHECK(false, "write_kv_cuda: slot " + std::to_string(slot) + " of token " +
                       std::to_string(t) + " out of range (" + std::to_string(num_slots) +
                       " slots); the row was not written");
}

}  // namespace kvq
