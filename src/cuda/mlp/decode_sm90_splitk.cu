// mlp_decode_sm90_splitk: the whole MLP of M <= 64 tokens in one kernel launch.
//
// The hidden dimension is split into tiles (gated: 8 hidden units = 8 gate rows + 8 up rows of
// W1; dense: 16 hidden units) and the tiles are dealt out evenly to one block per multiprocessor.
// Each block
//   1. computes the norm statistics of every row of x (x is small and stays in L2),
//   2. streams its W1 rows once with 16-byte loads and multiplies them on the tensor cores
//      (mma.sync m16n8k16, weights as the A operand, the normalised tokens staged in shared
//      memory as the B operand), then applies bias, activation and gate in registers and keeps the
//      hidden slice h in shared memory (it never touches global memory),
//   3. multiplies h by the matching columns of W2 (again streamed once) and adds its partial
//      outputs into an fp32 workspace with red.global.add (deterministic mode: stores its own
//      partials instead),
//   4. counts, per 16-row output tile, the blocks that are done; the block that completes a
//      tile adds b2 and the residual, writes y and re-zeroes the tile's workspace (deterministic
//      mode: every block's slot of it) and counter, so the next call (or a CUDA-graph replay)
//      starts from a clean workspace without a memset.
//
// Precision: weights enter the tensor cores exactly (fp16/fp32 weights are split into two bf16
// halves, hi + lo; fp8 e4m3 weights are exact in bf16, their fp32 scales are applied to the
// GEMM results per row). The B operands are split hi + lo too (~16 significant bits): h always, the
// tokens unless they are plain bf16 x (exact already). Accumulation is fp32 throughout.
//
// k-permutation trick: thread (g = lane / 4, t = lane % 4) loads 8 consecutive elements
// [8t, 8t+8) of a 32-wide k step for its rows g and g+8 and for token g; a dot product does not
// care about the order of k as long as A and B agree, so these 16-byte loads feed two
// m16n8k16 steps directly, with no shuffles and no shared-memory staging of the weights.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor_check.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/mlp/entries.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::activate;
using fmlp::cuda::ld_stream_v4;
using fmlp::cuda::load_scalar;
using fmlp::cuda::mma_bf16;
using fmlp::cuda::split_bf16;
using fmlp::cuda::store_scalar;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxTokens = 64;
constexpr int kStatsBytes = kMaxTokens * 8;
constexpr size_t kXsBudget = 96 * 1024;  // shared memory for one chunk of staged tokens

struct DecodeParams : fmlp::cuda::DecodeOperands, fmlp::cuda::Fp8Scales {
  int gated, split_x, split_h, deterministic, vec;
  int tiles, tile_hidden;  // tile_hidden: 8 gated, 16 dense
  int tw, ks;              // GEMM1 warps: tw tile columns x ks k-splits
  int kc;                  // staged chunk of k, a multiple of 32
  int xs_ld, hs_ld;        // shared-memory row strides in bf16 elements
  int xr_bytes;            // bytes of the staged-token region (also the k-split reduction buffer)
  float* ws;
  unsigned* counters;
};

using Fp8 = unsigned char;  // e4m3 bits
template <typename WT>
constexpr bool kFp8 = std::is_same<WT, Fp8>::value;

// Raw weight bytes for 8 consecutive k of one row, converted to bf16 hi (+ lo) only at use, so
// all loads of a step are in flight before the first conversion (fp8: the first 8 bytes).
template <typename WT>
struct Raw {
  uint4 v[sizeof(WT) == 4 ? 2 : 1];
};

// vec: 16-byte loads (8-byte for fp8; aligned rows, whole groups of 8); otherwise element loads
// of the first `nvalid` elements, zeros after, for strided, misaligned or ragged weights.
template <typename WT>
__device__ __forceinline__ void load_raw(Raw<WT>& r, const WT* p, bool ok, bool vec, int nvalid) {
  if (kFp8<WT> && vec) {
    const uint2 w = ok ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0, 0);
    r.v[0] = make_uint4(w.x, w.y, 0, 0);
    return;
  }
  if (vec) {
#pragma unroll
    for (int i = 0; i < int(sizeof(r.v) / 16); ++i)
      r.v[i] =
          ok ? ld_stream_v4(reinterpret_cast<const char*>(p) + 16 * i) : make_uint4(0, 0, 0, 0);
    return;
  }
  using Bits = std::conditional_t<sizeof(WT) == 4, uint32_t,
                                  std::conditional_t<sizeof(WT) == 2, uint16_t, uint8_t>>;
  Bits e[8];
  const Bits* q = reinterpret_cast<const Bits*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = ok && i < nvalid ? __ldg(q + i) : Bits(0);
  r.v[0] = make_uint4(0, 0, 0, 0);
  memcpy(&r.v[0], e, sizeof(e));
}

template <typename WT>
constexpr bool kSplitWeights = !std::is_same<WT, __nv_bfloat16>::value && !kFp8<WT>;

__device__ __forceinline__ uint32_t bf16_pair(__nv_bfloat16 a, __nv_bfloat16 b) {
  return uint32_t(__bfloat16_as_ushort(a)) | (uint32_t(__bfloat16_as_ushort(b)) << 16);
}

__device__ __forceinline__ void split_pair(float a, float b, uint32_t* hi, uint32_t* lo) {
  __nv_bfloat16 ah, al, bh, bl;
  split_bf16(a, &ah, &al);
  split_bf16(b, &bh, &bl);
  *hi = bf16_pair(ah, bh);
  *lo = bf16_pair(al, bl);
}

template <typename WT>
__device__ __forceinline__ void to_frag(const Raw<WT>& r, uint4& hi, uint4& lo) {
  if constexpr (std::is_same<WT, __nv_bfloat16>::value) {
    hi = r.v[0];
  } else if constexpr (kFp8<WT>) {  // exact in bf16: no lo half
    (void)lo;
    hi = fmlp::cuda::widen_e4m3x8_to<__nv_bfloat16>(r.v[0].x, r.v[0].y);
  } else if constexpr (std::is_same<WT, __half>::value) {
    const uint32_t* w = &r.v[0].x;
    uint32_t* h = &hi.x;
    uint32_t* l = &lo.x;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      split_pair(f.x, f.y, &h[i], &l[i]);
    }
  } else {
    const float* f = reinterpret_cast<const float*>(&r.v[0]);
    uint32_t* h = &hi.x;
    uint32_t* l = &lo.x;
#pragma unroll
    for (int i = 0; i < 4; ++i) split_pair(f[2 * i], f[2 * i + 1], &h[i], &l[i]);
  }
}

// acc += rows(g, g+8) x token(g) over one 32-wide k step (two m16n8k16 products).
__device__ __forceinline__ void mma_k32(float (&c)[4], const uint4& r0, const uint4& r1,
                                        const uint4& x) {
  mma_bf16(c, r0.x, r1.x, r0.y, r1.y, x.x, x.y);
  mma_bf16(c, r0.z, r1.z, r0.w, r1.w, x.z, x.w);
}

template <typename WT>
__device__ __forceinline__ void mma_rows(float (&c)[4], const Raw<WT>& ra, const Raw<WT>& rb,
                                         const __nv_bfloat16* xrow, int split_ld, bool split) {
  uint4 ah, al, bh, bl;
  to_frag(ra, ah, al);
  to_frag(rb, bh, bl);
  const uint4 xh = *reinterpret_cast<const uint4*>(xrow);
  mma_k32(c, ah, bh, xh);
  if (split) mma_k32(c, ah, bh, *reinterpret_cast<const uint4*>(xrow + split_ld));
  if constexpr (kSplitWeights<WT>) mma_k32(c, al, bl, xh);
}

__device__ __forceinline__ void store_split(__nv_bfloat16* p, int lo_offset, bool split, float v) {
  if (split) {
    split_bf16(v, p, p + lo_offset);
  } else {
    *p = __float2bfloat16_rn(v);
  }
}

template <typename WT, int TPW, int NT>
__global__ void __launch_bounds__(kThreads, 1) mlp_decode_sm90_splitk(const DecodeParams p) {
  constexpr int kMpad = NT * 8;
  constexpr int kUnroll = (sizeof(WT) == 4 ? 4 : 8) / TPW > 0 ? (sizeof(WT) == 4 ? 4 : 8) / TPW : 1;
  extern __shared__ __align__(16) unsigned char smem[];
  float2* stats = reinterpret_cast<float2*>(smem);
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + kStatsBytes);
  float* red = reinterpret_cast<float*>(smem + kStatsBytes);
  __nv_bfloat16* hs = reinterpret_cast<__nv_bfloat16*>(smem + kStatsBytes + p.xr_bytes);
  const int xs_lo = kMpad * p.xs_ld, hs_lo = kMpad * p.hs_ld;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int G = gridDim.x;
  const int t0 = int(int64_t(blockIdx.x) * p.tiles / G);
  const int tb = int(int64_t(blockIdx.x + 1) * p.tiles / G) - t0;
  const int hid0 = t0 * p.tile_hidden;
  const int hb = tb * p.tile_hidden;  // hidden units of this block, the last tile may pass H
  const WT* wg = static_cast<const WT*>(p.wg);
  const WT* wu = static_cast<const WT*>(p.wu);
  const WT* w2 = static_cast<const WT*>(p.w2);

  // 1. Norm statistics, one warp per token row.
  if (p.norm != FMLP_NORM_NONE) {
    for (int r = warp; r < p.m; r += kWarps) {
      const int64_t xr = r * p.x_ld;
      float mean = 0.f;
      if (p.norm == FMLP_NORM_LAYERNORM) {
        float s = 0.f;
        for (int k = lane; k < p.k; k += 32) s += load_scalar(p.x, p.act_t, xr + k);
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        mean = s / float(p.k);
      }
      float v = 0.f;
      for (int k = lane; k < p.k; k += 32) {
        const float d = load_scalar(p.x, p.act_t, xr + k) - mean;
        v += d * d;
      }
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) stats[r] = make_float2(mean, rsqrtf(v / float(p.k) + p.eps));
    }
  }
  // Padding tokens and hidden units past the block's slice stay zero in every product.
  {
    uint4* hz = reinterpret_cast<uint4*>(hs);
    const int n16 = (p.split_h ? 2 : 1) * hs_lo / 8;
    for (int i = threadIdx.x; i < n16; i += kThreads) hz[i] = make_uint4(0, 0, 0, 0);
  }

  // 2. GEMM1 + activation into hs.
  const int tw_i = warp % p.tw, ks_i = warp / p.tw;
  const bool gemm1 = ks_i < p.ks;
  for (int batch0 = 0; batch0 < tb; batch0 += p.tw * TPW) {
    float acc[TPW][NT][4];
#pragma unroll
    for (int i = 0; i < TPW; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    const WT* ra[TPW];
    const WT* rb[TPW];
    bool oka[TPW], okb[TPW];
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const int lt = batch0 + tw_i * TPW + i;
      const bool valid = gemm1 && lt < tb;
      const int j = hid0 + lt * p.tile_hidden + g;
      if (p.gated) {
        ra[i] = wg + int64_t(j) * p.wg_ld;
        rb[i] = wu + int64_t(j) * p.wu_ld;
        oka[i] = okb[i] = valid && j < p.h;
      } else {
        ra[i] = wg + int64_t(j) * p.wg_ld;
        rb[i] = wg + int64_t(j + 8) * p.wg_ld;
        oka[i] = valid && j < p.h;
        okb[i] = valid && j + 8 < p.h;
      }
    }
    for (int k0 = 0; k0 < p.k; k0 += p.kc) {
      const int kcur = min(p.kc, p.k - k0);
      const int kpad = (kcur + 31) & ~31;
      __syncthreads();  // the previous chunk (or the reduction buffer) is no longer read
      for (int idx = threadIdx.x; idx < kMpad * kpad; idx += kThreads) {
        const int r = idx / kpad, c = idx - r * kpad;
        float v = 0.f;
        if (r < p.m && c < kcur) {
          const int k = k0 + c;
          v = load_scalar(p.x, p.act_t, r * p.x_ld + k);
          if (p.norm != FMLP_NORM_NONE) {
            const float2 st = stats[r];
            v = (v - st.x) * st.y;
            if (p.gamma) v *= load_scalar(p.gamma, p.gamma_t, k);
            if (p.beta) v += load_scalar(p.beta, p.beta_t, k);
          }
        }
        store_split(xs + r * p.xs_ld + c, xs_lo, p.split_x, v);
      }
      __syncthreads();
      if (!gemm1) continue;
      const int nsteps = kpad / 32;
      for (int s = ks_i; s < nsteps; s += p.ks * kUnroll) {
        Raw<WT> a[kUnroll][TPW], b[kUnroll][TPW];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int su = s + u * p.ks;
          const int kk = k0 + su * 32 + 8 * t;
          const bool in = su < nsteps && kk < p.k;
#pragma unroll
          for (int i = 0; i < TPW; ++i) {
            load_raw(a[u][i], ra[i] + kk, in && oka[i], p.vec, p.k - kk);
            load_raw(b[u][i], rb[i] + kk, in && okb[i], p.vec, p.k - kk);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int su = s + u * p.ks;
          if (su >= nsteps) break;
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const __nv_bfloat16* xrow = xs + (8 * j + g) * p.xs_ld + su * 32 + 8 * t;
#pragma unroll
            for (int i = 0; i < TPW; ++i)
              mma_rows<WT>(acc[i][j], a[u][i], b[u][i], xrow, xs_lo, p.split_x);
          }
        }
      }
    }
    if (p.ks > 1) {  // sum the k-split partials in a fixed order (deterministic)
      __syncthreads();
      if (gemm1)
#pragma unroll
        for (int i = 0; i < TPW; ++i)
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              red[((warp * TPW + i) * NT + j) * 128 + lane * 4 + e] = acc[i][j][e];
      __syncthreads();
      if (gemm1 && ks_i == 0)
        for (int q = 1; q < p.ks; ++q)
#pragma unroll
          for (int i = 0; i < TPW; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc[i][j][e] += red[(((warp + q * p.tw) * TPW + i) * NT + j) * 128 + lane * 4 + e];
    }
    if (gemm1 && ks_i == 0) {
#pragma unroll
      for (int i = 0; i < TPW; ++i) {
        const int lt = batch0 + tw_i * TPW + i;
        if (lt >= tb) continue;
        const int jl = lt * p.tile_hidden + g;  // local hidden index of rows g (and g + 8)
        const int j = hid0 + jl;
#pragma unroll
        for (int jn = 0; jn < NT; ++jn)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int n = 8 * jn + 2 * t + e;
            __nv_bfloat16* hrow = hs + n * p.hs_ld;
            const float* c = acc[i][jn];
            // fp8: row r of W1 (or W_up) times its scale.
            auto sg = [&](int r) { return kFp8<WT> ? p.sg[r * p.sg_stride] : 1.f; };
            if (p.gated) {
              if (j >= p.h) continue;
              const float su = kFp8<WT> ? p.su[j * p.su_stride] : 1.f;
              const float gate = c[e] * sg(j) + (p.bg ? load_scalar(p.bg, p.bg_t, j) : 0.f);
              const float up = c[2 + e] * su + (p.bu ? load_scalar(p.bu, p.bu_t, j) : 0.f);
              store_split(hrow + jl, hs_lo, p.split_h, activate(p.act, gate) * up);
            } else {
              if (j < p.h)
                store_split(
                    hrow + jl, hs_lo, p.split_h,
                    activate(p.act, c[e] * sg(j) + (p.bg ? load_scalar(p.bg, p.bg_t, j) : 0.f)));
              if (j + 8 < p.h)
                store_split(hrow + jl + 8, hs_lo, p.split_h,
                            activate(p.act, c[2 + e] * sg(j + 8) +
                                                (p.bg ? load_scalar(p.bg, p.bg_t, j + 8) : 0.f)));
            }
          }
      }
    }
  }
  __syncthreads();

  // 3. GEMM2 over this block's hidden slice; partial outputs go to the workspace.
  const int mtiles = (p.n + 15) / 16;
  const int nsteps2 = (hb + 31) / 32;
  constexpr int kMU = 2, kSU = sizeof(WT) == 4 ? 2 : 4;
  float* part = p.deterministic ? p.ws + int64_t(blockIdx.x) * p.n * kMpad : p.ws;
  for (int mt0 = warp * kMU; mt0 < mtiles; mt0 += kWarps * kMU) {
    float acc[kMU][NT][4];
#pragma unroll
    for (int q = 0; q < kMU; ++q)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[q][j][e] = 0.f;
    for (int s0 = 0; s0 < nsteps2; s0 += kSU) {
      Raw<WT> a[kSU][kMU], b[kSU][kMU];
#pragma unroll
      for (int u = 0; u < kSU; ++u) {
        const int col = (s0 + u) * 32 + 8 * t;
        const bool in = s0 + u < nsteps2 && col < hb && hid0 + col < p.h;
#pragma unroll
        for (int q = 0; q < kMU; ++q) {
          const int o = (mt0 + q) * 16 + g;
          const int nv = p.h - hid0 - col;
          load_raw(a[u][q], w2 + int64_t(o) * p.w2_ld + hid0 + col, in && o < p.n, p.vec, nv);
          load_raw(b[u][q], w2 + int64_t(o + 8) * p.w2_ld + hid0 + col, in && o + 8 < p.n, p.vec,
                   nv);
        }
      }
#pragma unroll
      for (int u = 0; u < kSU; ++u) {
        if (s0 + u >= nsteps2) break;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const __nv_bfloat16* hrow = hs + (8 * j + g) * p.hs_ld + (s0 + u) * 32 + 8 * t;
#pragma unroll
          for (int q = 0; q < kMU; ++q)
            mma_rows<WT>(acc[q][j], a[u][q], b[u][q], hrow, hs_lo, p.split_h);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kMU; ++q)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int o = (mt0 + q) * 16 + g + 8 * r;
          const int n = 8 * j + 2 * t;
          if (o >= p.n || n >= p.m) continue;
          float* dst = part + int64_t(o) * kMpad + n;
          const float s2 = kFp8<WT> ? p.s2[o * p.s2_stride] : 1.f;  // a partial sum of row o
          const float v0 = acc[q][j][2 * r] * s2, v1 = acc[q][j][2 * r + 1] * s2;
          if (p.deterministic && n + 1 < p.m) {  // a padded token's column stays zero
            *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
          } else if (p.deterministic) {
            *dst = v0;
          } else if (n + 1 < p.m) {
            fmlp::cuda::red_add_v2_f32(dst, v0, v1);
          } else {
            fmlp::cuda::red_add_f32(dst, v0);
          }
        }
  }

  // 4. Per output tile: the block that arrives last finishes it and cleans the workspace.
  __threadfence();
  __syncthreads();
  for (int base = 0; base < mtiles; base += kThreads) {
    const int mt = base + threadIdx.x;
    bool last = false;
    if (mt < mtiles) last = atomicAdd(&p.counters[mt], 1u) == unsigned(G - 1);
    __shared__ int last_list[kThreads];
    __shared__ int last_count;
    if (threadIdx.x == 0) last_count = 0;
    __syncthreads();
    if (last) last_list[atomicAdd(&last_count, 1)] = mt;
    __syncthreads();
    const int nl = last_count;
    if (nl > 0) __threadfence();
    for (int q = warp; q < nl; q += kWarps) {
      const int lmt = last_list[q];
      for (int idx = lane; idx < 16 * p.m; idx += 32) {
        const int o = lmt * 16 + (idx & 15), n = idx >> 4;
        if (o >= p.n) continue;
        float v;
        if (p.deterministic) {  // the blocks' slots in block order, each left zero
          v = 0.f;
          for (int bb = 0; bb < G; ++bb) {
            float* w = p.ws + (int64_t(bb) * p.n + o) * kMpad + n;
            v += __ldcg(w);
            __stcg(w, 0.f);
          }
        } else {
          float* w = p.ws + int64_t(o) * kMpad + n;
          v = __ldcg(w);
          __stcg(w, 0.f);
        }
        if (p.b2) v += load_scalar(p.b2, p.b2_t, o);
        if (p.res) v += load_scalar(p.res, p.act_t, int64_t(n) * p.res_ld + o);
        store_scalar(p.y, p.act_t, int64_t(n) * p.y_ld + o, v);
      }
      if (lane == 0) p.counters[lmt] = 0u;
    }
    __syncthreads();  // last_list is reused by the next round
  }
}

// ---- host side ----

struct LaunchConfig {
  int grid = 0, tiles = 0, tile_hidden = 0, tpw = 1, nt = 1, tw = 1, ks = 1, kc = 0;
  int xs_ld = 0, hs_ld = 0, xr_bytes = 0, split_x = 0, split_h = 1;
  size_t smem = 0;
};

// Row stride (bf16 elements) for `cols` columns: 16-byte aligned rows whose byte stride is 64 mod
// 128, so the 8 token rows a warp reads at once fall into different bank halves.
int smem_ld(int cols) {
  int ld = (cols + 31) / 32 * 32;
  if (ld % 64 == 0) ld += 32;
  return ld;
}

constexpr size_t kMaxSmem = 227 * 1024;

bool make_config(const MlpDesc& d, LaunchConfig* c, std::string* why) {
  const int sms = cuda_sm_count(d.device_id);
  if (sms <= 0) {
    *why = "cannot read the multiprocessor count of " + device_string(d.device, d.device_id);
    return false;
  }
  c->tile_hidden = d.gated ? 8 : 16;
  c->tiles = int((d.hidden + c->tile_hidden - 1) / c->tile_hidden);
  c->grid = std::min(sms, c->tiles);
  const int tmax = (c->tiles + c->grid - 1) / c->grid;
  c->nt = d.m <= 8 ? 1 : d.m <= 16 ? 2 : d.m <= 32 ? 4 : 8;
  const int max_tpw = d.w_dtype == FMLP_DTYPE_BF16 ? std::min(4, 16 / c->nt) : 1;
  if (tmax <= kWarps) {
    c->tpw = 1;
  } else {
    const int want = (tmax + kWarps - 1) / kWarps;
    c->tpw = std::min(max_tpw, want <= 1 ? 1 : want <= 2 ? 2 : 4);
  }
  c->tw = std::min(kWarps, (tmax + c->tpw - 1) / c->tpw);
  c->ks = kWarps / c->tw;
  // x needs its low half unless it is bf16 as given; h always does: rounding h to bf16 (as
  // PyTorch does) costs up to ~2^-9 of the output's scale, which cancellation turns into many
  // bf16 units of a small output.
  c->split_x = d.act_dtype == FMLP_DTYPE_BF16 && d.norm == FMLP_NORM_NONE ? 0 : 1;
  c->split_h = 1;
  const int nsplit = c->split_x + 1, mpad = c->nt * 8;
  int kc = int((d.d_in + 31) / 32 * 32);
  while (kc > 32 && size_t(mpad) * smem_ld(kc) * 2 * nsplit > kXsBudget)
    kc = (kc / 2 + 31) / 32 * 32;
  c->kc = kc;
  c->xs_ld = smem_ld(kc);
  const size_t xs_bytes = size_t(mpad) * c->xs_ld * 2 * nsplit;
  const size_t red_bytes = c->ks > 1 ? size_t(kWarps) * c->tpw * c->nt * 128 * 4 : 0;
  c->xr_bytes = int((std::max(xs_bytes, red_bytes) + 15) / 16 * 16);
  c->hs_ld = smem_ld(tmax * c->tile_hidden);
  const size_t hs_bytes = size_t(mpad) * c->hs_ld * 2 * (c->split_h + 1);
  c->smem = kStatsBytes + size_t(c->xr_bytes) + hs_bytes;
  if (c->smem > kMaxSmem) {
    *why = fmt::format(
        "each block would keep {} hidden units x {} tokens in shared memory ({} "
        "bytes > {}); use fewer tokens per call or backend cpu",
        tmax * c->tile_hidden, mpad, c->smem, kMaxSmem);
    return false;
  }
  return true;
}

using KernelFn = void (*)(DecodeParams);

template <typename WT>
KernelFn pick_kernel(int tpw, int nt) {
  if constexpr (std::is_same<WT, __nv_bfloat16>::value) {
    switch (tpw * 16 + nt) {
      case 16 + 1: return mlp_decode_sm90_splitk<WT, 1, 1>;
      case 16 + 2: return mlp_decode_sm90_splitk<WT, 1, 2>;
      case 16 + 4: return mlp_decode_sm90_splitk<WT, 1, 4>;
      case 16 + 8: return mlp_decode_sm90_splitk<WT, 1, 8>;
      case 32 + 1: return mlp_decode_sm90_splitk<WT, 2, 1>;
      case 32 + 2: return mlp_decode_sm90_splitk<WT, 2, 2>;
      case 32 + 4: return mlp_decode_sm90_splitk<WT, 2, 4>;
      case 32 + 8: return mlp_decode_sm90_splitk<WT, 2, 8>;
      case 64 + 1: return mlp_decode_sm90_splitk<WT, 4, 1>;
      case 64 + 2: return mlp_decode_sm90_splitk<WT, 4, 2>;
      case 64 + 4: return mlp_decode_sm90_splitk<WT, 4, 4>;
      default: return nullptr;
    }
  } else {
    if (tpw != 1) return nullptr;
    switch (nt) {
      case 1: return mlp_decode_sm90_splitk<WT, 1, 1>;
      case 2: return mlp_decode_sm90_splitk<WT, 1, 2>;
      case 4: return mlp_decode_sm90_splitk<WT, 1, 4>;
      case 8: return mlp_decode_sm90_splitk<WT, 1, 8>;
      default: return nullptr;
    }
  }
}

KernelFn kernel_for(const MlpDesc& d, const LaunchConfig& c) {
  switch (d.w_dtype) {
    case FMLP_DTYPE_BF16: return pick_kernel<__nv_bfloat16>(c.tpw, c.nt);
    case FMLP_DTYPE_F16: return pick_kernel<__half>(c.tpw, c.nt);
    case FMLP_DTYPE_F32: return pick_kernel<float>(c.tpw, c.nt);
    case FMLP_DTYPE_F8_E4M3: return pick_kernel<Fp8>(c.tpw, c.nt);
    default: return nullptr;
  }
}

size_t round256(size_t n) {
  return (n + 255) / 256 * 256;
}

bool aligned16(const void* p) {
  return uintptr_t(p) % 16 == 0;
}

}  // namespace

bool mlp_decode_sm90_splitk_supports(const MlpDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CUDA) {
    *why = "needs CUDA device memory";
    return false;
  }
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3 && cuda_compute_capability(d.device_id) < 89) {
    *why =
        "fp8 e4m3 weights need sm_89 or newer here (cvt.rn.f16x2.e4m3x2); run them on "
        "mlp_decode_sm80_stream (bf16/f16 activations) or backend cpu";
    return false;
  }
  if (d.m > kMaxTokens) {
    *why = fmt::format(
        "M = {} tokens; this decode kernel handles M <= {} (split the batch into "
        "chunks of {} rows)",
        d.m, kMaxTokens, kMaxTokens);
    return false;
  }
  LaunchConfig c;
  if (!make_config(d, &c, why)) return false;
  if (kernel_for(d, c) == nullptr) {
    *why = "no instantiation for this weight dtype and shape (internal)";
    return false;
  }
  return true;
}

size_t mlp_decode_sm90_splitk_workspace(const MlpDesc& d) {
  LaunchConfig c;
  std::string why;
  if (!make_config(d, &c, &why)) return 0;
  const size_t slots = d.deterministic ? size_t(c.grid) : 1;
  const size_t mtiles = size_t((d.d_out + 15) / 16);
  return round256(slots * size_t(d.d_out) * c.nt * 8 * sizeof(float)) + mtiles * sizeof(unsigned);
}

fmlp_status_t mlp_decode_sm90_splitk_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                         void* workspace, void* stream) {
  LaunchConfig c;
  std::string why;
  if (!make_config(d, &c, &why)) return fail(FMLP_ERROR_NOT_SUPPORTED, "{}", why);
  const KernelFn fn = kernel_for(d, c);
  if (fn == nullptr) return fail(FMLP_ERROR_INTERNAL, "mlp_decode_sm90_splitk: no instantiation");
  DecodeParams p{};
  static_cast<fmlp::cuda::DecodeOperands&>(p) = fmlp::cuda::decode_operands(a, d);
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3)
    static_cast<fmlp::cuda::Fp8Scales&>(p) = fmlp::cuda::fp8_scales(a, d);
  p.gated = d.gated;
  p.split_x = c.split_x;
  p.split_h = c.split_h;
  p.deterministic = d.deterministic;
  p.tiles = c.tiles;
  p.tile_hidden = c.tile_hidden;
  p.tw = c.tw;
  p.ks = c.ks;
  p.kc = c.kc;
  p.xs_ld = c.xs_ld;
  p.hs_ld = c.hs_ld;
  p.xr_bytes = c.xr_bytes;
  // 16-byte weight loads need 16-byte aligned rows made of whole groups of 8 elements; the
  // packed layout guarantees it (rows padded with zeros), plain views may not.
  const bool rows8 = p.wg_ld % 8 == 0 && p.w2_ld % 8 == 0 && (!d.gated || p.wu_ld % 8 == 0);
  p.vec = d.layout == WeightLayout::kCudaPacked ||
          (d.d_in % 8 == 0 && d.hidden % 8 == 0 && rows8 && aligned16(p.wg) && aligned16(p.w2) &&
           (!d.gated || aligned16(p.wu)));
  const size_t slots = d.deterministic ? size_t(c.grid) : 1;
  p.ws = static_cast<float*>(workspace);
  p.counters = reinterpret_cast<unsigned*>(
      static_cast<char*>(workspace) + round256(slots * size_t(d.d_out) * c.nt * 8 * sizeof(float)));

  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  cudaError_t err =
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(c.smem));
  if (err == cudaSuccess) {
    fn<<<c.grid, kThreads, c.smem, static_cast<cudaStream_t>(stream)>>>(p);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess)
    return fail(FMLP_ERROR_CUDA,
                "mlp_decode_sm90_splitk launch ({} blocks x {} threads, {} bytes "
                "of shared memory) failed: {}",
                c.grid, kThreads, c.smem, cudaGetErrorString(err));
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
