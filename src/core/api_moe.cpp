// C ABI of the mixture-of-experts op: the one place its arguments are validated (host expert ids
// included), then dispatch through the op table (op_table.hpp).
#include <iterator>

#include "core/error.hpp"
#include "core/mlp_validate.hpp"
#include "core/moe_desc.hpp"
#include "core/planner.hpp"
#include "core/tensor_check.hpp"

namespace fmlp::detail {
namespace {

#define FMLP_TRY(expr)                           \
  do {                                           \
    const fmlp_status_t status_ = (expr);        \
    if (status_ != FMLP_SUCCESS) return status_; \
  } while (0)

bool is_act_dtype(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F32 || t == FMLP_DTYPE_F16 || t == FMLP_DTYPE_BF16;
}

fmlp_status_t check_float_dtype(const char* name, const fmlp_tensor_t& t) {
  if (!is_act_dtype(t.dtype))
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "{} has dtype {}; it must be f32, f16 or bf16", name,
                fmlp_dtype_name(t.dtype));
  return FMLP_SUCCESS;
}

fmlp_status_t check_config(const fmlp_moe_config_t& c) {
  if (c.num_experts < 1)
    return fail(FMLP_ERROR_INVALID_VALUE, "config.num_experts is {}; it must be >= 1",
                c.num_experts);
  if (c.first_expert < 0)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "config.first_expert is {}; it is the global id of local expert 0 and must be >= "
                "0 (0 without expert parallelism)",
                c.first_expert);
  if (c.global_experts < 0)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "config.global_experts is {}; pass the number of experts routed over (the rows of "
                "router_w), or 0 when w1/w2 hold every expert",
                c.global_experts);
  const bool range = c.global_experts != 0;
  const int64_t global = range ? c.global_experts : c.num_experts;
  if (int64_t(c.first_expert) + c.num_experts > global)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "config.first_expert {} + config.num_experts {} exceeds the global expert count "
                "{}{}; the local experts must be a range of the global ones (set global_experts "
                "to the router's expert count, or first_expert to 0 without expert parallelism)",
                c.first_expert, c.num_experts, global,
                range ? " (config.global_experts)" : " (config.global_experts is 0: num_experts)");
  if (c.top_k < 1 || c.top_k > global)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "config.top_k is {} but config.{} is {}; top_k must be in [1, {}]", c.top_k,
                range ? "global_experts" : "num_experts", global,
                range ? "global_experts" : "num_experts");
  if (unsigned(c.scoring) > unsigned(FMLP_MOE_SCORING_SIGMOID))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "config.scoring is {}; expected FMLP_MOE_SCORING_SOFTMAX (0) or "
                "FMLP_MOE_SCORING_SIGMOID (1)",
                int(c.scoring));
  if (c.round_router_logits != 0 && c.round_router_logits != 1)
    return fail(FMLP_ERROR_INVALID_VALUE, "config.round_router_logits is {}; expected 0 or 1",
                c.round_router_logits);
  if (c.renormalize != 0 && c.renormalize != 1)
    return fail(FMLP_ERROR_INVALID_VALUE, "config.renormalize is {}; expected 0 or 1",
                c.renormalize);
  return FMLP_SUCCESS;
}

fmlp_status_t check_routing(const fmlp_moe_args_t& a, MoeDesc* d) {
  const bool router = !tensor_absent(a.router_w);
  const bool ids = a.topk_ids != nullptr, wts = a.topk_weights != nullptr;
  if (ids != wts)
    return fail(FMLP_ERROR_NULL_POINTER,
                "{} is given but {} is NULL; pass both topk_ids and topk_weights to give the "
                "routing, or neither to run the router",
                ids ? "topk_ids" : "topk_weights", ids ? "topk_weights" : "topk_ids");
  if (ids && router)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "both router_w and topk_ids are given; pass the router or the routing, not both");
  if (!ids && !router)
    return fail(FMLP_ERROR_NULL_POINTER,
                "router_w is absent and topk_ids is NULL; pass the router [E, d] or the routing "
                "(topk_ids and topk_weights [T, top_k])");
  d->given_routing = ids;
  const bool range = a.config.global_experts != 0;
  if (router) {
    const int64_t shape[2] = {d->global_experts, d->d};
    FMLP_TRY(check_tensor("router_w", a.router_w, 2, shape,
                          range ? "[global_experts, d] (every expert, also with a local range)"
                                : "[num_experts, d]"));
    FMLP_TRY(check_float_dtype("router_w", a.router_w));
    d->router_dtype = a.router_w.dtype;
    if (!tensor_absent(a.router_b)) {
      const int64_t bs[1] = {d->global_experts};
      FMLP_TRY(check_tensor("router_b", a.router_b, 1, bs,
                            range ? "[global_experts]" : "[num_experts]"));
      FMLP_TRY(check_float_dtype("router_b", a.router_b));
      d->router_bias_dtype = a.router_b.dtype;
    }
    return FMLP_SUCCESS;
  }
  if (!tensor_absent(a.router_b))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "router_b is given but router_w is absent; the bias belongs to the router");
  if (uintptr_t(a.topk_ids) % alignof(int32_t) || uintptr_t(a.topk_weights) % alignof(float))
    return fail(FMLP_ERROR_MISALIGNED, "topk_ids and topk_weights must be 4-byte aligned");
  if (a.x.device_type == FMLP_DEVICE_CPU)  // device ids cannot be read without a sync
    for (int64_t t = 0; t < d->tokens; ++t)
      for (int64_t j = 0; j < d->top_k; ++j) {
        const int32_t e = a.topk_ids[t * d->top_k + j];
        if (e < 0 || e >= d->global_experts)
          return fail(FMLP_ERROR_INDEX_OUT_OF_RANGE,
                      "topk_ids[{}][{}] (token {}) is {}; expert ids must be in [0, {}) "
                      "(config.{}; ids outside the local range are global ids of other ranks' "
                      "experts and are fine)",
                      t, j, t, e, d->global_experts, range ? "global_experts" : "num_experts");
      }
  return FMLP_SUCCESS;
}

// An fp8 weight's stacked scales: fp32 [E] (one per expert), [E, rows] (one per row) or
// [E, halves * ceil(rows / halves / 128), ceil(cols / 128)] (128 x 128 blocks; halves = 2 for the
// gated w1's gate and up halves, each with its own block rows); their values are checked per
// expert by the mlp validation. Scales of 16-bit weights are an error.
fmlp_status_t check_expert_scale(const char* name, const char* weight_name,
                                 const fmlp_tensor_t& scale, const fmlp_tensor_t& w,
                                 int64_t experts, int halves) {
  const bool fp8 = w.dtype == FMLP_DTYPE_F8_E4M3;
  if (tensor_absent(scale)) {
    if (!fp8) return FMLP_SUCCESS;
    return fail(FMLP_ERROR_BAD_SCALE,
                "{} is fp8 e4m3 but {} is absent; pass fp32 scales [num_experts] (one per expert), "
                "[num_experts, {}] (one per row) or [num_experts, ceil(rows / 128), ceil(cols / "
                "128)] (one per 128 x 128 block), e.g. fmlp_quantize_fp8 of each expert",
                weight_name, name, w.shape[1]);
  }
  if (!fp8)
    return fail(FMLP_ERROR_BAD_SCALE,
                "{} is given but {} is {}; scales apply to fp8 e4m3 experts only, drop the scale",
                name, weight_name, fmlp_dtype_name(w.dtype));
  if (scale.dtype != FMLP_DTYPE_F32)
    return fail(FMLP_ERROR_BAD_SCALE, "{} has dtype {}; scales must be f32", name,
                fmlp_dtype_name(scale.dtype));
  if (scale.ndim == 3) {
    const int64_t rb = halves * block_count(w.shape[1] / halves), cb = block_count(w.shape[2]);
    const int64_t want[3] = {experts, rb, cb};
    return check_tensor(name, scale, 3, want,
                        halves == 2
                            ? "[num_experts, 2 * ceil(hidden / 128), ceil(d / 128)] (per expert "
                              "the gate's block scales, then the up's: torch.cat of gate_proj's "
                              "and up_proj's weight_scale_inv)"
                            : "[num_experts, ceil(rows / 128), ceil(cols / 128)] (one per 128 x "
                              "128 block of each expert)");
  }
  const bool per_expert = scale.ndim == 1 && scale.shape[0] == experts;
  const bool per_row = scale.ndim == 2 && scale.shape[0] == experts && scale.shape[1] == w.shape[1];
  if (!per_expert && !per_row)
    return fail(FMLP_ERROR_BAD_SCALE,
                "{} has shape {}; expected [{}] (one per expert), [{}, {}] "
                "(one per row of {}) or 3-D [{}, {}, {}] (one per 128 x 128 block)",
                name, shape_string(scale), experts, experts, w.shape[1], weight_name, experts,
                halves * block_count(w.shape[1] / halves), block_count(w.shape[2]));
  const int64_t any[2] = {-1, -1};
  return check_tensor(name, scale, scale.ndim, any, per_row ? "[E, rows]" : "[E]");
}

// Expert weights through the mlp op's own validation, expert by expert, so the mlp kernels can
// take any slice.
fmlp_status_t check_experts(const fmlp_moe_args_t& a, MoeDesc* d) {
  const fmlp_mlp_config_t mc{a.config.activation, a.config.gated, FMLP_NORM_NONE, 0.f,
                             a.config.deterministic};
  for (int64_t e = 0; e < d->experts; ++e) {
    fmlp_mlp_weights_t w{};
    w.w1 = expert_slice(a.w1, e);
    w.b1 = expert_slice(a.b1, e);
    w.w2 = expert_slice(a.w2, e);
    w.b2 = expert_slice(a.b2, e);
    w.w1_scale = expert_scale(a.w1_scale, e);
    w.w2_scale = expert_scale(a.w2_scale, e);
    MlpDesc md;
    if (const fmlp_status_t s = validate_mlp_weights(w, mc, d->d_out, &md); s != FMLP_SUCCESS)
      return fail(s, "expert {}: {}", e, last_error());
    if (e == 0)
      d->expert = md;
    else
      d->expert.weights_vec16 = d->expert.weights_vec16 && md.weights_vec16;
  }
  d->expert.act_dtype = FMLP_DTYPE_F32;
  d->expert.m = 0;
  return FMLP_SUCCESS;
}

}  // namespace

fmlp_status_t validate_moe(const fmlp_moe_args_t* a, MoeDesc* d) {
  if (a == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "args is NULL");
  FMLP_TRY(check_config(a->config));
  d->experts = a->config.num_experts;
  d->first_expert = a->config.first_expert;
  d->global_experts = a->config.global_experts != 0 ? a->config.global_experts : d->experts;
  d->top_k = a->config.top_k;
  d->activation = a->config.activation;
  d->gated = a->config.gated == 1;
  d->scoring = a->config.scoring;
  d->renormalize = a->config.renormalize == 1;
  d->deterministic = a->config.deterministic != 0;
  if (tensor_absent(a->x)) return fail(FMLP_ERROR_NULL_POINTER, "x is absent; pass [T, d]");
  if (tensor_absent(a->y)) return fail(FMLP_ERROR_NULL_POINTER, "y is absent; pass [T, d_out]");
  if (tensor_absent(a->w1))
    return fail(FMLP_ERROR_NULL_POINTER,
                "w1 is absent; pass [num_experts, hidden (2*hidden "
                "gated), d]");
  if (tensor_absent(a->w2))
    return fail(FMLP_ERROR_NULL_POINTER, "w2 is absent; pass [num_experts, d_out, hidden]");
  const int64_t any2[2] = {-1, -1};
  FMLP_TRY(check_tensor("x", a->x, 2, any2, "[T, d]"));
  d->tokens = a->x.shape[0];
  d->d = a->x.shape[1];
  const int64_t w1_shape[3] = {d->experts, -1, d->d};
  FMLP_TRY(check_tensor("w1", a->w1, 3, w1_shape, "[num_experts, hidden or 2*hidden, d]"));
  const int64_t w2_any[3] = {d->experts, -1, -1};
  FMLP_TRY(check_tensor("w2", a->w2, 3, w2_any, "[num_experts, d_out, hidden]"));
  d->d_out = a->w2.shape[1];
  d->hidden = a->w2.shape[2];
  const int64_t w1_rows = d->gated ? 2 * d->hidden : d->hidden;
  const int64_t w1_full[3] = {d->experts, w1_rows, d->d};
  FMLP_TRY(check_tensor("w1", a->w1, 3, w1_full,
                        d->gated ? "[num_experts, 2*hidden, d] (gate rows, then up rows)"
                                 : "[num_experts, hidden, d]"));
  const int64_t y_shape[2] = {d->tokens, d->d_out};
  FMLP_TRY(check_tensor("y", a->y, 2, y_shape, "[T, d_out]"));
  if (!is_act_dtype(a->x.dtype))
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "x has dtype {}; activations must be f32, f16 or bf16",
                fmlp_dtype_name(a->x.dtype));
  if (a->y.dtype != a->x.dtype)
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "y is {} but x is {}; y must have x's dtype",
                fmlp_dtype_name(a->y.dtype), fmlp_dtype_name(a->x.dtype));
  d->act_dtype = a->x.dtype;
  d->round_logits = a->config.round_router_logits == 1 && !d->given_routing &&
                    (d->act_dtype == FMLP_DTYPE_BF16 || d->act_dtype == FMLP_DTYPE_F16);
  d->x_vec16 =
      rows_start_16b(a->x.data, d->tokens, a->x.stride[0] * int64_t(dtype_size(d->act_dtype)));
  if (a->w1.dtype != FMLP_DTYPE_F8_E4M3) FMLP_TRY(check_float_dtype("w1", a->w1));
  if (a->w2.dtype != a->w1.dtype)
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "w2 is {} but w1 is {}; the experts share one dtype",
                fmlp_dtype_name(a->w2.dtype), fmlp_dtype_name(a->w1.dtype));
  d->w_dtype = a->w1.dtype;
  if (!tensor_absent(a->b1)) {
    const int64_t s[2] = {d->experts, w1_rows};
    FMLP_TRY(check_tensor("b1", a->b1, 2, s, "[num_experts, hidden or 2*hidden]"));
    FMLP_TRY(check_float_dtype("b1", a->b1));
    d->b1_dtype = a->b1.dtype;
  }
  if (!tensor_absent(a->b2)) {
    const int64_t s[2] = {d->experts, d->d_out};
    FMLP_TRY(check_tensor("b2", a->b2, 2, s, "[num_experts, d_out]"));
    FMLP_TRY(check_float_dtype("b2", a->b2));
    d->b2_dtype = a->b2.dtype;
  }
  if (!tensor_absent(a->residual)) {
    FMLP_TRY(check_tensor("residual", a->residual, 2, y_shape, "[T, d_out]"));
    if (a->residual.dtype != a->x.dtype)
      return fail(FMLP_ERROR_DTYPE_MISMATCH,
                  "residual is {} but x is {}; residual must have x's dtype",
                  fmlp_dtype_name(a->residual.dtype), fmlp_dtype_name(a->x.dtype));
    d->has_residual = true;
    d->residual_is_y = same_view(a->residual, a->y);
  }
  if (d->tokens > INT32_MAX / d->top_k)  // slots are indexed with int32 (ids, groups)
    return fail(FMLP_ERROR_SIZE_OVERFLOW,
                "T * top_k = {} * {} (token, expert) slots exceed 2^31 - 1; split the batch",
                d->tokens, d->top_k);
  FMLP_TRY(check_routing(*a, d));
  FMLP_TRY(check_expert_scale("w1_scale", "w1", a->w1_scale, a->w1, d->experts, d->gated ? 2 : 1));
  FMLP_TRY(check_expert_scale("w2_scale", "w2", a->w2_scale, a->w2, d->experts, 1));
  FMLP_TRY(check_experts(*a, d));
  d->device = a->x.device_type;
  d->device_id = a->x.device_id;
  d->expert.device = d->device;
  d->expert.device_id = d->device_id;
  const NamedTensor all[] = {{&a->y, "y"},
                             {&a->residual, "residual"},
                             {&a->router_w, "router_w"},
                             {&a->router_b, "router_b"},
                             {&a->w1, "w1"},
                             {&a->b1, "b1"},
                             {&a->w2, "w2"},
                             {&a->b2, "b2"},
                             {&a->w1_scale, "w1_scale"},
                             {&a->w2_scale, "w2_scale"}};
  FMLP_TRY(check_one_device(std::begin(all), std::end(all), d->device, d->device_id, "x is"));
  const ByteRange yr = byte_range(a->y);
  if (ranges_overlap(yr, byte_range(a->x)))
    return fail(FMLP_ERROR_ALIASING,
                "y overlaps x; the experts read x while y is written, so pass a separate output");
  for (const auto& n : all)
    if (n.t != &a->y && !(n.t == &a->residual && d->residual_is_y) &&
        ranges_overlap(yr, byte_range(*n.t)))
      return fail(FMLP_ERROR_ALIASING,
                  "y overlaps {}; y may only be the very same view as residual, so pass a "
                  "separate output buffer",
                  n.name);
  if (d->given_routing) {
    const size_t n = size_t(d->tokens * d->top_k) * 4;
    const ByteRange ids{uintptr_t(a->topk_ids), uintptr_t(a->topk_ids) + n};
    const ByteRange wts{uintptr_t(a->topk_weights), uintptr_t(a->topk_weights) + n};
    if (ranges_overlap(yr, ids) || ranges_overlap(yr, wts))
      return fail(FMLP_ERROR_ALIASING,
                  "y overlaps topk_ids or topk_weights; pass a separate output buffer");
  }
  return FMLP_SUCCESS;
}

namespace {

struct MoeOp {
  using Args = fmlp_moe_args_t;
  using Desc = MoeDesc;
  static constexpr const char* kName = "moe";
  static fmlp_status_t validate(const Args* a, Desc* d) { return validate_moe(a, d); }
  static std::string describe(const Desc& d) { return fmlp::detail::describe(d); }
  static bool empty(const Desc& d) { return d.tokens == 0; }
  static std::array<MoeKernelList, 3> lists() {
    return {cuda_moe_kernels(), cpu_moe_kernels(), ref_moe_kernels()};
  }
  // The CUDA planner prefers the weight streams while few tokens share an expert
  // (core/planner.hpp).
  static const MoeKernel* plan(const MoeDesc& d, fmlp_backend_t b, std::string* reason) {
    return b == FMLP_BACKEND_CUDA ? cuda_moe_plan(d, reason) : nullptr;
  }
};
using Table = OpTable<MoeOp>;

}  // namespace

std::string describe(const MoeDesc& d) {
  const std::string range = d.global_experts != d.experts
                                ? fmt::format(" experts [{}, {}) of {}", d.first_expert,
                                              d.first_expert + d.experts, d.global_experts)
                                : "";
  return fmt::format(
      "T={} d={} hidden={} d_out={} E={} k={}{} {} {} x={} w={} routing={}{}{}{} on {}", d.tokens,
      d.d, d.hidden, d.d_out, d.experts, d.top_k, range, d.gated ? "gated" : "dense",
      fmlp_activation_name(d.activation), fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype),
      d.given_routing                         ? "given"
      : d.scoring == FMLP_MOE_SCORING_SIGMOID ? "sigmoid"
                                              : "softmax",
      d.renormalize && !d.given_routing ? " renormalized" : "",
      d.round_logits ? " (logits rounded to x's dtype)" : "", d.has_residual ? " residual" : "",
      device_string(d.device, d.device_id));
}

}  // namespace fmlp::detail

using fmlp::detail::Table;

extern "C" {
// fmlp_moe, fmlp_moe_workspace_size, fmlp_moe_explain, fmlp_moe_kernel_count / _name / _backend /
// _supports / _workspace_size and fmlp_moe_with_kernel, through the op table (op_table.hpp).
FMLP_DEFINE_OP_TABLE_ABI(moe, fmlp_moe_args_t, Table)

fmlp_moe_config_t fmlp_moe_config_default(int32_t num_experts, int32_t top_k) {
  fmlp_moe_config_t c{};  // no expert range: first_expert and global_experts 0
  c.num_experts = num_experts;
  c.top_k = top_k;
  c.activation = FMLP_ACT_SILU;
  c.scoring = FMLP_MOE_SCORING_SOFTMAX;
  c.renormalize = 1;
  c.deterministic = 1;
  return c;
}
fmlp_status_t fmlp_moe_device_errors(void* workspace, size_t workspace_bytes, void* stream,
                                     int32_t* count) {
  using fmlp::detail::fail;
  if (count == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "count is NULL");
  if (workspace == nullptr)
    return fail(FMLP_ERROR_NULL_POINTER, "workspace is NULL; pass the one given to fmlp_moe");
  if (workspace_bytes < 16)
    return fail(FMLP_ERROR_WORKSPACE_TOO_SMALL,
                "workspace_bytes is {}; a cuda moe workspace holds at least 16 bytes",
                workspace_bytes);
  const fmlp_status_t s = fmlp::detail::cuda_moe_device_errors(workspace, stream, count);
  if (s == FMLP_SUCCESS) fmlp::detail::clear_last_error();
  return s;
}

}  // extern "C"
