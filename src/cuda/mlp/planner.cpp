// Crossover table and planner for the CUDA backend (see planner.hpp).
#include "cuda/mlp/planner.hpp"

#include <cstring>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/mlp/entries.hpp"
#include "cuda/mlp/tuning.hpp"

namespace fmlp::detail {
namespace {

// Measured on an H200 (bench/mlp_cuda_bench_prefill, commit of bench/results/cuda_prefill_h200.*;
// the decode entries forced one by one against the cuBLASLt path at M = 1..4 with
// bench/mlp_cuda_bench --kernel, bench/results/cuda_decode_{stream,cublaslt}_h200.*, commit
// a469f86): below the crossover the decode entries run in table order, the weight streams
// (mlp_decode_sm80_stream) first. Staging x and h in 16 bits and launching with programmatic
// dependent launch, the streams beat the cuBLASLt path at M = 1 on every measured
// shape; at larger M the cuBLASLt path reads the weights once for all tokens while the stream's
// shared memory and registers grow with M. The bench prints rows in this format to refill the
// table. 16-bit rows serve bf16 and fp16 alike: the paths read the same bytes and do the same math.
constexpr CrossoverEntry kTable[] = {
    // {d_in, hidden, gated, dtype, crossover M, source}
    // gpt2-small: the streams ahead of the cuBLASLt path up to M = 4.
    {768, 3072, false, FMLP_DTYPE_BF16, 5, "measured on NVIDIA H200 (sm_90)"},
    // 4096 -> 4096: the streams ahead at M = 1 and 2, behind at M = 4.
    {4096, 4096, false, FMLP_DTYPE_BF16, 3, "measured on NVIDIA H200 (sm_90)"},
    // llama3-8b: the streams ahead at M = 1 only.
    {4096, 14336, true, FMLP_DTYPE_BF16, 2, "measured on NVIDIA H200 (sm_90)"},
    // llama3-70b: the streams ahead at M = 1 (by less than the run-to-run spread of cuBLASLt).
    {8192, 28672, true, FMLP_DTYPE_BF16, 2, "measured on NVIDIA H200 (sm_90)"},
    // fp8 weights with 16-bit x: the cluster kernel against the W8A8 path at M = 8 and 16 (one
    // call, bench/results/cuda_decode_fp8_h200.*). gpt2-small: the cluster kernel ahead at both.
    {768, 3072, false, FMLP_DTYPE_F8_E4M3, 17, "measured on NVIDIA H200 (sm_90)"},
    // 4096 -> 4096: a tie at M = 8, the W8A8 path ahead at 16.
    {4096, 4096, false, FMLP_DTYPE_F8_E4M3, 16, "measured on NVIDIA H200 (sm_90)"},
    // llama3-8b: the cluster kernel ahead at both.
    {4096, 14336, true, FMLP_DTYPE_F8_E4M3, 17, "measured on NVIDIA H200 (sm_90)"},
};
// 16-bit shapes never measured: by weight bytes, the one thing the measured crossovers track.
// Every entry timed on the 22 real-model shapes of bench/decode_suite.txt (the rows at M = 2, 4, 8
// of bench/results/decode_suite_h100.log): the weight streams ahead of the cuBLASLt path at M = 2
// on every shape they take and at M = 4 below about 32 MiB of weights; above it the two are within
// a few percent at M = 4, either way. The H200 rows of kTable agree.
constexpr int64_t kSmallWeightBytes = int64_t(32) << 20;
constexpr int64_t kHugeWeightBytes = int64_t(1) << 30;
constexpr CrossoverEntry kDefaultSmall{
    0,     0,
    false, FMLP_DTYPE_INVALID,
    5,     "default for weights under 32 MiB: the weight streams up to M = 4"};
constexpr CrossoverEntry kDefaultLarge{
    0,     0,
    false, FMLP_DTYPE_INVALID,
    3,     "default for weights of 32 MiB to 1 GiB: the weight streams up to M = 2"};
constexpr CrossoverEntry kDefaultHuge{
    0,
    0,
    false,
    FMLP_DTYPE_INVALID,
    2,
    "default for weights of 1 GiB or more: the weight streams at M = 1, as measured for "
    "llama3-70b"};

// fp8 weights on the prefill path are W8A8 (activations quantised per token): below the crossover
// the decode kernels keep the exact weight-only dequantisation, and they stream the same fp8
// bytes, so the few-token range where they are close in speed stays with them. The fp8 rows of
// kTable hold the shapes measured; the prefill bench (--wdtype f8) prints rows for others.
constexpr CrossoverEntry kDefaultFp8{
    0,
    0,
    false,
    FMLP_DTYPE_F8_E4M3,
    16,
    "default for fp8 weights: weight-only decode kernels (exact dequantisation) below, W8A8 "
    "GEMMs from here; not measured for this shape"};

// Table key of a request: fp8 rows (dtype F8_E4M3) serve fp8 weights with 16-bit x; 16-bit rows
// serve bf16 and fp16 alike.
fmlp_dtype_t table_dtype(const MlpDesc& d) {
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3) return FMLP_DTYPE_F8_E4M3;
  return d.act_dtype == FMLP_DTYPE_F16 ? FMLP_DTYPE_BF16 : d.act_dtype;
}

const MlpKernel* find(const char* name) {
  const MlpKernelList l = cuda_mlp_kernels();
  for (size_t i = 0; i < l.count; ++i)
    if (std::strcmp(l.kernels[i].name, name) == 0) return &l.kernels[i];
  return nullptr;
}

std::string shape_text(const MlpDesc& d) {
  const std::string w = d.w_dtype == d.act_dtype
                            ? std::string()
                            : fmt::format(" with {} weights", fmlp_dtype_name(d.w_dtype));
  return fmt::format("d_in={} hidden={} {} {}{}", d.d_in, d.hidden, d.gated ? "gated" : "dense",
                     fmlp_dtype_name(d.act_dtype), w);
}

// What the prefill path does differently for fp8 weights, for explain.
const char* fp8_note(const MlpDesc& d, bool prefill) {
  if (d.w_dtype != FMLP_DTYPE_F8_E4M3) return "";
  return prefill ? " (W8A8: x and h quantised per token to e4m3 with dynamic scales, fp8 GEMMs)"
                 : " (weight-only fp8: weights dequantised exactly, activations unquantised)";
}

}  // namespace

const CrossoverEntry& cuda_crossover(const MlpDesc& d) {
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  for (const CrossoverEntry& e : kTable)
    if (e.d_in == d.d_in && e.hidden == d.hidden && e.gated == d.gated &&
        e.dtype == table_dtype(d) && (fp8 || d.w_dtype == d.act_dtype))
      return e;
  if (fp8) return kDefaultFp8;
  const int64_t rows1 = d.gated ? 2 * d.hidden : d.hidden;
  const int64_t bytes =
      (rows1 * d.d_in + d.d_out * d.hidden) * int64_t(fmlp::dtype_size(d.w_dtype));
  return bytes < kSmallWeightBytes  ? kDefaultSmall
         : bytes < kHugeWeightBytes ? kDefaultLarge
                                    : kDefaultHuge;
}

const MlpKernel* cuda_mlp_plan(const MlpDesc& d, std::string* reason) {
  // Packed weights timed at pack time (tuning.hpp): the fastest entry of the call's bucket, where
  // the call is the one timed (activations of the assumed dtype) and the entry takes it.
  if (const MlpTuning* t = d.tuning; t != nullptr && !d.deterministic) {
    const int b = mlp_tuning_bucket(d.m);
    std::string why;
    if (b >= 0 && t->pick[b] != nullptr && d.act_dtype == t->act_dtype &&
        d.device_id == t->device && t->pick[b]->supports(d, &why)) {
      if (reason)
        *reason = fmt::format("timed at pack time on cuda:{} for M <= {}: {}", t->device,
                              MlpTuning::kBucketM[b], t->detail[b]);
      return t->pick[b];
    }
  }
  const CrossoverEntry& c = cuda_crossover(d);
  const MlpKernel* prefill = find(kPrefillKernelName);
  std::string why;
  if (d.m >= c.m && prefill != nullptr) {
    if (prefill->supports(d, &why)) {
      if (reason)
        *reason =
            fmt::format("M={} >= crossover {} ({}) for {}: prefill path{}{}", d.m, c.m, c.source,
                        shape_text(d), fp8_note(d, true), mlp_prefill_gemm1_note(d));
      return prefill;
    }
  }
  // Below the crossover (or when the prefill path cannot run it): table order, decode first. fp8
  // weights too go to the weight streams (mlp_decode_sm80_stream) at every M they take (1..4, x
  // and h within their shared memory): with their fp8 chunk and staging they beat the cluster
  // kernel at M = 3 and 4 on gpt2-small, 4096 -> 4096 and llama3-8b at M = 3 (its M = 4 does not
  // fit the streams). To measure: fusedmlp_cuda_bench --wdtype f8 --ms 3,4 --kernel with each
  // entry forced in one call (bench/results/decode_entries_h100.json has every entry per M).
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
                           : fmt::format("M={} < crossover {} ({}) for {}: decode kernels first{}",
                                         d.m, c.m, c.source, shape_text(d), fp8_note(d, false));
    return &k;
  }
  if (reason) *reason = "no CUDA kernel handles the request";
  return nullptr;
}

}  // namespace fmlp::detail
