// moe_sm80_grouped, the expert part for many tokens per expert: two smem-tiled tensor-core GEMMs
// over the route kernel's chunk list (a chunk = up to BM slots of one expert, BM = 64 or 128).
// Grids are max_chunks x N tiles (a bound from the shapes alone, so nothing depends on the
// routing and the op stays capturable); blocks past the actual chunk count exit at once. Blocks
// of one N tile and consecutive chunks are adjacent in the grid, so the chunks of one expert read
// its weight tiles at about the same time (L2 hits after the first).
//
//   gate/up  A = the chunk's token rows of x (gathered through the slot permutation), B = W1[e]
//            rows (nn.Linear layout: K-contiguous, a "TN" GEMM). Gated: the block's 128 B rows
//            interleave 8 gate rows with the 8 up rows of the same units, so a thread holds the
//            gate and up sums of its units and the epilogue forms h = act(gate + bg) * (up + bu)
//            (dense: act(acc + b1)), rounds it to the weights' dtype (as PyTorch does) and stores
//            it to the [slots, hidden] workspace buffer at the chunk's positions.
//   down     A = those h rows (contiguous), B = W2[e] rows; fp32 results stored to the per-slot
//            output rows (row = the slot id) that the combine kernel reads, adds b2 to, weights,
//            sums in j order and re-zeroes (it re-zeroes h as well).
// Each output element is one block's fixed-order sum: reruns are bitwise equal.
//
// Tiles: BM x 128 x 64, 4 warps (2 along M x 2 along N, warp tile BM/2 x 64: 8 ldmatrix.x4 feed
// 32 mma at BM = 128), mma.sync m16n8k16 with fp32 accumulators, ldmatrix.x4 for both operands
// (double-buffered in registers across the k16 steps), cp.async.cg 16-byte copies in a 3-stage
// (BM = 128) or 4-stage (BM = 64) ring of 96 KiB: two blocks per multiprocessor (up to 255
// registers a thread, which the 64 x 64 warp tile needs: 128 accumulators + 2 x 32 fragments). A
// 128-byte smem row holds 8 pieces of 16 bytes stored at piece ^ (row % 8), so the 8 rows an
// ldmatrix phase reads (and the rows a warp's copies write) fall in distinct banks. N tiles past
// the matrix load its last row (valid addresses, results dropped, never stored).
//
// Short chunks (an expert's last one, or a whole expert below BM slots) would otherwise multiply
// BM rows (measured on an H200: a fifth off Mixtral T = 1 with the skip; T = 512, mostly full
// chunks, unchanged). So the GEMM works in whole m16 tiles
// of the chunk: tile i (rows 16 i .. 16 i + 15) is both copy i of every thread's A copies and m16
// tile i % kMI of warp row i / kMI, and it is live while 16 i < len. Dead tiles are neither
// copied, read by ldmatrix nor multiplied (a warp with none skips its B fragments as well), so
// their smem rows stay stale with no reader. Rows past len inside a live tile load the chunk's
// last row as before (finite data, results dropped, never stored). Live tiles run the same mmas
// in the same k order as without the skip: valid rows are bitwise unchanged. Every warp still
// takes part in every copy, commit, wait and barrier, so the pipeline stays in lockstep; the tests
// are block- or warp-uniform, so no mma or ldmatrix runs with part of a warp.
//
// fp8 e4m3 experts (FP8, sm_89+; the scheme in fp8.cuh): A is fp16 (x staged as fp16 with a
// power of two per token; h likewise per slot, see below) and B the e4m3 rows, 64 bytes per
// stage row, widened by cvt.rn.f16x2.e4m3x2 just before fp16 mma.sync. The k permutation: a B
// row's 16-byte piece ks of a stage holds k 16 ks .. 16 ks + 15 (one k16 step). ldmatrix.x4 over
// four n8 tiles gives lane (g, t) the 4 bytes 4t .. 4t + 3 of row g's piece of each, so the
// step maps k slots 2t, 2t+1 (b0) to k 16 ks + 4t, +1 and slots 2t+8, 2t+9 (b1) to 16 ks + 4t +
// 2, +3 (the two halves of that word after the widening); over t these are the step's 16 k once
// each. A takes the same map: a0 / a2 of row g are the 8 bytes at element 16 ks + 4t of the fp16
// row, one 8-byte shared load (a1 / a3 likewise for row g + 8). fp8 B rows are swizzled as piece
// ^ ((row / 2) % 4) (two 64-byte rows per 128 bytes), so the 8 rows of an ldmatrix phase hit
// distinct banks; the 8-byte A loads of a warp touch each 16-byte column of the A swizzle twice
// (two wavefronts for 256 bytes: no conflict). The gate/up epilogue multiplies the sums by the
// token's factor and the W1 scale of the row, then forms h in fp32 into a [slots, hidden] buffer;
// moe_sm89_stage_f16 stages each slot's row as fp16 with the power of two of its largest finite
// |h| over all hidden units (known only once every N tile is done, hence the extra pass), and the
// down epilogue multiplies by the inverse and the W2 scale of the output row.
#include <cuda_runtime.h>

#include <type_traits>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/launch_util.hpp"
#include "cuda/engines/mma_stream.cuh"
#include "cuda/moe/device.cuh"
#include "cuda/moe/fp8.cuh"
#include "cuda/moe/moe_cuda.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::activate;
using fmlp::cuda::cp_async_commit;
using fmlp::cuda::cp_async_wait;
using fmlp::cuda::expert_row_scale;
using fmlp::cuda::load_scalar;
using fmlp::cuda::mma;
using fmlp::cuda::pack2;

constexpr int kThreads = 128;       // 4 warps: 2 along M x 2 along N
constexpr int kBN = 128;            // B rows per block
constexpr int kBK = kMoeGroupedK;   // K per stage: one 128-byte smem row
constexpr int kRowBytes = kBK * 2;  // of 16-bit elements
constexpr int kPieces = kRowBytes / 16;
constexpr int kSteps = kBK / 16;  // k16 mma steps per stage

// FP8: B rows are e4m3, kBK bytes per stage row.
template <int BM, bool FP8 = false>
struct Tiles {
  static constexpr int kStages = BM == 64 ? 4 : 3;
  static constexpr int kWarpM = BM / 2, kWarpN = kBN / 2;
  static constexpr int kMI = kWarpM / 16;               // m16 tiles per warp
  static constexpr int kNJ = kWarpN / 8;                // n8 tiles per warp
  static constexpr int kCopyRows = kThreads / kPieces;  // rows one pass of copies covers
  static_assert(kCopyRows == 16, "copy i of A must be exactly block m16 tile i (live-tile test)");
  static constexpr int kARows = BM / kCopyRows;  // A rows a thread copies per stage
  static constexpr int kBRowBytes = FP8 ? kBK : kRowBytes;
  static constexpr int kBPieces = kBRowBytes / 16;
  static constexpr int kBCopyRows = kThreads / kBPieces;
  static constexpr int kBRows = kBN / kBCopyRows;
  static constexpr int kAStage = BM * kRowBytes, kBStage = kBN * kBRowBytes;
  static constexpr int kSmem = kStages * (kAStage + kBStage);
};

// Tile row that copy i of this thread fills (its piece is threadIdx.x % kPieces).
__device__ __forceinline__ int copy_row(int i) {
  return int(threadIdx.x) / kPieces + i * (kThreads / kPieces);
}

// B tile row that B copy i of this thread fills (the same as copy_row for 16-bit B).
template <bool FP8>
__device__ __forceinline__ int b_copy_row(int i) {
  using T = Tiles<64, FP8>;
  return int(threadIdx.x) / T::kBPieces + i * T::kBCopyRows;
}

// The L2 128-byte prefetch hint is what ptxas chose by itself for these copies (8 threads fill
// one 128-byte row) until the kernels also held the trimmed loop; stated here, it no longer
// depends on that heuristic.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(src)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void lds_v2(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(addr));
}

// The A and B fragments of one k16 step of a warp tile (FP8: b holds 4 e4m3 per n8 tile).
template <int BM, bool FP8 = false>
struct Frags {
  uint32_t a[Tiles<BM>::kMI][4];
  uint32_t b[Tiles<BM>::kNJ][FP8 ? 1 : 2];
};

// acc += A B^T over k_tiles * kBK columns; with TRIM only for the m16 tiles of A that hold one of
// its first `rows` rows (1 <= rows <= BM; acc of the other tiles is left as it was). a[i] / b[i]:
// start of tile row copy_row(i) of A (BM rows) / B (kBN rows), both K-contiguous; they are
// advanced as the stages are requested.
// Software pipeline (one __syncthreads per stage): the fragments of step ks + 1 are loaded into
// the other register buffer before step ks's mmas, the last step's loads read the next stage, and
// the copies of stage kt + kStages - 1 are issued at step 0 of stage kt.
// B element type: e4m3 bytes (FP8) or WT.
template <typename WT, bool FP8>
using BElem = std::conditional_t<FP8, uint8_t, WT>;

template <int BM, typename WT, bool TRIM, bool FP8>
__device__ __forceinline__ void gemm_tile(float (&acc)[Tiles<BM>::kMI][Tiles<BM>::kNJ][4],
                                          const WT* (&a)[Tiles<BM>::kARows],
                                          const BElem<WT, FP8>* (&b)[Tiles<BM, FP8>::kBRows],
                                          int k_tiles, int rows) {
  using T = Tiles<BM, FP8>;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem));
  const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int piece = tid % kPieces;
#pragma unroll
  for (int i = 0; i < T::kARows; ++i) a[i] += piece * 8;
  const int b_piece = tid % T::kBPieces;
#pragma unroll
  for (int i = 0; i < T::kBRows; ++i) b[i] += b_piece * (FP8 ? 16 : 8);
  // copy_row(i) % 8 is the same for every i: one swizzled offset serves all copies.
  const int row0 = copy_row(0);
  const uint32_t put = row0 * kRowBytes + ((piece ^ (row0 % 8)) << 4);
  // FP8 B: b_copy_row(i) / 2 % 4 is the same for every i likewise.
  const int b_row0 = b_copy_row<FP8>(0);
  const uint32_t b_put = FP8 ? b_row0 * T::kBRowBytes + ((b_piece ^ (b_row0 / 2 % 4)) << 4) : put;
  const uint32_t b_base = base + T::kStages * T::kAStage;
  // This warp's live m16 tiles (a prefix of its kMI): block tile warp / 2 * kMI + mi is live while
  // its first row is below `rows`. The broadcast tells the compiler that the count is warp-uniform:
  // it then branches around the mmas and predicates the ldmatrix instead of putting a WARPSYNC in
  // front of each (which also split the schedule).
  const int live =
      TRIM ? __shfl_sync(~0u, min(T::kMI, max(0, (rows - warp / 2 * T::kWarpM + 15) / 16)), 0)
           : T::kMI;
  auto request = [&](int stage) {
    const uint32_t sa = base + stage * T::kAStage + put, sb = b_base + stage * T::kBStage + b_put;
#pragma unroll
    for (int i = 0; i < T::kARows; ++i) {
      if (!TRIM || i * T::kCopyRows < rows)  // block tile i live (block-uniform)
        cp_async16(sa + i * T::kCopyRows * kRowBytes, a[i]);
      a[i] += kBK;
    }
#pragma unroll
    for (int i = 0; i < T::kBRows; ++i) {
      cp_async16(sb + i * T::kBCopyRows * T::kBRowBytes, b[i]);
      b[i] += kBK;
    }
  };
  // ldmatrix.x4 sources. A (m16 x k16): lanes 0-15 rows 0-15 at k 0-7, lanes 16-31 rows 0-15 at
  // k 8-15, giving a0..a3 of mma.m16n8k16. B (two n8 tiles x k16, rows = n): lanes 0-7 n 0-7 k 0-7,
  // 8-15 n 0-7 k 8-15, 16-23 n 8-15 k 0-7, 24-31 n 8-15 k 8-15: b0, b1 of both n tiles. Every
  // source row is a multiple of 8 plus lane % 8, so its swizzle term is lane % 8; the piece of
  // k16 step ks is 2 ks + (0 or 1), and 2 ks ^ x = 2 ks + x for x < 2.
  // FP8 (file comment): A row g of the warp's first m16 tile, the 8 bytes at element 4t of a
  // 16-element step; B rows lane of the warp's N half (ldmatrix.x4 over n8 tiles lane / 8 + 4q).
  const int g = lane / 4, t = lane % 4;
  const uint32_t a_src = FP8 ? base + (warp / 2 * T::kWarpM + g) * kRowBytes + (t % 2) * 8
                             : base + (warp / 2 * T::kWarpM + lane % 16) * kRowBytes;
  const uint32_t b_src =
      FP8 ? b_base + (warp % 2 * T::kWarpN + lane) * T::kBRowBytes
          : b_base + (warp % 2 * T::kWarpN + lane % 8 + lane / 16 * 8) * kRowBytes;
  const uint32_t a_x = uint32_t((lane / 16) ^ (lane % 8)),
                 b_x = uint32_t((lane / 8 % 2) ^ (lane % 8));
  auto load = [&](Frags<BM, FP8>& f, uint32_t sa, uint32_t sb, int ks) {
    if constexpr (FP8) {
      const uint32_t ao = uint32_t((2 * ks + t / 2) ^ g) << 4;  // row % 8 = g: the A swizzle
      const uint32_t bo = uint32_t(ks ^ (lane % 8 / 2)) << 4;   // row / 2 % 4 = lane % 8 / 2
#pragma unroll
      for (int mi = 0; mi < T::kMI; ++mi)
        if (mi < live) {
          lds_v2(sa + mi * 16 * kRowBytes + ao, f.a[mi][0], f.a[mi][2]);
          lds_v2(sa + (mi * 16 + 8) * kRowBytes + ao, f.a[mi][1], f.a[mi][3]);
        }
      if (live == 0) return;
#pragma unroll
      for (int q = 0; q < T::kNJ / 4; ++q)
        ldsm_x4(sb + q * 32 * T::kBRowBytes + bo, f.b[4 * q][0], f.b[4 * q + 1][0],
                f.b[4 * q + 2][0], f.b[4 * q + 3][0]);
      return;
    }
    const uint32_t ao = (a_x ^ uint32_t(2 * ks)) << 4, bo = (b_x ^ uint32_t(2 * ks)) << 4;
#pragma unroll
    for (int mi = 0; mi < T::kMI; ++mi)
      if (mi < live)
        ldsm_x4(sa + mi * 16 * kRowBytes + ao, f.a[mi][0], f.a[mi][1], f.a[mi][2], f.a[mi][3]);
    if (live == 0) return;
#pragma unroll
    for (int nj = 0; nj < T::kNJ; nj += 2)
      ldsm_x4(sb + nj * 8 * kRowBytes + bo, f.b[nj][0], f.b[nj][1], f.b[nj + 1][0], f.b[nj + 1][1]);
  };

#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) {
    if (s < k_tiles) request(s);
    cp_async_commit();
  }
  cp_async_wait<T::kStages - 2>();  // this thread's copies of stage 0 landed ...
  __syncthreads();                  // ... everyone's too
  Frags<BM, FP8> f[2];
  uint32_t sa = a_src, sb = b_src;
  load(f[0], sa, sb, 0);
  int rd = 0, wr = T::kStages - 1;
  for (int kt = 0; kt < k_tiles; ++kt) {
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      // Step ks + 1's fragments; after the barrier of step kSteps - 2 these are the next stage's.
      if (ks + 1 < kSteps || kt + 1 < k_tiles) load(f[(ks + 1) % 2], sa, sb, (ks + 1) % kSteps);
      if (ks == 0) {
        // The slot of stage kt - 1: every warp finished reading it before the last barrier.
        if (kt + T::kStages - 1 < k_tiles) request(wr);
        cp_async_commit();
        wr = wr + 1 == T::kStages ? 0 : wr + 1;
      }
      const Frags<BM, FP8>& c = f[ks % 2];
      if constexpr (FP8) {
        if (live > 0) {
          uint32_t bw[T::kNJ][2];  // k 16 ks + 4t, +1 and + 2, +3 of row g (file comment)
#pragma unroll
          for (int nj = 0; nj < T::kNJ; ++nj)
            bw[nj][0] = fmlp::cuda::e4m3x2_to_f16x2(c.b[nj][0]),
            bw[nj][1] = fmlp::cuda::e4m3x2_to_f16x2(c.b[nj][0] >> 16);
#pragma unroll
          for (int mi = 0; mi < T::kMI; ++mi)
            if (mi < live)
#pragma unroll
              for (int j = 0; j < T::kNJ; ++j) {
                const int nj = mi % 2 ? T::kNJ - 1 - j : j;
                mma<WT>(acc[mi][nj], c.a[mi][0], c.a[mi][1], c.a[mi][2], c.a[mi][3], bw[nj][0],
                        bw[nj][1]);
              }
        }
      } else {
#pragma unroll
        for (int mi = 0; mi < T::kMI; ++mi)
          if (mi < live)
#pragma unroll
            for (int j = 0; j < T::kNJ; ++j) {
              const int nj = mi % 2 ? T::kNJ - 1 - j : j;  // serpentine: reuse the last B fragment
              mma<WT>(acc[mi][nj], c.a[mi][0], c.a[mi][1], c.a[mi][2], c.a[mi][3], c.b[nj][0],
                      c.b[nj][1]);
            }
      }
      if (ks == kSteps - 2 && kt + 1 < k_tiles) {
        cp_async_wait<T::kStages - 2>();  // stage kt + 1 landed for this thread ...
        __syncthreads();  // ... and everyone; all reads of stage kt are issued by now
        rd = rd + 1 == T::kStages ? 0 : rd + 1;
        sa = a_src + rd * T::kAStage, sb = b_src + rd * T::kBStage;
      }
    }
  }
  cp_async_wait<0>();  // only empty groups are left; nothing may be in flight at exit
}

// gemm_tile for a chunk of `rows` rows. Chunks that fill every m16 tile (the full ones, which do
// most of the work) take the untrimmed copy of the loop: its live tests would all pass, and that
// copy keeps straight-line mma runs with the ldmatrix interleaved, where the trimmed one branches
// around each tile's mmas.
template <int BM, typename WT, bool FP8>
__device__ __forceinline__ void gemm_chunk(float (&acc)[Tiles<BM>::kMI][Tiles<BM>::kNJ][4],
                                           const WT* (&a)[Tiles<BM>::kARows],
                                           const BElem<WT, FP8>* (&b)[Tiles<BM, FP8>::kBRows],
                                           int k_tiles, int rows) {
  if (rows > BM - 16)
    gemm_tile<BM, WT, false, FP8>(acc, a, b, k_tiles, rows);
  else
    gemm_tile<BM, WT, true, FP8>(acc, a, b, k_tiles, rows);
}

// The chunk of this block: its expert, first position in the permutation and length.
struct Chunk {
  int e, start, len;
};

__device__ __forceinline__ bool chunk_of_block(const MoeParams& p, Chunk* c) {
  const int i = int(blockIdx.x);
  if (i >= p.hdr->chunks) return false;
  *c = Chunk{p.chunk_expert[i], p.chunk_start[i], p.chunk_len[i]};
  return true;
}

// Block (chunk, N tile): h of 64 units (gated) or 128 units (dense) for the chunk's tokens.
// FP8: WT is __half, x the staged fp16 copy, W1 e4m3, h stored in fp32 (file comment).
template <int BM, typename WT, bool GATED, bool FP8>
__global__ void __launch_bounds__(kThreads, 2) moe_sm80_grouped_gate_up(const MoeParams p) {
  using T = Tiles<BM, FP8>;
  using BT = BElem<WT, FP8>;
  Chunk c;
  if (!chunk_of_block(p, &c)) return;
  constexpr int kUnits = GATED ? kBN / 2 : kBN;
  const int u0 = int(blockIdx.y) * kUnits;
  const WT* x = static_cast<const WT*>(FP8 ? static_cast<const void*>(p.xh) : p.x);
  const int64_t x_ld = FP8 ? p.d : p.x_ld;
  const BT* w1 = static_cast<const BT*>(p.w1) + int64_t(c.e) * p.w1_e;
  const WT* a[T::kARows];
  const BT* b[T::kBRows];
#pragma unroll
  for (int i = 0; i < T::kARows; ++i) {
    const int slot = p.perm[c.start + min(copy_row(i), c.len - 1)];
    a[i] = x + int64_t(slot / p.top_k) * x_ld;
  }
#pragma unroll
  for (int i = 0; i < T::kBRows; ++i) {
    const int r = b_copy_row<FP8>(i);
    int row;
    if constexpr (GATED) {  // rows 16 q .. 16 q + 7: gate of units u0 + 8 q + 0..7; then their up
      const int unit = u0 + r / 16 * 8 + r % 8;
      row = r / 8 % 2 ? p.hidden + unit : unit;
    } else {
      row = min(u0 + r, p.hidden - 1);
    }
    b[i] = w1 + int64_t(row) * p.w1_ld;
  }
  float acc[T::kMI][T::kNJ][4] = {};
  gemm_chunk<BM, WT, FP8>(acc, a, b, p.d / kBK, c.len);

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32, g = lane / 4, t = lane % 4;
  const int m0 = warp / 2 * T::kWarpM + g;
  const void* b1 = fmlp::cuda::expert_vec(p.b1, p.b1_t, p.b1_e, c.e);
  WT* h = reinterpret_cast<WT*>(p.hbuf);
  float xf[T::kMI][2];  // FP8: the factor of the token of row m0 + 16 mi (+ 8)
  if constexpr (FP8) {
#pragma unroll
    for (int mi = 0; mi < T::kMI; ++mi)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int m = m0 + mi * 16 + hr * 8;
        xf[mi][hr] = m < c.len ? p.xinv[p.perm[c.start + m] / p.top_k] : 0.f;
      }
  }
  // The scales of W1 rows r, r + 1 (FP8).
  auto scales = [&](int r, float* s0, float* s1) {
    if constexpr (FP8) {
      *s0 = expert_row_scale(p.s1, p.s1_e, p.s1_r, c.e, r);
      *s1 = expert_row_scale(p.s1, p.s1_e, p.s1_r, c.e, r + 1);
    }
  };
  // h of units u, u + 1 (v[mi][0..1]: row m0 + 16 mi, v[mi][2..3]: 8 rows below) as 4-byte stores
  // (FP8: 8-byte fp32 stores).
  auto store = [&](int u, const float(&v)[T::kMI][4]) {
#pragma unroll
    for (int mi = 0; mi < T::kMI; ++mi)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int m = m0 + mi * 16 + hr * 8;
        if (m >= c.len) continue;
        if constexpr (FP8)
          *reinterpret_cast<float2*>(p.h32 + int64_t(c.start + m) * p.hidden + u) =
              make_float2(v[mi][2 * hr], v[mi][2 * hr + 1]);
        else
          *reinterpret_cast<uint32_t*>(h + int64_t(c.start + m) * p.hidden + u) =
              pack2<WT>(v[mi][2 * hr], v[mi][2 * hr + 1]);
      }
  };
  if constexpr (GATED) {
#pragma unroll
    for (int q = 0; q < T::kNJ / 2; ++q) {  // n8 tile 2q: gate, 2q + 1: up of the same units
      const int u = u0 + (warp % 2 * T::kNJ / 2 + q) * 8 + 2 * t;
      float bg0 = 0.f, bg1 = 0.f, bu0 = 0.f, bu1 = 0.f;
      if (b1) {
        bg0 = load_scalar(b1, p.b1_t, u), bg1 = load_scalar(b1, p.b1_t, u + 1);
        bu0 = load_scalar(b1, p.b1_t, p.hidden + u),
        bu1 = load_scalar(b1, p.b1_t, p.hidden + u + 1);
      }
      float sg0 = 1.f, sg1 = 1.f, su0 = 1.f, su1 = 1.f;
      scales(u, &sg0, &sg1);
      scales(p.hidden + u, &su0, &su1);
      float v[T::kMI][4];
#pragma unroll
      for (int mi = 0; mi < T::kMI; ++mi)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float gs = acc[mi][2 * q][i], us = acc[mi][2 * q + 1][i];
          if constexpr (FP8)
            gs *= xf[mi][i / 2] * (i % 2 ? sg1 : sg0), us *= xf[mi][i / 2] * (i % 2 ? su1 : su0);
          v[mi][i] = activate(p.act, gs + (i % 2 ? bg1 : bg0)) * (us + (i % 2 ? bu1 : bu0));
        }
      store(u, v);
    }
  } else {
#pragma unroll
    for (int nj = 0; nj < T::kNJ; ++nj) {
      const int u = u0 + warp % 2 * T::kWarpN + nj * 8 + 2 * t;
      if (u >= p.hidden) continue;  // hidden is a multiple of 64: u + 1 is inside too
      const float b0 = b1 ? load_scalar(b1, p.b1_t, u) : 0.f;
      const float b01 = b1 ? load_scalar(b1, p.b1_t, u + 1) : 0.f;
      float s0 = 1.f, s1 = 1.f;
      scales(u, &s0, &s1);
      float v[T::kMI][4];
#pragma unroll
      for (int mi = 0; mi < T::kMI; ++mi)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float a = acc[mi][nj][i];
          if constexpr (FP8) a *= xf[mi][i / 2] * (i % 2 ? s1 : s0);
          v[mi][i] = activate(p.act, a + (i % 2 ? b01 : b0));
        }
      store(u, v);
    }
  }
}

// Block (chunk, N tile): 128 outputs of the chunk's slots, fp32, into their per-slot rows.
// FP8: h is the staged fp16 copy, W2 e4m3 (file comment).
template <int BM, typename WT, bool FP8>
__global__ void __launch_bounds__(kThreads, 2) moe_sm80_grouped_down(const MoeParams p) {
  using T = Tiles<BM, FP8>;
  using BT = BElem<WT, FP8>;
  Chunk c;
  if (!chunk_of_block(p, &c)) return;
  const int n0 = int(blockIdx.y) * kBN;
  const WT* hrows = reinterpret_cast<const WT*>(p.hbuf);
  const BT* w2 = static_cast<const BT*>(p.w2) + int64_t(c.e) * p.w2_e;
  const WT* a[T::kARows];
  const BT* b[T::kBRows];
#pragma unroll
  for (int i = 0; i < T::kARows; ++i)
    a[i] = hrows + int64_t(c.start + min(copy_row(i), c.len - 1)) * p.hidden;
#pragma unroll
  for (int i = 0; i < T::kBRows; ++i)
    b[i] = w2 + int64_t(min(n0 + b_copy_row<FP8>(i), p.d_out - 1)) * p.w2_ld;
  float acc[T::kMI][T::kNJ][4] = {};
  gemm_chunk<BM, WT, FP8>(acc, a, b, p.hidden / kBK, c.len);

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32, g = lane / 4, t = lane % 4;
  const int m0 = warp / 2 * T::kWarpM + g, o0 = n0 + warp % 2 * T::kWarpN + 2 * t;
#pragma unroll
  for (int mi = 0; mi < T::kMI; ++mi)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int m = m0 + mi * 16 + hr * 8;
      if (m >= c.len) continue;
      float* row = p.out + int64_t(p.perm[c.start + m]) * p.d_out;
      const float hf = FP8 ? p.hinv[c.start + m] : 1.f;
#pragma unroll
      for (int nj = 0; nj < T::kNJ; ++nj) {
        const int o = o0 + nj * 8;  // d_out is a multiple of 8: o + 1 is inside too
        if (o >= p.d_out) continue;
        float v0 = acc[mi][nj][2 * hr], v1 = acc[mi][nj][2 * hr + 1];
        if constexpr (FP8) {
          v0 *= hf * expert_row_scale(p.s2, p.s2_e, p.s2_r, c.e, o);
          v1 *= hf * expert_row_scale(p.s2, p.s2_e, p.s2_r, c.e, o + 1);
        }
        *reinterpret_cast<float2*>(row + o) = make_float2(v0, v1);
      }
    }
}

template <auto KERNEL>
fmlp_status_t start(const char* name, dim3 grid, size_t smem, const MoeParams& p, cudaStream_t s) {
  if (const fmlp_status_t st = allow_dynamic_smem<KERNEL>(smem, name); st != FMLP_SUCCESS)
    return st;
  KERNEL<<<grid, kThreads, smem, s>>>(p);
  return launch_status(name, fmt::format("{} x {} blocks", grid.x, grid.y));
}

template <int BM, typename WT, bool FP8>
fmlp_status_t launch(const MoeParams& p, cudaStream_t s) {
  constexpr size_t smem = Tiles<BM, FP8>::kSmem;
  const unsigned chunks = unsigned(p.max_chunks);
  const unsigned units = p.gated ? kBN / 2 : kBN;
  const dim3 grid1(chunks, unsigned((p.hidden + units - 1) / units));
  fmlp_status_t st = p.gated ? start<&moe_sm80_grouped_gate_up<BM, WT, true, FP8>>(
                                   "moe_sm80_grouped_gate_up", grid1, smem, p, s)
                             : start<&moe_sm80_grouped_gate_up<BM, WT, false, FP8>>(
                                   "moe_sm80_grouped_gate_up", grid1, smem, p, s);
  if (st != FMLP_SUCCESS) return st;
  if (FP8) {  // h: fp32 -> fp16 with each slot's power of two, into hbuf
    st = moe_launch_stage_f16(p.h32, FMLP_DTYPE_F32, p.hidden, p.slots, p.hidden,
                              reinterpret_cast<uint16_t*>(p.hbuf), p.hinv, s);
    if (st != FMLP_SUCCESS) return st;
  }
  const dim3 grid2(chunks, unsigned((p.d_out + kBN - 1) / kBN));
  return start<&moe_sm80_grouped_down<BM, WT, FP8>>("moe_sm80_grouped_down", grid2, smem, p, s);
}

template <typename WT, bool FP8 = false>
fmlp_status_t dispatch(const MoeParams& p, cudaStream_t s) {
  return p.chunk == 128 ? launch<128, WT, FP8>(p, s) : launch<64, WT, FP8>(p, s);
}

}  // namespace

fmlp_status_t moe_launch_grouped(const MoeParams& p, cudaStream_t s) {
  if (p.w_t == FMLP_DTYPE_F8_E4M3) return dispatch<__half, true>(p, s);
  return p.w_t == FMLP_DTYPE_F16 ? dispatch<__half>(p, s) : dispatch<__nv_bfloat16>(p, s);
}

}  // namespace fmlp::detail
