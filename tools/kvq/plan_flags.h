// The KV-plan flags every command that builds a model shares (plan, generate,
// eval, bench, serve): registered once here, resolved into KvPlanOptions.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "kvq/plan/kv_plan.h"
#include "kvq/plan/speculative_config.h"

namespace kvq::cli {

struct PlanFlags {
  std::string model;
  std::string synthetic;  // --synthetic NAME (commands that accept it): a known model shape
  std::string kv_cache_dtype, k_cache_dtype, v_cache_dtype;
  std::string ctk, ctv;  // llama.cpp spellings, kept apart so provenance shows what was typed
  std::string skip_layers;
  int block_size = 16;
  std::string kv_cache_memory;  // "" = not given
  std::string speculative_config;  // --speculative-config JSON ("" = none)

  // with_synthetic: --model or --synthetic (one of them); otherwise --model is required.
  void add_to(CLI::App& app, bool with_memory = true, bool with_synthetic = false);
  // The model's config: config.json of --model, or the built-in shape of --synthetic.
  ModelConfig model_config() const;
  // Parses the dtype names through the registry (InputError names the flag on bad input).
  KvPlanOptions options() const;
  // --speculative-config (commands that speculate, and plan).
  void add_speculative_to(CLI::App& app);
  std::optional<SpeculativeConfig> speculative() const;
  // The drafter's plan (draft_model / dflash: its config.json under the target's flags).
  KvPlan drafter_plan(const SpeculativeConfig& spec) const;
};

// llama.cpp spells separate K/V dtypes -ctk/-ctv (single dash, several letters), which CLI11
// cannot declare; rewrite them to the hidden long options --ctk / --ctv before parsing.
std::vector<std::string> normalize_args(int argc, char** argv);

}  // namespace kvq::cli
