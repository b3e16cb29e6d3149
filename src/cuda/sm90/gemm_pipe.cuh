// The warp-specialised TMA + wgmma main loop of the sm_90a GEMMs whose B tile is two boxes of 128
// rows: gemm_sm90_wgmma_gated (gemm_gated.cu: the gate and the up rows of 128 hidden units)
// and moe_sm90_grouped (moe/sm90_grouped.cu: the same per expert, and 256 rows of W2).
//
// - A tile is 64 x CONSUMERS rows of A (x, or h) x 2 BOXN rows of B, k blocks of 64 16-bit
//   elements (128 bytes: one 128-byte swizzle row). A stage is the A rows x 64 + the two B boxes
//   BOXN x 64, the second box's rows directly after the first's, so one wgmma descriptor spans
//   N = 2 BOXN; as many stages as fit (PipeShape).
// - TMA with 128-byte swizzle; rows and columns past a tensor map's end arrive as zeros.
// - 1 + CONSUMERS warpgroups: WG0 produces (one thread issues the copies), each other WG owns 64
//   rows of A x 2 BOXN columns (m64n(2 BOXN)k16, BOXN fp32 accumulators a thread). A stage is
//   released per warp once wgmma.wait_group says the wgmmas reading it are done (empty barrier
//   count: the consumer warps).
// - 128 x 256 tiles (CONSUMERS 2, BOXN 128) are the prefill and moe default. 192-row tiles
//   (CONSUMERS 3) serve the moe path's chunks of up to 192 tokens, so that an expert of 129..192
//   tokens reads its weights once instead of again for a short second chunk; 512 threads leave
//   128 registers a thread, so their N is 176 (BOXN 88, gate/up) or 128 (BOXN 64, down). There a
//   consumer whose 64 rows all lie past the tile's valid rows skips its wgmmas and epilogue
//   (PROBLEM::rows).
// - Persistent: one block per SM walks the problem's tiles t = blockIdx.x, + gridDim.x, ...
//
// PROBLEM (a struct passed by value) gives:
//   int tiles() const                      tiles of the launch (may read device memory: every
//                                          thread asks, and must get the same answer)
//   int k_blocks() const
//   SmTile tile(int t) const               the tile's A row and its two B boxes' first rows
//   int rows(const SmTile&) const          (CONSUMERS = 3 only) the tile's valid A rows
//   void epilogue(const float (&d)[BOXN], const SmTile&, int row_in_tile, int col_in_tile) const
//                                          a thread's accumulators: rows row_in_tile (+ 8),
//                                          columns col_in_tile + 8 j (+ 1), j < BOXN / 4; d[4 j +
//                                          2 i + q] is row + 8 i, column + 8 j + q (columns
//                                          0..BOXN-1 come from box 0, the rest from box 1)
// The device code exists only in the sm_90a compile (FMLP_SM90A, async.cuh).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/sm90/async.cuh"
#include "fusedmlp/fusedmlp.h"

namespace fmlp::cuda::sm90 {

constexpr int kPipeBK = 64;  // elements of k per stage: one 128-byte swizzle row of 16-bit values

// The sizes of the pipe with CONSUMERS consumer warpgroups and B boxes of BOXN rows.
template <int CONSUMERS, int BOXN>
struct PipeShape {
  static_assert((CONSUMERS == 2 && BOXN == 128) || (CONSUMERS == 3 && (BOXN == 88 || BOXN == 64)),
                "the instantiated shapes: 128 x 256 tiles, 192 x 176 and 192 x 128");
  static constexpr int kBM = 64 * CONSUMERS;  // A rows per tile
  static constexpr int kBN = 2 * BOXN;        // B rows per tile
  // A rows per TMA box: one box at two consumers; 64-row boxes at three, so the three consumers'
  // parts land one after the other (a 128-row box would overrun the 192-row tile).
  static constexpr int kABox = CONSUMERS == 2 ? 128 : 64;
  static constexpr int kThreads = 128 * (1 + CONSUMERS);
  static constexpr uint32_t kTileA = uint32_t(kBM) * kPipeBK * 2;
  static constexpr uint32_t kBox = uint32_t(BOXN) * kPipeBK * 2;
  static constexpr uint32_t kStageBytes = kTileA + 2 * kBox;
  // As many stages as 227 KiB of shared memory hold with the barriers and 1024 bytes to align the
  // base (128-byte swizzle atoms are 1024 bytes and the descriptors assume atoms start
  // 1024-aligned: base offset 0): 4 of 48 or 46 KiB, 5 of 40 KiB.
  static constexpr int kStages = int((232448 - 1024 - 8 * 16) / kStageBytes);
  static constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 2 * kStages * 8 + 1024;
  // setmaxnreg at two consumers: the block starts with 168 registers a thread; what the producer
  // gives back (40) is exactly what the consumers take (232; the instruction waits for it). Three
  // consumers keep the 128 a thread that 512 threads start with: their N <= 176 tiles need at most
  // 88 accumulators.
  static constexpr bool kSetMaxNReg = CONSUMERS == 2;
};
using PipeWide = PipeShape<2, 128>;  // the prefill and moe default: 128 x 256 tiles
constexpr int kPipeBM = PipeWide::kBM;
constexpr int kPipeBN = PipeWide::kBN;
constexpr int kPipeThreads = PipeWide::kThreads;
constexpr size_t kPipeSmemBytes = PipeWide::kSmemBytes;

struct SmTile {
  int a_row;     // first A row
  int b_row[2];  // first rows of the two B boxes
  int id;        // the problem's own index (chunk, m tile ...)
  int n;         // the problem's N tile
};

// A [rows, cols] row-major 16-bit matrix (row stride ld elements) read in box_rows x 64 boxes
// (128: B, and A at two consumers; PipeShape::kABox), 128-byte swizzle (the layout the wgmma
// descriptors describe), zeros outside. The error names the kernel and the operand (`what`).
inline fmlp_status_t pipe_make_map(CUtensorMap* map, const char* kernel, const char* what,
                                   fmlp_dtype_t t, const void* p, int64_t rows, int64_t cols,
                                   int64_t ld, uint32_t box_rows = 128) {
  return make_tma_map_2d(
      map, kernel, what,
      t == FMLP_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, p,
      rows, cols, ld * 2, kPipeBK, box_rows);
}

#ifdef FMLP_SM90A

// Keeps the compiler from moving accumulator accesses across the asynchronous wgmma boundaries.
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of the wgmma asm below, 8 at a time: their names in the instruction
// and their bindings to d[]; the lists for 64, 88 and 128 accumulators (N = 128, 176, 256).
#define FMLP_ACC_NAMES_0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define FMLP_ACC_NAMES_1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define FMLP_ACC_NAMES_2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define FMLP_ACC_NAMES_3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define FMLP_ACC_NAMES_4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define FMLP_ACC_NAMES_5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define FMLP_ACC_NAMES_6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define FMLP_ACC_NAMES_7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define FMLP_ACC_NAMES_8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define FMLP_ACC_NAMES_9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define FMLP_ACC_NAMES_10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define FMLP_ACC_NAMES_11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define FMLP_ACC_NAMES_12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define FMLP_ACC_NAMES_13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define FMLP_ACC_NAMES_14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define FMLP_ACC_NAMES_15 "%120, %121, %122, %123, %124, %125, %126, %127"
#define FMLP_ACC_BIND8(B)                                                                     \
  "+f"(d[B]), "+f"(d[B + 1]), "+f"(d[B + 2]), "+f"(d[B + 3]), "+f"(d[B + 4]), "+f"(d[B + 5]), \
      "+f"(d[B + 6]), "+f"(d[B + 7])
#define FMLP_ACC16_NAMES FMLP_ACC_NAMES_0 ", " FMLP_ACC_NAMES_1
#define FMLP_ACC16_BINDS FMLP_ACC_BIND8(0), FMLP_ACC_BIND8(8)
#define FMLP_ACC32_NAMES FMLP_ACC16_NAMES ", " FMLP_ACC_NAMES_2 ", " FMLP_ACC_NAMES_3
#define FMLP_ACC32_BINDS FMLP_ACC16_BINDS, FMLP_ACC_BIND8(16), FMLP_ACC_BIND8(24)
#define FMLP_ACC48_NAMES FMLP_ACC32_NAMES ", " FMLP_ACC_NAMES_4 ", " FMLP_ACC_NAMES_5
#define FMLP_ACC48_BINDS FMLP_ACC32_BINDS, FMLP_ACC_BIND8(32), FMLP_ACC_BIND8(40)
#define FMLP_ACC64_NAMES FMLP_ACC48_NAMES ", " FMLP_ACC_NAMES_6 ", " FMLP_ACC_NAMES_7
#define FMLP_ACC64_BINDS FMLP_ACC48_BINDS, FMLP_ACC_BIND8(48), FMLP_ACC_BIND8(56)
#define FMLP_ACC80_NAMES FMLP_ACC64_NAMES ", " FMLP_ACC_NAMES_8 ", " FMLP_ACC_NAMES_9
#define FMLP_ACC80_BINDS FMLP_ACC64_BINDS, FMLP_ACC_BIND8(64), FMLP_ACC_BIND8(72)
#define FMLP_ACC88_NAMES FMLP_ACC80_NAMES ", " FMLP_ACC_NAMES_10
#define FMLP_ACC88_BINDS FMLP_ACC80_BINDS, FMLP_ACC_BIND8(80)
#define FMLP_ACC96_NAMES FMLP_ACC88_NAMES ", " FMLP_ACC_NAMES_11
#define FMLP_ACC96_BINDS FMLP_ACC88_BINDS, FMLP_ACC_BIND8(88)
#define FMLP_ACC112_NAMES FMLP_ACC96_NAMES ", " FMLP_ACC_NAMES_12 ", " FMLP_ACC_NAMES_13
#define FMLP_ACC112_BINDS FMLP_ACC96_BINDS, FMLP_ACC_BIND8(96), FMLP_ACC_BIND8(104)
#define FMLP_ACC128_NAMES FMLP_ACC112_NAMES ", " FMLP_ACC_NAMES_14 ", " FMLP_ACC_NAMES_15
#define FMLP_ACC128_BINDS FMLP_ACC112_BINDS, FMLP_ACC_BIND8(112), FMLP_ACC_BIND8(120)

// One wgmma of shape m64 x N x k16 with R = N / 2 accumulators (%0 .. %R-1), then da, db and
// scale_d as %R, %R+1 and %R+2 (DA, DB, SCALE).
#define FMLP_WGMMA(N, TYPE, NAMES, DA, DB, SCALE, ...)                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE                                   \
               ", 0;\n"                                                                    \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE "\n{" NAMES \
               "},\n" DA ", " DB ", p, 1, 1, 0, 0;\n}\n"                                   \
               : __VA_ARGS__                                                               \
               : "l"(da), "l"(db), "r"(scale_d))
#define FMLP_WGMMA_TYPED(N, ACC, DA, DB, SCALE)                                           \
  if constexpr (NN == N) {                                                                \
    if constexpr (std::is_same_v<T, __nv_bfloat16>)                                       \
      FMLP_WGMMA(N, "bf16", FMLP_ACC##ACC##_NAMES, DA, DB, SCALE, FMLP_ACC##ACC##_BINDS); \
    else                                                                                  \
      FMLP_WGMMA(N, "f16", FMLP_ACC##ACC##_NAMES, DA, DB, SCALE, FMLP_ACC##ACC##_BINDS);  \
  }

// d[64 x NN] (+)= A[64 x 16] B[NN x 16]^T, both K-major in shared memory, NN / 2 fp32 accumulators
// a thread; scale_d = 0 starts the accumulation (the registers' old values are ignored). NN = 256
// (two 128-row B boxes), 176 and 128 (the tall tiles' two 88- and 64-row boxes), 96 and 160
// (gemm_swap.cuh: a chunk's tokens as N).
template <typename T, int NN>
__device__ __forceinline__ void wgmma_m64nk16(float (&d)[NN / 2], uint64_t da, uint64_t db,
                                              int scale_d) {
  static_assert(NN == 256 || NN == 176 || NN == 160 || NN == 128 || NN == 96,
                "the instantiated wgmma shapes");
  FMLP_WGMMA_TYPED(256, 128, "%128", "%129", "%130")
  FMLP_WGMMA_TYPED(176, 88, "%88", "%89", "%90")
  FMLP_WGMMA_TYPED(160, 80, "%80", "%81", "%82")
  FMLP_WGMMA_TYPED(128, 64, "%64", "%65", "%66")
  FMLP_WGMMA_TYPED(96, 48, "%48", "%49", "%50")
}
#undef FMLP_ACC_NAMES_0
#undef FMLP_ACC_NAMES_1
#undef FMLP_ACC_NAMES_2
#undef FMLP_ACC_NAMES_3
#undef FMLP_ACC_NAMES_4
#undef FMLP_ACC_NAMES_5
#undef FMLP_ACC_NAMES_6
#undef FMLP_ACC_NAMES_7
#undef FMLP_ACC_NAMES_8
#undef FMLP_ACC_NAMES_9
#undef FMLP_ACC_NAMES_10
#undef FMLP_ACC_NAMES_11
#undef FMLP_ACC_NAMES_12
#undef FMLP_ACC_NAMES_13
#undef FMLP_ACC_NAMES_14
#undef FMLP_ACC_NAMES_15
#undef FMLP_ACC_BIND8
#undef FMLP_ACC16_NAMES
#undef FMLP_ACC16_BINDS
#undef FMLP_ACC32_NAMES
#undef FMLP_ACC32_BINDS
#undef FMLP_ACC48_NAMES
#undef FMLP_ACC48_BINDS
#undef FMLP_ACC64_NAMES
#undef FMLP_ACC64_BINDS
#undef FMLP_ACC80_NAMES
#undef FMLP_ACC80_BINDS
#undef FMLP_ACC88_NAMES
#undef FMLP_ACC88_BINDS
#undef FMLP_ACC96_NAMES
#undef FMLP_ACC96_BINDS
#undef FMLP_ACC112_NAMES
#undef FMLP_ACC112_BINDS
#undef FMLP_ACC128_NAMES
#undef FMLP_ACC128_BINDS
#undef FMLP_WGMMA
#undef FMLP_WGMMA_TYPED

// The kernel body (every thread of a PipeShape<CONSUMERS, BOXN>::kThreads block calls it, with its
// kSmemBytes of dynamic shared memory at smem_raw): ta maps A (kABox-row boxes), tb0 / tb1 the two
// B boxes of BOXN rows (the same map for both where the problem's B rows are one matrix).
template <typename T, typename PROBLEM, int CONSUMERS = 2, int BOXN = 128>
__device__ __forceinline__ void gemm_sm90_pipe(unsigned char* smem_raw, const CUtensorMap* ta,
                                               const CUtensorMap* tb0, const CUtensorMap* tb1,
                                               const PROBLEM& pr) {
  using P = PipeShape<CONSUMERS, BOXN>;
  constexpr int kStages = P::kStages;
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * P::kStageBytes);
  uint64_t* empty = full + kStages;
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);               // the producer's arrive.expect_tx
      mbar_init(&empty[s], 4 * CONSUMERS);  // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int tiles = pr.tiles(), k_blocks = pr.k_blocks();

  if (wg == 0) {
    if constexpr (P::kSetMaxNReg) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x != 0) return;
    prefetch_tensormap(ta);
    prefetch_tensormap(tb0);
    prefetch_tensormap(tb1);
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const SmTile tl = pr.tile(t);
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(&empty[stage], phase ^ 1);  // a fresh barrier passes parity 1 at once
        unsigned char* st = smem + stage * P::kStageBytes;
        mbar_expect_tx(&full[stage], P::kStageBytes);  // out-of-bounds box parts count too
#pragma unroll
        for (int a = 0; a < P::kBM / P::kABox; ++a)
          tma_load(st + a * P::kABox * kPipeBK * 2, ta, &full[stage], kb * kPipeBK,
                   tl.a_row + a * P::kABox);
        tma_load(st + P::kTileA, tb0, &full[stage], kb * kPipeBK, tl.b_row[0]);
        tma_load(st + P::kTileA + P::kBox, tb1, &full[stage], kb * kPipeBK, tl.b_row[1]);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  if constexpr (P::kSetMaxNReg) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1;  // this consumer's 64 rows of the tile
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  float d[BOXN];
  int stage = 0;
  uint32_t phase = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const SmTile tl = pr.tile(t);
    if constexpr (CONSUMERS == 3) {
      if (c * 64 >= pr.rows(tl)) {  // nothing of ours to compute: release the stages as they come
        for (int kb = 0; kb < k_blocks; ++kb) {
          mbar_wait(&full[stage], phase);
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[stage]);
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
        continue;
      }
    }
    int prev = 0;
    for (int kb = 0; kb < k_blocks; ++kb) {
      mbar_wait(&full[stage], phase);
      __syncwarp();  // the wgmma instructions below are .sync.aligned: the warp must be converged
      const uint32_t base = smem_u32(smem + stage * P::kStageBytes);
      const uint64_t da = smem_desc(base + uint32_t(c) * (64 * kPipeBK * 2));
      const uint64_t db = smem_desc(base + P::kTileA);
      fence_acc(d);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kPipeBK / 16; ++kk)
        wgmma_m64nk16<T, P::kBN>(d, da + 2 * kk, db + 2 * kk, (kb | kk) != 0);
      wgmma_commit();
      fence_acc(d);
      // The previous stage's wgmmas are complete once at most this stage's group is pending.
      wgmma_wait<1>();
      fence_acc(d);
      if (kb > 0 && lane == 0) mbar_arrive(&empty[prev]);
      prev = stage;
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    wgmma_wait<0>();
    fence_acc(d);
    if (lane == 0) mbar_arrive(&empty[prev]);
    pr.epilogue(d, tl, c * 64 + warp * 16 + lane / 4, 2 * (lane % 4));
  }
}

#endif  // FMLP_SM90A

}  // namespace fmlp::cuda::sm90
