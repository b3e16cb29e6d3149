// linear_sm80_mma: y[M, N] = x[M, K] W^T + b for 2 <= M <= 64 bf16/fp16 tokens and weights of the
// same dtype, on the tensor cores, one pass over W for all M rows.
//
// The CUDA-core kernel (sm80_gemv.cu) re-reads W for every x tile; here each weight serves all
// tokens through mma.sync m16n8k16 (fp32 accumulators), the same operand scheme as
// mlp/decode_sm90_cluster.cu:
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
// fp8 e4m3 weights (sm_89+, M = 1..64, weight-only or W8A8): a lane's 16-byte load is 16 columns
// of a 64-column step, widened exactly to fp16 with cvt.rn.f16x2.e4m3x2 (one instruction per two
// weights: the older GEMV's extra fp16 -> fp32 conversions made it compute bound) and fed to fp16
// mma.sync as two 8-column halves against the matching halves of the staged tokens (the k
// permutation stays the one of the 16-bit path). The tokens are staged as fp16: fp16 and e4m3 x
// exactly; bf16 x times a power of two per token and split that puts its largest finite |x| in
// [2^14, 2^15), which keeps every bf16 value at least 2^-24 of that maximum exact in fp16 (the
// rest flush, contributing < 2^-24 relative). The power of two, the fp8 scales and the bias are
// applied to the fp32 sums in the epilogue.
// K need not fill whole 16-byte chunks: with W's base and row stride 16-byte aligned (W stored with
// a padded row stride, as fusedmlp.FusedLinear does for odd K) a row's last, partial chunk is read
// by its own bytes (ld_stream_tail) and x is staged with zeros past K, so what lies past K never
// multiplies; only the last K split has such a chunk.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/engines/mma_stream.cuh"
#include "cuda/linear/entries.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::Frags;
using fmlp::cuda::ld_stream_tail;
using fmlp::cuda::ld_stream_v4;
using fmlp::cuda::load_scalar;
using fmlp::cuda::mma_step;
using fmlp::cuda::pipelined;
using fmlp::cuda::store_scalar;
using fmlp::cuda::widen_e4m3x8;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGroupRows = kWarps * 16;  // W rows per task
constexpr int kMaxTokens = 64;
constexpr int kMaxXsBytes = 96 * 1024;  // two blocks per sm_90 multiprocessor
constexpr int kBlocksPerSm = 2;

struct MmaParams : LinearOperands {
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
constexpr int pipe_steps() {
  return NT >= 8 ? 1 : NT >= 4 ? 2 : 4;
}
template <int NT>
constexpr int pipe_depth() {
  return NT >= 8 ? 2 : NT >= 4 ? 3 : 2;
}

// Eight 16-bit x values of `row` from column c, zeros at and past `cols` (the split's end, which
// an odd K leaves inside a piece).
__device__ __forceinline__ uint4 load8_upto(const unsigned short* row, int c, int cols, bool vec) {
  if (c + 8 <= cols) return fmlp::cuda::load_16b(row, c, vec);
  unsigned short e[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = c + i < cols ? row[c + i] : 0;
  return make_uint4(e[0] | uint32_t(e[1]) << 16, e[2] | uint32_t(e[3]) << 16,
                    e[4] | uint32_t(e[5]) << 16, e[6] | uint32_t(e[7]) << 16);
}

// Columns [k0, k0 + width) of the tokens into xs, zeros past M and past the split's `cols`.
template <int NT>
__device__ void stage(const MmaParams& p, unsigned short* xs, int k0, int cols, int width) {
  const int vecs = width / 8;
  for (int v = threadIdx.x; v < NT * 8 * vecs; v += kThreads) {
    const int m = v / vecs, c = (v % vecs) * 8;
    uint4 out = make_uint4(0, 0, 0, 0);
    if (m < p.m && c < cols) {
      const unsigned short* row =
          static_cast<const unsigned short*>(p.x) + int64_t(m) * p.x_ld + k0;
      out = load8_upto(row, c, cols, p.x_vec16);
    }
    *reinterpret_cast<uint4*>(xs + m * p.xs_stride + c) = out;
  }
}

// The fp8 path's staging: columns [k0, k0 + width) of the tokens as fp16 (zeros past M and past
// `cols`); inv[m] gets the factor that undoes the token's power of two (see the file comment).
// 16-bit x is read 8 values per step and each token's largest |x| is reduced per warp (one shared
// atomic per warp and token): per element, every thread's atomic on the token's one word
// serialised the staging.
template <int NT>
__device__ void stage_f16(const MmaParams& p, unsigned short* xs, float* inv, unsigned* amax,
                          int k0, int cols, int width) {
  const bool bf16 = p.x_t == FMLP_DTYPE_BF16, fp8 = p.x_t == FMLP_DTYPE_F8_E4M3;
  if (threadIdx.x < NT * 8) amax[threadIdx.x] = 0;
  __syncthreads();
  if (bf16) {
    for (int m = 0; m < p.m; ++m) {
      const unsigned short* row =
          static_cast<const unsigned short*>(p.x) + int64_t(m) * p.x_ld + k0;
      float mx = 0.f;
      for (int c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
        float f[8];
        fmlp::cuda::widen8<__nv_bfloat16>(load8_upto(row, c, cols, p.x_vec16), f);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (fabsf(f[i]) <= 3.4e38f) mx = fmaxf(mx, fabsf(f[i]));  // finite only
      }
      mx = fmlp::cuda::warp_max(mx);
      if (threadIdx.x % 32 == 0 && mx > 0.f) atomicMax(amax + m, __float_as_uint(mx));
    }
  }
  __syncthreads();
  float mul = 1.f;  // this thread's token's power of two
  if (bf16 && threadIdx.x < NT * 8) {
    inv[threadIdx.x] = ldexpf(1.f, -fmlp::cuda::pow2_shift_to(amax[threadIdx.x], 15));
  } else if (threadIdx.x < NT * 8) {
    inv[threadIdx.x] = 1.f;
  }
  __syncthreads();
  const int vecs = width / 8;
  for (int v = threadIdx.x; v < NT * 8 * vecs; v += kThreads) {  // NT * 8 tokens x vecs pieces
    const int m = v / vecs, c = (v % vecs) * 8;
    if (bf16) mul = 1.f / inv[m];
    uint32_t h[4] = {0, 0, 0, 0};
    if (m < p.m && c < cols) {  // a piece through the split's end has zeros past it
      const char* row = static_cast<const char*>(p.x) + (int64_t(m) * p.x_ld + k0) * (fp8 ? 1 : 2);
      if (fp8) {
        const auto* b = reinterpret_cast<const uint8_t*>(row) + c;
        uint8_t e[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) e[i] = c + i < cols ? b[i] : 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          h[i] = fmlp::cuda::e4m3x2_to_f16x2(e[2 * i] | e[2 * i + 1] << 8);
      } else {
        float f[8];
        const uint4 raw =
            load8_upto(reinterpret_cast<const unsigned short*>(row), c, cols, p.x_vec16);
        if (bf16)
          fmlp::cuda::widen8<__nv_bfloat16>(raw, f);
        else
          fmlp::cuda::widen8<__half>(raw, f);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const __half2 pair = __floats2half2_rn(f[2 * i] * mul, f[2 * i + 1] * mul);
          h[i] = *reinterpret_cast<const uint32_t*>(&pair);
        }
      }
    }
    *reinterpret_cast<uint4*>(xs + m * p.xs_stride + c) = make_uint4(h[0], h[1], h[2], h[3]);
  }
}

__device__ __forceinline__ void epilogue(const MmaParams& p, int row, int m, float v) {
  if (p.scale) v *= p.scale[p.scale_per_row ? row : 0];
  if (p.x_scale) v *= p.x_scale[p.x_scale_per_row ? m : 0];
  if (p.bias) v += load_scalar(p.bias, p.bias_t, row);
  store_scalar(static_cast<char*>(p.y) + int64_t(m) * p.y_ld * (p.y_t == FMLP_DTYPE_F32 ? 4 : 2),
               p.y_t, row, v);
}

// MINB blocks per multiprocessor (the register budget), SP steps per load batch, DEPTH batches in
// the ring: pipe_steps/depth<NT> and kBlocksPerSm for 16-bit weights, a measured Fp8Shape for fp8.
template <int NT, typename WT, bool FP8, int MINB, int SP, int DEPTH>
__global__ void __launch_bounds__(kThreads, MINB) linear_sm80_mma(const MmaParams p) {
  extern __shared__ uint4 smem_v[];
  auto* xs = reinterpret_cast<unsigned short*>(smem_v);  // [NT * 8][xs_stride]
  __shared__ float inv[NT * 8];                          // FP8: per-token factor of the staged tile
  __shared__ unsigned amax[NT * 8];  // FP8: largest finite |x| per token, as bits
  constexpr int SC = FP8 ? 64 : 32;  // columns per 16-byte load step
  constexpr int LC = FP8 ? 16 : 8;   // a lane's columns per step
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int tasks = p.splits * p.chunks;
  const int task0 = int(int64_t(tasks) * blockIdx.x / gridDim.x);
  const int task1 = int(int64_t(tasks) * (blockIdx.x + 1) / gridDim.x);
  int staged = -1;
  for (int task = task0; task < task1; ++task) {
    const int split = task / p.chunks, ch = task % p.chunks;
    const int k0 = split * p.kc, cols = min(p.kc, p.k - k0);
    const int steps = (cols + SC - 1) / SC, batches = (steps + SP - 1) / SP;
    const int rg = ch * kWarps + warp;
    const bool active = rg < p.rgs;
    const int r0 = rg * 16 + g;
    // Rows past N repeat the last row: valid loads whose results are never stored.
    using ST = std::conditional_t<FP8, uint8_t, WT>;  // stored weight element
    const ST* wg = static_cast<const ST*>(p.w) + int64_t(min(r0, p.n - 1)) * p.w_ld + k0;
    const ST* wg8 = static_cast<const ST*>(p.w) + int64_t(min(r0 + 8, p.n - 1)) * p.w_ld + k0;
    auto load = [&](Frags<SP>& f, int b) {
#pragma unroll
      for (int s = 0; s < SP; ++s) {
        const int col = (b * SP + s) * SC + LC * t;
        const bool in = active && col + LC <= cols;
        f.v[s][0] = in ? ld_stream_v4(wg + col) : make_uint4(0, 0, 0, 0);
        f.v[s][1] = in ? ld_stream_v4(wg8 + col) : make_uint4(0, 0, 0, 0);
      }
      // A split that ends inside a chunk (the last one, for K not whole chunks): that chunk by
      // its own bytes, apart, so whole-chunk splits keep one predicated load per piece.
      if (cols % LC) {
#pragma unroll
        for (int s = 0; s < SP; ++s) {
          const int col = (b * SP + s) * SC + LC * t;
          if (active && col < cols && col + LC > cols) {
            const int tail = (cols - col) * int(sizeof(ST));
            f.v[s][0] = ld_stream_tail(wg + col, tail);
            f.v[s][1] = ld_stream_tail(wg8 + col, tail);
          }
        }
      }
    };
    Frags<SP> ring[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH - 1; ++d)
      if (d < batches) load(ring[d], d);
    if (split != staged) {
      __syncthreads();  // every warp is done with the previous tile
      if constexpr (FP8)
        stage_f16<NT>(p, xs, inv, amax, k0, cols, steps * SC);
      else
        stage<NT>(p, xs, k0, cols, steps * SC);
      __syncthreads();
      staged = split;
    }
    float c[NT][4] = {};
    auto body = [&](const Frags<SP>& f, int b) {
      if (!active) return;
#pragma unroll
      for (int s = 0; s < SP; ++s) {
        if (b * SP + s >= steps) break;
        const int col = (b * SP + s) * SC + LC * t;
        if constexpr (FP8) {
          const uint4 a0 = widen_e4m3x8(f.v[s][0].x, f.v[s][0].y);
          const uint4 a8 = widen_e4m3x8(f.v[s][1].x, f.v[s][1].y);
          const uint4 b0 = widen_e4m3x8(f.v[s][0].z, f.v[s][0].w);
          const uint4 b8 = widen_e4m3x8(f.v[s][1].z, f.v[s][1].w);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const unsigned short* xr = xs + (nt * 8 + g) * p.xs_stride + col;
            mma_step<WT>(c[nt], a0, a8, *reinterpret_cast<const uint4*>(xr));
            mma_step<WT>(c[nt], b0, b8, *reinterpret_cast<const uint4*>(xr + 8));
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint4 xv = *reinterpret_cast<const uint4*>(xs + (nt * 8 + g) * p.xs_stride + col);
            mma_step<WT>(c[nt], f.v[s][0], f.v[s][1], xv);
          }
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
            if (row < p.n && m < p.m) epilogue(p, row, m, FP8 ? c[nt][i] * inv[m] : c[nt][i]);
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
          if (row < p.n && m < p.m)
            p.partial[(int64_t(split) * p.m + m) * p.n + row] = FP8 ? c[nt][i] * inv[m] : c[nt][i];
        }
    }
    if (!fmlp::cuda::block_arrive_last(p.counters + ch, unsigned(p.splits))) continue;
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

// Register budget and pipeline of the fp8 path at M <= 8, where the kernel is a pure weight
// stream: four blocks of 64 registers per thread and 2-step batches, two in flight, with 4 tasks
// per multiprocessor keep more bytes in flight than the 16-bit shape (two blocks, 4-step batches,
// 2 tasks per SM: ncu found 25 % occupancy and one issue per 3.7 cycles). Measured on an H200 at
// M = 1 (all five shapes x 2/4/8/16 tasks per SM): a third off 4096x14336, a little off
// 4096x4096; the wide shapes go to linear_sm80_stream (planner.cpp). The other shapes stay
// selectable for measurements: FMLP_LINEAR_MMA_FP8="shape index,tasks per SM".
struct Fp8Shape {
  int minb, sp, depth;
};
constexpr Fp8Shape kFp8Shapes[] = {{2, 4, 2}, {3, 2, 3}, {4, 2, 2}, {4, 1, 4}, {4, 1, 3}};
constexpr int kFp8Shape = 2, kFp8TasksPerSm = 4;

struct Config {
  int nt, rgs, chunks, splits, kc, xs_stride, blocks;
  int fp8_shape;  // index into kFp8Shapes, -1 for the 16-bit shapes
  size_t smem;
};

std::pair<int, int> fp8_shape_choice() {
  static const std::pair<int, int> choice = [] {
    std::pair<int, int> c{kFp8Shape, kFp8TasksPerSm};
    constexpr int kShapes = int(sizeof(kFp8Shapes) / sizeof(kFp8Shapes[0]));
    if (const std::string e = knob_string<Knob::FMLP_LINEAR_MMA_FP8>(); !e.empty()) {
      int v = 0, t = 0;
      char tail = 0;
      if (std::sscanf(e.c_str(), "%d,%d%c", &v, &t, &tail) == 2 && v >= 0 && v < kShapes &&
          t >= 1 && t <= 64)
        c = {v, t};
      else
        knob_reject(
            Knob::FMLP_LINEAR_MMA_FP8,
            fmt::format("\"SHAPE,TASKS\" with SHAPE in [0, {}] and TASKS in [1, 64]", kShapes - 1));
    }
    return c;
  }();
  return choice;
}

int token_tiles(int64_t m) {
  return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
}

Config config_for(const LinearDesc& d) {
  Config c{};
  c.nt = token_tiles(d.m);
  c.rgs = int((d.n + 15) / 16);
  c.chunks = (c.rgs + kWarps - 1) / kWarps;
  const int sms = std::max(1, cuda_sm_count(d.device_id));
  c.fp8_shape = -1;
  int blocks_per_sm = kBlocksPerSm, tasks_per_sm = kBlocksPerSm, xs_bytes = kMaxXsBytes;
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3 && c.nt == 1) {
    const auto [shape, tasks] = fp8_shape_choice();
    c.fp8_shape = shape;
    blocks_per_sm = kFp8Shapes[shape].minb;
    tasks_per_sm = tasks;
    xs_bytes = std::min(kMaxXsBytes, 192 * 1024 / blocks_per_sm);
  }
  const int64_t kc_max = (xs_bytes / (c.nt * 8 * 2) - 32) / 64 * 64;
  const int64_t need = (d.k + kc_max - 1) / kc_max;
  const int64_t want = (int64_t(tasks_per_sm) * sms + c.chunks - 1) / c.chunks;
  const int64_t sc = d.w_dtype == FMLP_DTYPE_F8_E4M3 ? 64 : 32;  // columns per load step
  const int64_t useful = std::max<int64_t>(1, d.k / (8 * sc));   // >= 8 steps per warp and split
  int64_t splits = std::max(need, std::min(want, useful));
  const int64_t per = (d.k + splits - 1) / splits;
  c.kc = int((per + sc - 1) / sc * sc);
  c.splits = int((d.k + c.kc - 1) / c.kc);
  c.xs_stride = (c.kc + 63) / 64 * 64 + 32;
  c.smem = size_t(c.nt) * 8 * size_t(c.xs_stride) * 2;
  // One task per block: the block scheduler balances them (a static deal of 1.7 tasks per
  // block would cost a whole extra task time).
  c.blocks = int(std::min<int64_t>(int64_t(c.splits) * c.chunks, (int64_t(1) << 31) - 1));
  return c;
}

template <int NT, typename WT, bool FP8, int MINB = kBlocksPerSm, int SP = pipe_steps<NT>(),
          int DEPTH = pipe_depth<NT>()>
fmlp_status_t launch(const MmaParams& p, const Config& c, cudaStream_t s) {
  constexpr auto kernel = &linear_sm80_mma<NT, WT, FP8, MINB, SP, DEPTH>;
  if (const fmlp_status_t st = allow_dynamic_smem<kernel>(c.smem, "linear_sm80_mma");
      st != FMLP_SUCCESS)
    return st;
  kernel<<<c.blocks, kThreads, c.smem, s>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fail(FMLP_ERROR_CUDA, "linear_sm80_mma launch failed: {}", cudaGetErrorString(e));
  return FMLP_SUCCESS;
}

template <int SHAPE>
fmlp_status_t launch_fp8(const MmaParams& p, const Config& c, cudaStream_t s) {
  constexpr Fp8Shape f = kFp8Shapes[SHAPE];
  return launch<1, __half, true, f.minb, f.sp, f.depth>(p, c, s);
}

template <typename WT, bool FP8>
fmlp_status_t dispatch(const MmaParams& p, const Config& c, cudaStream_t s) {
  if constexpr (FP8) {
    switch (c.fp8_shape) {
      case 0: return launch_fp8<0>(p, c, s);
      case 1: return launch_fp8<1>(p, c, s);
      case 2: return launch_fp8<2>(p, c, s);
      case 3: return launch_fp8<3>(p, c, s);
      case 4: return launch_fp8<4>(p, c, s);
      default: break;  // more than 8 tokens: the 16-bit shapes
    }
  }
  switch (c.nt) {
    case 1: return launch<1, WT, FP8>(p, c, s);
    case 2: return launch<2, WT, FP8>(p, c, s);
    case 4: return launch<4, WT, FP8>(p, c, s);
    default: return launch<8, WT, FP8>(p, c, s);
  }
}

}  // namespace

bool linear_sm80_mma_supports(const LinearDesc& d, std::string* why) {
  if (refuses_block_scales(d, why)) return false;
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  if (fp8) {
    if (cuda_compute_capability(d.device_id) < 89)
      return (*why = "fp8 weights need sm_89 or newer (cvt.rn.f16x2.e4m3x2)", false);
    if (d.act_dtype == FMLP_DTYPE_F32)
      return (*why =
                  "f32 activations with fp8 weights: the fp16 tensor-core path would round x; "
                  "the GEMV entry takes them",
              false);
  } else if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16) {
    return (*why = fmt::format("{} weights: the tensor-core path takes bf16, f16 or f8_e4m3",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  } else if (d.act_dtype != d.w_dtype) {
    return (*why = fmt::format("{} activations with {} weights: the tensor cores need one dtype",
                               fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype)),
            false);
  }
  const int64_t m_min = fp8 ? 1 : 2;  // 16-bit M = 1 is a plain stream: the GEMV or cuBLASLt
  if (d.m < m_min || d.m > kMaxTokens)
    return (*why = fmt::format("M={}: the tensor-core path takes {} to {} rows with {} weights",
                               d.m, m_min, kMaxTokens, fmlp_dtype_name(d.w_dtype)),
            false);
  if (d.k == 0)
    return (*why = "K = 0: nothing to multiply; linear_sm80_gemv writes y = bias", false);
  if (!d.w_rows16) {
    const int64_t per = fp8 ? 16 : 8, kp = (d.k + per - 1) / per * per;
    return (*why = fmt::format(
                "W's base and row stride must be 16-byte aligned (w_ld {} elements of {}): store "
                "W with a row stride of a multiple of {} elements, e.g. a [N, {}] buffer viewed "
                "as [:, :{}] (fusedmlp.FusedLinear keeps such a copy for odd K), to take this "
                "entry; linear_sm80_gemv reads it as it is with element loads",
                d.w_ld, fmlp_dtype_name(d.w_dtype), per, kp, d.k),
            false);
  }
  if (d.n >= (int64_t(1) << 31) || d.k >= (int64_t(1) << 31))
    return (*why = "N and K must be below 2^31", false);
  return true;
}

size_t linear_sm80_mma_workspace(const LinearDesc& d) {
  const Config c = config_for(d);
  if (c.splits == 1) return 0;
  return align_up(size_t(c.splits) * size_t(d.m) * size_t(d.n) * 4) +
         align_up(size_t(c.chunks) * 4);
}

fmlp_status_t linear_sm80_mma_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                                  void* stream) {
  const Config c = config_for(d);
  MmaParams p{};
  static_cast<LinearOperands&>(p) = linear_operands(a, d);
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
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3) return dispatch<__half, true>(p, c, s);
  return d.w_dtype == FMLP_DTYPE_F16 ? dispatch<__half, false>(p, c, s)
                                     : dispatch<__nv_bfloat16, false>(p, c, s);
}

}  // namespace fmlp::detail
