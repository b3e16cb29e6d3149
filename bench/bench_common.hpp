// What every device benchmark of the project shares: fail-fast checks, the median, and the copy
// floor, measured one way everywhere so the "% of floor" columns compare.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.h"

#define CK(call)                                                                                 \
  do {                                                                                           \
    const cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

#define FK(call)                                                                                  \
  do {                                                                                            \
    const fmlp_status_t s_ = (call);                                                              \
    if (s_ != FMLP_SUCCESS) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s: %s\n", __FILE__, __LINE__, #call, fmlp_status_name(s_), \
                   fmlp_last_error());                                                            \
      std::exit(3);                                                                               \
    }                                                                                             \
  } while (0)

namespace fmlp_bench {

// "a,b,c" as positive integers into *out; false on anything else (empty items, zero, junk).
inline bool parse_positive_list(const char* v, std::vector<int64_t>* out) {
  out->clear();
  for (const char* p = v; *p;) {
    char* end = nullptr;
    const long long n = std::strtoll(p, &end, 10);
    if (end == p || n < 1 || (*end != ',' && *end != '\0')) return false;
    out->push_back(n);
    p = *end == ',' ? end + 1 : end;
  }
  return !out->empty();
}

// Counter-based random bf16 values in [-scale, scale): element i depends only on (seed, i), so
// every process of a multi-GPU run holds identical data whatever its thread count.
inline void fill_bf16(std::vector<uint16_t>& v, uint64_t seed, float scale) {
  const size_t n = v.size();
  const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (size_t i = n * t / threads; i < n * (t + 1) / threads; ++i) {
        uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = float(z >> 40) * (1.f / 16777216.f);  // [0, 1)
        v[i] = fmlp::float_to_bf16((2.f * u - 1.f) * scale);
      }
    });
  for (std::thread& th : pool) th.join();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds per call of graph `g`, which holds `calls` calls, over `reps` replays
// timed with CUDA events, after `warmup` untimed replays.
inline double graph_us_per_call(cudaGraphExec_t g, cudaStream_t s, int calls, int reps,
                                int warmup = 3) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < warmup; ++i) CK(cudaGraphLaunch(g, s));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(g, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(1e3 * double(ms) / calls);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return median(t);
}

// Bytes per second of a stream-ordered device-to-device cudaMemcpyAsync of 2 GiB (far beyond the
// L2), read + write counted, median of 20 after 3 warm-ups. Not a graph memcpy node: in a graph
// the copy engines do it, which is slower (2.7 vs 4.2 TB/s on an H200) and would put kernels
// above 100 % of "copy".
inline double copy_bandwidth() {
  const size_t bytes = size_t(2) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < 23; ++i) {
    CK(cudaEventRecord(e0));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 3) t.push_back(ms * 1e-3);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * double(bytes) / median(t);
}

}  // namespace fmlp_bench
