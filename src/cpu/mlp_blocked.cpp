// mlp_cpu_avx2_blocked: the large-M kernel, two GotoBLAS-style GEMMs with fused epilogues.
// Both GEMMs compute C[m][c] = sum_k A[m][k] * B[c][k] with a 6x16 broadcast-FMA micro-kernel
// (12 accumulators, two 8-wide loads of B and six broadcasts of A per k). A is packed once per
// GEMM into 6-row panels (k-major, the 6 rows interleaved): the normalised x for GEMM1, and the
// hidden activations for GEMM2, which GEMM1's epilogue writes straight into that layout. The
// weights (f32/f16/bf16 rows, k contiguous) are widened to fp32 while packed into 16-column
// panels, kKc deep, by 8x8 transposes; a dense panel is 16 hidden units, a gated one 8 gate + 8
// up rows of the same 8 units, so the gating meets both halves in one tile. Threads claim whole
// weight panels, so each widens and streams only its own weight rows; every output element is
// summed in k order, kKc blocks at a time, whatever thread, tile or M block it falls in.
#include <omp.h>

#include <algorithm>
#include <atomic>

#include "cpu/mlp_common.hpp"

namespace fmlp::detail::cpu {
namespace {

constexpr int64_t kMr = 6;         // rows of A per micro-tile
constexpr int64_t kNr = 16;        // columns of B per micro-tile (two ymm)
constexpr int64_t kKc = 256;       // k block: a 16 KiB B panel stays in L1 while A streams
constexpr int64_t kMcPanels = 24;  // A panels per M block: 144 x kKc fp32 = 144 KiB in L2

// One k step of the assembly loop: A at byte offset AO, B at BO (the assembler adds the sums).
// clang-format off
#define FMLP_ROW(AO, R, C0, C1)                       \
  "vbroadcastss " AO "(%[a]), %%ymm" R "\n\t"         \
  "vfmadd231ps %%ymm12, %%ymm" R ", %[" C0 "]\n\t"    \
  "vfmadd231ps %%ymm13, %%ymm" R ", %[" C1 "]\n\t"
#define FMLP_K_STEP(AO, BO)                           \
  "vmovaps " BO "(%[b]), %%ymm12\n\t"                 \
  "vmovaps " BO "+32(%[b]), %%ymm13\n\t"              \
  FMLP_ROW(AO "+0", "14", "c00", "c01")               \
  FMLP_ROW(AO "+4", "15", "c10", "c11")               \
  FMLP_ROW(AO "+8", "14", "c20", "c21")               \
  FMLP_ROW(AO "+12", "15", "c30", "c31")              \
  FMLP_ROW(AO "+16", "14", "c40", "c41")              \
  FMLP_ROW(AO "+20", "15", "c50", "c51")
// clang-format on

// c[r][0..15] = (first ? 0 : c[r][0..15]) + sum_k a[k * 6 + r] * b[k * 16 + 0..15], each
// accumulator updated by one fma per k in k order. The main loop is written in assembly: GCC's
// allocation of the same loop in intrinsics adds register moves and reaches ~85% of the fma peak,
// this one ~95% (L1/L2-resident panels, one core).
inline void micro_6x16(const float* a, const float* b, int64_t kc, float* c, int64_t ldc,
                       bool first) {
  __m256 acc[kMr][2];
  for (int r = 0; r < kMr; ++r) {
    acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc);
    acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8);
  }
  if (int64_t n = kc / 4; n > 0) {
    // 4 k steps per iteration; A's next lines (L2) are prefetched 8 iterations ahead.
    asm volatile(
        // clang-format off
        "1:\n\t"
        FMLP_K_STEP("0", "0") FMLP_K_STEP("24", "64") FMLP_K_STEP("48", "128")
        FMLP_K_STEP("72", "192")
        "prefetcht0 768(%[a])\n\t"
        "add $96, %[a]\n\t"
        "add $256, %[b]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        // clang-format on
        : [c00] "+x"(acc[0][0]), [c01] "+x"(acc[0][1]), [c10] "+x"(acc[1][0]),
          [c11] "+x"(acc[1][1]), [c20] "+x"(acc[2][0]), [c21] "+x"(acc[2][1]),
          [c30] "+x"(acc[3][0]), [c31] "+x"(acc[3][1]), [c40] "+x"(acc[4][0]),
          [c41] "+x"(acc[4][1]), [c50] "+x"(acc[5][0]), [c51] "+x"(acc[5][1]), [a] "+r"(a),
          [b] "+r"(b), [n] "+r"(n)
        :
        : "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");
  }
  for (int64_t k = kc / 4 * 4; k < kc; ++k, a += kMr, b += kNr) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    for (int r = 0; r < kMr; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r);
      acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < kMr; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}

#undef FMLP_K_STEP
#undef FMLP_ROW

inline void transpose8(__m256* v) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    v[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// 8 weights of one row (n < 8: n of them, the other lanes 0) as fp32; fp8 codes are dequantised
// with the row's (or its 128 x 128 block's) scale here, so the GEMM itself is the same for every
// dtype and scale layout.
template <fmlp_dtype_t WT>
inline __m256 load_weights8(const char* p, int64_t n, __m256 row_scale) {
  if constexpr (WT == FMLP_DTYPE_F8_E4M3) {
    const __m256 codes = n >= 8 ? load8_f8(p) : load8_f8_partial(p, n);
    return _mm256_mul_ps(_mm256_mul_ps(codes, _mm256_set1_ps(kF8Unscale)), row_scale);
  } else {
    return n >= 8 ? load8<WT>(p) : load_partial<WT>(p, n);
  }
}

// dst[k * 16 + q] = src[q][k] widened to fp32 for q < 8 (0 for q >= valid), k in [kb, ke).
template <fmlp_dtype_t WT>
void pack_span(const char* const* src, const __m256* scale, int64_t valid, int64_t kb, int64_t ke,
               float* dst) {
  constexpr int64_t es = WT == FMLP_DTYPE_F32 ? 4 : WT == FMLP_DTYPE_F8_E4M3 ? 1 : 2;
  int64_t k = kb;
  __m256 v[8];
  if (valid >= 8) {  // the common case, without per-row or per-k checks
    for (; k + 8 <= ke; k += 8) {
      for (int q = 0; q < 8; ++q) v[q] = load_weights8<WT>(src[q] + k * es, 8, scale[q]);
      transpose8(v);
      for (int q = 0; q < 8; ++q) _mm256_store_ps(dst + (k + q) * kNr, v[q]);
    }
  }
  for (; k < ke; k += 8) {
    const int64_t left = ke - k;
    for (int64_t q = 0; q < 8; ++q) {
      if (!src[q])
        v[q] = _mm256_setzero_ps();
      else
        v[q] = load_weights8<WT>(src[q] + k * es, left, scale[q]);
    }
    transpose8(v);
    for (int64_t q = 0; q < std::min<int64_t>(8, left); ++q)
      _mm256_store_ps(dst + (k + q) * kNr, v[q]);
  }
}

// dst[k * 16 + q] = w[r0 + q][k0 + k] widened to fp32 for q < 8 (0 for q >= valid), k < kc.
// Block-scaled fp8 takes its scales per 128-column span (k0 is a multiple of kKc, so every span
// lies inside one block column).
template <fmlp_dtype_t WT>
void pack_half(const Rows& w, int64_t r0, int64_t valid, int64_t k0, int64_t kc, float* dst) {
  constexpr int64_t es = WT == FMLP_DTYPE_F32 ? 4 : WT == FMLP_DTYPE_F8_E4M3 ? 1 : 2;
  static_assert(kKc % kFp8Block == 0, "a k block must hold whole scale blocks");
  const char* src[8];
  __m256 scale[8];
  for (int64_t q = 0; q < 8; ++q) src[q] = q < valid ? w.row(r0 + q) + k0 * es : nullptr;
  if (WT == FMLP_DTYPE_F8_E4M3 && w.block != nullptr) {
    for (int64_t kb = 0; kb < kc; kb += kFp8Block) {
      for (int64_t q = 0; q < 8; ++q)
        scale[q] = _mm256_set1_ps(q < valid ? w.block_scale(r0 + q, k0 + kb) : 1.f);
      pack_span<WT>(src, scale, valid, kb, std::min(kc, kb + kFp8Block), dst);
    }
    return;
  }
  for (int64_t q = 0; q < 8; ++q)
    scale[q] = _mm256_set1_ps(WT == FMLP_DTYPE_F8_E4M3 && q < valid ? w.row_scale(r0 + q) : 1.f);
  pack_span<WT>(src, scale, valid, 0, kc, dst);
}

// Per-thread scratch: one packed B panel, the C tile of one M block, the x rows being packed.
struct Scratch {
  float* bpack;  // kKc x kNr
  float* ctile;  // kMcPanels * kMr rows x kNr
  float* rows;   // kMr x padded(k)
};

int64_t scratch_floats(int64_t kp) {
  return (kKc * kNr + kMcPanels * kMr * kNr + kMr * kp + 15) / 16 * 16;
}

int64_t panels(int64_t m) {
  return (m + kMr - 1) / kMr;
}

// C = A B^T over `count` B panels, claimed one at a time from `next` by the team's threads (call
// from inside the parallel region). A is packed in 6-row panels of `ka` floats per row (k < kdim
// used); pack(panel, k0, kc, dst) packs one B block; epilogue(panel, pb, pe, ctile) finishes a
// panel for A panels [pb, pe). A panel is computed whole by one thread in a fixed order, so the
// results do not depend on which thread takes it. Claiming dynamically keeps a thread slowed by
// another process on its core from holding up the others at the barrier.
template <class PACK, class EPILOGUE>
void gemm(const float* apack, int64_t ka, int64_t m, int64_t kdim, int64_t count,
          std::atomic<int64_t>& next, const Scratch& s, PACK pack, EPILOGUE epilogue) {
  const int64_t np = panels(m);
  const int64_t blocks = (np + kMcPanels - 1) / kMcPanels, per = (np + blocks - 1) / blocks;
  for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
    for (int64_t pb = 0; pb < np; pb += per) {
      const int64_t pe = std::min(np, pb + per);
      for (int64_t k0 = 0; k0 < kdim; k0 += kKc) {
        const int64_t kc = std::min(kKc, kdim - k0);
        pack(c, k0, kc, s.bpack);
        for (int64_t p = pb; p < pe; ++p)
          micro_6x16(apack + p * kMr * ka + k0 * kMr, s.bpack, kc, s.ctile + (p - pb) * kMr * kNr,
                     kNr, k0 == 0);
      }
      epilogue(c, pb, pe, s.ctile);
    }
  }
}

// Panel p of `dst` (ka floats per row) from the normalised x rows 6p .. 6p + 5 (zeros past m).
void pack_x_panel(const MlpView& v, int64_t p, int64_t ka, float* rows, float* dst) {
  const int64_t k = v.k;
  for (int64_t r = 0; r < kMr; ++r) {
    const int64_t i = p * kMr + r;
    if (i < v.m)
      normalize_row(v, i, rows + r * ka);
    else
      std::fill(rows + r * ka, rows + r * ka + k, 0.f);
  }
  float* out = dst + p * kMr * ka;
  for (int64_t c = 0; c < k; ++c)
    for (int64_t r = 0; r < kMr; ++r) out[c * kMr + r] = rows[r * ka + c];
}

// Writes 8 hidden values (n valid) of row `i` at unit j into the 6-row panel layout.
inline void put_hidden(float* hpack, int64_t hp, int64_t i, int64_t j, __m256 val, int64_t n) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, val);
  float* out = hpack + (i / kMr) * kMr * hp + j * kMr + i % kMr;
  for (int64_t l = 0; l < std::min<int64_t>(8, n); ++l) out[l * kMr] = tmp[l];
}

template <fmlp_dtype_t WT>
void blocked_impl(const MlpView& v, float* base, int max_threads) {
  const int64_t m = v.m, kp = padded(v.k), hp = padded(v.h), np = panels(m);
  float* apack = base;
  float* hpack = apack + np * kMr * kp;
  float* scratch = hpack + np * kMr * hp;
  // B panels: 16 hidden units (dense) or 8 gate + 8 up rows of 8 units (gated); 16 outputs.
  const int64_t unit_w = v.gated ? 8 : 16;
  const int64_t panels1 = (v.h + unit_w - 1) / unit_w, panels2 = (v.n + kNr - 1) / kNr;
  const double macs = double(m) * double(v.h * v.k * (v.gated ? 2 : 1) + v.n * v.h);
  std::atomic<int64_t> next1{0}, next2{0};
#pragma omp parallel num_threads(std::min(thread_count(macs), max_threads))
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    float* sbase = scratch + t * scratch_floats(kp);
    const Scratch s{sbase, sbase + kKc * kNr, sbase + kKc * kNr + kMcPanels * kMr * kNr};
    int64_t b, e;
    split(np, 1, nt, t, &b, &e);
    for (int64_t p = b; p < e; ++p) pack_x_panel(v, p, kp, s.rows, apack);
#pragma omp barrier
    const auto valid = [](int64_t total, int64_t r0) { return std::min<int64_t>(8, total - r0); };
    const auto pack1 = [&](int64_t c, int64_t k0, int64_t kc, float* dst) {
      const int64_t u = c * unit_w;
      pack_half<WT>(v.w_gate, u, valid(v.h, u), k0, kc, dst);
      if (v.gated)
        pack_half<WT>(v.w_up, u, valid(v.h, u), k0, kc, dst + 8);
      else
        pack_half<WT>(v.w_gate, u + 8, valid(v.h, u + 8), k0, kc, dst + 8);
    };
    // Rows past m in the last panel get values too (from zero x rows): GEMM2 reads them.
    const auto epilogue1 = [&](int64_t c, int64_t pb, int64_t pe, const float* ct) {
      const int64_t u = c * unit_w;
      for (int64_t i = pb * kMr; i < pe * kMr; ++i) {
        const float* cr = ct + (i - pb * kMr) * kNr;
        if (v.gated) {
          const int64_t left = v.h - u;
          const __m256 g = _mm256_add_ps(_mm256_loadu_ps(cr),
                                         load_upto8(v.b_gate.at(u), v.b_gate.dtype, left, 0.f));
          const __m256 up = _mm256_add_ps(_mm256_loadu_ps(cr + 8),
                                          load_upto8(v.b_up.at(u), v.b_up.dtype, left, 0.f));
          put_hidden(hpack, hp, i, u, _mm256_mul_ps(activate8(v.act, g), up), left);
          continue;
        }
        for (int64_t half = 0; half < 2 && u + half * 8 < v.h; ++half) {
          const int64_t j = u + half * 8, left = v.h - j;
          const __m256 g = _mm256_add_ps(_mm256_loadu_ps(cr + half * 8),
                                         load_upto8(v.b_gate.at(j), v.b_gate.dtype, left, 0.f));
          put_hidden(hpack, hp, i, j, activate8(v.act, g), left);
        }
      }
    };
    gemm(apack, kp, m, v.k, panels1, next1, s, pack1, epilogue1);
#pragma omp barrier
    const auto pack2 = [&](int64_t c, int64_t k0, int64_t kc, float* dst) {
      const int64_t o = c * kNr;
      pack_half<WT>(v.w2, o, valid(v.n, o), k0, kc, dst);
      pack_half<WT>(v.w2, o + 8, valid(v.n, o + 8), k0, kc, dst + 8);
    };
    const auto epilogue2 = [&](int64_t c, int64_t pb, int64_t pe, const float* ct) {
      const int64_t o = c * kNr, cnt = std::min(kNr, v.n - o);
      for (int64_t i = pb * kMr; i < std::min(pe * kMr, m); ++i)
        output_epilogue(v, i, o, cnt, ct + (i - pb * kMr) * kNr);
    };
    gemm(hpack, hp, m, v.h, panels2, next2, s, pack2, epilogue2);
  }
}

}  // namespace

bool blocked_supports(const MlpDesc& d, std::string* why) {
  return common_supports(d, why);
}

// The per-thread scratch is sized for omp_get_max_threads() at query time; the API checks the
// workspace against this size again at run time, and a run never uses more threads than that.
size_t blocked_workspace(const MlpDesc& d) {
  const int64_t rows = panels(d.m) * kMr;
  const int64_t floats =
      rows * (padded(d.d_in) + padded(d.hidden)) +
      int64_t(std::max(1, omp_get_max_threads())) * scratch_floats(padded(d.d_in));
  return size_t(floats) * sizeof(float) + 64;
}

fmlp_status_t blocked_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws, void*) {
  const MlpView v = make_view(a, d);
  float* base = workspace_base(ws);
  const int max_threads = std::max(1, omp_get_max_threads());
  switch (d.w_dtype) {
    case FMLP_DTYPE_F16: blocked_impl<FMLP_DTYPE_F16>(v, base, max_threads); break;
    case FMLP_DTYPE_BF16: blocked_impl<FMLP_DTYPE_BF16>(v, base, max_threads); break;
    case FMLP_DTYPE_F8_E4M3: blocked_impl<FMLP_DTYPE_F8_E4M3>(v, base, max_threads); break;
    default: blocked_impl<FMLP_DTYPE_F32>(v, base, max_threads); break;
  }
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail::cpu
