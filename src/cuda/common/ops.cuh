// Launch contracts of the cuda linear and softmax kernels, shared by their launchers and the op
// table.
#pragma once
#include <cstddef>
#include <string>

#include "core/linear_desc.hpp"

namespace fmlp::detail {

int cuda_sm_count(int device);            // backend.cpp; 0 when unreadable
int64_t cuda_l2_bytes(int device);        // backend.cpp; 0 when unreadable
int cuda_compute_capability(int device);  // backend.cpp; major * 10 + minor, 0 when unreadable

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

// Common checks of the cuda op kernels: device memory, compute capability 8.0+, 32-bit sizes.
bool cuda_op_device_ok(fmlp_device_type_t device, int device_id, std::string* why);

// linear_sm80_mma (linear_mma.cu): the tensor-core entry, listed in linear_gemv.cu.
bool linear_mma_supports(const LinearDesc& d, std::string* why);
size_t linear_mma_workspace(const LinearDesc& d);
fmlp_status_t linear_mma_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                             void* stream);

// linear_sm80_stream (linear_stream.cu): the memory-order GEMV for M <= 4, 16-bit weights.
bool linear_stream_supports(const LinearDesc& d, std::string* why);
size_t linear_stream_workspace(const LinearDesc& d);
fmlp_status_t linear_stream_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                                void* stream);

// linear_sm90_wgmma_fp8 (linear_wgmma_fp8.cu): fp8 weights on the tensor cores for M <= 4, sm_90a.
bool linear_wgmma_fp8_supports(const LinearDesc& d, std::string* why);
size_t linear_wgmma_fp8_workspace(const LinearDesc& d);
fmlp_status_t linear_wgmma_fp8_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                                   void* stream);

// linear_sm90_cublaslt (linear_cublaslt.cpp): one cuBLASLt GEMM for M >= 2, listed first.
bool linear_cublaslt_supports(const LinearDesc& d, std::string* why);
size_t linear_cublaslt_workspace(const LinearDesc& d);
fmlp_status_t linear_cublaslt_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                                  void* stream);

}  // namespace fmlp::detail
