// The accuracy contract every mlp kernel is tested against, stated once.
//
// Reference. The tests compute the reference themselves in double precision from the exact values
// stored in the test tensors (tests/mlp_case.cpp), with the activation formulas of
// src/ref/activation.hpp (the spec, including its NaN/Inf semantics). It is not rounded to the
// output dtype: the tolerance then budgets exactly two things, the kernel's own arithmetic and the
// one rounding of its result. Computing it in the test (rather than calling the ref kernel) keeps
// the oracle independent of src/ref, so the ref kernel is itself checked, and it is fast because
// every tensor is decoded to double once per case.
//
// Rule, per output element o of row i:
//   |out - ref| <= rtol * (|ref| + scale) + atol
// (atol: one subnormal step of the output dtype, the absolute rounding below the normal range)
// where scale is the natural size of the rounding errors of the sums that produce y[i][o]: the l2
// norm of the terms summed into it (W2[o][j] * magnitude(h_j), b2, residual), with magnitude(h_j)
// itself the l2 norm of the terms of its layer-1 dot products (times the activation's slope where
// that exceeds 1: relu2's 2g). Rounding errors of a sum grow with its terms, not with its result,
// so |ref| alone would flag kernels wherever terms happen to cancel; for random data scale is
// about the row's rms, so the rule is as tight as "relative to row rms".
//
// rtol = max(rtol of the activation (= output) dtype, rtol of the weight dtype):
//   f32   1e-4: fp32 accumulation of n terms drifts by ~2^-24 * sqrt(n) of scale (< 1e-5 even at
//         n = 3072 plus a second layer), which leaves room for activation approximations accurate
//         to ~1e-6 relative; TF32 tensor-core math (2^-11) is deliberately not allowed.
//   f16   2^-9 (two f16 ulps at 1.0): the output rounding costs 2^-11 |ref|; the rest covers
//         intermediates (normalised x, h) rounded to f16 before a tensor-core GEMM.
//   bf16  2^-7 (one bf16 ulp at 1.0, two unit roundoffs): output rounding costs 2^-8 |ref|, and
//         bf16 intermediates cost ~2^-9 * scale.
//   f8_e4m3 weights: like bf16. Weights are exact fp8 values times fp32 scales, so only the math
//         counts; kernels may run it in bf16 but must not quantise activations to fp8 -- except
//         the fp8 prefill path, which is W8A8 by design and has its own budget (kW8A8Rtol below).
//   GEMM-composed kernels (the prefill path) store the normalised x and GEMM1's output (gate and up
//         separately) in the 16-bit dtype before the activation, exactly as PyTorch's own
//         composition does: two or three more roundings of ~2^-9 each on the way to h, so their
//         16-bit budget is 1.5x (kGemmComposedRtolFactor); f32 is unaffected (no 16-bit storage).
//   16-bit weights with f32 activations: a kernel may cast activations to the weight dtype to use
//   tensor cores (what autocast does), hence the max with the weight dtype's rtol.
//
// Non-finite values. Where ref (rounded to the output dtype) is NaN, out must be NaN; where it is
// +-Inf, out must be non-finite; where it is finite, out must be finite and within tolerance.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/dtype.hpp"
#include "fusedmlp/fusedmlp.h"

namespace fmlp_test {

inline double dtype_rtol(fmlp_dtype_t t) {
  switch (t) {
    case FMLP_DTYPE_F32: return 1e-4;
    case FMLP_DTYPE_F16: return 1.0 / 512;  // 2^-9
    case FMLP_DTYPE_BF16:
    case FMLP_DTYPE_F8_E4M3: return 1.0 / 128;  // 2^-7
    default: return 0.0;
  }
}

// The spacing of the output dtype's subnormals: below the normal range rounding is absolute, so
// tiny outputs (e.g. hidden = 1, small weights) get one such step on top of the relative budget.
inline double dtype_atol(fmlp_dtype_t t) {
  switch (t) {
    case FMLP_DTYPE_F32: return 0x1p-149;
    case FMLP_DTYPE_F16: return 0x1p-24;
    case FMLP_DTYPE_BF16: return 0x1p-133;
    default: return 0.0;
  }
}

inline constexpr double kGemmComposedRtolFactor = 1.5;

inline double mlp_rtol(fmlp_dtype_t out_dtype, fmlp_dtype_t weight_dtype,
                       bool gemm_composed = false) {
  const double base = std::max(dtype_rtol(out_dtype), dtype_rtol(weight_dtype));
  return gemm_composed && base > 1e-3 ? base * kGemmComposedRtolFactor : base;
}

// W8A8 (the fp8 prefill path, mlp_prefill_sm90_cublaslt with fp8 weights): x and h are quantised
// per token to e4m3 with dynamic scales (amax / 448) before fp8 GEMMs; the reference still
// dequantises the weights exactly and keeps x and h unquantised, so the quantisation error is
// budgeted, not the kernels' arithmetic alone. Error model: e4m3 keeps 3 mantissa bits, so round
// to nearest costs at most 2^-4 relative per quantised value and 2^-3 / sqrt(12) * E[1/mantissa]
// = 0.027 rms. The K terms of a dot product carry independent errors: a layer-1 sum is off by
// 0.027 * (l2 norm of its terms) rms. Through the activation and the gate product (|act'| <= 1.1,
// |act(g)| <= |g| for the four activations) plus h's own quantisation, h_j is off by at most
// sqrt(1.2 + 1 + 1) * 0.027 * magnitude(h_j) ~ 0.048 magnitude(h_j) rms (typically half that:
// |act'| and |act(g) / g| average about 1/2), so y is off by ~0.02-0.05 * scale rms (scale as
// above). Two checks follow from it:
//   per element, rtol 2^-2: five standard deviations of the pessimistic 0.048, for the tails of
//     a few hundred thousand elements per case (it still catches a wrong or missing scale, a lost
//     gate product, a transposed operand: errors of order 1 * scale);
//   per case, the rms of |out - ref| / (|ref| + scale) <= 2^-5: the typical model value with 1.5x
//     margin, which a scale off by 10 % or a truncating rounding mode exceeds.
// A numpy emulation of the path (ml_dtypes e4m3, bf16 G and h, the test's data) gives per-case
// rms 0.009-0.017 and worst elements 0.06-0.10 over d_in 256-4096, hidden 512-2816, the four
// activations, gated and dense, with and without norms and biases.
inline constexpr double kW8A8Rtol = 1.0 / 4;
inline constexpr double kW8A8RmsBound = 1.0 / 32;

// ref as the output dtype would hold it; only used to classify it (overflow to Inf, NaN).
inline double round_to_dtype(double v, fmlp_dtype_t t) {
  unsigned char buf[4] = {};
  fmlp::detail::store_from_double(buf, t, 0, v);
  return fmlp::detail::load_as_double(buf, t, 0);
}

struct ElementCheck {
  bool ok;
  double err;       // |out - ref| (inf when the classes differ)
  double tol;       // allowed |out - ref|
  const char* why;  // set when !ok
};

inline ElementCheck check_element(double out, double ref, double scale, double rtol,
                                  fmlp_dtype_t out_dtype) {
  const double expected = round_to_dtype(ref, out_dtype);
  if (std::isnan(expected)) {
    const bool ok = std::isnan(out);
    return {ok, ok ? 0.0 : INFINITY, 0.0, ok ? "" : "reference is NaN but the output is not"};
  }
  if (std::isinf(expected)) {
    const bool ok = !std::isfinite(out);
    return {ok, ok ? 0.0 : INFINITY, 0.0, ok ? "" : "reference is Inf but the output is finite"};
  }
  const double tol = rtol * (std::fabs(ref) + scale) + dtype_atol(out_dtype);
  if (!std::isfinite(out))
    return {false, INFINITY, tol, "reference is finite but the output is not"};
  const double err = std::fabs(out - ref);
  return {err <= tol, err, tol, err <= tol ? "" : "outside tolerance"};
}

}  // namespace fmlp_test
