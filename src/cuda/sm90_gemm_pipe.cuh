// The warp-specialised TMA + wgmma main loop of the sm_90a GEMMs whose B tile is two boxes of 128
// rows: gemm_sm90_wgmma_gated (gemm_sm90_gated.cu: the gate and the up rows of 128 hidden units)
// and moe_sm90_grouped (moe_grouped_sm90.cu: the same per expert, and 256 rows of W2).
//
// - A tile is 128 rows of A (x, or h) x 256 rows of B, k blocks of 64 16-bit elements (128 bytes:
//   one 128-byte swizzle row). A stage is A 128x64 (16 KiB) + the two B boxes 128x64 (32 KiB),
//   the second box's rows directly after the first's, so one wgmma descriptor spans N = 256; 4
//   stages.
// - TMA with 128-byte swizzle; rows and columns past a tensor map's end arrive as zeros.
// - 3 warpgroups: WG0 produces (one thread issues the copies), WG1 and WG2 each own 64 rows of A
//   x 256 columns (m64n256k16, 128 fp32 accumulators a thread). A stage is released per warp once
//   wgmma.wait_group says the wgmmas reading it are done (empty barrier count 8).
// - Persistent: one block per SM walks the problem's tiles t = blockIdx.x, + gridDim.x, ...
//
// PROBLEM (a struct passed by value) gives:
//   int tiles() const                      tiles of the launch (may read device memory: every
//                                          thread asks, and must get the same answer)
//   int k_blocks() const
//   SmTile tile(int t) const               the tile's A row and its two B boxes' first rows
//   void epilogue(const float (&d)[128], const SmTile&, int row_in_tile, int col_in_tile) const
//                                          a thread's accumulators: rows row_in_tile (+ 8),
//                                          columns col_in_tile + 8 j (+ 1), j < 32; d[4 j + 2 i
//                                          + q] is row + 8 i, column + 8 j + q (columns 0..127
//                                          come from box 0, 128..255 from box 1)
// The device code exists only in the sm_90a compile (FMLP_SM90A, sm90_async.cuh).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/sm90_async.cuh"
#include "fusedmlp/fusedmlp.h"

namespace fmlp::cuda::sm90 {

constexpr int kPipeBM = 128;  // A rows per tile
constexpr int kPipeBN = 256;  // B rows per tile: two boxes of 128
constexpr int kPipeBK = 64;   // elements of k per stage: one 128-byte swizzle row of 16-bit values
constexpr int kPipeStages = 4;
constexpr int kPipeThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr uint32_t kPipeTileA = kPipeBM * kPipeBK * 2;  // 16 KiB
constexpr uint32_t kPipeBox = 128 * kPipeBK * 2;        // 16 KiB each B box
constexpr uint32_t kPipeStageBytes = kPipeTileA + 2 * kPipeBox;
// Stages, then full and empty barriers; + 1024 to align the base (128-byte swizzle atoms are 1024
// bytes and the descriptors assume atoms start 1024-aligned: base offset 0).
constexpr size_t kPipeSmemBytes =
    size_t(kPipeStages) * kPipeStageBytes + 2 * kPipeStages * 8 + 1024;

struct SmTile {
  int a_row;     // first A row
  int b_row[2];  // first rows of the two B boxes
  int id;        // the problem's own index (chunk, m tile ...)
  int n;         // the problem's N tile
};

// A [rows, cols] row-major 16-bit matrix (row stride ld elements) read in 128 x 64 boxes, 128-byte
// swizzle (the layout the wgmma descriptors describe), zeros outside. The error names the kernel
// and the operand (`what`).
inline fmlp_status_t pipe_make_map(CUtensorMap* map, const char* kernel, const char* what,
                                   fmlp_dtype_t t, const void* p, int64_t rows, int64_t cols,
                                   int64_t ld) {
  return make_tma_map_2d(
      map, kernel, what,
      t == FMLP_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, p,
      rows, cols, ld * 2, kPipeBK, 128);
}

#ifdef FMLP_SM90A

// Keeps the compiler from moving accumulator accesses across the asynchronous wgmma boundaries.
__device__ __forceinline__ void fence_acc(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d[64 x 256] (+)= A[64 x 16] B[256 x 16]^T, both K-major in shared memory; scale_d = 0 starts
// the accumulation (the registers' old values are ignored).
#define FMLP_WGMMA_M64N256K16(TYPE)                                                                \
  asm volatile(                                                                                    \
      "{\n"                                                                                        \
      ".reg .pred p;\n"                                                                            \
      "setp.ne.b32 p, %130, 0;\n"                                                                  \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE                                 \
      "\n"                                                                                         \
      "{"                                                                                          \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "           \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "           \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "           \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "           \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "           \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "     \
      "%111, "                                                                                     \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, " \
      "%127"                                                                                       \
      "},\n"                                                                                       \
      "%128, %129, p, 1, 1, 0, 0;\n"                                                               \
      "}\n"                                                                                        \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), \
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), \
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), \
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), \
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), \
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),          \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),        \
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),        \
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),        \
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])         \
      : "l"(da), "l"(db), "r"(scale_d))

template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db,
                                                 int scale_d) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    FMLP_WGMMA_M64N256K16("bf16");
  else
    FMLP_WGMMA_M64N256K16("f16");
}
#undef FMLP_WGMMA_M64N256K16

// The kernel body (every thread of a kPipeThreads block calls it, with kPipeSmemBytes of dynamic
// shared memory at smem_raw): ta maps A, tb0 / tb1 the two B boxes (the same map for both where
// the problem's B rows are one matrix).
template <typename T, typename PROBLEM>
__device__ __forceinline__ void gemm_sm90_pipe(unsigned char* smem_raw, const CUtensorMap* ta,
                                               const CUtensorMap* tb0, const CUtensorMap* tb1,
                                               const PROBLEM& pr) {
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kPipeStages * kPipeStageBytes);
  uint64_t* empty = full + kPipeStages;
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kPipeStages; ++s) {
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
    prefetch_tensormap(tb0);
    prefetch_tensormap(tb1);
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const SmTile tl = pr.tile(t);
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(&empty[stage], phase ^ 1);  // a fresh barrier passes parity 1 at once
        unsigned char* st = smem + stage * kPipeStageBytes;
        mbar_expect_tx(&full[stage], kPipeStageBytes);  // out-of-bounds box parts count too
        tma_load(st, ta, &full[stage], kb * kPipeBK, tl.a_row);
        tma_load(st + kPipeTileA, tb0, &full[stage], kb * kPipeBK, tl.b_row[0]);
        tma_load(st + kPipeTileA + kPipeBox, tb1, &full[stage], kb * kPipeBK, tl.b_row[1]);
        if (++stage == kPipeStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1;  // this consumer's 64-row half of the tile
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  float d[128];
  int stage = 0;
  uint32_t phase = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const SmTile tl = pr.tile(t);
    int prev = 0;
    for (int kb = 0; kb < k_blocks; ++kb) {
      mbar_wait(&full[stage], phase);
      __syncwarp();  // the wgmma instructions below are .sync.aligned: the warp must be converged
      const uint32_t base = smem_u32(smem + stage * kPipeStageBytes);
      const uint64_t da = smem_desc(base + uint32_t(c) * (kPipeTileA / 2));
      const uint64_t db = smem_desc(base + kPipeTileA);
      fence_acc(d);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kPipeBK / 16; ++kk)
        wgmma_m64n256k16<T>(d, da + 2 * kk, db + 2 * kk, (kb | kk) != 0);
      wgmma_commit();
      fence_acc(d);
      // The previous stage's wgmmas are complete once at most this stage's group is pending.
      wgmma_wait<1>();
      fence_acc(d);
      if (kb > 0 && lane == 0) mbar_arrive(&empty[prev]);
      prev = stage;
      if (++stage == kPipeStages) stage = 0, phase ^= 1;
    }
    wgmma_wait<0>();
    fence_acc(d);
    if (lane == 0) mbar_arrive(&empty[prev]);
    pr.epilogue(d, tl, c * 64 + warp * 16 + lane / 4, 2 * (lane % 4));
  }
}

#endif  // FMLP_SM90A

}  // namespace fmlp::cuda::sm90
