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
#include "kvq/plan/tensor_parallel.h"

namespace kvq::cli {

namespace {

struct PlanState {
  PlanFlags flags;
  bool json = false;
  std::string attention_backend;
  std::string device = "cpu";
  int tensor_parallel_size = 1;
};

// --tensor-parallel-size N: the heads each rank holds, its KV bytes per token and (with
// --kv-cache-memory, a per-GPU budget) the group's capacity, from rank 0's slice of the plan
// (every rank's slice has the same sizes).
nlohmann::json show_tensor_parallel(const PlanState& st, const KvPlan& plan, bool print) {
  const TensorParallelSplit split = split_heads(plan.model, st.tensor_parallel_size);
  const KvPlan rank0 = slice_kv_plan(plan, split, 0);
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < split.size; ++r)
    ranks.push_back({{"rank", r},
                     {"first_q_head", split.first_q_head(r)},
                     {"kv_heads", split.kv_heads_of(r)}});
  const size_t per_rank = rank0.bytes_per_token();
  nlohmann::json j = {{"size", split.size},
                      {"q_heads_per_rank", split.q_heads_per_rank},
                      {"kv_heads_per_rank", split.kv_heads_per_rank},
                      {"kv_head_replicas", split.kv_head_replicas},
                      {"ranks", ranks},
                      {"kv_bytes_per_token_per_rank", per_rank},
                      {"kv_bytes_per_token_group", per_rank * static_cast<size_t>(split.size)},
                      {"notes", split.notes},
                      {"memory", nullptr}};
  int64_t blocks = 0, tokens = 0;
  size_t budget = 0;
  if (!st.flags.kv_cache_memory.empty()) {
    budget = parse_byte_size(st.flags.kv_cache_memory, "--kv-cache-memory");
    blocks = blocks_for_budget(rank0.layers, budget);
    tokens = blocks * (rank0.layers.empty() ? 0 : rank0.layers.front().block_tokens);
    j["memory"] = {{"budget_bytes_per_rank", budget},
                   {"num_blocks_per_rank", blocks},
                   {"tokens", tokens}};
  }
  if (print) {
    std::cout << "tensor parallel: " << split.size << " ranks, each with "
              << split.q_heads_per_rank << " query / " << split.kv_heads_per_rank
              << " kv head(s) per layer:";
    for (int r = 0; r < split.size; ++r) {
      const std::vector<int> h = split.kv_heads_of(r);
      std::cout << (r ? "," : "") << " rank " << r << " kv "
                << (h.size() == 1 ? std::to_string(h[0])
                                  : std::to_string(h.front()) + "-" + std::to_string(h.back()));
    }
    std::cout << "\n  per rank: " << per_rank << " KV bytes/token (the whole model: "
              << plan.bytes_per_token() << ")\n";
    for (const std::string& n : split.notes) std::cout << "  note: " << n << "\n";
    if (!st.flags.kv_cache_memory.empty())
      std::cout << "  memory: " << st.flags.kv_cache_memory << " per GPU -> " << blocks
                << " blocks per rank -> " << tokens
                << " tokens for the group (block tables are the same on every rank)\n";
  }
  return j;
}

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
  sub->add_option("--tensor-parallel-size", st->tensor_parallel_size,
                  "(also -tp) show the split of the heads and the KV cache over N GPUs: per-rank "
                  "KV bytes/token, and the group's capacity for a per-GPU --kv-cache-memory")
      ->check(CLI::Range(1, 64));
  return [st]() {
    const ModelConfig config = st->flags.model_config();
    const KvPlan target = make_kv_plan(config, st->flags.options());
    // A size the heads do not split over fails before anything is printed.
    if (st->tensor_parallel_size != 1) (void)split_heads(config, st->tensor_parallel_size);
    const std::optional<SpeculativeConfig> spec = st->flags.speculative();
    // The drafter is planned by the same planner from the same flags (drafter_plan_options).
    std::optional<KvPlan> drafter;
    if (spec && spec->method != SpecMethod::kNgram) drafter = st->flags.drafter_plan(*spec);
    if (drafter && !st->json) std::cout << "target:\n";
    nlohmann::json j = show_plan(*st, target, !st->json);
    if (st->tensor_parallel_size != 1)
      j["tensor_parallel"] = show_tensor_parallel(*st, target, !st->json);
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
