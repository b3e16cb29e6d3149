// fusedmlp bench: measure the machine's read bandwidth, then for each workload check the fused
// op against ref, time it and the unfused OpenBLAS pipeline, and report.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>

#include "accuracy.hpp"
#include "bench_report.hpp"
#include "blas_baseline.hpp"
#include "blas_shim.hpp"
#include "commands.hpp"
#include "cuda_runner.hpp"
#include "dtype_convert.hpp"
#include "host_timer.hpp"
#include "runner.hpp"
#include "sysinfo.hpp"
#include "workloads.hpp"

namespace fmlp_cli {
namespace {

struct BenchOptions {
  std::vector<std::string> shapes = preset_names();
  std::vector<int64_t> ms = {1, 16, 128};
  fmlp_dtype_t act_dtype = FMLP_DTYPE_F32;
  bool act_dtype_given = false;  // else: f32 on the host, the weight dtype on the GPU
  fmlp_dtype_t w_dtype = FMLP_DTYPE_BF16;
  fmlp_backend_t backend = FMLP_BACKEND_AUTO;
  std::string gate_up = "separate";
  int reps = 20;
  double max_seconds = 1.0;
  int threads = 0;
  bool packed = false;
  bool no_baseline = false;
  bool hot = false;
  bool baseline_sgemm = false;  // sgemm at M = 1 too (default: the faster sgemv)  // no weight
                                // rotation: cache-resident weights when they fit
  int64_t bw_mib = 1024;
  uint64_t seed = 1;
  std::string json, csv;
};

// Enough identical weight sets that cycling through them reads > 3x the LLC (GPU: the L2) per
// round, so every timed call streams its weights from memory as it would in a real model.
int copies_for(double set_bytes, size_t llc_bytes) {
  if (set_bytes >= double(llc_bytes)) return 1;
  return int(std::min(1024.0, std::ceil(3.0 * double(llc_bytes) / set_bytes)));
}

// Calls to time: as many as fit in the per-loop budget, at least 3 and at most --reps.
int reps_for(double first_call_s, const BenchOptions& o) {
  const double fit = first_call_s > 0 ? o.max_seconds / first_call_s : double(o.reps);
  return std::clamp(int(fit), std::min(3, o.reps), o.reps);
}

std::string rows_text(const std::vector<int64_t>& rows) {
  std::string s;
  for (int64_t r : rows) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

// Throws WrongResult with everything needed to reproduce the mismatch.
void require_match(const ErrorStats& e, double tol, const std::vector<float>& got,
                   const std::vector<float>& ref, const BenchResult& r, const std::string& who,
                   const std::string& hint) {
  if (e.pass) return;
  std::string where;
  if (e.worst >= 0) {
    const int64_t d = r.shape.d_out;
    where = fmt::format(" worst at row {} col {}: got {:.6g}, ref {:.6g};",
                        r.checked_rows[size_t(e.worst / d)], e.worst % d, got[size_t(e.worst)],
                        ref[size_t(e.worst)]);
  }
  throw WrongResult(fmt::format("{} M={}: {} disagrees with the ref backend on rows {}: {};{} {}",
                                r.shape.name, r.m, who, rows_text(r.checked_rows),
                                summarize(e, tol), where, hint));
}

// The timing loop after the check call (which took first_s): a warm-up call when cheap, then
// reps_for() calls from weight set 2 on (set 0 ran the check, set 1 the warm-up).
template <typename TIMER>
std::vector<double> timed_loop(double first_s, const BenchOptions& o, int copies,
                               TIMER&& time_calls) {
  // OpenBLAS's threads busy-wait ~0.1 s after a call and OpenMP's spin briefly; let both pools
  // park so neither steals cores from the other's timing loop.
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  if (first_s < 0.1 * o.max_seconds) time_calls(1, 1 % copies);  // warm-up beyond the check call
  return time_calls(reps_for(first_s, o), copies > 1 ? 2 % copies : 0);
}

BenchResult bench_one(HostMlp& problem, BlasBaseline* baseline, const BenchOptions& o,
                      const BenchEnv& env) {
  BenchResult r;
  r.shape = problem.spec().shape;
  r.m = problem.spec().m;
  r.weight_copies = problem.copies();
  r.weight_bytes = double(problem.weight_bytes());
  r.io_bytes = double(problem.io_bytes());
  r.flops = mlp_flops(r.shape, r.m);
  r.floor_us = (r.weight_bytes + r.io_bytes) / (env.bandwidth.gbps * 1e9) * 1e6;
  // bf16-level: a sanity check that catches wrong kernels; `fusedmlp check` is the strict one.
  // 16-bit activations double it: y is itself rounded to 16 bits and the GPU paths round the
  // normalised x and the hidden (gate, up, h) to 16 bits before their GEMMs, as PyTorch does.
  r.tolerance = tolerance_for(FMLP_DTYPE_BF16) * (o.act_dtype == FMLP_DTYPE_F32 ? 1.0 : 2.0);
  r.checked_rows = sample_rows(r.m);

  std::unique_ptr<FusedRunner> runner = make_fused_runner(problem, o.backend, o.packed);
  r.backend = fmlp_backend_name(runner->backend());
  r.kernel = runner->kernel();
  progress("  fused: backend {}, kernel {}, {} weight set(s) of {}", r.backend, r.kernel,
           r.weight_copies, format_bytes(r.weight_bytes));
  const HostTimer first;
  runner->run(0);
  const double first_s = first.seconds();
  const std::vector<float> ref = problem.reference_rows(r.checked_rows);
  const std::vector<float> got = runner->output_rows(r.checked_rows);
  r.fused_error = compare(got, ref, r.tolerance);
  require_match(r.fused_error, r.tolerance, got, ref, r,
                fmt::format("backend {} (kernel {})", r.backend, r.kernel),
                "run `fusedmlp check` to find the failing kernel and case");
  const std::vector<double> t = timed_loop(first_s, o, problem.copies(), [&](int reps, int start) {
    return runner->time_calls(reps, start);
  });
  r.reps = int(t.size());
  r.fused_us = median(t) * 1e6;
  r.fused_min_us = minimum(t) * 1e6;
  r.gbps = (r.weight_bytes + r.io_bytes) / (r.fused_us * 1e-6) * 1e-9;
  r.pct_bandwidth = 100.0 * r.gbps / env.bandwidth.gbps;
  progress("  fused: median {:.1f} µs over {} calls ({:.1f} GB/s), {}", r.fused_us, r.reps, r.gbps,
           summarize(r.fused_error, r.tolerance));

  if (baseline == nullptr) return r;
  r.has_baseline = true;
  r.blas_copies = baseline->copies();
  r.blas_weight_bytes = double(baseline->weight_bytes());
  const HostTimer blas_first;
  baseline->run(0);
  const double blas_first_s = blas_first.seconds();
  const std::vector<float> blas_got = baseline->output_rows(r.checked_rows);
  r.blas_error = compare(blas_got, ref, r.tolerance);
  require_match(r.blas_error, r.tolerance, blas_got, ref, r, "the OpenBLAS baseline",
                "this is a bug in the CLI's baseline, not in the library; please report it");
  const std::vector<double> tb =
      timed_loop(blas_first_s, o, baseline->copies(),
                 [&](int reps, int start) { return baseline->time_calls(reps, start); });
  r.blas_reps = int(tb.size());
  r.blas_us = median(tb) * 1e6;
  r.blas_min_us = minimum(tb) * 1e6;
  r.speedup = r.blas_us / r.fused_us;
  progress("  OpenBLAS fp32: median {:.1f} µs over {} calls ({} weight set(s) of {})", r.blas_us,
           r.blas_reps, r.blas_copies, format_bytes(r.blas_weight_bytes));
  return r;
}

int run_bench(const BenchOptions& opts) {
  BenchOptions o = opts;
  if (o.ms.empty() || o.shapes.empty())
    throw CliError("--ms and --shapes need at least one value each");
  for (int64_t m : o.ms)
    if (m <= 0) throw CliError(fmt::format("--ms has {}; batch sizes must be >= 1", m));
  if (o.reps < 1) throw CliError(fmt::format("--reps is {}; pass 1 or more", o.reps));
  if (!(o.max_seconds > 0)) throw CliError("--max-seconds must be > 0");
  if (o.bw_mib < 16) throw CliError("--bw-mib must be at least 16 (use ~4x the LLC or more)");
  const bool on_cuda = bench_on_cuda(o.backend);
  std::vector<MlpShape> shapes;
  for (const std::string& s : o.shapes) shapes.push_back(parse_shape(s, o.gate_up == "stacked"));

  BenchEnv env;
  env.threads = apply_thread_count(o.threads);
  env.version = fmlp_version();
  env.git_commit = git_commit();
  env.date = utc_timestamp();
  env.cpu_model = cpu_model();
  env.openblas_config = openblas_get_config();
  env.llc = last_level_cache();
  const size_t bw_bytes = size_t(o.bw_mib) << 20;
  if (on_cuda) {
    // The GPU's tensor-core paths take x in the weight dtype (bf16 serving); no host baseline.
    if (!o.act_dtype_given && o.w_dtype != FMLP_DTYPE_F8_E4M3) o.act_dtype = o.w_dtype;
    if (!o.no_baseline) progress("backend cuda: the OpenBLAS baseline is host-only; skipped");
    o.no_baseline = true;
    progress("measuring the GPU's copy bandwidth ({} device-to-device)",
             format_bytes(double(bw_bytes)));
    const CudaDeviceInfo dev = cuda_device_info(bw_bytes);
    env.device = fmt::format("{} (driver {})", dev.name, dev.driver);
    env.llc = CacheInfo{dev.l2_bytes, "GPU L2"};
    env.bandwidth = Bandwidth{dev.copy_gbps, bw_bytes, 5, 0};
    env.bandwidth_kind = "copy";
    progress("  {}: {:.1f} GB/s (read + write), L2 {}", dev.name, dev.copy_gbps,
             format_bytes(double(dev.l2_bytes)));
  } else {
    progress("measuring memory read bandwidth ({}, {} threads; LLC {} from {})",
             format_bytes(double(bw_bytes)), env.threads, format_bytes(double(env.llc.bytes)),
             env.llc.source);
    if (bw_bytes < 4 * env.llc.bytes)
      progress(
          "warning: the {} bandwidth buffer is under 4x the LLC; the figure will include "
          "cache hits (raise --bw-mib)",
          format_bytes(double(bw_bytes)));
    env.bandwidth = measure_read_bandwidth(bw_bytes, 5);
    progress("  {:.1f} GB/s", env.bandwidth.gbps);
  }
  env.requested_backend = fmlp_backend_name(o.backend);
  env.act_dtype = fmlp_dtype_name(o.act_dtype);
  env.w_dtype = fmlp_dtype_name(o.w_dtype);
  env.packed = o.packed;
  env.max_seconds = o.max_seconds;

  std::vector<BenchResult> results;
  const size_t total = shapes.size() * o.ms.size();
  for (const MlpShape& shape : shapes) {
    progress("{}: {}; generating random weights", shape.name, describe(shape));
    HostMlp problem(MlpCase{shape, o.ms.front(), o.act_dtype, o.w_dtype, Residual::kNone}, o.seed);
    const double set_bytes = double(problem.weight_bytes());
    problem.set_copies(o.hot ? 1 : copies_for(set_bytes, env.llc.bytes));
    std::unique_ptr<BlasBaseline> baseline;
    if (!o.no_baseline) {
      const double f32_bytes = set_bytes * 4.0 / double(dtype_bytes(o.w_dtype));
      baseline = std::make_unique<BlasBaseline>(
          problem, o.hot ? 1 : copies_for(f32_bytes, env.llc.bytes), o.baseline_sgemm);
    }
    for (int64_t m : o.ms) {
      progress("[{}/{}] {} M={}", results.size() + 1, total, shape.name, m);
      problem.set_batch(m);
      if (baseline) baseline->set_batch(problem);
      results.push_back(bench_one(problem, baseline.get(), o, env));
    }
  }
  print_bench_table(stdout, env, results);
  if (!o.json.empty()) {
    write_bench_json(o.json, env, results);
    progress("wrote {}", o.json);
  }
  if (!o.csv.empty()) {
    write_bench_csv(o.csv, env, results);
    progress("wrote {}", o.csv);
  }
  return 0;
}

}  // namespace

void add_bench_command(CLI::App& app, Command* selected) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "Time the fused op against the unfused fp32 OpenBLAS pipeline on model shapes");
  cmd->add_option("--shapes", o->shapes,
                  "Comma-separated presets (gpt2-small, seed-4096, llama3-8b) or custom specs "
                  "DINxHIDDEN[xDOUT]:ACT[:gated][:bias]")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--ms", o->ms, "Comma-separated batch sizes M (rows of x)")
      ->delimiter(',')
      ->capture_default_str();
  CLI::Option* act = cmd->add_option("--act-dtype", o->act_dtype,
                                     "Activation dtype of x and y (default: f32 on the host, the "
                                     "weight dtype on the GPU)")
                         ->transform(choice_of(act_dtype_names()))
                         ->default_str("f32");
  cmd->add_option("--w-dtype,--wdtype", o->w_dtype,
                  "Weight dtype (f8 = f8_e4m3: fp32 weights quantised by fmlp_quantize_fp8 with "
                  "per-row scales)")
      ->transform(choice_of(weight_dtype_names()))
      ->default_str("bf16");
  cmd->add_option(
         "--backend", o->backend,
         "auto: cuda when a GPU is usable, else cpu when a cpu kernel handles the shape, else "
         "ref (with a warning)")
      ->transform(choice_of(backend_names()))
      ->default_str("auto");
  cmd->add_option("--gate-up", o->gate_up, "Layout of gate/up weights in gated shapes")
      ->check(CLI::IsMember({"separate", "stacked"}))
      ->capture_default_str();
  cmd->add_option("--reps", o->reps, "Most timed calls per measurement (median reported)")
      ->capture_default_str();
  cmd->add_option("--max-seconds", o->max_seconds,
                  "Time budget per timing loop; slow calls get fewer reps (at least 3)")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "OpenMP and OpenBLAS threads (0: their default)")
      ->capture_default_str();
  cmd->add_flag("--packed", o->packed, "Time fmlp_mlp_packed_run on pre-packed weights");
  cmd->add_flag("--no-baseline", o->no_baseline, "Skip the OpenBLAS pipeline");
  cmd->add_flag("--baseline-sgemm", o->baseline_sgemm,
                "OpenBLAS pipeline with sgemm at M = 1 too (by default M = 1 uses the faster "
                "sgemv)");
  cmd->add_flag("--hot", o->hot,
                "One weight copy: weights that fit the last-level cache stay there (the default "
                "rotates copies over 3x the cache so every call reads memory)");
  cmd->add_option("--bw-mib", o->bw_mib, "Buffer size of the bandwidth measurement, MiB")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "Random data seed")->capture_default_str();
  cmd->add_option("--json", o->json, "Write every field and the environment as JSON");
  cmd->add_option("--csv", o->csv, "Write every field and the environment as CSV");
  cmd->callback([o, act, selected] {
    o->act_dtype_given = act->count() > 0;
    *selected = [o] { return run_bench(*o); };
  });
}

}  // namespace fmlp_cli
