// Minimal logging to stderr. Warnings are also collected by the planner so
// `kvq plan --json` can report them; this is only the terminal side.
#pragma once

#include <string_view>

namespace kvq {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
void log(LogLevel level, std::string_view message);
inline void log_warning(std::string_view m) { log(LogLevel::kWarning, m); }
inline void log_info(std::string_view m) { log(LogLevel::kInfo, m); }

}  // namespace kvq
