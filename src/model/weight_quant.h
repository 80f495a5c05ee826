// A checkpoint's weight quantization as published: compressed-tensors "float-quantized" W8
// (config.json quantization_config with config_groups of 8-bit float weights, per-tensor or
// per-channel scales, static or dynamic 8-bit float activations, an `ignore` list) and ModelOpt
// FP8 (quant_algo FP8 in config.json or hf_quant_config.json, per-tensor scales,
// exclude_modules). Every other weight scheme (integer GPTQ/AWQ, NVFP4, block-scaled FP8, ...)
// is refused with one line naming it and what kvq loads.
//
// The CPU model reads such weights through CheckpointReader, which dequantizes each F8_E4M3
// weight once at load (code x its `weight_scale`, exact in fp32; activation scales not
// applied). The CUDA model on Hopper keeps the codes and scales and runs FP8 GEMMs with the
// static input scales where the checkpoint has them (model/cuda/linear.h).
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace kvq::model {

struct WeightQuantization {
  enum class Scale { kTensor, kChannel };

  bool fp8 = false;  // FP8 (e4m3) weights with `<name>_scale` tensors
  Scale scale = Scale::kTensor;
  bool static_activations = false;  // input_scale tensors (applied by CUDA FP8 projections)
  std::vector<std::string> ignore;  // modules left unquantized: names or "re:" patterns
  std::string description;          // e.g. "compressed-tensors float-quantized, W8 channel"

  // Whether the weight `name` (a ".weight" tensor) is one of the quantized ones.
  bool quantizes(std::string_view name) const;
};

// Reads `dir`'s config.json quantization_config and hf_quant_config.json. A configuration that
// declares only a KV-cache scheme (kv_cache_scheme, kv_cache_quant_algo) is no weight
// quantization. Throws InputError (one line: the file, the scheme, what kvq loads) otherwise.
WeightQuantization read_weight_quantization(const std::string& dir);
// The same from parsed files: config.json's object and hf_quant_config.json's (null: absent);
// the paths name them in errors.
WeightQuantization parse_weight_quantization(const nlohmann::json& config,
                                             const nlohmann::json& hf_quant,
                                             const std::string& config_path,
                                             const std::string& hf_quant_path);

}  // namespace kvq::model
