#include "kvq/core/error.h"

#include <cstdlib>
#include <string>

namespace kvq {

void throw_internal(const char* file, int line, const std::string& message) {
  throw InternalError(std::string("internal error at ") + file + ":" + std::to_string(line) + ": " +
                      message);
}

std::string env_choice(const char* name, std::initializer_list<const char*> accepted) {
  const char* e = std::getenv(name);
  const std::string value = e != nullptr ? e : "";
  if (value.empty()) return value;
  std::string list;
  for (const char* a : accepted) {
    if (value == a) return value;
    list += std::string(list.empty() ? "" : ", ") + a;
  }
  throw InputError(std::string(name) + "=" + value + " is not one of: " + list +
                   " (or unset for the default)");
}

}  // namespace kvq
