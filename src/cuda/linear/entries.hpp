// The launch contracts of the cuda linear entries in table order (linear/table.cpp lists them;
// each is defined in the file of its name: linear_sm80_mma in linear/sm80_mma.cu, ...), and the
// operands as their kernels read them.
#pragma once
#include <cstddef>
#include <string>

#include "core/linear_desc.hpp"
#include "cuda/common/device.hpp"

namespace fmlp::detail {

// The operands of one linear call as the CUDA kernels read them (their parameter structs derive
// from it): absent bias and scales as nullptr, strides in elements. Filled by linear_operands().
struct LinearOperands {
  const void* x;
  void* y;
  const void* w;
  const void* bias;      // nullptr: no bias
  const float* scale;    // fp8 weights: [1] or [N]
  const float* x_scale;  // fp8 x (W8A8): [1] or [M]
  int scale_per_row, x_scale_per_row;
  int64_t x_ld, y_ld, w_ld;
  fmlp_dtype_t x_t, y_t, bias_t;
  int m, n, k;
};

// No cuda linear entry reads block scales yet: every supports() starts here.
inline bool refuses_block_scales(const LinearDesc& d, std::string* why) {
  if (d.w_scale != ScaleKind::kBlock) return false;
  *why =
      "block-scaled fp8 weights (w_scale [ceil(N / 128), ceil(K / 128)]) run on the ref and cpu "
      "backends only; pass per-row scales [N] (fmlp_quantize_fp8 with a [N] scale) for the "
      "cuda kernels";
  return true;
}

inline LinearOperands linear_operands(const fmlp_linear_args_t& a, const LinearDesc& d) {
  LinearOperands o{};
  o.x = a.x.data;
  o.y = a.y.data;
  o.w = a.w.data;
  o.bias = d.bias_dtype == FMLP_DTYPE_INVALID ? nullptr : a.bias.data;
  o.scale = d.w_scale == ScaleKind::kNone ? nullptr : static_cast<const float*>(a.w_scale.data);
  o.x_scale = d.x_scale == ScaleKind::kNone ? nullptr : static_cast<const float*>(a.x_scale.data);
  o.scale_per_row = d.w_scale == ScaleKind::kPerRow;
  o.x_scale_per_row = d.x_scale == ScaleKind::kPerRow;
  o.x_ld = a.x.stride[0];
  o.y_ld = a.y.stride[0];
  o.w_ld = a.w.stride[0];
  o.x_t = d.act_dtype;
  o.y_t = d.out_dtype;
  o.bias_t = d.bias_dtype;
  o.m = int(d.m), o.n = int(d.n), o.k = int(d.k);
  return o;
}

// linear_sm90_cublaslt (sm90_cublaslt.cpp): one cuBLASLt GEMM for M >= 2, listed first.
FMLP_DECLARE_OP_ENTRY(linear_sm90_cublaslt, fmlp_linear_args_t, LinearDesc);

// linear_sm80_mma (sm80_mma.cu): the tensor-core entry.
FMLP_DECLARE_OP_ENTRY(linear_sm80_mma, fmlp_linear_args_t, LinearDesc);

// linear_sm90_cublaslt_fp8 (sm90_cublaslt_fp8.cpp): W8A8 through cuBLASLt's fp8 GEMM with
// per-row (outer-vector) or per-tensor scales.
FMLP_DECLARE_OP_ENTRY(linear_sm90_cublaslt_fp8, fmlp_linear_args_t, LinearDesc);

// linear_sm80_stream (sm80_stream.cu): the memory-order GEMV for M <= 4, 16-bit weights.
FMLP_DECLARE_OP_ENTRY(linear_sm80_stream, fmlp_linear_args_t, LinearDesc);

// linear_sm90_wgmma_fp8 (sm90_wgmma_fp8.cu): fp8 weights on the tensor cores for M <= 4, sm_90a.
FMLP_DECLARE_OP_ENTRY(linear_sm90_wgmma_fp8, fmlp_linear_args_t, LinearDesc);

// linear_sm80_gemv (sm80_gemv.cu): the general GEMV on the CUDA cores, any dtypes, listed last.
FMLP_DECLARE_OP_ENTRY(linear_sm80_gemv, fmlp_linear_args_t, LinearDesc);

}  // namespace fmlp::detail
