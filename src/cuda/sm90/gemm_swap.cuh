// The sm_90a TMA + wgmma main loop with the operands swapped: the weights are the wgmma's A (M,
// 64 rows a consumer) and a chunk's tokens its B (N = 96 or 160), so a chunk of a few tokens
// costs a weight stream at the copy rate instead of 64-row MMA tiles that are mostly padding
// (moe_sm90_grouped's swapped tiles, moe/sm90_grouped.cu; docs/moe.md).
//
// - A tile is 128 weight rows (PROBLEM::load_a copies them: gate and up rows interleaved in groups
//   of 8, or 128 consecutive W2 rows) x N token rows, k blocks of 64 16-bit elements (one 128-byte
//   swizzle row). A stage holds the weight rows and up to kSwapMaxN token rows in 32-row boxes;
//   only the boxes that hold the chunk's tokens are copied (the full barrier expects exactly
//   those bytes).
// - 1 + 2 warpgroups: WG0 produces (one thread issues the copies); consumer c owns weight rows
//   c * 64 .. + 63 (m64nNk16, N / 2 fp32 accumulators a thread; ptxas allocates the 168
//   registers a thread that a 384-thread block compiles to, whatever setmaxnreg grants later).
// - Persistent: one block per SM walks tiles t = blockIdx.x, + gridDim.x, ...
//
// PROBLEM (a struct passed by value) gives:
//   int tiles() const, int k_blocks() const, SwapTile tile(int t) const
//   void load_a(void* dst, const CUtensorMap* ta, uint64_t* bar, int kb, const SwapTile&) const
//       issues the TMA copies of the tile's 128 weight rows of k block kb (kSwapTileA bytes)
//   template <int N> void epilogue(const float (&d)[N / 2], const SwapTile&, int row, int col)
//       a thread's accumulators: weight rows row (+ 8) of the tile, token columns col + 8 j
//       (+ 1), j < N / 8; d[4 j + 2 i + q] is row + 8 i, column col + 8 j + q.
// The device code exists only in the sm_90a compile (FMLP_SM90A, async.cuh).
#pragma once
#include "cuda/sm90/gemm_pipe.cuh"

namespace fmlp::cuda::sm90 {

constexpr int kSwapBoxT = 32;   // token rows per TMA box (and N's granularity)
constexpr int kSwapMaxN = 160;  // tokens per tile: 80 accumulators a consumer thread

struct SwapShape {
  static constexpr int kThreads = 384;
  static constexpr uint32_t kTileA = 128 * kPipeBK * 2;
  static constexpr uint32_t kBoxB = kSwapBoxT * kPipeBK * 2;
  static constexpr uint32_t kStageBytes = kTileA + kSwapMaxN * kPipeBK * 2;  // 36 KiB
  // 6 stages: 96 KiB of weights in flight a multiprocessor.
  static constexpr int kStages = int((232448 - 1024 - 8 * 16) / kStageBytes);
  static constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 2 * kStages * 8 + 1024;
};

struct SwapTile {
  int e;      // the chunk's expert
  int b_row;  // first token row
  int len;    // valid token rows
  int nt;     // the problem's weight tile
};

#ifdef FMLP_SM90A

// One tile's k loop and epilogue for a consumer warpgroup, at the tile's N.
template <typename T, int N, typename PROBLEM>
__device__ __forceinline__ void swap_consume(const PROBLEM& pr, const SwapTile& tl,
                                             unsigned char* smem, uint64_t* full, uint64_t* empty,
                                             int& stage, uint32_t& phase, int k_blocks, int c) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  float d[N / 2];
  int prev = 0;
  for (int kb = 0; kb < k_blocks; ++kb) {
    mbar_wait(&full[stage], phase);
    __syncwarp();  // the wgmma instructions below are .sync.aligned: the warp must be converged
    const uint32_t base = smem_u32(smem + stage * SwapShape::kStageBytes);
    const uint64_t da = smem_desc(base + uint32_t(c) * (64 * kPipeBK * 2));
    const uint64_t db = smem_desc(base + SwapShape::kTileA);
    fence_acc(d);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kPipeBK / 16; ++kk)
      wgmma_m64nk16<T, N>(d, da + 2 * kk, db + 2 * kk, (kb | kk) != 0);
    wgmma_commit();
    fence_acc(d);
    // The previous stage's wgmmas are complete once at most this stage's group is pending.
    wgmma_wait<1>();
    fence_acc(d);
    if (kb > 0 && lane == 0) mbar_arrive(&empty[prev]);
    prev = stage;
    if (++stage == SwapShape::kStages) stage = 0, phase ^= 1;
  }
  wgmma_wait<0>();
  fence_acc(d);
  if (lane == 0) mbar_arrive(&empty[prev]);
  pr.template epilogue<N>(d, tl, c * 64 + warp * 16 + lane / 4, 2 * (lane % 4));
}

// The kernel body (every thread of a SwapShape::kThreads block calls it, with kSmemBytes of
// dynamic shared memory at smem_raw): ta maps the weights (PROBLEM::load_a reads it), tb the
// tokens (kSwapBoxT-row boxes).
template <typename T, typename PROBLEM>
__device__ __forceinline__ void gemm_sm90_swap(unsigned char* smem_raw, const CUtensorMap* ta,
                                               const CUtensorMap* tb, const PROBLEM& pr) {
  using S = SwapShape;
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kStages * S::kStageBytes);
  uint64_t* empty = full + S::kStages;
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      mbar_init(&full[s], 1);   // the producer's arrive.expect_tx
      mbar_init(&empty[s], 8);  // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int tiles = pr.tiles(), k_blocks = pr.k_blocks();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x != 0) return;
    prefetch_tensormap(ta);
    prefetch_tensormap(tb);
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const SwapTile tl = pr.tile(t);
      const int boxes = (tl.len + kSwapBoxT - 1) / kSwapBoxT;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(&empty[stage], phase ^ 1);  // a fresh barrier passes parity 1 at once
        unsigned char* st = smem + stage * S::kStageBytes;
        // Out-of-bounds box parts count too.
        mbar_expect_tx(&full[stage], S::kTileA + uint32_t(boxes) * S::kBoxB);
        pr.load_a(st, ta, &full[stage], kb, tl);
        for (int b = 0; b < boxes; ++b)
          tma_load(st + S::kTileA + b * S::kBoxB, tb, &full[stage], kb * kPipeBK,
                   tl.b_row + b * kSwapBoxT);
        if (++stage == S::kStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1;
  int stage = 0;
  uint32_t phase = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const SwapTile tl = pr.tile(t);
    // Two instantiated N: ptxas (13.0) spills the accumulators of every variant once a third one
    // (or a switch) joins them. Columns past the chunk compute on whatever the stage holds there
    // (MMA columns are independent) and are never stored.
    if (tl.len <= 96)
      swap_consume<T, 96>(pr, tl, smem, full, empty, stage, phase, k_blocks, c);
    else
      swap_consume<T, 160>(pr, tl, smem, full, empty, stage, phase, k_blocks, c);
  }
}

#endif  // FMLP_SM90A

}  // namespace fmlp::cuda::sm90
