// kvq CUDA decode attention timings per KV dtype, with the device's measured copy bandwidth.
//
// Shapes: batch x context over a paged cache (block 16, blocks in random order), 32 or 64
// query heads over 8 kv heads, head_dim 128, one decode query per sequence at the last
// position. The cache of each dtype is allocated once at the largest size that fits and
// filled through write_kv_cuda from random rows (never zeros); each grid point uses a
// prefix of its blocks. When a point's KV bytes would fit in L2, the timed iterations rotate
// over several disjoint copies so every byte comes from HBM.
//
// Timing: CUDA events around each iteration (Q prep + split-KV kernel + merge), after
// warm-up; the median is reported. bytes_read counts the cache bytes the kernel reads (K and
// V codes plus their per-token / per-block scales, whole 16-token tiles), plus Q and the output.
//
// Usage: cuda_decode_bench [--json FILE] [--csv FILE] [--dtypes a,b,...] [--quick]
//          [--batches 1,8,...] [--contexts 1024,...] [--heads 32,64]   (narrowed grids)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attention/cuda/cuda_decode.h"
#include "cache/cuda/cuda_check.h"
#include "kvq/cache/device_kv_cache.h"

namespace {

using namespace kvq;

__global__ void fill_random(float* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    // Sum of four uniforms: roughly normal; one value in 64 is an outlier.
    float s = 0.0f;
    for (int k = 0; k < 4; ++k) s += static_cast<float>((z >> (16 * k)) & 0xFFFF) / 65536.0f;
    float v = (s - 2.0f) * 1.7f;
    if ((z & 63) == 0) v *= 8.0f;
    x[i] = v;
  }
}

__global__ void iota_slots(int64_t* s, int64_t n, int64_t start) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) s[i] = start + i;
}

struct Point {
  std::string impl, dtype;
  int batch = 0, ctx = 0, hq = 0, hkv = 0, hd = 128;
  double time_us = 0, min_us = 0;
  double bytes_read = 0;
  int copies = 0, iters = 0, splits = 0;
  std::string note;
};

std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Device-to-device copy bandwidth, counting bytes read plus bytes written.
double measure_copy_tbs(size_t bytes) {
  void *a = nullptr, *b = nullptr;
  KVQ_CUDA_CHECK(cudaMalloc(&a, bytes));
  KVQ_CUDA_CHECK(cudaMalloc(&b, bytes));
  KVQ_CUDA_CHECK(cudaMemset(a, 0x3C, bytes));
  cudaEvent_t e0, e1;
  KVQ_CUDA_CHECK(cudaEventCreate(&e0));
  KVQ_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 23; ++i) {
    KVQ_CUDA_CHECK(cudaEventRecord(e0));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    KVQ_CUDA_CHECK(cudaEventRecord(e1));
    KVQ_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    KVQ_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 3) ms.push_back(t);
  }
  KVQ_CUDA_CHECK(cudaEventDestroy(e0));
  KVQ_CUDA_CHECK(cudaEventDestroy(e1));
  KVQ_CUDA_CHECK(cudaFree(a));
  KVQ_CUDA_CHECK(cudaFree(b));
  return 2.0 * static_cast<double>(bytes) / (median(ms) * 1e-3) / 1e12;
}

LayerKvSpec bench_spec(KvDtype d, int hq, int hkv) {
  LayerKvSpec s;
  s.layer = 0;
  s.k_dtype = s.v_dtype = d;
  s.num_q_heads = hq;
  s.num_kv_heads = hkv;
  s.head_dim_k = s.head_dim_v = 128;
  s.block_tokens = 16;
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

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, csv_path;
  std::vector<std::string> dtype_names, batch_list, ctx_list, head_list;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc)
      json_path = argv[++i];
    else if (a == "--csv" && i + 1 < argc)
      csv_path = argv[++i];
    else if (a == "--dtypes" && i + 1 < argc)
      dtype_names = split_csv(argv[++i]);
    else if (a == "--quick")
      quick = true;
    else if (a == "--batches" && i + 1 < argc)
      batch_list = split_csv(argv[++i]);
    else if (a == "--contexts" && i + 1 < argc)
      ctx_list = split_csv(argv[++i]);
    else if (a == "--heads" && i + 1 < argc)
      head_list = split_csv(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: %s [--json FILE] [--csv FILE] [--dtypes a,b] [--quick] "
                   "[--batches 1,8] [--contexts 1024,4096] [--heads 32,64]\n",
                   argv[0]);
      return 2;
    }
  }
  try {
    if (cuda_device_count() == 0) {
      std::fprintf(stderr, "cuda_decode_bench: no CUDA device\n");
      return 1;
    }
    std::vector<KvDtype> dtypes;
    if (dtype_names.empty()) {
      for (const auto& t : kKvDtypeTraits)
        if (t.concrete) dtypes.push_back(t.dtype);
    } else {
      for (const auto& n : dtype_names) dtypes.push_back(parse_kv_dtype_or_throw(n, "--dtypes"));
    }
    auto ints = [](const std::vector<std::string>& v, std::vector<int> dflt) {
      if (v.empty()) return dflt;
      std::vector<int> out;
      for (const auto& x : v) out.push_back(std::stoi(x));
      std::sort(out.begin(), out.end());  // the cache is sized from the last of each
      return out;
    };
    const std::vector<int> batches =
        ints(batch_list, quick ? std::vector<int>{1, 32} : std::vector<int>{1, 8, 32, 64, 128});
    const std::vector<int> contexts =
        ints(ctx_list, quick ? std::vector<int>{1024, 16384}
                             : std::vector<int>{256, 1024, 4096, 16384, 32768});
    std::vector<std::pair<int, int>> heads;
    for (int hq : ints(head_list, {32, 64})) heads.push_back({hq, 8});

    cudaDeviceProp prop{};
    KVQ_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const double copy_tbs = measure_copy_tbs(size_t{2} << 30);
    std::printf("device: %s, %d SMs, L2 %d MB; device-to-device copy %.3f TB/s (read + write)\n",
                prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, copy_tbs);
    std::fflush(stdout);

    std::vector<Point> points;
    std::mt19937 rng(12345);
    cudaStream_t stream = nullptr;
    cudaEvent_t e0, e1;
    KVQ_CUDA_CHECK(cudaEventCreate(&e0));
    KVQ_CUDA_CHECK(cudaEventCreate(&e1));
    const int max_tokens = batches.back() * contexts.back();

    for (KvDtype dtype : dtypes) {
      const LayerKvSpec base = bench_spec(dtype, 32, 8);
      // The largest cache that fits, leaving room for workspaces and the copy rotation.
      size_t free_b = 0, total_b = 0;
      KVQ_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
      const size_t budget = free_b > (size_t{6} << 30) ? free_b - (size_t{6} << 30) : free_b / 2;
      const int64_t want_blocks = max_tokens / 16 + 1024;  // + room for rotation copies
      const int64_t fit_blocks = static_cast<int64_t>(budget / base.block_bytes());
      const auto num_blocks = static_cast<int32_t>(std::min(want_blocks, fit_blocks));
      DeviceKvCache cache({base}, num_blocks);
      {
        // Fill every slot from random rows, a chunk at a time.
        const int64_t chunk = 65536;
        const size_t elems = static_cast<size_t>(chunk) * base.num_kv_heads * 128;
        float *k = nullptr, *v = nullptr;
        int64_t* slots = nullptr;
        KVQ_CUDA_CHECK(cudaMalloc(&k, elems * sizeof(float)));
        KVQ_CUDA_CHECK(cudaMalloc(&v, elems * sizeof(float)));
        KVQ_CUDA_CHECK(cudaMalloc(&slots, chunk * sizeof(int64_t)));
        fill_random<<<1024, 256>>>(k, static_cast<int64_t>(elems), 1);
        KVQ_CUDA_CHECK_LAUNCH();
        fill_random<<<1024, 256>>>(v, static_cast<int64_t>(elems), 2);
        KVQ_CUDA_CHECK_LAUNCH();
        const int64_t total = static_cast<int64_t>(num_blocks) * 16;
        for (int64_t s = 0; s < total; s += chunk) {
          const int64_t n = std::min(chunk, total - s);
          iota_slots<<<static_cast<unsigned>((n + 255) / 256), 256>>>(slots, n, s);
          KVQ_CUDA_CHECK_LAUNCH();
          write_kv_cuda(base, cache.layer_view(0), slots, n, k, v);
        }
        KVQ_CUDA_CHECK(cudaDeviceSynchronize());
        KVQ_CUDA_CHECK(cudaFree(k));
        KVQ_CUDA_CHECK(cudaFree(v));
        KVQ_CUDA_CHECK(cudaFree(slots));
      }
      const KvSideLayout kl = base.layout(KvSide::kK);
      const double token_head_bytes =
          2.0 * static_cast<double>(kl.row_data_bytes + kl.row_scale_bytes);

      for (auto [hq, hkv] : heads) {
        const LayerKvSpec spec = bench_spec(dtype, hq, hkv);
        for (int batch : batches) {
          for (int ctx : contexts) {
            Point pt;
            pt.impl = "kvq";
            pt.dtype = std::string(to_string(dtype));
            pt.batch = batch;
            pt.ctx = ctx;
            pt.hq = hq;
            pt.hkv = hkv;
            const int64_t blocks_needed = static_cast<int64_t>(batch) * ctx / 16;
            if (blocks_needed > num_blocks) {
              pt.note = "skipped: does not fit in device memory";
              points.push_back(pt);
              continue;
            }
            const double kv_bytes = static_cast<double>(batch) * ctx * hkv * token_head_bytes;
            const int copies = static_cast<int>(std::clamp<int64_t>(
                static_cast<int64_t>(std::ceil(4.0 * prop.l2CacheSize / kv_bytes)), 1,
                std::min<int64_t>(256, num_blocks / blocks_needed)));
            // Block tables: copy r owns a random permutation of its own block range.
            std::vector<int32_t*> d_indices(copies);
            for (int r = 0; r < copies; ++r) {
              std::vector<int32_t> ids(static_cast<size_t>(blocks_needed));
              std::iota(ids.begin(), ids.end(), static_cast<int32_t>(r * blocks_needed));
              std::shuffle(ids.begin(), ids.end(), rng);
              d_indices[r] = device_copy(ids);
            }
            std::vector<int32_t> indptr(batch + 1), lens(batch, ctx);
            for (int i = 0; i <= batch; ++i) indptr[i] = i * (ctx / 16);
            int32_t* d_indptr = device_copy(indptr);
            int32_t* d_lens = device_copy(lens);
            const size_t qn = static_cast<size_t>(batch) * hq * 128;
            float *q = nullptr, *out = nullptr;
            KVQ_CUDA_CHECK(cudaMalloc(&q, qn * sizeof(float)));
            KVQ_CUDA_CHECK(cudaMalloc(&out, qn * sizeof(float)));
            fill_random<<<256, 256>>>(q, static_cast<int64_t>(qn), 7);
            KVQ_CUDA_CHECK_LAUNCH();
            const cuda::DecodePlan plan = cuda::plan_decode(spec, lens);
            void* ws = nullptr;
            KVQ_CUDA_CHECK(cudaMalloc(&ws, plan.workspace_bytes));
            cuda::DecodeArgs a;
            a.q = q;
            a.out = out;
            a.block_table.indptr = d_indptr;
            a.block_table.seq_lens = d_lens;
            a.block_table.num_seqs = batch;
            a.block_table.block_tokens = 16;
            a.cache = cache.layer_view(0);
            a.softmax_scale = 1.0f / std::sqrt(128.0f);
            a.workspace = ws;
            auto run = [&](int r) {
              a.block_table.indices = d_indices[r % copies];
              cuda::run_decode(spec, plan, a, stream);
            };
            for (int w = 0; w < 3; ++w) run(w);
            KVQ_CUDA_CHECK(cudaDeviceSynchronize());
            // Enough iterations for ~30 ms of GPU time, between 10 and 200.
            KVQ_CUDA_CHECK(cudaEventRecord(e0, stream));
            run(0);
            KVQ_CUDA_CHECK(cudaEventRecord(e1, stream));
            KVQ_CUDA_CHECK(cudaEventSynchronize(e1));
            float probe = 0;
            KVQ_CUDA_CHECK(cudaEventElapsedTime(&probe, e0, e1));
            const int iters = std::clamp(static_cast<int>(30.0 / std::max(probe, 1e-3f)), 10, 200);
            std::vector<cudaEvent_t> ev(static_cast<size_t>(iters) + 1);
            for (auto& e : ev) KVQ_CUDA_CHECK(cudaEventCreate(&e));
            KVQ_CUDA_CHECK(cudaEventRecord(ev[0], stream));
            for (int it = 0; it < iters; ++it) {
              run(it + 1);
              KVQ_CUDA_CHECK(cudaEventRecord(ev[static_cast<size_t>(it) + 1], stream));
            }
            KVQ_CUDA_CHECK(cudaEventSynchronize(ev.back()));
            std::vector<float> ms;
            for (int it = 0; it < iters; ++it) {
              float t = 0;
              KVQ_CUDA_CHECK(cudaEventElapsedTime(&t, ev[static_cast<size_t>(it)],
                                                  ev[static_cast<size_t>(it) + 1]));
              ms.push_back(t);
            }
            for (auto& e : ev) KVQ_CUDA_CHECK(cudaEventDestroy(e));
            pt.time_us = median(ms) * 1e3;
            pt.min_us = *std::min_element(ms.begin(), ms.end()) * 1e3;
            pt.bytes_read = kv_bytes + 2.0 * static_cast<double>(qn) * sizeof(float);
            pt.copies = copies;
            pt.iters = iters;
            pt.splits = plan.max_splits;
            points.push_back(pt);
            std::printf("kvq %-20s hq %2d B %3d ctx %5d: %9.1f us  %5.2f TB/s  (%d splits)\n",
                        pt.dtype.c_str(), hq, batch, ctx, pt.time_us,
                        pt.bytes_read / (pt.time_us * 1e-6) / 1e12, plan.max_splits);
            std::fflush(stdout);
            for (auto* p : d_indices) KVQ_CUDA_CHECK(cudaFree(p));
            KVQ_CUDA_CHECK(cudaFree(d_indptr));
            KVQ_CUDA_CHECK(cudaFree(d_lens));
            KVQ_CUDA_CHECK(cudaFree(q));
            KVQ_CUDA_CHECK(cudaFree(out));
            KVQ_CUDA_CHECK(cudaFree(ws));
          }
        }
      }
    }

    nlohmann::json j;
    j["device"] = prop.name;
    j["sms"] = prop.multiProcessorCount;
    j["l2_bytes"] = prop.l2CacheSize;
    j["copy_tbs"] = copy_tbs;
    j["results"] = nlohmann::json::array();
    for (const Point& p : points)
      j["results"].push_back({{"impl", p.impl},
                              {"dtype", p.dtype},
                              {"batch", p.batch},
                              {"ctx", p.ctx},
                              {"hq", p.hq},
                              {"hkv", p.hkv},
                              {"head_dim", p.hd},
                              {"time_us", p.time_us},
                              {"min_us", p.min_us},
                              {"bytes_read", p.bytes_read},
                              {"copies", p.copies},
                              {"iters", p.iters},
                              {"splits", p.splits},
                              {"note", p.note}});
    if (!json_path.empty()) std::ofstream(json_path) << j.dump(1) << "\n";
    if (!csv_path.empty()) {
      std::ofstream csv(csv_path);
      csv << "impl,dtype,batch,ctx,hq,hkv,head_dim,time_us,min_us,bytes_read,eff_tbs,copies,iters,"
             "splits,note\n";
      for (const Point& p : points)
        csv << p.impl << "," << p.dtype << "," << p.batch << "," << p.ctx << "," << p.hq << ","
            << p.hkv << "," << p.hd << "," << p.time_us << "," << p.min_us << "," << p.bytes_read
            << "," << (p.time_us > 0 ? p.bytes_read / (p.time_us * 1e-6) / 1e12 : 0.0) << ","
            << p.copies << "," << p.iters << "," << p.splits << "," << p.note << "\n";
    }
    KVQ_CUDA_CHECK(cudaEventDestroy(e0));
    KVQ_CUDA_CHECK(cudaEventDestroy(e1));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_decode_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
