// Validation of fmlp_mlp_args_t: the single place where mlp arguments are checked. Kernels trust
// what passes here.
#include "core/mlp_validate.hpp"

#include <array>
#include <cmath>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor_check.hpp"

namespace fmlp::detail {
namespace {

bool is_act_dtype(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F32 || t == FMLP_DTYPE_F16 || t == FMLP_DTYPE_BF16;
}

#define FMLP_TRY(expr)                           \
  do {                                           \
    const fmlp_status_t status_ = (expr);        \
    if (status_ != FMLP_SUCCESS) return status_; \
  } while (0)

fmlp_status_t check_vector(const char* name, const fmlp_tensor_t& t, int64_t n, const char* doc) {
  const int64_t shape[1] = {n};
  FMLP_TRY(check_tensor(name, t, 1, shape, doc));
  if (!is_act_dtype(t.dtype))
    return fail(FMLP_ERROR_DTYPE_MISMATCH,
                "{} has dtype {}; biases and norm parameters must be "
                "f32, f16 or bf16",
                name, fmlp_dtype_name(t.dtype));
  return FMLP_SUCCESS;
}

// Block scales of fp8 weight w [rows, cols]: fp32 [halves * ceil(rows / halves / 128),
// ceil(cols / 128)]. halves = 2 for a stacked [gate; up] w1: each half has its own block rows (the
// gate scales, then the up scales), as the checkpoints store gate_proj and up_proj.
fmlp_status_t check_block_scale(const char* name, const fmlp_tensor_t& scale,
                                const fmlp_tensor_t& w, int halves) {
  const int64_t half_rows = w.shape[0] / halves;
  const int64_t rb = halves * block_count(half_rows), cb = block_count(w.shape[1]);
  const int64_t want[2] = {rb, cb};
  const char* doc = halves == 2 ? "[2 * ceil(hidden / 128), ceil(d_in / 128)] (the gate's block "
                                  "scales, then the up's: torch.cat of gate_proj's and "
                                  "up_proj's weight_scale_inv; or pass w_up separately)"
                                : "[ceil(rows / 128), ceil(cols / 128)] (one per 128 x 128 block)";
  FMLP_TRY(check_tensor(name, scale, 2, want, doc));
  if (scale.dtype != FMLP_DTYPE_F32)
    return fail(FMLP_ERROR_BAD_SCALE, "{} has dtype {}; scales must be f32", name,
                fmlp_dtype_name(scale.dtype));
  if (scale.device_type == FMLP_DEVICE_CPU) {  // device scales are checked at pack time
    const float* s = static_cast<const float*>(scale.data);
    for (int64_t i = 0; i < rb; ++i)
      for (int64_t j = 0; j < cb; ++j) {
        const float v = s[i * scale.stride[0] + j * scale.stride[1]];
        if (!(std::isfinite(v) && v > 0.f))
          return fail(FMLP_ERROR_BAD_SCALE, "{}[{}, {}] is {}; scales must be finite and > 0", name,
                      i, j, v);
      }
  }
  return FMLP_SUCCESS;
}

fmlp_status_t check_scale(const char* name, const char* weight_name, const fmlp_tensor_t& scale,
                          const fmlp_tensor_t& w, int halves, ScaleKind* kind) {
  const bool fp8 = w.dtype == FMLP_DTYPE_F8_E4M3;
  if (tensor_absent(scale)) {
    if (fp8)
      return fail(FMLP_ERROR_BAD_SCALE,
                  "{} is fp8 e4m3 but {} is absent; pass fp32 scales of "
                  "shape [1] (per tensor), [{}] (per row) or 2-D [ceil(rows / 128), ceil(cols / "
                  "128)] (per 128 x 128 block)",
                  weight_name, name, w.shape[0]);
    *kind = ScaleKind::kNone;
    return FMLP_SUCCESS;
  }
  if (!fp8)
    return fail(FMLP_ERROR_BAD_SCALE,
                "{} is given but {} is {}; scales apply to fp8 e4m3 "
                "weights only, drop the scale",
                name, weight_name, fmlp_dtype_name(w.dtype));
  if (scale.ndim == 2) {
    FMLP_TRY(check_block_scale(name, scale, w, halves));
    *kind = ScaleKind::kBlock;
    return FMLP_SUCCESS;
  }
  const int64_t any[1] = {-1};
  FMLP_TRY(
      check_tensor(name, scale, 1, any, "[1], [rows] or 2-D [ceil(rows / 128), ceil(cols / 128)]"));
  if (scale.dtype != FMLP_DTYPE_F32)
    return fail(FMLP_ERROR_BAD_SCALE, "{} has dtype {}; scales must be f32", name,
                fmlp_dtype_name(scale.dtype));
  if (scale.shape[0] == 1 && w.shape[0] != 1)
    *kind = ScaleKind::kPerTensor;
  else if (scale.shape[0] == w.shape[0])
    *kind = ScaleKind::kPerRow;
  else
    return fail(FMLP_ERROR_BAD_SCALE,
                "{} has {} entries; expected 1 (per tensor) or {} (one per "
                "row of {}), or a 2-D block scale",
                name, scale.shape[0], w.shape[0], weight_name);
  if (scale.device_type == FMLP_DEVICE_CPU) {  // device scales are checked at pack time
    const float* s = static_cast<const float*>(scale.data);
    for (int64_t i = 0; i < scale.shape[0]; ++i)
      if (!(std::isfinite(s[i]) && s[i] > 0.f))
        return fail(FMLP_ERROR_BAD_SCALE, "{}[{}] is {}; scales must be finite and > 0", name, i,
                    s[i]);
  }
  return FMLP_SUCCESS;
}

// Every weight-side tensor of the op, with its name for messages.
std::array<NamedTensor, 11> weight_tensors(const fmlp_mlp_weights_t& w) {
  return {{{&w.w1, "weights.w1"},
           {&w.w1_scale, "weights.w1_scale"},
           {&w.b1, "weights.b1"},
           {&w.w_up, "weights.w_up"},
           {&w.w_up_scale, "weights.w_up_scale"},
           {&w.b_up, "weights.b_up"},
           {&w.w2, "weights.w2"},
           {&w.w2_scale, "weights.w2_scale"},
           {&w.b2, "weights.b2"},
           {&w.norm_weight, "weights.norm_weight"},
           {&w.norm_bias, "weights.norm_bias"}}};
}

}  // namespace

fmlp_status_t validate_mlp_weights(const fmlp_mlp_weights_t& w, const fmlp_mlp_config_t& c,
                                   int64_t d_out_hint, MlpDesc* d) {
  if (unsigned(c.activation) > unsigned(FMLP_ACT_RELU2))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "config.activation is {}; expected one of relu (0), "
                "gelu (1), gelu_tanh (2), silu (3), relu2 (4)",
                int(c.activation));
  if (unsigned(c.norm) > unsigned(FMLP_NORM_RMSNORM))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "config.norm is {}; expected none (0), layernorm (1) "
                "or rmsnorm (2)",
                int(c.norm));
  if (c.gated != 0 && c.gated != 1)
    return fail(FMLP_ERROR_INVALID_VALUE, "config.gated is {}; expected 0 or 1", c.gated);
  if (c.norm != FMLP_NORM_NONE && !(std::isfinite(c.norm_eps) && c.norm_eps > 0.f))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "config.norm_eps is {}; a norm needs a finite eps > 0 "
                "(1e-5 is the usual value)",
                c.norm_eps);
  d->activation = c.activation;
  d->norm = c.norm;
  d->norm_eps = c.norm_eps;
  d->gated = c.gated == 1;
  d->deterministic = c.deterministic != 0;

  if (tensor_absent(w.w1)) return fail(FMLP_ERROR_NULL_POINTER, "weights.w1 is absent");
  if (tensor_absent(w.w2)) return fail(FMLP_ERROR_NULL_POINTER, "weights.w2 is absent");
  const int64_t any2[2] = {-1, -1};
  FMLP_TRY(check_tensor("weights.w1", w.w1, 2, any2, "[hidden, d_in]"));
  FMLP_TRY(check_tensor("weights.w2", w.w2, 2, any2, "[d_out, hidden]"));
  d->w_dtype = w.w1.dtype;
  d->d_in = w.w1.shape[1];
  d->d_out = w.w2.shape[0];
  d->stacked_gate_up = d->gated && tensor_absent(w.w_up);
  if (!d->gated && !tensor_absent(w.w_up))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "weights.w_up is given but config.gated is 0; set "
                "gated = 1 or drop w_up");
  if (d->stacked_gate_up && w.w1.shape[0] % 2 != 0)
    return fail(FMLP_ERROR_SHAPE_MISMATCH,
                "weights.w1 has {} rows; gated without weights.w_up "
                "needs the stacked [2*hidden, d_in] form (gate rows, then up rows), an even count",
                w.w1.shape[0]);
  d->hidden = d->stacked_gate_up ? w.w1.shape[0] / 2 : w.w1.shape[0];
  if (d_out_hint >= 0 && d->d_out != d_out_hint)
    return fail(FMLP_ERROR_SHAPE_MISMATCH,
                "weights.w2 has {} rows but y has {} columns; "
                "w2 must be [d_out, hidden] = [{}, {}]",
                d->d_out, d_out_hint, d_out_hint, d->hidden);
  if (d->d_in == 0 || d->hidden == 0 || d->d_out == 0)
    return fail(FMLP_ERROR_SHAPE_MISMATCH, "d_in ({}), hidden ({}) and d_out ({}) must all be > 0",
                d->d_in, d->hidden, d->d_out);
  const int64_t H = d->hidden;
  const int64_t w2_shape[2] = {d->d_out, H};
  FMLP_TRY(check_tensor("weights.w2", w.w2, 2, w2_shape, "[d_out, hidden]"));
  const int64_t w1_rows = d->stacked_gate_up ? 2 * H : H;
  const int64_t w1_shape[2] = {w1_rows, d->d_in};
  if (d->gated && !d->stacked_gate_up) {
    FMLP_TRY(check_tensor("weights.w_up", w.w_up, 2, w1_shape, "[hidden, d_in]"));
  }
  const fmlp_tensor_t* mats[3] = {&w.w1, &w.w_up, &w.w2};
  const char* mat_names[3] = {"weights.w1", "weights.w_up", "weights.w2"};
  for (int i = 0; i < 3; ++i) {
    if (tensor_absent(*mats[i])) continue;
    const fmlp_dtype_t t = mats[i]->dtype;
    if (!is_act_dtype(t) && t != FMLP_DTYPE_F8_E4M3)
      return fail(FMLP_ERROR_DTYPE_MISMATCH,
                  "{} has dtype {}; weights must be f32, f16, bf16 or "
                  "f8_e4m3",
                  mat_names[i], fmlp_dtype_name(t));
    if (t != d->w_dtype)
      return fail(FMLP_ERROR_DTYPE_MISMATCH,
                  "{} is {} but weights.w1 is {}; all weight matrices "
                  "must share one dtype",
                  mat_names[i], fmlp_dtype_name(t), fmlp_dtype_name(d->w_dtype));
  }
  FMLP_TRY(check_scale("weights.w1_scale", "weights.w1", w.w1_scale, w.w1,
                       d->stacked_gate_up ? 2 : 1, &d->w1_scale));
  if (d->gated && !d->stacked_gate_up) {
    FMLP_TRY(
        check_scale("weights.w_up_scale", "weights.w_up", w.w_up_scale, w.w_up, 1, &d->w_up_scale));
    // The packed form stacks gate and up into one w1 with one scale layout.
    if ((d->w1_scale == ScaleKind::kBlock) != (d->w_up_scale == ScaleKind::kBlock))
      return fail(FMLP_ERROR_BAD_SCALE,
                  "weights.{} is a 2-D block scale but weights.{} is {}; gate and up scales must "
                  "both be block scales or both per row / per tensor (re-quantise the other with "
                  "fmlp_quantize_fp8 and a 2-D scale)",
                  d->w1_scale == ScaleKind::kBlock ? "w1_scale" : "w_up_scale",
                  d->w1_scale == ScaleKind::kBlock ? "w_up_scale" : "w1_scale",
                  shape_string(d->w1_scale == ScaleKind::kBlock ? w.w_up_scale : w.w1_scale));
  } else if (!tensor_absent(w.w_up_scale)) {
    return fail(FMLP_ERROR_BAD_SCALE,
                "weights.w_up_scale is given but there is no separate "
                "weights.w_up; put the up scales after the gate scales in weights.w1_scale");
  }
  FMLP_TRY(check_scale("weights.w2_scale", "weights.w2", w.w2_scale, w.w2, 1, &d->w2_scale));

  d->has_b1 = !tensor_absent(w.b1);
  if (d->has_b1)
    FMLP_TRY(
        check_vector("weights.b1", w.b1, w1_rows, d->stacked_gate_up ? "[2*hidden]" : "[hidden]"));
  d->has_b_up = !tensor_absent(w.b_up);
  if (d->has_b_up) {
    if (!d->gated || d->stacked_gate_up)
      return fail(FMLP_ERROR_INVALID_VALUE,
                  "weights.b_up is given but there is no separate "
                  "weights.w_up; {}",
                  d->gated ? "put the up bias after the gate bias in b1" : "drop it (dense MLP)");
    FMLP_TRY(check_vector("weights.b_up", w.b_up, H, "[hidden]"));
  }
  d->has_b2 = !tensor_absent(w.b2);
  if (d->has_b2) FMLP_TRY(check_vector("weights.b2", w.b2, d->d_out, "[d_out]"));
  d->has_norm_weight = !tensor_absent(w.norm_weight);
  d->has_norm_bias = !tensor_absent(w.norm_bias);
  if (c.norm == FMLP_NORM_NONE && (d->has_norm_weight || d->has_norm_bias))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "weights.norm_{} is given but config.norm is none; set "
                "config.norm or drop it",
                d->has_norm_weight ? "weight" : "bias");
  if (c.norm == FMLP_NORM_RMSNORM && d->has_norm_bias)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "weights.norm_bias is given but RMSNorm has no bias; "
                "drop it or use layernorm");
  if (d->has_norm_weight)
    FMLP_TRY(check_vector("weights.norm_weight", w.norm_weight, d->d_in, "[d_in]"));
  if (d->has_norm_bias) FMLP_TRY(check_vector("weights.norm_bias", w.norm_bias, d->d_in, "[d_in]"));

  // One device for everything.
  d->device = w.w1.device_type;
  d->device_id = w.w1.device_id;
  d->weights_vec16 = true;
  for (const fmlp_tensor_t* m : {&w.w1, &w.w_up, &w.w2}) {
    if (tensor_absent(*m)) continue;
    const int64_t row_bytes = m->stride[0] * int64_t(dtype_size(m->dtype));
    if (uintptr_t(m->data) % 16 != 0 || (m->shape[0] > 1 && row_bytes % 16 != 0))
      d->weights_vec16 = false;
  }
  const auto all = weight_tensors(w);
  return check_one_device(all.data(), all.data() + all.size(), d->device, d->device_id,
                          "weights.w1 is");
}

fmlp_status_t validate_mlp_activations(const fmlp_tensor_t& y, const fmlp_tensor_t& x,
                                       const fmlp_tensor_t* residual, const fmlp_mlp_weights_t& w,
                                       MlpDesc* d) {
  if (tensor_absent(x)) return fail(FMLP_ERROR_NULL_POINTER, "x is absent; pass [M, d_in]");
  if (tensor_absent(y)) return fail(FMLP_ERROR_NULL_POINTER, "y is absent; pass [M, d_out]");
  const int64_t x_shape[2] = {-1, d->d_in};
  FMLP_TRY(check_tensor("x", x, 2, x_shape, "[M, d_in]"));
  d->m = x.shape[0];
  const int64_t y_shape[2] = {d->m, d->d_out};
  FMLP_TRY(check_tensor("y", y, 2, y_shape, "[M, d_out]"));
  if (!is_act_dtype(x.dtype))
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "x has dtype {}; activations must be f32, f16 or bf16",
                fmlp_dtype_name(x.dtype));
  if (y.dtype != x.dtype)
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "y is {} but x is {}; y must have x's dtype",
                fmlp_dtype_name(y.dtype), fmlp_dtype_name(x.dtype));
  d->act_dtype = x.dtype;
  d->has_residual = residual != nullptr && !tensor_absent(*residual);
  d->residual_is_y = false;
  if (d->has_residual) {
    FMLP_TRY(check_tensor("residual", *residual, 2, y_shape, "[M, d_out]"));
    if (residual->dtype != x.dtype)
      return fail(FMLP_ERROR_DTYPE_MISMATCH,
                  "residual is {} but x is {}; residual must have x's "
                  "dtype",
                  fmlp_dtype_name(residual->dtype), fmlp_dtype_name(x.dtype));
  }
  const NamedTensor acts[3] = {{&x, "x"}, {&y, "y"}, {residual, "residual"}};
  FMLP_TRY(check_one_device(acts, acts + (d->has_residual ? 3 : 2), d->device, d->device_id,
                            "the weights are"));
  // y may not overlap any input, except a residual given as the very same view (in-place add).
  const ByteRange yr = byte_range(y);
  if (ranges_overlap(yr, byte_range(x)))
    return fail(FMLP_ERROR_ALIASING,
                "y overlaps x; kernels read x while y is written, so pass a "
                "separate output buffer");
  if (d->has_residual && ranges_overlap(yr, byte_range(*residual))) {
    if (!same_view(y, *residual))
      return fail(FMLP_ERROR_ALIASING,
                  "residual overlaps y without being the same view; pass "
                  "exactly y (in-place add) or a separate buffer");
    d->residual_is_y = true;
  }
  for (const NamedTensor& n : weight_tensors(w))
    if (ranges_overlap(yr, byte_range(*n.t)))
      return fail(FMLP_ERROR_ALIASING,
                  "y overlaps {}; the output must not share memory with a "
                  "weight",
                  n.name);
  return FMLP_SUCCESS;
}

fmlp_status_t validate_mlp(const fmlp_mlp_args_t* args, MlpDesc* d) {
  if (args == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "args is NULL");
  const int64_t d_out_hint = args->y.ndim == 2 ? args->y.shape[1] : -1;
  FMLP_TRY(validate_mlp_weights(args->weights, args->config, d_out_hint, d));
  return validate_mlp_activations(args->y, args->x, &args->residual, args->weights, d);
}

}  // namespace fmlp::detail
