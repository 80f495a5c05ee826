// The warp-specialized prefill kernel for Hopper (sm_90a): warpgroup MMA (wgmma) fed through a
// shared-memory ring by a producer warpgroup (the FlashAttention-3 design). Included only by
// prefill_launch.cuh. docs/notes/prefill-tuning.md has each version and what it measured.
//
// Block: 3 warpgroups (384 threads) own (sequence, kv head, 128 query rows), the rows being
// (query token x query heads of the GQA group) as in the mma.sync kernel, so grids, split-KV
// partials and the merge are the same (PrefillBlock).
//   - warpgroup 0, the producer: per kv tile of 64 tokens it waits for a free stage of the ring
//     ("empty" mbarrier). Tiles wholly inside the block's visible range come by TMA (one thread,
//     16-token boxes of the paged cache: 16-bit rows straight into the 128-byte-swizzled operand
//     layout, 8-bit codes into the stage's staging buffer, "raw" mbarrier); edge tiles by
//     cp.async with the tokens outside the visible range zeroed. 8-bit codes are converted to
//     fp16 in the operand layout; the writes are fenced for the async proxy; then the stage's
//     "full" mbarrier.
//   - warpgroups 1 and 2, the consumers: 64 query rows each (Q converted to 16-bit operands in
//     shared memory once). S = Q K^T as m64n64k16 wgmmas from shared memory; the logits, mask
//     and online softmax in registers; P converted in registers to the A operand of O += P V
//     (m64n{64,128}k16, V read N-major from the same token-row layout). The MMAs of S(t) and of
//     P V(t - 1) are issued together and the softmax of S(t) runs under the P V MMAs; the two
//     consumers take turns at the tensor cores (named-barrier ping-pong); a stage is released
//     once its P V MMAs are done.
//
// Operand types as in the mma.sync kernel: bf16 for a bf16 side, fp16 for the others (fp16 Q
// with a per-row power-of-two scale; fp8 codes are exact in fp16); fp32 accumulation; Q and P
// never fp8. Per-tensor scales: K's in the logit factor, V's on the output.
#pragma once

#include "attention/cuda/prefill_kernel.cuh"
#include "attention/cuda/wgmma.cuh"
#include "cache/cuda/dispatch.h"

namespace kvq::cuda {
namespace prefill_wgmma {

using namespace prefill_detail;  // the unpacking helpers, quad reductions, exp2, cp.async

inline constexpr int kConsumers = 2;
// Named barriers: 1 + cw (a consumer warpgroup's Q), 3 + cw (ping-pong), kProducerBarrier (the
// producer warpgroup: an 8-bit staging buffer's reuse).
inline constexpr int kProducerBarrier = 5;
inline constexpr int kThreadsW = 128 * (1 + kConsumers);
inline constexpr int kRowsW = 64 * kConsumers;
static_assert(kRowsW == prefill_rows_per_block(128) && kRowsW == prefill_rows_per_block(64));

// BC: kv tokens per tile (the S tile's N), 64 or 128.
template <KvDtype DK, KvDtype DV, int HD, int BC>
struct WCfg {
  static_assert(prefill_wgmma_pair(DK, DV, HD));
  static constexpr int kBcW = BC;
  static constexpr bool kAny8 = value_bits(DK) == 8 || value_bits(DV) == 8;
  static constexpr bool kRawK = value_bits(DK) == 8;  // staged, then converted
  static constexpr bool kRawV = value_bits(DV) == 8;
  // Both sides 8-bit (64-token tiles): a tile's codes are staged two producer iterations before
  // its conversion, and the copies never touch the ring (only the conversion waits for a free
  // stage), so a TMA round trip and a block-table load are never on the conversion's path
  // (docs/notes/prefill-tuning.md v12).
  static constexpr bool kSplit = kRawK && kRawV && BC == 64;
  // Ring stages: the consumers hold two (S of tile t, P V of tile t - 1) and the producer keeps
  // up to three in flight (16-bit caches) or two (one 8-bit side); with kSplit three staging
  // buffers leave room for four.
  static constexpr int kStages = BC == 64 ? (kSplit ? 4 : 5) : 2;
  static constexpr bool kBf16K = bf16_operands(DK);
  static constexpr bool kBf16V = bf16_operands(DV);
  static constexpr int kCb = 8192;                  // bytes of a 64-row Q column block (64 x 128 B)
  static constexpr int kKvCb = BC * 128;            // bytes of a K / V tile's column block
  static constexpr int kQBytes = 64 * HD * 2;       // one consumer's Q tile
  static constexpr int kTileBytes = kBcW * HD * 2;  // one K or V tile in the ring
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kConsumers * kQBytes;
  static constexpr int kV = kK + kStages * kTileBytes;
  // Staging buffers of the 8-bit sides, one per tile between its copy and its conversion (two:
  // tile t lands while tile t - 1 is converted; kSplit three); a named barrier of the producer
  // warpgroup orders a buffer's reuse after every producer thread converted the tile before
  // (docs/notes/prefill-tuning.md v10: one per ring stage left room for four stages only, and
  // the consumers waited on conversions).
  static constexpr int kRaw = kV + kStages * kTileBytes;
  static constexpr int kRawBufs = kSplit ? 3 : kAny8 ? 2 : 0;
  // Producer iterations between a tile's copy and its conversion.
  static constexpr int kConvertLag = kSplit ? 2 : 1;
  static constexpr int kRawKBytes = kRawK ? kBcW * HD : 0;
  static constexpr int kRawBuf = kRawKBytes + (kRawV ? kBcW * HD : 0);
  static constexpr int kMeta =
      kRaw + kRawBufs * kRawBuf;  // per row: logit factor, sum of Q operands
  // full[kStages], empty[kStages], raw_full[kStages] (the 8-bit codes of a TMA tile landed)
  static constexpr int kBar = kMeta + 2 * kRowsW * 4;
  static constexpr int kSmem = kBar + 3 * kStages * 8;
  static constexpr int kSmemAlloc = kSmem + 1024;  // the base is aligned to 1024 in the kernel
  static_assert(kK % 1024 == 0 && kV % 1024 == 0 && kRaw % 1024 == 0 && kTileBytes % 1024 == 0);
  static_assert(kSmemAlloc <= 227 * 1024);
};

// Converts the 16 8-bit codes of one staged 16-byte chunk to fp16 and stores them as two
// swizzled chunks (dims 16 rc .. 16 rc + 15) of token row t of an operand tile.
template <KvDtype D, int kCbBytes>
__device__ __forceinline__ void convert_chunk(uint8_t* tile, const uint8_t* raw, int t, int rc,
                                              bool visible) {
  uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
  if (visible) {
    const uint4 w = *reinterpret_cast<const uint4*>(raw);
    lo = make_uint4(cvt8_pair01<D>(w.x), cvt8_pair01<D>(w.x >> 16), cvt8_pair01<D>(w.y),
                    cvt8_pair01<D>(w.y >> 16));
    hi = make_uint4(cvt8_pair01<D>(w.z), cvt8_pair01<D>(w.z >> 16), cvt8_pair01<D>(w.w),
                    cvt8_pair01<D>(w.w >> 16));
  }
  const int cb = (2 * rc) >> 3, cc = (2 * rc) & 7;
  *reinterpret_cast<uint4*>(tile + cb * kCbBytes + sm90::swizzle128(t, cc)) = lo;
  *reinterpret_cast<uint4*>(tile + cb * kCbBytes + sm90::swizzle128(t, cc + 1)) = hi;
}

// The token t and 16-byte chunk rc (16 dims) of an 8-bit side's chunk `ch` of a tile, HD / 16
// chunks a token: a quarter warp (8 consecutive ch) takes two tokens t, t + 1 (t even), each a
// different half of its row at head_dim 128 (both whole rows at 64), so its 16-byte reads of
// the staged codes and its swizzled 16-byte stores of the fp16 operands fall in distinct banks
// (token-major order put the two column blocks of one row, 8 KB apart, in the same banks).
// The copy (cp.async) and the conversion use the same order, so a thread converts what it
// copied.
template <int HD>
__device__ __forceinline__ void staged_chunk(int ch, int& t, int& rc) {
  constexpr int kPer = HD / 16;
  const int q = ch & 7, j = ch >> 3, tsub = q >> 2;
  if constexpr (kPer == 8) {
    t = 2 * (j >> 1) + tsub;
    rc = 4 * (tsub ^ (j & 1)) + (q & 3);
  } else {
    static_assert(kPer == 4);
    t = 2 * j + tsub;
    rc = q & 3;
  }
}

template <KvDtype DK, KvDtype DV, int HD, int BC>
__global__ void __launch_bounds__(kThreadsW, prefill_blocks_per_sm(HD, kRowsW, true))
    prefill_wgmma_kernel(const __grid_constant__ PrefillKernelParams p) {
  using C = WCfg<DK, DV, HD, BC>;
  constexpr int kS = C::kStages;
  constexpr int kBcW = BC;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t s_raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t s_base = (s_raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (s_base - s_raw);
  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid >> 7;
  PrefillBlock blk_;
  if (!prefill_block(p, kRowsW, kBcW, kThreadsW, blk_)) return;
  const int seq = blk_.seq, kvh = blk_.kvh, split = blk_.split, r0 = blk_.r0;
  const int q_start = blk_.q_start, kv_len = blk_.kv_len;
  const int rows_total = blk_.rows_total, first_pos = blk_.first_pos;
  const bool sliding = blk_.sliding, noncausal = blk_.noncausal;
  const int lo = blk_.lo, hi = blk_.hi, all_lo = blk_.all_lo, all_hi = blk_.all_hi;
  const int tile_b = blk_.tile_b, tile_e = blk_.tile_e;
  auto row_index = [&](int r) { return blk_.row_index(p, r); };
  const int num_tiles = tile_e - tile_b;
  const uint32_t bar_full = s_base + C::kBar, bar_empty = bar_full + 8 * kS,
                 bar_raw = bar_empty + 8 * kS;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      sm90::mbar_init(bar_full + 8 * s, 128);
      sm90::mbar_init(bar_empty + 8 * s, 128 * kConsumers);
      sm90::mbar_init(bar_raw + 8 * s, 1);
    }
    sm90::mbar_init_fence();
  }
  __syncthreads();

  const bool lab_no_loads = (p.lab & 1) != 0, lab_no_softmax = (p.lab & 2) != 0;
  const bool lab_no_pingpong = (p.lab & 4) != 0;
  const bool lab_no_tma = (p.lab & 16) != 0;
  // Tiles the producer keeps in flight: three for 16-bit caches, two with an 8-bit side (one
  // staging buffer each). KVQ_PREFILL_LAB bit 8 runs 16-bit caches with two (A/B).
  const bool lab_shallow = C::kAny8 || (p.lab & 8) != 0;
  if (wg == 0) {
    // ---------------- producer ----------------
    const int32_t* blocks = p.indices + p.indptr[seq];
    const uint8_t* k_head = p.k.base + static_cast<uint64_t>(kvh) * p.k.head_stride;
    const uint8_t* v_head = p.v.base + static_cast<uint64_t>(kvh) * p.v.head_stride;
    // Copies one side of tile `it`: a 16-bit side straight into the ring stage (zeros outside
    // [lo, hi)), an 8-bit side into staging buffer it % 3 (nothing outside; the conversion
    // writes the zeros).
    auto issue_side = [&](auto dtype, int it, const uint8_t* head, uint64_t block_bytes,
                          uint32_t tile_s, uint8_t* tile, uint32_t raw_s, const auto& blk,
                          const auto& row) {
      constexpr KvDtype D = decltype(dtype)::value;
      const int t0 = (tile_b + it) * kBcW;
      if constexpr (value_bits(D) == 16) {
        constexpr int kPer = HD / 8;  // 16-byte chunks per token
#pragma unroll
        for (int k = 0; k < kBcW * kPer / 128; ++k) {
          const int ch = tid + 128 * k, t = ch / kPer, cc = ch - t * kPer;
          const int seg = t >> 4, tok = t0 + t;
          const uint32_t dst =
              static_cast<uint32_t>((cc >> 3) * C::kKvCb) + sm90::swizzle128(t, cc & 7);
          if (tok >= lo && tok < hi) {
            const uint8_t* src = head + static_cast<uint64_t>(blk[seg]) * block_bytes +
                                 static_cast<uint64_t>(row[seg] + (t & 15)) * (HD * 2) + 16 * cc;
            cp_async16(tile_s + dst, src);
          } else {
            *reinterpret_cast<uint4*>(tile + dst) = make_uint4(0, 0, 0, 0);
          }
        }
      } else {
        constexpr int kPer = HD / 16;
#pragma unroll
        for (int k = 0; k < kBcW * kPer / 128; ++k) {
          int t = 0, rc = 0;
          staged_chunk<HD>(tid + 128 * k, t, rc);
          const int seg = t >> 4, tok = t0 + t;
          if (tok >= lo && tok < hi) {
            const uint8_t* src = head + static_cast<uint64_t>(blk[seg]) * block_bytes +
                                 static_cast<uint64_t>(row[seg] + (t & 15)) * HD + 16 * rc;
            cp_async16(raw_s + t * HD + 16 * rc, src);
          }
        }
      }
    };
    auto convert_side = [&](auto dtype, int it, uint8_t* tile, const uint8_t* raw) {
      constexpr KvDtype D = decltype(dtype)::value;
      if constexpr (value_bits(D) == 8) {
        const int t0 = (tile_b + it) * kBcW;
        constexpr int kPer = HD / 16;
#pragma unroll
        for (int k = 0; k < kBcW * kPer / 128; ++k) {
          int t = 0, rc = 0;
          staged_chunk<HD>(tid + 128 * k, t, rc);
          const int tok = t0 + t;
          convert_chunk<D, C::kKvCb>(tile, raw + t * HD + 16 * rc, t, rc, tok >= lo && tok < hi);
        }
      }
    };
    // Tiles wholly inside [lo, hi) (no token to zero) go by TMA where the plan made tensor maps
    // (16-bit K and V); the edge tiles by cp.async.
    auto tma_tile = [&](int it) {
      const int t0 = (tile_b + it) * kBcW;
      return p.tma != 0 && !lab_no_tma && !lab_no_loads && t0 >= lo && t0 + kBcW <= hi;
    };
    auto stage_k = [&](int it) { return C::kK + (it % kS) * C::kTileBytes; };
    auto stage_v = [&](int it) { return C::kV + (it % kS) * C::kTileBytes; };
    auto raw_buf = [&](int it) {
      return C::kRaw + (C::kAny8 ? (it % C::kRawBufs) * C::kRawBuf : 0);
    };
    auto finish = [&](int it) {
      // kSplit: the stage is taken here, not when the codes were copied.
      if constexpr (C::kSplit)
        if (it >= kS) sm90::mbar_wait(bar_empty + 8 * (it % kS), ((it / kS) - 1) & 1);
      if (tma_tile(it)) {
        if constexpr (!C::kAny8) return;                          // 16-bit sides: arrived at issue
        sm90::mbar_wait(bar_raw + 8 * (it % kS), (it / kS) & 1);  // the staged codes landed
      }
      if (lab_no_loads) {
        sm90::mbar_arrive(bar_full + 8 * (it % kS));
        return;
      }
      convert_side(KvDtypeConst<DK>{}, it, smem + stage_k(it), smem + raw_buf(it));
      convert_side(KvDtypeConst<DV>{}, it, smem + stage_v(it), smem + raw_buf(it) + C::kRawKBytes);
      sm90::fence_proxy_async_smem();
      sm90::mbar_arrive(bar_full + 8 * (it % kS));
    };
#pragma unroll 1
    for (int it = 0; it < num_tiles; ++it) {
      if constexpr (!C::kSplit)
        if (it >= kS) sm90::mbar_wait(bar_empty + 8 * (it % kS), ((it / kS) - 1) & 1);
      // Tile it's codes go to the staging buffer tile it - kRawBufs used: every producer thread
      // has converted that tile (its finish() ran in the previous iteration).
      if constexpr (C::kAny8) {
        static_assert(C::kRawBufs == C::kConvertLag + 1);
        if (it >= C::kRawBufs) sm90::named_barrier_sync(kProducerBarrier, 128);
      }
      const int t0 = (tile_b + it) * kBcW;
      int32_t blk[kBcW / 16], row[kBcW / 16];
#pragma unroll
      for (int q = 0; q < kBcW / 16; ++q) {
        const int tok = t0 + 16 * q;
        const int b = tok / p.block_tokens;
        row[q] = tok - b * p.block_tokens;
        blk[q] = (tok >= hi || tok + 16 <= lo) ? -1 : __ldg(blocks + b);
      }
      if constexpr (C::kAny8) {
        // A tile by cp.async completes its stage's "raw" phase at once, so that phase k of the
        // barrier is always use k of the stage (the parity finish() waits for).
        if (tid == 0 && !tma_tile(it)) sm90::mbar_arrive(bar_raw + 8 * (it % kS));
      }
      if (tma_tile(it)) {
        // The whole tile by TMA: one thread issues the copies and the byte counts. With 16-bit
        // sides only, the others arrive now (the phase completes when the bytes have landed);
        // with an 8-bit side everyone arrives in finish(), after converting the staged codes.
        // An empty cp.async group keeps the wait counts below uniform.
        if (tid == 0) {
          const uint32_t full = bar_full + 8 * (it % kS), raw = bar_raw + 8 * (it % kS);
          // Bytes each barrier waits for: 16-bit sides land in the stage ("full"), 8-bit codes
          // in the staging buffer ("raw", whose one arrival is this thread's).
          constexpr uint32_t kBytes16 =
              (C::kRawK ? 0 : C::kTileBytes) + (C::kRawV ? 0 : C::kTileBytes);
          constexpr uint32_t kBytes8 = C::kRawBuf;
          if constexpr (C::kAny8) {
            if constexpr (kBytes16 > 0) sm90::mbar_expect_tx(full, kBytes16);
            sm90::mbar_arrive_expect_tx(raw, kBytes8);
          } else {
            sm90::mbar_arrive_expect_tx(full, kBytes16);
          }
          auto side = [&](auto dtype, const CUtensorMap* map, int stage_off, int raw_off) {
            constexpr KvDtype D = decltype(dtype)::value;
#pragma unroll
            for (int q = 0; q < kBcW / 16; ++q) {
              if constexpr (value_bits(D) == 16) {
#pragma unroll
                for (int cb = 0; cb < HD / 64; ++cb)
                  sm90::tma_load_4d(
                      s_base + stage_off + static_cast<uint32_t>(cb * C::kKvCb + q * 16 * 128), map,
                      64 * cb, row[q], kvh, blk[q], full);
              } else {
                sm90::tma_load_4d(s_base + raw_off + static_cast<uint32_t>(q * 16 * HD), map, 0,
                                  row[q], kvh, blk[q], raw);
              }
            }
          };
          side(KvDtypeConst<DK>{}, &p.k_map, stage_k(it), raw_buf(it));
          side(KvDtypeConst<DV>{}, &p.v_map, stage_v(it), raw_buf(it) + C::kRawKBytes);
        } else if constexpr (!C::kAny8) {
          sm90::mbar_arrive(bar_full + 8 * (it % kS));
        }
      } else if (!lab_no_loads) {
        issue_side(KvDtypeConst<DK>{}, it, k_head, p.k.block_bytes, s_base + stage_k(it),
                   smem + stage_k(it), s_base + raw_buf(it), blk, row);
        issue_side(KvDtypeConst<DV>{}, it, v_head, p.v.block_bytes, s_base + stage_v(it),
                   smem + stage_v(it), s_base + raw_buf(it) + C::kRawKBytes, blk, row);
      }
      cp_async_commit();
      // Tile it - 2 (three in flight) is complete once at most two groups are pending; tile it - 1
      // (two in flight) once at most one is.
      // (kSplit: tile it - 2, staged two iterations ago, is converted now.)
      if (lab_shallow) {
        constexpr int kLag = C::kAny8 ? C::kConvertLag : 1;
        if (it >= kLag) {
          cp_async_wait<kLag>();
          finish(it - kLag);
        }
      } else if (it >= 2) {
        cp_async_wait<2>();
        finish(it - 2);
      }
    }
    cp_async_wait<0>();
    const int lag = lab_shallow ? (C::kAny8 ? C::kConvertLag : 1) : 2;
    for (int it = max(0, num_tiles - lag); it < num_tiles; ++it) finish(it);
    return;
  }

  // ---------------- consumers ----------------
  const int cw = wg - 1;
  const int ctid = tid - 128 * wg;
  const int warp = ctid >> 5, lane = ctid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int wg_r0 = r0 + 64 * cw;  // first row of this warpgroup
  float* rfac = reinterpret_cast<float*>(smem + C::kMeta);
  float* rqsum = rfac + kRowsW;
  if (wg_r0 >= rows_total) {
    // No row of this warpgroup exists: release each stage as it fills (arriving only after
    // the fill, so an arrival never counts toward an earlier use of the stage).
#pragma unroll 1
    for (int it = 0; it < num_tiles; ++it) {
      sm90::mbar_wait(bar_full + 8 * (it % kS), (it / kS) & 1);
      sm90::mbar_arrive(bar_empty + 8 * (it % kS));
    }
    return;
  }

  // ---- Q: each warp its 16 rows, as 16-bit operands in the swizzled layout ----
  const uint32_t q_tile = s_base + C::kQ + cw * C::kQBytes;
  {
    constexpr int E = HD / 32;
    uint8_t* qs = smem + C::kQ + cw * C::kQBytes;
    const float kscale = p.k.tensor_scale[kvh];
    float xs[16][E];
    load_q_rows<HD, 16>(xs, p, q_start, kvh, wg_r0 + 16 * warp, rows_total, lane);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int wr = 16 * warp + i;  // row within the warpgroup's tile
      const int lr = 64 * cw + wr;
      const bool valid = wg_r0 + wr < rows_total;
      const float2 aq = pack_q_row<C::kBf16K>(xs[i], [&](int e, uint32_t pr) {
        const int d = lane * E + e;
        *reinterpret_cast<uint32_t*>(qs + (d >> 6) * 8192 + sm90::swizzle128(wr, (d & 63) >> 3) +
                                     2 * (d & 7)) = pr;
      });
      if (lane == 0) {
        // A row past the last one has Q = 0: factor 1 keeps its (unused) logits finite.
        rfac[lr] = valid ? p.softmax_scale * kscale / aq.x : 1.0f;
        rqsum[lr] = aq.y;
      }
    }
  }
  sm90::fence_proxy_async_smem();
  sm90::named_barrier_sync(1 + cw, 128);

  const bool capped = p.soft_cap != 0.0f;
  const float cap = p.soft_cap, inv_cap = capped ? 1.0f / p.soft_cap : 0.0f;
  float fac[2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
    fac[i] = rfac[64 * cw + 16 * warp + g + 8 * i] * (capped ? 1.0f : kLog2e);
  auto row_pos = [&](int i) {
    return first_pos + min(wg_r0 + 16 * warp + g + 8 * i, rows_total - 1) / p.ratio;
  };

  float o[HD / 2];
#pragma unroll
  for (int j = 0; j < HD / 2; ++j) o[j] = 0.0f;
  float s[kBcW / 2];
#pragma unroll
  for (int j = 0; j < kBcW / 2; ++j) s[j] = 0.0f;
  float m[2], l[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    m[i] = -__uint_as_float(kF32Inf);
    l[i] = 0.0f;
  }

  // The logits of tile it in s -> P in s (in place), m / l updated; returns the factor of O.
  // Without soft-cap the running maximum is kept in log2 units and each P costs one FFMA and
  // one exp2: p = 2^(s fac - m fac) (fac > 0, so the maximum of s fac is fac times that of s).
  const float efac[2] = {capped ? 1.0f : fac[0], capped ? 1.0f : fac[1]};
  auto softmax = [&](int it, float(&corr)[2]) {
    const int t0 = (tile_b + it) * kBcW;
    if (lab_no_softmax) {
      corr[0] = corr[1] = 1.0f;
      l[0] = l[1] = 1.0f;
      return;
    }
    if (capped) {
#pragma unroll
      for (int j = 0; j < kBcW / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[4 * j + e] = cap * tanhf(s[4 * j + e] * fac[e >> 1] * inv_cap) * kLog2e;
    }
    if (!(t0 >= all_lo && t0 + kBcW <= all_hi)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int pos = row_pos(i);
        const int rlo = (sliding ? pos - p.window + 1 : 0) - t0;
        const int rhi = (noncausal ? kv_len : pos + 1) - t0;
#pragma unroll
        for (int j = 0; j < kBcW / 8; ++j)
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int tok = 8 * j + 2 * c + b;
            if (!(tok >= rlo && tok < rhi)) s[4 * j + 2 * i + b] = -__uint_as_float(kF32Inf);
          }
      }
    }
    float mx[2] = {-__uint_as_float(kF32Inf), -__uint_as_float(kF32Inf)};
#pragma unroll
    for (int j = 0; j < kBcW / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
    float mu[2], rs[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      rs[i] = 0.0f;
      const float m_new = fmaxf(m[i], quad_max(mx[i]) * efac[i]);
      mu[i] = m_new == -__uint_as_float(kF32Inf) ? 0.0f : m_new;
      corr[i] = fast_exp2(m[i] - mu[i]);
      m[i] = m_new;
    }
#pragma unroll
    for (int j = 0; j < kBcW / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[4 * j + e] = fast_exp2(fmaf(s[4 * j + e], efac[e >> 1], -mu[e >> 1]));
        rs[e >> 1] += s[4 * j + e];
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * corr[i] + rs[i];
  };
  // Descriptors: the start address field (bits 0-13, in 16-byte units) takes the offsets of the
  // k steps and stages by plain addition (every address stays below 256 KB).
  const uint64_t q_desc = sm90::smem_desc(q_tile, 16, 1024);
  const uint64_t k_desc0 = sm90::smem_desc(s_base + C::kK, 16, 1024);
  const uint64_t v_desc0 = sm90::smem_desc(s_base + C::kV, C::kKvCb, 1024);
  auto issue_s = [&](int it) {
    const uint64_t kd = k_desc0 + static_cast<uint64_t>((it % kS) * (C::kTileBytes >> 4));
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
      const uint64_t qo = static_cast<uint64_t>(((ks >> 2) * C::kCb + (ks & 3) * 32) >> 4);
      const uint64_t ko = static_cast<uint64_t>(((ks >> 2) * C::kKvCb + (ks & 3) * 32) >> 4);
      sm90::wgmma_ss<kBcW, C::kBf16K>(s, q_desc + qo, kd + ko, ks > 0 ? 1 : 0);
    }
    sm90::wgmma_commit();
  };
  uint32_t pa[kBcW / 16][4];
  auto issue_pv = [&](int it) {
    const uint32_t vt = s_base + C::kV + (it % kS) * C::kTileBytes;
#pragma unroll
    for (int kk = 0; kk < kBcW / 16; ++kk)
      sm90::wgmma_rs_tb<HD, C::kBf16V>(o, pa[kk], sm90::smem_desc(vt + kk * 2048, C::kKvCb, 1024));
    sm90::wgmma_commit();
  };
  auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < kBcW / 16; ++kk) {
      pa[kk][0] = pack2<C::kBf16V>(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = pack2<C::kBf16V>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = pack2<C::kBf16V>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = pack2<C::kBf16V>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  auto rescale_o = [&](const float(&corr)[2]) {
    if (corr[0] != 1.0f || corr[1] != 1.0f) {
#pragma unroll
      for (int j = 0; j < HD / 8; ++j) {
        o[4 * j + 0] *= corr[0];
        o[4 * j + 1] *= corr[0];
        o[4 * j + 2] *= corr[1];
        o[4 * j + 3] *= corr[1];
      }
    }
  };

  // Ping-pong (FlashAttention-3): the two consumers take turns to issue their MMAs (named
  // barriers 3 and 4, one per consumer's turn), so one's softmax runs while the other's MMAs
  // do. Both have the same number of issue phases (num_tiles + 1); consumer 0 goes first, and
  // the last phase hands over nothing. Only when both consumers have rows.
  const bool pingpong = r0 + 64 < rows_total && !lab_no_pingpong;
  int phase = 0;
  auto my_turn = [&] {
    if (pingpong) sm90::named_barrier_sync(3 + cw, 256);
  };
  auto hand_over = [&] {
    if (pingpong && !(cw == 1 && phase == num_tiles)) sm90::named_barrier_arrive(3 + (cw ^ 1), 256);
    ++phase;
  };
  if (pingpong && cw == 1) sm90::named_barrier_arrive(3, 256);

  // Software pipeline (FlashAttention-3's intra-warpgroup overlap): the MMAs of S(it) = Q K(it)^T
  // and of O += P(it - 1) V(it - 1) are issued together; the softmax of S(it) runs while the P V
  // MMAs do, then O is rescaled and stage it - 1 released.
  float corr[2];
  sm90::mbar_wait(bar_full, 0);
  my_turn();
  sm90::wgmma_fence();
  issue_s(0);
  hand_over();
  sm90::wgmma_wait<0>();
  sm90::fence_regs(s);
  softmax(0, corr);
  pack_p();
#pragma unroll 1
  for (int it = 1; it < num_tiles; ++it) {
    sm90::mbar_wait(bar_full + 8 * (it % kS), (it / kS) & 1);
    sm90::fence_regs(s);
    sm90::fence_regs(o);
    my_turn();
    sm90::wgmma_fence();
    issue_s(it);
    issue_pv(it - 1);
    hand_over();
    sm90::wgmma_wait<1>();  // S(it) done; P V (it - 1) may still run
    sm90::fence_regs(s);
    softmax(it, corr);
    sm90::wgmma_wait<0>();
    sm90::fence_regs(o);
    sm90::mbar_arrive(bar_empty + 8 * ((it - 1) % kS));
    rescale_o(corr);
    pack_p();
  }
  sm90::fence_regs(o);
  my_turn();
  sm90::wgmma_fence();
  issue_pv(num_tiles - 1);
  hand_over();
  sm90::wgmma_wait<0>();
  sm90::fence_regs(o);
  sm90::mbar_arrive(bar_empty + 8 * ((num_tiles - 1) % kS));

  // ---- epilogue: normalize, scale, write (or this split's partial) ----
  // (1 for a 16-bit cache, or the fp8 scale of a staged one: PrefillPlan::staged_blocks.)
  const float scale_o = p.v.tensor_scale[kvh];
  const bool partial = p.num_splits > 1;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float lsum = quad_sum(l[i]);
    const int r = wg_r0 + 16 * warp + g + 8 * i;
    if (partial && c == 0 && r < rows_total)
      p.part_ml[static_cast<size_t>(split) * p.part_rows + row_index(r)] = make_float2(m[i], lsum);
    if (r >= rows_total) continue;
    const float f = scale_o * (partial ? 1.0f : 1.0f / lsum);
    const size_t at = static_cast<size_t>(row_index(r)) * HD;
    float* dst =
        partial ? p.part_o + static_cast<size_t>(split) * p.part_rows * HD + at : p.out + at;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j)
      *reinterpret_cast<float2*>(dst + 8 * j + 2 * c) =
          make_float2(o[4 * j + 2 * i] * f, o[4 * j + 2 * i + 1] * f);
  }
}

}  // namespace prefill_wgmma

namespace prefill_wgmma {
template <KvDtype DK, KvDtype DV, int HD, int BC>
void launch_tile(const PrefillKernelParams& p, dim3 grid, cudaStream_t stream) {
  using C = WCfg<DK, DV, HD, BC>;
  auto* kernel = &prefill_wgmma_kernel<DK, DV, HD, BC>;
  KVQ_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemAlloc));
  kernel<<<grid, kThreadsW, C::kSmemAlloc, stream>>>(p);
  KVQ_CUDA_CHECK_LAUNCH();
}
template <KvDtype DK, KvDtype DV, int HD>
bool launch_hd(const PrefillKernelParams& p, dim3 grid, cudaStream_t stream) {
  if constexpr (prefill_wgmma_pair(DK, DV, HD)) {
    launch_tile<DK, DV, HD, 64>(p, grid, stream);
    return true;
  } else {
    return false;
  }
}
}  // namespace prefill_wgmma

// Launches the warpgroup-MMA prefill for (DK, DV, head_dim); false where that kernel is not
// built for them (the caller runs the mma.sync kernel).
template <KvDtype DK, KvDtype DV>
bool launch_prefill_wgmma(const PrefillKernelParams& p, int head_dim, dim3 grid,
                          cudaStream_t stream) {
  if (head_dim == 64) return prefill_wgmma::launch_hd<DK, DV, 64>(p, grid, stream);
  if (head_dim == 128) return prefill_wgmma::launch_hd<DK, DV, 128>(p, grid, stream);
  return false;
}

}  // namespace kvq::cuda
