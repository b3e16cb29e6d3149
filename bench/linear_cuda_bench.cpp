// fusedmlp_ops_bench: speed (and a spot check) of the cuda linear and softmax kernels.
//   linear: >= 40 projection shapes of real models, bf16 weights (a few fp8), M = 1 for all and
//           M in {4, 16, 64} for a subset; softmax: vocab-sized rows, few and many.
// Every case: CUDA-graph replay of `copies` calls over inputs rotated through > 3x the L2 (each
// call reads HBM), warm-up, median of --reps replays; reported against the floor (bytes / copy
// bandwidth measured in this run). Outputs are spot-checked against an fp64 host reference.
// usage: fusedmlp_ops_bench [--json FILE] [--reps N] [--only linear|fp8|softmax]
//                           [--shape NAME[,NAME...]] [--ms M[,M...]] [--softmax-kernel NAME]
//                           [--odd]
//   --only fp8: the fp8 linear rows alone; --shape: the linear rows of those shapes alone;
//   --ms: instead of the default rows, every (--shape) linear shape at each of these M, bf16
//         (and fp8 for the fp8 rows' shapes; with --only fp8 those alone);
//   --softmax-kernel: the softmax rows on that op-table entry (rows it does not take are left out);
//   --odd: instead of the default rows, odd shapes (kOddShapes: K and N not multiples of 8) next
//          to their aligned neighbours (rounded up to 16), bf16 and fp8, at M = 1, 4, 16, 64 (or
//          --ms); the odd weights with a padded row stride (what fusedmlp.FusedLinear stores) and
//          as given (contiguous, row stride K), each with its time over the aligned row's
//          ("odd/aligned", the goal: <= 1.1 padded); then the padded odd rows and the
//          aligned ones on each of the weight-stream and tensor-core entries forced (where they
//          take the call), to show which entry the planner should give odd shapes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.h"

namespace {

using fmlp_bench::chosen_kernel;
using fmlp_bench::copy_bandwidth;
using fmlp_bench::graph_us_per_call;

struct Shape {
  const char* name;
  int64_t n, k;
};
// nn.Linear projections (out, in) of real configs.
const Shape kShapes[] = {
    {"gpt2-s.qkv", 2304, 768},
    {"gpt2-s.o", 768, 768},
    {"gpt2-s.fc", 3072, 768},
    {"gpt2-s.proj", 768, 3072},
    {"gpt2-s.lm_head", 50257, 768},
    {"gpt2-m.qkv", 3072, 1024},
    {"gpt2-m.o", 1024, 1024},
    {"gpt2-m.fc", 4096, 1024},
    {"gpt2-m.proj", 1024, 4096},
    {"llama3-8b.q", 4096, 4096},
    {"llama3-8b.kv", 1024, 4096},
    {"llama3-8b.o", 4096, 4096},
    {"llama3-8b.gate_up", 28672, 4096},
    {"llama3-8b.up", 14336, 4096},
    {"llama3-8b.down", 4096, 14336},
    {"llama3-8b.lm_head", 128256, 4096},
    {"llama3-70b.q", 8192, 8192},
    {"llama3-70b.kv", 1024, 8192},
    {"llama3-70b.o", 8192, 8192},
    {"llama3-70b.up", 28672, 8192},
    {"llama3-70b.down", 8192, 28672},
    {"llama3-70b.lm_head", 128256, 8192},
    {"mistral-7b.q", 4096, 4096},
    {"mistral-7b.kv", 1024, 4096},
    {"mistral-7b.up", 14336, 4096},
    {"mistral-7b.down", 4096, 14336},
    {"mistral-7b.lm_head", 32000, 4096},
    {"mixtral.router", 8, 4096},
    {"mixtral.w1", 14336, 4096},
    {"mixtral.w2", 4096, 14336},
    {"mixtral.q", 4096, 4096},
    {"mixtral.kv", 1024, 4096},
    {"qwen2.5-0.5b.q", 896, 896},
    {"qwen2.5-0.5b.kv", 128, 896},
    {"qwen2.5-0.5b.up", 4864, 896},
    {"qwen2.5-0.5b.down", 896, 4864},
    {"qwen2.5-0.5b.lm_head", 151936, 896},
    {"qwen2.5-7b.q", 3584, 3584},
    {"qwen2.5-7b.kv", 512, 3584},
    {"qwen2.5-7b.up", 18944, 3584},
    {"qwen2.5-7b.down", 3584, 18944},
    {"qwen2.5-7b.lm_head", 152064, 3584},
    {"lm_head.768", 50257, 768},
    {"lm_head.4096", 128256, 4096},
};

// Odd projections (up and down of the odd MLP sizes in odd_suite.txt) and their neighbours rounded
// up to multiples of 16, for --odd.
struct OddPair {
  Shape odd, aligned;
};
const OddPair kOddShapes[] = {
    {{"odd.up.4095", 11007, 4095}, {"al.up.4096", 11008, 4096}},
    {{"odd.down.4095", 4095, 11007}, {"al.down.4096", 4096, 11008}},
    {{"odd.up.1001", 2731, 1001}, {"al.up.1008", 2736, 1008}},
    {{"odd.down.1001", 1001, 2731}, {"al.down.1008", 1008, 2736}},
};

uint64_t g_rng = 0x9E3779B97F4A7C15ull;
double urand() {  // [-1, 1)
  g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
  return double(g_rng >> 11) * 0x1p-52 - 1.0;
}

size_t esize(fmlp_dtype_t t) {
  return fmlp::dtype_size(t);
}

// Random bytes of dtype t (never zero); fp8 codes avoid NaN.
std::vector<uint8_t> random_host(fmlp_dtype_t t, size_t n, double scale) {
  std::vector<uint8_t> b(n * esize(t));
  for (size_t i = 0; i < n; ++i) {
    const float v = float(urand() * scale + (urand() > 0 ? 1e-3 : -1e-3));
    if (t == FMLP_DTYPE_F32)
      std::memcpy(&b[4 * i], &v, 4);
    else if (t == FMLP_DTYPE_BF16) {
      const uint16_t h = fmlp::float_to_bf16(v);
      std::memcpy(&b[2 * i], &h, 2);
    } else if (t == FMLP_DTYPE_F16) {
      const uint16_t h = fmlp::float_to_f16(v);
      std::memcpy(&b[2 * i], &h, 2);
    } else {
      b[i] = uint8_t((g_rng >> 20) % 0x7e) | uint8_t(urand() > 0 ? 0x80 : 0);
    }
  }
  return b;
}

double get(const uint8_t* p, fmlp_dtype_t t, size_t i) {
  switch (t) {
    case FMLP_DTYPE_F32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case FMLP_DTYPE_BF16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return fmlp::bf16_to_float(h);
    }
    case FMLP_DTYPE_F16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return fmlp::f16_to_float(h);
    }
    default: return fmlp::f8e4m3_to_float(p[i]);
  }
}

void* upload(const std::vector<uint8_t>& h) {
  void* d = nullptr;
  CK(cudaMalloc(&d, h.size()));
  CK(cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice));
  return d;
}

fmlp_tensor_t dev2d(void* p, fmlp_dtype_t t, int64_t r, int64_t c) {
  fmlp_tensor_t v = fmlp_tensor_2d(p, t, r, c, c);
  v.device_type = FMLP_DEVICE_CUDA;
  return v;
}

template <typename F>
cudaGraphExec_t capture(cudaStream_t s, F body) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  body();
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t e;
  CK(cudaGraphInstantiateWithFlags(&e, g, 0));
  CK(cudaGraphDestroy(g));
  return e;
}

struct Row {
  std::string op, shape, dtype, check;
  int64_t m, n, k;
  double us, bytes;
  std::string kernel;       // the cuda entry the dispatch chose
  double over_aligned = 0;  // --odd: us over the aligned neighbour's (0: not an odd row)
};

void print_row(const Row& r, double bw) {
  std::printf(
      "%-8s %-22s %-5s M=%-3lld N=%-7lld K=%-6lld %9.2f us %8.1f GB/s %6.1f%% of copy  %s  %s\n",
      r.op.c_str(), r.shape.c_str(), r.dtype.c_str(), (long long)r.m, (long long)r.n,
      (long long)r.k, r.us, r.bytes / r.us * 1e-3, 100.0 * r.bytes / bw / (r.us * 1e-6),
      r.check.c_str(), r.kernel.c_str());
  std::fflush(stdout);
}

// w_ld: W's row stride in elements (0: K, rows back to back); the padding past K is zeros.
// kernel: the op-table entry to time instead of the planner's pick (nullptr: dispatch); a row
// with an empty op when it does not take the call.
Row bench_linear(const Shape& sh, int64_t m, fmlp_dtype_t wt, size_t l2, cudaStream_t s, int reps,
                 int64_t w_ld = 0, const char* kernel = nullptr) {
  const fmlp_dtype_t xt = FMLP_DTYPE_BF16;
  const int64_t ld = w_ld > 0 ? w_ld : sh.k;
  const size_t wbytes = size_t(sh.n * ld) * esize(wt);
  const int copies = int(std::min<size_t>(64, std::max<size_t>(1, (3 * l2 + wbytes - 1) / wbytes)));
  const std::vector<uint8_t> hw =
      random_host(wt, size_t(sh.n * sh.k), 1.0 / std::sqrt(double(sh.k)));
  const std::vector<uint8_t> hx = random_host(xt, size_t(m * sh.k), 1.0);
  const std::vector<uint8_t> hb = random_host(xt, size_t(sh.n), 0.1);
  std::vector<float> hs(size_t(sh.n), 1.f / 64);
  std::vector<uint8_t> hsb(hs.size() * 4);
  std::memcpy(hsb.data(), hs.data(), hsb.size());
  std::vector<uint8_t> hw_ld(size_t(sh.n * ld) * esize(wt), 0);
  for (int64_t r = 0; r < sh.n; ++r)
    std::memcpy(hw_ld.data() + size_t(r * ld) * esize(wt), hw.data() + size_t(r * sh.k) * esize(wt),
                size_t(sh.k) * esize(wt));
  std::vector<void*> wcopies(static_cast<size_t>(copies));
  for (auto& w : wcopies) w = upload(hw_ld);
  void* x = upload(hx);
  void* bias = upload(hb);
  void* scale = upload(hsb);
  void* y = nullptr;
  CK(cudaMalloc(&y, size_t(m * sh.n) * esize(xt)));
  fmlp_linear_args_t a{dev2d(y, xt, m, sh.n), dev2d(x, xt, m, sh.k),
                       dev2d(wcopies[0], wt, sh.n, sh.k), fmlp_tensor_none(), fmlp_tensor_none()};
  a.w.stride[0] = ld;
  a.bias = fmlp_tensor_1d(bias, xt, sh.n);
  a.bias.device_type = FMLP_DEVICE_CUDA;
  if (wt == FMLP_DTYPE_F8_E4M3) {
    a.w_scale = fmlp_tensor_1d(scale, FMLP_DTYPE_F32, sh.n);
    a.w_scale.device_type = FMLP_DEVICE_CUDA;
  }
  auto release = [&] {
    for (void* w : wcopies) CK(cudaFree(w));
    CK(cudaFree(x));
    CK(cudaFree(bias));
    CK(cudaFree(scale));
    CK(cudaFree(y));
  };
  if (kernel && fmlp_linear_kernel_supports(&a, kernel) != FMLP_SUCCESS) {
    release();
    return {};
  }
  size_t wsb = 0;
  if (kernel)
    FK(fmlp_linear_kernel_workspace_size(&a, kernel, &wsb));
  else
    FK(fmlp_linear_workspace_size(&a, FMLP_BACKEND_CUDA, &wsb));
  void* ws = nullptr;
  if (wsb) {
    CK(cudaMalloc(&ws, wsb));
    CK(cudaMemset(ws, 0, wsb));
  }
  auto call = [&] {
    return kernel ? fmlp_linear_with_kernel(&a, kernel, ws, wsb, s)
                  : fmlp_linear(&a, FMLP_BACKEND_CUDA, ws, wsb, s);
  };
  // Spot check of the first copy against fp64.
  FK(call());
  CK(cudaStreamSynchronize(s));
  std::vector<uint8_t> hy(size_t(m * sh.n) * esize(xt));
  CK(cudaMemcpy(hy.data(), y, hy.size(), cudaMemcpyDeviceToHost));
  double worst = 0;
  for (int t = 0; t < 32; ++t) {
    const int64_t i = t % m, o = int64_t((uint64_t(t) * 2654435761u) % uint64_t(sh.n));
    double ref = 0, l2n = 0;
    for (int64_t c = 0; c < sh.k; ++c) {
      const double v = get(hw.data(), wt, size_t(o * sh.k + c)) *
                       get(hx.data(), xt, size_t(i * sh.k + c)) *
                       (wt == FMLP_DTYPE_F8_E4M3 ? 1.0 / 64 : 1.0);
      ref += v, l2n += v * v;
    }
    ref += get(hb.data(), xt, size_t(o));
    worst = std::max(worst, std::fabs(get(hy.data(), xt, size_t(i * sh.n + o)) - ref) /
                                ((std::fabs(ref) + std::sqrt(l2n)) / 128 + 1e-30));
  }
  cudaGraphExec_t g = capture(s, [&] {
    for (int c = 0; c < copies; ++c) {
      a.w.data = wcopies[size_t(c)];
      FK(call());
    }
  });
  Row r{"linear",
        std::string(sh.name) + (ld != sh.k ? ".ld" + std::to_string(ld) : ""),
        fmlp_dtype_name(wt),
        worst <= 1.0 ? "ok" : "CHECK-FAILED",
        m,
        sh.n,
        sh.k,
        0.0,
        double(size_t(sh.n * sh.k) * esize(wt) + size_t(m * (sh.k + sh.n)) * esize(xt))};
  r.kernel = kernel ? std::string(kernel) + " (forced)" : chosen_kernel(fmlp_linear_explain, a);
  r.us = graph_us_per_call(g, s, copies, reps);
  CK(cudaGraphExecDestroy(g));
  release();
  if (ws) CK(cudaFree(ws));
  return r;
}

const char* g_softmax_kernel = nullptr;  // --softmax-kernel: forced entry, or dispatch

// The call the softmax rows time: dispatch, or the entry --softmax-kernel names.
fmlp_status_t softmax_call(const fmlp_softmax_args_t& a, void* ws, size_t wsb, cudaStream_t s) {
  return g_softmax_kernel ? fmlp_softmax_with_kernel(&a, g_softmax_kernel, ws, wsb, s)
                          : fmlp_softmax(&a, FMLP_BACKEND_CUDA, ws, wsb, s);
}

Row bench_softmax(int64_t rows, int64_t n, fmlp_dtype_t t, bool log, size_t l2, cudaStream_t s,
                  int reps) {
  const size_t bytes = size_t(rows * n) * esize(t);
  const int copies = int(std::min<size_t>(256, std::max<size_t>(1, (3 * l2 + bytes - 1) / bytes)));
  const std::vector<uint8_t> hx = random_host(t, size_t(rows * n), 8.0);
  std::vector<void*> xs(static_cast<size_t>(copies)), ys(static_cast<size_t>(copies));
  for (int c = 0; c < copies; ++c) {
    xs[size_t(c)] = upload(hx);
    CK(cudaMalloc(&ys[size_t(c)], bytes));
  }
  fmlp_softmax_args_t a{dev2d(ys[0], t, rows, n), dev2d(xs[0], t, rows, n), 1.f, log ? 1 : 0};
  if (g_softmax_kernel && fmlp_softmax_kernel_supports(&a, g_softmax_kernel) != FMLP_SUCCESS) {
    std::printf("%s %lldx%lld %s: %s does not take it (%s)\n", log ? "logsoftm" : "softmax",
                (long long)rows, (long long)n, fmlp_dtype_name(t), g_softmax_kernel,
                fmlp_last_error());
    for (int c = 0; c < copies; ++c) {
      CK(cudaFree(xs[size_t(c)]));
      CK(cudaFree(ys[size_t(c)]));
    }
    return {};
  }
  size_t wsb = 0;
  if (g_softmax_kernel)
    FK(fmlp_softmax_kernel_workspace_size(&a, g_softmax_kernel, &wsb));
  else
    FK(fmlp_softmax_workspace_size(&a, FMLP_BACKEND_CUDA, &wsb));
  void* ws = nullptr;
  if (wsb) {
    CK(cudaMalloc(&ws, wsb));
    CK(cudaMemset(ws, 0, wsb));
  }
  FK(softmax_call(a, ws, wsb, s));
  CK(cudaStreamSynchronize(s));
  std::vector<uint8_t> hy(bytes);
  CK(cudaMemcpy(hy.data(), ys[0], bytes, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (int64_t r = 0; r < rows; r += std::max<int64_t>(1, rows / 4)) {
    double m = -INFINITY, sum = 0;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, get(hx.data(), t, size_t(r * n + i)));
    for (int64_t i = 0; i < n; ++i) sum += std::exp(get(hx.data(), t, size_t(r * n + i)) - m);
    for (int64_t i = 0; i < n; i += 97) {
      const double z = get(hx.data(), t, size_t(r * n + i)) - m;
      const double ref = log ? z - std::log(sum) : std::exp(z) / sum;
      const double tol =
          (log ? 1 + std::fabs(z) + std::log(sum) : std::fabs(ref) * (1 + std::fabs(z))) /
              (t == FMLP_DTYPE_F32 ? 1e4 : 128) +
          1e-30;
      worst = std::max(worst, std::fabs(get(hy.data(), t, size_t(r * n + i)) - ref) / tol);
    }
  }
  cudaGraphExec_t g = capture(s, [&] {
    for (int c = 0; c < copies; ++c) {
      a.x.data = xs[size_t(c)];
      a.y.data = ys[size_t(c)];
      FK(softmax_call(a, ws, wsb, s));
    }
  });
  Row r{log ? "logsoftm" : "softmax",
        std::to_string(rows) + "x" + std::to_string(n),
        fmlp_dtype_name(t),
        worst <= 1.0 ? "ok" : "CHECK-FAILED",
        rows,
        n,
        0,
        0.0,
        2.0 * double(bytes)};
  r.kernel = g_softmax_kernel ? g_softmax_kernel : chosen_kernel(fmlp_softmax_explain, a);
  r.us = graph_us_per_call(g, s, copies, reps);
  CK(cudaGraphExecDestroy(g));
  for (int c = 0; c < copies; ++c) {
    CK(cudaFree(xs[size_t(c)]));
    CK(cudaFree(ys[size_t(c)]));
  }
  if (ws) CK(cudaFree(ws));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json = "ops.json", only, shape;
  std::vector<int64_t> ms;
  int reps = 50;
  bool odd = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--reps" && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (a == "--only" && i + 1 < argc)
      only = argv[++i];
    else if (a == "--shape" && i + 1 < argc)
      shape = argv[++i];
    else if (a == "--ms" && i + 1 < argc) {
      if (!fmlp_bench::parse_positive_list(argv[++i], &ms)) {
        std::fprintf(stderr, "--ms %s: expected positive integers separated by commas\n", argv[i]);
        return 1;
      }
    } else if (a == "--odd") {
      odd = true;
    } else if (a == "--softmax-kernel" && i + 1 < argc) {
      g_softmax_kernel = argv[++i];
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 1;
    }
  }
  if (!only.empty() && only != "linear" && only != "fp8" && only != "softmax") {
    std::fprintf(stderr, "--only %s: expected linear, fp8 or softmax\n", only.c_str());
    return 1;
  }
  if (!shape.empty() && !fmlp_bench::check_names("--shape", shape, kShapes)) return 1;
  auto wanted = [&](const char* name) {  // --shape a,b,c: those suite entries only
    return shape.empty() || fmlp_bench::in_list(shape, name);
  };
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t l2 = size_t(prop.l2CacheSize);
  const double bw = copy_bandwidth();
  std::printf("%s, copy %.3f TB/s, L2 %zu MB\n", prop.name, bw * 1e-12, l2 >> 20);
  std::vector<Row> rows;
  const char* const fp8_shapes[] = {"llama3-8b.q", "llama3-8b.down", "llama3-8b.up",
                                    "llama3-70b.up"};
  if (odd) {  // --odd: odd shapes beside their aligned neighbours, no softmax
    const std::vector<int64_t> odd_ms = ms.empty() ? std::vector<int64_t>{1, 4, 16, 64} : ms;
    std::vector<std::string> summary;
    for (const OddPair& p : kOddShapes)
      for (fmlp_dtype_t wt : {FMLP_DTYPE_BF16, FMLP_DTYPE_F8_E4M3})
        for (int64_t m : odd_ms) {
          if (only == "fp8" && wt != FMLP_DTYPE_F8_E4M3) continue;
          const int64_t per = wt == FMLP_DTYPE_F8_E4M3 ? 16 : 8;
          const int64_t padded_ld = (p.odd.k + per - 1) / per * per;
          rows.push_back(bench_linear(p.aligned, m, wt, l2, s, reps)), print_row(rows.back(), bw);
          const double aligned_us = rows.back().us;
          for (const int64_t ld : {padded_ld, int64_t(0)}) {
            rows.push_back(bench_linear(p.odd, m, wt, l2, s, reps, ld));
            rows.back().over_aligned = rows.back().us / aligned_us;
            print_row(rows.back(), bw);
            char line[256];
            std::snprintf(line, sizeof line, "odd/aligned %-22s %-5s M=%-3lld %6.3f  (%s vs %s)%s",
                          rows.back().shape.c_str(), fmlp_dtype_name(wt), (long long)m,
                          rows.back().over_aligned, rows.back().kernel.c_str(),
                          rows[rows.size() - 1 - (ld ? 1 : 2)].kernel.c_str(),
                          ld && rows.back().over_aligned > 1.1 ? "  OVER 1.1" : "");
            summary.push_back(line);
          }
          for (const char* forced : {"linear_sm80_stream", "linear_sm80_mma"})
            for (const auto& [sh, ld] :
                 {std::pair<Shape, int64_t>{p.aligned, 0}, {p.odd, padded_ld}}) {
              Row r = bench_linear(sh, m, wt, l2, s, reps, ld, forced);
              if (r.op.empty()) continue;
              if (ld) r.over_aligned = r.us / aligned_us;
              rows.push_back(r), print_row(rows.back(), bw);
            }
        }
    std::printf("\n");
    for (const std::string& l : summary) std::printf("%s\n", l.c_str());
    only = "none";
  } else if (!ms.empty()) {  // --ms: the chosen shapes at the chosen M, no softmax
    for (int64_t m : ms)
      for (const Shape& sh : kShapes)
        if (wanted(sh.name)) {
          if (only != "fp8")
            rows.push_back(bench_linear(sh, m, FMLP_DTYPE_BF16, l2, s, reps)),
                print_row(rows.back(), bw);
          for (const char* name : fp8_shapes)
            if (std::string(sh.name) == name)
              rows.push_back(bench_linear(sh, m, FMLP_DTYPE_F8_E4M3, l2, s, reps)),
                  print_row(rows.back(), bw);
        }
    only = "none";
  }
  if (only.empty() || only == "linear") {
    for (const Shape& sh : kShapes)
      if (wanted(sh.name))
        rows.push_back(bench_linear(sh, 1, FMLP_DTYPE_BF16, l2, s, reps)),
            print_row(rows.back(), bw);
    for (const char* name :
         {"llama3-8b.q", "llama3-8b.down", "llama3-8b.lm_head", "mixtral.router"})
      for (const Shape& sh : kShapes)
        if (std::string(sh.name) == name && wanted(name)) {
          for (int64_t m : {4, 16, 64})
            rows.push_back(bench_linear(sh, m, FMLP_DTYPE_BF16, l2, s, reps)),
                print_row(rows.back(), bw);
        }
  }
  if (only.empty() || only == "linear" || only == "fp8") {
    // fp8 weight-only, per-row scales, M = 1: the 4096 -> 14336 and 8192 -> 28672 targets.
    for (const char* name : fp8_shapes)
      for (const Shape& sh : kShapes)
        if (std::string(sh.name) == name && wanted(name))
          rows.push_back(bench_linear(sh, 1, FMLP_DTYPE_F8_E4M3, l2, s, reps)),
              print_row(rows.back(), bw);
  }
  if (only.empty() || only == "softmax") {
    auto add_softmax = [&](Row r) {
      if (r.op.empty()) return;  // --softmax-kernel does not take the row
      rows.push_back(r);
      print_row(rows.back(), bw);
    };
    for (bool log : {false, true}) {
      add_softmax(bench_softmax(1, 128256, FMLP_DTYPE_F32, log, l2, s, reps));
      add_softmax(bench_softmax(256, 128256, FMLP_DTYPE_F32, log, l2, s, reps));
    }
    add_softmax(bench_softmax(32, 128256, FMLP_DTYPE_F32, false, l2, s, reps));
    add_softmax(bench_softmax(1, 128256, FMLP_DTYPE_BF16, false, l2, s, reps));
    add_softmax(bench_softmax(256, 128256, FMLP_DTYPE_BF16, false, l2, s, reps));
    add_softmax(bench_softmax(256, 32000, FMLP_DTYPE_BF16, false, l2, s, reps));
    add_softmax(bench_softmax(64, 32000, FMLP_DTYPE_BF16, false, l2, s, reps));
    add_softmax(bench_softmax(4096, 1024, FMLP_DTYPE_F32, false, l2, s, reps));
    add_softmax(bench_softmax(8192, 2048, FMLP_DTYPE_BF16, false, l2, s, reps));
    add_softmax(bench_softmax(1, 1 << 20, FMLP_DTYPE_F32, false, l2, s, reps));
  }
  FILE* f = std::fopen(json.c_str(), "w");
  if (!f) return 1;
  std::fprintf(f, "{\"gpu\": \"%s\", \"copy_TBps\": %.4f, \"rows\": [\n", prop.name, bw * 1e-12);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(
        f,
        "  {\"op\": \"%s\", \"shape\": \"%s\", \"dtype\": \"%s\", \"M\": %lld, \"N\": %lld, "
        "\"K\": %lld, \"us\": %.3f, \"GBps\": %.1f, \"pct_of_copy\": %.1f, \"check\": \"%s\", "
        "\"kernel\": \"%s\"%s}%s\n",
        r.op.c_str(), r.shape.c_str(), r.dtype.c_str(), (long long)r.m, (long long)r.n,
        (long long)r.k, r.us, r.bytes / r.us * 1e-3, 100.0 * r.bytes / bw / (r.us * 1e-6),
        r.check.c_str(), r.kernel.c_str(),
        r.over_aligned > 0 ? (", \"odd_over_aligned\": " + std::to_string(r.over_aligned)).c_str()
                           : "",
        i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  return 0;
}
