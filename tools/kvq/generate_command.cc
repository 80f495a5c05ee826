// kvq generate: stream a completion to stdout, then a one-line summary on stderr.
#include <charconv>
#include <cstdio>
#include <iostream>
#include <memory>

#include "commands.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/core/log.h"
#include "kvq/engine/generator.h"
#include "model_flags.h"

namespace kvq::cli {

namespace {

std::vector<int32_t> parse_ids(const std::string& text, const char* flag) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    int32_t v = 0;
    auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || p != item.data() + item.size() || v < 0)
      throw InputError(std::string(flag) + ": cannot parse '" + item +
                       "' as a token id; accepted: comma-separated non-negative integers (1,2,3)");
    ids.push_back(v);
    pos = comma + 1;
  }
  return ids;
}

}  // namespace

Action add_generate_command(CLI::App& app) {
  auto* sub = app.add_subcommand("generate", "generate text from a prompt");
  struct State {
    ModelFlags model;
    SamplingFlags sampling;
    std::string prompt;
    bool prompt_given = false;
    std::string prompt_ids;
    bool output_ids = false;
  };
  auto st = std::make_shared<State>();
  st->model.add_to(*sub);
  st->model.plan.add_speculative_to(*sub);
  st->sampling.add_to(*sub);
  auto* prompt = sub->add_option("--prompt", st->prompt, "prompt text (\"\" = BOS only)");
  auto* ids = sub->add_option("--prompt-ids", st->prompt_ids, "prompt as token ids: 1,2,3");
  prompt->excludes(ids);
  sub->add_flag("--output-ids", st->output_ids, "print the generated token ids instead of text");
  return [st, prompt, ids]() {
    if (prompt->count() == 0 && ids->count() == 0)
      throw InputError("generate needs --prompt TEXT or --prompt-ids 1,2,3");
    const SamplingParams params = st->sampling.params("--");
    LoadedModel lm = st->model.load();
    std::vector<int32_t> prompt_ids;
    if (ids->count() > 0) {
      prompt_ids = parse_ids(st->prompt_ids, "--prompt-ids");
    } else {
      prompt_ids = lm.tokenizer->encode(st->prompt, /*add_special_tokens=*/true);
      if (prompt_ids.empty() && lm.tokenizer->bos_id())
        prompt_ids.push_back(*lm.tokenizer->bos_id());
    }
    GeneratorOptions options;
    options.prefill_chunk = st->model.prefill_chunk;
    if (!st->model.plan.kv_cache_memory.empty())
      options.num_blocks =
          blocks_for_budget(lm.model->plan().layers,
                            parse_byte_size(st->model.plan.kv_cache_memory, "--kv-cache-memory"));
    const std::optional<Speculation> spec = st->model.load_speculation(*lm.model, *lm.tokenizer);
    std::shared_ptr<Proposer> proposer;
    if (spec) {
      // The drafter's cache holds what the target's holds, plus the drafts.
      const int32_t bt = lm.model->plan().layers.front().block_tokens;
      const int64_t tokens = static_cast<int64_t>(prompt_ids.size()) + params.max_tokens +
                             spec->config.num_speculative_tokens + 1;
      proposer = spec->proposer(static_cast<int32_t>((tokens + bt - 1) / bt),
                                st->model.max_num_batched_tokens);
      options.proposer = proposer.get();
      options.num_speculative_tokens = spec->config.num_speculative_tokens;
    }
    const bool text_out = !st->output_ids;
    GenerationResult r = generate(*lm.model, *lm.tokenizer, prompt_ids, params, options,
                                  [text_out](std::string_view piece, int32_t) {
                                    if (text_out && !piece.empty()) {
                                      std::fwrite(piece.data(), 1, piece.size(), stdout);
                                      std::fflush(stdout);
                                    }
                                    return true;
                                  });
    if (st->output_ids) {
      for (size_t i = 0; i < r.output_ids.size(); ++i)
        std::printf("%s%d", i ? " " : "", r.output_ids[i]);
    }
    std::printf("\n");
    std::fflush(stdout);
    const double gen = static_cast<double>(r.output_ids.size());
    std::fprintf(
        stderr,
        "kvq: prompt %d tokens, generated %zu tokens (%s) | prefill %.1f tok/s, decode %.1f "
        "tok/s | KV %.1f KiB used | plan: %s\n",
        r.prompt_tokens, r.output_ids.size(), r.finish_reason.c_str(),
        r.prefill_seconds > 0 ? r.prompt_tokens / r.prefill_seconds : 0.0,
        r.decode_seconds > 0 && gen > 1 ? (gen - 1) / r.decode_seconds : 0.0,
        static_cast<double>(r.kv_bytes_used) / 1024.0, summarize_kv_plan(lm.model->plan()).c_str());
    if (spec)
      std::fprintf(stderr,
                   "kvq: speculative %s | drafted %lld, accepted %lld (%.1f%%), mean accepted "
                   "length %.2f tokens per verify step (%lld steps)\n",
                   spec->summary().c_str(), static_cast<long long>(r.spec.drafted),
                   static_cast<long long>(r.spec.accepted), 100.0 * r.spec.acceptance_rate(),
                   r.spec.mean_accepted_length(), static_cast<long long>(r.spec.verify_steps));
    return 0;
  };
}

}  // namespace kvq::cli
