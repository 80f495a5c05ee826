#include "kvq/engine/generator.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>

#include "kvq/core/error.h"
#include "text_stream.h"
#include "verify.h"

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

// One forward pass of a single sequence: `tokens` appended at positions from `first_position`,
// logits for its last `num_rows` tokens, and the proposer's target features when it wants them.
struct SingleSequencePass {
  std::vector<int64_t> slots;
  std::vector<int32_t> positions, rows;
  int32_t q_indptr[2] = {0, 0};
  SequenceId ids[1] = {0};
  PagedKvCache::BlockTableStorage storage;
  std::vector<float> captured;
  ForwardBatch batch;
  const Model* target = nullptr;
  bool capturing = false;

  SingleSequencePass(const Model& model, PagedKvCache& cache, SequenceId seq,
                     std::span<const int32_t> tokens, int32_t first_position, int32_t num_rows,
                     const Proposer* features_to) {
    const int32_t n = static_cast<int32_t>(tokens.size());
    target = &model;
    slots = cache.append(seq, n);
    if (slots.empty()) throw InternalError("KV cache has no free block for the sequence");
    positions.resize(static_cast<size_t>(n));
    std::iota(positions.begin(), positions.end(), first_position);
    q_indptr[1] = n;
    ids[0] = seq;
    rows.resize(static_cast<size_t>(num_rows));
    std::iota(rows.begin(), rows.end(), n - num_rows);
    batch = ForwardBatch{tokens, positions, q_indptr, slots, cache.block_table(ids, storage), rows};
    if (features_to != nullptr && !features_to->target_layers().empty()) {
      batch.capture_layers = features_to->target_layers();
      capturing = true;
      // A drafter on the target's GPU reads the features there (no trip through the host).
      batch.capture_on_device =
          model.keeps_captures_on_device() && features_to->features_on_device(model);
      if (!batch.capture_on_device) {
        captured.resize(static_cast<size_t>(n) * batch.capture_layers.size() *
                        static_cast<size_t>(model.arch().hidden_size));
        batch.captured = captured;
      }
    }
  }
  // `batch` points into the members: the object never moves.
  SingleSequencePass(const SingleSequencePass&) = delete;
  SingleSequencePass& operator=(const SingleSequencePass&) = delete;

  // The features of the first n tokens to the proposer (when captured).
  void hand_features(Proposer* to, SequenceId seq, int32_t n) const {
    if (to == nullptr || !capturing) return;
    const Proposer::KeptRows kept[1] = {{static_cast<uint64_t>(seq), positions.front(), n, 0}};
    to->on_target_features(*target, kept, captured);
  }
};

// Runs the new tokens of a single sequence; fills `logits` with every token's row when
// `all_logits` (otherwise no logits are computed).
void step(const Model& model, PagedKvCache& cache, SequenceId seq, std::span<const int32_t> tokens,
          int32_t first_position, bool all_logits, std::vector<float>& logits,
          Proposer* features_to = nullptr) {
  const int32_t n = static_cast<int32_t>(tokens.size());
  SingleSequencePass pass(model, cache, seq, tokens, first_position, all_logits ? n : 0,
                          features_to);
  logits.resize(pass.rows.size() * static_cast<size_t>(model.vocab_size()));
  if (features_to != nullptr) features_to->before_target_pass(model);
  model.forward(pass.batch, cache, logits);
  pass.hand_features(features_to, seq, n);
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
  const int32_t chunk = std::max<int32_t>(1, options.prefill_chunk);
  const auto t0 = Clock::now();
  // Every prompt chunk but the last needs no logits; the last one is the first step below, which
  // like every step runs what the cache lacks (plus any drafts) and yields at least one token.
  int32_t computed = 0;
  const bool speculate =
      options.proposer != nullptr && options.num_speculative_tokens > 0 && params.speculate;
  Proposer* features_to = speculate ? options.proposer : nullptr;
  // The proposer keeps per-sequence state (a drafter's cache, context rows waiting for its next
  // pass) under this call's sequence id: dropped when the call ends, however it ends, so the
  // next call with the same proposer starts clean.
  struct ReleaseAtExit {
    Proposer* p;
    uint64_t seq;
    ~ReleaseAtExit() {
      try {
        if (p != nullptr) p->release(seq);
      } catch (...) {  // never from a destructor; the proposer's next use re-checks its state
      }
    }
  } release_at_exit{options.proposer, static_cast<uint64_t>(seq)};
  if (options.proposer != nullptr) options.proposer->release(static_cast<uint64_t>(seq));
  for (; prompt_len - computed > chunk; computed += chunk)
    step(model, cache, seq,
         prompt.subspan(static_cast<size_t>(computed), static_cast<size_t>(chunk)), computed, false,
         logits, features_to);

  TextStream stream(tokenizer, params);
  result.finish_reason = "length";
  auto t1 = Clock::now();
  bool cancelled = false, done = false;
  std::vector<int32_t> tokens(prompt.begin(), prompt.end());
  Draft draft;
  std::vector<PassResult> results;
  while (!done) {
    const int32_t generated = static_cast<int32_t>(result.output_ids.size());
    const int32_t len = static_cast<int32_t>(tokens.size());
    draft.tokens.clear();
    draft.q.clear();
    // No drafts on the prompt's step; at most what max tokens leaves after the target's own.
    if (speculate && generated > 0) {
      const DraftRequest req{
          1, tokens, std::min(options.num_speculative_tokens, max_new - generated - 1), &sampler};
      if (req.max_drafts > 0) options.proposer->propose({&req, 1}, {&draft, 1});
    }
    std::vector<int32_t> run(tokens.begin() + computed, tokens.end());
    run.insert(run.end(), draft.tokens.begin(), draft.tokens.end());
    // One row per draft plus the row of the last kept token.
    const SingleSequencePass pass(model, cache, seq, run, computed,
                                  static_cast<int32_t>(draft.tokens.size()) + 1, features_to);
    const PassSequence ps{&sampler, static_cast<uint64_t>(generated), draft.tokens, draft.q, false,
                          0};
    if (features_to != nullptr) features_to->before_target_pass(model);
    forward_and_accept(model, pass.batch, cache, {&ps, 1}, results, logits);
    const Verified& v = results.front().verified;
    // The rejected drafts' K/V are rolled back: the cache holds every kept token but the last;
    // the target's features of the kept positions go to the proposer.
    pass.hand_features(features_to, seq, len + v.accepted - computed);
    computed = len + v.accepted;
    cache.truncate(seq, computed);
    if (!draft.tokens.empty()) {
      result.spec.drafted += static_cast<int64_t>(draft.tokens.size());
      result.spec.accepted += v.accepted;
      result.spec.verify_steps += 1;
      result.spec.emitted += static_cast<int64_t>(v.tokens.size());
    }
    if (generated == 0) {
      result.prefill_seconds = seconds_since(t0);
      t1 = Clock::now();
    }
    for (int32_t id : v.tokens) {
      tokens.push_back(id);
      result.output_ids.push_back(id);
      const TextStream::Step out = stream.push(id);
      if (on_token && out.has_text && !on_token(out.text, id)) cancelled = true;
      if (out.stop) {
        result.finish_reason = "stop";
        done = true;
        break;
      }
      if (cancelled || static_cast<int32_t>(result.output_ids.size()) == max_new) {
        done = true;
        break;
      }
    }
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
