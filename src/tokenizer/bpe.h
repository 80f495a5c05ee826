// The BPE model of the Hugging Face tokenizers library: characters (or <0xNN> byte tokens, or
// unk) merged pair by pair, lowest merge rank first, leftmost first among equal ranks.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvq::tok {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // Parses tokenizer.json's "model" object (type BPE). Throws std::invalid_argument with what is
  // wrong (the caller names the file).
  static BpeModel from_json(const nlohmann::json& model);

  // Appends the ids of one pre-tokenized word to `out`.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  const Vocab& vocab() const { return vocab_; }
  // Token text by id, for ids in the vocabulary.
  const std::string* id_to_token(int32_t id) const;
  int32_t max_id() const { return static_cast<int32_t>(vocab_r_.size()) - 1; }

 private:
  struct MergeTarget {
    uint32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  Vocab vocab_;
  std::vector<std::string> vocab_r_;
  std::vector<bool> has_id_;
  std::unordered_map<uint64_t, MergeTarget> merges_;
  std::optional<std::string> unk_token_;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::vector<int32_t> byte_ids_;  // id of "<0xNN>" per byte, -1 when absent
};

}  // namespace kvq::tok
