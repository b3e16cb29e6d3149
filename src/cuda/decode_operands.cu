// decode_operands: the one place where an mlp call's tensors become the decode kernels' operand
// pointers (stacked gate/up split into two views, absent vectors as nullptr).
#include "core/dtype.hpp"
#include "cuda/decode_common.cuh"

namespace fmlp::cuda {

DecodeOperands decode_operands(const fmlp_mlp_args_t& a, const fmlp::detail::MlpDesc& d) {
  const fmlp_mlp_weights_t& w = a.weights;
  DecodeOperands o{};
  o.x = a.x.data;
  o.y = a.y.data;
  o.res = d.has_residual ? a.residual.data : nullptr;
  o.x_ld = a.x.stride[0];
  o.y_ld = a.y.stride[0];
  o.res_ld = d.has_residual ? a.residual.stride[0] : 0;
  o.wg = w.w1.data;
  o.wg_ld = w.w1.stride[0];
  if (d.gated && d.stacked_gate_up) {
    o.wu = static_cast<const char*>(w.w1.data) +
           d.hidden * w.w1.stride[0] * int64_t(fmlp::dtype_size(d.w_dtype));
    o.wu_ld = w.w1.stride[0];
  } else if (d.gated) {
    o.wu = w.w_up.data;
    o.wu_ld = w.w_up.stride[0];
  }
  o.w2 = w.w2.data;
  o.w2_ld = w.w2.stride[0];
  o.bg = d.has_b1 ? w.b1.data : nullptr;
  o.bg_t = w.b1.dtype;
  if (d.gated && d.stacked_gate_up && d.has_b1) {
    o.bu = static_cast<const char*>(w.b1.data) + d.hidden * int64_t(fmlp::dtype_size(w.b1.dtype));
    o.bu_t = w.b1.dtype;
  } else if (d.has_b_up) {
    o.bu = w.b_up.data;
    o.bu_t = w.b_up.dtype;
  }
  o.b2 = d.has_b2 ? w.b2.data : nullptr;
  o.b2_t = w.b2.dtype;
  o.gamma = d.has_norm_weight ? w.norm_weight.data : nullptr;
  o.gamma_t = w.norm_weight.dtype;
  o.beta = d.has_norm_bias ? w.norm_bias.data : nullptr;
  o.beta_t = w.norm_bias.dtype;
  o.act_t = d.act_dtype;
  o.act = d.activation;
  o.norm = d.norm;
  o.eps = d.norm_eps;
  o.m = int(d.m);
  o.k = int(d.d_in);
  o.h = int(d.hidden);
  o.n = int(d.d_out);
  return o;
}

}  // namespace fmlp::cuda
