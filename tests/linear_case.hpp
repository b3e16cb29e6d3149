// One linear case (LinCase) and its run through a named entry against an fp64 reference computed
// here (tolerance rule of tolerance.hpp: rtol * (|ref| + l2 norm of the summed terms) + atol, rtol
// the larger of the output and weight dtypes': f32 1e-4, f16 2^-9, bf16 and f8 2^-7), shared by
// test_linear.cpp and test_linear_odd.cpp. W8A8 cases (fp8 x with per-row or per-tensor x_scale)
// follow torch._scaled_mm's semantics.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "op_tensor.hpp"
#include "tolerance.hpp"

namespace fmlp_test {

struct LinCase {
  int64_t m = 1, n = 7, k = 127;
  fmlp_dtype_t xt = FMLP_DTYPE_F32, wt = FMLP_DTYPE_F32, bt = kAbsent;
  bool per_row = false, misaligned = false, strided = false, nonfinite = false;
  bool x_misaligned = false;  // x and y only: W stays 16-byte aligned
  bool x_strided = false;     // x and y only
  bool w_nan = false;         // fp8 W: NaN codes (0x7f, 0xff) in two rows
  bool wide_x = false;        // |x| log-uniform over 2^-20..2^10 in every row
  fmlp_dtype_t yt = kAbsent;  // y's dtype when x is f8_e4m3 (W8A8); else x's
  bool x_per_row = false;     // W8A8: x_scale [M] rather than [1]
  int64_t w_pad = 0;          // W rows padded by this many elements (poison) past K: ldw > K
  bool block = false;         // fp8 W: w_scale [ceil(N / 128), ceil(K / 128)] (block scales)
  fmlp_dtype_t out() const { return yt != kAbsent ? yt : xt; }
  std::string name() const {
    return "M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k) +
           " x=" + fmlp_dtype_name(xt) + " w=" + fmlp_dtype_name(wt) +
           (bt != kAbsent ? std::string(" bias=") + fmlp_dtype_name(bt) : "") +
           (wt == FMLP_DTYPE_F8_E4M3 ? (block     ? " scale/128x128"
                                        : per_row ? " scale/row"
                                                  : " scale/tensor")
                                     : "") +
           (xt == FMLP_DTYPE_F8_E4M3 ? std::string(x_per_row ? " x_scale/row" : " x_scale/tensor") +
                                           " y=" + fmlp_dtype_name(out())
                                     : "") +
           (misaligned ? " misaligned" : "") + (x_misaligned ? " x-misaligned" : "") +
           (strided ? " strided" : "") + (x_strided ? " x-strided" : "") +
           (nonfinite ? " nonfinite" : "") + (w_nan ? " w-nan" : "") + (wide_x ? " wide-x" : "") +
           (w_pad ? " w-pad=" + std::to_string(w_pad) : "");
  }
};

inline HostMatrix matrix(fmlp_dtype_t t, int64_t rows, int64_t cols) {
  HostMatrix h;
  h.dtype = t;
  h.rows = rows;
  h.cols = cols;
  h.bytes.resize(size_t(rows * cols) * fmlp::dtype_size(t));
  return h;
}

// How run_case calls the kernel: directly or captured in a CUDA graph (replayed after the inputs
// are refreshed); `y_bytes` receives y's buffer.
// Runs one case through `kernel`; returns "", the failure, or kSkipped + why when the kernel
// does not take the case.
inline std::string run_case(const LinCase& c, const char* kernel, bool device, uint64_t seed,
                            RunMode mode = {}) {
  Rng rng(seed);
  std::normal_distribution<double> nd;
  std::uniform_real_distribution<double> ud(-1.0, 1.0);
  HostMatrix x = matrix(c.xt, c.m, c.k), w = matrix(c.wt, c.n, c.k);
  const int64_t nb = (c.n + 127) / 128, kb = (c.k + 127) / 128;
  HostMatrix s = c.block ? matrix(FMLP_DTYPE_F32, nb, kb)
                         : matrix(FMLP_DTYPE_F32, 1, c.per_row ? c.n : 1),
             b;
  const bool x8 = c.xt == FMLP_DTYPE_F8_E4M3;
  HostMatrix xsc = matrix(FMLP_DTYPE_F32, 1, c.x_per_row ? c.m : 1);
  for (int64_t i = 0; i < xsc.cols; ++i) xsc.set(0, i, (0.5 + ud(rng) * 0.25) / 100.0);
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.k; ++j)
      x.set(i, j,
            x8         ? ud(rng) * 300.0
            : c.wide_x ? std::copysign(std::exp2(15.0 * ud(rng) - 5.0), ud(rng))
                       : nd(rng));
  const double wscale = c.wt == FMLP_DTYPE_F8_E4M3 ? 100.0 : 1.0 / std::sqrt(double(c.k));
  for (int64_t i = 0; i < c.n; ++i)
    for (int64_t j = 0; j < c.k; ++j) w.set(i, j, ud(rng) * wscale);
  for (int64_t r = 0; r < s.rows; ++r)  // block scales 1/4 .. 4 apart: a misread block shows
    for (int64_t i = 0; i < s.cols; ++i)
      s.set(r, i,
            (0.5 + ud(rng) * 0.25) / (100.0 * std::sqrt(double(c.k))) *
                (c.block ? std::exp2(double((r * 3 + i) % 5) - 2.0) : 1.0));
  if (c.nonfinite && !x8) {  // e4m3fn has no Inf
    x.set(0, c.k / 2, NAN);
    if (c.m >= 2) x.set(1, 0, INFINITY);
  }
  if (c.w_nan && c.wt == FMLP_DTYPE_F8_E4M3 && c.k > 0) {  // HostMatrix::set saturates: raw codes
    w.bytes[size_t(c.n / 2 * c.k + c.k / 3)] = 0x7f;
    w.bytes[size_t((c.n - 1) * c.k + c.k - 1)] = 0xff;
  }
  if (c.bt != kAbsent) {
    b = matrix(c.bt, 1, c.n);
    for (int64_t i = 0; i < c.n; ++i) b.set(0, i, 0.1 * nd(rng));
  }
  PlacedTensor px(c.xt, c.m, c.k, device, c.misaligned || c.x_misaligned, c.strided || c.x_strided);
  PlacedTensor pw(c.wt, c.n, c.k + c.w_pad, device, c.misaligned, c.strided);
  HostMatrix wp =
      w;  // padded rows: bytes 0x7f (NaN or near the largest finite) that must not count
  if (c.w_pad) {
    const size_t es = fmlp::dtype_size(c.wt), row = size_t(c.k) * es;
    wp = matrix(c.wt, c.n, c.k + c.w_pad);
    std::fill(wp.bytes.begin(), wp.bytes.end(), 0x7f);
    for (int64_t i = 0; i < c.n; ++i)
      std::memcpy(wp.bytes.data() + size_t(i) * (row + size_t(c.w_pad) * es),
                  w.bytes.data() + size_t(i) * row, row);
  }
  PlacedTensor py(c.out(), c.m, c.n, device, c.misaligned || c.x_misaligned,
                  c.strided || c.x_strided);
  PlacedTensor ps(FMLP_DTYPE_F32, s.rows, s.cols, device, false, c.block && c.strided);
  PlacedTensor pxs(FMLP_DTYPE_F32, 1, xsc.cols, device, false, false);
  PlacedTensor pb;
  HostMatrix stale = x;  // what a captured graph finds before its inputs are refreshed
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.k; ++j) stale.set(i, j, nd(rng));
  px.upload(mode.graph ? stale : x);
  pw.upload(wp);
  ps.upload(s);
  pxs.upload(xsc);
  fmlp_linear_args_t a{py.view(), px.view(), pw.view(), fmlp_tensor_none(), fmlp_tensor_none()};
  a.w.shape[1] = c.k;  // of the c.k + c.w_pad columns placed
  if (c.wt == FMLP_DTYPE_F8_E4M3) a.w_scale = c.block ? ps.view() : ps.vector_view();
  if (x8) a.x_scale = pxs.vector_view();
  if (c.bt != kAbsent) {
    pb = PlacedTensor(c.bt, 1, c.n, device, c.misaligned, false);
    pb.upload(b);
    a.bias = pb.vector_view();
  }
  if (fmlp_linear_kernel_supports(&a, kernel) != FMLP_SUCCESS)
    return std::string(kSkipped) + fmlp_last_error();
  size_t bytes = 0;
  if (fmlp_linear_kernel_workspace_size(&a, kernel, &bytes) != FMLP_SUCCESS)
    return fmlp_last_error();
  Buffer ws(bytes, device);
  ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
  auto call = [&](void* stream) {
    return fmlp_linear_with_kernel(&a, kernel, bytes ? ws.data() : nullptr, bytes, stream);
  };
  if (mode.graph) {
    const std::string err = capture_and_replay(call, [&] { px.upload(x); });
    if (!err.empty()) return err;
  } else if (const fmlp_status_t st = call(nullptr); st != FMLP_SUCCESS) {
    return std::string(fmlp_status_name(st)) + ": " + fmlp_last_error();
  }
  if (mode.y_bytes) *mode.y_bytes = py.raw();
  std::string stray;
  const std::vector<double> out = py.download(&stray);
  if (!stray.empty()) return stray;
  if (device) {  // the workspace's zeroed part must be left zero for the next call
    const std::vector<unsigned char> left = ws.download();
    if (first_nonzero_in_zeroed_part(left) != left.size())
      return "the workspace's zeroed part was not left zero";
  }
  const double rtol = mlp_rtol(c.out(), c.wt);
  int bad = 0;
  std::string first;
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t o = 0; o < c.n; ++o) {
      const double sc =
          (c.wt == FMLP_DTYPE_F8_E4M3 && !c.block ? s.get(0, c.per_row ? o : 0) : 1.0) *
          (x8 ? xsc.get(0, c.x_per_row ? i : 0) : 1.0);
      double ref = 0.0, l2 = 0.0;
      for (int64_t j = 0; j < c.k; ++j) {
        const double t = w.get(o, j) * sc * (c.block ? s.get(o / 128, j / 128) : 1.0) * x.get(i, j);
        ref += t;
        l2 += t * t;
      }
      if (c.bt != kAbsent) ref += b.get(0, o), l2 += b.get(0, o) * b.get(0, o);
      const ElementCheck e =
          check_element(out[size_t(i * c.n + o)], ref, std::sqrt(l2), rtol, c.out());
      if (!e.ok && bad++ == 0)
        first = "y[" + std::to_string(i) + "][" + std::to_string(o) +
                "] = " + std::to_string(out[size_t(i * c.n + o)]) + ", ref " + std::to_string(ref) +
                ": " + e.why;
    }
  return bad ? std::to_string(bad) + " wrong outputs; first " + first : "";
}

}  // namespace fmlp_test
