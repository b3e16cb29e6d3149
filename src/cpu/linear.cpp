// linear_cpu_avx2_gemv: y = x W^T + b on the host. The op is a stream over W, so each thread owns a
// contiguous slice of W rows and dots every 4-row group with a block of x rows (converted once to
// fp32 in the workspace) while the group is in L1. fp8 e4m3 weights are widened in registers; the
// per-row or per-tensor scale is applied to the finished dot product. fp8 activations (W8A8) are
// widened exactly when x is converted to fp32; their scale joins the weight scale at the end. Each
// output's summation order depends only on K, never on the thread count.
#include <omp.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/linear_desc.hpp"
#include "cpu/mlp_common.hpp"

namespace fmlp::detail {
namespace {

using cpu::hsum4;
using cpu::padded;

// e4m3 bits -> fp32: the magnitude bits shifted into an fp32 put the exponent 120 too low
// (subnormals included, exactly), one multiply fixes it; 0x7f is NaN.
inline __m256 fp8x8_to_f32(__m128i bytes) {
  const __m256i b = _mm256_cvtepu8_epi32(bytes);
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  __m256 f =
      _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), _mm256_set1_ps(0x1p120f));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
  f = _mm256_blendv_ps(f, _mm256_set1_ps(__builtin_nanf("")), nan);
  return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

template <fmlp_dtype_t WT>
constexpr int64_t wsize() {
  return WT == FMLP_DTYPE_F32 ? 4 : WT == FMLP_DTYPE_F8_E4M3 ? 1 : 2;
}

template <fmlp_dtype_t WT>
inline __m256 wload8(const char* p) {
  if constexpr (WT == FMLP_DTYPE_F8_E4M3)
    return fp8x8_to_f32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  else
    return cpu::load8<WT>(p);
}

template <fmlp_dtype_t WT>
inline __m256 wload_partial(const char* p, int64_t n) {
  alignas(32) char buf[32] = {};
  std::memcpy(buf, p, size_t(n * wsize<WT>()));
  return wload8<WT>(buf);
}

// out[r] lane j = w[j] . a[r] over k; the a rows are zero-padded to a multiple of 8.
template <fmlp_dtype_t WT, int MR>
inline void dot4(const char* const* w, const float* const* a, int64_t k, __m128* out) {
  __m256 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    __m256 av[MR];
    for (int r = 0; r < MR; ++r) av[r] = _mm256_loadu_ps(a[r] + c);
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = wload8<WT>(w[j] + c * wsize<WT>());
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(wv, av[r], acc[r][j]);
    }
  }
  if (c < k)
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = wload_partial<WT>(w[j] + c * wsize<WT>(), k - c);
      for (int r = 0; r < MR; ++r)
        acc[r][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a[r] + c), acc[r][j]);
    }
  for (int r = 0; r < MR; ++r) out[r] = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

struct View {
  const fmlp_linear_args_t* a;
  const LinearDesc* d;
  const float* xs;  // [m, padded(k)] fp32
  int64_t ldx;
};

// y[i][j..j+nj) for x rows i in [r0, r1), W rows j..j+nj (nj <= 4).
template <fmlp_dtype_t WT>
void row_group(const View& v, int64_t j, int64_t nj, int64_t r0, int64_t r1) {
  const LinearDesc& d = *v.d;
  const size_t es = dtype_size(d.out_dtype);
  const char* w[4];
  for (int64_t q = 0; q < 4; ++q)
    w[q] = row_ptr(v.a->w, j + std::min(q, nj - 1), size_t(wsize<WT>()));
  float scale[4] = {1.f, 1.f, 1.f, 1.f}, bias[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t q = 0; q < nj; ++q) {
    if (d.w_scale != ScaleKind::kNone)
      scale[q] =
          static_cast<const float*>(v.a->w_scale.data)[d.w_scale == ScaleKind::kPerRow ? j + q : 0];
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
  int64_t r = r0;
  for (; r + 3 <= r1; r += 3) {
    const float* ar[3] = {v.xs + r * v.ldx, v.xs + (r + 1) * v.ldx, v.xs + (r + 2) * v.ldx};
    __m128 s[3];
    dot4<WT, 3>(w, ar, d.k, s);
    for (int q = 0; q < 3; ++q) emit(r + q, s[q]);
  }
  for (; r < r1; ++r) {
    const float* ar[1] = {v.xs + r * v.ldx};
    __m128 s[1];
    dot4<WT, 1>(w, ar, d.k, s);
    emit(r, s[0]);
  }
}

template <fmlp_dtype_t WT>
void run_impl(const View& v) {
  const LinearDesc& d = *v.d;
  const int nt_max = cpu::thread_count(double(d.m) * double(d.n) * double(d.k));
  float* xs = const_cast<float*>(v.xs);
  const size_t es = dtype_size(d.act_dtype);
  constexpr int64_t kRowBlock = 48;  // x rows that stay in L2 while a thread's W slice streams by
#pragma omp parallel num_threads(nt_max)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
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
    for (int64_t r0 = 0; r0 < d.m; r0 += kRowBlock)
      for (int64_t j = b; j < e; j += 4)
        row_group<WT>(v, j, std::min<int64_t>(4, e - j), r0, std::min(d.m, r0 + kRowBlock));
  }
}

bool cpu_supports(const LinearDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CPU) return (*why = "needs host memory", false);
  if (const std::string& isa = cpu_unavailable_reason(); !isa.empty()) return (*why = isa, false);
  return true;
}

size_t cpu_workspace(const LinearDesc& d) {
  return size_t(d.m * padded(d.k)) * sizeof(float) + 64;
}

fmlp_status_t cpu_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws, void*) {
  const uintptr_t p = (uintptr_t(ws) + 63) / 64 * 64;
  const View v{&a, &d, reinterpret_cast<const float*>(p), padded(d.k)};
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
