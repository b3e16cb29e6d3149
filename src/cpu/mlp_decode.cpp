// mlp_cpu_avx2_decode: the small-M kernel. At small M the op is a stream over the weights, so
// each weight matrix is read from memory exactly once for all M rows together: every thread owns
// a contiguous slice of weight rows (hidden units for W1/gate/up, outputs for W2), dots each
// 4-row group with all M rows while it is in L1, and keeps the fp32 hidden activations in the
// workspace between the two passes. fp8 block scales (128 x 128) scale each 128-column chunk's
// dot products, summed in chunk order; per-row and per-tensor scales scale the finished ones.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>

#include "cpu/mlp_common.hpp"

namespace fmlp::detail::cpu {
namespace {

// Stores lanes [0, nj) of s at o.
inline void store_group(float* o, __m128 s, int64_t nj) {
  if (nj == 4) {
    _mm_storeu_ps(o, s);
  } else {
    alignas(16) float tmp[4];
    _mm_store_ps(tmp, s);
    std::copy(tmp, tmp + nj, o);
  }
}

// The group of fp8 rows wr (rows j .. j + nj - 1 of w) with block scales: each 128-column chunk's
// dot products (code / 256) times the chunk's scale of each row's block, summed in chunk order.
void block_scaled_group(const Rows& w, const char* const* wr, int64_t j, int64_t nj, const float* a,
                        int64_t lda, int64_t m, int64_t k, float* o, int64_t ldo, float* wide) {
  __m128 acc[kDecodeMaxM];
  for (int64_t r = 0; r < m; ++r) acc[r] = _mm_setzero_ps();
  for (int64_t c0 = 0; c0 < k; c0 += kFp8Block) {
    const char* wc[4];
    alignas(16) float sc[4];
    for (int64_t q = 0; q < 4; ++q) {
      wc[q] = wr[q] + c0;  // one byte a code
      sc[q] = w.block_scale(j + std::min(q, nj - 1), c0) * kF8Unscale;
    }
    const __m128 s4 = _mm_load_ps(sc);
    dot_row_group<FMLP_DTYPE_F8_E4M3>(
        wc, a + c0, lda, m, std::min(kFp8Block, k - c0), wide,
        [&](int64_t r, __m128 s) { acc[r] = _mm_fmadd_ps(s, s4, acc[r]); });
  }
  for (int64_t r = 0; r < m; ++r) store_group(o + r * ldo, acc[r], nj);
}

// out[r * ldo + (j - j0)] = w.row(j) . a[r] for j in [j0, j1), r < m; `wide` as in
// dot_row_group (this thread's).
template <fmlp_dtype_t WT>
void gemv_rows(const Rows& w, int64_t j0, int64_t j1, const float* a, int64_t lda, int64_t m,
               int64_t k, float* out, int64_t ldo, float* wide) {
  for (int64_t j = j0; j < j1; j += 4) {
    const int64_t nj = std::min<int64_t>(4, j1 - j);
    const char* wr[4];
    for (int64_t q = 0; q < 4; ++q) wr[q] = w.row(j + std::min(q, nj - 1));
    if constexpr (WT == FMLP_DTYPE_F8_E4M3) {
      if (w.block != nullptr) {
        block_scaled_group(w, wr, j, nj, a, lda, m, k, out + (j - j0), ldo, wide);
        continue;
      }
    }
    // fp8: the dot products are of code / 256; scale them per output row, not per element.
    __m128 row_scale = _mm_set1_ps(1.0f);
    if constexpr (WT == FMLP_DTYPE_F8_E4M3)
      row_scale = _mm_setr_ps(w.row_scale(j), w.row_scale(j + std::min<int64_t>(1, nj - 1)),
                              w.row_scale(j + std::min<int64_t>(2, nj - 1)),
                              w.row_scale(j + std::min<int64_t>(3, nj - 1)));
    float* o = out + (j - j0);
    dot_row_group<WT>(wr, a, lda, m, k, wide, [&](int64_t r, __m128 s) {
      if constexpr (WT == FMLP_DTYPE_F8_E4M3)
        s = _mm_mul_ps(_mm_mul_ps(s, _mm_set1_ps(kF8Unscale)), row_scale);
      store_group(o + r * ldo, s, nj);
    });
  }
}

// Floats of one thread's widening scratch (dot_row_group) for both passes; 0 where not used.
int64_t wide_floats(const MlpDesc& d) {
  if (!widens_f8_once(d.w_dtype, d.m)) return 0;
  return 4 * std::max(padded(d.d_in), padded(d.hidden));
}

template <fmlp_dtype_t WT>
void decode_impl(const MlpView& v, float* base, int64_t wide_per_thread) {
  const int64_t m = v.m, kp = padded(v.k), hp = padded(v.h);
  float* xn = base;
  float* hid = xn + m * kp;
  float* up = hid + m * hp;                        // gated only
  float* wide_base = up + (v.gated ? m * hp : 0);  // [threads][wide_per_thread]
  const double macs = double(m) * double(v.h * v.k * (v.gated ? 2 : 1) + v.n * v.h);
  // The widening scratch is sized for omp_get_max_threads() at query time (decode_workspace).
#pragma omp parallel num_threads(std::min(thread_count(macs), std::max(1, omp_get_max_threads())))
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    float* wide = wide_per_thread ? wide_base + t * wide_per_thread : nullptr;
    int64_t b, e;
    split(m, 1, nt, t, &b, &e);
    for (int64_t i = b; i < e; ++i) normalize_row(v, i, xn + i * kp);
#pragma omp barrier
    // 16 units per chunk keeps each thread's hidden columns on their own cache lines.
    split(v.h, 16, nt, t, &b, &e);
    if (b < e) {
      gemv_rows<WT>(v.w_gate, b, e, xn, kp, m, v.k, hid + b, hp, wide);
      if (v.gated) gemv_rows<WT>(v.w_up, b, e, xn, kp, m, v.k, up + b, hp, wide);
      for (int64_t i = 0; i < m; ++i)
        hidden_epilogue(v, b, e - b, hid + i * hp + b, v.gated ? up + i * hp + b : nullptr,
                        hid + i * hp + b);
    }
    if (t == nt - 1)  // the W2 pass reads whole 8-lane groups: the padding must be 0
      for (int64_t i = 0; i < m; ++i) std::fill(hid + i * hp + v.h, hid + (i + 1) * hp, 0.f);
#pragma omp barrier
    // 32 outputs per chunk: a whole cache line of y per thread even for fp16/bf16.
    split(v.n, 32, nt, t, &b, &e);
    constexpr int64_t kBlock = 64;
    alignas(32) float acc[kDecodeMaxM * kBlock];
    for (int64_t o = b; o < e; o += kBlock) {
      const int64_t cnt = std::min(kBlock, e - o);
      gemv_rows<WT>(v.w2, o, o + cnt, hid, hp, m, v.h, acc, kBlock, wide);
      for (int64_t i = 0; i < m; ++i) output_epilogue(v, i, o, cnt, acc + i * kBlock);
    }
  }
}

}  // namespace

bool decode_supports(const MlpDesc& d, std::string* why) {
  if (!common_supports(d, why)) return false;
  if (d.m > kDecodeMaxM) {
    *why = fmt::format("M={} > {}; the blocked kernel is faster", d.m, kDecodeMaxM);
    return false;
  }
  return true;
}

// The per-thread widening scratch is sized for omp_get_max_threads() at query time; the API checks
// the workspace against this size again at run time, and a run never uses more threads than that.
size_t decode_workspace(const MlpDesc& d) {
  return workspace_floats_bytes(d, (d.gated ? d.m * padded(d.hidden) : 0) +
                                       std::max(1, omp_get_max_threads()) * wide_floats(d));
}

fmlp_status_t decode_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws, void*) {
  const MlpView v = make_view(a, d);
  float* base = workspace_base(ws);
  const int64_t wide = wide_floats(d);
  switch (d.w_dtype) {
    case FMLP_DTYPE_F16: decode_impl<FMLP_DTYPE_F16>(v, base, wide); break;
    case FMLP_DTYPE_BF16: decode_impl<FMLP_DTYPE_BF16>(v, base, wide); break;
    case FMLP_DTYPE_F8_E4M3: decode_impl<FMLP_DTYPE_F8_E4M3>(v, base, wide); break;
    default: decode_impl<FMLP_DTYPE_F32>(v, base, wide); break;
  }
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail::cpu
