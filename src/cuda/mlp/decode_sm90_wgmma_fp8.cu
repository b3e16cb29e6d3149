// mlp_decode_sm90_wgmma_fp8: the MLP of up to four tokens with fp8 e4m3 weights as two tensor-core
// weight streams (engines/stream_wgmma_fp8.cuh), sm_90a.
//
// Why: the one-launch cluster kernel widens every e4m3 weight on the CUDA cores, and those
// conversions, not HBM, bound it (llama3-8b M = 1 runs far above its byte floor:
// bench/results/cuda_decode_fp8_h200.*). Here the
// tensor cores multiply e4m3 directly, at the price of h's round trip through the workspace
// (M x hidden 16-bit values) and a second launch, which programmatic dependent launch overlaps
// with the first one's tail (the down kernel's TMA copies of W2 start before it waits).
//   1. mlp_decode_sm90_wgmma_fp8_up: every block takes the norm statistics of x (all of d_in),
//      stages its k slice of the normalised x rounded to the activation dtype (as a 16-bit
//      model's norm output is rounded); gated: gate and up tiles of the same 64 units are read in
//      the same stage, so one thread holds both sums of a unit; the epilogue scales, adds b1,
//      applies the activation (and the gate product) and stores h rounded to the activation
//      dtype in the workspace.
//   2. mlp_decode_sm90_wgmma_fp8_down: stages its slice of h, streams W2; the epilogue scales,
//      adds b2 and the residual and writes y; the last block to finish re-zeroes h and its
//      counter (the workspace contract: left zero).
// Deterministic: fixed summation order everywhere.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/engines/stream_wgmma_fp8.cuh"
#include "cuda/mlp/entries.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::DecodeOperands;
using fmlp::cuda::kWgConsumers;
using fmlp::cuda::kWgMaxTokens;
using fmlp::cuda::kWgThreads;
using fmlp::cuda::WgShape;

constexpr const char* kName = "mlp_decode_sm90_wgmma_fp8";

struct WgMlpParams : DecodeOperands, fmlp::cuda::Fp8Scales {
  void* hbuf;              // [m, hidden] in the activation dtype, zero between calls
  unsigned* exit_counter;  // down blocks finished, zero between calls
  WgShape up, down;
  float *part_up, *part_down;
  unsigned *cnt_up, *cnt_down;
};

#ifdef FMLP_SM90A

__device__ __forceinline__ float round16(float v, fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F16 ? __half2float(__float2half_rn(v))
                             : __bfloat162float(__float2bfloat16_rn(v));
}

template <int NW>
struct UpOp {
  const WgMlpParams& p;
  int m;
  float* stats;  // shared: [kWgMaxTokens][2] mean, 1 / rms
  __device__ const char* row(int t) const {
    return static_cast<const char*>(p.x) + int64_t(t) * p.x_ld * 2;
  }
  // Per token, the sum over the consumer warpgroup of v[t]; `red` is [4][kWgMaxTokens] shared.
  __device__ void consumer_sums(float (&v)[kWgMaxTokens], float (*red)[kWgMaxTokens]) const {
#pragma unroll
    for (int t = 0; t < kWgMaxTokens; ++t) {
      v[t] = fmlp::cuda::warp_sum(v[t]);
      if (threadIdx.x % 32 == 0) red[threadIdx.x / 32][t] = v[t];
    }
    fmlp::cuda::wg_consumer_sync();
#pragma unroll
    for (int t = 0; t < kWgMaxTokens; ++t) v[t] = red[0][t] + red[1][t] + red[2][t] + red[3][t];
    fmlp::cuda::wg_consumer_sync();
  }
  // The norm statistics of every token (all of d_in: each block needs them for its slice), the
  // tokens side by side so their loads are in flight together.
  __device__ void prepare() {
    __shared__ float red[4][kWgMaxTokens];
    if (p.norm == FMLP_NORM_NONE) return;
    float mean[kWgMaxTokens] = {}, q[kWgMaxTokens] = {};
    if (p.norm == FMLP_NORM_LAYERNORM) {
#pragma unroll 4
      for (int c = threadIdx.x; c < p.k; c += kWgConsumers)
#pragma unroll
        for (int t = 0; t < kWgMaxTokens; ++t)
          if (t < m) mean[t] += fmlp::cuda::load_scalar(row(t), p.act_t, c);
      consumer_sums(mean, red);
#pragma unroll
      for (int t = 0; t < kWgMaxTokens; ++t) mean[t] /= float(p.k);
    }
#pragma unroll 4
    for (int c = threadIdx.x; c < p.k; c += kWgConsumers)
#pragma unroll
      for (int t = 0; t < kWgMaxTokens; ++t)
        if (t < m) {
          const float v = fmlp::cuda::load_scalar(row(t), p.act_t, c) - mean[t];
          q[t] += v * v;
        }
    consumer_sums(q, red);
    if (threadIdx.x == 0)
#pragma unroll
      for (int t = 0; t < kWgMaxTokens; ++t)
        stats[2 * t] = mean[t], stats[2 * t + 1] = rsqrtf(q[t] / float(p.k) + p.eps);
    fmlp::cuda::wg_consumer_sync();
  }
  __device__ float x(int t, int j) const {
    float v = fmlp::cuda::load_scalar(row(t), p.act_t, j);
    if (p.norm == FMLP_NORM_NONE) return v;
    v = (v - stats[2 * t]) * stats[2 * t + 1] * fmlp::cuda::opt(p.gamma, p.gamma_t, j, 1.f) +
        fmlp::cuda::opt(p.beta, p.beta_t, j, 0.f);
    return round16(v, p.act_t);
  }
  __device__ const uint8_t* w(int q, int r) const {
    return q == 0 ? static_cast<const uint8_t*>(p.wg) + int64_t(r) * p.wg_ld
                  : static_cast<const uint8_t*>(p.wu) + int64_t(r) * p.wu_ld;
  }
  __device__ void finish(int r, int t, const float (&v)[NW]) const {
    const float g = v[0] * p.sg[r * p.sg_stride] + fmlp::cuda::opt(p.bg, p.bg_t, r, 0.f);
    float hv;
    if constexpr (NW == 2) {
      const float u = v[1] * p.su[r * p.su_stride] + fmlp::cuda::opt(p.bu, p.bu_t, r, 0.f);
      hv = fmlp::cuda::activate(p.act, g) * u;
    } else {
      hv = fmlp::cuda::activate(p.act, g);
    }
    fmlp::cuda::store_scalar(static_cast<char*>(p.hbuf) + int64_t(t) * p.h * 2, p.act_t, r, hv);
  }
  __device__ void done() const {}
};

struct DownOp {
  const WgMlpParams& p;
  int m;
  __device__ void prepare() {}
  __device__ float x(int t, int j) const {  // h, written by the up grid: read past L1
    const unsigned short raw =
        __ldcg(static_cast<const unsigned short*>(p.hbuf) + int64_t(t) * p.h + j);
    return p.act_t == FMLP_DTYPE_F16 ? __half2float(__ushort_as_half(raw))
                                     : __bfloat162float(__ushort_as_bfloat16(raw));
  }
  __device__ const uint8_t* w(int, int r) const {
    return static_cast<const uint8_t*>(p.w2) + int64_t(r) * p.w2_ld;
  }
  __device__ void finish(int r, int t, const float (&v)[1]) const {
    float y = v[0] * p.s2[r * p.s2_stride] + fmlp::cuda::opt(p.b2, p.b2_t, r, 0.f);
    if (p.res)
      y += fmlp::cuda::load_scalar(static_cast<const char*>(p.res) + int64_t(t) * p.res_ld * 2,
                                   p.act_t, r);
    fmlp::cuda::store_scalar(static_cast<char*>(p.y) + int64_t(t) * p.y_ld * 2, p.act_t, r, y);
  }
  // Every block has read h once all have finished: the last re-zeroes it.
  __device__ void done() const {
    __shared__ unsigned is_last;
    __threadfence();
    fmlp::cuda::wg_consumer_sync();
    if (threadIdx.x == 0) is_last = atomicAdd(p.exit_counter, 1u) == gridDim.x - 1;
    fmlp::cuda::wg_consumer_sync();
    if (!is_last) return;
    const int64_t words = (int64_t(m) * p.h + 1) / 2;  // h starts 256-byte aligned
    for (int64_t i = threadIdx.x; i < words; i += kWgConsumers)
      __stcg(static_cast<unsigned*>(p.hbuf) + i, 0u);
    if (threadIdx.x == 0) *p.exit_counter = 0;
  }
};

#endif  // FMLP_SM90A

template <int NW>
__global__ void __launch_bounds__(kWgThreads, 1)
    mlp_decode_sm90_wgmma_fp8_up(const __grid_constant__ CUtensorMap mg,
                                 const __grid_constant__ CUtensorMap mu, const WgMlpParams p) {
#ifdef FMLP_SM90A
  __shared__ float stats[2 * kWgMaxTokens];
  UpOp<NW> op{p, p.m, stats};
  fmlp::cuda::wg_stream<NW>(&mg, &mu, p.up, p.part_up, p.cnt_up, op);
#endif
}

__global__ void __launch_bounds__(kWgThreads, 1)
    mlp_decode_sm90_wgmma_fp8_down(const __grid_constant__ CUtensorMap m2, const WgMlpParams p) {
#ifdef FMLP_SM90A
  DownOp op{p, p.m};
  fmlp::cuda::wg_stream<1>(&m2, &m2, p.down, p.part_down, p.cnt_down, op);
#endif
}

fmlp_status_t launch(bool gated, const CUtensorMap& mg, const CUtensorMap& mu,
                     const CUtensorMap& m2, const WgMlpParams& p, bool pdl, cudaStream_t cs) {
  const size_t smem_up = fmlp::cuda::wg_smem_bytes(p.up),
               smem_down = fmlp::cuda::wg_smem_bytes(p.down);
  fmlp_status_t st;
  if (gated) {
    constexpr auto up = &mlp_decode_sm90_wgmma_fp8_up<2>;
    st = allow_dynamic_smem<up>(smem_up, "mlp_decode_sm90_wgmma_fp8_up");
    if (st == FMLP_SUCCESS)
      st = launch_ex(up, dim3(fmlp::cuda::wg_grid(p.up)), dim3(kWgThreads), smem_up, pdl, cs,
                     "mlp_decode_sm90_wgmma_fp8_up", mg, mu, p);
  } else {
    constexpr auto up = &mlp_decode_sm90_wgmma_fp8_up<1>;
    st = allow_dynamic_smem<up>(smem_up, "mlp_decode_sm90_wgmma_fp8_up");
    if (st == FMLP_SUCCESS)
      st = launch_ex(up, dim3(fmlp::cuda::wg_grid(p.up)), dim3(kWgThreads), smem_up, pdl, cs,
                     "mlp_decode_sm90_wgmma_fp8_up", mg, mu, p);
  }
  if (st != FMLP_SUCCESS) return st;
  constexpr auto down = &mlp_decode_sm90_wgmma_fp8_down;
  if (st = allow_dynamic_smem<down>(smem_down, "mlp_decode_sm90_wgmma_fp8_down");
      st != FMLP_SUCCESS)
    return st;
  return launch_ex(down, dim3(fmlp::cuda::wg_grid(p.down)), dim3(kWgThreads), smem_down, pdl, cs,
                   "mlp_decode_sm90_wgmma_fp8_down", m2, p);
}

struct Shapes {
  WgShape up, down;
};

Shapes shapes_of(const MlpDesc& d) {
  const int sms = cuda_sm_count(d.device_id);
  return {fmlp::cuda::wg_shape(d.hidden, d.d_in, d.gated ? 2 : 1, sms),
          fmlp::cuda::wg_shape(d.d_out, d.hidden, 1, sms)};
}

// Workspace parts in order: h, the exit counter, up partials, up counters, down partials, down
// counters.
struct Layout {
  size_t h, exit, part_up, cnt_up, part_down, cnt_down, total;
};

Layout layout_of(const MlpDesc& d, const Shapes& s) {
  Layout l{};
  const int nw = d.gated ? 2 : 1;
  l.h = 0;
  l.exit = align_up(size_t(d.m) * size_t(d.hidden) * 2);
  l.part_up = l.exit + align_up(sizeof(unsigned));
  l.cnt_up = l.part_up + align_up(fmlp::cuda::wg_partial_bytes(s.up, nw));
  l.part_down = l.cnt_up + align_up(fmlp::cuda::wg_counter_bytes(s.up));
  l.cnt_down = l.part_down + align_up(fmlp::cuda::wg_partial_bytes(s.down, 1));
  l.total = l.cnt_down + align_up(fmlp::cuda::wg_counter_bytes(s.down));
  return l;
}

}  // namespace

bool mlp_decode_sm90_wgmma_fp8_supports(const MlpDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CUDA) return (*why = "needs CUDA device memory", false);
  if (d.w_dtype != FMLP_DTYPE_F8_E4M3)
    return (*why = fmt::format("{} weights: {} takes fp8 e4m3 weights", fmlp_dtype_name(d.w_dtype),
                               kName),
            false);
  if (d.act_dtype != FMLP_DTYPE_BF16 && d.act_dtype != FMLP_DTYPE_F16)
    return (*why = fmt::format("{} activations: {} splits x and h into e4m3 parts exactly only "
                               "for bf16/f16; the splitk kernel takes f32",
                               fmlp_dtype_name(d.act_dtype), kName),
            false);
  if (d.m < 1 || d.m > kWgMaxTokens)
    return (*why = fmt::format("M={}: {} takes 1 to {} tokens (more: mlp_decode_sm90_cluster)", d.m,
                               kName, kWgMaxTokens),
            false);
  if (d.d_in < 1 || d.hidden < 1)
    return (*why = fmt::format("d_in {} and hidden {} must be >= 1", d.d_in, d.hidden), false);
  if (!d.weights_vec16)
    return (*why =
                "a weight matrix is not 16-byte aligned (base or row stride); pack the weights "
                "with fmlp_mlp_pack",
            false);
  if (d.d_in >= (int64_t(1) << 30) || d.hidden >= (int64_t(1) << 30) ||
      d.d_out >= (int64_t(1) << 30))
    return (*why = "d_in, hidden and d_out must be below 2^30", false);
  const Shapes s = shapes_of(d);
  if (!fmlp::cuda::wg_shape_ok(s.up, kName, why) || !fmlp::cuda::wg_shape_ok(s.down, kName, why))
    return false;
  return fmlp::cuda::wg_device_supports(
      kName, d.device_id,
      std::max(fmlp::cuda::wg_smem_bytes(s.up), fmlp::cuda::wg_smem_bytes(s.down)), why);
}

size_t mlp_decode_sm90_wgmma_fp8_workspace(const MlpDesc& d) {
  return layout_of(d, shapes_of(d)).total;
}

fmlp_status_t mlp_decode_sm90_wgmma_fp8_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                            void* workspace, void* stream) {
  if (d.d_out == 0) return FMLP_SUCCESS;  // nothing to write
  WgMlpParams p{};
  static_cast<DecodeOperands&>(p) = fmlp::cuda::decode_operands(a, d);
  static_cast<fmlp::cuda::Fp8Scales&>(p) = fmlp::cuda::fp8_scales(a, d);
  const Shapes s = shapes_of(d);
  p.up = s.up;
  p.down = s.down;
  const Layout l = layout_of(d, s);
  char* base = static_cast<char*>(workspace);
  p.hbuf = base + l.h;
  p.exit_counter = reinterpret_cast<unsigned*>(base + l.exit);
  p.part_up = reinterpret_cast<float*>(base + l.part_up);
  p.cnt_up = reinterpret_cast<unsigned*>(base + l.cnt_up);
  p.part_down = reinterpret_cast<float*>(base + l.part_down);
  p.cnt_down = reinterpret_cast<unsigned*>(base + l.cnt_down);

  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  CUtensorMap mg, mu, m2;
  if (fmlp_status_t st = fmlp::cuda::wg_make_map(&mg, kName, d.gated ? "the gate weights" : "W1",
                                                 p.wg, d.hidden, d.d_in, p.wg_ld);
      st != FMLP_SUCCESS)
    return st;
  if (d.gated) {
    if (fmlp_status_t st =
            fmlp::cuda::wg_make_map(&mu, kName, "the up weights", p.wu, d.hidden, d.d_in, p.wu_ld);
        st != FMLP_SUCCESS)
      return st;
  } else {
    mu = mg;
  }
  if (fmlp_status_t st =
          fmlp::cuda::wg_make_map(&m2, kName, "W2", p.w2, d.d_out, d.hidden, p.w2_ld);
      st != FMLP_SUCCESS)
    return st;
  auto cs = static_cast<cudaStream_t>(stream);
  const bool pdl = pdl_enabled(cuda_compute_capability(d.device_id));
  return launch(d.gated, mg, mu, m2, p, pdl, cs);
}

}  // namespace fmlp::detail
