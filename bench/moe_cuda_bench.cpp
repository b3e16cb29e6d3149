// fusedmlp_moe_bench: speed of the cuda moe op (router + experts + combine, one fmlp_moe call) on
// two MoE layers, bf16, random router weights (so the routing is realistic), at T = 1..512 tokens.
//   mixtral: E = 8, top-2, 4096 -> 14336 (SwiGLU) -> 4096
//   e64k8:   E = 64, top-8, 2048 -> 1408 (SwiGLU) -> 2048 (Qwen/DeepSeek-style fine-grained)
// Every case: CUDA-graph replay of `copies` calls (weights and inputs rotated so the experts a call
// reads exceed 3x the L2), warm-up, median of --reps replays. Floor = bytes of the experts the
// routing actually hits (counted on the host from an fp64 routing of the same inputs) + router +
// x and y, at the copy bandwidth measured in this run. T <= 4 is checked against an fp64 host
// reference of token 0 before timing. Every row names the cuda entry that ran: the default dispatch
// picks, or --kernel NAME (fmlp_moe_with_kernel; rows it does not take are printed as skipped).
// --wdtype f8: fp8 e4m3 experts (the same random weights quantised per row, fp32 scales [E, rows];
// x and y stay bf16); the floor then counts the fp8 bytes and the scales of the experts hit, and
// the check uses the dequantised weights.
// --given: the routing is handed to the op (top-k ids and weights from the same fp64 routing, as a
// framework that routes itself would), so the router, its softmax and top-k are not timed; rows
// are named LAYER+given, and the floor counts the ids and weights instead of the router.
// usage: fusedmlp_moe_bench [--json FILE] [--reps N] [--ts 1,4,16,64,512] [--deterministic]
//                           [--kernel moe_sm90_grouped|moe_sm80_grouped|moe_sm80_chunked]
//                           [--wdtype bf16|f8] [--layers mixtral,e64k8] [--given]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.h"

namespace {

using fmlp_bench::chosen_kernel;
using fmlp_bench::copy_bandwidth;
using fmlp_bench::graph_us_per_call;

struct Layer {
  const char* name;
  int64_t e, k, d, h;
};
const Layer kLayers[] = {{"mixtral", 8, 2, 4096, 14336}, {"e64k8", 64, 8, 2048, 1408}};

uint64_t g_rng = 0x9E3779B97F4A7C15ull;
bool g_fp8 = false;    // --wdtype f8
bool g_given = false;  // --given
double urand() {       // [-1, 1)
  g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
  return double(g_rng >> 11) * 0x1p-52 - 1.0;
}

std::vector<uint16_t> random_bf16(size_t n, double scale) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = fmlp::float_to_bf16(float(urand() * scale));
  return v;
}
double bf(uint16_t v) {
  return fmlp::bf16_to_float(v);
}

template <typename T>
void* upload(const std::vector<T>& h) {
  void* d = nullptr;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Expert weights [rows, cols] (stacked): bf16, or (g_fp8) e4m3 codes with one scale per row.
struct Weights {
  std::vector<uint16_t> bf;
  std::vector<uint8_t> q;
  std::vector<float> s;
  int64_t cols = 1;
  double at(size_t i) const {
    return g_fp8 ? double(fmlp::f8e4m3_to_float(q[i])) * s[i / size_t(cols)]
                 : double(fmlp::bf16_to_float(bf[i]));
  }
};

Weights random_weights(size_t n, int64_t cols, double scale) {
  Weights w;
  w.bf = random_bf16(n, scale), w.cols = cols;
  if (!g_fp8) return w;
  w.q.resize(n), w.s.resize(n / size_t(cols));
  for (size_t r = 0; r < w.s.size(); ++r) {
    float amax = 0.f;
    for (size_t c = 0; c < size_t(cols); ++c)
      amax = std::max(amax, std::fabs(fmlp::bf16_to_float(w.bf[r * size_t(cols) + c])));
    w.s[r] = amax > 0.f ? amax / 448.f : 1.f;
    for (size_t c = 0; c < size_t(cols); ++c)
      w.q[r * size_t(cols) + c] =
          fmlp::float_to_f8e4m3(fmlp::bf16_to_float(w.bf[r * size_t(cols) + c]) / w.s[r]);
  }
  w.bf = {};
  return w;
}

fmlp_tensor_t dev(void* p, int nd, const int64_t* shape, fmlp_dtype_t dt = FMLP_DTYPE_BF16) {
  fmlp_tensor_t t = fmlp_tensor_none();
  t.data = p, t.dtype = dt, t.ndim = nd, t.device_type = FMLP_DEVICE_CUDA;
  int64_t s = 1;
  for (int i = nd - 1; i >= 0; --i) t.shape[i] = shape[i], t.stride[i] = s, s *= shape[i];
  return t;
}

// fp64 routing of token x (softmax, top-k with ties to the lower id, renormalised).
void route(const Layer& L, const uint16_t* wr, const uint16_t* x, int64_t* ids, double* w) {
  std::vector<double> s(size_t(L.e));
  double mx = -INFINITY, sum = 0;
  for (int64_t e = 0; e < L.e; ++e) {
    double a = 0;
    for (int64_t c = 0; c < L.d; ++c) a += bf(wr[e * L.d + c]) * bf(x[c]);
    mx = std::max(mx, s[size_t(e)] = a);
  }
  for (double& v : s) sum += (v = std::exp(v - mx));
  double tot = 0;
  for (int64_t j = 0; j < L.k; ++j) {
    int64_t b = -1;
    for (int64_t e = 0; e < L.e; ++e)
      if (std::find(ids, ids + j, e) == ids + j && (b < 0 || s[size_t(e)] > s[size_t(b)])) b = e;
    ids[j] = b, tot += (w[j] = s[size_t(b)] / sum);
  }
  for (int64_t j = 0; j < L.k; ++j) w[j] /= tot;
}

struct Row {
  std::string layer, check, kernel;
  int64_t t;
  double us, floor_us, bytes, hit;
  double tflops() const { return 2.0 * double(t * k) * 3.0 * double(d * h) / us * 1e-6; }
  int64_t k, d, h;
};

Row bench(const Layer& L, int64_t T, size_t l2, double bw, cudaStream_t s, int reps, bool det,
          const char* kernel) {
  const size_t w1n = size_t(L.e * 2 * L.h * L.d), w2n = size_t(L.e * L.d * L.h);
  const size_t esz = g_fp8 ? 1 : 2;
  // fp8: the codes and the fp32 row scales of W1 and W2.
  const double expert_bytes =
      double(3 * L.h * L.d) * double(esz) + (g_fp8 ? double(2 * L.h + L.d) * 4 : 0.0);
  // Copies so that the experts one call hits (at least k) exceed 3x the L2, within ~6 GB.
  const double hit_min = expert_bytes * double(std::min(L.e, L.k * T));
  const int copies = int(std::clamp<double>(std::ceil(3.0 * double(l2) / hit_min), 1.0,
                                            std::max(1.0, 6e9 / double((w1n + w2n) * esz))));
  const size_t nc = size_t(copies);
  std::vector<Weights> w1(nc), w2(nc);
  std::vector<std::vector<uint16_t>> x(nc);
  const std::vector<uint16_t> wr = random_bf16(size_t(L.e * L.d), 1.0 / std::sqrt(double(L.d)));
  std::vector<void*> dw1, dw2, dx, ds1, ds2;
  for (int c = 0; c < copies; ++c) {
    w1[size_t(c)] = random_weights(w1n, L.d, std::sqrt(3.0 / double(L.d)));
    w2[size_t(c)] = random_weights(w2n, L.h, std::sqrt(3.0 / double(L.h)));
    x[size_t(c)] = random_bf16(size_t(T * L.d), 1.7);
    if (g_fp8) {
      dw1.push_back(upload(w1[size_t(c)].q)), dw2.push_back(upload(w2[size_t(c)].q));
      ds1.push_back(upload(w1[size_t(c)].s)), ds2.push_back(upload(w2[size_t(c)].s));
    } else {
      dw1.push_back(upload(w1[size_t(c)].bf)), dw2.push_back(upload(w2[size_t(c)].bf));
    }
    dx.push_back(upload(x[size_t(c)]));
  }
  // The fp64 routing of every copy's tokens: the experts a call hits (the floor) and, with --given,
  // the routing handed to the op.
  std::vector<void*> dids, dwts;
  double hit = 0;
  for (int c = 0; c < copies; ++c) {
    std::set<int64_t> seen;
    std::vector<int64_t> ids(size_t(L.k));
    std::vector<double> w(size_t(L.k));
    std::vector<int32_t> all_ids;
    std::vector<float> all_w;
    for (int64_t t = 0; t < T; ++t) {
      route(L, wr.data(), x[size_t(c)].data() + t * L.d, ids.data(), w.data());
      seen.insert(ids.begin(), ids.end());
      for (int64_t j = 0; j < L.k; ++j)
        all_ids.push_back(int32_t(ids[size_t(j)])), all_w.push_back(float(w[size_t(j)]));
    }
    hit += double(seen.size()) / copies;
    if (g_given) dids.push_back(upload(all_ids)), dwts.push_back(upload(all_w));
  }
  void* dwr = upload(wr);
  void* dy = nullptr;
  CK(cudaMalloc(&dy, size_t(T * L.d) * 2));
  const int64_t xs[2] = {T, L.d}, wrs[2] = {L.e, L.d}, w1s[3] = {L.e, 2 * L.h, L.d},
                w2s[3] = {L.e, L.d, L.h};
  fmlp_moe_args_t a{};
  a.y = dev(dy, 2, xs), a.x = dev(dx[0], 2, xs), a.router_w = dev(dwr, 2, wrs);
  const fmlp_dtype_t wt = g_fp8 ? FMLP_DTYPE_F8_E4M3 : FMLP_DTYPE_BF16;
  a.w1 = dev(dw1[0], 3, w1s, wt), a.w2 = dev(dw2[0], 3, w2s, wt);
  if (g_fp8) {
    const int64_t s1s[2] = {L.e, 2 * L.h}, s2s[2] = {L.e, L.d};
    a.w1_scale = dev(ds1[0], 2, s1s, FMLP_DTYPE_F32),
    a.w2_scale = dev(ds2[0], 2, s2s, FMLP_DTYPE_F32);
  }
  a.residual = a.router_b = a.b1 = a.b2 = fmlp_tensor_none();
  if (g_given) {
    a.router_w = fmlp_tensor_none();
    a.topk_ids = static_cast<const int32_t*>(dids[0]);
    a.topk_weights = static_cast<const float*>(dwts[0]);
  }
  a.config = fmlp_moe_config_default(int32_t(L.e), int32_t(L.k));
  a.config.gated = 1, a.config.activation = FMLP_ACT_SILU, a.config.deterministic = det;
  Row r{std::string(L.name) + (g_given ? "+given" : ""),
        "-",
        kernel ? kernel : chosen_kernel(fmlp_moe_explain, a),
        T,
        0,
        0,
        0,
        0,
        L.k,
        L.d,
        L.h};
  const auto release = [&] {
    for (int c = 0; c < copies; ++c) {
      CK(cudaFree(dw1[size_t(c)]));
      CK(cudaFree(dw2[size_t(c)]));
      CK(cudaFree(dx[size_t(c)]));
      if (g_fp8) {
        CK(cudaFree(ds1[size_t(c)]));
        CK(cudaFree(ds2[size_t(c)]));
      }
      if (g_given) {
        CK(cudaFree(dids[size_t(c)]));
        CK(cudaFree(dwts[size_t(c)]));
      }
    }
    CK(cudaFree(dwr));
    CK(cudaFree(dy));
  };
  if (kernel && fmlp_moe_kernel_supports(&a, kernel) != FMLP_SUCCESS) {
    std::printf("%s T=%lld: %s skipped: %s\n", L.name, (long long)T, kernel, fmlp_last_error());
    r.check = "UNSUPPORTED";
    release();
    return r;
  }
  size_t wsb = 0;
  FK(kernel ? fmlp_moe_kernel_workspace_size(&a, kernel, &wsb)
            : fmlp_moe_workspace_size(&a, FMLP_BACKEND_CUDA, &wsb));
  void* ws = nullptr;
  CK(cudaMalloc(&ws, wsb));
  CK(cudaMemset(ws, 0, wsb));
  const auto call = [&] {
    return kernel ? fmlp_moe_with_kernel(&a, kernel, ws, wsb, s)
                  : fmlp_moe(&a, FMLP_BACKEND_CUDA, ws, wsb, s);
  };
  if (T <= 4) {  // token 0 of copy 0 against fp64
    FK(call());
    CK(cudaStreamSynchronize(s));
    std::vector<uint16_t> y(size_t(T * L.d));
    CK(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<int64_t> ids(size_t(L.k));
    std::vector<double> w(size_t(L.k)), ref(size_t(L.d), 0.0), h(size_t(L.h));
    route(L, wr.data(), x[0].data(), ids.data(), w.data());
    for (int64_t j = 0; j < L.k; ++j) {
      const size_t e1 = size_t(ids[size_t(j)] * 2 * L.h * L.d);
      const size_t e2 = size_t(ids[size_t(j)] * L.d * L.h);
      for (int64_t u = 0; u < L.h; ++u) {
        double g = 0, v = 0;
        for (int64_t c = 0; c < L.d; ++c) {
          g += w1[0].at(e1 + size_t(u * L.d + c)) * bf(x[0][size_t(c)]);
          v += w1[0].at(e1 + size_t((L.h + u) * L.d + c)) * bf(x[0][size_t(c)]);
        }
        h[size_t(u)] = g / (1 + std::exp(-g)) * v;
      }
      for (int64_t o = 0; o < L.d; ++o) {
        double acc = 0;
        for (int64_t u = 0; u < L.h; ++u) acc += w2[0].at(e2 + size_t(o * L.h + u)) * h[size_t(u)];
        ref[size_t(o)] += w[size_t(j)] * acc;
      }
    }
    double rms = 0, worst = 0;
    for (double v : ref) rms += v * v;
    rms = std::sqrt(rms / double(L.d));
    for (int64_t o = 0; o < L.d; ++o)
      worst = std::max(worst, std::fabs(bf(y[size_t(o)]) - ref[size_t(o)]) /
                                  ((std::fabs(ref[size_t(o)]) + rms) / 128));
    r.check = worst <= 1.0 ? "ok" : "CHECK-FAILED";
  }
  r.hit = hit;
  const double routing_bytes = g_given ? double(T * L.k) * 8 : double(L.e * L.d) * 2;
  r.bytes = hit * expert_bytes + routing_bytes + 2.0 * double(T * L.d) * 2;
  r.floor_us = r.bytes / bw * 1e6;
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int c = 0; c < copies; ++c) {
    a.x.data = dx[size_t(c)], a.w1.data = dw1[size_t(c)], a.w2.data = dw2[size_t(c)];
    if (g_fp8) a.w1_scale.data = ds1[size_t(c)], a.w2_scale.data = ds2[size_t(c)];
    if (g_given)
      a.topk_ids = static_cast<const int32_t*>(dids[size_t(c)]),
      a.topk_weights = static_cast<const float*>(dwts[size_t(c)]);
    FK(call());
  }
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ge;
  CK(cudaGraphInstantiateWithFlags(&ge, g, 0));
  CK(cudaGraphDestroy(g));
  r.us = graph_us_per_call(ge, s, copies, reps);
  int32_t errors = 0;
  FK(fmlp_moe_device_errors(ws, wsb, s, &errors));
  if (errors != 0) r.check = "DEVICE-ERRORS";
  CK(cudaGraphExecDestroy(ge));
  release();
  CK(cudaFree(ws));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json = "moe.json", ts = "1,4,16,64,512";
  int reps = 30;
  bool det = false;
  const char* kernel = nullptr;
  std::string layers = "mixtral,e64k8";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--reps" && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (a == "--ts" && i + 1 < argc)
      ts = argv[++i];
    else if (a == "--deterministic")
      det = true;
    else if (a == "--kernel" && i + 1 < argc)
      kernel = argv[++i];
    else if (a == "--layers" && i + 1 < argc)
      layers = argv[++i];
    else if (a == "--wdtype" && i + 1 < argc) {
      fmlp_dtype_t wt = FMLP_DTYPE_BF16;
      if (!fmlp_bench::parse_wdtype(argv[++i], &wt)) return 1;
      g_fp8 = wt == FMLP_DTYPE_F8_E4M3;
    } else if (a == "--given") {
      g_given = true;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 1;
    }
  }
  std::vector<int64_t> tv;
  if (!fmlp_bench::parse_positive_list(ts.c_str(), &tv)) {
    std::fprintf(stderr, "--ts %s: expected positive integers separated by commas\n", ts.c_str());
    return 1;
  }
  if (!fmlp_bench::check_names("--layers", layers, kLayers)) return 1;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double bw = copy_bandwidth();
  std::printf("%s, copy %.3f TB/s, L2 %d MB, deterministic %d, experts %s\n", prop.name, bw * 1e-12,
              prop.l2CacheSize >> 20, det ? 1 : 0, g_fp8 ? "f8_e4m3" : "bf16");
  std::vector<Row> rows;
  for (const Layer& L : kLayers)
    for (int64_t T : tv) {
      if (!fmlp_bench::in_list(layers, L.name)) continue;
      const Row r = bench(L, T, size_t(prop.l2CacheSize), bw, s, reps, det, kernel);
      if (r.us <= 0) continue;  // the named kernel does not take the case
      rows.push_back(r);
      std::printf(
          "%-8s T=%-4lld experts hit %6.2f  %9.2f us  floor %8.2f us  %5.1f%% of floor  "
          "%7.1f GB/s  %6.1f TFLOP/s  %s  %s\n",
          r.layer.c_str(), (long long)r.t, r.hit, r.us, r.floor_us, 100 * r.floor_us / r.us,
          r.bytes / r.us * 1e-3, r.tflops(), r.check.c_str(), r.kernel.c_str());
      std::fflush(stdout);
    }
  FILE* f = std::fopen(json.c_str(), "w");
  if (!f) return 1;
  std::fprintf(f,
               "{\"gpu\": \"%s\", \"copy_TBps\": %.4f, \"deterministic\": %d, \"wdtype\": "
               "\"%s\", \"rows\": [\n",
               prop.name, bw * 1e-12, det ? 1 : 0, g_fp8 ? "f8_e4m3" : "bf16");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f,
                 "  {\"layer\": \"%s\", \"T\": %lld, \"us\": %.3f, \"floor_us\": %.3f, "
                 "\"pct_of_floor\": %.1f, \"experts_hit\": %.3f, \"bytes\": %.0f, \"GBps\": %.1f, "
                 "\"TFLOPs\": %.2f, \"check\": \"%s\", \"kernel\": \"%s\"}%s\n",
                 r.layer.c_str(), (long long)r.t, r.us, r.floor_us, 100 * r.floor_us / r.us, r.hit,
                 r.bytes, r.bytes / r.us * 1e-3, r.tflops(), r.check.c_str(), r.kernel.c_str(),
                 i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  return 0;
}
