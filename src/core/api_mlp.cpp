// C ABI of the mlp op: the one place its arguments are validated (mlp_validate.cpp), then dispatch
// through the op table (op_table.hpp), the packed path included.
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#include "core/mlp_validate.hpp"
#include "core/planner.hpp"
#include "core/tensor_check.hpp"

namespace fmlp::detail {

std::string describe(const MlpDesc& d) {
  std::string s =
      fmt::format("M={} d_in={} hidden={} d_out={} x={} w={} {}{}", d.m, d.d_in, d.hidden, d.d_out,
                  fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype), d.gated ? "gated-" : "",
                  fmlp_activation_name(d.activation));
  if (d.norm == FMLP_NORM_LAYERNORM) s += " layernorm";
  if (d.norm == FMLP_NORM_RMSNORM) s += " rmsnorm";
  const auto kind = [](ScaleKind k) {
    return k == ScaleKind::kBlock ? "128x128" : k == ScaleKind::kPerRow ? "row" : "tensor";
  };
  if (d.w1_scale == ScaleKind::kBlock || d.w2_scale == ScaleKind::kBlock)
    s += fmt::format(" fp8-scales(w1 {}, w2 {})", kind(d.w1_scale), kind(d.w2_scale));
  if (d.has_b1 || d.has_b_up || d.has_b2) s += " bias";
  if (d.has_residual) s += d.residual_is_y ? " residual(in-place)" : " residual";
  if (d.deterministic) s += " deterministic";
  s += " on " + device_string(d.device, d.device_id);
  return s;
}

namespace {

struct MlpOp {
  using Args = fmlp_mlp_args_t;
  using Desc = MlpDesc;
  static constexpr const char* kName = "mlp";
  static fmlp_status_t validate(const Args* a, Desc* d) { return validate_mlp(a, d); }
  static std::string describe(const Desc& d) { return fmlp::detail::describe(d); }
  static bool empty(const Desc& d) { return d.m == 0; }
  static std::array<MlpKernelList, 3> lists() {
    return {cuda_mlp_kernels(), cpu_mlp_kernels(), ref_mlp_kernels()};
  }
  // The CUDA planner picks decode or prefill entries by M and shape (core/planner.hpp).
  static const MlpKernel* plan(const MlpDesc& d, fmlp_backend_t b, std::string* reason) {
    return b == FMLP_BACKEND_CUDA ? cuda_mlp_plan(d, reason) : nullptr;
  }
  // Unpacked 16-bit or fp8 weights the 16-byte weight streams cannot read (d_in or hidden not
  // whole 16-byte loads, misaligned rows) run on CUDA's general kernel: packing is the fix.
  static std::string explain_note(const MlpDesc& d, fmlp_backend_t b) {
    const bool fast_w = d.w_dtype == FMLP_DTYPE_BF16 || d.w_dtype == FMLP_DTYPE_F16 ||
                        d.w_dtype == FMLP_DTYPE_F8_E4M3;
    if (b != FMLP_BACKEND_CUDA || !fast_w || d.layout == WeightLayout::kCudaPacked || d.m > 64)
      return "";  // beyond M = 64 the prefill GEMMs take any size alike
    const int64_t per = 16 / int64_t(dtype_size(d.w_dtype));
    const bool odd = d.d_in % per != 0 || d.hidden % per != 0;
    if (!odd && d.weights_vec16) return "";
    const std::string what =
        odd ? fmt::format("d_in {} and hidden {} are not both multiples of {} ({} weights)", d.d_in,
                          d.hidden, per, fmlp_dtype_name(d.w_dtype))
            : std::string("the weight rows are not 16-byte aligned");
    return fmt::format(
        "unpacked weights: {}, so the 16-byte weight streams (mlp_decode_sm80_stream, "
        "mlp_decode_sm80_mma_streamk) decline and the general kernel's element loads are the "
        "cost; packing (fmlp_mlp_pack, fusedmlp.pack) pads the weight rows with zeros and takes "
        "the fast entries at any size",
        what);
  }
};
using Table = OpTable<MlpOp>;

}  // namespace
}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {
// fmlp_mlp, fmlp_mlp_workspace_size, fmlp_mlp_explain, fmlp_mlp_kernel_count / _name / _backend /
// _supports / _workspace_size and fmlp_mlp_with_kernel, through the op table (op_table.hpp).
FMLP_DEFINE_OP_TABLE_ABI(mlp, fmlp_mlp_args_t, Table)
}  // extern "C"

namespace {

fmlp_status_t packed_args(const fmlp_mlp_packed_t* p, const fmlp_tensor_t* y,
                          const fmlp_tensor_t* x, const fmlp_tensor_t* residual,
                          fmlp_mlp_args_t* args, MlpDesc* d) {
  if (p == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "packed is NULL");
  if (y == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "y is NULL");
  if (x == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "x is NULL");
  args->y = *y;
  args->x = *x;
  args->residual = residual ? *residual : fmlp_tensor_none();
  args->weights = p->weights;
  args->config = p->config;
  *d = p->desc;
  if (const fmlp_status_t s =
          validate_mlp_activations(args->y, args->x, &args->residual, args->weights, d);
      s != FMLP_SUCCESS)
    return s;
  return FMLP_SUCCESS;
}

}  // namespace

extern "C" {

fmlp_status_t fmlp_mlp_packed_workspace_size(const fmlp_mlp_packed_t* packed,
                                             const fmlp_tensor_t* y, const fmlp_tensor_t* x,
                                             size_t* bytes) {
  if (bytes == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "bytes is NULL");
  fmlp_mlp_args_t args{};
  MlpDesc d;
  if (const fmlp_status_t s = packed_args(packed, y, x, nullptr, &args, &d); s != FMLP_SUCCESS)
    return s;
  return Table::workspace_size_of(d, packed->backend, bytes);
}

fmlp_status_t fmlp_mlp_packed_explain(const fmlp_mlp_packed_t* packed, const fmlp_tensor_t* y,
                                      const fmlp_tensor_t* x, char* buf, size_t buf_size,
                                      size_t* needed) {
  fmlp_mlp_args_t args{};
  MlpDesc d;
  if (const fmlp_status_t s = packed_args(packed, y, x, nullptr, &args, &d); s != FMLP_SUCCESS)
    return s;
  return Table::explain_validated(d, packed->backend, packed->tuning_note, buf, buf_size, needed);
}

fmlp_status_t fmlp_mlp_packed_run(const fmlp_mlp_packed_t* packed, const fmlp_tensor_t* y,
                                  const fmlp_tensor_t* x, const fmlp_tensor_t* residual,
                                  void* workspace, size_t workspace_bytes, void* stream) {
  fmlp_mlp_args_t args{};
  MlpDesc d;
  if (const fmlp_status_t s = packed_args(packed, y, x, residual, &args, &d); s != FMLP_SUCCESS)
    return s;
  return Table::run_validated(args, d, packed->backend, workspace, workspace_bytes, stream,
                              "fmlp_mlp_packed_workspace_size");
}

fmlp_status_t fmlp_mlp_packed_kernel_workspace_size(const fmlp_mlp_packed_t* packed,
                                                    const char* kernel, const fmlp_tensor_t* y,
                                                    const fmlp_tensor_t* x, size_t* bytes) {
  if (bytes == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "bytes is NULL");
  fmlp_mlp_args_t args{};
  MlpDesc d;
  if (const fmlp_status_t s = packed_args(packed, y, x, nullptr, &args, &d); s != FMLP_SUCCESS)
    return s;
  const MlpKernel* k = nullptr;
  if (const fmlp_status_t s = Table::named_validated(d, kernel, &k); s != FMLP_SUCCESS) return s;
  *bytes = k->workspace_bytes(d);
  clear_last_error();
  return FMLP_SUCCESS;
}

fmlp_status_t fmlp_mlp_packed_with_kernel(const fmlp_mlp_packed_t* packed, const char* kernel,
                                          const fmlp_tensor_t* y, const fmlp_tensor_t* x,
                                          const fmlp_tensor_t* residual, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  fmlp_mlp_args_t args{};
  MlpDesc d;
  if (const fmlp_status_t s = packed_args(packed, y, x, residual, &args, &d); s != FMLP_SUCCESS)
    return s;
  const MlpKernel* k = nullptr;
  if (const fmlp_status_t s = Table::named_validated(d, kernel, &k); s != FMLP_SUCCESS) return s;
  return Table::run_kernel(*k, args, d, workspace, workspace_bytes, stream,
                           "fmlp_mlp_packed_kernel_workspace_size");
}

}  // extern "C"
