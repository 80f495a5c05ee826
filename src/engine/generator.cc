#include "kvq/engine/generator.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>

#include "kvq/core/error.h"
#include "text_stream.h"

namespace kvq {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

size_t bytes_per_block(const KvPlan& plan) {
  size_t n = 0;
  for (const auto& l : plan.layers) n += l.block_bytes();
  return n;
}

// Runs the new tokens [begin, end) of a single sequence; returns logits of the last one, or of
// every one when `all_logits`. With `rule` (a model that samples on its device, last row only)
// it returns the sampled next token instead and leaves `logits` alone.
int32_t step(const Model& model, PagedKvCache& cache, SequenceId seq,
             std::span<const int32_t> tokens, int32_t first_position, bool all_logits,
             std::vector<float>& logits, const DeviceSampling* rule = nullptr) {
  const int32_t n = static_cast<int32_t>(tokens.size());
  std::vector<int64_t> slots = cache.append(seq, n);
  if (slots.empty()) throw InternalError("KV cache has no free block for the sequence");
  std::vector<int32_t> positions(static_cast<size_t>(n));
  std::iota(positions.begin(), positions.end(), first_position);
  const int32_t q_indptr[2] = {0, n};
  PagedKvCache::BlockTableStorage storage;
  const SequenceId ids[1] = {seq};
  const BlockTableView table = cache.block_table(ids, storage);
  std::vector<int32_t> rows;
  if (all_logits) {
    rows.resize(static_cast<size_t>(n));
    std::iota(rows.begin(), rows.end(), 0);
  } else {
    rows = {n - 1};
  }
  ForwardBatch batch{tokens, positions, q_indptr, slots, table, rows};
  if (rule != nullptr && !all_logits) {
    int32_t id = 0;
    model.forward_sample(batch, cache, std::span<const DeviceSampling>(rule, 1),
                         std::span<int32_t>(&id, 1));
    return id;
  }
  logits.resize(rows.size() * static_cast<size_t>(model.vocab_size()));
  model.forward(batch, cache, logits);
  return -1;
}

int32_t blocks_for_tokens(int64_t tokens, int32_t block_tokens) {
  return static_cast<int32_t>((tokens + block_tokens - 1) / block_tokens);
}

}  // namespace

int32_t model_context_length(const Model& model) {
  const int32_t n = model.plan().model.max_position_embeddings;
  return n > 0 ? n : (1 << 30);
}

GenerationResult generate(const Model& model, const Tokenizer& tokenizer,
                          std::span<const int32_t> prompt, const SamplingParams& params,
                          const GeneratorOptions& options, const TokenCallback& on_token) {
  if (auto errors = sampling_param_errors(params); !errors.empty())
    throw InputError(errors.front());
  if (prompt.empty()) throw InputError("the prompt is empty (no tokens to start from)");
  const int32_t context = model_context_length(model);
  const int32_t prompt_len = static_cast<int32_t>(prompt.size());
  if (prompt_len >= context)
    throw InputError("the prompt has " + std::to_string(prompt_len) +
                     " tokens; the model's context is " + std::to_string(context) +
                     " tokens (max_position_embeddings), and generation needs room for one more");
  for (int32_t id : prompt)
    if (id < 0 || id >= model.vocab_size())
      throw InputError("prompt token id " + std::to_string(id) +
                       " is out of range; the vocabulary has " +
                       std::to_string(model.vocab_size()) + " tokens (0-" +
                       std::to_string(model.vocab_size() - 1) + ")");
  const int32_t max_new = std::min(params.max_tokens, context - prompt_len);

  const KvPlan& plan = model.plan();
  const int32_t block_tokens = plan.layers.front().block_tokens;
  const int32_t needed = blocks_for_tokens(prompt_len + max_new, block_tokens);
  const int64_t num_blocks = options.num_blocks.value_or(needed);
  if (num_blocks < needed)
    throw InputError("the KV cache budget holds " + std::to_string(num_blocks) + " blocks (" +
                     std::to_string(static_cast<int64_t>(num_blocks) * block_tokens) +
                     " tokens); the prompt plus max tokens need " + std::to_string(needed) +
                     " blocks (" + std::to_string(prompt_len + max_new) + " tokens)");
  // A budget larger than the request needs is not allocated: one request never uses more.
  const std::unique_ptr<PagedKvCache> owned = model.create_cache(needed);
  PagedKvCache& cache = *owned;
  const SequenceId seq = 1;
  cache.add_sequence(seq);

  GenerationResult result;
  result.prompt_tokens = prompt_len;
  std::vector<float> logits;
  Sampler sampler(params);
  // A model that samples on its device returns only the next id (logits stay there).
  const bool on_device = model.samples_on_device();
  DeviceSampling rule;
  int32_t next = -1;
  const auto t0 = Clock::now();
  const int32_t chunk = std::max<int32_t>(1, options.prefill_chunk);
  for (int32_t begin = 0; begin < prompt_len; begin += chunk) {
    const int32_t end = std::min(prompt_len, begin + chunk);
    rule = sampler.device_rule(0);
    next = step(model, cache, seq,
                prompt.subspan(static_cast<size_t>(begin), static_cast<size_t>(end - begin)), begin,
                false, logits, on_device && end == prompt_len ? &rule : nullptr);
  }
  result.prefill_seconds = seconds_since(t0);

  TextStream stream(tokenizer, params);
  result.finish_reason = "length";
  const auto t1 = Clock::now();
  bool cancelled = false;
  for (int32_t i = 0; i < max_new; ++i) {
    const int32_t id = on_device ? next : sampler.sample(logits);
    result.output_ids.push_back(id);
    const TextStream::Step out = stream.push(id);
    if (on_token && out.has_text && !on_token(out.text, id)) cancelled = true;
    if (out.stop) {
      result.finish_reason = "stop";
      break;
    }
    if (cancelled || i + 1 == max_new) break;
    rule = sampler.device_rule(static_cast<uint64_t>(i) + 1);
    next = step(model, cache, seq, std::span<const int32_t>(&result.output_ids.back(), 1),
                prompt_len + i, false, logits, on_device ? &rule : nullptr);
  }
  if (result.finish_reason == "length") {
    const std::string_view rest = stream.finish();
    if (on_token && !rest.empty()) on_token(rest, -1);
  }
  result.decode_seconds = seconds_since(t1);
  result.text = stream.take_text();
  result.kv_bytes_used = cache.blocks(seq).size() * bytes_per_block(plan);
  return result;
}

void score_tokens(const Model& model, std::span<const int32_t> tokens, int32_t prefill_chunk,
                  const std::function<void(int32_t, std::span<const float>)>& on_logits) {
  const KvPlan& plan = model.plan();
  const int32_t n = static_cast<int32_t>(tokens.size());
  const int32_t block_tokens = plan.layers.front().block_tokens;
  const std::unique_ptr<PagedKvCache> owned =
      model.create_cache(blocks_for_tokens(n, block_tokens));
  PagedKvCache& cache = *owned;
  const SequenceId seq = 1;
  cache.add_sequence(seq);
  std::vector<float> logits;
  const size_t vocab = static_cast<size_t>(model.vocab_size());
  const int32_t chunk = std::max<int32_t>(1, prefill_chunk);
  for (int32_t begin = 0; begin < n; begin += chunk) {
    const int32_t end = std::min(n, begin + chunk);
    step(model, cache, seq,
         tokens.subspan(static_cast<size_t>(begin), static_cast<size_t>(end - begin)), begin, true,
         logits);
    for (int32_t p = begin; p < end; ++p)
      on_logits(
          p, std::span<const float>(logits).subspan(static_cast<size_t>(p - begin) * vocab, vocab));
  }
}

}  // namespace kvq
