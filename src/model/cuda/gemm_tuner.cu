#include "model/cuda/gemm_tuner.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cache/cuda/cuda_check.h"
#include "kvq/core/error.h"
#include "model/cuda/cublas_check.h"
#include "model/cuda/gemv.h"
#include "model/cuda/model_kernels.h"

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
  bool epilogue;       // FP8: unit-scale GEMM + kvq's scaling kernel
  int gemv_warps;      // bf16: kvq's skinny kernel (gemv.h) with these warps per block, or 0
};

// The process-wide choices, keyed by (device, type and FP8 scaling restriction, m, n, k, lda,
// ldc).
using GlobalKey = std::tuple<int, int, int, int, int, int, int>;
std::mutex g_mu;
std::map<GlobalKey, Choice>& choices() {
  static std::map<GlobalKey, Choice> m;
  return m;
}

void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void* v, size_t n) {
  KVQ_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, a, v, n));
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
  GemmInput type = GemmInput::kBF16;
  bool epilogue = false;  // FP8: unit scales in cuBLASLt, kvq's kernel applies them
  bool timed = false;     // tune() chose the algorithm (else cuBLASLt's heuristic did)
  int gemv_warps = 0;     // bf16: gemv_bf16 (gemv.h) with these warps per block, not cuBLASLt
  int m = 0, n = 0, ldc = 0;

  Plan(GemmInput type_, int m_, int n_, int k, int lda, int ldc_, bool epilogue_ = false)
      : type(type_), epilogue(epilogue_), m(m_), n(n_), ldc(ldc_) {
    KVQ_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    set_attr(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
    set_attr(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt));
    const cudaDataType in_type = type == GemmInput::kFP8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    if (type == GemmInput::kFP8 && !epilogue) {
      // One fp32 scale per row of op(A) (the weight's output rows) and per column of op(B)
      // (the input's token rows); the pointers are set per call. With `epilogue` no scale is
      // set: cuBLASLt takes 1.
      const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      set_attr(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer, sizeof(outer));
      set_attr(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer, sizeof(outer));
    }
    // Column-major: w is k x n (ld k) used transposed, in is k x m (ld lda), out n x m (ld ldc).
    KVQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, in_type, static_cast<uint64_t>(k),
                                                static_cast<uint64_t>(n), k));
    KVQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, in_type, static_cast<uint64_t>(k),
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
  if (const char* e = std::getenv("KVQ_FP8_SCALING")) {
    if (std::strcmp(e, "outer_vector") == 0) fp8_scaling_ = Fp8Scaling::kOuterVector;
    if (std::strcmp(e, "epilogue") == 0) fp8_scaling_ = Fp8Scaling::kEpilogue;
  }
  if (const char* e = std::getenv("KVQ_GEMM_LOG"); e != nullptr && std::strcmp(e, "1") == 0)
    log_ = true;
  gemv_ = gemv_use_from_env();
  gemv_ring_ = gemv_ring_from_env();
  KVQ_CUBLAS_CHECK(cublasLtCreate(&lt_));
}

GemvUse gemv_use_from_env() {
  const char* e = std::getenv("KVQ_GEMV");
  const std::string v = e == nullptr ? "auto" : e;
  if (v == "auto") return GemvUse::kAuto;
  if (v == "0") return GemvUse::kNever;
  if (v == "force") return GemvUse::kForce;
  throw InputError("KVQ_GEMV=" + v + " is not one of: auto, 0, force");
}

int gemv_ring_from_env() {
  const char* e = std::getenv("KVQ_GEMV_RING");
  const std::string v = e == nullptr || *e == '\0' ? "1" : e;
  for (int rows = 0; rows <= kGemvMaxRows; ++rows)
    if (v == std::to_string(rows)) return rows;
  throw InputError("KVQ_GEMV_RING=" + v + " is not a row count 0 .. " +
                   std::to_string(kGemvMaxRows));
}

GemmTuner::~GemmTuner() {
  plans_.clear();
  if (lt_) (void)cublasLtDestroy(lt_);
}

const GemmTuner::Plan* GemmTuner::find(const Key& key) const {
  const auto it = plans_.find(key);
  return it == plans_.end() ? nullptr : it->second.get();
}

int GemmTuner::candidates(const Plan& plan, uint32_t align,
                          cublasLtMatmulHeuristicResult_t* found) const {
  cublasLtMatmulPreference_t pref = nullptr;
  KVQ_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  int returned = 0;
  try {
    KVQ_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (const cublasLtMatmulPreferenceAttributes_t attr : attrs)
      KVQ_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, plan.desc, plan.a, plan.b, plan.c,
                                                             plan.c, pref, 16, found, &returned);
    if (st != CUBLAS_STATUS_SUCCESS) returned = 0;
  } catch (...) {
    (void)cublasLtMatmulPreferenceDestroy(pref);
    throw;
  }
  (void)cublasLtMatmulPreferenceDestroy(pref);
  return returned;
}

void GemmTuner::set_scale_pointers(const Plan& plan, const float* in_scale,
                                   const float* w_scale) const {
  set_attr(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof(w_scale));
  set_attr(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &in_scale, sizeof(in_scale));
}

cublasStatus_t GemmTuner::launch(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const void* in,
                                 const float* in_scale, const GemmWeight& w, float* out,
                                 float beta) const {
  // Host-side attributes of the descriptor: the call below reads them (also under capture).
  if (plan.type == GemmInput::kFP8 && !plan.epilogue) set_scale_pointers(plan, in_scale, w.scale);
  const float alpha = 1.0f;
  return cublasLtMatmul(lt_, plan.desc, &alpha, w.w, plan.a, in, plan.b, &beta, out, plan.c, out,
                        plan.c, &algo, workspace_, workspace_bytes_, stream_);
}

cublasStatus_t GemmTuner::launch_epilogue(const Plan& plan, const cublasLtMatmulAlgo_t& algo,
                                          const void* in, const float* in_scale,
                                          const GemmWeight& w, float* raw, float* out, float beta,
                                          bool scale) const {
  // The unit-scale product into `raw` (out itself when beta is 0), laid out like out.
  const float alpha = 1.0f, zero = 0.0f;
  const cublasStatus_t st =
      cublasLtMatmul(lt_, plan.desc, &alpha, w.w, plan.a, in, plan.b, &zero, raw, plan.c, raw,
                     plan.c, &algo, workspace_, workspace_bytes_, stream_);
  if (st != CUBLAS_STATUS_SUCCESS || !scale) return st;
  fp8_scale_product(raw, plan.m, plan.n, plan.ldc, in_scale, w.scale, beta, out, stream_);
  return CUBLAS_STATUS_SUCCESS;
}

double GemmTuner::tune(int m, int n, int k, const void* in, int lda,
                       std::span<const void* const> weights, float* out, int ldc,
                       double gemv_margin) {
  std::vector<GemmWeight> w;
  for (const void* p : weights) w.push_back({p, nullptr});
  return tune(GemmInput::kBF16, m, n, k, in, nullptr, lda, w, out, ldc, gemv_margin);
}

double GemmTuner::tune(GemmInput type, int m, int n, int k, const void* in, const float* in_scale,
                       int lda, std::span<const GemmWeight> weights, float* out, int ldc,
                       double gemv_margin) {
  KVQ_CHECK(gemv_margin >= 1.0, "GemmTuner::tune: gemv_margin below 1");
  KVQ_CHECK(m > 0 && n > 0 && k > 0 && !weights.empty(), "GemmTuner::tune: empty GEMM");
  KVQ_CHECK(type != GemmInput::kFP8 || in_scale != nullptr, "GemmTuner::tune: FP8 without scales");
  for (const GemmWeight& w : weights)
    KVQ_CHECK(type == GemmInput::kBF16 || w.scale != nullptr,
              "GemmTuner::tune: FP8 weights without scales");
  const int ti = type_key(type);
  const Key key{ti, m, n, k, lda, ldc};
  if (const Plan* p = find(key); p != nullptr && p->timed) return 0.0;
  const int dev = current_device();
  const bool fp8 = type == GemmInput::kFP8;
  const bool w8 = type == GemmInput::kW8A16;  // kvq's kernel only
  const GlobalKey gkey{dev, ti, m, n, k, lda, ldc};
  {
    std::lock_guard<std::mutex> lock(g_mu);
    const auto it = choices().find(gkey);
    if (it != choices().end()) {
      auto plan = std::make_unique<Plan>(type, m, n, k, lda, ldc, it->second.epilogue);
      plan->timed = true;
      plan->algo = it->second.algo;
      plan->alignment = it->second.alignment;
      plan->gemv_warps = it->second.gemv_warps;
      plans_[key] = std::move(plan);
      return 0.0;
    }
  }
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  KVQ_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capturing));
  KVQ_CHECK(capturing == cudaStreamCaptureStatusNone,
            "GemmTuner::tune: the stream is being captured");

  uint32_t align = std::min(alignment_of(in), alignment_of(out));
  for (const GemmWeight& w : weights) align = std::min(align, alignment_of(w.w));
  std::vector<bool> scalings;  // epilogue or not, each timed
  if (!w8 && (!fp8 || fp8_scaling_ != Fp8Scaling::kEpilogue)) scalings.push_back(false);
  if (fp8 && fp8_scaling_ != Fp8Scaling::kOuterVector) scalings.push_back(true);

  cudaEvent_t e0 = nullptr, e1 = nullptr;
  KVQ_CUDA_CHECK(cudaEventCreate(&e0));
  KVQ_CUDA_CHECK(cudaEventCreate(&e1));
  double best_us = std::numeric_limits<double>::infinity();
  std::unique_ptr<Plan> best_plan;
  std::string timed;  // KVQ_GEMM_LOG: every candidate's time
  // Microseconds per GEMM of one candidate: a warm-up sweep (each sweep runs the shape over
  // every layer's weight, each read from HBM, as in a step), then three timed; negative when a
  // sweep fails to launch (the candidate is skipped).
  auto time_sweeps = [&](auto&& sweep) {
    constexpr int kSweeps = 3;
    if (!sweep()) return -1.0;
    KVQ_CUDA_CHECK(cudaEventRecord(e0, stream_));
    bool ok = true;
    for (int s = 0; s < kSweeps && ok; ++s) ok = sweep();
    KVQ_CUDA_CHECK(cudaEventRecord(e1, stream_));
    KVQ_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0.0f;
    KVQ_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return ok ? 1e3 * ms / (kSweeps * static_cast<double>(weights.size())) : -1.0;
  };
  try {
    for (const bool epilogue : scalings) {
      auto plan = std::make_unique<Plan>(type, m, n, k, lda, ldc, epilogue);
      plan->timed = true;
      plan->alignment = align;
      cublasLtMatmulHeuristicResult_t found[16] = {};
      // Vector scale modes need their pointers set before the heuristic query (cuBLASLt
      // refuses the query otherwise, and picks kernels for the scales it was shown).
      if (fp8 && !epilogue) set_scale_pointers(*plan, in_scale, weights.front().scale);
      const int returned = candidates(*plan, align, found);
      // The epilogue variant includes its scaling kernel.
      for (int i = 0; i < returned; ++i) {
        if (found[static_cast<size_t>(i)].state != CUBLAS_STATUS_SUCCESS) continue;
        const cublasLtMatmulAlgo_t& algo = found[static_cast<size_t>(i)].algo;
        const double us = time_sweeps([&]() {
          for (const GemmWeight& w : weights) {
            const cublasStatus_t st = epilogue ? launch_epilogue(*plan, algo, in, in_scale, w, out,
                                                                 out, 0.0f, !fp8_scales_deferred_)
                                               : launch(*plan, algo, in, in_scale, w, out, 0.0f);
            if (st != CUBLAS_STATUS_SUCCESS) return false;
          }
          return true;
        });
        if (log_) {
          char buf[32];
          std::snprintf(buf, sizeof buf, " %s%.1f", epilogue ? "e" : "", us);
          timed += buf;
        }
        if (us >= 0.0 && us < best_us) {
          best_us = us;
          plan->algo = algo;
          best_plan = std::move(plan);
          plan = std::make_unique<Plan>(type, m, n, k, lda, ldc, epilogue);
          plan->timed = true;
          plan->alignment = align;
        }
      }
    }
    // kvq's skinny kernel for products of up to kGemvMaxRows rows (gemv.h), timed the
    // same way; with KVQ_GEMV=force it is taken wherever it applies.
    // FP8 shapes take it only where the scaling is not restricted (kAuto).
    bool gemv_fits =
        gemv_ != GemvUse::kNever && align >= 16 && (!fp8 || fp8_scaling_ == Fp8Scaling::kAuto);
    for (const GemmWeight& w : weights)
      gemv_fits = gemv_fits && (fp8  ? gemv_fp8_fits(m, n, k, in, lda, w.w, out, ldc)
                                : w8 ? gemv_w8a16_fits(m, n, k, in, lda, w.w, out, ldc)
                                     : gemv_bf16_fits(m, n, k, in, lda, w.w, out, ldc));
    bool gemv_forced = false;  // with kForce the fastest variant wins over cuBLASLt's
    for (const int warps : kGemvWarps) {
      if (!gemv_fits) break;
      // The ring variant only for large weights: on the default model's (< 2 MB) it won the
      // tuner's timing by a hair and made some batch-1 steps 10% slower (version 19).
      const bool ring_ok = m <= gemv_ring_ && static_cast<double>(n) * k * (fp8 || w8 ? 1 : 2) >=
                                                  static_cast<double>(kGemvRingMinBytes);
      if ((warps == kGemvRing && !ring_ok) || !gemv_variant_fits(warps, m, k, fp8)) continue;
      const double us = time_sweeps([&]() {
        for (const GemmWeight& w : weights) {
          if (fp8) {
            gemv_fp8(m, n, k, in, in_scale, lda, w.w, w.scale, out, ldc, 0.0f, stream_, warps);
          } else if (w8) {
            gemv_w8a16(m, n, k, in, lda, w.w, w.scale, out, ldc, 0.0f, stream_, warps);
          } else {
            gemv_bf16(m, n, k, in, lda, w.w, out, ldc, 0.0f, stream_, warps);
          }
        }
        return true;
      });
      if (log_) {
        char buf[32];
        std::snprintf(buf, sizeof buf, " g%d:%.1f", warps, us);
        timed += buf;
      }
      // best_us: cuBLASLt's best (margin), or the other skinny variant's (plain comparison).
      const double bar = best_plan && best_plan->gemv_warps > 0 ? best_us : best_us * gemv_margin;
      if (us < bar || (gemv_ == GemvUse::kForce && !gemv_forced)) {
        gemv_forced = true;
        best_us = us;
        best_plan = std::make_unique<Plan>(type, m, n, k, lda, ldc);
        best_plan->timed = true;
        best_plan->alignment = align;
        best_plan->gemv_warps = warps;
      }
    }
  } catch (...) {
    (void)cudaEventDestroy(e0);
    (void)cudaEventDestroy(e1);
    throw;
  }
  (void)cudaEventDestroy(e0);
  (void)cudaEventDestroy(e1);
  if (log_)
    std::fprintf(stderr, "kvq: gemm tune %s m %d n %d k %d lda %d ldc %d: best %.1f us of%s\n",
                 fp8  ? "fp8"
                 : w8 ? "w8a16"
                      : "bf16",
                 m, n, k, lda, ldc, best_us, timed.c_str());
  if (!best_plan) return 0.0;  // nothing ran: run() keeps returning false for this shape
  {
    std::lock_guard<std::mutex> lock(g_mu);
    const auto [it, inserted] = choices().emplace(
        gkey, Choice{best_plan->algo, align, best_plan->epilogue, best_plan->gemv_warps});
    if (!inserted) {
      // Another tuner chose first (in another thread): take its choice, so every model of
      // this process runs the same algorithm for the shape.
      best_plan = std::make_unique<Plan>(type, m, n, k, lda, ldc, it->second.epilogue);
      best_plan->timed = true;
      best_plan->algo = it->second.algo;
      best_plan->alignment = it->second.alignment;
      best_plan->gemv_warps = it->second.gemv_warps;
    }
  }
  plans_[key] = std::move(best_plan);
  return best_us;
}

int GemmTuner::gemv_warps(GemmInput type, int m, int n, int k, int lda, int ldc) const {
  const Plan* p = find(Key{type_key(type), m, n, k, lda, ldc});
  return p != nullptr ? p->gemv_warps : 0;
}

bool GemmTuner::fp8_epilogue(int m, int n, int k, int lda, int ldc) const {
  const Plan* p = find(Key{type_key(GemmInput::kFP8), m, n, k, lda, ldc});
  return p != nullptr && p->epilogue;
}

bool GemmTuner::run(int m, int n, int k, const void* in, int lda, const void* w, float* out,
                    int ldc, float beta) const {
  const Plan* p = find(Key{type_key(GemmInput::kBF16), m, n, k, lda, ldc});
  if (p == nullptr) return false;
  if (alignment_of(in) < p->alignment || alignment_of(w) < p->alignment ||
      alignment_of(out) < p->alignment)
    return false;
  if (p->gemv_warps > 0) {
    if (!gemv_bf16_fits(m, n, k, in, lda, w, out, ldc)) return false;
    gemv_bf16(m, n, k, in, lda, w, out, ldc, beta, stream_, p->gemv_warps);
    return true;
  }
  KVQ_CUBLAS_CHECK(launch(*p, p->algo, in, nullptr, GemmWeight{w, nullptr}, out, beta));
  return true;
}

bool GemmTuner::run(GemmInput type, int m, int n, int k, const void* in, const float* in_scale,
                    int lda, const GemmWeight& w, float* out, int ldc, float beta, float* scratch,
                    size_t scratch_floats, bool* left_unscaled) {
  if (left_unscaled) *left_unscaled = false;
  if (type == GemmInput::kBF16)
    return std::as_const(*this).run(m, n, k, in, lda, w.w, out, ldc, beta);
  const Key key{type_key(type), m, n, k, lda, ldc};
  const Plan* p = find(key);
  if (type == GemmInput::kW8A16) {
    KVQ_CHECK(w.scale != nullptr, "GemmTuner::run: FP8 weights without scales");
    if (p == nullptr || p->gemv_warps == 0 || !gemv_w8a16_fits(m, n, k, in, lda, w.w, out, ldc))
      return false;
    gemv_w8a16(m, n, k, in, lda, w.w, w.scale, out, ldc, beta, stream_, p->gemv_warps);
    return true;
  }
  KVQ_CHECK(in_scale != nullptr && w.scale != nullptr, "GemmTuner::run: FP8 without scales");
  if (p != nullptr && p->gemv_warps > 0) {  // kvq's skinny kernel applies the scales itself
    if (!gemv_fp8_fits(m, n, k, in, lda, w.w, out, ldc)) return false;
    gemv_fp8(m, n, k, in, in_scale, lda, w.w, w.scale, out, ldc, beta, stream_, p->gemv_warps);
    return true;
  }
  if (p == nullptr) {
    // An untuned FP8 shape (a prefill chunk, or a step of more rows than the model tunes):
    // cuBLASLt's first choice for 16-byte aligned operands (what the FP8 kernels need
    // anyway), kept for the next call of the same shape. Up to kUntunedUnitScaleRows rows unit
    // scales (cuBLASLt's small-tile and split-K kernels exist only there; an 8B verification
    // step of 32 x 8 rows took 13.5 ms with outer-vector scaling, 11.3 with unit scales),
    // above that outer-vector scaling (large tiles suit, and a separate scaling pass would
    // cost a read and a write of the output), unless restricted. Not a function of
    // fp8_scales_deferred_, so a fused and an unfused model run the same GEMMs.
    constexpr int kUntunedUnitScaleRows = 512;
    const bool epilogue = fp8_scaling_ == Fp8Scaling::kEpilogue ||
                          (fp8_scaling_ == Fp8Scaling::kAuto && m <= kUntunedUnitScaleRows);
    auto plan = std::make_unique<Plan>(type, m, n, k, lda, ldc, epilogue);
    cublasLtMatmulHeuristicResult_t found[16] = {};
    if (!epilogue) set_scale_pointers(*plan, in_scale, w.scale);
    const int returned = candidates(*plan, 16, found);
    int pick = -1;
    for (int i = 0; i < returned && pick < 0; ++i)
      if (found[static_cast<size_t>(i)].state == CUBLAS_STATUS_SUCCESS) pick = i;
    if (pick < 0) return false;
    plan->algo = found[static_cast<size_t>(pick)].algo;
    plan->alignment = 16;
    p = plan.get();
    plans_[key] = std::move(plan);
  }
  if (alignment_of(in) < p->alignment || alignment_of(w.w) < p->alignment ||
      alignment_of(out) < p->alignment)
    return false;
  if (!p->epilogue) {
    KVQ_CUBLAS_CHECK(launch(*p, p->algo, in, in_scale, w, out, beta));
    return true;
  }
  float* raw = out;
  if (beta != 0.0f) {
    KVQ_CHECK(
        scratch != nullptr && scratch_floats >= static_cast<size_t>(m) * static_cast<size_t>(ldc),
        "GemmTuner::run: an FP8 GEMM with beta != 0 needs m * ldc floats of scratch");
    if (alignment_of(scratch) < p->alignment) return false;
    raw = scratch;
  }
  if (left_unscaled != nullptr) {
    KVQ_CUBLAS_CHECK(launch_epilogue(*p, p->algo, in, in_scale, w, raw, out, beta, false));
    *left_unscaled = true;
    return true;
  }
  KVQ_CUBLAS_CHECK(launch_epilogue(*p, p->algo, in, in_scale, w, raw, out, beta));
  return true;
}

}  // namespace kvq::cuda_model
