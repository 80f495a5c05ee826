// FP8-weight checkpoints written by the tests (compressed-tensors float-quantized or ModelOpt
// FP8) from a random tiny model, with the same model dequantized in float64 as the reference:
// shared by the CPU tests (fp8_checkpoint_test.cc) and the CUDA ones (tests/cuda_model).
#pragma once

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kvq/io/safetensors.h"
#include "kvq/quant/codec.h"
#include "model_test_util.h"

namespace kvq::test {

enum class Layout { kCompressedTensors, kModelOpt };

struct Fp8Case {
  Layout layout;
  bool per_channel;
  bool static_activations;
  bool ignore_lm_head;  // lm_head stays F32 and is named in the ignore list
};

inline bool is_projection(const std::string& name) {
  for (const char* p :
       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"})
    if (name.find(p) != std::string::npos && name.ends_with(".weight")) return true;
  return false;
}

// The FP8 checkpoint of `m` and (into `reference_dir`) the same model with every quantized
// weight dequantized in float64 and written as F32.
inline std::string write_fp8(const TinyModel& m, const Fp8Case& c, std::string& reference_dir,
                      std::mt19937& rng, std::vector<FixtureTensor>* tensors_out = nullptr) {
  const auto files = CheckpointFiles::open(m.dir);
  std::vector<FixtureTensor> fp8, ref;
  std::uniform_real_distribution<double> jitter(0.9, 1.1);
  for (const auto& [name, vals] : m.w) {
    const std::vector<int64_t> shape = files.find(name).second->shape;
    const bool quantize = is_projection(name) && !(c.ignore_lm_head && name == "lm_head.weight");
    if (!quantize) {
      std::vector<float> f(vals.begin(), vals.end());
      fp8.push_back(f32_tensor(name, shape, f));
      ref.push_back(f32_tensor(name, shape, f));
      continue;
    }
    const int64_t rows = shape[0], cols = shape[1];
    std::vector<float> scale(c.per_channel ? static_cast<size_t>(rows) : 1);
    for (size_t r = 0; r < scale.size(); ++r) {
      double amax = 0.0;
      const int64_t r0 = c.per_channel ? static_cast<int64_t>(r) : 0,
                    r1 = c.per_channel ? r0 + 1 : rows;
      for (int64_t i = r0 * cols; i < r1 * cols; ++i)
        amax = std::max(amax, std::abs(vals[static_cast<size_t>(i)]));
      // Not exactly amax / 448: scales with full fp32 mantissas, as calibration gives.
      scale[r] = static_cast<float>(amax / 448.0 * jitter(rng));
    }
    FixtureTensor q{name, "F8_E4M3", shape, std::vector<uint8_t>(static_cast<size_t>(rows * cols))};
    std::vector<float> deq(q.bytes.size());
    for (int64_t i = 0; i < rows * cols; ++i) {
      const double s = scale[c.per_channel ? static_cast<size_t>(i / cols) : 0];
      const uint8_t code =
          quant::fp8_e4m3_encode(static_cast<float>(vals[static_cast<size_t>(i)] / s));
      q.bytes[static_cast<size_t>(i)] = code;
      deq[static_cast<size_t>(i)] =
          static_cast<float>(static_cast<double>(quant::fp8_e4m3_decode(code)) * s);
    }
    fp8.push_back(std::move(q));
    const std::vector<int64_t> sshape =
        c.per_channel ? std::vector<int64_t>{rows, 1} : std::vector<int64_t>{};
    fp8.push_back(f32_tensor(name + "_scale", sshape, scale));
    if (c.static_activations)
      fp8.push_back(f32_tensor(name.substr(0, name.size() - 6) + "input_scale", {}, {0.05f}));
    ref.push_back(f32_tensor(name, shape, deq));
  }
  nlohmann::json config = m.config;
  nlohmann::json ignore =
      c.ignore_lm_head ? nlohmann::json::array({"lm_head"}) : nlohmann::json::array();
  if (c.layout == Layout::kCompressedTensors) {
    nlohmann::json acts =
        c.static_activations
            ? nlohmann::json{{"type", "float"},
                             {"num_bits", 8},
                             {"strategy", "tensor"},
                             {"dynamic", false}}
            : nlohmann::json{
                  {"type", "float"}, {"num_bits", 8}, {"strategy", "token"}, {"dynamic", true}};
    config["quantization_config"] = {{"quant_method", "compressed-tensors"},
                                     {"format", "float-quantized"},
                                     {"config_groups",
                                      {{"group_0",
                                        {{"targets", {"Linear"}},
                                         {"weights",
                                          {{"type", "float"},
                                           {"num_bits", 8},
                                           {"strategy", c.per_channel ? "channel" : "tensor"},
                                           {"dynamic", false},
                                           {"symmetric", true}}},
                                         {"input_activations", acts}}}}},
                                     {"ignore", ignore}};
  } else {
    config["quantization_config"] = {
        {"quant_method", "modelopt"}, {"quant_algo", "FP8"}, {"exclude_modules", ignore}};
  }
  reference_dir = make_model_dir(m.config, ref);
  if (tensors_out != nullptr) *tensors_out = fp8;
  return make_model_dir(config, fp8);
}

}  // namespace kvq::test
