// The fp8 weight stream on Hopper's tensor cores, shared by linear_sm90_wgmma_fp8
// (linear/sm90_wgmma_fp8.cu) and mlp_decode_sm90_wgmma_fp8 (mlp/decode_sm90_wgmma_fp8.cu): y_row =
// W_row . x for up to four tokens, W (e4m3) read once by TMA and multiplied by wgmma without
// widening it.
//
// Why: the CUDA-core fp8 streams (stream_gemv.cuh) convert e4m3 -> fp16 (8 per 16 bytes of W),
// work that keeps them above the weights' read time; wgmma multiplies e4m3 directly
// (m64n8k32), so the only per-weight work is the tensor cores'.
// Its B operand must be e4m3 too, so each token's x (bf16/fp16) is split exactly into two e4m3
// parts, hi = e4m3(x 2^e) and lo = e4m3(x 2^e - hi), 2^e a power of two per token and k slice that
// puts the slice's largest finite |x| in [2^7, 2^8): hi + lo keeps 8 significant bits (all of bf16;
// fp16 x is rounded to bf16's precision, as the tolerance policy allows), values under 2^-10 of the
// slice's largest lose bits below 2^-18 of it. B's 8 columns are (hi, lo) of tokens 0..3, so a
// thread's accumulator pair is one token's two parts of one row.
//
// Layout of the work: tiles of 64 W rows (wgmma's M) x k slices; block (slice s, r) of the grid
// (slices x per_slice blocks, one per SM, sized on the host by wg_shape) stages x's slice s once
// and walks tiles r, r + per_slice, ...; concurrent blocks cover consecutive rows, so the bytes in
// flight stay one window sliding through W. Per block: a producer thread (TMA copies of 64 x
// 128-byte boxes, 128-byte swizzle, into kWgStages stages of 16 KiB; rows past n and k past K
// arrive as zeros), a consumer warpgroup (wgmma per stage into fresh accumulators, two stages in
// the tensor pipe, added into fp32 registers: the tensor cores' fp8 accumulation keeps fewer bits
// than fp32, so it never spans more than 256 products) and a signaller thread. A tile's part goes
// to the workspace; for a split tile the signaller bumps the tile's counter with a gpu-scope
// release, so the consumers never wait for that fence; the slice-0 block of each tile finishes
// its tiles after its stream, all together, adding the parts in slice order (deterministic),
// re-zeroing them and the counters (the workspace contract) and running the caller's epilogue.
//
// Status: correct on every test, not faster than the CUDA-core entries at M = 1 (per-row
// scales), so the planners take it only when forced (FMLP_LINEAR_KERNEL, or
// fusedmlp_ops_bench --only linear against the default; docs/linear-softmax.md has the
// analysis): the TMA stream alone, without wgmma and epilogue, reaches only 80-85 % of the copy
// bandwidth (64-row boxes put 64 DRAM pages in every request batch), and a per-tile fence and
// atomic on the consumers' path cost more than the stream, hence the signaller thread and the
// deferred finish.
// Non-finite x: NaN becomes an e4m3 NaN (the token's outputs are NaN, as in the reference); +-Inf
// cannot be an e4m3 value, so it is staged as 0 and its products w * Inf are added in fp32 in the
// epilogue of a tile whose slice holds one (rare: a slow loop over the slice).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/sm90/async.cuh"

namespace fmlp::cuda {

constexpr int kWgTileRows = 64;                     // wgmma M: W rows per tile
constexpr int kWgBoxK = 128;                        // k bytes per TMA box (one swizzle row)
constexpr int kWgBoxBytes = kWgTileRows * kWgBoxK;  // 8 KiB
// 6 stages of 16 KiB (two boxes): of the five pipeline shapes measured on an H200 (2 x 4, 2 x 6,
// 4 x 3, 4 x 4 and 8 x 3 boxes x stages), the best or within 3 % on the four fp8 linear shapes.
constexpr int kWgStageBoxes = 2;
constexpr int kWgStages = 6;
constexpr int kWgStageBytes = kWgStageBoxes * kWgBoxBytes;
constexpr int kWgConsumers = 128;                          // one consumer warpgroup
constexpr int kWgThreads = kWgConsumers + 32;              // + the producer warp
constexpr int kWgMaxTokens = 4;                            // B's 8 columns: (hi, lo) per token
constexpr int kWgMaxSliceK = 2048;                         // B: 8 rows x 2 KiB of a block's slice
constexpr int kWgPartFloats = kWgMaxTokens * kWgTileRows;  // a tile's partial per matrix

// The partition of one stream: nw weight matrices of [n, k] e4m3 read together (the gated MLP's
// gate and up), computed on the host by wg_shape.
struct WgShape {
  int n, k;
  int stage_k;       // k per stage: 256 for one matrix, 128 for two
  int tiles;         // ceil(n / 64)
  int kstages;       // ceil(k / stage_k)
  int slices;        // k slices, one per block; every slice holds >= 1 stage
  int slice_stages;  // stages per slice (the last may hold fewer)
  int per_slice;     // blocks per slice: the grid is slices * per_slice
};

// Slices and blocks for at most `sms` blocks (one per SM): the fewest stages on the busiest
// block, counting a tile's epilogue as half a stage, ties to fewer slices (fewer partials).
inline WgShape wg_shape(int64_t n, int64_t k, int nw, int sms) {
  WgShape s{};
  s.n = int(n);
  s.k = int(k);
  s.stage_k = kWgStageBoxes * kWgBoxK / nw;
  s.tiles = int((n + kWgTileRows - 1) / kWgTileRows);
  s.kstages = int((k + s.stage_k - 1) / s.stage_k);
  const int max_slice_stages = kWgMaxSliceK / s.stage_k;
  double best = 1e300;
  for (int want = 1; want <= std::min(s.kstages, std::max(1, sms)); ++want) {
    const int ss = (s.kstages + want - 1) / want;
    if (ss > max_slice_stages) continue;
    const int slices = (s.kstages + ss - 1) / ss;  // every slice non-empty
    if (slices != want) continue;
    const int per_slice = std::max(1, std::min(s.tiles, std::max(1, sms) / slices));
    const int rounds = (s.tiles + per_slice - 1) / per_slice;
    const double cost = rounds * (ss + 0.5);
    if (cost < best - 1e-9) {
      best = cost;
      s.slices = slices;
      s.slice_stages = ss;
      s.per_slice = per_slice;
    }
  }
  return s;
}

inline int wg_grid(const WgShape& s) {
  return s.slices * s.per_slice;
}

// Dynamic shared memory of a block: 1024 for aligning the swizzle atoms, the stages, B (8 rows of
// the slice), the full and empty barriers.
inline size_t wg_smem_bytes(const WgShape& s) {
  return 1024 + size_t(kWgStages) * kWgStageBytes + size_t(s.slice_stages) * s.stage_k * 8 +
         2 * kWgStages * sizeof(uint64_t);
}

// Workspace: partials [tiles][slices][nw][kWgPartFloats] fp32 and a counter per tile (none with
// one slice); zero between calls.
inline size_t wg_partial_bytes(const WgShape& s, int nw) {
  return size_t(s.tiles) * s.slices * nw * kWgPartFloats * sizeof(float);
}
inline size_t wg_counter_bytes(const WgShape& s) {
  return s.slices > 1 ? size_t(s.tiles) * sizeof(unsigned) : 0;
}

// Whether wg_shape found a partition: K >= 1 cut into at most one slice per SM of at most
// kWgMaxSliceK (B's shared memory); *why (never null) says what to use instead otherwise.
inline bool wg_shape_ok(const WgShape& s, const char* kernel, std::string* why) {
  if (s.slices > 0) return true;
  *why = fmt::format(
      "{}: K={} cannot be cut into slices of at most {} over the SMs' blocks; the "
      "CUDA-core fp8 entries take it",
      kernel, s.k, kWgMaxSliceK);
  return false;
}

// What every user of the stream needs from the device: sm_90a, the driver's tensor-map encoder and
// `smem` bytes of shared memory per block; *why (never null) names `kernel` and the lack.
inline bool wg_device_supports(const char* kernel, int device, size_t smem, std::string* why) {
  if (const int cc = fmlp::detail::cuda_compute_capability(device); cc != 90)
    return (*why = fmt::format("{} is sm_90a code (TMA, fp8 wgmma); cuda:{} has compute "
                               "capability {}.{}",
                               kernel, device, cc / 10, cc % 10),
            false);
  if (sm90::encode_tiled() == nullptr)
    return (*why = fmt::format("{}: the driver has no cuTensorMapEncodeTiled", kernel), false);
  if (const int have = fmlp::detail::cuda_max_dynamic_smem(device, 0); size_t(have) < smem)
    return (*why = fmt::format("{} needs {} bytes of shared memory per block; cuda:{} offers {}",
                               kernel, smem, device, have),
            false);
  return true;
}

// The tensor map of an [n, k] e4m3 matrix with a row stride of `ld` bytes (a multiple of 16 when
// n > 1, base 16-byte aligned), read in 64-row x 128-byte boxes with 128-byte swizzle, zeros
// outside.
inline fmlp_status_t wg_make_map(CUtensorMap* map, const char* kernel, const char* what,
                                 const void* p, int64_t n, int64_t k, int64_t ld) {
  // A single row's stride is never used, but TMA wants one: a multiple of 16 covering the row.
  const int64_t stride = n > 1 ? ld : (std::max<int64_t>(k, 1) + 15) / 16 * 16;
  return sm90::make_tma_map_2d(map, kernel, what, CU_TENSOR_MAP_DATA_TYPE_UINT8, p, n, k, stride,
                               kWgBoxK, kWgTileRows);
}

#ifdef FMLP_SM90A

// The four consumer warps' barrier (the producer warp never joins: it may have left).
__device__ __forceinline__ void wg_consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kWgConsumers) : "memory");
}

// Two floats as packed e4m3 (lo in the low byte), round to nearest, NaN kept.
__device__ __forceinline__ uint32_t wg_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// The e4m3 pair's values (low byte first).
__device__ __forceinline__ float2 wg_e4m3x2_value(uint32_t v) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(uint16_t(v)));
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

__device__ __forceinline__ float wg_e4m3_value(uint8_t v) {
  return wg_e4m3x2_value(v).x;
}

// d[64 x 8] (+)= A[64 x 32] B[8 x 32]^T, e4m3 operands K-major in shared memory; scale_d = 0
// starts the accumulation.
__device__ __forceinline__ void wg_mma_m64n8k32(float (&d)[4], uint64_t da, uint64_t db,
                                                int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wg_fence_acc(float (&d)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The stream. OP supplies (device side):
//   int m;                                 tokens (1..4)
//   void prepare();                        after the previous grid: per-call setup of the
//                                          consumers (norm statistics; may wg_consumer_sync)
//   float x(int t, int j);                 token t's staged input j < k, rounded as the model
//                                          would (a 16-bit value)
//   const uint8_t* w(int q, int row);      row `row` of matrix q (for the Inf fixup)
//   void finish(int row, int t, const float (&v)[NW]);   the epilogue of row < n, token t < m:
//                                          v[q] = W_q[row] . x_t (before W's scales)
//   void done();                           each consumer thread, after its last epilogue
// Every thread of the block calls it; maps[q] is matrix q's tensor map (64 x 128-byte boxes).
template <int NW, typename OP>
__device__ __forceinline__ void wg_stream(const CUtensorMap* map0, const CUtensorMap* map1,
                                          const WgShape& s, float* part, unsigned* counters,
                                          OP& op) {
  using namespace fmlp::cuda::sm90;
  constexpr int kBoxes = kWgStageBoxes / NW;  // boxes per matrix and stage
  extern __shared__ unsigned char wg_smem_raw[];
  __shared__ int exps[kWgMaxTokens], infs[kWgMaxTokens];
  __shared__ float red_max[4][kWgMaxTokens];
  __shared__ int red_inf[4][kWgMaxTokens];
  __shared__ unsigned tiles_done;  // split tiles whose parts the consumers have stored
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(wg_smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* bsm = smem + kWgStages * kWgStageBytes;
  const int slice = int(blockIdx.x) % s.slices, first_tile = int(blockIdx.x) / s.slices;
  const int st_begin = slice * s.slice_stages;
  const int st_end = min(s.kstages, st_begin + s.slice_stages);
  const int slice_k = (st_end - st_begin) * s.stage_k;
  uint64_t* full = reinterpret_cast<uint64_t*>(bsm + size_t(s.slice_stages) * s.stage_k * 8);
  uint64_t* empty = full + kWgStages;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (threadIdx.x == 0) {
    tiles_done = 0;
    for (int i = 0; i < kWgStages; ++i) {
      mbar_init(&full[i], 1);   // the producer's arrive.expect_tx
      mbar_init(&empty[i], 4);  // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 4 && lane == 1) {
    // Signaller: publishes each split tile's stored parts with a gpu-scope release (a fence that
    // waits for the stores), so the consumers never wait for it.
    if (s.slices == 1) return;
    pdl_wait_previous_grid();
    int j = 0;
    for (int t = first_tile; t < s.tiles; t += s.per_slice, ++j) {
      unsigned done = 0;
      do {
        asm volatile("ld.acquire.cta.shared.u32 %0, [%1];"
                     : "=r"(done)
                     : "r"(smem_u32(&tiles_done))
                     : "memory");
      } while (done <= unsigned(j));
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counters + t) : "memory");
    }
    return;
  }
  if (warp == 4) {  // producer: W never depends on the previous grid, so it starts at once
    if (lane != 0) return;
    prefetch_tensormap(map0);
    if (NW == 2) prefetch_tensormap(map1);
    int stage = 0;
    uint32_t phase = 0;
    for (int t = first_tile; t < s.tiles; t += s.per_slice)
      for (int st = st_begin; st < st_end; ++st) {
        mbar_wait(&empty[stage], phase ^ 1);  // a fresh barrier passes parity 1 at once
        unsigned char* dst = smem + stage * kWgStageBytes;
        mbar_expect_tx(&full[stage], NW * kBoxes * kWgBoxBytes);  // zero-filled parts count too
#pragma unroll
        for (int q = 0; q < NW; ++q)
#pragma unroll
          for (int b = 0; b < kBoxes; ++b)
            tma_load(dst + (q * kBoxes + b) * kWgBoxBytes, q == 0 ? map0 : map1, &full[stage],
                     st * s.stage_k + b * kWgBoxK, t * kWgTileRows);
        if (++stage == kWgStages) stage = 0, phase ^= 1;
      }
    return;
  }

  // Consumers: x (or h) comes from the previous grid.
  pdl_wait_previous_grid();
  pdl_allow_next_grid();
  op.prepare();
  const int tid = int(threadIdx.x);
  const int k0 = st_begin * s.stage_k, k_end = min(s.k, k0 + slice_k);

  // Stage B. Each thread owns groups of 4 consecutive k of the slice (at most 4 groups: 2048 k),
  // reads them once and keeps them in registers between the max and the split.
  constexpr int kGroups = kWgMaxSliceK / 4 / kWgConsumers;
  float xv[kGroups][kWgMaxTokens][4];
  float mx[kWgMaxTokens] = {};
  int inf[kWgMaxTokens] = {};
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int j0 = k0 + 4 * (tid + g * kWgConsumers);
#pragma unroll
    for (int t = 0; t < kWgMaxTokens; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = 0.f;
        if (t < op.m && j0 + e < k_end) v = op.x(t, j0 + e);
        if (isinf(v)) inf[t] = 1, v = 0.f;
        mx[t] = fmaxf(mx[t], fabsf(v));  // fmaxf drops NaN
        xv[g][t][e] = v;
      }
  }
#pragma unroll
  for (int t = 0; t < kWgMaxTokens; ++t) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      mx[t] = fmaxf(mx[t], __shfl_xor_sync(0xffffffffu, mx[t], o));
      inf[t] |= __shfl_xor_sync(0xffffffffu, inf[t], o);
    }
    if (lane == 0) red_max[warp][t] = mx[t], red_inf[warp][t] = inf[t];
  }
  wg_consumer_sync();
  if (tid < kWgMaxTokens) {
    float m = 0.f;
    int f = 0;
    for (int w = 0; w < 4; ++w) m = fmaxf(m, red_max[w][tid]), f |= red_inf[w][tid];
    int e2 = 0;
    if (m > 0.f) frexpf(m, &e2);  // m in [2^(e2-1), 2^e2)
    exps[tid] = m > 0.f ? 8 - e2 : 0;
    infs[tid] = f;
  }
  wg_consumer_sync();
  float sc_a[kWgMaxTokens], sc_b[kWgMaxTokens];  // 2^e in two factors: e may exceed 127
#pragma unroll
  for (int t = 0; t < kWgMaxTokens; ++t) {
    const int e = exps[t];
    sc_a[t] = ldexpf(1.f, e / 2);
    sc_b[t] = ldexpf(1.f, e - e / 2);
  }
  // B row 2t is token t's hi part, 2t + 1 its lo part; 128-byte swizzle: 16-byte chunk c of row r
  // of a 1 KiB atom (128 k) sits at chunk c ^ r.
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int jr = 4 * (tid + g * kWgConsumers);
    if (jr >= slice_k) break;
    const int atom = jr / kWgBoxK, byte = jr % kWgBoxK, chunk = byte / 16;
#pragma unroll
    for (int t = 0; t < kWgMaxTokens; ++t) {
      uint32_t hi = 0, lo = 0;
      if (t < op.m) {
        float xs[4], res[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) xs[e] = xv[g][t][e] * sc_a[t] * sc_b[t];
        hi = wg_e4m3x2(xs[0], xs[1]) | (wg_e4m3x2(xs[2], xs[3]) << 16);
        const float2 h01 = wg_e4m3x2_value(hi), h23 = wg_e4m3x2_value(hi >> 16);
        res[0] = xs[0] - h01.x, res[1] = xs[1] - h01.y, res[2] = xs[2] - h23.x,
        res[3] = xs[3] - h23.y;
        lo = wg_e4m3x2(res[0], res[1]) | (wg_e4m3x2(res[2], res[3]) << 16);
      }
      const int r = 2 * t;
      *reinterpret_cast<uint32_t*>(bsm + atom * 1024 + r * 128 + ((chunk ^ r) * 16) + byte % 16) =
          hi;
      *reinterpret_cast<uint32_t*>(bsm + atom * 1024 + (r + 1) * 128 + ((chunk ^ (r + 1)) * 16) +
                                   byte % 16) = lo;
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // B is read by wgmma (async proxy)
  wg_consumer_sync();

  const int tok = lane % 4;  // this thread's token; rows 16 warp + lane / 4 and 8 more
  const int rl[2] = {16 * warp + lane / 4, 16 * warp + lane / 4 + 8};
  const bool has_tok = tok < op.m;
  const uint32_t bbase = smem_u32(bsm);
  int stage = 0;
  uint32_t phase = 0;
  for (int t = first_tile; t < s.tiles; t += s.per_slice) {
    // Two stages in the tensor pipe at once: stage st's wgmmas are issued before stage st - 1's
    // accumulators are waited for, added and its buffer released.
    float v[NW][2] = {};
    float d0[NW][4] = {}, d1[NW][4] = {};
    int prev_stage = 0;
    auto issue = [&](int st, float(&d)[NW][4]) {
      mbar_wait(&full[stage], phase);
      __syncwarp();  // wgmma is .sync.aligned: the warp must be converged
      const uint32_t abase = smem_u32(smem + stage * kWgStageBytes);
#pragma unroll
      for (int q = 0; q < NW; ++q) wg_fence_acc(d[q]);
      wgmma_fence();
#pragma unroll
      for (int q = 0; q < NW; ++q)
#pragma unroll
        for (int b = 0; b < kBoxes; ++b) {
          const uint64_t da = smem_desc(abase + (q * kBoxes + b) * kWgBoxBytes);
          const uint64_t db = smem_desc(bbase + ((st - st_begin) * kBoxes + b) * 1024);
#pragma unroll
          for (int kk = 0; kk < kWgBoxK / 32; ++kk)
            wg_mma_m64n8k32(d[q], da + 2 * kk, db + 2 * kk, (b | kk) != 0);
        }
      wgmma_commit();
#pragma unroll
      for (int q = 0; q < NW; ++q) wg_fence_acc(d[q]);
    };
    // After wgmma_wait: the older group's sums into v, its stage back to the producer.
    auto retire = [&](float(&d)[NW][4]) {
#pragma unroll
      for (int q = 0; q < NW; ++q) {
        wg_fence_acc(d[q]);
        v[q][0] += d[q][0] + d[q][1];
        v[q][1] += d[q][2] + d[q][3];
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[prev_stage]);
    };
    auto advance = [&] {
      prev_stage = stage;
      if (++stage == kWgStages) stage = 0, phase ^= 1;
    };
    for (int st = st_begin; st < st_end; st += 2) {
      issue(st, d0);
      if (st > st_begin) {
        wgmma_wait<1>();
        retire(d1);
      }
      advance();
      if (st + 1 < st_end) {
        issue(st + 1, d1);
        wgmma_wait<1>();
        retire(d0);
        advance();
      }
    }
    wgmma_wait<0>();
    if (((st_end - st_begin) & 1) != 0)
      retire(d0);
    else
      retire(d1);

    // This slice's part of rows rl[i] for token tok, unscaled; plus w * Inf where x had one.
    float val[2][NW];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int q = 0; q < NW; ++q) val[i][q] = has_tok ? ldexpf(v[q][i], -exps[tok]) : 0.f;
    if (has_tok && infs[tok]) {
      for (int j = k0; j < k_end; ++j) {
        const float xj = op.x(tok, j);
        if (!isinf(xj)) continue;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int row = t * kWgTileRows + rl[i];
          if (row >= s.n) continue;
#pragma unroll
          for (int q = 0; q < NW; ++q) val[i][q] += wg_e4m3_value(op.w(q, row)[j]) * xj;
        }
      }
    }
    // The tile's part goes to the workspace; a split tile's counter is bumped by the signaller
    // thread (the stream goes on at once). The slice-0 block finishes its tiles
    // after its last one, all together, so their global round trips overlap.
    float* mine = part + (size_t(t) * s.slices + slice) * NW * kWgPartFloats;
    if (has_tok)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int q = 0; q < NW; ++q) __stcg(mine + q * kWgPartFloats + tok * 64 + rl[i], val[i][q]);
    if (s.slices > 1) {
      wg_consumer_sync();  // every consumer's stores, then a cta-scope release to the signaller
      if (tid == 0)
        asm volatile("red.release.cta.shared.add.u32 [%0], 1;" ::"r"(smem_u32(&tiles_done))
                     : "memory");
    }
  }
  if (slice != 0) {
    op.done();
    return;
  }
  const int owned = (s.tiles - first_tile + s.per_slice - 1) / s.per_slice;
  if (s.slices > 1) {
    // Every block of the grid is resident (one per SM, and a dependent grid starts only after all
    // of them ran griddepcontrol.launch_dependents), so the other slices' blocks finish.
    for (int j = tid; j < owned; j += kWgConsumers) {
      unsigned c = 0;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];"
                     : "=r"(c)
                     : "l"(counters + first_tile + j * s.per_slice)
                     : "memory");
      } while (c != unsigned(s.slices));
    }
  }
  wg_consumer_sync();  // the block's own parts, and (acquired) the other slices'
  if (s.slices > 1)
    for (int j = tid; j < owned; j += kWgConsumers) counters[first_tile + j * s.per_slice] = 0;
  const int items = owned * kWgTileRows * op.m;
#pragma unroll 2
  for (int i = tid; i < items; i += kWgConsumers) {
    const int r = i % kWgTileRows, tk = (i / kWgTileRows) % op.m, j = i / (kWgTileRows * op.m);
    const int t = first_tile + j * s.per_slice, row = t * kWgTileRows + r;
    float* tile = part + size_t(t) * s.slices * NW * kWgPartFloats + tk * kWgTileRows + r;
    float sum[NW] = {};
#pragma unroll 4
    for (int sl = 0; sl < s.slices; ++sl)
#pragma unroll
      for (int q = 0; q < NW; ++q) {
        float* e = tile + (size_t(sl) * NW + q) * kWgPartFloats;
        sum[q] += __ldcg(e);
        __stcg(e, 0.f);
      }
    if (row < s.n) op.finish(row, tk, sum);
  }
  op.done();
}

#endif  // FMLP_SM90A

}  // namespace fmlp::cuda
