// The checkpoint tensors a decoder needs and where each lands: shared by the CPU model and the
// CUDA model so both check the same names and shapes. q/k/v are fused into one [q + 2 kv][H]
// tensor and gate/up into one [2I][H] (gate rows first), so each is one matrix product.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/model/model.h"
#include "model/checkpoint_reader.h"

namespace kvq::model {

enum class WeightKind : uint8_t {
  kEmbed,       // [V][H]
  kLmHead,      // [V][H] (absent when tied to the embedding)
  kFinalNorm,   // [H]
  kInputNorm,   // [H]
  kPostNorm,    // [H]
  kQkv,         // [q + 2 kv][H]
  kQkvBias,     // [q + 2 kv]
  kQNorm,       // [d] (Qwen3)
  kKNorm,       // [d] (Qwen3)
  kO,           // [H][q]
  kOBias,       // [H]
  kGateUp,      // [2I][H]
  kGateUpBias,  // [2I]
  kDown,        // [H][I]
  kDownBias,    // [H]
  kDflashFc,          // [H][layers * target hidden] (DFlash drafter)
  kDflashHiddenNorm,  // [H]
  kDflashMask,        // [H]: the mask rows' input embedding
};

// One destination tensor (layer -1 for the model-level ones).
struct WeightTensor {
  WeightKind kind;
  int layer;
  int64_t numel;
};

// One checkpoint tensor: its name, the shape config.json implies, and where it goes.
struct WeightPiece {
  std::string name;
  std::vector<int64_t> shape;
  size_t tensor;   // index into WeightLayout::tensors
  int64_t offset;  // elements into that tensor
};

struct WeightLayout {
  std::vector<WeightTensor> tensors;
  std::vector<WeightPiece> pieces;
};

// The layout for `config` (lm_head.weight is read when the checkpoint has it and the
// embeddings are not tied).
WeightLayout checkpoint_layout(const ModelConfig& config, const ArchitectureConfig& arch,
                               bool has_lm_head);

// Every piece's presence, dtype and shape checked (InputError naming the tensor).
void expect_layout(CheckpointReader& reader, const WeightLayout& layout);

// True when every piece is stored as F32 (kAuto weight precision keeps such checkpoints fp32).
bool layout_all_float32(const CheckpointReader& reader, const WeightLayout& layout);

}  // namespace kvq::model
