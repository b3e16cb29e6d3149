// softmax_cpu_avx2_chunked: softmax / log_softmax over rows on the host. Every row is cut into
// fixed chunks of kChunk elements; pass 1 finds each chunk's max and sum of exp (in L1), the
// chunk results are combined per row in chunk order in fp64, pass 2 writes the outputs. The
// partition never depends on the thread count, so neither do the results, and a single long row
// still spreads over every thread. NaN / Inf follow from the formula, as in the ref.
#include <omp.h>

#include <cmath>
#include <limits>

#include "core/dtype.hpp"
#include "core/linear_desc.hpp"
#include "cpu/mlp_common.hpp"

namespace fmlp::detail {
namespace {

constexpr int64_t kChunk = 8192;

struct Partial {
  double max, sum;
};

int64_t chunks_of(const SoftmaxDesc& d) {
  return (d.n + kChunk - 1) / kChunk;
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  const __m128 s = cpu::hsum4(v, v, v, v);
  return _mm_cvtss_f32(s);
}

// Max and sum of exp((x - max) / T) of x[0, n). A NaN may be lost by the max but not by the sum.
// A chunk of only -Inf sums relative to 0 (the CUDA kernels' combine rule): it adds 0 to its
// row instead of (-Inf - -Inf) = NaN, so masked logits spanning whole chunks leave the rest of the
// row a softmax; an all -Inf row still comes out NaN (its row max is -Inf).
template <fmlp_dtype_t T>
Partial chunk_partial(const char* x, int64_t n, float inv_t) {
  constexpr int64_t es = T == FMLP_DTYPE_F32 ? 4 : 2;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, cpu::load8<T>(x + i * es));
  float m = hmax(mv);
  for (int64_t j = i; j < n; ++j) m = std::max(m, float(load_as_double(x, T, j)));
  const float ms = m == -INFINITY ? 0.f : m;
  const __m256 m8 = _mm256_set1_ps(ms), t8 = _mm256_set1_ps(inv_t);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_add_ps(s0,
                       cpu::exp8(_mm256_mul_ps(_mm256_sub_ps(cpu::load8<T>(x + i * es), m8), t8)));
    s1 = _mm256_add_ps(
        s1, cpu::exp8(_mm256_mul_ps(_mm256_sub_ps(cpu::load8<T>(x + (i + 8) * es), m8), t8)));
  }
  double s = double(hsum(_mm256_add_ps(s0, s1)));
  for (; i < n; ++i) s += std::exp(double((float(load_as_double(x, T, i)) - ms) * inv_t));
  return {double(m), s};
}

template <fmlp_dtype_t T>
void chunk_output(const char* x, char* y, int64_t n, float m, float inv_t, float inv_s, float log_s,
                  bool log) {
  constexpr int64_t es = T == FMLP_DTYPE_F32 ? 4 : 2;
  const __m256 m8 = _mm256_set1_ps(m), t8 = _mm256_set1_ps(inv_t);
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t cnt = std::min<int64_t>(8, n - i);
    const __m256 v = cnt == 8 ? cpu::load8<T>(x + i * es) : cpu::load_partial<T>(x + i * es, cnt);
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(v, m8), t8);
    const __m256 o = log ? _mm256_sub_ps(z, _mm256_set1_ps(log_s))
                         : _mm256_mul_ps(cpu::exp8(z), _mm256_set1_ps(inv_s));
    cpu::store_upto8(y + i * es, T, o, cnt);
  }
}

template <fmlp_dtype_t T>
void run_impl(const fmlp_softmax_args_t& a, const SoftmaxDesc& d, Partial* ws) {
  const int64_t chunks = chunks_of(d), tasks = d.rows * chunks;
  const size_t es = dtype_size(T);
  const float inv_t = 1.f / d.temperature;
  Partial* row_stats = ws + tasks;  // per row: max, 1/sum (or log sum)
  const int nt = cpu::thread_count(double(d.rows) * double(d.n) * 8.0);
  const auto chunk = [&](int64_t t, int64_t* r, int64_t* off, int64_t* len) {
    *r = t / chunks;
    *off = (t % chunks) * kChunk;
    *len = std::min(kChunk, d.n - *off);
  };
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      int64_t r, off, len;
      chunk(t, &r, &off, &len);
      ws[t] = chunk_partial<T>(row_ptr(a.x, r, es) + off * int64_t(es), len, inv_t);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < d.rows; ++r) {
      const Partial* p = ws + r * chunks;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, p[c].max);
      double s = 0.0;
      for (int64_t c = 0; c < chunks; ++c) s += p[c].sum * std::exp((p[c].max - m) * double(inv_t));
      row_stats[r] = {m, s};
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      int64_t r, off, len;
      chunk(t, &r, &off, &len);
      const Partial st = row_stats[r];
      chunk_output<T>(row_ptr(a.x, r, es) + off * int64_t(es),
                      const_cast<char*>(row_ptr(a.y, r, es)) + off * int64_t(es), len,
                      float(st.max), inv_t, float(1.0 / st.sum), float(std::log(st.sum)), d.log);
    }
  }
}

bool cpu_supports(const SoftmaxDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CPU) return (*why = "needs host memory", false);
  if (const std::string& isa = cpu_unavailable_reason(); !isa.empty()) return (*why = isa, false);
  return true;
}

size_t cpu_workspace(const SoftmaxDesc& d) {
  return size_t(d.rows * (chunks_of(d) + 1)) * sizeof(Partial);
}

fmlp_status_t cpu_run(const fmlp_softmax_args_t& a, const SoftmaxDesc& d, void* ws, void*) {
  Partial* p = static_cast<Partial*>(ws);
  switch (d.dtype) {
    case FMLP_DTYPE_F16: run_impl<FMLP_DTYPE_F16>(a, d, p); break;
    case FMLP_DTYPE_BF16: run_impl<FMLP_DTYPE_BF16>(a, d, p); break;
    default: run_impl<FMLP_DTYPE_F32>(a, d, p); break;
  }
  return FMLP_SUCCESS;
}

const SoftmaxKernel kCpuKernels[] = {
    {"softmax_cpu_avx2_chunked", FMLP_BACKEND_CPU, cpu_supports, cpu_workspace, cpu_run},
};

}  // namespace

SoftmaxKernelList cpu_softmax_kernels() {
  return {kCpuKernels, 1};
}

}  // namespace fmlp::detail
