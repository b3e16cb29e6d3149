#include "sysinfo.hpp"

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>

#include "cli_common.hpp"
#include "host_timer.hpp"

#ifndef FMLP_CLI_GIT_COMMIT
#define FMLP_CLI_GIT_COMMIT ""
#endif

namespace fmlp_cli {
namespace {

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// "32768K" / "1M" / "262144" -> bytes; 0 when unparsable.
size_t parse_size(const std::string& s) {
  size_t used = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(s, &used);
  } catch (const std::exception&) {
    return 0;
  }
  const char unit = used < s.size() ? s[used] : ' ';
  if (unit == 'K') v <<= 10;
  if (unit == 'M') v <<= 20;
  if (unit == 'G') v <<= 30;
  return size_t(v);
}

}  // namespace

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
  }
  return "unknown";
}

std::vector<IsaFlag> isa_flags() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return {{"avx2", bool(__builtin_cpu_supports("avx2"))},
          {"fma", bool(__builtin_cpu_supports("fma"))},
          {"f16c", bool(__builtin_cpu_supports("f16c"))},
          {"avx512f", bool(__builtin_cpu_supports("avx512f"))}};
#else
  return {};
#endif
}

CacheInfo last_level_cache() {
  CacheInfo sys;
  int sys_level = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i);
    const std::string level = read_line(dir + "/level");
    if (level.empty()) break;
    if (read_line(dir + "/type") == "Instruction") continue;
    const int lv = std::atoi(level.c_str());
    const size_t bytes = parse_size(read_line(dir + "/size"));
    if (bytes > 0 && lv >= sys_level) {
      sys_level = lv;
      sys = {bytes, fmt::format("/sys L{}", lv)};
    }
  }
  CacheInfo conf;
#ifdef _SC_LEVEL3_CACHE_SIZE
  if (const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE); l3 > 0)
    conf = {size_t(l3), "sysconf L3"};
  else if (const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE); l2 > 0)
    conf = {size_t(l2), "sysconf L2"};
#endif
  if (sys.bytes == 0 && conf.bytes == 0) return {size_t(32) << 20, "unknown, assumed 32 MiB"};
  if (sys.bytes == 0 || sys.bytes == conf.bytes) return sys.bytes ? sys : conf;
  if (conf.bytes == 0) return sys;
  // They disagree on some AMD parts and VMs (per-CCX vs whole package); the larger one keeps
  // the weight rotation honest: data must not stay cached in any L3 the threads can reach.
  const CacheInfo& big = sys.bytes > conf.bytes ? sys : conf;
  const CacheInfo& small = sys.bytes > conf.bytes ? conf : sys;
  return {big.bytes, fmt::format("{}; {} says {}", big.source, small.source,
                                 format_bytes(double(small.bytes)))};
}

namespace {

// Sum of n words with eight independent accumulators, so a core keeps many cache lines in flight
// (one accumulator chain measures latency, not bandwidth).
uint64_t sum_words(const uint64_t* p, size_t n) {
  uint64_t a[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) a[k] += p[i + k];
  for (; i < n; ++i) a[0] += p[i];
  return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

#if defined(__x86_64__)
// The same with 32-byte loads, as the cpu kernels stream weights; used when the CPU has AVX2.
__attribute__((target("avx2"))) uint64_t sum_words_avx2(const uint64_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_words(p + i, n - i);
}
#endif

uint64_t sum_chunk(const uint64_t* p, size_t n) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return sum_words_avx2(p, n);
#endif
  return sum_words(p, n);
}

}  // namespace

Bandwidth measure_read_bandwidth(size_t bytes, int passes) {
  const size_t n = bytes / sizeof(uint64_t);
  std::unique_ptr<uint64_t, decltype(&std::free)> buf(
      static_cast<uint64_t*>(std::aligned_alloc(64, n * sizeof(uint64_t))), &std::free);
  if (!buf)
    throw CliError(
        fmt::format("cannot allocate {} to measure memory bandwidth; pass a smaller "
                    "--bw-mib",
                    format_bytes(double(bytes))));
  uint64_t* p = buf.get();
  // First touch from the threads that will read, so pages land near them.
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) p[i] = i;
  std::vector<double> gbps;
  volatile uint64_t sink = 0;
  constexpr size_t kChunk = size_t(1) << 17;  // 1 MiB of words per claim
  for (int pass = 0; pass < passes; ++pass) {
    const HostTimer t;
    uint64_t sum = 0;
    // Dynamic 1 MiB chunks: a thread preempted by another process does not hold up the pass, so
    // the figure is what the available cores can pull, as a kernel's threads would.
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : sum)
    for (size_t c = 0; c < (n + kChunk - 1) / kChunk; ++c)
      sum += sum_chunk(p + c * kChunk, std::min(kChunk, n - c * kChunk));
    const double s = t.seconds();
    sink = sink + sum;
    gbps.push_back(double(n * sizeof(uint64_t)) / s * 1e-9);
  }
  // The ceiling is the best pass: slower passes are the machine being busy, not the memory.
  return {*std::max_element(gbps.begin(), gbps.end()), n * sizeof(uint64_t), passes,
          omp_get_max_threads()};
}

std::string utc_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string git_commit() {
  fmlp_knob_info_t k{};
  if (fmlp_knob_info(fmlp_knob_find("FMLP_GIT_COMMIT"), &k) == FMLP_SUCCESS && *k.value)
    return k.value;
  return FMLP_CLI_GIT_COMMIT;
}

}  // namespace fmlp_cli
