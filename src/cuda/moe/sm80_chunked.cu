// moe_sm80_chunked, expert kernel: block (chunk, slice) runs the chunk's tokens (<= 8 * NT slots of
// one expert, from the route kernel's list) through one slice of that expert's hidden units.
//
// The op is weight-bandwidth bound at decode sizes, so the block streams its expert's weights the
// way mlp_decode_sm90_cluster does (engines/mma_stream.cuh): warps own 16-row groups, a lane's
// 16-byte non-allocating load of a row is its mma.sync A fragment (k order permuted inside each
// 32-column step, the same way for the tokens), a ring of loads in flight. Only the experts that
// received tokens are read, each weight once per chunk (chunks of one expert and slice are adjacent
// in the grid, so further chunks mostly hit L2).
//   layer 1: warps take (gate group, up group) pairs of the slice, so act(gate) * up is formed in
//            registers; the tokens (B operand) are read from x with 16-byte loads when x already
//            has the weights' dtype, else converted on the fly. With fewer groups than warps the
//            columns are split and the parts added in shared memory (fp32).
//   h:       rounded to the weights' dtype (as PyTorch rounds it) into shared memory; a slice is
//            processed in sub-slices of <= 256 units, so shared memory stays small.
//   layer 2: W2[:, slice] x h, the 16-row groups of d_out dealt over the warps (its loads are
//            requested before the barrier that publishes h); fp32 results either added into the
//            block's own rows of a per-slice partial buffer (no other block writes them: the sum
//            over slices happens in the combine kernel, in slice order) or red.add'ed into one
//            per-slot buffer when the partials would not fit (non-deterministic).
// fp8 e4m3 experts (FP8, sm_89+; the scheme in fp8.cuh): a lane's 16-byte load is 16 columns
// of a 64-column step, widened to two 8-column fp16 pieces that are two 32-column steps of the
// 16-bit path's k permutation (engines/mma_stream.cuh) against the matching pieces of the fp16
// tokens (x staged as fp16, read 16 bytes at a time). Layer 1's fp32 results are kept in shared
// memory until the sub-slice is complete; each slot's h is then staged as fp16 times the power of
// two of its largest finite |h| over the sub-slice, and the layer-2 sums of the sub-slice are
// multiplied by its inverse (the sums of one sub-slice share it) and by the W2 scale before they
// are added. The layer-1 sums take the token's factor and the W1 scale before the bias and
// activation.
#include <cuda_runtime.h>

#include <type_traits>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/launch_util.hpp"
#include "cuda/engines/mma_stream.cuh"
#include "cuda/moe/device.cuh"
#include "cuda/moe/fp8.cuh"
#include "cuda/moe/moe_cuda.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::activate;
using fmlp::cuda::expert_row_scale;
using fmlp::cuda::Frags;
using fmlp::cuda::from_f;
using fmlp::cuda::ld_stream_v4;
using fmlp::cuda::load_scalar;
using fmlp::cuda::mma_step;
using fmlp::cuda::pipelined;
using fmlp::cuda::prime;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// 32-column steps per load batch, batches in flight, and blocks per multiprocessor: the
// accumulators of more token tiles take the registers the load ring would use (ptxas -v: no
// spills on sm_90a, <= 24 bytes on sm_80).
template <int NT>
struct Pipe {
  static constexpr int kSteps = 1;
  static constexpr int kDepth = NT >= 2 ? 2 : 3;
  static constexpr int kMinBlocks = NT >= 4 ? 1 : 2;
};

// Rows g and g + 8 of a gate group and of its up group, one 16-byte piece per step.
template <int STEPS>
struct GateUpFrags {
  uint4 v[STEPS][4];
};

// Eight x values of token row `row` (nullptr: a padding token) at column col, as WT (FP8: of the
// fp16 staged x).
template <typename WT, bool FP8 = false>
__device__ __forceinline__ uint4 x_piece(const MoeParams& p, const void* row, int col) {
  if (row == nullptr || col >= p.d) return make_uint4(0, 0, 0, 0);
  if (FP8 || p.x_direct)
    return __ldg(reinterpret_cast<const uint4*>(static_cast<const WT*>(row) + col));
  float f[8];
  fmlp::cuda::load8(row, p.x_t, col, p.d, p.x_vec16, f);
  return make_uint4(fmlp::cuda::pack2<WT>(f[0], f[1]), fmlp::cuda::pack2<WT>(f[2], f[3]),
                    fmlp::cuda::pack2<WT>(f[4], f[5]), fmlp::cuda::pack2<WT>(f[6], f[7]));
}

// h of hidden unit `unit` from its layer-1 sums (0 past hidden, so padding never carries NaN).
__device__ __forceinline__ float hidden_value(const MoeParams& p, const void* b1, float gate,
                                              float up, int unit) {
  if (unit >= p.hidden) return 0.f;
  float h = activate(p.act, gate + (b1 ? load_scalar(b1, p.b1_t, unit) : 0.f));
  if (p.gated) h *= up + (b1 ? load_scalar(b1, p.b1_t, p.hidden + unit) : 0.f);
  return h;
}

// The 8 fp16 of a widened e4m3 piece: columns 0-7 (HI false) or 8-15 of its 16.
template <bool HI>
__device__ __forceinline__ uint4 widen_half(const uint4& v) {
  return HI ? fmlp::cuda::widen_e4m3x8(v.z, v.w) : fmlp::cuda::widen_e4m3x8(v.x, v.y);
}

// FP8: WT is __half (the mma type) and the weights are e4m3 bytes.
template <int NT, typename WT, bool FP8>
__global__ void __launch_bounds__(kThreads, Pipe<NT>::kMinBlocks)
    moe_sm80_chunked(const MoeParams p) {
  constexpr int CH = NT * 8, SP = Pipe<NT>::kSteps, DEPTH = Pipe<NT>::kDepth;
  constexpr int SC = FP8 ? 64 : 32, LC = FP8 ? 16 : 8;  // columns per step, per lane's load
  constexpr int HS = FP8 ? kMoeHsStrideF8 : kMoeHsStride;
  using ST = std::conditional_t<FP8, uint8_t, WT>;  // stored weight element
  const int chunk = blockIdx.x, slice = blockIdx.y;
  if (chunk >= p.hdr->chunks) return;  // the grid covers the most chunks any routing can give
  extern __shared__ __align__(16) unsigned char smem[];
  WT* hs = reinterpret_cast<WT*>(smem);                       // [CH][HS]
  float* h32 = reinterpret_cast<float*>(smem + CH * HS * 2);  // FP8: [CH][kMoeH32Stride]
  float* res = reinterpret_cast<float*>(smem + CH * HS * 2 +
                                        (FP8 ? CH * kMoeH32Stride * 4 : 0));  // [2][w][CH]
  // FP8: per chunk row, x's factor, h's factor and h's largest finite |value| (as bits).
  float* xinv = res + 2 * kMoeResRows * CH;
  float* hinv = xinv + CH;
  unsigned* hmax = reinterpret_cast<unsigned*>(hinv + CH);
  __shared__ int slot_of[CH];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int e = p.chunk_expert[chunk], start = p.chunk_start[chunk], len = p.chunk_len[chunk];
  for (int i = threadIdx.x; i < CH; i += kThreads) {
    slot_of[i] = i < len ? p.perm[start + i] : -1;
    if constexpr (FP8) xinv[i] = i < len ? p.xinv[slot_of[i] / p.top_k] : 0.f;
  }
  const ST* w1 = static_cast<const ST*>(p.w1) + int64_t(e) * p.w1_e;
  const ST* w2 = static_cast<const ST*>(p.w2) + int64_t(e) * p.w2_e;
  const void* b1 = fmlp::cuda::expert_vec(p.b1, p.b1_t, p.b1_e, e);
  const int tile0 = int(int64_t(p.tiles) * slice / p.slices);
  const int tile1 = int(int64_t(p.tiles) * (slice + 1) / p.slices);
  __syncthreads();
  const void* xr[NT];  // this lane's B-fragment token rows
  const size_t xs = p.x_t == FMLP_DTYPE_F32 ? 4 : 2;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int sl = slot_of[nt * 8 + g];
    if constexpr (FP8)
      xr[nt] = sl >= 0 ? p.xh + int64_t(sl / p.top_k) * p.d : nullptr;
    else
      xr[nt] =
          sl >= 0 ? static_cast<const char*>(p.x) + int64_t(sl / p.top_k) * p.x_ld * xs : nullptr;
  }
  const int steps1 = (p.d + SC - 1) / SC, ogs = (p.d_out + 15) / 16;
  // h of hidden unit u0 + lu for chunk row m from its layer-1 sums (FP8: scaled first).
  auto h_of = [&](float gate, float up, int u0, int lu, int m) {
    const int unit = u0 + lu;
    if constexpr (FP8) {
      if (unit < p.hidden) {
        gate *= xinv[m] * expert_row_scale(p.s1, p.s1_e, p.s1_r, e, unit);
        if (p.gated) up *= xinv[m] * expert_row_scale(p.s1, p.s1_e, p.s1_r, e, p.hidden + unit);
      }
    }
    return hidden_value(p, b1, gate, up, unit);
  };

  for (int q0 = tile0; q0 < tile1; q0 += kMoeSubTiles) {
    const int G = min(tile1, q0 + kMoeSubTiles) - q0, u0 = q0 * 16, w = G * 16;
    const int w32 = (w + SC - 1) / SC * SC;  // FP8: a multiple of 64
    const int parts = G >= kWarps ? 1 : min(kWarps / G, steps1);
    if constexpr (FP8) {
      for (int i = threadIdx.x; i < CH; i += kThreads) hmax[i] = 0;
    } else {
      for (int i = threadIdx.x; i < CH * (w32 - w); i += kThreads)
        hs[(i / (w32 - w)) * kMoeHsStride + w + i % (w32 - w)] = from_f<WT>(0.f);
    }
    __syncthreads();

    // Layer 1.
    for (int item = warp; item < G * parts; item += kWarps) {
      const int grp = item / parts, part = item % parts;
      const int st0 = steps1 * part / parts, st1 = steps1 * (part + 1) / parts;
      const int unit = u0 + grp * 16 + g;
      // Rows past hidden repeat the last row: valid loads whose results are dropped.
      const int r0 = min(unit, p.hidden - 1), r8 = min(unit + 8, p.hidden - 1);
      const ST* rg = w1 + int64_t(r0) * p.w1_ld;
      const ST* rg8 = w1 + int64_t(r8) * p.w1_ld;
      const ST* ru = w1 + int64_t(p.hidden + r0) * p.w1_ld;
      const ST* ru8 = w1 + int64_t(p.hidden + r8) * p.w1_ld;
      float cg[NT][4] = {}, cu[NT][4] = {};
      auto load = [&](GateUpFrags<SP>& f, int b) {
#pragma unroll
        for (int s = 0; s < SP; ++s) {
          const int step = st0 + b * SP + s, col = step * SC + LC * t;
          const bool in = step < st1 && col < p.d;
          const uint4 z = make_uint4(0, 0, 0, 0);
          f.v[s][0] = in ? ld_stream_v4(rg + col) : z;
          f.v[s][1] = in ? ld_stream_v4(rg8 + col) : z;
          f.v[s][2] = in && p.gated ? ld_stream_v4(ru + col) : z;
          f.v[s][3] = in && p.gated ? ld_stream_v4(ru8 + col) : z;
        }
      };
      auto body = [&](const GateUpFrags<SP>& f, int b) {
#pragma unroll
        for (int s = 0; s < SP; ++s) {
          const int step = st0 + b * SP + s, col = step * SC + LC * t;
          if (step >= st1) break;
          if constexpr (FP8) {
            const uint4 g0 = widen_half<false>(f.v[s][0]), g1 = widen_half<true>(f.v[s][0]);
            const uint4 g80 = widen_half<false>(f.v[s][1]), g81 = widen_half<true>(f.v[s][1]);
            uint4 q0 = {}, q1 = {}, q80 = {}, q81 = {};  // the up rows
            if (p.gated) {
              q0 = widen_half<false>(f.v[s][2]), q1 = widen_half<true>(f.v[s][2]);
              q80 = widen_half<false>(f.v[s][3]), q81 = widen_half<true>(f.v[s][3]);
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint4 x0 = x_piece<WT, true>(p, xr[nt], col);
              const uint4 x1 = x_piece<WT, true>(p, xr[nt], col + 8);
              mma_step<WT>(cg[nt], g0, g80, x0);
              mma_step<WT>(cg[nt], g1, g81, x1);
              if (p.gated) {
                mma_step<WT>(cu[nt], q0, q80, x0);
                mma_step<WT>(cu[nt], q1, q81, x1);
              }
            }
          } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint4 xb = x_piece<WT>(p, xr[nt], col);
              mma_step<WT>(cg[nt], f.v[s][0], f.v[s][1], xb);
              if (p.gated) mma_step<WT>(cu[nt], f.v[s][2], f.v[s][3], xb);
            }
          }
        }
      };
      const int batches = (st1 - st0 + SP - 1) / SP;
      GateUpFrags<SP> ring[DEPTH];
      prime(batches, ring, load);
      pipelined<DEPTH>(batches, ring, load, body);
      if (parts == 1) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int lu = grp * 16 + g + (i >= 2 ? 8 : 0), m = nt * 8 + 2 * t + (i & 1);
            if constexpr (FP8)
              h32[m * kMoeH32Stride + lu] = h_of(cg[nt][i], cu[nt][i], u0, lu, m);
            else
              hs[m * kMoeHsStride + lu] =
                  from_f<WT>(hidden_value(p, b1, cg[nt][i], cu[nt][i], u0 + lu));
          }
        continue;
      }
      // The K parts are summed in part order (part 0 stores, the others add after it), never
      // with atomics, so reruns are bitwise equal. Here G * parts <= kWarps: every warp holds
      // at most one item and warps 0 .. G * parts - 1 are exactly the ones meeting the barrier.
      for (int pp = 0; pp < parts; ++pp) {
        if (part == pp) {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int lu = grp * 16 + g + (i >= 2 ? 8 : 0), m = nt * 8 + 2 * t + (i & 1);
              float* sg = res + lu * CH + m;
              float* su = res + (w + lu) * CH + m;
              *sg = pp ? *sg + cg[nt][i] : cg[nt][i];
              if (p.gated) *su = pp ? *su + cu[nt][i] : cu[nt][i];
            }
        }
        asm volatile("bar.sync 1, %0;" ::"r"(G * parts * 32) : "memory");
      }
    }
    if (parts > 1) {
      __syncthreads();
      for (int i = threadIdx.x; i < w * CH; i += kThreads) {
        const int lu = i / CH, m = i % CH;
        if constexpr (FP8)
          h32[m * kMoeH32Stride + lu] = h_of(res[i], p.gated ? res[w * CH + i] : 0.f, u0, lu, m);
        else
          hs[m * kMoeHsStride + lu] =
              from_f<WT>(hidden_value(p, b1, res[i], p.gated ? res[w * CH + i] : 0.f, u0 + lu));
      }
    }
    if constexpr (FP8) {  // h as fp16 times each row's power of two (zeros from w to w32)
      __syncthreads();
      for (int i = threadIdx.x; i < CH * w; i += kThreads) {
        const float v = fabsf(h32[(i / w) * kMoeH32Stride + i % w]);
        if (v <= 3.4e38f && v > 0.f) atomicMax(hmax + i / w, __float_as_uint(v));
      }
      __syncthreads();
      for (int i = threadIdx.x; i < CH * w32; i += kThreads) {
        const int m = i / w32, lu = i % w32, shift = fmlp::cuda::pow2_shift_to(hmax[m], 15);
        if (lu == 0) hinv[m] = ldexpf(1.f, -shift);
        hs[m * HS + lu] =
            __float2half_rn(lu < w ? h32[m * kMoeH32Stride + lu] * ldexpf(1.f, shift) : 0.f);
      }
    }

    // Layer 2: this warp's output groups og = warp, warp + 8, ..., each over the sub-slice.
    const int steps2 = w32 / SC, batches2 = (steps2 + SP - 1) / SP;
    const int my_ogs = ogs > warp ? (ogs - warp + kWarps - 1) / kWarps : 0;
    auto load2 = [&](Frags<SP>& f, int q) {
      const int o = (warp + (q / batches2) * kWarps) * 16 + g, b = q % batches2;
      const ST* row = w2 + int64_t(min(o, p.d_out - 1)) * p.w2_ld + u0;
      const ST* row8 = w2 + int64_t(min(o + 8, p.d_out - 1)) * p.w2_ld + u0;
#pragma unroll
      for (int s = 0; s < SP; ++s) {
        const int lc = (b * SP + s) * SC + LC * t;
        const bool in = lc < w && u0 + lc < p.hidden;
        f.v[s][0] = in ? ld_stream_v4(row + lc) : make_uint4(0, 0, 0, 0);
        f.v[s][1] = in ? ld_stream_v4(row8 + lc) : make_uint4(0, 0, 0, 0);
      }
    };
    Frags<SP> ring2[DEPTH];
    prime(my_ogs * batches2, ring2, load2);  // independent of h: in flight across the barrier
    __syncthreads();
    float c2[NT][4] = {};
    auto body2 = [&](const Frags<SP>& f, int q) {
      const int b = q % batches2;
#pragma unroll
      for (int s = 0; s < SP; ++s) {
        const int step = b * SP + s, lc = step * SC + LC * t;
        if (step >= steps2) break;
        if constexpr (FP8) {
          const uint4 a0 = widen_half<false>(f.v[s][0]), a1 = widen_half<true>(f.v[s][0]);
          const uint4 a80 = widen_half<false>(f.v[s][1]), a81 = widen_half<true>(f.v[s][1]);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const WT* hr = hs + (nt * 8 + g) * HS + lc;
            mma_step<WT>(c2[nt], a0, a80, *reinterpret_cast<const uint4*>(hr));
            mma_step<WT>(c2[nt], a1, a81, *reinterpret_cast<const uint4*>(hr + 8));
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            mma_step<WT>(c2[nt], f.v[s][0], f.v[s][1],
                         *reinterpret_cast<const uint4*>(hs + (nt * 8 + g) * kMoeHsStride + lc));
        }
      }
      if (b != batches2 - 1) return;
      const int og = warp + (q / batches2) * kWarps;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int o = og * 16 + g + (i >= 2 ? 8 : 0), m = nt * 8 + 2 * t + (i & 1);
          if (o < p.d_out && m < len) {
            const int sl = slot_of[m];
            float v = c2[nt][i];
            if constexpr (FP8) v *= hinv[m] * expert_row_scale(p.s2, p.s2_e, p.s2_r, e, o);
            if (p.partial)  // this block alone writes these elements
              p.out[(int64_t(slice) * p.slots + sl) * p.d_out + o] += v;
            else
              fmlp::cuda::red_add_f32(p.out + int64_t(sl) * p.d_out + o, v);
          }
          c2[nt][i] = 0.f;
        }
    };
    pipelined<DEPTH>(my_ogs * batches2, ring2, load2, body2);
    __syncthreads();  // h is rewritten by the next sub-slice
  }
}

template <int NT, typename WT, bool FP8>
fmlp_status_t launch(const MoeParams& p, cudaStream_t s) {
  constexpr auto kernel = &moe_sm80_chunked<NT, WT, FP8>;
  if (const fmlp_status_t st = allow_dynamic_smem<kernel>(p.experts_smem, "moe_sm80_chunked");
      st != FMLP_SUCCESS)
    return st;
  const dim3 grid(unsigned(p.max_chunks), unsigned(p.slices));
  kernel<<<grid, kThreads, p.experts_smem, s>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fail(FMLP_ERROR_CUDA, "moe_sm80_chunked launch ({} x {} blocks) failed: {}",
                p.max_chunks, p.slices, cudaGetErrorString(e));
  return FMLP_SUCCESS;
}

template <typename WT, bool FP8 = false>
fmlp_status_t dispatch(const MoeParams& p, cudaStream_t s) {
  switch (p.chunk) {
    case 8: return launch<1, WT, FP8>(p, s);
    case 16: return launch<2, WT, FP8>(p, s);
    case 32: return launch<4, WT, FP8>(p, s);
    default: return launch<8, WT, FP8>(p, s);
  }
}

}  // namespace

fmlp_status_t moe_launch_experts(const MoeParams& p, cudaStream_t s) {
  if (p.w_t == FMLP_DTYPE_F8_E4M3) return dispatch<__half, true>(p, s);
  return p.w_t == FMLP_DTYPE_F16 ? dispatch<__half>(p, s) : dispatch<__nv_bfloat16>(p, s);
}

}  // namespace fmlp::detail
