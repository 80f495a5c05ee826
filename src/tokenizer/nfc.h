// Unicode Normalization Form C, for tokenizer.json's "NFC" normalizer (Qwen and others).
#pragma once

#include <string>
#include <string_view>

namespace kvq::tok {

// NFC of valid UTF-8 text. Text below U+0300 is returned unchanged without further work.
std::string nfc(std::string_view s);

}  // namespace kvq::tok
