// Decoder-only transformer models from Hugging Face checkpoints (Llama, Mistral,
// Qwen2, Qwen3) and their CPU forward pass over the paged KV cache.
//
// The model is built from a KvPlan: each layer writes its K/V with its own
// LayerKvSpec and runs the attention backend selected for that spec. Nothing
// here reads flags.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/attention/backend.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/plan/kv_plan.h"
#include "kvq/plan/model_config.h"

namespace kvq {

enum class ModelFamily : uint8_t { kLlama, kMistral, kQwen2, kQwen3 };

struct RopeScaling {
  enum class Kind : uint8_t { kNone, kLinear, kLlama3 } kind = Kind::kNone;
  float factor = 1.0f;
  float low_freq_factor = 1.0f;                 // llama3
  float high_freq_factor = 4.0f;                // llama3
  int original_max_position_embeddings = 8192;  // llama3
};

// What the forward pass needs beyond ModelConfig, read from config.json (transformers 4 and 5
// spellings: rope_theta or rope_parameters.rope_theta, rope_scaling or rope_parameters).
// A block-diffusion (DFlash) drafter's own fields (config.json "dflash_config"; see
// docs/notes/dflash.md): which target layers feed it, and how many drafts one block holds.
struct DflashConfig {
  std::vector<int32_t> target_layer_ids;  // target decoder layers whose outputs are the features
  int num_target_layers = 0;
  int target_hidden_size = 0;
  int max_speculative_tokens = 0;
};

struct ArchitectureConfig {
  ModelFamily family = ModelFamily::kLlama;
  std::optional<DflashConfig> dflash;  // set for architectures ["KvqDFlashDrafter"]
  int hidden_size = 0;
  int intermediate_size = 0;
  int vocab_size = 0;
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2 (and attention_bias: true)
  bool o_bias = false;    // attention_bias: true (Llama, Qwen3); Qwen2's o_proj has none
  bool mlp_bias = false;  // Llama's mlp_bias: gate/up/down biases
  bool qk_norm = false;   // Qwen3: RMSNorm over each head of q and k before RoPE
};

// Throws InputError for an architecture kvq cannot run (listing the supported ones) or a
// field it needs that is missing or malformed (naming config.json and the field).
ArchitectureConfig parse_architecture(const ModelConfig& config);

// How a checkpoint's weights are stored and how each device runs them, as `kvq plan` shows
// it. `stored`: "bfloat16 (config.json torch_dtype)", or the FP8 scheme it declares
// (compressed-tensors float-quantized, ModelOpt FP8) with its scale granularity and activation
// scales; `cpu` / `cuda`: what each device holds at run time. InputError (one line) for a
// scheme kvq refuses.
struct WeightScheme {
  bool fp8 = false;
  std::string stored, cpu, cuda;
};
WeightScheme describe_weights(const ModelConfig& config);

// One forward step over a batch of sequences. Their new tokens' cache slots are already
// reserved (PagedKvCache::append); the model writes K/V there, then attends.
class Model;

struct ForwardBatch {
  std::span<const int32_t> tokens;     // new tokens, sequences concatenated
  std::span<const int32_t> positions;  // position of each new token in its sequence
  std::span<const int32_t>
      q_indptr;  // num_seqs + 1: sequence i owns tokens [q_indptr[i], q_indptr[i+1])
  std::span<const int64_t> slots;  // cache slot of each new token
  BlockTableView block_table;      // the sequences' block tables, seq_lens including the new tokens
  std::span<const int32_t> logit_rows;  // indices into `tokens` whose logits are wanted, in order
  // Optional: the outputs of these decoder layers (residual stream after the layer, before the
  // final norm) for every token, into `captured` [tokens][capture_layers.size()][hidden] fp32
  // (a DFlash drafter's features).
  std::span<const int32_t> capture_layers = {};
  std::span<float> captured = {};
  // Instead of `captured` (left empty): the model keeps the captured rows in its own device
  // memory, where Model::device_captured() finds them until its next forward pass. Only for a
  // model with keeps_captures_on_device() (a DFlash drafter on the same GPU reads them there).
  bool capture_on_device = false;
  // A DFlash drafter that reads_features_of(*feature_source) only: before the pass, in the same
  // device step (one host round trip for both), the context K/V of rows `feature_rows` of
  // feature_source->device_captured() at `feature_positions`, written to `feature_slots`, as
  // write_feature_kv_from_target would. The rows may belong to any sequence, drafting or not.
  const Model* feature_source = nullptr;
  std::span<const int32_t> feature_rows = {}, feature_positions = {};
  std::span<const int64_t> feature_slots = {};
  // Tokens still on the device (a drafter's greedy drafts that were not waited for): token
  // token_dst[i] of this batch is row token_rows[i] of token_source's deferred ids
  // (Model::forward_sample_deferred, forward_greedy_chain with defer); the values in `tokens` at
  // those indices are placeholders (any id of the vocabulary). Only for a model that
  // accepts_tokens_from(*token_source). With a token source set, the pass waits on the device
  // for the source's deferred work to finish before it runs, even with no rows.
  const Model* token_source = nullptr;
  std::span<const int32_t> token_rows = {}, token_dst = {};
};

// The greedy pick of one logit row: the highest logit, the lowest id among ties; NaN never
// wins (0 when every logit is NaN). Sampler's greedy rule and the device's argmax are the same.
int32_t greedy_argmax(std::span<const float> logits);

// The argument checks of Model::forward_greedy_chain (InternalError naming what is wrong).
void check_greedy_chain(const ForwardBatch& batch, int steps, size_t next_slots, size_t out,
                        bool defer);

// A token id that a DFlash drafter embeds as its learned mask vector (block rows 1..k).
inline constexpr int32_t kMaskToken = -1;

// Sampling of one logit row where the logits are (Model::forward_sample). temperature 0:
// greedy (argmax, lowest id on ties, NaN never wins); otherwise temperature, then top-k,
// top-p and min-p filters, as the host Sampler applies them, drawn reproducibly from
// (seed, step).
struct DeviceSampling {
  float temperature = 0.0f;
  int top_k = 0;       // 0: off
  float top_p = 1.0f;  // 1: off
  float min_p = 0.0f;  // 0: off
  uint64_t seed = 0;   // with `step`, makes the draw reproducible
  uint64_t step = 0;
};

class Model {
 public:
  virtual ~Model() = default;

  // Memory-maps the checkpoint's safetensors, checks every tensor's name and shape (InputError
  // naming the tensor, its shape and the expected one), converts F32/F16/BF16 weights for the
  // CPU (FP8 weights are refused with a clear message), and selects an attention backend per
  // layer on the CPU (`forced_backend` non-empty: that one, or an InputError with its reasons).
  // Shows a progress bar on stderr for checkpoints over a few hundred MB.
  static std::unique_ptr<Model> load(const KvPlan& plan, std::string_view forced_backend = {});
  // A DFlash drafter (plan.model: a KvqDFlashDrafter config) over `target`'s embedding and LM
  // head (shared, not copied). InputError when the drafter does not fit the target (hidden size,
  // layer count, vocabulary) or a layer has no backend. CPU targets (a CUDA target's drafter:
  // CudaModel::load_dflash_drafter).
  static std::unique_ptr<Model> load_dflash_drafter(const KvPlan& plan, const Model& target,
                                                    std::string_view forced_backend = {});
  // The drafter's architecture when plan.model is a DFlash drafter made for `target` (its
  // target layers, hidden size and vocabulary); InputError naming config.json otherwise. Shared
  // by the CPU and the CUDA drafters.
  static ArchitectureConfig check_dflash_drafter(const KvPlan& plan, const Model& target);

  // The same weights (shared, not copied) under another plan of the same model, e.g. an
  // unquantized reference next to a quantized run in `kvq eval`. Throws InputError when the
  // plan's model shape differs or a layer has no backend.
  virtual std::unique_ptr<Model> with_plan(const KvPlan& plan,
                                           std::string_view forced_backend = {}) const = 0;

  virtual const KvPlan& plan() const = 0;
  virtual const ArchitectureConfig& arch() const = 0;
  virtual int vocab_size() const = 0;
  // The backend each layer runs, parallel to plan().layers.
  virtual std::vector<const AttentionBackend*> layer_backends() const = 0;

  // Runs the batch; writes logits [logit_rows.size()][vocab_size] (fp32, host memory) to
  // `logits`. `cache` must come from create_cache() of this model (or, for a CPU model, any
  // PagedKvCache over plan().layers).
  virtual void forward(const ForwardBatch& batch, PagedKvCache& cache,
                       std::span<float> logits) const = 0;

  // A DFlash drafter only: writes every layer's context K/V for `positions` into their cache
  // `slots` from the target's features ([n][layers * target hidden], the layers of
  // arch().dflash->target_layer_ids): K/V = k_proj / v_proj of hidden_norm(fc(features)), k_norm
  // and RoPE at the position. InternalError for other models.
  virtual void write_feature_kv(std::span<const float> features, std::span<const int32_t> positions,
                                std::span<const int64_t> slots, PagedKvCache& cache) const;
  // True when this (DFlash drafter) model can take `target`'s features where the target keeps
  // them (write_feature_kv_from_target): both on the same GPU.
  virtual bool reads_features_of(const Model& target) const {
    (void)target;
    return false;
  }
  // write_feature_kv with the features of `positions` in rows `rows` of the target's last
  // forward pass, captured with capture_on_device; they are read before this returns, so the
  // target may run its next pass. InternalError unless reads_features_of(target).
  virtual void write_feature_kv_from_target(const Model& target, std::span<const int32_t> rows,
                                            std::span<const int32_t> positions,
                                            std::span<const int64_t> slots,
                                            PagedKvCache& cache) const;
  // A model that can keep captured layer outputs on its device (ForwardBatch::capture_on_device).
  virtual bool keeps_captures_on_device() const { return false; }
  // The last forward pass's captured rows on the device, [tokens][capture layers][hidden] fp32;
  // nullptr when there are none.
  virtual const float* device_captured() const { return nullptr; }

  // Where the forward pass runs. A kCuda model keeps its KV cache in device memory.
  virtual Device device() const { return Device::kCpu; }
  // A cache of num_blocks blocks for this model's plan: host storage for a CPU model; for a
  // CUDA model, device storage behind a bookkeeping PagedKvCache (with_external_storage).
  // Throws InputError when num_blocks exceeds max_cache_blocks().
  virtual std::unique_ptr<PagedKvCache> create_cache(int32_t num_blocks) const;
  // The most blocks create_cache() can give now; -1 when only host memory limits it.
  virtual int64_t max_cache_blocks() const { return -1; }

  // True when forward_sample() picks tokens where the logits are, so only the ids cross to the
  // host (a CUDA model). Callers that need whole logit rows (log-probabilities) use forward().
  virtual bool samples_on_device() const { return false; }
  // Like forward(), but samples the next token of each logit row: next_tokens gets one id per
  // logit row. per_row has one entry per logit row (or exactly one, applied to every row).
  // Only models with samples_on_device() implement it (InternalError otherwise).
  virtual void forward_sample(const ForwardBatch& batch, PagedKvCache& cache,
                              std::span<const DeviceSampling> per_row,
                              std::span<int32_t> next_tokens) const;

  // Greedy drafting of `steps` tokens per sequence in one call (a draft model's k steps): runs
  // `batch`, whose logit rows are each sequence's last token in order, then steps - 1 passes of
  // one token per sequence, each sequence's argmax of the pass before at the next position, in
  // slot next_slots[(j - 1) * num_seqs + i] for pass j and sequence i. The caller reserved those
  // slots: the block tables hold them, while batch's seq_lens are the first pass's.
  // out[j * num_seqs + i]: sequence i's argmax of pass j. With `defer` (a model that
  // accepts_tokens_from() can read them: CUDA), nothing is waited for and `out` stays empty:
  // collect_sampled() returns the ids later, and a ForwardBatch may read them on the device
  // first (token_source). The base class runs forward() (or forward_sample()) pass by pass.
  virtual void forward_greedy_chain(const ForwardBatch& batch, PagedKvCache& cache, int steps,
                                    std::span<const int64_t> next_slots, std::span<int32_t> out,
                                    bool defer = false) const;
  // forward_sample() without waiting for the ids: they stay on the device until
  // collect_sampled() (see forward_greedy_chain's defer). Models that accept tokens from
  // another model's device only (InternalError otherwise).
  virtual void forward_sample_deferred(const ForwardBatch& batch, PagedKvCache& cache,
                                       std::span<const DeviceSampling> per_row) const;
  // Waits for the deferred ids of the last deferred call and copies them to `out` (exactly as
  // many as it produced). InternalError without one.
  virtual void collect_sampled(std::span<int32_t> out) const;
  // Waits for the last deferred call's work, if any, and gives its ids up (a caller that will
  // not collect them, e.g. after an exception between the deferred call and the pass that
  // read them). Does nothing without one.
  virtual void drop_deferred() const {}
  // True when a ForwardBatch of this model may take tokens from `source`'s deferred ids on the
  // device (ForwardBatch::token_source): both CUDA models on the same GPU.
  virtual bool accepts_tokens_from(const Model& source) const {
    (void)source;
    return false;
  }
};

}  // namespace kvq
