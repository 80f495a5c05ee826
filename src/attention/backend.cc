#include "kvq/attention/backend.h"

#include <algorithm>
#include <array>
#include <string>

#include "attention/backends.h"
#include "kvq/core/error.h"

namespace kvq {

namespace {

template <typename T>
bool contains(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (const auto& p : parts) {
    if (!out.empty()) out += sep;
    out += p;
  }
  return out;
}

std::string dtype_set(const std::vector<KvDtype>& dtypes) {
  std::string out = "{";
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i) out += ", ";
    out += to_string(dtypes[i]);
  }
  return out + "}";
}

// What the layer looks like, for error messages that name it.
std::string describe_layer(const LayerKvSpec& spec) {
  return "layer " + std::to_string(spec.layer) + " (K " + std::string(to_string(spec.k_dtype)) +
         ", V " + std::string(to_string(spec.v_dtype)) + ", head_dim " +
         std::to_string(spec.head_dim_k) +
         (spec.head_dim_v != spec.head_dim_k ? "/" + std::to_string(spec.head_dim_v) : "") +
         ", block_tokens " + std::to_string(spec.block_tokens) + ", " +
         std::string(to_string(spec.attention)) + ", GQA ratio " +
         std::to_string(spec.gqa_ratio()) + ")";
}

// The run-time arguments must describe the same layer as the spec the backend accepted;
// a mismatch is a bug in the caller (e.g. a cache view of another layer).
void check_args(const LayerKvSpec& spec, const AttentionArgs& a) {
  const BlockTableView& bt = a.block_table;
  KVQ_CHECK(bt.block_tokens == spec.block_tokens,
            "block table has block_tokens " + std::to_string(bt.block_tokens) + ", layer " +
                std::to_string(spec.layer) + " has " + std::to_string(spec.block_tokens));
  for (KvSide s : {KvSide::kK, KvSide::kV}) {
    const KvSideLayout want = spec.layout(s);
    const KvSideLayout& got = a.cache.layout(s);
    KVQ_CHECK(got.dtype == want.dtype && got.num_kv_heads == want.num_kv_heads &&
                  got.head_dim == want.head_dim && got.block_tokens == want.block_tokens &&
                  got.block_bytes == want.block_bytes,
              std::string("cache view ") + std::string(to_string(s)) + " side (" +
                  std::string(to_string(got.dtype)) + ") does not match layer " +
                  std::to_string(spec.layer) + "'s spec (" + std::string(to_string(want.dtype)) +
                  ")");
  }
  if (bt.num_seqs == 0) return;
  KVQ_CHECK(a.q && a.out && a.q_indptr && bt.indptr && bt.indices && bt.seq_lens &&
                a.cache.k_base && a.cache.v_base,
            "attention arguments with a null pointer");
  KVQ_CHECK(a.q_indptr[0] == 0 && bt.indptr[0] == 0, "indptr must start at 0");
  for (int32_t i = 0; i < bt.num_seqs; ++i) {
    const int32_t q_len = a.q_indptr[i + 1] - a.q_indptr[i];
    const int32_t kv_len = bt.seq_lens[i];
    const int32_t blocks = bt.indptr[i + 1] - bt.indptr[i];
    KVQ_CHECK(q_len >= 0 && q_len <= kv_len, "sequence " + std::to_string(i) + " has " +
                                                 std::to_string(q_len) + " queries but only " +
                                                 std::to_string(kv_len) + " cached tokens");
    KVQ_CHECK(blocks >= 0 && static_cast<int64_t>(blocks) * bt.block_tokens >= kv_len,
              "sequence " + std::to_string(i) + " holds " + std::to_string(kv_len) +
                  " tokens in only " + std::to_string(blocks) + " blocks");
    for (int32_t b = bt.indptr[i]; b < bt.indptr[i + 1]; ++b)
      KVQ_CHECK(bt.indices[b] >= 0 && bt.indices[b] < a.cache.num_blocks,
                "sequence " + std::to_string(i) + " uses block " + std::to_string(bt.indices[b]) +
                    ", the cache view has " + std::to_string(a.cache.num_blocks));
  }
}

}  // namespace

std::string format_int_set(const std::vector<int>& values) {
  std::string out = "{";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + "}";
}

std::string format_dtype_pairs(const std::vector<std::pair<KvDtype, KvDtype>>& pairs) {
  std::vector<KvDtype> ks, vs;
  for (const auto& [k, v] : pairs) {
    if (!contains(ks, k)) ks.push_back(k);
    if (!contains(vs, v)) vs.push_back(v);
  }
  if (ks.size() * vs.size() == pairs.size())
    return "K x V in " + dtype_set(ks) + " x " + dtype_set(vs);
  std::string out = "(K, V) in {";
  for (size_t i = 0; i < pairs.size(); ++i) {
    if (i) out += ", ";
    out += "(" + std::string(to_string(pairs[i].first)) + ", " +
           std::string(to_string(pairs[i].second)) + ")";
  }
  return out + "}";
}

std::string format_attention_kinds(const std::vector<AttentionKind>& kinds) {
  std::string out = "{";
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (i) out += ", ";
    out += to_string(kinds[i]);
  }
  return out + "}";
}

std::vector<std::string> AttentionBackend::reasons_unsupported(const LayerKvSpec& spec) const {
  const AttentionCapabilities& caps = capabilities();
  // An inconsistent spec is never runnable; its own errors say why.
  std::vector<std::string> reasons = spec.validation_errors();

  if (!contains(caps.kv_dtype_pairs, std::pair{spec.k_dtype, spec.v_dtype}))
    reasons.push_back("(K, V) dtypes (" + std::string(to_string(spec.k_dtype)) + ", " +
                      std::string(to_string(spec.v_dtype)) + ") not supported; accepts " +
                      format_dtype_pairs(caps.kv_dtype_pairs));
  if (!caps.head_dims.empty()) {
    const bool k_ok = contains(caps.head_dims, spec.head_dim_k);
    const bool v_ok = contains(caps.head_dims, spec.head_dim_v);
    if (spec.head_dim_k == spec.head_dim_v) {
      if (!k_ok)
        reasons.push_back("head_dim " + std::to_string(spec.head_dim_k) + " not in " +
                          format_int_set(caps.head_dims));
    } else {
      if (!k_ok)
        reasons.push_back("K head_dim " + std::to_string(spec.head_dim_k) + " not in " +
                          format_int_set(caps.head_dims));
      if (!v_ok)
        reasons.push_back("V head_dim " + std::to_string(spec.head_dim_v) + " not in " +
                          format_int_set(caps.head_dims));
    }
  }
  if (!caps.block_tokens.empty() && !contains(caps.block_tokens, spec.block_tokens))
    reasons.push_back("block_tokens " + std::to_string(spec.block_tokens) + " not in " +
                      format_int_set(caps.block_tokens));
  if (!contains(caps.attention_kinds, spec.attention))
    reasons.push_back("attention kind " + std::string(to_string(spec.attention)) + " not in " +
                      format_attention_kinds(caps.attention_kinds));
  if (!caps.gqa_ratios.empty() && !contains(caps.gqa_ratios, spec.gqa_ratio()))
    reasons.push_back("GQA ratio " + std::to_string(spec.gqa_ratio()) + " not in " +
                      format_int_set(caps.gqa_ratios));

  for (auto& r : extra_reasons(spec)) reasons.push_back(std::move(r));
  return reasons;
}

std::vector<std::string> AttentionBackend::reasons_unsupported(const LayerKvSpec& spec,
                                                               Device device) const {
  std::vector<std::string> reasons;
  if (capabilities().device != device)
    reasons.push_back("runs on " + std::string(to_string(capabilities().device)) + ", not " +
                      std::string(to_string(device)));
  for (auto& r : reasons_unsupported(spec)) reasons.push_back(std::move(r));
  return reasons;
}

void AttentionBackend::run(const LayerKvSpec& spec, const AttentionArgs& args) const {
  if (auto reasons = reasons_unsupported(spec); !reasons.empty())
    throw InternalError("attention backend " + std::string(name()) + " was handed " +
                        describe_layer(spec) +
                        ", which it does not support: " + join(reasons, "; "));
  KVQ_CHECK(args.logit_soft_cap == 0.0f || capabilities().logit_soft_cap,
            std::string(name()) + " was handed a logit soft-cap it does not support");
  check_args(spec, args);
  run_impl(spec, args);
}

std::span<const AttentionBackend* const> all_attention_backends() {
  // Highest priority first (a test checks the order against capabilities().priority).
#ifdef KVQ_WITH_CUDA
  static const std::array<const AttentionBackend*, 3> kBackends = {
      &cuda_decode_backend(), &cpu_avx512_backend(), &cpu_reference_backend()};
#else
  static const std::array<const AttentionBackend*, 2> kBackends = {&cpu_avx512_backend(),
                                                                   &cpu_reference_backend()};
#endif
  return kBackends;
}

const AttentionBackend* find_attention_backend(std::string_view name) {
  for (const AttentionBackend* b : all_attention_backends())
    if (b->name() == name) return b;
  return nullptr;
}

BackendChoice select_attention_backend(const LayerKvSpec& spec, Device device,
                                       std::string_view forced) {
  BackendChoice choice;
  if (!forced.empty()) {
    const AttentionBackend* b = find_attention_backend(forced);
    if (!b) {
      std::string valid;
      for (const AttentionBackend* c : all_attention_backends()) {
        if (!valid.empty()) valid += ", ";
        valid += c->name();
      }
      throw InputError("--attention-backend: unknown backend '" + std::string(forced) +
                       "'; valid: " + valid);
    }
    if (auto reasons = b->reasons_unsupported(spec, device); !reasons.empty())
      throw InputError("--attention-backend " + std::string(forced) + " cannot run " +
                       describe_layer(spec) + ": " + join(reasons, "; "));
    choice.backend = b;
    for (const AttentionBackend* c : all_attention_backends())
      if (c != b)
        choice.passed_over.push_back(
            {std::string(c->name()), {"--attention-backend " + std::string(forced) + " given"}});
    return choice;
  }

  for (const AttentionBackend* b : all_attention_backends()) {
    auto reasons = b->reasons_unsupported(spec, device);
    if (reasons.empty() && !choice.backend) {
      choice.backend = b;
      continue;
    }
    if (reasons.empty()) reasons.push_back("lower priority");
    choice.passed_over.push_back({std::string(b->name()), std::move(reasons)});
  }
  if (!choice.backend) {
    std::string msg = "no " + std::string(to_string(device)) + " attention backend can run " +
                      describe_layer(spec) + ":";
    for (const auto& [n, reasons] : choice.passed_over)
      msg += " [" + n + ": " + join(reasons, "; ") + "]";
    throw InputError(msg);
  }
  return choice;
}

}  // namespace kvq
