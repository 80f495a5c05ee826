// The one-shot peer-memory all-reduce (peer_all_reduce.h).
#include "model/cuda/peer_all_reduce.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "cache/cuda/cuda_check.h"
#include "cache/cuda/pdl.h"
#include "kvq/core/error.h"
#include "model/cuda/row_ops.cuh"

namespace kvq::cuda_model {
namespace {

constexpr int kMaxRanks = 8;
constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // float4s in flight per thread (remote loads are latency-bound)

struct PeerPtrs {
  const float* data[kMaxRanks];  // every rank's double buffer
  uint32_t* flags[kMaxRanks];    // every rank's flags [block][kMaxRanks]
};

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Every kernel's prologue: PDL (cache/cuda/pdl.h; the next kernel, the RMSNorm, may be
// scheduled now and waits for this one's end; every block of this grid is resident by then, so
// none waits behind it), then this block's number for this call (its previous call's + 1).
__device__ __forceinline__ uint32_t begin_call(const uint32_t* epochs) {
  kvq::cuda::wait_for_previous_kernel();
  kvq::cuda::allow_next_kernel();
  __shared__ uint32_t epoch;
  // Never 0 (the receive buffers' initial flags); 2 after 0xffffffff keeps the parity.
  if (threadIdx.x == 0) epoch = epochs[blockIdx.x] + 1 == 0 ? 2u : epochs[blockIdx.x] + 1;
  __syncthreads();
  return epoch;
}
// Stores the block's number for the next call (after every thread has read `epoch`).
__device__ __forceinline__ void count_call(uint32_t* epochs, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
}

// Element group j (floats 4j..4j+3) belongs to block (j / kThreads) % gridDim.x, thread
// j % kThreads, whatever x's alignment: every rank maps the same n the same way, so a block's
// flag says exactly which of the rank's floats are in its buffer. The grid is the same on
// every call, so each block's call counter (its epoch) alternates the buffer halves in step
// with the other ranks': a rank writes half h of call c only after every peer has signalled
// call c - 1, i.e. has finished call c - 2 (stream order), the last one that read half h.
__global__ void __launch_bounds__(kThreads)
    peer_all_reduce_kernel(PeerPtrs p, int rank, int ranks, size_t max_floats,
                           uint32_t* __restrict__ epochs, float* __restrict__ x, int64_t n,
                           const volatile int* abort) {
  const int b = blockIdx.x;
  const uint32_t epoch = begin_call(epochs);
  const size_t half = (epoch & 1u) * max_floats;
  float* __restrict__ mine = const_cast<float*>(p.data[rank]) + half;
  const int64_t groups = (n + 3) / 4;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  auto whole = [&](int64_t j) { return aligned && 4 * j + 3 < n; };
  // 1. This block's floats into the rank's buffer.
  for (int64_t j = int64_t{b} * kThreads + threadIdx.x; j < groups; j += stride) {
    if (whole(j)) {
      reinterpret_cast<float4*>(mine)[j] = reinterpret_cast<const float4*>(x)[j];
    } else {
      for (int64_t i = 4 * j, end = 4 * j + 4 < n ? 4 * j + 4 : n; i < end; ++i) mine[i] = x[i];
    }
  }
  __syncthreads();
  // 2. Signal this block's slice to every rank (itself included) and wait for theirs.
  if (threadIdx.x < ranks) {
    store_release(p.flags[threadIdx.x] + b * kMaxRanks + rank, epoch);
    const uint32_t* f = p.flags[rank] + b * kMaxRanks + threadIdx.x;
    uint32_t spins = 0;
    // The peer's flag is this call's number, or the next one's once it has passed this
    // barrier; anything else is an earlier barrier call's (the numbers count every call).
    while (load_acquire(f) - epoch > 1u)
      if ((++spins & 1023u) == 0 && *abort != 0) break;  // the group is failing: give up
  }
  count_call(epochs, epoch);
  // 3. Sum every rank's slice in rank order (the same bits on every rank).
  for (int64_t j0 = int64_t{b} * kThreads + threadIdx.x; j0 < groups; j0 += stride * kUnroll) {
    float4 acc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * stride;
      if (j < groups && whole(j))
        acc[u] = __ldcg(reinterpret_cast<const float4*>(p.data[0] + half) + j);
    }
    for (int q = 1; q < ranks; ++q) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = j0 + u * stride;
        if (j < groups && whole(j))
          v[u] = __ldcg(reinterpret_cast<const float4*>(p.data[q] + half) + j);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        acc[u].x += v[u].x;
        acc[u].y += v[u].y;
        acc[u].z += v[u].z;
        acc[u].w += v[u].w;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * stride;
      if (j >= groups) continue;
      if (whole(j)) {
        reinterpret_cast<float4*>(x)[j] = acc[u];
      } else {
        for (int64_t i = 4 * j, end = 4 * j + 4 < n ? 4 * j + 4 : n; i < end; ++i) {
          float s = __ldcg(p.data[0] + half + i);
          for (int q = 1; q < ranks; ++q) s += __ldcg(p.data[q] + half + i);
          x[i] = s;
        }
      }
    }
  }
}

// The low-latency variant (small messages; KVQ_TP_PEER_MODE=ll for all), after NCCL's LL protocol:
// each pair of floats travels to every peer as one 16-byte store {x0, epoch, x1, epoch}, whose two
// 8-byte halves arrive whole, so the receiver knows a value is this call's from its own flag:
// no fences, no barrier, one NVLink crossing. Each rank's receive buffer is
// [2 halves][ranks senders][max_floats / 2 pairs] of uint4. Element pair j belongs to
// thread j % (grid x threads) on every rank; the epoch is per block, as in the barrier variant:
// a rank writes half h of call c only after it read every peer's call c - 1, i.e. after every
// peer finished call c - 2, the last one that read half h.
__device__ __forceinline__ void store_volatile(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

struct PeerRecv {
  uint4* recv[kMaxRanks];  // every rank's receive buffer
};

// Pair j of this rank's floats to every peer's receive buffer (slot `rank`).
__device__ __forceinline__ void ll_send(const PeerRecv& p, int rank, int ranks, size_t half,
                                        size_t pairs_max, int64_t j, float2 mine, uint32_t epoch) {
  const uint4 out{__float_as_uint(mine.x), epoch, __float_as_uint(mine.y), epoch};
  for (int q = 0; q < ranks; ++q)
    if (q != rank) store_volatile(p.recv[q] + half + size_t(rank) * pairs_max + j, out);
}

// Pair j summed over the ranks in rank order (`mine` for this rank's term), each peer's term
// awaited until its flags say this call; gives up (garbage) once the group aborts.
__device__ __forceinline__ float2 ll_sum(const PeerRecv& p, int rank, int ranks, size_t half,
                                         size_t pairs_max, int64_t j, float2 mine, uint32_t epoch,
                                         const volatile int* abort, bool& gave_up) {
  float2 sum{0.0f, 0.0f};
  for (int q = 0; q < ranks; ++q) {
    float2 v = mine;
    if (q != rank) {
      const uint4* from = p.recv[rank] + half + size_t(q) * pairs_max + j;
      uint4 got = load_volatile(from);
      uint32_t spins = 0;
      while ((got.y != epoch || got.w != epoch) && !gave_up) {
        if ((++spins & 1023u) == 0 && *abort != 0) gave_up = true;  // the group is failing
        got = load_volatile(from);
      }
      v = make_float2(__uint_as_float(got.x), __uint_as_float(got.z));
    }
    if (q == 0) {
      sum = v;
    } else {
      sum.x += v.x;
      sum.y += v.y;
    }
  }
  return sum;
}

__global__ void __launch_bounds__(kThreads)
    peer_all_reduce_ll_kernel(PeerRecv p, int rank, int ranks, size_t max_floats,
                              uint32_t* __restrict__ epochs, float* __restrict__ x, int64_t n,
                              const volatile int* abort) {
  const int b = blockIdx.x;
  const uint32_t epoch = begin_call(epochs);
  const size_t pairs_max = max_floats / 2;
  const size_t half = (epoch & 1u) * size_t(ranks) * pairs_max;
  const int64_t pairs = (n + 1) / 2;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) & 7u) == 0;
  bool gave_up = false;
  // Every pair is sent before any is awaited: one NVLink crossing per call, not one per pair.
  auto mine = [&](int64_t j) {
    if (aligned && 2 * j + 1 < n) return reinterpret_cast<const float2*>(x)[j];
    return make_float2(x[2 * j], 2 * j + 1 < n ? x[2 * j + 1] : 0.0f);
  };
  for (int64_t j = int64_t{b} * kThreads + threadIdx.x; j < pairs; j += stride)
    ll_send(p, rank, ranks, half, pairs_max, j, mine(j), epoch);
  for (int64_t j = int64_t{b} * kThreads + threadIdx.x; j < pairs; j += stride) {
    const float2 sum = ll_sum(p, rank, ranks, half, pairs_max, j, mine(j), epoch, abort, gave_up);
    if (aligned && 2 * j + 1 < n) {
      reinterpret_cast<float2*>(x)[j] = sum;
    } else {
      x[2 * j] = sum.x;
      if (2 * j + 1 < n) x[2 * j + 1] = sum.y;
    }
  }
  count_call(epochs, epoch);
}

// The low-latency all-reduce of T rows of H floats fused with the RMSNorm that reads them next
// (row_ops.cuh's RMSNorm; its sum of squares adds in another order than rms_norm_rows', so
// the two may differ in the last bit, while every rank gets the same bits): block b owns rows b, b
// + grid, ...; pair jp of a row is pair r x H/2 + jp of the receive buffer, sent and awaited as in
// the kernel above (whose double-buffer argument holds: each call ends after every peer started
// it). The summed row stays in x (the residual) and its normalized copy goes to `out`.
__global__ void __launch_bounds__(kThreads)
    peer_all_reduce_rms_kernel(PeerRecv p, int rank, int ranks, size_t max_floats,
                               uint32_t* __restrict__ epochs, float* __restrict__ x, int T, int H,
                               const float* __restrict__ w, float eps, void* __restrict__ out,
                               bool bf16, const volatile int* abort) {
  __shared__ double scratch[32];
  const int b = blockIdx.x;
  const uint32_t epoch = begin_call(epochs);
  const size_t pairs_max = max_floats / 2;
  const size_t half = (epoch & 1u) * size_t(ranks) * pairs_max;
  const int row_pairs = H / 2;
  bool gave_up = false;
  // Every owned pair is sent before any is awaited (one NVLink crossing per call).
  for (int r = b; r < T; r += gridDim.x) {
    const float2* row = reinterpret_cast<const float2*>(x + int64_t{r} * H);
    for (int jp = static_cast<int>(threadIdx.x); jp < row_pairs; jp += kThreads)
      ll_send(p, rank, ranks, half, pairs_max, int64_t{r} * row_pairs + jp, row[jp], epoch);
  }
  for (int r = b; r < T; r += gridDim.x) {
    float2* row = reinterpret_cast<float2*>(x + int64_t{r} * H);
    double ss = 0.0;
    for (int jp = static_cast<int>(threadIdx.x); jp < row_pairs; jp += kThreads) {
      const float2 sum = ll_sum(p, rank, ranks, half, pairs_max, int64_t{r} * row_pairs + jp,
                                row[jp], epoch, abort, gave_up);
      row[jp] = sum;
      ss += static_cast<double>(sum.x) * sum.x + static_cast<double>(sum.y) * sum.y;
    }
    ss = rows::block_sum(ss, scratch);  // its barrier also orders the row's writes before reads
    rows::store_normed_row(out, r, H, x + int64_t{r} * H, rows::rms_inverse(ss, H, eps), w, bf16);
    __syncthreads();  // scratch is reused by the next row
  }
  count_call(epochs, epoch);
}

// Restores the caller's current device on scope exit.
struct DeviceGuard {
  int saved = 0;
  DeviceGuard() { (void)cudaGetDevice(&saved); }
  ~DeviceGuard() { (void)cudaSetDevice(saved); }
};

}  // namespace

std::unique_ptr<PeerAllReduce> PeerAllReduce::create(int n, size_t max_floats) {
  if (const char* e = std::getenv("KVQ_TP_PEER_ALLREDUCE");
      e != nullptr && std::strcmp(e, "0") == 0)
    return nullptr;
  if (n < 2 || n > kMaxRanks || max_floats == 0) return nullptr;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      int ok = 0;
      if (i != j && (cudaDeviceCanAccessPeer(&ok, i, j) != cudaSuccess || ok == 0)) return nullptr;
    }
  DeviceGuard guard;
  std::unique_ptr<PeerAllReduce> a(new PeerAllReduce());
  a->n_ = n;
  a->max_floats_ = (max_floats + 3) / 4 * 4;
  a->blocks_ = 64;
  // At most one block per SM of the smallest GPU: every block of both grids resident at once,
  // so no block's wait depends on another block of its own grid being scheduled.
  int sms = 1 << 30;
  for (int r = 0; r < n; ++r) {
    int count = 0;
    KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, r));
    sms = std::min(sms, count);
  }
  if (const char* e = std::getenv("KVQ_TP_PEER_BLOCKS"); e != nullptr && std::atoi(e) > 0)
    a->blocks_ = std::atoi(e);
  a->blocks_ = std::min(a->blocks_, sms);
  // Low latency up to 128K floats (batch 32 x hidden 4096), the barrier variant above (it moves
  // half the bytes: measured faster at 256K floats, slower at 4K-64K;
  // docs/notes/tensor-parallel.md).
  a->ll_max_floats_ = std::min<size_t>(a->max_floats_, size_t{1} << 17);
  if (const char* e = std::getenv("KVQ_TP_PEER_LL_MAX"); e != nullptr && std::atol(e) >= 0)
    a->ll_max_floats_ = std::min<size_t>(a->max_floats_, (std::atol(e) + 3) / 4 * 4);
  if (const char* e = std::getenv("KVQ_TP_PEER_MODE"); e != nullptr) {
    if (std::strcmp(e, "barrier") == 0) a->ll_max_floats_ = 0;
    if (std::strcmp(e, "ll") == 0) a->ll_max_floats_ = a->max_floats_;
  }
  void* host = nullptr;
  KVQ_CUDA_CHECK(cudaHostAlloc(&host, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  a->abort_ = static_cast<volatile int*>(host);
  *a->abort_ = 0;
  for (int r = 0; r < n; ++r) {
    KVQ_CUDA_CHECK(cudaSetDevice(r));
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      // Once per pair and process (another group may have turned it on).
      static std::mutex mu;
      static std::set<std::pair<int, int>> enabled;
      std::lock_guard<std::mutex> lock(mu);
      if (enabled.count({r, q}) != 0) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(q, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled)
        (void)cudaGetLastError();  // turned on outside kvq (NCCL)
      else
        KVQ_CUDA_CHECK(e);
      enabled.insert({r, q});
    }
    void* d = nullptr;
    // Barrier variant: [2][max_floats] floats; low latency: [2][n][ll_max_floats / 2] uint4.
    KVQ_CUDA_CHECK(cudaMalloc(&d, 2 * a->max_floats_ * sizeof(float)));
    a->data_.push_back(static_cast<float*>(d));
    const size_t ll_bytes = 2 * size_t(n) * (a->ll_max_floats_ / 2) * sizeof(uint4);
    d = nullptr;
    if (ll_bytes > 0) {
      KVQ_CUDA_CHECK(cudaMalloc(&d, ll_bytes));
      KVQ_CUDA_CHECK(cudaMemset(d, 0, ll_bytes));  // flags 0: no call yet
    }
    a->ll_.push_back(static_cast<uint4*>(d));
    const size_t flag_bytes = static_cast<size_t>(a->blocks_) * kMaxRanks * sizeof(uint32_t);
    KVQ_CUDA_CHECK(cudaMalloc(&d, flag_bytes));
    a->flags_.push_back(static_cast<uint32_t*>(d));
    KVQ_CUDA_CHECK(cudaMemset(d, 0, flag_bytes));
    KVQ_CUDA_CHECK(cudaMalloc(&d, static_cast<size_t>(a->blocks_) * sizeof(uint32_t)));
    a->epochs_.push_back(static_cast<uint32_t*>(d));
    KVQ_CUDA_CHECK(cudaMemset(d, 0, static_cast<size_t>(a->blocks_) * sizeof(uint32_t)));
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return a;
}

PeerAllReduce::~PeerAllReduce() {
  DeviceGuard guard;
  // Every device's kernels may write into any rank's buffers: all of them finish first.
  for (size_t r = 0; r < data_.size(); ++r) {
    (void)cudaSetDevice(static_cast<int>(r));
    (void)cudaDeviceSynchronize();
  }
  for (size_t r = 0; r < data_.size(); ++r) {
    (void)cudaSetDevice(static_cast<int>(r));
    (void)cudaFree(data_[r]);
    if (r < ll_.size()) (void)cudaFree(ll_[r]);
    if (r < flags_.size()) (void)cudaFree(flags_[r]);
    if (r < epochs_.size()) (void)cudaFree(epochs_[r]);
  }
  if (abort_ != nullptr) (void)cudaFreeHost(const_cast<int*>(abort_));
}

void PeerAllReduce::run(int rank, float* x, size_t n, cudaStream_t stream) const {
  KVQ_CHECK(rank >= 0 && rank < n_ && fits(n), "peer all-reduce: rank or size out of range");
  if (n == 0) return;
  // Both variants count calls in the same per-block epochs, and either kind of call ends only
  // after every peer started it: so when a rank starts call c, every peer has finished call
  // c - 2, whichever variants the calls between used (the double buffers' condition).
  if (n <= ll_max_floats_) {
    PeerRecv p{};
    for (int q = 0; q < n_; ++q) p.recv[q] = ll_[static_cast<size_t>(q)];
    kvq::cuda::launch_pdl(peer_all_reduce_ll_kernel, blocks_, kThreads, stream, p, rank, n_,
                          ll_max_floats_, epochs_[static_cast<size_t>(rank)], x,
                          static_cast<int64_t>(n), abort_);
    KVQ_CUDA_CHECK_LAUNCH();
    return;
  }
  PeerPtrs p{};
  for (int q = 0; q < n_; ++q) {
    p.data[q] = data_[static_cast<size_t>(q)];
    p.flags[q] = flags_[static_cast<size_t>(q)];
  }
  kvq::cuda::launch_pdl(peer_all_reduce_kernel, blocks_, kThreads, stream, p, rank, n_, max_floats_,
                        epochs_[static_cast<size_t>(rank)], x, static_cast<int64_t>(n), abort_);
  KVQ_CUDA_CHECK_LAUNCH();
}

bool PeerAllReduce::run_rms_norm(int rank, float* x, int T, int H, const float* w, float eps,
                                 void* out, bool bf16, cudaStream_t stream) const {
  KVQ_CHECK(rank >= 0 && rank < n_, "peer all-reduce: rank out of range");
  const size_t n = static_cast<size_t>(T) * static_cast<size_t>(H);
  if (T <= 0 || H <= 0 || H % 2 != 0 || n > ll_max_floats_) return false;
  KVQ_CHECK((reinterpret_cast<uintptr_t>(x) & 7u) == 0, "peer all-reduce: rows not 8-byte aligned");
  PeerRecv p{};
  for (int q = 0; q < n_; ++q) p.recv[q] = ll_[static_cast<size_t>(q)];
  kvq::cuda::launch_pdl(peer_all_reduce_rms_kernel, blocks_, kThreads, stream, p, rank, n_,
                        ll_max_floats_, epochs_[static_cast<size_t>(rank)], x, T, H, w, eps, out,
                        bf16, abort_);
  KVQ_CUDA_CHECK_LAUNCH();
  return true;
}

void PeerAllReduce::abort() {
  if (abort_ != nullptr) *abort_ = 1;
}

}  // namespace kvq::cuda_model
