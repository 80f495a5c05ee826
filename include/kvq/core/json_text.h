// JSON text from files and flags: the one place kvq turns untrusted text into nlohmann::json.
// Every failure of the parser (syntax, a number too large for a double, ...) becomes an
// InputError naming the origin, never a stray nlohmann exception.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace kvq {

// Parses `text`; InputError "<origin>: not valid JSON (<the parser's reason>)" on failure.
nlohmann::json parse_json_text(std::string_view text, const std::string& origin);

// Reads and parses the file at `path`; InputError when it cannot be read or is not JSON.
nlohmann::json parse_json_file(const std::string& path);

}  // namespace kvq
