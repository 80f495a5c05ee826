// The verification kernel: attention of a few query tokens per sequence over a long cached
// context (speculative decoding's k + 1 tokens), where every (sequence, kv head) has at most 32
// query rows (tokens x the GQA group). Included only by prefill_launch.cuh;
// docs/notes/prefill-tuning.md (v17) has the design and what it measured.
//
// The prefill kernels put query rows on the MMA rows: with 32 live rows a 64-row tile is half
// padding, and every warp that owns rows converts each K / V value again. Here the product is
// transposed, as in the one-query decode kernel: S^T = K Q^T and O^T = V^T P^T, so the kv tokens
// are the MMA rows (16 a slice) and all 32 query rows are the MMA columns (4 n-tiles of 8).
// Block: 4 warps own (sequence, kv head, 32 rows, a split's kv tiles); per 64-token kv tile
// warp w takes tokens 16w .. 16w + 15 (VCfg::kCH = 2 would give warps w and w + 4 the same
// tokens for rows 0-15 / 16-31). Each warp converts its slice once for its rows and
// runs its own online softmax over its slices with its own cp.async ring (no block barrier in
// the loop); at the end the four slices' (max, sum, O) merge through shared memory, and with
// split-KV the block writes the same partials as the other prefill kernels.
//
// Operands as in the other kernels: bf16 where a side is bf16, else fp16 (Q with one
// power-of-two scale for the block's rows; 8-bit codes exact in fp16); fp32 accumulation; Q and
// P never fp8. Per-tensor K scales fold into the logit factor (one number for the block), and
// so does it into the per-token K scales, which multiply the logits (the slice's rows);
// per-token V scales multiply P (normalized by a reference V scale that moves lazily, so fp16 P
// stays below 2^15), per-tensor V scales the output. nvfp4's block scales multiply its codes'
// operands in registers (as 2^7 s, exact in fp16; the 2^-7 goes into the logit factor / the
// output scale). Built for 16-bit, 8-bit, int4_per_token_head and nvfp4 sides
// (prefill_verify_pair); fp32 caches keep the small-q block.
#pragma once

#include <type_traits>

#include "attention/cuda/prefill_kernel.cuh"

namespace kvq::cuda {
namespace prefill_verify {

using namespace prefill_detail;  // PTX wrappers, unpacking helpers, PrefillBlock, Q rows

inline constexpr int kVWarps = 4;  // token slices a tile (the warps of one column half)
inline constexpr int kVRows = prefill_verify_rows();  // MMA columns: 4 n-tiles of 8
inline constexpr int kVSlice = 16;                    // kv tokens of one warp per tile
inline constexpr int kVTile = kVWarps * kVSlice;      // kv tokens per block tile
static_assert(kVRows == 32 && kVTile == 64);

// 4- and 8-byte cp.async (per-token metadata: a slice's edge tokens are copied one by one;
// nvfp4 rows of 36 / 72 bytes).
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}

template <KvDtype DK, KvDtype DV, int HD>
struct VCfg {
  static_assert(prefill_verify_pair(DK, DV, HD));
  // Column halves (kCH = 2: two warps a token slice, each for 16 of the 32 query rows, both
  // converting the slice; O^T in 64 registers, 128 a thread, four warps a scheduler) measured
  // slower for int4 / int4 (docs/notes/prefill-tuning.md v20c: +48% instructions for +14 points
  // of issue utilization), so every pair runs one warp a slice; the knob stays for the shapes
  // and dtypes where conversions are cheap against the occupancy they buy.
  static constexpr int kCH = 1;
  static constexpr int kWarps = kVWarps * kCH;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kCols = kVRows / kCH;  // a warp's MMA columns
  static constexpr int kNT = kCols / 8;       // its n-tiles
  static constexpr bool kReg8K = value_bits(DK) == 8;
  static constexpr bool kReg8V = value_bits(DV) == 8;
  // int4_per_token_head: codes ldmatrix'ed as 16-bit units and converted in registers, (scale,
  // zero) as a half2 per token; Q rotated as K was, O un-rotated as V was.
  static constexpr bool kInt4K = DK == KvDtype::kInt4PerTokenHead;
  static constexpr bool kInt4V = DV == KvDtype::kInt4PerTokenHead;
  static constexpr bool kRotK = traits(DK).rotated;
  static constexpr bool kRotV = traits(DV).rotated;
  static_assert(kRotK == kInt4K && kRotV == kInt4V);
  static_assert(!(kInt4K && bf16_operands(DK)), "int4 K's biased operands are fp16");
  // nvfp4: codes ldmatrix'ed as int4's are, E2M1 decoded in registers and multiplied by their
  // 16-value block's e4m3 scale (the row's last HD / 16 bytes) times 2^7.
  static constexpr bool kNvK = DK == KvDtype::kNvfp4;
  static constexpr bool kNvV = DV == KvDtype::kNvfp4;
  static constexpr bool k4K = kInt4K || kNvK;  // 4-bit codes: int4's layout of the operands
  static constexpr bool k4V = kInt4V || kNvV;
  static constexpr bool kBf16K = bf16_operands(DK);
  static constexpr bool kBf16V = bf16_operands(DV);
  static constexpr bool kMetaK = row_scaled(DK);
  static constexpr bool kMetaV = row_scaled(DV);
  static constexpr int kRowK = row_bytes(DK, HD);
  static constexpr int kRowV = row_bytes(DV, HD);
  // Rows an odd multiple of 16 B apart: the 8 rows an ldmatrix reads fall in distinct banks
  // (+16 B where a row is a multiple of 32 B; nvfp4's 72 / 36 B rows at 80 / 48).
  static constexpr int pitch(int row) { return row % 16 == 0 ? row + 16 : (row + 15) / 16 * 16; }
  static constexpr int kPitchK = pitch(kRowK);
  static constexpr int kPitchV = pitch(kRowV);
  static_assert(kPitchK / 16 % 2 == 1 && kPitchV / 16 % 2 == 1 && kPitchK % 16 == 0 &&
                kPitchV % 16 == 0);
  static constexpr int kQStride = HD + 8;  // 16-bit elements per Q row (ldmatrix, as above)
  // One warp's slice in its ring: K rows, V rows, K scales, V scales.
  static constexpr int kSliceV = kVSlice * kPitchK;
  static constexpr int kSliceMetaK = kSliceV + kVSlice * kPitchV;
  static constexpr int kSliceMetaV = kSliceMetaK + (kMetaK ? 4 * kVSlice : 0);
  static constexpr int kSlice = kSliceMetaV + (kMetaV ? 4 * kVSlice : 0);
  static constexpr int kQ = 0;
  static constexpr int kRowMax = kQ + kVRows * kQStride * 2;  // per row: max |q| (the Q scale's)
  static constexpr int kRowQsum = kRowMax + 4 * kVRows;       // per row: the sum of its Q operands
  // int4 K: per row -1024 x the sum of its (scaled) Q operands, the logits' initial value.
  static constexpr int kRowQbias = kRowQsum + 4 * kVRows;
  static constexpr int kRing = kRowQbias + (kInt4K ? 4 * kVRows : 0);
  // Four slices a warp in flight where two blocks an SM still fit, else three.
  static constexpr int kStages = kRing + kWarps * 4 * kSlice <= 110 * 1024 ? 4 : 3;
  static constexpr int kMain = kRing + kWarps * kStages * kSlice;
  // The merge (reuses everything): each token slice's O^T as [row][HD + 4] fp32 (a column
  // half's warp writes its rows), then (max, sum).
  static constexpr int kOStride = HD + 4;
  static constexpr int kMergeMl = kVWarps * kVRows * kOStride * 4;
  static constexpr int kMerge = kMergeMl + kVWarps * kVRows * 8;
  static constexpr int kSmem = cmax(kMain, kMerge);
  static_assert(kRowMax % 16 == 0 && kRowQsum % 16 == 0 && kRowQbias % 16 == 0 && kRing % 16 == 0 &&
                kSlice % 16 == 0 && kSliceV % 16 == 0);
  static_assert(kSmem <= 113 * 1024, "two blocks an SM");
};

// Copies the kVSlice rows (kRow bytes each, kPitch apart in shared memory) of one warp's slice
// starting at row `row` of a cache block (`block`: that block's rows of one kv head). kWhole: every
// token of the slice is in [lo, hi); else the rows of tokens outside it are zeroed instead.
// 16-byte copies where rows are a multiple of 16 bytes, else 8 or 4 (nvfp4).
template <int kRow, int kPitch, bool kWhole>
__device__ __forceinline__ void copy_slice_rows(uint32_t dst, const uint8_t* block, int row, int t0,
                                                int lo, int hi, int lane) {
  constexpr int kChunk = kRow % 16 == 0 ? 16 : kRow % 8 == 0 ? 8 : 4;
  constexpr int kPer = kRow / kChunk, kN = kVSlice * kPer;
  static_assert(kRow % kChunk == 0);
  const uint8_t* src = block + static_cast<uint64_t>(row) * kRow;
#pragma unroll
  for (int k = 0; k < (kN + 31) / 32; ++k) {
    const int ch = lane + 32 * k, t = ch / kPer, w = ch - t * kPer;
    if (kN % 32 != 0 && ch >= kN) break;
    const uint32_t d = dst + t * kPitch + kChunk * w;
    const void* from = src + t * kRow + kChunk * w;
    if (kWhole || (t0 + t >= lo && t0 + t < hi)) {
      if constexpr (kChunk == 16)
        cp_async16(d, from);
      else if constexpr (kChunk == 8)
        cp_async8(d, from);
      else
        cp_async4(d, from);
    } else if constexpr (kChunk == 16) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(d), "r"(0u) : "memory");
    } else if constexpr (kChunk == 8) {
      asm volatile("st.shared.v2.u32 [%0], {%1, %1};\n" ::"r"(d), "r"(0u) : "memory");
    } else {
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(d), "r"(0u) : "memory");
    }
  }
}

// The kVSlice per-token scales (4 bytes each, `src`: the slice's first) into `at`: a whole
// slice as four 16-byte copies, an edge slice token by token (zeros outside [lo, hi)).
template <bool kWhole>
__device__ __forceinline__ void copy_slice_meta(uint32_t at, const uint8_t* src, int t0, int lo,
                                                int hi, int lane) {
  if constexpr (kWhole) {
    if (lane < kVSlice / 4) cp_async16(at + 16 * lane, src + 16 * lane);
  } else if (lane < kVSlice) {
    const int tok = t0 + lane;
    if (tok >= lo && tok < hi)
      cp_async4(at + 4 * lane, src + 4 * lane);
    else
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at + 4 * lane), "r"(0u) : "memory");
  }
}

// Online softmax with a lazy maximum: a column's reference maximum moves only where the slice's
// maximum exceeds it by more than this (log2 units), so most slices skip the O^T rescale; P is
// then at most 2^8, which fp16 / bf16 hold with the same relative precision.
inline constexpr float kMaxSlack = 8.0f;
// A column's reference maximum before any logit: finite, so exp2(-inf - kNoMax) = 0 for masked
// logits and any real logit passes it by more than kMaxSlack; a column that saw nothing keeps
// l = 0, which the merges read as "nothing seen".
inline constexpr float kNoMax = -1e30f;
// Row-scaled V: the reference V scale moves only where a token's scale exceeds it by more than
// this factor, so P' = P s / s_ref < 2^8 x 2^7 = 2^15 stays inside fp16 (max 65504) and most
// slices skip O^T's rescale for it.
inline constexpr float kVScaleSlack = 128.0f;

// int4 K: the stored column of Q's dim d. An ldmatrix of K's rows as 16-bit units hands lane
// (g, c) bytes 4c .. 4c + 3 of a 32-dim group, dims 8c + k (k = 0..7, low nibble first); the
// decoders take them in the pairs (k, k + 4), k = 0..3, and pair k is k-step k / 2 of the
// group, MMA k index 2c + 8 (k % 2) (+ 1 for k + 4).
__device__ __forceinline__ int q_col_reg4(int d) {
  const int k = d & 7, c = (d >> 3) & 3;
  return (d & ~31) + 16 * ((k >> 1) & 1) + 2 * c + 8 * (k & 1) + (k >> 2);
}
// Nibbles j of both 16-bit halves of w (bits 4j .. 4j + 3 and 16 + 4j ..; `w8` = w >> 8) as
// f16x2 of code + 1024 for even j, 16 x code + 1024 for odd j (masked in place, no shift): one
// LOP3 a pair with the exponent bits in a register (`magic`, int4_magic()). Exact.
template <int kJ>
__device__ __forceinline__ uint32_t int4_nib_biased(uint32_t w, uint32_t w8, uint32_t magic) {
  static_assert(kJ >= 0 && kJ < 4);
  const uint32_t t = kJ >= 2 ? w8 : w;
  return (kJ & 1) ? and_or<0x00F000F0u>(t, magic) : and_or<0x000F000Fu>(t, magic);
}
// The same, without the bias: the unsigned codes (one HADD2 or HFMA2 more a pair).
template <int kJ>
__device__ __forceinline__ uint32_t int4_nib_pair(uint32_t w, uint32_t w8, uint32_t magic) {
  const uint32_t b = int4_nib_biased<kJ>(w, w8, magic);
  if constexpr (kJ & 1)
    return hfma2_bits(b, 0x2C002C00u, 0xD400D400u);  // x / 16 - 64 (0x2C00 = 1/16, 0xD400 = -64)
  else
    return hsub2_bits(b, 1024.0f);
}

// nvfp4: the E2M1 codes in nibble kJ of both 16-bit halves of w times s2 (nv_scale2): value x
// scale x 2^-7, exact in fp16 (e2m1_pair_scaled).
template <int kJ>
__device__ __forceinline__ uint32_t e2m1_nib_scaled(uint32_t w, uint32_t s2) {
  return e2m1_pair_scaled(w >> (4 * kJ), s2);
}
// Two e4m3 block scales, the bytes of {a, b} (byte_perm's numbering: 0-3 a, 4-7 b) that sel's
// two low nibbles pick, as a half2 of each x 2^7 (nvfp4_scale2_x128).
__device__ __forceinline__ uint32_t nv_scale2(uint32_t a, uint32_t b, uint32_t sel) {
  return nvfp4_scale2_x128(__byte_perm(a, b, sel));
}
// A token's nvfp4 block scales (HD / 16 bytes after its codes in the staged row) as words.
template <int HD>
__device__ __forceinline__ void nv_row_scales(const uint8_t* row, uint32_t (&w)[HD / 64]) {
  if constexpr (HD == 128) {
    const uint2 v = *reinterpret_cast<const uint2*>(row + HD / 2);
    w[0] = v.x;
    w[1] = v.y;
  } else {
    static_assert(HD == 64);
    w[0] = *reinterpret_cast<const uint32_t*>(row + HD / 2);
  }
}

template <KvDtype DK, KvDtype DV, int HD>
__global__ void __launch_bounds__(VCfg<DK, DV, HD>::kThreads, 2)
    prefill_verify_kernel(const __grid_constant__ PrefillKernelParams p) {
  using C = VCfg<DK, DV, HD>;
  constexpr int kS = C::kStages;
  constexpr int kMT = HD / 16;  // m-tiles of O^T (16 dims each)
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  // This warp's token slice of each tile and its columns (query rows col0 .. col0 + kCols - 1).
  const int sw = warp % kVWarps, col0 = C::kCols * (warp / kVWarps);
  constexpr int kVNT = C::kNT;
  const int g = lane >> 2, c = lane & 3;
  PrefillBlock blk;
  if (!prefill_block(p, kVRows, kVTile, C::kThreads, blk)) return;
  const int kvh = blk.kvh, r0 = blk.r0, rows_total = blk.rows_total;
  const int lo = blk.lo, hi = blk.hi, all_lo = blk.all_lo, all_hi = blk.all_hi;
  const int tile_b = blk.tile_b, tile_e = blk.tile_e;
  // A column half past the block's last row (a sequence of 16 rows or fewer, e.g. 4 tokens x 4
  // heads) copies and computes nothing: its columns are never merged (warp-uniform).
  const bool live = r0 + col0 < rows_total;
  const int tile_stop = live ? tile_e : tile_b;

  const int32_t* blocks = p.indices + p.indptr[blk.seq];
  const uint8_t* k_head = p.k.base + static_cast<uint64_t>(kvh) * p.k.head_stride;
  const uint8_t* v_head = p.v.base + static_cast<uint64_t>(kvh) * p.v.head_stride;
  const uint32_t s_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t ring_s = s_base + C::kRing + warp * kS * C::kSlice;

  // The next slice this warp copies (its tiles are issued in order): its cache block's index in
  // the table and row there, advanced by a tile a call without a division, and that block's id,
  // loaded a call ahead so no copy waits on it. A slice never crosses a cache block.
  int n_b, n_row;
  {
    const int t_first = tile_b * kVTile + kVSlice * sw;
    n_b = t_first / p.block_tokens;
    n_row = t_first - n_b * p.block_tokens;
  }
  auto id_of = [&](int tile) {
    const int t0 = tile * kVTile + kVSlice * sw;
    return tile < tile_e && t0 < hi ? __ldg(blocks + n_b) : 0;
  };
  int32_t n_id = id_of(tile_b);
  int issue_stage = 0;
  // This warp's slice of tile `tile` (the next in order) into ring stage (tile - tile_b) % kS:
  // rows outside [lo, hi) are zeroed (P is 0 there, but 0 x NaN is not); one cp.async group a
  // call.
  auto issue = [&](int tile) {
    const int t0 = tile * kVTile + kVSlice * sw;
    if (tile < tile_e && t0 < hi && t0 + kVSlice > lo) {
      const uint32_t dst = ring_s + issue_stage * C::kSlice;
      const uint64_t block = static_cast<uint64_t>(n_id);
      const uint8_t* kb = k_head + block * p.k.block_bytes;
      const uint8_t* vb = v_head + block * p.v.block_bytes;
      const int row = n_row;
      auto copy = [&](auto whole) {
        constexpr bool kW = decltype(whole)::value;
        copy_slice_rows<C::kRowK, C::kPitchK, kW>(dst, kb, row, t0, lo, hi, lane);
        copy_slice_rows<C::kRowV, C::kPitchV, kW>(dst + C::kSliceV, vb, row, t0, lo, hi, lane);
        if constexpr (C::kMetaK)
          copy_slice_meta<kW>(dst + C::kSliceMetaK,
                              kb + p.k.values_bytes + static_cast<uint64_t>(row) * 4, t0, lo, hi,
                              lane);
        if constexpr (C::kMetaV)
          copy_slice_meta<kW>(dst + C::kSliceMetaV,
                              vb + p.v.values_bytes + static_cast<uint64_t>(row) * 4, t0, lo, hi,
                              lane);
      };
      if (t0 >= lo && t0 + kVSlice <= hi)  // warp-uniform
        copy(std::true_type{});
      else
        copy(std::false_type{});
    }
    cp_async_commit();
    issue_stage = issue_stage + 1 == kS ? 0 : issue_stage + 1;
    n_row += kVTile;
    while (n_row >= p.block_tokens) n_row -= p.block_tokens, ++n_b;  // warp-uniform
    n_id = id_of(tile + 1);
  };
#pragma unroll
  for (int st = 0; st < kS - 1; ++st)
    if (live) issue(tile_b + st);

  // ---- Q: 32 / kWarps rows a warp as 16-bit operands (rotated for a rotated K; an 8-bit K's dim
  //      permutation q_col_reg8, a 4-bit K's q_col_reg4), one power-of-two scale for all 32
  //      rows (from their largest |q|: no row's absolute error grows past the largest row's),
  //      so the logits' factor is one number and folds into the per-token K scales ----
  float* rqsum = reinterpret_cast<float*>(smem + C::kRowQsum);
  float* rmax = reinterpret_cast<float*>(smem + C::kRowMax);
  float fac;  // logit factor: softmax scale x per-tensor K scale / Q's scale (x log2 e uncapped)
  {
    constexpr int E = HD / 32;
    constexpr int kWarpRows = kVRows / C::kWarps;
    uint16_t* qs = reinterpret_cast<uint16_t*>(smem + C::kQ);
    float xs[kWarpRows][E];
    load_q_rows<HD, kWarpRows>(xs, p, blk.q_start, kvh, r0 + warp * kWarpRows, rows_total, lane);
#pragma unroll
    for (int j = 0; j < kWarpRows; ++j) {
      if constexpr (C::kRotK) warp_hadamard_rotate<E>(xs[j], lane, p.signs);
      const float amax = warp_finite_amax(xs[j]);
      if (lane == 0) rmax[warp * kWarpRows + j] = amax;
    }
    __syncthreads();
    float bmax = 0.0f;
#pragma unroll
    for (int r = 0; r < kVRows; r += 4) {
      const float4 v = *reinterpret_cast<const float4*>(rmax + r);
      bmax = fmaxf(bmax, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
    }
    const float qa = q_operand_scale<C::kBf16K>(bmax);
    // nvfp4 K: its operands are value x scale x 2^-7 (e2m1_nib_scaled).
    fac = p.softmax_scale * p.k.tensor_scale[kvh] / qa * (p.soft_cap != 0.0f ? 1.0f : kLog2e) *
          (C::kNvK ? 128.0f : 1.0f);
#pragma unroll
    for (int j = 0; j < kWarpRows; ++j) {
      const int lr = warp * kWarpRows + j;
      float even = 0.0f;  // int4 K: the sum of the even-k dims' operands (stored x 16)
      const float qsum = pack_q_row_at<C::kBf16K>(xs[j], qa, [&](int e, uint32_t pr) {
        const int d = lane * E + e;
        if constexpr (C::k4K) {
          // A pair's dims are not adjacent columns. int4: d is even, so its k = d % 8 is: K's
          // even-k codes come as code + 1024, the odd as 16 x code + 1024 (int4_nib_biased);
          // Q's even-k operand x 16 (exact) makes every product 16 q code + 1024 q'.
          if constexpr (C::kInt4K) {
            even += __low2float(*reinterpret_cast<const __half2*>(&pr));
            pr = hmul2_bits(pr, 0x3C004C00u);  // (x 16, x 1)
          }
          qs[lr * C::kQStride + q_col_reg4(d)] = static_cast<uint16_t>(pr);
          qs[lr * C::kQStride + q_col_reg4(d + 1)] = static_cast<uint16_t>(pr >> 16);
        } else {
          const int col = C::kReg8K ? q_col_reg8(d) : d;
          *reinterpret_cast<uint32_t*>(qs + lr * C::kQStride + col) = pr;
        }
      });
      if constexpr (C::kInt4K) even = warp_sum(even);
      if (lane == 0) {
        rqsum[lr] = qsum;
        // The bias 1024 x (sum of the stored operands) that the logits start from, negated.
        if constexpr (C::kInt4K)
          reinterpret_cast<float*>(smem + C::kRowQbias)[lr] = -1024.0f * (qsum + 15.0f * even);
      }
    }
  }
  __syncthreads();

  // Per lane: the columns (query rows) col0 + 8 nt + 2c + b of its accumulators, index
  // j = 2 nt + b.
  const bool capped = p.soft_cap != 0.0f;
  const float cap = p.soft_cap, inv_cap = capped ? 1.0f / p.soft_cap : 0.0f;
  float m[2 * kVNT], l[2 * kVNT];
  // int4 K: per column the sum of its Q operands (the zero point's logit term); int4 V: per
  // column sum_t P'(t) z(t) / s(t) over this lane's tokens (the zero point's output term, in the
  // units of P' = P s / s_run, rescaled with O^T).
  [[maybe_unused]] float qsm[C::kInt4K ? 2 * kVNT : 1], zacc[C::kInt4V ? 2 * kVNT : 1];
#pragma unroll
  for (int j = 0; j < 2 * kVNT; ++j) {
    const int col = col0 + 8 * (j >> 1) + 2 * c + (j & 1);
    if constexpr (C::kInt4K) qsm[j] = rqsum[col];
    if constexpr (C::kInt4V) zacc[j] = 0.0f;
    m[j] = kNoMax;
    l[j] = 0.0f;
  }
  // The visible range of column j, recomputed where a slice needs masking.
  auto col_pos = [&](int j) {
    const int col = col0 + 8 * (j >> 1) + 2 * c + (j & 1);
    return blk.first_pos + min(r0 + col, rows_total - 1) / p.ratio;
  };
  float s_run = 0.0f, inv_s = 0.0f;  // the per-token V scales' reference maximum, 1 / it
  float o[kMT][kVNT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kVNT; ++nt)
      o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.0f;

  // ldmatrix lane addresses: Q rows as B (n-tile pairs), K rows as A, V rows as A^T.
  constexpr int kQRow = C::kQStride * 2;
  const uint32_t q_addr =
      s_base + C::kQ + (col0 + (lane & 7) + 8 * (lane >> 4)) * kQRow + 16 * ((lane >> 3) & 1);
  const uint32_t k_off = ((lane & 7) + 8 * ((lane >> 3) & 1)) * C::kPitchK + 16 * (lane >> 4);
  const uint32_t v_off = C::kReg8V
                             ? ((lane & 7) + 8 * ((lane >> 3) & 1)) * C::kPitchV + 16 * (lane >> 4)
                             : ((lane & 7) + 8 * (lane >> 4)) * C::kPitchV + 16 * ((lane >> 3) & 1);

  // int4: the decoders' exponent bits in a register (one LOP3 a pair).
  [[maybe_unused]] const uint32_t magic = (C::kInt4K || C::kInt4V) ? int4_magic() : 0u;
  // nvfp4 V: byte_perm selectors of the block scales (nv_scale2) of this lane's rows g / g + 8.
  [[maybe_unused]] const uint32_t nv_sel_lo = (g >> 2) | ((4 + (g >> 2)) << 4);
  [[maybe_unused]] const uint32_t nv_sel_hi = (2 + (g >> 2)) | ((6 + (g >> 2)) << 4);
  [[maybe_unused]] const float2* qbias = reinterpret_cast<const float2*>(smem + C::kRowQbias);

  int stage = 0;  // (tile - tile_b) % kS
#pragma unroll 1
  for (int tile = tile_b; tile < tile_stop; ++tile, stage = stage + 1 == kS ? 0 : stage + 1) {
    cp_async_wait<kS - 2>();
    __syncwarp();  // this slice's bytes landed for the whole warp; the last slice is read
    issue(tile + kS - 1);
    const int t0 = tile * kVTile + kVSlice * sw;
    if (!(t0 < hi && t0 + kVSlice > lo)) continue;  // warp-uniform
    const uint32_t buf = ring_s + stage * C::kSlice;
    const uint8_t* bufp = smem + (buf - s_base);

    // ---- S^T = K Q^T: 16 tokens x kCols rows ----
    // int4 K: the accumulators start at the columns' -1024 x (sum of Q operands), so the MMAs
    // leave 16 (Q . code) (see int4_nib_biased).
    float s[kVNT][4];
#pragma unroll
    for (int nt = 0; nt < kVNT; ++nt) {
      if constexpr (C::kInt4K) {
        const float2 b = qbias[col0 / 2 + 4 * nt + c];
        s[nt][0] = s[nt][2] = b.x;
        s[nt][1] = s[nt][3] = b.y;
      } else {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      }
    }
    [[maybe_unused]] uint32_t k4[4];  // 4-bit K: the ldmatrix of two groups
    // nvfp4 K: the block scales of this lane's tokens g, g + 8.
    [[maybe_unused]] uint32_t ksc[2][HD / 64];
    if constexpr (C::kNvK) {
      nv_row_scales<HD>(bufp + g * C::kPitchK, ksc[0]);
      nv_row_scales<HD>(bufp + (g + 8) * C::kPitchK, ksc[1]);
    }
#pragma unroll
    for (int kp = 0; kp < HD / 32; ++kp) {
      uint32_t ka[2][4];
      if constexpr (C::kNvK) {
        // As int4's below; the lane's dims 8c .. 8c + 7 of group kp are in block 2 kp + c / 2.
        if (kp % 2 == 0) ldsm_x4(buf + k_off + 16 * kp, k4[0], k4[1], k4[2], k4[3]);
        const uint32_t x = k4[2 * (kp % 2)], y = k4[2 * (kp % 2) + 1];
        const uint32_t sel = 0x11u * (2 * (kp % 2) + (c >> 1));
        const uint32_t sx = nv_scale2(ksc[0][kp / 2], 0u, sel);
        const uint32_t sy = nv_scale2(ksc[1][kp / 2], 0u, sel);
        ka[0][0] = e2m1_nib_scaled<0>(x, sx);
        ka[0][1] = e2m1_nib_scaled<0>(y, sy);
        ka[0][2] = e2m1_nib_scaled<1>(x, sx);
        ka[0][3] = e2m1_nib_scaled<1>(y, sy);
        ka[1][0] = e2m1_nib_scaled<2>(x, sx);
        ka[1][1] = e2m1_nib_scaled<2>(y, sy);
        ka[1][2] = e2m1_nib_scaled<3>(x, sx);
        ka[1][3] = e2m1_nib_scaled<3>(y, sy);
      } else if constexpr (C::kInt4K) {
        // One ldmatrix of 16-bit units for two 32-dim groups (kp, kp + 1): tokens g / g + 8,
        // dims 8c .. 8c + 7 of each; group kp's pairs k = 0, 1 are k-step 2 kp, 2, 3 the next.
        static_assert(HD % 64 == 0);
        if (kp % 2 == 0) ldsm_x4(buf + k_off + 16 * kp, k4[0], k4[1], k4[2], k4[3]);
        const uint32_t x = k4[2 * (kp % 2)], y = k4[2 * (kp % 2) + 1];
        const uint32_t x8 = x >> 8, y8 = y >> 8;
        ka[0][0] = int4_nib_biased<0>(x, x8, magic);
        ka[0][1] = int4_nib_biased<0>(y, y8, magic);
        ka[0][2] = int4_nib_biased<1>(x, x8, magic);
        ka[0][3] = int4_nib_biased<1>(y, y8, magic);
        ka[1][0] = int4_nib_biased<2>(x, x8, magic);
        ka[1][1] = int4_nib_biased<2>(y, y8, magic);
        ka[1][2] = int4_nib_biased<3>(x, x8, magic);
        ka[1][3] = int4_nib_biased<3>(y, y8, magic);
      } else if constexpr (C::kReg8K) {
        // One ldmatrix of bytes: tokens g / g + 8, bytes 4c .. 4c + 3 of two 16-dim groups.
        uint32_t w[4];
        ldsm_x4(buf + k_off + 32 * kp, w[0], w[1], w[2], w[3]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const Cvt8Word<DK> x(w[2 * h]), y(w[2 * h + 1]);
          ka[h][0] = x.template pair<0, 1>();
          ka[h][1] = y.template pair<0, 1>();
          ka[h][2] = x.template pair<2, 3>();
          ka[h][3] = y.template pair<2, 3>();
        }
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h)
          ldsm_x4(buf + k_off + 32 * (2 * kp + h), ka[h][0], ka[h][1], ka[h][2], ka[h][3]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int ks = 2 * kp + h;
#pragma unroll
        for (int np = 0; np < kVNT / 2; ++np) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(q_addr + np * 16 * kQRow + 32 * ks, b0, b1, b2, b3);
          mma<C::kBf16K>(s[2 * np], ka[h][0], ka[h][1], ka[h][2], ka[h][3], b0, b1);
          mma<C::kBf16K>(s[2 * np + 1], ka[h][0], ka[h][1], ka[h][2], ka[h][3], b2, b3);
        }
      }
    }

    // ---- logits (log2 units), mask, online softmax per column ----
    // Per-token metadata of this lane's tokens g, g + 8 (int4: (scale, zero) as a half2).
    // sc_mul: a factor on the scale (K: the logit factor; int4 K also 1/16, the products' 16 x).
    auto token_meta = [&](int off, bool int4, float sc_mul, float(&sc)[2], float(&zp)[2]) {
      const uint32_t* mt = reinterpret_cast<const uint32_t*>(bufp + off);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const uint32_t w = mt[g + 8 * hf];
        if (int4) {
          const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&w));
          sc[hf] = sz.x * sc_mul;
          zp[hf] = sz.y;
        } else {
          sc[hf] = __uint_as_float(w) * sc_mul;
        }
      }
    };
    // The logit of accumulator (nt, e) is s[nt][e] kf + kz qsm (int4 K: k = s q + z, so
    // s (Q . q) + z sum(Q); kf holds s fac / 16, kz z fac).
    float kf[2] = {fac, fac}, kz[2] = {0.0f, 0.0f};
    if constexpr (C::kMetaK) {
      token_meta(C::kSliceMetaK, C::kInt4K, C::kInt4K ? fac * 0.0625f : fac, kf, kz);
      if constexpr (C::kInt4K) kz[0] *= fac, kz[1] *= fac;
    }
    const bool edge = !(t0 >= all_lo && t0 + kVSlice <= all_hi);  // warp-uniform
    auto mask = [&](float(&x)[kVNT][4]) {
#pragma unroll
      for (int j = 0; j < 2 * kVNT; ++j) {
        const int pos = col_pos(j);
        const int rlo = blk.sliding ? pos - p.window + 1 : 0;
        const int rhi = blk.noncausal ? blk.kv_len : pos + 1;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int tok = t0 + g + 8 * hf;
          if (!(tok >= rlo && tok < rhi)) x[j >> 1][2 * hf + (j & 1)] = -__uint_as_float(kF32Inf);
        }
      }
    };
    // A logit before the soft cap (log2 units where uncapped).
    auto raw_logit = [&](int nt, int e) {
      const float acc = s[nt][e];
      if constexpr (C::kInt4K) return fmaf(acc, kf[e >> 1], kz[e >> 1] * qsm[2 * nt + (e & 1)]);
      return acc * kf[e >> 1];
    };
    // The logits less their columns' reference maxima (one FFMA each where uncapped; capped:
    // one branch for the slice, not one an element).
    float y[kVNT][4];
    if (!capped) {
#pragma unroll
      for (int nt = 0; nt < kVNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = 2 * nt + (e & 1);
          const float b = C::kInt4K ? fmaf(kz[e >> 1], qsm[j], -m[j]) : -m[j];
          y[nt][e] = fmaf(s[nt][e], kf[e >> 1], b);
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < kVNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          y[nt][e] = fmaf(cap * kLog2e, tanhf(raw_logit(nt, e) * inv_cap), -m[2 * nt + (e & 1)]);
    }
    if (edge) mask(y);
    // Lazy maximum decided by one vote: only where some logit passes its column's reference
    // maximum by more than kMaxSlack are the column maxima reduced (shuffles) and moved (the
    // first slices, mostly); every other slice keeps m and needs no rescale. There the logits
    // are formed again from the accumulators (y is not exact against the first reference).
    bool over = false;
#pragma unroll
    for (int nt = 0; nt < kVNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) over |= y[nt][e] > kMaxSlack;
    bool rescale = __any_sync(kFullMask, over);  // warp-uniform
    float corr[2 * kVNT];
#pragma unroll
    for (int j = 0; j < 2 * kVNT; ++j) corr[j] = 1.0f;
    if (rescale) {
      float x[kVNT][4];
#pragma unroll
      for (int nt = 0; nt < kVNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float v = raw_logit(nt, e);
          x[nt][e] = capped ? cap * kLog2e * tanhf(v * inv_cap) : v;
        }
      if (edge) mask(x);
#pragma unroll
      for (int j = 0; j < 2 * kVNT; ++j) {
        const float mx = col_max(fmaxf(x[j >> 1][j & 1], x[j >> 1][2 + (j & 1)]));
        if (mx - m[j] > kMaxSlack) {  // uniform across the column's lanes
          corr[j] = fast_exp2(m[j] - mx);
          l[j] *= corr[j];  // l before the V scales' factor below (O^T takes both)
          m[j] = mx;
        }
        y[j >> 1][j & 1] = x[j >> 1][j & 1] - m[j];
        y[j >> 1][2 + (j & 1)] = x[j >> 1][2 + (j & 1)] - m[j];
      }
    }
#pragma unroll
    for (int nt = 0; nt < kVNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = fast_exp2(y[nt][e]);
    // Row-scaled V: P *= s_v(token) / s_ref, so fp16 P stays below 2^8 x kVScaleSlack; the
    // reference s_ref moves to the slice's maximum (and O^T with it) only where a vote says a
    // token's scale passed it by more than kVScaleSlack.
    [[maybe_unused]] float pw[2] = {1.0f, 1.0f}, zw[2] = {0.0f, 0.0f};
    if constexpr (C::kMetaV) {
      float vsc[2], vzp[2] = {0.0f, 0.0f};
      token_meta(C::kSliceMetaV, C::kInt4V, 1.0f, vsc, vzp);
      if (__any_sync(kFullMask, fmaxf(vsc[0], vsc[1]) > s_run * kVScaleSlack)) {
        const float s_new = col_max(fmaxf(vsc[0], vsc[1]));  // a token's scale is its lanes'
        inv_s = 1.0f / s_new;                                // s_new > s_run x 128 >= 0
        const float f = s_run * inv_s;
#pragma unroll
        for (int j = 0; j < 2 * kVNT; ++j) corr[j] *= f;
        s_run = s_new;
        rescale = true;
      }
      pw[0] = vsc[0] * inv_s;
      pw[1] = vsc[1] * inv_s;
      if constexpr (C::kInt4V) {
        zw[0] = vzp[0] * inv_s;
        zw[1] = vzp[1] * inv_s;
      }
    }

    // ---- O^T = O^T * corr + V^T P^T (and the int4 V zeros' term with it) ----
    if (rescale) {
      if constexpr (C::kInt4V) {
#pragma unroll
        for (int j = 0; j < 2 * kVNT; ++j) zacc[j] *= corr[j];
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kVNT; ++nt) {
          o[mt][nt][0] *= corr[2 * nt];
          o[mt][nt][1] *= corr[2 * nt + 1];
          o[mt][nt][2] *= corr[2 * nt];
          o[mt][nt][3] *= corr[2 * nt + 1];
        }
    }
#pragma unroll
    for (int j = 0; j < 2 * kVNT; ++j) {
      const float a = s[j >> 1][j & 1], b = s[j >> 1][2 + (j & 1)];
      l[j] += a + b;
      // int4 V (v = s q + z): the zeros' share of O is sum_t P(t) z(t), kept in the units of
      // s_run as O^T is (so rescaled with it).
      if constexpr (C::kInt4V) zacc[j] = fmaf(a, zw[0], fmaf(b, zw[1], zacc[j]));
    }
    if constexpr (C::kMetaV) {
#pragma unroll
      for (int nt = 0; nt < kVNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= pw[e >> 1];
    }
    // P^T as B operands: the C fragment of tokens 0-7 (8-15) transposed.
    uint32_t pb[kVNT][2];
#pragma unroll
    for (int nt = 0; nt < kVNT; ++nt) {
      pb[nt][0] = movmatrix_trans(pack2<C::kBf16V>(s[nt][0], s[nt][1]));
      pb[nt][1] = movmatrix_trans(pack2<C::kBf16V>(s[nt][2], s[nt][3]));
    }
    if constexpr (C::kNvV) {
      // As int4's below. Rows g / g + 8 of the m-tiles 4 jp + j are dims 64 jp + 4g + j / + 32:
      // blocks 4 jp + g / 4 / 4 jp + 2 + g / 4, tokens (2c, 2c + 1) / (2c + 8, 2c + 9).
      uint32_t vs[4][HD / 64];
      nv_row_scales<HD>(bufp + C::kSliceV + (2 * c) * C::kPitchV, vs[0]);
      nv_row_scales<HD>(bufp + C::kSliceV + (2 * c + 1) * C::kPitchV, vs[1]);
      nv_row_scales<HD>(bufp + C::kSliceV + (2 * c + 8) * C::kPitchV, vs[2]);
      nv_row_scales<HD>(bufp + C::kSliceV + (2 * c + 9) * C::kPitchV, vs[3]);
#pragma unroll
      for (int jp = 0; jp < HD / 64; ++jp) {
        uint32_t r[4];
        ldsm_x4_trans(buf + C::kSliceV + v_off + 32 * jp, r[0], r[1], r[2], r[3]);
        const uint32_t s0 = nv_scale2(vs[0][jp], vs[1][jp], nv_sel_lo);
        const uint32_t s1 = nv_scale2(vs[0][jp], vs[1][jp], nv_sel_hi);
        const uint32_t s2 = nv_scale2(vs[2][jp], vs[3][jp], nv_sel_lo);
        const uint32_t s3 = nv_scale2(vs[2][jp], vs[3][jp], nv_sel_hi);
        auto mt4 = [&](auto jc) {
          constexpr int j = decltype(jc)::value;
          const uint32_t a0 = e2m1_nib_scaled<j>(r[0], s0);
          const uint32_t a1 = e2m1_nib_scaled<j>(r[1], s1);
          const uint32_t a2 = e2m1_nib_scaled<j>(r[2], s2);
          const uint32_t a3 = e2m1_nib_scaled<j>(r[3], s3);
#pragma unroll
          for (int nt = 0; nt < kVNT; ++nt)
            mma<false>(o[4 * jp + j][nt], a0, a1, a2, a3, pb[nt][0], pb[nt][1]);
        };
        mt4(std::integral_constant<int, 0>{});
        mt4(std::integral_constant<int, 1>{});
        mt4(std::integral_constant<int, 2>{});
        mt4(std::integral_constant<int, 3>{});
      }
    } else if constexpr (C::kInt4V) {
      // One transposed ldmatrix of 16-bit units (4 dims each) for 64 dims: tokens (2c, 2c + 1)
      // (+ 8) x units g, g + 8. m-tile 4 jp + j's rows g / g + 8 are dims 64 jp + 4g + j /
      // 64 jp + 32 + 4g + j: nibble j of both tokens' units.
#pragma unroll
      for (int jp = 0; jp < HD / 64; ++jp) {
        uint32_t r[4];
        ldsm_x4_trans(buf + C::kSliceV + v_off + 32 * jp, r[0], r[1], r[2], r[3]);
        const uint32_t r8[4] = {r[0] >> 8, r[1] >> 8, r[2] >> 8, r[3] >> 8};
        auto mt4 = [&](auto jc) {
          constexpr int j = decltype(jc)::value;
          const uint32_t a0 = int4_nib_pair<j>(r[0], r8[0], magic);
          const uint32_t a1 = int4_nib_pair<j>(r[1], r8[1], magic);
          const uint32_t a2 = int4_nib_pair<j>(r[2], r8[2], magic);
          const uint32_t a3 = int4_nib_pair<j>(r[3], r8[3], magic);
#pragma unroll
          for (int nt = 0; nt < kVNT; ++nt)
            mma<false>(o[4 * jp + j][nt], a0, a1, a2, a3, pb[nt][0], pb[nt][1]);
        };
        mt4(std::integral_constant<int, 0>{});
        mt4(std::integral_constant<int, 1>{});
        mt4(std::integral_constant<int, 2>{});
        mt4(std::integral_constant<int, 3>{});
      }
    } else if constexpr (C::kReg8V) {
      // One transposed ldmatrix of bytes: tokens (2c, 2c + 1) x dims (2g, 2g + 1) of two 16-dim
      // groups for tokens 0-7 and 8-15. m-tile mt's rows g / g + 8 are dims 16 mt + 2g / + 1.
#pragma unroll
      for (int jp = 0; jp < HD / 32; ++jp) {
        uint32_t w[4];
        ldsm_x4_trans(buf + C::kSliceV + v_off + 32 * jp, w[0], w[1], w[2], w[3]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const Cvt8Word<DV> x(w[2 * h]), y(w[2 * h + 1]);
          const uint32_t a0 = x.template pair<0, 2>(), a1 = x.template pair<1, 3>();
          const uint32_t a2 = y.template pair<0, 2>(), a3 = y.template pair<1, 3>();
#pragma unroll
          for (int nt = 0; nt < kVNT; ++nt)
            mma<false>(o[2 * jp + h][nt], a0, a1, a2, a3, pb[nt][0], pb[nt][1]);
        }
      }
    } else {
      // m-tile mt's rows g / g + 8 are dims 16 mt + g / + 8.
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        uint32_t a0, a1, a2, a3;
        ldsm_x4_trans(buf + C::kSliceV + v_off + 32 * mt, a0, a1, a2, a3);
#pragma unroll
        for (int nt = 0; nt < kVNT; ++nt)
          mma<C::kBf16V>(o[mt][nt], a0, a1, a2, a3, pb[nt][0], pb[nt][1]);
      }
    }
  }

  // ---- merge the four slices' states, then normalize (or write this split's partials) ----
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its ring, which the merge reuses
  float scale_o = 1.0f;
  if constexpr (tensor_scaled(DV)) scale_o = p.v.tensor_scale[kvh];
  if constexpr (C::kNvV) scale_o *= 128.0f;  // its operands are value x scale x 2^-7
  if constexpr (C::kMetaV) scale_o = s_run;
  float* ob = reinterpret_cast<float*>(smem) + (sw * kVRows + col0) * C::kOStride;
  float2* ml = reinterpret_cast<float2*>(smem + C::kMergeMl) + sw * kVRows + col0;
#pragma unroll
  for (int j = 0; j < 2 * kVNT; ++j) {
    float lsum = l[j];
    lsum += __shfl_xor_sync(kFullMask, lsum, 4);
    lsum += __shfl_xor_sync(kFullMask, lsum, 8);
    lsum += __shfl_xor_sync(kFullMask, lsum, 16);
    if (g == 0) ml[8 * (j >> 1) + 2 * c + (j & 1)] = make_float2(m[j], lsum);
    if constexpr (C::kInt4V) {
      zacc[j] += __shfl_xor_sync(kFullMask, zacc[j], 4);
      zacc[j] += __shfl_xor_sync(kFullMask, zacc[j], 8);
      zacc[j] += __shfl_xor_sync(kFullMask, zacc[j], 16);
    }
  }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kVNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * nt + 2 * c + (e & 1), hf = e >> 1;
        const int dim = C::k4V      ? 64 * (mt >> 2) + 32 * hf + 4 * g + (mt & 3)
                        : C::kReg8V ? 16 * mt + 2 * g + hf
                                    : 16 * mt + g + 8 * hf;
        float x = o[mt][nt][e];
        if constexpr (C::kInt4V) x += zacc[2 * nt + (e & 1)];
        ob[col * C::kOStride + dim] = x * scale_o;
      }
  __syncthreads();
  const bool partial = p.num_splits > 1;
  const float* obase = reinterpret_cast<const float*>(smem);
  const float2* mlbase = reinterpret_cast<const float2*>(smem + C::kMergeMl);
  constexpr int E = HD / 32;
#pragma unroll 1
  for (int col = warp; col < kVRows; col += C::kWarps) {
    const int r = r0 + col;
    if (r >= rows_total) break;  // warp-uniform; columns past the end are the last ones
    float mx = -__uint_as_float(kF32Inf);
#pragma unroll
    for (int w = 0; w < kVWarps; ++w) {
      const float2 v = mlbase[w * kVRows + col];
      if (v.y > 0.0f) mx = fmaxf(mx, v.x);
    }
    float wt[kVWarps], lsum = 0.0f;
#pragma unroll
    for (int w = 0; w < kVWarps; ++w) {
      const float2 v = mlbase[w * kVRows + col];
      wt[w] = v.y > 0.0f ? exp2f(v.x - mx) : 0.0f;
      lsum += wt[w] * v.y;
    }
    const float inv = partial ? 1.0f : (lsum > 0.0f ? 1.0f / lsum : 0.0f);
    const int ri = blk.row_index(p, r);
    float* dst = partial ? p.part_o + (static_cast<size_t>(blk.split) * p.part_rows + ri) * HD
                         : p.out + static_cast<size_t>(ri) * HD;
    // A rotated V's output is un-rotated here (a linear map, so split partials may be too):
    // warp_hadamard_unrotate takes dims lane E + e; others are written lane + 32 e (coalesced).
    float x[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int dim = C::kRotV ? lane * E + e : lane + 32 * e;
      float acc = 0.0f;
#pragma unroll
      for (int w = 0; w < kVWarps; ++w)
        acc = fmaf(wt[w], obase[(w * kVRows + col) * C::kOStride + dim], acc);
      x[e] = acc * inv;
    }
    if constexpr (C::kRotV) warp_hadamard_unrotate<E>(x, lane, p.signs);
#pragma unroll
    for (int e = 0; e < E; ++e) dst[C::kRotV ? lane * E + e : lane + 32 * e] = x[e];
    if (partial && lane == 0)
      p.part_ml[static_cast<size_t>(blk.split) * p.part_rows + ri] = make_float2(mx, lsum);
  }
}

template <KvDtype DK, KvDtype DV, int HD>
void launch(const PrefillKernelParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int kSmem = VCfg<DK, DV, HD>::kSmem;
  auto* kernel = &prefill_verify_kernel<DK, DV, HD>;
  KVQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  kernel<<<grid, VCfg<DK, DV, HD>::kThreads, kSmem, stream>>>(p);
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace prefill_verify

// The verification kernel for this pair at head_dim hd; false where it is not built.
template <KvDtype DK, KvDtype DV>
bool launch_prefill_verify(const PrefillKernelParams& p, int hd, dim3 grid, cudaStream_t stream) {
  if constexpr (prefill_verify_pair(DK, DV, 128)) {
    if (hd == 128) return prefill_verify::launch<DK, DV, 128>(p, grid, stream), true;
    if (hd == 64) return prefill_verify::launch<DK, DV, 64>(p, grid, stream), true;
  }
  return false;
}

}  // namespace kvq::cuda
