// What the machine is: CPU model, ISA flags, last-level cache, memory read bandwidth.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace fmlp_cli {

std::string cpu_model();

struct IsaFlag {
  const char* name;
  bool present;
};
// The flags the kernels care about (avx2, fma, f16c, avx512f); empty off x86.
std::vector<IsaFlag> isa_flags();

struct CacheInfo {
  size_t bytes = 0;
  std::string source;  // where the size came from
};
// Last-level cache: the larger of what /sys and sysconf report (they can disagree), else a guess.
CacheInfo last_level_cache();

struct Bandwidth {
  double gbps = 0.0;  // best pass, 1e9 bytes per second
  size_t buffer_bytes = 0;
  int passes = 0;
  int threads = 0;
};
// Multithreaded streaming read of a buffer of `bytes` (touched first so page faults are excluded).
Bandwidth measure_read_bandwidth(size_t bytes, int passes);

std::string utc_timestamp();  // ISO 8601
std::string git_commit();     // FMLP_GIT_COMMIT at run time, else the one seen at configure time

}  // namespace fmlp_cli
