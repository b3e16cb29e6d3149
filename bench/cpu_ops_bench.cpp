// Host benchmark of the cpu backend's linear and softmax (Google Benchmark). `fusedmlp bench` times
// the mlp; this times the companions on the shapes of the CUDA ops bench (linear_cuda_bench.cpp).
// Method: weights rotated over at least 1 GiB of copies so every call reads memory (more than 3x
// the last-level cache of the CPUs this runs on), random data (never zeros), each call's wall time
// (the op runs on OpenMP threads), each case checked against the ref backend before it is timed.
// Counters: GB/s of the bytes a call must move and % of the read bandwidth measured at start (the
// floor). Time is the mean of the calls; --benchmark_repetitions=N adds medians.
//
//   fusedmlp_cpu_ops_bench [--benchmark_filter=linear] [--benchmark_format=json] ...
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.h"

namespace {

constexpr size_t kRotateBytes = size_t(1) << 30;

// Counter-based random values in [-1, 1): element i depends only on (seed, i).
float rand_pm1(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(z >> 40) * (2.f / 16777216.f) - 1.f;
}

// Read bandwidth of this machine: the best of five parallel sums over 1 GiB.
double read_bandwidth() {
  static const double bw = [] {
    std::vector<uint64_t> buf(kRotateBytes / 8);
#pragma omp parallel for
    for (int64_t i = 0; i < int64_t(buf.size()); ++i) buf[size_t(i)] = uint64_t(i);
    double best = 0;
    for (int pass = 0; pass < 5; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum)
      for (int64_t i = 0; i < int64_t(buf.size()); ++i) sum += buf[size_t(i)];
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      benchmark::DoNotOptimize(sum);
      best = std::max(best, double(kRotateBytes) / s);
    }
    return best;
  }();
  return bw;
}

// Times the calls of `state`'s loop one by one (the reported time is their mean; medians come
// with --benchmark_repetitions) and adds GB/s and % of the read bandwidth. call(i) makes call i
// and returns false (having set the error) on failure.
template <typename CALL>
void time_calls(benchmark::State& state, double bytes_per_call, CALL call) {
  double seconds = 0;
  int64_t i = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!call(i++)) break;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    seconds += s;
  }
  if (seconds <= 0) return;
  const double rate = bytes_per_call * double(i) / seconds;
  state.counters["GB/s"] = rate * 1e-9;
  state.counters["%floor"] = 100.0 * rate / read_bandwidth();
}

struct LinearShape {
  const char* name;
  int64_t n, k;
};
const LinearShape kLinearShapes[] = {
    {"llama3-8b.up", 14336, 4096}, {"gpt2-s.lm_head", 50257, 768}, {"qwen2.5-0.5b.q", 896, 896}};

// One weight copy ([n, k] of bf16 or e4m3 with per-row scales) with its args for x and y.
struct LinearCopy {
  std::vector<uint8_t> w;
  std::vector<float> scale;
};

fmlp_linear_args_t linear_args(const LinearCopy& c, fmlp_dtype_t wt, int64_t n, int64_t k,
                               int64_t m, float* x, float* y) {
  fmlp_linear_args_t a{};
  a.y = fmlp_tensor_2d(y, FMLP_DTYPE_F32, m, n, n);
  a.x = fmlp_tensor_2d(x, FMLP_DTYPE_F32, m, k, k);
  a.w = fmlp_tensor_2d(const_cast<uint8_t*>(c.w.data()), wt, n, k, k);
  a.w_scale = wt == FMLP_DTYPE_F8_E4M3
                  ? fmlp_tensor_1d(const_cast<float*>(c.scale.data()), FMLP_DTYPE_F32, n)
                  : fmlp_tensor_none();
  a.bias = fmlp_tensor_none();
  a.x_scale = fmlp_tensor_none();
  return a;
}

bool linear_matches_ref(const LinearCopy& c, fmlp_dtype_t wt, int64_t n, int64_t k, int64_t m,
                        std::vector<float>& x, std::string* why) {
  const int64_t rows = std::min<int64_t>(n, 256);  // the first rows of W: enough, and fast in ref
  std::vector<float> y(size_t(m * rows), NAN), y_ref(size_t(m * rows), NAN);
  for (fmlp_backend_t b : {FMLP_BACKEND_CPU, FMLP_BACKEND_REF}) {
    fmlp_linear_args_t a =
        linear_args(c, wt, rows, k, m, x.data(), (b == FMLP_BACKEND_CPU ? y : y_ref).data());
    size_t ws_bytes = 0;
    std::vector<char> ws;
    if (fmlp_linear_workspace_size(&a, b, &ws_bytes) != FMLP_SUCCESS ||
        (ws.resize(ws_bytes), fmlp_linear(&a, b, ws.data(), ws_bytes, nullptr)) != FMLP_SUCCESS)
      return (*why = fmlp_last_error(), false);
  }
  // fp32 accumulation over k terms of |x w| <= |scale| (weights and x within [-1, 1]).
  const double tol = 1e-5 * std::sqrt(double(k)) * (wt == FMLP_DTYPE_F8_E4M3 ? 448.0 / 64 : 1.0);
  for (size_t i = 0; i < y.size(); ++i)
    if (!(std::fabs(double(y[i]) - double(y_ref[i])) <= tol)) {
      *why = "output " + std::to_string(i) + " is " + std::to_string(y[i]) + ", ref " +
             std::to_string(y_ref[i]);
      return false;
    }
  return true;
}

// The weight copies of one shape and dtype, made once for all its M.
const std::vector<LinearCopy>& linear_copies(const LinearShape& sh, fmlp_dtype_t wt) {
  static std::string key;
  static std::vector<LinearCopy> cs;
  if (key == std::string(sh.name) + fmlp_dtype_name(wt)) return cs;
  key = std::string(sh.name) + fmlp_dtype_name(wt);
  const int64_t n = sh.n, k = sh.k;
  const size_t wbytes = size_t(n * k) * (wt == FMLP_DTYPE_F8_E4M3 ? 1 : 2);
  cs.assign(std::min<size_t>(64, (kRotateBytes + wbytes - 1) / wbytes), LinearCopy{});
  for (size_t c = 0; c < cs.size(); ++c) {
    LinearCopy& cp = cs[c];
    cp.w.resize(wbytes);
#pragma omp parallel for
    for (int64_t i = 0; i < n * k; ++i) {
      const float v = rand_pm1(c + 1, uint64_t(i));
      if (wt == FMLP_DTYPE_F8_E4M3) {
        cp.w[size_t(i)] = fmlp::float_to_f8e4m3(v * 448.f);
      } else {
        const uint16_t h = fmlp::float_to_bf16(v);
        std::memcpy(&cp.w[size_t(i) * 2], &h, 2);
      }
    }
    if (wt == FMLP_DTYPE_F8_E4M3) cp.scale.assign(size_t(n), 1.f / 64);
  }
  return cs;
}

void bm_linear(benchmark::State& state, LinearShape sh, fmlp_dtype_t wt) {
  const int64_t m = state.range(0), n = sh.n, k = sh.k;
  const std::vector<LinearCopy>& cs = linear_copies(sh, wt);
  std::vector<float> x(size_t(m * k)), y(size_t(m * n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = rand_pm1(99, i);
  std::string why;
  if (!linear_matches_ref(cs[0], wt, n, k, m, x, &why)) {
    state.SkipWithError(("disagrees with the ref backend: " + why).c_str());
    return;
  }
  size_t ws_bytes = 0;
  fmlp_linear_args_t a = linear_args(cs[0], wt, n, k, m, x.data(), y.data());
  fmlp_linear_workspace_size(&a, FMLP_BACKEND_CPU, &ws_bytes);
  std::vector<char> ws(ws_bytes);
  time_calls(state, double(cs[0].w.size()) + double(m * (k + n)) * 4.0, [&](int64_t i) {
    a = linear_args(cs[size_t(i) % cs.size()], wt, n, k, m, x.data(), y.data());
    if (fmlp_linear(&a, FMLP_BACKEND_CPU, ws.data(), ws_bytes, nullptr) == FMLP_SUCCESS)
      return true;
    state.SkipWithError(fmlp_last_error());
    return false;
  });
}

void bm_softmax(benchmark::State& state) {
  const int64_t rows = state.range(0), n = 128256;
  const int64_t bytes = rows * n * 4;
  const int copies = int(std::min<int64_t>(64, (int64_t(kRotateBytes) + bytes - 1) / bytes));
  std::vector<std::vector<float>> xs(size_t(copies), std::vector<float>(size_t(rows * n)));
  for (int c = 0; c < copies; ++c)
    for (size_t i = 0; i < xs[size_t(c)].size(); ++i) xs[size_t(c)][i] = 8.f * rand_pm1(c + 7, i);
  std::vector<float> y(size_t(rows * n), NAN), y_ref(size_t(n), NAN);
  auto args = [&](float* x, float* out, int64_t r) {
    fmlp_softmax_args_t a{};
    a.x = fmlp_tensor_2d(x, FMLP_DTYPE_F32, r, n, n);
    a.y = fmlp_tensor_2d(out, FMLP_DTYPE_F32, r, n, n);
    a.temperature = 1.f;
    return a;
  };
  size_t ws_bytes = 0;
  fmlp_softmax_args_t a = args(xs[0].data(), y.data(), rows);
  fmlp_softmax_workspace_size(&a, FMLP_BACKEND_CPU, &ws_bytes);
  std::vector<char> ws(ws_bytes);
  fmlp_softmax_args_t r = args(xs[0].data(), y_ref.data(), 1);
  size_t ws_ref = 0;
  fmlp_softmax_workspace_size(&r, FMLP_BACKEND_REF, &ws_ref);
  std::vector<char> wr(ws_ref);
  if (fmlp_softmax(&a, FMLP_BACKEND_CPU, ws.data(), ws_bytes, nullptr) != FMLP_SUCCESS ||
      fmlp_softmax(&r, FMLP_BACKEND_REF, wr.data(), ws_ref, nullptr) != FMLP_SUCCESS) {
    state.SkipWithError(fmlp_last_error());
    return;
  }
  const float mx = *std::max_element(xs[0].begin(), xs[0].begin() + n);
  for (int64_t i = 0; i < n; ++i) {  // row 0, tests/test_softmax.cpp's f32 tolerance
    const float tol = 1e-4f * y_ref[size_t(i)] * (1.f + (mx - xs[0][size_t(i)]));
    if (!(std::fabs(y[size_t(i)] - y_ref[size_t(i)]) <= tol)) {
      state.SkipWithError("disagrees with the ref backend");
      return;
    }
  }
  time_calls(state, 2.0 * double(bytes), [&](int64_t i) {
    a = args(xs[size_t(i) % xs.size()].data(), y.data(), rows);
    if (fmlp_softmax(&a, FMLP_BACKEND_CPU, ws.data(), ws_bytes, nullptr) == FMLP_SUCCESS)
      return true;
    state.SkipWithError(fmlp_last_error());
    return false;
  });
}

}  // namespace

int main(int argc, char** argv) {
  for (const LinearShape& sh : kLinearShapes)
    for (fmlp_dtype_t wt : {FMLP_DTYPE_BF16, FMLP_DTYPE_F8_E4M3}) {
      const std::string name = std::string("linear/") + sh.name + "/" + fmlp_dtype_name(wt);
      benchmark::RegisterBenchmark(name.c_str(), bm_linear, sh, wt)
          ->ArgName("M")
          ->Arg(1)
          ->Arg(4)
          ->Arg(16)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  benchmark::RegisterBenchmark("softmax/128256/f32", bm_softmax)
      ->ArgName("rows")
      ->Arg(1)
      ->Arg(8)
      ->Arg(64)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("read bandwidth %.1f GB/s (best of 5 parallel sums over 1 GiB)\n",
              read_bandwidth() * 1e-9);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
