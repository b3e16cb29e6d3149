// Pieces shared by the cpu mlp kernels: the argument view they read, the workspace layout, the
// norm pass and the two epilogues, the static thread partition and the common supports() checks.
#pragma once
#include <cstdint>
#include <string>

#include "core/mlp_desc.hpp"
#include "cpu/fp8.hpp"
#include "cpu/simd.hpp"

namespace fmlp::detail::cpu {

// A 1-D parameter (bias, gamma, beta) or nothing.
struct Vec {
  const char* data = nullptr;
  fmlp_dtype_t dtype = FMLP_DTYPE_F32;
  const char* at(int64_t i) const { return data ? data + i * int64_t(elem_size(dtype)) : nullptr; }
};

// Rows of a matrix with inner stride 1; `ld` in bytes. fp8 weights carry their scales: row r's
// is scale[r * scale_step] (step 0: one scale for the tensor), or with block scales (block
// non-null) row r's scale for columns [c, c + 128), c a multiple of 128, is
// block[(r / 128) * block_ld + (c / 128) * block_cs].
struct Rows {
  const char* data = nullptr;
  int64_t ld = 0;
  const float* scale = nullptr;
  int64_t scale_step = 0;
  const float* block = nullptr;
  int64_t block_ld = 0, block_cs = 0;
  const char* row(int64_t r) const { return data + r * ld; }
  float row_scale(int64_t r) const { return scale[r * scale_step]; }
  float block_scale(int64_t r, int64_t c) const {
    return block[(r / kFp8Block) * block_ld + (c / kFp8Block) * block_cs];
  }
  // The rows from r0 on, as a matrix of their own; with block scales the new row 0 starts block
  // row `block_row0` (a stacked up half starts its own blocks, ScaleKind::kBlock).
  Rows from(int64_t r0, int64_t block_row0 = 0) const {
    return {row(r0),
            ld,
            scale ? scale + r0 * scale_step : nullptr,
            scale_step,
            block ? block + block_row0 * block_ld : nullptr,
            block_ld,
            block_cs};
  }
};

// Everything the kernels read, with the gate/up forms (stacked or separate) already resolved.
struct MlpView {
  int64_t m, k, h, n;
  fmlp_dtype_t act_dtype, w_dtype;
  fmlp_activation_t act;
  fmlp_norm_t norm;
  float eps;
  bool gated;
  Rows x, residual, w_gate, w_up, w2;  // w_gate is w1 when dense; residual.data may be null
  char* y;
  int64_t y_ld;
  Vec b_gate, b_up, b2, gamma, beta;
};
MlpView make_view(const fmlp_mlp_args_t& a, const MlpDesc& d);

// Row strides in floats of the normalised x and of the hidden activations: rounded up to 16 so
// every row starts on a cache line; the padding columns hold zeros.
inline int64_t padded(int64_t n) {
  return (n + 15) / 16 * 16;
}

// Workspace: [xn: m x padded(k)] [h: m x padded(h)] [extra floats], 64-byte aligned inside.
size_t workspace_floats_bytes(const MlpDesc& d, int64_t extra_floats);
float* workspace_base(void* ws);

// Writes xn row i (fp32, normalised, zero padded to padded(k)).
void normalize_row(const MlpView& v, int64_t i, float* xn);

// h[j] = act(g[j] + b_gate[j0+j]) (* (u[j] + b_up[j0+j]) when u is given), j < cnt.
void hidden_epilogue(const MlpView& v, int64_t j0, int64_t cnt, const float* g, const float* u,
                     float* h);

// y[i][o0+j] = acc[j] + b2[o0+j] (+ residual[i][o0+j], read before y is written), j < cnt.
void output_epilogue(const MlpView& v, int64_t i, int64_t o0, int64_t cnt, const float* acc);

// Static split of `units` into chunks of `grain` over `nt` threads: [*begin, *end) for thread t.
inline void split(int64_t units, int64_t grain, int nt, int t, int64_t* begin, int64_t* end) {
  const int64_t chunks = (units + grain - 1) / grain;
  const int64_t c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
  *begin = std::min(units, c0 * grain);
  *end = std::min(units, c1 * grain);
}

// Threads for a problem of `macs` multiply-adds: 1 below the fork/join break-even.
int thread_count(double macs);

bool common_supports(const MlpDesc& d, std::string* why);

// fp8 rows (code / 256, see fp8.hpp), 16 codes per step: the two halves go into the same
// accumulators in k order.
template <int MR>
inline void dot_tile_f8(const char* const* w, const float* const* a, int64_t k, __m128* out) {
  __m256 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    for (int j = 0; j < 4; ++j) {
      __m256 lo, hi;
      if (k - c >= 16)
        load16_f8(w[j] + c, &lo, &hi);
      else
        load16_f8_partial(w[j] + c, k - c, &lo, &hi);
      for (int r = 0; r < MR; ++r) {
        acc[r][j] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(a[r] + c), acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(a[r] + c + 8), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

// Dot products of 4 weight rows (dtype WT) with MR fp32 rows over k elements: out[r] lane j =
// w[j] . a[r] (fp8: / 256, unscaled). The a rows must be readable and zero up to k rounded to 16;
// the weight tail is loaded zero-padded, so every output takes the same operations whatever tile
// it falls in.
template <fmlp_dtype_t WT, int MR>
inline void dot_tile_wide(const char* const* w, const float* const* a, int64_t k, __m128* out) {
  constexpr int64_t es = WT == FMLP_DTYPE_F32 ? 4 : 2;
  __m256 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    __m256 av[MR];
    for (int r = 0; r < MR; ++r) av[r] = _mm256_loadu_ps(a[r] + c);
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = load8<WT>(w[j] + c * es);
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(wv, av[r], acc[r][j]);
    }
  }
  if (c < k) {
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = load_partial<WT>(w[j] + c * es, k - c);
      for (int r = 0; r < MR; ++r)
        acc[r][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a[r] + c), acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

template <fmlp_dtype_t WT, int MR>
inline void dot_tile(const char* const* w, const float* const* a, int64_t k, __m128* out) {
  if constexpr (WT == FMLP_DTYPE_F8_E4M3)
    dot_tile_f8<MR>(w, a, k, out);
  else
    dot_tile_wide<WT, MR>(w, a, k, out);
}

// x rows from which a group of 4 fp8 weight rows is widened once into a scratch of
// [4][padded(k)] floats and dotted as fp32, rather than widened again in every dot_tile (measured
// on the 2-core CI VM: slower at 4 rows, even at 6 for K = 4096, 1.2x at 8, 1.35x at 16).
constexpr int64_t kWidenOnceRows = 6;

// Whether m x rows with weights of w_dtype take that path (and the kernels a scratch for it).
inline bool widens_f8_once(fmlp_dtype_t w_dtype, int64_t m) {
  return w_dtype == FMLP_DTYPE_F8_E4M3 && m >= kWidenOnceRows;
}

// The 4 fp8 rows w[q] (k codes) as code / 256 in fp32 at out + q * ld (ld >= padded(k)), the
// columns from k to padded(k) zero.
inline void widen_f8_rows(const char* const* w, int64_t k, int64_t ld, float* out) {
  for (int q = 0; q < 4; ++q) {
    float* o = out + q * ld;
    for (int64_t c = 0; c < k; c += 16) {
      __m256 lo, hi;
      if (k - c >= 16)
        load16_f8(w[q] + c, &lo, &hi);
      else
        load16_f8_partial(w[q] + c, k - c, &lo, &hi);
      _mm256_storeu_ps(o + c, lo);
      _mm256_storeu_ps(o + c + 8, hi);
    }
  }
}

// emit(r, s) for r < m, s lane q = w[q] . (a + r * lda) over k (dot_tile's contract on the a rows;
// fp8: of code / 256), three rows at a time. `wide` (null, or [4][padded(k)] floats): fp8 groups
// are widened there once from kWidenOnceRows rows on, the same products in the same order.
template <fmlp_dtype_t WT, typename EMIT>
void dot_row_group(const char* const* w, const float* a, int64_t lda, int64_t m, int64_t k,
                   float* wide, const EMIT& emit) {
  if constexpr (WT == FMLP_DTYPE_F8_E4M3) {
    if (wide != nullptr && widens_f8_once(WT, m)) {
      widen_f8_rows(w, k, padded(k), wide);
      const char* wf[4];
      for (int q = 0; q < 4; ++q) wf[q] = reinterpret_cast<const char*>(wide + q * padded(k));
      dot_row_group<FMLP_DTYPE_F32>(wf, a, lda, m, k, nullptr, emit);
      return;
    }
  }
  int64_t r = 0;
  for (; r + 3 <= m; r += 3) {
    const float* ar[3] = {a + r * lda, a + (r + 1) * lda, a + (r + 2) * lda};
    __m128 s[3];
    dot_tile<WT, 3>(w, ar, k, s);
    for (int q = 0; q < 3; ++q) emit(r + q, s[q]);
  }
  if (m - r == 2) {
    const float* ar[2] = {a + r * lda, a + (r + 1) * lda};
    __m128 s[2];
    dot_tile<WT, 2>(w, ar, k, s);
    emit(r, s[0]);
    emit(r + 1, s[1]);
  } else if (m - r == 1) {
    const float* ar[1] = {a + r * lda};
    __m128 s[1];
    dot_tile<WT, 1>(w, ar, k, s);
    emit(r, s[0]);
  }
}

// The kernels' entry points (mlp_decode.cpp, mlp_blocked.cpp).
constexpr int64_t kDecodeMaxM = 16;
bool decode_supports(const MlpDesc& d, std::string* why);
size_t decode_workspace(const MlpDesc& d);
fmlp_status_t decode_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws, void* stream);
bool blocked_supports(const MlpDesc& d, std::string* why);
size_t blocked_workspace(const MlpDesc& d);
fmlp_status_t blocked_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws, void* stream);

}  // namespace fmlp::detail::cpu
