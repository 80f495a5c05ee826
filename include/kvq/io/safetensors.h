// safetensors files: header parsing with full validation, small-tensor reads,
// and the set of files that make up a checkpoint (single or sharded).
//
// Opening a file reads and validates only its header; tensor bytes are read
// on demand (pread for small tensors such as KV scales; mapping for weights).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvq {

enum class TensorDtype : uint8_t { kF64, kF32, kF16, kBF16, kF8E4M3, kF8E5M2, kI64, kI32, kI16, kI8, kU8, kBool };
std::string_view to_string(TensorDtype d);
size_t dtype_size(TensorDtype d);

struct TensorInfo {
  std::string name;
  TensorDtype dtype = TensorDtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Largest header accepted (the format's reference implementation uses 100 MB).
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

  // Reads and validates the header. Throws InputError naming the file and what is wrong:
  // too short, header length past the end (truncated) or over kMaxHeaderBytes (oversized),
  // not JSON / not an object, an entry without a valid dtype, shape or data_offsets, a byte
  // count that does not match dtype x shape, offsets running past the file, overlapping tensors.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return file_size_; }
  uint64_t data_offset() const { return data_offset_; }  // absolute offset of the data section
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Reads a small float tensor (F32, F16, BF16, F64) into fp32. Throws InputError for other dtypes.
  std::vector<float> read_floats(const TensorInfo& t) const;

 private:
  std::string path_;
  uint64_t file_size_ = 0;
  uint64_t data_offset_ = 0;
  std::vector<TensorInfo> tensors_;  // sorted by name
  std::map<std::string, std::string> metadata_;
};

// Every safetensors file of a checkpoint directory: model.safetensors.index.json's shards
// when it exists, else model.safetensors, else none (has_weights() == false).
class CheckpointFiles {
 public:
  static CheckpointFiles open(const std::string& dir);
  bool has_weights() const { return !files_.empty(); }
  const std::vector<SafetensorsFile>& files() const { return files_; }
  // The tensor and the file that holds it, or {nullptr, nullptr}.
  std::pair<const SafetensorsFile*, const TensorInfo*> find(std::string_view name) const;

 private:
  std::vector<SafetensorsFile> files_;
};

// Writes a safetensors file tensor by tensor, so a checkpoint never has to sit in memory whole:
// the header (the entries in order, offsets back to back, padded to 8 bytes) goes out first,
// then add() takes each tensor's bytes in the same order. finish() checks that every entry got
// its bytes and flushes. InputError naming the path on any I/O failure or misuse.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    TensorDtype dtype = TensorDtype::kF32;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(const std::string& path, std::vector<Entry> entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // The next entry's bytes (name and byte count must match it).
  void add(std::string_view name, const void* data, size_t bytes);
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq
