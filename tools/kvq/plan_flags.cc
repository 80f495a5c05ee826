#include "plan_flags.h"

#include "kvq/core/error.h"
#include "kvq/model/cuda_model.h"

namespace kvq::cli {

void PlanFlags::add_to(CLI::App& app, bool with_memory, bool with_synthetic) {
  auto* m =
      app.add_option("--model", model, "Hugging Face model directory (config.json, *.safetensors)");
  if (with_synthetic) {
    std::string names;
    for (const auto& n : synthetic_model_names()) names += (names.empty() ? "" : ", ") + n;
    auto* s = app.add_option("--synthetic", synthetic,
                             "random weights in the shape of a known model (" + names + ")");
    m->excludes(s);
    s->excludes(m);
    app.get_option("--model")->description(
        "Hugging Face model directory (config.json, *.safetensors); or --synthetic");
  } else {
    m->required();
  }
  app.add_option("--kv-cache-dtype", kv_cache_dtype,
                 "KV cache dtype of every layer, K and V: " + accepted_kv_dtype_names());
  auto* k = app.add_option("--k-cache-dtype", k_cache_dtype,
                           "K cache dtype (also -ctk); overrides --kv-cache-dtype for K");
  auto* v = app.add_option("--v-cache-dtype", v_cache_dtype,
                           "V cache dtype (also -ctv); overrides --kv-cache-dtype for V");
  app.add_option("--ctk", ctk)->group("")->excludes(k);
  app.add_option("--ctv", ctv)->group("")->excludes(v);
  app.add_option("--kv-cache-dtype-skip-layers", skip_layers,
                 "layers kept in the model's dtype: indices (3), ranges (0-3), sliding_window, "
                 "boundary:N; comma-separated");
  app.add_option("--block-size", block_size, "tokens per KV cache block (default 16)");
  if (with_memory)
    app.add_option("--kv-cache-memory", kv_cache_memory,
                   "KV cache memory budget (e.g. 4GiB): shows how many tokens fit");
}

ModelConfig PlanFlags::model_config() const {
  if (!synthetic.empty()) return synthetic_model_config(synthetic, "--synthetic");
  if (model.empty()) throw InputError("a model is needed: --model DIR or --synthetic NAME");
  return load_model_config(model);
}

KvPlanOptions PlanFlags::options() const {
  KvPlanOptions o;
  auto flag = [](const std::string& value, const char* name) -> std::optional<DtypeFlag> {
    if (value.empty()) return std::nullopt;
    return DtypeFlag{parse_kv_dtype_or_throw(value, name), std::string(name) + " " + value};
  };
  o.kv = flag(kv_cache_dtype, "--kv-cache-dtype");
  o.k = ctk.empty() ? flag(k_cache_dtype, "--k-cache-dtype") : flag(ctk, "-ctk");
  o.v = ctv.empty() ? flag(v_cache_dtype, "--v-cache-dtype") : flag(ctv, "-ctv");
  o.skip_layers = skip_layers;
  o.block_tokens = block_size;
  return o;
}

void PlanFlags::add_speculative_to(CLI::App& app) {
  app.add_option("--speculative-config", speculative_config,
                 "speculative decoding, JSON: {\"method\": \"ngram\" | \"draft_model\" | "
                 "\"dflash\", \"model\": DIR, \"num_speculative_tokens\": k, ...} "
                 "(see docs/CLI.md)");
}

std::optional<SpeculativeConfig> PlanFlags::speculative() const {
  if (speculative_config.empty()) return std::nullopt;
  return parse_speculative_config(speculative_config, "--speculative-config");
}

KvPlan PlanFlags::drafter_plan(const SpeculativeConfig& spec) const {
  const ModelConfig drafter = load_model_config(spec.model);
  return make_drafter_kv_plan(drafter, options(), spec);
}

std::vector<std::string> normalize_args(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-ctk" || a == "-ctv" || a.rfind("-ctk=", 0) == 0 || a.rfind("-ctv=", 0) == 0)
      a = "-" + a;
    // vLLM's -tp is --tensor-parallel-size.
    if (a == "-tp") a = "--tensor-parallel-size";
    if (a.rfind("-tp=", 0) == 0) a = "--tensor-parallel-size=" + a.substr(4);
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace kvq::cli
