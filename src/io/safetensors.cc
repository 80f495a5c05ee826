#include "kvq/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "kvq/core/error.h"
#include "kvq/core/json_text.h"

namespace kvq {

namespace {

struct DtypeName {
  std::string_view name;
  TensorDtype dtype;
  size_t size;
};
constexpr DtypeName kDtypes[] = {
    {"F64", TensorDtype::kF64, 8},        {"F32", TensorDtype::kF32, 4},
    {"F16", TensorDtype::kF16, 2},        {"BF16", TensorDtype::kBF16, 2},
    {"F8_E4M3", TensorDtype::kF8E4M3, 1}, {"F8_E5M2", TensorDtype::kF8E5M2, 1},
    {"I64", TensorDtype::kI64, 8},        {"I32", TensorDtype::kI32, 4},
    {"I16", TensorDtype::kI16, 2},        {"I8", TensorDtype::kI8, 1},
    {"U8", TensorDtype::kU8, 1},          {"BOOL", TensorDtype::kBool, 1},
};

std::string accepted_dtypes() {
  std::string s;
  for (const auto& d : kDtypes) {
    if (!s.empty()) s += ", ";
    s += d.name;
  }
  return s;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

void read_exact(int fd, void* buf, size_t n, uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r <= 0) throw InputError(path + ": read failed at offset " + std::to_string(offset));
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

std::string_view to_string(TensorDtype d) {
  for (const auto& x : kDtypes)
    if (x.dtype == d) return x.name;
  return "?";
}

size_t dtype_size(TensorDtype d) {
  for (const auto& x : kDtypes)
    if (x.dtype == d) return x.size;
  return 0;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw InputError(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw InputError(path + ": cannot stat");
  SafetensorsFile f;
  f.path_ = path;
  f.file_size_ = static_cast<uint64_t>(st.st_size);
  const std::string what = path + ": not a valid safetensors file: ";
  if (f.file_size_ < 8)
    throw InputError(what + "file is " + std::to_string(f.file_size_) +
                     " bytes, shorter than the 8-byte header length");
  uint8_t len_bytes[8];
  read_exact(fd.get(), len_bytes, 8, 0, path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > kMaxHeaderBytes)
    throw InputError(what + "header length " + std::to_string(header_len) +
                     " bytes is over the limit of " + std::to_string(kMaxHeaderBytes) +
                     " (oversized header)");
  if (header_len > f.file_size_ - 8)
    throw InputError(what + "header length " + std::to_string(header_len) +
                     " runs past the end of the " + std::to_string(f.file_size_) +
                     "-byte file (truncated)");
  f.data_offset_ = 8 + header_len;
  std::string header(header_len, '\0');
  read_exact(fd.get(), header.data(), header_len, 8, path);

  const nlohmann::json j = parse_json_text(header, what + "header");
  if (!j.is_object()) throw InputError(what + "header is not a JSON object");

  const uint64_t data_size = f.file_size_ - f.data_offset_;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      if (!it->is_object()) throw InputError(what + "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          throw InputError(what + "__metadata__ value of '" + m.key() + "' is not a string");
        f.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const std::string where = what + "tensor '" + name + "': ";
    const auto& e = *it;
    if (!e.is_object()) throw InputError(where + "entry is not an object");
    if (!e.contains("dtype") || !e["dtype"].is_string())
      throw InputError(where + "missing string 'dtype'");
    if (!e.contains("shape") || !e["shape"].is_array())
      throw InputError(where + "missing array 'shape'");
    if (!e.contains("data_offsets") || !e["data_offsets"].is_array() ||
        e["data_offsets"].size() != 2)
      throw InputError(where + "missing 'data_offsets' [begin, end]");
    TensorInfo t;
    t.name = name;
    const auto dname = e["dtype"].get<std::string>();
    bool found = false;
    for (const auto& d : kDtypes)
      if (d.name == dname) {
        t.dtype = d.dtype;
        found = true;
      }
    if (!found)
      throw InputError(where + "unknown dtype '" + dname + "'; accepted: " + accepted_dtypes());
    uint64_t numel = 1;
    for (const auto& s : e["shape"]) {
      if (!s.is_number_unsigned())
        throw InputError(where + "shape entries must be non-negative integers");
      const uint64_t v = s.get<uint64_t>();
      if (v != 0 && numel > std::numeric_limits<uint64_t>::max() / 16 / v)
        throw InputError(where + "shape is too large");
      numel *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    for (const auto& o : e["data_offsets"])
      if (!o.is_number_unsigned())
        throw InputError(where + "data_offsets must be non-negative integers");
    t.begin = e["data_offsets"][0].get<uint64_t>();
    t.end = e["data_offsets"][1].get<uint64_t>();
    if (t.begin > t.end)
      throw InputError(where + "data_offsets begin " + std::to_string(t.begin) + " > end " +
                       std::to_string(t.end));
    if (t.end > data_size)
      throw InputError(where + "data_offsets end " + std::to_string(t.end) +
                       " runs past the data section of " + std::to_string(data_size) +
                       " bytes (file truncated or offsets wrong)");
    const uint64_t want = numel * dtype_size(t.dtype);
    if (t.end - t.begin != want)
      throw InputError(where + "holds " + std::to_string(t.end - t.begin) + " bytes but " + dname +
                       " x shape needs " + std::to_string(want));
    f.tensors_.push_back(std::move(t));
  }

  // Overlap check over tensors sorted by offset (empty tensors occupy nothing).
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : f.tensors_)
    if (t.end > t.begin) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      throw InputError(what + "tensors '" + by_offset[i - 1]->name + "' and '" +
                       by_offset[i]->name + "' overlap (bytes " +
                       std::to_string(by_offset[i]->begin) + ".." +
                       std::to_string(by_offset[i - 1]->end) + ")");
  std::sort(f.tensors_.begin(), f.tensors_.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  return f;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  return (it != tensors_.end() && it->name == name) ? &*it : nullptr;
}

std::vector<float> SafetensorsFile::read_floats(const TensorInfo& t) const {
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<unsigned char> raw(t.end - t.begin);
  Fd fd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw InputError(path_ + ": cannot open: " + std::strerror(errno));
  read_exact(fd.get(), raw.data(), raw.size(), data_offset_ + t.begin, path_);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case TensorDtype::kF32:
        std::memcpy(&out[i], &raw[i * 4], 4);
        break;
      case TensorDtype::kF64: {
        double d;
        std::memcpy(&d, &raw[i * 8], 8);
        out[i] = static_cast<float>(d);
        break;
      }
      case TensorDtype::kF16: {
        uint16_t h;
        std::memcpy(&h, &raw[i * 2], 2);
        out[i] = half_to_float(h);
        break;
      }
      case TensorDtype::kBF16: {
        uint16_t b;
        std::memcpy(&b, &raw[i * 2], 2);
        const uint32_t bits = static_cast<uint32_t>(b) << 16;
        std::memcpy(&out[i], &bits, 4);
        break;
      }
      default:
        throw InputError(path_ + ": tensor '" + t.name + "' has dtype " +
                         std::string(to_string(t.dtype)) +
                         "; expected a float tensor (F32, F16, BF16, F64)");
    }
  }
  return out;
}

CheckpointFiles CheckpointFiles::open(const std::string& dir) {
  namespace fs = std::filesystem;
  CheckpointFiles c;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    const nlohmann::json j = parse_json_file(index.string());
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw InputError(index.string() + ": missing object 'weight_map' (tensor name -> file)");
    std::set<std::string> shards;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string())
        throw InputError(index.string() + ": weight_map entry '" + name + "' is not a file name");
      const auto s = file.get<std::string>();
      if (s.find('/') != std::string::npos || s == "..")
        throw InputError(index.string() + ": weight_map file '" + s +
                         "' must be a file name in the checkpoint directory");
      shards.insert(s);
    }
    for (const auto& s : shards)
      c.files_.push_back(SafetensorsFile::open((fs::path(dir) / s).string()));
    return c;
  }
  const fs::path single = fs::path(dir) / "model.safetensors";
  if (fs::exists(single)) c.files_.push_back(SafetensorsFile::open(single.string()));
  return c;
}

std::pair<const SafetensorsFile*, const TensorInfo*> CheckpointFiles::find(
    std::string_view name) const {
  for (const auto& f : files_)
    if (const TensorInfo* t = f.find(name)) return {&f, t};
  return {nullptr, nullptr};
}

}  // namespace kvq
