// Runtime ISA check for the cpu backend: its kernels are compiled for AVX2 + FMA + F16C and must
// never run on a CPU without them.
#include "core/mlp_desc.hpp"

namespace fmlp::detail {

namespace {

std::string probe_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  std::string missing;
  if (!__builtin_cpu_supports("avx2")) missing += " avx2";
  if (!__builtin_cpu_supports("fma")) missing += " fma";
  if (!__builtin_cpu_supports("f16c")) missing += " f16c";
  if (missing.empty()) return {};
  return "this CPU lacks" + missing + "; use backend ref";
#else
  return "the cpu backend needs an x86-64 CPU with AVX2, FMA and F16C; use backend ref";
#endif
}

}  // namespace

const std::string& cpu_unavailable_reason() {
  static const std::string reason = probe_isa();
  return reason;
}

}  // namespace fmlp::detail
