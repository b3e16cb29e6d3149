// mlp_decode_sm80_stream: the MLP of up to four tokens as two memory-order weight streams
// (engines/stream_gemv.cuh), for bf16/fp16 weights and e4m3 weights (weight-only, bf16/fp16 x).
//
// Why: at M = 1 the MLP is a read of its weights, and the one-launch kernels read them well below
// a plain stream (docs/decode.md: the cluster kernel at 47 % of DRAM peak). Here each weight
// matrix is one stream of engines/stream_gemv.cuh, at the price of h's round trip through the
// workspace (M x hidden x 2 bytes) and a second launch, which programmatic dependent launch
// overlaps with the first one's tail. Measured on an H200 (graph replay, cold L2,
// docs/decode.md, bench/results/cuda_decode_stream_h200.*): faster than the cuBLASLt path at
// M = 1 on gpt2-small, 4096 -> 4096 gelu, llama3-8b and llama3-70b, so the planner's M = 1
// choice on every measured shape.
//   1. mlp_decode_sm80_stream_up: every block stages x, normalised, in the weights' dtype (as a
//      16-bit model's norm output is rounded); W1 is streamed row by row (gated: gate row j and up
//      row j interleaved as rows 2j and 2j + 1 of one virtual matrix, so one thread gets both
//      sums); the epilogue adds b1 (b_gate, b_up), applies the activation (and the gating) and
//      stores h rounded to the weights' dtype (as PyTorch rounds it) to the workspace.
//   2. mlp_decode_sm80_stream_down: launched early, requests its first W2 batch (and into L2,
//      where W2 outgrows the L2 its first groups, else where rows are long its next two batches)
//      before it waits for the up grid; then every block stages h (scratch: nothing to clear;
//      with fp8 weights each block counts itself in and the last re-zeroes the largest-|h| words,
//      which live in the workspace's zeroed part); W2 is streamed; the epilogue adds b2 and the
//      residual and writes y.
// fp32 accumulation in a fixed order (deterministic). x and h in 16 bits halve the shared memory
// of fp32 staging (four blocks per multiprocessor at M <= 2 instead of three) and the shared-
// memory reads per weight chunk. Limits: h and the normalised x in shared memory (M x hidden and
// M x d_in elements of the weights' dtype, at most kMaxStageBytes).
// e4m3 weights: x (normalised) and h are rounded to the activations' 16-bit dtype, as a 16-bit
// model rounds them, h goes through the workspace in that dtype, and each kernel stages its rows
// as fp16 times a power of two per token for the stream's packed fp16 products; the epilogues
// undo the power of two and apply the per-tensor or per-row scales. The up kernel's epilogue also
// takes each token's largest finite |h| (one atomic per block into the workspace), so the down
// kernel stages h scaled straight from L2 (stream_stage_f16_scaled) instead of staging, scanning
// and rewriting it; x without a norm goes the same way (its largest |x| from a first pass).
// fp8 llama3-8b at M = 1 on an H200: about two thirds of the cluster kernel's time
// (bench/results/cuda_decode_fp8_h200.*).
#include <cuda_runtime.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/engines/stream_gemv.cuh"
#include "cuda/mlp/entries.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::activate;
using fmlp::cuda::DecodeOperands;
using fmlp::cuda::from_f;
using fmlp::cuda::kStreamThreads;
using fmlp::cuda::kStreamU;
using fmlp::cuda::kStreamWarps;
using fmlp::cuda::load_scalar;
using fmlp::cuda::opt;
using fmlp::cuda::stage_tokens_as;
using fmlp::cuda::store_scalar;
using fmlp::cuda::stream_begin;
using fmlp::cuda::stream_f16_scaled;
using fmlp::cuda::stream_grid;
using fmlp::cuda::stream_resident_blocks;
using fmlp::cuda::stream_run;
using fmlp::cuda::stream_shape;
using fmlp::cuda::stream_span;
using fmlp::cuda::stream_stage_f16_scaled;
using fmlp::cuda::StreamFp8;
using fmlp::cuda::StreamShape;
using fmlp::cuda::to_f;
using fmlp::cuda::x_rows_vec;

constexpr int kMaxTokens = 4;
// x and h are staged in the weights' 16-bit dtype: up to 2 tokens of llama3-8b's hidden (28 KiB
// each) leave room for four blocks per multiprocessor; more tokens or wider layers get fewer.
constexpr size_t kMaxStageBytes = 96 * 1024;

// Blocks per multiprocessor the register budget is cut for: four at M <= 2, where the shared
// memory allows them; the accumulators of 3 and 4 tokens would spill under 64 registers.
template <int M>
constexpr int kMinBlocks = M <= 2 ? 4 : 3;

struct StreamMlpParams : DecodeOperands, fmlp::cuda::Fp8Scales {
  void* hbuf;         // [m, hidden] in the staged dtype (AT), workspace scratch
  unsigned* counter;  // fp8: blocks of the down launch that read hmax, zero between calls
  unsigned* hmax;     // fp8: [m] each token's largest finite |h| (float bits), zero between calls
  StreamShape up, down;
  // Groups per block requested into L2 before the previous grid is complete (W1: its first; W2:
  // up to 64 KiB, 32 MiB over an H200's resident blocks, about half its L2), or none.
  int up_prefetch_groups, down_prefetch_groups;
  // W2 batches after the first of each block's first group requested into L2 before the wait,
  // to keep HBM busy while h is staged (where W2 groups are not prefetched).
  int down_prefetch_batches;
};

// Both kernels are launched with programmatic dependent launch: stream_begin requests the first
// weights, then waits for the previous grid before x, h, y or the workspace are touched.
// WT: the weights' element (StreamFp8 for e4m3), AT: the 16-bit dtype x and h are rounded to and h
// is kept in (WT itself for 16-bit weights), XS: what the stream reads (fp16 for e4m3).
template <typename WT, typename AT, int M>
__global__ void __launch_bounds__(kStreamThreads, kMinBlocks<M>)
    mlp_decode_sm80_stream_up(const StreamMlpParams p) {
  constexpr bool kFp8 = std::is_same_v<WT, StreamFp8>;
  using XS = std::conditional_t<kFp8, __half, WT>;
  extern __shared__ uint4 smem_v[];
  XS* xs = reinterpret_cast<XS*>(smem_v);  // [M][kp], zeros past k
  __shared__ float red[2][kStreamWarps][M];
  __shared__ float scratch[kStreamWarps];
  __shared__ float inv[M];  // fp8: the per-token factor undoing the staging's power of two
  __shared__ unsigned amax[M];
  if (int(blockIdx.x) >= p.up.groups) return;
  const bool gated = p.wu != nullptr;
  const auto sp = stream_span<WT>(p.up);
  // Gated: virtual row 2j is gate row j, 2j + 1 up row j.
  auto row_ptr = [&](int row) {
    if (!gated) return static_cast<const WT*>(p.wg) + int64_t(row) * p.wg_ld;
    return (row & 1) ? static_cast<const WT*>(p.wu) + int64_t(row >> 1) * p.wu_ld
                     : static_cast<const WT*>(p.wg) + int64_t(row >> 1) * p.wg_ld;
  };
  uint4 cur[kStreamU];
  stream_begin<WT>(cur, p.up, sp, row_ptr, p.up_prefetch_groups);  // in flight while x is staged
  bool staged = false;
  if constexpr (kFp8) {
    if (p.norm == FMLP_NORM_NONE && p.k == p.kp && x_rows_vec(p)) {  // x is AT: scaled fp16
      stream_stage_f16_scaled<AT, M, false>(xs, static_cast<const AT*>(p.x), p.x_ld, M, p.k,
                                            nullptr, red[0], inv);  // ends with a barrier
      staged = true;
    }
  }
  if constexpr (!kFp8) {
    constexpr fmlp_dtype_t kAt = std::is_same_v<AT, __half> ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16;
    if (p.norm == FMLP_NORM_NONE && p.act_t == kAt && p.k % 8 == 0 && x_rows_vec(p)) {  // as is
      fmlp::cuda::stream_copy_rows<M, false>(smem_v, static_cast<const uint4*>(p.x), p.x_ld / 8, M,
                                             p.k / 8);
      __syncthreads();
      staged = true;
    }
  }
  if (!staged) {
    stage_tokens_as<kStreamThreads, M>(p, reinterpret_cast<AT*>(xs), scratch, p.kp);  // barrier
    if constexpr (kFp8) stream_f16_scaled<M>(xs, p.kp, std::is_same_v<AT, __half>, inv, amax);
  }
  // Dot product v of row j of the gate / dense rows (up = false) or of the up rows, dequantised.
  auto dq = [&](float v, int t, int j, bool up) {
    if constexpr (kFp8) v *= inv[t] * (up ? p.su[j * p.su_stride] : p.sg[j * p.sg_stride]);
    return v;
  };
  AT* h = static_cast<AT*>(p.hbuf);
  // fp8: this thread's largest finite |h| per token, as stored, for the down kernel's power of two
  float hmax[M] = {};
  auto store_h = [&](int t, int j, float v) {
    const AT r = from_f<AT>(v);
    h[int64_t(t) * p.hp + j] = r;
    if constexpr (kFp8) {
      const float a = fabsf(to_f(r));
#pragma unroll
      for (int tt = 0; tt < M; ++tt)  // a constant index keeps hmax in registers
        if (tt == t && a <= 3.4e38f) hmax[tt] = fmaxf(hmax[tt], a);
    }
  };
  if (gated) {
    auto finish = [&](int row, int t, const float(&v)[2]) {
      const int j = row >> 1;
      const float a = dq(v[0], t, j, false) + opt(p.bg, p.bg_t, j, 0.f);
      const float u = dq(v[1], t, j, true) + opt(p.bu, p.bu_t, j, 0.f);
      store_h(t, j, activate(p.act, a) * u);
    };
    stream_run<WT, XS, M, 2>(p.up, sp, xs, row_ptr, finish, cur, red);
  } else {
    auto finish = [&](int row, int t, const float(&v)[1]) {
      store_h(t, row, activate(p.act, dq(v[0], t, row, false) + opt(p.bg, p.bg_t, row, 0.f)));
    };
    stream_run<WT, XS, M, 1>(p.up, sp, xs, row_ptr, finish, cur, red);
  }
  // h's columns [h, hp) meet the zero padding of W2's rows: zeros, not the scratch's old bytes
  // (which may hold a NaN pattern).
  const int pad = p.hp - p.h;  // < 16: M * pad < kStreamThreads
  if (blockIdx.x == 0 && int(threadIdx.x) < M * pad)
    h[int64_t(threadIdx.x / pad) * p.hp + p.h + threadIdx.x % pad] = from_f<AT>(0.f);
  if constexpr (kFp8) {  // one atomic per block and token
    __shared__ float wmax[kStreamWarps][M];
#pragma unroll
    for (int t = 0; t < M; ++t) {
      const float v = fmlp::cuda::warp_max(hmax[t]);
      if (threadIdx.x % 32 == 0) wmax[threadIdx.x / 32][t] = v;
    }
    __syncthreads();
    if (threadIdx.x < M) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kStreamWarps; ++w) v = fmaxf(v, wmax[w][threadIdx.x]);
      atomicMax(p.hmax + threadIdx.x, __float_as_uint(v));
    }
  }
}

template <typename WT, typename AT, int M>
__global__ void __launch_bounds__(kStreamThreads, kMinBlocks<M>)
    mlp_decode_sm80_stream_down(const StreamMlpParams p) {
  constexpr bool kFp8 = std::is_same_v<WT, StreamFp8>;
  using XS = std::conditional_t<kFp8, __half, WT>;
  extern __shared__ uint4 smem_v[];
  XS* hs = reinterpret_cast<XS*>(smem_v);  // [M][hp]
  __shared__ float red[2][kStreamWarps][M];
  __shared__ unsigned is_last;
  __shared__ float inv[M];
  if (int(blockIdx.x) >= p.down.groups) return;
  const auto sp = stream_span<WT>(p.down);
  auto row_ptr = [&](int row) { return static_cast<const WT*>(p.w2) + int64_t(row) * p.w2_ld; };
  uint4 cur[kStreamU];
  stream_begin<WT>(cur, p.down, sp, row_ptr, p.down_prefetch_groups,
                   p.down_prefetch_batches);  // then h is complete
  if constexpr (kFp8) {  // h as scaled fp16 (engines/stream_gemv.cuh) with the up kernel's largest
                         // |h|
    stream_stage_f16_scaled<AT, M, true>(hs, static_cast<const AT*>(p.hbuf), p.hp, M, p.hp, p.hmax,
                                         red[0], inv);  // ends with a barrier
  } else {
    const int vecs = M * p.hp / 8;  // hp is a multiple of 8; [M][hp] copied as one row
    fmlp::cuda::stream_copy_rows<1, true>(smem_v, static_cast<const uint4*>(p.hbuf), vecs, 1, vecs);
    __syncthreads();  // this block's reads of h are done
  }
  if constexpr (kFp8) {  // every block has read hmax: the last re-zeroes it for the next call
    if (threadIdx.x == 0) is_last = atomicAdd(p.counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (is_last) {
      if (threadIdx.x == 0) *p.counter = 0;
      if (threadIdx.x < M) p.hmax[threadIdx.x] = 0;
    }
  }
  const size_t es = p.act_t == FMLP_DTYPE_F32 ? 4 : 2;
  auto finish = [&](int row, int t, const float(&v)[1]) {
    float r = v[0];
    if constexpr (kFp8) r *= inv[t] * p.s2[row * p.s2_stride];
    r += opt(p.b2, p.b2_t, row, 0.f);
    if (p.res)
      r += load_scalar(static_cast<const char*>(p.res) + int64_t(t) * p.res_ld * es, p.act_t, row);
    store_scalar(static_cast<char*>(p.y) + int64_t(t) * p.y_ld * es, p.act_t, row, r);
  };
  stream_run<WT, XS, M, 1>(p.down, sp, hs, row_ptr, finish, cur, red);
}

template <typename WT, typename AT, int M>
fmlp_status_t launch(const StreamMlpParams& p, cudaStream_t s, int device) {
  constexpr auto up = &mlp_decode_sm80_stream_up<WT, AT, M>;
  constexpr auto down = &mlp_decode_sm80_stream_down<WT, AT, M>;
  const size_t smem_up = size_t(M) * size_t(p.kp) * sizeof(AT);
  const size_t smem_down = size_t(M) * size_t(p.hp) * sizeof(AT);
  if (fmlp_status_t st = allow_dynamic_smem<up>(smem_up, "mlp_decode_sm80_stream_up");
      st != FMLP_SUCCESS)
    return st;
  if (fmlp_status_t st = allow_dynamic_smem<down>(smem_down, "mlp_decode_sm80_stream_down");
      st != FMLP_SUCCESS)
    return st;
  const int sms = cuda_sm_count(device);
  const bool pdl = pdl_enabled(cuda_compute_capability(device));
  if (p.up.groups > 0) {  // hidden = 0: h is empty
    const int grid = stream_grid(p.up.groups, stream_resident_blocks(up, smem_up, device, sms));
    if (fmlp_status_t st = launch_ex(up, dim3(grid), dim3(kStreamThreads), smem_up, pdl, s,
                                     "mlp_decode_sm80_stream_up", p);
        st != FMLP_SUCCESS)
      return st;
  }
  const int grid = stream_grid(p.down.groups, stream_resident_blocks(down, smem_down, device, sms));
  return launch_ex(down, dim3(grid), dim3(kStreamThreads), smem_down, pdl, s,
                   "mlp_decode_sm80_stream_down", p);
}

template <typename WT, typename AT>
fmlp_status_t dispatch(const StreamMlpParams& p, cudaStream_t s, int device) {
  switch (p.m) {
    case 1: return launch<WT, AT, 1>(p, s, device);
    case 2: return launch<WT, AT, 2>(p, s, device);
    case 3: return launch<WT, AT, 3>(p, s, device);
    default: return launch<WT, AT, 4>(p, s, device);
  }
}

// The 16-bit dtype x and h are staged in: the weights' own, or for e4m3 weights the activations'.
size_t stage_elem_bytes(const MlpDesc& d) {
  return d.w_dtype == FMLP_DTYPE_F8_E4M3 ? dtype_size(d.act_dtype) : dtype_size(d.w_dtype);
}

}  // namespace

bool mlp_decode_sm80_stream_supports(const MlpDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CUDA) return (*why = "needs CUDA device memory", false);
  if (d.m < 1 || d.m > kMaxTokens)
    return (*why = fmt::format("M={}: the stream path takes 1 to {} tokens", d.m, kMaxTokens),
            false);
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16 && !fp8)
    return (*why = fmt::format("{} weights: the stream path takes bf16, f16 or f8_e4m3",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  if (fp8 && d.act_dtype != FMLP_DTYPE_BF16 && d.act_dtype != FMLP_DTYPE_F16)
    return (*why = fmt::format("{} activations with fp8 weights: the stream path stages x and h "
                               "in 16 bits; use bf16/f16 activations or mlp_decode_sm90_splitk",
                               fmlp_dtype_name(d.act_dtype)),
            false);
  const int64_t per_chunk = fp8 ? 16 : 8;  // weights per 16-byte load
  const int64_t kp = padded_width(d, d.d_in), hp = padded_width(d, d.hidden);
  if (kp % per_chunk != 0 || hp % per_chunk != 0)
    return (*why = fmt::format("d_in {} and hidden {} must be multiples of {} for 16-byte loads "
                               "of {} weights; fmlp_mlp_pack pads the weights so that any size "
                               "streams",
                               d.d_in, d.hidden, per_chunk, fmlp_dtype_name(d.w_dtype)),
            false);
  if (!d.weights_vec16)
    return (*why =
                "a weight matrix is not 16-byte aligned (base or row stride); pack the "
                "weights with fmlp_mlp_pack",
            false);
  const size_t es = stage_elem_bytes(d);
  const size_t x_bytes = size_t(d.m) * size_t(kp) * es, h_bytes = size_t(d.m) * size_t(hp) * es;
  if (std::max(x_bytes, h_bytes) > kMaxStageBytes)
    return (*why = fmt::format("M={} tokens of d_in {} / hidden {} take {} KiB of shared "
                               "memory, more than the stream path's {} KiB",
                               d.m, d.d_in, d.hidden, std::max(x_bytes, h_bytes) >> 10,
                               kMaxStageBytes >> 10),
            false);
  if (d.hidden >= (int64_t(1) << 30) || d.d_out >= (int64_t(1) << 31))
    return (*why = "hidden and d_out must be below 2^30 and 2^31", false);
  return true;
}

// The counter and hmax (fp8) in the workspace's zeroed part, h in its scratch part.
size_t mlp_decode_sm80_stream_workspace(const MlpDesc& d) {
  return cuda_scratch_workspace_bytes(size_t(d.m) * size_t(padded_width(d, d.hidden)) *
                                      stage_elem_bytes(d));
}

fmlp_status_t mlp_decode_sm80_stream_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                         void* workspace, void* stream) {
  StreamMlpParams p{};
  static_cast<DecodeOperands&>(p) = fmlp::cuda::decode_operands(a, d);
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  if (fp8) static_cast<fmlp::cuda::Fp8Scales&>(p) = fmlp::cuda::fp8_scales(a, d);
  p.counter = static_cast<unsigned*>(workspace);
  p.hmax = p.counter + 1;
  p.hbuf = cuda_workspace_scratch(workspace);
  const int es = int(dtype_size(d.w_dtype));
  p.up = stream_shape(d.gated ? 2 * d.hidden : d.hidden, p.kp, es, d.m, d.gated ? 2 : 1);
  p.down = stream_shape(d.d_out, p.hp, es, d.m);
  // Prefetching helps a little where W2 outgrows the L2 (llama3-8b M = 1) and hurt much where
  // most of W2 fits it (4096 -> 4096), measured on an H200 (fusedmlp_cuda_bench --ms 1).
  // FMLP_STREAM_PREFETCH=0 turns it off, =1 on, for measurements.
  static const int prefetch_env = int(knob_int_or<Knob::FMLP_STREAM_PREFETCH>(-1));
  const int64_t w2_bytes = d.d_out * int64_t(p.hp) * es;
  const bool prefetch =
      prefetch_env >= 0 ? prefetch_env == 1 : w2_bytes > cuda_l2_bytes(d.device_id);
  p.up_prefetch_groups = prefetch ? 1 : 0;
  p.down_prefetch_groups =
      prefetch
          ? int(std::max<int64_t>(
                1, (int64_t(64) << 10) / std::max<int64_t>(1, int64_t(p.down.rows) * p.hp * es)))
          : 0;
  // Without those, a down stream whose warps read more than two batches of their first group
  // requests the next two into L2 while h is staged: 3 % off fp8 llama3-8b at M = 1 (7 batches of
  // a 14 KB row a warp), with or without RMSNorm, where 1 batch gained as much and 4 lost.
  // Requesting batch 1 in every stream kernel instead (where it is all that is left) made the 4
  // KB rows slower (4096 -> 4096). FMLP_STREAM_PREFETCH_BATCHES=n forces n, for measurements
  // (fusedmlp_cuda_bench --wdtype f8 --ms 1).
  static const int batches_env = int(knob_int_or<Knob::FMLP_STREAM_PREFETCH_BATCHES>(-1));
  p.down_prefetch_batches = batches_env >= 0                                    ? batches_env
                            : p.down_prefetch_groups == 0 && p.down.batches > 2 ? 2
                                                                                : 0;
  if (d.d_out == 0) return FMLP_SUCCESS;
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  if (fp8)
    return d.act_dtype == FMLP_DTYPE_F16 ? dispatch<StreamFp8, __half>(p, s, d.device_id)
                                         : dispatch<StreamFp8, __nv_bfloat16>(p, s, d.device_id);
  return d.w_dtype == FMLP_DTYPE_F16 ? dispatch<__half, __half>(p, s, d.device_id)
                                     : dispatch<__nv_bfloat16, __nv_bfloat16>(p, s, d.device_id);
}

}  // namespace fmlp::detail
