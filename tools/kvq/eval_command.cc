// kvq eval: perplexity per KV dtype and, against an unquantized (float32) KV cache run of the
// same weights in the same process, mean KL divergence, top-1 agreement and delta PPL.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kvq/core/error.h"
#include "kvq/core/log.h"
#include "kvq/engine/evaluator.h"
#include "kvq/plan/model_config.h"
#include "model_flags.h"

namespace kvq::cli {

namespace {

std::string read_text_file(const std::string& path) {
  if (!std::filesystem::is_regular_file(path))
    throw InputError("--text " + path + ": not a readable file");
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

Action add_eval_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "eval",
      "perplexity, KL divergence and top-1 agreement of KV dtypes against an unquantized cache");
  struct State {
    ModelFlags model;
    std::string text;
    bool json = false;
    bool all_dtypes = false;
    int context = 512;
    int64_t max_tokens = 0;
    std::string reference_model;
    std::string reference_kv = "float32";
  };
  auto st = std::make_shared<State>();
  st->model.add_to(*sub);
  sub->add_option("--text", st->text, "UTF-8 text file to evaluate on")->required();
  sub->add_flag("--json", st->json, "print the report as JSON");
  sub->add_flag("--all-dtypes", st->all_dtypes,
                "evaluate every KV dtype (skip layers still apply)");
  sub->add_option("--context", st->context, "tokens per evaluation window (default 512)")
      ->check(CLI::Range(2, 1 << 20));
  sub->add_option("--max-tokens", st->max_tokens,
                  "evaluate at most this many tokens (default: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  sub->add_option("--reference-model", st->reference_model,
                  "compare against this model (same tokenizer and vocabulary), e.g. the bf16 "
                  "original of an FP8 checkpoint (default: the same weights)");
  sub->add_option("--reference-kv-cache-dtype", st->reference_kv,
                  "the reference's KV cache dtype (default float32)");
  return [st]() {
    const std::string text = read_text_file(st->text);
    LoadedModel lm = st->model.load();
    const std::vector<int32_t> tokens = lm.tokenizer->encode(text, /*add_special_tokens=*/false);

    // Reference: every layer's K and V in float32 (the exact path), of the same weights or of
    // --reference-model.
    const KvDtype ref_kv = parse_kv_dtype_or_throw(st->reference_kv, "--reference-kv-cache-dtype");
    if (!traits(ref_kv).concrete)
      throw InputError("--reference-kv-cache-dtype " + st->reference_kv +
                       ": name a dtype (auto is not one)");
    KvPlanOptions ref_options = st->model.plan.options();
    ref_options.kv = DtypeFlag{ref_kv, "--reference-kv-cache-dtype " + st->reference_kv};
    ref_options.k.reset();
    ref_options.v.reset();
    ref_options.skip_layers.clear();
    std::unique_ptr<Model> reference;
    if (st->reference_model.empty()) {
      reference =
          lm.model->with_plan(st->model.make_plan(ref_options), st->model.attention_backend);
    } else {
      ModelFlags rf = st->model;
      rf.plan.model = st->reference_model;
      reference = rf.load_model(make_kv_plan(load_model_config(st->reference_model), ref_options));
      if (reference->vocab_size() != lm.model->vocab_size())
        throw InputError("--reference-model " + st->reference_model + " has a vocabulary of " +
                         std::to_string(reference->vocab_size()) + " tokens; the model has " +
                         std::to_string(lm.model->vocab_size()));
    }

    std::vector<std::unique_ptr<Model>> owned;
    std::vector<EvalCandidate> candidates;
    if (!st->all_dtypes) {
      candidates.push_back({summarize_kv_plan(lm.model->plan()), lm.model.get(), ""});
    } else {
      for (const auto& t : kKvDtypeTraits) {
        if (!t.concrete) continue;
        KvPlanOptions o = st->model.plan.options();
        o.kv = DtypeFlag{t.dtype, "--all-dtypes " + std::string(t.name)};
        o.k.reset();
        o.v.reset();
        try {
          owned.push_back(lm.model->with_plan(st->model.make_plan(o), st->model.attention_backend));
          candidates.push_back({std::string(t.name), owned.back().get(), ""});
        } catch (const InputError& e) {
          candidates.push_back({std::string(t.name), nullptr, e.what()});
        }
      }
    }
    EvalOptions options;
    options.context = st->context;
    options.max_tokens = st->max_tokens;
    options.prefill_chunk = st->model.prefill_chunk;
    options.bos = lm.tokenizer->bos_id();
    const EvalReport r = evaluate_kv_dtypes(*reference, candidates, tokens, options);

    if (st->json) {
      nlohmann::json j;
      j["model"] = st->model.plan.model;
      j["text"] = st->text;
      j["predicted_tokens"] = r.predicted_tokens;
      j["windows"] = r.windows;
      j["context"] = st->context;
      j["reference"] = {{"kv_dtype", r.reference_label}, {"ppl", r.reference_ppl}};
      if (!st->reference_model.empty()) j["reference"]["model"] = st->reference_model;
      j["rows"] = nlohmann::json::array();
      for (const auto& row : r.rows) {
        nlohmann::json o = {{"kv_dtype", row.label}, {"plan", row.plan_summary}};
        if (!row.unsupported.empty()) {
          o["unsupported"] = row.unsupported;
        } else {
          o.update({{"kv_bytes_per_token", row.kv_bytes_per_token},
                    {"ratio_to_bf16", row.ratio_to_bf16},
                    {"ppl", row.ppl},
                    {"delta_ppl", row.delta_ppl},
                    {"mean_kl", row.mean_kl},
                    {"top1_agreement", row.top1_agreement}});
        }
        j["rows"].push_back(o);
      }
      std::cout << j.dump(2) << "\n";
      return 0;
    }
    std::printf("kvq eval: %s on %s: %lld predicted tokens in %d windows of <= %d tokens\n",
                st->model.plan.model.c_str(), st->text.c_str(),
                static_cast<long long>(r.predicted_tokens), r.windows, st->context);
    std::printf("reference: %s%s%s KV cache, PPL %.4f\n\n",
                st->reference_model.empty() ? "" : st->reference_model.c_str(),
                st->reference_model.empty() ? "" : " with a ", r.reference_label.c_str(),
                r.reference_ppl);
    std::printf("%-22s %11s %8s %10s %10s %10s %8s\n", "KV cache", "bytes/tok", "vs bf16", "PPL",
                "dPPL", "mean KL", "top-1");
    for (const auto& row : r.rows) {
      if (!row.unsupported.empty()) {
        std::printf("%-22s unsupported: %s\n", row.label.c_str(), row.unsupported.c_str());
        continue;
      }
      std::printf("%-22s %11zu %7.3fx %10.4f %+10.4f %10.6f %7.2f%%\n", row.label.c_str(),
                  row.kv_bytes_per_token, row.ratio_to_bf16, row.ppl, row.delta_ppl, row.mean_kl,
                  100.0 * row.top1_agreement);
    }
    return 0;
  };
}

}  // namespace kvq::cli
