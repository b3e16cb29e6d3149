// mlp_decode_sm80_prefetch: the whole MLP of up to four tokens in one launch, for MLPs whose
// weights fit in the GPU's shared memory (gpt2-small and -medium, BERT-base: up to ~25 MB on an
// H200).
//
// Such MLPs are latency-bound: at copy bandwidth the 9.4 MB of gpt2-small weights take less time
// than two DRAM round trips plus the launch. The register-stream kernel pays a round trip per phase
// (W2's loads can only start once its registers are free of W1), so here each block (one per
// multiprocessor) issues its entire share of both matrices at entry as 16-byte cp.async copies
// into shared memory: the W1 rows of its hidden slice (one group), then the matching columns of
// W2 (a second group). It stages x while they fly, computes the hidden slice as soon as the W1
// group lands (h never leaves the chip), multiplies it by the W2 columns when those land, and
// adds the partial outputs into an fp32 workspace; the last block to finish writes y
// (finish_last_block). One DRAM latency, the transfer at full bandwidth, one reduction.
// Launched with programmatic dependent launch (sm_90): the weight copies are issued before the
// wait for the previous grid (weights are never written on the stream), so back-to-back calls
// (the layers of a decode step) overlap one call's weight transfer with the previous one's tail;
// x, the accumulators and the counter are touched only after the wait. The partial outputs go out
// as 16-byte reductions where d_out allows (a quarter of the requests on the few accumulator lines
// every block adds into).
#include <cuda_runtime.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/mlp/entries.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::activate;
using fmlp::cuda::cp_async16;
using fmlp::cuda::cp_async_commit;
using fmlp::cuda::cp_async_wait;
using fmlp::cuda::finish_last_block;
using fmlp::cuda::opt;
using fmlp::cuda::pdl_allow_next_grid;
using fmlp::cuda::pdl_wait_previous_grid;
using fmlp::cuda::red_add_f32;
using fmlp::cuda::red_add_v4_f32;
using fmlp::cuda::stage_tokens;
using fmlp::cuda::warp_sum;
using fmlp::cuda::widen8;

constexpr int kThreads = 512;  // one block per multiprocessor: shared memory is the limit
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTokens = 4;  // the hidden slice is recomputed per token; beyond, tensor cores
constexpr int kTile = 8;       // hidden units per tile: one 16-byte chunk of a W2 row

struct PrefetchParams : fmlp::cuda::DecodeOperands {
  float* acc;         // [m, n] fp32 accumulators, zero between calls
  unsigned* counter;  // blocks done, zero between calls
  int units;          // the largest hidden slice of any block: the shared-memory layout's stride
};

template <int M, typename WT, bool GATED>
// Two blocks' registers per multiprocessor where the accumulators allow it (M <= 2: <= 64 registers
// without spills), so the next call's blocks (programmatic dependent launch) can become resident
// and start their weight copies while this call's blocks finish.
__global__ void __launch_bounds__(kThreads, M <= 2 ? 2 : 1)
    mlp_decode_sm80_prefetch(const PrefetchParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float scratch[kWarps];
  const int tiles = p.h / kTile;
  const int t0 = int(int64_t(tiles) * blockIdx.x / gridDim.x);
  const int t1 = int(int64_t(tiles) * (blockIdx.x + 1) / gridDim.x);
  const int h0 = t0 * kTile, slice = (t1 - t0) * kTile;
  // [rows1, k] W1 rows (gated: the slice's gate rows, then its up rows), [n, slice] W2 columns,
  // [M, k] x, [M, slice] h. Every part is a multiple of 16 bytes (k and slice multiples of 8).
  WT* w1s = reinterpret_cast<WT*>(smem_raw);
  WT* w2s = w1s + size_t(GATED ? 2 : 1) * p.units * p.k;
  float* xs = reinterpret_cast<float*>(w2s + size_t(p.n) * p.units);
  float* hs = xs + M * p.k;

  const int kc = p.k / kTile, rows1 = (GATED ? 2 : 1) * slice;
  for (int i = threadIdx.x; i < rows1 * kc; i += kThreads) {
    const int r = i / kc, c = (i % kc) * kTile;
    const WT* src = GATED && r >= slice
                        ? static_cast<const WT*>(p.wu) + int64_t(h0 + r - slice) * p.wu_ld
                        : static_cast<const WT*>(p.wg) + int64_t(h0 + r) * p.wg_ld;
    cp_async16(w1s + size_t(r) * p.k + c, src + c);
  }
  cp_async_commit();
  const int sc = slice / kTile;
  const WT* w2 = static_cast<const WT*>(p.w2) + h0;
  for (int i = threadIdx.x; i < p.n * sc; i += kThreads) {
    const int o = i / sc, c = (i % sc) * kTile;
    cp_async16(w2s + size_t(o) * slice + c, w2 + int64_t(o) * p.w2_ld + c);
  }
  cp_async_commit();

  pdl_wait_previous_grid();
  pdl_allow_next_grid();
  stage_tokens<kThreads, M>(p, xs, scratch);
  cp_async_wait<1>();  // this thread's W1 copies; the barrier publishes everyone's
  __syncthreads();

  // Hidden slice: a warp per unit, lanes across k (consecutive 16-byte chunks: no bank
  // conflicts).
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = warp; j < slice; j += kWarps) {
    float g[M] = {}, u[M] = {};
    const WT* gr = w1s + size_t(j) * p.k;
    const WT* ur = w1s + size_t(slice + j) * p.k;
    for (int c = lane * kTile; c < p.k; c += 32 * kTile) {
      float wg[8], wu[8];
      widen8<WT>(*reinterpret_cast<const uint4*>(gr + c), wg);
      if constexpr (GATED) widen8<WT>(*reinterpret_cast<const uint4*>(ur + c), wu);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4 a = *reinterpret_cast<const float4*>(xs + m * p.k + c);
        const float4 b = *reinterpret_cast<const float4*>(xs + m * p.k + c + 4);
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          g[m] = fmaf(wg[e], xv[e], g[m]);
          if constexpr (GATED) u[m] = fmaf(wu[e], xv[e], u[m]);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = activate(p.act, warp_sum(g[m]) + opt(p.bg, p.bg_t, h0 + j, 0.f));
      if constexpr (GATED) v *= warp_sum(u[m]) + opt(p.bu, p.bu_t, h0 + j, 0.f);
      if (lane == 0) hs[m * slice + j] = v;
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Output partials: a thread per output row, the slice's W2 columns of that row from shared
  // memory (h is read as a broadcast). Every lane runs each round (shuffles below).
  const bool vec4 = p.n % 4 == 0;
  for (int o0 = 0; o0 < p.n; o0 += kThreads) {
    const int o = o0 + int(threadIdx.x);
    float part[M] = {};
    const WT* wr = w2s + size_t(min(o, p.n - 1)) * slice;
    for (int t = 0; t < (o < p.n ? slice : 0); t += kTile) {
      float w[8];
      widen8<WT>(*reinterpret_cast<const uint4*>(wr + t), w);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4 a = *reinterpret_cast<const float4*>(hs + m * slice + t);
        const float4 b = *reinterpret_cast<const float4*>(hs + m * slice + t + 4);
        part[m] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y +
                   w[6] * b.z + w[7] * b.w;
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (vec4) {  // lanes 4i..4i+3 hold outputs o..o+3 (o0 and n are multiples of 4)
        const float b = __shfl_down_sync(0xffffffffu, part[m], 1);
        const float c = __shfl_down_sync(0xffffffffu, part[m], 2);
        const float d = __shfl_down_sync(0xffffffffu, part[m], 3);
        if (lane % 4 == 0 && o < p.n) red_add_v4_f32(p.acc + m * p.n + o, part[m], b, c, d);
      } else if (o < p.n) {
        red_add_f32(p.acc + m * p.n + o, part[m]);
      }
    }
  }
  finish_last_block<kThreads, M>(p, p.acc, p.counter);
}

int blocks_for(const MlpDesc& d) {
  return int(std::max<int64_t>(
      1, std::min<int64_t>(d.hidden / kTile, int64_t(cuda_sm_count(d.device_id)))));
}

int units_for(const MlpDesc& d, int blocks) {
  const int64_t tiles = d.hidden / kTile;
  return int((tiles + blocks - 1) / blocks * kTile);
}

size_t smem_bytes(const MlpDesc& d, int blocks) {
  const size_t u = size_t(units_for(d, blocks)), ws = fmlp::dtype_size(d.w_dtype);
  return ((d.gated ? 2 : 1) * u * size_t(d.d_in) + size_t(d.d_out) * u) * ws +
         size_t(d.m) * (size_t(d.d_in) + u) * sizeof(float);
}

template <int M, typename WT, bool GATED>
fmlp_status_t launch(const PrefetchParams& p, int blocks, size_t smem, bool pdl,
                     cudaStream_t stream) {
  constexpr auto kernel = &mlp_decode_sm80_prefetch<M, WT, GATED>;
  if (const fmlp_status_t st = allow_dynamic_smem<kernel>(smem, "mlp_decode_sm80_prefetch");
      st != FMLP_SUCCESS)
    return st;
  return launch_ex(kernel, dim3(blocks), dim3(kThreads), smem, pdl, stream,
                   "mlp_decode_sm80_prefetch", p);
}

template <int M, typename WT>
fmlp_status_t launch_m(const PrefetchParams& p, const MlpDesc& d, int blocks, size_t smem,
                       cudaStream_t s) {
  const bool pdl = pdl_enabled(cuda_compute_capability(d.device_id));
  return d.gated ? launch<M, WT, true>(p, blocks, smem, pdl, s)
                 : launch<M, WT, false>(p, blocks, smem, pdl, s);
}

template <typename WT>
fmlp_status_t dispatch(const PrefetchParams& p, const MlpDesc& d, int blocks, size_t smem,
                       cudaStream_t s) {
  switch (d.m) {
    case 1: return launch_m<1, WT>(p, d, blocks, smem, s);
    case 2: return launch_m<2, WT>(p, d, blocks, smem, s);
    case 3: return launch_m<3, WT>(p, d, blocks, smem, s);
    default: return launch_m<4, WT>(p, d, blocks, smem, s);
  }
}

}  // namespace

bool mlp_decode_sm80_prefetch_supports(const MlpDesc& d, std::string* why) {
  if (!split_hidden_supports(d, kMaxTokens, why)) return false;
  if (d.d_in > (int64_t(1) << 24) || d.hidden > (int64_t(1) << 24) || d.d_out > (int64_t(1) << 24))
    return (*why = "sizes above 2^24 do not fit in shared memory", false);
  const size_t smem = smem_bytes(d, blocks_for(d));
  const int limit = cuda_max_dynamic_smem(d.device_id, 1024);
  if (smem > size_t(limit))
    return (*why = fmt::format("the weights need {} KiB of shared memory per block, more than the "
                               "{} KiB a block can have; the streaming kernels take this shape",
                               smem / 1024, limit / 1024),
            false);
  return true;
}

size_t mlp_decode_sm80_prefetch_workspace(const MlpDesc& d) {
  return split_hidden_workspace(d);
}

fmlp_status_t mlp_decode_sm80_prefetch_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws,
                                           void* stream) {
  PrefetchParams p{};
  static_cast<fmlp::cuda::DecodeOperands&>(p) = fmlp::cuda::decode_operands(a, d);
  split_hidden_scratch(ws, d, &p.acc, &p.counter);

  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const int blocks = blocks_for(d);
  p.units = units_for(d, blocks);
  const size_t smem = smem_bytes(d, blocks);
  auto s = static_cast<cudaStream_t>(stream);
  return d.w_dtype == FMLP_DTYPE_F16 ? dispatch<__half>(p, d, blocks, smem, s)
                                     : dispatch<__nv_bfloat16>(p, d, blocks, smem, s);
}

}  // namespace fmlp::detail
