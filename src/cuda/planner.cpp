// Crossover table and planner for the CUDA backend (see planner.hpp).
#include "cuda/planner.hpp"

#include <cstring>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/mlp_prefill.cuh"

namespace fmlp::detail {
namespace {

// Measured on an H200 (bench/mlp_cuda_bench_prefill, commit of bench/results/cuda_prefill_h200.*):
// the cuBLASLt path is the fastest of our paths from M = 1 for every shape whose weights are
// tens of MB or more; only gpt2-small at M = 1 is faster on the one-launch register-stream decode
// kernel (11.4 us against 12.6). The bench prints rows in this format to refill the table.
// 16-bit rows serve bf16 and fp16 alike: the paths read the same bytes and do the same math.
constexpr CrossoverEntry kTable[] = {
    // {d_in, hidden, gated, dtype, crossover M, source}
    {768, 3072, false, FMLP_DTYPE_BF16, 2, "measured on NVIDIA H200 (sm_90)"},
    {4096, 4096, false, FMLP_DTYPE_BF16, 1, "measured on NVIDIA H200 (sm_90)"},
    {4096, 14336, true, FMLP_DTYPE_BF16, 1, "measured on NVIDIA H200 (sm_90)"},
    {8192, 28672, true, FMLP_DTYPE_BF16, 1, "measured on NVIDIA H200 (sm_90)"},
};
// Shapes never measured: by weight bytes, the one thing the measured crossovers track.
constexpr int64_t kSmallWeightBytes = int64_t(16) << 20;
constexpr CrossoverEntry kDefaultSmall{
    0,     0,
    false, FMLP_DTYPE_INVALID,
    2,     "default for weights under 16 MiB: decode kernels at M = 1, as measured for gpt2-small"};
constexpr CrossoverEntry kDefaultLarge{
    0,     0,
    false, FMLP_DTYPE_INVALID,
    1,     "default for weights of 16 MiB or more: the cuBLASLt path, as measured for 4096 and up"};

fmlp_dtype_t table_dtype(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F16 ? FMLP_DTYPE_BF16 : t;
}

const MlpKernel* find(const char* name) {
  const MlpKernelList l = cuda_mlp_kernels();
  for (size_t i = 0; i < l.count; ++i)
    if (std::strcmp(l.kernels[i].name, name) == 0) return &l.kernels[i];
  return nullptr;
}

std::string shape_text(const MlpDesc& d) {
  return fmt::format("d_in={} hidden={} {} {}", d.d_in, d.hidden, d.gated ? "gated" : "dense",
                     fmlp_dtype_name(d.act_dtype));
}

}  // namespace

const CrossoverEntry& cuda_crossover(const MlpDesc& d) {
  for (const CrossoverEntry& e : kTable)
    if (e.d_in == d.d_in && e.hidden == d.hidden && e.gated == d.gated &&
        e.dtype == table_dtype(d.act_dtype) && d.w_dtype == d.act_dtype)
      return e;
  const int64_t rows1 = d.gated ? 2 * d.hidden : d.hidden;
  const int64_t bytes =
      (rows1 * d.d_in + d.d_out * d.hidden) * int64_t(fmlp::dtype_size(d.w_dtype));
  return bytes < kSmallWeightBytes ? kDefaultSmall : kDefaultLarge;
}

const MlpKernel* cuda_plan(const MlpDesc& d, std::string* reason) {
  const CrossoverEntry& c = cuda_crossover(d);
  const MlpKernel* prefill = find(kPrefillKernelName);
  std::string why;
  if (d.m >= c.m && prefill != nullptr) {
    if (prefill->supports(d, &why)) {
      if (reason)
        *reason = fmt::format("M={} >= crossover {} ({}) for {}: prefill path", d.m, c.m, c.source,
                              shape_text(d));
      return prefill;
    }
  }
  // Below the crossover (or when the prefill path cannot run it): table order, decode first.
  const MlpKernelList l = cuda_mlp_kernels();
  for (size_t i = 0; i < l.count; ++i) {
    const MlpKernel& k = l.kernels[i];
    if (&k == prefill && d.m >= c.m) continue;  // already asked
    if (!k.supports(d, &why)) continue;
    if (reason)
      *reason = d.m >= c.m ? fmt::format(
                                 "M={} >= crossover {} ({}) for {}, but {} cannot run it; "
                                 "first supporting entry",
                                 d.m, c.m, c.source, shape_text(d), kPrefillKernelName)
                           : fmt::format("M={} < crossover {} ({}) for {}: decode kernels first",
                                         d.m, c.m, c.source, shape_text(d));
    return &k;
  }
  if (reason) *reason = "no CUDA kernel handles the request";
  return nullptr;
}

}  // namespace fmlp::detail
