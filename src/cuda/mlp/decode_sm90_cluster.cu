// mlp_decode_sm90_cluster: the whole MLP of up to 64 tokens in one launch, on the tensor cores,
// with thread-block clusters sharing the hidden activations.
//
// Decode reads every weight once; the kernel is built so that every block streams long
// contiguous runs of weights with many 16-byte loads in flight, and so that the partial outputs
// that cross blocks stay few.
//   * Every block owns a contiguous slice of the hidden dimension (whole 16-unit tiles, dealt
//     evenly). Phase 1: warps take 16-row groups of W1 (gated: gate and up groups) and multiply
//     them with the normalised tokens using mma.sync m16n8k16, weights as the A operand loaded
//     straight from global memory (no shared-memory staging: a lane's 16-byte load of one row is
//     its A fragment once the k order inside each 32-column step is permuted the same way for
//     both operands), tokens as the B operand from shared memory, staged in chunks. When a block
//     has fewer row groups than warps, warps split each chunk's columns and add their partials in
//     shared memory. The hidden activations go to shared memory (rounded to the weight dtype, as
//     PyTorch rounds them) and never touch global memory.
//   * The C blocks of a cluster then exchange their hidden slices through distributed shared
//     memory, so each block holds the cluster's whole slice (C times wider) and in phase 2 owns
//     1/C of the output rows: W2 (nn.Linear layout) is read in C-times longer contiguous runs
//     per row and the fp32 partial outputs that cross blocks shrink C-fold.
//   * Partial outputs go to an fp32 workspace with vector reductions; per 16-row output group, the
//     warp that adds the last contribution (a counter) adds b2 and the residual, writes y and
//     re-zeroes the workspace, so the next call or graph replay needs no memset.
// Not deterministic (the reduction order varies); deterministic mode goes to the splitk kernel.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/engines/mma_stream.cuh"
#include "cuda/mlp/entries.hpp"

namespace fmlp::detail {
namespace {

namespace cg = cooperative_groups;
using fmlp::cuda::activate;
using fmlp::cuda::Frags;
using fmlp::cuda::from_f;
using fmlp::cuda::ld_stream_v4;
using fmlp::cuda::load_scalar;
using fmlp::cuda::mma_step;
using fmlp::cuda::opt;
using fmlp::cuda::pipelined;
using fmlp::cuda::prime;
using fmlp::cuda::store_scalar;
using fmlp::cuda::widen_e4m3x8_to;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTokens = 64;

struct ClusterParams : fmlp::cuda::DecodeOperands, fmlp::cuda::Fp8Scales {
  float* acc;          // [n][mp] fp32 partial outputs, zero between calls
  unsigned* counters;  // [ceil(n / 16)] contributions per output row group, zero between calls
  int tiles;           // hidden / 16
  int parts;           // warps sharing one row group (column split of every chunk)
  int kc;              // staged x chunk width in columns, a multiple of 32 * steps * parts
  int xs_stride;       // elements per staged x row
  int hs_stride;       // elements per row of a block's hidden slice
  int hc_stride;       // elements per row of the cluster's hidden slice
  int res_rows;        // rows of the phase-1 result buffer (max row groups * 16)
  int region_bytes;    // bytes of the region shared by (results + x chunks) and the cluster slice
  bool x_vec16;        // x rows can be read with 16-byte loads
};

// The weights' storage per 16-byte load: 8 WT values (a 32-column step per 4 lanes) or 16 e4m3
// values (a 64-column step; each lane's 16 columns are two 8-column halves, multiplied with the
// matching halves of the token rows, so the k permutation stays the same as for 16-bit).
template <typename WT, bool FP8>
struct Storage {
  using T = std::conditional_t<FP8, uint8_t, WT>;
  static constexpr int kStepCols = FP8 ? 64 : 32;
  static constexpr int kLaneCols = FP8 ? 16 : 8;
};

// c += rows (one storage step of rows g and g + 8) x tokens (xrow: this lane's columns of one
// token row in shared memory, or nullptr for a padding token).
template <typename WT, bool FP8>
__device__ __forceinline__ void mma_storage_step(float (&c)[4], const uint4& rg, const uint4& rg8,
                                                 const WT* xrow) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  if constexpr (FP8) {
    const uint4 x0 = xrow ? *reinterpret_cast<const uint4*>(xrow) : zero;
    const uint4 x1 = xrow ? *reinterpret_cast<const uint4*>(xrow + 8) : zero;
    mma_step<WT>(c, widen_e4m3x8_to<WT>(rg.x, rg.y), widen_e4m3x8_to<WT>(rg8.x, rg8.y), x0);
    mma_step<WT>(c, widen_e4m3x8_to<WT>(rg.z, rg.w), widen_e4m3x8_to<WT>(rg8.z, rg8.w), x1);
  } else {
    mma_step<WT>(c, rg, rg8, xrow ? *reinterpret_cast<const uint4*>(xrow) : zero);
  }
}

[[maybe_unused]] __device__ __forceinline__ uint4 lds128(const void* p) {
  return *static_cast<const uint4*>(p);
}

[[maybe_unused]] __device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}
[[maybe_unused]] __device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}

// Per-token mean and 1/std for the pre-norm; one warp per token, x read from L2.
template <typename WT>
__device__ void token_stats(const ClusterParams& p, float* mean, float* inv) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int m = warp; m < p.m; m += kWarps) {
    const WT* row = static_cast<const WT*>(p.x) + int64_t(m) * p.x_ld;
    float s = 0.f;
    if (p.norm == FMLP_NORM_LAYERNORM)
      for (int c = lane; c < p.k; c += 32) s += load_scalar(row, p.act_t, c);
    const float mu = p.norm == FMLP_NORM_LAYERNORM ? fmlp::cuda::warp_sum(s) / float(p.k) : 0.f;
    float q = 0.f;
    for (int c = lane; c < p.k; c += 32) {
      const float d = load_scalar(row, p.act_t, c) - mu;
      q += d * d;
    }
    q = fmlp::cuda::warp_sum(q);
    if (lane == 0) {
      mean[m] = mu;
      inv[m] = rsqrtf(q / float(p.k) + p.eps);
    }
  }
}

// Stage columns [c0, c0 + kc) of the M tokens (normalised, as WT) into xs; zeros past d_in.
template <typename WT>
__device__ void stage_chunk(const ClusterParams& p, WT* xs, int c0, const float* mean,
                            const float* inv) {
  const int vecs = p.kc / 8;
  for (int v = threadIdx.x; v < p.m * vecs; v += kThreads) {
    const int m = v / vecs, c = c0 + (v % vecs) * 8;
    const WT* row = static_cast<const WT*>(p.x) + int64_t(m) * p.x_ld;
    uint4 out = make_uint4(0, 0, 0, 0);
    if (c < p.k) {
      if (p.norm == FMLP_NORM_NONE && p.x_vec16) {
        out = *reinterpret_cast<const uint4*>(row + c);
      } else {
        WT e[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float f = load_scalar(row, p.act_t, c + i);
          if (p.norm != FMLP_NORM_NONE)
            f = (f - mean[m]) * inv[m] * opt(p.gamma, p.gamma_t, c + i, 1.f) +
                opt(p.beta, p.beta_t, c + i, 0.f);
          e[i] = from_f<WT>(f);
        }
        out = *reinterpret_cast<const uint4*>(e);
      }
    }
    *reinterpret_cast<uint4*>(xs + m * p.xs_stride + (v % vecs) * 8) = out;
  }
}

// Pipeline shape per token-tile count: 32-column steps per lane per load (phase 1: per part,
// phase 2: per W2 batch) and how many loads are in flight; fewer with more token tiles, whose
// accumulators take the registers (128 per thread at 512 threads).
template <int NT>
struct Pipe {
  static constexpr int kSteps = NT >= 8 ? 2 : 4;
  static constexpr int kDepth = 2;
};

template <int NT, typename WT, bool FP8>
__global__ void __launch_bounds__(kThreads, 1) mlp_decode_sm90_cluster(const ClusterParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float mean[kMaxTokens], inv[kMaxTokens];
  constexpr int SP = Pipe<NT>::kSteps, DEPTH = Pipe<NT>::kDepth;
  using ST = typename Storage<WT, FP8>::T;
  constexpr int kStep = Storage<WT, FP8>::kStepCols, kLane = Storage<WT, FP8>::kLaneCols;
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int G = gridDim.x, b = blockIdx.x, b0 = b - rank;
  const int t0 = int(int64_t(p.tiles) * b / G), t1 = int(int64_t(p.tiles) * (b + 1) / G);
  const int tc0 = int(int64_t(p.tiles) * b0 / G), tc1 = int(int64_t(p.tiles) * (b0 + C) / G);
  const int T = t1 - t0, S = T * 16, SC = (tc1 - tc0) * 16;
  const bool gated = p.wu != nullptr;
  const int R = gated ? 2 * T : T;

  float* res = reinterpret_cast<float*>(smem);                          // [res_rows][m]
  WT* xs = reinterpret_cast<WT*>(smem + size_t(p.res_rows) * p.m * 4);  // [1|2][m][xs_stride]
  WT* hc = reinterpret_cast<WT*>(smem);                                 // [m][hc_stride]
  WT* hl = reinterpret_cast<WT*>(smem + p.region_bytes);                // [m][hs_stride]

  for (int i = threadIdx.x; i < R * 16 * p.m; i += kThreads) res[i] = 0.f;
  if (p.norm != FMLP_NORM_NONE) token_stats<WT>(p, mean, inv);
  __syncthreads();

  // Phase 1: hidden slice -> res (fp32), in passes of kWarps (row group, part) items. One
  // iteration covers bs columns (SP steps of every part); x is staged in chunks of kc columns (a
  // multiple of bs, the whole row when it fits), with block barriers only between chunks.
  const int bs = kStep * SP * p.parts, iters = (p.k + bs - 1) / bs, per_chunk = p.kc / bs;
  const bool chunked = per_chunk < iters;
  for (int pass = 0; pass * kWarps < R * p.parts; ++pass) {
    const int item = pass * kWarps + warp;
    const bool active = item < R * p.parts;
    const int rg = active ? item / p.parts : 0, part = item % p.parts;
    const ST* rows =
        rg < T ? static_cast<const ST*>(p.wg) + int64_t(t0 * 16 + rg * 16) * p.wg_ld
               : static_cast<const ST*>(p.wu) + int64_t(t0 * 16 + (rg - T) * 16) * p.wu_ld;
    const int64_t ld = rg < T ? p.wg_ld : p.wu_ld;
    const ST* row_g = rows + g * ld;
    const ST* row_g8 = rows + (g + 8) * ld;
    float c[NT][4] = {};
    Frags<SP> ring[DEPTH];
    auto load = [&](Frags<SP>& w, int i) {
#pragma unroll
      for (int s = 0; s < SP; ++s) {
        const int col = i * bs + (part * SP + s) * kStep + kLane * t;
        const bool in = active && col < p.k;
        w.v[s][0] = in ? ld_stream_v4(row_g + col) : make_uint4(0, 0, 0, 0);
        w.v[s][1] = in ? ld_stream_v4(row_g8 + col) : make_uint4(0, 0, 0, 0);
      }
    };
    auto body = [&](const Frags<SP>& w, int i) {
      const int chunk = i / per_chunk;
      if (chunked && i % per_chunk == 0 && (chunk + 1) * p.kc < p.k)
        stage_chunk<WT>(p, xs + ((chunk + 1) & 1) * p.m * p.xs_stride, (chunk + 1) * p.kc, mean,
                        inv);
      if (active) {
        const WT* xb = xs + (chunk & 1) * p.m * p.xs_stride + (i % per_chunk) * bs;
#pragma unroll
        for (int s = 0; s < SP; ++s) {
          const int col = (part * SP + s) * kStep + kLane * t;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const int m = nt * 8 + g;
            mma_storage_step<WT, FP8>(c[nt], w.v[s][0], w.v[s][1],
                                      m < p.m ? xb + m * p.xs_stride + col : nullptr);
          }
        }
      }
      if (chunked && (i % per_chunk == per_chunk - 1 || i == iters - 1)) __syncthreads();
    };
    prime(iters, ring, load);
    if (chunked || pass == 0) stage_chunk<WT>(p, xs, 0, mean, inv);
    __syncthreads();
    pipelined<DEPTH>(iters, ring, load, body);
    if (active) {
      float scale[2] = {1.f, 1.f};  // rows g and g + 8
      if constexpr (FP8) {
        const int unit = t0 * 16 + (rg < T ? rg : rg - T) * 16 + g;
        const float* sp = rg < T ? p.sg : p.su;
        const int stride = rg < T ? p.sg_stride : p.su_stride;
        scale[0] = sp[unit * stride];
        scale[1] = sp[(unit + 8) * stride];
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = rg * 16 + g + (i >= 2 ? 8 : 0), m = nt * 8 + 2 * t + (i & 1);
          if (m < p.m) atomicAdd(res + row * p.m + m, c[nt][i] * scale[i / 2]);
        }
    }
    __syncthreads();  // res complete; xs free for the next pass
  }

  // h = act(gate + bg) [* (up + bu)] for the block's slice, rounded to WT, into hl.
  const int h0 = t0 * 16;
  for (int i = threadIdx.x; i < S * p.m; i += kThreads) {
    const int j = i / p.m, m = i % p.m;
    float v = activate(p.act, res[j * p.m + m] + opt(p.bg, p.bg_t, h0 + j, 0.f));
    if (gated) v *= res[(S + j) * p.m + m] + opt(p.bu, p.bu_t, h0 + j, 0.f);
    hl[m * p.hs_stride + j] = from_f<WT>(v);
  }

  // Phase 2 owns output row groups [og0, og1) of this cluster rank; a warp takes every kWarps-th.
  const int og_all = (p.n + 15) / 16;
  const int og0 = int(int64_t(og_all) * rank / C), og1 = int(int64_t(og_all) * (rank + 1) / C);
  const int my_ogs = og1 - og0 > warp ? (og1 - og0 - warp + kWarps - 1) / kWarps : 0;
  const int steps = (SC + kStep - 1) / kStep, batches = (steps + SP - 1) / SP;
  const int total = my_ogs * batches;
  const ST* w2_cluster = static_cast<const ST*>(p.w2) + tc0 * 16;
  Frags<SP> ring2[DEPTH];
  auto load2 = [&](Frags<SP>& w, int q) {
    const int o = (og0 + warp + (q / batches) * kWarps) * 16 + g, batch = q % batches;
#pragma unroll
    for (int s = 0; s < SP; ++s) {
      const int col = (batch * SP + s) * kStep + kLane * t;
      const bool in = col < SC;
      w.v[s][0] = in && o < p.n ? ld_stream_v4(w2_cluster + int64_t(o) * p.w2_ld + col)
                                : make_uint4(0, 0, 0, 0);
      w.v[s][1] = in && o + 8 < p.n ? ld_stream_v4(w2_cluster + int64_t(o + 8) * p.w2_ld + col)
                                    : make_uint4(0, 0, 0, 0);
    }
  };
  // The warp that adds the last contribution to a row group finishes it: + b2, + residual, write
  // y, re-zero the accumulators and the counter. Counted after the warp's whole stream, so the
  // fence does not stall the weight loads in flight.
  auto finish = [&](int og) {
    const int rows = min(16, p.n - og * 16), count = rows * p.m;
    const size_t es = sizeof(WT);
    constexpr int kBatch = 8;  // loads first, then stores: y may alias the residual
    for (int base = 0; base < count; base += 32 * kBatch) {
      float v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * 32 + lane, m = i / rows, oo = og * 16 + i % rows;
        v[u] = 0.f;
        if (i >= count) continue;
        v[u] = __ldcg(p.acc + int64_t(oo) * (NT * 8) + m) + opt(p.b2, p.b2_t, oo, 0.f);
        if (p.res)
          v[u] += load_scalar(static_cast<const char*>(p.res) + m * p.res_ld * es, p.act_t, oo);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * 32 + lane, m = i / rows, oo = og * 16 + i % rows;
        if (i >= count) continue;
        p.acc[int64_t(oo) * (NT * 8) + m] = 0.f;
        store_scalar(static_cast<char*>(p.y) + m * p.y_ld * es, p.act_t, oo, v[u]);
      }
    }
    if (lane == 0) p.counters[og] = 0;
  };
  // The first W2 batches do not depend on h: they are requested before the hidden slices are
  // exchanged. With C > 1 they go out between the cluster barrier's arrive and its wait: the
  // arrive's release is a GPU-scope fence (MEMBAR.ALL.GPU) that waits for every load in flight, so
  // with them requested before it (a cluster.sync() after them) each block would first wait for
  // its W2 batches to arrive and only then for the other blocks: 1-5 % slower in a same-call A/B
  // (fp8 and bf16, gpt2-small and llama3-8b at M = 4 and 16; fusedmlp_cuda_bench --kernel
  // mlp_decode_sm90_cluster).
  if (C > 1) cluster_arrive();  // this rank's slice is in its shared memory
  prime(total, ring2, load2);

  const WT* hsrc = hl;
  int hstride = p.hs_stride;
  if (C > 1) {
    cluster_wait();  // every rank's is
    for (int q = 0; q < C; ++q) {
      const int qb = b0 + q;
      const int qt0 = int(int64_t(p.tiles) * qb / G), qt1 = int(int64_t(p.tiles) * (qb + 1) / G);
      const WT* remote = cluster.map_shared_rank(hl, q);
      const int vecs = (qt1 - qt0) * 2;  // 16-byte vectors per token row
      for (int i = threadIdx.x; i < p.m * vecs; i += kThreads) {
        const int m = i / vecs, v = i % vecs;
        *reinterpret_cast<uint4*>(hc + m * p.hc_stride + (qt0 - tc0) * 16 + v * 8) =
            lds128(remote + m * p.hs_stride + v * 8);
      }
    }
    cluster_arrive();  // done reading the other ranks; matched by the wait before exit
    hsrc = hc;
    hstride = p.hc_stride;
  }
  __syncthreads();

  const unsigned contributions = unsigned(G / C);  // one block per cluster adds to a row group
  float c2[NT][4] = {};
  auto body2 = [&](const Frags<SP>& w, int q) {
    const int batch = q % batches;
#pragma unroll
    for (int s = 0; s < SP; ++s) {
      const int col = (batch * SP + s) * kStep + kLane * t;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int m = nt * 8 + g;
        mma_storage_step<WT, FP8>(c2[nt], w.v[s][0], w.v[s][1],
                                  m < p.m && col < SC ? hsrc + m * hstride + col : nullptr);
      }
    }
    if (batch != batches - 1) return;
    const int og = og0 + warp + (q / batches) * kWarps, o = og * 16 + g;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int m = nt * 8 + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int oo = o + half * 8;
        float* dst = p.acc + int64_t(oo) * (NT * 8) + m;
        float scale = 1.f;
        if constexpr (FP8) scale = oo < p.n ? p.s2[oo * p.s2_stride] : 0.f;
        if (oo < p.n && m + 1 < p.m)
          fmlp::cuda::red_add_v2_f32(dst, c2[nt][2 * half] * scale, c2[nt][2 * half + 1] * scale);
        else if (oo < p.n && m < p.m)
          fmlp::cuda::red_add_f32(dst, c2[nt][2 * half] * scale);
        c2[nt][2 * half] = c2[nt][2 * half + 1] = 0.f;
      }
    }
  };
  pipelined<DEPTH>(total, ring2, load2, body2);
  __threadfence();
  __syncwarp();
  for (int i = 0; i < my_ogs; ++i) {
    const int og = og0 + warp + i * kWarps;
    unsigned last = 0;
    if (lane == 0) last = atomicAdd(p.counters + og, 1u) == contributions - 1;
    if (!__shfl_sync(0xffffffffu, last, 0)) continue;
    __threadfence();
    finish(og);
  }
  if (C > 1) cluster_wait();  // no rank leaves while another may still read its slice
#endif
}

// ---- host side ----

struct Plan {
  int cluster = 1, blocks = 0;
  ClusterParams shape{};  // the size fields of the params
  size_t smem = 0;
};

int round_up(int v, int to) {
  return (v + to - 1) / to * to;
}

// Row stride (elements of 2 bytes) whose byte size is 64 mod 128, so the 8 rows one 16-byte
// fragment load touches land in distinct shared-memory banks.
int conflict_free_stride(int cols) {
  const int s = round_up(std::max(cols, 32), 32);
  return (s * 2) % 128 == 0 ? s + 32 : s;
}

int token_tiles(int m) {
  return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
}

// Shared memory layout for one grid; sizes every block can need (slices differ by one tile).
// x is staged whole when it fits (no block barriers in phase 1), else in double-buffered chunks.
void size_plan(const MlpDesc& d, int cluster, int blocks, Plan* pl) {
  constexpr int kWholeX = 160 * 1024, kChunkX = 96 * 1024;
  const int m = int(d.m), sp = token_tiles(m) >= 8 ? 2 : 4;    // Pipe<NT>::kSteps
  const int step = d.w_dtype == FMLP_DTYPE_F8_E4M3 ? 64 : 32;  // Storage<>::kStepCols
  const int tiles = int(d.hidden / 16), k = int(d.d_in);
  const int tmax = (tiles + blocks - 1) / blocks;
  const int rmax = d.gated ? 2 * tmax : tmax;
  int parts = std::max(1, std::min(kWarps / rmax, 16));
  while (parts > 1 && step * sp * (parts - 1) >= k) --parts;  // no part left without columns
  const int bs = step * sp * parts, k_round = round_up(k, bs);
  ClusterParams& s = pl->shape;
  s.tiles = tiles;
  s.parts = parts;
  const bool whole = size_t(m) * conflict_free_stride(k_round) * 2 <= size_t(kWholeX);
  s.kc = whole ? k_round : std::max(bs, kChunkX / (4 * m) / bs * bs);
  s.xs_stride = conflict_free_stride(s.kc);
  s.hs_stride = conflict_free_stride(tmax * 16);
  const int sc_max = ((tiles * cluster + blocks - 1) / blocks + 1) * 16;
  s.hc_stride = conflict_free_stride(sc_max);
  s.res_rows = rmax * 16;
  const size_t phase1 = size_t(s.res_rows) * m * 4 + size_t(whole ? 1 : 2) * m * s.xs_stride * 2;
  const size_t cluster_slice = cluster > 1 ? size_t(m) * s.hc_stride * 2 : 0;
  s.region_bytes = int(round_up(int(std::max(phase1, cluster_slice)), 16));
  pl->smem = size_t(s.region_bytes) + size_t(m) * s.hs_stride * 2;
  pl->cluster = cluster;
  pl->blocks = blocks;
}

template <int NT, typename WT>
auto kernel_of(bool fp8) {
  return fp8 ? &mlp_decode_sm90_cluster<NT, WT, true> : &mlp_decode_sm90_cluster<NT, WT, false>;
}

using KernelFn = void (*)(ClusterParams);

// The tensor cores run in the activation dtype; fp8 weights are widened to it in registers.
KernelFn pick_kernel(const MlpDesc& d) {
  const bool h = d.act_dtype == FMLP_DTYPE_F16, f8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  switch (token_tiles(int(d.m))) {
    case 1: return h ? kernel_of<1, __half>(f8) : kernel_of<1, __nv_bfloat16>(f8);
    case 2: return h ? kernel_of<2, __half>(f8) : kernel_of<2, __nv_bfloat16>(f8);
    case 4: return h ? kernel_of<4, __half>(f8) : kernel_of<4, __nv_bfloat16>(f8);
    default: return h ? kernel_of<8, __half>(f8) : kernel_of<8, __nv_bfloat16>(f8);
  }
}

cudaLaunchConfig_t launch_config(const Plan& pl, cudaLaunchAttribute* attr, cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(pl.blocks));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = pl.smem;
  cfg.stream = s;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = unsigned(pl.cluster);
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Cluster size: FMLP_DECODE_CLUSTER (1, 2, 4 or 8; a tuning knob for the benchmarks) or the
// largest size whose grid still covers >= 90 % of the multiprocessors and whose shared memory
// fits. The grid is one block per multiprocessor, all co-resident.
bool make_plan(const MlpDesc& d, Plan* pl, std::string* why) {
  // The attribute and occupancy queries below act on the current device: make it the tensors'.
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return (*why = last_error(), false);
  const int sms = cuda_sm_count(d.device_id), tiles = int(d.hidden / 16);
  const int limit = cuda_max_dynamic_smem(d.device_id, 1024);
  static const int forced = int(knob_int_or<Knob::FMLP_DECODE_CLUSTER>(0));  // 1, 2, 4 or 8
  KernelFn k = pick_kernel(d);
  for (int c : {8, 4, 2, 1}) {
    if (forced && c != forced) continue;
    int blocks = std::min(tiles, sms) / c * c;
    if (blocks == 0) continue;
    Plan cand;
    size_plan(d, c, blocks, &cand);
    if (cand.smem > size_t(limit)) continue;
    if (c > 1) {
      if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, limit) !=
          cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      cudaLaunchAttribute attr;
      cudaLaunchConfig_t cfg = launch_config(cand, &attr, nullptr);
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, k, &cfg) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      blocks = std::min(blocks, clusters * c);
      if (!forced && blocks * 10 < sms * 9 && blocks < tiles) continue;
      if (blocks == 0) continue;
      size_plan(d, c, blocks, &cand);
    }
    *pl = cand;
    return true;
  }
  *why = fmt::format("M={} x d_in={} (hidden {}) needs more shared memory than cuda:{} has", d.m,
                     d.d_in, d.hidden, d.device_id);
  return false;
}

// make_plan queries the device (occupancy of clusters); dispatch asks on every call, so plans
// are kept per shape.
bool cached_plan(const MlpDesc& d, Plan* pl, std::string* why) {
  using Key = std::array<int64_t, 8>;
  static std::mutex mu;
  static std::map<Key, std::pair<bool, Plan>> cache;
  const Key key{
      d.device_id,         d.m, d.d_in, d.hidden, d.d_out, d.gated ? 1 : 0, int64_t(d.w_dtype),
      int64_t(d.act_dtype)};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    Plan p;
    std::string w;
    const bool ok = make_plan(d, &p, &w);
    it = cache.emplace(key, std::make_pair(ok, p)).first;
    if (!ok) *why = w;
  }
  if (!it->second.first && why->empty())
    *why = fmt::format("M={} x d_in={} (hidden {}) needs more shared memory than cuda:{} has", d.m,
                       d.d_in, d.hidden, d.device_id);
  *pl = it->second.second;
  return it->second.first;
}

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

}  // namespace

bool mlp_decode_sm90_cluster_supports(const MlpDesc& d, std::string* why) {
  if (d.deterministic)
    return (*why = "deterministic mode: the splitk kernel reduces in a fixed order", false);
  if (d.m > kMaxTokens)
    return (*why = fmt::format("M={} > {}: decode kernels take at most {} tokens", d.m, kMaxTokens,
                               kMaxTokens),
            false);
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  if (fp8 ? d.act_dtype == FMLP_DTYPE_F32 : d.act_dtype != d.w_dtype)
    return (*why = fmt::format("{} activations with {} weights: the tensor cores run bf16 or "
                               "fp16 activations with weights of that dtype or fp8 e4m3; the "
                               "splitk kernel handles other mixes",
                               fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype)),
            false);
  if (d.w_dtype == FMLP_DTYPE_F32)
    return (*why = "f32 weights: this kernel multiplies 16-bit operands on tensor cores", false);
  const int in_multiple = fp8 ? 16 : 8;  // one 16-byte load of a weight row
  if (d.d_in % in_multiple != 0 || d.hidden % 16 != 0)
    return (*why = fmt::format("d_in {} must be a multiple of {} and hidden {} of 16; the splitk "
                               "kernel handles other sizes",
                               d.d_in, in_multiple, d.hidden),
            false);
  if (!d.weights_vec16)
    return (*why =
                "a weight matrix is not 16-byte aligned (base or row stride); pack the "
                "weights with fmlp_mlp_pack",
            false);
  if (d.d_in > (int64_t(1) << 28) || d.hidden > (int64_t(1) << 28) || d.d_out > (int64_t(1) << 28))
    return (*why = "sizes above 2^28 need 64-bit indexing", false);
  Plan pl;
  return cached_plan(d, &pl, why);
}

size_t mlp_decode_sm90_cluster_workspace(const MlpDesc& d) {
  return align256(size_t(d.d_out) * size_t(token_tiles(int(d.m)) * 8) * 4) +
         align256(size_t((d.d_out + 15) / 16) * sizeof(unsigned));
}

fmlp_status_t mlp_decode_sm90_cluster_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws,
                                          void* stream) {
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  Plan pl;
  std::string why;
  if (!cached_plan(d, &pl, &why)) return fail(FMLP_ERROR_NOT_SUPPORTED, "{}", why);
  ClusterParams p = pl.shape;
  static_cast<fmlp::cuda::DecodeOperands&>(p) = fmlp::cuda::decode_operands(a, d);
  char* base = static_cast<char*>(ws);
  p.acc = reinterpret_cast<float*>(base);
  p.counters = reinterpret_cast<unsigned*>(
      base + align256(size_t(d.d_out) * size_t(token_tiles(int(d.m)) * 8) * 4));
  p.x_vec16 = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && p.x_ld % 8 == 0;
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3)
    static_cast<fmlp::cuda::Fp8Scales&>(p) = fmlp::cuda::fp8_scales(a, d);

  KernelFn k = pick_kernel(d);
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       cuda_max_dynamic_smem(d.device_id, 1024));
  if (e == cudaSuccess) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = launch_config(pl, &attr, static_cast<cudaStream_t>(stream));
    e = cudaLaunchKernelEx(&cfg, k, p);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA,
                "mlp_decode_sm90_cluster launch ({} blocks, cluster {}, {} bytes of shared "
                "memory) failed: {}",
                pl.blocks, pl.cluster, pl.smem, cudaGetErrorString(e));
  }
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
