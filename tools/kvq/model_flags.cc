#include "model_flags.h"

#include <omp.h>

#include <algorithm>

#include "kvq/core/error.h"
#include "kvq/core/log.h"
#include "kvq/model/cuda_model.h"
#ifdef KVQ_WITH_CUDA
#include "kvq/cache/device_kv_cache.h"
#endif

namespace kvq::cli {

void ModelFlags::add_to(CLI::App& app, bool with_synthetic) {
  plan.add_to(app, /*with_memory=*/true, with_synthetic);
  app.add_option("--attention-backend", attention_backend,
                 "force one attention backend for every layer (see kvq backends)");
  app.add_option("--device", device, "where the model runs: cpu or cuda (default cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--gpu-memory-utilization", gpu_memory_utilization,
                 "--device cuda: share of the GPU's memory kvq may use, weights and KV cache "
                 "included (default 0.9)")
      ->check(CLI::Range(0.01f, 1.0f));
  app.add_option("--dtype,--weight-dtype", weight_dtype,
                 "--device cuda: weight precision: auto (FP8 checkpoints stay FP8, float32 "
                 "ones float32, others bfloat16), bfloat16, float32, fp8 (the decoder "
                 "projections quantized at load, a scale per output row, inputs per token)")
      ->check(CLI::IsMember({"auto", "bfloat16", "bf16", "float32", "fp32", "fp8", "float8_e4m3"}));
  app.add_flag("--enforce-eager", enforce_eager, "--device cuda: no CUDA graphs for decode steps");
  app.add_option("--tensor-parallel-size", tensor_parallel_size,
                 "--device cuda: split the model over this many GPUs of this host (also -tp): "
                 "each holds its share of the heads, the MLP and the KV cache (default 1)")
      ->check(CLI::Range(1, 64));

  app.add_option("--prefill-chunk", prefill_chunk, "tokens per prefill step (default 512)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--threads", threads, "CPU threads (default: all cores)")
      ->check(CLI::Range(0, 1024));
}

KvPlan ModelFlags::make_plan(const KvPlanOptions& options) const {
  return make_kv_plan(plan.model_config(), options);
}

std::unique_ptr<Model> ModelFlags::load_model(const KvPlan& p) const {
  if (threads > 0) omp_set_num_threads(threads);
  if (device == "cpu") {
    if (tensor_parallel_size != 1)
      throw InputError("--tensor-parallel-size " + std::to_string(tensor_parallel_size) +
                       " needs --device cuda; the CPU model runs as one rank (accepted: 1)");
    if (!plan.synthetic.empty())
      throw InputError("--synthetic needs --device cuda (random weights are built on the GPU)");
    return Model::load(p, attention_backend);
  }
#ifdef KVQ_WITH_CUDA
  if (cuda_device_count() == 0)
    throw InputError("--device cuda: no CUDA device is available to this process; accepted: cpu");
  const CudaModelOptions o = cuda_options();
  if (!plan.synthetic.empty()) return CudaModel::synthetic(p, o);
  return CudaModel::load(p, o);
#else
  throw InputError("--device cuda: this kvq was built without CUDA (KVQ_CUDA=OFF); accepted: cpu");
#endif
}

#ifdef KVQ_WITH_CUDA
CudaModelOptions ModelFlags::cuda_options() const {
  CudaModelOptions o;
  o.weights = parse_weight_precision(weight_dtype, "--dtype");
  o.gpu_memory_utilization = gpu_memory_utilization;
  o.max_num_seqs = max_num_seqs;
  o.max_num_batched_tokens = max_num_batched_tokens;
  o.cuda_graphs = !enforce_eager;
  o.forced_backend = attention_backend;
  o.tensor_parallel_size = tensor_parallel_size;
  return o;
}
#endif

LoadedModel ModelFlags::load() const {
  KvPlan p = make_plan(plan.options());
  for (const auto& w : p.warnings) log_warning(w);
  LoadedModel lm;
  lm.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(plan.model));
  lm.model = load_model(p);
  return lm;
}

std::shared_ptr<Proposer> Speculation::proposer(int32_t num_blocks, int32_t max_step) const {
  switch (config.method) {
    case SpecMethod::kNgram:
      return make_ngram_proposer(config.prompt_lookup_min, config.prompt_lookup_max);
    case SpecMethod::kDraftModel:
      return make_draft_model_proposer(drafter, num_blocks, max_step);
    case SpecMethod::kDflash:
      return make_dflash_proposer(drafter, num_blocks);
  }
  throw InternalError("Speculation::proposer: unknown method");
}

size_t Speculation::drafter_block_bytes() const {
  size_t n = 0;
  if (drafter)
    for (const auto& l : drafter->plan().layers) n += l.block_bytes();
  return n;
}

std::string Speculation::summary() const {
  std::string s =
      std::string(to_string(config.method)) + " k=" + std::to_string(config.num_speculative_tokens);
  if (drafter)
    s += " (drafter " + drafter->plan().model.dir + ": " + summarize_kv_plan(drafter->plan()) + ")";
  return s;
}

std::optional<Speculation> ModelFlags::load_speculation(const Model& target,
                                                        const Tokenizer& tokenizer) const {
  std::optional<SpeculativeConfig> c = plan.speculative();
  if (!c) return std::nullopt;
  Speculation s;
  s.config = *c;
  if (c->method == SpecMethod::kDflash) {
    const KvPlan dp = plan.drafter_plan(*c);
    for (const auto& w : dp.warnings) log_warning("drafter: " + w);
#ifdef KVQ_WITH_CUDA
    if (target.device() == Device::kCuda)
      s.drafter =
          std::shared_ptr<const Model>(CudaModel::load_dflash_drafter(dp, target, cuda_options()));
#endif
    if (!s.drafter)
      s.drafter =
          std::shared_ptr<const Model>(Model::load_dflash_drafter(dp, target, attention_backend));
    const int max_k = s.drafter->arch().dflash->max_speculative_tokens;
    if (c->num_speculative_tokens > max_k)
      throw InputError("--speculative-config: num_speculative_tokens " +
                       std::to_string(c->num_speculative_tokens) + " exceeds the drafter " +
                       c->model + "'s max_speculative_tokens " + std::to_string(max_k) +
                       " (its block holds 1 + " + std::to_string(max_k) + " tokens)");
  }
  if (c->method == SpecMethod::kDraftModel) {
    const KvPlan dp = plan.drafter_plan(*c);
    if (dp.model.architecture == "KvqDFlashDrafter")
      throw InputError("--speculative-config: " + c->model +
                       " is a block-diffusion drafter (KvqDFlashDrafter); use \"method\": "
                       "\"dflash\" for it");
    for (const auto& w : dp.warnings) log_warning("drafter: " + w);
    const Tokenizer dt = Tokenizer::load(c->model);
    if (dt.vocab_size() != tokenizer.vocab_size())
      throw InputError("--speculative-config: the drafter " + c->model + "'s tokenizer has " +
                       std::to_string(dt.vocab_size()) + " tokens, the target's " +
                       std::to_string(tokenizer.vocab_size()) +
                       "; a drafter must use the target's tokenizer");
    for (int32_t id = 0; id < dt.vocab_size(); ++id)
      if (dt.id_to_token(id) != tokenizer.id_to_token(id))
        throw InputError("--speculative-config: the drafter " + c->model +
                         "'s tokenizer differs from the target's at id " + std::to_string(id) +
                         " ('" + dt.id_to_token(id).value_or("") + "' vs '" +
                         tokenizer.id_to_token(id).value_or("") +
                         "'); a drafter must use the target's tokenizer");
    s.drafter = std::shared_ptr<const Model>(load_model(dp));
    check_drafter_vocab(target, *s.drafter);
  }
  return s;
}

void SamplingFlags::add_to(CLI::App& app) {
  app.add_option("--temperature", temperature, "sampling temperature; 0 = greedy (default 0.8)");
  app.add_option("--top-k", top_k, "keep the k most likely tokens; 0 = off (default 40)");
  app.add_option("--top-p", top_p, "nucleus sampling threshold in (0, 1] (default 0.95)");
  app.add_option("--min-p", min_p, "drop tokens below min_p x the top probability (default 0.05)");
  app.add_option("--seed", seed, "random seed (default: random)");
  app.add_option("--max-tokens,-n", max_tokens, "tokens to generate at most (default 256)");
  app.add_option("--stop", stop, "stop string (repeatable); not included in the output");
  app.add_option("--stop-token-ids", stop_token_ids, "token ids that end generation (repeatable)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--ignore-eos", ignore_eos, "keep generating past end-of-sequence tokens");
}

SamplingParams SamplingFlags::params(const std::string& prefix) const {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  if (seed >= 0) p.seed = static_cast<uint64_t>(seed);
  p.max_tokens = max_tokens;
  p.stop = stop;
  p.stop_token_ids = stop_token_ids;
  p.ignore_eos = ignore_eos;
  auto errors = sampling_param_errors(p);
  if (!errors.empty()) {
    std::string e = errors.front();
    // "top_p must be ..." -> "--top-p must be ..." for the command line.
    const size_t sp = e.find(' ');
    std::string field = e.substr(0, sp);
    std::replace(field.begin(), field.end(), '_', '-');
    throw InputError(prefix + field + e.substr(sp));
  }
  return p;
}

}  // namespace kvq::cli
