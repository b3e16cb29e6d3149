// fusedmlp_cuda_bench_prefill: the cuda mlp kernels from one token to a long prompt, to place the
// planner's crossover between the decode kernels and the cuBLASLt prefill path.
//
// For each model shape (bf16 activations; bf16 weights, or with --wdtype f8 e4m3 weights with
// per-row scales from fmlp_quantize_fp8, which the prefill path runs as W8A8) and M in 1..8192,
// every CUDA op-table entry that supports the request is checked (rows 0 and M-1 against a host
// double reference, relative to the row rms) and timed: CUDA-graph replay of one call per weight
// copy, the copies rotated through > 3x the L2 (at large M the GEMMs are compute bound, so one copy
// is enough once the weights exceed it), median of the replays. Reported: us per call and per
// token, TFLOP/s, % of the bf16 matmul rate this GPU reaches in the same run (cuBLASLt, 8192^3;
// e4m3 x e4m3 -> bf16 with --wdtype f8), the kernel dispatch picks (the planner, read from
// fmlp_mlp_explain) and the fastest. It ends with crossover rows to paste into
// src/cuda/mlp/planner.cpp.
//
// usage: fusedmlp_cuda_bench_prefill [--json FILE] [--shapes a,b] [--ms 1,2,...] [--kernels a,b]
//                                    [--wdtype bf16|f8]
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_cublaslt.hpp"
#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.h"

namespace {

using fmlp_bench::chosen_kernel;
using fmlp_bench::median;

struct Shape {
  const char* name;
  int64_t d, h;
  fmlp_activation_t act;
  bool gated;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  for (size_t p = 0; p <= s.size();) {
    const size_t c = std::min(s.find(',', p), s.size());
    if (c > p) out.push_back(s.substr(p, c - p));
    p = c + 1;
  }
  return out;
}

// Uniform values of the given rms in bf16 (xorshift: fast enough for gigabytes of weights).
std::vector<uint16_t> random_bf16(size_t n, float rms, uint64_t seed) {
  std::vector<uint16_t> v(n);
  uint64_t z = seed * 0x9E3779B97F4A7C15ull | 1;
  const float k = rms * 3.4641016f / 4294967296.f;
  for (size_t i = 0; i < n; ++i) {
    z ^= z << 13;
    z ^= z >> 7;
    z ^= z << 17;
    v[i] = fmlp::float_to_bf16((float(uint32_t(z >> 32)) - 2147483648.f) * k);
  }
  return v;
}

template <typename E>
void* upload(const std::vector<E>& h) {
  void* d = nullptr;
  CK(cudaMalloc(&d, h.size() * sizeof(E)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(E), cudaMemcpyHostToDevice));
  return d;
}

// w (bf16 [rows, cols]) as e4m3 codes and per-row scales (fmlp_quantize_fp8, as served); *deq gets
// the dequantised values, which the reference uses (the spec dequantises exactly).
void quantize(const std::vector<uint16_t>& w, int64_t rows, int64_t cols, std::vector<uint8_t>* q,
              std::vector<float>* scale, std::vector<float>* deq) {
  std::vector<float> wf(w.size());
  for (size_t i = 0; i < w.size(); ++i) wf[i] = fmlp::bf16_to_float(w[i]);
  q->resize(w.size());
  scale->resize(size_t(rows));
  const fmlp_tensor_t wv = fmlp_tensor_2d(wf.data(), FMLP_DTYPE_F32, rows, cols, cols);
  const fmlp_tensor_t qv = fmlp_tensor_2d(q->data(), FMLP_DTYPE_F8_E4M3, rows, cols, cols);
  const fmlp_tensor_t sv = fmlp_tensor_1d(scale->data(), FMLP_DTYPE_F32, rows);
  if (fmlp_quantize_fp8(&wv, &qv, &sv, nullptr) != FMLP_SUCCESS) {
    std::fprintf(stderr, "fmlp_quantize_fp8: %s\n", fmlp_last_error());
    std::exit(2);
  }
  deq->resize(w.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = size_t(r * cols + c);
      (*deq)[i] = fmlp::f8e4m3_to_float((*q)[i]) * (*scale)[size_t(r)];
    }
}

double act_ref(fmlp_activation_t a, double x) {
  switch (a) {
    case FMLP_ACT_RELU: return x > 0 ? x : 0;
    case FMLP_ACT_GELU: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case FMLP_ACT_GELU_TANH:
      return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    default: return x / (1 + std::exp(-x));
  }
}

// The tensors of one shape: host copies for the reference, `copies` device copies of the weights.
struct Model {
  Shape s;
  fmlp_dtype_t wt;  // bf16 or f8_e4m3 (per-row scales)
  int64_t rows1;
  std::vector<uint16_t> b1, b2, x;
  std::vector<float> r1, r2;  // the weights as the reference reads them (dequantised for fp8)
  std::vector<void*> dw1, dw2, db1, db2, ds1, ds2;
  void *dx = nullptr, *dy = nullptr;
  std::vector<std::vector<double>> ref;  // host reference rows, computed on demand

  Model(const Shape& sh, fmlp_dtype_t w_dtype, int64_t max_m, int copies)
      : s(sh), wt(w_dtype), rows1(sh.gated ? 2 * sh.h : sh.h) {
    const std::vector<uint16_t> w1 =
        random_bf16(size_t(rows1 * s.d), 1.f / std::sqrt(float(s.d)), 1);
    const std::vector<uint16_t> w2 = random_bf16(size_t(s.d * s.h), 1.f / std::sqrt(float(s.h)), 2);
    std::vector<uint8_t> q1, q2;
    std::vector<float> s1, s2;
    if (wt == FMLP_DTYPE_F8_E4M3) {
      quantize(w1, rows1, s.d, &q1, &s1, &r1);
      quantize(w2, s.d, s.h, &q2, &s2, &r2);
    } else {
      for (auto [src, dst] : {std::pair{&w1, &r1}, std::pair{&w2, &r2}}) {
        dst->resize(src->size());
        for (size_t i = 0; i < src->size(); ++i) (*dst)[i] = fmlp::bf16_to_float((*src)[i]);
      }
    }
    if (!s.gated) {
      b1 = random_bf16(size_t(rows1), 0.3f, 3);
      b2 = random_bf16(size_t(s.d), 0.3f, 4);
    }
    x = random_bf16(size_t(max_m * s.d), 1.f, 5);
    for (int i = 0; i < copies; ++i) {
      if (wt == FMLP_DTYPE_F8_E4M3) {
        dw1.push_back(upload(q1)), dw2.push_back(upload(q2));
        ds1.push_back(upload(s1)), ds2.push_back(upload(s2));
      } else {
        dw1.push_back(upload(w1)), dw2.push_back(upload(w2));
      }
      if (!s.gated) db1.push_back(upload(b1)), db2.push_back(upload(b2));
    }
    dx = upload(x);
    CK(cudaMalloc(&dy, size_t(max_m * s.d) * 2));
    ref.resize(size_t(max_m));
  }
  ~Model() {
    for (auto* v : {&dw1, &dw2, &db1, &db2, &ds1, &ds2})
      for (void* p : *v) cudaFree(p);
    cudaFree(dx);
    cudaFree(dy);
  }
  fmlp_mlp_args_t args(int64_t m, int copy) const {
    auto t2 = [](void* p, int64_t r, int64_t c, fmlp_dtype_t t_ = FMLP_DTYPE_BF16) {
      fmlp_tensor_t t = fmlp_tensor_2d(p, t_, r, c, c);
      t.device_type = FMLP_DEVICE_CUDA;
      return t;
    };
    auto t1 = [](void* p, int64_t n, fmlp_dtype_t t_ = FMLP_DTYPE_BF16) {
      fmlp_tensor_t t = fmlp_tensor_1d(p, t_, n);
      t.device_type = FMLP_DEVICE_CUDA;
      return t;
    };
    fmlp_mlp_args_t a{};
    a.x = t2(dx, m, s.d);
    a.y = t2(dy, m, s.d);
    a.residual = fmlp_tensor_none();
    fmlp_mlp_weights_t& w = a.weights;
    for (fmlp_tensor_t* t : {&w.w1_scale, &w.b1, &w.w_up, &w.w_up_scale, &w.b_up, &w.w2_scale,
                             &w.b2, &w.norm_weight, &w.norm_bias})
      *t = fmlp_tensor_none();
    w.w1 = t2(dw1[size_t(copy)], rows1, s.d, wt);
    w.w2 = t2(dw2[size_t(copy)], s.d, s.h, wt);
    if (wt == FMLP_DTYPE_F8_E4M3) {
      w.w1_scale = t1(ds1[size_t(copy)], rows1, FMLP_DTYPE_F32);
      w.w2_scale = t1(ds2[size_t(copy)], s.d, FMLP_DTYPE_F32);
    }
    if (!s.gated) w.b1 = t1(db1[size_t(copy)], rows1), w.b2 = t1(db2[size_t(copy)], s.d);
    a.config = fmlp_mlp_config_default();
    a.config.activation = s.act;
    a.config.gated = s.gated;
    return a;
  }
  const std::vector<double>& ref_row(int64_t r) {
    std::vector<double>& y = ref[size_t(r)];
    if (!y.empty()) return y;
    std::vector<double> xr(size_t(s.d)), h(size_t(s.h));
    for (int64_t k = 0; k < s.d; ++k) xr[size_t(k)] = fmlp::bf16_to_float(x[size_t(r * s.d + k)]);
    auto dot = [&](const std::vector<float>& w, int64_t row, int64_t n, const double* v) {
      double acc = 0;
      for (int64_t k = 0; k < n; ++k) acc += double(w[size_t(row * n + k)]) * v[k];
      return acc;
    };
    for (int64_t j = 0; j < s.h; ++j) {
      const double g = dot(r1, j, s.d, xr.data()) + (b1.empty() ? 0 : fmlp::bf16_to_float(b1[j]));
      h[size_t(j)] = act_ref(s.act, g) * (s.gated ? dot(r1, s.h + j, s.d, xr.data()) : 1.0);
    }
    y.resize(size_t(s.d));
    for (int64_t o = 0; o < s.d; ++o)
      y[size_t(o)] = dot(r2, o, s.h, h.data()) + (b2.empty() ? 0 : fmlp::bf16_to_float(b2[o]));
    return y;
  }
  // Worst |y - ref| over rows {0, m-1}, relative to each row's rms.
  double check(int64_t m) {
    double worst = 0;
    for (const int64_t r : {int64_t(0), m - 1}) {
      std::vector<uint16_t> out(size_t(s.d));
      CK(cudaMemcpy(out.data(), static_cast<char*>(dy) + r * s.d * 2, out.size() * 2,
                    cudaMemcpyDeviceToHost));
      const std::vector<double>& y = ref_row(r);
      double rms = 0, err = 0;
      for (int64_t o = 0; o < s.d; ++o) {
        rms += y[size_t(o)] * y[size_t(o)];
        const double e = std::fabs(fmlp::bf16_to_float(out[size_t(o)]) - y[size_t(o)]);
        err = std::isfinite(e) ? std::max(err, e) : INFINITY;
      }
      worst = std::max(worst, err / std::sqrt(rms / double(s.d)));
    }
    return worst;
  }
};

// GEMM rate of this GPU through cuBLASLt (n^3, fp32 accumulation), TFLOP/s: bf16 in and out, or
// (fp8) e4m3 in (unit scales) and bf16 out, the GEMMs of the W8A8 path.
double matmul_rate(int64_t n, bool fp8) {
  cublasLtHandle_t h;
  LK(cublasLtCreate(&h));
  void *a, *b, *c, *ws;
  const size_t bytes = size_t(n * n) * 2, ws_bytes = size_t(32) << 20;
  for (void** p : {&a, &b, &c}) CK(cudaMalloc(p, bytes));
  CK(cudaMalloc(&ws, ws_bytes));
  std::vector<uint16_t> init = random_bf16(size_t(n * n), 1.f, 9);
  if (fp8)  // two e4m3 codes per 16 bits; clearing bit 3 of each leaves no NaN code (0x7f, 0xff)
    for (uint16_t& v : init) v = uint16_t(v & 0xF7F7u);
  CK(cudaMemcpy(a, init.data(), bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(b, init.data(), bytes, cudaMemcpyHostToDevice));
  cublasLtMatmulDesc_t op;
  LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t t = CUBLAS_OP_T;
  LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
  cublasLtMatrixLayout_t l, lab;
  LK(cublasLtMatrixLayoutCreate(&l, CUDA_R_16BF, uint64_t(n), uint64_t(n), n));
  LK(cublasLtMatrixLayoutCreate(&lab, fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF, uint64_t(n), uint64_t(n),
                                n));
  cublasLtMatmulPreference_t pref;
  LK(cublasLtMatmulPreferenceCreate(&pref));
  LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                          sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t r{};
  int count = 0;
  LK(cublasLtMatmulAlgoGetHeuristic(h, op, lab, lab, l, l, pref, 1, &r, &count));
  if (count == 0) {
    std::fprintf(stderr, "cuBLASLt has no %s algorithm for the %lld^3 rate GEMM\n",
                 fp8 ? "fp8" : "bf16", (long long)n);
    std::exit(2);
  }
  const float alpha = 1, beta = 0;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> ts;
  for (int i = 0; i < 25; ++i) {
    CK(cudaEventRecord(e0));
    LK(cublasLtMatmul(h, op, &alpha, a, lab, b, lab, &beta, c, l, c, l, &r.algo, ws, ws_bytes, 0));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 5) ts.push_back(ms * 1e-3);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(l);
  cublasLtMatrixLayoutDestroy(lab);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(h);
  for (void* p : {a, b, c, ws}) CK(cudaFree(p));
  return 2.0 * double(n) * double(n) * double(n) / median(ts) * 1e-12;
}

// Median us of one call of `kernel`, by graph replay over the weight copies.
double time_kernel(Model& md, int64_t m, int copies, const char* kernel, cudaStream_t s) {
  std::vector<void*> ws(size_t(copies), nullptr);
  std::vector<size_t> wsb(size_t(copies), 0);
  for (int i = 0; i < copies; ++i) {
    const fmlp_mlp_args_t a = md.args(m, i);
    if (fmlp_mlp_kernel_workspace_size(&a, kernel, &wsb[size_t(i)]) != FMLP_SUCCESS) return -1;
    if (wsb[size_t(i)]) {
      CK(cudaMalloc(&ws[size_t(i)], wsb[size_t(i)]));
      CK(cudaMemset(ws[size_t(i)], 0, wsb[size_t(i)]));
    }
    // Warm call: creates library handles and caches algorithm choices outside the capture.
    if (fmlp_mlp_with_kernel(&a, kernel, ws[size_t(i)], wsb[size_t(i)], s) != FMLP_SUCCESS) {
      std::fprintf(stderr, "%s M=%lld: %s\n", kernel, (long long)m, fmlp_last_error());
      return -1;
    }
  }
  CK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < copies; ++i) {
    const fmlp_mlp_args_t a = md.args(m, i);
    fmlp_mlp_with_kernel(&a, kernel, ws[size_t(i)], wsb[size_t(i)], s);
  }
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> t;
  double spent = 0;
  for (int i = 0; i < 1000 && (i < 7 || spent < 0.5); ++i) {  // >= 5 timed, about 0.5 s each
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    spent += ms * 1e-3;
    if (i >= 2) t.push_back(double(ms) * 1e3 / copies);
  }
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  for (void* p : ws)
    if (p) CK(cudaFree(p));
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  const char* json = nullptr;
  std::string shapes_arg = "gpt2-small,seed-4096,llama3-8b,llama3-70b";
  std::string ms_arg = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192", kernels_arg;
  fmlp_dtype_t wt = FMLP_DTYPE_BF16;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--shapes" && i + 1 < argc)
      shapes_arg = argv[++i];
    else if (a == "--ms" && i + 1 < argc)
      ms_arg = argv[++i];
    else if (a == "--kernels" && i + 1 < argc)
      kernels_arg = argv[++i];
    else if (a == "--wdtype" && i + 1 < argc) {
      if (!fmlp_bench::parse_wdtype(argv[++i], &wt)) return 1;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 1;
    }
  }
  const Shape all[] = {{"gpt2-small", 768, 3072, FMLP_ACT_GELU_TANH, false},
                       {"seed-4096", 4096, 4096, FMLP_ACT_GELU, false},
                       {"llama3-8b", 4096, 14336, FMLP_ACT_SILU, true},
                       {"llama3-70b", 8192, 28672, FMLP_ACT_SILU, true}};
  if (!fmlp_bench::check_names("--shapes", shapes_arg, all)) return 1;
  if (fmlp_backend_available(FMLP_BACKEND_CUDA) != FMLP_SUCCESS) {
    std::printf("cuda backend unavailable: %s\n", fmlp_last_error());
    return 1;
  }
  std::vector<std::string> kernels = split(kernels_arg);
  if (kernels.empty())
    for (int i = 0; i < fmlp_mlp_kernel_count(); ++i)
      if (fmlp_mlp_kernel_backend(i) == FMLP_BACKEND_CUDA)
        kernels.push_back(fmlp_mlp_kernel_name(i));
  std::vector<int64_t> ms;
  if (!fmlp_bench::parse_positive_list(ms_arg.c_str(), &ms)) {
    std::fprintf(stderr, "--ms %s: expected positive integers separated by commas\n",
                 ms_arg.c_str());
    return 1;
  }
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());

  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const bool f8 = wt == FMLP_DTYPE_F8_E4M3;
  // The % of matmul column is against the GEMM rate of the weight dtype (fp8 for the W8A8 path).
  const double peak = matmul_rate(8192, f8);
  std::printf("%s (sm_%d%d), %d SMs, L2 %d MiB, cuBLASLt %s 8192^3: %.1f TFLOP/s\n", prop.name,
              prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize >> 20,
              f8 ? "e4m3->bf16" : "bf16", peak);
  std::string out = "{\"gpu\": \"" + std::string(prop.name) +
                    "\", \"sm\": " + std::to_string(prop.major * 10 + prop.minor) +
                    ", \"wdtype\": \"" + fmlp_dtype_name(wt) +
                    "\", \"matmul_TFLOPs\": " + std::to_string(peak) + ", \"prefill\": [";
  std::string rows_out;
  bool first = true;
  int failures = 0;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("%-11s %5s %-26s %10s %9s %8s %7s %9s %s\n", "shape", "M", "kernel", "us", "us/token",
              "TFLOP/s", "%mm", "rel_err", "planner");
  for (const Shape& sh : all) {
    if (!fmlp_bench::in_list(shapes_arg, sh.name)) continue;
    const double params = double((sh.gated ? 3 : 2) * sh.d * sh.h);
    const double wbytes = params * (f8 ? 1 : 2);
    const int copies = std::max(1, int(std::ceil(3.0 * prop.l2CacheSize / wbytes)));
    Model md(sh, wt, max_m, copies);
    int64_t crossover = -1;  // smallest M from which the prefill path is the fastest
    for (const int64_t m : ms) {
      const double flops = 2.0 * double(m) * params;
      const fmlp_mlp_args_t a0 = md.args(m, 0);
      const std::string pick = chosen_kernel(fmlp_mlp_explain, a0);
      std::string best;
      double best_us = 1e300;
      for (const std::string& k : kernels) {
        if (fmlp_mlp_kernel_supports(&a0, k.c_str()) != FMLP_SUCCESS) continue;
        const double us = time_kernel(md, m, copies, k.c_str(), s);
        if (us < 0) {
          ++failures;
          continue;
        }
        const double err = md.check(m);
        // Sanity bounds (exact tolerances live in tests/): bf16, and W8A8 for the fp8 prefill path
        // (x and h quantised to e4m3: ~2-3 % rms of the row, tests/tolerance.hpp).
        const bool w8a8 = f8 && k.find("prefill") != std::string::npos;
        const bool ok = err < (w8a8 ? 1.0 / 4 : 1.0 / 32);
        failures += !ok;
        if (us < best_us) best_us = us, best = k;
        const double tf = flops / us * 1e-6;
        std::printf("%-11s %5lld %-26s %10.2f %9.3f %8.1f %6.1f%% %9.2e %s%s\n", sh.name,
                    (long long)m, k.c_str(), us, us / double(m), tf, 100 * tf / peak, err,
                    k == pick ? "<- planner" : "", ok ? "" : " CHECK FAILED");
        std::fflush(stdout);
        char row[640];
        std::snprintf(row, sizeof row,
                      "%s{\"shape\": \"%s\", \"d_in\": %lld, \"hidden\": %lld, \"gated\": %s, "
                      "\"M\": %lld, \"kernel\": \"%s\", \"us\": %.3f, \"us_per_token\": %.4f, "
                      "\"TFLOPs\": %.2f, \"pct_of_matmul\": %.2f, \"rel_err\": %.3e, "
                      "\"check_ok\": %s, \"planner_pick\": \"%s\", \"copies\": %d}",
                      first ? "" : ", ", sh.name, (long long)sh.d, (long long)sh.h,
                      sh.gated ? "true" : "false", (long long)m, k.c_str(), us, us / double(m), tf,
                      100 * tf / peak, err, ok ? "true" : "false", pick.c_str(), copies);
        out += row;
        first = false;
      }
      const bool prefill_best = best.find("prefill") != std::string::npos;
      if (prefill_best && crossover < 0) crossover = m;
      if (!prefill_best) crossover = -1;  // must stay fastest for every larger M
      if (!best.empty() && best != pick)
        std::printf("%-11s %5lld fastest is %s, the planner picks %s\n", sh.name, (long long)m,
                    best.c_str(), pick.c_str());
    }
    if (crossover > 0) {
      char row[512];
      std::snprintf(row, sizeof row,
                    "    {%lld, %lld, %s, %s, %lld, \"measured on %s (sm_%d%d)\"},\n",
                    (long long)sh.d, (long long)sh.h, sh.gated ? "true" : "false",
                    f8 ? "FMLP_DTYPE_F8_E4M3" : "FMLP_DTYPE_BF16", (long long)crossover, prop.name,
                    prop.major, prop.minor);
      rows_out += row;
    }
  }
  std::printf("\ncrossover rows for src/cuda/mlp/planner.cpp (kTable):\n%s", rows_out.c_str());
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
