// mlp_cpu_avx2_blocked: the any-M kernel, two cache-blocked GEMMs with fused epilogues.
// Work is cut into tiles of (up to kMc rows of x) x (up to kNc weight rows); each tile runs the
// whole k reduction in kKc blocks: the 4 weight rows of a group are widened to fp32 into an L1
// buffer once per block and then dotted with every 3-row group of the tile's activations (held
// in L2), partial sums going to a per-tile fp32 buffer. When a tile's reduction is done its
// epilogue runs on that cache-hot buffer: bias + activation (+ gating) writing the fp32 hidden
// once for GEMM1; bias + residual + the cast to the output dtype for GEMM2. Tiles are split
// statically over the threads, so every output takes the same operations on any thread count.
#include <omp.h>

#include <algorithm>

#include "cpu/mlp_common.hpp"

namespace fmlp::detail::cpu {
namespace {

constexpr int64_t kMc = 128;  // rows per tile: M=128 widens every weight once
constexpr int64_t kNc = 64;   // weight rows per tile; gated tiles hold 32 gate + 32 up rows
constexpr int64_t kKc = 256;  // k block: 4 fp32 weight rows (4 KiB) stay in L1, 128 x rows in L2

// Widens row[k0, k0 + kc) to fp32, zero-padded to a multiple of 8.
template <fmlp_dtype_t WT>
void widen_row(const char* row, int64_t kc, float* dst) {
  constexpr int64_t es = WT == FMLP_DTYPE_F32 ? 4 : 2;
  int64_t c = 0;
  for (; c + 8 <= kc; c += 8) _mm256_store_ps(dst + c, load8<WT>(row + c * es));
  if (c < kc) _mm256_storeu_ps(dst + c, load_partial<WT>(row + c * es, kc - c));
}

// acc[r * kNc + j] = sum_k a[r][k] * rows[j][k] for r < mc, j < ncols (ncols <= kNc).
template <fmlp_dtype_t WT>
void gemm_tile(const Rows& w, int64_t row0, int64_t ncols, const float* a, int64_t lda, int64_t mc,
               int64_t k, float* acc) {
  constexpr int64_t es = WT == FMLP_DTYPE_F32 ? 4 : 2;
  alignas(32) float wbuf[4 * kKc];
  const char* wr[4] = {
      reinterpret_cast<const char*>(wbuf), reinterpret_cast<const char*>(wbuf + kKc),
      reinterpret_cast<const char*>(wbuf + 2 * kKc), reinterpret_cast<const char*>(wbuf + 3 * kKc)};
  for (int64_t k0 = 0; k0 < k; k0 += kKc) {
    const int64_t kc = std::min(kKc, k - k0), kc8 = (kc + 7) / 8 * 8;
    const bool first = k0 == 0;
    for (int64_t g = 0; g < ncols; g += 4) {
      for (int64_t q = 0; q < 4; ++q) {
        if (g + q < ncols)
          widen_row<WT>(w.row(row0 + g + q) + k0 * es, kc, wbuf + q * kKc);
        else
          std::fill(wbuf + q * kKc, wbuf + q * kKc + kc8, 0.f);
      }
      // The next group's rows come from L3 or memory; fetching them now hides that latency
      // behind this group's dot products.
      const bool last = g + 4 >= ncols;
      const int64_t pg = last ? 0 : g + 4, pk = last ? k0 + kKc : k0;
      if (pk < k) {
        const int64_t bytes = std::min(kKc, k - pk) * es;
        for (int64_t q = pg; q < std::min(pg + 4, ncols); ++q)
          for (int64_t off = 0; off < bytes; off += 64)
            _mm_prefetch(w.row(row0 + q) + pk * es + off, _MM_HINT_T1);
      }
      const auto emit = [&](int64_t r, __m128 s) {
        float* p = acc + r * kNc + g;
        _mm_storeu_ps(p, first ? s : _mm_add_ps(_mm_loadu_ps(p), s));
      };
      int64_t r = 0;
      for (; r + 3 <= mc; r += 3) {
        const float* ar[3] = {a + r * lda + k0, a + (r + 1) * lda + k0, a + (r + 2) * lda + k0};
        __m128 s[3];
        dot_tile<FMLP_DTYPE_F32, 3>(wr, ar, kc8, s);
        for (int q = 0; q < 3; ++q) emit(r + q, s[q]);
      }
      if (mc - r == 2) {
        const float* ar[2] = {a + r * lda + k0, a + (r + 1) * lda + k0};
        __m128 s[2];
        dot_tile<FMLP_DTYPE_F32, 2>(wr, ar, kc8, s);
        emit(r, s[0]);
        emit(r + 1, s[1]);
      } else if (mc - r == 1) {
        const float* ar[1] = {a + r * lda + k0};
        __m128 s[1];
        dot_tile<FMLP_DTYPE_F32, 1>(wr, ar, kc8, s);
        emit(r, s[0]);
      }
    }
  }
}

// Balanced row blocks of at most kMc rows.
struct RowBlocks {
  int64_t count, size;
  explicit RowBlocks(int64_t m) : count((m + kMc - 1) / kMc), size((m + count - 1) / count) {}
};

template <fmlp_dtype_t WT>
void blocked_impl(const MlpView& v, float* base) {
  const int64_t m = v.m, kp = padded(v.k), hp = padded(v.h);
  float* xn = base;
  float* hid = xn + m * kp;
  const RowBlocks rb(m);
  const int64_t units = v.gated ? kNc / 2 : kNc;  // hidden units per GEMM1 tile
  const int64_t tiles1 = (v.h + units - 1) / units * rb.count;
  const int64_t tiles2 = (v.n + kNc - 1) / kNc * rb.count;
  const double macs = double(m) * double(v.h * v.k * (v.gated ? 2 : 1) + v.n * v.h);
#pragma omp parallel num_threads(thread_count(macs))
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    alignas(32) float acc[kMc * kNc];
    int64_t b, e;
    split(m, 1, nt, t, &b, &e);
    for (int64_t i = b; i < e; ++i) normalize_row(v, i, xn + i * kp);
#pragma omp barrier
    // Tile index = chunk * row blocks + row block: a thread's tiles share its weight rows.
    split(tiles1, 1, nt, t, &b, &e);
    for (int64_t tile = b; tile < e; ++tile) {
      const int64_t u = tile / rb.count * units, nu = std::min(units, v.h - u);
      const int64_t m0 = tile % rb.count * rb.size, mc = std::min(rb.size, m - m0);
      gemm_tile<WT>(v.w_gate, u, nu, xn + m0 * kp, kp, mc, v.k, acc);
      if (v.gated) gemm_tile<WT>(v.w_up, u, nu, xn + m0 * kp, kp, mc, v.k, acc + kNc / 2);
      for (int64_t r = 0; r < mc; ++r) {
        float* hrow = hid + (m0 + r) * hp;
        hidden_epilogue(v, u, nu, acc + r * kNc, v.gated ? acc + r * kNc + kNc / 2 : nullptr,
                        hrow + u);
        if (u + nu == v.h) std::fill(hrow + v.h, hrow + hp, 0.f);  // GEMM2 reads the padding
      }
    }
#pragma omp barrier
    split(tiles2, 1, nt, t, &b, &e);
    for (int64_t tile = b; tile < e; ++tile) {
      const int64_t o = tile / rb.count * kNc, no = std::min(kNc, v.n - o);
      const int64_t m0 = tile % rb.count * rb.size, mc = std::min(rb.size, m - m0);
      gemm_tile<WT>(v.w2, o, no, hid + m0 * hp, hp, mc, v.h, acc);
      for (int64_t r = 0; r < mc; ++r) output_epilogue(v, m0 + r, o, no, acc + r * kNc);
    }
  }
}

}  // namespace

bool blocked_supports(const MlpDesc& d, std::string* why) {
  return common_supports(d, why);
}

size_t blocked_workspace(const MlpDesc& d) {
  return workspace_floats_bytes(d, 0);
}

fmlp_status_t blocked_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws, void*) {
  const MlpView v = make_view(a, d);
  float* base = workspace_base(ws);
  switch (d.w_dtype) {
    case FMLP_DTYPE_F16: blocked_impl<FMLP_DTYPE_F16>(v, base); break;
    case FMLP_DTYPE_BF16: blocked_impl<FMLP_DTYPE_BF16>(v, base); break;
    default: blocked_impl<FMLP_DTYPE_F32>(v, base); break;
  }
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail::cpu
