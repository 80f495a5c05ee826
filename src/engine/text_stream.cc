#include "text_stream.h"

#include <algorithm>

namespace kvq {

namespace {

// Longest suffix of `text` that is a proper prefix of some stop string: text that must be held
// back until the next token shows whether a stop string completes.
size_t held_back(std::string_view text, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const auto& s : stops)
    for (size_t k = std::min(s.size() - 1, text.size()); k > hold; --k)
      if (text.substr(text.size() - k) == std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
  return hold;
}

}  // namespace

TextStream::TextStream(const Tokenizer& tokenizer, const SamplingParams& params)
    : stop_ids_(params.stop_token_ids), stops_(params.stop), decoder_(tokenizer) {
  if (!params.ignore_eos)
    for (int32_t id : tokenizer.eos_ids()) stop_ids_.push_back(id);
  for (const auto& s : stops_) max_stop_ = std::max(max_stop_, s.size());
}

TextStream::Step TextStream::push(int32_t id) {
  const bool is_stop_token = std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end();
  if (!is_stop_token) text_ += decoder_.push(id);
  // A stop string ends the text where it begins; only the new tail can hold a new match.
  size_t cut = std::string::npos;
  if (!stops_.empty()) {
    const size_t from = emitted_ > max_stop_ ? emitted_ - max_stop_ : 0;
    for (const auto& s : stops_) {
      const size_t at = text_.find(s, from);
      if (at != std::string::npos) cut = std::min(cut, at);
    }
  }
  Step step;
  step.stop = is_stop_token || cut != std::string::npos;
  if (is_stop_token) text_ += decoder_.finish();
  if (cut != std::string::npos) text_.resize(std::max(cut, emitted_));
  const size_t ready = step.stop ? text_.size() : text_.size() - held_back(text_, stops_);
  if (ready >= emitted_) {
    step.has_text = true;
    step.text = std::string_view(text_).substr(emitted_, ready - emitted_);
    emitted_ = ready;
  }
  return step;
}

std::string_view TextStream::finish() {
  text_ += decoder_.finish();
  const std::string_view rest = std::string_view(text_).substr(emitted_);
  emitted_ = text_.size();
  return rest;
}

}  // namespace kvq
