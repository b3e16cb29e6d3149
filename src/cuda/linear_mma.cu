// linear_sm80_mma: y[M, N] = x[M, K] W^T + b for 2 <= M <= 64 bf16/fp16 tokens and weights of the
// same dtype, on the tensor cores, one pass over W for all M rows.
//
// The CUDA-core kernel (linear_gemv.cu) re-reads W for every x tile; here each weight serves all
// tokens through mma.sync m16n8k16 (fp32 accumulators), the same operand scheme as
// mlp_decode_cluster.cu:
//   - a warp owns a 16-row group of W and streams it straight from global memory with 16-byte
//     non-allocating loads (a ring of batches in flight, the first requested before the block
//     stages x); a lane's 16-byte piece of row g (g + 8) is its A fragment once the k order inside
//     each 32-column step is permuted the same way for A and B,
//   - the tokens are the B operand, staged per K split in shared memory (row stride an odd
//     multiple of 64 bytes, so the two rows a quarter-warp reads fall in distinct banks),
//     zero-padded to a multiple of 8 tokens and of 32 columns,
//   - a task is (one K split, 8 row groups = 128 W rows), one per block (grids past 2^31 blocks
//     deal contiguous runs of split-major tasks, re-staging x only when the split changes),
//   - K is split until there are 2 tasks per multiprocessor (or the staged tile would not fit):
//     splits write fp32 partial sums to the workspace and the last split to arrive for a task (a
//     counter per task) adds them in split order (deterministic), applies the bias, writes y and
//     re-zeroes what it read and its counter, so the workspace is left zero-filled.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/decode_common.cuh"
#include "cuda/device_scope.hpp"
#include "cuda/mma_stream.cuh"
#include "cuda/ops.cuh"

namespace fmlp::detail {
namespace {

using fmlp::cuda::Frags;
using fmlp::cuda::ld_stream_v4;
using fmlp::cuda::load_scalar;
using fmlp::cuda::mma_step;
using fmlp::cuda::pipelined;
using fmlp::cuda::store_scalar;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGroupRows = kWarps * 16;  // W rows per task
constexpr int kMaxTokens = 64;
constexpr int kMaxXsBytes = 96 * 1024;  // two blocks per sm_90 multiprocessor
constexpr int kBlocksPerSm = 2;

struct MmaParams {
  const void* x;
  void* y;
  const void* w;
  const void* bias;  // nullptr: no bias
  int64_t x_ld, y_ld, w_ld;
  fmlp_dtype_t act_t, bias_t;
  int m, n, k;
  int rgs;             // 16-row groups of W
  int chunks;          // tasks per split (kWarps row groups each)
  int splits;          // K splits
  int kc;              // K per split, a multiple of 32
  int xs_stride;       // elements per staged x row: kc rounded up to 64, + 32
  bool x_vec16;        // x rows can be staged with 16-byte loads
  float* partial;      // [splits, m, n] when splits > 1
  unsigned* counters;  // [chunks] when splits > 1, zero between calls
};

// 32-column steps per load batch and batches in flight: fewer steps with more token tiles, whose
// accumulators and staged-token fragments take the registers (two blocks of 256 threads per
// multiprocessor leave 128 per thread).
template <int NT>
struct Pipe {
  static constexpr int kSteps = NT >= 8 ? 1 : NT >= 4 ? 2 : 4;
  static constexpr int kDepth = NT >= 8 ? 2 : NT >= 4 ? 3 : 2;
};

// Columns [k0, k0 + width) of the tokens into xs, zeros past M and past the split's `cols`.
template <int NT>
__device__ void stage(const MmaParams& p, unsigned short* xs, int k0, int cols, int width) {
  const int vecs = width / 8;
  for (int v = threadIdx.x; v < NT * 8 * vecs; v += kThreads) {
    const int m = v / vecs, c = (v % vecs) * 8;
    uint4 out = make_uint4(0, 0, 0, 0);
    if (m < p.m && c < cols) {  // cols is a multiple of 8: the piece is whole
      const unsigned short* row =
          static_cast<const unsigned short*>(p.x) + int64_t(m) * p.x_ld + k0 + c;
      if (p.x_vec16) {
        out = *reinterpret_cast<const uint4*>(row);
      } else {
        unsigned short e[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) e[i] = row[i];
        out = make_uint4(e[0] | uint32_t(e[1]) << 16, e[2] | uint32_t(e[3]) << 16,
                         e[4] | uint32_t(e[5]) << 16, e[6] | uint32_t(e[7]) << 16);
      }
    }
    *reinterpret_cast<uint4*>(xs + m * p.xs_stride + c) = out;
  }
}

__device__ __forceinline__ void epilogue(const MmaParams& p, int row, int m, float v) {
  if (p.bias) v += load_scalar(p.bias, p.bias_t, row);
  store_scalar(static_cast<char*>(p.y) + int64_t(m) * p.y_ld * 2, p.act_t, row, v);
}

template <int NT, typename WT>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) linear_sm80_mma(const MmaParams p) {
  extern __shared__ uint4 smem_v[];
  auto* xs = reinterpret_cast<unsigned short*>(smem_v);  // [NT * 8][xs_stride]
  __shared__ unsigned is_last;
  constexpr int SP = Pipe<NT>::kSteps, DEPTH = Pipe<NT>::kDepth;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int tasks = p.splits * p.chunks;
  const int task0 = int(int64_t(tasks) * blockIdx.x / gridDim.x);
  const int task1 = int(int64_t(tasks) * (blockIdx.x + 1) / gridDim.x);
  int staged = -1;
  for (int task = task0; task < task1; ++task) {
    const int split = task / p.chunks, ch = task % p.chunks;
    const int k0 = split * p.kc, cols = min(p.kc, p.k - k0);
    const int steps = (cols + 31) / 32, batches = (steps + SP - 1) / SP;
    const int rg = ch * kWarps + warp;
    const bool active = rg < p.rgs;
    const int r0 = rg * 16 + g;
    // Rows past N repeat the last row: valid loads whose results are never stored.
    const WT* wg = static_cast<const WT*>(p.w) + int64_t(min(r0, p.n - 1)) * p.w_ld + k0;
    const WT* wg8 = static_cast<const WT*>(p.w) + int64_t(min(r0 + 8, p.n - 1)) * p.w_ld + k0;
    auto load = [&](Frags<SP>& f, int b) {
#pragma unroll
      for (int s = 0; s < SP; ++s) {
        const int col = (b * SP + s) * 32 + 8 * t;
        const bool in = active && col < cols;
        f.v[s][0] = in ? ld_stream_v4(wg + col) : make_uint4(0, 0, 0, 0);
        f.v[s][1] = in ? ld_stream_v4(wg8 + col) : make_uint4(0, 0, 0, 0);
      }
    };
    Frags<SP> ring[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH - 1; ++d)
      if (d < batches) load(ring[d], d);
    if (split != staged) {
      __syncthreads();  // every warp is done with the previous tile
      stage<NT>(p, xs, k0, cols, steps * 32);
      __syncthreads();
      staged = split;
    }
    float c[NT][4] = {};
    auto body = [&](const Frags<SP>& f, int b) {
      if (!active) return;
#pragma unroll
      for (int s = 0; s < SP; ++s) {
        if (b * SP + s >= steps) break;
        const int col = (b * SP + s) * 32 + 8 * t;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint4 xv = *reinterpret_cast<const uint4*>(xs + (nt * 8 + g) * p.xs_stride + col);
          mma_step<WT>(c[nt], f.v[s][0], f.v[s][1], xv);
        }
      }
    };
    pipelined<DEPTH>(batches, ring, load, body);
    if (p.splits == 1) {
      if (active) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = r0 + (i >= 2 ? 8 : 0), m = nt * 8 + 2 * t + (i & 1);
            if (row < p.n && m < p.m) epilogue(p, row, m, c[nt][i]);
          }
      }
      continue;
    }
    if (active) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = r0 + (i >= 2 ? 8 : 0), m = nt * 8 + 2 * t + (i & 1);
          if (row < p.n && m < p.m) p.partial[(int64_t(split) * p.m + m) * p.n + row] = c[nt][i];
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(p.counters + ch, 1u) == unsigned(p.splits - 1);
    __syncthreads();
    if (!is_last) continue;
    __threadfence();
    const int row0 = ch * kGroupRows, rows = min(kGroupRows, p.n - row0);
    for (int i = threadIdx.x; i < p.m * rows; i += kThreads) {
      const int m = i / rows, row = row0 + i % rows;
      float s = 0.f;
      for (int q = 0; q < p.splits; ++q) {
        float* part = p.partial + (int64_t(q) * p.m + m) * p.n + row;
        s += __ldcg(part);
        *part = 0.f;  // the workspace contract: left zero-filled
      }
      epilogue(p, row, m, s);
    }
    if (threadIdx.x == 0) p.counters[ch] = 0;
  }
}

struct Config {
  int nt, rgs, chunks, splits, kc, xs_stride, blocks;
  size_t smem;
};

int token_tiles(int64_t m) {
  return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
}

Config config_for(const LinearDesc& d) {
  Config c{};
  c.nt = token_tiles(d.m);
  c.rgs = int((d.n + 15) / 16);
  c.chunks = (c.rgs + kWarps - 1) / kWarps;
  const int sms = std::max(1, cuda_sm_count(d.device_id));
  const int64_t kc_max = (kMaxXsBytes / (c.nt * 8 * 2) - 32) / 64 * 64;
  const int64_t need = (d.k + kc_max - 1) / kc_max;
  const int64_t want = (int64_t(kBlocksPerSm) * sms + c.chunks - 1) / c.chunks;
  const int64_t useful = std::max<int64_t>(1, d.k / 256);  // >= 8 steps per warp and split
  int64_t splits = std::max(need, std::min(want, useful));
  const int64_t per = (d.k + splits - 1) / splits;
  c.kc = int((per + 31) / 32 * 32);
  c.splits = int((d.k + c.kc - 1) / c.kc);
  c.xs_stride = (c.kc + 63) / 64 * 64 + 32;
  c.smem = size_t(c.nt) * 8 * size_t(c.xs_stride) * 2;
  // One task per block: the block scheduler balances them (a static deal of 1.7 tasks per
  // block would cost a whole extra task time).
  c.blocks = int(std::min<int64_t>(int64_t(c.splits) * c.chunks, (int64_t(1) << 31) - 1));
  return c;
}

size_t align_up(size_t n) {
  return (n + 255) / 256 * 256;
}

template <int NT, typename WT>
fmlp_status_t launch(const MmaParams& p, const Config& c, cudaStream_t s) {
  auto* kernel = &linear_sm80_mma<NT, WT>;
  if (c.smem > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(c.smem));
    if (e != cudaSuccess) {
      cudaGetLastError();
      return fail(FMLP_ERROR_CUDA, "linear_sm80_mma: cannot raise shared memory to {} bytes: {}",
                  c.smem, cudaGetErrorString(e));
    }
  }
  kernel<<<c.blocks, kThreads, c.smem, s>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fail(FMLP_ERROR_CUDA, "linear_sm80_mma launch failed: {}", cudaGetErrorString(e));
  return FMLP_SUCCESS;
}

template <typename WT>
fmlp_status_t dispatch(const MmaParams& p, const Config& c, cudaStream_t s) {
  switch (c.nt) {
    case 1: return launch<1, WT>(p, c, s);
    case 2: return launch<2, WT>(p, c, s);
    case 4: return launch<4, WT>(p, c, s);
    default: return launch<8, WT>(p, c, s);
  }
}

}  // namespace

bool linear_mma_supports(const LinearDesc& d, std::string* why) {
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16)
    return (*why = fmt::format("{} weights: the tensor-core path takes bf16 or f16",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  if (d.act_dtype != d.w_dtype)
    return (*why = fmt::format("{} activations with {} weights: the tensor cores need one dtype",
                               fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype)),
            false);
  if (d.m < 2 || d.m > kMaxTokens)
    return (*why = fmt::format("M={}: the tensor-core path takes 2 to {} rows", d.m, kMaxTokens),
            false);
  if (d.k == 0 || !d.w_vec16)
    return (*why = "W must be 16-byte aligned (base, row stride) with K a non-zero multiple of 8",
            false);
  if (d.n >= (int64_t(1) << 31) || d.k >= (int64_t(1) << 31))
    return (*why = "N and K must be below 2^31", false);
  return true;
}

size_t linear_mma_workspace(const LinearDesc& d) {
  const Config c = config_for(d);
  if (c.splits == 1) return 0;
  return align_up(size_t(c.splits) * size_t(d.m) * size_t(d.n) * 4) +
         align_up(size_t(c.chunks) * 4);
}

fmlp_status_t linear_mma_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                             void* stream) {
  const Config c = config_for(d);
  MmaParams p{};
  p.x = a.x.data;
  p.y = a.y.data;
  p.w = a.w.data;
  p.bias = d.bias_dtype == FMLP_DTYPE_INVALID ? nullptr : a.bias.data;
  p.bias_t = d.bias_dtype;
  p.x_ld = a.x.stride[0];
  p.y_ld = a.y.stride[0];
  p.w_ld = a.w.stride[0];
  p.act_t = d.act_dtype;
  p.m = int(d.m), p.n = int(d.n), p.k = int(d.k);
  p.rgs = c.rgs, p.chunks = c.chunks, p.splits = c.splits, p.kc = c.kc;
  p.xs_stride = c.xs_stride;
  p.x_vec16 = uintptr_t(p.x) % 16 == 0 && p.x_ld % 8 == 0;
  if (c.splits > 1) {
    char* base = static_cast<char*>(ws);
    p.partial = reinterpret_cast<float*>(base);
    p.counters = reinterpret_cast<unsigned*>(
        base + align_up(size_t(c.splits) * size_t(d.m) * size_t(d.n) * 4));
  }
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  const fmlp_status_t st =
      d.w_dtype == FMLP_DTYPE_F16 ? dispatch<__half>(p, c, s) : dispatch<__nv_bfloat16>(p, c, s);
  return st;
}

}  // namespace fmlp::detail
