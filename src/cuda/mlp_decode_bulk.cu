// mlp_decode_sm90_bulk: the whole MLP of up to four tokens in one launch, its weights streamed by
// bulk asynchronous copies into a ring of shared-memory stages.
//
// At M <= 4 the MLP is a weight stream, and reaching the copy bandwidth takes tens of KB in flight
// per multiprocessor at every moment. The register-stream kernels hold their loads in registers,
// so the bytes in flight dip whenever warps compute, reduce or change phase (ncu, llama3-8b M = 1:
// 54 % of DRAM peak, against 83 % for cuBLASLt's TMA-fed GEMV). Here one producer warp keeps a
// ring of ~190 KB of stages full with cp.async.bulk copies that complete on mbarriers, and eight
// consumer warps compute from shared memory. The producer runs ahead across the phase change, so
// the first W2 stages are in flight while the hidden slice is being finished.
//
// Work split as in mlp_decode_sm80_gemv: one block per multiprocessor owns a contiguous slice of
// whole 8-unit tiles of the hidden dimension (8 units = one 16-byte piece of a W2 row).
//   phase 1: stages of R hidden units (gated: the R gate rows, then the R up rows; one bulk copy
//            per row, so any 16-byte-aligned row stride works). Consumers dot every row with the
//            staged tokens (fp32, normalised) and add the row sums into shared memory; then
//            h = act(gate + bg) [* (up + bu)] for the slice, kept in shared memory only.
//   phase 2: stages of Q rows of W2, each row's piece the block's slice of columns (one bulk copy
//            per row). Groups of lanes take a row, multiply by h and add into the fp32 workspace
//            with red.global. Each block starts at a different stage of rows and wraps around, so
//            the blocks' adds spread over the output instead of queueing on the same addresses.
//   finish:  the last block to finish adds b2 and the residual, writes y and re-zeroes the
//            workspace (so the next call or a graph replay needs no memset), its loads batched.
//            One fence per thread at the end: a fence per stage waits for that stage's adds to
//            drain and stalled the consumers (measured: 3x slower).
// Not deterministic (atomic reduction order); deterministic mode goes to the splitk kernel.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/decode_common.cuh"
#include "cuda/device_scope.hpp"
#include "cuda/launch_util.hpp"
#include "cuda/mlp_decode.cuh"

namespace fmlp::detail {
namespace {

using fmlp::cuda::activate;
using fmlp::cuda::load_scalar;
using fmlp::cuda::opt;
using fmlp::cuda::red_add_f32;
using fmlp::cuda::stage_tokens;
using fmlp::cuda::store_scalar;
using fmlp::cuda::warp_sum;
using fmlp::cuda::widen8;

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kThreads = kConsumers + 32;  // + one producer warp
constexpr int kMaxTokens = 4;              // FMAs per weight grow with M; beyond, tensor cores
constexpr int kTile = 8;
constexpr int kMaxRows = 8;              // rows per phase-1 stage (per-row sums in registers)
constexpr int kStageTarget = 32 * 1024;  // bytes per stage: few, long copies per stage
constexpr int kMaxStages = 12;
constexpr int kMinStages = 3;
constexpr int kStaticSmem = 512;  // >= the mbarriers and the token-staging scratch (256 B)

struct BulkParams : fmlp::cuda::DecodeOperands {
  float* acc;         // [m, n] fp32 accumulators, zero between calls
  unsigned* counter;  // blocks done, zero between calls
  int units;          // R: hidden units per phase-1 stage
  int rows2;          // Q: W2 rows per phase-2 stage
  int stage_bytes;    // ring slot size, a multiple of 128
  int stages;         // ring depth
  int max_slice;      // the largest hidden slice of any block (shared-memory layout)
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
// Arrives (the producer's one arrival) and announces the bytes the stage's copies will deliver.
__device__ __forceinline__ void mbar_arrive_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile(
      "{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" ::"r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n"
      "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "\t@!p bra WAIT;\n\t}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src)
               : "memory");
}
// One pending arrival on `bar` now, performed when this thread's earlier cp.async copies land.
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// The consumer warps only: the producer never waits on them outside the ring.
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}
#endif

template <int M, typename WT, bool GATED>
__global__ void __launch_bounds__(kThreads, 1) mlp_decode_sm90_bulk(const BulkParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ float scratch[kThreads / 32];
  constexpr int kRowsPerUnit = GATED ? 2 : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tiles = p.h / kTile;
  const int t0 = int(int64_t(tiles) * blockIdx.x / gridDim.x);
  const int t1 = int(int64_t(tiles) * (blockIdx.x + 1) / gridDim.x);
  const int h0 = t0 * kTile, slice = (t1 - t0) * kTile;
  const int S = p.stages, R = p.units, Q = p.rows2;
  const int items1 = (slice + R - 1) / R, items2 = (p.n + Q - 1) / Q;
  const int first2 = int(int64_t(items2) * blockIdx.x / gridDim.x);  // this block's first W2 stage
  const unsigned row_bytes = unsigned(p.k) * 2, run_bytes = unsigned(slice) * 2;
  const int nv2 = slice / 8;  // 16-byte pieces of a W2 row's slice

  unsigned char* ring = smem;
  float* xs = reinterpret_cast<float*>(smem + size_t(S) * p.stage_bytes);  // [M, k]
  float* hs = xs + M * p.k;                                                // [M, max_slice]
  float* dots = hs + M * p.max_slice;  // [M, max_slice, 2]: gate (or dense) and up row sums

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], kConsumerWarps);
    asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::
                     : "memory");
  }
  for (int i = threadIdx.x; i < M * p.max_slice * 2; i += kThreads) dots[i] = 0.f;
  __syncthreads();

  const WT* wg = static_cast<const WT*>(p.wg);
  const WT* wu = static_cast<const WT*>(p.wu);
  const WT* w2 = static_cast<const WT*>(p.w2) + h0;
  auto issue = [&](int it) {  // producer warp: the copies of ring item `it`
    const int s = it % S;
    unsigned char* dst = ring + size_t(s) * p.stage_bytes;
    if (it < items1) {
      const int u0 = it * R, nu = min(R, slice - u0), rows = nu * kRowsPerUnit;
      if (lane == 0) mbar_arrive_expect(&full[s], unsigned(rows) * row_bytes);
      __syncwarp();
      for (int r = lane; r < rows; r += 32) {
        const bool up = GATED && r >= nu;
        const int64_t u = h0 + u0 + (up ? r - nu : r);
        const WT* src = up ? wu + u * p.wu_ld : wg + u * p.wg_ld;
        bulk_copy(dst + size_t(r) * row_bytes, src, row_bytes, &full[s]);
      }
    } else {
      // W2 pieces are short (the slice: ~200 bytes a row), too short for one bulk copy each (the
      // per-copy cost dominated, measured): 16-byte cp.async by every lane instead, completion
      // tracked by the same mbarrier (each lane's arrive fires when its own copies have landed).
      const int o0 = ((it - items1 + first2) % items2) * Q, nq = min(Q, p.n - o0);
      const int per_pass = nv2 <= 32 ? 32 / nv2 : 1, lq = nv2 <= 32 ? lane / nv2 : 0;
      const int lv = nv2 <= 32 ? lane % nv2 : lane, vstep = nv2 <= 32 ? nv2 : 32;
      if (lq < per_pass)
        for (int q = lq; q < nq; q += per_pass) {
          const WT* src = w2 + int64_t(o0 + q) * p.w2_ld;
          for (int v = lv; v < nv2; v += vstep)
            cp_async16(dst + size_t(q) * run_bytes + v * 16, src + v * 8);
        }
      cp_async_arrive(&full[s]);
      __syncwarp();
      if (lane == 0) mbar_arrive(&full[s]);
    }
  };

  const int items = items1 + items2;
  if (warp == kConsumerWarps) {
    // The first S stages need no free slot: in flight before the tokens are even staged.
    for (int it = 0; it < min(S, items); ++it) issue(it);
    stage_tokens<kThreads, M>(p, xs, scratch);
    for (int it = S; it < items; ++it) {
      mbar_wait(&empty[it % S], unsigned((it / S - 1) & 1));
      issue(it);
    }
    return;  // nothing after this waits on the producer
  }
  stage_tokens<kThreads, M>(p, xs, scratch);

  const int ct = threadIdx.x;  // 0 .. kConsumers-1
  const int kv = p.k / 8;      // 16-byte pieces per W1 row
  for (int it = 0; it < items1; ++it) {
    const int s = it % S;
    mbar_wait(&full[s], unsigned((it / S) & 1));
    const uint4* st = reinterpret_cast<const uint4*>(ring + size_t(s) * p.stage_bytes);
    const int u0 = it * R, nu = min(R, slice - u0), rows = nu * kRowsPerUnit;
    float a[kMaxRows][M] = {};
    for (int v = ct; v < kv; v += kConsumers) {
      float xv[M][8];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4 lo = *reinterpret_cast<const float4*>(xs + m * p.k + v * 8);
        const float4 hi = *reinterpret_cast<const float4*>(xs + m * p.k + v * 8 + 4);
        xv[m][0] = lo.x, xv[m][1] = lo.y, xv[m][2] = lo.z, xv[m][3] = lo.w;
        xv[m][4] = hi.x, xv[m][5] = hi.y, xv[m][6] = hi.z, xv[m][7] = hi.w;
      }
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r >= rows) break;
        float w[8];
        widen8<WT>(st[r * kv + v], w);
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int e = 0; e < 8; ++e) a[r][m] = fmaf(w[e], xv[m][e], a[r][m]);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);  // the sums below read registers only
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r >= rows) break;
      const bool up = GATED && r >= nu;
      const int j = u0 + (up ? r - nu : r);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float sum = warp_sum(a[r][m]);
        if (lane == 0) atomicAdd(dots + (m * p.max_slice + j) * 2 + (up ? 1 : 0), sum);
      }
    }
  }
  consumers_sync();
  for (int i = ct; i < M * slice; i += kConsumers) {
    const int m = i / slice, j = i % slice, o = (m * p.max_slice + j) * 2;
    float v = activate(p.act, dots[o] + opt(p.bg, p.bg_t, h0 + j, 0.f));
    if constexpr (GATED) v *= dots[o + 1] + opt(p.bu, p.bu_t, h0 + j, 0.f);
    hs[m * p.max_slice + j] = v;
  }
  consumers_sync();

  // Phase 2: groups of G lanes (a power of two covering the row's pieces, at most a warp) per W2
  // row; every lane runs the same iterations so the group shuffles stay warp-uniform.
  const int nv = nv2;
  int G = 1;
  while (G < nv && G < 32) G <<= 1;
  const int groups = kConsumers / G, group = ct / G, gl = ct % G;
  for (int i2 = 0; i2 < items2; ++i2) {
    const int it = items1 + i2, s = it % S;
    mbar_wait(&full[s], unsigned((it / S) & 1));
    const unsigned char* st = ring + size_t(s) * p.stage_bytes;
    const int o0 = ((i2 + first2) % items2) * Q, nq = min(Q, p.n - o0);
    for (int qb = 0; qb < nq; qb += groups) {
      const int q = qb + group;
      float part[M] = {};
      if (q < nq) {
        const uint4* row = reinterpret_cast<const uint4*>(st + size_t(q) * run_bytes);
        for (int v = gl; v < nv; v += G) {
          float w[8];
          widen8<WT>(row[v], w);
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const float4 lo = *reinterpret_cast<const float4*>(hs + m * p.max_slice + v * 8);
            const float4 hi = *reinterpret_cast<const float4*>(hs + m * p.max_slice + v * 8 + 4);
            part[m] += w[0] * lo.x + w[1] * lo.y + w[2] * lo.z + w[3] * lo.w + w[4] * hi.x +
                       w[5] * hi.y + w[6] * hi.z + w[7] * hi.w;
          }
        }
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        for (int off = G / 2; off > 0; off >>= 1)
          part[m] += __shfl_xor_sync(0xffffffffu, part[m], off);
        if (gl == 0 && q < nq) red_add_f32(p.acc + int64_t(m) * p.n + o0 + q, part[m]);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
  }

  __shared__ unsigned is_last;
  __threadfence();
  consumers_sync();
  if (ct == 0) is_last = atomicAdd(p.counter, 1u) == gridDim.x - 1;
  consumers_sync();
  if (!is_last) return;
  __threadfence();
  constexpr int kBatch = 8;  // independent loads in flight per thread
  const int total = M * p.n;
  const size_t es = p.act_t == FMLP_DTYPE_F32 ? 4 : 2;
  for (int base = 0; base < total; base += kBatch * kConsumers) {
    float v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + j * kConsumers + ct;
      v[j] = i < total ? __ldcg(p.acc + i) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + j * kConsumers + ct;
      if (i >= total) break;
      const int m = i / p.n, o = i % p.n;
      p.acc[i] = 0.f;
      float r = v[j] + opt(p.b2, p.b2_t, o, 0.f);
      if (p.res) r += load_scalar(static_cast<const char*>(p.res) + m * p.res_ld * es, p.act_t, o);
      store_scalar(static_cast<char*>(p.y) + m * p.y_ld * es, p.act_t, o, r);
    }
  }
  if (ct == 0) *p.counter = 0;
#endif
}

struct Plan {
  int blocks = 0, units = 0, rows2 = 0, stage_bytes = 0, stages = 0, max_slice = 0;
  size_t smem = 0;
};

Plan plan_for(const MlpDesc& d) {
  Plan pl;
  const int64_t tiles = d.hidden / kTile;
  pl.blocks = int(std::max<int64_t>(1, std::min<int64_t>(tiles, cuda_sm_count(d.device_id))));
  pl.max_slice = int((tiles + pl.blocks - 1) / pl.blocks * kTile);
  const int64_t rows_per_unit = d.gated ? 2 : 1;
  const int64_t unit_bytes = rows_per_unit * d.d_in * 2;
  pl.units = int(std::clamp<int64_t>(kStageTarget / unit_bytes, 1, kMaxRows / rows_per_unit));
  const int64_t stage = std::max<int64_t>(pl.units * unit_bytes, int64_t(pl.max_slice) * 2);
  pl.stage_bytes = int((stage + 127) / 128 * 128);
  pl.rows2 = int(pl.stage_bytes / (int64_t(pl.max_slice) * 2));
  const int64_t fixed = d.m * d.d_in * 4 + 3 * d.m * int64_t(pl.max_slice) * 4;
  const int64_t avail = cuda_max_dynamic_smem(d.device_id, kStaticSmem) - fixed;
  pl.stages = int(std::clamp<int64_t>(avail / pl.stage_bytes, 0, kMaxStages));
  pl.smem = size_t(fixed + int64_t(pl.stages) * pl.stage_bytes);
  return pl;
}

template <int M, typename WT, bool GATED>
fmlp_status_t launch(const BulkParams& p, const Plan& pl, cudaStream_t stream) {
  constexpr auto kernel = &mlp_decode_sm90_bulk<M, WT, GATED>;
  if (const fmlp_status_t st = allow_dynamic_smem<kernel>(pl.smem, "mlp_decode_sm90_bulk");
      st != FMLP_SUCCESS)
    return st;
  kernel<<<pl.blocks, kThreads, pl.smem, stream>>>(p);
  return launch_status("mlp_decode_sm90_bulk");
}

template <typename WT, bool GATED>
fmlp_status_t dispatch_m(const BulkParams& p, const Plan& pl, int m, cudaStream_t s) {
  switch (m) {
    case 1: return launch<1, WT, GATED>(p, pl, s);
    case 2: return launch<2, WT, GATED>(p, pl, s);
    case 3: return launch<3, WT, GATED>(p, pl, s);
    default: return launch<4, WT, GATED>(p, pl, s);
  }
}

template <typename WT>
fmlp_status_t dispatch(const BulkParams& p, const Plan& pl, const MlpDesc& d, cudaStream_t s) {
  return d.gated ? dispatch_m<WT, true>(p, pl, int(d.m), s)
                 : dispatch_m<WT, false>(p, pl, int(d.m), s);
}

}  // namespace

bool mlp_decode_sm90_bulk_supports(const MlpDesc& d, std::string* why) {
  if (!split_hidden_supports(d, kMaxTokens, why)) return false;
  if (d.d_in > (int64_t(1) << 24) || d.hidden > (int64_t(1) << 30) || d.d_out > (int64_t(1) << 30))
    return (*why = "sizes above 2^24 (d_in) or 2^30 need 64-bit indexing", false);
  const Plan pl = plan_for(d);
  if (pl.stages < kMinStages)
    return (*why = fmt::format("M x d_in = {} x {} leaves shared memory for {} stages of {} bytes "
                               "(needs {}); the cluster and splitk kernels take it",
                               d.m, d.d_in, pl.stages, pl.stage_bytes, kMinStages),
            false);
  return true;
}

size_t mlp_decode_sm90_bulk_workspace(const MlpDesc& d) {
  return split_hidden_workspace(d);
}

fmlp_status_t mlp_decode_sm90_bulk_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws,
                                       void* stream) {
  BulkParams p{};
  static_cast<fmlp::cuda::DecodeOperands&>(p) = fmlp::cuda::decode_operands(a, d);
  const Plan pl = plan_for(d);
  split_hidden_scratch(ws, d, &p.acc, &p.counter);
  p.units = pl.units, p.rows2 = pl.rows2, p.stage_bytes = pl.stage_bytes;
  p.stages = pl.stages, p.max_slice = pl.max_slice;

  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  return d.w_dtype == FMLP_DTYPE_F16 ? dispatch<__half>(p, pl, d, s)
                                     : dispatch<__nv_bfloat16>(p, pl, d, s);
}

}  // namespace fmlp::detail
