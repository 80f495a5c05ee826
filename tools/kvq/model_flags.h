// Flags of the commands that run a model (generate, eval, serve): the plan flags plus
// backend and device choice, and the sampling flags.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "kvq/engine/sampler.h"
#include "kvq/model/model.h"
#include "kvq/tokenizer/tokenizer.h"
#include "plan_flags.h"

namespace kvq::cli {

struct LoadedModel {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
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
  KvPlan make_plan(const KvPlanOptions& options) const;
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
