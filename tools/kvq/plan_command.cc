// kvq plan: the per-layer KV cache table for a model and flags. Reads only config files,
// safetensors headers and the (tiny) KV scale tensors, never the weights.
#include <cstdio>
#include <iostream>
#include <memory>

#include "commands.h"
#include "kvq/attention/backend.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/log.h"
#include "kvq/model/model.h"
#include "plan_flags.h"
#include "kvq/plan/speculative_config.h"

namespace kvq::cli {

namespace {

struct PlanState {
  PlanFlags flags;
  bool json = false;
  std::string attention_backend;
  std::string device = "cpu";
};

// One plan (the target's or the drafter's): its table, backends and memory, printed, or as JSON.
nlohmann::json show_plan(const PlanState& st, const KvPlan& plan, bool print) {
  // Backend choice per layer: fails here, at start-up, when a layer has no backend.
  const Device device = st.device == "cuda" ? Device::kCuda : Device::kCpu;
  std::vector<BackendChoice> choices;
  for (const auto& spec : plan.layers)
    choices.push_back(select_attention_backend(spec, device, st.attention_backend));
  nlohmann::json memory = nullptr;
  if (!st.flags.kv_cache_memory.empty()) {
    const size_t budget = parse_byte_size(st.flags.kv_cache_memory, "--kv-cache-memory");
    const int64_t blocks = blocks_for_budget(plan.layers, budget);
    const int64_t block_tokens = plan.layers.empty() ? 0 : plan.layers.front().block_tokens;
    size_t per_block = 0;
    for (const auto& l : plan.layers) per_block += l.block_bytes();
    memory = {{"budget_bytes", budget},
              {"num_blocks", blocks},
              {"tokens", blocks * block_tokens},
              {"bytes_per_block_all_layers", per_block}};
  }
  for (const auto& w : plan.warnings) log_warning(w);
  auto out = kv_plan_to_json(plan);
  out["memory"] = memory;
  for (size_t i = 0; i < choices.size(); ++i) {
    nlohmann::json passed = nlohmann::json::array();
    for (const auto& [name, reasons] : choices[i].passed_over)
      passed.push_back({{"name", name}, {"reasons", reasons}});
    out["layers"][i]["attention_backend"] = {{"name", choices[i].backend->name()},
                                           {"passed_over", passed}};
  }
  const WeightScheme ws = describe_weights(plan.model);
  out["weights"] = {{"stored", ws.stored}, {"fp8", ws.fp8}, {"cpu", ws.cpu}, {"cuda", ws.cuda}};
  if (!print) return out;
  std::cout << format_kv_plan(plan);
  std::cout << "weights: " << ws.stored << "; runs as " << ws.cpu << " on the CPU, " << ws.cuda
            << " on CUDA\n";
  // Backends, grouped: "cpu_reference: layers 0-4 (cpu_avx512: head_dim 8 not in {64, 128,
  // 256})".
  std::cout << "attention backends (" << st.device << "):\n";
  for (size_t i = 0; i < choices.size();) {
    size_t j = i;
    auto same = [&](size_t a, size_t b) {
      return choices[a].backend == choices[b].backend &&
             choices[a].passed_over == choices[b].passed_over;
    };
    while (j + 1 < choices.size() && same(j + 1, i)) ++j;
    std::cout << "  layers " << plan.layers[i].layer;
    if (j > i) std::cout << "-" << plan.layers[j].layer;
    std::cout << ": " << choices[i].backend->name();
    for (const auto& [name, reasons] : choices[i].passed_over) {
      std::cout << "; passed over " << name << ": ";
      for (size_t r = 0; r < reasons.size(); ++r) std::cout << (r ? ", " : "") << reasons[r];
    }
    std::cout << "\n";
    i = j + 1;
  }
  if (!memory.is_null())
    std::cout << "memory: " << st.flags.kv_cache_memory << " = "
              << memory["budget_bytes"].get<size_t>() << " bytes -> "
              << memory["num_blocks"].get<int64_t>() << " blocks of "
              << memory["bytes_per_block_all_layers"].get<size_t>() << " bytes (all layers) -> "
              << memory["tokens"].get<int64_t>() << " tokens\n";
  return out;
}

}  // namespace

Action add_plan_command(CLI::App& app) {
  auto* sub = app.add_subcommand("plan", "show the per-layer KV cache plan for a model and flags");
  auto st = std::make_shared<PlanState>();
  st->flags.add_to(*sub, /*with_memory=*/true, /*with_synthetic=*/true);
  st->flags.add_speculative_to(*sub);
  sub->add_flag("--json", st->json, "print the plan as JSON (schema in docs/CLI.md)");
  sub->add_option("--attention-backend", st->attention_backend,
                  "force one attention backend for every layer (see kvq backends)");
  sub->add_option("--device", st->device, "device the layers run on: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  return [st]() {
    const ModelConfig config = st->flags.model_config();
    const KvPlan target = make_kv_plan(config, st->flags.options());
    const std::optional<SpeculativeConfig> spec = st->flags.speculative();
    // The drafter is planned by the same planner from the same flags (drafter_plan_options).
    std::optional<KvPlan> drafter;
    if (spec && spec->method != SpecMethod::kNgram) drafter = st->flags.drafter_plan(*spec);
    if (drafter && !st->json) std::cout << "target:\n";
    nlohmann::json j = show_plan(*st, target, !st->json);
    if (spec) {
      nlohmann::json s = {{"method", to_string(spec->method)},
                          {"num_speculative_tokens", spec->num_speculative_tokens},
                          {"drafter", nullptr}};
      if (spec->method == SpecMethod::kNgram) {
        s["prompt_lookup_min"] = spec->prompt_lookup_min;
        s["prompt_lookup_max"] = spec->prompt_lookup_max;
        if (!st->json)
          std::cout << "speculative: ngram (prompt lookup, n-grams " << spec->prompt_lookup_min
                    << ".." << spec->prompt_lookup_max << "), k=" << spec->num_speculative_tokens
                    << ", no drafter model\n";
      } else {
        s["model"] = spec->model;
        if (!st->json)
          std::cout << "\ndrafter (" << to_string(spec->method) << ", " << spec->model
                    << ", k=" << spec->num_speculative_tokens << "):\n";
        s["drafter"] = show_plan(*st, *drafter, !st->json);
      }
      j["speculative"] = s;
    }
    if (st->json) std::cout << j.dump(2) << "\n";
    return 0;
  };
}

}  // namespace kvq::cli
