// The decode side of a tokenizer.json: token strings -> text, in one go (HF's decode_chain,
// step by step) and incrementally for streaming.
#pragma once

#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "tokenizer/pipeline.h"

namespace kvq::tok {

struct DecoderStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace };
  Kind kind;
  Pattern pattern;          // kReplace
  std::string content;      // kReplace: replacement; kStrip: the character stripped
  size_t start = 0;         // kStrip
  size_t stop = 0;          // kStrip
  std::string replacement;  // kMetaspace
  bool prepend = true;      // kMetaspace: prepend_scheme != never
};

class DecoderStream;

class Decoder {
 public:
  // nullptr for a JSON null. Throws std::invalid_argument naming the path.
  static std::unique_ptr<Decoder> parse(const nlohmann::json& j, const std::string& path);

  // HF's Decoder::decode: every step over the whole token list, then concatenation.
  std::string decode(std::vector<std::string> tokens) const;
  std::unique_ptr<DecoderStream> stream() const;

  const std::vector<DecoderStep>& steps() const { return steps_; }

 private:
  std::vector<DecoderStep> steps_;  // a Sequence, flattened
};

// Incremental form of Decoder::decode: push() returns text that no later token can change.
class DecoderStream {
 public:
  virtual ~DecoderStream() = default;
  virtual std::string push(std::string token) = 0;
  virtual std::string finish() = 0;  // then ready for a new sequence
};

}  // namespace kvq::tok
