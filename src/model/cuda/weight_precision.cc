// WeightPrecision names (built with or without CUDA: the command line parses them either way).
#include <string>

#include "kvq/core/error.h"
#include "kvq/model/cuda_model.h"

namespace kvq {

WeightPrecision parse_weight_precision(std::string_view text, std::string_view flag) {
  if (text == "auto") return WeightPrecision::kAuto;
  if (text == "bfloat16" || text == "bf16") return WeightPrecision::kBFloat16;
  if (text == "float32" || text == "fp32") return WeightPrecision::kFloat32;
  if (text == "fp8" || text == "float8_e4m3") return WeightPrecision::kFp8;
  throw InputError(std::string(flag) + " '" + std::string(text) +
                   "' is not a weight precision; accepted: auto, bfloat16 (bf16), float32 (fp32), fp8 "
                   "(float8_e4m3)");
}

std::string_view to_string(WeightPrecision p) {
  switch (p) {
    case WeightPrecision::kAuto:
      return "auto";
    case WeightPrecision::kBFloat16:
      return "bfloat16";
    case WeightPrecision::kFloat32:
      return "float32";
    case WeightPrecision::kFp8:
      return "fp8";
  }
  return "?";
}

}  // namespace kvq
