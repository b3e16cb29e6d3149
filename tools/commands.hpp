// The subcommands. Each adds itself to the app and, when the user picks it, sets the action
// main runs after parsing.
#pragma once
#include <CLI/CLI.hpp>

#include "cli_common.hpp"

namespace fmlp_cli {

void add_bench_command(CLI::App& app, Command* selected);
void add_check_command(CLI::App& app, Command* selected);
void add_explain_command(CLI::App& app, Command* selected);
void add_info_command(CLI::App& app, Command* selected);
void add_quantize_command(CLI::App& app, Command* selected);

}  // namespace fmlp_cli
