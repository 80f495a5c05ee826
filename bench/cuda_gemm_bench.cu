// Kernel lab for the decode GEMMs of the CUDA model (issue #13): how fast cuBLASLt runs the
// skinny products of a decode step (out[m][n] = in[m][k] * w[n][k]^T, m = the batch) for
// bf16 and FP8 e4m3 operands, and which FP8 scaling mode gives it the better kernels.
//
//   cuda_gemm_bench [--shapes llama3-8b] [--m 1,8,16,64] [--layers 8] [--beta 0|1]
//                   [--modes bf16,fp8-vector,fp8-scalar,gemv,gemv-fp8,gemv-w8a16]
//
// For every (m, n, k) and mode it asks cuBLASLt's heuristic for up to 32 candidates, times each
// over `layers` distinct weight matrices in turn (so the weights stream from HBM as in a step,
// not from L2), and prints the best: microseconds per GEMM, the weight bytes / time in GB/s,
// and the candidate count. Modes:
//   bf16        bf16 x bf16 -> fp32 (what the model runs today)
//   fp8-vector  e4m3 x e4m3 -> fp32, one scale per weight row and per token row applied by
//               cuBLASLt (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, the model's FP8 path)
//   fp8-scalar  e4m3 x e4m3 -> fp32, one scale per tensor (the per-row scales would then be
//               applied by the kernel that consumes the product)
//   gemv        bf16 x bf16 -> fp32 by kvq's skinny kernel (src/model/cuda/gemv.h; m <= 16),
//               the candidate GemmTuner times beside cuBLASLt's
//   gemv-fp8    e4m3 x e4m3 -> fp32 with both scale vectors, the same kernel's FP8 form
//   gemv-w8a16  bf16 inputs x e4m3 weights -> fp32 with the weights' row scales (gemv_w8a16:
//               the FP8 model's decode steps, no input quantization)
// Each line also gives the device's copy bandwidth (read + write, measured once at start) and
// the weight bytes / time as a share of it.
// --beta 1 times out = product + out (the residual add the model's o and down projections
// ask of cuBLASLt); 0 (default) writes the product alone. One JSON line per point on stdout.
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "model/cuda/gemv.h"

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define CB(x)                                                                                \
  do {                                                                                       \
    cublasStatus_t s_ = (x);                                                                 \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                       \
      std::fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)s_); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

namespace {

enum class Mode { kBf16, kFp8Vector, kFp8Scalar, kGemv, kGemvFp8, kGemvW8a16 };
constexpr Mode kModes[] = {Mode::kBf16, Mode::kFp8Vector, Mode::kFp8Scalar,
                           Mode::kGemv, Mode::kGemvFp8,   Mode::kGemvW8a16};
const char* name(Mode m) {
  return m == Mode::kBf16        ? "bf16"
         : m == Mode::kFp8Vector ? "fp8-vector"
         : m == Mode::kFp8Scalar ? "fp8-scalar"
         : m == Mode::kGemv      ? "gemv"
         : m == Mode::kGemvFp8   ? "gemv-fp8"
                                 : "gemv-w8a16";
}

// Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written (the median
// of 20 copies of 2 GiB).
double copy_gbs(cudaStream_t st) {
  const size_t bytes = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemsetAsync(a, 0x3c, bytes, st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 23; ++i) {
    CK(cudaEventRecord(e0, st));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 3) ms.push_back(t);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaFree(a));
  CK(cudaFree(b));
  std::sort(ms.begin(), ms.end());
  return 2.0 * static_cast<double>(bytes) / (ms[ms.size() / 2] * 1e6);
}

__global__ void fill(uint8_t* p, size_t n, uint32_t seed, bool fp8) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    // fp8: any code but NaN (0x7f / 0xff); bf16 bytes: small magnitudes (high byte 0x3c/0xbc).
    p[i] = fp8 ? static_cast<uint8_t>((h & 0x7f) == 0x7f ? 0x38 : h)
               : static_cast<uint8_t>((i & 1) ? ((h & 1) ? 0x3c : 0xbc) : h);
  }
}

__global__ void ones(float* p, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = 1.0f;
}

struct Point {
  double best_us = std::numeric_limits<double>::infinity();
  // With beta 1: the best time at beta 0, and the beta-1 time of the algorithm that gives it
  // (a tuner that times with beta 0 and runs with beta 1 gets the latter).
  double best0_us = std::numeric_limits<double>::infinity();
  double best0_algo_at_beta_us = -1.0;
  int candidates = 0;
  int tile = -1, splitk = -1;
};

Point run(cublasLtHandle_t lt, cudaStream_t st, Mode mode, int m, int n, int k, int layers,
          float beta, void* ws, size_t ws_bytes) {
  const bool fp8 = mode == Mode::kFp8Vector || mode == Mode::kFp8Scalar || mode == Mode::kGemvFp8;
  const bool w8 = mode == Mode::kGemvW8a16;  // e4m3 weights, bf16 inputs
  const size_t el = fp8 ? 1 : 2;
  const size_t wel = fp8 || w8 ? 1 : 2;
  std::vector<void*> w(static_cast<size_t>(layers));
  for (auto& p : w) {
    CK(cudaMalloc(&p, static_cast<size_t>(n) * k * wel));
    fill<<<1024, 256, 0, st>>>(static_cast<uint8_t*>(p), static_cast<size_t>(n) * k * wel,
                               static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p)), fp8 || w8);
    CK(cudaGetLastError());
  }
  void* in = nullptr;
  float *out = nullptr, *sa = nullptr, *sb = nullptr;
  CK(cudaMalloc(&in, static_cast<size_t>(m) * k * el));
  fill<<<256, 256, 0, st>>>(static_cast<uint8_t*>(in), static_cast<size_t>(m) * k * el, 7u, fp8);
  CK(cudaGetLastError());
  CK(cudaMalloc(&out, static_cast<size_t>(m) * n * sizeof(float)));
  CK(cudaMalloc(&sa, static_cast<size_t>(n) * sizeof(float)));
  CK(cudaMalloc(&sb, static_cast<size_t>(m) * sizeof(float)));
  ones<<<64, 256, 0, st>>>(sa, n);
  ones<<<64, 256, 0, st>>>(sb, m);
  CK(cudaGetLastError());

  if (mode == Mode::kGemv || mode == Mode::kGemvFp8 || w8) {
    Point p;
    p.candidates = m <= kvq::cuda_model::kGemvMaxRows ? 1 : 0;
    if (p.candidates == 1) {
      // Every variant (warps per block); the best is reported, its warps as tile_id.
      for (const int warps : kvq::cuda_model::kGemvWarps) {
        if (!kvq::cuda_model::gemv_variant_fits(warps, m, k, fp8)) continue;
        auto sweep = [&](float b) {
          for (void* wp : w) {
            if (fp8)
              kvq::cuda_model::gemv_fp8(m, n, k, in, sb, k, wp, sa, out, n, b, st, warps);
            else if (w8)
              kvq::cuda_model::gemv_w8a16(m, n, k, in, k, wp, sa, out, n, b, st, warps);
            else
              kvq::cuda_model::gemv_bf16(m, n, k, in, k, wp, out, n, b, st, warps);
          }
        };
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        constexpr int kSweeps = 10;
        sweep(beta);
        CK(cudaEventRecord(e0, st));
        for (int s = 0; s < kSweeps; ++s) sweep(beta);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        const double us = 1e3 * ms / (kSweeps * layers);
        std::fprintf(stderr, "gemv n %d k %d m %d warps %d: %.2f us\n", n, k, m, warps, us);
        if (us < p.best_us) p.best_us = us, p.tile = warps;
        CK(cudaEventDestroy(e0));
        CK(cudaEventDestroy(e1));
      }
    }
    for (void* q : w) CK(cudaFree(q));
    CK(cudaFree(in));
    CK(cudaFree(out));
    CK(cudaFree(sa));
    CK(cudaFree(sb));
    return p;
  }
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  CB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
  CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
  CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt)));
  if (mode == Mode::kFp8Vector) {
    const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer,
                                      sizeof(outer)));
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer,
                                      sizeof(outer)));
  }
  if (fp8) {
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  }
  const cudaDataType ty = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  CB(cublasLtMatrixLayoutCreate(&la, ty, static_cast<uint64_t>(k), static_cast<uint64_t>(n), k));
  CB(cublasLtMatrixLayoutCreate(&lb, ty, static_cast<uint64_t>(k), static_cast<uint64_t>(m), k));
  CB(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, static_cast<uint64_t>(n), static_cast<uint64_t>(m),
                                n));
  cublasLtMatmulPreference_t pref = nullptr;
  CB(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t wsb = ws_bytes;
  CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                          sizeof(wsb)));
  cublasLtMatmulHeuristicResult_t found[32] = {};
  int returned = 0;
  if (cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 32, found, &returned) !=
      CUBLAS_STATUS_SUCCESS)
    returned = 0;
  Point p;
  p.candidates = returned;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const float alpha = 1.0f;
  // Microseconds per GEMM of candidate i at beta b, or infinity if it fails to launch.
  auto time_at = [&](int i, float b) {
    auto sweep = [&]() {
      for (void* wp : w)
        if (cublasLtMatmul(lt, desc, &alpha, wp, la, in, lb, &b, out, lc, out, lc, &found[i].algo,
                           ws, ws_bytes, st) != CUBLAS_STATUS_SUCCESS)
          return false;
      return true;
    };
    if (!sweep()) return std::numeric_limits<double>::infinity();
    constexpr int kSweeps = 10;
    CK(cudaEventRecord(e0, st));
    bool ok = true;
    for (int s = 0; s < kSweeps && ok; ++s) ok = sweep();
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ok ? 1e3 * ms / (kSweeps * layers) : std::numeric_limits<double>::infinity();
  };
  for (int i = 0; i < returned; ++i) {
    if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
    const double us = time_at(i, beta);
    if (beta != 0.0f) {
      const double us0 = time_at(i, 0.0f);
      if (us0 < p.best0_us) p.best0_us = us0, p.best0_algo_at_beta_us = us;
    }
    if (us < p.best_us) {
      p.best_us = us;
      size_t sz = 0;
      int v = -1;
      if (cublasLtMatmulAlgoConfigGetAttribute(&found[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &v,
                                               sizeof(v), &sz) == CUBLAS_STATUS_SUCCESS)
        p.tile = v;
      v = -1;
      if (cublasLtMatmulAlgoConfigGetAttribute(&found[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &v,
                                               sizeof(v), &sz) == CUBLAS_STATUS_SUCCESS)
        p.splitk = v;
    }
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  (void)cublasLtMatmulPreferenceDestroy(pref);
  (void)cublasLtMatrixLayoutDestroy(lc);
  (void)cublasLtMatrixLayoutDestroy(lb);
  (void)cublasLtMatrixLayoutDestroy(la);
  (void)cublasLtMatmulDescDestroy(desc);
  for (void* q : w) CK(cudaFree(q));
  CK(cudaFree(in));
  CK(cudaFree(out));
  CK(cudaFree(sa));
  CK(cudaFree(sb));
  return p;
}

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  std::string str(s);
  size_t pos = 0;
  while (pos <= str.size()) {
    const size_t c = str.find(',', pos);
    const std::string tok = str.substr(pos, c == std::string::npos ? std::string::npos : c - pos);
    if (!tok.empty()) v.push_back(std::atoi(tok.c_str()));
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> ms = {1, 8, 16, 64};
  int layers = 8;
  float beta = 0.0f;
  std::string shape_set = "llama3-8b";
  std::vector<Mode> modes = {Mode::kBf16, Mode::kFp8Vector, Mode::kFp8Scalar, Mode::kGemv,
                             Mode::kGemvFp8};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--m") && i + 1 < argc) {
      ms = parse_list(argv[++i]);
    } else if (!std::strcmp(argv[i], "--beta") && i + 1 < argc) {
      const std::string b = argv[++i];
      if (b != "0" && b != "1") {
        std::fprintf(stderr, "cuda_gemm_bench: --beta accepts 0 or 1, got %s\n", b.c_str());
        return 2;
      }
      beta = b == "1" ? 1.0f : 0.0f;
    } else if (!std::strcmp(argv[i], "--modes") && i + 1 < argc) {
      modes.clear();
      std::string list = argv[++i];
      size_t pos = 0;
      while (pos <= list.size()) {
        const size_t c = std::min(list.find(',', pos), list.size());
        const std::string tok = list.substr(pos, c - pos);
        bool found = false;
        for (Mode md : kModes)
          if (tok == name(md)) modes.push_back(md), found = true;
        if (!found) {
          std::fprintf(stderr,
                       "cuda_gemm_bench: --modes accepts bf16, fp8-vector, fp8-scalar, gemv, "
                       "gemv-fp8, gemv-w8a16; got %s\n",
                       tok.c_str());
          return 2;
        }
        pos = c + 1;
      }
    } else if (!std::strcmp(argv[i], "--layers") && i + 1 < argc) {
      layers = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--shapes") && i + 1 < argc) {
      shape_set = argv[++i];
      if (shape_set != "llama3-8b" && shape_set != "llama3-8b-tp2") {
        std::fprintf(stderr,
                     "cuda_gemm_bench: --shapes accepts llama3-8b or llama3-8b-tp2, got %s\n",
                     shape_set.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: cuda_gemm_bench [--shapes llama3-8b|llama3-8b-tp2] [--m 1,8,16,64] "
                   "[--layers 8] [--beta 0|1] "
                   "[--modes bf16,fp8-vector,fp8-scalar,gemv,gemv-fp8,gemv-w8a16]\n");
      return 2;
    }
  }
  struct Shape {
    const char* name;
    int n, k;
  };
  // One rank's share under tensor parallelism 2: q|k|v and gate|up split by output, o and down
  // by input, the LM head by vocabulary.
  const std::vector<Shape> shapes = shape_set == "llama3-8b"
                                        ? std::vector<Shape>{{"qkv", 6144, 4096},
                                                             {"o", 4096, 4096},
                                                             {"gate_up", 28672, 4096},
                                                             {"down", 4096, 14336},
                                                             {"lm_head", 128256, 4096}}
                                        : std::vector<Shape>{{"qkv", 3072, 4096},
                                                             {"o", 4096, 2048},
                                                             {"gate_up", 14336, 4096},
                                                             {"down", 4096, 7168},
                                                             {"lm_head", 64128, 4096}};
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cublasLtHandle_t lt;
  CB(cublasLtCreate(&lt));
  const size_t ws_bytes = size_t{32} << 20;
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  const double copy = copy_gbs(st);
  std::fprintf(stderr, "device %s, copy %.0f GB/s (read + write)\n", prop.name, copy);
  for (const Shape& s : shapes)
    for (int m : ms)
      for (Mode mode : modes) {
        const Point p = run(lt, st, mode, m, s.n, s.k, layers, beta, ws, ws_bytes);
        const bool one_byte = mode == Mode::kFp8Vector || mode == Mode::kFp8Scalar ||
                              mode == Mode::kGemvFp8 || mode == Mode::kGemvW8a16;
        const double bytes = static_cast<double>(s.n) * s.k * (one_byte ? 1 : 2);
        const double gbs = p.best_us > 0 && p.best_us < 1e30 ? bytes / (p.best_us * 1e3) : 0.0;
        std::printf(
            "{\"shape\": \"%s\", \"m\": %d, \"n\": %d, \"k\": %d, \"mode\": \"%s\", \"beta\": "
            "%g, \"best_us\": %.2f, "
            "\"weight_gb_per_s\": %.0f, \"pct_copy\": %.1f, \"copy_gb_per_s\": %.0f, "
            "\"candidates\": %d, \"tile_id\": %d, \"splitk\": %d, "
            "\"best_beta0_us\": %.2f, \"beta0_choice_at_beta_us\": %.2f}\n",
            s.name, m, s.n, s.k, name(mode), beta, p.best_us < 1e30 ? p.best_us : -1.0, gbs,
            100.0 * gbs / copy, copy, p.candidates, p.tile, p.splitk,
            p.best0_us < 1e30 ? p.best0_us : -1.0,
            p.best0_algo_at_beta_us < 1e30 ? p.best0_algo_at_beta_us : -1.0);
        std::fflush(stdout);
      }
  CK(cudaFree(ws));
  CB(cublasLtDestroy(lt));
  CK(cudaStreamDestroy(st));
  return 0;
}
