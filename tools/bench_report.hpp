// What bench measured, and its three renderings: the stdout table, JSON and CSV.
#pragma once
#include <cstdio>
#include <string>
#include <vector>

#include "accuracy.hpp"
#include "sysinfo.hpp"
#include "workloads.hpp"

namespace fmlp_cli {

struct BenchEnv {
  std::string version, git_commit, date, cpu_model, openblas_config;
  std::string device;                   // the GPU when bench ran on backend cuda, else empty
  std::string bandwidth_kind = "read";  // read (host streaming read) or copy (GPU d2d copy)
  int threads = 0;
  CacheInfo llc;
  Bandwidth bandwidth;
  std::string requested_backend;
  std::string act_dtype, w_dtype;
  bool packed = false;
  double max_seconds = 0.0;
};

struct BenchResult {
  MlpShape shape;
  int64_t m = 0;
  std::string backend, kernel;
  int weight_copies = 1, reps = 0;
  double fused_us = 0.0, fused_min_us = 0.0;
  double weight_bytes = 0.0, io_bytes = 0.0;
  double gbps = 0.0, pct_bandwidth = 0.0;
  double flops = 0.0, floor_us = 0.0;
  ErrorStats fused_error;
  double tolerance = 0.0;
  std::vector<int64_t> checked_rows;
  bool has_baseline = false;
  int blas_copies = 1, blas_reps = 0;
  double blas_us = 0.0, blas_min_us = 0.0, blas_weight_bytes = 0.0, speedup = 0.0;
  ErrorStats blas_error;
};

void print_bench_table(std::FILE* out, const BenchEnv& env, const std::vector<BenchResult>& r);
void write_bench_json(const std::string& path, const BenchEnv& env,
                      const std::vector<BenchResult>& r);
void write_bench_csv(const std::string& path, const BenchEnv& env,
                     const std::vector<BenchResult>& r);

}  // namespace fmlp_cli
