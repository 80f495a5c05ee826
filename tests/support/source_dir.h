// Where the tests find the repository's models and fixtures, at run time (never a path compiled
// into the binaries, so a bundle of test binaries runs on another machine):
//   1. $KVQ_SOURCE_DIR when set;
//   2. else the directory the build recorded next to the test binaries
//      (kvq_test_source_dir.txt, written by tests/CMakeLists.txt at configure time);
//   3. else the current directory (a bundle on the GPU machine runs from the repository root).
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace kvq::test {

inline const std::string& source_dir() {
  static const std::string dir = [] {
    if (const char* e = std::getenv("KVQ_SOURCE_DIR"); e != nullptr && *e != '\0')
      return std::string(e);
    std::error_code ec;
    const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) {
      std::ifstream f(exe.parent_path() / "kvq_test_source_dir.txt");
      std::string line;
      if (f && std::getline(f, line) && !line.empty() &&
          std::filesystem::exists(std::filesystem::path(line) / "models"))
        return line;
    }
    return std::filesystem::current_path(ec).string();
  }();
  return dir;
}

}  // namespace kvq::test
