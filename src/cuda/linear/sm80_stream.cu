// linear_sm80_stream: y[M, N] = x[M, K] W^T + b for M <= 4 tokens and bf16, fp16 or fp8 e4m3
// weights, as one memory-order stream over W (engines/stream_gemv.cuh says why and how).
//   - x is staged once per block: in its own dtype for 16-bit weights; for fp8 weights as fp16
//     times a power of two per token (engines/stream_gemv.cuh), undone with the per-row or
//     per-tensor scale in the epilogue; one token of 16-bit-weight streams with few rows per block
//     is read in place instead (x_direct),
//   - the epilogue adds the bias and converts; no workspace, deterministic,
//   - K need not fill whole 16-byte chunks: with W's base and row stride 16-byte aligned (a
//     caller that stores W with a padded row stride, as fusedmlp.FusedLinear does for odd K) the
//     stream runs over K rounded up to whole chunks, reads only the row's own bytes of its last
//     chunk (StreamShape::tail) and stages x with zeros past K, so whatever lies past K, in W's
//     padding or x's, never multiplies.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/engines/stream_gemv.cuh"
#include "cuda/linear/entries.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::kStreamThreads;
using fmlp::cuda::kStreamWarps;
using fmlp::cuda::load_scalar;
using fmlp::cuda::store_scalar;
using fmlp::cuda::stream_begin;
using fmlp::cuda::stream_dispatch_u;
using fmlp::cuda::stream_grid;
using fmlp::cuda::stream_pick_loads;
using fmlp::cuda::stream_resident_blocks;
using fmlp::cuda::stream_run;
using fmlp::cuda::stream_shape;
using fmlp::cuda::stream_span;
using fmlp::cuda::StreamFp8;
using fmlp::cuda::StreamShape;

constexpr int kMaxXsBytes = 48 * 1024;  // staged x: four blocks per multiprocessor
constexpr int kMaxTokens = 4;

struct StreamParams : LinearOperands {
  StreamShape s;
  int prefetch_groups;  // groups per block requested into L2 before the previous grid is done
  bool x_direct;        // one token read in place (x_direct)
  bool epi_ahead;       // a row's bias and scale loaded one group ahead (epi_ahead below)
};

// Whether the kernel loads each row's bias and fp8 scale one group ahead (stream_run_rows'
// fetch): where every block takes one group and a row's warps combine it through the block
// barrier, so the load goes out with the block's first weights instead of after the barrier.
// Same-call A/Bs at M = 1 found it 5-10 % faster on such shapes, slower where a warp holds a
// group of whole rows, and within noise (or slightly behind) where blocks loop over groups.
// FMLP_LINEAR_EPI_AHEAD=0|1 forces it off / on for measurements (fusedmlp_ops_bench --only
// linear; the ctest linear_stream_epi_ahead checks the forced path).
bool epi_ahead(const StreamShape& s, int grid) {
  static const int env = int(knob_int_or<Knob::FMLP_LINEAR_EPI_AHEAD>(-1));
  return env >= 0 ? env == 1 : grid >= s.groups && s.wpr > 1;
}

// One token whose row is 16-byte aligned is read in place through L1 (every block reads the same
// lines), instead of being staged in each block's shared memory, where staging costs more than
// it saves: x of at least 4 KiB and a block's share of W at most 4x x's bytes (few rows per
// block, long rows): at M = 1 bf16 that is 10-15 % faster on such shapes, while where each
// block has many rows in place is slower (4096 x 4096, the K = 768 lm head: the inner loop's x
// reads from L1 cost more than from shared memory) and the 14336-column downs do not change.
// FMLP_STREAM_XDIRECT=0|1 forces staging / in place (where allowed) for measurements
// (fusedmlp_ops_bench --only linear --ms 1).
bool x_direct(const LinearDesc& d, const void* x, const StreamShape& s) {
  static const int env = int(knob_int_or<Knob::FMLP_STREAM_XDIRECT>(-1));
  if (env == 0 || d.m != 1 || d.w_dtype == FMLP_DTYPE_F8_E4M3 || s.k != d.k ||
      reinterpret_cast<uintptr_t>(x) % 16 != 0)
    return false;
  if (env == 1) return true;
  const int64_t x_bytes = d.k * int64_t(dtype_size(d.act_dtype));
  const int64_t blocks = std::min<int64_t>(s.groups, int64_t(4) * cuda_sm_count(d.device_id));
  const int64_t w_per_block = d.n * d.k * 2 / std::max<int64_t>(1, blocks);
  return x_bytes >= 4096 && w_per_block <= 4 * x_bytes;
}

// Whether token rows of x can be read as 16-byte pieces.
template <typename XT>
__device__ __forceinline__ bool x_vec_ok(const StreamParams& p) {
  return reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
         (p.m == 1 || (p.x_ld * int64_t(sizeof(XT))) % 16 == 0);
}

// Piece c (16 bytes) of token row src holding x[c * E, c * E + E) with zeros past K: the pieces
// a K that is not whole chunks leaves at the end of the staged row.
template <typename XT>
__device__ __forceinline__ uint4 x_tail_piece(const XT* src, int c, int k) {
  using Bits = std::conditional_t<sizeof(XT) == 4, uint32_t, uint16_t>;
  constexpr int kPerVec = 16 / int(sizeof(XT));
  Bits e[kPerVec];
#pragma unroll
  for (int j = 0; j < kPerVec; ++j)
    e[j] = c * kPerVec + j < k ? reinterpret_cast<const Bits*>(src)[c * kPerVec + j] : Bits(0);
  uint4 v;
  memcpy(&v, e, sizeof(v));
  return v;
}

// Stages x rows [0, MT) (zeros past M and past K up to the stream's padded width s.k) in x's own
// dtype (16-bit weights), 16 bytes per step; one loop per token, so no step divides by k. Aligned
// rows: a thread requests four pieces before it stores any, one memory latency per four. With the
// misaligned path's branch in the same loop ptxas kept each load next to its store, so a thread
// waited for its pieces one after another: at K = 14336 (seven a thread) that was 3-4 % of the bf16
// downs' time and of the fp8 down's (fusedmlp_ops_bench --only linear). cp.async.cg copies instead
// (no registers, all in flight) were 2-47 % slower than the serial loads: L2 only, so the four
// blocks of a multiprocessor no longer share x's lines in L1 and every block's requests for the
// same few KB meet in the L2 (cp.async.ca measured as the register loads).
template <typename XT, int MT>
__device__ void stage_x(const StreamParams& p, XT* xs) {
  const int kp = p.s.k;
  const bool vec = x_vec_ok<XT>(p);
  constexpr int kPerVec = 16 / int(sizeof(XT));
  const int vecs = kp / kPerVec;   // kp is whole 16-byte chunks of W, so of x too
  const int full = p.k / kPerVec;  // pieces wholly inside K
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const XT* src = static_cast<const XT*>(p.x) + int64_t(t) * p.x_ld;
    uint4* dst = reinterpret_cast<uint4*>(xs + int64_t(t) * kp);
    if (t >= p.m) {
      for (int c = threadIdx.x; c < vecs; c += kStreamThreads) dst[c] = make_uint4(0, 0, 0, 0);
      continue;
    }
    if (vec) {
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      for (int c0 = threadIdx.x; c0 < full; c0 += 4 * kStreamThreads) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = c0 + j * kStreamThreads;
          v[j] = c < full ? s4[c] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (c0 + j * kStreamThreads < full) dst[c0 + j * kStreamThreads] = v[j];
      }
    } else {
      for (int c = threadIdx.x; c < full; c += kStreamThreads)
        dst[c] = fmlp::cuda::load_16b(src, c * kPerVec, false);
    }
    for (int c = full + int(threadIdx.x); c < vecs; c += kStreamThreads)
      dst[c] = x_tail_piece<XT>(src, c, p.k);
  }
}

// XDIRECT: x is read in place through L1 rather than staged (x_direct above says when and why).
template <typename WT, typename XT, int MT, int U, bool XDIRECT>
__global__ void __launch_bounds__(kStreamThreads, 4) linear_sm80_stream(const StreamParams p) {
  constexpr bool kFp8 = std::is_same_v<WT, StreamFp8>;
  static_assert(!(XDIRECT && kFp8), "fp8 weights need x staged as scaled fp16");
  using XS = std::conditional_t<kFp8, __half, XT>;  // staged x
  extern __shared__ uint4 smem_v[];
  XS* xs = reinterpret_cast<XS*>(smem_v);  // [MT][k]
  __shared__ float red[2][kStreamWarps][MT];
  __shared__ float inv[MT];      // fp8: the per-token factor undoing the staging's power of two
  __shared__ unsigned amax[MT];  // fp8, misaligned x
  if (int(blockIdx.x) >= p.s.groups) return;
  const auto sp = stream_span<WT>(p.s);
  auto row_ptr = [&](int row) { return static_cast<const WT*>(p.w) + int64_t(row) * p.w_ld; };
  uint4 cur[U];
  stream_begin<WT>(cur, p.s, sp, row_ptr, p.prefetch_groups);  // in flight while x is staged
  const XS* xrun = xs;
  if constexpr (XDIRECT) {
    xrun = static_cast<const XS*>(p.x);
  } else if constexpr (kFp8) {
    // x as fp16 times a power of two per token (engines/stream_gemv.cuh), from x in registers where
    // its rows allow 16-byte loads. Per element, with a division by k per element, this staging was
    // half of the fp8 stream's instructions (ncu, 4096 -> 14336 at M = 1); 16-byte steps took
    // about a third off that shape's time.
    if (!x_vec_ok<XT>(p) || p.k != p.s.k) {  // misaligned x, or K padded to whole chunks
      stage_x<XT, MT>(p, xs);  // the raw 16-bit x (bf16 or fp16: XT only sizes the pieces)
      __syncthreads();
      fmlp::cuda::stream_f16_scaled<MT>(xs, p.s.k, p.x_t == FMLP_DTYPE_F16, inv, amax);
    } else if (p.x_t == FMLP_DTYPE_F16) {
      fmlp::cuda::stream_stage_f16_scaled<__half, MT, false>(
          xs, static_cast<const __half*>(p.x), p.x_ld, p.m, p.s.k, nullptr, red[0], inv);
    } else {
      fmlp::cuda::stream_stage_f16_scaled<__nv_bfloat16, MT, false>(
          xs, static_cast<const __nv_bfloat16*>(p.x), p.x_ld, p.m, p.s.k, nullptr, red[0], inv);
    }
  } else {
    stage_x<XT, MT>(p, xs);
    __syncthreads();
  }
  struct Epi {
    float scale, bias;
  };
  auto epi = [&](int row) {
    Epi e{1.f, 0.f};
    if constexpr (kFp8) e.scale = p.scale[p.scale_per_row ? row : 0];
    if (p.bias) e.bias = load_scalar(p.bias, p.bias_t, row);
    return e;
  };
  Epi next{};
  int next_row = -1;  // the row `next` belongs to
  auto fetch = [&](int row, int) {
    if (p.epi_ahead) next = epi(row), next_row = row;
  };
  auto finish = [&](int row, int t, const float(&sum)[1]) {
    if (t >= p.m) return;
    const Epi e = row == next_row ? next : epi(row);
    float v = sum[0];
    if constexpr (kFp8) v *= inv[t] * e.scale;
    if (p.bias) v += e.bias;
    const int64_t es = p.y_t == FMLP_DTYPE_F32 ? 4 : 2;
    store_scalar(static_cast<char*>(p.y) + int64_t(t) * p.y_ld * es, p.y_t, row, v);
  };
  stream_run<WT, XS, MT>(p.s, sp, xrun, row_ptr, finish, cur, red, fetch);
}

// K rounded up to whole 16-byte chunks of W: the width the stream reads and x is staged at.
int64_t padded_k(const LinearDesc& d) {
  const int64_t per = d.w_dtype == FMLP_DTYPE_F8_E4M3 ? 16 : 8;
  return (d.k + per - 1) / per * per;
}

size_t smem_bytes(const LinearDesc& d, int mt) {
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  return size_t(mt) * size_t(padded_k(d)) * (fp8 ? 2 : dtype_size(d.act_dtype));
}

int token_tile(int64_t m) {
  return m <= 1 ? 1 : m <= 2 ? 2 : 4;
}

// Each block's first group into L2 while the previous kernel drains, where W outgrows the L2 or
// the blocks take four or more groups each (so first groups are at most a quarter of W).
// mlp/decode_sm80_stream.cu measured the prefetch to hurt where most of the matrix fits the L2;
// what hurt is prefetching much of it at once: it helps the fp8 4096 -> 14336 (58.7 MB, four
// groups a block) and slows the fp8 4096 <- 14336 (one group a block: all of W) by a third and
// 4096 x 4096 by 8 %. FMLP_STREAM_PREFETCH=0 turns it off, =1 on, for measurements (as for the
// MLP streams; fusedmlp_ops_bench --only linear).
template <typename WT>
int prefetch_groups(const StreamShape& s, int grid, int device) {
  static const int env = int(knob_int_or<Knob::FMLP_STREAM_PREFETCH>(-1));
  if (env >= 0) return env;
  const int64_t w_bytes = int64_t(s.n) * s.k * int64_t(sizeof(WT));
  return w_bytes > cuda_l2_bytes(device) || s.groups >= 4 * grid ? 1 : 0;
}

template <typename WT, typename XT, int MT, int U, bool XDIRECT>
fmlp_status_t launch(const StreamParams& p, size_t smem, int device, cudaStream_t s) {
  constexpr auto kernel = &linear_sm80_stream<WT, XT, MT, U, XDIRECT>;
  if (const fmlp_status_t st = allow_dynamic_smem<kernel>(smem, "linear_sm80_stream");
      st != FMLP_SUCCESS)
    return st;
  const int grid =
      stream_grid(p.s.groups, stream_resident_blocks(kernel, smem, device, cuda_sm_count(device)));
  StreamParams q = p;
  q.epi_ahead = epi_ahead(p.s, grid);
  q.prefetch_groups = prefetch_groups<WT>(p.s, grid, device);
  return launch_ex(kernel, dim3(grid), dim3(kStreamThreads), smem,
                   pdl_enabled(cuda_compute_capability(device)), s, "linear_sm80_stream", q);
}

template <typename WT, typename XT, int MT>
fmlp_status_t dispatch_u(const StreamParams& p, size_t smem, int device, cudaStream_t s) {
  if constexpr (MT == 1 && !std::is_same_v<WT, StreamFp8>) {
    if (p.x_direct)
      return stream_dispatch_u(p.s, [&](auto u) {
        return launch<WT, XT, 1, decltype(u)::value, true>(p, 0, device, s);
      });
  }
  return stream_dispatch_u(p.s, [&](auto u) {
    return launch<WT, XT, MT, decltype(u)::value, false>(p, smem, device, s);
  });
}

template <typename WT, typename XT>
fmlp_status_t dispatch_mt(const StreamParams& p, int mt, size_t smem, int device, cudaStream_t s) {
  switch (mt) {
    case 1: return dispatch_u<WT, XT, 1>(p, smem, device, s);
    case 2: return dispatch_u<WT, XT, 2>(p, smem, device, s);
    default: return dispatch_u<WT, XT, 4>(p, smem, device, s);
  }
}

template <typename WT>
fmlp_status_t dispatch_x(const StreamParams& p, int mt, size_t smem, int device, cudaStream_t s) {
  if constexpr (std::is_same_v<WT, StreamFp8>) {  // x is read by dtype while staged: one instance
    return dispatch_mt<WT, __half>(p, mt, smem, device, s);
  } else {
    switch (p.x_t) {
      case FMLP_DTYPE_F32: return dispatch_mt<WT, float>(p, mt, smem, device, s);
      case FMLP_DTYPE_F16: return dispatch_mt<WT, __half>(p, mt, smem, device, s);
      default: return dispatch_mt<WT, __nv_bfloat16>(p, mt, smem, device, s);
    }
  }
}

}  // namespace

bool linear_sm80_stream_supports(const LinearDesc& d, std::string* why) {
  if (refuses_block_scales(d, why)) return false;
  const bool fp8_w = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (d.w8a8())
    return (*why = "fp8 activations (W8A8): linear_sm80_mma and cuBLASLt take them", false);
  if (d.w_dtype ==
      FMLP_DTYPE_F8_E4M3) {  // any sm_80+ device (engines/stream_gemv.cuh: the widening)
    if (d.act_dtype == FMLP_DTYPE_F32)
      return (*why =
                  "f32 activations with fp8 weights: staging x as fp16 would round it; "
                  "linear_sm80_gemv takes them",
              false);
  } else if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16) {
    return (*why = fmt::format("{} weights: the stream GEMV takes bf16, f16 or f8_e4m3 (f32: "
                               "linear_sm80_gemv)",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  }
  if (d.m < 1 || d.m > kMaxTokens)
    return (*why = fmt::format("M={}: the stream GEMV takes 1 to {} rows (more: cuBLASLt)", d.m,
                               kMaxTokens),
            false);
  if (!d.w_rows16)
    return (*why = fmt::format(
                "W's base and row stride must be 16-byte aligned (w_ld {} elements of {}): store "
                "W with a row stride of a multiple of {} elements, e.g. a [N, {}] buffer viewed "
                "as [:, :{}] (fusedmlp.FusedLinear keeps such a copy for odd K), to take this "
                "entry; linear_sm80_gemv reads it as it is with element loads",
                d.w_ld, fmlp_dtype_name(d.w_dtype), fp8_w ? 16 : 8, padded_k(d), d.k),
            false);
  if (d.n >= (int64_t(1) << 31) || d.k >= (int64_t(1) << 31))
    return (*why = "N and K must be below 2^31", false);
  const size_t smem = smem_bytes(d, token_tile(d.m));
  if (smem > size_t(kMaxXsBytes))
    return (*why = fmt::format("{} staged x rows of K={} take {} KiB of shared memory, more than "
                               "{} KiB; cuBLASLt or linear_sm80_gemv take it",
                               token_tile(d.m), d.k, smem >> 10, kMaxXsBytes >> 10),
            false);
  return true;
}

size_t linear_sm80_stream_workspace(const LinearDesc&) {
  return 0;
}

fmlp_status_t linear_sm80_stream_run(const fmlp_linear_args_t& a, const LinearDesc& d, void*,
                                     void* stream) {
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  StreamParams p{};
  static_cast<LinearOperands&>(p) = linear_operands(a, d);
  const int es = fp8 ? 1 : 2;
  const int64_t w_bytes = d.n * d.k * es;
  p.s = stream_shape(d.n, padded_k(d), es, d.m);
  p.s.tail = int(d.k * es % 16);
  stream_pick_loads(p.s, w_bytes);
  p.x_direct = x_direct(d, a.x.data, p.s);
  if (p.s.groups == 0) return FMLP_SUCCESS;  // N = 0: nothing to write
  const int mt = token_tile(d.m);
  const size_t smem = smem_bytes(d, mt);
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  switch (d.w_dtype) {
    case FMLP_DTYPE_F8_E4M3: return dispatch_x<StreamFp8>(p, mt, smem, d.device_id, s);
    case FMLP_DTYPE_F16: return dispatch_x<__half>(p, mt, smem, d.device_id, s);
    default: return dispatch_x<__nv_bfloat16>(p, mt, smem, d.device_id, s);
  }
}

}  // namespace fmlp::detail
