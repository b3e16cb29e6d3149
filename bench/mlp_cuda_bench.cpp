// fusedmlp_cuda_bench: correctness and speed of the cuda mlp kernels on one GPU.
//
//   1. feature matrix: small random problems over dtypes, activations, norms, biases, residual
//      (in place too), strided/misaligned views and packed weights, checked against backend ref
//   2. deterministic mode reruns bitwise; a CUDA graph replayed on new inputs matches eager
//   3. model shapes x M in {1, 4, 16, 64}: checked against ref on rows {0, M-1}, then timed by
//      CUDA-graph replay over weight copies rotated through > 3x the L2 (each call reads HBM),
//      median of many replays, against the floor (weight + x/y bytes) / measured copy bandwidth
//
// usage: fusedmlp_cuda_bench [--json FILE] [--shapes a,b] [--ms 1,4] [--reps N] [--skip-matrix]
//                            [--kernel NAME] [--wdtype bf16|f8] [--norm none|layernorm|rmsnorm]
//   --norm: the model shapes with that pre-norm fused (gamma, and beta for LayerNorm, in bf16)
// shapes: gpt2-small, seed-4096, llama3-8b, llama3-70b (the default set) and llama3-70b-tp2 (one
// rank's shard of llama3-70b at tensor parallelism 2)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bench_common.hpp"
#include "fusedmlp/fusedmlp.h"
#include "mlp_bench_case.hpp"

namespace {

using namespace fmlp_bench;

// Kernel forced with --kernel (op-table name); nullptr = dispatch (backend cuda).
const char* g_kernel = nullptr;
// Weight dtype of the model-shape sweep (--wdtype bf16 | f8).
fmlp_dtype_t g_wt = FMLP_DTYPE_BF16;
// Pre-norm of the model-shape sweep (--norm none | layernorm | rmsnorm).
fmlp_norm_t g_norm = FMLP_NORM_NONE;
const char* act_name(fmlp_activation_t a) {
  return fmlp_activation_name(a);
}

int feature_matrix(std::mt19937& rng, int cases) {
  int failures = 0;
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  const fmlp_dtype_t dts[3] = {FMLP_DTYPE_BF16, FMLP_DTYPE_F16, FMLP_DTYPE_F32};
  const int64_t ms[6] = {1, 3, 8, 17, 40, 64};
  for (int ci = 0; ci < cases; ++ci) {
    Problem p{};
    p.m = ms[ci % 6];
    p.gated = (ci / 2) % 2;
    p.d = 64 * (1 + int(rng() % 8)) + (ci % 5 == 4 ? 8 : 0);
    p.h = p.gated ? 8 * (20 + int(rng() % 100)) : 16 * (10 + int(rng() % 60));
    p.n = 8 * (8 + int(rng() % 90));
    p.at = dts[(ci / 3) % 3];
    p.wt = ci % 4 == 3 ? dts[(ci / 4) % 3] : FMLP_DTYPE_BF16;
    p.bt = dts[ci % 3];
    p.act = fmlp_activation_t(ci % 4);
    p.norm = fmlp_norm_t((ci / 4) % 3);
    p.separate_up = p.gated && (ci % 3 == 1);
    p.bias = ci % 2 == 0 || !p.gated;
    p.residual = ci % 3 != 2;
    p.inplace = p.residual && ci % 2 == 1;
    p.packed = ci % 5 == 1;
    p.deterministic = ci % 7 == 3;
    p.pad = ci % 6 == 5 ? 3 : ci % 6 == 2 ? 8 : 0;  // 3: misaligned + odd strides (slow path)
    if (ci % 11 == 7) {  // ragged sizes: only the slow path or packed weights handle them
      p.d += 5;
      p.h += p.gated ? 3 : 5;
      p.n += 3;
    }
    Case c;
    c.make(p, rng);
    Runner r;
    r.kernel = g_kernel;
    r.setup(c);
    std::vector<uint8_t> y_before = c.y.host;
    const fmlp_status_t st = r.run(c, s);
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    char desc[256];
    std::snprintf(desc, sizeof desc,
                  "M=%lld d=%lld h=%lld n=%lld x=%s w=%s b=%s %s%s norm=%d%s%s%s%s%s pad=%lld",
                  (long long)p.m, (long long)p.d, (long long)p.h, (long long)p.n,
                  fmlp_dtype_name(p.at), fmlp_dtype_name(p.wt), fmlp_dtype_name(p.bt),
                  p.gated ? (p.separate_up ? "gated(sep)-" : "gated-") : "", act_name(p.act),
                  int(p.norm), p.bias ? " bias" : "",
                  p.residual ? (p.inplace ? " res(inplace)" : " res") : "",
                  p.packed ? " packed" : "", p.deterministic ? " det" : "", "", (long long)p.pad);
    if (st != FMLP_SUCCESS) {
      std::printf("FAIL run %s: %s\n", desc, fmlp_last_error());
      ++failures;
    } else {
      c.y.download();
      const bool w8a8 = is_w8a8(p.wt, ran_kernel(c, g_kernel));
      CheckResult cr = check_rows(c, y_before, 0, p.m, w8a8);
      std::printf("%s case %2d %s: worst %.2f units %s\n", cr.ok ? "ok  " : "FAIL", ci, desc,
                  cr.worst_units, cr.detail.c_str());
      failures += !cr.ok;
      // a second call must see a clean workspace
      if (!p.inplace) {
        std::vector<uint8_t> first = c.y.host;
        r.run(c, s);
        CK(cudaStreamSynchronize(s));
        c.y.download();
        CheckResult c2 = check_rows(c, y_before, 0, p.m, w8a8);
        if (!c2.ok) {
          std::printf("FAIL second call case %d: worst %.2f %s\n", ci, c2.worst_units,
                      c2.detail.c_str());
          ++failures;
        }
      }
    }
    r.release();
    c.release();
  }
  CK(cudaStreamDestroy(s));
  return failures;
}

// Deterministic reruns are bitwise equal; a captured graph replays correctly on new inputs.
int determinism_and_graph(std::mt19937& rng) {
  int failures = 0;
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  Problem p{16,
            1024,
            2816,
            1024,
            FMLP_DTYPE_BF16,
            FMLP_DTYPE_BF16,
            FMLP_DTYPE_BF16,
            FMLP_ACT_SILU,
            FMLP_NORM_RMSNORM,
            true,
            false,
            false,
            true,
            false,
            false,
            true,
            0};
  Case c;
  c.make(p, rng);
  Runner r;
  r.kernel = g_kernel;
  r.setup(c);
  FK(r.run(c, s));
  CK(cudaStreamSynchronize(s));
  c.y.download();
  std::vector<uint8_t> a = c.y.host;
  for (int i = 0; i < 5; ++i) FK(r.run(c, s));
  CK(cudaStreamSynchronize(s));
  c.y.download();
  const bool same = a == c.y.host;
  std::printf("%s deterministic rerun bitwise equal\n", same ? "ok  " : "FAIL");
  failures += !same;

  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  FK(r.run(c, s));
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  c.x.fill(rng, 1.f);  // new inputs in the same buffers
  c.x.upload();
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  c.y.download();
  std::vector<uint8_t> from_graph = c.y.host;
  FK(r.run(c, s));
  CK(cudaStreamSynchronize(s));
  c.y.download();
  const bool g_ok = from_graph == c.y.host && from_graph != a;
  std::printf("%s graph replay on new inputs equals eager\n", g_ok ? "ok  " : "FAIL");
  failures += !g_ok;
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  r.release();
  c.release();
  CK(cudaStreamDestroy(s));
  return failures;
}

struct Shape {
  const char* name;
  int64_t d, h;
  fmlp_activation_t act;
  bool gated;
};

}  // namespace

int main(int argc, char** argv) {
  const char* json = nullptr;
  std::string shapes_arg = "gpt2-small,seed-4096,llama3-8b,llama3-70b", ms_arg = "1,4,16,64";
  int reps = 200, cases = 48;
  bool matrix = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--shapes" && i + 1 < argc)
      shapes_arg = argv[++i];
    else if (a == "--ms" && i + 1 < argc)
      ms_arg = argv[++i];
    else if (a == "--reps" && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (a == "--cases" && i + 1 < argc)
      cases = std::atoi(argv[++i]);
    else if (a == "--kernel" && i + 1 < argc)
      g_kernel = argv[++i];
    else if (a == "--wdtype" && i + 1 < argc) {
      if (!fmlp_bench::parse_wdtype(argv[++i], &g_wt)) return 1;
    } else if (a == "--norm" && i + 1 < argc) {
      const std::string n = argv[++i];
      if (n != "none" && n != "layernorm" && n != "rmsnorm") {
        std::fprintf(stderr, "--norm %s: expected none, layernorm or rmsnorm\n", n.c_str());
        return 1;
      }
      g_norm = n == "layernorm" ? FMLP_NORM_LAYERNORM
               : n == "rmsnorm" ? FMLP_NORM_RMSNORM
                                : FMLP_NORM_NONE;
    } else if (a == "--skip-matrix")
      matrix = false;
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 1;
    }
  }
  const Shape all[] = {{"gpt2-small", 768, 3072, FMLP_ACT_GELU_TANH, false},
                       {"seed-4096", 4096, 4096, FMLP_ACT_GELU, false},
                       {"llama3-8b", 4096, 14336, FMLP_ACT_SILU, true},
                       {"llama3-70b", 8192, 28672, FMLP_ACT_SILU, true},
                       // one rank's shard of llama3-70b at tensor parallelism 2 (issue #9)
                       {"llama3-70b-tp2", 8192, 14336, FMLP_ACT_SILU, true}};
  if (!fmlp_bench::check_names("--shapes", shapes_arg, all)) return 1;
  if (fmlp_backend_available(FMLP_BACKEND_CUDA) != FMLP_SUCCESS) {
    std::printf("cuda backend unavailable: %s\n", fmlp_last_error());
    return 1;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::mt19937 rng(1234);
  int failures = 0;
  if (matrix) {
    failures += feature_matrix(rng, cases);
    failures += determinism_and_graph(rng);
  }
  const double bw = copy_bandwidth();
  std::printf("%s, %d SMs, L2 %d MiB, copy bandwidth %.3f TB/s\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, bw / 1e12);

  std::vector<int64_t> ms;
  if (!fmlp_bench::parse_positive_list(ms_arg.c_str(), &ms)) {
    std::fprintf(stderr, "--ms %s: expected positive integers separated by commas\n",
                 ms_arg.c_str());
    return 1;
  }
  std::string out = "{\"gpu\": \"" + std::string(prop.name) +
                    "\", \"copy_TBps\": " + std::to_string(bw / 1e12) +
                    ", \"norm\": " + std::to_string(int(g_norm)) + ", \"mlp\": [";
  bool first = true;
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  std::printf("%-11s %3s %9s %9s %9s %7s %s\n", "shape", "M", "us", "floor_us", "GB/s", "%floor",
              "check");
  for (const Shape& sh : all) {
    if (!fmlp_bench::in_list(shapes_arg, sh.name)) continue;
    const int64_t rows1 = sh.gated ? 2 * sh.h : sh.h;
    const double wbytes = double(rows1 * sh.d + sh.d * sh.h) * double(esize(g_wt));
    const int copies = std::max(1, int(std::ceil(3.0 * prop.l2CacheSize / wbytes)));
    for (int64_t m : ms) {
      Problem p{m,      sh.d,   sh.h,     sh.d,  FMLP_DTYPE_BF16, g_wt,  FMLP_DTYPE_BF16,
                sh.act, g_norm, sh.gated, false, !sh.gated,       false, false,
                false,  false,  0};
      std::vector<Case> cs(static_cast<size_t>(copies));
      std::vector<Runner> rs(static_cast<size_t>(copies));
      bool skipped = false;
      for (int i = 0; i < copies && !skipped; ++i) {
        if (i == 0) {
          cs[0].make(p, rng);
          fmlp_mlp_args_t a0 = cs[0].args(true);
          size_t ignored = 0;
          if (g_kernel && fmlp_mlp_kernel_workspace_size(&a0, g_kernel, &ignored) ==
                              FMLP_ERROR_NOT_SUPPORTED) {  // a forced kernel may skip some M
            std::printf("%-11s %3lld skipped: %s\n", sh.name, (long long)m, fmlp_last_error());
            skipped = true;
            continue;
          }
        } else {  // same contents, separate memory: only the rotation matters for timing
          cs[i] = cs[0];
          for (Buf* b : {&cs[i].w1, &cs[i].w2, &cs[i].b1, &cs[i].b2}) {
            if (!b->dev) continue;
            void* src = b->dev;
            CK(cudaMalloc(&b->dev, b->host.size() + 256));
            CK(cudaMemcpy(b->dev, src, b->host.size(), cudaMemcpyDeviceToDevice));
          }
          cs[i].wu.dev = nullptr;
        }
        rs[i].kernel = g_kernel;
        rs[i].setup(cs[i]);
      }
      if (skipped) {
        cs[0].release();
        continue;
      }
      // correctness on rows {0, M-1}
      std::vector<uint8_t> y_before = cs[0].y.host;
      FK(rs[0].run(cs[0], s));
      CK(cudaStreamSynchronize(s));
      cs[0].y.download();
      const std::string kernel = ran_kernel(cs[0], g_kernel);
      const bool w8a8 = is_w8a8(p.wt, kernel);
      CheckResult cr = check_rows(cs[0], y_before, 0, 1, w8a8);
      if (m > 1 && cr.ok) {
        CheckResult c2 = check_rows(cs[0], y_before, m - 1, 1, w8a8);
        if (!c2.ok || c2.worst_units > cr.worst_units) cr = c2;
      }
      failures += !cr.ok;
      // timing: one graph = one call per weight copy
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < copies; ++i) FK(rs[i].run(cs[i], s));
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      const double us = graph_us_per_call(ge, s, copies, reps, /*warmup=*/10);
      CK(cudaGetLastError());
      const double bytes = wbytes + 4.0 * double(m * sh.d);
      const double floor_us = bytes / bw * 1e6;
      std::printf("%-11s %3lld %9.2f %9.2f %9.0f %6.1f%% %s %.2f units %s\n", sh.name, (long long)m,
                  us, floor_us, bytes / us * 1e-3, 100 * floor_us / us, cr.ok ? "ok" : "FAIL",
                  cr.worst_units, cr.detail.c_str());
      std::fflush(stdout);
      char row[512];
      std::snprintf(row, sizeof row,
                    "%s{\"shape\": \"%s\", \"M\": %lld, \"us\": %.3f, \"floor_us\": %.3f, "
                    "\"pct_of_floor\": %.2f, \"GBps\": %.1f, \"copies\": %d, \"check_ok\": %s, "
                    "\"worst_units\": %.3f, \"kernel\": \"%s\"}",
                    first ? "" : ", ", sh.name, (long long)m, us, floor_us, 100 * floor_us / us,
                    bytes / us * 1e-3, copies, cr.ok ? "true" : "false", cr.worst_units,
                    kernel.c_str());
      out += row;
      first = false;
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
      for (int i = 0; i < copies; ++i) {
        rs[i].release();
        if (i > 0) {
          for (Buf* b : {&cs[i].w1, &cs[i].w2, &cs[i].b1, &cs[i].b2}) b->release();
        }
      }
      cs[0].release();
    }
  }
  out += "], \"failures\": " + std::to_string(failures) + "}\n";
  if (json) {
    FILE* f = std::fopen(json, "w");
    if (f) {
      std::fputs(out.c_str(), f);
      std::fclose(f);
    }
  }
  std::printf("%s: %d failures\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}
