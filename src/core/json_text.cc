#include "kvq/core/json_text.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "kvq/core/error.h"

namespace kvq {

nlohmann::json parse_json_text(std::string_view text, const std::string& origin) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, out_of_range (406), ...
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    if (what.size() > 160) what = what.substr(0, 160) + "...";
    throw InputError(origin + ": not valid JSON (" + what + ")");
  }
}

nlohmann::json parse_json_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(path + ": cannot be read");
  std::ostringstream ss;
  ss << f.rdbuf();
  return parse_json_text(ss.str(), path);
}

}  // namespace kvq
