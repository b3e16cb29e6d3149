// The mixture-of-experts op as the kernels see it: a validated, pointer-free description and its
// op-table entries (op_table.hpp). api_moe.cpp validates every argument once (host expert ids
// included); kernels trust what they receive.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.hpp"
#include "core/mlp_desc.hpp"
#include "core/op_table.hpp"

namespace fmlp::detail {

struct MoeDesc {
  int64_t tokens = 0, d = 0, hidden = 0, d_out = 0, experts = 0, top_k = 0;
  // Expert parallelism: the local experts are global ids [first_expert, first_expert + experts)
  // of global_experts (= experts, first_expert 0 without a range). Routing is over the global
  // ids; slots routed elsewhere contribute nothing.
  int64_t first_expert = 0, global_experts = 0;
  fmlp_dtype_t act_dtype = FMLP_DTYPE_INVALID;          // x, y, residual
  fmlp_dtype_t w_dtype = FMLP_DTYPE_INVALID;            // W1 and W2
  fmlp_dtype_t router_dtype = FMLP_DTYPE_INVALID;       // INVALID when the routing is given
  fmlp_dtype_t router_bias_dtype = FMLP_DTYPE_INVALID;  // INVALID when absent
  fmlp_dtype_t b1_dtype = FMLP_DTYPE_INVALID, b2_dtype = FMLP_DTYPE_INVALID;
  fmlp_activation_t activation = FMLP_ACT_RELU;
  fmlp_moe_scoring_t scoring = FMLP_MOE_SCORING_SOFTMAX;
  bool gated = false, renormalize = false, deterministic = false;
  bool round_logits = false;  // router logits rounded to act_dtype (16-bit x, router running)
  bool given_routing = false, has_residual = false, residual_is_y = false;
  bool x_vec16 = false;  // x's base and row stride are multiples of 16 bytes
  fmlp_device_type_t device = FMLP_DEVICE_CPU;
  int32_t device_id = 0;
  // Expert 0 as the mlp kernels see it with fp32 x and y (m = 0); weights_vec16 holds for every
  // expert. Lets a backend run each expert's token group through its mlp kernels.
  MlpDesc expert;
};

using MoeKernel = OpKernel<fmlp_moe_args_t, MoeDesc>;
using MoeKernelList = OpKernelList<fmlp_moe_args_t, MoeDesc>;
MoeKernelList ref_moe_kernels();
MoeKernelList cpu_moe_kernels();
MoeKernelList cuda_moe_kernels();  // src/cuda/moe/table.cpp (empty without CUDA)
std::string describe(const MoeDesc& d);

// Expert e's slice of a stacked [E, rows, cols] (or [E, n]) tensor as a 2-D (or 1-D) view.
inline fmlp_tensor_t expert_slice(const fmlp_tensor_t& t, int64_t e) {
  if (t.data == nullptr && t.ndim == 0) return t;
  fmlp_tensor_t s = t;
  s.data = static_cast<char*>(t.data) + e * t.stride[0] * int64_t(dtype_size(t.dtype));
  s.ndim = t.ndim - 1;
  for (int i = 0; i + 1 < t.ndim; ++i) s.shape[i] = t.shape[i + 1], s.stride[i] = t.stride[i + 1];
  s.shape[t.ndim - 1] = 0, s.stride[t.ndim - 1] = 0;
  return s;
}

// Expert e's dequantisation scales as the mlp op takes them: [1] out of [E], [rows] out of
// [E, rows], [row blocks, col blocks] out of [E, row blocks, col blocks]; absent stays absent.
inline fmlp_tensor_t expert_scale(const fmlp_tensor_t& s, int64_t e) {
  if (s.data == nullptr && s.ndim == 0) return s;
  if (s.ndim >= 2) return expert_slice(s, e);
  fmlp_tensor_t v = s;
  v.data = static_cast<char*>(s.data) + e * s.stride[0] * int64_t(dtype_size(s.dtype));
  v.shape[0] = 1;
  return v;
}

// Every argument checked (api_moe.cpp), the description filled in; also used by fmlp_tp_moe.
fmlp_status_t validate_moe(const fmlp_moe_args_t* a, MoeDesc* d);

// The local index of global expert id `e`, or -1 when another range holds it.
inline int64_t local_expert(const MoeDesc& d, int64_t e) {
  const int64_t l = e - d.first_expert;
  return l >= 0 && l < d.experts ? l : -1;
}

// Host routing of token t in fp64, the spec both host backends share: fills ids[top_k] (global
// ids) and weights[top_k]; `scores` holds `global_experts` doubles of scratch.
void moe_route_token(const fmlp_moe_args_t& a, const MoeDesc& d, int64_t t, double* scores,
                     int32_t* ids, double* weights);

// fmlp_moe_device_errors: reads and clears the count at the start of a cuda moe workspace
// (src/cuda/moe/table.cpp; BACKEND_UNAVAILABLE without CUDA).
fmlp_status_t cuda_moe_device_errors(void* workspace, void* stream, int32_t* count);

}  // namespace fmlp::detail
