// ref backend of the linear op: scalar, fp64 accumulation; the oracle the other kernels are
// tested against.
#include "core/dtype.hpp"
#include "core/linear_desc.hpp"
#include "core/tensor_check.hpp"

namespace fmlp::detail {
namespace {

bool host_only(const LinearDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CPU) return (*why = "needs host memory", false);
  return true;
}

size_t no_workspace(const LinearDesc&) {
  return 0;
}

fmlp_status_t ref_run(const fmlp_linear_args_t& a, const LinearDesc& d, void*, void*) {
  const size_t xs = dtype_size(a.x.dtype), ys = dtype_size(a.y.dtype), ws = dtype_size(a.w.dtype);
  const float* scale = static_cast<const float*>(a.w_scale.data);
  const float* x_scale = static_cast<const float*>(a.x_scale.data);
  for (int64_t i = 0; i < d.m; ++i) {
    const char* x = row_ptr(a.x, i, xs);
    char* y = const_cast<char*>(row_ptr(a.y, i, ys));
    // W8A8: (x_scale * w_scale) * sum, as torch._scaled_mm; exact in fp64.
    const double xsc =
        d.x_scale == ScaleKind::kNone ? 1.0 : x_scale[d.x_scale == ScaleKind::kPerRow ? i : 0];
    for (int64_t o = 0; o < d.n; ++o) {
      const char* w = row_ptr(a.w, o, ws);
      double acc = 0.0;
      if (d.w_scale == ScaleKind::kBlock) {  // w[o, c] * scale[o / 128, c / 128], weight-only
        const float* s = scale + (o / kFp8Block) * a.w_scale.stride[0];
        for (int64_t c = 0; c < d.k; ++c)
          acc += load_as_double(w, d.w_dtype, c) *
                 double(s[(c / kFp8Block) * a.w_scale.stride[1]]) *
                 load_as_double(x, d.act_dtype, c);
      } else {
        for (int64_t c = 0; c < d.k; ++c)
          acc += load_as_double(w, d.w_dtype, c) * load_as_double(x, d.act_dtype, c);
      }
      if (d.w_scale == ScaleKind::kPerTensor || d.w_scale == ScaleKind::kPerRow)
        acc *= xsc * scale[d.w_scale == ScaleKind::kPerRow ? o : 0];
      if (d.bias_dtype != FMLP_DTYPE_INVALID) acc += load_as_double(a.bias.data, d.bias_dtype, o);
      store_from_double(y, d.out_dtype, o, acc);
    }
  }
  return FMLP_SUCCESS;
}

const LinearKernel kRefKernels[] = {
    {"linear_ref_scalar_fp64", FMLP_BACKEND_REF, host_only, no_workspace, ref_run},
};

}  // namespace

LinearKernelList ref_linear_kernels() {
  return {kRefKernels, 1};
}

}  // namespace fmlp::detail
