// `kvq plan` output: the JSON document (schema in docs/CLI.md) and the table.
#include <algorithm>
#include <cstdio>
#include <sstream>

#include "kvq/plan/kv_plan.h"

namespace kvq {

namespace {

using nlohmann::json;

json scale_json(const ScaleSource& s) {
  json j = {{"source", to_string(s.kind)}};
  j["tensor"] = s.tensor.empty() ? json(nullptr) : json(s.tensor);
  j["values"] = s.values;
  return j;
}

json side_json(const LayerKvSpec& spec, KvSide side, const SideDecision& d) {
  const KvDtype dt = spec.dtype(side);
  return {{"dtype", to_string(dt)},
          {"quantized", is_quantized(dt)},
          {"scale", scale_json(spec.scale(side))},
          {"provenance", to_string(d.provenance)},
          {"detail", d.detail},
          {"bytes_per_token",
           static_cast<size_t>(spec.num_kv_heads) *
               (row_data_bytes(dt, spec.head_dim(side)) + row_scale_bytes(dt))}};
}

std::string scale_text(const ScaleSource& s) {
  switch (s.kind) {
    case ScaleSourceKind::kNone: return "-";
    case ScaleSourceKind::kDynamic: return "dynamic";
    case ScaleSourceKind::kDefaultOne: return "1.0 default";
    case ScaleSourceKind::kCheckpoint: {
      if (s.values.size() != 1) return "ckpt per-head";
      char buf[32];
      std::snprintf(buf, sizeof buf, "ckpt %.4g", static_cast<double>(s.values[0]));
      return buf;
    }
  }
  return "?";
}

std::string provenance_text(const SideDecision& d) {
  return std::string(to_string(d.provenance)) + " (" + d.detail + ")";
}

std::string pad(std::string s, size_t w) {
  if (s.size() < w) s.append(w - s.size(), ' ');
  return s;
}

}  // namespace

json kv_plan_to_json(const KvPlan& plan) {
  const ModelConfig& m = plan.model;
  json j;
  j["kvq_plan_version"] = 1;
  j["model"] = {{"path", m.dir},
                {"architecture", m.architecture},
                {"model_type", m.model_type},
                {"num_layers", m.num_layers},
                {"num_attention_heads", m.num_q_heads},
                {"num_kv_heads", m.num_kv_heads},
                {"head_dim", m.head_dim},
                {"dtype", to_string(m.model_dtype)},
                {"sliding_window", m.sliding_window > 0 ? json(m.sliding_window) : json(nullptr)}};
  j["block_tokens"] = plan.layers.empty() ? 0 : plan.layers.front().block_tokens;
  json layers = json::array();
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const auto& s = plan.layers[i];
    const auto& d = plan.decisions[i];
    layers.push_back({{"layer", s.layer},
                      {"attention", to_string(s.attention)},
                      {"sliding_window", s.sliding_window > 0 ? json(s.sliding_window) : json(nullptr)},
                      {"num_q_heads", s.num_q_heads},
                      {"num_kv_heads", s.num_kv_heads},
                      {"head_dim", s.head_dim_k},
                      {"k", side_json(s, KvSide::kK, d.k)},
                      {"v", side_json(s, KvSide::kV, d.v)},
                      {"bytes_per_token", s.bytes_per_token()},
                      {"block_bytes", s.block_bytes()}});
  }
  j["layers"] = std::move(layers);
  const size_t bpt = plan.bytes_per_token(), bf16 = plan.bf16_bytes_per_token();
  j["totals"] = {{"kv_bytes_per_token", bpt},
                 {"bf16_kv_bytes_per_token", bf16},
                 {"ratio_to_bf16", bf16 ? static_cast<double>(bpt) / static_cast<double>(bf16) : 0.0},
                 {"tokens_per_gib", bpt ? (size_t{1} << 30) / bpt : 0}};
  j["warnings"] = plan.warnings;
  j["notes"] = plan.notes;
  return j;
}

std::string format_kv_plan(const KvPlan& plan) {
  const ModelConfig& m = plan.model;
  std::ostringstream o;
  o << "model: " << m.dir << " (" << (m.architecture.empty() ? "?" : m.architecture) << ", "
    << m.num_layers << " layers, " << m.num_q_heads << " query / " << m.num_kv_heads
    << " kv heads, head_dim " << m.head_dim << ", " << to_string(m.model_dtype);
  if (m.sliding_window > 0) o << ", sliding window " << m.sliding_window;
  o << ")\n";
  o << "block size: " << (plan.layers.empty() ? 0 : plan.layers.front().block_tokens)
    << " tokens\n\n";
  const size_t w[] = {6, 16, 20, 20, 14, 14, 12};
  o << pad("layer", w[0]) << pad("attention", w[1]) << pad("K dtype", w[2]) << pad("V dtype", w[3])
    << pad("K scale", w[4]) << pad("V scale", w[5]) << pad("bytes/token", w[6]) << "provenance\n";
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const auto& s = plan.layers[i];
    const auto& d = plan.decisions[i];
    std::string attn(to_string(s.attention));
    if (s.attention == AttentionKind::kSlidingWindow) attn = "sliding(" + std::to_string(s.sliding_window) + ")";
    std::string prov = provenance_text(d.k) == provenance_text(d.v)
                           ? provenance_text(d.k)
                           : "K: " + provenance_text(d.k) + "; V: " + provenance_text(d.v);
    o << pad(std::to_string(s.layer), w[0]) << pad(attn, w[1])
      << pad(std::string(to_string(s.k_dtype)), w[2]) << pad(std::string(to_string(s.v_dtype)), w[3])
      << pad(scale_text(s.k_scale), w[4]) << pad(scale_text(s.v_scale), w[5])
      << pad(std::to_string(s.bytes_per_token()), w[6]) << prov << "\n";
  }
  const size_t bpt = plan.bytes_per_token(), bf16 = plan.bf16_bytes_per_token();
  char ratio[32];
  std::snprintf(ratio, sizeof ratio, "%.3f", bf16 ? static_cast<double>(bpt) / static_cast<double>(bf16) : 0.0);
  o << "\ntotals: " << bpt << " KV bytes/token, " << (bpt ? (size_t{1} << 30) / bpt : 0)
    << " tokens/GiB, " << ratio << "x the bytes of a bfloat16 cache (" << bf16 << " bytes/token)\n";
  for (const auto& n : plan.notes) o << "note: " << n << "\n";
  return o.str();
}

std::string summarize_kv_plan(const KvPlan& plan) {
  // Group layers by (K dtype, V dtype) in order of first appearance.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (const auto& s : plan.layers) {
    std::string key = s.k_dtype == s.v_dtype
                          ? std::string(to_string(s.k_dtype))
                          : "K " + std::string(to_string(s.k_dtype)) + " / V " + std::string(to_string(s.v_dtype));
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
    if (it == groups.end()) groups.push_back({key, {s.layer}});
    else it->second.push_back(s.layer);
  }
  std::string out;
  for (const auto& [key, layers] : groups) {
    if (!out.empty()) out += ", ";
    out += key + " x" + std::to_string(layers.size());
  }
  const size_t bpt = plan.bytes_per_token(), bf16 = plan.bf16_bytes_per_token();
  char tail[96];
  std::snprintf(tail, sizeof tail, " | %zu KV bytes/token (%.2fx bf16)", bpt,
                bf16 ? static_cast<double>(bpt) / static_cast<double>(bf16) : 0.0);
  return out + tail;
}

}  // namespace kvq
