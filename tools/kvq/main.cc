// kvq: the command line. Every user error becomes one line on stderr and exit code 2.
#include <cstdio>
#include <exception>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "commands.h"
#include "kvq/attention/support_matrix.h"
#include "kvq/core/error.h"
#ifdef KVQ_WITH_CUDA
#include "kvq/model/cuda_model.h"
#endif
#include "plan_flags.h"

int main(int argc, char** argv) {
  CLI::App app{"kvq: LLM inference with a per-layer KV cache precision"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "help for every command");
  std::map<CLI::App*, kvq::cli::Action> actions;
  auto add = [&](kvq::cli::Action (*adder)(CLI::App&)) {
    const size_t before = app.get_subcommands({}).size();
    auto action = adder(app);
    actions[app.get_subcommands({})[before]] = std::move(action);
  };
  add(kvq::cli::add_plan_command);
  add(kvq::cli::add_backends_command);
  add(kvq::cli::add_generate_command);
  add(kvq::cli::add_eval_command);
  add(kvq::cli::add_serve_command);
  add(kvq::cli::add_bench_command);
  add(kvq::cli::add_quantize_command);

  std::vector<std::string> args = kvq::cli::normalize_args(argc, argv);
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());
  try {
    app.parse(static_cast<int>(cargs.size()), cargs.data());
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "kvq: error: %s (see kvq --help)\n", e.what());
    return 2;
  }
  try {
    kvq::check_cpu_kernel_env();
#ifdef KVQ_WITH_CUDA
    kvq::check_cuda_model_env();
#endif
    for (auto* sub : app.get_subcommands())
      if (auto it = actions.find(sub); it != actions.end()) return it->second();
    return 2;
  } catch (const kvq::InputError& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq: internal error: %s\n", e.what());
    return 1;
  }
}
