// Crossover table and planner for the CUDA backend (see planner.hpp).
#include "cuda/planner.hpp"

#include <cstring>

#include "core/error.hpp"
#include "cuda/mlp_prefill.cuh"

namespace fmlp::detail {
namespace {

// Refill from the benchmark: `fusedmlp_cuda_bench --prefill --json out.json` prints one row per
// (shape, dtype) it swept, in this format. Until measured, every shape uses the default: the
// decode kernels were measured best only at M = 1 (bench/results/cuda_decode_h200.json).
constexpr CrossoverEntry kDefault{
    0, 0, false, FMLP_DTYPE_INVALID, 2, "default estimate, not measured for this shape"};
constexpr CrossoverEntry kTable[] = {
    // {d_in, hidden, gated, dtype, crossover M, source}
    {4096, 14336, true, FMLP_DTYPE_BF16, 2, "estimate for H200 (sm_90), not yet measured"},
    {8192, 28672, true, FMLP_DTYPE_BF16, 2, "estimate for H200 (sm_90), not yet measured"},
    {768, 3072, false, FMLP_DTYPE_BF16, 2, "estimate for H200 (sm_90), not yet measured"},
    {4096, 4096, false, FMLP_DTYPE_BF16, 2, "estimate for H200 (sm_90), not yet measured"},
};

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
    if (e.d_in == d.d_in && e.hidden == d.hidden && e.gated == d.gated && e.dtype == d.act_dtype)
      return e;
  return kDefault;
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
