// The cpu backend's op-table entries and what its two mlp kernels share: the argument view,
// workspace layout, the per-row norm and the vectorised epilogues.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "core/tensor_check.hpp"
#include "cpu/mlp_common.hpp"

namespace fmlp::detail {
namespace cpu {
namespace {

Rows rows_of(const fmlp_tensor_t& t, const fmlp_tensor_t* scale = nullptr) {
  Rows r{static_cast<const char*>(t.data), t.stride[0] * int64_t(elem_size(t.dtype))};
  if (scale != nullptr && !tensor_absent(*scale) && scale->ndim == 2) {
    r.block = static_cast<const float*>(scale->data);
    r.block_ld = scale->stride[0];
    r.block_cs = scale->shape[1] == 1 ? 0 : scale->stride[1];
  } else if (scale != nullptr && !tensor_absent(*scale)) {
    r.scale = static_cast<const float*>(scale->data);
    r.scale_step = scale->shape[0] == 1 ? 0 : 1;
  }
  return r;
}

Vec vec_of(const fmlp_tensor_t& t) {
  if (tensor_absent(t)) return {};
  return {static_cast<const char*>(t.data), t.dtype};
}

// Sum of n fp32 values (n a multiple of 8) in one fixed order.
float sum8(const float* p, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + k));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + k + 8));
  }
  if (k < n) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + k));
  return _mm_cvtss_f32(hsum4(_mm256_add_ps(a0, a1), a0, a0, a0));
}

}  // namespace

MlpView make_view(const fmlp_mlp_args_t& a, const MlpDesc& d) {
  const fmlp_mlp_weights_t& w = a.weights;
  MlpView v{};
  v.m = d.m;
  v.k = d.d_in;
  v.h = d.hidden;
  v.n = d.d_out;
  v.act_dtype = d.act_dtype;
  v.w_dtype = d.w_dtype;
  v.act = d.activation;
  v.norm = d.norm;
  v.eps = d.norm_eps;
  v.gated = d.gated;
  v.x = rows_of(a.x);
  v.y = static_cast<char*>(a.y.data);
  v.y_ld = a.y.stride[0] * int64_t(elem_size(a.y.dtype));
  if (d.has_residual) v.residual = rows_of(a.residual);
  v.w_gate = rows_of(w.w1, &w.w1_scale);
  v.b_gate = vec_of(w.b1);
  if (d.gated && d.stacked_gate_up) {
    v.w_up = v.w_gate.from(d.hidden, block_count(d.hidden));
    if (v.b_gate.data) v.b_up = {v.b_gate.at(d.hidden), v.b_gate.dtype};
  } else if (d.gated) {
    v.w_up = rows_of(w.w_up, &w.w_up_scale);
    v.b_up = vec_of(w.b_up);
  }
  v.w2 = rows_of(w.w2, &w.w2_scale);
  v.b2 = vec_of(w.b2);
  v.gamma = vec_of(w.norm_weight);
  v.beta = vec_of(w.norm_bias);
  return v;
}

size_t workspace_floats_bytes(const MlpDesc& d, int64_t extra_floats) {
  return size_t(d.m * (padded(d.d_in) + padded(d.hidden)) + extra_floats) * sizeof(float) + 64;
}

float* workspace_base(void* ws) {
  const uintptr_t p = (reinterpret_cast<uintptr_t>(ws) + 63) & ~uintptr_t(63);
  return reinterpret_cast<float*>(p);
}

void normalize_row(const MlpView& v, int64_t i, float* xn) {
  const int64_t k = v.k, kp = padded(k);
  const char* x = v.x.row(i);
  const size_t es = elem_size(v.act_dtype);
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) _mm256_storeu_ps(xn + c, load8(x + c * es, v.act_dtype));
  for (; c < kp; c += 8)
    _mm256_storeu_ps(xn + c,
                     c < k ? load_partial(x + c * es, v.act_dtype, k - c) : _mm256_setzero_ps());
  if (v.norm == FMLP_NORM_NONE) return;
  if (v.norm == FMLP_NORM_LAYERNORM) {
    // Centring on x[0] first keeps the fp32 rounding of the mean relative to the spread of the
    // row rather than to its offset (a row like 3 + small noise would otherwise lose digits).
    const __m256 shift = _mm256_set1_ps(xn[0]);
    for (c = 0; c < k; c += 8) {
      const __m256 r = _mm256_sub_ps(_mm256_loadu_ps(xn + c), shift);
      if (k - c >= 8) {
        _mm256_storeu_ps(xn + c, r);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, r);
        std::copy(tmp, tmp + (k - c), xn + c);
      }
    }
  }
  // Padding lanes are 0, so they add nothing to the sums; the mean is subtracted only from the
  // k real lanes below.
  const float mean = v.norm == FMLP_NORM_LAYERNORM ? sum8(xn, kp) / float(k) : 0.f;
  const __m256 vmean = _mm256_set1_ps(mean);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (c = 0; c < kp; c += 8) {
    const int64_t left = k - c;
    __m256 d = _mm256_sub_ps(_mm256_loadu_ps(xn + c), vmean);
    if (left < 8) {
      alignas(32) float mask[8];
      for (int l = 0; l < 8; ++l) mask[l] = l < left ? 1.f : 0.f;
      d = left > 0 ? _mm256_mul_ps(d, _mm256_load_ps(mask)) : _mm256_setzero_ps();
    }
    if ((c / 8) % 2 == 0)
      a0 = _mm256_fmadd_ps(d, d, a0);
    else
      a1 = _mm256_fmadd_ps(d, d, a1);
  }
  const float var = _mm_cvtss_f32(hsum4(_mm256_add_ps(a0, a1), a0, a0, a0)) / float(k);
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(var + v.eps));
  for (c = 0; c < k; c += 8) {
    const int64_t left = k - c;
    const __m256 g = load_upto8(v.gamma.at(c), v.gamma.dtype, left, 1.f);
    const __m256 b = load_upto8(v.beta.at(c), v.beta.dtype, left, 0.f);
    const __m256 r =
        _mm256_fmadd_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xn + c), vmean), inv), g, b);
    if (left >= 8) {
      _mm256_storeu_ps(xn + c, r);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, r);
      std::copy(tmp, tmp + left, xn + c);
    }
  }
}

void hidden_epilogue(const MlpView& v, int64_t j0, int64_t cnt, const float* g, const float* u,
                     float* h) {
  for (int64_t j = 0; j < cnt; j += 8) {
    const int64_t left = cnt - j;
    const __m256 bg = load_upto8(v.b_gate.at(j0 + j), v.b_gate.dtype, left, 0.f);
    __m256 r = activate8(v.act, _mm256_add_ps(_mm256_loadu_ps(g + j), bg));
    if (u) {
      const __m256 bu = load_upto8(v.b_up.at(j0 + j), v.b_up.dtype, left, 0.f);
      r = _mm256_mul_ps(r, _mm256_add_ps(_mm256_loadu_ps(u + j), bu));
    }
    store_upto8(h + j, FMLP_DTYPE_F32, r, left);
  }
}

void output_epilogue(const MlpView& v, int64_t i, int64_t o0, int64_t cnt, const float* acc) {
  const size_t es = elem_size(v.act_dtype);
  char* y = v.y + i * v.y_ld + o0 * int64_t(es);
  const char* res = v.residual.data ? v.residual.row(i) + o0 * int64_t(es) : nullptr;
  for (int64_t j = 0; j < cnt; j += 8) {
    const int64_t left = cnt - j;
    __m256 r =
        _mm256_add_ps(_mm256_loadu_ps(acc + j), load_upto8(v.b2.at(o0 + j), v.b2.dtype, left, 0.f));
    if (res) r = _mm256_add_ps(r, load_upto8(res + j * int64_t(es), v.act_dtype, left, 0.f));
    store_upto8(y + j * int64_t(es), v.act_dtype, r, left);
  }
}

int thread_count(double macs) {
  return macs < 2e5 ? 1 : std::max(1, omp_get_max_threads());
}

bool common_supports(const MlpDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CPU || d.layout == WeightLayout::kCudaPacked) {
    *why = "needs host memory";
    return false;
  }
  if (const std::string& isa = cpu_unavailable_reason(); !isa.empty()) {
    *why = isa;
    return false;
  }
  return true;
}

}  // namespace cpu

namespace {
const MlpKernel kCpuKernels[] = {
    {"mlp_cpu_avx2_decode", FMLP_BACKEND_CPU, cpu::decode_supports, cpu::decode_workspace,
     cpu::decode_run},
    {"mlp_cpu_avx2_blocked", FMLP_BACKEND_CPU, cpu::blocked_supports, cpu::blocked_workspace,
     cpu::blocked_run},
};
}  // namespace

MlpKernelList cpu_mlp_kernels() {
  return {kCpuKernels, 2};
}

}  // namespace fmlp::detail
