// mlp_prefill_sm90_cublaslt with fp8 e4m3 weights: W8A8, the way fp8 serving stacks run prefill
// (torch._scaled_mm rowwise + activation + torch._scaled_mm). The activations are quantised per
// token to e4m3 with dynamic scales, both GEMMs run on fp8 tensor cores (cuBLASLt, fp32
// accumulation, outer-vector scales: per weight row and per token). This is not the exact
// weight-only dequantisation of the ref: docs/prefill.md states the error it adds.
//
// Per pass of `chunk` tokens:
//   0. (once per call) the weight scales as per-row vectors in scratch: per-tensor scales repeated,
//      so both GEMMs use the one scale mode torch's rowwise recipe uses
//   1. x8, sx = q(norm(x)): one block per token row; mean/variance, row amax, then the e4m3 codes
//      (the norm and the quantisation are one kernel: x is read from HBM once) prefill_fp8_quant_x
//   2. G = (x8 W1^T) * sx * s1, 16-bit: one GEMM over [gate; up] when they are stacked
//   3. h = act(G_gate + bg) * (G_up + bu) (or act(G + b1)), rounded to the activation dtype as the
//      16-bit path rounds it, then h8, sh = q(h): one block per token row keeps the row in shared
//      memory between its amax and its codes                           prefill_fp8_bias_act_quant
//   4. y = (h8 W2^T) * sh * s2 (+ residual as C with beta = 1) straight into y when there is no b2
//      and cuBLASLt's heuristic offers that; otherwise D into scratch and y = D + b2 (+ residual)
//      in a small kernel (cuBLASLt offers no bias epilogue with outer-vector scales)
//      prefill_fp8_out
// q(v) per row: scale = amax / 448 (at least FLT_MIN: an all-zero row gives zero codes), codes
// e4m3(v / scale) rounded to nearest even and saturated to +-448. A row holding NaN or Inf gets a
// NaN scale, so every output of that token is NaN: e4m3 has no Inf, and a bad scale must not turn
// a non-finite row into finite numbers.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/common/lt_gemm.hpp"
#include "cuda/mlp/entries.hpp"
#include "cuda/mlp/prefill_common.cuh"

namespace fmlp::detail {
namespace {

using fmlp::cuda::load_scalar;
using namespace prefill;  // the helpers both prefill paths share

constexpr int kThreads = 512;  // one block per token row

// Byte offsets of the regions from the base of the workspace's scratch part.
struct Layout {
  int64_t chunk = 0;      // tokens per pass
  int64_t ldg = 0;        // row stride of G (elements): 2H gated, H dense
  int64_t ld_out = 0;     // row stride of GEMM2's D when it goes to scratch (reuses G's bytes)
  size_t s1 = 0;          // [ldg] fp32: the weight scale of each column of G
  size_t s2 = 0;          // [d_out] fp32
  size_t xq = 0, sx = 0;  // [chunk, d_in] e4m3 and [chunk] fp32
  size_t hq = 0, sh = 0;  // [chunk, H] e4m3 and [chunk] fp32
  size_t g = 0, lt = 0, end = 0;
};

Layout layout(const MlpDesc& d, size_t es) {
  Layout l;
  l.ldg = d.gated ? 2 * d.hidden : d.hidden;
  l.ld_out = round8(d.d_out);
  const int64_t g_cols = std::max(l.ldg, l.ld_out);
  const int64_t row_bytes = g_cols * int64_t(es) + d.d_in + d.hidden + 8;
  l.chunk = prefill::pass_rows(d.m, row_bytes);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align_up(bytes);
    return at;
  };
  l.s1 = take(size_t(l.ldg) * 4);
  l.s2 = take(size_t(d.d_out) * 4);
  l.xq = take(size_t(l.chunk * d.d_in));
  l.sx = take(size_t(l.chunk) * 4);
  l.hq = take(size_t(l.chunk * d.hidden));
  l.sh = take(size_t(l.chunk) * 4);
  l.g = take(size_t(l.chunk * g_cols) * es);
  l.lt = off;
  l.end = off + kLtWorkspaceBytes;
  return l;
}

// The scale of a row from its amax (+Inf when the row holds NaN or Inf), see the file comment.
__device__ __forceinline__ float row_scale(float amax) {
  return isinf(amax) ? __int_as_float(0x7fffffff) : fmaxf(amax / 448.f, FLT_MIN);
}

// |v| for the amax, +Inf for NaN and Inf (fmaxf would drop a NaN).
__device__ __forceinline__ float amax_term(float v) {
  return isfinite(v) ? fabsf(v) : INFINITY;
}

// Eight e4m3 codes of v * rcp (saturating, NaN stays NaN), one 8-byte store.
__device__ __forceinline__ void store_e4m3x8(uint8_t* q, const float (&v)[8], float rcp) {
  uint32_t w[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[4 * i] * rcp, v[4 * i + 1] * rcp),
                                                 __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(v[4 * i + 2] * rcp, v[4 * i + 3] * rcp), __NV_SATFINITE, __NV_E4M3);
    w[i] = lo | (hi << 16);
  }
  *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
}

// Eight consecutive elements as floats; VEC: one 16-byte load (the row and stride allow it).
template <typename T, bool VEC>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  if (VEC) {
    const Vec8<T> t = *reinterpret_cast<const Vec8<T>*>(p);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = to_f(t.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = to_f(p[e]);
  }
}

struct QuantXParams {
  const void* x;
  int64_t ldx;
  int64_t rows, k;  // k % 16 == 0 (supports)
  const void *gamma, *beta;
  fmlp_dtype_t gamma_t, beta_t;
  fmlp_norm_t norm;
  float eps;
  uint8_t* q;  // [rows, k]
  float* scale;
};

// One block per token row: (norm: mean, centred variance) then the row amax of the normalised
// values, then their codes. The row is re-read from L1/L2 for each pass; HBM sees it once.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads) prefill_fp8_quant_x(QuantXParams p) {
  __shared__ float red[kThreads / 32];
  const int64_t groups = p.k / 8;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.ldx;
    float mean = 0.f, inv = 1.f;
    if (p.norm != FMLP_NORM_NONE) {
      float v[8];
      if (p.norm == FMLP_NORM_LAYERNORM) {
        float s = 0.f;
        for (int64_t gi = threadIdx.x; gi < groups; gi += kThreads) {
          load8<T, VEC>(x + gi * 8, v);
#pragma unroll
          for (int e = 0; e < 8; ++e) s += v[e];
        }
        mean = block_reduce<kThreads>(s, red) / float(p.k);
      }
      float s2 = 0.f;
      for (int64_t gi = threadIdx.x; gi < groups; gi += kThreads) {
        load8<T, VEC>(x + gi * 8, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) s2 += (v[e] - mean) * (v[e] - mean);
      }
      inv = 1.f / sqrtf(block_reduce<kThreads>(s2, red) / float(p.k) + p.eps);
    }
    auto normalised = [&](float(&v)[8], int64_t i0) {
      if (p.norm == FMLP_NORM_NONE) return;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float gm = p.gamma ? load_scalar(p.gamma, p.gamma_t, i0 + e) : 1.f;
        const float bt = p.beta ? load_scalar(p.beta, p.beta_t, i0 + e) : 0.f;
        v[e] = (v[e] - mean) * inv * gm + bt;
      }
    };
    float amax = 0.f;
    for (int64_t gi = threadIdx.x; gi < groups; gi += kThreads) {
      float v[8];
      load8<T, VEC>(x + gi * 8, v);
      normalised(v, gi * 8);
#pragma unroll
      for (int e = 0; e < 8; ++e) amax = fmaxf(amax, amax_term(v[e]));
    }
    const float s = row_scale(block_reduce<kThreads, true>(amax, red));
    const float rcp = 1.f / s;
    for (int64_t gi = threadIdx.x; gi < groups; gi += kThreads) {
      float v[8];
      load8<T, VEC>(x + gi * 8, v);
      normalised(v, gi * 8);
      store_e4m3x8(p.q + row * p.k + gi * 8, v, rcp);
    }
    if (threadIdx.x == 0) p.scale[row] = s;
  }
}

struct ActQuantParams {
  ActParams a;  // G: 16-byte aligned rows, cols % 16 == 0
  uint8_t* q;   // [rows, cols]
  float* scale;
};

// One block per token row: h in the activation dtype into shared memory (cols elements) while the
// row amax accumulates, then the codes from shared memory. Each thread reads back only the groups
// it wrote, so the amax reduction is the only barrier.
template <typename T, bool GATED>
__global__ void __launch_bounds__(kThreads) prefill_fp8_bias_act_quant(ActQuantParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float red[kThreads / 32];
  Vec8<T>* stash = reinterpret_cast<Vec8<T>*>(smem);
  const ActParams& a = p.a;
  const int64_t groups = a.cols / 8;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* g = static_cast<const T*>(a.g) + row * a.ldg;
    const T* u = g + a.up;
    float amax = 0.f;
    for (int64_t gi = threadIdx.x; gi < groups; gi += kThreads) {
      const Vec8<T> gv = *reinterpret_cast<const Vec8<T>*>(g + gi * 8);
      Vec8<T> uv{};
      if (GATED) uv = *reinterpret_cast<const Vec8<T>*>(u + gi * 8);
      Vec8<T> hv;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        hv.v[e] = from_f<T>(bias_act<GATED>(a, to_f(gv.v[e]), to_f(uv.v[e]), gi * 8 + e));
        amax = fmaxf(amax, amax_term(to_f(hv.v[e])));
      }
      stash[gi] = hv;
    }
    const float s = row_scale(block_reduce<kThreads, true>(amax, red));
    const float rcp = 1.f / s;
    for (int64_t gi = threadIdx.x; gi < groups; gi += kThreads) {
      const Vec8<T> hv = stash[gi];
      float v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = to_f(hv.v[e]);
      store_e4m3x8(p.q + row * a.cols + gi * 8, v, rcp);
    }
    if (threadIdx.x == 0) p.scale[row] = s;
  }
}

// s1[j] = the weight scale of column j of G (gate rows, then up rows: from w1_scale, or from
// w_up_scale for separate up weights), s2[o] = w2's; a per-tensor scale ([1]) is repeated.
struct ScaleParams {
  float *s1, *s2;
  const float *w1s, *wus, *w2s;
  int64_t n1s, nus, n2s;  // source lengths (1: per tensor)
  int64_t hidden;         // where the up columns start when wus is set
  int64_t n1, n2;         // lengths of s1 and s2
};

__global__ void prefill_fp8_scales(ScaleParams p) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < p.n1 + p.n2;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (i >= p.n1) {
      p.s2[i - p.n1] = p.w2s[p.n2s == 1 ? 0 : i - p.n1];
      continue;
    }
    const bool up = p.wus != nullptr && i >= p.hidden;
    const float* src = up ? p.wus : p.w1s;
    const int64_t n = up ? p.nus : p.n1s, j = up ? i - p.hidden : i;
    p.s1[i] = src[n == 1 ? 0 : j];
  }
}

struct OutParams {
  const void* d;  // GEMM2's D in scratch [rows, ldd]
  int64_t ldd;
  void* y;
  int64_t ldy;
  const void* res;  // may be y (in place): each element is read before it is written
  int64_t ldr;
  const void* b2;
  fmlp_dtype_t b2_t;
  int64_t rows, cols;
};

// y = D + b2 (+ residual), rounded once to the activation dtype.
template <typename T>
__global__ void __launch_bounds__(kThreads) prefill_fp8_out(OutParams p) {
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    const T* d = static_cast<const T*>(p.d) + row * p.ldd;
    const T* r = p.res ? static_cast<const T*>(p.res) + row * p.ldr : nullptr;
    T* y = static_cast<T*>(p.y) + row * p.ldy;
    for (int64_t j = blockIdx.x * int64_t(kThreads) + threadIdx.x; j < p.cols;
         j += int64_t(gridDim.x) * kThreads) {
      float v = to_f(d[j]);
      if (p.b2) v += load_scalar(p.b2, p.b2_t, j);
      if (r) v += to_f(r[j]);
      y[j] = from_f<T>(v);
    }
  }
}

// The GEMMs of one pass. direct: GEMM2 writes y itself (with the residual as C); otherwise its D
// goes to scratch and prefill_fp8_out finishes y.
struct PassGemms {
  LtGemm g1, up, g2;
  bool separate_up = false, direct = false;
};

// The GEMMs for tokens [r0, r0 + mc), checked against cuBLASLt's heuristic before anything runs
// (the answers are cached, so the per-pass calls are lookups).
fmlp_status_t plan_pass(const fmlp_mlp_args_t& a, const MlpDesc& d, char* base, const Layout& l,
                        int64_t r0, int64_t mc, PassGemms* p) {
  const fmlp_mlp_weights_t& w = a.weights;
  const size_t es = dtype_size(d.act_dtype);
  const int64_t H = d.hidden;
  LtGemm g1;
  g1.device = d.device_id;
  g1.dtype = d.act_dtype;
  g1.deterministic = d.deterministic;
  g1.fp8 = true;
  g1.n = mc;
  g1.k = d.d_in;
  g1.a = w.w1.data;
  g1.lda = w.w1.stride[0];
  g1.a_scale = reinterpret_cast<const float*>(base + l.s1);
  g1.b = base + l.xq;
  g1.ldb = d.d_in;
  g1.b_scale = reinterpret_cast<const float*>(base + l.sx);
  g1.d = base + l.g;
  g1.ldd = l.ldg;
  g1.m = d.gated && d.stacked_gate_up ? 2 * H : H;
  p->g1 = g1;
  p->separate_up = d.gated && !d.stacked_gate_up;
  if (p->separate_up) {
    p->up = g1;
    p->up.a = w.w_up.data;
    p->up.lda = w.w_up.stride[0];
    p->up.a_scale = g1.a_scale + H;
    p->up.d = base + l.g + size_t(H) * es;
  }
  LtGemm g2 = g1;
  g2.m = d.d_out;
  g2.k = H;
  g2.a = w.w2.data;
  g2.lda = w.w2.stride[0];
  g2.a_scale = reinterpret_cast<const float*>(base + l.s2);
  g2.b = base + l.hq;
  g2.ldb = H;
  g2.b_scale = reinterpret_cast<const float*>(base + l.sh);
  g2.d = const_cast<char*>(offset(a.y.data, r0 * a.y.stride[0], es));
  g2.ldd = a.y.stride[0];
  if (d.has_residual) {
    g2.c = offset(a.residual.data, r0 * a.residual.stride[0], es);
    g2.ldc = a.residual.stride[0];
  }
  p->direct = !d.has_b2 && lt_available(g2, kLtWorkspaceBytes);
  if (!p->direct) {
    g2.c = nullptr;
    g2.ldc = 0;
    g2.d = base + l.g;
    g2.ldd = l.ld_out;
  }
  p->g2 = g2;
  for (const LtGemm* g : {&p->g1, p->separate_up ? &p->up : nullptr, &p->g2})
    if (g && !lt_available(*g, kLtWorkspaceBytes))
      return fail(FMLP_ERROR_NOT_SUPPORTED,
                  "cuBLASLt has no fp8 e4m3 algorithm (per-row scales, {} output) for the GEMM "
                  "m={} n={} k={} (lda {}): use fmlp_mlp_with_kernel with "
                  "mlp_decode_sm90_splitk (weight-only fp8)",
                  fmlp_dtype_name(d.act_dtype), g->m, g->n, g->k, g->lda);
  return FMLP_SUCCESS;
}

template <typename T>
fmlp_status_t run_passes(const fmlp_mlp_args_t& a, const MlpDesc& d, char* base, const Layout& l,
                         cudaStream_t s) {
  const fmlp_mlp_weights_t& w = a.weights;
  const size_t es = sizeof(T);
  const int64_t H = d.hidden;
  // Every distinct pass size is checked before the first launch: a refusal leaves y untouched.
  const int64_t passes = (d.m + l.chunk - 1) / l.chunk;
  PassGemms pg;
  for (const int64_t r0 : {int64_t(0), (passes - 1) * l.chunk})
    if (const fmlp_status_t st = plan_pass(a, d, base, l, r0, std::min(l.chunk, d.m - r0), &pg);
        st != FMLP_SUCCESS)
      return st;

  auto scale_len = [](const fmlp_tensor_t& t) { return t.shape[0]; };
  ScaleParams sp{
      reinterpret_cast<float*>(base + l.s1),
      reinterpret_cast<float*>(base + l.s2),
      static_cast<const float*>(w.w1_scale.data),
      d.gated && !d.stacked_gate_up ? static_cast<const float*>(w.w_up_scale.data) : nullptr,
      static_cast<const float*>(w.w2_scale.data),
      scale_len(w.w1_scale),
      d.gated && !d.stacked_gate_up ? scale_len(w.w_up_scale) : 0,
      scale_len(w.w2_scale),
      H,
      l.ldg,
      d.d_out};
  prefill_fp8_scales<<<int(std::min<int64_t>((l.ldg + d.d_out + 255) / 256, 1024)), 256, 0, s>>>(
      sp);
  if (const fmlp_status_t st = launch_status("prefill_fp8_scales"); st != FMLP_SUCCESS) return st;

  // h is staged in shared memory, one row per block (supports() bounds H by the opt-in limit).
  const size_t smem = size_t(H) * es;
  auto* act_kernel =
      d.gated ? prefill_fp8_bias_act_quant<T, true> : prefill_fp8_bias_act_quant<T, false>;
  if (const fmlp_status_t st =
          d.gated ? allow_dynamic_smem<prefill_fp8_bias_act_quant<T, true>>(smem, "h row")
                  : allow_dynamic_smem<prefill_fp8_bias_act_quant<T, false>>(smem, "h row");
      st != FMLP_SUCCESS)
    return st;
  const bool x_vec =
      reinterpret_cast<uintptr_t>(a.x.data) % 16 == 0 && (a.x.stride[0] * int64_t(es)) % 16 == 0;
  auto gemm = [&](const LtGemm& g) {
    size_t used = 0;
    return lt_matmul(g, base + l.lt, kLtWorkspaceBytes, &used, s);
  };

  for (int64_t r0 = 0; r0 < d.m; r0 += l.chunk) {
    const int64_t mc = std::min(l.chunk, d.m - r0);
    if (const fmlp_status_t st = plan_pass(a, d, base, l, r0, mc, &pg); st != FMLP_SUCCESS)
      return st;
    const unsigned rows_grid = unsigned(std::min<int64_t>(mc, 1 << 30));

    QuantXParams qp{offset(a.x.data, r0 * a.x.stride[0], es),
                    a.x.stride[0],
                    mc,
                    d.d_in,
                    d.has_norm_weight ? w.norm_weight.data : nullptr,
                    d.has_norm_bias ? w.norm_bias.data : nullptr,
                    w.norm_weight.dtype,
                    w.norm_bias.dtype,
                    d.norm,
                    d.norm_eps,
                    reinterpret_cast<uint8_t*>(base + l.xq),
                    reinterpret_cast<float*>(base + l.sx)};
    if (x_vec)
      prefill_fp8_quant_x<T, true><<<rows_grid, kThreads, 0, s>>>(qp);
    else
      prefill_fp8_quant_x<T, false><<<rows_grid, kThreads, 0, s>>>(qp);
    if (const fmlp_status_t st = launch_status("prefill_fp8_quant_x"); st != FMLP_SUCCESS)
      return st;

    if (const fmlp_status_t st = gemm(pg.g1); st != FMLP_SUCCESS) return st;
    if (pg.separate_up)
      if (const fmlp_status_t st = gemm(pg.up); st != FMLP_SUCCESS) return st;

    ActParams ap{base + l.g, l.ldg,   H,          mc,         H,
                 nullptr,    nullptr, w.b1.dtype, w.b1.dtype, d.activation};
    if (d.has_b1) ap.bg = w.b1.data;
    if (d.gated && d.stacked_gate_up && d.has_b1) {
      ap.bu = offset(w.b1.data, H, dtype_size(w.b1.dtype));
    } else if (d.has_b_up) {
      ap.bu = w.b_up.data;
      ap.bu_t = w.b_up.dtype;
    }
    const ActQuantParams aq{ap, reinterpret_cast<uint8_t*>(base + l.hq),
                            reinterpret_cast<float*>(base + l.sh)};
    act_kernel<<<rows_grid, kThreads, smem, s>>>(aq);
    if (const fmlp_status_t st = launch_status("prefill_fp8_bias_act_quant"); st != FMLP_SUCCESS)
      return st;

    if (const fmlp_status_t st = gemm(pg.g2); st != FMLP_SUCCESS) return st;
    if (!pg.direct) {
      OutParams op{
          base + l.g,
          l.ld_out,
          const_cast<char*>(offset(a.y.data, r0 * a.y.stride[0], es)),
          a.y.stride[0],
          d.has_residual ? offset(a.residual.data, r0 * a.residual.stride[0], es) : nullptr,
          d.has_residual ? a.residual.stride[0] : 0,
          d.has_b2 ? w.b2.data : nullptr,
          w.b2.dtype,
          mc,
          d.d_out};
      const dim3 grid(unsigned((d.d_out + kThreads - 1) / kThreads),
                      unsigned(std::min<int64_t>(mc, 65535)));
      prefill_fp8_out<T><<<grid, kThreads, 0, s>>>(op);
      if (const fmlp_status_t st = launch_status("prefill_fp8_out"); st != FMLP_SUCCESS) return st;
    }
  }
  return FMLP_SUCCESS;
}

template <typename T>
fmlp_status_t run_typed(const fmlp_mlp_args_t& a, const MlpDesc& d, void* workspace,
                        cudaStream_t s) {
  const Layout l = layout(d, sizeof(T));
  return run_passes<T>(a, d, prefill::scratch_base(workspace), l, s);
}

}  // namespace

bool mlp_prefill_fp8_supports(const MlpDesc& d, std::string* why) {
  if (d.act_dtype != FMLP_DTYPE_BF16 && d.act_dtype != FMLP_DTYPE_F16)
    return (*why = fmt::format(
                "fp8 e4m3 weights with {} x: this path quantises the activations to e4m3 (W8A8) "
                "and computes in bf16/f16; cast x to bf16 for it, or stay on the decode kernels "
                "(exact weight-only dequantisation)",
                fmlp_dtype_name(d.act_dtype)),
            false);
  const int cc = cuda_compute_capability(d.device_id);
  if (cc < 89)
    return (*why = fmt::format(
                "fp8 e4m3 weights: cuBLASLt's fp8 GEMMs need compute capability 8.9 or newer; "
                "cuda:{} is {}.{} (the decode kernels run fp8 weights there)",
                d.device_id, cc / 10, cc % 10),
            false);
  if (d.d_in % 16 != 0 || d.hidden % 16 != 0 || d.d_out % 16 != 0)
    return (*why = fmt::format(
                "fp8 e4m3 weights: cuBLASLt's fp8 GEMMs need d_in, hidden and d_out multiples of "
                "16, got {}, {} and {}; the decode kernels take any size",
                d.d_in, d.hidden, d.d_out),
            false);
  if (!d.weights_vec16)
    return (*why =
                "fp8 e4m3 weights: cuBLASLt's fp8 GEMMs need every weight matrix 16-byte aligned "
                "with a row stride of a multiple of 16 bytes; fmlp_mlp_pack lays them out so",
            false);
  const size_t es = dtype_size(d.act_dtype);
  int optin = 0;
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, d.device_id);
  if (size_t(d.hidden) * es + 1024 > size_t(optin))
    return (*why = fmt::format(
                "fp8 e4m3 weights: hidden = {} does not fit one token's row of h in shared "
                "memory ({} bytes per block on cuda:{}); the decode kernels take any hidden",
                d.hidden, optin, d.device_id),
            false);
  // The heuristic is asked once per problem class (cached), with aligned stand-in pointers: what
  // this cuBLASLt offers for outer-vector fp8 GEMMs on this GPU.
  const Layout l = layout(d, es);
  const void* aligned = reinterpret_cast<const void*>(uintptr_t(256));
  const float* scale = static_cast<const float*>(aligned);
  LtGemm g;
  g.device = d.device_id;
  g.dtype = d.act_dtype;
  g.deterministic = d.deterministic;
  g.fp8 = true;
  g.a_scale = g.b_scale = scale;
  g.a = g.b = aligned;
  g.d = const_cast<void*>(aligned);
  g.n = std::max<int64_t>(l.chunk, 1);
  const int64_t rows1 = d.gated && d.stacked_gate_up ? 2 * d.hidden : d.hidden;
  const int64_t dims[2][2] = {{rows1, d.d_in}, {d.d_out, d.hidden}};  // {m, k} of GEMM1, GEMM2
  for (const auto& mk : dims) {
    g.m = mk[0], g.k = mk[1];
    g.lda = g.ldb = g.k;
    g.ldd = round8(g.m);
    if (!lt_available(g, kLtWorkspaceBytes))
      return (*why = fmt::format(
                  "fp8 e4m3 weights: this cuBLASLt offers no fp8 GEMM with per-row (outer-vector) "
                  "scales and {} output for m={} n={} k={} on cuda:{}; the decode kernels run "
                  "fp8 weights",
                  fmlp_dtype_name(d.act_dtype), g.m, g.n, g.k, d.device_id),
              false);
  }
  return true;
}

size_t mlp_prefill_fp8_workspace(const MlpDesc& d) {
  return cuda_scratch_workspace_bytes(layout(d, dtype_size(d.act_dtype)).end);
}

fmlp_status_t mlp_prefill_fp8_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* workspace,
                                  void* stream) {
  if (d.m == 0) return FMLP_SUCCESS;
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return d.act_dtype == FMLP_DTYPE_F16 ? run_typed<__half>(a, d, workspace, s)
                                       : run_typed<__nv_bfloat16>(a, d, workspace, s);
}

}  // namespace fmlp::detail
