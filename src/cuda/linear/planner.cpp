// Choice table and planner of the CUDA linear entries (see planner.hpp).
#include "cuda/linear/planner.hpp"

#include <cstring>

#include "core/error.hpp"
#include "core/knobs.hpp"

namespace fmlp::detail {
namespace {

constexpr const char* kGemv = "linear_sm80_gemv";
constexpr const char* kLt = "linear_sm90_cublaslt";
constexpr const char* kStream = "linear_sm80_stream";
constexpr const char* kMma = "linear_sm80_mma";

// M = 1, measured on an H200 (fusedmlp_ops_bench with FMLP_LINEAR_KERNEL forcing each entry, in
// one call; bench/results/linear_h200.json): the memory-order stream (linear_sm80_stream) beat
// the GEMV and cuBLASLt on most of the bench's 16-bit shapes, by the most on the small and medium
// ones (llama3-8b q 4096x4096 and k/v 1024x4096), and ties or wins on the lm heads. It is the
// default wherever it runs; the rows below are the measured exceptions, and shapes it cannot take
// (x larger than its shared memory, fp32 weights) keep the older rule. fp8 weights: the same rule.
// With its x staged in 16-byte steps the stream beats the tensor-core entry (linear_sm80_mma) on
// all four measured shapes at M = 1, per-row scales (4096x4096, 4096<-14336, 14336<-4096,
// 28672<-8192; bench/results/linear_fp8_h200.json). The fp8 wgmma stream (linear_sm90_wgmma_fp8)
// ties or loses on all four, so it is only taken when forced.
constexpr const char* kMeasured = "measured on NVIDIA H200 (sm_90)";
constexpr LinearChoice kTable[] = {
    // {n, k, w dtype, entry at M = 1, source}
    {4864, 896, FMLP_DTYPE_BF16, kLt, kMeasured},    // a tie with the stream
    {151936, 896, FMLP_DTYPE_BF16, kLt, kMeasured},  // a tie with the stream
};
// Shapes not in the table, when the stream cannot run them: the GEMV below 6 MiB of weights (one
// launch, no epilogue pass: the tiny projections) and for N >= 28672 (wide outputs keep every SM
// streaming), cuBLASLt between. fp8: the tensor-core entry.
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

bool runs(const LinearKernel* k, const LinearDesc& d) {
  std::string why;
  return k != nullptr && k->supports(d, &why);
}

// The M = 1 choice for weight-only 16-bit and fp8 weights, or nullptr (then table order).
const LinearKernel* m1_choice(const LinearDesc& d, std::string* reason) {
  if (d.m != 1 || d.w8a8()) return nullptr;
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  if (!fp8 && d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16) return nullptr;
  for (const LinearChoice& e : kTable)
    if (e.n == d.n && e.k == d.k && e.w == table_dtype(d.w_dtype) && runs(find(e.kernel), d)) {
      if (reason) *reason = fmt::format("M=1 N={} K={}: {} ({})", d.n, d.k, e.kernel, e.source);
      return find(e.kernel);
    }
  const LinearKernel* stream = find(kStream);
  if (runs(stream, d)) {
    if (reason)
      *reason = fmt::format("M=1 N={} K={} not measured: {} (the default wherever it runs)", d.n,
                            d.k, kStream);
    return stream;
  }
  if (fp8) {
    const LinearKernel* mma = find(kMma);
    if (!runs(mma, d)) return nullptr;
    if (reason)
      *reason = fmt::format("M=1 N={} K={} fp8, {} cannot run it: {}", d.n, d.k, kStream, kMma);
    return mma;
  }
  const LinearKernel* gemv = find(kGemv);
  const LinearKernel* lt = find(kLt);
  if (!runs(gemv, d) || !runs(lt, d)) return nullptr;
  const int64_t bytes = d.n * d.k * 2;
  const bool use_lt = bytes >= kLtMinBytes && d.n < kGemvMinN;
  if (reason)
    *reason = fmt::format(
        "M=1 N={} K={} not measured, {} cannot run it: default by shape ({} MiB of weights; "
        "cuBLASLt takes >= {} MiB with N < {}): {}",
        d.n, d.k, kStream, bytes >> 20, kLtMinBytes >> 20, kGemvMinN, use_lt ? kLt : kGemv);
  return use_lt ? lt : gemv;
}

// M = 2..4 (the stream's two- and four-token tiles; M = 3 runs the four-token one), measured on an
// H200 (fusedmlp_ops_bench --ms 2,4 with the stream forced against the table order's pick,
// torch's F.linear in the same call; bench/results/linear_m2_4_h200.json). fp8 weight-only:
// the stream wins wherever it runs (linear_sm80_mma's time x 0.60-0.67 at M = 2, 0.86-0.87 at
// M = 4). 16-bit: at M = 2 it wins up to 256 MiB of weights (cuBLASLt's time x 0.32 for the router
// 8x4096 .. 0.96 for llama3-8b's up; llama3-70b's up, 470 MB, 1.01); at M = 3, 4 only for narrow
// outputs (N <= 1024: x 0.45 the router, 0.74 qwen2.5-0.5b q, 0.77 llama3-8b k/v); wider ones lost
// (gpt2 qkv 2304x768 x 1.13, llama3-8b q x 1.13, up x 1.28, gpt2's lm head x 1.17 to the mma
// entry), so cuBLASLt keeps them.
constexpr int64_t kStreamM2MaxBytes = int64_t(256) << 20;
constexpr int64_t kStreamM4MaxN = 1024;

const LinearKernel* few_token_choice(const LinearDesc& d, std::string* reason) {
  if (d.m < 2 || d.m > 4 || d.w8a8()) return nullptr;
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  // 16-bit: with x of the same dtype, as measured (f32 x keeps the table order; unmeasured).
  if (!fp8 &&
      ((d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16) || d.act_dtype != d.w_dtype))
    return nullptr;
  const LinearKernel* stream = find(kStream);
  if (!runs(stream, d)) return nullptr;
  const int64_t bytes = d.n * d.k * (fp8 ? 1 : 2);
  if (!fp8 && (d.m == 2 ? bytes >= kStreamM2MaxBytes : d.n > kStreamM4MaxN)) return nullptr;
  if (reason)
    *reason = fmt::format(
        "M={} N={} K={}: {} ({}; measured at M = 2..4: fp8 wherever it runs, 16-bit at M = 2 "
        "below {} MiB of weights, at M = 3..4 for N <= {})",
        d.m, d.n, d.k, kStream, kMeasured, kStreamM2MaxBytes >> 20, kStreamM4MaxN);
  return stream;
}

}  // namespace

const LinearKernel* cuda_linear_plan(const LinearDesc& d, std::string* reason) {
  std::string note, why;
  if (const std::string env = knob_string<Knob::FMLP_LINEAR_KERNEL>(); !env.empty()) {
    const LinearKernel* k = find(env.c_str());
    if (k != nullptr && k->supports(d, &why)) {
      if (reason) *reason = fmt::format("FMLP_LINEAR_KERNEL={} forces it", env);
      return k;
    }
    if (k == nullptr)
      knob_reject(Knob::FMLP_LINEAR_KERNEL,
                  "the name of a CUDA linear entry (`fusedmlp info` lists them)");
    note = k == nullptr ? fmt::format(" (FMLP_LINEAR_KERNEL={} ignored: no such CUDA entry)", env)
                        : fmt::format(" (FMLP_LINEAR_KERNEL={} ignored: {})", env, why);
  }
  for (auto choice : {m1_choice, few_token_choice})
    if (const LinearKernel* k = choice(d, reason)) {
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
