// PCRE2-backed regular expressions with the Unicode semantics of Oniguruma, which the Hugging Face
// tokenizers library uses for its split patterns.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvq::tok {

class Regex {
 public:
  // Compiles once with PCRE2_UTF | PCRE2_UCP (JIT when available). Throws std::invalid_argument
  // with PCRE2's message for a bad pattern.
  explicit Regex(std::string_view pattern);
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex();

  // Non-overlapping matches in `s` (valid UTF-8) from left to right, as [begin, end) byte
  // offsets. Empty matches are reported; the search then resumes one character later.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;
  bool search(std::string_view s) const;

 private:
  int match_at(std::string_view s, size_t start, void* match_data) const;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

// Oniguruma's \s also matches U+0085 (NEL), PCRE2's does not; rewrite \s / \S so the two agree.
std::string onig_to_pcre2(std::string_view pattern);

}  // namespace kvq::tok
