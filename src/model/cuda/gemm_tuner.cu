#include "model/cuda/gemm_tuner.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>

#include "cache/cuda/cuda_check.h"
#include "kvq/core/error.h"
#include "model/cuda/cublas_check.h"

namespace kvq::cuda_model {

namespace {

// Largest power of two <= 256 that divides the address.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

struct Choice {
  cublasLtMatmulAlgo_t algo;
  uint32_t alignment;  // every pointer must be at least this aligned
};

// The process-wide choices, keyed by (device, m, n, k, lda, ldc).
std::mutex g_mu;
std::map<std::tuple<int, int, int, int, int, int>, Choice>& choices() {
  static std::map<std::tuple<int, int, int, int, int, int>, Choice> m;
  return m;
}

int current_device() {
  int dev = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

}  // namespace

struct GemmTuner::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  uint32_t alignment = 256;

  Plan(int m, int n, int k, int lda, int ldc) {
    KVQ_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    KVQ_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    KVQ_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt)));
    // Column-major: w is k x n (ld k) used transposed, in is k x m (ld lda), out n x m (ld ldc).
    KVQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, static_cast<uint64_t>(k),
                                                static_cast<uint64_t>(n), k));
    KVQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, static_cast<uint64_t>(k),
                                                static_cast<uint64_t>(m), lda));
    KVQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, static_cast<uint64_t>(n),
                                                static_cast<uint64_t>(m), ldc));
  }
  ~Plan() {
    if (c) (void)cublasLtMatrixLayoutDestroy(c);
    if (b) (void)cublasLtMatrixLayoutDestroy(b);
    if (a) (void)cublasLtMatrixLayoutDestroy(a);
    if (desc) (void)cublasLtMatmulDescDestroy(desc);
  }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
};

GemmTuner::GemmTuner(cudaStream_t stream, void* workspace, size_t workspace_bytes)
    : stream_(stream), workspace_(workspace), workspace_bytes_(workspace_bytes) {
  KVQ_CUBLAS_CHECK(cublasLtCreate(&lt_));
}

GemmTuner::~GemmTuner() {
  plans_.clear();
  if (lt_) (void)cublasLtDestroy(lt_);
}

const GemmTuner::Plan* GemmTuner::find(const Key& key) const {
  const auto it = plans_.find(key);
  return it == plans_.end() ? nullptr : it->second.get();
}

double GemmTuner::tune(int m, int n, int k, const void* in, int lda,
                       std::span<const void* const> weights, float* out, int ldc) {
  KVQ_CHECK(m > 0 && n > 0 && k > 0 && !weights.empty(), "GemmTuner::tune: empty GEMM");
  const Key key{m, n, k, lda, ldc};
  if (find(key) != nullptr) return 0.0;
  const int dev = current_device();
  const std::tuple<int, int, int, int, int, int> gkey{dev, m, n, k, lda, ldc};
  auto plan = std::make_unique<Plan>(m, n, k, lda, ldc);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    const auto it = choices().find(gkey);
    if (it != choices().end()) {
      plan->algo = it->second.algo;
      plan->alignment = it->second.alignment;
      plans_.emplace(key, std::move(plan));
      return 0.0;
    }
  }
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  KVQ_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capturing));
  KVQ_CHECK(capturing == cudaStreamCaptureStatusNone,
            "GemmTuner::tune: the stream is being captured");

  uint32_t align = std::min(alignment_of(in), alignment_of(out));
  for (const void* w : weights) align = std::min(align, alignment_of(w));
  cublasLtMatmulPreference_t pref = nullptr;
  KVQ_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  cublasLtMatmulHeuristicResult_t found[16] = {};
  int returned = 0;
  try {
    KVQ_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (const cublasLtMatmulPreferenceAttributes_t attr : attrs)
      KVQ_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
        lt_, plan->desc, plan->a, plan->b, plan->c, plan->c, pref, 16, found, &returned);
    if (st != CUBLAS_STATUS_SUCCESS) returned = 0;
  } catch (...) {
    (void)cublasLtMatmulPreferenceDestroy(pref);
    throw;
  }
  (void)cublasLtMatmulPreferenceDestroy(pref);

  cudaEvent_t e0 = nullptr, e1 = nullptr;
  KVQ_CUDA_CHECK(cudaEventCreate(&e0));
  KVQ_CUDA_CHECK(cudaEventCreate(&e1));
  const float alpha = 1.0f, beta = 0.0f;
  auto sweep = [&](const cublasLtMatmulAlgo_t& algo) {
    for (const void* w : weights)
      if (cublasLtMatmul(lt_, plan->desc, &alpha, w, plan->a, in, plan->b, &beta, out, plan->c, out,
                         plan->c, &algo, workspace_, workspace_bytes_,
                         stream_) != CUBLAS_STATUS_SUCCESS)
        return false;
    return true;
  };
  constexpr int kSweeps = 3;
  double best_us = std::numeric_limits<double>::infinity();
  int best = -1;
  for (int i = 0; i < returned; ++i) {
    if (found[static_cast<size_t>(i)].state != CUBLAS_STATUS_SUCCESS) continue;
    const cublasLtMatmulAlgo_t& algo = found[static_cast<size_t>(i)].algo;
    if (!sweep(algo)) continue;  // warm-up; an algorithm that fails to launch is skipped
    KVQ_CUDA_CHECK(cudaEventRecord(e0, stream_));
    bool ok = true;
    for (int s = 0; s < kSweeps && ok; ++s) ok = sweep(algo);
    KVQ_CUDA_CHECK(cudaEventRecord(e1, stream_));
    KVQ_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0.0f;
    KVQ_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    const double us = 1e3 * ms / (kSweeps * static_cast<double>(weights.size()));
    if (ok && us < best_us) best_us = us, best = i;
  }
  (void)cudaEventDestroy(e0);
  (void)cudaEventDestroy(e1);
  if (best < 0) return 0.0;  // nothing ran: run() keeps returning false for this shape
  plan->algo = found[static_cast<size_t>(best)].algo;
  plan->alignment = align;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    choices().emplace(gkey, Choice{plan->algo, align});
  }
  plans_.emplace(key, std::move(plan));
  return best_us;
}

bool GemmTuner::run(int m, int n, int k, const void* in, int lda, const void* w, float* out,
                    int ldc, float beta) const {
  const Plan* p = find(Key{m, n, k, lda, ldc});
  if (p == nullptr) return false;
  if (alignment_of(in) < p->alignment || alignment_of(w) < p->alignment ||
      alignment_of(out) < p->alignment)
    return false;
  const float alpha = 1.0f;
  KVQ_CUBLAS_CHECK(cublasLtMatmul(lt_, p->desc, &alpha, w, p->a, in, p->b, &beta, out, p->c, out,
                                  p->c, &p->algo, workspace_, workspace_bytes_, stream_));
  return true;
}

}  // namespace kvq::cuda_model
