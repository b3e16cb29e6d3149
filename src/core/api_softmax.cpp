// C ABI of the softmax op: the one place its arguments are validated, then dispatch through the
// op table (op_table.hpp).
#include <cmath>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/linear_desc.hpp"
#include "core/tensor_check.hpp"

namespace fmlp::detail {
namespace {

#define FMLP_TRY(expr)                           \
  do {                                           \
    const fmlp_status_t status_ = (expr);        \
    if (status_ != FMLP_SUCCESS) return status_; \
  } while (0)

fmlp_status_t validate_softmax(const fmlp_softmax_args_t* a, SoftmaxDesc* d) {
  if (a == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "args is NULL");
  if (tensor_absent(a->x)) return fail(FMLP_ERROR_NULL_POINTER, "x is absent; pass [rows, n]");
  if (tensor_absent(a->y)) return fail(FMLP_ERROR_NULL_POINTER, "y is absent; pass [rows, n]");
  if (a->x.ndim != 1 && a->x.ndim != 2)
    return fail(FMLP_ERROR_SHAPE_MISMATCH, "x must be 1-D [n] or 2-D [rows, n], got a {}-D tensor",
                a->x.ndim);
  const int64_t any[2] = {-1, -1};
  FMLP_TRY(check_tensor("x", a->x, a->x.ndim, any, a->x.ndim == 2 ? "[rows, n]" : "[n]"));
  FMLP_TRY(check_tensor("y", a->y, a->x.ndim, a->x.shape, a->x.ndim == 2 ? "[rows, n]" : "[n]"));
  const fmlp_dtype_t t = a->x.dtype;
  if (t != FMLP_DTYPE_F32 && t != FMLP_DTYPE_F16 && t != FMLP_DTYPE_BF16)
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "x has dtype {}; softmax takes f32, f16 or bf16",
                fmlp_dtype_name(t));
  if (a->y.dtype != t)
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "y is {} but x is {}; y must have x's dtype",
                fmlp_dtype_name(a->y.dtype), fmlp_dtype_name(t));
  if (!(std::isfinite(a->temperature) && a->temperature > 0.f))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "temperature is {}; it must be finite and > 0 (1 is plain softmax)",
                a->temperature);
  if (a->log != 0 && a->log != 1)
    return fail(FMLP_ERROR_INVALID_VALUE, "log is {}; expected 0 (softmax) or 1 (log_softmax)",
                a->log);
  if (a->y.device_type != a->x.device_type || a->y.device_id != a->x.device_id)
    return fail(FMLP_ERROR_DEVICE_MISMATCH,
                "y is on {} but x is on {}; put both tensors on one device",
                device_string(a->y.device_type, a->y.device_id),
                device_string(a->x.device_type, a->x.device_id));
  d->in_place = false;
  if (ranges_overlap(byte_range(a->y), byte_range(a->x))) {
    if (!same_view(a->y, a->x))
      return fail(FMLP_ERROR_ALIASING,
                  "y overlaps x without being the same view; pass exactly x (in place) or a "
                  "separate buffer");
    d->in_place = true;
  }
  d->rows = a->x.ndim == 2 ? a->x.shape[0] : 1;
  d->n = a->x.shape[a->x.ndim - 1];
  d->dtype = t;
  d->temperature = a->temperature;
  d->log = a->log == 1;
  d->device = a->x.device_type;
  d->device_id = a->x.device_id;
  return FMLP_SUCCESS;
}

struct SoftmaxOp {
  using Args = fmlp_softmax_args_t;
  using Desc = SoftmaxDesc;
  static constexpr const char* kName = "softmax";
  static fmlp_status_t validate(const Args* a, Desc* d) { return validate_softmax(a, d); }
  static std::string describe(const Desc& d) { return fmlp::detail::describe(d); }
  static bool empty(const Desc& d) { return d.rows == 0 || d.n == 0; }
  static std::array<SoftmaxKernelList, 3> lists() {
    return {cuda_softmax_kernels(), cpu_softmax_kernels(), ref_softmax_kernels()};
  }
  // No planner (core/planner.hpp): the first entry that supports a request runs it.
  static const SoftmaxKernel* plan(const SoftmaxDesc&, fmlp_backend_t, std::string*) {
    return nullptr;
  }
};
using Table = OpTable<SoftmaxOp>;

}  // namespace

std::string describe(const SoftmaxDesc& d) {
  return fmt::format("{} rows={} n={} {}{}{} on {}", d.log ? "log_softmax" : "softmax", d.rows, d.n,
                     fmlp_dtype_name(d.dtype),
                     d.temperature != 1.f ? fmt::format(" T={}", d.temperature) : "",
                     d.in_place ? " in-place" : "", device_string(d.device, d.device_id));
}

}  // namespace fmlp::detail

using fmlp::detail::Table;

extern "C" {
// fmlp_softmax, fmlp_softmax_workspace_size, fmlp_softmax_explain, fmlp_softmax_kernel_count /
// _name / _backend / _supports / _workspace_size and fmlp_softmax_with_kernel, through the op table
// (op_table.hpp).
FMLP_DEFINE_OP_TABLE_ABI(softmax, fmlp_softmax_args_t, Table)
}  // extern "C"
