// CudaModel: the decoder of decoder_model.cc on one CUDA device. Weights are uploaded once
// (fp32 or bf16 matrices, fp32 norms and biases); every step runs on one stream the model owns:
// embedding gather, per layer RMSNorm -> fused QKV GEMM -> bias / q-k norm / RoPE ->
// write_kv_cuda -> attention (cuda decode, or prefill) -> o_proj GEMM accumulating into the fp32
// residual (beta = 1) -> RMSNorm -> gate_up GEMM -> SwiGLU -> down GEMM accumulating; then the
// final norm and lm_head on the logit rows only.
//
// Step inputs (tokens, positions, slots, block tables, logit rows, sampling parameters) go to
// the device in one copy from a pinned staging buffer whose layout is fixed at load, so a decode
// step can be replayed from a CUDA graph: decode batches are padded to a batch bucket (dummy
// sequences with slot -1 and seq_len 0, which the write and decode kernels skip), and the decode
// attention is planned for a context bucket (2^k or 3 x 2^(k-1) >= the longest sequence), never
// for this step's lengths; the kernels derive each sequence's splits from the device seq_lens,
// which stays within a plan made for longer sequences. Graphs on or off run the same plans and
// GEMM shapes, so they give identical results. With bf16 weights the GEMMs of a decode step
// (<= 256 rows) use cuBLASLt algorithms timed once per batch bucket (gemm_tuner.h; the choice
// is process-wide, so it too is the same with graphs on or off).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/cuda/cuda_decode.h"
#include "attention/cuda/cuda_generic.h"
#include "cache/cuda/cuda_check.h"
#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/model/cuda_model.h"
#include "kvq/plan/speculative_config.h"
#include "model/checkpoint_reader.h"
#include "model/cuda/cublas_check.h"
#include "model/cuda/gemm_tuner.h"
#include "model/cuda/gemv.h"
#include "model/cuda/linear.h"
#include "model/cuda/model_kernels.h"
#include "model/cuda/tensor_parallel.h"
#include "model/kernels.h"
#include "model/weight_layout.h"

// The prefill kernels are being written next to the decode ones; until their implementation
// is in the tree, a prefill runs as one decode query per position (correct, slower).
#if __has_include("attention/cuda/cuda_prefill.h") && \
                  __has_include("attention/cuda/cuda_prefill.cu")
#include "attention/cuda/cuda_prefill.h"
#define KVQ_MODEL_CUDA_PREFILL 1
#else
#define KVQ_MODEL_CUDA_PREFILL 0
#endif
// Device sampling (temperature, top-k/p, min-p) comes from sampling.cu; without it, greedy only.
#if __has_include("model/cuda/sampling.h") && __has_include("model/cuda/sampling.cu")
#include "model/cuda/sampling.h"
#define KVQ_MODEL_CUDA_SAMPLING 1
#else
#define KVQ_MODEL_CUDA_SAMPLING 0
#endif

namespace kvq {

namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t n, size_t a = kAlign) {
  return (n + a - 1) / a * a;
}

int pow2_at_least(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Context buckets of decode graphs: two per octave (2^k and 3 * 2^(k-1)), so a step's
// attention plan is made for at most 1.5x its longest sequence (a plan for a longer context
// gives each sequence fewer splits than it could use).
int context_bucket(int64_t n) {
  const int p = pow2_at_least(n);
  return p >= 4 && 3 * (p / 4) >= n ? 3 * (p / 4) : p;
}
int next_context_bucket(int b) {
  return context_bucket(static_cast<int64_t>(b) + 1);
}

constexpr int kMinContextBucket = 16;
constexpr size_t kCublasWorkspace = 32u << 20;
// Decode steps up to this many rows run GEMMs with timed cuBLASLt algorithms (gemm_tuner.h).
constexpr int kMaxTunedRows = 256;

// KVQ_GEMV_SILU=1 (default) | 0: gate|up's SiLU-mul in the skinny GEMM's epilogue where that
// kernel runs gate|up (0: always the separate kernel, for A/B runs).
bool gemv_silu_from_env() {
  const char* e = std::getenv("KVQ_GEMV_SILU");
  const std::string v = e == nullptr ? "1" : e;
  if (v != "0" && v != "1") throw InputError("KVQ_GEMV_SILU=" + v + " is not one of: 1, 0");
  return v == "1";
}
// KVQ_L2_PREFETCH=1|0: at one-row steps, o's weight (if at least
// CudaModelOptions::l2_prefetch_min_bytes, 16 MiB) is
// prefetched into L2 on a side stream while the attention chain runs after q|k|v's product
// (cp.async.bulk.prefetch.L2 by kL2PrefetchWarps warps). 8B batch 1 x 1k, H200: -1 to -2% a step;
// batch 4-32 and verification steps within +-1.5% either way, hence one row only; prefetching
// gate|up's first 8-16 MiB too cost 4-7%, and 64 blocks of loads (3.3 TB/s) delayed the
// attention's cluster launch (docs/notes/decode-tuning.md version 20).
bool l2_prefetch_from_env() {
  const char* e = std::getenv("KVQ_L2_PREFETCH");
  const std::string v = e == nullptr || *e == '\0' ? "1" : e;
  if (v != "0" && v != "1") throw InputError("KVQ_L2_PREFETCH=" + v + " is not one of: 1, 0");
  return v == "1";
}
constexpr int kL2PrefetchWarps = 8;
// KVQ_FP8_W8A16=n: FP8 projections of steps of at most n rows (0 .. kGemvMaxRows; default 8)
// multiply their bf16 input rows by the e4m3 weights on kvq's skinny GEMM (gemv.h gemv_w8a16:
// no input quantization, no scaling kernel, and the bf16 path's RMSNorm prologue and SiLU-mul
// epilogue apply); larger steps quantize their inputs to e4m3 (W8A8). FP8-weight 8B steps,
// H200: batch 1 -7%, 4 -4%, 8 -5%, 16 +1% (the two-n-tile form reads its weights slower),
// hence 8. 0: always W8A8 (A/B; docs/notes/decode-tuning.md version 21).
constexpr int kFp8W8a16Rows = 8;
int fp8_w8a16_rows_from_env() {
  const char* e = std::getenv("KVQ_FP8_W8A16");
  const std::string v = e == nullptr || *e == '\0' ? std::to_string(kFp8W8a16Rows) : e;
  for (int rows = 0; rows <= cuda_model::kGemvMaxRows; ++rows)
    if (v == std::to_string(rows)) return rows;
  throw InputError("KVQ_FP8_W8A16=" + v + " is not a row count 0 .. " +
                   std::to_string(cuda_model::kGemvMaxRows));
}
// KVQ_GEMV_NORM=n: the RMSNorm before q|k|v and before gate|up inside the skinny GEMM that reads
// it, where that kernel runs the product, for steps of at most n rows (0: the separate kernel,
// A/B). Default 1: every block of the product normalizes its own copy of the rows, which pays at
// one row and costs more than the separate kernel from two (8B step, H200: batch 1 -1.7%; batch 2
// +4%, batch 4 +15%, verification of 2-4 queries at batch 1 +4 to +14%; docs/notes/
// decode-tuning.md version 18).
int gemv_norm_from_env() {
  const char* e = std::getenv("KVQ_GEMV_NORM");
  const std::string v = e == nullptr || *e == '\0' ? "1" : e;
  if (v.size() != 1 || v[0] < '0' || v[0] > '0' + cuda_model::kGemvNormMaxRows)
    throw InputError("KVQ_GEMV_NORM=" + v + " is not a row count 0 .. " +
                     std::to_string(cuda_model::kGemvNormMaxRows));
  return v[0] - '0';
}
// Verification steps of speculative decoding with up to this many queries per sequence (k + 1)
// are graph-replayed like decode steps.
constexpr int kMaxVerifyQueries = 17;
// Their Q buckets (queries per sequence a graph step is padded to): 2^j and 2^j + 1, so k =
// 2^j - 1 and k = 2^j drafts run unpadded. A padded query costs more than its rows: Q x the GQA
// group fills whole 16-row warps of the decode kernel (Llama-3-8B, group 4: 8 queries are 2 warps
// of rows, 9 are 3), and fewer rows leave more warps of a cluster for splits of the context
// (8B verification of 1 + 7 tokens at batch 1 x 1k, H200: 5.63 ms padded to 9, 5.09 at 8;
// docs/notes/decode-tuning.md version 18). KVQ_VERIFY_Q_BUCKETS=coarse: 2, 3, 5, 9, 17 only
// (the old buckets, fewer graphs; A/B).
constexpr int kVerifyQBuckets[] = {2, 3, 4, 5, 8, 9, 16, 17};

bool verify_coarse_q_from_env() {
  const char* e = std::getenv("KVQ_VERIFY_Q_BUCKETS");
  const std::string v = e == nullptr ? "" : e;
  if (!v.empty() && v != "fine" && v != "coarse")
    throw InputError("KVQ_VERIFY_Q_BUCKETS=" + v + " is not one of: fine, coarse");
  return v == "coarse";
}

// The Q bucket of a verification step whose longest sequence has max_q queries (2..17).
int verify_q_bucket(int max_q, bool coarse) {
  for (int q : kVerifyQBuckets)
    if (q >= max_q && (!coarse || (q & (q - 1)) != 0 || q == 2)) return q;
  KVQ_CHECK(false, "verify_q_bucket: " + std::to_string(max_q) + " queries exceed the buckets");
  return 0;
}

// Device allocations released together (weights, buffers); never throws on release.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() {
    for (void* p : ptrs_) (void)cudaFree(p);
  }
  void* alloc(size_t bytes) {
    void* p = nullptr;
    KVQ_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
    ptrs_.push_back(p);
    bytes_ += bytes;
    return p;
  }
  size_t bytes() const { return bytes_; }

 private:
  std::vector<void*> ptrs_;
  size_t bytes_ = 0;
};

// Weights on the device, shared by every plan of the model (with_plan).
struct DeviceWeights {
  using Linear = cuda_model::Linear;
  DeviceArena arena;
  // GEMM inputs (activations) in bf16: bf16 and FP8 models; fp32 for a float32 model.
  bool bf16 = false;
  const void* embed = nullptr;  // bf16 or fp32 like the activations
  Linear lm_head;               // .w within embed when tied (a rank's rows under TP)
  bool tied = false;
  const float* final_norm = nullptr;
  // A DFlash drafter's own tensors; its embedding and LM head are the target's (`target`).
  Linear fc;
  const float *hidden_norm = nullptr, *mask = nullptr;
  std::shared_ptr<const DeviceWeights> target;
  struct Layer {
    const float *input_norm = nullptr, *post_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;
    Linear qkv, o, gate_up, down;
    const float *qkv_bias = nullptr, *o_bias = nullptr, *gate_up_bias = nullptr,
                *down_bias = nullptr;
  };
  std::vector<Layer> layers;

  bool any_fp8() const {
    for (const Layer& l : layers)
      for (const Linear* x : {&l.qkv, &l.o, &l.gate_up, &l.down})
        if (x->dtype == Linear::Dtype::kFP8) return true;
    return fc.dtype == Linear::Dtype::kFP8 || lm_head.dtype == Linear::Dtype::kFP8;
  }

  // Matrices are held in their Linear's precision (the embedding in the activations');
  // norms and biases in fp32.
  static bool is_matrix(model::WeightKind k) {
    using K = model::WeightKind;
    return k == K::kEmbed || k == K::kLmHead || k == K::kQkv || k == K::kO || k == K::kGateUp ||
           k == K::kDown || k == K::kDflashFc;
  }
  // The decoder projections (what FP8 weights cover; the embedding, LM head and a drafter's
  // fc stay in the activations' precision).
  static bool is_projection(model::WeightKind k) {
    using K = model::WeightKind;
    return k == K::kQkv || k == K::kO || k == K::kGateUp || k == K::kDown;
  }
  Linear* linear_of(model::WeightKind kind, int layer) {
    Layer* l = layer >= 0 ? &layers[static_cast<size_t>(layer)] : nullptr;
    switch (kind) {
      case model::WeightKind::kLmHead:
        return &lm_head;
      case model::WeightKind::kDflashFc:
        return &fc;
      case model::WeightKind::kQkv:
        return &l->qkv;
      case model::WeightKind::kO:
        return &l->o;
      case model::WeightKind::kGateUp:
        return &l->gate_up;
      case model::WeightKind::kDown:
        return &l->down;
      default:
        return nullptr;
    }
  }
  static size_t elem_bytes(model::WeightKind kind, Linear::Dtype dtype) {
    return !is_matrix(kind)                ? 4
           : dtype == Linear::Dtype::kFP8  ? 1
           : dtype == Linear::Dtype::kBF16 ? 2
                                           : 4;
  }
  // Allocates tensor t (a matrix: `cols` inputs, in `dtype`) and records where it is; in
  // `where` instead of the weights' arena for a tensor shard() cuts down afterwards.
  void* place(const model::WeightTensor& t, int cols, Linear::Dtype dtype,
              DeviceArena* where = nullptr) {
    DeviceArena& a = where != nullptr ? *where : arena;
    void* p = a.alloc(static_cast<size_t>(t.numel) * elem_bytes(t.kind, dtype));
    Layer* l = t.layer >= 0 ? &layers[static_cast<size_t>(t.layer)] : nullptr;
    auto* f = static_cast<float*>(p);
    if (Linear* lin = linear_of(t.kind, t.layer)) {
      lin->dtype = dtype;
      lin->k = cols;
      lin->n = static_cast<int>(t.numel / cols);
      lin->w = p;
      if (dtype == Linear::Dtype::kFP8)
        lin->scale = static_cast<float*>(a.alloc(static_cast<size_t>(lin->n) * 4));
      return p;
    }
    switch (t.kind) {
      case model::WeightKind::kEmbed:
        embed = p;
        break;
      case model::WeightKind::kFinalNorm:
        final_norm = f;
        break;
      case model::WeightKind::kInputNorm:
        l->input_norm = f;
        break;
      case model::WeightKind::kPostNorm:
        l->post_norm = f;
        break;
      case model::WeightKind::kQkvBias:
        l->qkv_bias = f;
        break;
      case model::WeightKind::kQNorm:
        l->q_norm = f;
        break;
      case model::WeightKind::kKNorm:
        l->k_norm = f;
        break;
      case model::WeightKind::kOBias:
        l->o_bias = f;
        break;
      case model::WeightKind::kGateUpBias:
        l->gate_up_bias = f;
        break;
      case model::WeightKind::kDownBias:
        l->down_bias = f;
        break;
      case model::WeightKind::kDflashHiddenNorm:
        hidden_norm = f;
        break;
      case model::WeightKind::kDflashMask:
        mask = f;
        break;
      default:
        KVQ_CHECK(false, "DeviceWeights::place: a matrix without a Linear");
    }
    return p;
  }
  // Tensor parallelism: replaces placed tensor t (at `full`, `cols` inputs) by the rank's
  // shard of it in the weights' arena (the rows or columns tp_shard names; an FP8 matrix's row
  // scales with its rows) and points its Linear or bias there.
  void shard(const model::WeightTensor& t, int cols, Linear::Dtype dtype, const void* full,
             const TpShard& sh) {
    const size_t elem = elem_bytes(t.kind, dtype);
    const int64_t rows = t.numel / cols;
    const auto* src = static_cast<const std::byte*>(full);
    Linear* lin = linear_of(t.kind, t.layer);
    const float* scale = lin != nullptr ? lin->scale : nullptr;
    void* out = nullptr;
    float* out_scale = nullptr;
    if (!sh.rows.empty()) {
      const size_t row_bytes = static_cast<size_t>(cols) * elem;
      out = arena.alloc(static_cast<size_t>(sh.num_rows()) * row_bytes);
      if (scale != nullptr) out_scale = static_cast<float*>(arena.alloc(sh.num_rows() * 4));
      int64_t at = 0;
      for (const auto& [first, count] : sh.rows) {
        KVQ_CHECK(first >= 0 && count > 0 && first + count <= rows, "shard: rows out of range");
        KVQ_CUDA_CHECK(cudaMemcpy(static_cast<std::byte*>(out) + at * row_bytes,
                                  src + first * row_bytes, count * row_bytes,
                                  cudaMemcpyDeviceToDevice));
        if (scale != nullptr)
          KVQ_CUDA_CHECK(
              cudaMemcpy(out_scale + at, scale + first, count * 4, cudaMemcpyDeviceToDevice));
        at += count;
      }
    } else {
      KVQ_CHECK(sh.col0 >= 0 && sh.cols > 0 && sh.col0 + sh.cols <= cols,
                "shard: columns out of range");
      out = arena.alloc(static_cast<size_t>(rows * sh.cols) * elem);
      KVQ_CUDA_CHECK(cudaMemcpy2D(out, sh.cols * elem, src + sh.col0 * elem, cols * elem,
                                  sh.cols * elem, rows, cudaMemcpyDeviceToDevice));
      if (scale != nullptr) {  // one per output row: all kept
        out_scale = static_cast<float*>(arena.alloc(rows * 4));
        KVQ_CUDA_CHECK(cudaMemcpy(out_scale, scale, rows * 4, cudaMemcpyDeviceToDevice));
      }
    }
    if (lin != nullptr) {
      lin->w = out;
      lin->scale = out_scale;
      if (!sh.rows.empty())
        lin->n = static_cast<int>(sh.num_rows());
      else
        lin->k = static_cast<int>(sh.cols);
      return;
    }
    Layer& l = layers[static_cast<size_t>(t.layer)];
    if (t.kind == model::WeightKind::kQkvBias)
      l.qkv_bias = static_cast<const float*>(out);
    else if (t.kind == model::WeightKind::kGateUpBias)
      l.gate_up_bias = static_cast<const float*>(out);
    else
      KVQ_CHECK(false, "shard: tensor kind is not split");
  }
  // `vocab_rows`: a tensor-parallel rank's rows of a tied LM head (first, count); count 0:
  // all of them.
  void finish(int vocab, int hidden, std::pair<int64_t, int64_t> vocab_rows = {0, 0}) {
    if (target) {
      embed = target->embed;
      lm_head = target->lm_head;
    }
    if (lm_head.empty()) {  // tied: the embedding, in the activations' precision
      tied = true;
      const int64_t first = vocab_rows.second > 0 ? vocab_rows.first : 0;
      const int64_t rows = vocab_rows.second > 0 ? vocab_rows.second : vocab;
      lm_head = Linear{bf16 ? Linear::Dtype::kBF16 : Linear::Dtype::kF32,
                       static_cast<int>(rows),
                       hidden,
                       static_cast<const std::byte*>(embed) + first * hidden * (bf16 ? 2 : 4),
                       nullptr,
                       nullptr};
    }
  }
};

// Inputs of each matrix kind (the columns of its [n][k] weight).
int matrix_cols(model::WeightKind kind, const KvPlan& plan, const ArchitectureConfig& arch) {
  using K = model::WeightKind;
  switch (kind) {
    case K::kO:
      return plan.model.num_q_heads * plan.model.head_dim;
    case K::kDown:
      return arch.intermediate_size;
    case K::kDflashFc:
      return static_cast<int>(arch.dflash->target_layer_ids.size()) *
             arch.dflash->target_hidden_size;
    default:
      return arch.hidden_size;
  }
}

// The projections (and biases) a tensor-parallel rank holds a shard of; nullopt: replicated
// (embedding, LM head, norms, and the o / down biases, added after the all-reduce).
std::optional<TpMatrix> tp_matrix(model::WeightKind kind) {
  using K = model::WeightKind;
  switch (kind) {
    case K::kQkv:
    case K::kQkvBias:
      return TpMatrix::kQkv;
    case K::kGateUp:
    case K::kGateUpBias:
      return TpMatrix::kGateUp;
    case K::kO:
      return TpMatrix::kO;
    case K::kDown:
      return TpMatrix::kDown;
    case K::kLmHead:
      return TpMatrix::kVocab;
    default:
      return std::nullopt;
  }
}

// tp's shard of tensor t (nullopt when t is replicated or tp has one rank).
// Under tensor parallelism the LM head is split by vocabulary rows when the vocabulary divides
// by the group size; KVQ_TP_VOCAB_PARALLEL=0 keeps it whole on every rank (an A/B for timing).
bool vocab_parallel(const ArchitectureConfig& arch, const cuda_model::TpRank& tp) {
  static const bool off = [] {
    const char* e = std::getenv("KVQ_TP_VOCAB_PARALLEL");
    return e != nullptr && std::string_view(e) == "0";
  }();
  return tp.active() && !off && arch.vocab_size % tp.size == 0;
}

std::optional<TpShard> shard_of(const model::WeightTensor& t, const KvPlan& plan,
                                const ArchitectureConfig& arch, const cuda_model::TpRank& tp) {
  if (!tp.active()) return std::nullopt;
  const std::optional<TpMatrix> m = tp_matrix(t.kind);
  if (!m) return std::nullopt;
  if (*m == TpMatrix::kVocab && !vocab_parallel(arch, tp)) return std::nullopt;  // replicated
  return tp_shard(*m, tp.split, plan.model, arch.intermediate_size, tp.rank, arch.vocab_size);
}

// A tensor-parallel rank's rows of a tied LM head (the embedding): its vocabulary shard, or
// (0, 0) for all rows (one rank, or a vocabulary that does not divide).
std::pair<int64_t, int64_t> tied_vocab_rows(const ArchitectureConfig& arch,
                                            const cuda_model::TpRank& tp) {
  if (!vocab_parallel(arch, tp)) return {0, 0};
  const int64_t per = arch.vocab_size / tp.size;
  return {tp.rank * per, per};
}

// A projection cuBLASLt's FP8 kernels take: both dimensions multiples of 16.
bool fp8_shape_ok(int n, int k) {
  return n % 16 == 0 && k % 16 == 0;
}

// `target`: a DFlash drafter's target, whose embedding and LM head it shares (and whose
// activation precision it takes; its own matrices are bf16 when the target's are FP8).
// `tp`: a tensor-parallel rank keeps its shards of the split projections (shard_of).
std::shared_ptr<DeviceWeights> load_checkpoint_weights(
    const KvPlan& plan, const ArchitectureConfig& arch, WeightPrecision requested,
    WeightPrecision& chosen, std::shared_ptr<const DeviceWeights> target = nullptr,
    const cuda_model::TpRank& tp = {}) {
  using Dtype = cuda_model::Linear::Dtype;
  model::CheckpointReader reader(plan.model.dir);
  const model::WeightLayout layout =
      model::checkpoint_layout(plan.model, arch, reader.has("lm_head.weight"));
  model::expect_layout(reader, layout);
  const bool ckpt_fp8 = reader.quantization().fp8;
  chosen = requested;
  if (chosen == WeightPrecision::kAuto)
    chosen = ckpt_fp8 && cuda_fp8_gemm_available()       ? WeightPrecision::kFp8
             : model::layout_all_float32(reader, layout) ? WeightPrecision::kFloat32
                                                         : WeightPrecision::kBFloat16;
  if (chosen == WeightPrecision::kFp8 && !cuda_fp8_gemm_available())
    throw InputError(
        "--dtype fp8: kvq's FP8 GEMMs (cuBLASLt with a scale per row and per column) run on "
        "Hopper (compute capability 9.x); accepted here: auto, bfloat16, float32");
  auto w = std::make_shared<DeviceWeights>();
  w->bf16 = chosen != WeightPrecision::kFloat32;
  if (target) {
    w->bf16 = target->bf16;
    chosen = target->bf16 ? WeightPrecision::kBFloat16 : WeightPrecision::kFloat32;
    w->target = std::move(target);
  }
  const bool fp8 = chosen == WeightPrecision::kFp8;
  const Dtype act = w->bf16 ? Dtype::kBF16 : Dtype::kF32;
  w->layers.resize(static_cast<size_t>(plan.model.num_layers));
  std::vector<std::vector<const model::WeightPiece*>> pieces(layout.tensors.size());
  for (const model::WeightPiece& pc : layout.pieces) pieces[pc.tensor].push_back(&pc);
  // Matrices go up as fp32 in bounded chunks (whole rows) and are converted on the device.
  constexpr size_t kChunk = size_t{16} << 20;  // floats
  DeviceArena staging;
  float* chunk = w->bf16 ? static_cast<float*>(staging.alloc(kChunk * sizeof(float))) : nullptr;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const model::WeightTensor& t = layout.tensors[i];
    const bool matrix = DeviceWeights::is_matrix(t.kind);
    const int cols = matrix ? matrix_cols(t.kind, plan, arch) : 1;
    const int rows = static_cast<int>(t.numel / cols);
    const std::optional<TpShard> sh = shard_of(t, plan, arch, tp);
    DeviceArena full;  // the whole tensor of a shard, until shard() copies the rank's part
    // An FP8 checkpoint's projections stay FP8 (with its scales) unless all of a fused
    // matrix's pieces are ignored; --dtype fp8 quantizes every projection per output row.
    int f8_pieces = 0;
    for (const model::WeightPiece* pc : pieces[i])
      f8_pieces += reader.dtype(pc->name) == TensorDtype::kF8E4M3 ? 1 : 0;
    const bool given = f8_pieces == static_cast<int>(pieces[i].size()) && f8_pieces > 0;
    Dtype dtype = act;
    if (fp8 && DeviceWeights::is_projection(t.kind) && fp8_shape_ok(rows, cols) &&
        (!sh || fp8_shape_ok(sh->rows.empty() ? rows : static_cast<int>(sh->num_rows()),
                             sh->cols > 0 ? static_cast<int>(sh->cols) : cols)) &&
        (!ckpt_fp8 || f8_pieces > 0))
      dtype = Dtype::kFP8;
    model::FloatArray host(static_cast<size_t>(t.numel));
    for (const model::WeightPiece* pc : pieces[i]) reader.read(pc->name, host.data() + pc->offset);
    void* dst = w->place(t, cols, dtype, sh ? &full : nullptr);
    if (dtype == Dtype::kFP8) {
      cuda_model::Linear& lin = *w->linear_of(t.kind, t.layer);
      if (given) {
        // The checkpoint's codes exactly: value / its scale rounds back to the stored code.
        std::vector<float> scales(static_cast<size_t>(rows));
        for (const model::WeightPiece* pc : pieces[i]) {
          const std::vector<float> s = reader.weight_row_scales(pc->name);
          std::copy(s.begin(), s.end(), scales.begin() + pc->offset / cols);
        }
        KVQ_CUDA_CHECK(cudaMemcpy(const_cast<float*>(lin.scale), scales.data(),
                                  scales.size() * sizeof(float), cudaMemcpyHostToDevice));
        // Static activation scales (one per fused matrix: the largest of its pieces').
        float in_scale = 0.0f;
        bool all = true;
        for (const model::WeightPiece* pc : pieces[i]) {
          const float v = reader.input_scale(pc->name);
          all = all && v > 0.0f;
          in_scale = std::max(in_scale, v);
        }
        if (all && in_scale > 0.0f) {
          auto* d = static_cast<float*>(w->arena.alloc(sizeof(float)));
          KVQ_CUDA_CHECK(cudaMemcpy(d, &in_scale, sizeof(float), cudaMemcpyHostToDevice));
          lin.in_scale = d;
        }
      }
      const int64_t rows_per = std::max<int64_t>(1, static_cast<int64_t>(kChunk) / cols);
      for (int64_t r0 = 0; r0 < rows; r0 += rows_per) {
        const int64_t nr = std::min<int64_t>(rows_per, rows - r0);
        KVQ_CUDA_CHECK(cudaMemcpy(chunk, host.data() + r0 * cols,
                                  static_cast<size_t>(nr * cols) * sizeof(float),
                                  cudaMemcpyHostToDevice));
        cuda_model::quantize_rows_fp8(
            chunk, false, static_cast<int>(nr), cols, cols,
            given ? cuda_model::Fp8Scale::kGiven : cuda_model::Fp8Scale::kDynamic, nullptr,
            static_cast<uint8_t*>(dst) + r0 * cols, const_cast<float*>(lin.scale) + r0, nullptr);
        KVQ_CUDA_CHECK(cudaDeviceSynchronize());
      }
    } else if (w->bf16 && matrix) {
      for (size_t o = 0; o < host.size(); o += kChunk) {
        const size_t n = std::min(kChunk, host.size() - o);
        KVQ_CUDA_CHECK(
            cudaMemcpy(chunk, host.data() + o, n * sizeof(float), cudaMemcpyHostToDevice));
        cuda_model::to_bf16(chunk, static_cast<int64_t>(n), static_cast<uint16_t*>(dst) + o,
                            nullptr);
        KVQ_CUDA_CHECK(cudaDeviceSynchronize());
      }
    } else {
      KVQ_CUDA_CHECK(
          cudaMemcpy(dst, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    if (sh) w->shard(t, cols, dtype, dst, *sh);
  }
  reader.finish();
  w->finish(arch.vocab_size, arch.hidden_size, tied_vocab_rows(arch, tp));
  return w;
}

// Random weights; with `fp8` the decoder projections are quantized per output row (dynamic
// activations), as --dtype fp8 converts a checkpoint.
std::shared_ptr<DeviceWeights> synthetic_weights(const KvPlan& plan, const ArchitectureConfig& arch,
                                                 uint64_t seed, bool fp8,
                                                 const cuda_model::TpRank& tp = {}) {
  using Dtype = cuda_model::Linear::Dtype;
  const model::WeightLayout layout = model::checkpoint_layout(plan.model, arch, true);
  auto w = std::make_shared<DeviceWeights>();
  w->bf16 = true;
  w->layers.resize(static_cast<size_t>(plan.model.num_layers));
  const double H = arch.hidden_size, I = arch.intermediate_size;
  const double q = double(plan.model.num_q_heads) * plan.model.head_dim;
  int64_t largest = 0;
  for (const model::WeightTensor& t : layout.tensors)
    if (DeviceWeights::is_projection(t.kind)) largest = std::max(largest, t.numel);
  DeviceArena staging;
  void* tmp = fp8 ? staging.alloc(static_cast<size_t>(largest) * 2) : nullptr;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const model::WeightTensor& t = layout.tensors[i];
    using K = model::WeightKind;
    const bool matrix = DeviceWeights::is_matrix(t.kind);
    const int cols = matrix ? matrix_cols(t.kind, plan, arch) : 1;
    const int rows = static_cast<int>(t.numel / cols);
    // Every rank draws the whole tensor (the same values as one GPU) and keeps its shard.
    const std::optional<TpShard> sh = shard_of(t, plan, arch, tp);
    DeviceArena full;
    const bool q8 = fp8 && DeviceWeights::is_projection(t.kind) && fp8_shape_ok(rows, cols) &&
                    (!sh || fp8_shape_ok(sh->rows.empty() ? rows : static_cast<int>(sh->num_rows()),
                                         sh->cols > 0 ? static_cast<int>(sh->cols) : cols));
    void* p = w->place(t, cols, q8 ? Dtype::kFP8 : Dtype::kBF16, sh ? &full : nullptr);
    if (matrix) {
      // Unit-variance inputs give unit-variance outputs: scale 1 / sqrt(fan_in).
      const double fan_in = t.kind == K::kO ? q : t.kind == K::kDown ? I : H;
      cuda_model::fill_random_bf16(q8 ? tmp : p, t.numel, seed * 1000003ull + i,
                                   static_cast<float>(1.0 / std::sqrt(fan_in)), nullptr);
      if (q8)
        cuda_model::quantize_rows_fp8(tmp, true, rows, cols, cols, cuda_model::Fp8Scale::kDynamic,
                                      nullptr, static_cast<uint8_t*>(p),
                                      const_cast<float*>(w->linear_of(t.kind, t.layer)->scale),
                                      nullptr);
      KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    } else {
      const bool norm = t.kind == K::kFinalNorm || t.kind == K::kInputNorm ||
                        t.kind == K::kPostNorm || t.kind == K::kQNorm || t.kind == K::kKNorm;
      cuda_model::fill_f32(static_cast<float*>(p), t.numel, norm ? 1.0f : 0.0f, nullptr);
    }
    if (sh) {
      KVQ_CUDA_CHECK(cudaDeviceSynchronize());
      w->shard(t, cols, q8 ? Dtype::kFP8 : Dtype::kBF16, p, *sh);
    }
  }
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  w->finish(arch.vocab_size, arch.hidden_size, tied_vocab_rows(arch, tp));
  return w;
}

// What the CUDA kernels cannot run for one layer (decode, the cache write, prefill). Head dims
// the tensor-core kernels do not take run the generic kernel (cuda_generic.h): no plan beyond
// the batch shape, no workspace.
std::vector<std::string> layer_cuda_reasons(const LayerKvSpec& spec) {
  if (cuda::uses_generic_attention(spec)) return cuda::generic_unsupported_reasons(spec);
  std::vector<std::string> r = cuda::decode_unsupported_reasons(spec);
#if KVQ_MODEL_CUDA_PREFILL
  for (std::string& s : cuda::prefill_unsupported_reasons(spec))
    if (std::find(r.begin(), r.end(), s) == r.end()) r.push_back(std::move(s));
#endif
  return r;
}

class CudaDecoderModel final : public CudaModel {
 public:
  // `tp`: a tensor-parallel rank (plan: slice_kv_plan's for it; weights: its shards).
  CudaDecoderModel(const KvPlan& plan, const CudaModelOptions& options,
                   std::shared_ptr<const DeviceWeights> weights, WeightPrecision precision,
                   size_t free_at_load, cuda_model::TpRank tp = {});
  ~CudaDecoderModel() override;

  std::unique_ptr<Model> with_plan(const KvPlan& plan,
                                   std::string_view forced_backend) const override;
  const KvPlan& plan() const override { return plan_; }
  const ArchitectureConfig& arch() const override { return arch_; }
  int vocab_size() const override { return vocab_; }
  std::vector<const AttentionBackend*> layer_backends() const override { return backends_; }
  void forward(const ForwardBatch& batch, PagedKvCache& cache,
               std::span<float> logits) const override;
  void write_feature_kv(std::span<const float> features, std::span<const int32_t> positions,
                        std::span<const int64_t> slots, PagedKvCache& cache) const override;
  bool reads_features_of(const Model& target) const override;
  void write_feature_kv_from_target(const Model& target, std::span<const int32_t> rows,
                                    std::span<const int32_t> positions,
                                    std::span<const int64_t> slots,
                                    PagedKvCache& cache) const override;
  bool keeps_captures_on_device() const override { return true; }
  const float* device_captured() const override { return last_captured_; }
  std::unique_ptr<PagedKvCache> create_cache(int32_t num_blocks) const override;
  int64_t max_cache_blocks() const override;

  // The device weights, for a DFlash drafter built over this model.
  const std::shared_ptr<const DeviceWeights>& weights() const { return w_; }
  const CudaModelOptions& options() const override { return options_; }
  WeightPrecision weight_precision() const override { return precision_; }
  CudaMemoryReport memory() const override;
  void forward_sample(const ForwardBatch& batch, PagedKvCache& cache,
                      std::span<const DeviceSampling> per_row,
                      std::span<int32_t> next_tokens) const override;
  void forward_sample_deferred(const ForwardBatch& batch, PagedKvCache& cache,
                               std::span<const DeviceSampling> per_row) const override;
  void collect_sampled(std::span<int32_t> out) const override;
  void drop_deferred() const override;
  void forward_greedy_chain(const ForwardBatch& batch, PagedKvCache& cache, int steps,
                            std::span<const int64_t> next_slots, std::span<int32_t> out,
                            bool defer) const override;
  bool accepts_tokens_from(const Model& source) const override;
  void copy_blocks(PagedKvCache& cache,
                   std::span<const std::pair<int32_t, int32_t>> src_dst) const override;

  // Validates the plan against the model and the CUDA kernels (InputError naming the layer);
  // returns the parsed architecture. A DFlash drafter's config passes only with `drafter`;
  // a tensor-parallel rank's plan has its share of the heads.
  static ArchitectureConfig validate(const KvPlan& plan, const CudaModelOptions& options,
                                     bool drafter = false, const cuda_model::TpRank& tp = {});

 private:
  // One step as the device runs it.
  struct Step {
    int T = 0;            // token rows (decode: padded to the batch bucket)
    int S = 0;            // sequences (decode: padded)
    int R = 0;            // logit rows asked for
    bool decode = false;  // every sequence has one query
    // A speculative verification step (2..kMaxVerifyQueries queries per sequence), padded to
    // the batch bucket with Q rows per sequence so it too can be replayed from a graph: the
    // prefill kernels read every length from the device, and the logits of all padded rows
    // are computed in the body.
    bool verify = false;
    int Q = 0;  // verify: most queries of a sequence
    // A verify step whose attention runs the decode kernel with Q queries per sequence
    // (cuda::DecodeOptions::q_per_seq), planned for its context bucket like a decode step.
    bool verify_decode = false;
    int context = 0;      // decode, verify_decode: context bucket
    int capture_set = 0;  // 0: no capture; else 1 + index into capture_sets_
    // A DFlash drafter's context rows written before the body (ForwardBatch::feature_rows):
    // their number (graph steps: padded to a bucket with inert rows, slot -1) and the target's
    // captured features they are gathered from.
    int C = 0;
    const float* feature_src = nullptr;
    size_t num_indices = 0;
    int fallback_context = 0;  // prefill without the prefill kernels: bucket of the rows
#if KVQ_MODEL_CUDA_PREFILL
    std::vector<cuda::PrefillPlan> prefill_plans;  // per layer group
#endif
  };

  void allocate_buffers();
  // The index (1-based) of this list of capture layers, with the capture buffer grown to hold
  // it (growing it drops the graphs, which hold its address).
  int capture_set(std::span<const int32_t> layers) const;
  Step stage(const ForwardBatch& b, PagedKvCache& cache,
             std::span<const DeviceSampling> per_row) const;
  void run_step(const Step& st, PagedKvCache& cache) const;
  // Checks of forward_sample's arguments; the number of logit rows.
  size_t check_sample_args(const ForwardBatch& b, std::span<const DeviceSampling> per_row) const;
  // Stages and runs the batch and samples its logit rows into d_out on the device (lock held).
  void run_and_sample(const ForwardBatch& b, PagedKvCache& cache,
                      std::span<const DeviceSampling> per_row, int32_t* d_out) const;
  // Samples logits_ rows [0, n) with the staged rules of rows [first, first + n) into d_out.
  void sample_rows(int first, int n, int32_t* d_out) const;
  // Deferred ids (forward_sample_deferred, a deferred greedy chain) of this model are given up:
  // the next pass reuses their buffers (waits for the work that wrote them first).
  void drop_deferred_locked() const;
  // After an exception in a call that queued work reading the pinned staging: wait for it, so
  // the next call may refill that staging.
  void settle_after_throw() const {
    (void)cudaStreamSynchronize(stream_);
  }
  // Marks n ids at d_ids (copied to pinned h_ids) as this model's deferred ids, ready on the
  // device at ids_ready_.
  void defer_ids(const int32_t* d_ids, int32_t* h_ids, int n,
                 std::chrono::steady_clock::time_point t0) const;
  // The chain buffers for `steps` passes (allocated on first use, grown when needed).
  void reserve_chain(int steps) const;
  // The captured rows of the batch's real tokens to b.captured (host), on the stream.
  void copy_captured(const ForwardBatch& b) const;
  // Checks of a feature write's positions and slots against `cache`; its layer views.
  std::vector<LayerCacheView> check_feature_write(std::span<const int32_t> positions,
                                                  std::span<const int64_t> slots,
                                                  PagedKvCache& cache) const;
  // Context K/V of n rows whose features are in feat_ and whose slots and positions are on the
  // device, written into every layer's cache.
  // A DFlash drafter's context rows from the gathered features (feat_): hidden_norm(fc(.)) into
  // h_rows (n rows of h_'s layout) and their RoPE table into cs_rows.
  void context_features(int n, const int32_t* d_positions, void* h_rows, float* cs_rows) const;
  void context_kv_rows(int n, const std::vector<LayerCacheView>& views, const int64_t* d_slots,
                       const int32_t* d_positions) const;
  // The staged feature rows of a step (ForwardBatch::feature_rows) into the step's staging.
  void stage_features(const ForwardBatch& b, PagedKvCache& cache, Step& st) const;
  // The first n slots, positions (and rows) of h_feat_step_ to d_feat_step_, on the stream.
  void stage_feature_rows(int n, bool rows) const;
  void run_body(const Step& st, const std::vector<LayerCacheView>& views) const;
  // The skinny GEMM's warps for L's product of T rows with the RMSNorm (weight norm_w) of x_ in
  // its prologue (gemv_bf16_norm), or 0 where the tuner does not run L there, or it does not fit.
  int norm_in_gemv_warps(const cuda_model::Linear& L, int T, const float* norm_w) const;
  void attention(const Step& st, int layer, const LayerCacheView& view) const;
  // Final norm + lm_head for logit rows [first, first + n) into logits_ rows [0, n).
  void logits_rows(int first, int n) const;
  // out[m][L.n] (row stride ldc) = in[m][L.k] (row stride lda, the activations' precision)
  // times L's weight transposed (+ beta * out): the GEMM L's precision calls for
  // (cuda_model::Linear).
  // FP8 projections take two options: `quantized` (the producer of the input already wrote its
  // codes and scales to act8_ / act_scale_: rms_norm_rows_fp8 and kin) and `defer_scales`
  // (the consumer applies the row and column scales; the returned pointers say which, both null
  // when linear() applied them). With beta 1 (a residual add) a deferred product is left in
  // `add` (fp8_raw_) and out untouched: the next add_rms_norm_rows / rms_norm_rows_fp8 adds it.
  struct LinearOpts {
    bool quantized = false;
    bool defer_scales = false;
  };
  struct Deferred {
    const float* row_scale = nullptr;
    const float* col_scale = nullptr;
    const float* add = nullptr;
    cuda_model::ResidualAdd residual() const { return {add, row_scale, col_scale}; }
  };
  Deferred linear(const cuda_model::Linear& L, int m, const void* in, int lda, float* out, int ldc,
                  float beta, LinearOpts opts) const;
  void linear(const cuda_model::Linear& L, int m, const void* in, int lda, float* out, int ldc,
              float beta) const {
    (void)linear(L, m, in, lda, out, ldc, beta, LinearOpts{});
  }
  // Whether an FP8 projection of an m-row step runs as W8A16 (bf16 inputs on kvq's skinny
  // GEMM; fp8_w8a16_rows_from_env): m within KVQ_FP8_W8A16 and the tuner timed a variant for it.
  bool w8a16(const cuda_model::Linear& L, int m) const {
    return L.dtype == cuda_model::Linear::Dtype::kFP8 && m <= w8a16_rows_ && bf16_ && tuner_ &&
           tuner_->gemv_warps(cuda_model::GemmInput::kW8A16, m, L.n, L.k, L.k, L.n) > 0;
  }
  // Whether the forward pass fuses an FP8 projection's input quantization into the kernel
  // that produces the input (and its scales into the consumer) at an m-row step: not for
  // W8A16 (bf16 inputs). KVQ_FP8_FUSE=0 turns it off (A/B; the results are the same bits).
  bool fuse_fp8(const cuda_model::Linear& L, int m) const {
    return fp8_fuse_ && L.dtype == cuda_model::Linear::Dtype::kFP8 && !w8a16(L, m);
  }
  // The skinny GEMM's fused forms for bf16 weights or W8A16 FP8 ones (L's dtype says which).
  void gemv_norm_product(const cuda_model::Linear& L, int T, const cuda_model::GemvNorm& norm,
                         float* out, int ldc, int warps) const;
  void gemv_silu_mul_product(const cuda_model::Linear& gate_up, int T, const void* in,
                             const cuda_model::GemvNorm* norm, void* out, int ldo, int warps) const;
  static cuda_model::Fp8Scale fp8_mode(const cuda_model::Linear& L) {
    return L.in_scale ? cuda_model::Fp8Scale::kStatic : cuda_model::Fp8Scale::kDynamic;
  }
  cuda::DecodePlan decode_plan(int group, int num_seqs, int context, int q_per_seq = 1) const;
  // Times the GEMM algorithms of an m-row decode step once (bf16 weights, m <= kMaxTunedRows).
  void tune_gemms(int m) const;
  // The q|k|v product of a DFlash step whose C context rows ride ahead of its T block rows
  // (C + T rows, from the regions in front of h_ and qkv_).
  void tune_riding_qkv(int C, int T) const;

  KvPlan plan_;
  ArchitectureConfig arch_;
  CudaModelOptions options_;
  std::shared_ptr<const DeviceWeights> w_;
  WeightPrecision precision_;
  bool bf16_ = false;
  int num_layers_ = 0, H_ = 0, I_ = 0, vocab_ = 0, nq_ = 0, nkv_ = 0, d_ = 0;
  int q_dim_ = 0, kv_dim_ = 0, qkv_dim_ = 0;
  float eps_ = 1e-6f, softmax_scale_ = 1.0f;
  int num_sms_ = 0;
  // KVQ_PREFILL_SMALL_Q=0: verification and short-chunk steps keep the default prefill block
  // shape (an A/B switch for benchmarks; see cuda::PrefillOptions::small_q).
  bool prefill_small_q_ = true;
  // KVQ_VERIFY_CONTEXT_BUCKETS=1: verification graphs per context bucket (A/B switch).
  bool verify_context_buckets_ = false;
  bool verify_coarse_q_ = false;  // KVQ_VERIFY_Q_BUCKETS=coarse (kVerifyQBuckets)
  // Verification attention (and a DFlash block's): on the decode kernel (the queries as rows
  // of its warps, planned per context bucket) or the prefill kernel's small-q block.
  // KVQ_VERIFY_KERNEL=auto (default) picks by shape (verify_on_decode_kernel); decode / prefill
  // force one (A/B switch).
  enum class VerifyKernel { kAuto, kDecode, kPrefill } verify_kernel_ = VerifyKernel::kAuto;
  bool verify_on_decode_kernel(int num_seqs, int q_per_seq, int context) const;
  std::vector<const AttentionBackend*> backends_;
  std::vector<int> layer_group_;         // layers with the same attention kind and window
  std::vector<LayerKvSpec> group_spec_;  // one representative per group
  bool any_generic_ = false;             // a layer runs the generic attention (no verify graphs)
  std::vector<int> batch_buckets_;
  int max_context_bucket_ = 0;
  int max_seq_len_ = 0;  // longest sequence the buffers and workspaces were sized for

  // Capacities.
  int T_cap_ = 0, S_cap_ = 0, R_cap_ = 0;
  size_t idx_cap_ = 0;
  // Device state.
  size_t device_total_ = 0, free_at_load_ = 0;
  cuda_model::TpRank tp_;  // one rank of a tensor-parallel group (size 1: none)
  cudaStream_t stream_ = nullptr;
  // o's weight prefetched into L2 beside a one-row step's attention chain (l2_prefetch_from_env):
  // a side stream forked from stream_ after q|k|v's product and joined at the end of the step.
  struct SidePrefetch {
    cudaStream_t s = nullptr;  // null: off
    cudaEvent_t fork = nullptr, join = nullptr;
    SidePrefetch() = default;
    SidePrefetch(const SidePrefetch&) = delete;
    SidePrefetch& operator=(const SidePrefetch&) = delete;
    ~SidePrefetch() {
      if (s) (void)cudaStreamSynchronize(s);
      if (fork) (void)cudaEventDestroy(fork);
      if (join) (void)cudaEventDestroy(join);
      if (s) (void)cudaStreamDestroy(s);
    }
  };
  SidePrefetch pf_;
  cublasHandle_t cublas_ = nullptr;
  std::unique_ptr<cuda_model::GemmTuner> tuner_;
  mutable std::set<int> tuned_rows_;
  mutable std::set<int> tuned_riding_rows_;  // C + T of tune_riding_qkv
  DeviceArena buf_;
  float *x_ = nullptr, *qkv_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr,
        *att_ = nullptr, *mlp_ = nullptr, *cs_ = nullptr, *logits_ = nullptr;
  void* h_ = nullptr;  // GEMM inputs (bf16 or fp32)
  // FP8 projections: their quantized input rows and one scale per row (rows of up to
  // max(H, I, q_dim) values: the decoder projections; a DFlash drafter's fc is never FP8).
  uint8_t* act8_ = nullptr;
  float* act_scale_ = nullptr;
  // FP8 products scaled by kvq's kernel that accumulate into the residual (beta 1) land here
  // first: T x H floats (gemm_tuner.h, Fp8Scaling).
  float* fp8_raw_ = nullptr;
  // Vocabulary-parallel LM head: this rank's logit columns [R][V/N] and every rank's, gathered.
  float* lm_part_ = nullptr;
  float* lm_gather_ = nullptr;
  size_t fp8_raw_floats_ = 0;
  bool fp8_fuse_ = true;
  int w8a16_rows_ = 0;  // KVQ_FP8_W8A16
  // A DFlash drafter's context rows ride in the layers' q|k|v products (run_body);
  // KVQ_DFLASH_RIDE=0: they are written on their own first (A/B switch).
  bool context_rows_ride_ = false;
  // gate|up's SiLU-mul in the skinny kernel's epilogue where it runs gate|up (KVQ_GEMV_SILU=0:
  // never, for A/B runs).
  bool gemv_silu_ = true;
  int gemv_norm_ = 1;  // KVQ_GEMV_NORM: the most rows whose RMSNorms ride in the skinny GEMM
  // KVQ_STEP_LAB (timing experiments only: the outputs are wrong), bits: 1 no input RMSNorm,
  // 2 no q|k|v post, 4 no cache write, 8 no attention, 16 no attention-output conversion,
  // 32 no post-attention RMSNorm, 64 no GEMMs. The step's time without a kernel is its cost.
  int step_lab_ = 0;
  mutable bool lab_no_gemm_ = false;  // inside run_body with KVQ_STEP_LAB bit 64
  double* inv_freq_ = nullptr;
  void* attn_ws_ = nullptr;
  void* sample_ws_ = nullptr;
  size_t attn_ws_bytes_ = 0;
  // The fp16 staging of per-tensor fp8 caches for long prefill steps (cuda::PrefillPlan::
  // staged_blocks), shared by the layers (they run in stream order); 0 bytes: none.
  void* prefill_stage_ = nullptr;
  size_t prefill_stage_bytes_ = 0;
  int32_t* d_ids_ = nullptr;
  // A DFlash drafter's features [T_cap][F] (fp32, and bf16 for bf16 weights).
  float* feat_ = nullptr;
  void* feat_h_ = nullptr;
  // Their slots [T_cap] (int64), positions [T_cap] and rows in the target's captures [T_cap]
  // (pinned and device), apart from the step staging so a feature write need not wait for its
  // copies before the next step is staged.
  std::byte* h_feat_step_ = nullptr;
  std::byte* d_feat_step_ = nullptr;
  // Captured layer outputs [T][layers][H] (fp32), grown on first use.
  mutable std::unique_ptr<DeviceArena> cap_arena_;
  mutable float* cap_ = nullptr;
  mutable const float* last_captured_ = nullptr;  // cap_ after a forward that captured
  mutable size_t cap_layers_ = 0;
  mutable std::vector<std::vector<int32_t>> capture_sets_;
  // Step staging: the same layout in pinned host memory and on the device.
  // `features`: a DFlash drafter's fused context rows, packed for the step's row count C as
  // slots [C] (int64), positions [C], rows [C]; copied only by steps that have them.
  struct Offsets {
    size_t tokens, positions, slots, q_indptr, bt_indptr, seq_lens, exp_indptr, exp_seq_lens,
        logit_rows, params, indices, features, gather, total;
  };
  // The staging layout of the step being staged or run (stage() picks off_small_ for steps of at
  // most small_rows_ rows, else off_big_; they share indices, features and gather).
  mutable Offsets off_{};
  Offsets off_big_{}, off_small_{};
  int small_rows_ = 0;
  static constexpr int kSmallStageRows = 128;
  std::byte* h_step_ = nullptr;
  std::byte* d_step_ = nullptr;
  int32_t* h_ids_ = nullptr;

  mutable std::mutex mu_;
  // The host staging stage() fills: h_step_, or h_chain_step_ for a greedy chain's first
  // one-token pass (its copy may still be pending while the chain stages that pass).
  mutable std::byte* h_stage_ = nullptr;
  // Deferred ids: where they are on the device and in pinned memory (after the stream's work
  // up to now), how many (0: none outstanding), and the event after which the device copy is
  // complete (a pass of another model that reads them waits on it).
  mutable const int32_t* deferred_ids_ = nullptr;
  mutable const int32_t* deferred_host_ = nullptr;
  mutable int deferred_n_ = 0;
  mutable std::chrono::steady_clock::time_point deferred_t0_{};
  cudaEvent_t ids_ready_ = nullptr;
  // Greedy chains: every pass's ids [steps][S_cap] on the device and pinned, the later
  // passes' slots [steps][S_cap] on the device (staged from the end of h_chain_step_), and the
  // staging of the first one-token pass; sized for chain_steps_ passes.
  mutable int chain_steps_ = 0;
  mutable int32_t* d_chain_ids_ = nullptr;
  mutable int32_t* h_chain_ids_ = nullptr;
  mutable int64_t* d_chain_slots_ = nullptr;
  mutable std::byte* h_chain_step_ = nullptr;
  // KVQ_GPU_TIMING=1: device time of every forward (events from after the staging to after
  // the copies back: body, sampling, launch gaps) against the host wall time of the whole
  // call, printed at destruction.
  struct Timing {
    bool on = false;
    cudaEvent_t begin = nullptr, end = nullptr;
    int64_t calls = 0;
    double device_ms = 0.0, wall_ms = 0.0;
  };
  mutable Timing timing_;
  void timing_begin() const;  // after the step's staging: device time of the step itself
  void timing_end(std::chrono::steady_clock::time_point t0) const;
  // Graphs by (batch bucket, context bucket or -Q for verify steps, capture set, fused context
  // rows bucket).
  using GraphKey = std::tuple<int, int, int, int>;
  mutable std::map<GraphKey, cudaGraphExec_t> graphs_;
  mutable std::set<GraphKey> seen_;  // keys run eagerly once (warm-up)
  // The storage the graphs were captured for: every layer's K and V base. (Layer 0's K base
  // alone is not enough: a new cache can reuse that address while other layers moved.)
  mutable std::vector<const std::byte*> graph_cache_;
  // The target's captured features the graphs with fused context rows read.
  mutable const float* graph_feature_src_ = nullptr;
  mutable size_t graph_bytes_ = 0;

  template <typename T>
  T* h_at(size_t off) const {
    return reinterpret_cast<T*>(h_stage_ + off);
  }
  template <typename T>
  T* d_at(size_t off) const {
    return reinterpret_cast<T*>(d_step_ + off);
  }
};

ArchitectureConfig CudaDecoderModel::validate(const KvPlan& plan, const CudaModelOptions& o,
                                              bool drafter, const cuda_model::TpRank& tp) {
  ArchitectureConfig arch = parse_architecture(plan.model);
  const ModelConfig& c = plan.model;
  if (arch.dflash && !drafter)
    throw InputError(c.dir +
                     ": a DFlash drafter is loaded over its target "
                     "(--speculative-config with method dflash), not alone");
  if (!(o.gpu_memory_utilization > 0.0f && o.gpu_memory_utilization <= 1.0f))
    throw InputError("--gpu-memory-utilization " + std::to_string(o.gpu_memory_utilization) +
                     " is outside (0, 1]");
  if (o.max_num_seqs < 1 || o.max_num_batched_tokens < 1)
    throw InputError("max_num_seqs and max_num_batched_tokens must be positive");
  KVQ_CHECK(plan.layers.size() == static_cast<size_t>(c.num_layers),
            "the plan has " + std::to_string(plan.layers.size()) + " layers, the model " +
                std::to_string(c.num_layers));
  const int want_q = tp.active() ? tp.split.q_heads_per_rank : c.num_q_heads;
  const int want_kv = tp.active() ? tp.split.kv_heads_per_rank : c.num_kv_heads;
  for (const LayerKvSpec& s : plan.layers) {
    KVQ_CHECK(s.num_q_heads == want_q && s.num_kv_heads == want_kv && s.head_dim_k == c.head_dim &&
                  s.head_dim_v == c.head_dim,
              "layer " + std::to_string(s.layer) + "'s spec does not match the model's heads");
    const auto reasons = layer_cuda_reasons(s);
    if (!reasons.empty()) {
      std::string all;
      for (const auto& r : reasons) all += (all.empty() ? "" : "; ") + r;
      throw InputError("layer " + std::to_string(s.layer) + " (" +
                       std::string(to_string(s.k_dtype)) + "/" + std::string(to_string(s.v_dtype)) +
                       ") cannot run on the CUDA model: " + all);
    }
  }
  return arch;
}

CudaDecoderModel::CudaDecoderModel(const KvPlan& plan, const CudaModelOptions& options,
                                   std::shared_ptr<const DeviceWeights> weights,
                                   WeightPrecision precision, size_t free_at_load,
                                   cuda_model::TpRank tp)
    : plan_(plan),
      arch_(validate(plan, options, weights && weights->target != nullptr, tp)),
      options_(options),
      w_(std::move(weights)),
      precision_(precision),
      free_at_load_(free_at_load),
      tp_(std::move(tp)) {
  const ModelConfig& c = plan_.model;
  bf16_ = w_->bf16;
  num_layers_ = c.num_layers;
  H_ = arch_.hidden_size;
  I_ = arch_.intermediate_size / tp_.size;
  vocab_ = arch_.vocab_size;
  nq_ = plan_.layers.front().num_q_heads;  // the rank's heads under tensor parallelism
  nkv_ = plan_.layers.front().num_kv_heads;
  d_ = c.head_dim;
  q_dim_ = nq_ * d_;
  kv_dim_ = nkv_ * d_;
  qkv_dim_ = q_dim_ + 2 * kv_dim_;
  eps_ = arch_.rms_norm_eps;
  softmax_scale_ = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d_)));
  for (const LayerKvSpec& s : plan_.layers)
    backends_.push_back(
        select_attention_backend(s, Device::kCuda, options_.forced_backend).backend);
  for (const LayerKvSpec& s : plan_.layers) {
    int g = -1;
    for (size_t i = 0; i < group_spec_.size(); ++i)
      if (group_spec_[i].attention == s.attention &&
          group_spec_[i].sliding_window == s.sliding_window)
        g = static_cast<int>(i);
    if (g < 0) {
      g = static_cast<int>(group_spec_.size());
      group_spec_.push_back(s);
    }
    layer_group_.push_back(g);
    any_generic_ = any_generic_ || cuda::uses_generic_attention(s);
  }
  int dev = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&dev));
  KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, dev));
  if (const char* e = std::getenv("KVQ_PREFILL_SMALL_Q"); e != nullptr && std::string(e) == "0")
    prefill_small_q_ = false;
  if (const char* e = std::getenv("KVQ_VERIFY_CONTEXT_BUCKETS");
      e != nullptr && std::string(e) == "1")
    verify_context_buckets_ = true;
  verify_coarse_q_ = verify_coarse_q_from_env();
  if (const char* e = std::getenv("KVQ_VERIFY_KERNEL"); e != nullptr) {
    const std::string v(e);
    if (v != "auto" && v != "decode" && v != "prefill")
      throw InputError("KVQ_VERIFY_KERNEL=" + v + " is not one of: auto, decode, prefill");
    verify_kernel_ = v == "decode"    ? VerifyKernel::kDecode
                     : v == "prefill" ? VerifyKernel::kPrefill
                                      : VerifyKernel::kAuto;
  }
  try {
    allocate_buffers();
  } catch (...) {
    if (cublas_) (void)cublasDestroy(cublas_);
    if (stream_) (void)cudaStreamDestroy(stream_);
    if (h_step_) (void)cudaFreeHost(h_step_);
    if (h_ids_) (void)cudaFreeHost(h_ids_);
    if (h_feat_step_) (void)cudaFreeHost(h_feat_step_);
    if (ids_ready_) (void)cudaEventDestroy(ids_ready_);
    throw;
  }
}

CudaDecoderModel::~CudaDecoderModel() {
  if (timing_.on) {
    if (timing_.calls > 0)
      std::fprintf(stderr,
                   "kvq gpu timing (%s): %lld forward calls, device %.4f ms/call, host wall "
                   "%.4f ms/call\n",
                   arch_.dflash ? "drafter" : "model", static_cast<long long>(timing_.calls),
                   timing_.device_ms / timing_.calls, timing_.wall_ms / timing_.calls);
    (void)cudaEventDestroy(timing_.begin);
    (void)cudaEventDestroy(timing_.end);
  }
  for (auto& [key, exec] : graphs_) (void)cudaGraphExecDestroy(exec);
  if (stream_) (void)cudaStreamSynchronize(stream_);
  if (cublas_) (void)cublasDestroy(cublas_);
  if (stream_) (void)cudaStreamDestroy(stream_);
  if (h_step_) (void)cudaFreeHost(h_step_);
  if (h_ids_) (void)cudaFreeHost(h_ids_);
  if (h_feat_step_) (void)cudaFreeHost(h_feat_step_);
  if (h_chain_step_) (void)cudaFreeHost(h_chain_step_);
  if (h_chain_ids_) (void)cudaFreeHost(h_chain_ids_);
  if (d_chain_ids_) (void)cudaFree(d_chain_ids_);
  if (d_chain_slots_) (void)cudaFree(d_chain_slots_);
  if (ids_ready_) (void)cudaEventDestroy(ids_ready_);
}

bool CudaDecoderModel::verify_on_decode_kernel(int num_seqs, int q_per_seq, int context) const {
  if (q_per_seq > cuda::kDecodeMaxQueries || verify_kernel_ == VerifyKernel::kPrefill) return false;
  if (verify_kernel_ == VerifyKernel::kDecode) return true;
  // Measured on an H100 (docs/notes/decode-tuning.md, version 6): the decode kernel's step is
  // shorter where the grid is small (few sequences x kv heads, short context: the default
  // model at batch 1 and 8, Llama-3-8B at batch 1 x 1k) and longer where the prefill block's
  // staged tiles serve more rows (Llama-3-8B at batch 8, or batch 1 x 8k). At head_dim 64 and up
  // to 9 queries per sequence (as measured) the decode kernel also wins at 64 (sequence, kv
  // head) pairs: the default model's verification forward at batch 32 x 9 queries, 0.37-0.39 ms
  // against the prefill block's 0.40-0.41 (2026-11-27, docs/BENCHMARKS.md), where Llama-3-8B's
  // (head_dim 128) batch 8 x 8 queries, also 64 pairs, is faster on the prefill block.
  const int64_t pairs = static_cast<int64_t>(num_seqs) * nkv_;
  return context <= 2048 && (pairs <= 16 || (d_ <= 64 && pairs <= 64 && q_per_seq <= 9));
}

cuda::DecodePlan CudaDecoderModel::decode_plan(int group, int num_seqs, int context,
                                               int q_per_seq) const {
  if (cuda::uses_generic_attention(group_spec_[static_cast<size_t>(group)])) return {};
  cuda::DecodeOptions o;
  o.num_sms = num_sms_;
  o.q_per_seq = q_per_seq;
  const std::vector<int32_t> lens(static_cast<size_t>(num_seqs), context);
  cuda::DecodePlan p = cuda::plan_decode(group_spec_[static_cast<size_t>(group)], lens, o);
  // The plan picks the number of work items per sequence for the bucket's length; keep that
  // count for the shorter sequences the plan is replayed on (each item gets ceil(tiles /
  // max_splits) tiles) instead of keeping the tiles per item, which would leave SM slots idle.
  p.chunk_tiles = 1;
  return p;
}

void CudaDecoderModel::allocate_buffers() {
  KVQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  if (l2_prefetch_from_env()) {
    KVQ_CUDA_CHECK(cudaStreamCreateWithFlags(&pf_.s, cudaStreamNonBlocking));
    KVQ_CUDA_CHECK(cudaEventCreateWithFlags(&pf_.fork, cudaEventDisableTiming));
    KVQ_CUDA_CHECK(cudaEventCreateWithFlags(&pf_.join, cudaEventDisableTiming));
  }
  if (const char* e = std::getenv("KVQ_GPU_TIMING"); e != nullptr && std::string(e) == "1") {
    KVQ_CUDA_CHECK(cudaEventCreate(&timing_.begin));
    KVQ_CUDA_CHECK(cudaEventCreate(&timing_.end));
    timing_.on = true;
  }
  KVQ_CUBLAS_CHECK(cublasCreate(&cublas_));
  KVQ_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  KVQ_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  // A workspace of our own: cuBLAS must not allocate while a graph is being captured.
  void* gemm_ws = buf_.alloc(kCublasWorkspace);
  KVQ_CUBLAS_CHECK(cublasSetWorkspace(cublas_, gemm_ws, kCublasWorkspace));
  if (bf16_) tuner_ = std::make_unique<cuda_model::GemmTuner>(stream_, gemm_ws, kCublasWorkspace);
  gemv_silu_ = gemv_silu_from_env();
  gemv_norm_ = gemv_norm_from_env();
  if (const char* e = std::getenv("KVQ_STEP_LAB"); e != nullptr) step_lab_ = std::atoi(e);
  if (const char* e = std::getenv("KVQ_FP8_FUSE"); e != nullptr && std::string(e) == "0")
    fp8_fuse_ = false;
  if (tuner_) tuner_->set_fp8_scales_deferred(fp8_fuse_);
  w8a16_rows_ = fp8_w8a16_rows_from_env();

  S_cap_ = options_.max_num_seqs;
  T_cap_ = std::max(options_.max_num_batched_tokens, options_.max_num_seqs);
  // Logit rows: every decode row, and every padded row of a verification step of up to
  // kMaxVerifyQueries per sequence (so its graph holds the logits) while those stay under
  // 256 MiB; larger verification steps run eagerly.
  const int verify_rows = static_cast<int>(std::min<int64_t>(
      int64_t{S_cap_} * kMaxVerifyQueries, (int64_t{256} << 20) / (int64_t{vocab_} * 4)));
  R_cap_ = std::min(T_cap_, std::max({S_cap_, 256, verify_rows}));
  for (int b = 1; b < S_cap_; b <<= 1) batch_buckets_.push_back(b);
  batch_buckets_.push_back(S_cap_);
  const int max_len =
      std::max(plan_.model.max_position_embeddings > 0 ? plan_.model.max_position_embeddings : 8192,
               kMinContextBucket);
  max_context_bucket_ = context_bucket(max_len);
  max_seq_len_ = max_len;
  const int bt = plan_.layers.front().block_tokens;
  idx_cap_ = static_cast<size_t>(S_cap_) * static_cast<size_t>((max_len + bt - 1) / bt + 1);

  // The decode workspace for the largest plan any step can make: every sequence count up to
  // max_num_seqs (decode buckets and prefill-fallback chunks) and every context bucket.
  for (size_t g = 0; g < group_spec_.size(); ++g)
    for (int ctx = kMinContextBucket; ctx <= max_context_bucket_; ctx = next_context_bucket(ctx))
      for (int n = 1; n <= S_cap_; ++n)
        attn_ws_bytes_ =
            std::max(attn_ws_bytes_, decode_plan(static_cast<int>(g), n, ctx).workspace_bytes);
  // And for verification steps on the decode kernel: a batch bucket of Q-query sequences
  // (every Q bucket) whose rows fit a graph step.
  for (size_t g = 0; g < group_spec_.size(); ++g)
    for (int ctx = kMinContextBucket; ctx <= max_context_bucket_; ctx = next_context_bucket(ctx))
      for (int n : batch_buckets_)
        for (int q : kVerifyQBuckets)
          if (q <= cuda::kDecodeMaxQueries &&
              static_cast<int64_t>(n) * q <= std::min(T_cap_, R_cap_))
            attn_ws_bytes_ = std::max(attn_ws_bytes_,
                                      decode_plan(static_cast<int>(g), n, ctx, q).workspace_bytes);
#if KVQ_MODEL_CUDA_PREFILL
  {
    // Sized on the largest batch shape; checked again per step.
    std::vector<int32_t> qi{0, T_cap_}, sl{std::max(T_cap_, max_len)};
    for (const LayerKvSpec& s : group_spec_)
      if (!cuda::uses_generic_attention(s)) {
        attn_ws_bytes_ = std::max(attn_ws_bytes_, cuda::plan_prefill(s, qi, sl).workspace_bytes);
        // Split-KV plans of small-q steps (verification) stay under this bound.
        attn_ws_bytes_ = std::max(attn_ws_bytes_, cuda::kPrefillSplitWorkspaceBytes);
        // Staging for steps of up to max(T_cap, 32k) context tokens (a prompt prefilled in one
        // or two steps; longer contexts convert in the kernel): 128 MiB for Llama-3-8B.
        if (cuda::prefill_stageable(s) && cuda::prefill_staging_enabled()) {
          const int64_t tokens = std::min<int64_t>(max_len, std::max<int64_t>(T_cap_, 32768));
          prefill_stage_bytes_ =
              std::max(prefill_stage_bytes_,
                       cuda::prefill_staging_bytes(s, (tokens + bt - 1) / bt + S_cap_, S_cap_));
        }
      }
    if (prefill_stage_bytes_ > 0) prefill_stage_ = buf_.alloc(prefill_stage_bytes_);
  }
#endif
  attn_ws_ = buf_.alloc(attn_ws_bytes_);

  const size_t T = static_cast<size_t>(T_cap_), act = bf16_ ? 2 : 4;
  // A DFlash drafter's context rows ride in each layer's q|k|v product ahead of the block rows
  // (run_body): up to T_cap of them in front of h_, qkv_, q_, k_, v_ and cs_.
  const size_t front = arch_.dflash ? T : 0;
  x_ = static_cast<float*>(buf_.alloc(T * H_ * 4));
  const size_t h_row = static_cast<size_t>(std::max({H_, I_, q_dim_})) * act;
  h_ = static_cast<std::byte*>(buf_.alloc(front * H_ * act + T * h_row)) + front * H_ * act;
  qkv_ = static_cast<float*>(buf_.alloc((front + T) * qkv_dim_ * 4)) + front * qkv_dim_;
  q_ = static_cast<float*>(buf_.alloc((front + T) * q_dim_ * 4)) + front * q_dim_;
  att_ = static_cast<float*>(buf_.alloc(T * q_dim_ * 4));
  k_ = static_cast<float*>(buf_.alloc((front + T) * kv_dim_ * 4)) + front * kv_dim_;
  v_ = static_cast<float*>(buf_.alloc((front + T) * kv_dim_ * 4)) + front * kv_dim_;
  mlp_ = static_cast<float*>(buf_.alloc(T * 2 * I_ * 4));
  cs_ = static_cast<float*>(buf_.alloc((front + T) * d_ * 4)) + front * d_;
  logits_ = static_cast<float*>(buf_.alloc(static_cast<size_t>(R_cap_) * vocab_ * 4));
  if (w_->lm_head.n < vocab_) {  // vocabulary-parallel LM head (tensor parallelism)
    KVQ_CHECK(tp_.active() && w_->lm_head.n * tp_.size == vocab_,
              "a partial LM head outside a tensor-parallel group");
    lm_part_ = static_cast<float*>(buf_.alloc(static_cast<size_t>(R_cap_) * w_->lm_head.n * 4));
    lm_gather_ = static_cast<float*>(buf_.alloc(static_cast<size_t>(R_cap_) * vocab_ * 4));
  }
  d_ids_ = static_cast<int32_t*>(buf_.alloc(T * 4));
  if (w_->any_fp8()) {
    act8_ = static_cast<uint8_t*>(buf_.alloc(T * static_cast<size_t>(std::max({H_, I_, q_dim_}))));
    act_scale_ = static_cast<float*>(buf_.alloc(T * 4));
    fp8_raw_floats_ = T * static_cast<size_t>(H_);
    fp8_raw_ = static_cast<float*>(buf_.alloc(fp8_raw_floats_ * 4));
  }
  if (arch_.dflash) {
    const size_t F = arch_.dflash->target_layer_ids.size() *
                     static_cast<size_t>(arch_.dflash->target_hidden_size);
    feat_ = static_cast<float*>(buf_.alloc(T * F * 4));
    // Not with FP8 q|k|v weights: their input quantization (act8_, act_scale_) holds T_cap rows.
    context_rows_ride_ = !tp_.active();
    for (const DeviceWeights::Layer& w : w_->layers)
      context_rows_ride_ = context_rows_ride_ && w.qkv.dtype != cuda_model::Linear::Dtype::kFP8;
    if (const char* e = std::getenv("KVQ_DFLASH_RIDE"); e != nullptr && std::string(e) == "0")
      context_rows_ride_ = false;
    if (bf16_) feat_h_ = buf_.alloc(T * F * 2);
    d_feat_step_ = static_cast<std::byte*>(buf_.alloc(T * 16));
  }
#if KVQ_MODEL_CUDA_SAMPLING
  sample_ws_ = buf_.alloc(cuda::sampling_workspace_bytes(R_cap_, vocab_));
#endif
  const std::vector<double> inv = model::rope_inv_freq(d_, arch_.rope_theta, arch_.rope_scaling);
  inv_freq_ = static_cast<double*>(buf_.alloc(inv.size() * sizeof(double)));
  KVQ_CUDA_CHECK(
      cudaMemcpy(inv_freq_, inv.data(), inv.size() * sizeof(double), cudaMemcpyHostToDevice));

  size_t o = 0;
  auto region = [&](size_t bytes) {
    const size_t at = o;
    o = align_up(o + bytes, 64);
    return at;
  };
  const size_t S1 = static_cast<size_t>(S_cap_) + 1;
  // The per-row arrays (tokens .. params) for `rows` rows. A step's main copy runs from the first
  // of them to the end of its block-table indices, so steps of at most small_rows_ rows (decode,
  // most verification steps) stage into a second, compact set: a few KB per copy instead of
  // ~0.5 MB sized for max_num_batched_tokens (11.5 us of the H200's copy engine before every 8B
  // batch-1 step; docs/notes/decode-tuning.md version 20).
  auto per_row = [&](Offsets& f, size_t rows) {
    f.tokens = region(rows * 4);
    f.positions = region(rows * 4);
    f.slots = region(rows * 8);
    f.q_indptr = region(std::min(S1, rows + 1) * 4);
    f.bt_indptr = region(std::min(S1, rows + 1) * 4);
    f.seq_lens = region(std::min(S1, rows + 1) * 4);
    f.exp_indptr = region(rows * 4);
    f.exp_seq_lens = region(rows * 4);
    f.logit_rows = region(rows * 4);
    f.params = region(rows * sizeof(DeviceSampling));
  };
  per_row(off_big_, T);
  small_rows_ = std::min(T_cap_, kSmallStageRows);
  if (small_rows_ < T_cap_) per_row(off_small_, static_cast<size_t>(small_rows_));
  off_big_.indices = region(idx_cap_ * 4);
  off_big_.features = region(arch_.dflash ? T * 16 : 0);
  // ForwardBatch::token_rows [n], then token_dst [n]: after the step's main copy, copied only
  // by steps that have them.
  off_big_.gather = region(T * 8);
  off_big_.total = o;
  if (small_rows_ < T_cap_) {
    off_small_.indices = off_big_.indices;
    off_small_.features = off_big_.features;
    off_small_.gather = off_big_.gather;
    off_small_.total = off_big_.total;
  } else {
    off_small_ = off_big_;
  }
  off_ = off_big_;
  d_step_ = static_cast<std::byte*>(buf_.alloc(off_.total));
  void* hp = nullptr;
  KVQ_CUDA_CHECK(cudaHostAlloc(&hp, off_.total, cudaHostAllocDefault));
  h_step_ = static_cast<std::byte*>(hp);
  h_stage_ = h_step_;
  KVQ_CUDA_CHECK(cudaEventCreateWithFlags(&ids_ready_, cudaEventDisableTiming));
  KVQ_CUDA_CHECK(cudaHostAlloc(&hp, T * 4, cudaHostAllocDefault));
  h_ids_ = static_cast<int32_t*>(hp);
  if (arch_.dflash) {
    KVQ_CUDA_CHECK(cudaHostAlloc(&hp, T * 16, cudaHostAllocDefault));
    h_feat_step_ = static_cast<std::byte*>(hp);
  }
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());

  size_t free_now = 0, total = 0;
  KVQ_CUDA_CHECK(cudaMemGetInfo(&free_now, &total));
  device_total_ = total;
  const double share = static_cast<double>(options_.gpu_memory_utilization) * total;
  const double used = static_cast<double>(total - free_now);
  if (used > share) {
    auto gib = [](double b) { return std::to_string(b / (1 << 30)).substr(0, 6) + " GiB"; };
    throw InputError("the model needs " +
                     gib(static_cast<double>(w_->arena.bytes() + buf_.bytes())) +
                     " of device memory (weights " + gib(static_cast<double>(w_->arena.bytes())) +
                     ", buffers " + gib(static_cast<double>(buf_.bytes())) + "); with " +
                     gib(used - static_cast<double>(w_->arena.bytes() + buf_.bytes())) +
                     " used by others the device holds " + gib(used) + ", over the " + gib(share) +
                     " allowed by --gpu-memory-utilization " +
                     std::to_string(options_.gpu_memory_utilization).substr(0, 4) +
                     " (raise it, or lower max_num_batched_tokens / max_num_seqs)");
  }
}

std::unique_ptr<Model> CudaDecoderModel::with_plan(const KvPlan& plan,
                                                   std::string_view forced_backend) const {
  const ModelConfig& a = plan_.model;
  const ModelConfig& b = plan.model;
  if (a.architecture != b.architecture || a.num_layers != b.num_layers ||
      a.num_q_heads != b.num_q_heads || a.num_kv_heads != b.num_kv_heads ||
      a.head_dim != b.head_dim || a.hidden_size != b.hidden_size || a.vocab_size != b.vocab_size)
    throw InputError("with_plan: the plan is for a different model (" + b.architecture + ", " +
                     std::to_string(b.num_layers) + " layers) than the loaded one (" +
                     a.architecture + ", " + std::to_string(a.num_layers) + " layers)");
  KvPlan p = plan;
  p.model.raw = a.raw;
  p.model.dir = a.dir;
  CudaModelOptions o = options_;
  o.forced_backend = std::string(forced_backend);
  // A tensor-parallel rank stays one (plan: the caller's slice of the new plan).
  return std::make_unique<CudaDecoderModel>(p, o, w_, precision_, free_at_load_, tp_);
}

CudaMemoryReport CudaDecoderModel::memory() const {
  CudaMemoryReport r;
  size_t free_now = 0, total = 0;
  KVQ_CUDA_CHECK(cudaMemGetInfo(&free_now, &total));
  r.device_total = total;
  r.free_at_load = free_at_load_;
  r.weights = w_->arena.bytes();
  // A decode step reads every matrix but the embedding (a gather of a few rows), unless the
  // LM head is the embedding: then the head's rows (a vocabulary shard under tensor parallelism).
  r.weights_read_per_step = r.weights;
  if (!w_->tied && !w_->target)
    r.weights_read_per_step -= static_cast<size_t>(vocab_) * H_ * (bf16_ ? 2 : 4);
  else if (w_->tied)
    r.weights_read_per_step -= static_cast<size_t>(vocab_ - w_->lm_head.n) * H_ * (bf16_ ? 2 : 4);
  {
    std::lock_guard<std::mutex> lock(mu_);
    r.activations = buf_.bytes() + off_.total + static_cast<size_t>(T_cap_) * 4 + graph_bytes_ +
                    (cap_arena_ ? cap_arena_->bytes() : 0);
  }
  const double budget =
      static_cast<double>(options_.gpu_memory_utilization) * total - double(total - free_now);
  r.kv_budget = budget > 0 ? static_cast<size_t>(budget) : 0;
  return r;
}

int64_t CudaDecoderModel::max_cache_blocks() const {
  return blocks_for_budget(plan_.layers, memory().kv_budget);
}

std::unique_ptr<PagedKvCache> CudaDecoderModel::create_cache(int32_t num_blocks) const {
  const int64_t most = max_cache_blocks();
  if (num_blocks < 0 || num_blocks > most) {
    const CudaMemoryReport m = memory();
    throw InputError("a KV cache of " + std::to_string(num_blocks) +
                     " blocks does not fit on the device: at most " + std::to_string(most) +
                     " blocks fit in the " + std::to_string(m.kv_budget >> 20) +
                     " MiB left under --gpu-memory-utilization " +
                     std::to_string(options_.gpu_memory_utilization).substr(0, 4) +
                     " (raise --gpu-memory-utilization or ask for fewer blocks)");
  }
  auto storage = std::make_shared<DeviceKvCache>(plan_.layers, num_blocks);
  std::vector<LayerCacheView> views;
  for (size_t i = 0; i < plan_.layers.size(); ++i) views.push_back(storage->layer_view(i));
  return std::make_unique<PagedKvCache>(PagedKvCache::with_external_storage(
      plan_.layers, num_blocks, std::move(views), std::move(storage)));
}

void CudaDecoderModel::copy_blocks(PagedKvCache& cache,
                                   std::span<const std::pair<int32_t, int32_t>> src_dst) const {
  KVQ_CHECK(cache.external_storage() && cache.num_layers() == plan_.layers.size(),
            "copy_blocks: the cache was not made by this model's create_cache()");
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t l = 0; l < cache.num_layers(); ++l) {
    const LayerCacheView v = cache.layer_view(l);
    for (const auto& [src, dst] : src_dst) {
      KVQ_CHECK(src >= 0 && src < v.num_blocks && dst >= 0 && dst < v.num_blocks,
                "copy_blocks: block pair (" + std::to_string(src) + ", " + std::to_string(dst) +
                    ") outside the cache's " + std::to_string(v.num_blocks) + " blocks");
      for (KvSide s : {KvSide::kK, KvSide::kV})
        KVQ_CUDA_CHECK(cudaMemcpyAsync(v.block(s, dst), v.block(s, src), v.layout(s).block_bytes,
                                       cudaMemcpyDeviceToDevice, stream_));
    }
  }
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

CudaDecoderModel::Deferred CudaDecoderModel::linear(const cuda_model::Linear& L, int m,
                                                    const void* in, int lda, float* out, int ldc,
                                                    float beta, LinearOpts opts) const {
  using Dtype = cuda_model::Linear::Dtype;
  if (m == 0 || L.n == 0 || lab_no_gemm_) return {};
  if (L.dtype == Dtype::kFP8) {
    KVQ_CHECK(act8_ != nullptr && tuner_ != nullptr && bf16_,
              "an FP8 projection in a model without FP8 buffers");
    // W8A16 (no input quantization, the scales applied by the kernel) where it applies.
    if (!opts.quantized && w8a16(L, m) &&
        tuner_->run(cuda_model::GemmInput::kW8A16, m, L.n, L.k, in, nullptr, lda,
                    cuda_model::GemmWeight{L.w, L.scale}, out, ldc, beta))
      return {};
    if (!opts.quantized)
      cuda_model::quantize_rows_fp8(in, true, m, L.k, lda, fp8_mode(L), L.in_scale, act8_,
                                    act_scale_, stream_);
    bool unscaled = false;
    if (!tuner_->run(cuda_model::GemmInput::kFP8, m, L.n, L.k, act8_, act_scale_, L.k,
                     cuda_model::GemmWeight{L.w, L.scale}, out, ldc, beta, fp8_raw_,
                     fp8_raw_floats_,
                     opts.defer_scales && (beta == 0.0f || beta == 1.0f) ? &unscaled : nullptr))
      throw InternalError("cuBLASLt offers no FP8 GEMM for m " + std::to_string(m) + ", n " +
                          std::to_string(L.n) + ", k " + std::to_string(L.k) +
                          " on this GPU (run with --dtype bfloat16)");
    if (!unscaled) return {};
    return Deferred{act_scale_, L.scale, beta != 0.0f ? fp8_raw_ : nullptr};
  }
  KVQ_CHECK(!opts.quantized, "linear: a pre-quantized input for a projection that is not FP8");
  const bool bf16 = L.dtype == Dtype::kBF16;
  if (bf16 && tuner_ && tuner_->run(m, L.n, L.k, in, lda, L.w, out, ldc, beta)) return {};
  const float alpha = 1.0f;
  const cudaDataType t = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  // Row-major out[m][n] = in[m][k] * w[n][k]^T is column-major out^T = w^T-op * in^T.
  // fp32 weights: pedantic fp32 compute (no TF32), so the result matches the CPU path.
  KVQ_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, L.n, m, L.k, &alpha, L.w, t, L.k,
                                in, t, lda, &beta, out, CUDA_R_32F, ldc,
                                bf16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_PEDANTIC,
                                CUBLAS_GEMM_DEFAULT));
  return {};
}

CudaDecoderModel::Step CudaDecoderModel::stage(const ForwardBatch& b, PagedKvCache& cache,
                                               std::span<const DeviceSampling> per_row) const {
  const int T = static_cast<int>(b.tokens.size());
  const int R = static_cast<int>(b.logit_rows.size());
  const int S = b.block_table.num_seqs;
  KVQ_CHECK(b.positions.size() == b.tokens.size() && b.slots.size() == b.tokens.size(),
            "forward: tokens, positions and slots differ in length");
  KVQ_CHECK(b.q_indptr.size() == static_cast<size_t>(S) + 1 && b.q_indptr.front() == 0 &&
                b.q_indptr.back() == T,
            "forward: q_indptr does not cover the batch's tokens");
  KVQ_CHECK(cache.num_layers() == static_cast<size_t>(num_layers_) && cache.external_storage(),
            "forward: the cache was not made by this model's create_cache()");
  KVQ_CHECK(R <= T, "forward: more logit rows than tokens");
  for (int32_t l : b.capture_layers)
    KVQ_CHECK(l >= 0 && l < num_layers_,
              "forward: capture layer " + std::to_string(l) + " outside the model's layers");
  KVQ_CHECK(b.captured.size() ==
                    b.capture_layers.size() * static_cast<size_t>(T) * static_cast<size_t>(H_) ||
                (b.capture_on_device && b.captured.empty()),
            "forward: captured span does not hold tokens x capture_layers x hidden floats");
  KVQ_CHECK(b.block_table.block_tokens == plan_.layers.front().block_tokens,
            "forward: block table block_tokens differs from the plan's");
  if (T > T_cap_)
    throw InputError("a step of " + std::to_string(T) + " tokens exceeds max_num_batched_tokens " +
                     std::to_string(options_.max_num_batched_tokens));
  if (S > S_cap_)
    throw InputError("a step of " + std::to_string(S) + " sequences exceeds max_num_seqs " +
                     std::to_string(options_.max_num_seqs));
  for (int32_t r : b.logit_rows)
    KVQ_CHECK(r >= 0 && r < T, "forward: logit row " + std::to_string(r) + " out of range");
  KVQ_CHECK(b.token_rows.size() == b.token_dst.size() && b.token_dst.size() <= b.tokens.size(),
            "forward: token_rows and token_dst differ in length or exceed the tokens");
  if (b.token_source != nullptr) {
    KVQ_CHECK(accepts_tokens_from(*b.token_source),
              "forward: the token source is not a CUDA model on this device");
    const auto& src = static_cast<const CudaDecoderModel&>(*b.token_source);
    KVQ_CHECK(src.deferred_n_ > 0, "forward: the token source has no deferred ids");
    for (size_t i = 0; i < b.token_rows.size(); ++i)
      KVQ_CHECK(b.token_rows[i] >= 0 && b.token_rows[i] < src.deferred_n_ && b.token_dst[i] >= 0 &&
                    b.token_dst[i] < T,
                "forward: token row " + std::to_string(b.token_rows[i]) + " -> " +
                    std::to_string(b.token_dst[i]) + " outside the source's " +
                    std::to_string(src.deferred_n_) + " ids or the batch's " + std::to_string(T) +
                    " tokens");
  } else {
    KVQ_CHECK(b.token_rows.empty(), "forward: token rows without a token source");
  }
  for (int32_t t : b.tokens)
    if ((t < 0 || t >= vocab_) && !(t == kMaskToken && arch_.dflash))
      throw InputError("token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                       std::to_string(vocab_ - 1) + ")");
  const int64_t num_slots =
      static_cast<int64_t>(cache.layer_view(0).num_blocks) * b.block_table.block_tokens;
  for (int i = 0; i < T; ++i) {
    KVQ_CHECK(b.positions[static_cast<size_t>(i)] >= 0, "forward: negative position");
    KVQ_CHECK(b.slots[static_cast<size_t>(i)] >= 0 && b.slots[static_cast<size_t>(i)] < num_slots,
              "forward: slot " + std::to_string(b.slots[static_cast<size_t>(i)]) +
                  " outside the cache's " + std::to_string(num_slots) + " slots");
  }
  const size_t num_indices = S > 0 ? static_cast<size_t>(b.block_table.indptr[S]) : 0;
  if (num_indices > idx_cap_)
    throw InputError("the step's block tables hold " + std::to_string(num_indices) +
                     " blocks, more than the " + std::to_string(idx_cap_) +
                     " sized at load (max_num_seqs x max_position_embeddings)");

  Step st;
  st.R = R;
  st.num_indices = num_indices;
  st.capture_set = b.capture_layers.empty() ? 0 : capture_set(b.capture_layers);
  bool decode = S > 0 && S == T;
  int max_len = 1;
  for (int i = 0; i < S; ++i) {
    const int q_len = b.q_indptr[static_cast<size_t>(i) + 1] - b.q_indptr[static_cast<size_t>(i)];
    const int kv_len = b.block_table.seq_lens[i];
    KVQ_CHECK(q_len >= 0 && q_len <= kv_len, "forward: sequence " + std::to_string(i) + " has " +
                                                 std::to_string(q_len) + " new tokens but " +
                                                 std::to_string(kv_len) + " cached");
    decode = decode && q_len == 1;
    max_len = std::max(max_len, kv_len);
  }
  if (max_len > max_seq_len_)
    throw InputError("a sequence of " + std::to_string(max_len) +
                     " tokens is longer than the model's context of " +
                     std::to_string(max_seq_len_) +
                     " tokens (max_position_embeddings), which the CUDA model was sized for");
  st.decode = decode;
  int max_q = 0;
  for (int i = 0; i < S; ++i)
    max_q = std::max(max_q,
                     b.q_indptr[static_cast<size_t>(i) + 1] - b.q_indptr[static_cast<size_t>(i)]);
  if (decode) {
    st.S = st.T = *std::lower_bound(batch_buckets_.begin(), batch_buckets_.end(), S);
    st.context = std::max(kMinContextBucket, context_bucket(max_len));
  } else {
    st.S = S;
    st.T = T;
#if KVQ_MODEL_CUDA_PREFILL
    // Small-q steps (speculative verification) are padded to a batch bucket of Q rows per
    // sequence; the padding sequences have no queries and no cache, the padding rows no slot.
    if (options_.cuda_graphs && S > 0 && max_q >= 2 && max_q <= kMaxVerifyQueries &&
        !any_generic_) {
      const int sb = *std::lower_bound(batch_buckets_.begin(), batch_buckets_.end(), S);
      const int qb = verify_q_bucket(max_q, verify_coarse_q_);
      st.Q = qb;
      st.T = sb * qb;
      if (static_cast<int64_t>(sb) * qb <= std::min(T_cap_, R_cap_)) {
        st.verify = true;
        st.S = sb;
      } else {
        st.T = T;
        st.Q = 0;
      }
    }
#endif
  }

  // Fill the staging buffer; padding rows are inert (slot -1, seq_len 0, no blocks). A graph
  // captures the layout's addresses: its key fixes st.T, hence the layout.
  off_ = st.T <= small_rows_ ? off_small_ : off_big_;
  int32_t* tok = h_at<int32_t>(off_.tokens);
  int32_t* pos = h_at<int32_t>(off_.positions);
  int64_t* slot = h_at<int64_t>(off_.slots);
  std::copy(b.tokens.begin(), b.tokens.end(), tok);
  std::copy(b.positions.begin(), b.positions.end(), pos);
  std::copy(b.slots.begin(), b.slots.end(), slot);
  for (int i = T; i < st.T; ++i) tok[i] = 0, pos[i] = 0, slot[i] = -1;
  int32_t* qi = h_at<int32_t>(off_.q_indptr);
  int32_t* bi = h_at<int32_t>(off_.bt_indptr);
  int32_t* sl = h_at<int32_t>(off_.seq_lens);
  for (int i = 0; i <= S; ++i)
    qi[i] = b.q_indptr[static_cast<size_t>(i)], bi[i] = b.block_table.indptr[i];
  for (int i = 0; i < S; ++i) sl[i] = b.block_table.seq_lens[i];
  for (int i = S; i < st.S; ++i)
    qi[i + 1] = st.verify ? qi[S] : i + 1, bi[i + 1] = bi[S], sl[i] = 0;
  int32_t* rows = h_at<int32_t>(off_.logit_rows);
  std::copy(b.logit_rows.begin(), b.logit_rows.end(), rows);
  for (int i = R; i < (decode || st.verify ? st.T : R); ++i) rows[i] = 0;
  if (!per_row.empty()) {
    auto* params = h_at<DeviceSampling>(off_.params);
    for (int i = 0; i < R; ++i)
      params[i] = per_row[per_row.size() == 1 ? 0 : static_cast<size_t>(i)];
  }
  if (!decode) {
    // Without the prefill kernels each query row is its own decode "sequence": its block
    // table starts where its sequence's does and holds the tokens it may see.
    int32_t* ei = h_at<int32_t>(off_.exp_indptr);
    int32_t* el = h_at<int32_t>(off_.exp_seq_lens);
    int fb_max = 1;
    for (int i = 0; i < S; ++i) {
      const int q0 = b.q_indptr[static_cast<size_t>(i)],
                q1 = b.q_indptr[static_cast<size_t>(i) + 1];
      const int kv_len = b.block_table.seq_lens[i];
      for (int j = q0; j < q1; ++j) {
        ei[j] = b.block_table.indptr[i];
        el[j] = kv_len - (q1 - q0) + (j - q0) + 1;
        fb_max = std::max(fb_max, el[j]);
      }
    }
    st.fallback_context = std::max(kMinContextBucket, context_bucket(fb_max));
#if KVQ_MODEL_CUDA_PREFILL
    // A verify step's plan is the bucket's (st.S sequences of up to Q queries), so one graph
    // serves every step of that shape.
    std::vector<int32_t> bucket_qi, bucket_sl;
    if (st.verify) {
      for (int i = 0; i <= st.S; ++i) bucket_qi.push_back(i * st.Q);
      bucket_sl.assign(static_cast<size_t>(st.S), st.Q);
    }
    // Split-KV where the grid is small (few sequences, few queries): planned for this step's
    // lengths, or for a verify graph, for the longest sequence the model takes.
    cuda::PrefillOptions po;
    po.num_sms = num_sms_;
    po.small_q = prefill_small_q_;
    po.staging_capacity = prefill_stage_bytes_;
    if (st.verify) {
      // The plan of the step's context bucket (a graph per bucket: fewer or no kv splits, and no
      // merge, at short context), or of the longest sequence the model takes (one graph).
      st.verify_decode = verify_on_decode_kernel(st.S, st.Q, context_bucket(max_len));
      st.context = verify_context_buckets_ || st.verify_decode
                       ? std::max(kMinContextBucket, context_bucket(max_len))
                       : 0;
      po.max_kv_len = verify_context_buckets_ ? st.context : max_seq_len_;
    }
    for (const LayerKvSpec& s : group_spec_) {
      if (st.verify_decode) break;  // attention() plans the decode kernel
      if (cuda::uses_generic_attention(s)) {
        st.prefill_plans.emplace_back();  // the generic kernel needs only the batch shape
        continue;
      }
      st.prefill_plans.push_back(
          st.verify
              ? cuda::plan_prefill(s, bucket_qi, bucket_sl, po)
              : cuda::plan_prefill(
                    s, std::span<const int32_t>(b.q_indptr.data(), static_cast<size_t>(S) + 1),
                    std::span<const int32_t>(b.block_table.seq_lens, static_cast<size_t>(S)), po));
      KVQ_CHECK(st.prefill_plans.back().workspace_bytes <= attn_ws_bytes_,
                "forward: the prefill workspace exceeds what was sized at load");
    }
#endif
  }
  std::copy(b.block_table.indices, b.block_table.indices + num_indices,
            h_at<int32_t>(off_.indices));
  const size_t n_gather = b.token_dst.size();
  if (n_gather > 0) {
    std::copy(b.token_rows.begin(), b.token_rows.end(), h_at<int32_t>(off_.gather));
    std::copy(b.token_dst.begin(), b.token_dst.end(), h_at<int32_t>(off_.gather) + n_gather);
  }
  KVQ_CUDA_CHECK(cudaMemcpyAsync(d_step_ + off_.tokens, h_stage_ + off_.tokens,
                                 off_.indices + num_indices * 4 - off_.tokens,
                                 cudaMemcpyHostToDevice, stream_));
  if (n_gather > 0)
    KVQ_CUDA_CHECK(cudaMemcpyAsync(d_step_ + off_.gather, h_stage_ + off_.gather, n_gather * 8,
                                   cudaMemcpyHostToDevice, stream_));
  stage_features(b, cache, st);
  if (b.token_source != nullptr) {
    // The source's deferred ids are complete on its stream at ids_ready_; nothing of this pass
    // runs before them (the source may still be reading buffers this pass writes, e.g. a
    // DFlash drafter reading this model's captured features).
    const auto& src = static_cast<const CudaDecoderModel&>(*b.token_source);
    KVQ_CUDA_CHECK(cudaStreamWaitEvent(stream_, src.ids_ready_, 0));
    const auto* gather = d_at<int32_t>(off_.gather);
    cuda_model::scatter_tokens(src.deferred_ids_, gather, gather + n_gather,
                               static_cast<int>(n_gather), d_at<int32_t>(off_.tokens), stream_);
  }
  return st;
}

void CudaDecoderModel::stage_features(const ForwardBatch& b, PagedKvCache& cache, Step& st) const {
  const size_t C = b.feature_rows.size();
  if (b.feature_source == nullptr && C == 0) return;
  KVQ_CHECK(b.feature_source != nullptr && reads_features_of(*b.feature_source),
            "forward: feature rows need a DFlash drafter on its target's GPU (reads_features_of)");
  KVQ_CHECK(b.feature_positions.size() == C && b.feature_slots.size() == C,
            "forward: feature rows, positions and slots differ in length");
  if (C == 0) return;
  KVQ_CHECK(C <= static_cast<size_t>(T_cap_), "forward: " + std::to_string(C) +
                                                  " feature rows exceed the step's " +
                                                  std::to_string(T_cap_) + " rows");
  const auto& src = static_cast<const CudaDecoderModel&>(*b.feature_source);
  st.feature_src = src.device_captured();
  KVQ_CHECK(st.feature_src != nullptr,
            "forward: the feature source's last pass captured no features");
  (void)check_feature_write(b.feature_positions, b.feature_slots, cache);
  for (int32_t r : b.feature_rows)
    KVQ_CHECK(r >= 0 && r < src.T_cap_, "forward: feature row " + std::to_string(r) +
                                            " outside the source's " + std::to_string(src.T_cap_) +
                                            " captured rows");
  // A graph step pads the rows to a bucket (inert: slot -1) so few graphs serve every count.
  const int n = static_cast<int>(C);
  st.C = st.decode || st.verify ? std::min(T_cap_, std::max(4, pow2_at_least(n))) : n;
  auto* slots = h_at<int64_t>(off_.features);
  auto* positions = reinterpret_cast<int32_t*>(slots + st.C);
  int32_t* rows = positions + st.C;
  std::copy(b.feature_slots.begin(), b.feature_slots.end(), slots);
  std::copy(b.feature_positions.begin(), b.feature_positions.end(), positions);
  std::copy(b.feature_rows.begin(), b.feature_rows.end(), rows);
  for (int i = n; i < st.C; ++i) slots[i] = -1, positions[i] = 0, rows[i] = 0;
  KVQ_CUDA_CHECK(cudaMemcpyAsync(d_step_ + off_.features, h_stage_ + off_.features,
                                 static_cast<size_t>(st.C) * 16, cudaMemcpyHostToDevice, stream_));
}

void CudaDecoderModel::attention(const Step& st, int l, const LayerCacheView& view) const {
  const LayerKvSpec& spec = plan_.layers[static_cast<size_t>(l)];
  const int g = layer_group_[static_cast<size_t>(l)];
  BlockTableView bt;
  bt.indices = d_at<int32_t>(off_.indices);
  bt.block_tokens = spec.block_tokens;
  if (cuda::uses_generic_attention(spec)) {
    // Decode and prefill alike: the staged q_indptr covers padded decode rows too.
    bt.indptr = d_at<int32_t>(off_.bt_indptr);
    bt.seq_lens = d_at<int32_t>(off_.seq_lens);
    bt.num_seqs = st.S;
    cuda::GenericPlan p;
    p.num_seqs = st.S;
    p.total_q = st.T;
    cuda::GenericArgs a;
    a.q = q_;
    a.out = att_;
    a.q_indptr = d_at<int32_t>(off_.q_indptr);
    a.block_table = bt;
    a.cache = view;
    a.softmax_scale = softmax_scale_;
    cuda::run_generic(spec, p, a, stream_);
    return;
  }
  if (st.decode || st.verify_decode) {
    bt.indptr = d_at<int32_t>(off_.bt_indptr);
    bt.seq_lens = d_at<int32_t>(off_.seq_lens);
    bt.num_seqs = st.S;
    const cuda::DecodePlan p = decode_plan(g, st.S, st.context, st.verify_decode ? st.Q : 1);
    KVQ_CHECK(p.workspace_bytes <= attn_ws_bytes_, "decode workspace exceeds the sized one");
    cuda::DecodeArgs a;
    a.q = q_;
    a.out = att_;
    if (st.verify_decode) a.q_indptr = d_at<int32_t>(off_.q_indptr);
    a.block_table = bt;
    a.cache = view;
    a.softmax_scale = softmax_scale_;
    a.workspace = attn_ws_;
    cuda::run_decode(spec, p, a, stream_);
    return;
  }
#if KVQ_MODEL_CUDA_PREFILL
  bt.indptr = d_at<int32_t>(off_.bt_indptr);
  bt.seq_lens = d_at<int32_t>(off_.seq_lens);
  bt.num_seqs = st.S;
  cuda::PrefillArgs a;
  a.q = q_;
  a.out = att_;
  a.q_indptr = d_at<int32_t>(off_.q_indptr);
  a.block_table = bt;
  a.cache = view;
  a.softmax_scale = softmax_scale_;
  a.workspace = attn_ws_;
  a.staging = prefill_stage_;
  cuda::run_prefill(spec, st.prefill_plans[static_cast<size_t>(g)], a, stream_);
#else
  // Chunks of query rows, each a decode batch (see stage()).
  for (int r0 = 0; r0 < st.T; r0 += S_cap_) {
    const int n = std::min(S_cap_, st.T - r0);
    bt.indptr = d_at<int32_t>(off_.exp_indptr) + r0;
    bt.seq_lens = d_at<int32_t>(off_.exp_seq_lens) + r0;
    bt.num_seqs = n;
    const cuda::DecodePlan p = decode_plan(g, n, st.fallback_context);
    KVQ_CHECK(p.workspace_bytes <= attn_ws_bytes_, "decode workspace exceeds the sized one");
    cuda::DecodeArgs a;
    a.q = q_ + static_cast<size_t>(r0) * q_dim_;
    a.out = att_ + static_cast<size_t>(r0) * q_dim_;
    a.block_table = bt;
    a.cache = view;
    a.softmax_scale = softmax_scale_;
    a.workspace = attn_ws_;
    cuda::run_decode(spec, p, a, stream_);
  }
#endif
}

void CudaDecoderModel::logits_rows(int first, int n) const {
  cuda_model::rms_norm_rows(x_, d_at<int32_t>(off_.logit_rows) + first, n, H_, w_->final_norm, eps_,
                            h_, bf16_, stream_);
  if (lm_part_ == nullptr) {
    linear(w_->lm_head, n, h_, H_, logits_, vocab_, 0.0f);
    return;
  }
  // Vocabulary-parallel LM head: this rank's columns of the logits, gathered from every rank
  // ([rank][row][column]) and laid out as [row][vocab].
  const int vs = w_->lm_head.n;
  linear(w_->lm_head, n, h_, H_, lm_part_, vs, 0.0f);
  cuda_model::all_gather(tp_, lm_part_, static_cast<size_t>(n) * vs, lm_gather_, stream_);
  cuda_model::interleave_shards(lm_gather_, tp_.size, n, vs, logits_, stream_);
}

int CudaDecoderModel::norm_in_gemv_warps(const cuda_model::Linear& L, int T,
                                         const float* norm_w) const {
  const bool w8 = w8a16(L, T);
  if (T > gemv_norm_ || !bf16_ || !tuner_ || tp_.active() ||
      (L.dtype != cuda_model::Linear::Dtype::kBF16 && !w8) || L.k != H_)
    return 0;
  const int warps = tuner_->gemv_warps(
      w8 ? cuda_model::GemmInput::kW8A16 : cuda_model::GemmInput::kBF16, T, L.n, L.k, L.k, L.n);
  return warps > 0 && cuda_model::gemv_norm_fits(T, L.k, {x_, H_, norm_w, eps_}) ? warps : 0;
}

void CudaDecoderModel::gemv_norm_product(const cuda_model::Linear& L, int T,
                                         const cuda_model::GemvNorm& norm, float* out, int ldc,
                                         int warps) const {
  if (L.dtype == cuda_model::Linear::Dtype::kFP8)
    cuda_model::gemv_w8a16_norm(T, L.n, L.k, norm, L.w, L.scale, out, ldc, 0.0f, stream_, warps);
  else
    cuda_model::gemv_bf16_norm(T, L.n, L.k, norm, L.w, out, ldc, 0.0f, stream_, warps);
}

void CudaDecoderModel::gemv_silu_mul_product(const cuda_model::Linear& gate_up, int T,
                                             const void* in, const cuda_model::GemvNorm* norm,
                                             void* out, int ldo, int warps) const {
  const int n = gate_up.n / 2;
  if (gate_up.dtype == cuda_model::Linear::Dtype::kFP8) {
    if (norm != nullptr)
      cuda_model::gemv_w8a16_silu_mul_norm(T, n, gate_up.k, *norm, gate_up.w, gate_up.scale, out,
                                           ldo, true, stream_, warps);
    else
      cuda_model::gemv_w8a16_silu_mul(T, n, gate_up.k, in, gate_up.k, gate_up.w, gate_up.scale, out,
                                      ldo, true, stream_, warps);
  } else if (norm != nullptr) {
    cuda_model::gemv_bf16_silu_mul_norm(T, n, gate_up.k, *norm, gate_up.w, out, ldo, true, stream_,
                                        warps);
  } else {
    cuda_model::gemv_bf16_silu_mul(T, n, gate_up.k, in, gate_up.k, gate_up.w, out, ldo, true,
                                   stream_, warps);
  }
}

void CudaDecoderModel::run_body(const Step& st, const std::vector<LayerCacheView>& views) const {
  // A DFlash drafter's context rows: C rows whose K/V every layer writes before the block
  // attends to them. Where the layers' q|k|v products are plain (no FP8 input, no tensor
  // parallelism) they ride in each layer's product ahead of the block rows (ctx rows in front
  // of h_, qkv_, q_, k_, v_, cs_: one GEMM and one q|k|v post per layer for both); otherwise
  // they are written first on their own (context_kv_rows).
  const int ctx = st.C > 0 && context_rows_ride_ ? st.C : 0;  // rows riding
  const int64_t* ctx_slots = nullptr;
  void* ctx_h = static_cast<std::byte*>(h_) - static_cast<size_t>(ctx) * H_ * (bf16_ ? 2 : 4);
  if (st.C > 0) {
    const int F =
        static_cast<int>(arch_.dflash->target_layer_ids.size()) * arch_.dflash->target_hidden_size;
    ctx_slots = d_at<int64_t>(off_.features);
    const auto* positions = reinterpret_cast<const int32_t*>(ctx_slots + st.C);
    const int32_t* rows = positions + st.C;
    cuda_model::gather_rows(st.feature_src, rows, st.C, F, feat_, stream_);
    if (ctx > 0) {
      // In front of h_ and cs_ (see allocate_buffers), ahead of the block rows.
      context_features(ctx, positions, ctx_h, cs_ - static_cast<size_t>(ctx) * d_);
    } else {
      context_kv_rows(st.C, views, ctx_slots, positions);
    }
  }
  const int T = st.T;
  // Timing experiments only (step_lab_): one-query and verification steps.
  const int lab = st.decode || st.verify ? step_lab_ : 0;
  lab_no_gemm_ = (lab & 64) != 0;
  const int32_t* tokens = d_at<int32_t>(off_.tokens);
  cuda_model::embed_gather(w_->embed, bf16_, w_->mask, tokens, T, H_, x_, stream_);
  cuda_model::rope_table(d_at<int32_t>(off_.positions), T, inv_freq_, d_ / 2, cs_, stream_);
  Deferred pending;     // the previous layer's down product, when its residual add was deferred
  bool forked = false;  // pf_.s has work to join
  // Tensor parallelism: an all-reduce whose RMSNorm ran in the same kernel (h_ is ready).
  bool normed = false;
  const bool tp = tp_.active();
  // The all-reduce of the residual after o / down, fused with the RMSNorm `norm` that reads it
  // next where the group can (all_reduce_rms_norm); true when that norm is done.
  auto all_reduce = [&](const float* norm, bool fusable) {
    const int64_t n = static_cast<int64_t>(T) * H_;
    if (fusable && norm != nullptr &&
        cuda_model::all_reduce_rms_norm(tp_, x_, T, H_, norm, eps_, h_, bf16_, stream_))
      return true;
    cuda_model::all_reduce_sum(tp_, x_, static_cast<size_t>(n), stream_);
    return false;
  };
  for (int l = 0; l < num_layers_; ++l) {
    const DeviceWeights::Layer& w = w_->layers[static_cast<size_t>(l)];
    const LayerKvSpec& spec = plan_.layers[static_cast<size_t>(l)];
    // An FP8 projection's input is quantized by the kernel that produces it and its product's
    // scales applied by the kernel that consumes it, where fuse_fp8() (the same bits).
    // The previous layer's down product joins the residual stream here when its add was
    // deferred (pending.add).
    // The input RMSNorm inside q|k|v's skinny GEMM where the tuner runs it there (bf16, a few
    // rows, no context rows riding, no deferred residual add): one launch less.
    const int qkv_norm_warps = !normed && ctx == 0 && !pending.add && !(lab & (1 | 64))
                                   ? norm_in_gemv_warps(w.qkv, T, w.input_norm)
                                   : 0;
    if (normed || (lab & 1) || qkv_norm_warps > 0) {
      // the previous layer's down all-reduce normalized x_ into h_ (or the GEMM normalizes)
    } else if (fuse_fp8(w.qkv, T)) {
      cuda_model::rms_norm_rows_fp8(x_, T, H_, w.input_norm, eps_, fp8_mode(w.qkv), w.qkv.in_scale,
                                    act8_, act_scale_, stream_, pending.residual());
    } else if (pending.add) {
      cuda_model::add_rms_norm_rows(x_, pending.residual(), T, H_, w.input_norm, eps_, h_, bf16_,
                                    stream_);
    } else {
      cuda_model::rms_norm_rows(x_, nullptr, T, H_, w.input_norm, eps_, h_, bf16_, stream_);
    }
    pending = {};
    // With ctx rows: rows [-ctx, 0) of these buffers are the context rows (see above).
    Deferred dq;
    if (qkv_norm_warps > 0)
      gemv_norm_product(w.qkv, T, {x_, H_, w.input_norm, eps_}, qkv_, qkv_dim_, qkv_norm_warps);
    else
      dq = linear(w.qkv, ctx + T, ctx_h, H_, qkv_ - ctx * qkv_dim_, qkv_dim_, 0.0f,
                  {fuse_fp8(w.qkv, T), fuse_fp8(w.qkv, T)});
    if (pf_.s != nullptr && T == 1 && ctx == 0 &&
        w.o.weight_bytes() >= options_.l2_prefetch_min_bytes) {
      // While q|k|v post, the cache write, Q prep and attention run (latency-bound, on a few
      // SMs, the memory all but idle), o's weight comes into L2 on the side stream.
      KVQ_CUDA_CHECK(cudaEventRecord(pf_.fork, stream_));
      KVQ_CUDA_CHECK(cudaStreamWaitEvent(pf_.s, pf_.fork));
      cuda_model::l2_prefetch(w.o.w, w.o.weight_bytes(), kL2PrefetchWarps, pf_.s);
      forked = true;
    }
    if (!(lab & 2))
      cuda_model::qkv_post(qkv_ - ctx * qkv_dim_, w.qkv_bias, w.q_norm, w.k_norm, cs_ - ctx * d_,
                           ctx + T, nq_, nkv_, d_, eps_, q_ - ctx * q_dim_, k_ - ctx * kv_dim_,
                           v_ - ctx * kv_dim_, stream_, dq.row_scale, dq.col_scale);
    if (ctx > 0)
      write_kv_cuda(spec, views[static_cast<size_t>(l)], ctx_slots, ctx, k_ - ctx * kv_dim_,
                    v_ - ctx * kv_dim_, stream_);
    if (!(lab & 4))
      write_kv_cuda(spec, views[static_cast<size_t>(l)], d_at<int64_t>(off_.slots), T, k_, v_,
                    stream_);
    if (!(lab & 8)) attention(st, l, views[static_cast<size_t>(l)]);
    const void* att_in = att_;
    if (fuse_fp8(w.o, T)) {
      cuda_model::quantize_rows_fp8_rounded(att_, T, q_dim_, q_dim_, fp8_mode(w.o), w.o.in_scale,
                                            act8_, act_scale_, stream_);
    } else if (bf16_) {
      if (!(lab & 16)) cuda_model::to_bf16(att_, static_cast<int64_t>(T) * q_dim_, h_, stream_);
      att_in = h_;
    }
    // o's scaled product is added to the residual by the post-attention RMSNorm (no bias).
    // Tensor parallelism: rank 0 adds its partial product to the residual, the others write
    // theirs over it, and the all-reduce sums them: every rank holds the new residual.
    const float residual_beta = tp && tp_.rank != 0 ? 0.0f : 1.0f;
    const Deferred dox = linear(w.o, T, att_in, q_dim_, x_, H_, residual_beta,
                                {fuse_fp8(w.o, T), fuse_fp8(w.o, T) && !w.o_bias && !tp});
    normed = tp && all_reduce(w.post_norm, !w.o_bias && !fuse_fp8(w.gate_up, T));
    if (w.o_bias) cuda_model::add_bias_rows(x_, w.o_bias, T, H_, stream_);
    // Where the tuner runs gate|up on kvq's skinny kernel (bf16 weights, no bias), its
    // SiLU-mul rides in that kernel's epilogue (the same bits), writing bf16 rows into mlp_
    // for down; otherwise SiLU-mul is its own wide kernel (one block per row of 14336 would be
    // latency-bound at a few rows). down's input is quantized by linear() from bf16 rows.
    // FP8 gate|up weights the same where they run as W8A16.
    const bool gate_up_w8 = w8a16(w.gate_up, T);
    const int silu_warps =
        gemv_silu_ && tuner_ &&
                (w.gate_up.dtype == cuda_model::Linear::Dtype::kBF16 || gate_up_w8) &&
                !w.gate_up_bias && !(lab & 64) &&
                (gate_up_w8 ? cuda_model::gemv_w8a16_silu_mul_fits(T, I_, H_, h_, H_, w.gate_up.w,
                                                                   mlp_, I_, true)
                            : cuda_model::gemv_bf16_silu_mul_fits(T, I_, H_, h_, H_, w.gate_up.w,
                                                                  mlp_, I_, true))
            ? tuner_->gemv_warps(
                  gate_up_w8 ? cuda_model::GemmInput::kW8A16 : cuda_model::GemmInput::kBF16, T,
                  2 * I_, H_, H_, 2 * I_)
            : 0;
    // The post-attention RMSNorm inside that kernel, where it fits (as for q|k|v above).
    const bool post_norm_in_gemv = silu_warps > 0 && T <= gemv_norm_ && !tp && !normed &&
                                   !dox.add && !(lab & 32) && !fuse_fp8(w.gate_up, T) &&
                                   cuda_model::gemv_norm_fits(T, H_, {x_, H_, w.post_norm, eps_});
    if (normed || (lab & 32) || post_norm_in_gemv) {
      // h_ is the post-attention RMSNorm of the all-reduced residual (or the GEMM normalizes)
    } else if (fuse_fp8(w.gate_up, T)) {
      cuda_model::rms_norm_rows_fp8(x_, T, H_, w.post_norm, eps_, fp8_mode(w.gate_up),
                                    w.gate_up.in_scale, act8_, act_scale_, stream_, dox.residual());
    } else if (dox.add) {
      cuda_model::add_rms_norm_rows(x_, dox.residual(), T, H_, w.post_norm, eps_, h_, bf16_,
                                    stream_);
    } else {
      cuda_model::rms_norm_rows(x_, nullptr, T, H_, w.post_norm, eps_, h_, bf16_, stream_);
    }
    const void* down_in = h_;
    if (post_norm_in_gemv) {
      const cuda_model::GemvNorm nm{x_, H_, w.post_norm, eps_};
      gemv_silu_mul_product(w.gate_up, T, nullptr, &nm, mlp_, I_, silu_warps);
      down_in = mlp_;
    } else if (silu_warps > 0) {
      gemv_silu_mul_product(w.gate_up, T, h_, nullptr, mlp_, I_, silu_warps);
      down_in = mlp_;
    } else {
      const Deferred dg = linear(w.gate_up, T, h_, H_, mlp_, 2 * I_, 0.0f,
                                 {fuse_fp8(w.gate_up, T), fuse_fp8(w.gate_up, T)});
      cuda_model::silu_mul(mlp_, w.gate_up_bias, T, I_, h_, bf16_, stream_, dg.row_scale,
                           dg.col_scale);
    }
    // down's scaled product is added by the next layer's input RMSNorm, unless this layer's
    // output is read here (the last layer: the final norm; a captured layer) or has a bias.
    bool captured = false;
    if (st.capture_set > 0)
      for (int32_t c : capture_sets_[static_cast<size_t>(st.capture_set) - 1])
        captured = captured || c == l;
    const bool fold_down =
        fuse_fp8(w.down, T) && !w.down_bias && l + 1 < num_layers_ && !captured && !tp;
    pending = linear(w.down, T, down_in, I_, x_, H_, residual_beta, {false, fold_down});
    // The next layer's input RMSNorm may run inside the all-reduce (not the last layer's: the
    // final norm reads only the logit rows).
    const DeviceWeights::Layer* next =
        l + 1 < num_layers_ ? &w_->layers[static_cast<size_t>(l) + 1] : nullptr;
    normed = tp && all_reduce(next ? next->input_norm : nullptr,
                              next && !w.down_bias && !fuse_fp8(next->qkv, T));
    if (w.down_bias) cuda_model::add_bias_rows(x_, w.down_bias, T, H_, stream_);
    if (st.capture_set > 0) {
      // This layer's output rows into their column of the [T][layers][H] capture buffer.
      const std::vector<int32_t>& cap = capture_sets_[static_cast<size_t>(st.capture_set) - 1];
      for (size_t c = 0; c < cap.size(); ++c)
        if (cap[c] == l)
          KVQ_CUDA_CHECK(cudaMemcpy2DAsync(
              cap_ + c * H_, cap.size() * H_ * sizeof(float), x_, H_ * sizeof(float),
              H_ * sizeof(float), static_cast<size_t>(T), cudaMemcpyDeviceToDevice, stream_));
    }
  }
  if (forked) {
    KVQ_CUDA_CHECK(cudaEventRecord(pf_.join, pf_.s));
    KVQ_CUDA_CHECK(cudaStreamWaitEvent(stream_, pf_.join));
  }
  KVQ_CHECK(pending.add == nullptr, "run_body: the last layer's residual add was deferred");
  lab_no_gemm_ = false;
  // A decode step computes its (padded) logit rows inside the body, so a graph holds them.
  if (st.decode || st.verify) logits_rows(0, st.T);
}

int CudaDecoderModel::capture_set(std::span<const int32_t> layers) const {
  const std::vector<int32_t> want(layers.begin(), layers.end());
  size_t i = 0;
  while (i < capture_sets_.size() && capture_sets_[i] != want) ++i;
  if (i == capture_sets_.size()) capture_sets_.push_back(want);
  if (want.size() > cap_layers_) {
    // The graphs hold the old buffer's address: drop them (their keys stay warm).
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (auto& [key, exec] : graphs_) KVQ_CUDA_CHECK(cudaGraphExecDestroy(exec));
    graphs_.clear();
    auto arena = std::make_unique<DeviceArena>();
    cap_ = static_cast<float*>(
        arena->alloc(static_cast<size_t>(T_cap_) * want.size() * static_cast<size_t>(H_) * 4));
    cap_arena_ = std::move(arena);
    cap_layers_ = want.size();
  }
  return static_cast<int>(i) + 1;
}

void CudaDecoderModel::copy_captured(const ForwardBatch& b) const {
  last_captured_ = b.capture_layers.empty() || b.tokens.empty() ? nullptr : cap_;
  if (b.capture_layers.empty() || b.tokens.empty() || b.capture_on_device) return;
  // Padded rows come after the real ones, so the first T rows are the batch's tokens.
  KVQ_CUDA_CHECK(cudaMemcpyAsync(b.captured.data(), cap_, b.captured.size() * sizeof(float),
                                 cudaMemcpyDeviceToHost, stream_));
}

std::vector<LayerCacheView> CudaDecoderModel::check_feature_write(
    std::span<const int32_t> positions, std::span<const int64_t> slots, PagedKvCache& cache) const {
  KVQ_CHECK(arch_.dflash.has_value(), "write_feature_kv: not a DFlash drafter");
  KVQ_CHECK(slots.size() == positions.size(),
            "write_feature_kv: positions and slots differ in length");
  KVQ_CHECK(cache.num_layers() == static_cast<size_t>(num_layers_) && cache.external_storage(),
            "write_feature_kv: the cache was not made by this model's create_cache()");
  const int64_t num_slots =
      static_cast<int64_t>(cache.layer_view(0).num_blocks) * plan_.layers.front().block_tokens;
  for (size_t i = 0; i < positions.size(); ++i) {
    KVQ_CHECK(positions[i] >= 0, "write_feature_kv: negative position");
    KVQ_CHECK(slots[i] >= 0 && slots[i] < num_slots,
              "write_feature_kv: slot " + std::to_string(slots[i]) + " outside the cache's " +
                  std::to_string(num_slots) + " slots");
  }
  std::vector<LayerCacheView> views;
  for (size_t l = 0; l < cache.num_layers(); ++l) views.push_back(cache.layer_view(l));
  return views;
}

void CudaDecoderModel::stage_feature_rows(int n, bool rows) const {
  // Slots at 0, positions at T_cap * 8, rows at T_cap * 12: only the first n of each.
  for (const auto [at, bytes] : {std::pair<size_t, size_t>{0, 8},
                                 {size_t(T_cap_) * 8, 4},
                                 {size_t(T_cap_) * 12, rows ? 4 : 0}})
    if (bytes > 0)
      KVQ_CUDA_CHECK(cudaMemcpyAsync(d_feat_step_ + at, h_feat_step_ + at, size_t(n) * bytes,
                                     cudaMemcpyHostToDevice, stream_));
}

void CudaDecoderModel::context_features(int n, const int32_t* d_positions, void* h_rows,
                                        float* cs_rows) const {
  const int Fi =
      static_cast<int>(arch_.dflash->target_layer_ids.size()) * arch_.dflash->target_hidden_size;
  const void* in = feat_;
  if (bf16_) {
    cuda_model::to_bf16(feat_, static_cast<int64_t>(n) * Fi, feat_h_, stream_);
    in = feat_h_;
  }
  linear(w_->fc, n, in, Fi, x_, H_, 0.0f);
  cuda_model::rms_norm_rows(x_, nullptr, n, H_, w_->hidden_norm, eps_, h_rows, bf16_, stream_);
  cuda_model::rope_table(d_positions, n, inv_freq_, d_ / 2, cs_rows, stream_);
}

void CudaDecoderModel::context_kv_rows(int n, const std::vector<LayerCacheView>& views,
                                       const int64_t* d_slots, const int32_t* d_positions) const {
  // The context rows: hidden_norm(fc(features)), then each layer's k/v projections of them
  // (no input_layernorm), k_norm and RoPE, written in the layer's cache format.
  context_features(n, d_positions, h_, cs_);
  for (int l = 0; l < num_layers_; ++l) {
    const DeviceWeights::Layer& w = w_->layers[static_cast<size_t>(l)];
    // The whole q|k|v product (the q columns are not used): one GEMM shape shared with the
    // forward pass, at the cost of the q columns' flops.
    linear(w.qkv, n, h_, H_, qkv_, qkv_dim_, 0.0f);
    cuda_model::qkv_post(qkv_, w.qkv_bias, w.q_norm, w.k_norm, cs_, n, nq_, nkv_, d_, eps_, q_, k_,
                         v_, stream_);
    write_kv_cuda(plan_.layers[static_cast<size_t>(l)], views[static_cast<size_t>(l)], d_slots, n,
                  k_, v_, stream_);
  }
}

void CudaDecoderModel::write_feature_kv(std::span<const float> features,
                                        std::span<const int32_t> positions,
                                        std::span<const int64_t> slots, PagedKvCache& cache) const {
  KVQ_CHECK(arch_.dflash.has_value(), "write_feature_kv: not a DFlash drafter");
  const size_t F =
      arch_.dflash->target_layer_ids.size() * static_cast<size_t>(arch_.dflash->target_hidden_size);
  const size_t T = positions.size();
  KVQ_CHECK(features.size() == F * T, "write_feature_kv: features and positions differ in length");
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<LayerCacheView> views = check_feature_write(positions, slots, cache);
  for (size_t r0 = 0; r0 < T; r0 += static_cast<size_t>(T_cap_)) {
    const int n = static_cast<int>(std::min(static_cast<size_t>(T_cap_), T - r0));
    // Earlier copies from the pinned staging (a previous chunk or call) must be done before it
    // is refilled; after a forward() (which waits for its step) this costs nothing.
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::copy_n(slots.begin() + static_cast<ptrdiff_t>(r0), n,
                reinterpret_cast<int64_t*>(h_feat_step_));
    std::copy_n(positions.begin() + static_cast<ptrdiff_t>(r0), n,
                reinterpret_cast<int32_t*>(h_feat_step_ + size_t(T_cap_) * 8));
    stage_feature_rows(n, false);
    KVQ_CUDA_CHECK(cudaMemcpyAsync(feat_, features.data() + r0 * F,
                                   static_cast<size_t>(n) * F * sizeof(float),
                                   cudaMemcpyHostToDevice, stream_));
    context_kv_rows(n, views, reinterpret_cast<int64_t*>(d_feat_step_),
                    reinterpret_cast<int32_t*>(d_feat_step_ + size_t(T_cap_) * 8));
  }
  // No wait: the next step on this stream runs after these writes, and the features (pageable
  // host memory) were staged by the driver before cudaMemcpyAsync returned.
}

bool CudaDecoderModel::reads_features_of(const Model& target) const {
  return arch_.dflash.has_value() && dynamic_cast<const CudaDecoderModel*>(&target) != nullptr;
}

void CudaDecoderModel::write_feature_kv_from_target(const Model& target,
                                                    std::span<const int32_t> rows,
                                                    std::span<const int32_t> positions,
                                                    std::span<const int64_t> slots,
                                                    PagedKvCache& cache) const {
  KVQ_CHECK(reads_features_of(target),
            "write_feature_kv_from_target: the target is not a CUDA model on this device");
  KVQ_CHECK(rows.size() == positions.size(),
            "write_feature_kv_from_target: rows and positions differ in length");
  const size_t T = positions.size();
  if (T == 0) return;
  const float* src = target.device_captured();
  KVQ_CHECK(src != nullptr,
            "write_feature_kv_from_target: the target's last pass captured no features");
  const int F =
      static_cast<int>(arch_.dflash->target_layer_ids.size()) * arch_.dflash->target_hidden_size;
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<LayerCacheView> views = check_feature_write(positions, slots, cache);
  for (int32_t r : rows) KVQ_CHECK(r >= 0, "write_feature_kv_from_target: negative row");
  auto* d_rows = reinterpret_cast<int32_t*>(d_feat_step_ + size_t(T_cap_) * 12);
  for (size_t r0 = 0; r0 < T; r0 += static_cast<size_t>(T_cap_)) {
    const int n = static_cast<int>(std::min(static_cast<size_t>(T_cap_), T - r0));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the staging and feat_ are free again
    std::copy_n(slots.begin() + static_cast<ptrdiff_t>(r0), n,
                reinterpret_cast<int64_t*>(h_feat_step_));
    std::copy_n(positions.begin() + static_cast<ptrdiff_t>(r0), n,
                reinterpret_cast<int32_t*>(h_feat_step_ + size_t(T_cap_) * 8));
    std::copy_n(rows.begin() + static_cast<ptrdiff_t>(r0), n,
                reinterpret_cast<int32_t*>(h_feat_step_ + size_t(T_cap_) * 12));
    stage_feature_rows(n, true);
    cuda_model::gather_rows(src, d_rows, n, F, feat_, stream_);
    // The target's buffer is read before its next pass (on its own stream) may overwrite it.
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    context_kv_rows(n, views, reinterpret_cast<int64_t*>(d_feat_step_),
                    reinterpret_cast<int32_t*>(d_feat_step_ + size_t(T_cap_) * 8));
  }
}

void CudaDecoderModel::tune_gemms(int m) const {
  using Dtype = cuda_model::Linear::Dtype;
  if (!tuner_ || m > kMaxTunedRows || !tuned_rows_.insert(m).second) return;
  // Each projection kind over every layer, per precision (an FP8 checkpoint's ignore list can
  // leave some layers' projections in bf16).
  // gate|up on kvq's skinny kernel carries the SiLU-mul in its epilogue (run_body), one launch
  // less than cuBLASLt's product and the separate kernel: it is taken within this margin of
  // cuBLASLt (H200, 8B batch 1: 60.3 us against 56.7 us alone, but 4.98-5.02 ms per step
  // against 5.07-5.22; docs/notes/decode-tuning.md version 15).
  constexpr double kSiluFusedMargin = 1.10;
  auto tune = [&](auto member, float* out, double margin = 1.0) {
    std::vector<const void*> bf16;
    std::vector<cuda_model::GemmWeight> fp8;
    const cuda_model::Linear* shape = nullptr;
    for (const DeviceWeights::Layer& w : w_->layers) {
      const cuda_model::Linear& L = w.*member;
      shape = &L;
      if (L.dtype == Dtype::kBF16) bf16.push_back(L.w);
      if (L.dtype == Dtype::kFP8) fp8.push_back({L.w, L.scale});
    }
    if (shape == nullptr) return;
    // Nothing is live between steps: the scratch operands are the step's own buffers.
    if (!bf16.empty())
      tuner_->tune(m, shape->n, shape->k, h_, shape->k, bf16, out, shape->n, margin);
    if (!fp8.empty())
      tuner_->tune(cuda_model::GemmInput::kFP8, m, shape->n, shape->k, act8_, act_scale_, shape->k,
                   fp8, out, shape->n);
    if (!fp8.empty() && m <= w8a16_rows_ && bf16_)
      tuner_->tune(cuda_model::GemmInput::kW8A16, m, shape->n, shape->k, h_, nullptr, shape->k, fp8,
                   out, shape->n);
  };
  tune(&DeviceWeights::Layer::qkv, qkv_);
  tune(&DeviceWeights::Layer::o, x_);
  bool gate_up_bias = false;
  for (const DeviceWeights::Layer& w : w_->layers) gate_up_bias = gate_up_bias || w.gate_up_bias;
  tune(&DeviceWeights::Layer::gate_up, mlp_, gemv_silu_ && !gate_up_bias ? kSiluFusedMargin : 1.0);
  tune(&DeviceWeights::Layer::down, x_);
  const cuda_model::Linear& head = w_->lm_head;
  if (head.dtype == Dtype::kBF16) {
    const void* lm_head[1] = {head.w};
    tuner_->tune(m, head.n, H_, h_, H_, lm_head, lm_part_ ? lm_part_ : logits_, head.n);
  }
}

void CudaDecoderModel::tune_riding_qkv(int C, int T) const {
  const int m = C + T;
  if (!tuner_ || m > kMaxTunedRows || !tuned_riding_rows_.insert(m).second) return;
  std::vector<const void*> bf16;
  for (const DeviceWeights::Layer& w : w_->layers)
    if (w.qkv.dtype == cuda_model::Linear::Dtype::kBF16) bf16.push_back(w.qkv.w);
  if (bf16.empty()) return;
  const cuda_model::Linear& shape = w_->layers.front().qkv;
  const size_t act = bf16_ ? 2 : 4;
  tuner_->tune(m, shape.n, shape.k, static_cast<std::byte*>(h_) - static_cast<size_t>(C) * H_ * act,
               shape.k, bf16, qkv_ - static_cast<size_t>(C) * qkv_dim_, shape.n);
}

void CudaDecoderModel::run_step(const Step& st, PagedKvCache& cache) const {
  // Before any graph capture: the first decode step of each batch bucket picks its GEMMs.
  if (st.decode || st.verify) tune_gemms(st.T);
  if ((st.decode || st.verify) && st.C > 0) {
    if (context_rows_ride_)
      tune_riding_qkv(st.C, st.T);
    else
      tune_gemms(st.C);
  }
  std::vector<LayerCacheView> views;
  for (size_t l = 0; l < cache.num_layers(); ++l) views.push_back(cache.layer_view(l));
  const bool graph = (st.decode || st.verify) && options_.cuda_graphs;
  if (!graph) {
    run_body(st, views);
    return;
  }
  std::vector<const std::byte*> cache_id;
  for (const LayerCacheView& v : views) {
    cache_id.push_back(v.k_base);
    cache_id.push_back(v.v_base);
  }
  if (cache_id != graph_cache_) {  // graphs hold the cache's addresses
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (auto& [key, exec] : graphs_) KVQ_CUDA_CHECK(cudaGraphExecDestroy(exec));
    graphs_.clear();
    graph_cache_ = cache_id;
  }
  if (st.C > 0 && st.feature_src != graph_feature_src_) {  // graphs hold the source's address
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (auto it = graphs_.begin(); it != graphs_.end();) {
      if (std::get<3>(it->first) > 0) {
        KVQ_CUDA_CHECK(cudaGraphExecDestroy(it->second));
        it = graphs_.erase(it);
      } else {
        ++it;
      }
    }
    graph_feature_src_ = st.feature_src;
  }
  // Verify graphs are keyed by (batch bucket, -(Q + 64 x context bucket)); the bucket is 0 (one
  // graph for every length) unless KVQ_VERIFY_CONTEXT_BUCKETS=1. Their attention reads lengths
  // on the device.
  const GraphKey key{st.S, st.verify ? -(st.Q + 64 * st.context) : st.context, st.capture_set,
                     st.C};
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (seen_.insert(key).second) {  // first time: run eagerly (loads modules, warms cuBLAS)
      run_body(st, views);
      return;
    }
    size_t free_before = 0, free_after = 0, total = 0;
    KVQ_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
    cudaGraph_t g = nullptr;
    KVQ_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      run_body(st, views);
    } catch (...) {
      (void)cudaStreamEndCapture(stream_, &g);
      if (g) (void)cudaGraphDestroy(g);
      throw;
    }
    KVQ_CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, g, 0);
    (void)cudaGraphDestroy(g);
    KVQ_CUDA_CHECK(err);
    KVQ_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
    if (free_before > free_after) graph_bytes_ += free_before - free_after;
    it = graphs_.emplace(key, exec).first;
  }
  KVQ_CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
}

void CudaDecoderModel::forward(const ForwardBatch& b, PagedKvCache& cache,
                               std::span<float> logits) const {
  const size_t R = b.logit_rows.size(), V = static_cast<size_t>(vocab_);
  KVQ_CHECK(logits.size() == R * V, "forward: logits span has " + std::to_string(logits.size()) +
                                        " floats, expected " + std::to_string(R) + " x " +
                                        std::to_string(V));
  KVQ_CHECK(!b.tokens.empty() || b.feature_rows.empty(),
            "forward: feature rows need a pass with at least one token");
  std::lock_guard<std::mutex> lock(mu_);
  if (b.tokens.empty()) return;
  drop_deferred_locked();
  const auto t0 = std::chrono::steady_clock::now();
  const Step st = stage(b, cache, {});
  timing_begin();
  run_step(st, cache);
  for (int r0 = 0; r0 < st.R; r0 += R_cap_) {
    const int n = std::min(R_cap_, st.R - r0);
    if (!st.decode && !st.verify) logits_rows(r0, n);
    KVQ_CUDA_CHECK(cudaMemcpyAsync(logits.data() + static_cast<size_t>(r0) * V, logits_,
                                   static_cast<size_t>(n) * V * sizeof(float),
                                   cudaMemcpyDeviceToHost, stream_));
  }
  copy_captured(b);
  if (timing_.on) KVQ_CUDA_CHECK(cudaEventRecord(timing_.end, stream_));
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  timing_end(t0);
}

size_t CudaDecoderModel::check_sample_args(const ForwardBatch& b,
                                           std::span<const DeviceSampling> per_row) const {
  const size_t R = b.logit_rows.size();
  KVQ_CHECK(per_row.size() == R || per_row.size() == 1,
            "forward_sample: per_row needs one entry per logit row or exactly one");
#if !KVQ_MODEL_CUDA_SAMPLING
  for (const DeviceSampling& p : per_row)
    if (p.temperature != 0.0f)
      throw InputError(
          "device sampling with temperature > 0 is not built yet in this CUDA model; use "
          "temperature 0 (greedy)");
#endif
  KVQ_CHECK(!b.tokens.empty() || b.feature_rows.empty(),
            "forward: feature rows need a pass with at least one token");
  return R;
}

void CudaDecoderModel::run_and_sample(const ForwardBatch& b, PagedKvCache& cache,
                                      std::span<const DeviceSampling> per_row,
                                      int32_t* d_out) const {
  const Step st = stage(b, cache, per_row);
  timing_begin();
  run_step(st, cache);
  for (int r0 = 0; r0 < st.R; r0 += R_cap_) {
    const int n = std::min(R_cap_, st.R - r0);
    if (!st.decode && !st.verify) logits_rows(r0, n);
    sample_rows(r0, n, d_out + r0);
  }
}

void CudaDecoderModel::sample_rows(int first, int n, int32_t* d_out) const {
#if KVQ_MODEL_CUDA_SAMPLING
  cuda::sample_tokens(logits_, n, vocab_, d_at<DeviceSampling>(off_.params) + first, d_out,
                      sample_ws_, stream_);
#else
  (void)first;
  cuda_model::argmax_rows(logits_, n, vocab_, d_out, stream_);
#endif
}

void CudaDecoderModel::drop_deferred() const {
  std::lock_guard<std::mutex> lock(mu_);
  drop_deferred_locked();
}

void CudaDecoderModel::drop_deferred_locked() const {
  if (deferred_n_ == 0) return;
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  deferred_n_ = 0;
}

void CudaDecoderModel::defer_ids(const int32_t* d_ids, int32_t* h_ids, int n,
                                 std::chrono::steady_clock::time_point t0) const {
  KVQ_CUDA_CHECK(cudaEventRecord(ids_ready_, stream_));
  KVQ_CUDA_CHECK(cudaMemcpyAsync(h_ids, d_ids, static_cast<size_t>(n) * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream_));
  if (timing_.on) KVQ_CUDA_CHECK(cudaEventRecord(timing_.end, stream_));
  deferred_ids_ = d_ids;
  deferred_host_ = h_ids;
  deferred_n_ = n;
  deferred_t0_ = t0;
}

void CudaDecoderModel::forward_sample(const ForwardBatch& b, PagedKvCache& cache,
                                      std::span<const DeviceSampling> per_row,
                                      std::span<int32_t> next_tokens) const {
  const size_t R = check_sample_args(b, per_row);
  KVQ_CHECK(next_tokens.size() == R, "forward_sample: next_tokens has " +
                                         std::to_string(next_tokens.size()) + " entries, " +
                                         std::to_string(R) + " logit rows");
  std::lock_guard<std::mutex> lock(mu_);
  if (b.tokens.empty()) return;
  drop_deferred_locked();
  const auto t0 = std::chrono::steady_clock::now();
  run_and_sample(b, cache, per_row, d_ids_);
  KVQ_CUDA_CHECK(
      cudaMemcpyAsync(h_ids_, d_ids_, R * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  copy_captured(b);
  if (timing_.on) KVQ_CUDA_CHECK(cudaEventRecord(timing_.end, stream_));
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  timing_end(t0);
  std::copy(h_ids_, h_ids_ + R, next_tokens.begin());
}

void CudaDecoderModel::forward_sample_deferred(const ForwardBatch& b, PagedKvCache& cache,
                                               std::span<const DeviceSampling> per_row) const {
  const size_t R = check_sample_args(b, per_row);
  KVQ_CHECK(R > 0 && b.captured.empty(),
            "forward_sample_deferred: a pass with logit rows and no host captures");
  std::lock_guard<std::mutex> lock(mu_);
  drop_deferred_locked();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    run_and_sample(b, cache, per_row, d_ids_);
  } catch (...) {
    settle_after_throw();
    throw;
  }
  defer_ids(d_ids_, h_ids_, static_cast<int>(R), t0);
}

void CudaDecoderModel::collect_sampled(std::span<int32_t> out) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (deferred_n_ == 0) throw InternalError("collect_sampled: no deferred ids to collect");
  KVQ_CHECK(out.size() == static_cast<size_t>(deferred_n_),
            "collect_sampled: out has " + std::to_string(out.size()) + " entries, " +
                std::to_string(deferred_n_) + " ids were deferred");
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::copy(deferred_host_, deferred_host_ + deferred_n_, out.begin());
  deferred_n_ = 0;
  timing_end(deferred_t0_);
}

bool CudaDecoderModel::accepts_tokens_from(const Model& source) const {
  const auto* src = dynamic_cast<const CudaDecoderModel*>(&source);
  // One GPU: a tensor-parallel rank's stream and the source's are on different devices.
  // The same vocabulary: the ids skip the host's range check on their way.
  return src != nullptr && src != this && !tp_.active() && !src->tp_.active() &&
         src->vocab_ == vocab_;
}

void CudaDecoderModel::reserve_chain(int steps) const {
  if (steps <= chain_steps_) return;
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));  // nothing in flight reads the old buffers
  if (h_chain_step_) KVQ_CUDA_CHECK(cudaFreeHost(h_chain_step_));
  if (h_chain_ids_) KVQ_CUDA_CHECK(cudaFreeHost(h_chain_ids_));
  if (d_chain_ids_) KVQ_CUDA_CHECK(cudaFree(d_chain_ids_));
  if (d_chain_slots_) KVQ_CUDA_CHECK(cudaFree(d_chain_slots_));
  h_chain_step_ = nullptr, h_chain_ids_ = nullptr, d_chain_ids_ = nullptr, d_chain_slots_ = nullptr,
  chain_steps_ = 0;
  const size_t n = static_cast<size_t>(steps) * static_cast<size_t>(S_cap_);
  void* p = nullptr;
  KVQ_CUDA_CHECK(cudaHostAlloc(&p, align_up(off_.total) + n * 8, cudaHostAllocDefault));
  h_chain_step_ = static_cast<std::byte*>(p);
  KVQ_CUDA_CHECK(cudaHostAlloc(&p, n * 4, cudaHostAllocDefault));
  h_chain_ids_ = static_cast<int32_t*>(p);
  KVQ_CUDA_CHECK(cudaMalloc(&p, n * 4));
  d_chain_ids_ = static_cast<int32_t*>(p);
  KVQ_CUDA_CHECK(cudaMalloc(&p, n * 8));
  d_chain_slots_ = static_cast<int64_t*>(p);
  chain_steps_ = steps;
}

void CudaDecoderModel::forward_greedy_chain(const ForwardBatch& b, PagedKvCache& cache, int steps,
                                            std::span<const int64_t> next_slots,
                                            std::span<int32_t> out, bool defer) const {
  const BlockTableView& bt = b.block_table;
  const int S = bt.num_seqs;
  check_greedy_chain(b, steps, next_slots.size(), out.size(), defer);
  KVQ_CHECK(S <= S_cap_, "forward_greedy_chain: more sequences than max_num_seqs");
  const size_t n_out = static_cast<size_t>(steps) * static_cast<size_t>(S);
  KVQ_CHECK(b.captured.empty() && b.capture_layers.empty() && b.feature_rows.empty() &&
                b.token_source == nullptr,
            "forward_greedy_chain: a plain pass (no captures, features or token source)");
  const int64_t num_slots = static_cast<int64_t>(cache.layer_view(0).num_blocks) * bt.block_tokens;
  for (int64_t s : next_slots)
    KVQ_CHECK(s >= 0 && s < num_slots, "forward_greedy_chain: slot " + std::to_string(s) +
                                           " outside the cache's " + std::to_string(num_slots) +
                                           " slots");
  int max_last = 0;  // the longest sequence after the last pass
  for (int i = 0; i < S; ++i) max_last = std::max(max_last, bt.seq_lens[i] + steps - 1);
  if (max_last > max_seq_len_)
    throw InputError("a sequence of " + std::to_string(max_last) +
                     " tokens is longer than the model's context of " +
                     std::to_string(max_seq_len_) + " tokens (max_position_embeddings)");

  std::lock_guard<std::mutex> lock(mu_);
  drop_deferred_locked();
  reserve_chain(steps);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    const DeviceSampling greedy[1] = {DeviceSampling{}};
    run_and_sample(b, cache, greedy, d_chain_ids_);
    if (steps > 1) {
      // Pass 1 is staged on the host (into the chain's own staging: the first pass's copy may
      // not have run yet), with placeholder tokens that pass 0's ids replace on the device;
      // passes 2.. advance its staging on the device. All of them replay one decode graph, sized
      // for the last pass's lengths.
      std::vector<int32_t> tokens(static_cast<size_t>(S), 0), positions(static_cast<size_t>(S)),
          q_indptr(static_cast<size_t>(S) + 1), seq_lens(bt.seq_lens, bt.seq_lens + S);
      std::iota(q_indptr.begin(), q_indptr.end(), 0);
      for (int i = 0; i < S; ++i) {
        positions[static_cast<size_t>(i)] =
            b.positions[static_cast<size_t>(b.q_indptr[static_cast<size_t>(i) + 1] - 1)] + 1;
        ++seq_lens[static_cast<size_t>(i)];
      }
      BlockTableView table = bt;
      table.seq_lens = seq_lens.data();
      const std::span<const int32_t> rows(q_indptr.data(), static_cast<size_t>(S));
      const ForwardBatch b1{tokens, positions, q_indptr, next_slots.first(static_cast<size_t>(S)),
                            table,  rows};
      h_stage_ = h_chain_step_;
      Step st;
      try {
        st = stage(b1, cache, greedy);
      } catch (...) {
        h_stage_ = h_step_;
        throw;
      }
      h_stage_ = h_step_;
      KVQ_CHECK(st.decode, "forward_greedy_chain: a one-token pass was not staged as decode");
      st.context = std::max(kMinContextBucket, context_bucket(max_last));
      auto* h_slots = reinterpret_cast<int64_t*>(h_chain_step_ + align_up(off_.total));
      std::copy(next_slots.begin(), next_slots.end(), h_slots);
      KVQ_CUDA_CHECK(cudaMemcpyAsync(d_chain_slots_, h_slots, next_slots.size() * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, stream_));
      KVQ_CUDA_CHECK(cudaMemcpyAsync(d_at<int32_t>(off_.tokens), d_chain_ids_,
                                     static_cast<size_t>(S) * sizeof(int32_t),
                                     cudaMemcpyDeviceToDevice, stream_));
      for (int j = 1; j < steps; ++j) {
        if (j > 1)
          cuda_model::advance_decode_step(d_chain_ids_ + static_cast<size_t>(j - 1) * S,
                                          d_chain_slots_ + static_cast<size_t>(j - 1) * S, S,
                                          d_at<int32_t>(off_.tokens), d_at<int32_t>(off_.positions),
                                          d_at<int32_t>(off_.seq_lens), d_at<int64_t>(off_.slots),
                                          stream_);
        run_step(st, cache);
        sample_rows(0, S, d_chain_ids_ + static_cast<size_t>(j) * S);
      }
    }
  } catch (...) {
    h_stage_ = h_step_;
    settle_after_throw();
    throw;
  }
  if (defer) {
    defer_ids(d_chain_ids_, h_chain_ids_, static_cast<int>(n_out), t0);
    return;
  }
  KVQ_CUDA_CHECK(cudaMemcpyAsync(h_chain_ids_, d_chain_ids_, n_out * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream_));
  if (timing_.on) KVQ_CUDA_CHECK(cudaEventRecord(timing_.end, stream_));
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  timing_end(t0);
  std::copy(h_chain_ids_, h_chain_ids_ + n_out, out.begin());
}

void CudaDecoderModel::timing_begin() const {
  if (timing_.on) KVQ_CUDA_CHECK(cudaEventRecord(timing_.begin, stream_));
}

void CudaDecoderModel::timing_end(std::chrono::steady_clock::time_point t0) const {
  if (!timing_.on) return;
  const double wall =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  float ms = 0.0f;
  KVQ_CUDA_CHECK(cudaEventElapsedTime(&ms, timing_.begin, timing_.end));
  ++timing_.calls;
  timing_.device_ms += ms;
  timing_.wall_ms += wall;
}

// Context creation and the device's memory before kvq allocates anything.
size_t init_device(size_t& total) {
  if (cuda_device_count() == 0)
    throw InputError("no usable CUDA device (the CUDA model needs one; use the CPU model)");
  KVQ_CUDA_CHECK(cudaFree(nullptr));
  size_t free_b = 0;
  KVQ_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
  return free_b;
}

}  // namespace

void check_cuda_model_env() {
  (void)cuda_model::gemv_use_from_env();
  (void)cuda_model::gemv_ring_from_env();
  (void)cuda_model::gemv_ring_pdl_from_env();
  (void)gemv_silu_from_env();
  (void)gemv_norm_from_env();
  (void)l2_prefetch_from_env();
  (void)fp8_w8a16_rows_from_env();
  (void)verify_coarse_q_from_env();
  // Read where they apply (cache/cuda/pdl.h, attention/cuda/cuda_decode.cu); checked here.
  auto check_int = [](const char* name, int lo, int hi, const char* accepted) {
    const char* e = std::getenv(name);
    if (e == nullptr || *e == '\0') return;  // unset or empty: the default
    const std::string v = e;
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || n < lo || n > hi)
      throw InputError(std::string(name) + "=" + v + " is not " + accepted);
  };
  check_int("KVQ_PDL_EARLY", 0, 7, "one of: 0 .. 7 (bits)");
  check_int("KVQ_DECODE_TINY_MAX_TILES", 1, 1 << 20, "a tile count from 1");
  check_int("KVQ_DECODE_CLUSTER_MAX_TILES", 1, 1 << 20, "a tile count from 1");
  if (const char* e = std::getenv("KVQ_DECODE_CLUSTER_BLOCKS"); e != nullptr) {
    const std::string v = e;
    if (!v.empty() && v != "8" && v != "16")
      throw InputError("KVQ_DECODE_CLUSTER_BLOCKS=" + v + " is not one of: 8, 16");
  }
  if (const char* e = std::getenv("KVQ_FP8_HELD"); e != nullptr) {  // model_kernels.cu
    const std::string v = e;
    if (!v.empty() && v != "0" && v != "1")
      throw InputError("KVQ_FP8_HELD=" + v + " is not one of: 1, 0");
  }
  if (const char* e = std::getenv("KVQ_DECODE_CLUSTER"); e != nullptr) {
    const std::string v = e;
    if (!v.empty() && v != "auto" && v != "0" && v != "force")
      throw InputError("KVQ_DECODE_CLUSTER=" + v + " is not one of: auto, 0, force");
  }
}

bool cuda_fp8_gemm_available() {
  if (cuda_device_count() == 0) return false;
  int dev = 0, major = 0, minor = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&dev));
  KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  (void)minor;
  // cuBLAS scales FP8 GEMMs per row and per column (outer vectors) on sm_90 only (Ada has FP8
  // tensor cores but no such kernels; Blackwell's FP8 GEMMs take block scales).
  return major == 9;
}

std::unique_ptr<CudaModel> CudaModel::load(const KvPlan& plan, const CudaModelOptions& options) {
  if (plan.model.dir.empty())
    throw InputError("the model config has no directory, so there are no weights to load");
  auto load_rank = [&](const cuda_model::TpRank& tp) -> std::unique_ptr<CudaModel> {
    size_t total = 0;
    const size_t free_at_load = init_device(total);
    const KvPlan p = tp.active() ? slice_kv_plan(plan, tp.split, tp.rank) : plan;
    const ArchitectureConfig arch = CudaDecoderModel::validate(p, options, false, tp);
    for (const LayerKvSpec& s : p.layers)  // an unrunnable plan fails before weights move
      (void)select_attention_backend(s, Device::kCuda, options.forced_backend);
    WeightPrecision chosen = options.weights;
    auto weights = load_checkpoint_weights(p, arch, options.weights, chosen, nullptr, tp);
    return std::make_unique<CudaDecoderModel>(p, options, std::move(weights), chosen, free_at_load,
                                              tp);
  };
  if (options.tensor_parallel_size > 1)
    return cuda_model::make_tensor_parallel_model(plan, options, load_rank);
  return load_rank({});
}

std::unique_ptr<CudaModel> CudaModel::load_dflash_drafter(const KvPlan& plan, const Model& target,
                                                          const CudaModelOptions& options) {
  const auto* t = dynamic_cast<const CudaDecoderModel*>(&target);
  if (t == nullptr)
    throw InputError(
        target.device() == Device::kCuda
            ? "--speculative-config: a DFlash drafter does not run with --tensor-parallel-size "
              "above 1 yet; accepted: --tensor-parallel-size 1"
            : "--speculative-config: a DFlash drafter on the GPU needs a CUDA target "
              "(--device cuda); for a CPU target use Model::load_dflash_drafter");
  size_t total = 0;
  const size_t free_at_load = init_device(total);
  (void)Model::check_dflash_drafter(plan, target);
  const ArchitectureConfig arch = CudaDecoderModel::validate(plan, options, /*drafter=*/true);
  for (const LayerKvSpec& s : plan.layers)
    (void)select_attention_backend(s, Device::kCuda, options.forced_backend);
  WeightPrecision chosen = t->weight_precision();
  auto weights = load_checkpoint_weights(plan, arch, chosen, chosen, t->weights());
  return std::make_unique<CudaDecoderModel>(plan, options, std::move(weights), chosen,
                                            free_at_load);
}

std::unique_ptr<CudaModel> CudaModel::synthetic(const KvPlan& plan, const CudaModelOptions& options,
                                                uint64_t seed) {
  size_t total = 0;
  (void)init_device(total);  // a clear error when there is no GPU
  if (options.weights == WeightPrecision::kFloat32)
    throw InputError(
        "synthetic models hold bfloat16 (or, with --dtype fp8, FP8) weights; float32 was asked "
        "for");
  const bool fp8 = options.weights == WeightPrecision::kFp8;
  if (fp8 && !cuda_fp8_gemm_available())
    throw InputError(
        "--dtype fp8: kvq's FP8 GEMMs (cuBLASLt with a scale per row and per column) run on "
        "Hopper (compute capability 9.x); accepted here: auto, bfloat16");
  auto load_rank = [&](const cuda_model::TpRank& tp) -> std::unique_ptr<CudaModel> {
    size_t total_r = 0;
    const size_t free_r = init_device(total_r);
    const KvPlan p = tp.active() ? slice_kv_plan(plan, tp.split, tp.rank) : plan;
    const ArchitectureConfig arch = CudaDecoderModel::validate(p, options, false, tp);
    for (const LayerKvSpec& s : p.layers)
      (void)select_attention_backend(s, Device::kCuda, options.forced_backend);
    auto weights = synthetic_weights(p, arch, seed, fp8, tp);
    return std::make_unique<CudaDecoderModel>(
        p, options, std::move(weights), fp8 ? WeightPrecision::kFp8 : WeightPrecision::kBFloat16,
        free_r, tp);
  };
  if (options.tensor_parallel_size > 1)
    return cuda_model::make_tensor_parallel_model(plan, options, load_rank);
  return load_rank({});
}

}  // namespace kvq
