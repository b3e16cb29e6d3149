#include "blas_baseline.hpp"

#include "blas_shim.hpp"
#if FMLP_CLI_HAVE_OPENBLAS
#define FMLP_CBLAS(f) cblas_##f
#else  // unreachable: the constructor throws; these keep the file compiling
#define FMLP_CBLAS(f) no_cblas
#define CblasRowMajor 0
#define CblasNoTrans 0
#define CblasTrans 0
template <typename... A>
void no_cblas(A...) {}
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cli_common.hpp"
#include "host_timer.hpp"

namespace fmlp_cli {
namespace {

float* f32(const HostTensor& t) {
  return static_cast<float*>(t.data());
}

// out[j] = act(in[j] + bias[j]) over a row, in forms GCC vectorises with glibc's libmvec (this
// file is built with -ffast-math): a fair unfused baseline runs its activation pass at SIMD speed,
// not as a scalar libm loop.
void activate_row(fmlp_activation_t act, const float* in, const float* bias, float* out,
                  int64_t n) {
  switch (act) {
    case FMLP_ACT_RELU:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float v = in[j] + (bias ? bias[j] : 0.f);
        out[j] = v > 0.f ? v : 0.f;
      }
      break;
    case FMLP_ACT_GELU:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float v = in[j] + (bias ? bias[j] : 0.f);
        out[j] = 0.5f * v * (1.f + erff(v * 0.70710678f));
      }
      break;
    case FMLP_ACT_GELU_TANH:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {  // 0.5 v (1 + tanh u) = v / (1 + exp(-2u))
        const float v = in[j] + (bias ? bias[j] : 0.f);
        out[j] = v / (1.f + expf(-1.5957691216f * (v + 0.044715f * v * v * v)));
      }
      break;
    case FMLP_ACT_SILU:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float v = in[j] + (bias ? bias[j] : 0.f);
        out[j] = v / (1.f + expf(-v));
      }
      break;
    case FMLP_ACT_RELU2:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float v = std::max(in[j] + (bias ? bias[j] : 0.f), 0.f);
        out[j] = v * v;
      }
      break;
    case FMLP_ACT_MAX_ENUM: break;  // not an activation (validation rejects it)
  }
}

}  // namespace

BlasBaseline::BlasBaseline(const HostMlp& problem, int copies, bool gemm_only)
    : shape_(problem.spec().shape), m_(problem.spec().m), gemm_only_(gemm_only) {
#if !FMLP_CLI_HAVE_OPENBLAS
  throw CliError(
      "this fusedmlp was built without OpenBLAS (-DFMLP_CLI_OPENBLAS=OFF): no host "
      "baseline; pass --no-baseline");
#endif
  if (shape_.norm != FMLP_NORM_NONE || problem.spec().residual != Residual::kNone)
    throw CliError("the OpenBLAS baseline covers norm-free, residual-free problems only");
  const int64_t H = shape_.hidden, K = shape_.d_in, N = shape_.d_out;
  const int64_t rows1 = shape_.gated ? 2 * H : H;
  const WeightSet& w = problem.weights(0);
  Set s;
  s.w1 = HostTensor(FMLP_DTYPE_F32, rows1, K);
  widen_to_f32(w.w1, &w.w1_scale, f32(s.w1));
  if (!w.w_up.empty()) widen_to_f32(w.w_up, &w.w_up_scale, f32(s.w1) + H * K);
  s.w2 = HostTensor(FMLP_DTYPE_F32, N, H);
  widen_to_f32(w.w2, &w.w2_scale, f32(s.w2));
  if (!w.b1.empty()) {
    s.b1 = HostTensor(FMLP_DTYPE_F32, rows1, 0);
    widen_to_f32(w.b1, nullptr, f32(s.b1));
    if (!w.b_up.empty()) widen_to_f32(w.b_up, nullptr, f32(s.b1) + H);
  }
  if (!w.b2.empty()) {
    s.b2 = HostTensor(FMLP_DTYPE_F32, N, 0);
    widen_to_f32(w.b2, nullptr, f32(s.b2));
  }
  for (int i = 1; i < copies; ++i)
    sets_.push_back({s.w1.clone(), s.b1.clone(), s.w2.clone(), s.b2.clone()});
  sets_.insert(sets_.begin(), std::move(s));
  set_batch(problem);
}

void BlasBaseline::set_batch(const HostMlp& problem) {
  const int64_t H = shape_.hidden;
  m_ = problem.spec().m;
  x_ = HostTensor(FMLP_DTYPE_F32, m_, shape_.d_in);
  widen_to_f32(problem.x(), nullptr, f32(x_));
  h_ = HostTensor(FMLP_DTYPE_F32, m_, shape_.gated ? 2 * H : H);
  a_ = shape_.gated ? HostTensor(FMLP_DTYPE_F32, m_, H) : HostTensor();
  y_ = HostTensor(FMLP_DTYPE_F32, m_, shape_.d_out);
}

size_t BlasBaseline::weight_bytes() const {
  const Set& s = sets_.front();
  return s.w1.bytes() + s.w2.bytes() + (s.b1.empty() ? 0 : s.b1.bytes()) +
         (s.b2.empty() ? 0 : s.b2.bytes());
}

void BlasBaseline::run(int copy) {
  const Set& s = sets_[size_t(copy)];
  const int64_t H = shape_.hidden, K = shape_.d_in, N = shape_.d_out;
  const int64_t rows1 = shape_.gated ? 2 * H : H;
  const int m = int(m_);
  const bool gemv = m == 1 && !gemm_only_;
  if (gemv) FMLP_CBLAS(sgemv)
  (CblasRowMajor, CblasNoTrans, int(rows1), int(K), 1.f, f32(s.w1), int(K), f32(x_), 1, 0.f,
   f32(h_), 1);
  else FMLP_CBLAS(sgemm)(CblasRowMajor, CblasNoTrans, CblasTrans, m, int(rows1), int(K), 1.f,
                         f32(x_), int(K), f32(s.w1), int(K), 0.f, f32(h_), int(rows1));

  // The activation pass: one read of h (+ b1), one write of the activated hidden state.
  const float* b1 = s.b1.empty() ? nullptr : f32(s.b1);
  float* h = f32(h_);
  float* act_out = shape_.gated ? f32(a_) : h;
  const fmlp_activation_t act = shape_.act;
  const bool gated = shape_.gated;
  // Small passes stay on this thread: waking OpenMP workers while OpenBLAS's own threads still
  // spin would oversubscribe the cores and cost more than the pass itself.
  const bool threaded = m_ * H >= (int64_t(1) << 16);
#pragma omp parallel for schedule(static) if (threaded)
  for (int64_t i = 0; i < m_; ++i) {
    const float* row = h + i * rows1;
    float* out = act_out + i * H;
    activate_row(act, row, b1, out, H);
    if (gated) {
      const float* up = row + H;
      const float* bu = b1 ? b1 + H : nullptr;
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) out[j] *= up[j] + (bu ? bu[j] : 0.f);
    }
  }

  float beta = 0.f;
  if (!s.b2.empty()) {
    for (int64_t i = 0; i < m_; ++i) std::memcpy(f32(y_) + i * N, f32(s.b2), size_t(N) * 4);
    beta = 1.f;
  }
  if (gemv) FMLP_CBLAS(sgemv)
  (CblasRowMajor, CblasNoTrans, int(N), int(H), 1.f, f32(s.w2), int(H), act_out, 1, beta, f32(y_),
   1);
  else FMLP_CBLAS(sgemm)(CblasRowMajor, CblasNoTrans, CblasTrans, m, int(N), int(H), 1.f, act_out,
                         int(H), f32(s.w2), int(H), beta, f32(y_), int(N));
}

std::vector<float> BlasBaseline::output_rows(const std::vector<int64_t>& rows) const {
  std::vector<float> out;
  const int64_t n = shape_.d_out;
  for (int64_t r : rows) out.insert(out.end(), f32(y_) + r * n, f32(y_) + (r + 1) * n);
  return out;
}

std::vector<double> BlasBaseline::time_calls(int reps, int first) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const HostTimer timer;
    run((first + i) % copies());
    t.push_back(timer.seconds());
  }
  return t;
}

}  // namespace fmlp_cli
