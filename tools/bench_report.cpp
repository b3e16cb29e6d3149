#include "bench_report.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_common.hpp"

namespace fmlp_cli {
namespace {

using Json = nlohmann::ordered_json;

Json env_json(const BenchEnv& e) {
  return Json{{"fusedmlp_version", e.version},
              {"git_commit", e.git_commit},
              {"date", e.date},
              {"cpu_model", e.cpu_model},
              {"threads", e.threads},
              {"llc_bytes", e.llc.bytes},
              {"llc_source", e.llc.source},
              {"device", e.device},
              {"bandwidth_kind", e.bandwidth_kind},
              {"bandwidth_gbps", e.bandwidth.gbps},
              {"bandwidth_buffer_bytes", e.bandwidth.buffer_bytes},
              {"bandwidth_passes", e.bandwidth.passes},
              {"openblas_config", e.openblas_config},
              {"requested_backend", e.requested_backend},
              {"act_dtype", e.act_dtype},
              {"w_dtype", e.w_dtype},
              {"packed", e.packed},
              {"max_seconds_per_timing", e.max_seconds}};
}

Json result_json(const BenchResult& r) {
  Json j{{"shape", r.shape.name},
         {"d_in", r.shape.d_in},
         {"hidden", r.shape.hidden},
         {"d_out", r.shape.d_out},
         {"activation", fmlp_activation_name(r.shape.act)},
         {"gated", r.shape.gated},
         {"stacked_gate_up", r.shape.stacked},
         {"bias", r.shape.bias},
         {"m", r.m},
         {"backend", r.backend},
         {"kernel", r.kernel},
         {"weight_copies", r.weight_copies},
         {"reps", r.reps},
         {"fused_us", r.fused_us},
         {"fused_min_us", r.fused_min_us},
         {"weight_bytes", r.weight_bytes},
         {"io_bytes", r.io_bytes},
         {"gbps", r.gbps},
         {"pct_bandwidth", r.pct_bandwidth},
         {"flops", r.flops},
         {"gflops_per_s", r.fused_us > 0 ? r.flops / r.fused_us * 1e-3 : 0.0},
         {"memory_floor_us", r.floor_us},
         {"checked_rows", r.checked_rows},
         {"tolerance", r.tolerance},
         {"max_abs_error", r.fused_error.max_abs},
         {"max_rel_error", r.fused_error.max_rel}};
  if (r.has_baseline) {
    j["blas_weight_copies"] = r.blas_copies;
    j["blas_reps"] = r.blas_reps;
    j["blas_us"] = r.blas_us;
    j["blas_min_us"] = r.blas_min_us;
    j["blas_weight_bytes"] = r.blas_weight_bytes;
    j["blas_max_rel_error"] = r.blas_error.max_rel;
    j["speedup"] = r.speedup;
  }
  return j;
}

std::ofstream open_output(const std::string& path) {
  std::ofstream out(path);
  if (!out)
    throw CliError(
        fmt::format("cannot write '{}'; check that its directory exists and is "
                    "writable",
                    path));
  return out;
}

std::string csv_field(const Json& v) {
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    if (s.find_first_of(",\"\n") == std::string::npos) return s;
    std::string q = "\"";
    for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
    return q + "\"";
  }
  if (v.is_array()) {
    std::string s;
    for (const Json& e : v) s += (s.empty() ? "" : " ") + e.dump();
    return s;
  }
  return v.dump();
}

}  // namespace

void print_bench_table(std::FILE* out, const BenchEnv& e, const std::vector<BenchResult>& rs) {
  fmt::print(out, "fusedmlp {}{} bench, {}\n", e.version,
             e.git_commit.empty() ? "" : " (" + e.git_commit + ")", e.date);
  fmt::print(out, "cpu: {}, {} threads, LLC {} ({})\n", e.cpu_model, e.threads,
             format_bytes(double(e.llc.bytes)), e.llc.source);
  if (!e.device.empty())
    fmt::print(out, "gpu: {}, L2 {}\n", e.device, format_bytes(double(e.llc.bytes)));
  fmt::print(out, "memory {} bandwidth: {:.1f} GB/s (best of {} passes over {})\n",
             e.bandwidth_kind, e.bandwidth.gbps, e.bandwidth.passes,
             format_bytes(double(e.bandwidth.buffer_bytes)));
  fmt::print(out, "backend {}, activations {}, weights {}{}; times are medians\n\n",
             e.requested_backend, e.act_dtype, e.w_dtype, e.packed ? ", packed" : "");
  size_t width = 14;
  for (const BenchResult& r : rs) width = std::max(width, r.shape.name.size());
  fmt::print(out, "{:<{}} {:>4} {:>11} {:>7} {:>5} {:>8} {:>12} {:>8}  {}\n", "shape", width, "M",
             "fused µs", "GB/s", "%bw", "GFLOP/s", "OpenBLAS µs", "speedup", "kernel");
  for (const BenchResult& r : rs) {
    const std::string blas = r.has_baseline ? fmt::format("{:.1f}", r.blas_us) : "-";
    const std::string speedup = r.has_baseline ? fmt::format("{:.2f}x", r.speedup) : "-";
    fmt::print(out, "{:<{}} {:>4} {:>11.1f} {:>7.1f} {:>4.0f}% {:>8.1f} {:>12} {:>8}  {}\n",
               r.shape.name, width, r.m, r.fused_us, r.gbps, r.pct_bandwidth,
               r.flops / r.fused_us * 1e-3, blas, speedup, r.kernel);
  }
  fmt::print(out, "\n");
  for (const BenchResult& r : rs)
    fmt::print(out,
               "napkin {} M={}: {} weights + {} x/y, {:.3g} GFLOP ({:.2f} flop/byte); "
               "memory floor {:.1f} µs at {:.1f} GB/s\n",
               r.shape.name, r.m, format_bytes(r.weight_bytes), format_bytes(r.io_bytes),
               r.flops * 1e-9, r.flops / (r.weight_bytes + r.io_bytes), r.floor_us,
               e.bandwidth.gbps);
}

void write_bench_json(const std::string& path, const BenchEnv& e,
                      const std::vector<BenchResult>& rs) {
  Json results = Json::array();
  for (const BenchResult& r : rs) results.push_back(result_json(r));
  std::ofstream out = open_output(path);
  out << Json{{"environment", env_json(e)}, {"results", results}}.dump(2) << "\n";
}

void write_bench_csv(const std::string& path, const BenchEnv& e,
                     const std::vector<BenchResult>& rs) {
  std::ofstream out = open_output(path);
  const Json env = env_json(e);
  bool header = false;
  std::vector<std::string> keys;
  for (const BenchResult& r : rs) {
    Json row = result_json(r);
    for (auto it = env.begin(); it != env.end(); ++it) row[it.key()] = it.value();
    if (!header) {
      // Baseline columns exist in every row (empty when absent) so the header is stable.
      for (const char* k : {"blas_weight_copies", "blas_reps", "blas_us", "blas_min_us",
                            "blas_weight_bytes", "blas_max_rel_error", "speedup"})
        if (!row.contains(k)) row[k] = nullptr;
      for (auto it = row.begin(); it != row.end(); ++it) keys.push_back(it.key());
      std::string line;
      for (const std::string& k : keys) line += (line.empty() ? "" : ",") + k;
      out << line << "\n";
      header = true;
    }
    std::string line;
    for (size_t i = 0; i < keys.size(); ++i) {
      const auto v = row.find(keys[i]);
      line += (i ? "," : "") + (v == row.end() || v->is_null() ? std::string() : csv_field(*v));
    }
    out << line << "\n";
  }
}

}  // namespace fmlp_cli
