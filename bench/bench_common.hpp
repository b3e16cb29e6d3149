// What every device benchmark of the project shares: fail-fast checks, the median, and the copy
// floor, measured one way everywhere so the "% of floor" columns compare.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
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

// The options every one-process-per-GPU bench takes (examples/tp_*.cpp).
struct RankOptions {
  int rank = -1, size = 0, device = -1, reps = 100;
  uint64_t seed = 1234;
  std::string id_file, json;
  // Takes option `a` with value `v` when it is one of these; false otherwise.
  bool take(const std::string& a, const char* v) {
    if (a == "--rank")
      rank = std::atoi(v);
    else if (a == "--size")
      size = std::atoi(v);
    else if (a == "--device")
      device = std::atoi(v);
    else if (a == "--reps")
      reps = std::max(5, std::atoi(v));
    else if (a == "--seed")
      seed = std::strtoull(v, nullptr, 10);
    else if (a == "--id-file")
      id_file = v;
    else if (a == "--json")
      json = v;
    else
      return false;
    return true;
  }
  // "" when rank, size and the id file are usable (device defaults to rank), else why not.
  const char* finish() {
    if (size < 1 || rank < 0 || rank >= size || id_file.empty())
      return "--rank, --size and --id-file are required (0 <= rank < size)";
    if (device < 0) device = rank;
    return "";
  }
  // argv as "--option value" pairs: these options, then extra(option, value) for the bench's own
  // (false: unknown); usage(why) is called (and must not return) on anything wrong.
  template <typename EXTRA, typename USAGE>
  void parse(int argc, char** argv, EXTRA extra, USAGE usage) {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      const char* v = argv[++i];
      if (!take(a, v) && !extra(a, v)) usage(("unknown option " + a).c_str());
    }
    if (const char* why = finish(); *why) usage(why);
  }
};

// NVLink SHARP / multicast stays off on these machines: NCCL_NVLS_ENABLE=0, with a note when the
// environment asked otherwise.
inline void nccl_nvls_off() {
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  if (nvls != nullptr && std::strcmp(nvls, "0") != 0)
    std::fprintf(stderr, "NCCL_NVLS_ENABLE=%s overridden to 0 (NVLink SHARP stays off)\n", nvls);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
}

// "a,b,c" as integers in [lo, hi] into *out; false on anything else (empty items, out of range,
// junk).
inline bool parse_int_list(const char* v, int64_t lo, int64_t hi, std::vector<int64_t>* out) {
  out->clear();
  for (const char* p = v; *p;) {
    char* end = nullptr;
    const long long n = std::strtoll(p, &end, 10);
    if (end == p || n < lo || n > hi || (*end != ',' && *end != '\0')) return false;
    out->push_back(n);
    p = *end == ',' ? end + 1 : end;
  }
  return !out->empty();
}

// "a,b,c" as positive integers into *out; false on anything else (empty items, zero, junk).
inline bool parse_positive_list(const char* v, std::vector<int64_t>* out) {
  return parse_int_list(v, 1, INT64_MAX, out);
}

// --wdtype's value: bf16 or f8 (e4m3) weights; anything else is refused on stderr (false).
inline bool parse_wdtype(const std::string& v, fmlp_dtype_t* out) {
  if (v != "bf16" && v != "f8") {
    std::fprintf(stderr, "--wdtype %s: expected bf16 or f8\n", v.c_str());
    return false;
  }
  *out = v == "f8" ? FMLP_DTYPE_F8_E4M3 : FMLP_DTYPE_BF16;
  return true;
}

// Whether `name` is an item of the comma-separated `list`.
inline bool in_list(const std::string& list, const char* name) {
  return ("," + list + ",").find("," + std::string(name) + ",") != std::string::npos;
}

// Whether every item of the comma-separated `list` names one of `items` (anything with a .name);
// if not, says which on stderr and returns false: a typo in --shapes would bench nothing.
template <typename ITEMS>
bool check_names(const char* flag, const std::string& list, const ITEMS& items) {
  for (size_t b = 0; b <= list.size();) {
    const size_t e = std::min(list.find(',', b), list.size());
    const std::string item = list.substr(b, e - b);
    bool known = false;
    for (const auto& it : items) known = known || item == it.name;
    if (!known) {
      std::string names;
      for (const auto& it : items) names += (names.empty() ? "" : ", ") + std::string(it.name);
      std::fprintf(stderr, "%s: no entry '%s' (expected one of %s)\n", flag, item.c_str(),
                   names.c_str());
      return false;
    }
    b = e + 1;
  }
  return true;
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

// Per-call microseconds of graph `ge` holding `calls` calls: `reps` launches queued back to back,
// each bracketed by its own events (so no host, or other rank's host, stalls the GPU between
// them), after 5 untimed launches; median over launches.
inline double graph_us_bracketed(cudaGraphExec_t ge, cudaStream_t s, int reps, int calls = 1) {
  for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ge, s));
  std::vector<cudaEvent_t> ev(size_t(reps) + 1);
  for (cudaEvent_t& e : ev) CK(cudaEventCreate(&e));
  CK(cudaEventRecord(ev[0], s));
  for (int i = 0; i < reps; ++i) {
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(ev[size_t(i) + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev[size_t(i)], ev[size_t(i) + 1]));
    t.push_back(double(ms) * 1e3 / calls);
  }
  for (cudaEvent_t& e : ev) CK(cudaEventDestroy(e));
  return median(t);
}

// A copy of 16-bit host values in fresh device memory (at least 256 bytes).
inline void* upload_u16(const std::vector<uint16_t>& h) {
  void* d = nullptr;
  CK(cudaMalloc(&d, std::max<size_t>(h.size() * 2, 256)));
  CK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return d;
}

// A contiguous [rows, cols] bf16 view of device memory on `device`.
inline fmlp_tensor_t device_bf16_2d(void* p, int64_t rows, int64_t cols, int device) {
  fmlp_tensor_t t = fmlp_tensor_2d(p, FMLP_DTYPE_BF16, rows, cols, cols);
  t.device_type = FMLP_DEVICE_CUDA;
  t.device_id = device;
  return t;
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

// The entry the default cuda dispatch runs for `args`: the "chosen" line of an fmlp_*_explain
// report (the planner's pick, which need not be the first entry of the table that takes it).
// The report is read whole: the chosen line may follow many rejected entries.
template <typename ARGS, typename EXPLAIN>
std::string chosen_kernel(EXPLAIN explain, const ARGS& args) {
  size_t need = 0;
  if (explain(&args, FMLP_BACKEND_CUDA, nullptr, 0, &need) != FMLP_SUCCESS) return "?";
  std::vector<char> buf(need + 1);
  if (explain(&args, FMLP_BACKEND_CUDA, buf.data(), buf.size(), &need) != FMLP_SUCCESS) return "?";
  const char* p = std::strstr(buf.data(), "chosen");
  if (p == nullptr) return "none";
  p += 6;
  while (*p == ' ') ++p;
  return std::string(p, p + std::strcspn(p, " \n"));
}

}  // namespace fmlp_bench
