// One function per `kvq` subcommand: registers its flags and returns the action to run.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace kvq::cli {

using Action = std::function<int()>;

Action add_plan_command(CLI::App& app);
Action add_backends_command(CLI::App& app);
Action add_generate_command(CLI::App& app);
Action add_eval_command(CLI::App& app);
Action add_serve_command(CLI::App& app);
Action add_bench_command(CLI::App& app);
Action add_quantize_command(CLI::App& app);

}  // namespace kvq::cli
