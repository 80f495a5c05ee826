// Flags of the commands that run a model (generate, eval, serve): the plan flags plus
// backend and device choice, and the sampling flags.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "kvq/engine/sampler.h"
#include "kvq/engine/speculative.h"
#include "kvq/model/cuda_model.h"
#include "kvq/model/model.h"
#include "kvq/tokenizer/tokenizer.h"
#include "plan_flags.h"

namespace kvq::cli {

struct LoadedModel {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

// What --speculative-config loads: the parsed config and, for draft_model, the drafter (planned
// like the target, on the target's device, with the target's tokenizer checked).
struct Speculation {
  SpeculativeConfig config;
  std::shared_ptr<const Model> drafter;

  // A proposer; a drafter's cache gets num_blocks blocks (the target's token capacity).
  std::shared_ptr<Proposer> proposer(int32_t num_blocks, int32_t max_step_tokens) const;
  // Drafter cache bytes per block of tokens (0 without a drafter model).
  size_t drafter_block_bytes() const;
  // "draft_model k=4 (drafter K/V fp8_e4m3 x2, ...)" for summaries.
  std::string summary() const;
};

struct ModelFlags {
  PlanFlags plan;
  std::string attention_backend;
  std::string device = "cpu";
  int prefill_chunk = 512;
  int threads = 0;
  // --device cuda only.
  float gpu_memory_utilization = 0.9f;
  std::string weight_dtype = "auto";
  bool enforce_eager = false;
  int tensor_parallel_size = 1;  // --tensor-parallel-size / -tp
  // Step limits the CUDA model sizes its buffers for (set by the command: serve and bench
  // have their own --max-num-seqs / --max-num-batched-tokens flags).
  int max_num_seqs = 256;
  int max_num_batched_tokens = 8192;

  // with_synthetic: accept --synthetic NAME instead of --model (kvq bench).
  void add_to(CLI::App& app, bool with_synthetic = false);
  // Plans, loads the tokenizer and the weights; prints plan warnings.
  LoadedModel load() const;
  // The weights only, under `plan`, on --device (random weights for --synthetic).
  std::unique_ptr<Model> load_model(const KvPlan& plan) const;
#ifdef KVQ_WITH_CUDA
  // --dtype, --gpu-memory-utilization, --enforce-eager, ... as the CUDA model's options.
  CudaModelOptions cuda_options() const;
#endif
  KvPlan make_plan(const KvPlanOptions& options) const;
  // --speculative-config: nullopt when not given; InputError for an inconsistent one (bad JSON,
  // a drafter with another vocabulary or tokenizer, layers no backend can run).
  std::optional<Speculation> load_speculation(const Model& target,
                                              const Tokenizer& tokenizer) const;
};

struct SamplingFlags {
  float temperature = 0.8f;
  int top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  int64_t seed = -1;
  int max_tokens = 256;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;

  void add_to(CLI::App& app);
  // Throws InputError naming the flag (prefix "--") for an invalid value.
  SamplingParams params(const std::string& flag_prefix) const;
};

}  // namespace kvq::cli
