// fusedmlp tune: measure the cuBLASLt algorithms of the CUDA paths' GEMMs for model shapes and
// batch sizes, and write the tune table that FMLP_TUNE_FILE / fmlp_tune_load read back.
#include <memory>

#include "commands.hpp"
#include "fusedmlp/fusedmlp.hpp"
#include "runner.hpp"
#include "workloads.hpp"

namespace fmlp_cli {
namespace {

struct TuneOptions {
  std::vector<std::string> shapes = {"llama3-8b"};
  std::vector<int64_t> ms = {256, 1024, 4096};
  fmlp_dtype_t w_dtype = FMLP_DTYPE_BF16;
  std::string gate_up = "separate";
  bool packed = false;
  std::string out, merge;
  uint64_t seed = 1;
};

int run_tune(const TuneOptions& o) {
  if (!bench_on_cuda(FMLP_BACKEND_CUDA))
    throw CliError("tune measures cuBLASLt GEMMs and needs the cuda backend");
  if (!o.merge.empty()) {
    fmlp::tune_load(o.merge);
    progress("loaded {} entries from {}", fmlp_tune_count(), o.merge);
  }
  for (const std::string& spec : o.shapes) {
    MlpCase c;
    c.shape = parse_shape(spec, o.gate_up == "stacked");
    // Activations in the weight dtype, bf16 for fp8 weights (bench's default on the GPU).
    c.w_dtype = o.w_dtype;
    c.act_dtype = o.w_dtype == FMLP_DTYPE_F8_E4M3 ? FMLP_DTYPE_BF16 : o.w_dtype;
    for (int64_t m : o.ms) {
      if (m <= 0) throw CliError(fmt::format("--ms must be positive (got {})", m));
      c.m = m;
      HostMlp problem(c, o.seed, 1);
      std::unique_ptr<FusedRunner> runner = make_fused_runner(problem, FMLP_BACKEND_CUDA, o.packed);
      const size_t before = fmlp_tune_count();
      {
        const fmlp::Tuning tuning;
        runner->run(0);
      }
      progress("{} M={}: kernel {}, {} new tune entries", c.shape.name, m, runner->kernel(),
               fmlp_tune_count() - before);
    }
  }
  fmlp::tune_save(o.out);
  fmt::print("wrote {} tune entries to {}; use them with FMLP_TUNE_FILE={}\n", fmlp_tune_count(),
             o.out, o.out);
  return 0;
}

}  // namespace

void add_tune_command(CLI::App& app, Command* selected) {
  auto o = std::make_shared<TuneOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tune",
      "Time the cuBLASLt algorithms of the CUDA paths' GEMMs (prefill, cuBLASLt decode) for "
      "shapes and batch sizes; write the tune file FMLP_TUNE_FILE reads");
  cmd->add_option("--shapes", o->shapes,
                  "Comma-separated presets (gpt2-small, seed-4096, llama3-8b) or "
                  "custom specs DINxHIDDEN[xDOUT]:ACT[:gated][:bias] (llama3-70b: "
                  "8192x28672:silu:gated)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--ms", o->ms, "Comma-separated batch sizes M (rows of x)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--w-dtype,--wdtype", o->w_dtype, "Weight dtype")
      ->transform(choice_of(weight_dtype_names()))
      ->default_str("bf16");
  cmd->add_option("--gate-up", o->gate_up, "Layout of gate/up weights in gated shapes")
      ->check(CLI::IsMember({"separate", "stacked"}))
      ->capture_default_str();
  cmd->add_flag("--packed", o->packed, "Tune fmlp_mlp_packed_run's GEMMs (packed weights)");
  cmd->add_option("--merge", o->merge, "Start from this tune file (its entries are kept)");
  cmd->add_option("-o,--out", o->out, "The tune file to write")->required();
  cmd->add_option("--seed", o->seed, "Random data seed")->capture_default_str();
  cmd->callback([o, selected] { *selected = [o] { return run_tune(*o); }; });
}

}  // namespace fmlp_cli
