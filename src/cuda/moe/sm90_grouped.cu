// moe_sm90_grouped: the grouped path's two GEMMs (sm80_grouped.cu) on the TMA + wgmma main loop of
// sm90/gemm_pipe.cuh, for gated 16-bit experts on sm_90a. mma.sync tops out near 300 TFLOP/s
// there (Mixtral-like T = 512 under ncu, both GEMMs), which keeps a 512-token call at about twice
// its weights' read time.
//
//   gather   x rows into chunk order, xg[q] = x[perm[q] / k] (a [slots, d] copy in the workspace),
//            so a chunk's tokens are one 2-D box for TMA.
//   gate/up  tile (chunk, 128 hidden units; tall: 88): A = the chunk's rows of xg from its start
//            (128; tall: 192), B = the gate rows then the up rows of those units of the chunk's
//            expert (W1 seen as one [E * 2 hidden, d] matrix); the epilogue forms h = act(gate +
//            bg) * (up + bu) for the chunk's rows, rounded to the weights' dtype, into hbuf
//            [slots, hidden] at the chunk's positions (as the mma.sync path stores it).
//   down     tile (chunk, 256 outputs; tall: 128): A = the chunk's h rows, B = those rows of the
//            expert's W2 (W2 seen as [E * d_out, d_hidden]); fp32 results into the per-slot
//            output rows that the combine kernel reads.
// The plan's chunk (128 or 192 slots, moe/plan.cpp) picks the tiles (Tiles below). Up to 48
// expected slots per hit expert the plan asks for the swapped tiles instead (chunks of 160,
// sm90/gemm_swap.cuh: the weights as the wgmma's M, the chunk's tokens as N; Swap* below).
// A tile's rows past the chunk (the next chunk's tokens, or zeros past the buffers) and B rows
// past the expert (the next expert's rows) are multiplied and dropped, never stored: MMA rows and
// columns are independent. Tiles are walked chunk-fastest, so the chunks of one expert read the
// same weight box at about the same time (L2 hits after the first). Grids are the SM count; the
// chunk count is read on the device, so nothing depends on the routing and the op stays
// capturable. Each output element is one tile's fixed-order sum: reruns are bitwise equal.
// The gathered x lives in the hbuf region, which combine re-zeroes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/launch_util.hpp"
#include "cuda/moe/device.cuh"
#include "cuda/moe/moe_cuda.hpp"
#include "cuda/sm90/gemm_swap.cuh"

namespace fmlp::detail {
namespace {

using namespace fmlp::cuda::sm90;

constexpr int kGatherThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kGatherThreads) moe_sm90_gather_x(const MoeParams p) {
  const int per_row = p.d / 8;  // 16-byte pieces (d is a multiple of 64, x rows 16-byte aligned)
  const int64_t total = int64_t(p.slots) * per_row;
  uint4* xg = static_cast<uint4*>(p.xg);
  for (int64_t i = int64_t(blockIdx.x) * kGatherThreads + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * kGatherThreads) {
    const int q = int(i / per_row), c = int(i % per_row);
    const T* row = static_cast<const T*>(p.x) + int64_t(p.perm[q] / p.top_k) * p.x_ld;
    xg[i] = reinterpret_cast<const uint4*>(row)[c];
  }
}

#ifdef FMLP_SM90A

// The tiles of both GEMMs: (chunk, N tile), chunk fastest. p is the kernel's __grid_constant__
// parameter block (referenced, not copied).
struct ChunkTiles {
  const MoeParams& p;
  int chunks, n_tiles;
  __device__ int tiles() const { return chunks * n_tiles; }
  __device__ int rows(const SmTile& tl) const { return p.chunk_len[tl.id]; }
  // Tile t when each expert owns `expert_rows` rows of B, an N tile is `width` of them and the
  // second box starts `second` rows after the first.
  __device__ SmTile chunk_tile(int t, int expert_rows, int width, int second) const {
    const int ci = t % chunks, nt = t / chunks;
    const int base = p.chunk_expert[ci] * expert_rows + nt * width;
    return SmTile{p.chunk_start[ci], {base, base + second}, ci, nt};
  }
};

// BOXN hidden units per tile: their gate rows (box 0), then their up rows (box 1).
template <typename T, fmlp_activation_t ACT, int BOXN>
struct GateUpProblem : ChunkTiles {
  __device__ int k_blocks() const { return p.d / kPipeBK; }
  // The units' gate rows, then their up rows (W1 as [E x 2 hidden, d]).
  __device__ SmTile tile(int t) const { return chunk_tile(t, 2 * p.hidden, BOXN, p.hidden); }
  __device__ void epilogue(const float (&d)[BOXN], const SmTile& tl, int row, int col) const {
    const int len = p.chunk_len[tl.id], e = p.chunk_expert[tl.id];
    const void* b1 = fmlp::cuda::expert_vec(p.b1, p.b1_t, p.b1_e, e);
    T* h = reinterpret_cast<T*>(p.hbuf);
#pragma unroll
    for (int j = 0; j < BOXN / 8; ++j) {
      const int u = tl.n * BOXN + col + 8 * j;  // hidden is a multiple of 64: u + 1 too
      if (u >= p.hidden) continue;
      float bg0 = 0.f, bg1 = 0.f, bu0 = 0.f, bu1 = 0.f;
      if (b1) {
        bg0 = fmlp::cuda::load_scalar(b1, p.b1_t, u);
        bg1 = fmlp::cuda::load_scalar(b1, p.b1_t, u + 1);
        bu0 = fmlp::cuda::load_scalar(b1, p.b1_t, p.hidden + u);
        bu1 = fmlp::cuda::load_scalar(b1, p.b1_t, p.hidden + u + 1);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row + 8 * i;
        if (r >= len) continue;
        constexpr int kUp = BOXN / 2;  // the up columns' first accumulator
        const float h0 =
            fmlp::cuda::activate(ACT, d[4 * j + 2 * i] + bg0) * (d[kUp + 4 * j + 2 * i] + bu0);
        const float h1 = fmlp::cuda::activate(ACT, d[4 * j + 2 * i + 1] + bg1) *
                         (d[kUp + 4 * j + 2 * i + 1] + bu1);
        *reinterpret_cast<uint32_t*>(h + int64_t(tl.a_row + r) * p.hidden + u) =
            fmlp::cuda::pack2<T>(h0, h1);
      }
    }
  }
};

// 2 BOXN consecutive rows of W2 (as [E x d_out, hidden]) per tile.
template <int BOXN>
struct DownProblem : ChunkTiles {
  __device__ int k_blocks() const { return p.hidden / kPipeBK; }
  __device__ SmTile tile(int t) const { return chunk_tile(t, p.d_out, 2 * BOXN, BOXN); }
  __device__ void epilogue(const float (&d)[BOXN], const SmTile& tl, int row, int col) const {
    const int len = p.chunk_len[tl.id];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = row + 8 * i;
      if (r >= len) continue;
      float* out = p.out + int64_t(p.perm[tl.a_row + r]) * p.d_out;
#pragma unroll
      for (int j = 0; j < BOXN / 4; ++j) {
        const int o = tl.n * 2 * BOXN + col + 8 * j;  // d_out is a multiple of 8: o + 1 too
        if (o < p.d_out)
          *reinterpret_cast<float2*>(out + o) = make_float2(d[4 * j + 2 * i], d[4 * j + 2 * i + 1]);
      }
    }
  }
};

// The swapped tiles (sm90/gemm_swap.cuh): the weights are the wgmma's A, the chunk's tokens its B.
// A tile is (chunk, 128 weight rows); the pipe picks N (96 or 160) from the chunk's length.
struct SwapChunkTiles {
  const MoeParams& p;
  int chunks, n_tiles;
  __device__ int tiles() const { return chunks * n_tiles; }
  __device__ SwapTile tile(int t) const {
    const int ci = t % chunks, nt = t / chunks;
    return SwapTile{p.chunk_expert[ci], p.chunk_start[ci], min(kSwapMaxN, p.chunk_len[ci]), nt};
  }
};

// 64 hidden units per tile, their gate and up rows interleaved in groups of 8 by the 5-d W1 map
// (launch_swapped): tile row 16 g + r is gate row 8 g + r, row 16 g + 8 + r the up row of the same
// unit, so a thread's accumulator rows row and row + 8 are the gate and the up of one unit.
template <typename T, fmlp_activation_t ACT>
struct SwapGateUpProblem : SwapChunkTiles {
  __device__ int k_blocks() const { return p.d / kPipeBK; }
  __device__ void load_a(void* dst, const CUtensorMap* ta, uint64_t* bar, int kb,
                         const SwapTile& tl) const {
    tma_load_5d(dst, ta, bar, kb * kPipeBK, 0, 0, tl.nt * 8, tl.e);
  }
  template <int N>
  __device__ __forceinline__ void epilogue(const float (&d)[N / 2], const SwapTile& tl, int row,
                                           int col) const {
    const int u = tl.nt * 64 + (row >> 4) * 8 + (row & 7);
    if (u >= p.hidden) return;
    const void* b1 = fmlp::cuda::expert_vec(p.b1, p.b1_t, p.b1_e, tl.e);
    const float bg = b1 ? fmlp::cuda::load_scalar(b1, p.b1_t, u) : 0.f;
    const float bu = b1 ? fmlp::cuda::load_scalar(b1, p.b1_t, p.hidden + u) : 0.f;
    T* h = reinterpret_cast<T*>(p.hbuf) + int64_t(tl.b_row) * p.hidden + u;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int tok = col + 8 * j + q;
        if (tok < tl.len)
          h[int64_t(tok) * p.hidden] = fmlp::cuda::from_f<T>(
              fmlp::cuda::activate(ACT, d[4 * j + q] + bg) * (d[4 * j + 2 + q] + bu));
      }
  }
};

// 128 consecutive rows of W2 (as [E x d_out, hidden]) per tile; fp32 into the slots' output rows.
struct SwapDownProblem : SwapChunkTiles {
  __device__ int k_blocks() const { return p.hidden / kPipeBK; }
  __device__ void load_a(void* dst, const CUtensorMap* ta, uint64_t* bar, int kb,
                         const SwapTile& tl) const {
    tma_load(dst, ta, bar, kb * kPipeBK, tl.e * p.d_out + tl.nt * 128);
  }
  template <int N>
  __device__ __forceinline__ void epilogue(const float (&d)[N / 2], const SwapTile& tl, int row,
                                           int col) const {
    const int o = tl.nt * 128 + row;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int tok = col + 8 * j + q;
        if (tok >= tl.len) continue;
        float* out = p.out + int64_t(p.perm[tl.b_row + tok]) * p.d_out + o;
        if (o < p.d_out) out[0] = d[4 * j + q];
        if (o + 8 < p.d_out) out[8] = d[4 * j + 2 + q];
      }
  }
};

#endif  // FMLP_SM90A

// The tile shapes: 128 x 256 for both GEMMs (TALL false), or 192 rows (three consumers) x 176
// (gate/up: 88 units) and x 128 (down). N is what fills the SMs' last round of tiles: Mixtral-like
// hidden 14336 makes 163 gate/up tiles an expert (8 experts: 9.9 rounds of 132 SMs; 96 units made
// 150, 9.1 rounds, and ran slower at T = 512 on an H200 in the same call:
// bench/results/moe_tall_ab_h200.json) and 4096 outputs 32 down tiles (1.9 rounds; 176 would
// make 24, 1.5).
template <bool TALL>
struct Tiles {
  static constexpr int kConsumers = TALL ? 3 : 2;
  static constexpr int kUpBox = TALL ? 88 : 128, kDownBox = TALL ? 64 : 128;
  using Up = PipeShape<kConsumers, kUpBox>;
  using Down = PipeShape<kConsumers, kDownBox>;
};

template <typename T, fmlp_activation_t ACT, bool TALL>
__global__ void __launch_bounds__(Tiles<TALL>::Up::kThreads, 1)
    moe_sm90_grouped_gate_up(const __grid_constant__ CUtensorMap ta,
                             const __grid_constant__ CUtensorMap tb,
                             const __grid_constant__ MoeParams p) {
#ifdef FMLP_SM90A
  extern __shared__ unsigned char smem_raw[];
  using Problem = GateUpProblem<T, ACT, Tiles<TALL>::kUpBox>;
  const Problem pr{{p, p.hdr->chunks, (p.hidden + Tiles<TALL>::kUpBox - 1) / Tiles<TALL>::kUpBox}};
  gemm_sm90_pipe<T, Problem, Tiles<TALL>::kConsumers, Tiles<TALL>::kUpBox>(smem_raw, &ta, &tb, &tb,
                                                                           pr);
#endif
}

template <typename T, bool TALL>
__global__ void __launch_bounds__(Tiles<TALL>::Down::kThreads, 1)
    moe_sm90_grouped_down(const __grid_constant__ CUtensorMap ta,
                          const __grid_constant__ CUtensorMap tb,
                          const __grid_constant__ MoeParams p) {
#ifdef FMLP_SM90A
  extern __shared__ unsigned char smem_raw[];
  using Problem = DownProblem<Tiles<TALL>::kDownBox>;
  const Problem pr{
      {p, p.hdr->chunks, (p.d_out + Tiles<TALL>::Down::kBN - 1) / Tiles<TALL>::Down::kBN}};
  gemm_sm90_pipe<T, Problem, Tiles<TALL>::kConsumers, Tiles<TALL>::kDownBox>(smem_raw, &ta, &tb,
                                                                             &tb, pr);
#endif
}

template <typename T, fmlp_activation_t ACT>
__global__ void __launch_bounds__(SwapShape::kThreads, 1)
    moe_sm90_grouped_gate_up_swap(const __grid_constant__ CUtensorMap ta,
                                  const __grid_constant__ CUtensorMap tb,
                                  const __grid_constant__ MoeParams p) {
#ifdef FMLP_SM90A
  extern __shared__ unsigned char smem_raw[];
  using Problem = SwapGateUpProblem<T, ACT>;
  const Problem pr{{p, p.hdr->chunks, (p.hidden + 63) / 64}};
  gemm_sm90_swap<T, Problem>(smem_raw, &ta, &tb, pr);
#endif
}

template <typename T>
__global__ void __launch_bounds__(SwapShape::kThreads, 1)
    moe_sm90_grouped_down_swap(const __grid_constant__ CUtensorMap ta,
                               const __grid_constant__ CUtensorMap tb,
                               const __grid_constant__ MoeParams p) {
#ifdef FMLP_SM90A
  extern __shared__ unsigned char smem_raw[];
  const SwapDownProblem pr{{p, p.hdr->chunks, (p.d_out + 127) / 128}};
  gemm_sm90_swap<T, SwapDownProblem>(smem_raw, &ta, &tb, pr);
#endif
}

// ---- host ----

// f(std::integral_constant<fmlp_activation_t, ACT>{}) for the call's activation: the one switch
// from the runtime activation to the gate/up kernels' template parameter.
template <typename F>
fmlp_status_t with_activation(fmlp_activation_t act, F&& f) {
  using A = fmlp_activation_t;
  switch (act) {
    case FMLP_ACT_RELU: return f(std::integral_constant<A, FMLP_ACT_RELU>{});
    case FMLP_ACT_GELU: return f(std::integral_constant<A, FMLP_ACT_GELU>{});
    case FMLP_ACT_GELU_TANH: return f(std::integral_constant<A, FMLP_ACT_GELU_TANH>{});
    case FMLP_ACT_RELU2: return f(std::integral_constant<A, FMLP_ACT_RELU2>{});
    default: return f(std::integral_constant<A, FMLP_ACT_SILU>{});
  }
}

template <auto KERNEL, typename SHAPE>
fmlp_status_t start(const char* name, int grid, const CUtensorMap& ta, const CUtensorMap& tb,
                    const MoeParams& p, cudaStream_t s) {
  if (const fmlp_status_t st = allow_dynamic_smem<KERNEL>(SHAPE::kSmemBytes, name);
      st != FMLP_SUCCESS)
    return st;
  KERNEL<<<grid, SHAPE::kThreads, SHAPE::kSmemBytes, s>>>(ta, tb, p);
  return launch_status(name, fmt::format("{} blocks", grid));
}

template <typename T, bool TALL>
fmlp_status_t launch_gemms(const MoeParams& p, int sms, cudaStream_t s) {
  using Up = typename Tiles<TALL>::Up;
  using Down = typename Tiles<TALL>::Down;
  const fmlp_dtype_t t = p.w_t;
  CUtensorMap ta1, tb1, ta2, tb2;
  const int64_t rows1 = int64_t(p.experts) * 2 * p.hidden, rows2 = int64_t(p.experts) * p.d_out;
  const char* name = "moe_sm90_grouped";
  fmlp_status_t st =
      pipe_make_map(&ta1, name, "the gathered x", t, p.xg, p.slots, p.d, p.d, Up::kABox);
  if (st == FMLP_SUCCESS)
    st = pipe_make_map(&tb1, name, "W1", t, p.w1, rows1, p.d, p.w1_ld, Tiles<TALL>::kUpBox);
  if (st == FMLP_SUCCESS)
    st = pipe_make_map(&ta2, name, "h", t, p.hbuf, p.slots, p.hidden, p.hidden, Down::kABox);
  if (st == FMLP_SUCCESS)
    st = pipe_make_map(&tb2, name, "W2", t, p.w2, rows2, p.hidden, p.w2_ld, Tiles<TALL>::kDownBox);
  if (st != FMLP_SUCCESS) return st;
  const int64_t n1 = (p.hidden + Tiles<TALL>::kUpBox - 1) / Tiles<TALL>::kUpBox;
  const int64_t n2 = (p.d_out + Down::kBN - 1) / Down::kBN;
  const int grid1 = int(std::clamp<int64_t>(int64_t(p.max_chunks) * n1, 1, sms));
  const int grid2 = int(std::clamp<int64_t>(int64_t(p.max_chunks) * n2, 1, sms));
  st = with_activation(p.act, [&](auto act) {
    return start<&moe_sm90_grouped_gate_up<T, decltype(act)::value, TALL>, Up>(
        "moe_sm90_grouped_gate_up", grid1, ta1, tb1, p, s);
  });
  if (st != FMLP_SUCCESS) return st;
  return start<&moe_sm90_grouped_down<T, TALL>, Down>("moe_sm90_grouped_down", grid2, ta2, tb2, p,
                                                      s);
}

// The swapped tiles: W1 through a 5-d map whose 128-row box interleaves 8 gate and 8 up rows
// (dims k, row in group, gate / up, group, expert), W2 in 128-row boxes, the chunk's tokens
// (gathered x, then h) in kSwapBoxT-row boxes.
template <typename T>
fmlp_status_t launch_swapped(const MoeParams& p, int sms, cudaStream_t s) {
  const fmlp_dtype_t t = p.w_t;
  const char* name = "moe_sm90_grouped";
  CUtensorMap tw1, tx, tw2, th;
  const int64_t ld1 = p.w1_ld * 2;
  const cuuint64_t dims[5] = {cuuint64_t(p.d), 8, 2, cuuint64_t(p.hidden / 8),
                              cuuint64_t(p.experts)};
  const cuuint64_t strides[4] = {cuuint64_t(ld1), cuuint64_t(ld1 * p.hidden), cuuint64_t(ld1 * 8),
                                 cuuint64_t(p.w1_e * 2)};
  const cuuint32_t box[5] = {kPipeBK, 8, 2, 8, 1};
  fmlp_status_t st = make_tma_map(
      &tw1, name, "W1 (gate and up rows interleaved)",
      t == FMLP_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      p.w1, 5, dims, strides, box);
  if (st == FMLP_SUCCESS)
    st = pipe_make_map(&tx, name, "the gathered x", t, p.xg, p.slots, p.d, p.d, kSwapBoxT);
  if (st == FMLP_SUCCESS)
    st = pipe_make_map(&tw2, name, "W2", t, p.w2, int64_t(p.experts) * p.d_out, p.hidden, p.w2_ld);
  if (st == FMLP_SUCCESS)
    st = pipe_make_map(&th, name, "h", t, p.hbuf, p.slots, p.hidden, p.hidden, kSwapBoxT);
  if (st != FMLP_SUCCESS) return st;
  const int64_t n1 = (p.hidden + 63) / 64, n2 = (p.d_out + 127) / 128;
  const int grid1 = int(std::clamp<int64_t>(int64_t(p.max_chunks) * n1, 1, sms));
  const int grid2 = int(std::clamp<int64_t>(int64_t(p.max_chunks) * n2, 1, sms));
  st = with_activation(p.act, [&](auto act) {
    return start<&moe_sm90_grouped_gate_up_swap<T, decltype(act)::value>, SwapShape>(
        "moe_sm90_grouped_gate_up_swap", grid1, tw1, tx, p, s);
  });
  if (st != FMLP_SUCCESS) return st;
  return start<&moe_sm90_grouped_down_swap<T>, SwapShape>("moe_sm90_grouped_down_swap", grid2, tw2,
                                                          th, p, s);
}

template <typename T>
fmlp_status_t launch(const MoeParams& p, int sms, cudaStream_t s) {
  const int64_t pieces = int64_t(p.slots) * (p.d / 8);
  const int gather_blocks =
      int(std::clamp<int64_t>((pieces + kGatherThreads - 1) / kGatherThreads, 1, 8 * sms));
  moe_sm90_gather_x<T><<<gather_blocks, kGatherThreads, 0, s>>>(p);
  if (const fmlp_status_t st = launch_status("moe_sm90_gather_x"); st != FMLP_SUCCESS) return st;
  if (p.sm90_swap) return launch_swapped<T>(p, sms, s);
  // The plan's chunk is the tiles' rows: 192 (tall, three consumer warpgroups) or 128.
  return p.chunk == Tiles<true>::Up::kBM ? launch_gemms<T, true>(p, sms, s)
                                         : launch_gemms<T, false>(p, sms, s);
}

}  // namespace

bool moe_grouped_sm90_takes(const MoeParams& p, std::string* why) {
  const int64_t ws = 2;  // bytes of a 16-bit weight
  if (p.xg == nullptr) return (*why = "no gathered-x buffer in the workspace plan", false);
  if (!p.gated) return (*why = "dense experts (the sm_90 tiles pair gate and up rows)", false);
  if (!p.x_direct) return (*why = "x is not the experts' dtype in 16-byte aligned rows", false);
  if (p.w1_e != 2 * int64_t(p.hidden) * p.w1_ld || p.w2_e != int64_t(p.d_out) * p.w2_ld)
    return (*why =
                "the experts are not one matrix each of W1 and W2 (expert stride = rows x row "
                "stride): one TMA map spans every expert",
            false);
  if (reinterpret_cast<uintptr_t>(p.w1) % 16 || reinterpret_cast<uintptr_t>(p.w2) % 16 ||
      (p.w1_ld * ws) % 16 || (p.w2_ld * ws) % 16)
    return (*why = "W1 or W2 is not 16-byte aligned (TMA)", false);
  if (int64_t(p.experts) * 2 * p.hidden >= (int64_t(1) << 31))
    return (*why = "experts x 2 hidden rows past TMA's 32-bit coordinates", false);
  if (fmlp::cuda::sm90::encode_tiled() == nullptr)
    return (*why = "the driver has no cuTensorMapEncodeTiled", false);
  return true;
}

fmlp_status_t moe_launch_grouped_sm90(const MoeParams& p, int sms, cudaStream_t s) {
  return p.w_t == FMLP_DTYPE_F16 ? launch<__half>(p, sms, s) : launch<__nv_bfloat16>(p, sms, s);
}

}  // namespace fmlp::detail
