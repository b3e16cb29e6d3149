// moe_sm80_stream: MoE decode (a few tokens, bf16/f16 experts) as two memory-order weight streams
// (stream_gemv.cuh) after the route kernel (moe_route.cu), no combine launch.
//
// Why: at decode sizes the op is a read of the hit experts' weights, and the stream reads weights
// near copy bandwidth where the chunked kernel's per-chunk mma streaming reached 45 % of it
// (bench/results/moe_chunked_h200.json: Mixtral T = 1 at 374 us against a 168 us floor).
// Every slot (token t, rank j of its top k) is its own set of virtual rows, so the grid and the
// row space depend on the shapes only (no host sync, capturable): a block reads the routing from
// the workspace and skips (reads nothing for) the rows of slots without a local expert.
//   1. moe_sm80_stream_up, grid (blocks, T): block row y is token t; its x is staged in its own
//      dtype (exact). Virtual rows (i, j[, gate|up]) in that order: W1 row i of slot j's expert
//      (gated: gate row i and up row i adjacent, one thread gets both sums). Epilogue: b1, the
//      activation, the gating; h[slot][i] stored in the experts' dtype into the workspace (the
//      rounding PyTorch and moe_sm80_chunked apply).
//   2. moe_sm80_stream_down, grid (blocks, T): the block reads its token's k rows of h where the
//      up launch wrote them (through L1), and the last block to finish re-zeroes h and the routing
//      (the workspace contract). Virtual rows (r, j) with j padded to KP (k rounded up to a power
//      of two), so one thread gets the k slot sums of output r and adds w_j (sum_j + b2) in slot
//      order, then the residual, and writes y: no per-slot outputs, no combine.
// Tokens that share an expert each read its rows, at the same place of the same order at about
// the same time (all blocks are resident), so the repeats mostly hit L2; the entry declines when
// the expected repeats would make L2 the bottleneck (moe_kernels.cpp). fp32 accumulation in a
// fixed order: deterministic. Limits (moe_kernels.cpp): T <= kMoeStreamMaxTokens, k <= 8, the
// staged x (d in x's dtype) within kMoeStreamStageBytes.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/launch_util.hpp"
#include "cuda/moe_cuda.hpp"
#include "cuda/moe_device.cuh"
#include "cuda/ops.cuh"
#include "cuda/stream_gemv.cuh"

namespace fmlp::detail {
namespace {

using fmlp::cuda::activate;
using fmlp::cuda::from_f;
using fmlp::cuda::kStreamThreads;
using fmlp::cuda::kStreamU;
using fmlp::cuda::kStreamWarps;
using fmlp::cuda::load_scalar;
using fmlp::cuda::pdl_allow_next_grid;
using fmlp::cuda::pdl_wait_previous_grid;
using fmlp::cuda::store_scalar;
using fmlp::cuda::stream_begin;
using fmlp::cuda::stream_dispatch_u;
using fmlp::cuda::stream_load;
using fmlp::cuda::stream_pick_loads;
using fmlp::cuda::stream_resident_blocks;
using fmlp::cuda::stream_run_rows;
using fmlp::cuda::stream_shape;
using fmlp::cuda::stream_span;
using fmlp::cuda::StreamShape;

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
  XT* xs = reinterpret_cast<XT*>(smem_v);  // [d]: this block's token
  __shared__ float red[2][kStreamWarps][1];
  __shared__ int eid[kMoeStreamMaxTopK];
  const int t = blockIdx.y, k = p.top_k;
  pdl_wait_previous_grid();  // for the routing (programmatic dependent launch, common.cuh)
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
  if (p.x_vec16) {
    const int words = p.d * int(sizeof(XT)) / 16;  // d is a multiple of 8
    for (int i = threadIdx.x; i < words; i += kStreamThreads)
      smem_v[i] = __ldg(reinterpret_cast<const uint4*>(xr) + i);
  } else {
    for (int i = threadIdx.x; i < p.d; i += kStreamThreads) xs[i] = xr[i];
  }
  __syncthreads();
  WT* hb = reinterpret_cast<WT*>(p.hbuf);  // [slots][hidden]
  auto x_rows = [&](int) { return static_cast<const XT*>(xs); };
  auto store_h = [&](int q, float gate, float up) {
    const int i = q / k, j = q - i * k, e = eid[j];
    if (e < 0) return;
    float h = gate + expert_elem(p.b1, p.b1_t, p.b1_e, e, i);
    h = activate(p.act, h);
    if (gated) h *= up + expert_elem(p.b1, p.b1_t, p.b1_e, e, p.hidden + i);
    hb[int64_t(t * k + j) * p.hidden + i] = from_f<WT>(h);
  };
  if (gated) {
    auto finish = [&](int v, int, const float(&sum)[2]) { store_h(v >> 1, sum[0], sum[1]); };
    stream_run_rows<WT, XT, 1, 2, true>(s, sp, x_rows, row_ptr, finish, cur, red);
  } else {
    auto finish = [&](int v, int, const float(&sum)[1]) { store_h(v, sum[0], 0.f); };
    stream_run_rows<WT, XT, 1, 1, true>(s, sp, x_rows, row_ptr, finish, cur, red);
  }
}

// U = 6 (FMLP_MOE_STREAM_DOWN_U) holds two 6-load batches: three blocks per SM, not four.
template <typename WT, int KP, int U>
__global__ void __launch_bounds__(kStreamThreads, U > 4 ? 3 : 4)
    moe_sm80_stream_down(const MoeParams p, const StreamShape s) {
  __shared__ float red[2][kStreamWarps][1];
  __shared__ int eid[KP];
  __shared__ float wt[KP];
  __shared__ int bad;
  const int t = blockIdx.y, k = p.top_k;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  if (threadIdx.x < KP) {
    const int j = threadIdx.x;
    const int e = j < k ? __ldcg(p.ids + t * k + j) : kMoeSlotRemote;
    eid[j] = e;
    wt[j] = e >= 0 ? __ldcg(p.wts + t * k + j) : 0.f;
    if (e == kMoeSlotBad) bad = 1;  // an expert id was out of range: the row becomes NaN
  }
  __syncthreads();
  const auto sp = stream_span<WT>(s);
  const WT* w2 = static_cast<const WT*>(p.w2);
  // Virtual row v: output r = v / KP of slot j = v % KP (padding slots j >= k have eid < 0).
  auto row_ptr = [&](int v) -> const WT* {
    const int e = eid[v % KP];
    return e < 0 ? nullptr : w2 + int64_t(e) * p.w2_e + int64_t(v / KP) * p.w2_ld;
  };
  uint4 cur[U];
  // The routing read above is complete: every block of the up launch let this launch start only
  // after its own wait for the route kernel. h is not, until stream_begin's wait.
  stream_begin<WT, true>(cur, s, sp, row_ptr, 0);
  // h is read where the up launch left it (L2, then L1: the blocks of one token read the same k
  // rows) rather than staged: staging k x hidden 16-bit values (56 KiB at Mixtral's k = 2) in
  // shared memory left three blocks per SM and 74 % of DRAM bandwidth (ncu), and delayed each
  // block's first FMA by a 56 KiB copy.
  const WT* hrow = reinterpret_cast<const WT*>(p.hbuf) + int64_t(t) * k * p.hidden;
  auto x_rows = [&](int v) {
    const int j = v % KP;
    return hrow + int64_t(j < k ? j : 0) * p.hidden;
  };
  const size_t es = p.x_t == FMLP_DTYPE_F32 ? 4 : 2;
  auto finish = [&](int v, int, const float(&sum)[KP]) {
    const int r = v / KP;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < KP; ++j) {
      const int e = eid[j];
      if (e < 0) continue;
      const float o = sum[j] + expert_elem(p.b2, p.b2_t, p.b2_e, e, r);
      acc = fmaf(wt[j], o, acc);
    }
    if (p.res)
      acc += load_scalar(static_cast<const char*>(p.res) + int64_t(t) * p.res_ld * es, p.x_t, r);
    if (bad) acc = __int_as_float(0x7fc00000);
    store_scalar(static_cast<char*>(p.y) + int64_t(t) * p.y_ld * es, p.x_t, r, acc);
  };
  stream_run_rows<WT, WT, 1, KP, true>(s, sp, x_rows, row_ptr, finish, cur, red);
  // The last block to finish leaves the workspace zeroed: every block's reads of h and of the
  // routing are done once its stream is (their values were used).
  if (!fmlp::cuda::block_arrive_last(&p.hdr->combine_done, gridDim.x * gridDim.y)) return;
  for (int64_t i = threadIdx.x; i < p.hbuf_words; i += kStreamThreads)
    p.hbuf[i] = make_uint4(0, 0, 0, 0);
  for (int i = threadIdx.x; i < p.slots; i += kStreamThreads)
    p.ids[i] = 0, p.wts[i] = 0.f, p.perm[i] = 0;
  for (int i = threadIdx.x; i < p.max_chunks; i += kStreamThreads)
    p.chunk_expert[i] = p.chunk_start[i] = p.chunk_len[i] = 0;  // the route kernel's plan
  if (threadIdx.x == 0) p.hdr->chunks = 0, p.hdr->combine_done = 0;
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
  return launch_rows<&moe_sm80_stream_up<WT, XT>>(p, s, size_t(p.d) * sizeof(XT), w,
                                                  "moe_sm80_stream_up");
}

template <typename WT, int KP>
fmlp_status_t launch_down(const MoeParams& p, const StreamShape& s, const Where& w) {
  if constexpr (KP == 8)
    if (s.u == 6)
      return launch_rows<&moe_sm80_stream_down<WT, 8, 6>>(p, s, 0, w, "moe_sm80_stream_down");
  return stream_dispatch_u(s, [&](auto u) {
    return launch_rows<&moe_sm80_stream_down<WT, KP, decltype(u)::value>>(p, s, 0, w,
                                                                          "moe_sm80_stream_down");
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
  const StreamShape up = stream_shape(int64_t(p.top_k) * rows1, p.d, 2, 1, p.gated ? 2 : 1);
  StreamShape down = stream_shape(int64_t(kp) * p.d_out, p.hidden, 2, 1, kp);
  // E = 64's 1408-wide rows: 176 chunks, two batches either way, 192 loaded at U = 3 against 256
  stream_pick_loads(down, int64_t(p.top_k) * p.d_out * p.hidden * 2);
  // Under ncu (E = 64 T = 1, docs/moe.md session 29) the down streamed at 1.80 TB/s against the
  // up's 3.07, with about 30 % fewer bytes in flight a warp. FMLP_MOE_STREAM_DOWN_U=6 (k = 8 only)
  // reads a 1408-wide row in one batch, 3 KB a warp in flight (FMLP_STREAM_U=3|4 forces the
  // others). Off until measured.
  static const bool six = env_knob("FMLP_MOE_STREAM_DOWN_U", 6, 6, 0) == 6;
  if (six && kp == 8) stream_set_loads(down, 6);
  fmlp_status_t e = p.x_t == FMLP_DTYPE_F32   ? launch_up<WT, float>(p, up, w)
                    : p.x_t == FMLP_DTYPE_F16 ? launch_up<WT, __half>(p, up, w)
                                              : launch_up<WT, __nv_bfloat16>(p, up, w);
  if (e != FMLP_SUCCESS) return e;
  switch (kp) {
    case 1: return launch_down<WT, 1>(p, down, w);
    case 2: return launch_down<WT, 2>(p, down, w);
    case 4: return launch_down<WT, 4>(p, down, w);
    default: return launch_down<WT, 8>(p, down, w);
  }
}

}  // namespace

fmlp_status_t moe_launch_stream(const MoeParams& p, cudaStream_t s) {
  return p.w_t == FMLP_DTYPE_F16 ? launch_all<__half>(p, s) : launch_all<__nv_bfloat16>(p, s);
}

}  // namespace fmlp::detail
