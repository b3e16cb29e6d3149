// linear_cpu_avx2_gemv: y = x W^T + b on the host. The op is a stream over W, so each thread owns a
// contiguous slice of W rows and dots every 4-row group with a block of x rows (converted once to
// fp32 in the workspace) while the group is in L1. fp8 e4m3 weights are widened in registers as
// code / 256 (cpu/fp8.hpp), or, from cpu::kWidenOnceRows x rows, once per row group into a thread's
// scratch; the per-row or per-tensor scale (times 256) is applied to the finished dot product,
// block scales (128 x 128) to each 128-column chunk's.
// fp8 activations (W8A8) are widened exactly when x is converted to fp32; their scale joins the
// weight scale at the end. Each output's summation order depends only on K, never on the thread
// count.
#include <omp.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/linear_desc.hpp"
#include "cpu/mlp_common.hpp"

namespace fmlp::detail {
namespace {

using cpu::padded;

constexpr int64_t kRowBlock = 48;  // x rows that stay in L2 while a thread's W slice streams by

struct View {
  const fmlp_linear_args_t* a;
  const LinearDesc* d;
  const float* xs;  // [m, padded(k)] fp32
  int64_t ldx;
  float* wide;  // fp8 weights: per thread [4][ldx] fp32 for a row group widened once
};

// y[i][j..j+nj) for x rows i in [r0, r1), W rows j..j+nj (nj <= 4); `v.wide` is this thread's.
template <fmlp_dtype_t WT>
void row_group(const View& v, int64_t j, int64_t nj, int64_t r0, int64_t r1) {
  const LinearDesc& d = *v.d;
  const size_t es = dtype_size(d.out_dtype);
  const char* w[4];
  for (int64_t q = 0; q < 4; ++q) w[q] = row_ptr(v.a->w, j + std::min(q, nj - 1), dtype_size(WT));
  float scale[4] = {1.f, 1.f, 1.f, 1.f}, bias[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t q = 0; q < nj; ++q) {
    if (d.w_scale == ScaleKind::kPerTensor || d.w_scale == ScaleKind::kPerRow)
      // fp8 dot products are of code / 256 (cpu/fp8.hpp)
      scale[q] = static_cast<const float*>(
                     v.a->w_scale.data)[d.w_scale == ScaleKind::kPerRow ? j + q : 0] *
                 (WT == FMLP_DTYPE_F8_E4M3 ? cpu::kF8Unscale : 1.f);
    if (d.bias_dtype != FMLP_DTYPE_INVALID)
      bias[q] = float(load_as_double(v.a->bias.data, d.bias_dtype, j + q));
  }
  const float* x_scale = static_cast<const float*>(v.a->x_scale.data);
  const auto emit = [&](int64_t r, __m128 s) {
    alignas(16) float t[4];
    _mm_store_ps(t, s);
    char* y = const_cast<char*>(row_ptr(v.a->y, r, es));
    const float xs =
        d.x_scale == ScaleKind::kNone ? 1.f : x_scale[d.x_scale == ScaleKind::kPerRow ? r : 0];
    for (int64_t q = 0; q < nj; ++q)
      store_from_double(y, d.out_dtype, j + q, double(t[q] * (xs * scale[q]) + bias[q]));
  };
  if (d.w_scale != ScaleKind::kBlock) {
    cpu::dot_row_group<WT>(w, v.xs + r0 * v.ldx, v.ldx, r1 - r0, d.k, v.wide,
                           [&](int64_t r, __m128 s) { emit(r0 + r, s); });
    return;
  }
  // Block scales: each 128-column chunk's dot products (code / 256) times that chunk's scale of
  // the row's block, summed in chunk order.
  const fmlp_tensor_t& st = v.a->w_scale;
  __m128 acc[kRowBlock];
  for (int64_t r = 0; r < r1 - r0; ++r) acc[r] = _mm_setzero_ps();
  for (int64_t c0 = 0; c0 < d.k; c0 += kFp8Block) {
    const char* wc[4];
    alignas(16) float sc[4];
    for (int64_t q = 0; q < 4; ++q) {
      const int64_t row = j + std::min(q, nj - 1);
      wc[q] = w[q] + c0;  // fp8: one byte a column
      sc[q] = static_cast<const float*>(
                  st.data)[(row / kFp8Block) * st.stride[0] + (c0 / kFp8Block) * st.stride[1]] *
              cpu::kF8Unscale;
    }
    const __m128 s4 = _mm_load_ps(sc);
    cpu::dot_row_group<WT>(wc, v.xs + r0 * v.ldx + c0, v.ldx, r1 - r0,
                           std::min(kFp8Block, d.k - c0), v.wide,
                           [&](int64_t r, __m128 s) { acc[r] = _mm_fmadd_ps(s, s4, acc[r]); });
  }
  for (int64_t r = 0; r < r1 - r0; ++r) emit(r0 + r, acc[r]);
}

template <fmlp_dtype_t WT>
void run_impl(const View& v) {
  const LinearDesc& d = *v.d;
  const int nt_max = std::min(cpu::thread_count(double(d.m) * double(d.n) * double(d.k)),
                              std::max(1, omp_get_max_threads()));  // what the scratch is sized for
  float* xs = const_cast<float*>(v.xs);
  const size_t es = dtype_size(d.act_dtype);
  auto body = [&](int t, int nt) {
    int64_t b, e;
    cpu::split(d.m, 1, nt, t, &b, &e);
    for (int64_t i = b; i < e; ++i) {
      const char* x = row_ptr(v.a->x, i, es);
      float* o = xs + i * v.ldx;
      for (int64_t c = 0; c < d.k; ++c) o[c] = float(load_as_double(x, d.act_dtype, c));
      std::fill(o + d.k, o + v.ldx, 0.f);
    }
#pragma omp barrier
    cpu::split(d.n, 16, nt, t, &b, &e);
    View mine = v;
    if (v.wide) mine.wide = v.wide + int64_t(t) * 4 * v.ldx;
    for (int64_t r0 = 0; r0 < d.m; r0 += kRowBlock)
      for (int64_t j = b; j < e; j += 4)
        row_group<WT>(mine, j, std::min<int64_t>(4, e - j), r0, std::min(d.m, r0 + kRowBlock));
  };
  // One thread (small calls: cpu::thread_count) runs without a parallel region: its fork and join
  // cost more than a decode-sized GEMV itself (bench/host_overhead.py, the linear rows).
  if (nt_max == 1) {
    body(0, 1);
    return;
  }
#pragma omp parallel num_threads(nt_max)
  body(omp_get_thread_num(), omp_get_num_threads());
}

bool cpu_supports(const LinearDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CPU) return (*why = "needs host memory", false);
  if (const std::string& isa = cpu_unavailable_reason(); !isa.empty()) return (*why = isa, false);
  return true;
}

// fp8 weights with cpu::kWidenOnceRows x rows or more add a [4][padded(k)] scratch per thread,
// sized for omp_get_max_threads() at query time (the API checks the size again at run time; a run
// uses no more threads), like the cpu mlp's blocked kernel.
size_t cpu_workspace(const LinearDesc& d) {
  const int64_t wide =
      cpu::widens_f8_once(d.w_dtype, d.m) ? int64_t(std::max(1, omp_get_max_threads())) * 4 : 0;
  return size_t((d.m + wide) * padded(d.k)) * sizeof(float) + 64;
}

fmlp_status_t cpu_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws, void*) {
  const uintptr_t p = (uintptr_t(ws) + 63) / 64 * 64;
  float* xs = reinterpret_cast<float*>(p);
  const View v{&a, &d, xs, padded(d.k),
               cpu::widens_f8_once(d.w_dtype, d.m) ? xs + d.m * padded(d.k) : nullptr};
  switch (d.w_dtype) {
    case FMLP_DTYPE_F16: run_impl<FMLP_DTYPE_F16>(v); break;
    case FMLP_DTYPE_BF16: run_impl<FMLP_DTYPE_BF16>(v); break;
    case FMLP_DTYPE_F8_E4M3: run_impl<FMLP_DTYPE_F8_E4M3>(v); break;
    default: run_impl<FMLP_DTYPE_F32>(v); break;
  }
  return FMLP_SUCCESS;
}

const LinearKernel kCpuKernels[] = {
    {"linear_cpu_avx2_gemv", FMLP_BACKEND_CPU, cpu_supports, cpu_workspace, cpu_run},
};

}  // namespace

LinearKernelList cpu_linear_kernels() {
  return {kCpuKernels, 1};
}

}  // namespace fmlp::detail
