// Runs the `kvq` binary as a user would and captures exit code, stdout, stderr.
#pragma once

#include <string>
#include <vector>

namespace kvq::test {

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// The kvq binary: $KVQ_BINARY, else the one this build made.
const std::string& kvq_binary();

// Runs kvq_binary() with `args` (no shell involved).
CommandResult run_kvq(const std::vector<std::string>& args);

// A fresh empty directory under the system temp dir, removed at exit of the test binary.
std::string make_temp_dir(const std::string& tag);

}  // namespace kvq::test
