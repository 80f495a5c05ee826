// The split-KV decode kernel (one instantiation per (K dtype, V dtype) pair x head_dim;
// included only by the decode_<dtype>.cu / decode_<k>__<v>.cu files). See cuda_decode.h for the
// algorithm and decode_params.h for the register layouts.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <string>
#include <type_traits>

#include "attention/cuda/cuda_decode.h"
#include "attention/cuda/decode_params.h"
#include "attention/cuda/operand_pairs.cuh"
#include "cache/cuda/cuda_check.h"
#include "cache/cuda/dispatch.h"
#include "cache/cuda/mbarrier.cuh"
#include "kvq/core/error.h"

// Kernel-lab switches (docs/notes/decode-tuning.md version 23). KVQ_ONEQ_BLOCKS: the blocks
// per SM one-query warps at head_dim 128 budget registers for (3: version 22's).
// KVQ_DECODE_TRANSPOSED=0 (with KVQ_ONEQ_BLOCKS=3): one-query warps keep the 8-row product
// (rows 8..15 of the MMAs zero).
#ifndef KVQ_ONEQ_BLOCKS
#define KVQ_ONEQ_BLOCKS 4
#endif
#ifndef KVQ_DECODE_TRANSPOSED
#define KVQ_DECODE_TRANSPOSED 1
#endif

namespace kvq::cuda {
namespace decode_detail {

using namespace operand_pairs;  // the code -> operand pair decoders, warp reductions

constexpr bool kDecodeTransposed = KVQ_DECODE_TRANSPOSED != 0;
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

// The unpacking of codes into 16-bit operand pairs (low half = first element) is in
// operand_pairs.cuh, shared with the prefill kernels.

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
  // Operands of int8 / int4 per-token-head sides carry a constant bias (the codes' fp16
  // exponent trick without its subtraction): a logit is corrected by kBias x the sum of its
  // Q operands, a row of O by kBias x the sum of its P operands (version 22 of
  // docs/notes/decode-tuning.md).
  static constexpr float kBias = D == KvDtype::kInt8PerTokenHead ? 1152.0f : kInt4 ? 1024.0f : 0.0f;
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
  // Only where the second tile fits the register budget of kMinBlocks (no spills); the
  // kernel adds 16-row warps of 8-bit tiles.
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
// (kParts & 2), V per-token metadata (kParts & 4). kFull: the caller knows every token of the
// tile is inside [x.lo, x.hi), so no load is predicated and nothing is zero-filled.
template <KvDtype DK, KvDtype DV, int HD, int kParts = 7, bool kFull = false, bool kTokG = false>
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
      const bool vis = kFull || (t0 + tt >= x.lo && t0 + tt < x.hi);
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
      const bool vis = kFull || (t0 + tt >= x.lo && t0 + tt < x.hi);
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
  if constexpr (kTokG && (SK::kRowScale || SV::kRowScale)) {
    // The transposed one-query product: metadata of tokens g and g + 8 (ks / vs [0], [1]).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tt = x.g + 8 * h;
      const bool vis = kFull || (t0 + tt >= x.lo && t0 + tt < x.hi);
      if constexpr (SK::kRowScale && (kParts & 1) != 0) {
        const uint32_t ka = __ldg(reinterpret_cast<const unsigned int*>(
            kh + p.k.values_bytes + static_cast<uint64_t>(off + tt) * 4));
        r.ks[h] = vis ? ka : 0u;
      }
      if constexpr (SV::kRowScale && (kParts & 4) != 0) {
        const uint32_t va = __ldg(reinterpret_cast<const unsigned int*>(
            vh + p.v.values_bytes + static_cast<uint64_t>(off + tt) * 4));
        r.vs[h] = vis ? va : 0u;
      }
    }
  } else if constexpr (SK::kRowScale || SV::kRowScale) {
    // Metadata of tokens (2c, 2c + 1) and (2c + 8, 2c + 9): one 8-byte load each.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tt = 2 * x.c + 8 * h;
      const bool v0 = kFull || (t0 + tt >= x.lo && t0 + tt < x.hi);
      const bool v1 = kFull || (t0 + tt + 1 >= x.lo && t0 + tt + 1 < x.hi);
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

// ---- the one-query ring (docs/notes/decode-tuning.md version 24) ----------------------------
// Each warp of a one-query kernel of a 4-bit pair (decode_ring_pair) streams its tiles through
// a ring of kStages stages in static shared memory: lane 0 issues a tile's bulk copies (its K
// codes, K per-token metadata, V codes, V metadata: each contiguous in a cache block) kStages
// tiles ahead, completing on the stage's mbarrier, and the lanes read their registers back in
// load_tile's layout, K before the logits and V after them. The tiles in flight cost no
// registers and no per-lane address arithmetic.
template <KvDtype DK, KvDtype DV, int HD>
struct Ring {
  using SK = Shape<DK, HD>;
  using SV = Shape<DV, HD>;
  static constexpr int kKRow = kv_row_bytes(DK, HD), kVRow = kv_row_bytes(DV, HD);
  static constexpr int kKCodes = kDecodeTileTokens * kKRow;  // multiples of 16
  static constexpr int kVCodes = kDecodeTileTokens * kVRow;
  static constexpr int kKMeta = SK::kRowScale ? kDecodeTileTokens * 4 : 0;
  static constexpr int kVMeta = SV::kRowScale ? kDecodeTileTokens * 4 : 0;
  static constexpr int kKStage = kKCodes + kKMeta;
  static constexpr int kStage = kKStage + kVCodes + kVMeta;
  // Static shared memory of a block stays under 48 KB (4 warps): 4 stages for 4-bit sides
  // (8-bit ones would get 2; with them the ring measured 1-3% slower than the registers).
  static constexpr int kStages = cmin(4, (45 * 1024) / (kDecodeWarps * kStage));
  static constexpr bool kOn = decode_ring_pair(DK, DV, HD) && kStages >= 2;
  // Tiles a trip (process_t's NT): two only where two trips' stages fit the ring.
  static constexpr int kTrip = kStages >= 4 ? decode_ring_trip(DK, DV) : 1;
  static_assert(kKCodes % 16 == 0 && kVCodes % 16 == 0 && kKStage % 16 == 0);
};

template <int W>
__device__ __forceinline__ void lds_words(uint32_t a, uint32_t* dst) {
  if constexpr (W == 16) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3])
                 : "r"(a));
  } else if constexpr (W == 8) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(dst[0]), "=r"(dst[1]) : "r"(a));
  } else {
    static_assert(W == 4);
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(dst[0]) : "r"(a));
  }
}
template <int W>
__device__ __forceinline__ uint32_t lds_small(uint32_t a) {
  uint32_t v;
  if constexpr (W == 2)
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=r"(v) : "r"(a));
  else
    asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(a));
  return v;
}

// load_tile<..., kTokG = true> for a tile in ring stage `st` (a shared-window address): the
// same registers, zeros for the tokens outside [x.lo, x.hi) unless kFull.
// kParts: 1 K codes and metadata, 2 V codes and metadata.
template <KvDtype DK, KvDtype DV, int HD, bool kFull, int kParts>
__device__ __forceinline__ void load_tile_ring(TileRaw<DK, DV, HD>& r, uint32_t st,
                                               const TileCtx& x, int t0) {
  using SK = Shape<DK, HD>;
  using SV = Shape<DV, HD>;
  using RG = Ring<DK, DV, HD>;
#pragma unroll
  for (int n = 0; n < ((kParts & 1) != 0 ? 2 : 0); ++n) {
    const int tt = 8 * n + x.g;
    const bool vis = kFull || (t0 + tt >= x.lo && t0 + tt < x.hi);
    const uint32_t row = st + tt * RG::kKRow;
#pragma unroll
    for (int j = 0; j < SK::kKChunks; ++j) {
      uint32_t* dst = &r.k[n][j * (SK::kKChunk / 4)];
      if (vis) {
        lds_words<SK::kKChunk>(row + (x.c + 4 * j) * SK::kKChunk, dst);
      } else {
#pragma unroll
        for (int w = 0; w < SK::kKChunk / 4; ++w) dst[w] = 0;
      }
      if constexpr (SK::kNvfp4) {
        const uint32_t sc = row + HD / 2 + ((x.c + 4 * j) * SK::kKEpb) / 16;
        r.kb[n][j] = vis ? lds_small<(SK::kKEpb >= 32 ? 2 : 1)>(sc) : 0u;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < ((kParts & 2) != 0 ? 4 : 0); ++i) {
    const int tt = 2 * x.c + (i & 1) + 8 * (i >> 1);
    const bool vis = kFull || (t0 + tt >= x.lo && t0 + tt < x.hi);
    const uint32_t row = st + RG::kKStage + tt * RG::kVRow;
#pragma unroll
    for (int l = 0; l < SV::kVPart / SV::kVLoad; ++l) {
      uint32_t* dst = &r.v[i][l * (SV::kVLoad / 4)];
      if (vis) {
        lds_words<SV::kVLoad>(row + x.g * SV::kVPart + l * SV::kVLoad, dst);
      } else {
#pragma unroll
        for (int w = 0; w < SV::kVLoad / 4; ++w) dst[w] = 0;
      }
    }
    if constexpr (SV::kNvfp4) {
      const uint32_t sc = row + HD / 2 + (x.g * (HD / 8)) / 16;
      r.vb[i] = vis ? lds_small<(HD / 8 >= 32 ? 2 : 1)>(sc) : 0u;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int tt = x.g + 8 * h;
    const bool vis = kFull || (t0 + tt >= x.lo && t0 + tt < x.hi);
    if constexpr (SK::kRowScale && (kParts & 1) != 0) {
      uint32_t ka;
      lds_words<4>(st + RG::kKCodes + tt * 4, &ka);
      r.ks[h] = vis ? ka : 0u;
    }
    if constexpr (SV::kRowScale && (kParts & 2) != 0) {
      uint32_t va;
      lds_words<4>(st + RG::kKStage + RG::kVCodes + tt * 4, &va);
      r.vs[h] = vis ? va : 0u;
    }
  }
}

// K operand pair i of one token (pair 2s -> B reg 0 of k-step s, pair 2s + 1 -> B reg 1).
// Called with constant i inside unrolled loops, so each conversion sits next to its MMA.
// kX16 (int4_per_token_head): odd pairs as code x 16 + 1024 (as v_pair's kX16); the caller
// scales the Q operands of the even pairs by 16 to match; `magic`: 0x64006400 in a register
// (int4_magic), so each pair is one LOP3.
template <KvDtype D, int HD, bool kX16 = false>
__device__ __forceinline__ uint32_t k_pair(const uint32_t* w, const uint32_t* kb, int i,
                                           uint32_t magic = 0x64006400u) {
  using S = Shape<D, HD>;
  if constexpr (S::kBits == 16) {
    return w[i];
  } else if constexpr (S::kBits == 32) {
    return f32x2_to_bf16x2(w[2 * i], w[2 * i + 1]);
  } else if constexpr (D == KvDtype::kInt8PerTokenHead) {
    // q + 128 for the word's four codes at once, then each pair's two bytes placed under
    // 0x64 exponent bytes by one byte permute: 1024 + q + 128, as int8_pair_biased gives.
    const uint32_t t = w[i / 2] ^ 0x80808080u;
    return __byte_perm(t, 0x64646464u, (i & 1) ? 0x4342 : 0x4140);
  } else if constexpr (S::kBits == 8) {
    return fp8x2_to_f16x2<D == KvDtype::kFp8E5M2>(w[i / 2], i & 1);
  } else if constexpr (S::kInt4 && kX16) {
    const uint32_t t = (i & 2) ? (w[i / 4] >> 8) : w[i / 4];
    return (i & 1) ? and_or<0x00F000F0u>(t, magic) : and_or<0x000F000Fu>(t, magic);
  } else if constexpr (S::kInt4) {
    const uint32_t t = w[i / 4] >> (4 * (i % 4));
    return uint4_pair_biased(t);
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
// kX16 (int4_per_token_head): the pairs of odd j come as 16 (code + 64) = code x 16 + 1024,
// their nibbles masked in place (one shift per four pairs instead of three); the caller
// divides those dims of O by 16. kX16 with int8_per_token_head: the pair in one LOP3.
// `magic` (with kX16): the exponent bits in a register, 0x64006400 for int4 (int4_magic),
// 0x64806480 for int8 (the transposed kernel's vmagic).
template <KvDtype D, int HD, bool kX16 = false>
__device__ __forceinline__ uint32_t v_pair(const uint32_t* a, const uint32_t* b, uint32_t ab,
                                           uint32_t bb, int j, uint32_t magic = 0x64006400u) {
  using S = Shape<D, HD>;
  if constexpr (S::kBits == 16) {
    return __byte_perm(a[j / 2], b[j / 2], (j & 1) ? 0x7632 : 0x5410);
  } else if constexpr (S::kBits == 32) {
    return f32x2_to_bf16x2(a[j], b[j]);
  } else if constexpr (D == KvDtype::kInt8PerTokenHead) {
    const int k = j % 4;
    const uint32_t x = __byte_perm(a[j / 4], b[j / 4], static_cast<unsigned>(k | ((4 + k) << 8)));
    // kX: the exponent bits 0x64806480 in a register (`magic`), one LOP3 a pair.
    if constexpr (kX16) return and_xor<0x00FF00FFu>(x, magic);
    return int8_pair_biased(x);
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
    } else if constexpr (kX16) {
      const uint32_t t = (k & 2) ? (y >> 8) : y;
      return (k & 1) ? and_or<0x00F000F0u>(t, magic) : and_or<0x000F000Fu>(t, magic);
    } else {
      return uint4_pair_biased(y >> (4 * k));
    }
  }
}

// A V row's per-token metadata word: int4 (scale, zero) as half2, else the fp32 scale.
template <bool kInt4>
__device__ __forceinline__ void v_row_meta(uint32_t w, float& scale, float& zero) {
  if constexpr (kInt4) {
    const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&w));
    scale = sz.x;
    zero = sz.y;
  } else {
    scale = __uint_as_float(w);
    zero = 0.0f;
  }
}

// D = A * B + D with all 16 rows of A live (rows g and g + 8 of each lane): d0, d1 row g,
// d2, d3 row g + 8; a0 / a2 row g, a1 / a3 row g + 8.
template <bool kBf16>
__device__ __forceinline__ void mma16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The cluster merge (DecodePlan::cluster). Each warp's rows' partials (o normalized by its own
// sum, and (max, sum)) sit in its block's dynamic shared memory: [warp][row][kStride] floats,
// then [warp][row] float2.
template <int HD, int kR>
struct ClusterSmem {
  static constexpr int kStride = decode_cluster_row_stride(HD);
  __device__ static float* o() {
    extern __shared__ float4 decode_cluster_smem[];
    return reinterpret_cast<float*>(decode_cluster_smem);
  }
  __device__ static float2* ml() {
    return reinterpret_cast<float2*>(o() + kDecodeWarps * kR * kStride);
  }
};

// After every warp wrote its partials: a cluster barrier, then warp w of the cluster merges
// rows w, w + 4 x cluster, ... of the (sequence, kv head), reading every split's partial of
// the row through distributed shared memory, as decode_merge_warp_kernel does from global
// memory (un-rotating rotated V); a second barrier keeps each block's shared memory alive
// until every reader is done. Not inlined: the split-KV loop's register allocation stays that
// of the kernel without it (inlined, int4 at head_dim 128 spilled 12 bytes more and ran 2%
// slower at batch 32 x 4k). It takes the few parameters it reads by value: a reference to the
// kernel's parameter block made the caller copy the whole block (over 1 KB) to each thread's
// stack, which made the merge slower than the merge kernel.
struct ClusterMergeArgs {
  const int32_t* q_indptr;
  float* out;
  int ratio, max_splits, head_chunks, cluster, num_q_heads;
  bool unrotate;
  HadamardSigns signs;
};
template <int HD, int kR>
__device__ __noinline__ void cluster_merge(const ClusterMergeArgs p, int seq, int kvh) {
  namespace cg = cooperative_groups;
  using CS = ClusterSmem<HD, kR>;
  constexpr int E = HD / 32;
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  int q0 = seq, q_len = 1;
  decode_queries(p.q_indptr, seq, q0, q_len);
  float* part_o = CS::o();
  float2* part_ml = CS::ml();
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int rank = static_cast<int>(cluster.block_rank());
  const int rows = q_len * p.ratio;  // the (query token, head) rows that exist
  for (int r = rank * kDecodeWarps + warp; r < rows; r += p.cluster * kDecodeWarps) {
    const int hc = r / kR, rloc = r - hc * kR;
    // Lane s holds split s's (max, sum), then its weight l * 2^(m - M); max_splits <= 32
    // (kDecodeClusterMaxSplits, the plan's cap). Then every split's slice of the row,
    // eight loads in flight at a time (no branch between them: an empty split's o is zeros).
    float2 v = make_float2(-__uint_as_float(kF32Inf), 0.0f);
    if (lane < p.max_splits) {
      const int it = lane * p.head_chunks + hc;
      v = cluster.map_shared_rank(part_ml, it / kDecodeWarps)[(it % kDecodeWarps) * kR + rloc];
    }
    const float mx = warp_max(v.y > 0.0f ? v.x : -__uint_as_float(kF32Inf));
    const float w = v.y > 0.0f ? v.y * exp2f(v.x - mx) : 0.0f;
    float acc[E];
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = 0.0f;
#pragma unroll 8
    for (int k = 0; k < p.max_splits; ++k) {
      const float wk = __shfl_sync(kFullMask, w, k);
      const int it = k * p.head_chunks + hc;
      const float* src = cluster.map_shared_rank(part_o, it / kDecodeWarps) +
                         ((it % kDecodeWarps) * kR + rloc) * CS::kStride + lane * E;
      float x[E];
      if constexpr (E % 4 == 0) {
#pragma unroll
        for (int q = 0; q < E / 4; ++q) {
          const float4 t = reinterpret_cast<const float4*>(src)[q];
          x[4 * q] = t.x, x[4 * q + 1] = t.y, x[4 * q + 2] = t.z, x[4 * q + 3] = t.w;
        }
      } else {
        static_assert(E == 2);
        const float2 t = *reinterpret_cast<const float2*>(src);
        x[0] = t.x, x[1] = t.y;
      }
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] = fmaf(wk, x[e], acc[e]);
    }
    const float wsum = warp_sum(w);
    // No split saw a key (a padding sequence of a graph step, seq_len 0): zeros.
    const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= inv;
    if (p.unrotate) warp_hadamard_unrotate<E>(acc, lane, p.signs);
    const int t = r / p.ratio, head = r - t * p.ratio;
    float* out = p.out + (static_cast<size_t>(q0 + t) * p.num_q_heads + kvh * p.ratio + head) * HD +
                 lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) out[e] = acc[e];
  }
  cluster.sync();
}

// Blocks (of 4 warps) per SM the register budget is set for: more resident warps hide more
// load latency. 16/32-bit dtypes and head_dim 256 keep the compiler's natural allocation
// (capping them spills); 16-row warps (twice the accumulators and Q registers) get two
// blocks at head_dim 128. One-query warps at head_dim 128 (the transposed product) get four,
// but with an nvfp4 side (int4 / int8: 7-8% faster at 24-40 bytes of spill; nvfp4 6% slower;
// fp8 fits 128 registers unasked; docs/notes/decode-tuning.md version 23).
template <KvDtype DK, KvDtype DV, int HD, int kR>
constexpr int kMinBlocks = cmax(kv_value_bits(DK), kv_value_bits(DV)) > 8
                               ? 1
                               : (HD == 64 ? (kR == 8 ? 4 : 3)
                                           : (HD == 128 ? (kR == 8 ? (DK == KvDtype::kNvfp4 ||
                                                                              DV == KvDtype::kNvfp4
                                                                          ? 3
                                                                          : KVQ_ONEQ_BLOCKS)
                                                                   : 2)
                                                        : 1));

// kR rows per warp: 8 (rows g; rows 8..15 of the MMAs are zero) or 16 (rows g and g + 8,
// head_dim <= 128): the rows of decode_params.h, r = hc * kR + row. kMulti: several queries
// per sequence (p.q_indptr), each row with its own visible range; without it one query per
// sequence (decode), whose rows all see the sequence's range.
template <KvDtype DK, KvDtype DV, int HD, int kR, bool kMulti>
__global__ void __launch_bounds__(kDecodeWarps * 32, kMinBlocks<DK, DV, HD, kR>)
    decode_main_kernel(const __grid_constant__ DecodeKernelParams p) {
  using P = PairShape<DK, DV, HD>;
  using SK = Shape<DK, HD>;  // S = Q K^T: operand type, K scales, K zero points
  using SV = Shape<DV, HD>;  // O += P V: operand type of P, V scales, V zero points
  static_assert(kR == 8 || (kR == 16 && HD <= 128 && kMulti));
  constexpr int kH = kR / 8;  // rows per lane: g, and g + 8 when kR == 16
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  // A 1-D grid of warps over (sequence, kv head, work item): a block may hold the items of
  // several (sequence, kv head) pairs, so the launch has no partly idle blocks and the
  // number of resident rounds follows the number of items, not of (sequence, head) pairs.
  // The cluster merge: cluster i is (sequence, kv head) i, its warps the items in order (those
  // past max_splits x head_chunks idle), and no warp leaves before the cluster's barriers.
  const int items_per = p.max_splits * p.head_chunks;
  const bool clustered = p.cluster > 0;
  int64_t group = 0;  // seq * num_kv_heads + kvh
  int item = 0;
  if (clustered) {
    group = blockIdx.x / p.cluster;
    item = static_cast<int>(blockIdx.x % p.cluster) * kDecodeWarps + warp;
  } else {
    const int64_t w = static_cast<int64_t>(blockIdx.x) * kDecodeWarps + warp;
    group = w / items_per;
    item = static_cast<int>(w - group * items_per);
  }
  if (group >= static_cast<int64_t>(p.num_seqs) * p.num_kv_heads) return;  // never clustered
  const int seq = static_cast<int>(group / p.num_kv_heads);
  const int kvh = static_cast<int>(group - static_cast<int64_t>(seq) * p.num_kv_heads);
  const int split = item / p.head_chunks;
  const int hc = item - split * p.head_chunks;

  const int kv_len = p.seq_lens[seq];
  int q0 = seq, q_len = 1;
  if constexpr (kMulti) decode_queries(p.q_indptr, seq, q0, q_len);
  // The warp's rows r = hc * kR + row are (query t = r / ratio, head r % ratio): its queries
  // run from t_first to t_last; none: the warp has nothing to do.
  const int r_first = hc * kR;
  const int t_first = r_first / p.ratio;
  if (t_first >= q_len && !clustered) return;
  const int t_last = min(q_len - 1, (r_first + kR - 1) / p.ratio);
  int first_tile = 0, chunk = 0;
  const int tiles = decode_visible_tiles(kv_len, q_len, p.attention_kind, p.window, first_tile);
  const int nsplit = decode_num_splits(tiles, p.chunk_tiles, p.max_splits, chunk);
  // A sequence with no visible tile (a padding sequence of a graph step, seq_len 0) under a
  // one-split plan has no merge after this kernel: its first item writes its rows' zeros (an
  // empty partial, normalized by a zero sum). With several splits the merge writes them.
  const bool zero_fill = nsplit == 0 && split == 0 && p.out != nullptr && p.max_splits == 1;
  // Whole warp: no block-level synchronization (the cluster merge's warps stay, idle).
  if (split >= nsplit && !zero_fill && !clustered) return;
  TileCtx x;
  // Loads: the union of the warp's rows' visible ranges (zeros outside it); the logits: each
  // of the lane's rows' own range.
  {
    int lo = 0, hi = 0;
    decode_query_range(kv_len, q_len, t_first, p.attention_kind, p.window, x.lo, hi);
    decode_query_range(kv_len, q_len, t_last, p.attention_kind, p.window, lo, x.hi);
  }
  int tb = first_tile + split * chunk;
  // Clustered: a warp past the group's items, or whose rows have no query, or past the
  // sequence's splits walks no tile (an empty partial).
  const bool idle =
      clustered && (item >= items_per || t_first >= q_len || (split >= nsplit && !zero_fill));
  int te = idle ? tb : min(first_tile + tiles, tb + chunk);
  if constexpr (kMulti) {
    tb = max(tb, x.lo / kDecodeTileTokens);
    te = min(te, (x.hi + kDecodeTileTokens - 1) / kDecodeTileTokens);
  }
  x.g = lane >> 2;
  x.c = lane & 3;
  int row_t[kH], row_lo[kH], row_hi[kH];
  bool row_valid[kH];
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    if constexpr (kMulti) {
      row_t[h] = (r_first + 8 * h + x.g) / p.ratio;
      row_valid[h] = row_t[h] < q_len;
      row_lo[h] = row_hi[h] = 0;
      if (row_valid[h])
        decode_query_range(kv_len, q_len, row_t[h], p.attention_kind, p.window, row_lo[h],
                           row_hi[h]);
    } else {
      // One query: every row sees the sequence's range (rows past the group have Q = 0).
      row_t[h] = 0;
      row_valid[h] = r_first + x.g < p.ratio;
      row_lo[h] = x.lo;
      row_hi[h] = x.hi;
    }
  }
  x.blocks = p.indices + p.indptr[seq];
  x.k_head = p.k.base + static_cast<uint64_t>(kvh) * p.k.head_stride;
  x.v_head = p.v.base + static_cast<uint64_t>(kvh) * p.v.head_stride;

  // Q's fragments come from the prep kernel, which may still be finishing.
  wait_for_previous_kernel();
  if (p.early) allow_next_kernel();
  const size_t qbase =
      (static_cast<size_t>(seq) * p.num_kv_heads + kvh) * p.head_chunks + static_cast<size_t>(hc);
  // Q's A-operand registers (per k-step: a0, a2 of row g, then a1, a3 of row g + 8); for
  // head_dim 256 they are re-read from L1 each tile instead of pinning 32 registers (the
  // accumulators already take 64).
  const uint2* qf = p.qfrag + (qbase * SK::kKSteps * 32 + lane) * kH;
  constexpr int kQRegs = P::kQInRegs ? SK::kKSteps : 1;
  uint32_t qa[kQRegs][2 * kH];
  if constexpr (P::kQInRegs) {
#pragma unroll
    for (int s = 0; s < SK::kKSteps; ++s) {
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        const uint2 v = qf[s * 32 * kH + h];
        qa[s][2 * h] = v.x;
        qa[s][2 * h + 1] = v.y;
      }
    }
  }
  float qfactor[kH], qsum[kH];
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    const float2 qm = p.qmeta[qbase * kR + 8 * h + x.g];
    qfactor[h] = qm.x;
    qsum[h] = qm.y;
  }
  float qfactor_t[2], qsum_t[2];  // the transposed form's rows 2c, 2c + 1 (set below)
  // 16-row warps of 8-bit tiles at head_dim <= 128 keep the next tile in flight too: they
  // run at 2 blocks per SM either way (fp8 at head_dim 128: 218 registers instead of 199, no
  // spill), so the raw tile costs no occupancy (docs/notes/decode-tuning.md version 11).
  constexpr bool kPrefetch =
      P::kPrefetch || (kMulti && kR == 16 && HD <= 128 && SK::kBits == 8 && SV::kBits == 8);
  const bool capped = p.soft_cap != 0.0f;
  const float cap = p.soft_cap, inv_cap = capped ? 1.0f / p.soft_cap : 0.0f;

  // kT: the transposed product of one-query warps (docs/notes/decode-tuning.md version 23).
  // S^T = K Q^T and O^T = V^T P^T put the tile's 16 tokens (and 16 dims of O) on the MMA rows
  // and the warp's 8 query rows on its columns, so no MMA row is zero: half the MMAs of the
  // 8-row form, and no zeroed accumulator halves. The lane holds rows 2c and 2c + 1 (e = 0, 1)
  // of tokens g and g + 8; o[i] is O^T's m-tile i: dims g (HD / 8) + 2i (entries 0, 1) and
  // g (HD / 8) + 2i + 1 (entries 2, 3) of rows 2c, 2c + 1.
  constexpr bool kT = kDecodeTransposed && !kMulti && kR == 8 && !P::kLateV;
  // 8- and 4-bit sides of the transposed product: tiles through the shared-memory ring.
  constexpr bool kRing = kT && Ring<DK, DV, HD>::kOn;
  // int4 K in the transposed product: odd K pairs masked in place at 16x (k_pair's kX16).
  constexpr bool kK16 = kT && SK::kInt4;
  [[maybe_unused]] float2 kzb[2];
  constexpr int kE = kT ? 2 : kH;  // rows per lane
  constexpr int kOA = kT ? SV::kNTiles / 2 : SV::kNTiles, kOB = kT ? 4 : 2 * kH;
  if constexpr (kT) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float2 qm = p.qmeta[qbase * kR + 2 * x.c + e];
      qfactor_t[e] = qm.x;
      qsum_t[e] = qm.y;
    }
    if constexpr (kK16) {
      // Row g's Q operands of the even K pairs (B register 0 of each k-step) x 16, exact in
      // fp16 (|q| < 2); their sum E over the row, sent to the lanes holding row g's logits.
      float ev = 0.0f;
#pragma unroll
      for (int s = 0; s < SK::kKSteps; ++s) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&qa[s][0]));
        ev += f.x + f.y;
        qa[s][0] = hmul2_bits(qa[s][0], 0x4C004C00u);  // 16.0 in half
      }
      ev = quad_sum(ev);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float er = __shfl_sync(kFullMask, ev, (2 * x.c + e) * 4);
        kzb[e] = make_float2(-SK::kBias * (15.0f * er + qsum_t[e]), 16.0f * qsum_t[e]);
        qfactor_t[e] *= 0.0625f;
      }
    }
  }
  float o[kOA][kOB];
#pragma unroll
  for (int j = 0; j < kOA; ++j)
#pragma unroll
    for (int e = 0; e < kOB; ++e) o[j][e] = 0.0f;
  float m[kE], l[kE], zacc[kE];  // per row: running max (log2 units), lane's share of the sum
#pragma unroll
  for (int h = 0; h < kE; ++h) {
    m[h] = -__uint_as_float(kF32Inf);
    l[h] = 0.0f;
    zacc[h] = 0.0f;  // int4: this lane's share of sum(p * zero point)
  }
  float s_run = 0.0f;  // running max of the per-token V scales (the same for every row)
  // Biased V operands: this lane's share of each row's sum of P (as the MMAs saw it, in fp16),
  // scaled along with o; o - kBias x the row's sum is the unbiased product.
  float bacc[kE];
#pragma unroll
  for (int h = 0; h < kE; ++h) bacc[h] = 0.0f;

  // after_k: called once the tile's logits are done with its K (the prefetching loop issues
  // the next tile's loads there).
  // The int4 decoders' exponent bits in a register (and_or), and the int8 V pairs' (and_xor).
  const uint32_t i4magic = (kT && (SK::kInt4 || SV::kInt4)) ? int4_magic() : 0x64006400u;
  const uint32_t vmagic =
      (kT && DV == KvDtype::kInt8PerTokenHead) ? opaque_const(0x64806480u) : i4magic;
  // NT tiles a trip (tile, tile + 1, ...: 1, or 2 in the ring's trips): their S^T chains are
  // independent, and the running maxima, the rescale of o and their reductions are paid once
  // a trip.
  // before_v: called once the logits are done, before anything reads V (the ring reads V's
  // codes from shared memory there).
  auto process_t = [&](auto nt, TileRaw<DK, DV, HD>* cur, int tile, auto&& after_k, auto&& before_v,
                       auto& oo) {
    constexpr int NT = decltype(nt)::value;
    // ---- S^T = K Q^T: st[u][2 n + e] = token g + 8 n of tile u, row 2c + e ----
    float st[NT][4];
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) st[u][i] = 0.0f;
#pragma unroll
    for (int s = 0; s < SK::kKSteps; ++s) {
#pragma unroll
      for (int u = 0; u < NT; ++u) {
        const uint32_t a0 = k_pair<DK, HD, kK16>(cur[u].k[0], cur[u].kb[0], 2 * s, i4magic);
        const uint32_t a1 = k_pair<DK, HD, kK16>(cur[u].k[1], cur[u].kb[1], 2 * s, i4magic);
        const uint32_t a2 = k_pair<DK, HD, kK16>(cur[u].k[0], cur[u].kb[0], 2 * s + 1, i4magic);
        const uint32_t a3 = k_pair<DK, HD, kK16>(cur[u].k[1], cur[u].kb[1], 2 * s + 1, i4magic);
        mma16<SK::kBf16>(st[u], {a0, a1, a2, a3}, qa[s][0], qa[s][1]);
      }
    }
    float corr[2], pr[2][NT][2];  // pr[e][u][n]: row 2c + e, token g + 8 n of tile u
    float xs[2][NT][2];
#pragma unroll
    for (int u = 0; u < NT; ++u) {
      const int t0 = (tile + u) * kDecodeTileTokens;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        [[maybe_unused]] float sz_scale = 1.0f, sz_zero = 0.0f;
        if constexpr (SK::kInt4) {
          const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&cur[u].ks[n]));
          sz_scale = sz.x;
          sz_zero = sz.y;
        } else if constexpr (SK::kRowScale) {
          sz_scale = __uint_as_float(cur[u].ks[n]);
        }
        const int tt = t0 + x.g + 8 * n;
        const bool vis = tt >= x.lo && tt < x.hi;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float r = st[u][2 * n + e];
          if constexpr (kK16) {
            // raw = 16 q.code + 1024 (sum of the operands); kzb = (-1024 x that sum, 16 sum q).
            r = fmaf(r, sz_scale, fmaf(kzb[e].x, sz_scale, sz_zero * kzb[e].y));
          } else if constexpr (SK::kRowScale) {
            if constexpr (SK::kBias != 0.0f) r = fmaf(-SK::kBias, qsum_t[e], r);
            r *= sz_scale;
          }
          r *= qfactor_t[e];
          if (capped) r = cap * tanhf(r * inv_cap);
          xs[e][u][n] = vis ? r * kLog2e : -__uint_as_float(kF32Inf);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float tmax = fmaxf(xs[e][0][0], xs[e][0][1]);
#pragma unroll
      for (int u = 1; u < NT; ++u) tmax = fmaxf(tmax, fmaxf(xs[e][u][0], xs[e][u][1]));
      tmax = col_max(tmax);
      const float m_new = fmaxf(m[e], tmax);
      const float m_use = m_new == -__uint_as_float(kF32Inf) ? 0.0f : m_new;
      corr[e] = exp2f(m[e] - m_use);
      float psum = 0.0f;
#pragma unroll
      for (int u = 0; u < NT; ++u) {
        pr[e][u][0] = exp2f(xs[e][u][0] - m_use);
        pr[e][u][1] = exp2f(xs[e][u][1] - m_use);
        psum = u == 0 ? pr[e][u][0] + pr[e][u][1] : psum + (pr[e][u][0] + pr[e][u][1]);
      }
      l[e] = l[e] * corr[e] + psum;
      m[e] = m_new;
    }
    after_k();
    before_v();
    if constexpr (SV::kRowScale) {
      float sv[NT][2], zv[NT][2];
#pragma unroll
      for (int u = 0; u < NT; ++u)
#pragma unroll
        for (int n = 0; n < 2; ++n) v_row_meta<SV::kInt4>(cur[u].vs[n], sv[u][n], zv[u][n]);
      float smax = fmaxf(sv[0][0], sv[0][1]);
#pragma unroll
      for (int u = 1; u < NT; ++u) smax = fmaxf(smax, fmaxf(sv[u][0], sv[u][1]));
      smax = col_max(smax);
      const float s_new = fmaxf(s_run, smax);
      const float inv_s = s_new > 0.0f ? 1.0f / s_new : 0.0f;
      const float rescale = s_new > 0.0f ? s_run * inv_s : 1.0f;
      s_run = s_new;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if constexpr (SV::kInt4) {
          float zs = 0.0f;
#pragma unroll
          for (int u = 0; u < NT; ++u) {
            const float zu = pr[e][u][0] * zv[u][0] + pr[e][u][1] * zv[u][1];
            zs = u == 0 ? zu : zs + zu;
          }
          zacc[e] = zacc[e] * corr[e] + zs;
        }
        corr[e] *= rescale;
#pragma unroll
        for (int u = 0; u < NT; ++u) {
          pr[e][u][0] *= sv[u][0] * inv_s;
          pr[e][u][1] *= sv[u][1] * inv_s;
        }
      }
    }
    // ---- P^T as the B operand: (rows 2c, 2c + 1) pairs of token g, transposed to (tokens
    // 2c, 2c + 1) pairs of row g ----
    uint32_t pb[NT][2];
#pragma unroll
    for (int u = 0; u < NT; ++u) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        uint32_t x2;
        if constexpr (SV::kBf16) {
          x2 = pack2<true>(pr[0][u][n], pr[1][u][n]);
        } else {
          x2 = pack2<false>(pr[0][u][n], pr[1][u][n]);
          if constexpr (SV::kBias != 0.0f) {
            const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&x2));
            pr[0][u][n] = a.x;
            pr[1][u][n] = a.y;
          }
        }
        pb[u][n] = movmatrix_trans(x2);
      }
    }
    if constexpr (!SV::kBf16 && SV::kBias != 0.0f) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float bs = 0.0f;
#pragma unroll
        for (int u = 0; u < NT; ++u)
          bs = u == 0 ? pr[e][u][0] + pr[e][u][1] : bs + (pr[e][u][0] + pr[e][u][1]);
        bacc[e] = fmaf(bacc[e], corr[e], bs);
      }
    }
    {
      bool rescale_o = corr[0] != 1.0f || corr[1] != 1.0f;
      if (__any_sync(kFullMask, rescale_o)) {
#pragma unroll
        for (int i = 0; i < kOA; ++i) {
          oo[i][0] *= corr[0];
          oo[i][1] *= corr[1];
          oo[i][2] *= corr[0];
          oo[i][3] *= corr[1];
        }
      }
    }
    // ---- O^T += V^T P^T: m-tile i is n-tiles 2i (rows g) and 2i + 1 (rows g + 8) of V ----
#pragma unroll
    for (int u = 0; u < NT; ++u) {
#pragma unroll
      for (int i = 0; i < kOA; ++i) {
        // int4 V: dims of odd n-tiles (entries 2, 3 of o[i]) accumulate 16x (v_pair's kX16);
        // int8 V: its pairs' exponent bits in a register.
        constexpr bool kX = SV::kInt4 || DV == KvDtype::kInt8PerTokenHead;
        const TileRaw<DK, DV, HD>& c = cur[u];
        const uint32_t a0 = v_pair<DV, HD, kX>(c.v[0], c.v[1], c.vb[0], c.vb[1], 2 * i, vmagic);
        const uint32_t a1 = v_pair<DV, HD, kX>(c.v[0], c.v[1], c.vb[0], c.vb[1], 2 * i + 1, vmagic);
        const uint32_t a2 = v_pair<DV, HD, kX>(c.v[2], c.v[3], c.vb[2], c.vb[3], 2 * i, vmagic);
        const uint32_t a3 = v_pair<DV, HD, kX>(c.v[2], c.v[3], c.vb[2], c.vb[3], 2 * i + 1, vmagic);
        mma16<SV::kBf16>(oo[i], {a0, a1, a2, a3}, pb[u][0], pb[u][1]);
      }
    }
  };

  auto process = [&](TileRaw<DK, DV, HD>& cur, int tile, auto&& after_k) {
    const int t0 = tile * kDecodeTileTokens;
    // ---- S = Q K^T for tokens 0-7 (n = 0) and 8-15 (n = 1) of the tile ----
    // sc[n][2 h + e]: row g + 8 h, token 8 n + 2 c + e.
    float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int s = 0; s < SK::kKSteps; ++s) {
      uint32_t qv[2 * kH];
      if constexpr (P::kQInRegs) {
#pragma unroll
        for (int e = 0; e < 2 * kH; ++e) qv[e] = qa[s][e];
      } else {
#pragma unroll
        for (int h = 0; h < kH; ++h) {
          const uint2 v = __ldg(qf + s * 32 * kH + h);
          qv[2 * h] = v.x;
          qv[2 * h + 1] = v.y;
        }
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const uint32_t b0 = k_pair<DK, HD>(cur.k[n], cur.kb[n], 2 * s);
        const uint32_t b1 = k_pair<DK, HD>(cur.k[n], cur.kb[n], 2 * s + 1);
        if constexpr (kH == 1) {
          mma<SK::kBf16>(sc[n][0], sc[n][1], qv[0], qv[1], b0, b1);
        } else {
          mma16<SK::kBf16>(sc[n], {qv[0], qv[2], qv[1], qv[3]}, b0, b1);
        }
      }
    }

    // ---- logits of tokens 2c, 2c + 1, 2c + 8, 2c + 9 (the lane's C-fragment entries) ----
    float corr[kH], pr[kH][4];
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      float xs[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float r = sc[i >> 1][2 * h + (i & 1)];
        if constexpr (SK::kInt4) {
          // k = scale * code + zero; the operands are code + kBias.
          const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&cur.ks[i]));
          r = fmaf(r, sz.x, fmaf(-SK::kBias, sz.x, sz.y) * qsum[h]);
        } else if constexpr (SK::kRowScale) {
          if constexpr (SK::kBias != 0.0f) r = fmaf(-SK::kBias, qsum[h], r);
          r *= __uint_as_float(cur.ks[i]);
        }
        r *= qfactor[h];
        if (capped) r = cap * tanhf(r * inv_cap);
        const int tt = t0 + 2 * x.c + (i & 1) + 8 * (i >> 1);
        xs[i] = tt >= row_lo[h] && tt < row_hi[h] ? r * kLog2e : -__uint_as_float(kF32Inf);
      }
      const float tmax = quad_max(fmaxf(fmaxf(xs[0], xs[1]), fmaxf(xs[2], xs[3])));
      const float m_new = fmaxf(m[h], tmax);
      const float m_use = m_new == -__uint_as_float(kF32Inf) ? 0.0f : m_new;
      corr[h] = exp2f(m[h] - m_use);
#pragma unroll
      for (int i = 0; i < 4; ++i) pr[h][i] = exp2f(xs[i] - m_use);
      l[h] = l[h] * corr[h] + ((pr[h][0] + pr[h][1]) + (pr[h][2] + pr[h][3]));
      m[h] = m_new;
    }
    after_k();
    if constexpr (SV::kRowScale) {
      float sv[4], zv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v_row_meta<SV::kInt4>(cur.vs[i], sv[i], zv[i]);
      const float smax = quad_max(fmaxf(fmaxf(sv[0], sv[1]), fmaxf(sv[2], sv[3])));
      const float s_new = fmaxf(s_run, smax);
      const float inv_s = s_new > 0.0f ? 1.0f / s_new : 0.0f;
      const float rescale = s_new > 0.0f ? s_run * inv_s : 1.0f;
      s_run = s_new;
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        if constexpr (SV::kInt4)
          zacc[h] = zacc[h] * corr[h] +
                    ((pr[h][0] * zv[0] + pr[h][1] * zv[1]) + (pr[h][2] * zv[2] + pr[h][3] * zv[3]));
        corr[h] *= rescale;
#pragma unroll
        for (int i = 0; i < 4; ++i) pr[h][i] *= sv[i] * inv_s;
      }
    }

    // ---- O = O * corr + P V ----
    // head_dim 256: V codes only now, so K and V codes are never live together.
    if constexpr (P::kLateV) load_tile<DK, DV, HD, 2>(cur, p, x, tile);
    uint32_t pa[kH][2];  // per row: tokens (2c, 2c + 1), (2c + 8, 2c + 9)
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      if constexpr (SV::kBf16) {
        pa[h][0] = pack2<true>(pr[h][0], pr[h][1]);
        pa[h][1] = pack2<true>(pr[h][2], pr[h][3]);
      } else {
        pa[h][0] = pack2<false>(pr[h][0], pr[h][1]);
        pa[h][1] = pack2<false>(pr[h][2], pr[h][3]);
        if constexpr (SV::kBias != 0.0f) {
          const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&pa[h][0]));
          const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&pa[h][1]));
          bacc[h] = fmaf(bacc[h], corr[h], (a.x + a.y) + (b.x + b.y));
        }
      }
    }
    // Rescale o only when some row's factor is not 1 (a new running max or V scale): after
    // the first tiles that is rare, and multiplying by 1 changes no bit.
    {
      bool rescale_o = false;
#pragma unroll
      for (int h = 0; h < kH; ++h) rescale_o |= corr[h] != 1.0f;
      if (__any_sync(kFullMask, rescale_o)) {
#pragma unroll
        for (int j = 0; j < SV::kNTiles; ++j)
#pragma unroll
          for (int h = 0; h < kH; ++h) {
            o[j][2 * h] *= corr[h];
            o[j][2 * h + 1] *= corr[h];
          }
      }
    }
#pragma unroll
    for (int j = 0; j < SV::kNTiles; ++j) {
      const uint32_t b0 = v_pair<DV, HD>(cur.v[0], cur.v[1], cur.vb[0], cur.vb[1], j);
      const uint32_t b1 = v_pair<DV, HD>(cur.v[2], cur.v[3], cur.vb[2], cur.vb[3], j);
      if constexpr (kH == 1) {
        mma<SV::kBf16>(o[j][0], o[j][1], pa[0][0], pa[0][1], b0, b1);
      } else {
        mma16<SV::kBf16>(o[j], {pa[0][0], pa[1][0], pa[0][1], pa[1][1]}, b0, b1);
      }
    }
  };

  // Tiles wholly inside the loads' range skip the per-token checks and zero fills (not for
  // nvfp4 sides: 1-2% slower with it, docs/notes/decode-tuning.md version 22).
  constexpr bool kFullLoads = !SK::kNvfp4 && !SV::kNvfp4;
  auto load_any = [&](TileRaw<DK, DV, HD>& r, int tile) {
    const int t0 = tile * kDecodeTileTokens;
    if (kFullLoads && t0 >= x.lo && t0 + kDecodeTileTokens <= x.hi)
      load_tile<DK, DV, HD, 7, true, kT>(r, p, x, tile);
    else
      load_tile<DK, DV, HD, 7, false, kT>(r, p, x, tile);
  };
  auto run = [&](TileRaw<DK, DV, HD>& r, int tile, auto&& after_k) {
    if constexpr (kT)
      process_t(
          std::integral_constant<int, 1>{}, &r, tile, after_k, [] {}, o);
    else
      process(r, tile, after_k);
  };
  TileRaw<DK, DV, HD> cur;
  if (tb >= te) {
    // No tile of this split is visible to the warp's rows (a multi-query sequence's later
    // split for its first queries): an empty partial (max -inf, sum 0).
  } else if constexpr (P::kLateV) {
#pragma unroll 1
    for (int tile = tb; tile < te; ++tile) {
      load_tile<DK, DV, HD, 5>(cur, p, x, tile);
      process(cur, tile, [] {});
    }
  } else if constexpr (kRing) {
    // The shared-memory ring (Ring): stage s holds tiles tb + s, tb + s + kStages, ...; each
    // stage's mbarrier completes one phase per tile.
    using RG = Ring<DK, DV, HD>;
    constexpr int S = RG::kStages;
    __shared__ alignas(128) uint8_t ring_buf[kDecodeWarps][S][RG::kStage];
    __shared__ alignas(8) uint64_t ring_bar[kDecodeWarps][S];
    const uint32_t buf = sm90::smem_addr(&ring_buf[warp][0][0]);
    const uint32_t bar = sm90::smem_addr(&ring_bar[warp][0]);
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < S; ++s) sm90::mbar_init(bar + 8 * s, 1);
      sm90::mbar_init_fence();
    }
    __syncwarp();
    // Block ids: lane l holds that of the sequence's block bbase + l (id_cur) and of
    // bbase + 32 + l (id_nxt, loaded 32 blocks before its use); the copies walk (block, row)
    // from the split's first tile without a division a tile.
    const int nblk = p.indptr[seq + 1] - p.indptr[seq];
    const int bt = p.block_tokens;
    int ib = (tb * kDecodeTileTokens) / bt, ioff = tb * kDecodeTileTokens - ib * bt;
    int bbase = ib;
    auto id_at = [&](int b) { return b < nblk ? __ldg(x.blocks + b) : 0; };
    int id_cur = id_at(bbase + lane), id_nxt = id_at(bbase + 32 + lane);
    const uint64_t policy = sm90::l2_evict_first();
    auto issue = [&](int s) {
      if (ib - bbase >= 32) {  // warp-uniform
        bbase += 32;
        id_cur = id_nxt;
        id_nxt = id_at(bbase + 32 + lane);
      }
      const int blk = __shfl_sync(kFullMask, id_cur, ib - bbase);
      if (lane == 0) {
        const uint8_t* kh = x.k_head + static_cast<uint64_t>(blk) * p.k.block_bytes;
        const uint8_t* vh = x.v_head + static_cast<uint64_t>(blk) * p.v.block_bytes;
        const uint32_t dst = buf + s * RG::kStage, b8 = bar + 8 * s;
        // The warp's reads of this stage (ordered by the caller's __syncwarp) come before
        // the copies' writes.
        sm90::fence_proxy_async_smem();
        sm90::mbar_arrive_expect_tx(b8, RG::kStage);
        sm90::bulk_copy_g2s(dst, kh + ioff * RG::kKRow, RG::kKCodes, b8, policy);
        if constexpr (RG::kKMeta > 0)
          sm90::bulk_copy_g2s(dst + RG::kKCodes, kh + p.k.values_bytes + ioff * 4, RG::kKMeta, b8,
                              policy);
        sm90::bulk_copy_g2s(dst + RG::kKStage, vh + ioff * RG::kVRow, RG::kVCodes, b8, policy);
        if constexpr (RG::kVMeta > 0)
          sm90::bulk_copy_g2s(dst + RG::kKStage + RG::kVCodes, vh + p.v.values_bytes + ioff * 4,
                              RG::kVMeta, b8, policy);
      }
      ioff += kDecodeTileTokens;
      if (ioff == bt) {
        ioff = 0;
        ++ib;
      }
    };
#pragma unroll
    for (int s = 0; s < S; ++s)
      if (tb + s < te) issue(s);
    int s = 0;
    uint32_t parity = 0;
    // One trip of NT tiles from tile on: wait for their stages, read them into registers,
    // give the stages back to the copies of the tiles S further, then the products.
    // K is read back before the logits, V once they are done (so the registers never hold
    // both sides of the trip); then the stages go back to the copies.
    auto trip = [&](auto nt, TileRaw<DK, DV, HD>* tr, int tile) {
      constexpr int NT = decltype(nt)::value;
      int ss[NT];
      bool full[NT];
#pragma unroll
      for (int u = 0; u < NT; ++u) {
        const int t0 = (tile + u) * kDecodeTileTokens;
        ss[u] = s;
        full[u] = t0 >= x.lo && t0 + kDecodeTileTokens <= x.hi;
        sm90::mbar_wait(bar + 8 * s, parity);
        if (full[u])
          load_tile_ring<DK, DV, HD, true, 1>(tr[u], buf + s * RG::kStage, x, t0);
        else
          load_tile_ring<DK, DV, HD, false, 1>(tr[u], buf + s * RG::kStage, x, t0);
        if (++s == S) {
          s = 0;
          parity ^= 1u;
        }
      }
      process_t(
          nt, tr, tile, [] {},
          [&] {
#pragma unroll
            for (int u = 0; u < NT; ++u) {
              const int t0 = (tile + u) * kDecodeTileTokens;
              if (full[u])
                load_tile_ring<DK, DV, HD, true, 2>(tr[u], buf + ss[u] * RG::kStage, x, t0);
              else
                load_tile_ring<DK, DV, HD, false, 2>(tr[u], buf + ss[u] * RG::kStage, x, t0);
            }
            __syncwarp();
#pragma unroll
            for (int u = 0; u < NT; ++u)
              if (tile + u + S < te) issue(ss[u]);
          },
          o);
    };
    constexpr int kNT = RG::kTrip;
    TileRaw<DK, DV, HD> tr[kNT];
    int tile = tb;
#pragma unroll 1
    for (; tile + kNT <= te; tile += kNT) trip(std::integral_constant<int, kNT>{}, tr, tile);
    if constexpr (kNT > 1) {
      if (tile < te) trip(std::integral_constant<int, 1>{}, tr, tile);
    }
  } else if constexpr (kPrefetch) {
    load_any(cur, tb);
#pragma unroll 1
    for (int tile = tb; tile < te; ++tile) {
      TileRaw<DK, DV, HD> nxt;
      // One-query kernels at head_dim 128 issue the next tile's loads once this tile's logits
      // are done, not before its first MMA: issued first, this tile's first use of its K codes
      // waited for the new loads too (22% of the int4 kernel's stall samples on that one
      // instruction; docs/notes/decode-tuning.md version 22). Not for nvfp4 sides (1-4%
      // slower with it); elsewhere not measured yet.
      constexpr bool kLate = !kMulti && HD == 128 && !SK::kNvfp4 && !SV::kNvfp4;
      if (!kLate && tile + 1 < te) load_any(nxt, tile + 1);
      run(cur, tile, [&] {
        if (kLate && tile + 1 < te) load_any(nxt, tile + 1);
      });
      cur = nxt;
    }
  } else {
    load_any(cur, tb);
#pragma unroll 1
    for (int tile = tb; tile < te; ++tile) {
      run(cur, tile, [] {});
      if (tile + 1 < te) load_any(cur, tile + 1);
    }
  }

  if (!p.early) allow_next_kernel();  // the merge may get scheduled; it waits for our writes

  // ---- each row's partial: o normalized by its own sum, with (max, sum) to merge ----
  float scale_o = 1.0f;
  if constexpr (SV::kRowScale) scale_o = s_run;
  if constexpr (SV::kTensorScale) scale_o = p.v.tensor_scale[kvh];
  // A sequence with a single split is final here (when V is not rotated): write the output.
  // The cluster merge: the partial goes to this block's shared memory (ClusterSmem).
  const bool direct = !clustered && p.out != nullptr && (nsplit == 1 || zero_fill);
  if constexpr (kT) {
    // Rows 2c + e; the lane's 16 floats of each: dims g (HD / 8) .. + HD / 8 - 1.
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float l_tot = col_sum(l[e]);
      const float inv_l = l_tot > 0.0f ? 1.0f / l_tot : 0.0f;
      const float zterm = SV::kInt4 ? col_sum(zacc[e]) : 0.0f;
      const float bterm = SV::kBias != 0.0f ? SV::kBias * col_sum(bacc[e]) : 0.0f;
      const int rloc = 2 * x.c + e;
      if (r_first + rloc >= p.ratio) continue;
      const int head = r_first + rloc;
      const size_t row =
          (((static_cast<size_t>(seq) * p.max_splits + split) * p.num_kv_heads + kvh) *
               p.head_chunks +
           hc) *
              kR +
          rloc;
      const int slot = warp * kR + rloc;
      float* dst =
          clustered ? ClusterSmem<HD, kR>::o() + slot * ClusterSmem<HD, kR>::kStride
          : direct  ? p.out + (static_cast<size_t>(q0) * p.num_q_heads + kvh * p.ratio + head) * HD
                    : p.part_o + row * HD;
      float4* d4 = reinterpret_cast<float4*>(dst + x.g * (HD / 8));
      const float scale_hi = SV::kInt4 ? scale_o * 0.0625f : scale_o;
#pragma unroll
      for (int i = 0; i < kOA; i += 2) {
        float4 v;
        v.x = ((o[i][e] - bterm) * scale_o + zterm) * inv_l;
        v.y = ((o[i][2 + e] - bterm) * scale_hi + zterm) * inv_l;
        v.z = ((o[i + 1][e] - bterm) * scale_o + zterm) * inv_l;
        v.w = ((o[i + 1][2 + e] - bterm) * scale_hi + zterm) * inv_l;
        d4[i / 2] = v;
      }
      if (x.g == 0 && !direct)
        (clustered ? ClusterSmem<HD, kR>::ml()[slot] : p.part_ml[row]) = make_float2(m[e], l_tot);
    }
  }
#pragma unroll
  for (int h = 0; h < (kT ? 0 : kH); ++h) {
    const float l_tot = quad_sum(l[h]);
    const float inv_l = l_tot > 0.0f ? 1.0f / l_tot : 0.0f;  // 0: a row that saw no token
    const float zterm = SV::kInt4 ? quad_sum(zacc[h]) : 0.0f;
    const float bterm = SV::kBias != 0.0f ? SV::kBias * quad_sum(bacc[h]) : 0.0f;
    if (!row_valid[h]) continue;
    const int rloc = 8 * h + x.g;
    const int head = r_first + rloc - row_t[h] * p.ratio;
    const size_t row = (((static_cast<size_t>(seq) * p.max_splits + split) * p.num_kv_heads + kvh) *
                            p.head_chunks +
                        hc) *
                           kR +
                       rloc;
    const int slot = warp * kR + rloc;
    float* dst =
        clustered ? ClusterSmem<HD, kR>::o() + slot * ClusterSmem<HD, kR>::kStride
        : direct
            ? p.out +
                  (static_cast<size_t>(q0 + row_t[h]) * p.num_q_heads + kvh * p.ratio + head) * HD
            : p.part_o + row * HD;
#pragma unroll
    for (int j = 0; j < SV::kNTiles; ++j) {
      dst[(2 * x.c) * (HD / 8) + j] = ((o[j][2 * h] - bterm) * scale_o + zterm) * inv_l;
      dst[(2 * x.c + 1) * (HD / 8) + j] = ((o[j][2 * h + 1] - bterm) * scale_o + zterm) * inv_l;
    }
    if (x.c == 0 && !direct)
      (clustered ? ClusterSmem<HD, kR>::ml()[slot] : p.part_ml[row]) = make_float2(m[h], l_tot);
  }
  if (clustered)
    cluster_merge<HD, kR>({p.q_indptr, p.out, p.ratio, p.max_splits, p.head_chunks, p.cluster,
                           p.num_q_heads, p.unrotate, p.signs},
                          seq, kvh);
}

}  // namespace decode_detail

template <KvDtype DK, KvDtype DV>
DecodeMainKernel decode_main_kernel_for(int head_dim, bool multi_query) {
  DecodeMainKernel k = nullptr;
  with_head_dim(head_dim, [&](auto hd) {
    constexpr int HD = decltype(hd)::value;
    if (!multi_query) {
      k = decode_detail::decode_main_kernel<DK, DV, HD, 8, false>;
      if constexpr (decode_detail::kDecodeTransposed && decode_detail::Ring<DK, DV, HD>::kOn) {
        // The ring's blocks (35-37 KB of static shared memory at head_dim 128) fit 4 to an SM
        // only with the largest carveout, and the cluster merge's dynamic shared memory on
        // top of them needs the opt-in past 48 KB a block.
        static std::atomic<uint64_t> done{0};
        prefer_max_shared_once(reinterpret_cast<const void*>(k), done,
                               decode_cluster_smem_bytes(HD, decode_rows_per_warp(HD, false)));
      }
    } else
      k = decode_detail::decode_main_kernel<DK, DV, HD, decode_rows_per_warp(HD, true), true>;
  });
  return k;
}

}  // namespace kvq::cuda
