#include "kvq/core/log.h"

#include <atomic>
#include <cstdio>
#include <string>

namespace kvq {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }

void log(LogLevel level, std::string_view message) {
  if (static_cast<int>(level) < g_level.load()) return;
  static constexpr const char* kPrefix[] = {"debug", "info", "warning", "error"};
  std::string line = "kvq: ";
  line += kPrefix[static_cast<int>(level)];
  line += ": ";
  line += message;
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace kvq
