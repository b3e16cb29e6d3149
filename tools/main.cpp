// fusedmlp: the command-line front end (bench, check, explain, info, quantize) over the public
// API.
#include <iostream>

#include "commands.hpp"
#include "fusedmlp/fusedmlp.hpp"

int main(int argc, char** argv) {
  using namespace fmlp_cli;
  CLI::App app{
      "fusedmlp: a transformer FFN block as one fused op. Run a subcommand with --help "
      "for its options."};
  app.require_subcommand(0, 1);
  app.footer(
      "Exit status: 0 ok, 1 usage or runtime error, 2 a result disagreed with the "
      "reference.\n");
  Command selected;
  add_bench_command(app, &selected);
  add_check_command(app, &selected);
  add_explain_command(app, &selected);
  add_info_command(app, &selected);
  add_quantize_command(app, &selected);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints the message, or the help it asked for
    return code == 0 ? 0 : kExitError;
  }
  if (!selected) {
    std::cout << app.help();
    return 0;
  }
  try {
    return selected();
  } catch (const WrongResult& e) {
    std::cerr << "fusedmlp: wrong result: " << e.what() << "\n";
    return kExitWrongResult;
  } catch (const CliError& e) {
    std::cerr << "fusedmlp: error: " << e.what() << "\n";
  } catch (const fmlp::Error& e) {
    std::cerr << "fusedmlp: library error: " << e.what() << "\n";
  } catch (const std::bad_alloc&) {
    std::cerr << "fusedmlp: error: out of host memory; use smaller --shapes/--ms\n";
  }
  return kExitError;
}
