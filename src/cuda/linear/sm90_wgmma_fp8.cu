// linear_sm90_wgmma_fp8: y[M, N] = x[M, K] (W * scale)^T + b for M <= 4 tokens of bf16/fp16 x
// and e4m3 weights, W read once by TMA and multiplied on the tensor cores without widening it
// (engines/stream_wgmma_fp8.cuh says why and how). sm_90a only. The epilogue applies the per-row or
// per-tensor scale and the bias; deterministic.
#include <cuda_runtime.h>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/engines/stream_wgmma_fp8.cuh"
#include "cuda/linear/entries.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::kWgMaxTokens;
using fmlp::cuda::kWgThreads;
using fmlp::cuda::WgShape;

constexpr const char* kName = "linear_sm90_wgmma_fp8";

struct LinearWgParams : LinearOperands {
  WgShape s;
  float* part;
  unsigned* counters;
};

#ifdef FMLP_SM90A
struct LinearOp {
  const LinearWgParams& p;
  int m;
  __device__ void prepare() {}
  __device__ float x(int t, int j) const {
    return fmlp::cuda::load_scalar(static_cast<const char*>(p.x) + int64_t(t) * p.x_ld * 2, p.x_t,
                                   j);
  }
  __device__ const uint8_t* w(int, int row) const {
    return static_cast<const uint8_t*>(p.w) + int64_t(row) * p.w_ld;
  }
  __device__ void finish(int row, int t, const float (&v)[1]) const {
    float r = v[0] * p.scale[p.scale_per_row ? row : 0];
    if (p.bias) r += fmlp::cuda::load_scalar(p.bias, p.bias_t, row);
    const int64_t es = p.y_t == FMLP_DTYPE_F32 ? 4 : 2;
    fmlp::cuda::store_scalar(static_cast<char*>(p.y) + int64_t(t) * p.y_ld * es, p.y_t, row, r);
  }
  __device__ void done() const {}
};
#endif

__global__ void __launch_bounds__(kWgThreads, 1)
    linear_sm90_wgmma_fp8(const __grid_constant__ CUtensorMap map, const LinearWgParams p) {
#ifdef FMLP_SM90A
  LinearOp op{p, p.m};
  fmlp::cuda::wg_stream<1>(&map, &map, p.s, p.part, p.counters, op);
#endif
}

WgShape shape_of(const LinearDesc& d) {
  return fmlp::cuda::wg_shape(d.n, d.k, 1, cuda_sm_count(d.device_id));
}

}  // namespace

bool linear_sm90_wgmma_fp8_supports(const LinearDesc& d, std::string* why) {
  if (refuses_block_scales(d, why)) return false;
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (d.w_dtype != FMLP_DTYPE_F8_E4M3 || d.w8a8())
    return (*why = fmt::format("{} takes fp8 e4m3 weights with bf16/f16 x (weight-only); got {} "
                               "weights, {} x",
                               kName, fmlp_dtype_name(d.w_dtype), fmlp_dtype_name(d.act_dtype)),
            false);
  if (d.act_dtype != FMLP_DTYPE_BF16 && d.act_dtype != FMLP_DTYPE_F16)
    return (*why = fmt::format("{} x: {} splits x into e4m3 parts exactly only for bf16/f16 x; "
                               "linear_sm80_gemv takes it",
                               fmlp_dtype_name(d.act_dtype), kName),
            false);
  if (d.m < 1 || d.m > kWgMaxTokens)
    return (*why = fmt::format("M={}: {} takes 1 to {} rows (more: linear_sm80_mma)", d.m, kName,
                               kWgMaxTokens),
            false);
  if (!d.w_vec16)
    return (*why =
                "W must be 16-byte aligned (base, row stride) with K in whole 16-byte chunks "
                "(TMA)",
            false);
  if (d.n >= (int64_t(1) << 31) || d.k >= (int64_t(1) << 31))
    return (*why = "N and K must be below 2^31", false);
  const WgShape s = shape_of(d);
  return fmlp::cuda::wg_shape_ok(s, kName, why) &&
         fmlp::cuda::wg_device_supports(kName, d.device_id, fmlp::cuda::wg_smem_bytes(s), why);
}

size_t linear_sm90_wgmma_fp8_workspace(const LinearDesc& d) {
  const WgShape s = shape_of(d);
  return align_up(fmlp::cuda::wg_partial_bytes(s, 1)) + align_up(fmlp::cuda::wg_counter_bytes(s));
}

fmlp_status_t linear_sm90_wgmma_fp8_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                                        void* stream) {
  if (d.n == 0) return FMLP_SUCCESS;  // nothing to write
  LinearWgParams p{};
  static_cast<LinearOperands&>(p) = linear_operands(a, d);
  p.s = shape_of(d);
  p.part = static_cast<float*>(ws);
  p.counters = reinterpret_cast<unsigned*>(static_cast<char*>(ws) +
                                           align_up(fmlp::cuda::wg_partial_bytes(p.s, 1)));
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  CUtensorMap map;
  if (fmlp_status_t st = fmlp::cuda::wg_make_map(&map, kName, "W", p.w, d.n, d.k, p.w_ld);
      st != FMLP_SUCCESS)
    return st;
  const size_t smem = fmlp::cuda::wg_smem_bytes(p.s);
  constexpr auto kernel = &linear_sm90_wgmma_fp8;
  if (fmlp_status_t st = allow_dynamic_smem<kernel>(smem, kName); st != FMLP_SUCCESS) return st;
  return launch_ex(kernel, dim3(fmlp::cuda::wg_grid(p.s)), dim3(kWgThreads), smem,
                   pdl_enabled(cuda_compute_capability(d.device_id)),
                   static_cast<cudaStream_t>(stream), kName, map, p);
}

}  // namespace fmlp::detail
