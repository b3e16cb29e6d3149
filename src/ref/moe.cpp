// ref backend of the moe op: scalar fp64 loops; the oracle the other kernels are tested against.
// moe_route_token is the routing spec, shared with the cpu backend so both pick the same experts.
#include <cmath>

#include "core/linear_desc.hpp"
#include "core/moe_desc.hpp"
#include "core/tensor_check.hpp"
#include "ref/activation.hpp"

namespace fmlp::detail {

void moe_route_token(const fmlp_moe_args_t& a, const MoeDesc& d, int64_t t, double* scores,
                     int32_t* ids, double* weights) {
  if (d.given_routing) {
    for (int64_t j = 0; j < d.top_k; ++j) {
      ids[j] = a.topk_ids[t * d.top_k + j];
      weights[j] = double(a.topk_weights[t * d.top_k + j]);
    }
    return;
  }
  const char* x = row_ptr(a.x, t, dtype_size(d.act_dtype));
  double mx = -INFINITY;
  for (int64_t e = 0; e < d.global_experts; ++e) {
    const char* w = row_ptr(a.router_w, e, dtype_size(d.router_dtype));
    double acc = 0.0;
    for (int64_t c = 0; c < d.d; ++c)
      acc += load_as_double(w, d.router_dtype, c) * load_as_double(x, d.act_dtype, c);
    if (d.router_bias_dtype != FMLP_DTYPE_INVALID)
      acc += load_as_double(a.router_b.data, d.router_bias_dtype, e);
    if (d.round_logits) acc = round_to_dtype(acc, d.act_dtype);  // a 16-bit nn.Linear's output
    scores[e] = acc;
    mx = std::fmax(mx, acc);
  }
  if (d.scoring == FMLP_MOE_SCORING_SIGMOID) {
    for (int64_t e = 0; e < d.global_experts; ++e) scores[e] = 1.0 / (1.0 + std::exp(-scores[e]));
  } else {
    double sum = 0.0;
    for (int64_t e = 0; e < d.global_experts; ++e) sum += (scores[e] = std::exp(scores[e] - mx));
    for (int64_t e = 0; e < d.global_experts; ++e) scores[e] /= sum;
  }
  // Selection by repeated arg-max: strict > keeps the lower id on ties; a NaN score is never
  // larger, so NaN logits fall back to the lowest unpicked ids.
  for (int64_t j = 0; j < d.top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < d.global_experts; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || ids[i] == e;
      if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
    }
    ids[j] = int32_t(best);
    weights[j] = scores[best];
  }
  if (d.renormalize) {
    double sum = 0.0;
    for (int64_t j = 0; j < d.top_k; ++j) sum += weights[j];
    for (int64_t j = 0; j < d.top_k; ++j) weights[j] /= sum;
  }
}

namespace {

bool host_only(const MoeDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CPU) return (*why = "needs host memory", false);
  return true;
}

// Row `row`'s dequantisation scale of an expert's scale view (expert_scale) at column `col`: 1
// without one; block scales over `halves` halves of the `rows` rows (ScaleKind::kBlock).
double scale_at(const fmlp_tensor_t& s, int64_t row, int64_t col, int64_t rows, int halves) {
  if (s.data == nullptr) return 1.0;
  const float* p = static_cast<const float*>(s.data);
  if (s.ndim == 2)
    return p[block_row(row, rows, halves) * s.stride[0] + col / kFp8Block * s.stride[1]];
  return s.shape[0] == 1 ? p[0] : p[row * s.stride[0]];
}

// scores [global experts], ids [k], weights [k], h [rows1], out [d_out] in doubles.
size_t ref_workspace(const MoeDesc& d) {
  const int64_t rows1 = d.gated ? 2 * d.hidden : d.hidden;
  return size_t(d.global_experts + 2 * d.top_k + rows1 + d.d_out) * sizeof(double);
}

fmlp_status_t ref_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws, void*) {
  const int64_t rows1 = d.gated ? 2 * d.hidden : d.hidden;
  double* scores = static_cast<double*>(ws);
  double* weights = scores + d.global_experts;
  int32_t* ids = reinterpret_cast<int32_t*>(weights + d.top_k);
  double* h = weights + 2 * d.top_k;
  double* out = h + rows1;
  const size_t xs = dtype_size(d.act_dtype), es = dtype_size(d.w_dtype);
  for (int64_t t = 0; t < d.tokens; ++t) {
    moe_route_token(a, d, t, scores, ids, weights);
    const char* x = row_ptr(a.x, t, xs);
    for (int64_t o = 0; o < d.d_out; ++o)
      out[o] = d.has_residual ? load_as_double(row_ptr(a.residual, t, xs), d.act_dtype, o) : 0.0;
    for (int64_t j = 0; j < d.top_k; ++j) {
      const int64_t e = local_expert(d, ids[j]);
      if (e < 0) continue;  // another expert range's slot
      const fmlp_tensor_t w1 = expert_slice(a.w1, e), w2 = expert_slice(a.w2, e);
      const fmlp_tensor_t b1 = expert_slice(a.b1, e), b2 = expert_slice(a.b2, e);
      const fmlp_tensor_t s1 = expert_scale(a.w1_scale, e), s2 = expert_scale(a.w2_scale, e);
      for (int64_t r = 0; r < rows1; ++r) {
        const char* w = row_ptr(w1, r, es);
        double acc = 0.0;
        if (d.expert.w1_scale == ScaleKind::kBlock) {
          for (int64_t c = 0; c < d.d; ++c)
            acc += load_as_double(w, d.w_dtype, c) * scale_at(s1, r, c, rows1, d.gated ? 2 : 1) *
                   load_as_double(x, d.act_dtype, c);
        } else {
          for (int64_t c = 0; c < d.d; ++c)
            acc += load_as_double(w, d.w_dtype, c) * load_as_double(x, d.act_dtype, c);
          acc *= scale_at(s1, r, 0, rows1, 1);
        }
        if (d.b1_dtype != FMLP_DTYPE_INVALID) acc += load_as_double(b1.data, d.b1_dtype, r);
        h[r] = acc;
      }
      for (int64_t r = 0; r < d.hidden; ++r)
        h[r] = d.gated ? ref::activate(d.activation, h[r]) * h[d.hidden + r]
                       : ref::activate(d.activation, h[r]);
      for (int64_t o = 0; o < d.d_out; ++o) {
        const char* w = row_ptr(w2, o, es);
        double acc = 0.0;
        if (d.expert.w2_scale == ScaleKind::kBlock) {
          for (int64_t c = 0; c < d.hidden; ++c)
            acc += load_as_double(w, d.w_dtype, c) * scale_at(s2, o, c, d.d_out, 1) * h[c];
        } else {
          for (int64_t c = 0; c < d.hidden; ++c) acc += load_as_double(w, d.w_dtype, c) * h[c];
          acc *= scale_at(s2, o, 0, d.d_out, 1);
        }
        if (d.b2_dtype != FMLP_DTYPE_INVALID) acc += load_as_double(b2.data, d.b2_dtype, o);
        out[o] += weights[j] * acc;
      }
    }
    void* y = const_cast<char*>(row_ptr(a.y, t, xs));
    for (int64_t o = 0; o < d.d_out; ++o) store_from_double(y, d.act_dtype, o, out[o]);
  }
  return FMLP_SUCCESS;
}

const MoeKernel kRefKernels[] = {
    {"moe_ref_scalar_fp64", FMLP_BACKEND_REF, host_only, ref_workspace, ref_run},
};

}  // namespace

MoeKernelList ref_moe_kernels() {
  return {kRefKernels, 1};
}

}  // namespace fmlp::detail
