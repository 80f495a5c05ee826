// kvq backends: the attention backends built into this binary and what each accepts.
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kvq/attention/support_matrix.h"

namespace kvq::cli {

Action add_backends_command(CLI::App& app) {
  auto* sub = app.add_subcommand("backends", "print the attention backends' support matrix");
  auto json = std::make_shared<bool>(false);
  sub->add_flag("--json", *json, "print the support matrix as JSON (schema in docs/CLI.md)");
  return [json]() {
    if (*json) {
      std::cout << attention_support_matrix_json().dump(2) << "\n";
    } else {
      for (const auto& line : attention_support_matrix_lines()) std::cout << line << "\n";
    }
    return 0;
  };
}

}  // namespace kvq::cli
