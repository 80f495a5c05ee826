// kvq CUDA prefill attention timings per KV dtype (run_prefill, device-resident tables).
//
// Shapes: batch 1, 32 query heads over 8 kv heads, head_dim 128, block 16 (blocks in random
// order), causal:
//   prefillN     N new queries over their own N tokens (N = 1k, 4k, 8k, 16k; --quick: 8k);
//   chunk2048    the last 2048-token chunk of 8192 (6144 cached before it);
//   chunk8192    the last 8192-token chunk of 32768.
// Each shape runs on the mma.sync kernel and, where it is built for the dtype, on the
// warpgroup-MMA (wgmma) kernel (PrefillOptions::Kernel), one line each.
// The cache is filled through write_kv_cuda from random rows (never zeros). Q is fp32 (kvq's
// contract), the output fp32.
//
// Timing: CUDA events around each call after warm-up; the median is reported. FLOPs count
// the causal work only: 4 * head_dim * (sum over queries of visible keys) * query heads.
//
// --verify: the speculative verification shape instead. B sequences (B in 1, 8, 32, 64) of C
// cached tokens (C in 1024, 4096, 8192) each with the last Q = 8 positions as queries (1 + 7
// drafts), split-KV planned like the model does (num_sms); timed on the plan's kernel (the wgmma
// one where it is built), on the mma.sync kernel's small-q block and through the decode kernel (the
// Q queries as rows of its warps), and beside them the decode kernel on the same batch (one query
// per sequence). Reported: time, KV bytes read / time as % of the measured device copy bandwidth
// (bytes read
// + written of a 1 GiB cudaMemcpy), and verify / decode.
//
// Usage: cuda_prefill_bench [--json FILE] [--dtypes a,b,...] [--quick] [--verify]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "attention/cuda/cuda_decode.h"
#include "attention/cuda/cuda_prefill.h"
#include "cache/cuda/cuda_check.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"

namespace {

using namespace kvq;

constexpr int kHq = 32, kHkv = 8, kHd = 128, kBlock = 16, kCtx = 8192, kMaxCtx = 32768,
              kMaxQ = 16384;

__global__ void fill_random(float* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float s = 0.0f;
    for (int k = 0; k < 4; ++k) s += static_cast<float>((z >> (16 * k)) & 0xFFFF) / 65536.0f;
    float v = (s - 2.0f) * 1.7f;
    if ((z & 63) == 0) v *= 8.0f;
    x[i] = v;
  }
}

std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

LayerKvSpec bench_spec(KvDtype d) {
  LayerKvSpec s;
  s.k_dtype = s.v_dtype = d;
  s.num_q_heads = kHq;
  s.num_kv_heads = kHkv;
  s.head_dim_k = s.head_dim_v = kHd;
  s.block_tokens = kBlock;
  s.attention = AttentionKind::kCausal;
  for (KvSide side : {KvSide::kK, KvSide::kV}) {
    ScaleSource& sc = side == KvSide::kK ? s.k_scale : s.v_scale;
    if (traits(d).uses_tensor_scale) {
      sc.kind = ScaleSourceKind::kCheckpoint;
      sc.values = {d == KvDtype::kNvfp4 ? 0.01f : 0.03f};
    } else if (traits(d).scale_kind == ScaleKind::kPerTokenHead) {
      sc.kind = ScaleSourceKind::kDynamic;
    }
  }
  return s;
}

template <typename T>
T* device_copy(const std::vector<T>& h) {
  T* d = nullptr;
  KVQ_CUDA_CHECK(cudaMalloc(&d, sizeof(T) * std::max<size_t>(h.size(), 1)));
  KVQ_CUDA_CHECK(cudaMemcpy(d, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice));
  return d;
}

struct Shape {
  const char* name;
  int q_len, kv_len;
};

// Median of `iters` timed calls of fn (CUDA events on the default stream) after 3 warm-ups.
template <typename F>
std::vector<float> time_ms(F&& fn, int iters, cudaEvent_t e0, cudaEvent_t e1) {
  for (int w = 0; w < 3; ++w) fn();
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int it = 0; it < iters; ++it) {
    KVQ_CUDA_CHECK(cudaEventRecord(e0, nullptr));
    fn();
    KVQ_CUDA_CHECK(cudaEventRecord(e1, nullptr));
    KVQ_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    KVQ_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms;
}

// Device copy bandwidth (bytes read + written per second) of a 1 GiB cudaMemcpy.
double copy_bandwidth(cudaEvent_t e0, cudaEvent_t e1) {
  const size_t n = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  KVQ_CUDA_CHECK(cudaMalloc(&a, n));
  KVQ_CUDA_CHECK(cudaMalloc(&b, n));
  KVQ_CUDA_CHECK(cudaMemset(a, 1, n));
  const auto ms =
      time_ms([&] { KVQ_CUDA_CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, nullptr)); },
              10, e0, e1);
  KVQ_CUDA_CHECK(cudaFree(a));
  KVQ_CUDA_CHECK(cudaFree(b));
  return 2.0 * static_cast<double>(n) / (ms[ms.size() / 2] * 1e-3);
}

// Bytes of K and V (codes and per-token metadata) that attention over `tokens` cached tokens
// reads for one layer.
double kv_bytes(const LayerKvSpec& spec, int64_t tokens) {
  return static_cast<double>(spec.bytes_per_token()) * static_cast<double>(tokens);
}

// `shapes`: the (batch, context) points to run; empty = all of them.
int run_verify(const std::vector<KvDtype>& dtypes, bool quick, const std::string& json_path,
               const std::vector<std::pair<int, int>>& shapes) {
  cudaDeviceProp prop{};
  KVQ_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaEvent_t e0, e1;
  KVQ_CUDA_CHECK(cudaEventCreate(&e0));
  KVQ_CUDA_CHECK(cudaEventCreate(&e1));
  const double bw = copy_bandwidth(e0, e1);
  std::printf("device: %s, %d SMs, copy bandwidth %.2f TB/s\n", prop.name, prop.multiProcessorCount,
              bw / 1e12);
  constexpr int kQ = 8, kMaxB = 64, kMaxC = 8192;
  const int iters = quick ? 10 : 50;
  const int32_t blocks_per_seq = kMaxC / kBlock, num_blocks = kMaxB * blocks_per_seq;
  std::mt19937 rng(4242);
  std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  const size_t qn = static_cast<size_t>(kMaxB) * kQ * kHq * kHd;
  float *q = nullptr, *out = nullptr;
  KVQ_CUDA_CHECK(cudaMalloc(&q, qn * sizeof(float)));
  KVQ_CUDA_CHECK(cudaMalloc(&out, qn * sizeof(float)));
  fill_random<<<1024, 256>>>(q, static_cast<int64_t>(qn), 7);
  KVQ_CUDA_CHECK_LAUNCH();
  void* ws = nullptr;
  const size_t ws_bytes =
      std::max(cuda::kPrefillSplitWorkspaceBytes, size_t{256} << 20);  // decode's too
  KVQ_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  nlohmann::json results = nlohmann::json::array();
  std::printf("%-20s %3s %5s | %34s | %28s | %13s | %26s | %20s | %s\n", "dtype", "B", "ctx",
              "verify, plan: kernel us (% bw)", "verify, mma small-q: us (% bw)", "wgmma: us",
              "verify decode-k.: us (% bw)", "decode: us (% bw)",
              "verify/decode plan, mma small-q, decode-k.");
  for (KvDtype dtype : dtypes) {
    const LayerKvSpec spec = bench_spec(dtype);
    DeviceKvCache cache({spec}, num_blocks);
    {
      // Fill every slot (random rows, never zeros), one sequence's worth of rows at a time.
      const size_t elems = static_cast<size_t>(kMaxC) * kHkv * kHd;
      float *k = nullptr, *v = nullptr;
      int64_t* d_slots = nullptr;
      KVQ_CUDA_CHECK(cudaMalloc(&k, elems * sizeof(float)));
      KVQ_CUDA_CHECK(cudaMalloc(&v, elems * sizeof(float)));
      KVQ_CUDA_CHECK(cudaMalloc(&d_slots, kMaxC * sizeof(int64_t)));
      for (int sq = 0; sq < kMaxB; ++sq) {
        fill_random<<<1024, 256>>>(k, static_cast<int64_t>(elems), 100 + 2 * sq);
        KVQ_CUDA_CHECK_LAUNCH();
        fill_random<<<1024, 256>>>(v, static_cast<int64_t>(elems), 101 + 2 * sq);
        KVQ_CUDA_CHECK_LAUNCH();
        std::vector<int64_t> slots(static_cast<size_t>(kMaxC));
        for (int t = 0; t < kMaxC; ++t)
          slots[static_cast<size_t>(t)] =
              static_cast<int64_t>(ids[static_cast<size_t>(sq * blocks_per_seq + t / kBlock)]) *
                  kBlock +
              t % kBlock;
        KVQ_CUDA_CHECK(cudaMemcpy(d_slots, slots.data(), slots.size() * sizeof(int64_t),
                                  cudaMemcpyHostToDevice));
        write_kv_cuda(spec, cache.layer_view(0), d_slots, kMaxC, k, v);
      }
      KVQ_CUDA_CHECK(cudaDeviceSynchronize());
      KVQ_CUDA_CHECK(cudaFree(k));
      KVQ_CUDA_CHECK(cudaFree(v));
      KVQ_CUDA_CHECK(cudaFree(d_slots));
    }
    for (int C : {1024, 4096, 8192}) {
      for (int B : {1, 8, 32, 64}) {
        if (!shapes.empty() &&
            std::find(shapes.begin(), shapes.end(), std::make_pair(B, C)) == shapes.end())
          continue;
        // Sequence i: its first C / kBlock blocks of its stripe of ids.
        std::vector<int32_t> indptr{0}, indices, lens(static_cast<size_t>(B), C), q_indptr{0};
        for (int i = 0; i < B; ++i) {
          for (int b = 0; b < C / kBlock; ++b)
            indices.push_back(ids[static_cast<size_t>(i * blocks_per_seq + b)]);
          indptr.push_back(static_cast<int32_t>(indices.size()));
          q_indptr.push_back((i + 1) * kQ);
        }
        int32_t* d_indptr = device_copy(indptr);
        int32_t* d_indices = device_copy(indices);
        int32_t* d_lens = device_copy(lens);
        int32_t* d_q_indptr = device_copy(q_indptr);
        BlockTableView bt;
        bt.indptr = d_indptr;
        bt.indices = d_indices;
        bt.seq_lens = d_lens;
        bt.num_seqs = B;
        bt.block_tokens = kBlock;
        cuda::PrefillArgs a;
        a.q = q;
        a.out = out;
        a.q_indptr = d_q_indptr;
        a.block_table = bt;
        a.cache = cache.layer_view(0);
        a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kHd));
        a.workspace = ws;
        // [1]: the plan's choice (what the model runs: the verification kernel where it is
        // built); [0]: the small-q block of the mma.sync kernel; [2]: the wgmma kernel (where
        // it is built; 0 elsewhere).
        double verify_us[3] = {0, 0, 0};
        int rows_per_block[3] = {0, 0, 0}, splits[3] = {0, 0, 0};
        std::string kernel[3];
        for (int small : {1, 0, 2}) {
          cuda::PrefillOptions po;
          po.num_sms = prop.multiProcessorCount;
          if (small == 0) po.kernel = cuda::PrefillOptions::Kernel::kMma;
          if (small == 2) po.kernel = cuda::PrefillOptions::Kernel::kWgmma;
          const cuda::PrefillPlan plan = cuda::plan_prefill(spec, q_indptr, lens, po);
          if (small == 2 && !plan.wgmma) continue;
          KVQ_CHECK(plan.workspace_bytes <= ws_bytes, "verify bench: workspace too small");
          const auto ms =
              time_ms([&] { cuda::run_prefill(spec, plan, a, nullptr); }, iters, e0, e1);
          verify_us[small] = ms[ms.size() / 2] * 1e3;
          rows_per_block[small] = plan.rows_per_block;
          splits[small] = plan.num_splits;
          kernel[small] = plan.kernel_name();
        }
        cuda::DecodeOptions dopt;
        dopt.num_sms = prop.multiProcessorCount;
        const cuda::DecodePlan dplan = cuda::plan_decode(spec, lens, dopt);
        KVQ_CHECK(dplan.workspace_bytes <= ws_bytes, "verify bench: decode workspace too small");
        cuda::DecodeArgs da;
        da.q = q;
        da.out = out;
        da.block_table = bt;
        da.cache = cache.layer_view(0);
        da.softmax_scale = a.softmax_scale;
        da.workspace = ws;
        const auto dms =
            time_ms([&] { cuda::run_decode(spec, dplan, da, nullptr); }, iters, e0, e1);
        const double decode_us = dms[dms.size() / 2] * 1e3;
        // The verification through the decode kernel (kQ queries per sequence as rows).
        dopt.q_per_seq = kQ;
        const cuda::DecodePlan mplan = cuda::plan_decode(spec, lens, dopt);
        KVQ_CHECK(mplan.workspace_bytes <= ws_bytes, "verify bench: decode workspace too small");
        da.q_indptr = d_q_indptr;
        const auto mms =
            time_ms([&] { cuda::run_decode(spec, mplan, da, nullptr); }, iters, e0, e1);
        const double multi_us = mms[mms.size() / 2] * 1e3;
        const double bytes = kv_bytes(spec, static_cast<int64_t>(B) * C);
        auto pct = [&](double us) { return 100.0 * bytes / (us * 1e-6) / bw; };
        std::printf(
            "%-20s %3d %5d | %7s %8.1f (%5.1f%%) s%-3d | %12.1f (%5.1f%%) s%-3d | %8.1f s%-3d | "
            "%10.1f (%5.1f%%) s%-3d | %10.1f (%5.1f%%) | %.2fx, %.2fx, %.2fx\n",
            std::string(to_string(dtype)).c_str(), B, C, kernel[1].c_str(), verify_us[1],
            pct(verify_us[1]), splits[1], verify_us[0], pct(verify_us[0]), splits[0], verify_us[2],
            splits[2], multi_us, pct(multi_us), mplan.max_splits, decode_us, pct(decode_us),
            verify_us[1] / decode_us, verify_us[0] / decode_us, multi_us / decode_us);
        std::fflush(stdout);
        results.push_back({{"dtype", std::string(to_string(dtype))},
                           {"batch", B},
                           {"context", C},
                           {"q_per_seq", kQ},
                           {"kv_bytes", bytes},
                           {"verify_plan_us", verify_us[1]},
                           {"verify_plan_kernel", kernel[1]},
                           {"verify_plan_rows_per_block", rows_per_block[1]},
                           {"verify_plan_splits", splits[1]},
                           {"verify_mma_small_q_us", verify_us[0]},
                           {"verify_mma_small_q_rows_per_block", rows_per_block[0]},
                           {"verify_mma_small_q_splits", splits[0]},
                           {"verify_wgmma_us", verify_us[2]},
                           {"verify_wgmma_splits", splits[2]},
                           {"verify_decode_kernel_us", multi_us},
                           {"verify_decode_kernel_splits", mplan.max_splits},
                           {"decode_us", decode_us},
                           {"copy_bandwidth", bw},
                           {"iters", iters}});
        for (int32_t* d : {d_indptr, d_indices, d_lens, d_q_indptr}) KVQ_CUDA_CHECK(cudaFree(d));
      }
    }
  }
  KVQ_CUDA_CHECK(cudaFree(ws));
  KVQ_CUDA_CHECK(cudaFree(q));
  KVQ_CUDA_CHECK(cudaFree(out));
  KVQ_CUDA_CHECK(cudaEventDestroy(e0));
  KVQ_CUDA_CHECK(cudaEventDestroy(e1));
  nlohmann::json j;
  j["device"] = prop.name;
  j["sms"] = prop.multiProcessorCount;
  j["copy_bandwidth"] = bw;
  j["shape"] = {{"hq", kHq}, {"hkv", kHkv}, {"head_dim", kHd}, {"block", kBlock}};
  j["results"] = results;
  if (!json_path.empty()) std::ofstream(json_path) << j.dump(1) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  std::vector<std::string> dtype_names;
  bool quick = false, verify = false;
  std::vector<std::pair<int, int>> shapes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--dtypes" && i + 1 < argc) {
      dtype_names = split_csv(argv[++i]);
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--verify") {
      verify = true;
    } else if (a == "--shapes" && i + 1 < argc) {
      for (const auto& sh : split_csv(argv[++i])) {
        int b = 0, c = 0;
        char x = 0, rest = 0;
        if (std::sscanf(sh.c_str(), "%d%c%d%c", &b, &x, &c, &rest) != 3 || x != 'x' || b <= 0 ||
            c <= 0) {
          std::fprintf(
              stderr,
              "cuda_prefill_bench: --shapes: bad shape '%s' (accepted: BxC, e.g. 32x4096)\n",
              sh.c_str());
          return 2;
        }
        shapes.emplace_back(b, c);
      }
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--json FILE] [--dtypes a,b] [--quick] [--verify [--shapes BxC,...]]\n",
          argv[0]);
      return 2;
    }
  }
  try {
    if (cuda_device_count() == 0) {
      std::fprintf(stderr, "cuda_prefill_bench: no CUDA device\n");
      return 1;
    }
    std::vector<KvDtype> dtypes;
    if (dtype_names.empty()) {
      for (const auto& t : kKvDtypeTraits)
        if (t.concrete) dtypes.push_back(t.dtype);
    } else {
      for (const auto& n : dtype_names) dtypes.push_back(parse_kv_dtype_or_throw(n, "--dtypes"));
    }
    if (verify) return run_verify(dtypes, quick, json_path, shapes);
    cudaDeviceProp prop{};
    KVQ_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    std::vector<Shape> shapes = {{"prefill8192", kCtx, kCtx}, {"chunk2048", 2048, kCtx}};
    if (!quick) {
      shapes = {{"prefill1024", 1024, 1024}, {"prefill4096", 4096, 4096},
                {"prefill8192", 8192, 8192}, {"prefill16384", 16384, 16384},
                {"chunk2048", 2048, kCtx},   {"chunk8192", 8192, kMaxCtx}};
    }
    const int iters = quick ? 5 : 20;

    nlohmann::json results = nlohmann::json::array();
    std::mt19937 rng(12345);
    cudaStream_t stream = nullptr;
    const size_t qn = static_cast<size_t>(kMaxQ) * kHq * kHd;
    float *q = nullptr, *out = nullptr;
    KVQ_CUDA_CHECK(cudaMalloc(&q, qn * sizeof(float)));
    KVQ_CUDA_CHECK(cudaMalloc(&out, qn * sizeof(float)));
    fill_random<<<1024, 256>>>(q, static_cast<int64_t>(qn), 7);
    KVQ_CUDA_CHECK_LAUNCH();
    const int32_t num_blocks = kMaxCtx / kBlock;
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    int32_t* d_indices = device_copy(ids);
    int32_t* d_indptr = device_copy(std::vector<int32_t>{0, num_blocks});
    cudaEvent_t e0, e1;
    KVQ_CUDA_CHECK(cudaEventCreate(&e0));
    KVQ_CUDA_CHECK(cudaEventCreate(&e1));
    const size_t stage_bytes =
        cuda::prefill_staging_bytes(bench_spec(KvDtype::kFp8E4M3), num_blocks, 1);
    void* stage = nullptr;
    KVQ_CUDA_CHECK(cudaMalloc(&stage, stage_bytes));

    for (KvDtype dtype : dtypes) {
      const LayerKvSpec spec = bench_spec(dtype);
      DeviceKvCache cache({spec}, num_blocks);
      {
        const size_t elems = static_cast<size_t>(kMaxCtx) * kHkv * kHd;
        float *k = nullptr, *v = nullptr;
        KVQ_CUDA_CHECK(cudaMalloc(&k, elems * sizeof(float)));
        KVQ_CUDA_CHECK(cudaMalloc(&v, elems * sizeof(float)));
        fill_random<<<1024, 256>>>(k, static_cast<int64_t>(elems), 1);
        KVQ_CUDA_CHECK_LAUNCH();
        fill_random<<<1024, 256>>>(v, static_cast<int64_t>(elems), 2);
        KVQ_CUDA_CHECK_LAUNCH();
        std::vector<int64_t> slots(static_cast<size_t>(kMaxCtx));
        for (int t = 0; t < kMaxCtx; ++t)
          slots[static_cast<size_t>(t)] =
              static_cast<int64_t>(ids[t / kBlock]) * kBlock + t % kBlock;
        int64_t* d_slots = device_copy(slots);
        write_kv_cuda(spec, cache.layer_view(0), d_slots, kMaxCtx, k, v);
        KVQ_CUDA_CHECK(cudaDeviceSynchronize());
        KVQ_CUDA_CHECK(cudaFree(k));
        KVQ_CUDA_CHECK(cudaFree(v));
        KVQ_CUDA_CHECK(cudaFree(d_slots));
      }
      for (const Shape& sh : shapes) {
        const std::vector<int32_t> q_indptr = {0, sh.q_len};
        const std::vector<int32_t> lens = {sh.kv_len};
        int32_t* d_q_indptr = device_copy(q_indptr);
        int32_t* d_lens = device_copy(lens);
        // mma, wgmma, and for per-tensor fp8 caches wgmma over the fp16 staging (the time
        // includes the staging's two launches).
        for (int variant = 0; variant < 3; ++variant) {
          const auto kernel = variant == 0 ? cuda::PrefillOptions::Kernel::kMma
                                           : cuda::PrefillOptions::Kernel::kWgmma;
          cuda::PrefillOptions po;
          po.kernel = kernel;
          po.staging = variant == 2 ? cuda::PrefillOptions::Staging::kForce
                                    : cuda::PrefillOptions::Staging::kOff;
          po.staging_capacity = variant == 2 ? stage_bytes : 0;
          const cuda::PrefillPlan plan = cuda::plan_prefill(spec, q_indptr, lens, po);
          if (kernel == cuda::PrefillOptions::Kernel::kWgmma && !plan.wgmma) continue;
          if (variant == 2 && plan.staged_blocks == 0) continue;
          const std::string kernel_name =
              plan.staged_blocks > 0 ? "wgmma-staged" : std::string(plan.kernel_name());
          cuda::PrefillArgs a;
          a.q = q;
          a.out = out;
          a.q_indptr = d_q_indptr;
          a.block_table.indptr = d_indptr;
          a.block_table.indices = d_indices;
          a.block_table.seq_lens = d_lens;
          a.block_table.num_seqs = 1;
          a.block_table.block_tokens = kBlock;
          a.cache = cache.layer_view(0);
          a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kHd));
          a.staging = stage;
          for (int w = 0; w < 3; ++w) cuda::run_prefill(spec, plan, a, stream);
          KVQ_CUDA_CHECK(cudaDeviceSynchronize());
          std::vector<float> ms;
          for (int it = 0; it < iters; ++it) {
            KVQ_CUDA_CHECK(cudaEventRecord(e0, stream));
            cuda::run_prefill(spec, plan, a, stream);
            KVQ_CUDA_CHECK(cudaEventRecord(e1, stream));
            KVQ_CUDA_CHECK(cudaEventSynchronize(e1));
            float t = 0;
            KVQ_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
            ms.push_back(t);
          }
          std::sort(ms.begin(), ms.end());
          const double med_ms = ms[ms.size() / 2];
          double visible = 0;  // sum over queries of visible keys
          for (int j = 0; j < sh.q_len; ++j) visible += sh.kv_len - sh.q_len + j + 1;
          const double flops = 4.0 * kHd * visible * kHq;
          const double tflops = flops / (med_ms * 1e-3) / 1e12;
          std::printf("kvq %-20s %-13s %-6s q %5d kv %5d: %9.1f us  %6.1f TFLOP/s\n",
                      std::string(to_string(dtype)).c_str(), sh.name, kernel_name.c_str(), sh.q_len,
                      sh.kv_len, med_ms * 1e3, tflops);
          std::fflush(stdout);
          results.push_back({{"impl", "kvq"},
                             {"kernel", kernel_name},
                             {"dtype", std::string(to_string(dtype))},
                             {"shape", sh.name},
                             {"q_len", sh.q_len},
                             {"kv_len", sh.kv_len},
                             {"hq", kHq},
                             {"hkv", kHkv},
                             {"head_dim", kHd},
                             {"time_us", med_ms * 1e3},
                             {"min_us", ms.front() * 1e3},
                             {"flops", flops},
                             {"tflops", tflops},
                             {"iters", iters}});
        }
        KVQ_CUDA_CHECK(cudaFree(d_q_indptr));
        KVQ_CUDA_CHECK(cudaFree(d_lens));
      }
    }
    KVQ_CUDA_CHECK(cudaEventDestroy(e0));
    KVQ_CUDA_CHECK(cudaEventDestroy(e1));
    KVQ_CUDA_CHECK(cudaFree(q));
    KVQ_CUDA_CHECK(cudaFree(out));
    KVQ_CUDA_CHECK(cudaFree(d_indices));
    KVQ_CUDA_CHECK(cudaFree(d_indptr));
    KVQ_CUDA_CHECK(cudaFree(stage));
    nlohmann::json j;
    j["device"] = prop.name;
    j["sms"] = prop.multiProcessorCount;
    j["results"] = results;
    if (!json_path.empty()) std::ofstream(json_path) << j.dump(1) << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_prefill_bench: %s\n", e.what());
    return 1;
  }
}
