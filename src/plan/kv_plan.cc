#include "kvq/plan/kv_plan.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "kvq/core/error.h"
#include "kvq/core/json_text.h"
#include "kvq/io/safetensors.h"

namespace kvq {

namespace {

using nlohmann::json;

constexpr std::string_view kSkipFlag = "--kv-cache-dtype-skip-layers";

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t')) --e;
  return std::string(s.substr(b, e - b));
}

std::optional<int> parse_nonneg_int(std::string_view s) {
  if (s.empty() || s.size() > 9) return std::nullopt;
  int v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

// "0-2, 4" style list of layer indices.
std::string format_layer_list(const std::vector<int>& layers) {
  std::string out;
  for (size_t i = 0; i < layers.size();) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(layers[i]);
    if (j > i) out += "-" + std::to_string(layers[j]);
    i = j + 1;
  }
  return out;
}

float dtype_max(KvDtype d) {
  switch (d) {
    case KvDtype::kFp8E4M3:
      return 448.0f;
    case KvDtype::kFp8E5M2:
      return 57344.0f;
    case KvDtype::kNvfp4:
      return 6.0f * 448.0f;
    default:
      return 0.0f;
  }
}

std::optional<CheckpointKvScheme> scheme_from_modelopt_algo(const json& algo,
                                                            const std::string& where) {
  if (algo.is_null()) return std::nullopt;
  CheckpointKvScheme s;
  const std::string a = algo.is_string() ? algo.get<std::string>() : algo.dump();
  s.description = where + " kv_cache_quant_algo " + a;
  if (a == "FP8") {
    s.dtype = KvDtype::kFp8E4M3;
  } else if (a == "NVFP4") {
    s.dtype = KvDtype::kNvfp4;
  } else {
    s.unsupported =
        where + ": kv_cache_quant_algo '" + a + "' is not supported by kvq; supported: FP8, NVFP4";
  }
  return s;
}

// Scale tensors a checkpoint may carry for (layer, side), in the order they are tried.
std::vector<std::string> scale_tensor_names(int layer, KvSide side) {
  const std::string p = "model.layers." + std::to_string(layer) + ".self_attn.";
  const std::string s = side == KvSide::kK ? "k" : "v";
  return {p + s + "_scale", p + s + "_proj." + s + "_scale", p + "attn." + s + "_scale",
          p + "kv_scale"};
}

}  // namespace

std::optional<CheckpointKvScheme> read_checkpoint_kv_scheme(const ModelConfig& config) {
  const json& raw = config.raw;
  const std::string cfg = config.dir.empty()
                              ? std::string("config.json")
                              : (std::filesystem::path(config.dir) / "config.json").string();
  if (raw.contains("quantization_config") && raw["quantization_config"].is_object()) {
    const json& q = raw["quantization_config"];
    if (q.contains("kv_cache_scheme") && !q["kv_cache_scheme"].is_null()) {
      const json& k = q["kv_cache_scheme"];
      CheckpointKvScheme s;
      const std::string type = k.is_object() && k.contains("type") && k["type"].is_string()
                                   ? k["type"].get<std::string>()
                                   : "?";
      const int bits = k.is_object() && k.contains("num_bits") && k["num_bits"].is_number_integer()
                           ? k["num_bits"].get<int>()
                           : -1;
      const std::string strategy =
          k.is_object() && k.contains("strategy") && k["strategy"].is_string()
              ? k["strategy"].get<std::string>()
              : "tensor";
      const bool dynamic = k.is_object() && k.contains("dynamic") && k["dynamic"] != false &&
                           !k["dynamic"].is_null();
      s.description = "config.json quantization_config.kv_cache_scheme (" + type + ", " +
                      std::to_string(bits) + " bits, " + strategy + ")";
      if (type == "float" && bits == 8 && !dynamic &&
          (strategy == "tensor" || strategy == "attn_head")) {
        s.dtype = KvDtype::kFp8E4M3;
        s.per_head_scales = strategy == "attn_head";
      } else {
        s.unsupported = cfg + ": quantization_config.kv_cache_scheme {type " + type +
                        ", num_bits " + std::to_string(bits) + ", strategy " + strategy +
                        (dynamic ? ", dynamic" : "") +
                        "} is not supported by kvq; supported: type float, num_bits 8, strategy "
                        "tensor or attn_head, static scales; or choose a dtype with "
                        "--kv-cache-dtype";
      }
      return s;
    }
    if (q.contains("kv_cache_quant_algo"))
      return scheme_from_modelopt_algo(q["kv_cache_quant_algo"], "config.json quantization_config");
  }
  if (!config.dir.empty()) {
    const auto path = std::filesystem::path(config.dir) / "hf_quant_config.json";
    if (std::filesystem::exists(path)) {
      const json j = parse_json_file(path.string());
      if (j.is_object() && j.contains("quantization") && j["quantization"].is_object() &&
          j["quantization"].contains("kv_cache_quant_algo"))
        return scheme_from_modelopt_algo(j["quantization"]["kv_cache_quant_algo"],
                                         "hf_quant_config.json");
    }
  }
  return std::nullopt;
}

std::vector<bool> parse_skip_layers(std::string_view spec, const ModelConfig& config) {
  std::vector<bool> skip(static_cast<size_t>(config.num_layers), false);
  const std::string accepted =
      "accepted: comma-separated layer indices (3), ranges (0-3), sliding_window, boundary:N";
  const std::string flag(kSkipFlag);
  auto check_index = [&](int i) {
    if (i >= config.num_layers)
      throw InputError(flag + ": layer " + std::to_string(i) + " is out of range; the model has " +
                       std::to_string(config.num_layers) + " layers (0-" +
                       std::to_string(config.num_layers - 1) + ")");
  };
  std::string_view rest = spec;
  while (true) {
    const size_t comma = rest.find(',');
    const std::string item = trim(rest.substr(0, comma));
    if (item.empty())
      throw InputError(flag + ": empty item in '" + std::string(spec) + "'; " + accepted);
    if (item == "sliding_window") {
      for (int i = 0; i < config.num_layers; ++i)
        if (config.layer_attention[static_cast<size_t>(i)] == AttentionKind::kSlidingWindow)
          skip[static_cast<size_t>(i)] = true;
    } else if (item.rfind("boundary:", 0) == 0) {
      auto n = parse_nonneg_int(std::string_view(item).substr(9));
      if (!n || *n == 0)
        throw InputError(flag + ": cannot parse '" + item + "' (boundary:N needs N >= 1); " +
                         accepted);
      for (int i = 0; i < config.num_layers; ++i)
        if (i < *n || i >= config.num_layers - *n) skip[static_cast<size_t>(i)] = true;
    } else if (auto dash = item.find('-'); dash != std::string::npos) {
      auto a = parse_nonneg_int(trim(std::string_view(item).substr(0, dash)));
      auto b = parse_nonneg_int(trim(std::string_view(item).substr(dash + 1)));
      if (!a || !b || *a > *b)
        throw InputError(flag + ": cannot parse range '" + item + "' (expected a-b with a <= b); " +
                         accepted);
      check_index(*b);
      for (int i = *a; i <= *b; ++i) skip[static_cast<size_t>(i)] = true;
    } else if (auto i = parse_nonneg_int(item)) {
      check_index(*i);
      skip[static_cast<size_t>(*i)] = true;
    } else {
      throw InputError(flag + ": cannot parse '" + item + "'; " + accepted);
    }
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return skip;
}

size_t KvPlan::bytes_per_token() const {
  size_t n = 0;
  for (const auto& l : layers) n += l.bytes_per_token();
  return n;
}

size_t KvPlan::bf16_bytes_per_token() const {
  size_t n = 0;
  for (auto l : layers) {
    l.k_dtype = l.v_dtype = KvDtype::kBFloat16;
    n += l.bytes_per_token();
  }
  return n;
}

KvPlan make_kv_plan(const ModelConfig& config, const KvPlanOptions& options) {
  KvPlan plan;
  plan.model = config;
  plan.warnings = config.warnings;
  if (options.block_tokens <= 0 || options.block_tokens > 4096)
    throw InputError(
        "--block-size: " + std::to_string(options.block_tokens) +
        " is out of range; accepted: 1 to 4096 tokens (16 or 32 for the fast backends)");

  const std::vector<bool> skip = options.skip_layers.empty()
                                     ? std::vector<bool>(static_cast<size_t>(config.num_layers))
                                     : parse_skip_layers(options.skip_layers, config);
  const std::optional<CheckpointKvScheme> scheme = read_checkpoint_kv_scheme(config);
  const std::string model_detail = "model dtype " + std::string(to_string(config.model_dtype));
  bool scheme_used = false;

  for (int i = 0; i < config.num_layers; ++i) {
    LayerKvSpec spec;
    spec.layer = i;
    spec.attention = config.layer_attention[static_cast<size_t>(i)];
    spec.sliding_window =
        spec.attention == AttentionKind::kSlidingWindow ? config.sliding_window : 0;
    spec.num_q_heads = config.num_q_heads;
    spec.num_kv_heads = config.num_kv_heads;
    spec.head_dim_k = spec.head_dim_v = config.head_dim;
    spec.block_tokens = options.block_tokens;
    spec.model_dtype = config.model_dtype;
    LayerDecision decision;

    for (KvSide side : {KvSide::kK, KvSide::kV}) {
      const std::optional<DtypeFlag>& own = side == KvSide::kK ? options.k : options.v;
      const std::optional<DtypeFlag>& flag = own ? own : options.kv;
      KvDtype dtype;
      SideDecision d;
      if (skip[static_cast<size_t>(i)]) {
        dtype = config.model_dtype;
        d = {Provenance::kSkipRule, std::string(kSkipFlag) + " " + options.skip_layers};
      } else if (flag && flag->dtype != KvDtype::kAuto) {
        dtype = flag->dtype;
        d = {Provenance::kUserFlag, flag->flag};
      } else if (scheme) {
        if (!scheme->unsupported.empty()) throw InputError(scheme->unsupported);
        dtype = scheme->dtype;
        d = {Provenance::kCheckpointScheme, scheme->description};
        scheme_used = true;
      } else {
        dtype = config.model_dtype;
        d = {Provenance::kModelDefault,
             flag ? model_detail + " (" + flag->flag + ")" : model_detail};
      }
      if (auto reason = head_dim_unsupported_reason(dtype, config.head_dim); !reason.empty())
        throw InputError(d.detail + ": " + std::string(to_string(dtype)) +
                         " cannot be used for layer " + std::to_string(i) + " " +
                         std::string(to_string(side)) + ": " + reason);
      (side == KvSide::kK ? spec.k_dtype : spec.v_dtype) = dtype;
      (side == KvSide::kK ? decision.k : decision.v) = d;
    }
    plan.layers.push_back(std::move(spec));
    plan.decisions.push_back(std::move(decision));
  }

  if (scheme && !scheme_used)
    plan.notes.push_back("the checkpoint declares " + scheme->description +
                         "; every layer's dtype was chosen explicitly, so it is not used");

  // Every safetensors header is read and validated (a broken checkpoint fails here, at
  // start-up); tensor bytes are read only for per-tensor KV scales.
  std::unique_ptr<CheckpointFiles> files;
  if (!config.dir.empty())
    files = std::make_unique<CheckpointFiles>(CheckpointFiles::open(config.dir));
  std::vector<int> defaulted[2];
  KvDtype defaulted_dtype[2] = {KvDtype::kAuto, KvDtype::kAuto};
  for (auto& spec : plan.layers) {
    for (KvSide side : {KvSide::kK, KvSide::kV}) {
      ScaleSource& src = side == KvSide::kK ? spec.k_scale : spec.v_scale;
      const auto& t = traits(spec.dtype(side));
      if (t.scale_kind == ScaleKind::kPerTokenHead) {
        src.kind = ScaleSourceKind::kDynamic;
        continue;
      }
      if (!t.uses_tensor_scale) continue;
      bool found = false;
      if (files) {
        for (const auto& name : scale_tensor_names(spec.layer, side)) {
          auto [file, info] = files->find(name);
          if (!info) continue;
          std::vector<float> values = file->read_floats(*info);
          if (values.size() != 1 && values.size() != static_cast<size_t>(spec.num_kv_heads))
            throw InputError(file->path() + ": scale tensor '" + name + "' has " +
                             std::to_string(values.size()) + " values; expected 1 or " +
                             std::to_string(spec.num_kv_heads) + " (one per kv head)");
          for (float v : values)
            if (!std::isfinite(v) || v <= 0.0f)
              throw InputError(file->path() + ": scale tensor '" + name +
                               "' holds a value that is not a positive finite number");
          src.kind = ScaleSourceKind::kCheckpoint;
          src.tensor = name;
          src.values = std::move(values);
          found = true;
          break;
        }
      }
      if (!found) {
        src.kind = ScaleSourceKind::kDefaultOne;
        src.values = {1.0f};
        defaulted[static_cast<int>(side)].push_back(spec.layer);
        defaulted_dtype[static_cast<int>(side)] = spec.dtype(side);
      }
    }
  }
  for (KvSide side : {KvSide::kK, KvSide::kV}) {
    const auto& layers = defaulted[static_cast<int>(side)];
    if (layers.empty()) continue;
    const KvDtype d = defaulted_dtype[static_cast<int>(side)];
    char max_text[32];
    std::snprintf(max_text, sizeof max_text, "%g", static_cast<double>(dtype_max(d)));
    const std::string s = side == KvSide::kK ? "k" : "v";
    plan.warnings.push_back("layers " + format_layer_list(layers) + ": the checkpoint has no " + s +
                            "_scale tensors; " + std::string(to_string(side)) +
                            " uses a per-tensor scale of 1.0 (values beyond +-" + max_text +
                            " saturate in " + std::string(to_string(d)) + ")");
  }

  // A 16-bit cache of the other 16-bit format converts values; say so once.
  auto converts = [&](KvDtype d) {
    return (d == KvDtype::kFloat16 && config.model_dtype == KvDtype::kBFloat16) ||
           (d == KvDtype::kBFloat16 && config.model_dtype == KvDtype::kFloat16);
  };
  for (const auto& spec : plan.layers) {
    const KvDtype d = converts(spec.k_dtype) ? spec.k_dtype : spec.v_dtype;
    if (converts(d)) {
      plan.notes.push_back(std::string(to_string(d)) + " cache for a " +
                           std::string(to_string(config.model_dtype)) +
                           " model: values are converted (rounded), never reinterpreted");
      break;
    }
  }
  for (const auto& spec : plan.layers) {
    auto errors = spec.validation_errors();
    KVQ_CHECK(errors.empty(), "planner produced an invalid spec: " + errors.front());
  }
  return plan;
}

}  // namespace kvq
