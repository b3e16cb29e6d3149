// gemm_sm90_wgmma_gated: h = act(x Wg^T + bg) * (x Wu^T + bu) for the prefill path, one kernel
// from x and the weights to h (docs/cuda-prefill.md, "Fused GEMM1"). The cuBLASLt route writes
// the [M, 2H] pre-activations G and reads them back in prefill_bias_act: at llama3-8b M = 4096
// that round trip is ~0.5 GB of HBM traffic, ~150 us of a ~2.2 ms layer.
//
// Design (the usual Hopper recipe; sm_90a features: TMA, mbarrier transaction counts, wgmma,
// setmaxnreg):
// - tile 128 tokens x (128 gate + the same 128 up units), k blocks of 64 elements (128 bytes:
//   one 128-byte swizzle row). A stage is x 128x64 (16 KiB) + Wg 128x64 + Wu 128x64 (32 KiB),
//   gate rows directly followed by up rows, so one wgmma descriptor spans N = 256; 4 stages.
// - TMA with 128-byte swizzle through three tensor maps (x, Wg, Wu): separate maps make stacked
//   and separate gate/up views the same case, and rows/columns past the end arrive as zeros.
// - 3 warpgroups: WG0 produces (one thread issues the copies), WG1 and WG2 each own 64 token rows
//   x 256 columns of the tile (m64n256k16, 128 fp32 accumulators a thread). A stage is released
//   per warp once wgmma.wait_group says the wgmmas reading it are done (empty barrier count 8).
// - In the accumulator layout a thread holds gate column c (group j < 16) and up column c
//   (group j + 16), so bias, activation and gate product are register-only; h is rounded once.
// - Persistent: one block per SM walks the tiles with the M tiles of a group of kGroupM fastest:
//   the concurrent blocks share a few weight column tiles (read once from HBM) and the group's x
//   rows (16 MiB at d_in 4096), which stay in L2 while the weights stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/gemm_sm90_gated.cuh"
#include "cuda/launch_util.hpp"
#include "cuda/ops.cuh"
#include "cuda/sm90_async.cuh"

// The kernel body exists only in the sm_90a compile (FMLP_SM90A, sm90_async.cuh); the portable
// (sm_80 + PTX) compile gets an empty stub that supports() never lets launch (it requires compute
// capability 9.0).

namespace fmlp::detail {
namespace {

using namespace fmlp::cuda::sm90;

constexpr const char* kName = "gemm_sm90_wgmma_gated";
constexpr int kBM = 128;  // tokens per tile
constexpr int kBN = 128;  // hidden units per tile (gate and up each)
constexpr int kBK = 64;   // elements of k per stage: one 128-byte swizzle row of 16-bit values
constexpr int kStages = 4;
constexpr int kThreads = 384;               // producer warpgroup + 2 consumer warpgroups
constexpr uint32_t kTileA = kBM * kBK * 2;  // 16 KiB
constexpr uint32_t kTileW = kBN * kBK * 2;  // 16 KiB each for gate and up
constexpr uint32_t kStageBytes = kTileA + 2 * kTileW;
// Stages, then full and empty barriers; + 1024 to align the base (128-byte swizzle atoms are 1024
// bytes and the descriptors assume atoms start 1024-aligned: base offset 0).
constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 2 * kStages * 8 + 1024;

struct Epilogue {
  void* out;
  int64_t ldo;
  const void* bg;
  const void* bu;
  fmlp_dtype_t bg_t, bu_t;
  int m, h;
  int m_tiles, n_tiles, k_blocks;
};

#ifdef FMLP_SM90A

constexpr int kGroupM = 16;  // M tiles walked fastest (see the header comment)

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

// Tile t of the persistent walk: groups of kGroupM M tiles, M fastest inside a group.
__device__ __forceinline__ void tile_coords(int t, int m_tiles, int n_tiles, int* mt, int* nt) {
  const int per_group = kGroupM * n_tiles;
  const int first = (t / per_group) * kGroupM;
  const int rows = min(kGroupM, m_tiles - first);
  const int idx = t % per_group;
  *mt = first + idx % rows;
  *nt = idx / rows;
}

template <fmlp_activation_t ACT>
__device__ __forceinline__ float gated(float g, float u) {
  return fmlp::cuda::activate(ACT, g) * u;
}

// Consumer c's 64 x 128 slice of h from its accumulators (gate in d[0..63], up in d[64..127]):
// rows 16 w + lane / 4 (+ 8), columns 8 j + 2 (lane % 4) (+ 1).
template <typename T, fmlp_activation_t ACT>
__device__ __forceinline__ void store_h(const Epilogue& e, const float (&d)[128], int row0,
                                        int col0) {
  T* out = static_cast<T*>(e.out);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int col = col0 + 8 * j;
    float bg[2] = {0.f, 0.f}, bu[2] = {0.f, 0.f};
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      if (col + q >= e.h) continue;
      if (e.bg) bg[q] = fmlp::cuda::load_scalar(e.bg, e.bg_t, col + q);
      if (e.bu) bu[q] = fmlp::cuda::load_scalar(e.bu, e.bu_t, col + q);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = row0 + 8 * i;
      if (row >= e.m || col >= e.h) continue;
      const float h0 = gated<ACT>(d[4 * j + 2 * i] + bg[0], d[64 + 4 * j + 2 * i] + bu[0]);
      const float h1 = gated<ACT>(d[4 * j + 2 * i + 1] + bg[1], d[64 + 4 * j + 2 * i + 1] + bu[1]);
      T* p = out + int64_t(row) * e.ldo + col;
      if (col + 1 < e.h)
        *reinterpret_cast<uint32_t*>(p) = fmlp::cuda::pack2<T>(h0, h1);
      else
        *p = fmlp::cuda::from_f<T>(h0);
    }
  }
}

#endif  // FMLP_SM90A

template <typename T, fmlp_activation_t ACT>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_sm90_wgmma_gated(const __grid_constant__ CUtensorMap tx,
                          const __grid_constant__ CUtensorMap tg,
                          const __grid_constant__ CUtensorMap tu, const Epilogue e) {
#ifdef FMLP_SM90A
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);   // the producer's arrive.expect_tx
      mbar_init(&empty[s], 8);  // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int tiles = e.m_tiles * e.n_tiles;

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x != 0) return;
    prefetch_tensormap(&tx);
    prefetch_tensormap(&tg);
    prefetch_tensormap(&tu);
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      int mt, nt;
      tile_coords(t, e.m_tiles, e.n_tiles, &mt, &nt);
      for (int kb = 0; kb < e.k_blocks; ++kb) {
        mbar_wait(&empty[stage], phase ^ 1);  // a fresh barrier passes parity 1 at once
        unsigned char* st = smem + stage * kStageBytes;
        mbar_expect_tx(&full[stage], kStageBytes);  // out-of-bounds box parts count too (zeros)
        tma_load(st, &tx, &full[stage], kb * kBK, mt * kBM);
        tma_load(st + kTileA, &tg, &full[stage], kb * kBK, nt * kBN);
        tma_load(st + kTileA + kTileW, &tu, &full[stage], kb * kBK, nt * kBN);
        if (++stage == kStages) stage = 0, phase ^= 1;
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
    int mt, nt;
    tile_coords(t, e.m_tiles, e.n_tiles, &mt, &nt);
    int prev = 0;
    for (int kb = 0; kb < e.k_blocks; ++kb) {
      mbar_wait(&full[stage], phase);
      __syncwarp();  // the wgmma instructions below are .sync.aligned: the warp must be converged
      const uint32_t base = smem_u32(smem + stage * kStageBytes);
      const uint64_t da = smem_desc(base + uint32_t(c) * (kTileA / 2));
      const uint64_t db = smem_desc(base + kTileA);
      fence_acc(d);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
        wgmma_m64n256k16<T>(d, da + 2 * kk, db + 2 * kk, (kb | kk) != 0);
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
    store_h<T, ACT>(e, d, mt * kBM + c * 64 + warp * 16 + lane / 4, nt * kBN + 2 * (lane % 4));
  }
#endif  // FMLP_SM90A
}

// ---- host ----

// A [rows, cols] row-major matrix (row stride ld elements) read in 128 x 64 boxes, 128-byte
// swizzle (the layout the wgmma descriptors describe), zeros outside.
fmlp_status_t make_map(CUtensorMap* map, const char* what, fmlp_dtype_t t, const void* p,
                       int64_t rows, int64_t cols, int64_t ld) {
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * 2};
  const cuuint32_t box[2] = {kBK, 128};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(
      map,
      t == FMLP_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(p), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return fail(FMLP_ERROR_CUDA,
                "{}: encoding the TMA descriptor of {} ([{}, {}], row stride {}) failed (CUresult "
                "{})",
                kName, what, rows, cols, ld, int(r));
  return FMLP_SUCCESS;
}

template <typename T, fmlp_activation_t ACT>
fmlp_status_t launch(const CUtensorMap& tx, const CUtensorMap& tg, const CUtensorMap& tu,
                     const Epilogue& e, int grid, cudaStream_t s) {
  constexpr auto kernel = gemm_sm90_wgmma_gated<T, ACT>;
  if (const fmlp_status_t st = allow_dynamic_smem<kernel>(kSmemBytes, kName); st != FMLP_SUCCESS)
    return st;
  kernel<<<grid, kThreads, kSmemBytes, s>>>(tx, tg, tu, e);
  return launch_status(kName);
}

template <typename T>
fmlp_status_t launch_act(fmlp_activation_t act, const CUtensorMap& tx, const CUtensorMap& tg,
                         const CUtensorMap& tu, const Epilogue& e, int grid, cudaStream_t s) {
  switch (act) {
    case FMLP_ACT_RELU: return launch<T, FMLP_ACT_RELU>(tx, tg, tu, e, grid, s);
    case FMLP_ACT_GELU: return launch<T, FMLP_ACT_GELU>(tx, tg, tu, e, grid, s);
    case FMLP_ACT_GELU_TANH: return launch<T, FMLP_ACT_GELU_TANH>(tx, tg, tu, e, grid, s);
    default: return launch<T, FMLP_ACT_SILU>(tx, tg, tu, e, grid, s);
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

bool gemm_sm90_gated_supports(const GatedGemmArgs& a, std::string* why) {
  if (a.dtype != FMLP_DTYPE_BF16 && a.dtype != FMLP_DTYPE_F16)
    return (*why = fmt::format("{} needs bf16 or f16, got {}", kName, fmlp_dtype_name(a.dtype)),
            false);
  const int cc = cuda_compute_capability(a.device);
  if (cc != 90)
    return (*why = fmt::format("{} is sm_90a code; device {} has compute capability {}.{}", kName,
                               a.device, cc / 10, cc % 10),
            false);
  if (a.m < 1 || a.k < 1 || a.h < 1 || a.m > (int64_t(1) << 30) || a.h > (int64_t(1) << 30) ||
      a.k > (int64_t(1) << 30) || (a.m + kBM - 1) / kBM * ((a.h + kBN - 1) / kBN) > INT32_MAX)
    return (*why = fmt::format("{}: sizes m={} k={} h={} outside its 32-bit tile indexing", kName,
                               a.m, a.k, a.h),
            false);
  // TMA: 16-byte aligned global addresses and row strides in multiples of 16 bytes.
  if (a.k % 8 != 0 || a.ldx % 8 != 0 || a.ldwg % 8 != 0 || a.ldwu % 8 != 0 || a.ldo % 8 != 0)
    return (*why = fmt::format(
                "{} needs d_in and the row strides of x, the weights and h in multiples of 8 "
                "elements (16 bytes, TMA); got d_in={} ldx={} ldwg={} ldwu={} ldh={}",
                kName, a.k, a.ldx, a.ldwg, a.ldwu, a.ldo),
            false);
  if (!aligned16(a.x) || !aligned16(a.wg) || !aligned16(a.wu) || !aligned16(a.out))
    return (*why = fmt::format("{} needs 16-byte aligned x, weights and h (TMA)", kName), false);
  if (encode_tiled() == nullptr)
    return (*why = fmt::format("{}: the driver has no cuTensorMapEncodeTiled", kName), false);
  if (size_t(cuda_max_dynamic_smem(a.device, 0)) < kSmemBytes)
    return (*why = fmt::format("{} needs {} bytes of shared memory per block; device {} offers {}",
                               kName, kSmemBytes, a.device, cuda_max_dynamic_smem(a.device, 0)),
            false);
  return true;
}

fmlp_status_t gemm_sm90_gated_run(const GatedGemmArgs& a, cudaStream_t s) {
  CUtensorMap tx, tg, tu;
  if (fmlp_status_t st = make_map(&tx, "x", a.dtype, a.x, a.m, a.k, a.ldx); st != FMLP_SUCCESS)
    return st;
  if (fmlp_status_t st = make_map(&tg, "the gate weights", a.dtype, a.wg, a.h, a.k, a.ldwg);
      st != FMLP_SUCCESS)
    return st;
  if (fmlp_status_t st = make_map(&tu, "the up weights", a.dtype, a.wu, a.h, a.k, a.ldwu);
      st != FMLP_SUCCESS)
    return st;
  Epilogue e{a.out,
             a.ldo,
             a.bg,
             a.bu,
             a.bg_t,
             a.bu_t,
             int(a.m),
             int(a.h),
             int((a.m + kBM - 1) / kBM),
             int((a.h + kBN - 1) / kBN),
             int((a.k + kBK - 1) / kBK)};
  const int tiles = e.m_tiles * e.n_tiles;
  const int grid = std::min(tiles, std::max(1, cuda_sm_count(a.device)));
  if (a.dtype == FMLP_DTYPE_BF16) return launch_act<__nv_bfloat16>(a.act, tx, tg, tu, e, grid, s);
  return launch_act<__half>(a.act, tx, tg, tu, e, grid, s);
}

}  // namespace fmlp::detail
