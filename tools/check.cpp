// fusedmlp check: every runnable op-table kernel against the ref oracle on a fixed set of cases.
#include <memory>

#include "accuracy.hpp"
#include "cli_common.hpp"
#include "commands.hpp"
#include "fp8_report.hpp"
#include "workloads.hpp"

namespace fmlp_cli {
namespace {

struct CheckOptions {
  std::string kernel;  // empty: all
  uint64_t seed = 7;
  int threads = 0;
  bool quiet = false;
  fmlp_dtype_t w_dtype = FMLP_DTYPE_INVALID;  // set: every case uses it (f8: plus the report)
  int64_t report_m = 4;
};

MlpCase make_case(int64_t m, int64_t d_in, int64_t hidden, int64_t d_out, fmlp_activation_t act,
                  bool gated, bool stacked, bool bias, fmlp_dtype_t act_dtype, fmlp_dtype_t w_dtype,
                  fmlp_norm_t norm = FMLP_NORM_NONE, Residual residual = Residual::kNone) {
  MlpShape s;
  s.d_in = d_in;
  s.hidden = hidden;
  s.d_out = d_out;
  s.act = act;
  s.gated = gated;
  s.stacked = gated && stacked;
  s.bias = bias;
  s.norm = norm;
  s.name = describe(s);
  return {s, m, act_dtype, w_dtype, residual};
}

// Odd sizes catch tail handling; every activation x (dense, gated separate, gated stacked);
// every activation/weight dtype pair; norms and both residual forms.
std::vector<MlpCase> check_cases() {
  const fmlp_dtype_t F32 = FMLP_DTYPE_F32, F16 = FMLP_DTYPE_F16, BF16 = FMLP_DTYPE_BF16,
                     F8 = FMLP_DTYPE_F8_E4M3;
  std::vector<MlpCase> c;
  for (fmlp_activation_t act : {FMLP_ACT_RELU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH, FMLP_ACT_SILU}) {
    c.push_back(make_case(5, 67, 131, 45, act, false, false, true, F32, BF16));
    c.push_back(make_case(5, 67, 131, 45, act, true, false, false, F32, BF16));
    c.push_back(make_case(3, 67, 131, 45, act, true, true, true, F32, BF16));
  }
  for (fmlp_dtype_t ad : {F32, F16, BF16})
    for (fmlp_dtype_t wd : {F32, F16, BF16, F8}) {
      c.push_back(make_case(4, 96, 160, 80, FMLP_ACT_GELU, false, false, true, ad, wd));
      c.push_back(make_case(2, 128, 136, 128, FMLP_ACT_SILU, true, false, false, ad, wd));
    }
  c.push_back(make_case(1, 1, 1, 1, FMLP_ACT_GELU, false, false, true, F32, BF16));
  c.push_back(make_case(1, 3, 5, 7, FMLP_ACT_SILU, true, true, false, F32, F32));
  c.push_back(make_case(1, 1024, 2816, 1024, FMLP_ACT_SILU, true, false, false, F32, BF16));
  c.push_back(make_case(2, 768, 3072, 768, FMLP_ACT_GELU_TANH, false, false, true, BF16, BF16));
  c.push_back(make_case(17, 257, 515, 129, FMLP_ACT_GELU, false, false, true, F32, BF16));
  c.push_back(make_case(33, 64, 256, 64, FMLP_ACT_SILU, true, true, false, F16, F16));
  c.push_back(make_case(64, 128, 384, 128, FMLP_ACT_RELU, false, false, false, F32, F32));
  c.push_back(make_case(7, 100, 200, 100, FMLP_ACT_GELU, false, false, true, F32, BF16,
                        FMLP_NORM_LAYERNORM, Residual::kSeparate));
  c.push_back(make_case(7, 100, 200, 100, FMLP_ACT_SILU, true, false, false, BF16, BF16,
                        FMLP_NORM_RMSNORM, Residual::kInPlace));
  c.push_back(make_case(3, 72, 72, 40, FMLP_ACT_SILU, true, true, true, F32, F8, FMLP_NORM_RMSNORM,
                        Residual::kSeparate));
  return c;
}

std::string case_label(const MlpCase& c) {
  const char* res = c.residual == Residual::kSeparate  ? " +residual"
                    : c.residual == Residual::kInPlace ? " +residual(in-place)"
                                                       : "";
  return fmt::format("M={} {} {}/{}{}", c.m, c.shape.name, fmlp_dtype_name(c.act_dtype),
                     fmlp_dtype_name(c.w_dtype), res);
}

struct KernelToRun {
  std::string name;
  fmlp_backend_t backend;
};

// The kernels check can run here; prints why the others are left out.
std::vector<KernelToRun> runnable_kernels(const std::string& only) {
  std::vector<KernelToRun> run;
  bool found = only.empty();
  for (int i = 0; i < fmlp_mlp_kernel_count(); ++i) {
    const std::string name = fmlp_mlp_kernel_name(i);
    const fmlp_backend_t b = fmlp_mlp_kernel_backend(i);
    if (!only.empty() && name != only) continue;
    found = true;
    if (b == FMLP_BACKEND_REF) {
      fmt::print("note  {} is the reference every kernel is compared with\n", name);
    } else if (fmlp_backend_available(b) != FMLP_SUCCESS) {
      fmt::print("note  {} not run: backend {} is unavailable: {}\n", name, fmlp_backend_name(b),
                 fmlp_last_error());
    } else if (b == FMLP_BACKEND_CUDA) {
      fmt::print("note  {} not run: check does not drive device memory yet\n", name);
    } else {
      run.push_back({name, b});
    }
  }
  if (!found)
    throw CliError(
        fmt::format("--kernel '{}' is not in the op table; `fusedmlp info` lists the "
                    "kernels",
                    only));
  return run;
}

int run_check(const CheckOptions& o) {
  apply_thread_count(o.threads);
  if (o.report_m < 1)
    throw CliError(fmt::format("--report-m is {}; pass 1 or more rows", o.report_m));
  const std::vector<KernelToRun> kernels = runnable_kernels(o.kernel);
  if (kernels.empty()) {
    fmt::print("no kernel besides the reference can run here, so there is nothing to check\n");
    return 0;
  }
  std::vector<MlpCase> cases = check_cases();
  if (o.w_dtype != FMLP_DTYPE_INVALID)
    for (MlpCase& c : cases) c.w_dtype = o.w_dtype;
  int passed = 0, failed = 0, skipped = 0;
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    HostMlp problem(cases[ci], o.seed + ci);
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < cases[ci].m; ++r) rows.push_back(r);
    const std::vector<float> ref = problem.reference_rows(rows);
    const double tol = tolerance_for(cases[ci].act_dtype);
    const std::string label = case_label(cases[ci]);
    for (const KernelToRun& k : kernels) {
      problem.reset_output();
      const fmlp_mlp_args_t args = problem.args(0);
      fmlp_status_t s = fmlp_mlp_kernel_supports(&args, k.name.c_str());
      if (s == FMLP_ERROR_NOT_SUPPORTED) {
        ++skipped;
        if (!o.quiet) fmt::print("SKIP  {}  {}: {}\n", k.name, label, fmlp_last_error());
        continue;
      }
      size_t bytes = 0;
      if (s == FMLP_SUCCESS) s = fmlp_mlp_kernel_workspace_size(&args, k.name.c_str(), &bytes);
      std::vector<unsigned char> ws(bytes);
      if (s == FMLP_SUCCESS)
        s = fmlp_mlp_with_kernel(&args, k.name.c_str(), ws.empty() ? nullptr : ws.data(), ws.size(),
                                 nullptr);
      if (s != FMLP_SUCCESS) {
        ++failed;
        fmt::print("FAIL  {}  {}: returned {}: {}\n", k.name, label, fmlp_status_name(s),
                   fmlp_last_error());
        continue;
      }
      // fp8 weights on the prefill path run W8A8 (x and h quantised per token to e4m3,
      // docs/prefill.md): a few % of the row's scale, not the exact weight-only result.
      const bool w8a8 =
          cases[ci].w_dtype == FMLP_DTYPE_F8_E4M3 && k.name.find("prefill") != std::string::npos;
      const double ktol = w8a8 ? 0.25 : tol;
      const ErrorStats e = compare(problem.output_rows(rows), ref, ktol);
      (e.pass ? passed : failed)++;
      fmt::print("{}  {}  {}  {}\n", e.pass ? "PASS" : "FAIL", k.name, label, summarize(e, ktol));
    }
    std::fflush(stdout);
  }
  fmt::print("{} passed, {} failed, {} skipped (kernel does not handle the case)\n", passed, failed,
             skipped);
  if (o.w_dtype == FMLP_DTYPE_F8_E4M3 && !print_fp8_accuracy_report(o.seed, o.report_m)) ++failed;
  if (failed > 0) {
    fmt::print(stderr,
               "fusedmlp check: {} case(s) failed; the FAIL lines name the kernel and "
               "case to reproduce\n",
               failed);
    return kExitWrongResult;
  }
  return 0;
}

}  // namespace

void add_check_command(CLI::App& app, Command* selected) {
  auto o = std::make_shared<CheckOptions>();
  CLI::App* cmd = app.add_subcommand(
      "check",
      "Run every available op-table kernel against the ref backend; non-zero exit on "
      "any failure");
  cmd->add_option("--kernel", o->kernel, "Only this kernel (names: fusedmlp info)");
  cmd->add_option("--seed", o->seed, "Random data seed")->capture_default_str();
  cmd->add_option("--threads", o->threads, "OpenMP threads (0: default)")->capture_default_str();
  cmd->add_flag("-q,--quiet", o->quiet, "Do not print SKIP lines");
  cmd->add_option(
         "--w-dtype,--wdtype", o->w_dtype,
         "Run every case with this weight dtype; f8 (f8_e4m3, per-row scales from "
         "fmlp_quantize_fp8) also reports the fp8 accuracy on the gpt2-small and llama3-8b "
         "shapes against the bf16-weight fp64 ref")
      ->transform(choice_of(weight_dtype_names()));
  cmd->add_option("--report-m", o->report_m, "Rows of x in the fp8 accuracy report")
      ->capture_default_str();
  cmd->callback([o, selected] { *selected = [o] { return run_check(*o); }; });
}

}  // namespace fmlp_cli
