// C ABI of the linear op: the one place its arguments are validated, then dispatch through the
// op table (op_table.hpp).
#include <cmath>
#include <iterator>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/linear_desc.hpp"
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

// One operand's fp8 scales: `s` for the e4m3 tensor `of` with `rows` rows ([1] or [rows]).
fmlp_status_t check_scale(const char* name, const fmlp_tensor_t& s, const char* of, bool fp8,
                          fmlp_dtype_t of_dtype, int64_t rows, const char* rows_name,
                          ScaleKind* kind) {
  if (tensor_absent(s)) {
    if (fp8)
      return fail(FMLP_ERROR_BAD_SCALE,
                  "{} is fp8 e4m3 but {} is absent; pass fp32 scales of shape [1] (per tensor) "
                  "or [{}] (one per {})",
                  of, name, rows, rows_name);
    *kind = ScaleKind::kNone;
    return FMLP_SUCCESS;
  }
  if (!fp8)
    return fail(FMLP_ERROR_BAD_SCALE,
                "{} is given but {} is {}; scales apply to fp8 e4m3 tensors only, drop the scale",
                name, of, fmlp_dtype_name(of_dtype));
  const int64_t any[1] = {-1};
  FMLP_TRY(check_tensor(name, s, 1, any, "[1] or [rows]"));
  if (s.dtype != FMLP_DTYPE_F32)
    return fail(FMLP_ERROR_BAD_SCALE, "{} has dtype {}; scales must be f32", name,
                fmlp_dtype_name(s.dtype));
  if (s.shape[0] == 1 && rows != 1)
    *kind = ScaleKind::kPerTensor;
  else if (s.shape[0] == rows)
    *kind = ScaleKind::kPerRow;
  else
    return fail(FMLP_ERROR_BAD_SCALE,
                "{} has {} entries; expected 1 (per tensor) or {} (one per {} of {})", name,
                s.shape[0], rows, rows_name, of);
  if (s.device_type == FMLP_DEVICE_CPU) {
    const float* p = static_cast<const float*>(s.data);
    for (int64_t i = 0; i < s.shape[0]; ++i)
      if (!(std::isfinite(p[i]) && p[i] > 0.f))
        return fail(FMLP_ERROR_BAD_SCALE, "{}[{}] is {}; scales must be finite and > 0", name, i,
                    p[i]);
  }
  return FMLP_SUCCESS;
}

// Block scales of the fp8 weight w [n, k]: fp32 [ceil(n / 128), ceil(k / 128)], weight-only.
fmlp_status_t check_block_scale(const fmlp_tensor_t& s, bool w_fp8, bool x_fp8,
                                fmlp_dtype_t w_dtype, int64_t n, int64_t k) {
  if (!w_fp8)
    return fail(FMLP_ERROR_BAD_SCALE,
                "w_scale is given but w is {}; scales apply to fp8 e4m3 weights only, drop the "
                "scale",
                fmlp_dtype_name(w_dtype));
  if (x_fp8)
    return fail(FMLP_ERROR_NOT_SUPPORTED,
                "w_scale is 2-D (block scales) and x is f8_e4m3; block-scaled weights take x in "
                "f32, f16 or bf16 (weight-only), or pass per-row w_scale [N] for W8A8");
  const int64_t rb = (n + kFp8Block - 1) / kFp8Block, cb = (k + kFp8Block - 1) / kFp8Block;
  const int64_t want[2] = {rb, cb};
  FMLP_TRY(check_tensor("w_scale", s, 2, want,
                        "[ceil(N / 128), ceil(K / 128)] (one per 128 x 128 block of w)"));
  if (s.dtype != FMLP_DTYPE_F32)
    return fail(FMLP_ERROR_BAD_SCALE, "w_scale has dtype {}; scales must be f32",
                fmlp_dtype_name(s.dtype));
  if (s.device_type == FMLP_DEVICE_CPU) {
    const float* p = static_cast<const float*>(s.data);
    for (int64_t i = 0; i < rb; ++i)
      for (int64_t j = 0; j < cb; ++j) {
        const float v = p[i * s.stride[0] + j * s.stride[1]];
        if (!(std::isfinite(v) && v > 0.f))
          return fail(FMLP_ERROR_BAD_SCALE, "w_scale[{}, {}] is {}; scales must be finite and > 0",
                      i, j, v);
      }
  }
  return FMLP_SUCCESS;
}

fmlp_status_t validate_linear(const fmlp_linear_args_t* a, LinearDesc* d) {
  if (a == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "args is NULL");
  if (tensor_absent(a->w)) return fail(FMLP_ERROR_NULL_POINTER, "w is absent; pass [N, K]");
  if (tensor_absent(a->x)) return fail(FMLP_ERROR_NULL_POINTER, "x is absent; pass [M, K]");
  if (tensor_absent(a->y)) return fail(FMLP_ERROR_NULL_POINTER, "y is absent; pass [M, N]");
  const int64_t any2[2] = {-1, -1};
  FMLP_TRY(check_tensor("w", a->w, 2, any2, "[N, K]"));
  d->n = a->w.shape[0];
  d->k = a->w.shape[1];
  const int64_t x_shape[2] = {-1, d->k};
  FMLP_TRY(check_tensor("x", a->x, 2, x_shape, "[M, K]"));
  d->m = a->x.shape[0];
  const int64_t y_shape[2] = {d->m, d->n};
  FMLP_TRY(check_tensor("y", a->y, 2, y_shape, "[M, N]"));
  if (!is_act_dtype(a->w.dtype) && a->w.dtype != FMLP_DTYPE_F8_E4M3)
    return fail(FMLP_ERROR_DTYPE_MISMATCH,
                "w has dtype {}; weights must be f32, f16, bf16 or f8_e4m3",
                fmlp_dtype_name(a->w.dtype));
  const bool x_fp8 = a->x.dtype == FMLP_DTYPE_F8_E4M3;
  if (!is_act_dtype(a->x.dtype) && !x_fp8)
    return fail(FMLP_ERROR_DTYPE_MISMATCH,
                "x has dtype {}; activations must be f32, f16, bf16 or f8_e4m3 (W8A8)",
                fmlp_dtype_name(a->x.dtype));
  if (x_fp8 && a->w.dtype != FMLP_DTYPE_F8_E4M3)
    return fail(FMLP_ERROR_DTYPE_MISMATCH,
                "x is f8_e4m3 but w is {}; fp8 activations (W8A8) need f8_e4m3 weights, or pass "
                "x in f32, f16 or bf16",
                fmlp_dtype_name(a->w.dtype));
  if (x_fp8 ? !is_act_dtype(a->y.dtype) : a->y.dtype != a->x.dtype)
    return fail(FMLP_ERROR_DTYPE_MISMATCH,
                x_fp8 ? "y is {} with f8_e4m3 x; W8A8 outputs are f32, f16 or bf16"
                      : "y is {} but x is {}; y must have x's dtype",
                fmlp_dtype_name(a->y.dtype), fmlp_dtype_name(a->x.dtype));
  d->act_dtype = a->x.dtype;
  d->out_dtype = a->y.dtype;
  d->w_dtype = a->w.dtype;
  if (!tensor_absent(a->w_scale) && a->w_scale.ndim == 2) {
    FMLP_TRY(check_block_scale(a->w_scale, a->w.dtype == FMLP_DTYPE_F8_E4M3, x_fp8, a->w.dtype,
                               d->n, d->k));
    d->w_scale = ScaleKind::kBlock;
  } else {
    FMLP_TRY(check_scale("w_scale", a->w_scale, "w", a->w.dtype == FMLP_DTYPE_F8_E4M3, a->w.dtype,
                         d->n, "row", &d->w_scale));
  }
  FMLP_TRY(
      check_scale("x_scale", a->x_scale, "x", x_fp8, a->x.dtype, d->m, "row (token)", &d->x_scale));
  d->bias_dtype = FMLP_DTYPE_INVALID;
  if (!tensor_absent(a->bias)) {
    const int64_t b_shape[1] = {d->n};
    FMLP_TRY(check_tensor("bias", a->bias, 1, b_shape, "[N]"));
    if (!is_act_dtype(a->bias.dtype))
      return fail(FMLP_ERROR_DTYPE_MISMATCH, "bias has dtype {}; it must be f32, f16 or bf16",
                  fmlp_dtype_name(a->bias.dtype));
    d->bias_dtype = a->bias.dtype;
  }
  d->device = a->w.device_type;
  d->device_id = a->w.device_id;
  const NamedTensor all[] = {{&a->x, "x"},
                             {&a->y, "y"},
                             {&a->w_scale, "w_scale"},
                             {&a->bias, "bias"},
                             {&a->x_scale, "x_scale"}};
  FMLP_TRY(check_one_device(std::begin(all), std::end(all), d->device, d->device_id, "w is"));
  const ByteRange yr = byte_range(a->y);
  for (const auto& n : all)
    if (n.t != &a->y && ranges_overlap(yr, byte_range(*n.t)))
      return fail(FMLP_ERROR_ALIASING,
                  "y overlaps {}; the kernels read {} while y is written, so pass a separate "
                  "output buffer",
                  n.name, n.name);
  if (ranges_overlap(yr, byte_range(a->w)))
    return fail(FMLP_ERROR_ALIASING,
                "y overlaps w; the output must not share memory with the weights");
  const int64_t es = int64_t(dtype_size(d->w_dtype));
  d->w_ld = a->w.stride[0];
  d->w_rows16 = rows_start_16b(a->w.data, d->n, a->w.stride[0] * es);
  d->w_vec16 = d->w_rows16 && (d->k * es) % 16 == 0;
  auto vec16 = [&](const fmlp_tensor_t& t, int64_t cols) {
    const int64_t es = int64_t(dtype_size(t.dtype));
    return rows_start_16b(t.data, d->m, t.stride[0] * es) && (cols * es) % 16 == 0;
  };
  d->io_vec16 = vec16(a->x, d->k) && vec16(a->y, d->n);
  return FMLP_SUCCESS;
}

struct LinearOp {
  using Args = fmlp_linear_args_t;
  using Desc = LinearDesc;
  static constexpr const char* kName = "linear";
  static fmlp_status_t validate(const Args* a, Desc* d) { return validate_linear(a, d); }
  static std::string describe(const Desc& d) { return fmlp::detail::describe(d); }
  static bool empty(const Desc& d) { return d.m == 0 || d.n == 0; }
  static std::array<LinearKernelList, 3> lists() {
    return {cuda_linear_kernels(), cpu_linear_kernels(), ref_linear_kernels()};
  }
  // The CUDA planner picks between entries by shape (core/planner.hpp).
  static const LinearKernel* plan(const LinearDesc& d, fmlp_backend_t b, std::string* reason) {
    return b == FMLP_BACKEND_CUDA ? cuda_linear_plan(d, reason) : nullptr;
  }
  // 16-bit and fp8 W whose rows do not start on 16-byte boundaries (mostly a contiguous W of odd
  // K) leave CUDA only the general GEMV and its element loads: say what reaches the streams.
  static std::string explain_note(const LinearDesc& d, fmlp_backend_t b) {
    const bool fast_w = d.w_dtype == FMLP_DTYPE_BF16 || d.w_dtype == FMLP_DTYPE_F16 ||
                        d.w_dtype == FMLP_DTYPE_F8_E4M3;
    if (b != FMLP_BACKEND_CUDA || !fast_w || d.w_rows16 || d.n == 0 || d.k == 0) return "";
    const int64_t per = 16 / int64_t(dtype_size(d.w_dtype)), kp = (d.k + per - 1) / per * per;
    return fmt::format(
        "W's rows are not 16-byte aligned (w_ld {} elements of {}{}), so the weight streams "
        "(linear_sm80_stream, linear_sm80_mma) decline and linear_sm80_gemv reads W with element "
        "loads; store W with a row stride of a multiple of {} elements (a [N, {}] buffer viewed "
        "as [:, :{}]; fusedmlp.FusedLinear keeps such a copy for odd K) to take them",
        d.w_ld, fmlp_dtype_name(d.w_dtype), d.w_ld == d.k ? ", contiguous" : "", per, kp, d.k);
  }
};
using Table = OpTable<LinearOp>;

}  // namespace

std::string describe(const LinearDesc& d) {
  auto scale = [](ScaleKind k) {
    return k == ScaleKind::kPerTensor ? " scale/tensor"
           : k == ScaleKind::kPerRow  ? " scale/row"
           : k == ScaleKind::kBlock   ? " scale/128x128"
                                      : "";
  };
  return fmt::format("M={} N={} K={} x={}{}{} w={}{}{}{} on {}", d.m, d.n, d.k,
                     fmlp_dtype_name(d.act_dtype), scale(d.x_scale),
                     d.w8a8() ? fmt::format(" y={}", fmlp_dtype_name(d.out_dtype)) : "",
                     fmlp_dtype_name(d.w_dtype), scale(d.w_scale),
                     d.bias_dtype != FMLP_DTYPE_INVALID ? " bias" : "",
                     d.w_vec16    ? " vec16"
                     : d.w_rows16 ? " rows16"
                                  : "",
                     device_string(d.device, d.device_id));
}

}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {
// fmlp_linear, fmlp_linear_workspace_size, fmlp_linear_explain, fmlp_linear_kernel_count / _name /
// _backend / _supports / _workspace_size and fmlp_linear_with_kernel, through the op table
// (op_table.hpp).
FMLP_DEFINE_OP_TABLE_ABI(linear, fmlp_linear_args_t, Table)
}  // extern "C"
