// Choice table and planner of the CUDA linear entries (see linear_planner.hpp).
#include "cuda/linear_planner.hpp"

#include <cstdlib>
#include <cstring>

#include "core/error.hpp"

namespace fmlp::detail {
namespace {

constexpr const char* kGemv = "linear_sm80_gemv";
constexpr const char* kLt = "linear_sm90_cublaslt";

// M = 1, 16-bit weights, measured on an H200 (bench/results/ops_h200.json: fusedmlp_ops_bench
// and bench/peers_ops.py in one session). cuBLASLt (with its bias epilogue) beat torch's F.linear
// on every shape it ran at M = 1 (1.06-1.14x); the GEMV won on tiny weights (launch-bound: up to
// 1.99x) and on wide ones (lm heads, N >= 28672: 85-100 % of the copy rate) and lost on the
// medium shapes in between (0.79-0.99x), which the default below now sends to cuBLASLt.
constexpr const char* kMeasured = "measured on NVIDIA H200 (sm_90)";
constexpr LinearChoice kTable[] = {
    // {n, k, w dtype, entry at M = 1, source}
    {4096, 4096, FMLP_DTYPE_BF16, kLt, kMeasured},     // 13.9 us, torch 15.1
    {4096, 14336, FMLP_DTYPE_BF16, kLt, kMeasured},    // 33.3 us, torch 37.6
    {1024, 8192, FMLP_DTYPE_BF16, kLt, kMeasured},     // 10.1 us, torch 10.7
    {3584, 3584, FMLP_DTYPE_BF16, kLt, kMeasured},     // 12.2 us, torch 13.2
    {3584, 18944, FMLP_DTYPE_BF16, kLt, kMeasured},    // 39.3 us, torch 43.6
    {4864, 896, FMLP_DTYPE_BF16, kLt, kMeasured},      // 5.1 us, torch 5.8
    {151936, 896, FMLP_DTYPE_BF16, kLt, kMeasured},    // 69.5 us, torch 77.6
    {28672, 4096, FMLP_DTYPE_BF16, kGemv, kMeasured},  // 65.9 us, torch 69.0
    {3072, 768, FMLP_DTYPE_BF16, kGemv, kMeasured},    // 4.8 us, torch 5.0
    {768, 3072, FMLP_DTYPE_BF16, kGemv, kMeasured},    // 7.0 us, torch 7.8
};
// Shapes not in the table: the GEMV below 6 MiB of weights (one launch, no epilogue pass: the
// tiny projections) and for N >= 28672 (wide outputs keep every SM streaming), cuBLASLt between.
constexpr int64_t kLtMinBytes = int64_t(6) << 20;
constexpr int64_t kGemvMinN = 28672;

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
  const bool use_lt = bytes >= kLtMinBytes && d.n < kGemvMinN;
  if (reason)
    *reason = fmt::format(
        "M=1 N={} K={} not measured: default by shape ({} MiB of weights; cuBLASLt takes >= {} MiB "
        "with N < {}): {}",
        d.n, d.k, bytes >> 20, kLtMinBytes >> 20, kGemvMinN, use_lt ? kLt : kGemv);
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
