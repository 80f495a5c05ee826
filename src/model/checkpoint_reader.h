// Reads a checkpoint's weights into fp32: checks each tensor's presence, dtype and shape
// (InputError naming the tensor and file), then converts F32/F16/BF16 by value from the
// memory-mapped files, with a progress line on stderr for large checkpoints. F8_E4M3 weights
// of a checkpoint that declares FP8 weight quantization (weight_quant.h) are dequantized: code
// x its `weight_scale` (per tensor or per output channel), exact in fp32.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/io/safetensors.h"
#include "model/mapped_file.h"
#include "model/weight_quant.h"

namespace kvq::model {

class CheckpointReader {
 public:
  // Opens (and validates the headers of) the directory's safetensors files. Throws InputError
  // when the directory has none.
  explicit CheckpointReader(const std::string& dir);

  bool has(std::string_view name) const;
  // The stored dtype of `name` (InputError when absent).
  TensorDtype dtype(std::string_view name) const;
  // Checks that `name` exists with `shape` and a float dtype this reader converts; adds its
  // bytes to the total the progress line counts. Throws InputError otherwise.
  void expect(std::string_view name, const std::vector<int64_t>& shape);
  // Converts a tensor expect() accepted into `dst` (numel floats).
  void read(std::string_view name, float* dst);
  // For an F8_E4M3 weight that expect() accepted: its dequantization scale per output row (a
  // per-tensor scale repeated `rows` times); empty for a float weight.
  std::vector<float> weight_row_scales(std::string_view name);
  // Its static activation scale (the module's `input_scale`, one value), when the checkpoint
  // declares static activations and has the tensor; 0 otherwise.
  float input_scale(std::string_view name);
  // Ends the progress line (if one was shown).
  void finish();
  // The checkpoint's declared weight quantization.
  const WeightQuantization& quantization() const { return quant_; }

 private:
  std::pair<const SafetensorsFile*, const TensorInfo*> find_or_throw(std::string_view name) const;
  const MappedFile& mapping(const SafetensorsFile* file);
  // A float tensor (F32/F16/BF16) by value into dst.
  void convert(const SafetensorsFile* file, const TensorInfo* t, float* dst);

  std::string dir_;
  WeightQuantization quant_;
  CheckpointFiles files_;
  std::vector<MappedFile> maps_;  // parallel to files_.files(), opened on first use
  uint64_t total_bytes_ = 0;
  uint64_t done_bytes_ = 0;
  int shown_percent_ = -1;
};

}  // namespace kvq::model
