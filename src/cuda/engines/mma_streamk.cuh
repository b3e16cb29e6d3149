// The stream-K tensor-core weight stream: Y[rows, tokens] = W[rows, k] . X[tokens, k]^T for up to
// 64 tokens, W read once, every multiprocessor busy to the end. Shared by the batched decode
// entries (mlp/decode_sm80_mma_streamk.cu).
//
// Why this shape of kernel: at 2..64 tokens a decode GEMM is still a read of W (64 tokens of
// bf16 are 64 flops a weight byte, a third of what an H100's tensor cores do per byte of HBM),
// so what matters is that every multiprocessor streams its share of W at the rate of a plain
// read until the very end. A GEMM tile walk does not: one 16-row x K tile a warp is 224 tiles of
// 128 rows for llama3-8b's gate/up, 1.7 rounds of 132 multiprocessors, the last round on 92
// (docs/decode.md: the swapped-tile decode kernel that lost). Here:
//   - a tile is 16 * WARPS rows of W (one 16-row mma group a warp) over all of k, cut into
//     chunks of kc columns; the tiles' chunks form one sequence of iterations, and block b takes
//     the contiguous run [iters * b / blocks, iters * (b + 1) / blocks) of it (stream-K), so
//     blocks get the same number of weight bytes whatever the tile count,
//   - W is the mma.sync m16n8k16 A operand loaded straight from global memory (a lane's 16-byte
//     piece of row g / g + 8 is its fragment under the k permutation of mma_stream.cuh), DEPTH
//     32-column steps in flight per warp in a register ring that runs on across chunk and tile
//     boundaries,
//   - the tokens are the B operand: each chunk's [tokens, kc] slice is staged by cp.async into one
//     of two shared-memory buffers while the block works on the other, shared by its WARPS
//     warps (the x bytes a block re-reads from L2 are tokens / (16 * WARPS) of its W bytes),
//   - a tile a block holds whole is finished from registers (`epi`); a tile split between
//     blocks (at most the first and last of each block's run) is finished by the block that
//     arrives last on its counter, which sums the fp32 partials in block order (deterministic for
//     a given grid) and re-zeroes the tile's counter.
// The tile counters are left zero (the zeroed part of the workspace, fusedmlp.h); the partial
// slots are scratch: every slot a finisher reads was written in the same call.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/engines/mma_stream.cuh"

namespace fmlp::cuda {

// The partition of one stream-K GEMM (host-computed by mma_streamk_shape).
struct MmaStreamKShape {
  int n, k;    // rows of W (virtual rows: a gated W1's gate and up halves, mlp decode) and columns
  int kc;      // columns per chunk: a multiple of 64 (bank-conflict-free rows) and of 32 * DEPTH
  int tiles;   // ceil(n / (16 * WARPS))
  int chunks;  // ceil(k / kc)
  int iters;   // tiles * chunks
  int blocks;  // grid, <= iters
};

// The workspace one stream-K GEMM counts and sums in: tile counters [tiles] (zero between calls)
// and two partial slots a block ([blocks][2][WARPS * 32 * NT * 4] floats, the lanes' accumulators
// in [warp][register][lane] order; scratch).
struct MmaStreamKScratch {
  unsigned* tile_count;
  float* slots;
};

// Floats in one partial slot.
constexpr int mma_streamk_slot_floats(int warps, int nt) {
  return warps * 32 * nt * 4;
}

inline MmaStreamKShape mma_streamk_shape(int64_t n, int64_t k, int warps, int kc, int max_blocks) {
  MmaStreamKShape s{};
  s.n = int(n);
  s.k = int(k);
  s.kc = kc;
  s.tiles = int((n + 16 * warps - 1) / (16 * warps));
  s.chunks = int((k + kc - 1) / kc);
  s.iters = s.tiles * s.chunks;
  s.blocks = s.iters < max_blocks ? s.iters : max_blocks;
  if (s.blocks < 1) s.blocks = 1;
  return s;
}

// Whether the run arithmetic below fits 32 bits (iters * blocks < 2^31): callers check it on the
// host (a 64-bit division in the kernel is a long subroutine that holds many registers).
inline bool mma_streamk_fits(const MmaStreamKShape& s) {
  return int64_t(s.iters) * (s.blocks + 1) < (int64_t(1) << 31);
}

// First iteration of block b's run.
__host__ __device__ __forceinline__ int mma_streamk_begin(const MmaStreamKShape& s, int b) {
  return int(unsigned(s.iters) * unsigned(b) / unsigned(s.blocks));
}

// The block whose run holds iteration i.
__device__ __forceinline__ int mma_streamk_owner(const MmaStreamKShape& s, int i) {
  return int((unsigned(i + 1) * unsigned(s.blocks) - 1u) / unsigned(s.iters));
}

// Elements a staged token row takes in shared memory, so that the two token rows a quarter-warp
// reads fall in different banks: 8 columns a lane and step (a lane reads 16 bytes of each 64) want
// a row stride of an odd multiple of 64 bytes (kc + 32), 16 columns (16 bytes of each 32: the two
// halves of its 16 columns) an odd multiple of 16 (kc + 8).
__host__ __device__ constexpr int mma_streamk_xs_stride(int kc, bool lane16) {
  return lane16 ? kc + 8 : kc + 32;
}

// Shared memory of a block: two staged chunks of NT * 8 token rows of 16-bit values.
inline size_t mma_streamk_smem(int nt, int kc, bool lane16) {
  return size_t(2) * nt * 8 * mma_streamk_xs_stride(kc, lane16) * 2;
}

// 16 bytes from global to shared memory, or zeros where `in` is false (cp.async's source size 0).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool in) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int bytes = in ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(bytes)
               : "memory");
}

// The stream itself, for block blockIdx.x; every thread of the block calls it.
//   WT: the weights' element, bf16 / fp16 (the mma's type, XT) or e4m3 (uint8_t: a lane's
//     16-byte load is 16 columns of a 64-column step, widened exactly to XT, whose two halves
//     meet the matching 8-column pieces of the tokens, so the k permutation stays the 16-bit
//     one),
//   row_ptr(v): the W row of virtual row v, or nullptr for a row that is not there (its results
//     are zero and never finished),
//   x: the tokens, [m][x_ld] values of XT, 16-byte aligned rows (x_ld a multiple of 8), `m` <=
//     NT * 8 of them; k a multiple of 16 / sizeof(WT) (columns past k read as zero),
//   xs: the block's shared memory (mma_streamk_smem bytes),
//   epi(tile, acc): finishes this warp's 16 rows of `tile` (rows tile * 16 * WARPS + 16 * warp +
//     g and + 8 of lane (g, t) = (lane / 4, lane % 4), tokens nt * 8 + 2t and + 1 in
//     acc[nt][0..1] and acc[nt][2..3]),
//   before_x(): runs once the first weights are requested, before X is read (programmatic
//     dependent launch's wait goes there).
template <int WARPS, int NT, int DEPTH, typename WT, typename XT, bool WIDE, typename RowPtr,
          typename Epi, typename BeforeX>
__device__ __forceinline__ void mma_streamk_run(const MmaStreamKShape& s, RowPtr row_ptr,
                                                const XT* x, int64_t x_ld, int m,
                                                const MmaStreamKScratch& scr, XT* xs, Epi epi,
                                                BeforeX before_x) {
  constexpr bool kFp8 = sizeof(WT) == 1;
  // A lane's columns of a load step: 8 (one 16-byte piece of a 16-bit row), or 16 (fp8: one
  // piece; WIDE 16-bit: two adjacent pieces, so each quad of lanes reads 128 contiguous bytes of
  // a row a step instead of 64). 16 columns are two 8-column halves against matching pieces of
  // the tokens.
  constexpr int kLaneCols = kFp8 || WIDE ? 16 : 8;
  constexpr int kStepCols = 4 * kLaneCols;                   // columns of one step
  constexpr int kPieces = kLaneCols * int(sizeof(WT)) / 16;  // 16-byte loads a row
  static_assert(!(kFp8 && WIDE), "fp8 steps are 64 columns already");
  constexpr int kThreads = WARPS * 32;
  constexpr int kRows = 16 * WARPS;
  constexpr int kSlot = mma_streamk_slot_floats(WARPS, NT);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int b = blockIdx.x;
  const int it0 = mma_streamk_begin(s, b), it1 = mma_streamk_begin(s, b + 1);
  if (it0 >= it1) {
    before_x();
    return;
  }
  const int spc = s.kc / kStepCols;  // steps per chunk
  const int xs_stride = mma_streamk_xs_stride(s.kc, kLaneCols == 16);
  const int nsteps = (it1 - it0) * spc;

  // ---- the weight loader: steps in order over the run, its own (tile, chunk, step) position
  int l_tile = it0 / s.chunks, l_chunk = it0 % s.chunks, l_sub = 0;
  const WT* pg = nullptr;
  const WT* pg8 = nullptr;
  auto rows_of = [&](int tile) {
    const int v = tile * kRows + warp * 16 + g;
    pg = row_ptr(v);
    pg8 = row_ptr(v + 8);
  };
  rows_of(l_tile);
  // f.v[piece][0 | 1]: rows g | g + 8.
  auto load = [&](Frags<kPieces>& f) {
    const int col = (l_chunk * spc + l_sub) * kStepCols + kLaneCols * t;
#pragma unroll
    for (int q = 0; q < kPieces; ++q) {
      const int c = col + q * 8;  // k is a multiple of 16 / sizeof(WT): a piece is whole
      const bool in = c < s.k;
      f.v[q][0] = in && pg ? ld_stream_v4(pg + c) : make_uint4(0, 0, 0, 0);
      f.v[q][1] = in && pg8 ? ld_stream_v4(pg8 + c) : make_uint4(0, 0, 0, 0);
    }
    if (++l_sub == spc) {
      l_sub = 0;
      if (++l_chunk == s.chunks) {
        l_chunk = 0;
        rows_of(++l_tile);
      }
    }
  };
  Frags<kPieces> ring[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH - 1; ++d)
    if (d < nsteps) load(ring[d]);
  before_x();

  // ---- X staging: the chunk of iteration `it` into buffer `buf`
  auto stage = [&](int it, int buf) {
    const int chunk = it % s.chunks;
    const int c0 = chunk * s.kc;
    const int vecs = s.kc / 8;  // 16-byte pieces of a token row in a chunk
    XT* dst = xs + buf * (NT * 8 * xs_stride);
    for (int q = threadIdx.x; q < NT * 8 * vecs; q += kThreads) {
      const int tok = q / vecs, c = c0 + (q - tok * vecs) * 8;
      const bool in = tok < m && c < s.k;
      cp_async16_zfill(dst + tok * xs_stride + (c - c0), in ? x + tok * x_ld + c : x, in);
    }
    cp_async_commit();
  };
  stage(it0, 0);

  // ---- the compute side
  int c_chunk = it0 % s.chunks, c_tile = it0 / s.chunks;
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  // A split tile's counter answer is read one tile late: thread 0 issues the atomicAdd and the
  // block goes on streaming; the answer is published in shared memory before a barrier the block
  // passes anyway (its next tile end's, or the run's end), so no round trip to L2 stalls the
  // weight stream between two barriers.
  __shared__ int last_tile;  // the split tile this block is to finish (-1: none)
  // Thread 0's pending add: its answer in a register (a shared-memory store of an atomic's answer
  // would wait for it), what it was for (t_tile -1: none) in shared memory (registers are what
  // the widest instances are short of).
  unsigned t_old = 0u;
  __shared__ int t_tile, t_n;
  if (threadIdx.x == 0) t_tile = -1;
  auto slot_of = [&](int tile, int blk) {
    const int which = mma_streamk_begin(s, blk) / s.chunks == tile ? 0 : 1;
    return scr.slots + (int64_t(blk) * 2 + which) * kSlot;
  };
  // Whether this block was the last to add its part of tile t_tile (all threads, after a barrier
  // that follows thread 0's publication): if so it sums every part in block order
  // (deterministic), this block's own too, and finishes the tile; acc must be free.
  auto publish_tile = [&]() {
    if (threadIdx.x == 0) {
      const bool last = t_tile >= 0 && t_old == unsigned(t_n) - 1u;
      if (last) __threadfence();
      last_tile = last ? t_tile : -1;
      t_tile = -1;
    }
  };
  auto finish_pending = [&]() {
    const int tile = last_tile;
    if (tile < 0) return;
    const int first = tile * s.chunks;
    const int c_first = mma_streamk_owner(s, first),
              c_last = mma_streamk_owner(s, first + s.chunks - 1);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    for (int blk = c_first; blk <= c_last; ++blk) {
      float* sl = slot_of(tile, blk) + warp * (NT * 4 * 32) + lane;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] += __ldcg(sl + (nt * 4 + i) * 32);
    }
    epi(tile, acc);
    if (threadIdx.x == 0) scr.tile_count[tile] = 0;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  };

  // A tile ends in this block: whole (finish from registers) or a part (partial sums to the
  // block's slot; the last of the tile's blocks to add finishes it, see finish_pending).
  auto end_tile = [&](int tile) {
    const int first = tile * s.chunks, last_it = first + s.chunks - 1;
    const int c_first = mma_streamk_owner(s, first), c_last = mma_streamk_owner(s, last_it);
    if (c_first == c_last) {
      epi(tile, acc);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
      return;
    }
    float* mine = slot_of(tile, b) + warp * (NT * 4 * 32) + lane;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) __stcg(mine + (nt * 4 + i) * 32, acc[nt][i]);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    publish_tile();   // an earlier split tile of this run (its add has had a whole tile's time)
    __syncthreads();  // every part of this slot is written; last_tile is visible
    finish_pending();
    if (threadIdx.x == 0) {
      __threadfence();
      t_old = atomicAdd(scr.tile_count + tile, 1u);
      t_tile = tile;
      t_n = c_last - c_first + 1;
    }
  };

  for (int c_it = it0; c_it < it1; ++c_it) {
    const int j = c_it - it0;
    // A new chunk: its X is staged; start staging the next one.
    cp_async_wait<0>();
    __syncthreads();  // the chunk is visible; every warp is done with the other buffer
    const XT* xbuf = xs + (j & 1) * (NT * 8 * xs_stride);
    if (c_it + 1 < it1) stage(c_it + 1, (j + 1) & 1);
    const XT* xr = xbuf + g * xs_stride + kLaneCols * t;
    for (int s0 = 0; s0 < spc; s0 += DEPTH) {  // spc is a multiple of DEPTH: ring slots line up
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) {
        const int i = j * spc + s0 + d;
        if (i + DEPTH - 1 < nsteps) load(ring[(d + DEPTH - 1) % DEPTH]);
        const Frags<kPieces>& f = ring[d];
        const XT* xc = xr + (s0 + d) * kStepCols;
        if constexpr (kFp8) {
          const uint4 g_lo = widen_e4m3x8_to<XT>(f.v[0][0].x, f.v[0][0].y);
          const uint4 g8_lo = widen_e4m3x8_to<XT>(f.v[0][1].x, f.v[0][1].y);
          const uint4 g_hi = widen_e4m3x8_to<XT>(f.v[0][0].z, f.v[0][0].w);
          const uint4 g8_hi = widen_e4m3x8_to<XT>(f.v[0][1].z, f.v[0][1].w);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const XT* xt = xc + nt * 8 * xs_stride;
            mma_step<XT>(acc[nt], g_lo, g8_lo, *reinterpret_cast<const uint4*>(xt));
            mma_step<XT>(acc[nt], g_hi, g8_hi, *reinterpret_cast<const uint4*>(xt + 8));
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int q = 0; q < kPieces; ++q)
              mma_step<XT>(acc[nt], f.v[q][0], f.v[q][1],
                           *reinterpret_cast<const uint4*>(xc + nt * 8 * xs_stride + q * 8));
        }
      }
    }
    if (c_chunk + 1 == s.chunks || c_it + 1 == it1) end_tile(c_tile);
    if (++c_chunk == s.chunks) {
      c_chunk = 0;
      ++c_tile;
    }
  }
  // The add still pending: the run's last split tile (a barrier first: a warp may still be
  // reading the last_tile an earlier tile end published).
  __syncthreads();
  publish_tile();
  __syncthreads();
  finish_pending();
}

}  // namespace fmlp::cuda
