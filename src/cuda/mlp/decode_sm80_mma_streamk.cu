// mlp_decode_sm80_mma_streamk: the MLP of 1..64 tokens of bf16/fp16 (batched decode), with
// bf16/fp16 weights or e4m3 weights (weight-only: widened exactly to the activations' dtype in
// registers, the fp32 scales applied in the epilogues), as two stream-K tensor-core weight
// streams (engines/mma_streamk.cuh), each weight read once for all tokens, chained with
// programmatic dependent launch.
//   0. (only with a pre-norm, or x that cannot be staged as it is) mlp_decode_sm80_mma_streamk_
//      stage: one block a token writes norm(x) in the weights' dtype to the workspace (as a
//      16-bit model's norm output is rounded); the up stream stages that instead of x.
//   1. mlp_decode_sm80_mma_streamk_up: W1's rows as mma groups of 16 (gated: 8 gate rows over
//      the 8 up rows of the same hidden units, so one lane holds both sums of a unit and applies
//      the activation and the gating in registers), b1 and the activation in the epilogue, h
//      rounded to the weights' dtype (as PyTorch rounds it) into the workspace, [M][hidden]:
//      M x hidden x 2 bytes that stay in L2.
//   2. mlp_decode_sm80_mma_streamk_down: W2 against h, b2 and the residual in the epilogue.
// Only the tile counters need the zeroed part of the workspace (fusedmlp.h); norm(x), h and the
// partial slots are scratch, written before they are read in every call, so nothing is cleared.
// fp32 accumulation in a fixed order for a given grid (tiles split between blocks are summed in
// block order), so reruns on one device are bitwise equal: the entry takes deterministic mode.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/engines/mma_streamk.cuh"
#include "cuda/mlp/entries.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::DecodeOperands;
using fmlp::cuda::MmaStreamKScratch;
using fmlp::cuda::MmaStreamKShape;

constexpr int kMaxTokens = 64;
constexpr int kWarps = 8;  // a block: 8 warps, two blocks a multiprocessor (128 registers each)
constexpr int kStageThreads = 256;

// Weight load steps a warp keeps in flight (engines/mma_streamk.cuh): 32-column steps of 16-byte
// pieces, or 64-column steps (fp8, and WIDE 16-bit: two pieces a row and lane) whose registers
// leave room for 3 of them with 48 and 64 tokens' accumulators.
constexpr int depth_for(bool lane16, bool two_pieces, int nt) {
  return lane16 && two_pieces && nt >= 6 ? 3 : 4;
}
struct StreamKMlpParams : DecodeOperands, fmlp::cuda::Fp8Scales {
  const void* xsrc;  // what the up stream stages: x itself, or norm(x) in the workspace
  int64_t xsrc_ld;
  void* xn;    // [m][k] workspace rows the stage kernel writes (or nullptr)
  void* hbuf;  // [m][h] workspace
  MmaStreamKShape up, down;
  MmaStreamKScratch scratch;
};

// What the launches of one call need, worked out once on the host: the same for the workspace
// query and the run.
struct Plan {
  int nt;
  bool wide;   // 16-bit weights read as 64-column steps (two 16-byte pieces a row and lane)
  bool stage;  // the stage kernel runs (a pre-norm, or x rows not 16-byte aligned)
  MmaStreamKShape up, down;
  // The tile counters in the workspace's zeroed part; xn, h and the partial slots in its scratch.
  size_t tiles_bytes, xn_bytes, h_bytes, slot_bytes, total;
};

// Token tiles of 8 an instance is built for: M = 17..24 runs the 32-token instance, etc.
int nt_for(int64_t m) {
  const int nt = int((m + 7) / 8);
  return nt <= 2 ? nt : nt <= 4 ? 4 : nt <= 6 ? 6 : 8;
}

// Columns per chunk: two rounds of a warp's load steps in flight (`unit` columns) where that
// leaves at least four iterations a block, else one (small layers: more, shorter iterations keep
// more multiprocessors busy).
MmaStreamKShape shape_for(int64_t n, int64_t k, int max_blocks, int unit) {
  auto s = fmlp::cuda::mma_streamk_shape(n, k, kWarps, 2 * unit, max_blocks);
  if (s.iters < 4 * max_blocks) s = fmlp::cuda::mma_streamk_shape(n, k, kWarps, unit, max_blocks);
  return s;
}

// The stage kernel runs for a pre-norm and for x whose rows cannot be staged by 16-byte copies
// (the workspace always has room for its output: M x d_in x 2 bytes).
bool needs_stage(const fmlp_mlp_args_t& a, const MlpDesc& d) {
  const size_t es = dtype_size(d.act_dtype);
  const bool x_vec = reinterpret_cast<uintptr_t>(a.x.data) % 16 == 0 &&
                     (d.m == 1 || (size_t(a.x.stride[0]) * es) % 16 == 0);
  return d.norm != FMLP_NORM_NONE || !x_vec || padded_width(d, d.d_in) != d.d_in;
}

Plan plan_for(const MlpDesc& d) {
  Plan pl{};
  // FMLP_STREAMK_WIDE=0|1 forces 16-bit weights' 32- or 64-column steps, for measurements.
  static const int env_wide = int(knob_bool<Knob::FMLP_STREAMK_WIDE>());
  pl.nt = nt_for(d.m);
  const int sms = std::max(1, cuda_sm_count(d.device_id));
  const int max_blocks = sms * 2;
  const int64_t rows1 = d.gated ? (d.hidden + 7) / 8 * 16 : d.hidden;
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  pl.wide = !fp8 && env_wide == 1;
  const bool lane16 = fp8 || pl.wide;
  const int unit = (lane16 ? 64 : 32) * depth_for(lane16, pl.wide, pl.nt);
  const int64_t kp = padded_width(d, d.d_in), hp = padded_width(d, d.hidden);
  pl.up = shape_for(rows1, kp, max_blocks, unit);
  pl.down = shape_for(d.d_out, hp, max_blocks, unit);
  const size_t es = dtype_size(d.act_dtype);  // x and h are staged in the activations' dtype
  pl.xn_bytes = align_up(size_t(d.m) * size_t(kp) * es);
  pl.h_bytes = align_up(size_t(d.m) * size_t(hp) * es);
  pl.tiles_bytes = align_up(size_t(std::max(pl.up.tiles, pl.down.tiles)) * 4);
  pl.slot_bytes = align_up(size_t(std::max(pl.up.blocks, pl.down.blocks)) * 2 *
                           size_t(fmlp::cuda::mma_streamk_slot_floats(kWarps, pl.nt)) * 4);
  pl.total = cuda_scratch_workspace_bytes(pl.xn_bytes + pl.h_bytes + pl.slot_bytes);
  return pl;
}

// The activation, not inlined: an epilogue applies it to up to 128 values a lane, at two call
// sites (whole and split tiles), and the inlined erff / tanhf / expf made the up kernels ten times
// the size of their main loop.
template <typename WT, bool WIDE, int NT>
constexpr int kDepth = depth_for(sizeof(WT) == 1 || WIDE, WIDE, NT);

__device__ __noinline__ float act_of(fmlp_activation_t act, float x) {
  return fmlp::cuda::activate(act, x);
}

__device__ __forceinline__ void pdl_begin() {
  fmlp::cuda::pdl_wait_previous_grid();
  fmlp::cuda::pdl_allow_next_grid();
}

// norm(x) of token blockIdx.x in WT into p.xn ([m][kp], zeros past k: they meet the zero padding
// of packed W1 rows).
template <typename WT>
__global__ void __launch_bounds__(kStageThreads)
    mlp_decode_sm80_mma_streamk_stage(const StreamKMlpParams p) {
  __shared__ float scratch[kStageThreads / 32];
  pdl_begin();
  const int64_t es = p.act_t == FMLP_DTYPE_F32 ? 4 : 2;
  const bool vec = fmlp::cuda::x_rows_vec(p);
  const char* row = static_cast<const char*>(p.x) + blockIdx.x * p.x_ld * es;
  float mean, inv;
  fmlp::cuda::token_norm_stats<kStageThreads>(p, row, vec, scratch, mean, inv);
  WT* out = static_cast<WT*>(p.xn) + int64_t(blockIdx.x) * p.kp;
  for (int c = p.k + int(threadIdx.x); c < p.kp; c += kStageThreads)
    out[c] = fmlp::cuda::from_f<WT>(0.f);
  fmlp::cuda::for_row_runs<kStageThreads>(
      row, p.act_t, p.k, vec, [&](int c0, int n, const float(&f)[8]) {
        float g[8], b[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          g[e] = e < n ? fmlp::cuda::opt(p.gamma, p.gamma_t, c0 + e, 1.f) : 0.f;
          b[e] = e < n ? fmlp::cuda::opt(p.beta, p.beta_t, c0 + e, 0.f) : 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (e < n) out[c0 + e] = fmlp::cuda::from_f<WT>((f[e] - mean) * inv * g[e] + b[e]);
      });
}

// WT: the weights' element (uint8_t: e4m3), XT: the activations' 16-bit dtype.
template <typename WT, typename XT, bool WIDE, int NT>
__global__ void __launch_bounds__(kWarps * 32, 2)
    mlp_decode_sm80_mma_streamk_up(const StreamKMlpParams p) {
  constexpr bool kFp8 = sizeof(WT) == 1;
  extern __shared__ uint4 smem_v[];
  const bool gated = p.wu != nullptr;
  auto row_ptr = [&](int v) -> const WT* {
    if (!gated) return v < p.h ? static_cast<const WT*>(p.wg) + int64_t(v) * p.wg_ld : nullptr;
    const int unit = (v >> 4) * 8 + (v & 7);
    if (unit >= p.h) return nullptr;
    return (v & 8) ? static_cast<const WT*>(p.wu) + int64_t(unit) * p.wu_ld
                   : static_cast<const WT*>(p.wg) + int64_t(unit) * p.wg_ld;
  };
  XT* h = static_cast<XT*>(p.hbuf);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  auto epi = [&](int tile, const float(&acc)[NT][4]) {
    const int v = tile * 16 * kWarps + warp * 16 + g;  // virtual row of c[0..1]; v + 8: c[2..3]
    if (gated) {
      const int unit = (v >> 4) * 8 + (v & 7);
      if (unit >= p.h) return;
      const float bg = fmlp::cuda::opt(p.bg, p.bg_t, unit, 0.f);
      const float bu = fmlp::cuda::opt(p.bu, p.bu_t, unit, 0.f);
      const float sg = kFp8 ? p.sg[unit * p.sg_stride] : 1.f;
      const float su = kFp8 ? p.su[unit * p.su_stride] : 1.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int tok = nt * 8 + 2 * t + i;
          if (tok < p.m)
            h[int64_t(tok) * p.hp + unit] = fmlp::cuda::from_f<XT>(
                act_of(p.act, acc[nt][i] * sg + bg) * (acc[nt][2 + i] * su + bu));
        }
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int unit = v + 8 * half;
        if (unit >= p.h) continue;
        const float b1 = fmlp::cuda::opt(p.bg, p.bg_t, unit, 0.f);
        const float sg = kFp8 ? p.sg[unit * p.sg_stride] : 1.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int tok = nt * 8 + 2 * t + i;
            if (tok < p.m)
              h[int64_t(tok) * p.hp + unit] =
                  fmlp::cuda::from_f<XT>(act_of(p.act, acc[nt][2 * half + i] * sg + b1));
          }
      }
    }
  };
  fmlp::cuda::mma_streamk_run<kWarps, NT, kDepth<WT, WIDE, NT>, WT, XT, WIDE>(
      p.up, row_ptr, static_cast<const XT*>(p.xsrc), p.xsrc_ld, p.m, p.scratch,
      reinterpret_cast<XT*>(smem_v), epi, pdl_begin);
  // h's columns [h, hp) meet the zero padding of packed W2 rows: zeros, not the scratch's old
  // bytes (written after the previous grid's wait, which the run passed).
  const int pad = p.hp - p.h;
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < p.m * pad; i += kWarps * 32)
      h[int64_t(i / pad) * p.hp + p.h + i % pad] = fmlp::cuda::from_f<XT>(0.f);
}

template <typename WT, typename XT, bool WIDE, int NT>
__global__ void __launch_bounds__(kWarps * 32, 2)
    mlp_decode_sm80_mma_streamk_down(const StreamKMlpParams p) {
  constexpr bool kFp8 = sizeof(WT) == 1;
  extern __shared__ uint4 smem_v[];
  auto row_ptr = [&](int v) -> const WT* {
    return v < p.n ? static_cast<const WT*>(p.w2) + int64_t(v) * p.w2_ld : nullptr;
  };
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const XT* res = static_cast<const XT*>(p.res);
  XT* y = static_cast<XT*>(p.y);
  auto epi = [&](int tile, const float(&acc)[NT][4]) {  // y and the residual are XT
    const int v = tile * 16 * kWarps + warp * 16 + g;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int o = v + 8 * half;
      if (o >= p.n) continue;
      const float b2 = fmlp::cuda::opt(p.b2, p.b2_t, o, 0.f);
      const float s2 = kFp8 ? p.s2[o * p.s2_stride] : 1.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int tok = nt * 8 + 2 * t + i;
          if (tok >= p.m) continue;
          float r = acc[nt][2 * half + i] * s2 + b2;
          if (res) r += fmlp::cuda::to_f(res[int64_t(tok) * p.res_ld + o]);
          y[int64_t(tok) * p.y_ld + o] = fmlp::cuda::from_f<XT>(r);
        }
    }
  };
  fmlp::cuda::mma_streamk_run<kWarps, NT, kDepth<WT, WIDE, NT>, WT, XT, WIDE>(
      p.down, row_ptr, static_cast<const XT*>(p.hbuf), p.hp, p.m, p.scratch,
      reinterpret_cast<XT*>(smem_v), epi, pdl_begin);
}

template <typename WT, typename XT, bool WIDE, int NT>
fmlp_status_t launch(const StreamKMlpParams& p, const Plan& pl, cudaStream_t s, int device) {
  constexpr bool kLane16 = sizeof(WT) == 1 || WIDE;
  constexpr auto up = &mlp_decode_sm80_mma_streamk_up<WT, XT, WIDE, NT>;
  constexpr auto down = &mlp_decode_sm80_mma_streamk_down<WT, XT, WIDE, NT>;
  const size_t smem_up = fmlp::cuda::mma_streamk_smem(NT, p.up.kc, kLane16);
  const size_t smem_down = fmlp::cuda::mma_streamk_smem(NT, p.down.kc, kLane16);
  if (fmlp_status_t st = allow_dynamic_smem<up>(smem_up, "mlp_decode_sm80_mma_streamk_up");
      st != FMLP_SUCCESS)
    return st;
  if (fmlp_status_t st = allow_dynamic_smem<down>(smem_down, "mlp_decode_sm80_mma_streamk_down");
      st != FMLP_SUCCESS)
    return st;
  const bool pdl = pdl_enabled(cuda_compute_capability(device));
  if (pl.stage) {
    if (fmlp_status_t st =
            launch_ex(&mlp_decode_sm80_mma_streamk_stage<XT>, dim3(unsigned(p.m)),
                      dim3(kStageThreads), 0, pdl, s, "mlp_decode_sm80_mma_streamk_stage", p);
        st != FMLP_SUCCESS)
      return st;
  }
  if (fmlp_status_t st = launch_ex(up, dim3(unsigned(p.up.blocks)), dim3(kWarps * 32), smem_up, pdl,
                                   s, "mlp_decode_sm80_mma_streamk_up", p);
      st != FMLP_SUCCESS)
    return st;
  return launch_ex(down, dim3(unsigned(p.down.blocks)), dim3(kWarps * 32), smem_down, pdl, s,
                   "mlp_decode_sm80_mma_streamk_down", p);
}

template <typename WT, typename XT, bool WIDE>
fmlp_status_t dispatch_nt(const StreamKMlpParams& p, const Plan& pl, cudaStream_t s, int device) {
  switch (pl.nt) {
    case 1: return launch<WT, XT, WIDE, 1>(p, pl, s, device);
    case 2: return launch<WT, XT, WIDE, 2>(p, pl, s, device);
    case 4: return launch<WT, XT, WIDE, 4>(p, pl, s, device);
    case 6: return launch<WT, XT, WIDE, 6>(p, pl, s, device);
    default: return launch<WT, XT, WIDE, 8>(p, pl, s, device);
  }
}

template <typename WT, typename XT>
fmlp_status_t dispatch(const StreamKMlpParams& p, const Plan& pl, cudaStream_t s, int device) {
  if constexpr (sizeof(WT) == 1) {
    return dispatch_nt<WT, XT, false>(p, pl, s, device);
  } else {
    return pl.wide ? dispatch_nt<WT, XT, true>(p, pl, s, device)
                   : dispatch_nt<WT, XT, false>(p, pl, s, device);
  }
}

}  // namespace

bool mlp_decode_sm80_mma_streamk_supports(const MlpDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CUDA) return (*why = "needs CUDA device memory", false);
  if (d.m < 1 || d.m > kMaxTokens)
    return (*why = fmt::format("M={}: this entry takes 1 to {} tokens", d.m, kMaxTokens), false);
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16 && !fp8)
    return (*why = fmt::format("{} weights: this entry takes bf16, f16 or f8_e4m3 weights",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  if (fp8 ? d.act_dtype != FMLP_DTYPE_BF16 && d.act_dtype != FMLP_DTYPE_F16
          : d.act_dtype != d.w_dtype)
    return (*why = fmt::format("{} activations with {} weights: this entry takes {}",
                               fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype),
                               fp8 ? "bf16 or f16 activations with fp8 weights"
                                   : "activations of the weights' dtype"),
            false);
  if (fp8 && cuda_compute_capability(d.device_id) < 89)
    return (*why = "fp8 weights need compute capability 8.9 or newer (the e4m3 conversion)", false);
  const int64_t per_load = fp8 ? 16 : 8;  // weights per 16-byte load
  const int64_t kp = padded_width(d, d.d_in), hp = padded_width(d, d.hidden);
  if (kp % per_load != 0 || hp % per_load != 0 || d.d_in == 0 || d.hidden == 0)
    return (*why = fmt::format("d_in {} and hidden {} must be positive multiples of {} for "
                               "16-byte loads of {} weights; fmlp_mlp_pack pads the weights so "
                               "that any size streams",
                               d.d_in, d.hidden, per_load, fmlp_dtype_name(d.w_dtype)),
            false);
  if (!d.weights_vec16)
    return (*why =
                "a weight matrix is not 16-byte aligned (base or row stride); pack the weights "
                "with fmlp_mlp_pack",
            false);
  if (d.hidden >= (int64_t(1) << 30) || d.d_out >= (int64_t(1) << 30) ||
      d.d_in >= (int64_t(1) << 30))
    return (*why = "d_in, hidden and d_out must be below 2^30", false);
  const Plan pl = plan_for(d);
  if (!fmlp::cuda::mma_streamk_fits(pl.up) || !fmlp::cuda::mma_streamk_fits(pl.down))
    return (*why = "the layer is too large for the stream-K partition's 32-bit arithmetic", false);
  if (pl.tiles_bytes > kCudaWorkspaceZeroedBytes)
    return (*why = fmt::format("{} bytes of tile counters exceed the workspace's zeroed part ({} "
                               "bytes); mlp_decode_sm90_splitk takes layers this large",
                               pl.tiles_bytes, kCudaWorkspaceZeroedBytes),
            false);
  return true;
}

size_t mlp_decode_sm80_mma_streamk_workspace(const MlpDesc& d) {
  return plan_for(d).total;
}

fmlp_status_t mlp_decode_sm80_mma_streamk_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                              void* workspace, void* stream) {
  Plan pl = plan_for(d);
  pl.stage = needs_stage(a, d);
  StreamKMlpParams p{};
  static_cast<DecodeOperands&>(p) = fmlp::cuda::decode_operands(a, d);
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3)
    static_cast<fmlp::cuda::Fp8Scales&>(p) = fmlp::cuda::fp8_scales(a, d);
  p.scratch.tile_count = static_cast<unsigned*>(workspace);
  char* scratch = static_cast<char*>(cuda_workspace_scratch(workspace));
  p.xn = scratch;
  p.hbuf = scratch + pl.xn_bytes;
  p.scratch.slots = reinterpret_cast<float*>(scratch + pl.xn_bytes + pl.h_bytes);
  p.up = pl.up;
  p.down = pl.down;
  p.xsrc = pl.stage ? p.xn : a.x.data;
  p.xsrc_ld = pl.stage ? p.kp : a.x.stride[0];
  if (d.d_out == 0) return FMLP_SUCCESS;
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  const bool f16 = d.act_dtype == FMLP_DTYPE_F16;
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3)
    return f16 ? dispatch<uint8_t, __half>(p, pl, s, d.device_id)
               : dispatch<uint8_t, __nv_bfloat16>(p, pl, s, d.device_id);
  return f16 ? dispatch<__half, __half>(p, pl, s, d.device_id)
             : dispatch<__nv_bfloat16, __nv_bfloat16>(p, pl, s, d.device_id);
}

}  // namespace fmlp::detail
