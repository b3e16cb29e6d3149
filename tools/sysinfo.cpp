#include "sysinfo.hpp"

#include <omp.h>
#include <unistd.h>

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
  for (int pass = 0; pass < passes; ++pass) {
    const HostTimer t;
    uint64_t sum = 0;
    // Dynamic chunks of 512 KiB: a thread preempted by another process does not hold up the
    // pass, so the figure is what the available cores can pull, as a kernel's threads would.
#pragma omp parallel for schedule(dynamic, 65536) reduction(+ : sum)
    for (size_t i = 0; i < n; ++i) sum += p[i];
    const double s = t.seconds();
    sink = sink + sum;
    gbps.push_back(double(n * sizeof(uint64_t)) / s * 1e-9);
  }
  return {median(gbps), n * sizeof(uint64_t), passes, omp_get_max_threads()};
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
  if (const char* env = std::getenv("FMLP_GIT_COMMIT"); env && *env) return env;
  return FMLP_CLI_GIT_COMMIT;
}

}  // namespace fmlp_cli
