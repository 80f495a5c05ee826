// The whole decoder on one CUDA device (KVQ_CUDA builds): weights uploaded once, cuBLAS GEMMs,
// fused elementwise kernels, the per-layer CUDA attention over a device-resident paged cache,
// logits and sampling on the device, decode steps replayed from CUDA graphs.
//
// Synthetic models (`kvq bench --synthetic NAME`): random weights built on the device in the
// exact shape of a real model, so an 8B-class model can be benchmarked without a checkpoint.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/model/model.h"
#include "kvq/plan/model_config.h"

namespace kvq {

// Precision the weights are held in on the device. kAuto: FP8 for an FP8 checkpoint (on a GPU
// with FP8 GEMMs), float32 for a float32 checkpoint (so the GPU path matches the CPU path),
// bfloat16 otherwise. kFp8: the decoder projections in e4m3 with a scale per output row (an
// FP8 checkpoint's own codes and scales; a bf16 one quantized at load), inputs quantized per
// token (or with the checkpoint's static input scales); embeddings, the LM head, norms and
// activations stay bf16 (model/cuda/linear.h).
enum class WeightPrecision : uint8_t { kAuto, kBFloat16, kFloat32, kFp8 };
// "auto", "bfloat16" / "bf16", "float32" / "fp32", "fp8"; InputError naming `flag` otherwise.
WeightPrecision parse_weight_precision(std::string_view text, std::string_view flag);
std::string_view to_string(WeightPrecision p);

// Whether the current CUDA device runs kvq's FP8 (e4m3) GEMMs: cuBLASLt with outer-vector
// scales, on Hopper (compute capability 9.x) only.
bool cuda_fp8_gemm_available();

// Checks the CUDA model's A/B environment switches (KVQ_GEMV, KVQ_GEMV_SILU) before any work;
// InputError naming the variable and the values it takes otherwise.
void check_cuda_model_env();

struct CudaModelOptions {
  WeightPrecision weights = WeightPrecision::kAuto;
  // Share of the device's total memory this process may hold: weights, activations,
  // workspaces and the KV cache (max_cache_blocks() is what is left of it). In (0, 1].
  float gpu_memory_utilization = 0.9f;
  int max_num_seqs = 256;             // largest batch of one step
  int max_num_batched_tokens = 8192;  // most new tokens in one step
  bool cuda_graphs = true;            // decode steps replayed from graphs per batch bucket
  // One-row steps prefetch o's weight into L2 beside the attention chain where it has at least
  // this many bytes (KVQ_L2_PREFETCH=0: never; docs/notes/decode-tuning.md version 20).
  size_t l2_prefetch_min_bytes = size_t{16} << 20;
  std::string forced_backend;  // --attention-backend (empty: choose)
  // --tensor-parallel-size: the model split over GPUs 0..N-1 of this process, one rank per GPU
  // (src/model/cuda/tensor_parallel.h); memory options apply to each GPU.
  int tensor_parallel_size = 1;
};

// Device memory as the model sees it (bytes).
struct CudaMemoryReport {
  size_t device_total = 0;
  size_t free_at_load = 0;  // free before kvq allocated anything
  size_t weights = 0;
  size_t weights_read_per_step = 0;  // `weights` less an embedding a step only gathers from
  size_t activations = 0;            // activation buffers, attention workspaces, logits, graphs
  size_t kv_budget = 0;              // utilization * total - everything above - other processes
};

// Names accepted by synthetic_model_config (at least "llama3-8b" and "qwen3-8b").
const std::vector<std::string>& synthetic_model_names();
// The config.json of a known model shape, parsed (dir is empty; torch_dtype bfloat16).
// InputError naming `flag` and listing the names for an unknown name.
ModelConfig synthetic_model_config(std::string_view name, std::string_view flag = "--synthetic");

class CudaModel : public Model {
 public:
  // Loads a checkpoint (plan.model.dir) onto the current CUDA device. InputError when no
  // device is usable, when the weights + buffers do not fit under gpu_memory_utilization
  // (naming what was needed and what is available), or when a layer has no CUDA backend
  // (naming the layer and the reasons).
  static std::unique_ptr<CudaModel> load(const KvPlan& plan, const CudaModelOptions& options);
  // Random bfloat16 weights of plan.model's shape (plan.model from synthetic_model_config),
  // generated on the device from `seed`; scaled so activations stay finite through every layer.
  static std::unique_ptr<CudaModel> synthetic(const KvPlan& plan, const CudaModelOptions& options,
                                              uint64_t seed = 1);
  // A DFlash drafter (plan.model: a KvqDFlashDrafter config) on the device of `target`, a CUDA
  // model: its own tensors are uploaded in the target's weight precision, the embedding and the
  // LM head are the target's device tensors (shared). InputError when the target is not a CUDA
  // model, the drafter does not fit it (Model::check_dflash_drafter) or a layer has no CUDA
  // kernel.
  static std::unique_ptr<CudaModel> load_dflash_drafter(const KvPlan& plan, const Model& target,
                                                        const CudaModelOptions& options);

  Device device() const override { return Device::kCuda; }
  virtual const CudaModelOptions& options() const = 0;
  virtual WeightPrecision weight_precision() const = 0;
  virtual CudaMemoryReport memory() const = 0;

  bool samples_on_device() const override { return true; }
  // forward() + sampling of each logit row on the device (Model::forward_sample).
  void forward_sample(const ForwardBatch& batch, PagedKvCache& cache,
                      std::span<const DeviceSampling> per_row,
                      std::span<int32_t> next_tokens) const override = 0;

  // Copies whole blocks (every layer, K and V) inside a cache made by create_cache(): block
  // pairs (src, dst). Lets a benchmark fill many sequences from one real prefill.
  virtual void copy_blocks(PagedKvCache& cache,
                           std::span<const std::pair<int32_t, int32_t>> src_dst) const = 0;
};

}  // namespace kvq
