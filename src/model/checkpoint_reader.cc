#include "model/checkpoint_reader.h"

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
    : dir_(dir), files_(CheckpointFiles::open(dir)) {
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

void CheckpointReader::expect(std::string_view name, const std::vector<int64_t>& shape) {
  auto [file, t] = find_or_throw(name);
  if (t->dtype != TensorDtype::kF32 && t->dtype != TensorDtype::kF16 &&
      t->dtype != TensorDtype::kBF16)
    throw InputError(file->path() + ": tensor '" + t->name + "' has dtype " +
                     std::string(to_string(t->dtype)) +
                     "; kvq runs F32, F16 and BF16 weights (quantized weights such as FP8 or "
                     "integer checkpoints are not supported)");
  if (t->shape != shape)
    throw InputError(file->path() + ": tensor '" + t->name + "' has shape " + shape_text(t->shape) +
                     "; config.json implies " + shape_text(shape));
  total_bytes_ += t->end - t->begin;
}

const MappedFile& CheckpointReader::mapping(const SafetensorsFile* file) {
  const size_t i = static_cast<size_t>(file - files_.files().data());
  if (!maps_[i].data()) maps_[i] = MappedFile::open(file->path());
  KVQ_CHECK(maps_[i].size() == file->file_size(), file->path() + " changed size while loading");
  return maps_[i];
}

void CheckpointReader::read(std::string_view name, float* dst) {
  auto [file, t] = find_or_throw(name);
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
      KVQ_CHECK(false, "read() of a tensor expect() did not accept: " + t->name);
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

void CheckpointReader::finish() {
  if (shown_percent_ >= 0) std::fprintf(stderr, "\n");
  shown_percent_ = -1;
}

}  // namespace kvq::model
