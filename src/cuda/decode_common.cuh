// Device helpers shared by the decode kernels: dtype widening of 16-byte weight
// chunks, warp sums, optional-vector loads.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "core/mlp_desc.hpp"
#include "cuda/common.cuh"

namespace fmlp::cuda {

// Eight bf16/fp16 weights of a 16-byte chunk as fp32 (bf16: the bits shifted into place).
template <typename WT>
__device__ __forceinline__ void widen8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<WT, __half>) {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    } else {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// An optional vector (biases, norm parameters): `absent` when there is none.
__device__ __forceinline__ float opt(const void* p, fmlp_dtype_t t, int64_t i, float absent) {
  return p ? load_scalar(p, t, i) : absent;
}

// The operands of one mlp call as the decode kernels read them (kernel parameter structs derive
// from it): stacked gate/up resolved into two row-strided views, absent vectors as nullptr,
// strides in elements. Filled on the host by decode_operands().
struct DecodeOperands {
  const void* x;
  void* y;
  const void* res;
  int64_t x_ld, y_ld, res_ld;
  const void* wg;  // dense: W1; gated: gate rows
  const void* wu;  // gated: up rows
  const void* w2;
  int64_t wg_ld, wu_ld, w2_ld;
  const void *bg, *bu, *b2, *gamma, *beta;
  fmlp_dtype_t act_t, bg_t, bu_t, b2_t, gamma_t, beta_t;
  fmlp_activation_t act;
  fmlp_norm_t norm;
  float eps;
  int m, k, h, n;
};

DecodeOperands decode_operands(const fmlp_mlp_args_t& a, const fmlp::detail::MlpDesc& d);

}  // namespace fmlp::cuda
