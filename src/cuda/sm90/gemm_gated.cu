// gemm_sm90_wgmma_gated: h = act(x Wg^T + bg) * (x Wu^T + bu) for the prefill path, one kernel
// from x and the weights to h (docs/prefill.md, "Fused GEMM1"). The cuBLASLt route writes
// the [M, 2H] pre-activations G and reads them back in prefill_bias_act: at llama3-8b M = 4096
// that round trip is ~0.5 GB of HBM traffic, several % of the layer's time.
//
// Design: the TMA + wgmma main loop of gemm_pipe.cuh with the gate rows of 128 hidden units as
// B's first box and their up rows as its second, so in the accumulator layout a thread holds gate
// column c (group j < 16) and up column c (group j + 16): bias, activation and gate product are
// register-only, and h is rounded once. The tiles are walked with the M tiles of a group of
// kGroupM fastest: the concurrent blocks share a few weight column tiles (read once from HBM) and
// the group's x rows (16 MiB at d_in 4096), which stay in L2 while the weights stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/sm90/gemm_gated.cuh"
#include "cuda/sm90/gemm_pipe.cuh"

// The kernel body exists only in the sm_90a compile (FMLP_SM90A, async.cuh); the portable
// (sm_80 + PTX) compile gets an empty stub that supports() never lets launch (it requires compute
// capability 9.0).

namespace fmlp::detail {
namespace {

using namespace fmlp::cuda::sm90;

constexpr const char* kName = "gemm_sm90_wgmma_gated";
constexpr int kBM = kPipeBM;  // tokens per tile
constexpr int kBN = 128;      // hidden units per tile (gate and up each)
constexpr int kBK = kPipeBK;

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

// The pipe's problem: m tiles x n tiles of h, B = the gate rows then the up rows of n tile nt.
template <typename T, fmlp_activation_t ACT>
struct GatedProblem {
  Epilogue e;
  __device__ int tiles() const { return e.m_tiles * e.n_tiles; }
  __device__ int k_blocks() const { return e.k_blocks; }
  __device__ SmTile tile(int t) const {
    int mt, nt;
    tile_coords(t, e.m_tiles, e.n_tiles, &mt, &nt);
    return SmTile{mt * kBM, {nt * kBN, nt * kBN}, mt, nt};
  }
  __device__ void epilogue(const float (&d)[128], const SmTile& tl, int row, int col) const {
    store_h<T, ACT>(e, d, tl.id * kBM + row, tl.n * kBN + col);
  }
};

#endif  // FMLP_SM90A

template <typename T, fmlp_activation_t ACT>
__global__ void __launch_bounds__(kPipeThreads, 1)
    gemm_sm90_wgmma_gated(const __grid_constant__ CUtensorMap tx,
                          const __grid_constant__ CUtensorMap tg,
                          const __grid_constant__ CUtensorMap tu, const Epilogue e) {
#ifdef FMLP_SM90A
  extern __shared__ unsigned char smem_raw[];
  gemm_sm90_pipe<T>(smem_raw, &tx, &tg, &tu, GatedProblem<T, ACT>{e});
#endif  // FMLP_SM90A
}

// ---- host ----

template <typename T, fmlp_activation_t ACT>
fmlp_status_t launch(const CUtensorMap& tx, const CUtensorMap& tg, const CUtensorMap& tu,
                     const Epilogue& e, int grid, cudaStream_t s) {
  constexpr auto kernel = gemm_sm90_wgmma_gated<T, ACT>;
  if (const fmlp_status_t st = allow_dynamic_smem<kernel>(kPipeSmemBytes, kName);
      st != FMLP_SUCCESS)
    return st;
  kernel<<<grid, kPipeThreads, kPipeSmemBytes, s>>>(tx, tg, tu, e);
  return launch_status(kName);
}

template <typename T>
fmlp_status_t launch_act(fmlp_activation_t act, const CUtensorMap& tx, const CUtensorMap& tg,
                         const CUtensorMap& tu, const Epilogue& e, int grid, cudaStream_t s) {
  switch (act) {
    case FMLP_ACT_RELU: return launch<T, FMLP_ACT_RELU>(tx, tg, tu, e, grid, s);
    case FMLP_ACT_GELU: return launch<T, FMLP_ACT_GELU>(tx, tg, tu, e, grid, s);
    case FMLP_ACT_GELU_TANH: return launch<T, FMLP_ACT_GELU_TANH>(tx, tg, tu, e, grid, s);
    case FMLP_ACT_RELU2: return launch<T, FMLP_ACT_RELU2>(tx, tg, tu, e, grid, s);
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
  if (size_t(cuda_max_dynamic_smem(a.device, 0)) < kPipeSmemBytes)
    return (*why = fmt::format("{} needs {} bytes of shared memory per block; device {} offers {}",
                               kName, kPipeSmemBytes, a.device, cuda_max_dynamic_smem(a.device, 0)),
            false);
  return true;
}

fmlp_status_t gemm_sm90_gated_run(const GatedGemmArgs& a, cudaStream_t s) {
  CUtensorMap tx, tg, tu;
  fmlp_status_t st = pipe_make_map(&tx, kName, "x", a.dtype, a.x, a.m, a.k, a.ldx);
  if (st == FMLP_SUCCESS)
    st = pipe_make_map(&tg, kName, "the gate weights", a.dtype, a.wg, a.h, a.k, a.ldwg);
  if (st == FMLP_SUCCESS)
    st = pipe_make_map(&tu, kName, "the up weights", a.dtype, a.wu, a.h, a.k, a.ldwu);
  if (st != FMLP_SUCCESS) return st;
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
