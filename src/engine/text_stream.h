// Per-request stop conditions and streamed text, shared by generate() and LlmEngine so both
// stop and stream identically: stop tokens (the tokenizer's EOS ids unless ignore_eos, plus
// stop_token_ids) end generation without adding text; a stop string ends the text where it
// begins; text that could still begin a stop string is held back until ruled out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/engine/sampler.h"
#include "kvq/tokenizer/tokenizer.h"

namespace kvq {

class TextStream {
 public:
  // The tokenizer must outlive the stream.
  TextStream(const Tokenizer& tokenizer, const SamplingParams& params);

  struct Step {
    std::string_view text;  // newly final text (valid until the next call)
    bool has_text = false;  // false when held-back text shrank below what was already handed out
    bool stop = false;      // a stop token or a stop string ended generation here
  };
  // Feeds one sampled id.
  Step push(int32_t id);
  // Ends a generation that no stop ended (length, cancellation): flushes held-back text.
  std::string_view finish();

  const std::string& text() const { return text_; }
  std::string take_text() { return std::move(text_); }

 private:
  std::vector<int32_t> stop_ids_;
  std::vector<std::string> stops_;
  size_t max_stop_ = 0;
  StreamingDecoder decoder_;
  std::string text_;    // all final text so far
  size_t emitted_ = 0;  // bytes of text_ handed out
};

}  // namespace kvq
