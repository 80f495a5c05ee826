// SafetensorsWriter (kvq/io/safetensors.h): header first, then the tensors in order.
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvq/core/error.h"
#include "kvq/io/safetensors.h"

namespace kvq {

struct SafetensorsWriter::Impl {
  std::string path;
  std::vector<Entry> entries;
  std::vector<uint64_t> sizes;
  size_t next = 0;
  std::ofstream out;
  bool finished = false;
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<Entry> entries,
                                     const std::map<std::string, std::string>& metadata)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  m.entries = std::move(entries);
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const Entry& e : m.entries) {
    uint64_t n = 1;
    for (int64_t d : e.shape) {
      if (d < 0) throw InputError(path + ": tensor '" + e.name + "' has a negative dimension");
      n *= static_cast<uint64_t>(d);
    }
    const uint64_t bytes = n * dtype_size(e.dtype);
    if (h.contains(e.name)) throw InputError(path + ": tensor '" + e.name + "' written twice");
    h[e.name] = {{"dtype", std::string(to_string(e.dtype))},
                 {"shape", e.shape},
                 {"data_offsets", {off, off + bytes}}};
    m.sizes.push_back(bytes);
    off += bytes;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  m.out.open(path, std::ios::binary | std::ios::trunc);
  if (!m.out) throw InputError(path + ": cannot be written");
  const uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) m.out.put(static_cast<char>((len >> (8 * i)) & 0xff));
  m.out.write(text.data(), static_cast<std::streamsize>(text.size()));
  if (!m.out) throw InputError(path + ": write failed");
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::add(std::string_view name, const void* data, size_t bytes) {
  Impl& m = *impl_;
  if (m.finished || m.next >= m.entries.size() || m.entries[m.next].name != name ||
      m.sizes[m.next] != bytes)
    throw InputError(m.path + ": tensor '" + std::string(name) + "' (" + std::to_string(bytes) +
                     " bytes) is not the next one the header declares");
  m.out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!m.out) throw InputError(m.path + ": write failed (disk full?)");
  ++m.next;
}

void SafetensorsWriter::finish() {
  Impl& m = *impl_;
  if (m.next != m.entries.size())
    throw InputError(m.path + ": " + std::to_string(m.entries.size() - m.next) +
                     " declared tensors were never written");
  m.out.flush();
  if (!m.out) throw InputError(m.path + ": write failed (disk full?)");
  m.out.close();
  m.finished = true;
}

}  // namespace kvq
