#include "model/weight_quant.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "kvq/core/error.h"
#include "kvq/core/json_text.h"
#include "kvq/model/model.h"

namespace kvq::model {

namespace {

using json = nlohmann::json;

constexpr const char* kAccepted =
    "kvq loads F32/F16/BF16 weights and FP8 weights as compressed-tensors float-quantized "
    "(8-bit float, per-tensor or per-channel scales) or ModelOpt FP8 publish them";

std::string text_of(const json& j) {
  return j.is_string() ? j.get<std::string>() : j.dump();
}

[[noreturn]] void refuse(const std::string& where, const std::string& what) {
  throw InputError(where + ": " + what + " is not supported; " + kAccepted);
}

// A number-of-bits field; anything but an integer reads as -1 (refused by the caller with the
// value named) instead of escaping as a JSON type error.
int bits_of(const json& o) {
  if (!o.contains("num_bits")) return -1;
  const json& b = o["num_bits"];
  return b.is_number_integer() && b.get<int64_t>() >= 0 && b.get<int64_t>() <= 64
             ? static_cast<int>(b.get<int64_t>())
             : -1;
}

std::string bits_text(const json& o) {
  const int b = bits_of(o);
  return b >= 0 ? std::to_string(b) : o.contains("num_bits") ? o["num_bits"].dump() : "?";
}

// A true/false field; a value of another type is an error that names it.
bool flag_of(const json& o, const char* key, bool def, const std::string& where) {
  if (!o.contains(key) || o[key].is_null()) return def;
  if (!o[key].is_boolean())
    throw InputError(where + ": '" + key + "' should be true or false, got " + o[key].dump());
  return o[key].get<bool>();
}

std::vector<std::string> string_list(const json& j, const std::string& where,
                                     const std::string& field) {
  std::vector<std::string> out;
  if (j.is_null()) return out;
  if (!j.is_array())
    throw InputError(where + ": " + field + " should be a list of module names, got " + j.dump());
  for (const json& e : j) {
    if (!e.is_string())
      throw InputError(where + ": " + field + " should hold module names, got " + e.dump());
    out.push_back(e.get<std::string>());
  }
  return out;
}

// compressed-tensors: config_groups of {targets, weights, input_activations}.
WeightQuantization compressed_tensors(const json& q, const std::string& where) {
  WeightQuantization w;
  if (!q.contains("config_groups") || q["config_groups"].is_null() ||
      (q["config_groups"].is_object() && q["config_groups"].empty()))
    return w;  // a KV-cache scheme alone
  const std::string format = q.contains("format") ? text_of(q["format"]) : "float-quantized";
  if (format != "float-quantized" && format != "naive-quantized")
    refuse(where, "compressed-tensors format '" + format + "'");
  if (!q["config_groups"].is_object())
    throw InputError(where + ": quantization_config.config_groups should be an object, got " +
                     q["config_groups"].dump());
  bool first = true;
  for (const auto& [name, g] : q["config_groups"].items()) {
    const std::string gw = where + " config_groups." + name;
    if (!g.is_object() || !g.contains("weights") || !g["weights"].is_object())
      throw InputError(gw + ": a group needs a 'weights' object");
    const json& wt = g["weights"];
    const std::string type = wt.contains("type") ? text_of(wt["type"]) : "?";
    const int bits = bits_of(wt);
    const std::string strategy = wt.contains("strategy") ? text_of(wt["strategy"]) : "tensor";
    if (type != "float" || bits != 8)
      refuse(gw, "weights of type " + type + " with " + bits_text(wt) + " bits");
    if (strategy != "tensor" && strategy != "channel")
      refuse(gw, "weight scale strategy '" + strategy + "'" +
                     (wt.contains("block_structure") ? " " + wt["block_structure"].dump() : ""));
    if (flag_of(wt, "dynamic", false, gw + ".weights")) refuse(gw, "dynamic weight scales");
    const auto targets = string_list(g.value("targets", json::array({"Linear"})), gw, "targets");
    for (const std::string& t : targets)
      if (t != "Linear") refuse(gw, "targets '" + t + "' (only Linear layers are quantized)");
    bool stat = false;
    if (g.contains("input_activations") && !g["input_activations"].is_null()) {
      const json& a = g["input_activations"];
      const std::string at = a.contains("type") ? text_of(a["type"]) : "?";
      if (at != "float" || bits_of(a) != 8)
        refuse(gw, "input activations of type " + at + " with " + bits_text(a) + " bits");
      stat = !flag_of(a, "dynamic", false, gw + ".input_activations");
    }
    const auto scale = strategy == "tensor" ? WeightQuantization::Scale::kTensor
                                            : WeightQuantization::Scale::kChannel;
    if (!first && (scale != w.scale || stat != w.static_activations))
      refuse(where, "config_groups with different weight or activation schemes");
    w.scale = scale;
    w.static_activations = stat;
    first = false;
  }
  w.fp8 = true;
  w.ignore = string_list(q.value("ignore", json::array()), where, "ignore");
  w.description = "compressed-tensors " + format + ", FP8 weights with per-" +
                  (w.scale == WeightQuantization::Scale::kTensor ? "tensor" : "channel") +
                  " scales, " + (w.static_activations ? "static" : "dynamic") + " activations";
  return w;
}

WeightQuantization modelopt(const json& q, const std::string& where) {
  WeightQuantization w;
  if (!q.contains("quant_algo") || q["quant_algo"].is_null()) return w;  // KV scheme alone
  const std::string algo = text_of(q["quant_algo"]);
  if (algo != "FP8") refuse(where, "ModelOpt quant_algo '" + algo + "'");
  w.fp8 = true;
  w.static_activations = true;
  w.ignore = string_list(q.value("exclude_modules", json::array()), where, "exclude_modules");
  w.description = "ModelOpt FP8, per-tensor weight scales";
  return w;
}

// A "re:" ignore pattern as checkpoints write them ("re:.*lm_head", "re:model\.layers\.0\..*"):
// literals, "\x" escapes, "." (any character) and ".*" (any run); no backtracking regex engine,
// so a hostile pattern costs at most |pattern| x |name| steps. Other regex syntax is refused.
bool pattern_matches(std::string_view pat, std::string_view s) {
  struct Tok {
    char c;
    bool any, star;
  };
  std::vector<Tok> toks;
  for (size_t i = 0; i < pat.size(); ++i) {
    const char c = pat[i];
    if (c == '\\' && i + 1 < pat.size()) {
      toks.push_back({pat[++i], false, false});
    } else if (c == '.') {
      const bool star = i + 1 < pat.size() && pat[i + 1] == '*';
      toks.push_back({0, true, star});
      if (star) ++i;
    } else if (std::string_view("[](){}+?|^$*\\").find(c) != std::string_view::npos) {
      throw InputError("quantization config: ignore pattern 're:" + std::string(pat) +
                       "' uses regex syntax kvq does not match ('" + std::string(1, c) +
                       "'); accepted: literals, '\\.' escapes, '.' and '.*'");
    } else {
      toks.push_back({c, false, false});
    }
  }
  // reach[j]: the first j tokens match the prefix read so far.
  std::vector<char> reach(toks.size() + 1, 0), next(toks.size() + 1, 0);
  auto close = [&](std::vector<char>& r) {  // ".*" also matches nothing
    for (size_t j = 0; j < toks.size(); ++j)
      if (r[j] && toks[j].star) r[j + 1] = 1;
  };
  reach[0] = 1;
  close(reach);
  for (char ch : s) {
    std::fill(next.begin(), next.end(), 0);
    for (size_t j = 0; j < toks.size(); ++j) {
      if (!reach[j]) continue;
      if (toks[j].star)
        next[j] = 1;  // ".*" takes this character and stays
      else if (toks[j].any || toks[j].c == ch)
        next[j + 1] = 1;
    }
    close(next);
    reach.swap(next);
  }
  return reach[toks.size()] != 0;
}

}  // namespace

bool WeightQuantization::quantizes(std::string_view name) const {
  if (!fp8) return false;
  std::string module(name);
  if (module.ends_with(".weight")) module.resize(module.size() - 7);
  for (const std::string& p : ignore) {
    if (p.starts_with("re:")) {
      if (pattern_matches(std::string_view(p).substr(3), module)) return false;
    } else if (module == p || (p.find('.') == std::string::npos && module.ends_with("." + p)) ||
               (p.ends_with("*") && module.starts_with(p.substr(0, p.size() - 1)))) {
      // A bare name ("lm_head") matches that module anywhere; "x.*" matches by prefix.
      return false;
    }
  }
  return true;
}

WeightQuantization parse_weight_quantization(const nlohmann::json& cfg,
                                             const nlohmann::json& hf_quant,
                                             const std::string& config_path,
                                             const std::string& hf_quant_path) {
  {
    if (cfg.is_object() && cfg.contains("quantization_config") &&
        !cfg["quantization_config"].is_null()) {
      const std::string where = config_path + " quantization_config";
      const json& q = cfg["quantization_config"];
      if (!q.is_object())
        throw InputError(where + " should be an object, got " + q.dump().substr(0, 80));
      const std::string method = q.contains("quant_method") ? text_of(q["quant_method"]) : "";
      if (method == "compressed-tensors") return compressed_tensors(q, where);
      if (method == "modelopt") return modelopt(q, where);
      if (method.empty() && (q.contains("kv_cache_quant_algo") || q.contains("kv_cache_scheme")))
        return {};
      std::string what = "quant_method '" + method + "'";
      if (q.contains("weight_block_size"))
        what += " with weight_block_size " + q["weight_block_size"].dump();
      refuse(where, what);
    }
  }
  if (hf_quant.is_object() && hf_quant.contains("quantization") &&
      hf_quant["quantization"].is_object())
    return modelopt(hf_quant["quantization"], hf_quant_path);
  return {};
}

WeightQuantization read_weight_quantization(const std::string& dir) {
  const auto cfg_path = std::filesystem::path(dir) / "config.json";
  const auto hf = std::filesystem::path(dir) / "hf_quant_config.json";
  const json cfg = std::filesystem::exists(cfg_path) ? parse_json_file(cfg_path.string()) : json();
  const json hq = std::filesystem::exists(hf) ? parse_json_file(hf.string()) : json();
  return parse_weight_quantization(cfg, hq, cfg_path.string(), hf.string());
}

}  // namespace kvq::model

namespace kvq {

WeightScheme describe_weights(const ModelConfig& config) {
  WeightScheme w;
  if (config.dir.empty()) {
    w.stored = "random bfloat16 (synthetic)";
    w.cpu = "-";
    w.cuda = "bfloat16";
    return w;
  }
  const model::WeightQuantization q = model::read_weight_quantization(config.dir);
  const std::string dtype = config.torch_dtype.empty() ? "float32" : config.torch_dtype;
  if (!q.fp8) {
    w.stored = dtype + " (config.json torch_dtype)";
    w.cpu = dtype == "bfloat16" ? "bfloat16" : "float32";
    w.cuda = dtype == "float32" ? "float32 (--dtype auto)"
                                : "bfloat16 (--dtype auto; --dtype fp8 quantizes the projections)";
    return w;
  }
  w.fp8 = true;
  w.stored = q.description + (q.ignore.empty() ? std::string()
                                               : ", " + std::to_string(q.ignore.size()) +
                                                     " ignore pattern(s)");
  w.cpu = "float32, dequantized once at load (4 bytes per weight; activations not quantized)";
  w.cuda = "FP8 on Hopper (the checkpoint's codes and scales, inputs quantized per token or "
           "with its static input scales; --dtype bfloat16 dequantizes), bfloat16 elsewhere";
  return w;
}

}  // namespace kvq
