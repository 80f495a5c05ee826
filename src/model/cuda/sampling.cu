// Device sampling (see sampling.h for the rules and the cost per row).
#include "model/cuda/sampling.h"

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cub/block/block_scan.cuh>
#include <string>

#include "cache/cuda/cuda_check.h"
#include "kvq/core/error.h"

namespace kvq::cuda {

namespace {

using u64 = unsigned long long;

// 512 threads leave 128 registers a thread (1024 spill in the radix passes).
constexpr int kThreads = 512;
constexpr int kBins = 2048;  // 11-bit digits: 3 radix passes cover a 32-bit key
constexpr int kPer = kBins / kThreads;
constexpr int kMaxGather = kThreads;  // top_k up to this is finished in shared memory
// exp(s - max) in [0, 1] as fixed point: integer sums are exact and order-independent, so a
// (seed, step) gives the same token on every run. 2^42 * 2^21 elements fits 64 bits.
constexpr float kFixedOne = 4398046511104.0f;  // 2^42
constexpr int kMaxVocab = 1 << 21;

using ScanU64 = cub::BlockScan<u64, kThreads>;
using ScanF64 = cub::BlockScan<double, kThreads>;

struct Best {
  float v;
  int id;
};

struct Smem {
  u64 hist[kBins];
  union {
    typename ScanU64::TempStorage u;
    typename ScanF64::TempStorage d;
  } scan;
  Best red[kThreads / 32];
  float cand_s[kMaxGather];  // gathered top-k candidates, then the same ranked
  int cand_id[kMaxGather];
  float rank_s[kMaxGather];
  int rank_id[kMaxGather];
  int cross_digit;
  u64 cross_above;
  u64 cross_bin;
  int count;
  int thr_count[16];
  float thr_dist[16];
};

// Orders floats as unsigned integers (larger float, larger key).
__device__ __forceinline__ uint32_t order_key(float s) {
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key ^ 0x80000000u) : ~key);
}

// Candidate order of the CPU sampler: larger value first, lower id on ties.
__device__ __forceinline__ bool better(float v, int id, float bv, int bid) {
  return v > bv || (v == bv && id < bid);
}

// In the prefix of the order ending at (key, id)?
__device__ __forceinline__ bool within(uint32_t key, int id, uint32_t cut_key, int cut_id) {
  return key > cut_key || (key == cut_key && id <= cut_id);
}

__device__ __forceinline__ u64 mix64(u64 z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Standard Gumbel noise for token `id` of a row whose stream is `base`.
__device__ __forceinline__ float gumbel(u64 base, int id) {
  const u64 h = mix64(base + static_cast<u64>(id + 1) * 0x9E3779B97F4A7C15ull);
  // 23 bits: u in [2^-24, 1 - 2^-24], both exact in float, so neither log is 0 or -inf.
  const float u = (static_cast<float>(static_cast<uint32_t>(h >> 41)) + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}

// Calls f(i, x, live) for this thread's elements i = t, t + kThreads, ..., loading kUnroll of
// them before using any: the passes are bound by memory latency otherwise. Trip counts are
// warp-uniform (live is false past the end, x then 0), so f may use warp collectives.
constexpr int kUnroll = 4;
template <class F>
__device__ __forceinline__ void for_each_element(const float* __restrict__ row, int n, F f) {
  for (int i0 = 0; i0 < n; i0 += kUnroll * kThreads) {
    float x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * kThreads + static_cast<int>(threadIdx.x);
      x[u] = i < n ? __ldg(row + i) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * kThreads + static_cast<int>(threadIdx.x);
      f(i, x[u], i < n);
    }
  }
}

__device__ Best block_argmax(Smem& sm, float v, int id) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    const int oid = __shfl_xor_sync(0xFFFFFFFFu, id, o);
    if (better(ov, oid, v, id)) v = ov, id = oid;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sm.red[warp] = {v, id};
  __syncthreads();
  if (warp == 0) {
    const bool live = lane < kThreads / 32;
    v = live ? sm.red[lane].v : -INFINITY;
    id = live ? sm.red[lane].id : INT_MAX;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xFFFFFFFFu, v, o);
      const int oid = __shfl_xor_sync(0xFFFFFFFFu, id, o);
      if (better(ov, oid, v, id)) v = ov, id = oid;
    }
    if (lane == 0) sm.red[0] = {v, id};
  }
  __syncthreads();
  const Best b = sm.red[0];
  __syncthreads();
  return b;
}

struct Cut {
  uint32_t key = 0;  // the cut element's key
  u64 above = 0;     // weight of elements with a larger key
  u64 eq = 0;        // weight of elements with exactly this key
  u64 target = 0;
};

// Radix select over the candidates elem(i, x, key) accepts, each weighing weight_of(key)
// (asked only of those still in the running, as it may cost an exp): the key at which the
// weight of candidates with key >= it first reaches target_of(total weight), going down from
// the largest key. false (no cut) when target_of returns 0.
// kCounts: every weight is 1 (weight_of is not called). Only 32-bit shared atomics are used:
// sm_90's 64-bit shared atomic add is a compare-and-swap loop, and warp-aggregating with
// __reduce_add_sync over __match_any_sync groups serializes.
template <bool kCounts, class Elem, class WeightOf, class TargetOf>
__device__ bool radix_select(Smem& sm, const float* row, int n, Elem elem, WeightOf weight_of,
                             TargetOf target_of, Cut& cut) {
  unsigned* const counts = reinterpret_cast<unsigned*>(sm.hist);
  uint32_t prefix = 0, prefix_mask = 0;
  u64 above = 0, target = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
    const uint32_t dmask = pass == 2 ? 0x3FFu : 0x7FFu;
    for (int b = threadIdx.x; b < kBins; b += kThreads) sm.hist[b] = 0;
    __syncthreads();
    for_each_element(row, n, [&](int i, float x, bool live) {
      uint32_t key = 0;
      bool hit = live && elem(i, x, key) && (key & prefix_mask) == prefix;
      if constexpr (kCounts) {
        if (hit) atomicAdd(&counts[(key >> shift) & dmask], 1u);
      } else {
        // 64-bit sums from 32-bit atomics: low words, and high words plus the carry of each
        // low add that wrapped (the adder sees it in the old value). Exact and order-free.
        if (hit) {
          const u64 w = weight_of(key);
          const uint32_t bin = (key >> shift) & dmask;
          const unsigned wl = static_cast<unsigned>(w), wh = static_cast<unsigned>(w >> 32);
          const unsigned old = wl != 0 ? atomicAdd(&counts[bin], wl) : 0u;
          const unsigned carry = old > 0xFFFFFFFFu - wl ? 1u : 0u;
          if (wh + carry != 0) atomicAdd(&counts[kBins + bin], wh + carry);
        }
      }
    });
    __syncthreads();
    // Thread t holds bins kBins-1-kPer*t down to kBins-kPer*(t+1): thread order is descending
    // key order.
    const int d_top = kBins - 1 - kPer * static_cast<int>(threadIdx.x);
    u64 h[kPer], local = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      local += h[j] = static_cast<u64>(counts[d_top - j]) +
                      (kCounts ? 0ull : static_cast<u64>(counts[kBins + d_top - j]) << 32);
    u64 before, total;
    ScanU64(sm.scan.u).ExclusiveSum(local, before, total);
    if (pass == 0) {
      target = target_of(total);
      if (target == 0) {
        __syncthreads();
        return false;
      }
    }
    before += above;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (before < target && before + h[j] >= target) {
        sm.cross_digit = d_top - j;
        sm.cross_above = before;
        sm.cross_bin = h[j];
      }
      before += h[j];
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(sm.cross_digit) << shift;
    prefix_mask |= dmask << shift;
    above = sm.cross_above;
    cut.eq = sm.cross_bin;
    __syncthreads();
  }
  cut.key = prefix;
  cut.above = above;
  cut.target = target;
  return true;
}

// Distances below the max (in logit / temperature units) tried for a small top_k: 2^-6 .. 2^9.
__device__ __forceinline__ float gather_distance(int j) {
  return ldexpf(1.0f, j - 6);
}

__device__ __forceinline__ u64 to_fixed(float w) {
  return w > 0.0f ? __float2ull_rz(fminf(w, 1.0f) * kFixedOne) : 0ull;
}

__device__ __forceinline__ bool is_greedy(const DeviceSampling& p) {
  return !(p.temperature > 0.0f) || p.top_k == 1;
}

// Greedy rows over many blocks: one block per (slice of kSliceElems logits, row) writes the
// slice's best (largest non-NaN value, lowest id on ties; {-inf, INT_MAX} for a slice of NaNs)
// to part[row * slices + slice]; sample_kernel then takes the best of a row's slices by the same
// rule, which is the row's greedy token. One 512-thread block reading a 128k-logit row alone
// took 34 us on an H200 (docs/notes/decode-tuning.md version 19). Rows that sample exit at once.
constexpr int kSliceThreads = 256;
constexpr int kSliceElems = 2048;
__global__ void __launch_bounds__(kSliceThreads)
    greedy_slices_kernel(const float* __restrict__ logits, int n, const DeviceSampling* params,
                         Best* __restrict__ part, int slices) {
  const int r = static_cast<int>(blockIdx.y), sl = static_cast<int>(blockIdx.x);
  if (!is_greedy(params[r])) return;
  const float* row = logits + static_cast<size_t>(r) * static_cast<size_t>(n);
  const int lo = sl * kSliceElems, hi = min(n, lo + kSliceElems);
  constexpr int kPerThread = kSliceElems / kSliceThreads;
  float x[kPerThread];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int i = lo + u * kSliceThreads + static_cast<int>(threadIdx.x);
    x[u] = i < hi ? __ldg(row + i) : NAN;
  }
  float bv = -INFINITY;
  int bid = INT_MAX;
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int i = lo + u * kSliceThreads + static_cast<int>(threadIdx.x);
    if (!isnan(x[u]) && better(x[u], i, bv, bid)) bv = x[u], bid = i;
  }
  __shared__ Best red[kSliceThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xFFFFFFFFu, bv, o);
    const int oid = __shfl_xor_sync(0xFFFFFFFFu, bid, o);
    if (better(ov, oid, bv, bid)) bv = ov, bid = oid;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = {bv, bid};
  __syncthreads();
  if (threadIdx.x == 0) {
    Best b = red[0];
    for (int w = 1; w < kSliceThreads / 32; ++w)
      if (better(red[w].v, red[w].id, b.v, b.id)) b = red[w];
    part[static_cast<size_t>(r) * slices + sl] = b;
  }
}

int greedy_slices(int vocab) {
  return (vocab + kSliceElems - 1) / kSliceElems;
}

// `part` (nullable): greedy rows' slice results from greedy_slices_kernel, `slices` a row.
__global__ void __launch_bounds__(kThreads, 2)
    sample_kernel(const float* __restrict__ logits, int n, const DeviceSampling* params,
                  int32_t* out, const Best* __restrict__ part, int slices) {
  __shared__ Smem sm;
  const int t = threadIdx.x;
  const float* row = logits + static_cast<size_t>(blockIdx.x) * static_cast<size_t>(n);
  const DeviceSampling p = params[blockIdx.x];

  if (is_greedy(p)) {  // greedy: one pass, or the best of the row's slices
    float bv = -INFINITY;
    int bid = INT_MAX;
    if (part != nullptr) {
      for (int s = t; s < slices; s += kThreads) {
        const Best b = part[static_cast<size_t>(blockIdx.x) * slices + s];
        if (better(b.v, b.id, bv, bid)) bv = b.v, bid = b.id;
      }
    } else {
      for_each_element(row, n, [&](int i, float x, bool live) {
        if (live && !isnan(x) && better(x, i, bv, bid)) bv = x, bid = i;
      });
    }
    const Best b = block_argmax(sm, bv, bid);
    if (t == 0) out[blockIdx.x] = b.id == INT_MAX ? 0 : b.id;
    return;
  }

  const float temp = p.temperature;
  // The CPU sampler orders by logit / temperature; -0 and +0 are one value there.
  auto scaled = [temp](float x) {
    const float s = x / temp;
    return s == 0.0f ? 0.0f : s;
  };
  const u64 base = mix64(mix64(p.seed ^ 0x6A09E667F3BCC909ull) ^ (p.step * 0xD1B54A32D192ED03ull));

  // Small top_k: the k best usually lie within a few units of the max. One pass counts how many
  // lie within each of 16 distances of it (no atomics per element); the first distance holding
  // k, when its elements fit in shared memory, is gathered and sorted there. Flat or crowded
  // rows fall back to the radix select below.
  bool ranked = false;  // rank_s / rank_id hold the top_k best, in order
  bool k_off = false;   // top_k >= the non-NaN candidates
  float s_max = -INFINITY;
  if (p.top_k > 0 && p.top_k <= kMaxGather) {
    float mx = -INFINITY;
    int valid = 0;
    for_each_element(row, n, [&](int, float x, bool live) {
      if (live && !isnan(x)) mx = fmaxf(mx, scaled(x)), ++valid;
    });
    s_max = block_argmax(sm, mx, 0).v;
    if (t < 16) sm.thr_count[t] = 0;
    if (t == 0) sm.count = 0;
    valid = __reduce_add_sync(0xFFFFFFFFu, valid);
    __syncthreads();
    if ((t & 31) == 0) atomicAdd(&sm.count, valid);
    __syncthreads();
    valid = sm.count;
    __syncthreads();
    if (p.top_k >= valid) {
      k_off = true;
    } else if (isfinite(s_max)) {
      // Counts of candidates within each distance of sm.thr_dist (one pass) into thr_count.
      auto count_within = [&] {
        float dist[16];
        int c[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) dist[j] = sm.thr_dist[j], c[j] = 0;
        for_each_element(row, n, [&](int, float x, bool live) {
          if (!live || isnan(x)) return;
          const float d = s_max - scaled(x);
#pragma unroll
          for (int j = 0; j < 16; ++j) c[j] += d <= dist[j] ? 1 : 0;
        });
        __syncthreads();  // every thread has read thr_dist
        if (t < 16) sm.thr_count[t] = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int w = __reduce_add_sync(0xFFFFFFFFu, c[j]);
          if ((t & 31) == 0) atomicAdd(&sm.thr_count[j], w);
        }
        __syncthreads();
        int first = -1;  // the smallest distance holding k
        for (int j = 15; j >= 0; --j)
          if (sm.thr_count[j] >= p.top_k) first = j;
        return first;
      };
      // Coarse: 2^-6 .. 2^9 below the max; then, when the first distance holding k holds too
      // many to sort in shared memory, 16 even steps inside that octave.
      if (t < 16) sm.thr_dist[t] = gather_distance(t);
      __syncthreads();
      int pick = count_within();
      if (pick >= 0 && sm.thr_count[pick] > kBins) {
        const float lo = pick == 0 ? 0.0f : gather_distance(pick - 1), hi = gather_distance(pick);
        __syncthreads();
        if (t < 16) sm.thr_dist[t] = lo + (hi - lo) * static_cast<float>(t + 1) / 16.0f;
        __syncthreads();
        pick = count_within();
      }
      if (pick >= 0 && sm.thr_count[pick] <= kBins) {
        const float dist = sm.thr_dist[pick];
        __syncthreads();
        if (t == 0) sm.count = 0;
        __syncthreads();
        for_each_element(row, n, [&](int i, float x, bool live) {
          float sv = 0.0f;
          bool hit = false;
          if (live && !isnan(x)) sv = scaled(x), hit = s_max - sv <= dist;
          const unsigned b = __ballot_sync(0xFFFFFFFFu, hit);
          if (b == 0) return;
          int at = 0;
          if ((t & 31) == 0) at = atomicAdd(&sm.count, __popc(b));
          at = __shfl_sync(0xFFFFFFFFu, at, 0) + __popc(b & ((1u << (t & 31)) - 1u));
          if (hit && at < kBins)
            sm.hist[at] = (static_cast<u64>(order_key(sv)) << 32) | ~static_cast<uint32_t>(i);
        });
        __syncthreads();
        const int m = min(sm.count, kBins);
        int size = 2;
        while (size < m) size <<= 1;
        for (int i = m + t; i < size; i += kThreads) sm.hist[i] = 0;  // sorts last
        __syncthreads();
        // Bitonic sort, descending: larger key first, then lower id (larger ~id).
        for (int span = 2; span <= size; span <<= 1) {
          for (int stride = span >> 1; stride > 0; stride >>= 1) {
            for (int i = t; i < size; i += kThreads) {
              const int j = i ^ stride;
              if (j > i) {
                const u64 a = sm.hist[i], b = sm.hist[j];
                if ((i & span) == 0 ? a < b : a > b) sm.hist[i] = b, sm.hist[j] = a;
              }
            }
            __syncthreads();
          }
        }
        if (t < p.top_k) {
          sm.rank_s[t] = key_float(static_cast<uint32_t>(sm.hist[t] >> 32));
          sm.rank_id[t] = static_cast<int>(~static_cast<uint32_t>(sm.hist[t]));
        }
        __syncthreads();
        ranked = true;
      }
    }
  }

  // top-k: the k-th candidate in order is the cut (key, id).
  bool k_on = false;
  uint32_t k_key = 0;
  int k_id = INT_MAX;
  if (p.top_k > 0 && !ranked && !k_off) {
    const u64 k = static_cast<u64>(p.top_k);
    Cut c;
    k_on = radix_select<true>(
        sm, row, n,
        [&](int, float x, uint32_t& key) {
          if (isnan(x)) return false;
          key = order_key(scaled(x));
          return true;
        },
        [](uint32_t) { return 1ull; }, [k](u64 total) { return k < total ? k : 0ull; }, c);
    if (k_on) {
      k_key = c.key;
      const u64 need = k - c.above;
      if (need < c.eq) {  // ties straddle the cut: keep the `need` lowest ids among them
        Cut ci;
        radix_select<true>(
            sm, row, n,
            [&](int i, float x, uint32_t& key) {
              if (isnan(x) || order_key(scaled(x)) != k_key) return false;
              key = ~static_cast<uint32_t>(i);
              return true;
            },
            [](uint32_t) { return 1ull; }, [need](u64) { return need; }, ci);
        k_id = static_cast<int>(~ci.key);
      }
    }
  }
  auto in_k = [&](uint32_t key, int i) { return !k_on || within(key, i, k_key, k_id); };

  if (ranked || (k_on && p.top_k <= kMaxGather)) {
    // Small k: the k candidates ranked in shared memory; top-p / min-p apply there.
    if (!ranked) {
      if (t == 0) sm.count = 0;
      __syncthreads();
      for_each_element(row, n, [&](int i, float x, bool live) {
        if (!live || isnan(x)) return;
        const float s = scaled(x);
        if (!in_k(order_key(s), i)) return;
        const int slot = atomicAdd(&sm.count, 1);
        if (slot < kMaxGather) sm.cand_s[slot] = s, sm.cand_id[slot] = i;
      });
      __syncthreads();
      const int mg = min(sm.count, kMaxGather);
      if (t < mg) {
        const float s = sm.cand_s[t];
        const int id = sm.cand_id[t];
        int rank = 0;
        for (int j = 0; j < mg; ++j) rank += better(sm.cand_s[j], sm.cand_id[j], s, id) ? 1 : 0;
        sm.rank_s[rank] = s;
        sm.rank_id[rank] = id;
      }
      __syncthreads();
    }
    const int m = p.top_k;
    s_max = sm.rank_s[0];
    float s = 0.0f;
    int id = INT_MAX;
    double w = 0.0;
    if (t < m) {
      s = sm.rank_s[t];
      id = sm.rank_id[t];
      w = isinf(s_max) ? (s == s_max ? 1.0 : 0.0) : exp(static_cast<double>(s) - s_max);
    }
    double cum_before, total;
    ScanF64(sm.scan.d).ExclusiveSum(w, cum_before, total);
    bool keep = t < m;
    // Rank 0 always stays (the CPU keeps at least one candidate).
    if (keep && t > 0 && p.top_p < 1.0f) keep = cum_before < static_cast<double>(p.top_p) * total;
    if (keep && t > 0 && p.min_p > 0.0f) keep = w >= static_cast<double>(p.min_p);
    const Best b = block_argmax(sm, keep ? s + gumbel(base, id) : -INFINITY, keep ? id : INT_MAX);
    if (t == 0) out[blockIdx.x] = b.id == INT_MAX ? 0 : b.id;
    return;
  }

  // General path: top-p and min-p need exp(s - max) (s_max is known already when k_off).
  if (!k_off && (p.top_p < 1.0f || p.min_p > 0.0f)) {
    float bv = -INFINITY;
    for_each_element(row, n, [&](int, float x, bool live) {
      if (live && !isnan(x)) bv = fmaxf(bv, scaled(x));
    });
    s_max = block_argmax(sm, bv, 0).v;
  }
  auto weight = [s_max](float s) {
    return isinf(s_max) ? (s == s_max ? 1.0f : 0.0f) : expf(s - s_max);
  };

  // top-p over the top-k candidates: the shortest prefix whose weight reaches top_p of theirs.
  bool p_on = false;
  uint32_t p_key = 0;
  int p_id = INT_MAX;
  if (p.top_p < 1.0f) {
    const double top_p = p.top_p;
    Cut c;
    p_on = radix_select<false>(
        sm, row, n,
        [&](int i, float x, uint32_t& key) {
          if (isnan(x)) return false;
          key = order_key(scaled(x));
          return in_k(key, i);
        },
        [&](uint32_t key) { return to_fixed(weight(key_float(key))); },
        [top_p](u64 total) {
          const double want = ceil(top_p * static_cast<double>(total));
          const u64 target = want < 1.0 ? 1ull : static_cast<u64>(want);
          return target >= total ? 0ull : target;
        },
        c);
    if (p_on) {
      p_key = c.key;
      // Every candidate at the cut key has the same weight: how many of them reach the target?
      const u64 fw = to_fixed(weight(key_float(p_key)));
      const u64 need = fw > 0 ? (c.target - c.above + fw - 1) / fw : 1;
      if (fw > 0 && need < c.eq / fw) {
        Cut ci;
        radix_select<true>(
            sm, row, n,
            [&](int i, float x, uint32_t& key) {
              if (isnan(x)) return false;
              const uint32_t kx = order_key(scaled(x));
              if (kx != p_key || !in_k(kx, i)) return false;
              key = ~static_cast<uint32_t>(i);
              return true;
            },
            [](uint32_t) { return 1ull; }, [need](u64) { return need; }, ci);
        p_id = static_cast<int>(~ci.key);
      }
    }
  }

  // The draw: Gumbel-max over what every cut kept.
  const float min_p = p.min_p;
  float bv = -INFINITY;
  int bid = INT_MAX;
  for_each_element(row, n, [&](int i, float x, bool live) {
    if (!live || isnan(x)) return;
    const float s = scaled(x);
    const uint32_t key = order_key(s);
    if (!in_k(key, i) || (p_on && !within(key, i, p_key, p_id))) return;
    if (min_p > 0.0f && !(weight(s) >= min_p)) return;
    const float v = s + gumbel(base, i);
    if (better(v, i, bv, bid)) bv = v, bid = i;
  });
  const Best b = block_argmax(sm, bv, bid);
  if (t == 0) out[blockIdx.x] = b.id == INT_MAX ? 0 : b.id;
}

}  // namespace

size_t sampling_workspace_bytes(int rows, int vocab) {
  return rows > 0 && vocab > 0
             ? static_cast<size_t>(rows) * static_cast<size_t>(greedy_slices(vocab)) * sizeof(Best)
             : 0;
}

void sample_tokens(const float* logits, int rows, int vocab, const DeviceSampling* params,
                   int32_t* out, void* workspace, cudaStream_t stream) {
  KVQ_CHECK(rows >= 0, "sample_tokens: rows " + std::to_string(rows) + " < 0");
  KVQ_CHECK(vocab >= 1 && vocab <= kMaxVocab,
            "sample_tokens: vocab " + std::to_string(vocab) + " outside [1, 2^21]");
  if (rows == 0) return;
  Best* part = static_cast<Best*>(workspace);
  const int slices = greedy_slices(vocab);
  if (part != nullptr) {
    greedy_slices_kernel<<<dim3(static_cast<unsigned>(slices), static_cast<unsigned>(rows)),
                           kSliceThreads, 0, stream>>>(logits, vocab, params, part, slices);
    KVQ_CUDA_CHECK_LAUNCH();
  }
  sample_kernel<<<rows, kThreads, 0, stream>>>(logits, vocab, params, out, part, slices);
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace kvq::cuda
