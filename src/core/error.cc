#include "kvq/core/error.h"

#include <string>

namespace kvq {

void throw_internal(const char* file, int line, const std::string& message) {
  throw InternalError(std::string("internal error at ") + file + ":" + std::to_string(line) +
                      ": " + message);
}

}  // namespace kvq
