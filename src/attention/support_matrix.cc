#include "kvq/attention/support_matrix.h"

#include <nlohmann/json.hpp>

#include "attention/backends.h"
#include "attention/cpu_avx512/kernel.h"
#include "attention/cuda/kv_pairs.h"
#ifdef KVQ_WITH_CUDA
#include "attention/cuda/cuda_prefill.h"
#endif

namespace kvq {

namespace {

nlohmann::json int_set_or_any(const std::vector<int>& values) {
  if (values.empty()) return "any";
  return values;
}

// Facts about a backend that its whitelists do not show.
std::string notes(const AttentionBackend& b) {
  if (b.name() == "cpu_reference") return "scalar float64 oracle";
  if (b.name() == "cuda") {
    std::vector<std::pair<KvDtype, KvDtype>> mixed(std::begin(cuda::kCudaMixedKvPairs),
                                                   std::end(cuda::kCudaMixedKvPairs));
    return "tensor-core kernels for head_dim 64/128/256 with K == V or " +
           format_dtype_pairs(mixed) +
           "; every other pair and head_dim runs the generic kernel; prefill of more than one "
           "small-q block on warpgroup MMA (wgmma) where both sides are bf16/float16/fp8_e4m3/"
           "fp8_e5m2 at head_dim 64/128 (KVQ_PREFILL_KERNEL=mma: the mma.sync kernel); "
           "verification batches (<= 32 query rows a sequence and kv head) over 8-bit, "
           "int4_per_token_head and nvfp4 caches "
           "on the verification kernel (tokens as MMA rows); long "
           "prefill steps of the CUDA model stage the step's cache once to 16 bits and run "
           "wgmma on it (fp8: the exact fp16 codes; per-token-head, 4-bit, fp32: dequantized "
           "to bf16; KVQ_PREFILL_STAGING=off: never)";
  }
  if (b.name() != "cpu_avx512") return "";
  // How int8/int4 K's logits are computed: integer dot products on the codes, or K decoded.
  auto int_dot = [](cpu_attn::Isa isa) -> std::string {
    const bool avx512 = isa == cpu_attn::Isa::kAvx512;
    switch (cpu_attn::default_k_dot(isa, KvDtype::kInt8PerTokenHead)) {
      case cpu_attn::KDot::kVnni:
        return std::string("; int8/int4 K: logits as int8 dot products on the codes (vpdpbusd, ") +
               (avx512 ? "AVX512-VNNI" : "AVX-VNNI") + ")";
      case cpu_attn::KDot::kMaddubs:
        return std::string("; int8/int4 K: logits as int8 dot products on the codes (vpmaddubsw") +
               (cpu_attn::k_dot_supported(isa, cpu_attn::KDot::kVnni) ? ", KVQ_CPU_INT_DOT=maddubs"
                                                                      : "") +
               ")";
      case cpu_attn::KDot::kFloat:
        break;
    }
    return "; int8/int4 K decoded to fp32 (KVQ_CPU_INT_DOT=0)";
  };
  // fp8_e4m3/e5m2 K and V: the scale applied after the products, or while decoding.
  const std::string fp8 = cpu_attn::default_fp8_scale_after()
                              ? "; fp8 K/V: the scale applied after the products"
                              : "; fp8 K/V: scaled while decoding (KVQ_CPU_FP8_SCALE_AFTER=0)";
  switch (cpu_attn::best_isa()) {
    case cpu_attn::Isa::kAvx512:
      return "AVX-512 kernels active on this CPU" + int_dot(cpu_attn::Isa::kAvx512) + fp8;
    case cpu_attn::Isa::kAvx2:
      return (cpu_attn::cpu_has_avx512() ? "AVX2/FMA kernels active (KVQ_CPU_ISA=avx2)"
                                         : "this CPU lacks AVX-512: AVX2/FMA kernels active") +
             int_dot(cpu_attn::Isa::kAvx2) + fp8;
    case cpu_attn::Isa::kPortable:
      break;
  }
  return cpu_attn::cpu_has_avx2() ? "the portable fallback runs (KVQ_CPU_ISA=portable)"
                                  : "this CPU lacks AVX2 and AVX-512: runs the portable fallback";
}

}  // namespace

void check_cpu_kernel_env() {
  // (The model's products read KVQ_CPU_ISA too, with the same values.)
  (void)cpu_attn::default_k_dot(cpu_attn::best_isa(), KvDtype::kInt8PerTokenHead);
  (void)cpu_attn::default_fp8_scale_after();
#ifdef KVQ_WITH_CUDA
  cuda::check_prefill_kernel_env();
#endif
}

nlohmann::json attention_support_matrix_json() {
  nlohmann::json backends = nlohmann::json::array();
  for (const AttentionBackend* b : all_attention_backends()) {
    const AttentionCapabilities& c = b->capabilities();
    nlohmann::json pairs = nlohmann::json::array();
    for (const auto& [k, v] : c.kv_dtype_pairs) pairs.push_back({to_string(k), to_string(v)});
    nlohmann::json kinds = nlohmann::json::array();
    for (AttentionKind k : c.attention_kinds) kinds.push_back(to_string(k));
    backends.push_back({{"name", b->name()},
                        {"device", to_string(c.device)},
                        {"priority", c.priority},
                        {"kv_dtype_pairs", pairs},
                        {"head_dims", int_set_or_any(c.head_dims)},
                        {"block_tokens", int_set_or_any(c.block_tokens)},
                        {"gqa_ratios", int_set_or_any(c.gqa_ratios)},
                        {"attention_kinds", kinds},
                        {"logit_soft_cap", c.logit_soft_cap},
                        {"notes", notes(*b)}});
  }
  return {{"backends", backends}};
}

std::vector<std::string> attention_support_matrix_lines() {
  std::vector<std::string> lines;
  auto set_or_any = [](const std::vector<int>& v) {
    return v.empty() ? std::string("any") : format_int_set(v);
  };
  for (const AttentionBackend* b : all_attention_backends()) {
    const AttentionCapabilities& c = b->capabilities();
    std::string head = std::string(b->name()) + " (" + std::string(to_string(c.device)) +
                       ", priority " + std::to_string(c.priority) + ")";
    if (auto n = notes(*b); !n.empty()) head += ": " + n;
    lines.push_back(head);
    lines.push_back("  dtypes:       " + format_dtype_pairs(c.kv_dtype_pairs));
    lines.push_back("  head_dim:     " + set_or_any(c.head_dims));
    lines.push_back("  block_tokens: " + set_or_any(c.block_tokens));
    lines.push_back("  attention:    " + format_attention_kinds(c.attention_kinds));
    lines.push_back("  GQA ratio:    " + set_or_any(c.gqa_ratios));
    lines.push_back(std::string("  soft-cap:     ") + (c.logit_soft_cap ? "yes" : "no"));
  }
  return lines;
}

}  // namespace kvq
