// moe_sm89_stage_f16: the fp16 staging of x (and of the grouped path's h) for fp8 experts (see
// fp8.cuh). One block per row: the largest finite |value|, then the scaled fp16 copy.
#include <cuda_runtime.h>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/launch_util.hpp"
#include "cuda/moe/fp8.cuh"
#include "cuda/moe/moe_cuda.hpp"

namespace fmlp::detail {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    moe_sm89_stage_f16(const void* src, fmlp_dtype_t t, int64_t ld, int cols, uint16_t* dst,
                       float* inv) {
  __shared__ unsigned amax;
  const int r = int(blockIdx.x);
  const size_t es = t == FMLP_DTYPE_F32 ? 4 : 2;
  const char* row = static_cast<const char*>(src) + int64_t(r) * ld * int64_t(es);
  if (threadIdx.x == 0) amax = 0;
  __syncthreads();
  if (t != FMLP_DTYPE_F16) {
    float m = 0.f;
    for (int c = int(threadIdx.x); c < cols; c += kThreads) {
      const float v = fabsf(fmlp::cuda::load_scalar(row, t, c));
      if (v <= 3.4e38f) m = fmaxf(m, v);  // finite only: NaN and Inf pass through unscaled
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
    if (threadIdx.x % 32 == 0) atomicMax(&amax, __float_as_uint(m));  // bits order as values
  }
  __syncthreads();
  const int shift = fmlp::cuda::pow2_shift_to(amax, 15);
  const float mul = ldexpf(1.f, shift);
  if (threadIdx.x == 0) inv[r] = ldexpf(1.f, -shift);
  uint16_t* out = dst + int64_t(r) * cols;
  for (int c = int(threadIdx.x); c < cols; c += kThreads)
    out[c] = __half_as_ushort(__float2half_rn(fmlp::cuda::load_scalar(row, t, c) * mul));
}

}  // namespace

fmlp_status_t moe_launch_stage_f16(const void* src, fmlp_dtype_t t, int64_t ld, int rows, int cols,
                                   uint16_t* dst, float* inv, cudaStream_t s) {
  if (rows == 0) return FMLP_SUCCESS;
  moe_sm89_stage_f16<<<unsigned(rows), kThreads, 0, s>>>(src, t, ld, cols, dst, inv);
  return launch_status("moe_sm89_stage_f16", fmt::format("{} rows", rows));
}

}  // namespace fmlp::detail
