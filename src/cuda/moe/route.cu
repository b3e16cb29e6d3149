// The routing and combine kernels of moe_sm80_chunked (moe_cuda.hpp has the overview).
//
// moe_sm80_route: a block routes route_tokens tokens, one at a time. Router logits in fp32 (16-bit
// router rows in 16-byte pieces: threads over the pieces, kRouteExperts router rows at a time;
// otherwise warps over experts, a lane over 8-column pieces of a router row), softmax or sigmoid,
// top-k with the ref's rule (strict >, so ties go to the lower id; a NaN score never wins unless it
// is the lowest unpicked id: by rank where no score is NaN, else by repeated arg-max), optional
// renormalisation. The split router's blocks of a token block meet in a cluster on sm_90
// (route_cluster_gather), else through the workspace. Given routing is read
// as is; an id outside [0, global experts) is never used as an index: its slot is marked
// kMoeSlotBad (combine turns the token's row into NaN) and counted in the workspace header.
// Per-expert counts by atomics. For the weight streams (ids_only) only ids and weights are written:
// no counts, no plan, and the streams' launch may start at once (griddepcontrol.launch_dependents).
// Expert parallelism: routing is over the global experts (router rows, given ids); a slot whose
// expert is outside the local range is marked kMoeSlotRemote, counted nowhere and never run.
// The last block to finish (a counter) plans: exclusive scan of the counts, a stable scatter of the
// slot ids grouped by expert (each warp counts its contiguous run of slots per expert, runs are
// ranked in warp order, lanes of one step are ranked with __match_any_sync), the chunk list, and
// the counts re-zeroed.
//
// moe_sm80_combine (several output slices; moe_sm80_combine_rows for one): one (token, column
// tile) per block; the expert outputs of the token's k slots summed over the hidden slices in a
// fixed order, weighted, + b2, + residual, stored as y's dtype; remote slots add nothing. Every
// value read is re-zeroed (and the grouped path's h buffer); the last block clears the routing, so
// the workspace is left zero-filled (the error count aside).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/moe/device.cuh"
#include "cuda/moe/moe_cuda.hpp"

namespace fmlp::detail {
namespace {

namespace cg = cooperative_groups;

using fmlp::cuda::block_arrive_last;
using fmlp::cuda::load8;
using fmlp::cuda::load_scalar;
using fmlp::cuda::pdl_allow_next_grid;
using fmlp::cuda::store_scalar;
using fmlp::cuda::warp_max;
using fmlp::cuda::warp_sum;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRouteTokens = 4;
constexpr int kRouteExperts = kRouteSplitExperts;  // router rows per pass of router_logits_columns
constexpr unsigned kFull = 0xffffffffu;
// select_topk ranks every score at once up to this many experts (a lane holds E / 32 of them).
constexpr int kRankMaxExperts = 128;
// The split router's blocks of one token block meet in a cluster up to this many (portable size).
constexpr int kRouteClusterMax = 8;

struct RouteShared {
  float scores[kMaxRouteTokens][kMoeMaxExperts];
  float picked[kMaxRouteTokens][kMoeMaxExperts];  // select_topk: the j-th pick's weight
  unsigned char taken[kMaxRouteTokens][kMoeMaxExperts];
  int run[kWarps][kMoeMaxExperts];  // plan: per-warp counts, then per-warp next positions
  int off[kMoeMaxExperts], chunk_off[kMoeMaxExperts], count[kMoeMaxExperts];
  float red[kWarps][kRouteExperts];  // router_logits_columns: per-warp sums
  int valid;                         // slots with an expert
};

// A token's logit for expert e from its dot product v: + router bias, rounded as a 16-bit router
// would store it when asked.
__device__ __forceinline__ float finish_logit(const MoeParams& p, float v, int e) {
  float l = v + (p.rb ? load_scalar(p.rb, p.rb_t, e) : 0.f);
  if (p.round_logits)  // what a 16-bit nn.Linear router would have stored
    l = p.x_t == FMLP_DTYPE_BF16 ? __bfloat162float(__float2bfloat16_rn(l))
                                 : __half2float(__float2half_rn(l));
  return l;
}

// The logits of token t into `scores` (+ router bias): warps over router rows, a lane's 8-column
// pieces in order; for fp32 router rows and rows without 16-byte pieces.
__device__ void router_logits(const MoeParams& p, int t, float* scores) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t rs = p.rw_t == FMLP_DTYPE_F32 ? 4 : 2, xs = p.x_t == FMLP_DTYPE_F32 ? 4 : 2;
  const void* xrow = static_cast<const char*>(p.x) + int64_t(t) * p.x_ld * xs;
  for (int e = warp; e < p.global_experts; e += kWarps) {
    const void* wrow = static_cast<const char*>(p.rw) + int64_t(e) * p.rw_ld * rs;
    float acc = 0.f;
    // Unrolled so a lane has several router loads in flight rather than one dependent round trip
    // to memory per 256 columns.
#pragma unroll 8
    for (int c = lane * 8; c < p.d; c += 256) {
      float w[8], xv[8];
      load8(wrow, p.rw_t, c, p.d, p.rw_vec16, w);
      load8(xrow, p.x_t, c, p.d, p.x_vec16, xv);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc = fmaf(w[i], xv[i], acc);
    }
    const float v = warp_sum(acc);
    if (lane == 0) scores[e] = finish_logit(p, v, e);
  }
}

// router_logits for 16-bit router rows with 16-byte pieces (d % 8 == 0): threads over the
// 8-column pieces, kRouteExperts router rows at a time, so every thread has 16 loads in flight
// (64 KB per block) where a warp per router row had one dependent round trip per piece: one
// block routes a decode step alone, and that way it took over half of a decode call (E = 64,
// d = 2048, under ncu). Each x piece is read once per pass and serves the pass's
// rows. Sums: per thread over its pieces in order, then the warp's lanes, then the warps in order:
// deterministic. Router rows [e_begin, e_end) only.
template <typename RT>
__device__ void router_logits_columns(const MoeParams& p, int t, float* scores, RouteShared& sh,
                                      int e_begin, int e_end) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, pieces = p.d / 8;
  const size_t xs = p.x_t == FMLP_DTYPE_F32 ? 4 : 2;
  const RT* rw = static_cast<const RT*>(p.rw);
  const void* xrow = static_cast<const char*>(p.x) + int64_t(t) * p.x_ld * xs;
  for (int e0 = e_begin; e0 < e_end; e0 += kRouteExperts) {
    const int ne = min(kRouteExperts, e_end - e0);
    float acc[kRouteExperts] = {};
    for (int c = threadIdx.x; c < pieces; c += kThreads) {
      uint4 w[kRouteExperts];
#pragma unroll
      for (int i = 0; i < kRouteExperts; ++i)
        w[i] = i < ne ? __ldg(reinterpret_cast<const uint4*>(rw + int64_t(e0 + i) * p.rw_ld) + c)
                      : make_uint4(0, 0, 0, 0);
      float xv[8];
      load8(xrow, p.x_t, c * 8, p.d, p.x_vec16, xv);
#pragma unroll
      for (int i = 0; i < kRouteExperts; ++i) {
        float wf[8];
        fmlp::cuda::widen8<RT>(w[i], wf);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[i] = fmaf(wf[q], xv[q], acc[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kRouteExperts; ++i)
      if (i < ne) {
        const float v = warp_sum(acc[i]);
        if (lane == 0) sh.red[warp][i] = v;
      }
    __syncthreads();
    if (int(threadIdx.x) < ne) {
      const int i = threadIdx.x;
      float v = 0.f;
      for (int w = 0; w < kWarps; ++w) v += sh.red[w][i];
      scores[e0 + i] = finish_logit(p, v, e0 + i);
    }
    __syncthreads();  // sh.red is reused by the next pass
  }
}

// The j-th pick of a token, in slot `slot`: its local expert (kMoeSlotRemote when another rank
// holds it), its weight in `picked` (remote ones too: the renormalisation sums all k) and, for the
// chunk plan, its expert's count.
__device__ __forceinline__ void record_pick(const MoeParams& p, int slot, int e, float w,
                                            float& picked) {
  const int local = e - p.first_expert;
  const bool here = local >= 0 && local < p.experts;
  p.ids[slot] = here ? local : kMoeSlotRemote;
  picked = w;
  if (here && !p.ids_only) atomicAdd(p.counts + local, 1);
}

// Scores, top-k and weights of token t (one warp; its logits in s, `picked` room for top_k
// weights).
__device__ void select_topk(const MoeParams& p, int t, float* s, unsigned char* taken,
                            float* picked) {
  const int lane = threadIdx.x % 32, E = p.global_experts;
  bool nan = false;
  if (p.sigmoid) {
#pragma unroll 1
    for (int e = lane; e < E; e += 32) nan |= isnan(s[e] = 1.f / (1.f + expf(-s[e])));
  } else {
    float mx = -INFINITY;  // fmaxf skips NaN, as the ref's std::fmax
#pragma unroll 1
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, s[e]);
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll 1
    for (int e = lane; e < E; e += 32) sum += (s[e] = expf(s[e] - mx));
    sum = warp_sum(sum);
#pragma unroll 1
    for (int e = lane; e < E; e += 32) nan |= isnan(s[e] /= sum);
  }
  __syncwarp();
  const int slot0 = t * p.top_k;
  float wsum = 0.f;
  if (p.topk_rank && !__any_sync(kFull, nan)) {
    // Without NaN the pick rule is a strict total order (higher score, then lower id), so the
    // j-th pick is the score with j scores ahead of it: every rank at once, where the arg-max
    // rounds below are top_k dependent warp reductions one after the other.
    constexpr int kPer = kRankMaxExperts / 32;
    float v[kPer];
    int r[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) v[i] = lane + 32 * i < E ? s[lane + 32 * i] : 0.f, r[i] = 0;
#pragma unroll 4
    for (int f = 0; f < E; ++f) {
      const float u = s[f];
#pragma unroll
      for (int i = 0; i < kPer; ++i) r[i] += u > v[i] || (u == v[i] && f < lane + 32 * i);
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (lane + 32 * i < E && r[i] < p.top_k)
        record_pick(p, slot0 + r[i], lane + 32 * i, v[i], picked[r[i]]);
    __syncwarp();
    if (lane == 0)
#pragma unroll 1
      for (int j = 0; j < p.top_k; ++j) wsum += picked[j];  // in pick order, as below
  } else {
#pragma unroll 1
    for (int e = lane; e < E; e += 32) taken[e] = 0;
    __syncwarp();
#pragma unroll 1
    for (int j = 0; j < p.top_k; ++j) {
      int first = INT_MAX, best = INT_MAX;
      float bv = 0.f;
#pragma unroll 1
      for (int e = lane; e < E; e += 32) {
        if (taken[e]) continue;
        first = min(first, e);
        const float v = s[e];
        if (!isnan(v) && (best == INT_MAX || v > bv)) bv = v, best = e;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        first = min(first, __shfl_xor_sync(kFull, first, o));
        const float ov = __shfl_xor_sync(kFull, bv, o);
        const int ob = __shfl_xor_sync(kFull, best, o);
        if (ob != INT_MAX && (best == INT_MAX || ov > bv || (ov == bv && ob < best)))
          bv = ov, best = ob;
      }
      const int pick = isnan(s[first]) ? first : best;
      if (lane == 0) {
        taken[pick] = 1;
        record_pick(p, slot0 + j, pick, s[pick], picked[j]);
        wsum += picked[j];
      }
      __syncwarp();
    }
  }
  // The weights are stored once, by all lanes, from shared memory: renormalising them in place
  // in global memory (p.wts[j] /= wsum, lane 0, one pick after the other) put top_k dependent
  // round trips to the L2 at the end of every routed call's critical path. Same arithmetic:
  // w / wsum, wsum summed in pick order by lane 0.
  const float total = __shfl_sync(kFull, wsum, 0);
#pragma unroll 1
  for (int j = lane; j < p.top_k; j += 32)
    p.wts[slot0 + j] = p.renormalize ? picked[j] / total : picked[j];
}

__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

// The split router's hand-off inside one cluster (p.route_cluster: the token block's gridDim.y
// router blocks, sm_90): every block stores its logits straight into rank 0's scores through
// distributed shared memory, and after one cluster barrier rank 0 has them all; true in rank 0.
// The global hand-off below it costs a fence, a counter and a reload from the L2 on the critical
// path of every routed call.
__device__ bool route_cluster_gather(RouteShared& sh, int tn, int e0, int e1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cg::cluster_group cluster = cg::this_cluster();
  const bool leader = cluster.block_rank() == 0;
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // the arrive at the kernel's start
  if (!leader)
#pragma unroll 1
    for (int i = threadIdx.x; i < tn * (e1 - e0); i += kThreads) {
      const int tk = i / (e1 - e0), e = e0 + i % (e1 - e0);
      *cluster.map_shared_rank(&sh.scores[tk][e], 0) = sh.scores[tk][e];
    }
  cluster.sync();
  return leader;
#else
  return false;  // never launched as a cluster below sm_90 (moe_launch_route)
#endif
}

// The last route block: group the slots by expert and cut the groups into chunks.
__device__ void plan(const MoeParams& p, RouteShared& sh) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, E = p.experts, C = p.chunk;
  if (warp == 0) {  // exclusive scans of the counts and of the chunks per expert
    const int per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
    int cs = 0, ks = 0;
    for (int e = e0; e < e1; ++e) {
      const int c = __ldcg(p.counts + e);
      sh.count[e] = c;
      cs += c, ks += (c + C - 1) / C;
    }
    int ci = cs, ki = ks;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(kFull, ci, o), b = __shfl_up_sync(kFull, ki, o);
      if (lane >= o) ci += a, ki += b;
    }
    int run = ci - cs, krun = ki - ks;
    for (int e = e0; e < e1; ++e) {
      sh.off[e] = run, sh.chunk_off[e] = krun;
      run += sh.count[e], krun += (sh.count[e] + C - 1) / C;
      p.counts[e] = 0;  // read for the last time: back to zero for the next call
    }
    if (lane == 31) sh.valid = ci, p.hdr->chunks = ki;
  }
  for (int i = threadIdx.x; i < kWarps * E; i += kThreads) sh.run[i / E][i % E] = 0;
  __syncthreads();
  const int n = p.slots, seg = (n + kWarps - 1) / kWarps;
  const int s0 = min(n, warp * seg), s1 = min(n, s0 + seg);
  const unsigned below = (1u << lane) - 1;
  for (int base = s0; base < s1; base += 32) {  // per-warp counts of its run
    const int i = base + lane, id = i < s1 ? __ldcg(p.ids + i) : -1;
    const unsigned same = __match_any_sync(kFull, id);
    if (id >= 0 && (same & below) == 0) sh.run[warp][id] += __popc(same);
    __syncwarp();  // the next group's leader may update the same counter
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads) {  // first position of each warp's run
    int at = sh.off[e];
    for (int w = 0; w < kWarps; ++w) {
      const int c = sh.run[w][e];
      sh.run[w][e] = at;
      at += c;
    }
  }
  __syncthreads();
  for (int base = s0; base < s1; base += 32) {
    const int i = base + lane, id = i < s1 ? __ldcg(p.ids + i) : -1;
    const unsigned same = __match_any_sync(kFull, id);
    const int at = id >= 0 ? sh.run[warp][id] : 0;
    __syncwarp();
    if (id >= 0) {
      p.perm[at + __popc(same & below)] = i;
      if ((same & below) == 0) sh.run[warp][id] = at + __popc(same);
    }
    __syncwarp();
  }
  for (int e = threadIdx.x; e < E; e += kThreads) {
    const int c = sh.count[e];
    for (int q = 0; q * C < c; ++q) {
      const int at = sh.chunk_off[e] + q;
      p.chunk_expert[at] = e;
      p.chunk_start[at] = sh.off[e] + q * C;
      p.chunk_len[at] = min(C, c - q * C);
    }
  }
}

// A one-block-per-token-group kernel is latency, and much of it is instruction fetch: the code a
// block runs is fetched cold on every call. So the router runs one token at a time through one
// copy of its code (a rolled loop), and select_topk's loops are rolled. Under ncu on an H200
// (caches flushed) the routing kernel's time fell by two thirds on Mixtral T = 1 from the code
// unrolled for four tokens to select_topk and the router appearing once each (192 -> 85 KB of
// code; the whole op unchanged under graph replay, where the code stays cached), and by a quarter
// on E = 64 top-8 T = 4 with the tokens rolled (the whole op faster at Mixtral T = 4..512 and
// E = 64 T = 16..64; docs/moe.md, fusedmlp_moe_bench).
// COLUMNS: 16-bit router rows in 16-byte pieces (router_logits_columns) or given routing; the
// other routers (router_logits) are the other kernel, so neither path's registers or code shape
// the other's (one kernel with both took 128 registers and a 480-byte stack frame).
template <bool COLUMNS>
__global__ void __launch_bounds__(kThreads) moe_sm80_route(const MoeParams p) {
  __shared__ RouteShared sh;
  // The weight streams wait for this grid (griddepcontrol.wait) before they read the routing, so
  // their blocks may become resident now and request weights the moment the routing is complete.
  if (p.ids_only) pdl_allow_next_grid();
  // Distributed shared memory may be written only once every block of the cluster runs
  // (route_cluster_gather waits for this arrive).
  if (p.route_cluster) cluster_arrive_relaxed();
  const int t0 = blockIdx.x * p.route_tokens, tn = min(p.route_tokens, p.tokens - t0);
  const int warp = threadIdx.x / 32;
  if (p.given) {
    for (int i = threadIdx.x; i < tn * p.top_k; i += kThreads) {
      const int slot = t0 * p.top_k + i, id = p.given_ids[slot];
      const bool valid = id >= 0 && id < p.global_experts;
      const int local = valid ? id - p.first_expert : -1;
      if (!valid) {
        p.ids[slot] = kMoeSlotBad;
        atomicAdd(&p.hdr->errors, 1);
      } else if (local < 0 || local >= p.experts) {
        p.ids[slot] = kMoeSlotRemote;
      } else {
        p.ids[slot] = local;
        p.wts[slot] = p.given_wts[slot];
        if (!p.ids_only) atomicAdd(p.counts + local, 1);
      }
    }
  } else {
    // Split router (host: 16-bit rows in 16-byte pieces): this block's kRouteExperts rows into
    // the logits buffer; the last of the token block's gridDim.y blocks to arrive takes all of
    // them back (re-zeroing the buffer and the counter) and selects. One pass per block instead
    // of E / 16 dependent passes in one block. Each router variant and select_topk appear once:
    // see the code-size note above the kernel.
    const int E = p.global_experts, split = p.route_split > 1;
    const int e0 = split ? int(blockIdx.y) * kRouteExperts : 0;
    const int e1 = split ? min(E, e0 + kRouteExperts) : E;
#pragma unroll 1
    for (int q = 0; q < tn; ++q) {  // one token at a time (see above the kernel)
      if constexpr (!COLUMNS)
        router_logits(p, t0 + q, sh.scores[q]);  // never split (the host splits 16-bit pieces)
      else if (p.rw_t == FMLP_DTYPE_BF16)
        router_logits_columns<__nv_bfloat16>(p, t0 + q, sh.scores[q], sh, e0, e1);
      else
        router_logits_columns<__half>(p, t0 + q, sh.scores[q], sh, e0, e1);
    }
    __syncthreads();
    if (p.route_cluster) {
      if (!route_cluster_gather(sh, tn, e0, e1)) return;
    } else if (split) {
#pragma unroll 1
      for (int i = threadIdx.x; i < tn * (e1 - e0); i += kThreads) {
        const int tk = i / (e1 - e0), e = e0 + i % (e1 - e0);
        p.logits[int64_t(t0 + tk) * E + e] = sh.scores[tk][e];
      }
      if (!block_arrive_last(p.route_parts + blockIdx.x, gridDim.y)) return;
#pragma unroll 1
      for (int i = threadIdx.x; i < tn * E; i += kThreads) {
        float* l = p.logits + int64_t(t0) * E + i;
        sh.scores[i / E][i % E] = __ldcg(l);
        *l = 0.f;
      }
      if (threadIdx.x == 0) p.route_parts[blockIdx.x] = 0;
      __syncthreads();
    }
    if (warp < tn) select_topk(p, t0 + warp, sh.scores[warp], sh.taken[warp], sh.picked[warp]);
  }
  if (p.ids_only) return;
  if (!block_arrive_last(&p.hdr->route_done, gridDim.x)) return;
  plan(p, sh);
  if (threadIdx.x == 0) p.hdr->route_done = 0;
}

// The end of a combine block: the expert kernel's lists and the grouped path's h are not read by
// combine, so any block clears them; the last block clears the routing.
__device__ void combine_clear(const MoeParams& p) {
  const int64_t nb = int64_t(gridDim.x) * gridDim.y;
  const int64_t b = int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
  for (int64_t i = b * kThreads + threadIdx.x; i < p.slots; i += nb * kThreads) p.perm[i] = 0;
  for (int64_t i = b * kThreads + threadIdx.x; i < p.max_chunks; i += nb * kThreads)
    p.chunk_expert[i] = p.chunk_start[i] = p.chunk_len[i] = 0;
  for (int64_t i = b * kThreads + threadIdx.x; i < p.hbuf_words; i += nb * kThreads)
    p.hbuf[i] = make_uint4(0, 0, 0, 0);
  if (!block_arrive_last(&p.hdr->combine_done, unsigned(nb))) return;
  for (int i = threadIdx.x; i < p.slots; i += kThreads) p.ids[i] = 0, p.wts[i] = 0.f;
  if (threadIdx.x == 0) p.hdr->chunks = 0, p.hdr->combine_done = 0;
}

// The token's routing, shared by a combine block: each slot's local expert (< 0: none ran) and
// weight; true when a slot's expert id was out of range.
struct CombineSlots {
  float wt[kMoeMaxExperts];
  int eid[kMoeMaxExperts];
  bool bad;
};

__device__ void combine_load_slots(const MoeParams& p, int t, CombineSlots& cs) {
  if (threadIdx.x == 0) cs.bad = false;
  __syncthreads();
  for (int j = threadIdx.x; j < p.top_k; j += kThreads) {
    cs.eid[j] = p.ids[t * p.top_k + j];
    cs.wt[j] = p.wts[t * p.top_k + j];
    if (cs.eid[j] == kMoeSlotBad) cs.bad = true;
  }
  __syncthreads();
}

// y[t, o] = v (the weighted expert sum) + the slots' weighted b2 + the residual, in that order;
// NaN when a slot's expert id was out of range (never silent).
__device__ void combine_store(const MoeParams& p, const CombineSlots& cs, int t, int o, float v) {
  const size_t es = p.x_t == FMLP_DTYPE_F32 ? 4 : 2;
  if (p.b2)
    for (int j = 0; j < p.top_k; ++j)
      if (cs.eid[j] >= 0)
        v = fmaf(cs.wt[j],
                 load_scalar(fmlp::cuda::expert_vec(p.b2, p.b2_t, p.b2_e, cs.eid[j]), p.b2_t, o),
                 v);
  if (p.res)
    v += load_scalar(static_cast<const char*>(p.res) + int64_t(t) * p.res_ld * es, p.x_t, o);
  if (cs.bad) v = __int_as_float(0x7fc00000);
  store_scalar(static_cast<char*>(p.y) + int64_t(t) * p.y_ld * es, p.x_t, o, v);
}

__global__ void __launch_bounds__(kThreads) moe_sm80_combine(const MoeParams p, int groups) {
  __shared__ float part[kThreads];
  __shared__ CombineSlots cs;
  const int t = blockIdx.x, cols = kThreads / groups;
  const int r = threadIdx.x / cols, c = threadIdx.x % cols, o = blockIdx.y * cols + c;
  const int k = p.top_k;
  const int* eid = cs.eid;
  const float* wt = cs.wt;
  combine_load_slots(p, t, cs);
  // Thread r of a column sums slices r, r + groups, ...; the groups are then added in order.
  float acc = 0.f;
  if (o < p.d_out)
    for (int j = 0; j < k; ++j) {
      if (eid[j] < 0) continue;  // no expert ran: its partials were never written (still zero)
      // Slices r, r + groups, ... in order; loaded kBatch at a time before they are re-zeroed,
      // so a thread waits on memory once per batch rather than once per slice.
      constexpr int kBatch = 8;
      const int64_t step = int64_t(groups) * p.slots * p.d_out;
      float* at = p.out + (int64_t(r) * p.slots + t * k + j) * p.d_out + o;
      float s = 0.f;
      for (int q = r; q < p.out_slices; q += kBatch * groups, at += kBatch * step) {
        const int n = min(kBatch, (p.out_slices - q + groups - 1) / groups);
        float v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) v[u] = u < n ? __ldcg(at + u * step) : 0.f;
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          if (u < n) s += v[u], at[u * step] = 0.f;
      }
      acc = fmaf(wt[j], s, acc);
    }
  part[threadIdx.x] = acc;
  __syncthreads();
  if (r == 0 && o < p.d_out) {
    float v = 0.f;
    for (int q = 0; q < groups; ++q) v += part[q * cols + c];
    combine_store(p, cs, t, o, v);
  }
  combine_clear(p);
}

// moe_sm80_combine for one output slice (the grouped path, and the chunked path's red.add
// buffer): one (token, 1024-column tile) per block, four columns per thread as one 16-byte load
// per slot, the k slots' loads issued together (8 at a time) before any is re-zeroed. Same sums
// in the same order as moe_sm80_combine, which it beats by an order of magnitude under ncu (E = 64
// top-8 2048 -> 1408, T = 512): moe_sm80_combine takes 256 columns per block, a 4-byte load per
// slot, each slot's load issued after the previous slot's re-zeroing store, and took about half
// of the grouped op's time at T = 512 (docs/moe.md; fusedmlp_moe_bench --ts 512).
__global__ void __launch_bounds__(kThreads) moe_sm80_combine_rows(const MoeParams p) {
  __shared__ CombineSlots cs;
  const int t = blockIdx.x, k = p.top_k, o = (blockIdx.y * kThreads + threadIdx.x) * 4;
  const int* eid = cs.eid;
  const float* wt = cs.wt;
  combine_load_slots(p, t, cs);
  if (o < p.d_out) {
    float acc[4] = {};
    constexpr int kBatch = 8;
    for (int j0 = 0; j0 < k; j0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int j = j0 + u;
        v[u] =
            j < k && eid[j] >= 0
                ? __ldcg(reinterpret_cast<const float4*>(p.out + int64_t(t * k + j) * p.d_out + o))
                : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int j = j0 + u;
        if (j >= k || eid[j] < 0) continue;  // no expert ran: its row was never written
        acc[0] = fmaf(wt[j], v[u].x, acc[0]), acc[1] = fmaf(wt[j], v[u].y, acc[1]);
        acc[2] = fmaf(wt[j], v[u].z, acc[2]), acc[3] = fmaf(wt[j], v[u].w, acc[3]);
        *reinterpret_cast<float4*>(p.out + int64_t(t * k + j) * p.d_out + o) =
            make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) combine_store(p, cs, t, o + i, acc[i]);
  }
  combine_clear(p);
}

}  // namespace

// FMLP_MOE_ROUTE_RANK=0 and FMLP_MOE_ROUTE_CLUSTER=0 turn the ranked top-k and the cluster
// hand-off off (A/B).
fmlp_status_t moe_launch_route(const MoeParams& p_in, cudaStream_t s) {
  static const bool rank_on = knob_bool<Knob::FMLP_MOE_ROUTE_RANK>();
  static const bool cluster_on = knob_bool<Knob::FMLP_MOE_ROUTE_CLUSTER>();
  MoeParams p = p_in;
  p.topk_rank = rank_on && p.global_experts <= kRankMaxExperts;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError(), device = -1;
  p.route_cluster = cluster_on && !p.given && p.route_split > 1 &&
                    p.route_split <= kRouteClusterMax && device >= 0 &&
                    cuda_compute_capability(device) >= 90;
  const int blocks = (p.tokens + p.route_tokens - 1) / p.route_tokens;
  const dim3 grid(unsigned(blocks), unsigned(std::max(1, p.route_split)));
  const bool columns = p.given || (p.rw_vec16 && p.d % 8 == 0 &&
                                   (p.rw_t == FMLP_DTYPE_BF16 || p.rw_t == FMLP_DTYPE_F16));
  if (p.route_cluster) {  // columns always: the host splits only 16-bit rows in 16-byte pieces
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kThreads);
    cfg.stream = s;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 1;
    attr.val.clusterDim.y = unsigned(p.route_split);
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    if (const cudaError_t e = cudaLaunchKernelEx(&cfg, moe_sm80_route<true>, p); e != cudaSuccess) {
      cudaGetLastError();
      return fail(FMLP_ERROR_CUDA, "moe_sm80_route launch (a cluster of {} blocks) failed: {}",
                  p.route_split, cudaGetErrorString(e));
    }
  } else if (columns) {
    moe_sm80_route<true><<<grid, kThreads, 0, s>>>(p);
  } else {
    moe_sm80_route<false><<<grid, kThreads, 0, s>>>(p);
  }
  return launch_status("moe_sm80_route");
}

fmlp_status_t moe_launch_combine(const MoeParams& p, cudaStream_t s) {
  if (p.out_slices == 1 && p.d_out % 4 == 0) {
    const dim3 grid(unsigned(p.tokens), unsigned((p.d_out + 4 * kThreads - 1) / (4 * kThreads)));
    moe_sm80_combine_rows<<<grid, kThreads, 0, s>>>(p);
    return launch_status("moe_sm80_combine_rows");
  }
  int groups = 1;  // threads per column summing the slices: up to 8, a power of two
  while (groups < 8 && groups * 2 <= p.out_slices) groups *= 2;
  const int cols = kThreads / groups;
  const dim3 grid(unsigned(p.tokens), unsigned((p.d_out + cols - 1) / cols));
  moe_sm80_combine<<<grid, kThreads, 0, s>>>(p, groups);
  return launch_status("moe_sm80_combine");
}

}  // namespace fmlp::detail
