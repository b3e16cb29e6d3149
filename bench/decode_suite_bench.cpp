// fusedmlp_decode_suite_bench: the decode suite (bench/decode_suite.txt) at M = 1..64 on one GPU:
// for every shape and M, what dispatch runs on packed weights, as users run it (fmlp_mlp_pack,
// which times the entries per M on this GPU; checked against backend ref on rows 0 and M - 1) and
// every other cuda mlp entry that takes the call (checked against dispatch's output), each timed
// by CUDA-graph replay over weight copies rotated through > 3x the L2, median of replays, against
// the floor (weight + x/y bytes) / the device copy bandwidth measured in the same run. The JSON
// feeds bench/report.py decode-suite (with bench/peers_suite.py's PyTorch times) and the planner
// check: is dispatch within 5 % of the fastest entry?
//
// usage: fusedmlp_decode_suite_bench [--suite FILE] [--shapes a,b] [--ms 1,2,4] [--reps N]
//                                    [--entries all|none|a,b] [--json FILE]
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "fusedmlp/fusedmlp.h"
#include "mlp_bench_case.hpp"

namespace {

using namespace fmlp_bench;

struct SuiteShape {
  std::string name;
  int64_t d = 0, h = 0;
  fmlp_activation_t act = FMLP_ACT_RELU;
  bool gated = false;
};

bool read_suite(const std::string& path, std::vector<SuiteShape>* out) {
  std::ifstream f(path);
  if (!f) {
    std::fprintf(stderr, "--suite %s: cannot open it\n", path.c_str());
    return false;
  }
  std::string line;
  int no = 0;
  while (std::getline(f, line)) {
    ++no;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream is(line);
    SuiteShape s;
    std::string act;
    int gated = -1;
    if (!(is >> s.name >> s.d >> s.h >> act >> gated) || s.d <= 0 || s.h <= 0 ||
        (gated != 0 && gated != 1)) {
      std::fprintf(stderr, "%s:%d: expected 'name d_model hidden act gated ...'\n", path.c_str(),
                   no);
      return false;
    }
    const char* acts[] = {"relu", "gelu", "gelu_tanh", "silu"};
    bool known = false;
    for (int a = 0; a < 4; ++a)
      if (act == acts[a]) s.act = fmlp_activation_t(a), known = true;
    if (!known) {
      std::fprintf(stderr, "%s:%d: activation '%s': expected relu, gelu, gelu_tanh or silu\n",
                   path.c_str(), no, act.c_str());
      return false;
    }
    s.gated = gated == 1;
    out->push_back(s);
  }
  return !out->empty();
}

// The largest |a - b| over the first rows of y, in units of 2^-8 of |b| + the row's rms (bf16).
double diff_units(const Case& c, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  double worst = 0;
  for (int64_t i = 0; i < c.p.m; ++i) {
    double rms = 0;
    for (int64_t o = 0; o < c.p.n; ++o) {
      const double v = get(b, c.p.at, size_t(c.y.off + i * c.ld_y + o));
      rms += v * v;
    }
    rms = std::sqrt(rms / double(c.p.n));
    for (int64_t o = 0; o < c.p.n; ++o) {
      const size_t idx = size_t(c.y.off + i * c.ld_y + o);
      const double x = get(a, c.p.at, idx), y = get(b, c.p.at, idx);
      if (std::isnan(x) || std::isnan(y)) {
        if (std::isnan(x) != std::isnan(y)) return 1e9;
        continue;
      }
      worst = std::max(worst, std::fabs(x - y) / (std::ldexp(1.0, -8) * (std::fabs(y) + rms)));
    }
  }
  return worst;
}

// The entry dispatch picks for a packed run of c (the pack's timing, when it has one).
std::string packed_kernel(Case& c) {
  fmlp_mlp_args_t a = c.args(true);
  fmlp_mlp_packed_t* p = nullptr;
  FK(fmlp_mlp_pack(&p, &a.weights, &a.config, FMLP_BACKEND_CUDA, nullptr));
  size_t needed = 0;
  FK(fmlp_mlp_packed_explain(p, &a.y, &a.x, nullptr, 0, &needed));
  std::string text(needed, '\0');
  FK(fmlp_mlp_packed_explain(p, &a.y, &a.x, text.data(), text.size(), &needed));
  fmlp_mlp_packed_destroy(p);
  const size_t at = text.find("chosen   ");
  if (at == std::string::npos) return "?";
  const size_t b = at + 9;
  return text.substr(b, text.find(' ', b) - b);
}

}  // namespace

int main(int argc, char** argv) {
  std::string suite_path = "bench/decode_suite.txt", shapes_arg, ms_arg = "1,2,4,8,16,32,64",
              entries_arg = "all";
  const char* json = nullptr;
  int reps = 100;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--suite" && i + 1 < argc)
      suite_path = argv[++i];
    else if (a == "--shapes" && i + 1 < argc)
      shapes_arg = argv[++i];
    else if (a == "--ms" && i + 1 < argc)
      ms_arg = argv[++i];
    else if (a == "--reps" && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (a == "--entries" && i + 1 < argc)
      entries_arg = argv[++i];
    else if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 1;
    }
  }
  std::vector<SuiteShape> suite;
  if (!read_suite(suite_path, &suite)) return 1;
  if (!shapes_arg.empty() && !check_names("--shapes", shapes_arg, suite)) return 1;
  std::vector<int64_t> ms;
  if (!parse_int_list(ms_arg.c_str(), 1, 64, &ms)) {
    std::fprintf(stderr, "--ms %s: expected integers 1..64 separated by commas\n", ms_arg.c_str());
    return 1;
  }
  std::vector<std::string> entries;
  for (int i = 0; i < fmlp_mlp_kernel_count(); ++i)
    if (fmlp_mlp_kernel_backend(i) == FMLP_BACKEND_CUDA &&
        (entries_arg == "all" || in_list(entries_arg, fmlp_mlp_kernel_name(i))))
      entries.push_back(fmlp_mlp_kernel_name(i));
  if (fmlp_backend_available(FMLP_BACKEND_CUDA) != FMLP_SUCCESS) {
    std::printf("cuda backend unavailable: %s\n", fmlp_last_error());
    return 1;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double bw = copy_bandwidth();
  std::printf("%s, %d SMs, L2 %d MiB, copy bandwidth %.3f TB/s\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, bw / 1e12);
  std::mt19937 rng(4321);
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  int failures = 0;
  std::string out = "{\"gpu\": \"" + std::string(prop.name) +
                    "\", \"copy_TBps\": " + std::to_string(bw / 1e12) + ", \"rows\": [";
  bool first_row = true;
  auto write_json = [&](const std::string& rows, int fails) {
    if (!json) return;
    if (FILE* f = std::fopen(json, "w")) {
      std::fputs((rows + "], \"failures\": " + std::to_string(fails) + "}\n").c_str(), f);
      std::fclose(f);
    }
  };
  for (const SuiteShape& sh : suite) {
    if (!shapes_arg.empty() && !in_list(shapes_arg, sh.name.c_str())) continue;
    const int64_t rows1 = sh.gated ? 2 * sh.h : sh.h;
    const double wbytes = double(rows1 * sh.d + sh.d * sh.h) * 2.0;
    const int copies = std::max(1, int(std::ceil(3.0 * prop.l2CacheSize / wbytes)));
    for (int64_t m : ms) {
      Problem p{m,
                sh.d,
                sh.h,
                sh.d,
                FMLP_DTYPE_BF16,
                FMLP_DTYPE_BF16,
                FMLP_DTYPE_BF16,
                sh.act,
                FMLP_NORM_NONE,
                sh.gated,
                false,
                !sh.gated,
                false,
                false,
                false,
                false,
                0};
      std::vector<Case> cs(static_cast<size_t>(copies));
      cs[0].make(p, rng);
      for (int i = 1; i < copies; ++i) {  // same contents, separate memory: the rotation
        cs[i] = cs[0];
        for (Buf* b : {&cs[i].w1, &cs[i].w2, &cs[i].b1, &cs[i].b2}) {
          if (!b->dev) continue;
          void* src = b->dev;
          CK(cudaMalloc(&b->dev, b->host.size() + 256));
          CK(cudaMemcpy(b->dev, src, b->host.size(), cudaMemcpyDeviceToDevice));
        }
        cs[i].wu.dev = nullptr;
      }
      const std::vector<uint8_t> y_before = cs[0].y.host;
      const double bytes = wbytes + 4.0 * double(m * sh.d);
      const double floor_us = bytes / bw * 1e6;
      // Times one runner setup (dispatch when kernel is null) over the copies; fills y_out.
      auto time_one = [&](const char* kernel, std::vector<uint8_t>* y_out, double* us) {
        std::vector<Runner> rs(static_cast<size_t>(copies));
        for (int i = 0; i < copies; ++i) {
          rs[i].kernel = kernel;
          rs[i].pack = true;  // dispatch as a user runs it: packed (and timed) weights
          rs[i].setup(cs[i]);
        }
        CK(cudaMemcpy(cs[0].y.dev, y_before.data(), y_before.size(), cudaMemcpyHostToDevice));
        FK(rs[0].run(cs[0], s));
        CK(cudaStreamSynchronize(s));
        cs[0].y.download();
        *y_out = cs[0].y.host;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < copies; ++i) FK(rs[i].run(cs[i], s));
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        *us = graph_us_per_call(ge, s, copies, reps, /*warmup=*/10);
        CK(cudaGetLastError());
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
        for (Runner& r : rs) r.release();
      };
      std::vector<uint8_t> y_dispatch;
      double us_dispatch = 0;
      time_one(nullptr, &y_dispatch, &us_dispatch);
      const std::string dispatched = packed_kernel(cs[0]);
      cs[0].y.host = y_dispatch;
      CheckResult cr = check_rows(cs[0], y_before, 0, 1, false);
      if (m > 1 && cr.ok) {
        CheckResult c2 = check_rows(cs[0], y_before, m - 1, 1, false);
        if (!c2.ok || c2.worst_units > cr.worst_units) cr = c2;
      }
      failures += !cr.ok;
      std::printf("%-15s M=%-3lld floor %8.2f us  dispatch %-27s %8.2f us (%5.1f%%) %s %.2f\n",
                  sh.name.c_str(), (long long)m, floor_us, dispatched.c_str(), us_dispatch,
                  100 * floor_us / us_dispatch, cr.ok ? "ok" : "FAIL", cr.worst_units);
      std::string ent;
      std::string best = dispatched;
      double best_us = us_dispatch;
      for (const std::string& e : entries) {
        if (e == dispatched) continue;
        fmlp_mlp_args_t a0 = cs[0].args(true);
        if (fmlp_mlp_kernel_supports(&a0, e.c_str()) != FMLP_SUCCESS) continue;
        std::vector<uint8_t> y_e;
        double us = 0;
        time_one(e.c_str(), &y_e, &us);
        const double units = diff_units(cs[0], y_e, y_dispatch);
        const bool ok = units <= 8.0;  // two outputs each within the 4-unit check of ref
        failures += !ok;
        std::printf("%-15s M=%-3lld          %-36s %8.2f us (%5.1f%%) %s %.2f vs dispatch\n",
                    sh.name.c_str(), (long long)m, e.c_str(), us, 100 * floor_us / us,
                    ok ? "ok" : "FAIL", units);
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s\"%s\": %.3f", ent.empty() ? "" : ", ", e.c_str(), us);
        ent += buf;
        if (us < best_us) best_us = us, best = e;
      }
      std::fflush(stdout);
      char row[768];
      std::snprintf(row, sizeof row,
                    "%s{\"shape\": \"%s\", \"d_in\": %lld, \"hidden\": %lld, \"act\": \"%s\", "
                    "\"gated\": %s, \"weight_MB\": %.3f, \"M\": %lld, \"floor_us\": %.3f, "
                    "\"ours_us\": %.3f, \"kernel\": \"%s\", \"check_ok\": %s, "
                    "\"worst_units\": %.3f, \"best_entry\": \"%s\", \"best_entry_us\": %.3f, "
                    "\"copies\": %d, \"entries_us\": {",
                    first_row ? "" : ",\n  ", sh.name.c_str(), (long long)sh.d, (long long)sh.h,
                    fmlp_activation_name(sh.act), sh.gated ? "true" : "false", wbytes / 1e6,
                    (long long)m, floor_us, us_dispatch, dispatched.c_str(),
                    cr.ok ? "true" : "false", cr.worst_units, best.c_str(), best_us, copies);
      out += row + ent + "}}";
      first_row = false;
      write_json(out, failures);  // after every row: a time limit keeps what was measured
      for (int i = 0; i < copies; ++i) {
        if (i > 0)
          for (Buf* b : {&cs[i].w1, &cs[i].w2, &cs[i].b1, &cs[i].b2}) b->release();
      }
      cs[0].release();
    }
  }
  write_json(out, failures);
  std::printf("%s: %d failures\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}
