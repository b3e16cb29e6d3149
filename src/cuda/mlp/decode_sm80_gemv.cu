// mlp_decode_sm80_gemv: the whole MLP of one token in one launch, on the CUDA cores.
//
// At M = 1 the MLP is a pure weight stream: every weight is used for one FMA, so the kernel is
// built for bytes in flight, not for arithmetic. Two blocks of 256 threads per multiprocessor each
// own a contiguous slice of the hidden dimension (whole tiles of 8 units, dealt evenly, so every
// block streams the same number of bytes to within one tile):
//   1. each block normalises the M rows of x into shared memory (fp32; x is small and L2-resident),
//   2. phase 1: each warp takes hidden units of the slice in turn and streams the unit's W1 row
//      (gated: gate and up rows) with 16-byte non-allocating loads, 8 per row in flight per lane,
//      reduces across the warp and writes act(.) [* up] to shared memory: the hidden activations
//      never touch global memory,
//   3. phase 2: the block multiplies its hidden slice by the matching 16-byte-aligned columns of W2
//      (nn.Linear layout, so each W2 row holds the slice contiguously), lanes grouped per row, and
//      adds the partial outputs into an fp32 workspace with red.global.add,
//   4. the last block to finish (a counter in the workspace) adds b2 and the residual, writes y,
//      and re-zeroes the accumulators and the counter, so the next call (or graph replay) needs
//      no memset.
// Deterministic mode goes to the splitk kernel, which reduces in a fixed order.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor_check.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/mlp/entries.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::activate;
using fmlp::cuda::finish_last_block;
using fmlp::cuda::ld_stream_v4;
using fmlp::cuda::opt;
using fmlp::cuda::stage_tokens;
using fmlp::cuda::warp_sum;
using fmlp::cuda::widen8;

// Two blocks per multiprocessor: while one waits at a barrier (phase change, finalisation) the
// other keeps its weight stream going.
constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 2;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTokens = 1;      // beyond one token the tensor-core kernel is faster (measured)
constexpr int kTile = 8;           // hidden units per tile: one 16-byte chunk of a W2 row
constexpr int kRowLoads = 8;       // 16-byte loads in flight per lane per W1 row (x2 when gated)
constexpr int kPhase2Unroll = 16;  // W2 rows in flight per lane

struct GemvParams : fmlp::cuda::DecodeOperands {
  float* acc;         // [m, n] fp32 accumulators, zero between calls
  unsigned* counter;  // blocks done, zero between calls
};

// dot(W row, x_m) for all M tokens, for one row (dense) or the gate and up rows together (gated,
// so both rows' loads are in flight at once); per-lane sums, not yet reduced over the warp.
template <int M, typename WT, bool GATED>
__device__ __forceinline__ void row_dot(const WT* g_row, const WT* u_row, const float* xs, int k,
                                        float (&g)[M], float (&u)[M]) {
  const int lane = threadIdx.x % 32;
  for (int base = lane * 8; base < k; base += 32 * 8 * kRowLoads) {
    uint4 vg[kRowLoads], vu[kRowLoads];
#pragma unroll
    for (int i = 0; i < kRowLoads; ++i) {
      const int c = base + i * 256;
      if (c < k) {
        vg[i] = ld_stream_v4(g_row + c);
        if constexpr (GATED) vu[i] = ld_stream_v4(u_row + c);
      }
    }
#pragma unroll
    for (int i = 0; i < kRowLoads; ++i) {
      const int c = base + i * 256;
      if (c >= k) break;
      float wg[8], wu[8];
      widen8<WT>(vg[i], wg);
      if constexpr (GATED) widen8<WT>(vu[i], wu);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4 a = *reinterpret_cast<const float4*>(xs + m * k + c);
        const float4 b = *reinterpret_cast<const float4*>(xs + m * k + c + 4);
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          g[m] = fmaf(wg[e], xv[e], g[m]);
          if constexpr (GATED) u[m] = fmaf(wu[e], xv[e], u[m]);
        }
      }
    }
  }
}

template <int M, typename WT, bool GATED>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) mlp_decode_sm80_gemv(const GemvParams p) {
  extern __shared__ float smem[];
  __shared__ float scratch[kWarps];
  float* xs = smem;          // [M, k]
  float* hs = xs + M * p.k;  // [M, slice]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tiles = p.h / kTile;
  const int t0 = int(int64_t(tiles) * blockIdx.x / gridDim.x);
  const int t1 = int(int64_t(tiles) * (blockIdx.x + 1) / gridDim.x);
  const int h0 = t0 * kTile, slice = (t1 - t0) * kTile;

  stage_tokens<kThreads, M>(p, xs, scratch);

  // Phase 1: hidden slice -> shared memory.
  for (int j = warp; j < slice; j += kWarps) {
    float g[M] = {}, u[M] = {};
    row_dot<M, WT, GATED>(static_cast<const WT*>(p.wg) + (h0 + j) * p.wg_ld,
                          GATED ? static_cast<const WT*>(p.wu) + (h0 + j) * p.wu_ld : nullptr, xs,
                          p.k, g, u);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float gs = warp_sum(g[m]);
      float v = activate(p.act, gs + opt(p.bg, p.bg_t, h0 + j, 0.f));
      if constexpr (GATED) v *= warp_sum(u[m]) + opt(p.bu, p.bu_t, h0 + j, 0.f);
      if (lane == 0) hs[m * slice + j] = v;
    }
  }

  // Phase 2: lanes form groups of G (a power of two >= the slice's tile count); a group takes one
  // W2 row, each lane a 16-byte chunk of the block's columns. The first batch of W2 loads does not
  // depend on h, so it is issued before the barrier that publishes h.
  const int nt = t1 - t0;
  int G = 1;
  while (G < nt && G < 32) G <<= 1;
  const int groups = kThreads / G, group = threadIdx.x / G, gl = threadIdx.x % G;
  const WT* w2 = static_cast<const WT*>(p.w2) + h0;
  uint4 v[kPhase2Unroll];
  auto load_batch = [&](int o0, int t) {
#pragma unroll
    for (int r = 0; r < kPhase2Unroll; ++r) {
      const int o = o0 + r * groups;
      if (o < p.n && t < nt) v[r] = ld_stream_v4(w2 + o * p.w2_ld + t * kTile);
    }
  };
  load_batch(group, gl);
  __syncthreads();
  bool preloaded = true;
  // The loop bound is the block's, not the group's: the shuffles below name the whole warp, so
  // every lane must run the same iterations. (With per-group bounds the first lanes of a warp ran
  // one iteration more when d_out is not a multiple of the block's stride, e.g. d_out 4104 at two
  // tiles per block, and their full-mask shuffles hung the kernel; compute-sanitizer's synccheck
  // in bench/run_device.sh catches that.)
  for (int ob = 0; ob < p.n; ob += groups * kPhase2Unroll) {
    const int o0 = ob + group;
    float part[kPhase2Unroll][M] = {};
    for (int tb = 0; tb < nt; tb += G) {
      const int t = tb + gl;
      if (!preloaded) load_batch(o0, t);
      preloaded = false;
#pragma unroll
      for (int r = 0; r < kPhase2Unroll; ++r) {
        if (o0 + r * groups >= p.n || t >= nt) continue;
        float w[8];
        widen8<WT>(v[r], w);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float4 a = *reinterpret_cast<const float4*>(hs + m * slice + t * kTile);
          const float4 b = *reinterpret_cast<const float4*>(hs + m * slice + t * kTile + 4);
          part[r][m] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x +
                        w[5] * b.y + w[6] * b.z + w[7] * b.w;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kPhase2Unroll; ++r) {
      const int o = o0 + r * groups;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float s = part[r][m];
        for (int off = G / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (gl == 0 && o < p.n) atomicAdd(p.acc + m * p.n + o, s);
      }
    }
  }

  finish_last_block<kThreads, M>(p, p.acc, p.counter);
}

size_t smem_bytes(const MlpDesc& d, int blocks) {
  const int64_t tiles = d.hidden / kTile;
  const int64_t slice = (tiles + blocks - 1) / blocks * kTile;
  return size_t(d.m * (d.d_in + slice)) * sizeof(float);
}

int blocks_for(const MlpDesc& d) {
  const int64_t tiles = d.hidden / kTile;
  return int(std::max<int64_t>(
      1, std::min<int64_t>(tiles, kBlocksPerSm * int64_t(cuda_sm_count(d.device_id)))));
}

template <int M, typename WT, bool GATED>
fmlp_status_t launch(const GemvParams& p, int blocks, size_t smem, cudaStream_t stream) {
  constexpr auto kernel = &mlp_decode_sm80_gemv<M, WT, GATED>;
  if (const fmlp_status_t st = allow_dynamic_smem<kernel>(smem, "mlp_decode_sm80_gemv");
      st != FMLP_SUCCESS)
    return st;
  kernel<<<blocks, kThreads, smem, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fail(FMLP_ERROR_CUDA, "mlp_decode_sm80_gemv launch failed: {}", cudaGetErrorString(e));
  return FMLP_SUCCESS;
}

template <typename WT>
fmlp_status_t dispatch(const GemvParams& p, const MlpDesc& d, int blocks, size_t smem,
                       cudaStream_t s) {
  return d.gated ? launch<1, WT, true>(p, blocks, smem, s)
                 : launch<1, WT, false>(p, blocks, smem, s);
}

}  // namespace

bool mlp_decode_sm80_gemv_supports(const MlpDesc& d, std::string* why) {
  if (!split_hidden_supports(d, kMaxTokens, why)) return false;
  if (d.d_in > (int64_t(1) << 30) || d.hidden > (int64_t(1) << 30) || d.d_out > (int64_t(1) << 30))
    return (*why = "sizes above 2^30 need 64-bit indexing", false);
  const size_t smem = smem_bytes(d, blocks_for(d));
  if (smem > size_t(cuda_max_dynamic_smem(d.device_id, 1024)))
    return (*why = fmt::format("M x d_in = {} x {} tokens need {} bytes of shared memory, more "
                               "than the device has",
                               d.m, d.d_in, smem),
            false);
  return true;
}

size_t mlp_decode_sm80_gemv_workspace(const MlpDesc& d) {
  return split_hidden_workspace(d);
}

fmlp_status_t mlp_decode_sm80_gemv_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws,
                                       void* stream) {
  GemvParams p{};
  static_cast<fmlp::cuda::DecodeOperands&>(p) = fmlp::cuda::decode_operands(a, d);
  split_hidden_scratch(ws, d, &p.acc, &p.counter);

  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const int blocks = blocks_for(d);
  const size_t smem = smem_bytes(d, blocks);
  auto s = static_cast<cudaStream_t>(stream);
  const fmlp_status_t status = d.w_dtype == FMLP_DTYPE_F16
                                   ? dispatch<__half>(p, d, blocks, smem, s)
                                   : dispatch<__nv_bfloat16>(p, d, blocks, smem, s);
  return status;
}

}  // namespace fmlp::detail
