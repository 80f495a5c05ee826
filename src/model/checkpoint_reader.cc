#include "model/checkpoint_reader.h"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "kvq/core/error.h"
#include "kvq/quant/codec.h"

namespace kvq::model {

namespace {

// Checkpoints above this many bytes show a progress line while converting.
constexpr uint64_t kProgressBytes = 300ull << 20;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

CheckpointReader::CheckpointReader(const std::string& dir)
    : dir_(dir), quant_(read_weight_quantization(dir)), files_(CheckpointFiles::open(dir)) {
  if (!files_.has_weights())
    throw InputError(dir +
                     ": no model.safetensors or model.safetensors.index.json (kvq reads "
                     "Hugging Face safetensors checkpoints)");
  maps_.resize(files_.files().size());
}

bool CheckpointReader::has(std::string_view name) const {
  return files_.find(name).second != nullptr;
}

TensorDtype CheckpointReader::dtype(std::string_view name) const {
  return find_or_throw(name).second->dtype;
}

std::pair<const SafetensorsFile*, const TensorInfo*> CheckpointReader::find_or_throw(
    std::string_view name) const {
  auto found = files_.find(name);
  if (!found.second)
    throw InputError(dir_ + ": the checkpoint has no tensor '" + std::string(name) +
                     "' (the architecture in config.json needs it)");
  return found;
}

namespace {
bool is_float(TensorDtype d) {
  return d == TensorDtype::kF32 || d == TensorDtype::kF16 || d == TensorDtype::kBF16;
}
std::string scale_name_of(std::string_view weight) {
  return std::string(weight) + "_scale";  // q_proj.weight -> q_proj.weight_scale
}
}  // namespace

void CheckpointReader::expect(std::string_view name, const std::vector<int64_t>& shape) {
  auto [file, t] = find_or_throw(name);
  const bool fp8 = t->dtype == TensorDtype::kF8E4M3 && quant_.quantizes(t->name);
  if (!is_float(t->dtype) && !fp8)
    throw InputError(
        file->path() + ": tensor '" + t->name + "' has dtype " + std::string(to_string(t->dtype)) +
        (t->dtype == TensorDtype::kF8E4M3 && quant_.fp8
             ? " but the quantization config leaves it unquantized (ignore list)"
             : std::string("; kvq runs F32, F16 and BF16 weights, and F8_E4M3 weights where "
                           "config.json declares FP8 weight quantization (compressed-tensors "
                           "float-quantized, ModelOpt FP8); ") +
                   (quant_.fp8 ? "this checkpoint declares FP8 weights, not " +
                                     std::string(to_string(t->dtype))
                               : std::string("this checkpoint declares none"))));
  if (t->shape != shape)
    throw InputError(file->path() + ": tensor '" + t->name + "' has shape " + shape_text(t->shape) +
                     "; config.json implies " + shape_text(shape));
  total_bytes_ += t->end - t->begin;
  if (!fp8) return;
  // Its scale: one value (per tensor) or one per output row (per channel).
  const std::string sname = scale_name_of(t->name);
  auto [sfile, s] = files_.find(sname);
  if (s == nullptr)
    throw InputError(file->path() + ": F8_E4M3 tensor '" + t->name + "' has no '" + sname + "' (" +
                     quant_.description + ")");
  const int64_t rows = shape.empty() ? 1 : shape[0];
  const bool per_tensor = quant_.scale == WeightQuantization::Scale::kTensor;
  const bool shape_ok = per_tensor ? s->numel() == 1
                                   : (s->shape == std::vector<int64_t>{rows, 1} ||
                                      s->shape == std::vector<int64_t>{rows});
  if (!is_float(s->dtype) || !shape_ok)
    throw InputError(sfile->path() + ": scale tensor '" + sname + "' has dtype " +
                     std::string(to_string(s->dtype)) + " and shape " + shape_text(s->shape) +
                     "; expected F32/F16/BF16 of shape " +
                     (per_tensor ? std::string("[] or [1] (per-tensor scale)")
                                 : shape_text({rows, 1}) + " (per-channel scale)"));
}

void CheckpointReader::convert(const SafetensorsFile* file, const TensorInfo* t, float* dst) {
  const std::byte* src = mapping(file).data() + file->data_offset() + t->begin;
  const int64_t n = t->numel();
  switch (t->dtype) {
    case TensorDtype::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      break;
    case TensorDtype::kBF16:
#pragma omp parallel for schedule(static) if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(b) << 16;  // bf16 is fp32's top half
        std::memcpy(dst + i, &bits, 4);
      }
      break;
    case TensorDtype::kF16:
#pragma omp parallel for schedule(static) if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = quant::fp16_bits_to_float(h);
      }
      break;
    default:
      KVQ_CHECK(false, "convert() of a tensor that is not F32/F16/BF16: " + t->name);
  }
}

const MappedFile& CheckpointReader::mapping(const SafetensorsFile* file) {
  const size_t i = static_cast<size_t>(file - files_.files().data());
  if (!maps_[i].data()) maps_[i] = MappedFile::open(file->path());
  KVQ_CHECK(maps_[i].size() == file->file_size(), file->path() + " changed size while loading");
  return maps_[i];
}

void CheckpointReader::read(std::string_view name, float* dst) {
  auto [file, t] = find_or_throw(name);
  if (t->dtype == TensorDtype::kF8E4M3) {
    KVQ_CHECK(quant_.quantizes(t->name), "read() of a tensor expect() did not accept: " + t->name);
    auto [sfile, s] = find_or_throw(scale_name_of(t->name));
    std::vector<float> scale(static_cast<size_t>(s->numel()));
    convert(sfile, s, scale.data());
    const std::byte* src = mapping(file).data() + file->data_offset() + t->begin;
    const int64_t n = t->numel();
    const int64_t rows = t->shape.empty() ? 1 : t->shape[0];
    const int64_t cols = rows > 0 ? n / rows : 0;
    const bool per_tensor = scale.size() == 1;
    // code x scale: the decoded code has 4 significant bits, so the fp32 product is the exact
    // product rounded once (what float64 dequantization rounded to fp32 gives).
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i)
      dst[i] = quant::fp8_e4m3_decode(static_cast<uint8_t>(src[i])) *
               scale[per_tensor ? 0 : static_cast<size_t>(i / cols)];
  } else {
    convert(file, t, dst);
  }
  done_bytes_ += t->end - t->begin;
  if (total_bytes_ > kProgressBytes) {
    // A handful of updates (every 10%), not one per tensor.
    const int pct = static_cast<int>(done_bytes_ * 100 / total_bytes_);
    if (pct / 10 != shown_percent_ / 10) {
      shown_percent_ = pct;
      std::fprintf(stderr, "\rkvq: converting weights %3d%%", pct);
      std::fflush(stderr);
    }
  }
}

std::vector<float> CheckpointReader::weight_row_scales(std::string_view name) {
  auto [file, t] = find_or_throw(name);
  if (t->dtype != TensorDtype::kF8E4M3) return {};
  KVQ_CHECK(quant_.quantizes(t->name), "weight_row_scales() of a tensor expect() did not accept");
  auto [sfile, s] = find_or_throw(scale_name_of(t->name));
  std::vector<float> scale(static_cast<size_t>(s->numel()));
  convert(sfile, s, scale.data());
  const size_t rows = t->shape.empty() ? 1 : static_cast<size_t>(t->shape[0]);
  if (scale.size() == 1) scale.assign(rows, scale[0]);
  KVQ_CHECK(scale.size() == rows, "weight_row_scales: expect() checked the scale's shape");
  return scale;
}

float CheckpointReader::input_scale(std::string_view name) {
  if (!quant_.fp8 || !quant_.static_activations) return 0.0f;
  const std::string_view suffix = "weight";
  if (name.size() < suffix.size() || name.substr(name.size() - suffix.size()) != suffix)
    return 0.0f;
  const std::string iname =
      std::string(name.substr(0, name.size() - suffix.size())) + "input_scale";
  auto [file, t] = files_.find(iname);
  if (t == nullptr) return 0.0f;
  if (!is_float(t->dtype) || t->numel() != 1)
    throw InputError(file->path() + ": activation scale '" + iname + "' has dtype " +
                     std::string(to_string(t->dtype)) + " and shape " + shape_text(t->shape) +
                     "; expected one F32/F16/BF16 value");
  float v = 0.0f;
  convert(file, t, &v);
  if (!(v > 0.0f) || !std::isfinite(v))
    throw InputError(file->path() + ": activation scale '" + iname + "' is " +
                     std::to_string(v) + "; expected a positive finite value");
  return v;
}

void CheckpointReader::finish() {
  if (shown_percent_ >= 0) std::fprintf(stderr, "\n");
  shown_percent_ = -1;
}

}  // namespace kvq::model
