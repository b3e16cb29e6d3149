// ref backend: the obvious scalar mlp with fp64 accumulation. It is the oracle for every test;
// keep it simple rather than fast.
#include "core/dtype.hpp"
#include "core/mlp_desc.hpp"
#include "core/tensor_check.hpp"
#include "ref/activation.hpp"

namespace fmlp::detail {
namespace {

double scale_of(const fmlp_tensor_t& s, int64_t row) {
  if (tensor_absent(s)) return 1.0;
  const float* p = static_cast<const float*>(s.data);
  return s.shape[0] == 1 ? p[0] : p[row];
}

double vec(const fmlp_tensor_t& v, int64_t i, double absent) {
  return tensor_absent(v) ? absent : load_as_double(v.data, v.dtype, i);
}

// Row `row` of matrix w (scaled when fp8) dotted with the fp64 vector x. A 2-D scale holds 128 x
// 128 blocks over `halves` halves of w's rows (ScaleKind::kBlock): each element is scaled.
double dot_row(const fmlp_tensor_t& w, const fmlp_tensor_t& scale, int64_t row, const double* x,
               int halves = 1) {
  const int64_t n = w.shape[1];
  const char* base = static_cast<const char*>(w.data) + row * w.stride[0] * dtype_size(w.dtype);
  double acc = 0.0;
  if (!tensor_absent(scale) && scale.ndim == 2) {
    const float* s = static_cast<const float*>(scale.data) +
                     block_row(row, w.shape[0], halves) * scale.stride[0];
    for (int64_t k = 0; k < n; ++k)
      acc += load_as_double(base, w.dtype, k) * double(s[k / kFp8Block * scale.stride[1]]) * x[k];
    return acc;
  }
  for (int64_t k = 0; k < n; ++k) acc += load_as_double(base, w.dtype, k) * x[k];
  return acc * scale_of(scale, row);
}

bool ref_supports(const MlpDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CPU) {
    *why = "needs host memory";
    return false;
  }
  return true;
}

size_t ref_workspace(const MlpDesc& d) {
  return size_t(d.d_in + d.hidden) * sizeof(double);
}

fmlp_status_t ref_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws, void*) {
  const fmlp_mlp_weights_t& w = a.weights;
  double* xn = static_cast<double*>(ws);
  double* h = xn + d.d_in;
  for (int64_t i = 0; i < d.m; ++i) {
    const char* xrow =
        static_cast<const char*>(a.x.data) + i * a.x.stride[0] * dtype_size(a.x.dtype);
    for (int64_t k = 0; k < d.d_in; ++k) xn[k] = load_as_double(xrow, a.x.dtype, k);
    if (d.norm != FMLP_NORM_NONE) {
      double mean = 0.0;
      if (d.norm == FMLP_NORM_LAYERNORM) {
        for (int64_t k = 0; k < d.d_in; ++k) mean += xn[k];
        mean /= double(d.d_in);
      }
      double var = 0.0;
      for (int64_t k = 0; k < d.d_in; ++k) var += (xn[k] - mean) * (xn[k] - mean);
      const double inv = 1.0 / std::sqrt(var / double(d.d_in) + double(d.norm_eps));
      for (int64_t k = 0; k < d.d_in; ++k)
        xn[k] = (xn[k] - mean) * inv * vec(w.norm_weight, k, 1.0) + vec(w.norm_bias, k, 0.0);
    }
    for (int64_t j = 0; j < d.hidden; ++j) {
      const int halves = d.stacked_gate_up ? 2 : 1;
      const double g = dot_row(w.w1, w.w1_scale, j, xn, halves) + vec(w.b1, j, 0.0);
      if (!d.gated) {
        h[j] = ref::activate(d.activation, g);
        continue;
      }
      double u;
      if (d.stacked_gate_up)
        u = dot_row(w.w1, w.w1_scale, d.hidden + j, xn, halves) + vec(w.b1, d.hidden + j, 0.0);
      else
        u = dot_row(w.w_up, w.w_up_scale, j, xn) + vec(w.b_up, j, 0.0);
      h[j] = ref::activate(d.activation, g) * u;
    }
    char* yrow = static_cast<char*>(a.y.data) + i * a.y.stride[0] * dtype_size(a.y.dtype);
    const char* rrow = d.has_residual ? static_cast<const char*>(a.residual.data) +
                                            i * a.residual.stride[0] * dtype_size(a.y.dtype)
                                      : nullptr;
    for (int64_t o = 0; o < d.d_out; ++o) {
      double v = dot_row(w.w2, w.w2_scale, o, h) + vec(w.b2, o, 0.0);
      if (rrow) v += load_as_double(rrow, a.y.dtype, o);  // read before the write: in-place safe
      store_from_double(yrow, a.y.dtype, o, v);
    }
  }
  return FMLP_SUCCESS;
}

const MlpKernel kRefKernels[] = {
    {"mlp_ref_scalar_fp64", FMLP_BACKEND_REF, ref_supports, ref_workspace, ref_run},
};

}  // namespace

MlpKernelList ref_mlp_kernels() {
  return {kRefKernels, 1};
}

}  // namespace fmlp::detail
