// fp8 e4m3 experts in the cuda moe entries (sm_89+, weight-only: x and h stay 16-bit or wider,
// fp32 accumulation), the scheme of linear/sm80_mma.cu:
//   - weights are widened exactly to fp16 with cvt.rn.f16x2.e4m3x2 (one instruction per two) and
//     multiplied by fp16 mma.sync m16n8k16 with fp32 accumulators;
//   - the other operand must then be fp16. x is staged once per call (moe_stage_f16, before the
//     expert kernels) as an fp16 copy: f16 x as it is; bf16 or f32 x times a power of two per
//     token that puts its largest finite |x| in [2^14, 2^15). Every bf16 value down to 2^-24 of
//     that maximum stays exact in fp16 (f32 x is rounded to 11 bits, finer than the bf16
//     rounding the 16-bit experts apply to f32 x); the rest flush or lose bits below 2^-24 of the
//     token's largest term, far inside the bf16-grade tolerance of fp8 experts. NaN and Inf pass
//     through (they are left out of the maximum);
//   - h, between the two GEMMs, is handled the same way per slot (its largest finite |h| over
//     the hidden units it is summed over, sm80_chunked.cu / sm80_grouped.cu say which), rather than
//     rounded to bf16 as for 16-bit experts: fp16 with a power of two keeps 3 more bits than bf16,
//     and an unscaled fp16 h could overflow (65504) or sink into subnormals;
//   - the epilogues multiply the fp32 sums by the factor undoing the power of two and by the
//     expert's scale of the output row (per expert or per row), then add the bias.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda/common/decode_common.cuh"
#include "cuda/moe/moe_cuda.hpp"

namespace fmlp::cuda {

// Expert e's dequantisation scale of row r: s[e * s_e + r * s_r] (s_r = 0: one per expert).
__device__ __forceinline__ float expert_row_scale(const float* s, int64_t s_e, int64_t s_r, int e,
                                                  int r) {
  return s[int64_t(e) * s_e + int64_t(r) * s_r];
}

}  // namespace fmlp::cuda
