// Choice table and planner of the CUDA linear entries (see linear_planner.hpp).
#include "cuda/linear_planner.hpp"

#include <cstdlib>
#include <cstring>

#include "core/error.hpp"

namespace fmlp::detail {
namespace {

constexpr const char* kGemv = "linear_sm80_gemv";
constexpr const char* kLt = "linear_sm90_cublaslt";

// M = 1, 16-bit weights. Provisional until the next device run: the shapes where cuBLAS (torch)
// beat the split-K GEMV in bench/results/ops_h200.json (commit 69d7937) go to cuBLASLt, whose
// M = 4 times there were below the GEMV's M = 1 times. bench/linear_cuda_bench times both
// entries at M = 1 and prints the rows that replace these.
constexpr LinearChoice kTable[] = {
    // {n, k, w dtype, entry at M = 1, source}
    {4096, 4096, FMLP_DTYPE_BF16, kLt, "provisional (torch beat the GEMV on H200)"},
    {4096, 14336, FMLP_DTYPE_BF16, kLt, "provisional (torch beat the GEMV on H200)"},
    {1024, 8192, FMLP_DTYPE_BF16, kLt, "provisional (torch beat the GEMV on H200)"},
    {3584, 3584, FMLP_DTYPE_BF16, kLt, "provisional (torch beat the GEMV on H200)"},
    {3584, 18944, FMLP_DTYPE_BF16, kLt, "provisional (torch beat the GEMV on H200)"},
    {4864, 896, FMLP_DTYPE_BF16, kLt, "provisional (torch beat the GEMV on H200)"},
    {151936, 896, FMLP_DTYPE_BF16, kLt, "provisional (torch beat the GEMV on H200)"},
};
// Shapes never measured: tall-and-narrow weights of 16 MiB or more (N <= 4096) went to cuBLAS in
// every measurement; wide ones (large N) and small ones to the GEMV.
constexpr int64_t kLtMinBytes = int64_t(16) << 20;
constexpr int64_t kLtMaxN = 4096;

fmlp_dtype_t table_dtype(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F16 ? FMLP_DTYPE_BF16 : t;
}

const LinearKernel* find(const char* name) {
  const LinearKernelList l = cuda_linear_kernels();
  for (size_t i = 0; i < l.count; ++i)
    if (std::strcmp(l.kernels[i].name, name) == 0) return &l.kernels[i];
  return nullptr;
}

// The M = 1 choice between the GEMV and cuBLASLt for 16-bit weights, or nullptr.
const LinearKernel* m1_choice(const LinearDesc& d, std::string* reason) {
  const LinearKernel* gemv = find(kGemv);
  const LinearKernel* lt = find(kLt);
  std::string why;
  if (d.m != 1 || !gemv || !lt || !gemv->supports(d, &why) || !lt->supports(d, &why))
    return nullptr;
  for (const LinearChoice& e : kTable)
    if (e.n == d.n && e.k == d.k && e.w == table_dtype(d.w_dtype)) {
      if (reason) *reason = fmt::format("M=1 N={} K={}: {} ({})", d.n, d.k, e.kernel, e.source);
      return find(e.kernel);
    }
  const int64_t bytes = d.n * d.k * 2;
  const bool use_lt = bytes >= kLtMinBytes && d.n <= kLtMaxN;
  if (reason)
    *reason = fmt::format(
        "M=1 N={} K={} not measured: default by weight bytes ({} MiB{}): {}", d.n, d.k, bytes >> 20,
        use_lt ? fmt::format(" >= {}, N <= {}", kLtMinBytes >> 20, kLtMaxN)
               : fmt::format(", cuBLASLt takes >= {} MiB with N <= {}", kLtMinBytes >> 20, kLtMaxN),
        use_lt ? kLt : kGemv);
  return use_lt ? lt : gemv;
}

}  // namespace

const LinearKernel* cuda_linear_plan(const LinearDesc& d, std::string* reason) {
  std::string note, why;
  if (const char* env = std::getenv("FMLP_LINEAR_KERNEL"); env != nullptr && *env != '\0') {
    const LinearKernel* k = find(env);
    if (k != nullptr && k->supports(d, &why)) {
      if (reason) *reason = fmt::format("FMLP_LINEAR_KERNEL={} forces it", env);
      return k;
    }
    note = k == nullptr ? fmt::format(" (FMLP_LINEAR_KERNEL={} ignored: no such CUDA entry)", env)
                        : fmt::format(" (FMLP_LINEAR_KERNEL={} ignored: {})", env, why);
  }
  if (const LinearKernel* k = m1_choice(d, reason)) {
    if (reason) *reason += note;
    return k;
  }
  const LinearKernelList l = cuda_linear_kernels();
  for (size_t i = 0; i < l.count; ++i)
    if (l.kernels[i].supports(d, &why)) {
      if (reason) *reason = "first supporting entry in table order" + note;
      return &l.kernels[i];
    }
  if (reason) *reason = "no CUDA kernel handles the request" + note;
  return nullptr;
}

}  // namespace fmlp::detail
