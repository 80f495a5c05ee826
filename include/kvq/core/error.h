// Errors. Bad input from a user (a flag, a file, a request) is an InputError:
// one line naming what was wrong and what is accepted. The command line turns
// it into exit code 2; nothing below ever exits or aborts on bad input.
#pragma once

#include <initializer_list>
#include <stdexcept>
#include <string>

namespace kvq {

class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& message) : std::runtime_error(message) {}
};

// A broken internal invariant (a bug in kvq, not bad input).
class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& message) : std::logic_error(message) {}
};

[[noreturn]] void throw_internal(const char* file, int line, const std::string& message);

// The value of environment variable `name` ("" when unset or empty), which must be one of
// `accepted`; anything else is an InputError naming the variable and the accepted values.
// For kvq's A/B switches (KVQ_CPU_ISA and the like), so a mistyped value is refused
// instead of silently running the default.
std::string env_choice(const char* name, std::initializer_list<const char*> accepted);

}  // namespace kvq

#define KVQ_CHECK(cond, msg)                                       \
  do {                                                             \
    if (!(cond)) ::kvq::throw_internal(__FILE__, __LINE__, (msg)); \
  } while (0)
