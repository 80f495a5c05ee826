// The mma.sync prefill kernel (one instantiation per (K, V) pair x head_dim; included by
// prefill_launch.cuh). See cuda_prefill.h for the algorithm.
//
// The code -> 16-bit operand pair decoders and the warp reductions are operand_pairs.cuh's,
// shared with the decode kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "attention/cuda/operand_pairs.cuh"
#include "attention/cuda/prefill_params.h"
#include "cache/cuda/cuda_check.h"
#include "kvq/core/error.h"

namespace kvq::cuda {
namespace prefill_detail {

using namespace operand_pairs;  // the code -> operand pair decoders, warp reductions

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

__host__ __device__ constexpr int value_bits(KvDtype d) {
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
// Bytes of one (token, kv head) row as stored (nvfp4's block scales follow its codes).
__host__ __device__ constexpr int row_bytes(KvDtype d, int hd) {
  return d == KvDtype::kNvfp4 ? hd / 16 * 9 : hd * value_bits(d) / 8;
}
// MMA operands in bf16 where fp16 could not hold the values; every quantized code is exact
// in fp16.
__host__ __device__ constexpr bool bf16_operands(KvDtype d) {
  return d == KvDtype::kBFloat16 || d == KvDtype::kFloat32;
}
__host__ __device__ constexpr bool row_scaled(KvDtype d) {
  return d == KvDtype::kInt8PerTokenHead || d == KvDtype::kFp8PerTokenHead ||
         d == KvDtype::kInt4PerTokenHead;
}
__host__ __device__ constexpr bool tensor_scaled(KvDtype d) {
  return d == KvDtype::kFp8E4M3 || d == KvDtype::kFp8E5M2 || d == KvDtype::kNvfp4;
}
__host__ __device__ constexpr int cmax(int a, int b) {
  return a > b ? a : b;
}

// How a side's staged bytes reach the tensor cores: 16-bit caches are ldmatrix'ed straight
// from the cp.async staging tile; 8-bit caches are ldmatrix'ed as bytes and converted in
// registers (with a permuted head dim, see below); fp32 and 4-bit caches are dequantized into
// a 16-bit shared-memory tile first (an extra pass and barrier per tile).
enum class Mode { kDirect16, kReg8, kDequant };
__host__ __device__ constexpr Mode side_mode(KvDtype d) {
  return (d == KvDtype::kFloat16 || d == KvDtype::kBFloat16) ? Mode::kDirect16
         : value_bits(d) == 8                                ? Mode::kReg8
                                                             : Mode::kDequant;
}

// Shared-memory plan of one block (byte offsets). kRowsPerBlock: query rows of one block,
// prefill_rows_per_block (two 16-row MMA tiles per warp; one at head_dim 256) or, for small-q
// batches, prefill_small_q_rows (one tile per warp: half the accumulators, so more blocks per
// SM where each block has few live rows).
template <KvDtype DK, KvDtype DV, int HD, int kRowsPerBlock>
struct Cfg {
  static constexpr int kRowK = row_bytes(DK, HD);
  static constexpr int kRowV = row_bytes(DV, HD);
  static constexpr Mode kModeK = side_mode(DK);
  static constexpr Mode kModeV = side_mode(DV);
  static constexpr bool kDeqK = kModeK == Mode::kDequant;
  static constexpr bool kDeqV = kModeV == Mode::kDequant;
  static constexpr bool kAnyDeq = kDeqK || kDeqV;
  // 16-row MMA tiles per warp: two where the accumulators fit (each K / V fragment read
  // from shared memory then serves twice the rows), one at head_dim 256 and for small q.
  static constexpr int kMT = kRowsPerBlock / (kWarps * 16);
  static_assert(kMT >= 1 && kWarps * 16 * kMT == kRowsPerBlock);
  static constexpr int kRows = kWarps * 16 * kMT;
  // kv tokens per tile: 64 at head_dim 64, else 32 (registers), and 32 where the raw staging
  // buffers (wide rows) would not fit.
  static constexpr int kBc = (HD <= 64 && (kRowK + kRowV) * 64 * 2 <= 65536) ? 64 : 32;
  static constexpr int kStride = HD + 8;  // 16-bit elements per smem row: +16 B breaks bank
                                          // conflicts of ldmatrix
  // Staged row pitch: +16 B where ldmatrix reads the staged rows (bank conflicts).
  static constexpr int kPitchK = kDeqK ? kRowK : kRowK + 16;
  static constexpr int kPitchV = kDeqV ? kRowV : kRowV + 16;
  static constexpr bool kMetaK = row_scaled(DK);
  static constexpr bool kMetaV = row_scaled(DV);
  static constexpr bool kInt4K = DK == KvDtype::kInt4PerTokenHead;
  static constexpr bool kInt4V = DV == KvDtype::kInt4PerTokenHead;
  static constexpr bool kRotK = traits(DK).rotated;
  static constexpr bool kRotV = traits(DV).rotated;
  static constexpr bool kBf16K = bf16_operands(DK);
  static constexpr bool kBf16V = bf16_operands(DV);

  static constexpr int kQs = 0;                                      // [kRows][kStride] Q
  static constexpr int kKs = kQs + kRows * kStride * 2;              // [kBc][kStride] K (dequant)
  static constexpr int kVs = kKs + (kDeqK ? kBc * kStride * 2 : 0);  // [kBc][kStride] V (dequant)
  static constexpr int kRowMeta = kVs + (kDeqV ? kBc * kStride * 2 : 0);  // factor, qsum [kRows]
  static constexpr int kRaw = kRowMeta + 2 * kRows * 4;  // kStages raw staging buffers
  static constexpr int kRawK = kBc * kPitchK;            // within a raw buffer
  static constexpr int kRawV = kRawK + kBc * kPitchV;    // offset of the metadata..
  static constexpr int kRawMetaK = kRawV;                // K metadata (per-token scales)
  static constexpr int kRawMetaV = kRawMetaK + (kMetaK ? kBc * 4 : 0);
  static constexpr int kRawBuf = kRawMetaV + (kMetaV ? kBc * 4 : 0);
  // Three stages (loads of tile j + 2 overlap compute of j) where two blocks per SM still fit
  // (one at head_dim 256; three for the small-q blocks).
  static constexpr int kStages =
      kRaw + 3 * kRawBuf <= (HD == 256 ? 200 : (kMT == 1 ? 74 : 110)) * 1024 ? 3 : 2;
  static constexpr int kMain = kRaw + kStages * kRawBuf;
  static constexpr int kEpiStride = HD + 4;  // fp32 per row of the un-rotation staging
  static constexpr int kEpi = kRotV ? kRows * kEpiStride * 4 : 0;
  static constexpr int kSmem = cmax(kMain, kEpi);
  static_assert(kRowMeta % 16 == 0 && kRaw % 16 == 0 && kRawBuf % 16 == 0 && kRawK % 16 == 0);
  static_assert(kDeqK || kRowK % 16 == 0);
  static_assert(kDeqV || kRowV % 16 == 0);
};

// ---- PTX wrappers -----------------------------------------------------------------------------

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1,
                                              uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D += A * B, m16n8k16, fp32 accumulators.
template <bool kBf16>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// ---- unpacking into 16-bit operand pairs (low half = lower dim) -----------------------------

// Nibbles of byte k of w (dims 2k, 2k + 1 of a 4-bit word) into bits 0-3 and 16-19.
__device__ __forceinline__ uint32_t nibble_pair(uint32_t w, int k) {
  return __byte_perm(w, w >> 4, static_cast<unsigned>(k | ((4 + k) << 8)));
}

// Dims [8u, 8u + 8) of one stored row -> eight 16-bit operands in dim order (per-token and
// per-tensor scales are applied elsewhere; nvfp4's block scales here, exactly).
template <KvDtype D, int HD>
__device__ __forceinline__ uint4 dequant8(const uint8_t* row, int u) {
  uint4 r;
  if constexpr (D == KvDtype::kFloat16 || D == KvDtype::kBFloat16) {
    r = *reinterpret_cast<const uint4*>(row + 16 * u);
  } else if constexpr (D == KvDtype::kFloat32) {
    const uint4 a = *reinterpret_cast<const uint4*>(row + 32 * u);
    const uint4 b = *reinterpret_cast<const uint4*>(row + 32 * u + 16);
    r.x = f32x2_to_bf16x2(a.x, a.y);
    r.y = f32x2_to_bf16x2(a.z, a.w);
    r.z = f32x2_to_bf16x2(b.x, b.y);
    r.w = f32x2_to_bf16x2(b.z, b.w);
  } else if constexpr (D == KvDtype::kInt8PerTokenHead) {
    const uint2 w = *reinterpret_cast<const uint2*>(row + 8 * u);
    r.x = int8_pair(__byte_perm(w.x, 0u, 0x0100));
    r.y = int8_pair(__byte_perm(w.x, 0u, 0x0302));
    r.z = int8_pair(__byte_perm(w.y, 0u, 0x0100));
    r.w = int8_pair(__byte_perm(w.y, 0u, 0x0302));
  } else if constexpr (value_bits(D) == 8) {
    constexpr bool kE5M2 = D == KvDtype::kFp8E5M2;
    const uint2 w = *reinterpret_cast<const uint2*>(row + 8 * u);
    r.x = fp8x2_to_f16x2<kE5M2>(w.x);
    r.y = fp8x2_to_f16x2<kE5M2>(w.x >> 16);
    r.z = fp8x2_to_f16x2<kE5M2>(w.y);
    r.w = fp8x2_to_f16x2<kE5M2>(w.y >> 16);
  } else if constexpr (D == KvDtype::kInt4PerTokenHead) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(row + 4 * u);
    r.x = uint4_pair(nibble_pair(w, 0));
    r.y = uint4_pair(nibble_pair(w, 1));
    r.z = uint4_pair(nibble_pair(w, 2));
    r.w = uint4_pair(nibble_pair(w, 3));
  } else {
    static_assert(D == KvDtype::kNvfp4);
    const uint32_t w = *reinterpret_cast<const uint32_t*>(row + 4 * u);
    const uint32_t code = row[HD / 2 + u / 2];
    const uint32_t scale2 = fp8x2_to_f16x2<false>(code | (code << 8));
    r.x = hmul2_bits(e2m1_pair(nibble_pair(w, 0)), scale2);
    r.y = hmul2_bits(e2m1_pair(nibble_pair(w, 1)), scale2);
    r.z = hmul2_bits(e2m1_pair(nibble_pair(w, 2)), scale2);
    r.w = hmul2_bits(e2m1_pair(nibble_pair(w, 3)), scale2);
  }
  return r;
}

// Where the 16-token segments of one kv tile live: cache block id (-1: outside [lo, hi), not
// read: the block may not exist) and the first token's row within the block. Computed once
// per tile and shared by K, V and their metadata (one integer division per segment).
template <int kSegs>
struct TileSegs {
  int32_t block[kSegs];
  int32_t row[kSegs];
};

// Starts the cp.async copies of one side's bytes for one tile: UNIT bytes per token (a row,
// or a row's metadata) landing PITCH bytes apart, 16-token segments (never split across cache
// blocks, since block_tokens is a multiple of 16).
template <int UNIT, int PITCH, int kBc>
__device__ __forceinline__ void issue_side(uint32_t dst, const uint8_t* head, uint64_t block_bytes,
                                           const TileSegs<kBc / 16>& sg, int tid) {
  constexpr int kChunks = (kBc / 16) * UNIT;  // 16-byte chunks; UNIT per segment
  static_assert(PITCH == UNIT || UNIT % 16 == 0);
#pragma unroll
  for (int k = 0; k < (kChunks + kThreads - 1) / kThreads; ++k) {
    const int ch = tid + k * kThreads;
    if (kChunks % kThreads != 0 && ch >= kChunks) break;
    const int seg = ch / UNIT, w = ch - seg * UNIT;
    int32_t block = sg.block[0], row = sg.row[0];
#pragma unroll
    for (int q = 1; q < kBc / 16; ++q)
      if (seg == q) block = sg.block[q], row = sg.row[q];
    if (block < 0) continue;
    const uint8_t* src = head + static_cast<uint64_t>(block) * block_bytes +
                         static_cast<uint64_t>(row) * UNIT + 16 * w;
    if constexpr (PITCH == UNIT) {
      cp_async16(dst + 16 * ch, src);
    } else {
      constexpr int kPerRow = UNIT / 16;
      const int r = 16 * seg + w / kPerRow;
      cp_async16(dst + r * PITCH + 16 * (w % kPerRow), src);
    }
  }
}

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) = 0
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// Two fp8 / int8 codes (bits 0-7 and 16-23 of w) -> an f16x2 operand pair (exact).
template <KvDtype D>
__device__ __forceinline__ uint32_t cvt8_pair02(uint32_t w) {
  if constexpr (D == KvDtype::kInt8PerTokenHead)
    return int8_pair(w);
  else
    return fp8x2_to_f16x2<D == KvDtype::kFp8E5M2>(__byte_perm(w, 0u, 0x0020));
}
// Two 8-bit codes (bits 0-15 of w) -> an f16x2 operand pair (exact).
template <KvDtype D>
__device__ __forceinline__ uint32_t cvt8_pair01(uint32_t w) {
  if constexpr (D == KvDtype::kInt8PerTokenHead)
    return int8_pair(__byte_perm(w, 0u, 0x0100));
  else
    return fp8x2_to_f16x2<D == KvDtype::kFp8E5M2>(w);
}

// Two of the four 8-bit codes of a word as an f16x2 operand pair (exact), bytes kLo / kHi
// (low / high half): int8 with one xor a word (the codes as q + 128) and a byte_perm and an hsub2
// a pair; fp8 with one cvt a pair (bytes 2, 3 read from the upper half, others byte_perm'ed).
template <KvDtype D>
struct Cvt8Word {
  uint32_t u;
  __device__ __forceinline__ explicit Cvt8Word(uint32_t w)
      : u(D == KvDtype::kInt8PerTokenHead ? w ^ 0x80808080u : w) {}
  template <int kLo, int kHi>
  __device__ __forceinline__ uint32_t pair() const {
    static_assert(kLo >= 0 && kLo < 4 && kHi >= 0 && kHi < 4);
    if constexpr (D == KvDtype::kInt8PerTokenHead) {
      // 0x64 above each code: half 1024 + (q + 128); minus 1152 is q.
      return hsub2_bits(__byte_perm(u, 0x64646464u, kLo | 4 << 4 | kHi << 8 | 5 << 12), 1152.0f);
    } else {
      constexpr bool kE5M2 = D == KvDtype::kFp8E5M2;
      if constexpr (kLo == 0 && kHi == 1) {
        return fp8x2_to_f16x2<kE5M2>(u);
      } else if constexpr (kLo == 2 && kHi == 3) {
        return fp8x2_to_f16x2<kE5M2>(u, 1);  // the upper half read in place
      } else {
        return fp8x2_to_f16x2<kE5M2>(__byte_perm(u, 0u, kLo | kHi << 4));
      }
    }
  }
};

// Reg8 K: one ldmatrix (b16 view of the byte rows) hands lane (g, c) bytes 4c .. 4c + 3 of a
// 16-dim group of token g; they become MMA k indices 2c, 2c + 1, 2c + 8, 2c + 9. Q is stored
// with that permutation of each 16-dim group, so the dot product is unchanged: the 16-bit
// column of stored dim d (d % 16 = 2p + i) is 16 (d / 16) + 2 ((p % 2) * 4 + p / 2) + i.
__device__ __forceinline__ int q_col_reg8(int d) {
  const int p = (d & 15) >> 1;
  return (d & ~15) + 2 * ((p & 1) * 4 + (p >> 1)) + (d & 1);
}

// The query rows, kv range and kv tiles of one prefill block (both kernels' grid: blockIdx.x =
// split x q tiles + the q tile in reverse order, highest rows first since under a causal mask
// they carry the most kv tiles; y = kv head; z = sequence). Rows are (query token x query head
// of the kv head's group), row-major.
struct PrefillBlock {
  int seq, kvh, split, r0;
  int q_start, q_len, kv_len, rows_total, first_pos;
  bool sliding, noncausal;
  int lo, hi;          // kv positions some row of the block sees
  int all_lo, all_hi;  // kv positions every row sees
  int tile_b, tile_e;  // the block's kv tiles (its split's share)
  // The index of query row r in out / part_o.
  __device__ int row_index(const PrefillKernelParams& p, int r) const {
    const int t = r / p.ratio, h = r - t * p.ratio;
    return (q_start + t) * p.num_q_heads + kvh * p.ratio + h;
  }
};

// Fills b for this block of `rows` rows and tiles of `tile_tokens` kv tokens. False when the
// block has nothing to do: no row exists, or its split's share of the tiles is empty (its rows
// are then reported "nothing seen" in part_ml, by `threads` threads).
__device__ __forceinline__ bool prefill_block(const PrefillKernelParams& p, int rows,
                                              int tile_tokens, int threads, PrefillBlock& b) {
  b.seq = static_cast<int>(blockIdx.z);
  b.kvh = static_cast<int>(blockIdx.y);
  const int num_qt = static_cast<int>(gridDim.x) / p.num_splits;
  b.split = static_cast<int>(blockIdx.x) / num_qt;
  const int qtile = num_qt - 1 - (static_cast<int>(blockIdx.x) - b.split * num_qt);
  b.q_start = p.q_indptr[b.seq];
  b.q_len = p.q_indptr[b.seq + 1] - b.q_start;
  b.kv_len = p.seq_lens[b.seq];
  b.rows_total = b.q_len * p.ratio;
  b.r0 = qtile * rows;
  if (b.r0 >= b.rows_total) return false;
  b.first_pos = b.kv_len - b.q_len;
  const int p_lo = b.first_pos + b.r0 / p.ratio;
  const int p_hi = b.first_pos + min(b.rows_total - 1, b.r0 + rows - 1) / p.ratio;
  b.sliding = p.attention_kind == static_cast<int>(AttentionKind::kSlidingWindow);
  b.noncausal = p.attention_kind == static_cast<int>(AttentionKind::kNonCausal);
  b.lo = b.sliding ? max(0, p_lo - p.window + 1) : 0;
  b.hi = b.noncausal ? b.kv_len : p_hi + 1;
  b.all_lo = b.sliding ? p_hi - p.window + 1 : 0;
  b.all_hi = b.noncausal ? b.kv_len : p_lo + 1;
  b.tile_b = b.lo / tile_tokens;
  b.tile_e = (b.hi + tile_tokens - 1) / tile_tokens;
  if (p.num_splits > 1) {
    const int per = (b.tile_e - b.tile_b + p.num_splits - 1) / p.num_splits;
    const int first = b.tile_b + b.split * per;
    b.tile_e = min(b.tile_e, first + per);
    b.tile_b = first;
    if (b.tile_b >= b.tile_e) {
      for (int r = b.r0 + static_cast<int>(threadIdx.x); r < min(b.rows_total, b.r0 + rows);
           r += threads)
        p.part_ml[static_cast<size_t>(b.split) * p.part_rows + b.row_index(p, r)] =
            make_float2(-__uint_as_float(kF32Inf), 0.0f);
      return false;
    }
  }
  return true;
}

// Q rows r_first .. r_first + N - 1 of a block (row r: query token r / ratio, query head
// kvh * ratio + r % ratio), HD / 32 values a lane, zeros past rows_total. Every row's loads are
// issued before any row is used: one round trip to memory instead of N (a row's loads used to
// wait behind the previous row's shared-memory stores; docs/notes/prefill-tuning.md v16).
template <int HD, int N>
__device__ __forceinline__ void load_q_rows(float (&xs)[N][HD / 32], const PrefillKernelParams& p,
                                            int q_start, int kvh, int r_first, int rows_total,
                                            int lane) {
  constexpr int E = HD / 32;
  static_assert(E % 2 == 0);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int r = r_first + j;
    if (r < rows_total) {
      const int t = r / p.ratio, h = r - t * p.ratio;
      const float* src =
          p.q + (static_cast<size_t>(q_start + t) * p.num_q_heads + kvh * p.ratio + h) * HD +
          lane * E;
#pragma unroll
      for (int e = 0; e < E; e += 2) {
        const float2 f = __ldg(reinterpret_cast<const float2*>(src + e));
        xs[j][e] = f.x;
        xs[j][e + 1] = f.y;
      }
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) xs[j][e] = 0.0f;
    }
  }
}

// One Q row (E values a lane) as 16-bit MMA operands scaled by `a`: each packed pair of values
// e, e + 1 goes to store(e, pair). Returns the warp's sum of the operands.
template <bool kBf16, int E, typename Store>
__device__ __forceinline__ float pack_q_row_at(const float (&x)[E], float a, Store&& store) {
  float qsum = 0.0f;
#pragma unroll
  for (int e = 0; e < E; e += 2) {
    const uint32_t pr = pack2<kBf16>(x[e] * a, x[e + 1] * a);
    if constexpr (kBf16) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pr));
      qsum += f.x + f.y;
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&pr));
      qsum += f.x + f.y;
    }
    store(e, pr);
  }
  return warp_sum(qsum);
}

// The power-of-two scale a with |q a| < 2 for fp16 operands of values up to `amax` (keeps Q's
// precision whatever its range); bf16: 1.
template <bool kBf16>
__device__ __forceinline__ float q_operand_scale(float amax) {
  return (!kBf16 && amax > 0.0f) ? ldexpf(1.0f, -ilogbf(amax)) : 1.0f;
}

// One Q row as 16-bit MMA operands with its own scale (q_operand_scale of its maximum).
// Returns a and the warp's sum of the operands.
template <bool kBf16, int E, typename Store>
__device__ __forceinline__ float2 pack_q_row(const float (&x)[E], Store&& store) {
  const float a = q_operand_scale<kBf16>(warp_finite_amax(x));
  return make_float2(a, pack_q_row_at<kBf16>(x, a, store));
}

template <int HD, int kRowsPerBlock>
constexpr int kMinBlocks = prefill_blocks_per_sm(HD, kRowsPerBlock);

template <KvDtype DK, KvDtype DV, int HD, int kRowsPerBlock>
__global__ void __launch_bounds__(kThreads, kMinBlocks<HD, kRowsPerBlock>)
    prefill_kernel(const __grid_constant__ PrefillKernelParams p) {
  using C = Cfg<DK, DV, HD, kRowsPerBlock>;
  constexpr int kBc = C::kBc;
  constexpr int kMT = C::kMT;
  constexpr int kRows = C::kRows;
  constexpr int kS = C::kStages;
  constexpr int kWarpRows = 16 * kMT;
  constexpr int kRowStride = C::kStride * 2;  // bytes
  constexpr bool kReg8K = C::kModeK == Mode::kReg8;
  constexpr bool kReg8V = C::kModeV == Mode::kReg8;
  // Pitch (bytes) of the rows ldmatrix reads: the dequantized tile or the staged bytes.
  constexpr int kKPitch = C::kDeqK ? kRowStride : C::kPitchK;
  constexpr int kVPitch = C::kDeqV ? kRowStride : C::kPitchV;
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  PrefillBlock blk_;
  if (!prefill_block(p, kRows, kBc, kThreads, blk_)) return;
  const int seq = blk_.seq, kvh = blk_.kvh, split = blk_.split, r0 = blk_.r0;
  const int q_start = blk_.q_start, kv_len = blk_.kv_len;
  const int rows_total = blk_.rows_total, first_pos = blk_.first_pos;
  const bool sliding = blk_.sliding, noncausal = blk_.noncausal;
  const int lo = blk_.lo, hi = blk_.hi, all_lo = blk_.all_lo, all_hi = blk_.all_hi;
  const int tile_b = blk_.tile_b, tile_e = blk_.tile_e;
  auto row_index = [&](int r) { return blk_.row_index(p, r); };

  const int32_t* blocks = p.indices + p.indptr[seq];
  const uint8_t* k_head = p.k.base + static_cast<uint64_t>(kvh) * p.k.head_stride;
  const uint8_t* v_head = p.v.base + static_cast<uint64_t>(kvh) * p.v.head_stride;
  const uint32_t s_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  float* rfac = reinterpret_cast<float*>(smem + C::kRowMeta);
  float* rqsum = rfac + kRows;

  // Every stage commits one cp.async group (possibly empty) so the wait counts are fixed.
  auto issue = [&](int tile) {
    if (tile < tile_e) {
      const int t0 = tile * kBc;
      const uint32_t raw = s_base + C::kRaw + ((tile - tile_b) % kS) * C::kRawBuf;
      TileSegs<kBc / 16> sg;
#pragma unroll
      for (int q = 0; q < kBc / 16; ++q) {
        const int tok = t0 + 16 * q;
        const int b = tok / p.block_tokens;
        sg.row[q] = tok - b * p.block_tokens;
        sg.block[q] = (tok >= hi || tok + 16 <= lo) ? -1 : __ldg(blocks + b);
      }
      issue_side<C::kRowK, C::kPitchK, kBc>(raw, k_head, p.k.block_bytes, sg, tid);
      issue_side<C::kRowV, C::kPitchV, kBc>(raw + C::kRawK, v_head, p.v.block_bytes, sg, tid);
      if constexpr (C::kMetaK)
        issue_side<4, 4, kBc>(raw + C::kRawMetaK, k_head + p.k.values_bytes, p.k.block_bytes, sg,
                              tid);
      if constexpr (C::kMetaV)
        issue_side<4, 4, kBc>(raw + C::kRawMetaV, v_head + p.v.values_bytes, p.v.block_bytes, sg,
                              tid);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st < kS - 1; ++st) issue(tile_b + st);

  // ---- Q: each warp its 16 rows (rotated for a rotated K), as 16-bit operands in smem ----
  {
    constexpr int E = HD / 32;
    uint16_t* qs = reinterpret_cast<uint16_t*>(smem + C::kQs);
    const float kscale = p.k.tensor_scale[kvh];
    // Eight rows' loads at a time (load_q_rows), then their conversions.
    constexpr int kChunk = 8;
    static_assert(kWarpRows % kChunk == 0);
#pragma unroll 1
    for (int i0 = 0; i0 < kWarpRows; i0 += kChunk) {
      float xs[kChunk][E];
      load_q_rows<HD, kChunk>(xs, p, q_start, kvh, r0 + warp * kWarpRows + i0, rows_total, lane);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const int lr = warp * kWarpRows + i0 + j;
        const bool valid = r0 + lr < rows_total;
        float(&x)[E] = xs[j];
        if constexpr (C::kRotK) warp_hadamard_rotate<E>(x, lane, p.signs);
        const float2 aq = pack_q_row<C::kBf16K>(x, [&](int e, uint32_t pr) {
          const int col = kReg8K ? q_col_reg8(lane * E + e) : lane * E + e;
          *reinterpret_cast<uint32_t*>(qs + lr * C::kStride + col) = pr;
        });
        if (lane == 0) {
          rfac[lr] = valid ? p.softmax_scale * kscale / aq.x : 0.0f;
          rqsum[lr] = aq.y;
        }
      }
    }
    __syncwarp();
  }

  // Per-lane rows g and g + 8 of each of the warp's MMA tiles: row i is tile i / 2, half i % 2.
  constexpr int kLR = 2 * kMT;
  const bool capped = p.soft_cap != 0.0f;
  const float cap = p.soft_cap, inv_cap = capped ? 1.0f / p.soft_cap : 0.0f;
  // The visible range of row i, recomputed where a tile needs masking (few tiles; keeps
  // registers for the accumulators).
  auto row_pos = [&](int i) {
    const int lr = warp * kWarpRows + 16 * (i >> 1) + g + 8 * (i & 1);
    return first_pos + min(r0 + lr, rows_total - 1) / p.ratio;
  };
  float fac[kLR], qsm[kLR];
#pragma unroll
  for (int i = 0; i < kLR; ++i) {
    const int lr = warp * kWarpRows + 16 * (i >> 1) + g + 8 * (i & 1);
    fac[i] = rfac[lr] * (capped ? 1.0f : kLog2e);
    qsm[i] = rqsum[lr];
  }

  float o[kMT][HD / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.0f;
  float m[kLR], l[kLR], zacc[kLR];
#pragma unroll
  for (int i = 0; i < kLR; ++i) {
    m[i] = -__uint_as_float(kF32Inf);
    l[i] = zacc[i] = 0.0f;
  }
  float s_run = 0.0f;

  // ldmatrix lane offsets (bytes): Q rows of this warp, K rows (tokens), V rows (tokens).
  const uint32_t q_addr = s_base + C::kQs +
                          (warp * kWarpRows + (lane & 7) + 8 * ((lane >> 3) & 1)) * kRowStride +
                          16 * (lane >> 4);
  const uint32_t k_off =
      kReg8K ? lane * kKPitch : ((lane & 7) + 8 * (lane >> 4)) * kKPitch + 16 * ((lane >> 3) & 1);
  const uint32_t v_off = ((lane & 7) + 8 * ((lane >> 3) & 1)) * kVPitch + 16 * (lane >> 4);

  // A warp whose rows are all past the last query row (a small-q block: 8 tokens x 4 heads fill
  // one warp of four) stages tiles with the others but skips the math.
  const bool warp_live = r0 + warp * kWarpRows < rows_total;
#pragma unroll 1
  for (int tile = tile_b; tile < tile_e; ++tile) {
    cp_async_wait<kS - 2>();
    __syncthreads();       // this tile's bytes landed; everyone is done with the last tile's
    issue(tile + kS - 1);  // into the buffer the last tile used

    const int t0 = tile * kBc;
    const uint8_t* raw = smem + C::kRaw + ((tile - tile_b) % kS) * C::kRawBuf;
    const uint32_t raw_s = s_base + C::kRaw + ((tile - tile_b) % kS) * C::kRawBuf;
    const bool edge = t0 < lo || t0 + kBc > hi;
    // ---- fp32 / 4-bit sides: dequantize into 16-bit operand rows (zeros outside [lo, hi));
    //      staged 8 / 16-bit V rows outside [lo, hi) are zeroed (P is 0 there, but 0 x NaN
    //      is not) ----
    if constexpr (C::kAnyDeq) {
#pragma unroll 2
      for (int idx = tid; idx < kBc * HD / 8; idx += kThreads) {
        const int t = idx / (HD / 8), u = idx - t * (HD / 8);
        const bool vis = t0 + t >= lo && t0 + t < hi;
        if constexpr (C::kDeqK) {
          uint4 kq = make_uint4(0, 0, 0, 0);
          if (vis) kq = dequant8<DK, HD>(raw + t * C::kRowK, u);
          *reinterpret_cast<uint4*>(smem + C::kKs + t * kRowStride + 16 * u) = kq;
        }
        if constexpr (C::kDeqV) {
          uint4 vq = make_uint4(0, 0, 0, 0);
          if (vis) vq = dequant8<DV, HD>(raw + C::kRawK + t * C::kRowV, u);
          *reinterpret_cast<uint4*>(smem + C::kVs + t * kRowStride + 16 * u) = vq;
        }
      }
    }
    if constexpr (!C::kDeqV) {
      if (edge) {
        constexpr int kPerRow = C::kRowV / 16;
        for (int idx = tid; idx < kBc * kPerRow; idx += kThreads) {
          const int t = idx / kPerRow, w = idx - t * kPerRow;
          if (t0 + t < lo || t0 + t >= hi)
            *reinterpret_cast<uint4*>(smem + C::kRaw + ((tile - tile_b) % kS) * C::kRawBuf +
                                      C::kRawK + t * C::kPitchV + 16 * w) = make_uint4(0, 0, 0, 0);
        }
      }
    }
    if (C::kAnyDeq || (!C::kDeqV && edge)) __syncthreads();
    if (!warp_live) continue;  // no block barrier below this point in the loop

    // Per-token metadata of the columns this lane touches (8j + 2c + b), 0 outside [lo, hi).
    auto meta = [&](int off, int col) -> uint32_t {
      const bool vis = t0 + col >= lo && t0 + col < hi;
      return vis ? *reinterpret_cast<const uint32_t*>(raw + off + 4 * col) : 0u;
    };

    // ---- S = Q K^T: 16 rows x kBc tokens per MMA tile ----
    const uint32_t k_addr = (C::kDeqK ? s_base + C::kKs : raw_s) + k_off;
    const uint32_t v_addr = (C::kDeqV ? s_base + C::kVs : raw_s + C::kRawK) + v_off;
    float s[kMT][kBc / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j)
        s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
    if constexpr (kReg8K) {
      // One ldmatrix: 4 n-tiles (32 tokens) x one k-step of bytes (16 dims).
#pragma unroll
      for (int ks = 0; ks < HD / 16; ++ks) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
          ldsm_x4(q_addr + mt * 16 * kRowStride + 32 * ks, a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
#pragma unroll
        for (int n4 = 0; n4 < kBc / 32; ++n4) {
          uint32_t w[4];
          ldsm_x4(k_addr + n4 * 32 * kKPitch + 16 * ks, w[0], w[1], w[2], w[3]);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint32_t b0 = cvt8_pair01<DK>(w[q]), b1 = cvt8_pair01<DK>(w[q] >> 16);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
              mma<false>(s[mt][4 * n4 + q], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
          }
        }
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < HD / 16; ++ks) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
          ldsm_x4(q_addr + mt * 16 * kRowStride + 32 * ks, a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
#pragma unroll
        for (int np = 0; np < kBc / 16; ++np) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(k_addr + np * 16 * kKPitch + 32 * ks, b0, b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma<C::kBf16K>(s[mt][2 * np], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
            mma<C::kBf16K>(s[mt][2 * np + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
          }
        }
      }
    }

    // ---- logits (log2 units), mask, online softmax ----
    const bool need_mask = !(t0 >= all_lo && t0 + kBc <= all_hi);
    float ksc[kBc / 4], kzp[kBc / 4];  // per column 8j + 2c + b: index 2j + b
    if constexpr (C::kMetaK) {
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j)
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const uint32_t w = meta(C::kRawMetaK, 8 * j + 2 * c + b);
          if constexpr (C::kInt4K) {
            const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&w));
            ksc[2 * j + b] = sz.x;
            kzp[2 * j + b] = sz.y;
          } else {
            ksc[2 * j + b] = __uint_as_float(w);
          }
        }
    }
    float mx[kLR];
#pragma unroll
    for (int i = 0; i < kLR; ++i) mx[i] = -__uint_as_float(kF32Inf);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 2 * mt + (e >> 1);
          float x = s[mt][j][e];
          if constexpr (C::kInt4K) {
            x = fmaf(x, ksc[2 * j + (e & 1)], kzp[2 * j + (e & 1)] * qsm[i]);
          } else if constexpr (C::kMetaK) {
            x *= ksc[2 * j + (e & 1)];
          }
          x *= fac[i];
          if (capped) x = cap * tanhf(x * inv_cap) * kLog2e;
          s[mt][j][e] = x;
        }
      }
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < kLR; ++i) {
        const int pos = row_pos(i);
        const int rlo = sliding ? pos - p.window + 1 : 0;
        const int rhi = noncausal ? kv_len : pos + 1;
#pragma unroll
        for (int j = 0; j < kBc / 8; ++j)
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int tok = t0 + 8 * j + 2 * c + b;
            if (!(tok >= rlo && tok < rhi))
              s[i >> 1][j][2 * (i & 1) + b] = -__uint_as_float(kF32Inf);
          }
      }
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          mx[2 * mt + (e >> 1)] = fmaxf(mx[2 * mt + (e >> 1)], s[mt][j][e]);
    float corr[kLR], mu[kLR], rs[kLR];
#pragma unroll
    for (int i = 0; i < kLR; ++i) {
      rs[i] = 0.0f;
      const float m_new = fmaxf(m[i], quad_max(mx[i]));
      mu[i] = m_new == -__uint_as_float(kF32Inf) ? 0.0f : m_new;
      corr[i] = fast_exp2(m[i] - mu[i]);
      m[i] = m_new;
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[mt][j][e] = fast_exp2(s[mt][j][e] - mu[2 * mt + (e >> 1)]);
          rs[2 * mt + (e >> 1)] += s[mt][j][e];
        }
      }
#pragma unroll
    for (int i = 0; i < kLR; ++i) l[i] = l[i] * corr[i] + rs[i];

    if constexpr (C::kMetaV) {
      // P *= s_v(token) / (running max of s_v): fp16 P stays in [0, 1].
      auto vscale = [&](int col) -> float2 {
        const uint32_t w = meta(C::kRawMetaV, col);
        if constexpr (C::kInt4V)
          return __half22float2(*reinterpret_cast<const __half2*>(&w));
        else
          return make_float2(__uint_as_float(w), 0.0f);
      };
      float vmx = vscale(lane).x;
      if constexpr (kBc > 32) vmx = fmaxf(vmx, vscale(lane + 32).x);
      vmx = warp_max(vmx);
      const float s_new = fmaxf(s_run, vmx);
      const float inv_s = s_new > 0.0f ? 1.0f / s_new : 0.0f;
      float zs[kLR];
#pragma unroll
      for (int i = 0; i < kLR; ++i) zs[i] = 0.0f;
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j)
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const float2 sz = vscale(8 * j + 2 * c + b);
          const float f = sz.x * inv_s;
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              if constexpr (C::kInt4V) zs[2 * mt + hf] += s[mt][j][2 * hf + b] * sz.y;
              s[mt][j][2 * hf + b] *= f;
            }
        }
      const float rescale = s_new > 0.0f && s_new != s_run ? s_run * inv_s : 1.0f;
#pragma unroll
      for (int i = 0; i < kLR; ++i) {
        if constexpr (C::kInt4V) zacc[i] = zacc[i] * corr[i] + zs[i];
        corr[i] *= rescale;
      }
      s_run = s_new;
    }

    // ---- O = O * corr + P V (the rescale skipped when no row of the warp needs it: once the
    //      running maxima settle, most tiles) ----
    bool rescale_o = false;
#pragma unroll
    for (int i = 0; i < kLR; ++i) rescale_o |= corr[i] != 1.0f;
    if (__any_sync(kFullMask, rescale_o))
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
          o[mt][j][0] *= corr[2 * mt];
          o[mt][j][1] *= corr[2 * mt];
          o[mt][j][2] *= corr[2 * mt + 1];
          o[mt][j][3] *= corr[2 * mt + 1];
        }
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = pack2<C::kBf16V>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<C::kBf16V>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<C::kBf16V>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<C::kBf16V>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
      if constexpr (kReg8V) {
        // One transposed ldmatrix: 16 tokens x 32 dims of bytes. Lane (g, c) gets tokens
        // (2c, 2c + 1) x dims (2g, 2g + 1) per 8 x 16 block: n-tile 4dq + q holds dims
        // 32dq + 16 (q / 2) + 2n + (q % 2), so lane c's outputs are 4 adjacent dims.
#pragma unroll
        for (int dq = 0; dq < HD / 32; ++dq) {
          uint32_t w[4];
          ldsm_x4_trans(v_addr + kk * 16 * kVPitch + 32 * dq, w[0], w[1], w[2], w[3]);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint32_t lo16 = w[2 * (q >> 1)] >> (8 * (q & 1));
            const uint32_t hi16 = w[2 * (q >> 1) + 1] >> (8 * (q & 1));
            const uint32_t b0 = cvt8_pair02<DV>(lo16), b1 = cvt8_pair02<DV>(hi16);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
              mma<false>(o[mt][4 * dq + q], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
          }
        }
      } else {
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_trans(v_addr + kk * 16 * kVPitch + 32 * dp, b0, b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma<C::kBf16V>(o[mt][2 * dp], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
            mma<C::kBf16V>(o[mt][2 * dp + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
          }
        }
      }
    }
  }

  // ---- epilogue: normalize, scale, (un-rotate), write ----
  float scale_o = 1.0f;
  if constexpr (tensor_scaled(DV)) scale_o = p.v.tensor_scale[kvh];
  if constexpr (C::kMetaV) scale_o = s_run;
  float inv_l[kLR], zt[kLR];
  const bool partial = p.num_splits > 1;
#pragma unroll
  for (int i = 0; i < kLR; ++i) {
    const float lsum = quad_sum(l[i]);
    // A split's output stays unnormalized; its (max, sum) go with it.
    inv_l[i] = partial ? 1.0f : 1.0f / lsum;
    zt[i] = C::kInt4V ? quad_sum(zacc[i]) : 0.0f;
    if (partial && c == 0) {
      const int r = r0 + warp * kWarpRows + 16 * (i >> 1) + g + 8 * (i & 1);
      if (r < rows_total)
        p.part_ml[static_cast<size_t>(split) * p.part_rows + row_index(r)] =
            make_float2(m[i], lsum);
    }
  }
  // Where row r's output goes: out, or this split's partial.
  auto out_row = [&](int r) -> float* {
    const size_t at = static_cast<size_t>(row_index(r)) * HD;
    return partial ? p.part_o + static_cast<size_t>(split) * p.part_rows * HD + at : p.out + at;
  };
  // Output dims of accumulator o[mt][j][2 hf + b]: 8j + 2c + b, or for a Reg8 V (pairs of
  // n-tiles 2u, 2u + 1) 16u + 4c + 2b + (j % 2).
  if constexpr (!C::kRotV) {
#pragma unroll
    for (int i = 0; i < kLR; ++i) {
      const int mt = i >> 1, hf = i & 1;
      const int r = r0 + warp * kWarpRows + 16 * mt + g + 8 * hf;
      if (r >= rows_total) continue;
      float* dst = out_row(r);
      auto fin = [&](float x) { return (x * scale_o + zt[i]) * inv_l[i]; };
      if constexpr (kReg8V) {
#pragma unroll
        for (int u = 0; u < HD / 16; ++u)
          *reinterpret_cast<float4*>(dst + 16 * u + 4 * c) =
              make_float4(fin(o[mt][2 * u][2 * hf]), fin(o[mt][2 * u + 1][2 * hf]),
                          fin(o[mt][2 * u][2 * hf + 1]), fin(o[mt][2 * u + 1][2 * hf + 1]));
      } else {
#pragma unroll
        for (int j = 0; j < HD / 8; ++j)
          *reinterpret_cast<float2*>(dst + 8 * j + 2 * c) =
              make_float2(fin(o[mt][j][2 * hf]), fin(o[mt][j][2 * hf + 1]));
      }
    }
  } else {
    static_assert(!kReg8V, "a rotated V is 4-bit (dequantized in shared memory)");
    constexpr int E = HD / 32;
    __syncthreads();  // every warp is done with the operand tiles this staging reuses
    float* epi = reinterpret_cast<float*>(smem) + warp * kWarpRows * C::kEpiStride;
#pragma unroll
    for (int i = 0; i < kLR; ++i) {
      const int mt = i >> 1, hf = i & 1;
#pragma unroll
      for (int j = 0; j < HD / 8; ++j)
        *reinterpret_cast<float2*>(epi + (16 * mt + g + 8 * hf) * C::kEpiStride + 8 * j + 2 * c) =
            make_float2((o[mt][j][2 * hf] * scale_o + zt[i]) * inv_l[i],
                        (o[mt][j][2 * hf + 1] * scale_o + zt[i]) * inv_l[i]);
    }
    __syncwarp();
    for (int rr = 0; rr < kWarpRows; ++rr) {
      const int r = r0 + warp * kWarpRows + rr;
      if (r >= rows_total) break;  // warp-uniform
      float x[E];
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = epi[rr * C::kEpiStride + lane * E + e];
      warp_hadamard_unrotate<E>(x, lane, p.signs);
      float* dst = out_row(r) + lane * E;
#pragma unroll
      for (int e = 0; e < E; ++e) dst[e] = x[e];
    }
  }
}

template <KvDtype DK, KvDtype DV, int HD, int kRowsPerBlock>
void launch_rows(const PrefillKernelParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int kSmem = Cfg<DK, DV, HD, kRowsPerBlock>::kSmem;
  auto* kernel = &prefill_kernel<DK, DV, HD, kRowsPerBlock>;
  KVQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  KVQ_CUDA_CHECK_LAUNCH();
}

// The block shape the plan chose (p.rows_per_block): the default or, where the head_dim has
// one, the small-q shape.
template <KvDtype DK, KvDtype DV, int HD>
void launch_hd(const PrefillKernelParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int kSmall = prefill_small_q_rows(HD);
  if constexpr (kSmall > 0) {
    if (p.rows_per_block == kSmall) return launch_rows<DK, DV, HD, kSmall>(p, grid, stream);
  }
  KVQ_CHECK(p.rows_per_block == prefill_rows_per_block(HD),
            "cuda prefill: no kernel with " + std::to_string(p.rows_per_block) +
                " query rows per block at head_dim " + std::to_string(HD));
  launch_rows<DK, DV, HD, prefill_rows_per_block(HD)>(p, grid, stream);
}

}  // namespace prefill_detail

}  // namespace kvq::cuda
