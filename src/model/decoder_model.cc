// The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3: matrices as
// model::Linear (bf16 where the checkpoint is bf16, else fp32; q/k/v and gate/up fused so each
// is one product), activations fp32, K/V written into each layer's own cache format and
// attended by the backend chosen for that layer's spec.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "kvq/attention/support_matrix.h"
#include "kvq/core/error.h"
#include "kvq/model/model.h"
#include "model/checkpoint_reader.h"
#include "model/kernels.h"
#include "model/linear.h"
#include "model/step_profile.h"
#include "model/weight_layout.h"

namespace kvq {

namespace {

using model::FloatArray;
using model::Linear;

struct LayerWeights {
  FloatArray input_norm, post_norm;  // [H]
  FloatArray q_norm, k_norm;         // [d] (Qwen3)
  Linear qkv;                        // [q_dim + 2 kv_dim][H]
  FloatArray qkv_bias;               // [q_dim + 2 kv_dim]
  Linear o;                          // [H][q_dim]
  FloatArray o_bias;                 // [H]
  Linear gate_up;                    // [2I][H] (gate rows, then up rows)
  FloatArray gate_up_bias;           // [2I]
  Linear down;                       // [H][I]
  FloatArray down_bias;              // [H]
};

// Weights are immutable after loading and shared by every plan of the model (with_plan).
struct ModelWeights {
  Linear embed, lm_head;  // lm_head empty when tied to embed
  FloatArray final_norm;
  std::vector<LayerWeights> layers;
  // A DFlash drafter's own tensors (its embedding and LM head are its target's).
  Linear fc;
  FloatArray hidden_norm, mask_embedding;
  std::shared_ptr<const ModelWeights> target;  // the target's weights (DFlash drafter only)

  const Linear& embedding() const { return target ? target->embed : embed; }
  const Linear& head() const {
    const ModelWeights& w = target ? *target : *this;
    return w.lm_head.empty() ? w.embed : w.lm_head;
  }
};

class DecoderModel final : public Model {
 public:
  // Loads the weights when `weights` is null.
  DecoderModel(const KvPlan& plan, std::string_view forced_backend,
               std::shared_ptr<const ModelWeights> weights);

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

  // The weights, for a DFlash drafter built over this model.
  std::shared_ptr<const ModelWeights> weights() const { return weights_; }
  // A DFlash drafter's constructor: its own tensors are loaded, the embedding is the target's.
  DecoderModel(const KvPlan& plan, std::string_view forced_backend,
               std::shared_ptr<const ModelWeights> weights,
               std::shared_ptr<const ModelWeights> target);

 private:
  std::shared_ptr<const ModelWeights> load_weights(
      std::shared_ptr<const ModelWeights> target = nullptr) const;
  // K (k_norm, RoPE) and V of `rows` normed hidden rows h [T][H] at their positions' RoPE
  // table `rope` [T][d/2][2] into kb/vb (the k and v part of the fused q|k|v projection).
  void project_kv(const LayerWeights& w, int T, const float* h, const float* rope, float* kv,
                  float* kb, float* vb) const;
  // One token's cos/sin table [d/2][2] at `position`.
  void rope_row(int32_t position, float* cs) const;
  // One token's K (k_norm, RoPE by `cs`) and V from its k|v projections (k at `k_row`, v at
  // `k_row + kv_dim`, biases added), into kd [nkv][d] and vd [nkv][d].
  void finish_kv_row(const LayerWeights& w, const float* k_row, const float* cs, float* kd,
                     float* vd) const;

  KvPlan plan_;
  ArchitectureConfig arch_;
  int num_layers_ = 0, hidden_ = 0, inter_ = 0, vocab_ = 0;
  int num_q_heads_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
  int q_dim_ = 0, kv_dim_ = 0, qkv_dim_ = 0;
  std::shared_ptr<const ModelWeights> weights_;
  std::vector<const AttentionBackend*> backends_;
  std::vector<double> inv_freq_;
};

DecoderModel::DecoderModel(const KvPlan& plan, std::string_view forced_backend,
                           std::shared_ptr<const ModelWeights> weights)
    : plan_(plan), arch_(parse_architecture(plan.model)), weights_(std::move(weights)) {
  const ModelConfig& c = plan_.model;
  if (c.dir.empty())
    throw InputError("the model config has no directory, so there are no weights to load");
  num_layers_ = c.num_layers;
  hidden_ = arch_.hidden_size;
  inter_ = arch_.intermediate_size;
  vocab_ = arch_.vocab_size;
  num_q_heads_ = c.num_q_heads;
  num_kv_heads_ = c.num_kv_heads;
  head_dim_ = c.head_dim;
  q_dim_ = num_q_heads_ * head_dim_;
  kv_dim_ = num_kv_heads_ * head_dim_;
  qkv_dim_ = q_dim_ + 2 * kv_dim_;

  KVQ_CHECK(plan_.layers.size() == static_cast<size_t>(num_layers_),
            "the plan has " + std::to_string(plan_.layers.size()) + " layers, the model " +
                std::to_string(num_layers_));
  for (const LayerKvSpec& s : plan_.layers)
    KVQ_CHECK(s.num_q_heads == num_q_heads_ && s.num_kv_heads == num_kv_heads_ &&
                  s.head_dim_k == head_dim_ && s.head_dim_v == head_dim_,
              "layer " + std::to_string(s.layer) + "'s spec does not match the model's heads");

  // Backends first: an unrunnable plan fails before the weights are converted.
  for (const LayerKvSpec& s : plan_.layers)
    backends_.push_back(select_attention_backend(s, Device::kCpu, forced_backend).backend);

  model::use_single_threaded_blas();
  inv_freq_ = model::rope_inv_freq(head_dim_, arch_.rope_theta, arch_.rope_scaling);
  if (!weights_ && !arch_.dflash) weights_ = load_weights();
}

DecoderModel::DecoderModel(const KvPlan& plan, std::string_view forced_backend,
                           std::shared_ptr<const ModelWeights> weights,
                           std::shared_ptr<const ModelWeights> target)
    : DecoderModel(plan, forced_backend, std::move(weights)) {
  // A drafter's own tensors, over the target's embedding and LM head.
  if (!weights_) weights_ = load_weights(std::move(target));
}

std::unique_ptr<Model> DecoderModel::with_plan(const KvPlan& plan,
                                               std::string_view forced_backend) const {
  const ModelConfig& a = plan_.model;
  const ModelConfig& b = plan.model;
  if (a.architecture != b.architecture || a.num_layers != b.num_layers ||
      a.num_q_heads != b.num_q_heads || a.num_kv_heads != b.num_kv_heads ||
      a.head_dim != b.head_dim || a.hidden_size != b.hidden_size || a.vocab_size != b.vocab_size)
    throw InputError("with_plan: the plan is for a different model (" + b.architecture + ", " +
                     std::to_string(b.num_layers) + " layers, " + std::to_string(b.num_q_heads) +
                     "/" + std::to_string(b.num_kv_heads) + " heads of " +
                     std::to_string(b.head_dim) + ") than the loaded one (" + a.architecture +
                     ", " + std::to_string(a.num_layers) + " layers, " +
                     std::to_string(a.num_q_heads) + "/" + std::to_string(a.num_kv_heads) +
                     " heads of " + std::to_string(a.head_dim) + ")");
  KvPlan p = plan;
  p.model.raw = a.raw;  // the weights were loaded for this config
  p.model.dir = a.dir;
  return std::make_unique<DecoderModel>(p, forced_backend, weights_);
}

std::shared_ptr<const ModelWeights> DecoderModel::load_weights(
    std::shared_ptr<const ModelWeights> target) const {
  auto weights = std::make_shared<ModelWeights>();
  ModelWeights& mw = *weights;
  mw.target = std::move(target);
  if (arch_.dflash && !mw.target)
    throw InputError(plan_.model.dir +
                     ": a DFlash drafter is loaded over its target "
                     "(--speculative-config with method dflash), not alone");
  model::CheckpointReader reader(plan_.model.dir);
  // Every tensor's name, shape and place (shared with the CUDA model); all are checked before
  // any is converted.
  const model::WeightLayout layout =
      model::checkpoint_layout(plan_.model, arch_, reader.has("lm_head.weight"));
  mw.layers.resize(static_cast<size_t>(num_layers_));
  // Vectors land in their FloatArray; matrices are read as fp32 and become a Linear (bf16
  // when every piece of the tensor is stored as bf16, so the rounding is exact).
  std::vector<FloatArray*> dst;
  std::vector<FloatArray> matrix_values(layout.tensors.size());
  std::vector<std::pair<Linear*, int>> matrix(layout.tensors.size(),
                                              {nullptr, 0});  // (Linear, rows)
  for (size_t ti = 0; ti < layout.tensors.size(); ++ti) {
    const model::WeightTensor& t = layout.tensors[ti];
    LayerWeights* w = t.layer >= 0 ? &mw.layers[static_cast<size_t>(t.layer)] : nullptr;
    FloatArray* a = &matrix_values[ti];
    switch (t.kind) {
      case model::WeightKind::kEmbed:
        matrix[ti] = {&mw.embed, vocab_};
        break;
      case model::WeightKind::kLmHead:
        matrix[ti] = {&mw.lm_head, vocab_};
        break;
      case model::WeightKind::kFinalNorm:
        a = &mw.final_norm;
        break;
      case model::WeightKind::kInputNorm:
        a = &w->input_norm;
        break;
      case model::WeightKind::kPostNorm:
        a = &w->post_norm;
        break;
      case model::WeightKind::kQkv:
        matrix[ti] = {&w->qkv, qkv_dim_};
        break;
      case model::WeightKind::kQkvBias:
        a = &w->qkv_bias;
        break;
      case model::WeightKind::kQNorm:
        a = &w->q_norm;
        break;
      case model::WeightKind::kKNorm:
        a = &w->k_norm;
        break;
      case model::WeightKind::kO:
        matrix[ti] = {&w->o, hidden_};
        break;
      case model::WeightKind::kOBias:
        a = &w->o_bias;
        break;
      case model::WeightKind::kGateUp:
        matrix[ti] = {&w->gate_up, 2 * inter_};
        break;
      case model::WeightKind::kGateUpBias:
        a = &w->gate_up_bias;
        break;
      case model::WeightKind::kDown:
        matrix[ti] = {&w->down, hidden_};
        break;
      case model::WeightKind::kDownBias:
        a = &w->down_bias;
        break;
      case model::WeightKind::kDflashFc:
        matrix[ti] = {&mw.fc, hidden_};
        break;
      case model::WeightKind::kDflashHiddenNorm:
        a = &mw.hidden_norm;
        break;
      case model::WeightKind::kDflashMask:
        a = &mw.mask_embedding;
        break;
    }
    *a = FloatArray(static_cast<size_t>(t.numel));
    dst.push_back(a);
  }
  model::expect_layout(reader, layout);
  // A matrix becomes its Linear as soon as its last piece is read, so the fp32 copy of one
  // matrix at a time is resident (the arrays are allocated untouched above).
  std::vector<bool> bf16(layout.tensors.size(), true);
  std::vector<int> pieces_left(layout.tensors.size(), 0);
  for (const model::WeightPiece& pc : layout.pieces) ++pieces_left[pc.tensor];
  for (const model::WeightPiece& pc : layout.pieces) {
    const size_t ti = pc.tensor;
    reader.read(pc.name, dst[ti]->data() + pc.offset);
    bf16[ti] = bf16[ti] && reader.dtype(pc.name) == TensorDtype::kBF16;
    auto [lin, rows] = matrix[ti];
    if (--pieces_left[ti] > 0 || !lin) continue;
    const int cols = static_cast<int>(layout.tensors[ti].numel / rows);
    *lin = Linear(std::move(matrix_values[ti]), rows, cols,
                  bf16[ti] ? Linear::Storage::kBFloat16 : Linear::Storage::kFloat32);
  }
  reader.finish();
  return weights;
}

void add_bias(float* x, const float* bias, int n) {
  for (int i = 0; i < n; ++i) x[i] += bias[i];
}

void DecoderModel::forward(const ForwardBatch& b, PagedKvCache& cache,
                           std::span<float> logits) const {
  const int T = static_cast<int>(b.tokens.size());
  const int R = static_cast<int>(b.logit_rows.size());
  KVQ_CHECK(b.positions.size() == b.tokens.size() && b.slots.size() == b.tokens.size(),
            "forward: tokens, positions and slots differ in length");
  KVQ_CHECK(b.q_indptr.size() == static_cast<size_t>(b.block_table.num_seqs) + 1 &&
                b.q_indptr.front() == 0 && b.q_indptr.back() == T,
            "forward: q_indptr does not cover the batch's tokens");
  KVQ_CHECK(logits.size() == static_cast<size_t>(R) * static_cast<size_t>(vocab_),
            "forward: logits span has " + std::to_string(logits.size()) + " floats, expected " +
                std::to_string(R) + " x " + std::to_string(vocab_));
  KVQ_CHECK(cache.num_layers() == static_cast<size_t>(num_layers_),
            "forward: the cache has " + std::to_string(cache.num_layers()) + " layers, the model " +
                std::to_string(num_layers_));
  KVQ_CHECK(R <= T, "forward: more logit rows than tokens");
  for (int32_t r : b.logit_rows)
    KVQ_CHECK(r >= 0 && r < T, "forward: logit row " + std::to_string(r) + " out of range");
  for (int32_t t : b.tokens)
    if ((t < 0 || t >= vocab_) && !(t == kMaskToken && arch_.dflash))
      throw InputError("token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                       std::to_string(vocab_ - 1) + ")");
  const size_t ncap = b.capture_layers.size();
  KVQ_CHECK(!b.capture_on_device, "forward: a CPU model keeps no captures on a device");
  KVQ_CHECK(b.feature_source == nullptr && b.feature_rows.empty(),
            "forward: a CPU model reads no features on a device (use write_feature_kv)");
  KVQ_CHECK(b.token_source == nullptr && b.token_rows.empty(),
            "forward: a CPU model reads no tokens on a device (accepts_tokens_from is false)");
  KVQ_CHECK(b.captured.size() == ncap * static_cast<size_t>(T) * static_cast<size_t>(hidden_),
            "forward: captured span does not hold tokens x capture_layers x hidden floats");
  for (int32_t p : b.positions) KVQ_CHECK(p >= 0, "forward: negative position");
  if (T == 0) return;
  KVQ_PROFILE_SCOPE("forward");

  const int H = hidden_, I = inter_, d = head_dim_;
  const float eps = arch_.rms_norm_eps;
  const size_t t = static_cast<size_t>(T);

  // One scratch allocation per call, sized by the batch.
  const size_t n_x = t * H, n_qkv = t * qkv_dim_, n_q = t * q_dim_, n_kv = t * kv_dim_,
               n_mlp = t * 2 * I, n_rope = t * d;
  FloatArray scratch(2 * n_x + n_qkv + 2 * n_q + 2 * n_kv + n_mlp + n_rope);
  float* x = scratch.data();  // residual stream [T][H]
  float* h = x + n_x;         // normed rows [T][H]
  float* qkv = h + n_x;       // fused q|k|v projections [T][qkv_dim]
  float* qb = qkv + n_qkv;    // rotated queries [T][nq][d]
  float* att = qb + n_q;      // attention output [T][nq][d]
  float* kb = att + n_q;      // rotated keys [T][nkv][d]
  float* vb = kb + n_kv;      // values [T][nkv][d]
  float* mlp = vb + n_kv;     // gate|up [T][2I]; silu(gate)*up overwrites gate
  float* rope = mlp + n_mlp;  // cos, sin pairs [T][d/2][2]

#pragma omp parallel for schedule(static) if (T >= 16)
  for (int i = 0; i < T; ++i) {
    const int32_t tok = b.tokens[static_cast<size_t>(i)];
    if (tok == kMaskToken) {
      std::copy_n(weights_->mask_embedding.data(), H, x + size_t(i) * H);
    } else {
      weights_->embedding().row(tok, x + size_t(i) * H);
    }
    rope_row(b.positions[static_cast<size_t>(i)], rope + size_t(i) * d);
  }

  const float softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (int l = 0; l < num_layers_; ++l) {
    const LayerWeights& w = weights_->layers[static_cast<size_t>(l)];
    const LayerKvSpec& spec = plan_.layers[static_cast<size_t>(l)];

#pragma omp parallel for schedule(static) if (T >= 16)
    for (int i = 0; i < T; ++i)
      model::rms_norm(x + size_t(i) * H, w.input_norm.data(), H, eps, h + size_t(i) * H);
    {
      KVQ_PROFILE_SCOPE("qkv_proj");
      w.qkv.apply(T, h, H, qkv, qkv_dim_, 0.0f);
    }

#pragma omp parallel for schedule(static) if (T >= 16)
    for (int i = 0; i < T; ++i) {
      float* row = qkv + size_t(i) * qkv_dim_;
      if (!w.qkv_bias.empty()) add_bias(row, w.qkv_bias.data(), qkv_dim_);
      const float* cs = rope + size_t(i) * d;
      for (int hd = 0; hd < num_q_heads_; ++hd) {
        float* dst = qb + size_t(i) * q_dim_ + size_t(hd) * d;
        const float* src = row + size_t(hd) * d;
        if (arch_.qk_norm) {
          model::rms_norm(src, w.q_norm.data(), d, eps, dst);
        } else {
          std::copy_n(src, d, dst);
        }
        model::apply_rope(dst, d, cs);
      }
      finish_kv_row(w, row + q_dim_, cs, kb + size_t(i) * kv_dim_, vb + size_t(i) * kv_dim_);
    }

    const LayerCacheView view = cache.layer_view(static_cast<size_t>(l));
    {
      KVQ_PROFILE_SCOPE("kv_write");
      write_kv_reference(spec, view, b.slots, kb, vb);
    }
    AttentionArgs args;
    args.q = qb;
    args.out = att;
    args.q_indptr = b.q_indptr.data();
    args.block_table = b.block_table;
    args.cache = view;
    args.softmax_scale = softmax_scale;
    {
      KVQ_PROFILE_SCOPE("attention");
      backends_[static_cast<size_t>(l)]->run(spec, args);
    }

    // Residual adds ride on the product's beta = 1.
    {
      KVQ_PROFILE_SCOPE("o_proj");
      w.o.apply(T, att, q_dim_, x, H, 1.0f);
    }
    if (!w.o_bias.empty())
      for (int i = 0; i < T; ++i) add_bias(x + size_t(i) * H, w.o_bias.data(), H);

#pragma omp parallel for schedule(static) if (T >= 16)
    for (int i = 0; i < T; ++i)
      model::rms_norm(x + size_t(i) * H, w.post_norm.data(), H, eps, h + size_t(i) * H);
    {
      KVQ_PROFILE_SCOPE("gate_up_proj");
      w.gate_up.apply(T, h, H, mlp, 2 * I, 0.0f);
    }
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int i = 0; i < T; ++i) {
      float* row = mlp + size_t(i) * 2 * I;
      if (!w.gate_up_bias.empty()) add_bias(row, w.gate_up_bias.data(), 2 * I);
      model::silu_mul(row, row + I, I, row);
    }
    {
      KVQ_PROFILE_SCOPE("down_proj");
      w.down.apply(T, mlp, 2 * I, x, H, 1.0f);
    }
    if (!w.down_bias.empty())
      for (int i = 0; i < T; ++i) add_bias(x + size_t(i) * H, w.down_bias.data(), H);
    for (size_t c = 0; c < ncap; ++c)
      if (b.capture_layers[c] == l)
        for (int i = 0; i < T; ++i)
          std::copy_n(x + size_t(i) * H, H,
                      b.captured.data() + (size_t(i) * ncap + c) * static_cast<size_t>(H));
  }

  if (R == 0) return;
  KVQ_PROFILE_SCOPE("lm_head");
  for (int r = 0; r < R; ++r)
    model::rms_norm(x + size_t(b.logit_rows[static_cast<size_t>(r)]) * H,
                    weights_->final_norm.data(), H, eps, h + size_t(r) * H);
  weights_->head().apply(R, h, H, logits.data(), vocab_, 0.0f);
}

void DecoderModel::write_feature_kv(std::span<const float> features,
                                    std::span<const int32_t> positions,
                                    std::span<const int64_t> slots, PagedKvCache& cache) const {
  KVQ_CHECK(arch_.dflash.has_value(), "write_feature_kv: not a DFlash drafter");
  const int T = static_cast<int>(positions.size());
  const int H = hidden_, d = head_dim_;
  const size_t F =
      arch_.dflash->target_layer_ids.size() * static_cast<size_t>(arch_.dflash->target_hidden_size);
  KVQ_CHECK(slots.size() == positions.size() && features.size() == F * static_cast<size_t>(T),
            "write_feature_kv: features, positions and slots differ in length");
  if (T == 0) return;
  const size_t t = static_cast<size_t>(T);
  FloatArray scratch(2 * t * H + t * d + t * 2 * kv_dim_ + 2 * t * kv_dim_);
  float* fused = scratch.data();  // fc(features) [T][H]
  float* c = fused + t * H;       // hidden_norm(fused) [T][H]
  float* rope = c + t * H;        // [T][d/2][2]
  float* kv = rope + t * d;       // k|v projections [T][2 kv_dim]
  float* kb = kv + t * 2 * kv_dim_;
  float* vb = kb + t * kv_dim_;
  weights_->fc.apply(T, features.data(), static_cast<int>(F), fused, H, 0.0f);
  for (int i = 0; i < T; ++i) {
    model::rms_norm(fused + size_t(i) * H, weights_->hidden_norm.data(), H, arch_.rms_norm_eps,
                    c + size_t(i) * H);
    rope_row(positions[static_cast<size_t>(i)], rope + size_t(i) * d);
  }
  for (int l = 0; l < num_layers_; ++l) {
    // No input_layernorm: the context rows are the fused feature itself.
    project_kv(weights_->layers[static_cast<size_t>(l)], T, c, rope, kv, kb, vb);
    write_kv_reference(plan_.layers[static_cast<size_t>(l)],
                       cache.layer_view(static_cast<size_t>(l)), slots, kb, vb);
  }
}

void DecoderModel::project_kv(const LayerWeights& w, int T, const float* h, const float* rope,
                              float* kv, float* kb, float* vb) const {
  const int H = hidden_, d = head_dim_;
  // Rows q_dim .. q_dim + 2 kv_dim of the fused q|k|v matrix are k_proj then v_proj.
  w.qkv.apply(T, h, H, kv, 2 * kv_dim_, 0.0f, q_dim_, 2 * kv_dim_);
  for (int i = 0; i < T; ++i) {
    float* row = kv + size_t(i) * 2 * kv_dim_;
    if (!w.qkv_bias.empty()) add_bias(row, w.qkv_bias.data() + q_dim_, 2 * kv_dim_);
    finish_kv_row(w, row, rope + size_t(i) * d, kb + size_t(i) * kv_dim_, vb + size_t(i) * kv_dim_);
  }
}

void DecoderModel::rope_row(int32_t position, float* cs) const {
  for (int f = 0; f < head_dim_ / 2; ++f) {
    const double a = position * inv_freq_[static_cast<size_t>(f)];
    cs[2 * f] = static_cast<float>(std::cos(a));
    cs[2 * f + 1] = static_cast<float>(std::sin(a));
  }
}

void DecoderModel::finish_kv_row(const LayerWeights& w, const float* k_row, const float* cs,
                                 float* kd, float* vd) const {
  const int d = head_dim_;
  for (int hd = 0; hd < num_kv_heads_; ++hd) {
    float* dst = kd + size_t(hd) * d;
    const float* src = k_row + size_t(hd) * d;
    if (arch_.qk_norm) {
      model::rms_norm(src, w.k_norm.data(), d, arch_.rms_norm_eps, dst);
    } else {
      std::copy_n(src, d, dst);
    }
    model::apply_rope(dst, d, cs);
  }
  std::copy_n(k_row + kv_dim_, kv_dim_, vd);
}

}  // namespace

std::unique_ptr<Model> Model::load(const KvPlan& plan, std::string_view forced_backend) {
  // A bad KVQ_CPU_ISA / KVQ_CPU_INT_DOT fails here, not in each request on an engine thread.
  check_cpu_kernel_env();
  if (parse_architecture(plan.model).dflash)
    throw InputError(plan.model.dir +
                     ": a DFlash drafter is loaded over its target "
                     "(--speculative-config with method dflash), not alone");
  return std::make_unique<DecoderModel>(plan, forced_backend, nullptr);
}

ArchitectureConfig Model::check_dflash_drafter(const KvPlan& plan, const Model& target) {
  const ArchitectureConfig a = parse_architecture(plan.model);
  const std::string src = plan.model.dir + "/config.json";
  if (!a.dflash)
    throw InputError(src + ": method dflash needs a KvqDFlashDrafter config (architectures " +
                     "[\"KvqDFlashDrafter\"]), got '" + plan.model.architecture + "'");
  const ArchitectureConfig& ta = target.arch();
  if (a.dflash->num_target_layers != target.plan().model.num_layers ||
      a.dflash->target_hidden_size != ta.hidden_size || a.vocab_size != ta.vocab_size ||
      a.hidden_size != ta.hidden_size)
    throw InputError(src + ": the drafter was made for a target of " +
                     std::to_string(a.dflash->num_target_layers) + " layers, hidden " +
                     std::to_string(a.dflash->target_hidden_size) + ", vocabulary " +
                     std::to_string(a.vocab_size) + "; this target has " +
                     std::to_string(target.plan().model.num_layers) + " layers, hidden " +
                     std::to_string(ta.hidden_size) + ", vocabulary " +
                     std::to_string(ta.vocab_size));
  return a;
}

std::unique_ptr<Model> Model::load_dflash_drafter(const KvPlan& plan, const Model& target,
                                                  std::string_view forced_backend) {
  const auto* t = dynamic_cast<const DecoderModel*>(&target);
  if (t == nullptr)
    throw InputError(
        "--speculative-config: Model::load_dflash_drafter loads a drafter for a "
        "CPU target; a CUDA target's drafter is CudaModel::load_dflash_drafter");
  (void)check_dflash_drafter(plan, target);
  return std::make_unique<DecoderModel>(plan, forced_backend, nullptr, t->weights());
}

}  // namespace kvq
