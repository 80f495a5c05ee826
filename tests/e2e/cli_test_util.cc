#include "e2e/cli_test_util.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>

#include "support/fixtures.h"

extern char** environ;

namespace kvq::test {

namespace {
std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
}  // namespace

std::string make_temp_dir(const std::string& tag) {
  return fresh_dir(tag);  // inside the process's test directory, removed at exit
}

const std::string& kvq_binary() {
  static const std::string b = [] {
    const char* env = std::getenv("KVQ_BINARY");
    return std::string(env != nullptr && *env != '\0' ? env : KVQ_BINARY);
  }();
  return b;
}

CommandResult run_kvq(const std::vector<std::string>& args) {
  const std::string dir = make_temp_dir("run");
  const std::string out_path = dir + "/stdout", err_path = dir + "/stderr";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const std::string& binary = kvq_binary();
  std::vector<std::string> argv_s = {binary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, binary.c_str(), &fa, nullptr, argv.data(), environ) != 0)
    throw std::runtime_error("cannot spawn " + binary);
  posix_spawn_file_actions_destroy(&fa);
  int status = 0;
  waitpid(pid, &status, 0);
  CommandResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out_path);
  r.err = slurp(err_path);
  std::filesystem::remove_all(dir);
  return r;
}

}  // namespace kvq::test
