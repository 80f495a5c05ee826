// UTF-8 helpers shared by the tokenizer stages.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvq::tok {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// What starts at s[i]: a whole character of `len` bytes, an invalid sequence whose maximal
// subpart is `len` bytes (replaced by one U+FFFD), or a valid but truncated prefix of `len`
// bytes that reaches the end of s.
enum class Utf8Status { kChar, kInvalid, kTruncated };
struct Utf8Step {
  Utf8Status status;
  size_t len;
};
Utf8Step utf8_step(std::string_view s, size_t i);

// s with every invalid sequence replaced by U+FFFD, exactly as Rust's String::from_utf8_lossy.
std::string utf8_lossy(std::string_view s);
bool utf8_valid(std::string_view s);

// Length in bytes of the (valid) character starting at s[i]; 1 for a stray byte.
size_t utf8_char_len(std::string_view s, size_t i);
// Code point of the valid character at s[i] (len = utf8_char_len).
uint32_t utf8_decode(std::string_view s, size_t i, size_t len);
void utf8_append(std::string& out, uint32_t cp);
size_t utf8_count_chars(std::string_view s);

// Rust's char::is_whitespace (Unicode White_Space).
bool is_unicode_whitespace(uint32_t cp);

// GPT-2's reversible byte <-> printable character map, as UTF-8 strings.
struct ByteLevelMap {
  std::array<std::string, 256> byte_to_char;
  // Code point -> byte, for code points < 512 (all mapped characters are below 324);
  // -1 when the code point is not a mapped character.
  std::array<int16_t, 512> char_to_byte;
};
const ByteLevelMap& byte_level_map();

}  // namespace kvq::tok
