// ref backend of the softmax op: fp64, the max-subtracted formula PyTorch's kernels use, so the
// non-finite cases come out the same way (NaN or +Inf in a row, or an all -Inf row: NaN row).
#include <cmath>
#include <limits>

#include "core/dtype.hpp"
#include "core/linear_desc.hpp"

namespace fmlp::detail {
namespace {

bool host_only(const SoftmaxDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CPU) return (*why = "needs host memory", false);
  return true;
}

size_t no_workspace(const SoftmaxDesc&) {
  return 0;
}

fmlp_status_t ref_run(const fmlp_softmax_args_t& a, const SoftmaxDesc& d, void*, void*) {
  const size_t es = dtype_size(d.dtype);
  const double inv_t = 1.0 / double(d.temperature);
  for (int64_t r = 0; r < d.rows; ++r) {
    const char* x = row_ptr(a.x, r, es);
    char* y = const_cast<char*>(row_ptr(a.y, r, es));
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < d.n; ++i) {
      const double v = load_as_double(x, d.dtype, i);
      m = std::isnan(v) || std::isnan(m) ? std::nan("") : std::max(m, v);
    }
    double s = 0.0;
    for (int64_t i = 0; i < d.n; ++i) s += std::exp((load_as_double(x, d.dtype, i) - m) * inv_t);
    const double log_s = std::log(s);
    for (int64_t i = 0; i < d.n; ++i) {  // each element read before it is written: in place safe
      const double z = (load_as_double(x, d.dtype, i) - m) * inv_t;
      store_from_double(y, d.dtype, i, d.log ? z - log_s : std::exp(z) / s);
    }
  }
  return FMLP_SUCCESS;
}

const SoftmaxKernel kRefKernels[] = {
    {"softmax_ref_scalar_fp64", FMLP_BACKEND_REF, host_only, no_workspace, ref_run},
};

}  // namespace

SoftmaxKernelList ref_softmax_kernels() {
  return {kRefKernels, 1};
}

}  // namespace fmlp::detail
