#include "model/weight_layout.h"

#include <utility>

namespace kvq::model {

WeightLayout checkpoint_layout(const ModelConfig& c, const ArchitectureConfig& arch,
                               bool has_lm_head) {
  WeightLayout out;
  const int64_t H = arch.hidden_size, I = arch.intermediate_size, V = arch.vocab_size;
  const int64_t d = c.head_dim, q = int64_t{c.num_q_heads} * d, kv = int64_t{c.num_kv_heads} * d;
  auto tensor = [&](WeightKind kind, int layer, int64_t numel) {
    out.tensors.push_back({kind, layer, numel});
    return out.tensors.size() - 1;
  };
  auto add = [&](std::string name, std::vector<int64_t> shape, size_t t, int64_t offset) {
    out.pieces.push_back({std::move(name), std::move(shape), t, offset});
  };

  if (arch.dflash) {
    // The embedding and the LM head are the target's.
    const int64_t F = static_cast<int64_t>(arch.dflash->target_layer_ids.size()) *
                      arch.dflash->target_hidden_size;
    add("fc.weight", {H, F}, tensor(WeightKind::kDflashFc, -1, H * F), 0);
    add("hidden_norm.weight", {H}, tensor(WeightKind::kDflashHiddenNorm, -1, H), 0);
    add("mask_embedding", {H}, tensor(WeightKind::kDflashMask, -1, H), 0);
  } else {
    add("model.embed_tokens.weight", {V, H}, tensor(WeightKind::kEmbed, -1, V * H), 0);
    if (!arch.tie_word_embeddings && has_lm_head)
      add("lm_head.weight", {V, H}, tensor(WeightKind::kLmHead, -1, V * H), 0);
  }
  add("model.norm.weight", {H}, tensor(WeightKind::kFinalNorm, -1, H), 0);

  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {H}, tensor(WeightKind::kInputNorm, i, H), 0);
    add(p + "post_attention_layernorm.weight", {H}, tensor(WeightKind::kPostNorm, i, H), 0);
    const size_t qkv = tensor(WeightKind::kQkv, i, (q + 2 * kv) * H);
    add(p + "self_attn.q_proj.weight", {q, H}, qkv, 0);
    add(p + "self_attn.k_proj.weight", {kv, H}, qkv, q * H);
    add(p + "self_attn.v_proj.weight", {kv, H}, qkv, (q + kv) * H);
    if (arch.qkv_bias) {
      const size_t b = tensor(WeightKind::kQkvBias, i, q + 2 * kv);
      add(p + "self_attn.q_proj.bias", {q}, b, 0);
      add(p + "self_attn.k_proj.bias", {kv}, b, q);
      add(p + "self_attn.v_proj.bias", {kv}, b, q + kv);
    }
    if (arch.qk_norm) {
      add(p + "self_attn.q_norm.weight", {d}, tensor(WeightKind::kQNorm, i, d), 0);
      add(p + "self_attn.k_norm.weight", {d}, tensor(WeightKind::kKNorm, i, d), 0);
    }
    add(p + "self_attn.o_proj.weight", {H, q}, tensor(WeightKind::kO, i, H * q), 0);
    if (arch.o_bias) add(p + "self_attn.o_proj.bias", {H}, tensor(WeightKind::kOBias, i, H), 0);
    const size_t gu = tensor(WeightKind::kGateUp, i, 2 * I * H);
    add(p + "mlp.gate_proj.weight", {I, H}, gu, 0);
    add(p + "mlp.up_proj.weight", {I, H}, gu, I * H);
    add(p + "mlp.down_proj.weight", {H, I}, tensor(WeightKind::kDown, i, H * I), 0);
    if (arch.mlp_bias) {
      const size_t b = tensor(WeightKind::kGateUpBias, i, 2 * I);
      add(p + "mlp.gate_proj.bias", {I}, b, 0);
      add(p + "mlp.up_proj.bias", {I}, b, I);
      add(p + "mlp.down_proj.bias", {H}, tensor(WeightKind::kDownBias, i, H), 0);
    }
  }
  return out;
}

void expect_layout(CheckpointReader& reader, const WeightLayout& layout) {
  for (const WeightPiece& pc : layout.pieces) reader.expect(pc.name, pc.shape);
}

bool layout_all_float32(const CheckpointReader& reader, const WeightLayout& layout) {
  for (const WeightPiece& pc : layout.pieces)
    if (reader.dtype(pc.name) != TensorDtype::kF32) return false;
  return true;
}

}  // namespace kvq::model
