// The encode-side stages of a Hugging Face tokenizer.json: normalizers, pre-tokenizers and
// post-processors. Parsers throw std::invalid_argument naming the JSON path and what is
// accepted; the caller prefixes the file name.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvq::tok {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void apply(std::string& s) const = 0;
};
// nullptr for a JSON null.
std::unique_ptr<Normalizer> parse_normalizer(const nlohmann::json& j, const std::string& path);

// One piece of text on its way to the model. at_origin: the piece starts at offset 0 of the
// original input (Metaspace's prepend_scheme "first" only prepends there).
struct PreSplit {
  std::string text;
  bool at_origin;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces `splits` by their finer splits (never empty strings).
  virtual void apply(std::vector<PreSplit>& splits) const = 0;
};
std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const nlohmann::json& j, const std::string& path);

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void apply(std::vector<int32_t>& ids, bool add_special_tokens) const = 0;
};
std::unique_ptr<PostProcessor> parse_post_processor(const nlohmann::json& j,
                                                    const std::string& path);

// The spans of `s` kept by HF's split behaviours ("Removed", "Isolated", "MergedWithPrevious",
// "MergedWithNext", "Contiguous"), given the covering list of (span, is_match) pieces.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
struct Piece {
  size_t begin, end;
  bool is_match;
};
std::vector<Piece> split_by_behavior(std::vector<Piece> pieces, SplitBehavior behavior);

class Regex;

// A {"String": s} or {"Regex": r} pattern of a Split, Replace, ... Literal patterns never match
// when empty, as in HF.
struct Pattern {
  std::string literal;
  std::shared_ptr<const Regex> regex;

  static Pattern parse(const nlohmann::json& j, const std::string& path);
  // Covering list of (span, is_match) pieces, like HF's Pattern::find_matches.
  std::vector<Piece> find_matches(std::string_view s) const;
  std::string replace_all(std::string_view s, std::string_view content) const;
};

}  // namespace kvq::tok
