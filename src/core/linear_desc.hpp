// The linear and softmax ops as the kernels see them: validated, pointer-free descriptions and
// their op-table entries (op_table.hpp). api_linear.cpp / api_softmax.cpp validate every argument
// once; kernels trust what they receive.
#pragma once
#include <cstdint>
#include <string>

#include "core/mlp_desc.hpp"
#include "core/op_table.hpp"

namespace fmlp::detail {

struct LinearDesc {
  int64_t m = 0, n = 0, k = 0;
  fmlp_dtype_t act_dtype = FMLP_DTYPE_INVALID;  // x: f32, f16, bf16, or f8_e4m3 (W8A8)
  fmlp_dtype_t out_dtype = FMLP_DTYPE_INVALID;  // y: act_dtype, or f32/f16/bf16 for W8A8
  fmlp_dtype_t w_dtype = FMLP_DTYPE_INVALID;
  fmlp_dtype_t bias_dtype = FMLP_DTYPE_INVALID;  // INVALID when there is no bias
  ScaleKind w_scale = ScaleKind::kNone;
  ScaleKind x_scale = ScaleKind::kNone;  // per tensor or per row (token) for f8_e4m3 x
  bool w8a8() const { return act_dtype == FMLP_DTYPE_F8_E4M3; }
  fmlp_device_type_t device = FMLP_DEVICE_CPU;
  int32_t device_id = 0;
  // W starts on a 16-byte boundary, its row stride is a multiple of 16 bytes and K fills whole
  // 16-byte chunks, so kernels may stream it with 16-byte vector loads.
  bool w_vec16 = false;
  // W starts on a 16-byte boundary and its row stride is a multiple of 16 bytes, K of any size:
  // every row's whole chunks take 16-byte loads and the kernels that read a row's last, partial
  // chunk by its own bytes (linear_sm80_stream, linear_sm80_mma) stream it too. A caller gets it
  // for odd K by storing W with a padded row stride.
  bool w_rows16 = false;
  int64_t w_ld = 0;  // W's row stride in elements, for explain
  // x and y start on 16-byte boundaries with row strides of whole 16-byte chunks.
  bool io_vec16 = false;
};

using LinearKernel = OpKernel<fmlp_linear_args_t, LinearDesc>;
using LinearKernelList = OpKernelList<fmlp_linear_args_t, LinearDesc>;
LinearKernelList ref_linear_kernels();
LinearKernelList cpu_linear_kernels();
LinearKernelList cuda_linear_kernels();  // empty when CUDA is not built
std::string describe(const LinearDesc& d);

struct SoftmaxDesc {
  int64_t rows = 0, n = 0;
  fmlp_dtype_t dtype = FMLP_DTYPE_INVALID;  // x and y
  float temperature = 1.f;
  bool log = false;
  bool in_place = false;  // y is the very same view as x
  fmlp_device_type_t device = FMLP_DEVICE_CPU;
  int32_t device_id = 0;
};

using SoftmaxKernel = OpKernel<fmlp_softmax_args_t, SoftmaxDesc>;
using SoftmaxKernelList = OpKernelList<fmlp_softmax_args_t, SoftmaxDesc>;
SoftmaxKernelList ref_softmax_kernels();
SoftmaxKernelList cpu_softmax_kernels();
SoftmaxKernelList cuda_softmax_kernels();  // empty when CUDA is not built
std::string describe(const SoftmaxDesc& d);

// A 2-D view's row r as bytes (1-D views are one row).
inline const char* row_ptr(const fmlp_tensor_t& t, int64_t r, size_t esize) {
  return static_cast<const char*>(t.data) + (t.ndim == 2 ? r * t.stride[0] : 0) * int64_t(esize);
}

}  // namespace fmlp::detail
