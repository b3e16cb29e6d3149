// fusedmlp info: the library, the machine and what can run on it.
#include <omp.h>

#include <memory>

#include "blas_shim.hpp"
#include "commands.hpp"
#include "sysinfo.hpp"

namespace fmlp_cli {
namespace {

std::string availability(fmlp_backend_t b) {
  if (fmlp_backend_available(b) == FMLP_SUCCESS) return "available";
  return fmt::format("unavailable: {}", fmlp_last_error());
}

// Every FMLP_* environment knob (docs/tuning.md) with the value that applies now; with
// `verbose` also its range and purpose.
void print_knobs(bool verbose) {
  fmt::print("knobs (FMLP_* environment variables; docs/tuning.md):\n");
  const int n = fmlp_knob_count();
  for (int i = 0; i < n; ++i) {
    fmlp_knob_info_t k{};
    if (fmlp_knob_info(i, &k) != FMLP_SUCCESS) continue;
    const std::string def = *k.default_value ? k.default_value : "unset";
    const std::string value = *k.value ? k.value : "unset";
    std::string note =
        k.env == nullptr ? fmt::format("default {}", def) : fmt::format("set; default {}", def);
    if (*k.error) note = k.error;
    fmt::print("  {:<6} {:<28} {:<8} ({})\n", k.scope, k.name, value, note);
    if (verbose) {
      if (*k.range) fmt::print("         accepts {}\n", k.range);
      fmt::print("         {}\n", k.purpose);
    }
  }
}

int run_info(bool knobs_only) {
  if (knobs_only) {
    print_knobs(true);
    return 0;
  }
  fmt::print("fusedmlp {}", fmlp_version());
  if (const std::string c = git_commit(); !c.empty()) fmt::print(" (commit {})", c);
  fmt::print("\ncpu:       {}\n", cpu_model());
  std::string flags;
  for (const IsaFlag& f : isa_flags()) flags += fmt::format(" {}{}", f.present ? "+" : "-", f.name);
  fmt::print("isa:      {}\n", flags.empty() ? " (not x86: the cpu backend needs x86-64)" : flags);
  const CacheInfo llc = last_level_cache();
  fmt::print("llc:       {} ({})\n", format_bytes(double(llc.bytes)), llc.source);
  fmt::print("openmp:    {} threads (of {} processors; set OMP_NUM_THREADS to change)\n",
             omp_get_max_threads(), omp_get_num_procs());
  fmt::print("openblas:  {} ({} threads)\n", openblas_get_config(), openblas_get_num_threads());
  fmt::print("build:     {}\n", fmlp_build_info());
  size_t need = 0;
  fmlp_cuda_devices(nullptr, 0, &need);
  std::string devices(need, '\0');
  fmlp_cuda_devices(devices.data(), devices.size(), &need);
  devices.resize(need - 1);
  fmt::print("gpus:      {}\n", devices.empty() ? "none found" : "");
  if (!devices.empty()) fmt::print("{}", devices);
  fmt::print("backends:\n");
  for (fmlp_backend_t b : {FMLP_BACKEND_REF, FMLP_BACKEND_CPU, FMLP_BACKEND_CUDA})
    fmt::print("  {:<5} {}\n", fmlp_backend_name(b), availability(b));
  // Every op's table, the names fmlp_*_with_kernel takes (the error for an unknown name points
  // here).
  struct OpTable {
    const char* op;
    int (*count)();
    const char* (*name)(int);
    fmlp_backend_t (*backend)(int);
  };
  const OpTable tables[] = {
      {"mlp", fmlp_mlp_kernel_count, fmlp_mlp_kernel_name, fmlp_mlp_kernel_backend},
      {"linear", fmlp_linear_kernel_count, fmlp_linear_kernel_name, fmlp_linear_kernel_backend},
      {"softmax", fmlp_softmax_kernel_count, fmlp_softmax_kernel_name, fmlp_softmax_kernel_backend},
      {"moe", fmlp_moe_kernel_count, fmlp_moe_kernel_name, fmlp_moe_kernel_backend},
  };
  for (const OpTable& t : tables) {
    fmt::print(
        "{} kernels (dispatch takes the planner's pick, else the first of the backend that "
        "handles the request):\n",
        t.op);
    const int n = t.count();
    for (int i = 0; i < n; ++i)
      fmt::print("  {:<5} {}\n", fmlp_backend_name(t.backend(i)), t.name(i));
    if (n == 0) fmt::print("  (none)\n");
  }
  print_knobs(false);
  return 0;
}

}  // namespace

void add_info_command(CLI::App& app, Command* selected) {
  CLI::App* cmd = app.add_subcommand(
      "info",
      "Version, CPU and ISA, threads, backend availability, the kernel table and the "
      "environment knobs");
  auto knobs_only = std::make_shared<bool>(false);
  cmd->add_flag("--knobs", *knobs_only,
                "Only the FMLP_* environment knobs, with what each accepts and does");
  cmd->callback(
      [selected, knobs_only] { *selected = [knobs_only] { return run_info(*knobs_only); }; });
}

}  // namespace fmlp_cli
