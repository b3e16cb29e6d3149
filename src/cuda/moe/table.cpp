// The cuda moe entries in table order (overview in moe_cuda.hpp): moe_sm80_stream (route, two
// weight streams in sm80_stream.cu) for a few tokens, moe_sm90_grouped and moe_sm80_grouped
// (route, grouped GEMMs in sm90_grouped.cu / sm80_grouped.cu, combine) for many tokens per expert,
// moe_sm80_chunked (route, sm80_chunked.cu, combine) otherwise: what they take, their workspaces,
// their launches, and the device error count.
#include <algorithm>
#include <string>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/moe/moe_cuda.hpp"
#include "cuda/moe/tuning.hpp"

namespace fmlp::detail {
namespace {

// What every entry needs: no block scales, the device, 16-bit experts (or fp8 ones on sm_89+), the
// route kernel's expert limit.
bool moe_common_supports(const MoeDesc& d, std::string* why) {
  if (d.expert.w1_scale == ScaleKind::kBlock || d.expert.w2_scale == ScaleKind::kBlock)
    return (*why = fmt::format("{} is a 3-D block scale (128 x 128 blocks per expert): the cuda "
                               "moe entries take [E] or [E, rows] fp8 scales only; run on the cpu "
                               "backend, or re-quantise each expert per row (fmlp_quantize_fp8 "
                               "with a [rows] scale) for cuda",
                               d.expert.w1_scale == ScaleKind::kBlock ? "w1_scale" : "w2_scale"),
            false);
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3) {
    if (cuda_compute_capability(d.device_id) < 89)
      return (*why =
                  "f8_e4m3 experts need sm_89 or newer (cvt.rn.f16x2.e4m3x2); run them on "
                  "backend cpu or pass bf16 experts",
              false);
  } else if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16) {
    return (*why = fmt::format("{} experts: the cuda moe entries stream bf16 or f16 experts (or "
                               "f8_e4m3 ones with scales)",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  }
  if (d.global_experts > kMoeMaxExperts)
    return (*why = fmt::format("{} experts routed over: the routing kernel keeps per-expert "
                               "tables in shared memory and takes at most {}",
                               d.global_experts, kMoeMaxExperts),
            false);
  return true;
}

// The weight rows of moe_sm80_chunked are read with 16-byte loads, whole rows of them.
bool moe_rows_vec16(const MoeDesc& d, std::string* why) {
  if (d.d % 8 != 0 || d.hidden % 8 != 0)
    return (*why = fmt::format("d={} and hidden={} must be multiples of 8 (16-byte weight "
                               "loads); pad the experts (moe_sm80_stream takes any size at up "
                               "to {} tokens with 16-byte aligned rows)",
                               d.d, d.hidden, kMoeStreamMaxTokens),
            false);
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3 && (d.d % 16 != 0 || d.hidden % 16 != 0))
    return (*why = fmt::format("d={} and hidden={} must be multiples of 16 with f8_e4m3 experts "
                               "(16-byte loads of 16 weights); pad the experts",
                               d.d, d.hidden),
            false);
  if (!d.expert.weights_vec16)
    return (*why =
                "an expert's W1 or W2 is not 16-byte aligned (base or row stride); store "
                "the experts with 16-byte aligned rows",
            false);
  return true;
}

bool moe_sm80_chunked_supports(const MoeDesc& d, std::string* why) {
  if (!moe_common_supports(d, why)) return false;
  if (!moe_rows_vec16(d, why)) return false;
  if (d.d >= (int64_t(1) << 28) || d.hidden >= (int64_t(1) << 28) || d.d_out > (int64_t(1) << 21))
    return (*why = "d and hidden must be below 2^28 and d_out at most 2^21", false);
  return true;
}

bool moe_sm80_grouped_supports(const MoeDesc& d, std::string* why) {
  if (!moe_common_supports(d, why)) return false;
  const double per = tokens_per_hit_expert(d);
  const double expert_bytes = double(d.hidden * (d.gated ? 2 : 1) * d.d + d.d_out * d.hidden) *
                              double(dtype_size(d.w_dtype));
  if (per < kGroupedMinRows && expert_bytes < kGroupedBigExpert)
    return (*why = fmt::format("{:.2f} expected tokens per hit expert (below {}) on experts of "
                               "{:.1f} MiB (below {:.0f}): moe_sm80_chunked streams such experts "
                               "faster at decode sizes",
                               per, kGroupedMinRows, expert_bytes / (1 << 20),
                               kGroupedBigExpert / (1 << 20)),
            false);
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;  // x is staged as fp16 first: any dtype
  if (!fp8 && d.act_dtype != d.w_dtype)
    return (*why = fmt::format("x is {} but the experts are {}: the grouped GEMM copies x rows "
                               "as they are (moe_sm80_chunked converts them); pass x in the "
                               "experts' dtype",
                               fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype)),
            false);
  if (d.d % kMoeGroupedK != 0 || d.hidden % kMoeGroupedK != 0 || d.d_out % 8 != 0)
    return (*why = fmt::format("d={}, hidden={}, d_out={}: the grouped GEMM's tiles need d and "
                               "hidden multiples of {} and d_out a multiple of 8",
                               d.d, d.hidden, d.d_out, kMoeGroupedK),
            false);
  if ((!fp8 && !d.x_vec16) || !d.expert.weights_vec16)
    return (*why =
                "x, W1 or W2 rows are not 16-byte aligned (base or row stride): the grouped "
                "GEMM copies 16-byte pieces; store them with 16-byte aligned rows",
            false);
  if (d.hidden >= (int64_t(1) << 22) || d.d_out >= (int64_t(1) << 22) || d.d >= (int64_t(1) << 28))
    return (*why = "hidden and d_out must be below 2^22 (grid rows) and d below 2^28", false);
  return true;
}

bool moe_sm80_stream_supports(const MoeDesc& d, std::string* why) {
  if (!moe_common_supports(d, why)) return false;
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3)
    return (*why =
                "f8_e4m3 experts: the stream takes bf16 or f16 experts (moe_sm80_chunked and "
                "moe_sm80_grouped take fp8 ones)",
            false);
  if (d.tokens < 1 || d.tokens > kMoeStreamMaxTokens)
    return (*why = fmt::format("T={}: the stream takes 1 to {} tokens (a grid row each)", d.tokens,
                               kMoeStreamMaxTokens),
            false);
  if (d.top_k > kMoeStreamMaxTopK)
    return (*why = fmt::format("top_k={}: the stream sums a token's k slots in one thread of a "
                               "group of at most {} rows",
                               d.top_k, kMoeStreamMaxTopK),
            false);
  // Any d and hidden: rows that end inside a 16-byte chunk have it read by its own bytes
  // (sm80_stream.cu), as long as every row starts on a 16-byte boundary.
  if (!d.expert.weights_vec16)
    return (*why = fmt::format(
                "an expert's W1 or W2 is not 16-byte aligned (base or row stride); store the "
                "experts with 16-byte aligned rows{}",
                d.d % 8 || d.hidden % 8
                    ? fmt::format(" (d={}, hidden={}: a row stride of a multiple of 8 "
                                  "elements, e.g. W1 [E, rows, {}] and W2 [E, d_out, {}] viewed "
                                  "as [..., :d] and [..., :hidden])",
                                  d.d, d.hidden, moe_stream_width(d.d), moe_stream_width(d.hidden))
                    : ""),
            false);
  if (d.d >= (int64_t(1) << 28) || d.hidden >= (int64_t(1) << 27) ||
      d.d_out * moe_stream_pair(int(d.top_k)) >= (int64_t(1) << 31))
    return (*why = "d must be below 2^28, hidden below 2^27 and d_out below 2^28", false);
  const size_t x_bytes = size_t(moe_stream_width(d.d)) * dtype_size(d.act_dtype);
  if (x_bytes > kMoeStreamStageBytes)
    return (*why = fmt::format("a token's x (d={}, {}) takes {} KiB of shared memory, more than "
                               "the stream's {} KiB",
                               d.d, fmlp_dtype_name(d.act_dtype), x_bytes >> 10,
                               kMoeStreamStageBytes >> 10),
            false);
  return true;
}

size_t moe_sm80_chunked_workspace(const MoeDesc& d) {
  return moe_plan(d).total;
}

size_t moe_sm80_grouped_workspace(const MoeDesc& d) {
  return moe_plan_grouped(d).total;
}

// Route, [fp8 experts: x staged as fp16,] the experts (launch_experts), combine.
fmlp_status_t moe_run_with(const fmlp_moe_args_t& a, const MoeDesc& d, const MoePlan& pl, void* ws,
                           void* stream,
                           fmlp_status_t (*launch_experts)(const MoeParams&, cudaStream_t)) {
  const MoeParams p = moe_params(a, d, pl, ws);
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const auto s = static_cast<cudaStream_t>(stream);
  if (const fmlp_status_t st = moe_launch_route(p, s); st != FMLP_SUCCESS) return st;
  if (p.w_t == FMLP_DTYPE_F8_E4M3)
    if (const fmlp_status_t st =
            moe_launch_stage_f16(p.x, p.x_t, p.x_ld, p.tokens, p.d, p.xh, p.xinv, s);
        st != FMLP_SUCCESS)
      return st;
  if (const fmlp_status_t st = launch_experts(p, s); st != FMLP_SUCCESS) return st;
  return moe_launch_combine(p, s);
}

size_t moe_sm80_stream_workspace(const MoeDesc& d) {
  return moe_plan_stream(d).total;
}

fmlp_status_t moe_sm80_stream_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws,
                                  void* stream) {
  MoeParams p = moe_params(a, d, moe_plan_stream(d), ws);
  p.ids_only = true;  // the streams read ids and weights; their up launch may start early
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const auto s = static_cast<cudaStream_t>(stream);
  if (const fmlp_status_t st = moe_launch_route(p, s); st != FMLP_SUCCESS) return st;
  return moe_launch_stream(p, s);
}

fmlp_status_t moe_sm80_chunked_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws,
                                   void* stream) {
  return moe_run_with(a, d, moe_plan(d), ws, stream, moe_launch_experts);
}

fmlp_status_t moe_sm80_grouped_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws,
                                   void* stream) {
  return moe_run_with(a, d, moe_plan_grouped(d), ws, stream, moe_launch_grouped);
}

// moe_sm90_grouped: what moe_sm80_grouped takes, for gated 16-bit experts with x in their dtype on
// an sm_90 device, from kGroupedSm90MinRows expected tokens per hit expert.
bool moe_sm90_grouped_supports(const MoeDesc& d, std::string* why) {
  if (!moe_sm80_grouped_supports(d, why)) return false;
  if (const double per = tokens_per_hit_expert(d); per < kGroupedSm90MinRows)
    return (*why = fmt::format("{:.2f} expected tokens per hit expert (below {}): "
                               "moe_sm80_grouped's 64-row tiles, measured faster there",
                               per, kGroupedSm90MinRows),
            false);
  const int cc = cuda_compute_capability(d.device_id);
  if (cc != 90)
    return (*why = fmt::format("moe_sm90_grouped is sm_90a code; device {} has compute capability "
                               "{}.{}",
                               d.device_id, cc / 10, cc % 10),
            false);
  if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16)
    return (*why = fmt::format("{} experts: moe_sm90_grouped takes bf16 or f16 (fp8: "
                               "moe_sm80_grouped)",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  if (!d.gated)
    return (*why =
                "dense experts: moe_sm90_grouped's tiles pair gate and up rows "
                "(moe_sm80_grouped takes them)",
            false);
  return true;
}

size_t moe_sm90_grouped_workspace(const MoeDesc& d) {  // room for every plan (see the run)
  return std::max({moe_plan_grouped_sm90(d, false).total, moe_plan_grouped_sm90(d, true).total,
                   grouped_plan(d, kGroupedSm90SwapChunk, true).total});
}

// The sm_90 GEMMs where the call's tensors allow them (one TMA map over every expert's W1 and
// W2: expert stride = rows x row stride, 16-byte aligned), else the mma.sync GEMMs of
// moe_sm80_grouped on the same plan.
fmlp_status_t moe_launch_grouped_sm90_or_sm80(const MoeParams& p, cudaStream_t s) {
  std::string why;
  if (!moe_grouped_sm90_takes(p, &why)) return moe_launch_grouped(p, s);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError(), device = 0;
  return moe_launch_grouped_sm90(p, std::max(1, cuda_sm_count(device)), s);
}

fmlp_status_t moe_sm90_grouped_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws,
                                   void* stream) {
  MoePlan pl = moe_plan_grouped_sm90(d, false);
  if (grouped_sm90_swapped(d)) {
    // Swapped tiles only where the sm_90 GEMMs take the tensors (as the tall ones below).
    MoePlan swapped = grouped_plan(d, kGroupedSm90SwapChunk, true);
    swapped.sm90_swap = true;
    std::string why;
    if (moe_grouped_sm90_takes(moe_params(a, d, swapped, ws), &why)) pl = swapped;
  } else if (grouped_sm90_tall(d)) {
    // Tall chunks only where the sm_90 GEMMs take the tensors: the fallback (moe_sm80_grouped's
    // GEMMs on the same plan) tiles at most 128 rows.
    const MoePlan tall = moe_plan_grouped_sm90(d, true);
    std::string why;
    if (moe_grouped_sm90_takes(moe_params(a, d, tall, ws), &why)) pl = tall;
  }
  return moe_run_with(a, d, pl, ws, stream, moe_launch_grouped_sm90_or_sm80);
}

// Dispatch takes the first entry that supports a call: the weight streams for a few tokens, the
// grouped GEMMs at many tokens per expert, the mma streaming kernel otherwise.
const MoeKernel kCudaMoeKernels[] = {
    {"moe_sm80_stream", FMLP_BACKEND_CUDA, moe_sm80_stream_supports, moe_sm80_stream_workspace,
     moe_sm80_stream_run},
    {"moe_sm90_grouped", FMLP_BACKEND_CUDA, moe_sm90_grouped_supports, moe_sm90_grouped_workspace,
     moe_sm90_grouped_run},
    {"moe_sm80_grouped", FMLP_BACKEND_CUDA, moe_sm80_grouped_supports, moe_sm80_grouped_workspace,
     moe_sm80_grouped_run},
    {"moe_sm80_chunked", FMLP_BACKEND_CUDA, moe_sm80_chunked_supports, moe_sm80_chunked_workspace,
     moe_sm80_chunked_run},
};

}  // namespace

MoeKernelList cuda_moe_kernels() {
  return {kCudaMoeKernels, sizeof(kCudaMoeKernels) / sizeof(kCudaMoeKernels[0])};
}

fmlp_status_t cuda_moe_device_errors(void* workspace, void* stream, int32_t* count) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, workspace) != cudaSuccess ||
      attr.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return fail(FMLP_ERROR_INVALID_VALUE,
                "workspace is not device memory; pass the workspace of a cuda fmlp_moe call");
  }
  const DeviceScope scope(attr.device);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const auto s = static_cast<cudaStream_t>(stream);
  int32_t host = 0;
  cudaError_t e = cudaMemcpyAsync(&host, workspace, sizeof host, cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaMemsetAsync(workspace, 0, sizeof host, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA,
                "reading the moe error count failed: {} (it synchronises the stream: call it "
                "outside graph capture)",
                cudaGetErrorString(e));
  }
  *count = host;
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
