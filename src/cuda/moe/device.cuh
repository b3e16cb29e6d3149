// Device helpers of the moe kernels: eight activations of any dtype as fp32 (vector loads when the
// row allows them), and an expert's row of a per-expert vector.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"

namespace fmlp::cuda {

// Elements [c, c + 8) of a row of dtype t; zeros past n. vec: the row is 16-byte aligned and n a
// multiple of 8, so a piece is one (two for f32) 16-byte load.
__device__ __forceinline__ void load8(const void* row, fmlp_dtype_t t, int c, int n, bool vec,
                                      float (&f)[8]) {
  if (vec && c + 8 <= n) {
    if (t == FMLP_DTYPE_F32) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(row) + c));
      const float4 b =
          __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(row) + c + 4));
      f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z,
      f[7] = b.w;
      return;
    }
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(row) + c));
    if (t == FMLP_DTYPE_F16)
      widen8<__half>(v, f);
    else
      widen8<__nv_bfloat16>(v, f);
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = c + i < n ? load_scalar(row, t, c + i) : 0.f;
}

// Expert e's row of a per-expert vector (b1, b2: [E, n] of dtype t, expert stride `stride`
// elements), or nullptr when the vector is absent.
__device__ __forceinline__ const void* expert_vec(const void* v, fmlp_dtype_t t, int64_t stride,
                                                  int e) {
  return v ? static_cast<const char*>(v) + int64_t(e) * stride * (t == FMLP_DTYPE_F32 ? 4 : 2)
           : nullptr;
}

}  // namespace fmlp::cuda
