// The split-KV decode kernel (one instantiation per (K dtype, V dtype) pair x head_dim;
// included only by the decode_<dtype>.cu / decode_<k>__<v>.cu files). See cuda_decode.h for the
// algorithm and decode_params.h for the register layouts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "attention/cuda/cuda_decode.h"
#include "attention/cuda/decode_params.h"
#include "cache/cuda/cuda_check.h"
#include "cache/cuda/dispatch.h"
#include "kvq/core/error.h"

namespace kvq::cuda {
namespace decode_detail {

constexpr float kLog2e = 1.4426950408889634f;

// D = A * B + D on the tensor cores, m16n8k16, fp32 accumulators. Only the upper 8 rows of A
// (the warp's query heads) are live: rows 8..15 are zero and their outputs are dropped.
template <bool kBf16>
__device__ __forceinline__ void mma(float& d0, float& d1, uint32_t a0, uint32_t a2, uint32_t b0,
                                    uint32_t b1) {
  float d2, d3;
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%10,%11};\n"
        : "+f"(d0), "+f"(d1), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.0f), "f"(0.0f));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%10,%11};\n"
        : "+f"(d0), "+f"(d1), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.0f), "f"(0.0f));
  }
}

// ---- unpacking into 16-bit operand pairs (low half = first element) -------------------------

__device__ __forceinline__ uint32_t hsub2_bits(uint32_t a, float b) {
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a), __float2half2_rn(b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, uint32_t b) {
  const __half2 r =
      __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t f32x2_to_bf16x2(uint32_t lo, uint32_t hi) {
  const __nv_bfloat162 r = __floats2bfloat162_rn(__uint_as_float(lo), __uint_as_float(hi));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t f32x2_to_f16x2(float lo, float hi) {
  const __half2 r = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t f32x2_to_bf16x2f(float lo, float hi) {
  const __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&r);
}

// int8 codes in bytes 0 and 2 of x -> half2 (exact: 1024 + (q + 128) - 1152).
__device__ __forceinline__ uint32_t int8_pair(uint32_t x) {
  return hsub2_bits((x & 0x00FF00FFu) ^ 0x64806480u, 1152.0f);
}
// 4-bit codes in bits 0-3 and 16-19 of t -> half2 of the unsigned codes (exact).
__device__ __forceinline__ uint32_t uint4_pair(uint32_t t) {
  return hsub2_bits((t & 0x000F000Fu) | 0x64006400u, 1024.0f);
}
// E2M1 codes in bits 0-3 and 16-19 of t -> half2 of their values (exact): the code's bits
// land in the half's exponent/mantissa as value * 2^-14, then one exact scaling by 2^14.
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t t) {
  const uint32_t bits = ((t << 9) & 0x0E000E00u) | ((t << 12) & 0x80008000u);
  return hmul2_bits(bits, 0x74007400u);  // 0x7400 = 16384.0 in half
}
template <KvDtype D, int HD>
struct Shape {
  static constexpr int kBits = kv_value_bits(D);
  static constexpr bool kBf16 = kv_bf16_operands(D);
  static constexpr int kCodeBytes = kv_code_bytes(D, HD);
  static constexpr int kKChunk = k_chunk_bytes(D, HD);
  static constexpr int kKChunks = kCodeBytes / 4 / kKChunk;  // per lane and token
  static constexpr int kKWords = kCodeBytes / 16;            // per lane and token
  static constexpr int kKEpb = kKChunk * 8 / kBits;          // values per chunk
  static constexpr int kVPart = v_part_bytes(D, HD);
  static constexpr int kVLoad = v_load_bytes(D, HD);
  static constexpr int kVWords = kVPart / 4;
  static constexpr int kKSteps = HD / 16;
  static constexpr int kNTiles = HD / 8;
  static constexpr bool kRowScale = D == KvDtype::kInt8PerTokenHead ||
                                    D == KvDtype::kFp8PerTokenHead ||
                                    D == KvDtype::kInt4PerTokenHead;
  static constexpr bool kInt4 = D == KvDtype::kInt4PerTokenHead;
  static constexpr bool kNvfp4 = D == KvDtype::kNvfp4;
  static constexpr bool kTensorScale =
      D == KvDtype::kFp8E4M3 || D == KvDtype::kFp8E5M2 || D == KvDtype::kNvfp4;
  static_assert(kKWords >= 1 && kVWords >= 1 && kKChunk >= 4 && kVLoad >= 4);
};

// What depends on both sides: the K side (SK) feeds S = Q K^T, the V side (SV) feeds O += P V.
template <KvDtype DK, KvDtype DV, int HD>
struct PairShape {
  using SK = Shape<DK, HD>;
  using SV = Shape<DV, HD>;
  // Keep the next tile's raw bytes in flight while computing this one, when they are few.
  // Only where the second tile fits the register budget of kMinBlocks (no spills).
  // (Tried for 8-bit rows at head_dim 128 too: 196 registers, 2 blocks/SM instead of 3, and
  // 5-15% slower at large batches; see docs/notes/decode-tuning.md, version 1.)
  static constexpr bool kPrefetch = SK::kCodeBytes + SV::kCodeBytes <= 128;
  static constexpr bool kQInRegs = HD <= 128;
  // head_dim 256: V is loaded after S = Q K^T, so K and V bytes are never live together.
  static constexpr bool kLateV = HD > 128;
};

// Raw bytes of one 16-token tile, as this lane loads them.
template <KvDtype DK, KvDtype DV, int HD>
struct TileRaw {
  using SK = Shape<DK, HD>;
  using SV = Shape<DV, HD>;
  uint32_t k[2][SK::kKWords];    // tokens g and 8 + g
  uint32_t v[4][SV::kVWords];    // tokens 2c, 2c + 1, 2c + 8, 2c + 9
  uint32_t ks[4];                // per-token K metadata of tokens 2c, 2c + 1, 2c + 8, 2c + 9
  uint32_t vs[4];                // per-token V metadata, same tokens
  uint32_t kb[2][SK::kKChunks];  // nvfp4: K block-scale bytes per chunk
  uint32_t vb[4];                // nvfp4: V block-scale bytes
};

template <int W>
__device__ __forceinline__ void load_words(const uint8_t* p, uint32_t* dst) {
  if constexpr (W == 16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
  } else if constexpr (W == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    dst[0] = v.x, dst[1] = v.y;
  } else {
    static_assert(W == 4);
    dst[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  }
}

struct TileCtx {
  const uint8_t* k_head;  // this kv head's K in block 0 (add block * block_bytes)
  const uint8_t* v_head;
  const int32_t* blocks;  // this sequence's block ids
  int lo, hi;             // visible positions
  int g, c;
};

// Loads parts of a tile: K codes and metadata (kParts & 1), V codes and nvfp4 block scales
// (kParts & 2), V per-token metadata (kParts & 4).
template <KvDtype DK, KvDtype DV, int HD, int kParts = 7>
__device__ __forceinline__ void load_tile(TileRaw<DK, DV, HD>& r, const DecodeKernelParams& p,
                                          const TileCtx& x, int tile) {
  using SK = Shape<DK, HD>;
  using SV = Shape<DV, HD>;
  const int t0 = tile * kDecodeTileTokens;
  const int32_t block = x.blocks[t0 / p.block_tokens];
  const int off = t0 % p.block_tokens;
  const uint8_t* kh = x.k_head + static_cast<uint64_t>(block) * p.k.block_bytes;
  const uint8_t* vh = x.v_head + static_cast<uint64_t>(block) * p.v.block_bytes;
  if constexpr ((kParts & 1) != 0) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int tt = 8 * n + x.g;
      const bool vis = t0 + tt >= x.lo && t0 + tt < x.hi;
      const uint8_t* row = kh + static_cast<uint64_t>(off + tt) * p.k.row_bytes;
#pragma unroll
      for (int j = 0; j < SK::kKChunks; ++j) {
        uint32_t* dst = &r.k[n][j * (SK::kKChunk / 4)];
        if (vis) {
          load_words<SK::kKChunk>(row + (x.c + 4 * j) * SK::kKChunk, dst);
        } else {
#pragma unroll
          for (int w = 0; w < SK::kKChunk / 4; ++w) dst[w] = 0;
        }
        if constexpr (SK::kNvfp4) {
          const uint8_t* sc = row + HD / 2 + ((x.c + 4 * j) * SK::kKEpb) / 16;
          if constexpr (SK::kKEpb >= 32)
            r.kb[n][j] = vis ? __ldg(reinterpret_cast<const unsigned short*>(sc)) : 0u;
          else
            r.kb[n][j] = vis ? __ldg(sc) : 0u;
        }
      }
    }
  }
  if constexpr ((kParts & 2) != 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tt = 2 * x.c + (i & 1) + 8 * (i >> 1);
      const bool vis = t0 + tt >= x.lo && t0 + tt < x.hi;
      const uint8_t* row = vh + static_cast<uint64_t>(off + tt) * p.v.row_bytes;
#pragma unroll
      for (int l = 0; l < SV::kVPart / SV::kVLoad; ++l) {
        uint32_t* dst = &r.v[i][l * (SV::kVLoad / 4)];
        if (vis) {
          load_words<SV::kVLoad>(row + x.g * SV::kVPart + l * SV::kVLoad, dst);
        } else {
#pragma unroll
          for (int w = 0; w < SV::kVLoad / 4; ++w) dst[w] = 0;
        }
      }
      if constexpr (SV::kNvfp4) {
        const uint8_t* sc = row + HD / 2 + (x.g * (HD / 8)) / 16;
        if constexpr (HD / 8 >= 32)
          r.vb[i] = vis ? __ldg(reinterpret_cast<const unsigned short*>(sc)) : 0u;
        else
          r.vb[i] = vis ? __ldg(sc) : 0u;
      }
    }
  }
  if constexpr (SK::kRowScale || SV::kRowScale) {
    // Metadata of tokens (2c, 2c + 1) and (2c + 8, 2c + 9): one 8-byte load each.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tt = 2 * x.c + 8 * h;
      const bool v0 = t0 + tt >= x.lo && t0 + tt < x.hi;
      const bool v1 = t0 + tt + 1 >= x.lo && t0 + tt + 1 < x.hi;
      if constexpr (SK::kRowScale && (kParts & 1) != 0) {
        const uint2 ka = __ldg(reinterpret_cast<const uint2*>(kh + p.k.values_bytes +
                                                              static_cast<uint64_t>(off + tt) * 4));
        r.ks[2 * h] = v0 ? ka.x : 0u;
        r.ks[2 * h + 1] = v1 ? ka.y : 0u;
      }
      if constexpr (SV::kRowScale && (kParts & 4) != 0) {
        const uint2 va = __ldg(reinterpret_cast<const uint2*>(vh + p.v.values_bytes +
                                                              static_cast<uint64_t>(off + tt) * 4));
        r.vs[2 * h] = v0 ? va.x : 0u;
        r.vs[2 * h + 1] = v1 ? va.y : 0u;
      }
    }
  }
}

// One fp8 code pair (a 16-bit half) -> half2 (exact).
template <bool kE5M2>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t w, int high_half) {
  const uint32_t h16 = high_half ? (w >> 16) : (w & 0xFFFFu);
  uint32_t r;
  if constexpr (kE5M2)
    asm("{.reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e5m2x2 %0, t;}\n" : "=r"(r) : "r"(h16));
  else
    asm("{.reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;}\n" : "=r"(r) : "r"(h16));
  return r;
}

// K operand pair i of one token (pair 2s -> B reg 0 of k-step s, pair 2s + 1 -> B reg 1).
// Called with constant i inside unrolled loops, so each conversion sits next to its MMA.
template <KvDtype D, int HD>
__device__ __forceinline__ uint32_t k_pair(const uint32_t* w, const uint32_t* kb, int i) {
  using S = Shape<D, HD>;
  if constexpr (S::kBits == 16) {
    return w[i];
  } else if constexpr (S::kBits == 32) {
    return f32x2_to_bf16x2(w[2 * i], w[2 * i + 1]);
  } else if constexpr (D == KvDtype::kInt8PerTokenHead) {
    return int8_pair(__byte_perm(w[i / 2], 0u, (i & 1) ? 0x0302 : 0x0100));
  } else if constexpr (S::kBits == 8) {
    return fp8x2_to_f16x2<D == KvDtype::kFp8E5M2>(w[i / 2], i & 1);
  } else if constexpr (S::kInt4) {
    return uint4_pair(w[i / 4] >> (4 * (i % 4)));
  } else {
    static_assert(S::kNvfp4);
    constexpr int kWordsPerChunk = S::kKChunk / 4;
    const int wi = i / 4;
    const int j = wi / kWordsPerChunk, wc = wi % kWordsPerChunk;
    const uint32_t code = (kb[j] >> (8 * (wc / 2))) & 0xFFu;
    const uint32_t scale2 = fp8x2_to_f16x2<false>(code | (code << 8), 0);
    return hmul2_bits(e2m1_pair(w[wi] >> (4 * (i % 4))), scale2);
  }
}

// V operand pair of two tokens a, b for n-tile j: (a's dim j of this lane's part, b's).
template <KvDtype D, int HD>
__device__ __forceinline__ uint32_t v_pair(const uint32_t* a, const uint32_t* b, uint32_t ab,
                                           uint32_t bb, int j) {
  using S = Shape<D, HD>;
  if constexpr (S::kBits == 16) {
    return __byte_perm(a[j / 2], b[j / 2], (j & 1) ? 0x7632 : 0x5410);
  } else if constexpr (S::kBits == 32) {
    return f32x2_to_bf16x2(a[j], b[j]);
  } else if constexpr (D == KvDtype::kInt8PerTokenHead) {
    const int k = j % 4;
    return int8_pair(__byte_perm(a[j / 4], b[j / 4], static_cast<unsigned>(k | ((4 + k) << 8))));
  } else if constexpr (S::kBits == 8) {
    const int k = j % 4;
    return fp8x2_to_f16x2<D == KvDtype::kFp8E5M2>(
        __byte_perm(a[j / 4], b[j / 4], static_cast<unsigned>(k | ((4 + k) << 4))), 0);
  } else {
    static_assert(S::kBits == 4);
    const int wi = j / 8, h = (j % 8) / 4, k = j % 4;
    const uint32_t y = __byte_perm(a[wi], b[wi], h ? 0x7632 : 0x5410);
    if constexpr (S::kNvfp4) {
      const uint32_t ca = (ab >> (8 * (wi / 2))) & 0xFFu, cb = (bb >> (8 * (wi / 2))) & 0xFFu;
      const uint32_t scale2 = fp8x2_to_f16x2<false>(ca | (cb << 8), 0);
      return hmul2_bits(e2m1_pair(y >> (4 * k)), scale2);
    } else {
      return uint4_pair(y >> (4 * k));
    }
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
  return fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(kFullMask, v, 1);
  return v + __shfl_xor_sync(kFullMask, v, 2);
}

// Blocks (of 4 warps) per SM the register budget is set for: more resident warps hide more
// load latency. 16/32-bit dtypes and head_dim 256 keep the compiler's natural allocation
// (capping them spills).
template <KvDtype DK, KvDtype DV, int HD>
constexpr int kMinBlocks = cmax(kv_value_bits(DK), kv_value_bits(DV)) > 8
                               ? 1
                               : (HD == 64 ? 4 : (HD == 128 ? 3 : 1));

template <KvDtype DK, KvDtype DV, int HD>
__global__ void __launch_bounds__(kDecodeWarps * 32, kMinBlocks<DK, DV, HD>)
    decode_main_kernel(const __grid_constant__ DecodeKernelParams p) {
  using P = PairShape<DK, DV, HD>;
  using SK = Shape<DK, HD>;  // S = Q K^T: operand type, K scales, K zero points
  using SV = Shape<DV, HD>;  // O += P V: operand type of P, V scales, V zero points
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  // A 1-D grid of warps over (sequence, kv head, work item): a block may hold the items of
  // several (sequence, kv head) pairs, so the launch has no partly idle blocks and the
  // number of resident rounds follows the number of items, not of (sequence, head) pairs.
  const int items_per = p.max_splits * p.head_chunks;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kDecodeWarps + warp;
  const int64_t group = w / items_per;  // seq * num_kv_heads + kvh
  if (group >= static_cast<int64_t>(p.num_seqs) * p.num_kv_heads) return;
  const int item = static_cast<int>(w - group * items_per);
  const int seq = static_cast<int>(group / p.num_kv_heads);
  const int kvh = static_cast<int>(group - static_cast<int64_t>(seq) * p.num_kv_heads);
  const int split = item / p.head_chunks;
  const int hc = item - split * p.head_chunks;

  const int kv_len = p.seq_lens[seq];
  TileCtx x;
  decode_visible_range(kv_len, p.attention_kind, p.window, x.lo, x.hi);
  int first_tile = 0, chunk = 0;
  const int tiles = decode_visible_tiles(kv_len, p.attention_kind, p.window, first_tile);
  const int nsplit = decode_num_splits(tiles, p.chunk_tiles, p.max_splits, chunk);
  if (split >= nsplit) return;  // whole warp: no block-level synchronization in this kernel
  const int tb = first_tile + split * chunk;
  const int te = min(first_tile + tiles, tb + chunk);

  x.g = lane >> 2;
  x.c = lane & 3;
  x.blocks = p.indices + p.indptr[seq];
  x.k_head = p.k.base + static_cast<uint64_t>(kvh) * p.k.head_stride;
  x.v_head = p.v.base + static_cast<uint64_t>(kvh) * p.v.head_stride;

  // Q's fragments come from the prep kernel, which may still be finishing.
  wait_for_previous_kernel();
  const size_t qbase =
      (static_cast<size_t>(seq) * p.num_kv_heads + kvh) * p.head_chunks + static_cast<size_t>(hc);
  // Q's A-operand registers; for head_dim 256 they are re-read from L1 each tile instead of
  // pinning 32 registers (the accumulators already take 64).
  const uint2* qf = p.qfrag + qbase * SK::kKSteps * 32 + lane;
  constexpr int kQRegs = P::kQInRegs ? SK::kKSteps : 1;
  uint32_t qa0[kQRegs], qa2[kQRegs];
  if constexpr (P::kQInRegs) {
#pragma unroll
    for (int s = 0; s < SK::kKSteps; ++s) {
      const uint2 v = qf[s * 32];
      qa0[s] = v.x;
      qa2[s] = v.y;
    }
  }
  const float2 qm = p.qmeta[qbase * 8 + x.g];
  const float qfactor = qm.x, qsum = qm.y;
  const bool capped = p.soft_cap != 0.0f;
  const float cap = p.soft_cap, inv_cap = capped ? 1.0f / p.soft_cap : 0.0f;

  float o[SV::kNTiles][2];
#pragma unroll
  for (int j = 0; j < SV::kNTiles; ++j) o[j][0] = o[j][1] = 0.0f;
  float m = -__uint_as_float(kF32Inf);  // running max, log2 units
  float l = 0.0f;                       // this lane's share of the running sum
  float s_run = 0.0f;                   // running max of the per-token V scales
  float zacc = 0.0f;                    // int4: this lane's share of sum(p * zero point)

  auto process = [&](TileRaw<DK, DV, HD>& cur, int tile) {
    const int t0 = tile * kDecodeTileTokens;
    // ---- S = Q K^T for tokens 0-7 (n = 0) and 8-15 (n = 1) of the tile ----
    float sc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
    for (int s = 0; s < SK::kKSteps; ++s) {
      uint32_t q0, q2;
      if constexpr (P::kQInRegs) {
        q0 = qa0[s];
        q2 = qa2[s];
      } else {
        const uint2 v = __ldg(qf + s * 32);
        q0 = v.x;
        q2 = v.y;
      }
      mma<SK::kBf16>(sc[0][0], sc[0][1], q0, q2, k_pair<DK, HD>(cur.k[0], cur.kb[0], 2 * s),
                     k_pair<DK, HD>(cur.k[0], cur.kb[0], 2 * s + 1));
      mma<SK::kBf16>(sc[1][0], sc[1][1], q0, q2, k_pair<DK, HD>(cur.k[1], cur.kb[1], 2 * s),
                     k_pair<DK, HD>(cur.k[1], cur.kb[1], 2 * s + 1));
    }

    // ---- logits of tokens 2c, 2c + 1, 2c + 8, 2c + 9 (the lane's C-fragment entries) ----
    float xs[4], pr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float r = sc[i >> 1][i & 1];
      if constexpr (SK::kInt4) {
        const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&cur.ks[i]));
        r = fmaf(r, sz.x, sz.y * qsum);
      } else if constexpr (SK::kRowScale) {
        r *= __uint_as_float(cur.ks[i]);
      }
      r *= qfactor;
      if (capped) r = cap * tanhf(r * inv_cap);
      const int tt = t0 + 2 * x.c + (i & 1) + 8 * (i >> 1);
      xs[i] = tt >= x.lo && tt < x.hi ? r * kLog2e : -__uint_as_float(kF32Inf);
    }
    const float tmax = quad_max(fmaxf(fmaxf(xs[0], xs[1]), fmaxf(xs[2], xs[3])));
    const float m_new = fmaxf(m, tmax);
    const float m_use = m_new == -__uint_as_float(kF32Inf) ? 0.0f : m_new;
    float corr = exp2f(m - m_use);
#pragma unroll
    for (int i = 0; i < 4; ++i) pr[i] = exp2f(xs[i] - m_use);
    l = l * corr + ((pr[0] + pr[1]) + (pr[2] + pr[3]));
    m = m_new;
    if constexpr (SV::kRowScale) {
      float sv[4], zv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (SV::kInt4) {
          const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&cur.vs[i]));
          sv[i] = sz.x;
          zv[i] = sz.y;
        } else {
          sv[i] = __uint_as_float(cur.vs[i]);
          zv[i] = 0.0f;
        }
      }
      const float smax = quad_max(fmaxf(fmaxf(sv[0], sv[1]), fmaxf(sv[2], sv[3])));
      const float s_new = fmaxf(s_run, smax);
      const float inv_s = s_new > 0.0f ? 1.0f / s_new : 0.0f;
      if constexpr (SV::kInt4)
        zacc = zacc * corr + ((pr[0] * zv[0] + pr[1] * zv[1]) + (pr[2] * zv[2] + pr[3] * zv[3]));
      corr *= s_new > 0.0f ? s_run * inv_s : 1.0f;
      s_run = s_new;
#pragma unroll
      for (int i = 0; i < 4; ++i) pr[i] *= sv[i] * inv_s;
    }

    // ---- O = O * corr + P V ----
    // head_dim 256: V codes only now, so K and V codes are never live together.
    if constexpr (P::kLateV) load_tile<DK, DV, HD, 2>(cur, p, x, tile);
    uint32_t pa0, pa2;
    if constexpr (SV::kBf16) {
      pa0 = f32x2_to_bf16x2f(pr[0], pr[1]);
      pa2 = f32x2_to_bf16x2f(pr[2], pr[3]);
    } else {
      pa0 = f32x2_to_f16x2(pr[0], pr[1]);
      pa2 = f32x2_to_f16x2(pr[2], pr[3]);
    }
#pragma unroll
    for (int j = 0; j < SV::kNTiles; ++j) {
      o[j][0] *= corr;
      o[j][1] *= corr;
      mma<SV::kBf16>(o[j][0], o[j][1], pa0, pa2,
                     v_pair<DV, HD>(cur.v[0], cur.v[1], cur.vb[0], cur.vb[1], j),
                     v_pair<DV, HD>(cur.v[2], cur.v[3], cur.vb[2], cur.vb[3], j));
    }
  };

  TileRaw<DK, DV, HD> cur;
  if constexpr (P::kLateV) {
#pragma unroll 1
    for (int tile = tb; tile < te; ++tile) {
      load_tile<DK, DV, HD, 5>(cur, p, x, tile);
      process(cur, tile);
    }
  } else if constexpr (P::kPrefetch) {
    load_tile<DK, DV, HD>(cur, p, x, tb);
#pragma unroll 1
    for (int tile = tb; tile < te; ++tile) {
      TileRaw<DK, DV, HD> nxt;
      if (tile + 1 < te) load_tile<DK, DV, HD>(nxt, p, x, tile + 1);
      process(cur, tile);
      cur = nxt;
    }
  } else {
    load_tile<DK, DV, HD>(cur, p, x, tb);
#pragma unroll 1
    for (int tile = tb; tile < te; ++tile) {
      process(cur, tile);
      if (tile + 1 < te) load_tile<DK, DV, HD>(cur, p, x, tile + 1);
    }
  }

  allow_next_kernel();  // the merge may get scheduled; it waits for this grid's writes

  // ---- the warp's partial: o normalized by its own sum, with (max, sum) to merge ----
  const float l_tot = quad_sum(l);
  float scale_o = 1.0f;
  if constexpr (SV::kRowScale) scale_o = s_run;
  if constexpr (SV::kTensorScale) scale_o = p.v.tensor_scale[kvh];
  const float inv_l = 1.0f / l_tot;
  const float zterm = SV::kInt4 ? quad_sum(zacc) : 0.0f;
  const int rows = min(kDecodeHeadsPerWarp, p.ratio - hc * kDecodeHeadsPerWarp);
  // A sequence with a single split is final here (when V is not rotated): write the output.
  const bool direct = p.out != nullptr && nsplit == 1;
  if (x.g < rows) {
    const size_t row = (((static_cast<size_t>(seq) * p.max_splits + split) * p.num_kv_heads + kvh) *
                            p.head_chunks +
                        hc) *
                           kDecodeHeadsPerWarp +
                       x.g;
    float* dst = direct ? p.out + (static_cast<size_t>(seq) * p.num_q_heads + kvh * p.ratio +
                                   hc * kDecodeHeadsPerWarp + x.g) *
                                      HD
                        : p.part_o + row * HD;
#pragma unroll
    for (int j = 0; j < SV::kNTiles; ++j) {
      dst[(2 * x.c) * (HD / 8) + j] = (o[j][0] * scale_o + zterm) * inv_l;
      dst[(2 * x.c + 1) * (HD / 8) + j] = (o[j][1] * scale_o + zterm) * inv_l;
    }
    if (x.c == 0 && !direct) p.part_ml[row] = make_float2(m, l_tot);
  }
}

}  // namespace decode_detail

template <KvDtype DK, KvDtype DV>
DecodeMainKernel decode_main_kernel_for(int head_dim) {
  DecodeMainKernel k = nullptr;
  with_head_dim(head_dim, [&](auto hd) {
    k = decode_detail::decode_main_kernel<DK, DV, decltype(hd)::value>;
  });
  return k;
}

}  // namespace kvq::cuda
