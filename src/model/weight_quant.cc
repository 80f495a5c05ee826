#include "model/weight_quant.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "kvq/core/error.h"
#include "kvq/core/json_text.h"

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
    const int bits = wt.value("num_bits", -1);
    const std::string strategy = wt.contains("strategy") ? text_of(wt["strategy"]) : "tensor";
    if (type != "float" || bits != 8)
      refuse(gw, "weights of type " + type + " with " + std::to_string(bits) + " bits");
    if (strategy != "tensor" && strategy != "channel")
      refuse(gw, "weight scale strategy '" + strategy + "'" +
                     (wt.contains("block_structure") ? " " + wt["block_structure"].dump() : ""));
    if (wt.value("dynamic", false) == true) refuse(gw, "dynamic weight scales");
    const auto targets = string_list(g.value("targets", json::array({"Linear"})), gw, "targets");
    for (const std::string& t : targets)
      if (t != "Linear") refuse(gw, "targets '" + t + "' (only Linear layers are quantized)");
    bool stat = false;
    if (g.contains("input_activations") && !g["input_activations"].is_null()) {
      const json& a = g["input_activations"];
      const std::string at = a.contains("type") ? text_of(a["type"]) : "?";
      if (at != "float" || a.value("num_bits", -1) != 8)
        refuse(gw, "input activations of type " + at + " with " +
                       std::to_string(a.value("num_bits", -1)) + " bits");
      stat = a.value("dynamic", false) != true;
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

}  // namespace

bool WeightQuantization::quantizes(std::string_view name) const {
  if (!fp8) return false;
  std::string module(name);
  if (module.ends_with(".weight")) module.resize(module.size() - 7);
  for (const std::string& p : ignore) {
    if (p.starts_with("re:")) {
      try {
        if (std::regex_match(module, std::regex(p.substr(3)))) return false;
      } catch (const std::regex_error&) {
        throw InputError("quantization config: ignore pattern '" + p + "' is not a valid regex");
      }
    } else if (module == p || (p.find('.') == std::string::npos && module.ends_with("." + p)) ||
               (p.ends_with("*") && module.starts_with(p.substr(0, p.size() - 1)))) {
      // A bare name ("lm_head") matches that module anywhere; "x.*" matches by prefix.
      return false;
    }
  }
  return true;
}

WeightQuantization read_weight_quantization(const std::string& dir) {
  const auto cfg_path = std::filesystem::path(dir) / "config.json";
  if (std::filesystem::exists(cfg_path)) {
    const json cfg = parse_json_file(cfg_path.string());
    if (cfg.is_object() && cfg.contains("quantization_config") &&
        !cfg["quantization_config"].is_null()) {
      const std::string where = cfg_path.string() + " quantization_config";
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
  const auto hf = std::filesystem::path(dir) / "hf_quant_config.json";
  if (std::filesystem::exists(hf)) {
    const json j = parse_json_file(hf.string());
    if (j.is_object() && j.contains("quantization") && j["quantization"].is_object())
      return modelopt(j["quantization"], hf.string());
  }
  return {};
}

}  // namespace kvq::model
