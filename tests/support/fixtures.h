// Test fixtures written by the tests themselves: model directories with a
// config.json and small safetensors files (valid or deliberately broken).
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

namespace kvq::test {

// One directory per test process under the system's temporary directory ($TMPDIR), removed
// with everything in it when the process exits normally (failed tests included), so a test
// run leaves nothing behind.
inline const std::filesystem::path& test_root() {
  struct Root {
    std::filesystem::path path;
    Root() {
      std::random_device rd;
      path = std::filesystem::temp_directory_path() /
             ("kvq-test-" + std::to_string(rd()) + std::to_string(rd()));
      std::filesystem::create_directories(path);
    }
    ~Root() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Root root;
  return root.path;
}

// A new, empty directory inside test_root().
inline std::string fresh_dir(const std::string& tag) {
  std::random_device rd;
  auto dir = test_root() / (tag + "-" + std::to_string(rd()) + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

struct FixtureTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline FixtureTensor f32_tensor(const std::string& name, std::vector<int64_t> shape,
                                const std::vector<float>& values) {
  FixtureTensor t{name, "F32", std::move(shape), std::vector<uint8_t>(values.size() * 4)};
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

// Header JSON for `tensors` laid out back to back.
inline nlohmann::json safetensors_header(const std::vector<FixtureTensor>& tensors) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t off = 0;
  for (const auto& t : tensors) {
    h[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  return h;
}

// Writes 8-byte little-endian header length, `header_text`, then `data`.
inline void write_raw_safetensors(const std::string& path, const std::string& header_text,
                                  const std::vector<uint8_t>& data,
                                  uint64_t declared_len = UINT64_MAX) {
  const uint64_t len = declared_len == UINT64_MAX ? header_text.size() : declared_len;
  std::ofstream f(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((len >> (8 * i)) & 0xff));
  f << header_text;
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

inline void write_safetensors(const std::string& path, const std::vector<FixtureTensor>& tensors) {
  std::vector<uint8_t> data;
  for (const auto& t : tensors) data.insert(data.end(), t.bytes.begin(), t.bytes.end());
  write_raw_safetensors(path, safetensors_header(tensors).dump(), data);
}

// A small Llama-style config.json.
inline nlohmann::json llama_config(int layers = 4, int q_heads = 8, int kv_heads = 2,
                                   int head_dim = 64, const std::string& dtype = "bfloat16") {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"num_hidden_layers", layers},
          {"num_attention_heads", q_heads},
          {"num_key_value_heads", kv_heads},
          {"hidden_size", q_heads * head_dim},
          {"head_dim", head_dim},
          {"vocab_size", 256},
          {"max_position_embeddings", 1024},
          {"torch_dtype", dtype}};
}

// A model directory with `config` and (optionally) one model.safetensors.
inline std::string make_model_dir(const nlohmann::json& config,
                                  const std::vector<FixtureTensor>& tensors = {},
                                  bool with_weights = true) {
  const std::string dir = fresh_dir("model");
  write_text(dir + "/config.json", config.dump(2));
  if (with_weights) write_safetensors(dir + "/model.safetensors", tensors);
  return dir;
}

}  // namespace kvq::test
