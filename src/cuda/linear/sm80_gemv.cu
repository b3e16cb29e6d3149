// linear_sm80_gemv: y[M, N] = x[M, K] W^T + b for small M, in one launch on the CUDA cores (the
// general kernel: any weight dtype, mixed dtypes, unaligned W; bf16/fp16 with 2 <= M <= 64 go to
// linear_sm80_mma, sm80_mma.cu).
//
// At small M the op is a stream over W, so the kernel is built for bytes in flight:
//   - a task is (8 W rows, one K split, one tile of up to MT x rows); each of the block's 8 warps
//     owns one W row, its lanes read consecutive 16-byte chunks (non-allocating loads, two
//     batches of kUnroll in flight per lane; the first batch is requested before the x tile is
//     staged, so the staging hides under the W latency) and FMA them with the x tile staged in
//     shared memory as fp32, so every W load serves all MT rows of the tile; fp32 accumulation,
//     warp-shuffle reduction,
//   - the x tiles of one W slice are adjacent task ids, so blocks that re-read a slice for the
//     next x tile find it in L2 (larger M re-reads W from L2, a simple correct fallback),
//   - one task per block up to 16 tasks per resident block (the block scheduler balances them),
//     a resident grid dealing tasks statically beyond,
//   - K is split only when N is too small to give every multiprocessor a task (then up to 2
//     tasks per multiprocessor, never below one load batch per lane): each split writes fp32
//     partial sums to the workspace and the last split to arrive for a task (a counter per task,
//     no spinning) adds them in split order, so results are deterministic; it re-zeroes the
//     partial sums it read and its counter, leaving the workspace zero-filled for the next call.
//     Splitting shapes that already fill the GPU made them slower (4096 x 4096 bf16 split in
//     two, on an H200); the likely causes: every block's stream halves, so a
//     warp's second batch barely overlaps the first, and the partial-sum round trip (write,
//     fence, counter, re-read by the last block) lands on the critical path at the end,
//   - fp8 e4m3 is widened pairwise with cvt.rn.f16x2.e4m3x2 on sm_89+ (exact: every e4m3 value,
//     subnormals included, is an fp16 value; NaN stays NaN),
//   - fp8 activations (W8A8) are widened and multiplied by their scale when x is staged,
//   - the epilogue applies the fp8 scale, adds the bias and converts to the output dtype.
// Unaligned W (base or row stride not in whole 16-byte chunks) takes the same kernel with element
// loads; a K that is not whole chunks on aligned rows streams the chunks and adds the rest by
// elements.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/linear/entries.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::ld_stream_v4;
using fmlp::cuda::load_scalar;
using fmlp::cuda::store_scalar;
using fmlp::cuda::warp_sum;
using fmlp::cuda::widen8;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;           // 16-byte W loads per lane per batch (two in flight)
constexpr int kXsBytes = 32 * 1024;  // staged x per block
using Fp8 = unsigned char;

struct LinearParams : LinearOperands {
  int mtiles, splits, rowgroups;
  int kc;              // K per split, a multiple of the 16-byte sweep of a warp
  int kx;              // K staged per pass, a multiple of it too
  float* partial;      // [splits, m, n] when splits > 1
  unsigned* counters;  // [rowgroups * mtiles] when splits > 1, zero between calls
};

template <typename WT>
constexpr int kPerChunk = 16 / int(sizeof(WT));  // W elements per 16-byte chunk

__device__ __forceinline__ float fp8_to_f32(uint32_t b) {
  // The magnitude bits placed in an fp32 give 2^-120 times the value (subnormals exactly).
  const float f = __uint_as_float(((b & 0x7fu) << 20) | ((b & 0x80u) << 24)) * 0x1p120f;
  return (b & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u) : f;
}

template <typename WT>
__device__ __forceinline__ float load_w(const WT* row, int64_t c) {
  if constexpr (std::is_same_v<WT, Fp8>)
    return fp8_to_f32(row[c]);
  else if constexpr (std::is_same_v<WT, float>)
    return row[c];
  else if constexpr (std::is_same_v<WT, __half>)
    return __half2float(row[c]);
  else
    return __bfloat162float(row[c]);
}

// One 16-byte chunk of W as fp32.
template <typename WT>
__device__ __forceinline__ void widen(const uint4& v, float (&f)[kPerChunk<WT>]) {
  if constexpr (std::is_same_v<WT, float>) {
    f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
  } else if constexpr (std::is_same_v<WT, Fp8>) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // byte 2i is the low half of pair i
      const unsigned short pair = (w[i / 2] >> (16 * (i % 2))) & 0xffffu;
      uint32_t h;
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(pair));
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&h));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
#else
#pragma unroll
    for (int i = 0; i < 16; ++i) f[i] = fp8_to_f32((w[i / 4] >> (8 * (i % 4))) & 0xffu);
#endif
  } else {
    widen8<WT>(v, f);
  }
}

// The first batch of a lane's 16-byte chunks of W row[0, chunks * E): requested before the x
// tile is staged.
template <typename WT>
__device__ __forceinline__ void first_batch(const WT* row, int chunks, uint4 (&v)[kUnroll]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    v[u] = lane + 32 * u < chunks ? ld_stream_v4(row + int64_t(lane + 32 * u) * kPerChunk<WT>)
                                  : make_uint4(0, 0, 0, 0);
}

// acc[r] += W row[0, chunks * E) . xs row r, for one warp; `cur` holds first_batch(row); the
// next batch is requested before the current one is used. (The copy cur = nxt waits for those
// loads, so one batch is in flight, not two: docs/linear-softmax.md.)
template <typename WT, int MT>
__device__ __forceinline__ void row_dot_vec(const WT* row, int chunks, const float* xs, int ld,
                                            uint4 (&cur)[kUnroll], float (&acc)[MT]) {
  constexpr int E = kPerChunk<WT>;
  const int lane = threadIdx.x % 32;
  for (int c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    uint4 nxt[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * (kUnroll + u);
      nxt[u] = c < chunks ? ld_stream_v4(row + int64_t(c) * E) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      float f[E];
      widen<WT>(cur[u], f);
#pragma unroll
      for (int r = 0; r < MT; ++r) {
#pragma unroll
        for (int e = 0; e < E; e += 4) {
          const float4 xv = *reinterpret_cast<const float4*>(xs + r * ld + c * E + e);
          acc[r] = fmaf(f[e], xv.x, acc[r]);
          acc[r] = fmaf(f[e + 1], xv.y, acc[r]);
          acc[r] = fmaf(f[e + 2], xv.z, acc[r]);
          acc[r] = fmaf(f[e + 3], xv.w, acc[r]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) cur[u] = nxt[u];
  }
}

// acc[r] += W row[0, len) . xs row r with element loads (unaligned or ragged W).
template <typename WT, int MT>
__device__ __forceinline__ void row_dot_scalar(const WT* row, int len, const float* xs, int ld,
                                               float (&acc)[MT]) {
  for (int c = threadIdx.x % 32; c < len; c += 32) {
    const float wv = load_w(row, c);
#pragma unroll
    for (int r = 0; r < MT; ++r) acc[r] = fmaf(wv, xs[r * ld + c], acc[r]);
  }
}

__device__ __forceinline__ void epilogue(const LinearParams& p, int row, int m, float v) {
  if (p.scale) v *= p.scale[p.scale_per_row ? row : 0];
  if (p.bias) v += load_scalar(p.bias, p.bias_t, row);
  const int64_t es = p.y_t == FMLP_DTYPE_F32 ? 4 : 2;
  store_scalar(static_cast<char*>(p.y) + m * p.y_ld * es, p.y_t, row, v);
}

// x[m][c] as staged: fp8 activations dequantised with their scale.
__device__ __forceinline__ float load_x(const LinearParams& p, const char* xr, int m, int64_t c) {
  if (p.x_t == FMLP_DTYPE_F8_E4M3)
    return fp8_to_f32(reinterpret_cast<const Fp8*>(xr)[c]) * p.x_scale[p.x_scale_per_row ? m : 0];
  return load_scalar(xr, p.x_t, c);
}

template <typename WT, int MT, bool VEC>
__global__ void __launch_bounds__(kThreads) linear_sm80_gemv(const LinearParams p) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);  // [MT, kx]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t es = p.x_t == FMLP_DTYPE_F32 ? 4 : p.x_t == FMLP_DTYPE_F8_E4M3 ? 1 : 2;
  const int64_t tasks = int64_t(p.rowgroups) * p.splits * p.mtiles;
  int64_t staged = -1;
  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int mt = int(task % p.mtiles);
    const int split = int(task / p.mtiles % p.splits);
    const int rg = int(task / (int64_t(p.mtiles) * p.splits));
    const int m0 = mt * MT, mcount = min(MT, p.m - m0);
    const int k0 = split * p.kc, k1 = min(p.k, k0 + p.kc);
    const int row = rg * kWarps + warp;
    const WT* wrow = static_cast<const WT*>(p.w) + int64_t(min(row, p.n - 1)) * p.w_ld;
    float acc[MT] = {};
    // With one staging pass per task, consecutive tasks of the same x tile and split (all of
    // them when M <= MT and K is not split) reuse what is staged.
    const int64_t key = int64_t(split) * p.mtiles + mt;
    const bool reuse = p.kc <= p.kx && key == staged;
    staged = key;
    for (int kb = k0; kb < k1; kb += p.kx) {
      const int len = min(p.kx, k1 - kb);
      uint4 batch[kUnroll];
      if (VEC && row < p.n) first_batch<WT>(wrow + kb, len / kPerChunk<WT>, batch);
      if (!reuse) {
        __syncthreads();  // the previous pass is done reading xs
#pragma unroll
        for (int r = 0; r < MT; ++r) {
          const char* xr = static_cast<const char*>(p.x) + (m0 + r) * p.x_ld * es;
          for (int c = threadIdx.x; c < len; c += kThreads)
            xs[r * p.kx + c] = r < mcount ? load_x(p, xr, m0 + r, kb + c) : 0.f;
        }
        __syncthreads();
      }
      if (row < p.n) {
        if constexpr (VEC) {
          row_dot_vec<WT, MT>(wrow + kb, len / kPerChunk<WT>, xs, p.kx, batch, acc);
          // A K that is not whole chunks (W stored with a padded row stride) ends the last
          // pass with a partial chunk: by elements, so nothing past K is read.
          const int full = len / kPerChunk<WT> * kPerChunk<WT>;
          if (full < len)
            row_dot_scalar<WT, MT>(wrow + kb + full, len - full, xs + full, p.kx, acc);
        } else {
          row_dot_scalar<WT, MT>(wrow + kb, len, xs, p.kx, acc);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < MT; ++r) acc[r] = warp_sum(acc[r]);
    if (p.splits == 1) {
      if (lane == 0 && row < p.n)
        for (int r = 0; r < mcount; ++r) epilogue(p, row, m0 + r, acc[r]);
      continue;
    }
    if (lane == 0 && row < p.n)
      for (int r = 0; r < mcount; ++r)
        p.partial[(int64_t(split) * p.m + m0 + r) * p.n + row] = acc[r];
    unsigned* counter = p.counters + int64_t(rg) * p.mtiles + mt;
    if (!fmlp::cuda::block_arrive_last(counter, unsigned(p.splits))) continue;
    if (threadIdx.x < kWarps * MT) {
      const int r = threadIdx.x / kWarps, o = rg * kWarps + threadIdx.x % kWarps;
      if (r < mcount && o < p.n) {
        float s = 0.f;
        for (int q = 0; q < p.splits; ++q) {
          float* part = p.partial + (int64_t(q) * p.m + m0 + r) * p.n + o;
          s += __ldcg(part);
          *part = 0.f;  // the workspace contract: left zero-filled
        }
        epilogue(p, o, m0 + r, s);
      }
    }
    if (threadIdx.x == 0) *counter = 0;
  }
}

struct Config {
  int mt, mtiles, splits, rowgroups, kc, kx, blocks;
};

int elem_bytes(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F32 ? 4 : t == FMLP_DTYPE_F8_E4M3 ? 1 : 2;
}

Config config_for(const LinearDesc& d) {
  Config c{};
  c.mt = d.m <= 1 ? 1 : d.m <= 2 ? 2 : d.m <= 4 ? 4 : 8;
  c.mtiles = int((d.m + c.mt - 1) / c.mt);
  c.rowgroups = int((d.n + kWarps - 1) / kWarps);
  const int sweep = 32 * (16 / elem_bytes(d.w_dtype));  // K of one 16-byte load per lane
  const int sms = std::max(1, cuda_sm_count(d.device_id));
  const int64_t base = int64_t(c.rowgroups) * c.mtiles;
  // Split K only when the tasks cannot cover the multiprocessors (see the file comment), to 2
  // tasks per multiprocessor, never below one load batch (kUnroll sweeps) per split.
  const int64_t want = base >= sms ? 1 : (2 * sms + base - 1) / base;
  const int64_t useful = std::max<int64_t>(1, d.k / (int64_t(sweep) * kUnroll));
  c.splits = int(std::max<int64_t>(1, std::min(want, useful)));
  const int64_t per = (d.k + c.splits - 1) / c.splits;
  c.kc = int(std::max<int64_t>(sweep, (per + sweep - 1) / sweep * sweep));
  c.splits = int(std::max<int64_t>(1, (d.k + c.kc - 1) / c.kc));
  c.kx = std::min(c.kc, kXsBytes / (4 * c.mt) / sweep * sweep);
  c.blocks = int(std::min<int64_t>(base * c.splits, int64_t(1) << 30));
  return c;
}

}  // namespace

bool linear_sm80_gemv_supports(const LinearDesc& d, std::string* why) {
  if (refuses_block_scales(d, why)) return false;
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (d.m >= (int64_t(1) << 31) || d.n >= (int64_t(1) << 31) || d.k >= (int64_t(1) << 31))
    return (*why = "M, N and K must be below 2^31", false);
  return true;
}

size_t linear_sm80_gemv_workspace(const LinearDesc& d) {
  const Config c = config_for(d);
  if (c.splits == 1) return 0;
  return align_up(size_t(c.splits) * size_t(d.m) * size_t(d.n) * 4) +
         align_up(size_t(c.rowgroups) * size_t(c.mtiles) * 4);
}

namespace {

// Tasks are dealt to the blocks statically (task = block + i * grid). Up to 16 tasks per resident
// block, each block takes one and the block scheduler balances them (a static deal of 3.4 tasks
// per block would leave a quarter of the blocks running a fourth task alone); past that the grid
// is what the multiprocessors hold at once, so the imbalance stays under 1/16 and blocks reuse
// their staged x.
template <typename KERNEL>
int grid_for(KERNEL kernel, const Config& c, size_t smem, int device) {
  const int64_t resident =
      int64_t(std::max(1, cuda_sm_count(device))) * blocks_per_sm(kernel, kThreads, smem, device);
  return int(c.blocks <= 16 * resident ? c.blocks : resident);
}

template <typename WT, int MT>
fmlp_status_t launch(const LinearParams& p, const Config& c, bool vec, int device, cudaStream_t s) {
  const size_t smem = size_t(MT) * size_t(c.kx) * 4;
  if (vec) {
    auto* k = &linear_sm80_gemv<WT, MT, true>;
    k<<<grid_for(k, c, smem, device), kThreads, smem, s>>>(p);
  } else {
    auto* k = &linear_sm80_gemv<WT, MT, false>;
    k<<<grid_for(k, c, smem, device), kThreads, smem, s>>>(p);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fail(FMLP_ERROR_CUDA, "linear_sm80_gemv launch failed: {}", cudaGetErrorString(e));
  return FMLP_SUCCESS;
}

template <typename WT>
fmlp_status_t dispatch_mt(const LinearParams& p, const Config& c, bool vec, int device,
                          cudaStream_t s) {
  switch (c.mt) {
    case 1: return launch<WT, 1>(p, c, vec, device, s);
    case 2: return launch<WT, 2>(p, c, vec, device, s);
    case 4: return launch<WT, 4>(p, c, vec, device, s);
    default: return launch<WT, 8>(p, c, vec, device, s);
  }
}

}  // namespace

fmlp_status_t linear_sm80_gemv_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                                   void* stream) {
  const Config c = config_for(d);
  LinearParams p{};
  static_cast<LinearOperands&>(p) = linear_operands(a, d);
  p.mtiles = c.mtiles, p.splits = c.splits, p.rowgroups = c.rowgroups, p.kc = c.kc, p.kx = c.kx;
  if (c.splits > 1) {
    char* base = static_cast<char*>(ws);
    p.partial = reinterpret_cast<float*>(base);
    p.counters = reinterpret_cast<unsigned*>(
        base + align_up(size_t(c.splits) * size_t(d.m) * size_t(d.n) * 4));
  }
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  fmlp_status_t st;
  switch (d.w_dtype) {
    case FMLP_DTYPE_F32: st = dispatch_mt<float>(p, c, d.w_rows16, d.device_id, s); break;
    case FMLP_DTYPE_F16: st = dispatch_mt<__half>(p, c, d.w_rows16, d.device_id, s); break;
    case FMLP_DTYPE_BF16: st = dispatch_mt<__nv_bfloat16>(p, c, d.w_rows16, d.device_id, s); break;
    default: st = dispatch_mt<Fp8>(p, c, d.w_rows16, d.device_id, s); break;
  }
  return st;
}

}  // namespace fmlp::detail
