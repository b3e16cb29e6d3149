// decode_operands: the one place where an mlp call's tensors become the decode kernels' operand
// pointers (stacked gate/up split into two views, absent vectors as nullptr).
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/launch_util.hpp"
#include "cuda/mlp/entries.hpp"

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
  o.kp = int(fmlp::detail::padded_width(d, d.d_in));
  o.hp = int(fmlp::detail::padded_width(d, d.hidden));
  return o;
}

Fp8Scales fp8_scales(const fmlp_mlp_args_t& a, const fmlp::detail::MlpDesc& d) {
  using fmlp::detail::ScaleKind;
  Fp8Scales f{};
  const fmlp_mlp_weights_t& w = a.weights;
  f.sg = static_cast<const float*>(w.w1_scale.data);
  f.sg_stride = d.w1_scale == ScaleKind::kPerRow ? 1 : 0;
  if (!d.gated) {
  } else if (d.stacked_gate_up) {  // [1] or [2 * hidden]: gate scales, then up scales
    f.su = f.sg + (f.sg_stride ? d.hidden : 0);
    f.su_stride = f.sg_stride;
  } else {
    f.su = static_cast<const float*>(w.w_up_scale.data);
    f.su_stride = d.w_up_scale == ScaleKind::kPerRow ? 1 : 0;
  }
  f.s2 = static_cast<const float*>(w.w2_scale.data);
  f.s2_stride = d.w2_scale == ScaleKind::kPerRow ? 1 : 0;
  return f;
}

}  // namespace fmlp::cuda

namespace fmlp::detail {

int64_t padded_width(const MlpDesc& d, int64_t cols) {
  if (d.layout != WeightLayout::kCudaPacked) return cols;
  const int64_t per_load = int64_t(16 / dtype_size(d.w_dtype));  // cuda/mlp/pack.cu's row_align
  return (cols + per_load - 1) / per_load * per_load;
}

bool split_hidden_supports(const MlpDesc& d, int max_tokens, std::string* why) {
  if (d.device != FMLP_DEVICE_CUDA) return (*why = "needs CUDA device memory", false);
  if (d.deterministic)
    return (*why = "deterministic mode: the splitk kernel reduces in a fixed order", false);
  if (d.m > max_tokens)
    return (*why = fmt::format("M={} > {}; the tensor-core decode kernels take larger M", d.m,
                               max_tokens),
            false);
  if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16)
    return (*why = fmt::format("{} weights: this kernel streams bf16/fp16 only",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  if (d.d_in % 8 != 0 || d.hidden % 8 != 0)
    return (*why = fmt::format("d_in {} and hidden {} must be multiples of 8 for 16-byte loads; "
                               "the splitk kernel handles other sizes",
                               d.d_in, d.hidden),
            false);
  if (!d.weights_vec16)
    return (*why =
                "a weight matrix is not 16-byte aligned (base or row stride); pack the weights "
                "with fmlp_mlp_pack",
            false);
  return true;
}

size_t split_hidden_workspace(const MlpDesc& d) {
  return align_up(size_t(d.m) * size_t(d.d_out) * 4) + align_up(4);
}

void split_hidden_scratch(void* workspace, const MlpDesc& d, float** acc, unsigned** counter) {
  char* base = static_cast<char*>(workspace);
  *acc = reinterpret_cast<float*>(base);
  *counter = reinterpret_cast<unsigned*>(base + align_up(size_t(d.m) * size_t(d.d_out) * 4));
}

}  // namespace fmlp::detail
