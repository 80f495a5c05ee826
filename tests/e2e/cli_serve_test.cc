// `kvq serve` as a process: SIGTERM drains (requests in flight finish within the grace period,
// /health says draining, new requests get 503), then the process exits 0.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "e2e/cli_test_util.h"
#include "support/source_dir.h"

extern char** environ;

namespace kvq::test {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

const std::string kCode = ::kvq::test::source_dir() + "/models/kvq-code-tiny";

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A `kvq serve --port 0` child whose stderr goes to a file; the port is read from its banner.
class ServeProcess {
 public:
  explicit ServeProcess(std::vector<std::string> args) : err_(make_temp_dir("serve") + "/err") {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    args.insert(args.begin(), {kvq_binary(), "serve"});
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, kvq_binary().c_str(), &fa, nullptr, argv.data(), environ) != 0)
      pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    const std::string banner = "listening on http://127.0.0.1:";
    const auto until = Clock::now() + std::chrono::seconds(120);
    while (pid_ > 0 && Clock::now() < until && port_ <= 0) {
      const std::string e = slurp(err_);
      if (const size_t at = e.find(banner); at != std::string::npos)
        port_ = std::atoi(e.c_str() + at + banner.size());
      else
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~ServeProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  std::string err() const { return slurp(err_); }
  // The exit code, or -1 when it did not exit within `seconds` (then it is killed).
  int wait_exit(double seconds) {
    const auto until = Clock::now() + std::chrono::duration<double>(seconds);
    int status = 0;
    while (Clock::now() < until) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

 private:
  std::string err_;
  pid_t pid_ = -1;
  int port_ = -1;
  bool exited_ = false;
};

int health(int port) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(5, 0);
  auto r = c.Get("/health");
  return r ? r->status : -1;
}

// Waits (up to a minute) until the server's engine computes one request.
bool one_request_running(int port) {
  const auto until = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < until) {
    httplib::Client c("127.0.0.1", port);
    auto m = c.Get("/metrics");
    if (m && m->body.find("kvq_requests_running 1") != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

TEST(CliServe, SigtermLetsRequestsInFlightFinishThenExitsZero) {
  if (!std::filesystem::exists(kCode + "/config.json")) GTEST_SKIP() << "no default model";
  ServeProcess serve({"--model", kCode, "--port", "0", "--shutdown-grace-period", "120"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  EXPECT_EQ(health(serve.port()), 200);
  int status = 0;
  json body;
  std::thread client([&] {
    httplib::Client c("127.0.0.1", serve.port());
    c.set_read_timeout(300, 0);
    auto r =
        c.Post("/v1/completions",
               R"({"prompt": "def main(", "max_tokens": 96, "ignore_eos": true, "temperature": 0})",
               "application/json");
    status = r ? r->status : -1;
    if (r) body = json::parse(r->body, nullptr, false);
  });
  // The request is in the engine, then SIGTERM.
  ASSERT_TRUE(one_request_running(serve.port())) << serve.err();
  ASSERT_EQ(kill(serve.pid(), SIGTERM), 0);
  bool draining = false;
  for (int i = 0; i < 200 && !draining; ++i) {
    draining = health(serve.port()) == 503;
    if (!draining) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  client.join();
  EXPECT_EQ(status, 200) << body.dump() << "\n" << serve.err();
  EXPECT_EQ(body["usage"]["completion_tokens"], 96) << "the request in flight was cut short";
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(serve.wait_exit(60), 0) << serve.err();
  const std::string err = serve.err();
  EXPECT_NE(err.find("SIGTERM received, refusing new requests"), std::string::npos) << err;
  EXPECT_NE(err.find("kvq serve: stopped"), std::string::npos) << err;
  // (draining is seen only if the request was still running when /health was asked.)
  if (!draining) std::printf("note: the request finished before /health was polled\n");
}

TEST(CliServe, SigtermWithoutGraceCancelsAndExitsZero) {
  if (!std::filesystem::exists(kCode + "/config.json")) GTEST_SKIP() << "no default model";
  ServeProcess serve({"--model", kCode, "--port", "0", "--shutdown-grace-period", "0"});
  ASSERT_GT(serve.port(), 0) << serve.err();
  int status = 0;
  std::thread client([&] {
    httplib::Client c("127.0.0.1", serve.port());
    c.set_read_timeout(300, 0);
    auto r = c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 1900, "ignore_eos": true})",
                    "application/json");
    status = r ? r->status : -1;
  });
  ASSERT_TRUE(one_request_running(serve.port())) << serve.err();
  const auto t0 = Clock::now();
  ASSERT_EQ(kill(serve.pid(), SIGTERM), 0);
  client.join();
  EXPECT_TRUE(status == 503 || status == -1) << status;
  EXPECT_EQ(serve.wait_exit(60), 0) << serve.err();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 30.0);
  EXPECT_NE(serve.err().find("1 request(s) cancelled"), std::string::npos) << serve.err();
}

}  // namespace
}  // namespace kvq::test
