// moe_sm80_stream: MoE decode (a few tokens, bf16/f16 experts) as two memory-order weight streams
// (engines/stream_gemv.cuh) after the route kernel (route.cu), no combine launch.
//
// Why: at decode sizes the op is a read of the hit experts' weights, and the stream reads weights
// near copy bandwidth where the chunked kernel's per-chunk mma streaming reached 45 % of it
// (bench/results/moe_chunked_h200.json, Mixtral T = 1).
// Every slot (token t, rank j of its top k) is its own set of virtual rows, so the grid and the
// row space depend on the shapes only (no host sync, capturable): a block reads the routing from
// the workspace and skips (reads nothing for) the rows of slots without a local expert.
//   1. moe_sm80_stream_up, grid (blocks, T): block row y is token t; its x is staged in its own
//      dtype (exact). Virtual rows (i, j[, gate|up]) in that order: W1 row i of slot j's expert
//      (gated: gate row i and up row i adjacent, one thread gets both sums). Epilogue: b1, the
//      activation, the gating; h[slot][i] stored in the experts' dtype into the workspace (the
//      rounding PyTorch and moe_sm80_chunked apply).
//   2. moe_sm80_stream_down, grid (blocks, T): the block reads its token's k rows of h, staged in
//      shared memory where they fit (down_h_rows), and the last block to finish re-zeroes h and
//      the routing (the workspace contract). Virtual rows (r, j) with j padded to KP (k rounded up
//      to a power of two), so one thread gets the k slot sums of output r and adds w_j (sum_j + b2)
//      in slot order, then the residual, and writes y: no per-slot outputs, no combine.
// Tokens that share an expert each read its rows, at the same place of the same order at about
// the same time (all blocks are resident), so the repeats mostly hit L2; the entry declines when
// the expected repeats would make L2 the bottleneck (moe/planner.cpp). fp32 accumulation in a
// fixed order: deterministic. Limits (moe/table.cpp): T <= kMoeStreamMaxTokens, k <= 8, the
// staged x (d in x's dtype) within kMoeStreamStageBytes.
// d and hidden of any size, on expert rows that start on 16-byte boundaries (a padded row stride
// where the size is not a multiple of 8): both streams run over the widths rounded up to whole
// chunks (moe_stream_width: dp, hp), read a row's partial last chunk by its own bytes
// (StreamShape::tail), x is staged with zeros past d and h kept as [slots][hp] rows whose padding
// the up kernel never writes (zero, as the whole workspace region is between calls), so nothing
// past a row multiplies.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/engines/stream_gemv.cuh"
#include "cuda/moe/device.cuh"
#include "cuda/moe/moe_cuda.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::activate;
using fmlp::cuda::from_f;
using fmlp::cuda::kStreamPerChunk;
using fmlp::cuda::kStreamThreads;
using fmlp::cuda::kStreamU;
using fmlp::cuda::kStreamWarps;
using fmlp::cuda::ld_stream_tail;
using fmlp::cuda::ld_stream_v4;
using fmlp::cuda::load_scalar;
using fmlp::cuda::pdl_allow_next_grid;
using fmlp::cuda::pdl_wait_previous_grid;
using fmlp::cuda::store_scalar;
using fmlp::cuda::stream_begin;
using fmlp::cuda::stream_dispatch_u;
using fmlp::cuda::stream_fma_x8;
using fmlp::cuda::stream_load;
using fmlp::cuda::stream_pick_loads;
using fmlp::cuda::stream_resident_blocks;
using fmlp::cuda::stream_run_rows;
using fmlp::cuda::stream_shape;
using fmlp::cuda::stream_shape_rows;
using fmlp::cuda::stream_span;
using fmlp::cuda::StreamShape;
using fmlp::cuda::widen8;

static_assert(kMoeStreamMaxTopK <= kStreamWarps, "a row's k slot sums must fit one group");

// Element i of expert e's row of a per-expert vector (b1, b2), 0 when the vector is absent.
__device__ __forceinline__ float expert_elem(const void* v, fmlp_dtype_t t, int64_t stride, int e,
                                             int i) {
  return v ? load_scalar(fmlp::cuda::expert_vec(v, t, stride, e), t, i) : 0.f;
}

template <typename WT, typename XT>
__global__ void __launch_bounds__(kStreamThreads, 4)
    moe_sm80_stream_up(const MoeParams p, const StreamShape s) {
  extern __shared__ uint4 smem_v[];
  XT* xs = reinterpret_cast<XT*>(smem_v);  // [dp]: this block's token, zeros past d
  __shared__ float red[2][kStreamWarps][1];
  __shared__ int eid[kMoeStreamMaxTopK];
  const int t = blockIdx.y, k = p.top_k;
  pdl_wait_previous_grid();  // for the routing (programmatic dependent launch, common/common.cuh)
  pdl_allow_next_grid();
  if (threadIdx.x < k) eid[threadIdx.x] = __ldcg(p.ids + t * k + threadIdx.x);
  __syncthreads();
  const auto sp = stream_span<WT>(s);
  const WT* w1 = static_cast<const WT*>(p.w1);
  const bool gated = p.gated;
  // Virtual row v: pair q = v / 2 (gated; else q = v) is hidden unit i = q / k of slot j = q % k.
  auto row_ptr = [&](int v) -> const WT* {
    const int q = gated ? v >> 1 : v, i = q / k, e = eid[q - i * k];
    if (e < 0) return nullptr;  // remote or bad id: nothing to read
    const int r = gated && (v & 1) ? p.hidden + i : i;
    return w1 + int64_t(e) * p.w1_e + int64_t(r) * p.w1_ld;
  };
  uint4 cur[kStreamU];
  stream_load<WT, true>(cur, s, sp, row_ptr, blockIdx.x, 0);  // in flight while x is staged
  const XT* xr = static_cast<const XT*>(p.x) + int64_t(t) * p.x_ld;
  if (p.x_vec16 && p.d == p.dp) {
    const int words = p.d * int(sizeof(XT)) / 16;  // d is a multiple of 8
    for (int i = threadIdx.x; i < words; i += kStreamThreads)
      smem_v[i] = __ldg(reinterpret_cast<const uint4*>(xr) + i);
  } else {
    for (int i = threadIdx.x; i < p.dp; i += kStreamThreads)
      xs[i] = i < p.d ? xr[i] : fmlp::cuda::from_f<XT>(0.f);
  }
  __syncthreads();
  WT* hb = reinterpret_cast<WT*>(p.hbuf);  // [slots][hp]
  auto x_rows = [&](int) { return static_cast<const XT*>(xs); };
  auto store_h = [&](int q, float gate, float up) {
    const int i = q / k, j = q - i * k, e = eid[j];
    if (e < 0) return;
    float h = gate + expert_elem(p.b1, p.b1_t, p.b1_e, e, i);
    h = activate(p.act, h);
    if (gated) h *= up + expert_elem(p.b1, p.b1_t, p.b1_e, e, p.hidden + i);
    hb[int64_t(t * k + j) * p.hp + i] = from_f<WT>(h);
  };
  if (gated) {
    auto finish = [&](int v, int, const float(&sum)[2]) { store_h(v >> 1, sum[0], sum[1]); };
    stream_run_rows<WT, XT, 1, 2, true>(s, sp, x_rows, row_ptr, finish, cur, red);
  } else {
    auto finish = [&](int v, int, const float(&sum)[1]) { store_h(v, sum[0], 0.f); };
    stream_run_rows<WT, XT, 1, 1, true>(s, sp, x_rows, row_ptr, finish, cur, red);
  }
}

// A down block's routing for its token t: each slot's local expert (padding slots j >= k and
// remote ones < 0) and weight. The routing is complete when the down launch starts: every block of
// the up launch let it start only after its own wait for the route kernel.
template <int KP>
struct DownSlots {
  int eid[KP];
  float wt[KP];
  int bad;  // an expert id was out of range: the token's row becomes NaN
};

template <int KP>
__device__ __forceinline__ void down_slots_load(DownSlots<KP>& d, const MoeParams& p, int t) {
  const int k = p.top_k;
  if (threadIdx.x == 0) d.bad = 0;
  __syncthreads();
  if (threadIdx.x < KP) {
    const int j = threadIdx.x;
    const int e = j < k ? __ldcg(p.ids + t * k + j) : kMoeSlotRemote;
    d.eid[j] = e;
    d.wt[j] = e >= 0 ? __ldcg(p.wts + t * k + j) : 0.f;
    if (e == kMoeSlotBad) d.bad = 1;
  }
  __syncthreads();
}

// Token t's k rows of h: where the up launch left them, or (STAGE_H) copied into `hs` first, after
// the caller's wait for the up launch. Staging needs k x hidden <= kMoeStreamDownStageBytes, which
// keeps four blocks per SM: under ncu (E = 64 T = 1, docs/moe.md) the in-place reads
// were issued one L1 round trip at a time inside the compute phase. Mixtral's k = 2 rows (56 KiB)
// are read in place: staging them left three blocks per SM and 74 % of DRAM bandwidth (ncu).
template <typename WT, bool STAGE_H>
__device__ __forceinline__ const WT* down_h_rows(const MoeParams& p, int t, uint4* hs) {
  const WT* h = reinterpret_cast<const WT*>(p.hbuf) + int64_t(t) * p.top_k * p.hp;
  if constexpr (!STAGE_H) return h;
  const int words = p.top_k * p.hp * int(sizeof(WT)) / 16;  // hp is a multiple of 8
  for (int i = threadIdx.x; i < words; i += kStreamThreads)
    hs[i] = __ldcg(reinterpret_cast<const uint4*>(h) + i);
  __syncthreads();
  return reinterpret_cast<const WT*>(hs);
}

// y[t][r] from output r's slot sums `sum(j)`: w_j (sum_j + b2) in slot order, the residual, NaN
// for a bad id.
template <int KP, typename Sum>
__device__ __forceinline__ void down_store(const MoeParams& p, const DownSlots<KP>& d, int t, int r,
                                           Sum sum) {
  const size_t es = p.x_t == FMLP_DTYPE_F32 ? 4 : 2;
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < KP; ++j) {
    const int e = d.eid[j];
    if (e < 0) continue;
    acc = fmaf(d.wt[j], sum(j) + expert_elem(p.b2, p.b2_t, p.b2_e, e, r), acc);
  }
  if (p.res)
    acc += load_scalar(static_cast<const char*>(p.res) + int64_t(t) * p.res_ld * es, p.x_t, r);
  if (d.bad) acc = __int_as_float(0x7fc00000);
  store_scalar(static_cast<char*>(p.y) + int64_t(t) * p.y_ld * es, p.x_t, r, acc);
}

// The last down block to finish leaves the workspace zeroed: every block's reads of h and of the
// routing are done once its stream is (their values were used).
__device__ __forceinline__ void down_clear_workspace(const MoeParams& p) {
  if (!fmlp::cuda::block_arrive_last(&p.hdr->combine_done, gridDim.x * gridDim.y)) return;
  for (int64_t i = threadIdx.x; i < p.hbuf_words; i += kStreamThreads)
    p.hbuf[i] = make_uint4(0, 0, 0, 0);
  for (int i = threadIdx.x; i < p.slots; i += kStreamThreads)
    p.ids[i] = 0, p.wts[i] = 0.f, p.perm[i] = 0;
  for (int i = threadIdx.x; i < p.max_chunks; i += kStreamThreads)
    p.chunk_expert[i] = p.chunk_start[i] = p.chunk_len[i] = 0;  // the route kernel's plan
  if (threadIdx.x == 0) p.hdr->chunks = 0, p.hdr->combine_done = 0;
}

template <typename WT, int KP, int U, bool STAGE_H>
__global__ void __launch_bounds__(kStreamThreads, 4)
    moe_sm80_stream_down(const MoeParams p, const StreamShape s) {
  extern __shared__ uint4 hs_v[];  // STAGE_H: [k][hidden] of this block's token
  __shared__ float red[2][kStreamWarps][1];
  __shared__ DownSlots<KP> d;
  const int t = blockIdx.y, k = p.top_k;
  down_slots_load(d, p, t);
  const auto sp = stream_span<WT>(s);
  const WT* w2 = static_cast<const WT*>(p.w2);
  // Virtual row v: output r = v / KP of slot j = v % KP (padding slots j >= k have eid < 0).
  auto row_ptr = [&](int v) -> const WT* {
    const int e = d.eid[v % KP];
    return e < 0 ? nullptr : w2 + int64_t(e) * p.w2_e + int64_t(v / KP) * p.w2_ld;
  };
  uint4 cur[U];
  stream_begin<WT, true>(cur, s, sp, row_ptr, 0);  // then h is complete
  const WT* hrow = down_h_rows<WT, STAGE_H>(p, t, hs_v);
  auto x_rows = [&](int v) {
    const int j = v % KP;
    return hrow + int64_t(j < k ? j : 0) * p.hp;
  };
  auto finish = [&](int v, int, const float(&sum)[KP]) {
    down_store(p, d, t, v / KP, [&](int j) { return sum[j]; });
  };
  stream_run_rows<WT, WT, 1, KP, true>(s, sp, x_rows, row_ptr, finish, cur, red);
  down_clear_workspace(p);
}

// moe_sm80_stream_down_warp (rows of up to 4 KB: launch_all): the same sums with one warp per
// output row r, which reads W2 row r of each of the token's slots in turn (s.batches batches of U
// loads a row, the next one always in flight) and keeps slot j's sum in lane j, so no block
// barrier ties the warps together: under ncu (E = 64 T = 1, docs/moe.md)
// moe_sm80_stream_down spent a third of its cycles at stream_run_rows' per-group barrier. The warps
// of a block take consecutive rows, so each step reads 8 adjacent rows of one expert. Grid:
// (blocks, T); warp w of block b takes rows b * 8 + w, + 8 * gridDim.x, ... With s.wpr = 2 (one
// token) a pair of warps takes each row, half of it each, so one token's rows make twice the warps;
// the halves meet at a barrier of the two warps only.
template <typename WT, int U, bool STAGE_H>
__global__ void __launch_bounds__(kStreamThreads, 4)
    moe_sm80_stream_down_warp(const MoeParams p, const StreamShape s) {
  constexpr int KP = kMoeStreamMaxTopK;
  extern __shared__ uint4 hs_v[];
  __shared__ DownSlots<KP> d;
  __shared__ float part[2][kStreamWarps / 2][KP];  // s.wpr == 2: the second half's slot sums
  const int t = blockIdx.y, k = p.top_k, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // s.wpr warps (1 or 2) share a row, warp `half` taking chunks [c0, c1) of it.
  const int half = warp % s.wpr, c0 = half * s.cpw;
  const int c1 = min(p.hp / kStreamPerChunk<WT>, c0 + s.cpw);
  const int tail_c = s.tail ? p.hp / kStreamPerChunk<WT> - 1 : -1;  // a row's partial chunk
  const int step = int(gridDim.x) * s.rows;
  down_slots_load(d, p, t);
  const WT* w2 = static_cast<const WT*>(p.w2);
  // Position (row r, slot j, batch b) of this warp's sequence, and its successor.
  struct Pos {
    int r, j, b;
  };
  auto next = [&](Pos q) {
    if (++q.b < s.batches) return q;
    q.b = 0;
    if (++q.j < k) return q;
    q.j = 0, q.r += step;
    return q;
  };
  auto load = [&](uint4(&v)[U], Pos q) {
    const int e = q.r < p.d_out ? d.eid[q.j] : -1;
    const WT* wr = e < 0 ? nullptr : w2 + int64_t(e) * p.w2_e + int64_t(q.r) * p.w2_ld;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + (q.b * U + u) * 32 + lane;
      v[u] = wr && c < c1 && c != tail_c ? ld_stream_v4(wr + int64_t(c) * kStreamPerChunk<WT>)
                                         : make_uint4(0, 0, 0, 0);
    }
    if (s.tail) {  // a row's partial last chunk by its own bytes, apart (stream_load says why)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + (q.b * U + u) * 32 + lane;
        if (wr && c < c1 && c == tail_c)
          v[u] = ld_stream_tail(wr + int64_t(c) * kStreamPerChunk<WT>, s.tail);
      }
    }
  };
  Pos at{int(blockIdx.x) * s.rows + warp / s.wpr, 0, 0};
  uint4 cur[U], alt[U];
  load(cur, at);
  pdl_wait_previous_grid();  // h (the weights and the routing were complete before)
  pdl_allow_next_grid();
  const WT* h = down_h_rows<WT, STAGE_H>(p, t, hs_v);
  float acc = 0.f, mine = 0.f;  // lane j: slot j's sum of the current row
  bool flip = false;            // as in stream_run_rows: the buffers swap roles, never copied
  int parity = 0;               // s.wpr == 2: the `part` buffer of the current row
  auto run = [&](const uint4(&use)[U], uint4(&fill)[U]) {
    const Pos n = next(at);
    if (n.r < p.d_out) load(fill, n);
    const WT* x = h + int64_t(at.j) * p.hp;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + (at.b * U + u) * 32 + lane;
      if (c >= c1) continue;
      float wf[8];
      widen8<WT>(use[u], wf);
      stream_fma_x8<WT>(acc, wf, x, c);
    }
    if (at.b + 1 == s.batches) {
      const float sum = fmlp::cuda::warp_sum(acc);
      acc = 0.f;
      if (lane == at.j) mine = sum;
      if (at.j + 1 == k && s.wpr == 2) {
        // The pair's two halves meet through shared memory: the second hands its sums to the
        // first at a barrier of the two warps only (ids 1..4), double-buffered by row parity.
        float* pp = part[parity][warp / 2];
        if (half == 1 && lane < KP) pp[lane] = mine;
        asm volatile("bar.sync %0, 64;" ::"r"(1 + warp / 2) : "memory");
        if (half == 0 && lane < KP) mine += pp[lane];
        parity ^= 1;
      }
      if (at.j + 1 == k && half == 0) {
        float sums[KP];
#pragma unroll
        for (int j = 0; j < KP; ++j) sums[j] = __shfl_sync(0xffffffffu, mine, j);
        if (lane == 0) down_store(p, d, t, at.r, [&](int j) { return sums[j]; });
      }
    }
    at = n;
  };
  while (at.r < p.d_out) {
    if (flip)
      run(alt, cur);
    else
      run(cur, alt);
    flip = !flip;
  }
  down_clear_workspace(p);
}

// Where the launches go: the caller's stream, its device, programmatic dependent launch or not.
struct Where {
  cudaStream_t st;
  int device;
  bool pdl;
};

// KERNEL over a grid of (blocks per token, T): the resident blocks shared by the T token rows, so
// every block is resident at once (the down launch's last block to stage h counts on it only for
// speed).
template <auto KERNEL>
fmlp_status_t launch_rows(const MoeParams& p, const StreamShape& s, size_t smem, const Where& w,
                          const char* name) {
  if (fmlp_status_t e = allow_dynamic_smem<KERNEL>(smem, name); e != FMLP_SUCCESS) return e;
  const int resident = stream_resident_blocks(KERNEL, smem, w.device, cuda_sm_count(w.device));
  const int blocks = std::max(1, std::min(s.groups, resident / std::max(1, p.tokens)));
  return launch_ex(KERNEL, dim3(unsigned(blocks), unsigned(p.tokens)), dim3(kStreamThreads), smem,
                   w.pdl, w.st, name, p, s);
}

template <typename WT, typename XT>
fmlp_status_t launch_up(const MoeParams& p, const StreamShape& s, const Where& w) {
  return launch_rows<&moe_sm80_stream_up<WT, XT>>(p, s, size_t(p.dp) * sizeof(XT), w,
                                                  "moe_sm80_stream_up");
}

// The down launch for shape s: the stream_run_rows kernel (KP slots a row group), or with
// `warp_rows` the warp-per-row kernel; h staged when `stage`.
template <typename WT, int KP>
fmlp_status_t launch_down(const MoeParams& p, const StreamShape& s, bool warp_rows, bool stage,
                          const Where& w) {
  const size_t hs = stage ? size_t(p.top_k) * p.hp * sizeof(WT) : 0;
  const char* name = warp_rows ? "moe_sm80_stream_down_warp" : "moe_sm80_stream_down";
  return stream_dispatch_u(s, [&](auto u) {
    constexpr int U = decltype(u)::value;
    if (warp_rows)
      return stage ? launch_rows<&moe_sm80_stream_down_warp<WT, U, true>>(p, s, hs, w, name)
                   : launch_rows<&moe_sm80_stream_down_warp<WT, U, false>>(p, s, 0, w, name);
    if constexpr (KP == kMoeStreamMaxTopK)
      if (stage) return launch_rows<&moe_sm80_stream_down<WT, KP, U, true>>(p, s, hs, w, name);
    return launch_rows<&moe_sm80_stream_down<WT, KP, U, false>>(p, s, 0, w, name);
  });
}

template <typename WT>
fmlp_status_t launch_all(const MoeParams& p, cudaStream_t st) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError(), device = 0;
  const Where w{st, device, pdl_enabled(cuda_compute_capability(device))};
  const int rows1 = p.gated ? 2 * p.hidden : p.hidden;
  const int kp = moe_stream_pair(p.top_k);
  // Each slot's rows are read for its one token.
  StreamShape up = stream_shape(int64_t(p.top_k) * rows1, p.dp, 2, 1, p.gated ? 2 : 1);
  up.tail = p.d * 2 % 16;
  // The down kernel: 0 row groups, 1 a warp per output row, 2 a pair of warps per row (half a
  // row each), where a W2 row is at most 4 KB: a pair at one token, a warp from two on.
  // Measured (docs/moe.md): at E = 64 T = 1 pairs beat row groups and a warp per row loses (one
  // token's rows make 2048 warps, half the GPU); at T = 2 and 4 a warp per row beats row groups
  // and ties with pairs; at T = 16 all tie. Mixtral's rows (28 KB, each streamed by one warp or
  // pair) scatter the reads over all of W2, so there row groups win at T = 1 and 2.
  // FMLP_MOE_STREAM_DOWN_WARP=0|1|2 forces one of them (fusedmlp_moe_bench --layers
  // e64k8,mixtral --ts 1,2,4,16 with each).
  static const int warp_knob = int(knob_int_or<Knob::FMLP_MOE_STREAM_DOWN_WARP>(-1));
  const int down_mode = warp_knob >= 0                 ? warp_knob
                        : p.hidden * sizeof(WT) > 4096 ? 0
                        : p.tokens == 1                ? 2
                                                       : 1;
  const bool warp_rows = down_mode >= 1;
  // Row groups: k (padded to kp) virtual rows an output row. A warp per row: groups of 8 output
  // rows, or 4 read by pairs.
  StreamShape down = warp_rows ? stream_shape_rows(p.d_out, p.hp, 2,
                                                   down_mode == 2 ? kStreamWarps / 2 : kStreamWarps)
                               : stream_shape(int64_t(kp) * p.d_out, p.hp, 2, 1, kp);
  down.tail = p.hidden * 2 % 16;
  // E = 64's 1408-wide rows: 176 chunks, two batches either way, 192 loaded at U = 3 against 256
  stream_pick_loads(down, int64_t(p.top_k) * p.d_out * p.hp * 2);
  // h staged where it fits, by the row-group kernel at k = 8 (measured there, docs/moe.md: no
  // slower at E = 64 T = 1..4 and the down kernel faster under ncu) and by the warp kernel
  // (measured staged). FMLP_MOE_STREAM_DOWN_STAGE=0 reads h in place.
  static const bool stage_on = knob_bool<Knob::FMLP_MOE_STREAM_DOWN_STAGE>();
  const bool stage = stage_on && (kp == kMoeStreamMaxTopK || warp_rows) &&
                     size_t(p.top_k) * p.hp * sizeof(WT) <= kMoeStreamDownStageBytes;
  fmlp_status_t e = p.x_t == FMLP_DTYPE_F32   ? launch_up<WT, float>(p, up, w)
                    : p.x_t == FMLP_DTYPE_F16 ? launch_up<WT, __half>(p, up, w)
                                              : launch_up<WT, __nv_bfloat16>(p, up, w);
  if (e != FMLP_SUCCESS) return e;
  switch (kp) {
    case 1: return launch_down<WT, 1>(p, down, warp_rows, stage, w);
    case 2: return launch_down<WT, 2>(p, down, warp_rows, stage, w);
    case 4: return launch_down<WT, 4>(p, down, warp_rows, stage, w);
    default: return launch_down<WT, 8>(p, down, warp_rows, stage, w);
  }
}

}  // namespace

fmlp_status_t moe_launch_stream(const MoeParams& p, cudaStream_t s) {
  return p.w_t == FMLP_DTYPE_F16 ? launch_all<__half>(p, s) : launch_all<__nv_bfloat16>(p, s);
}

}  // namespace fmlp::detail
