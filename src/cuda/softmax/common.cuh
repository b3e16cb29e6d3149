// Device helpers of the cuda softmax kernels (softmax/*.cu): the (max, sum of exp) pairs and their
// combination, the 16-byte vector loads and stores, the output formula, and the parameters of
// the row kernels (sm80_rows, sm80_warp_rows, sm90_cluster). The non-finite rules are those of
// sm80_rows.cu's file comment.
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "core/linear_desc.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/softmax/entries.hpp"

namespace fmlp::detail {

namespace softmax {

using fmlp::cuda::load_scalar;
using fmlp::cuda::store_scalar;
using fmlp::cuda::widen8;

constexpr float kLog2e = 1.4426950408889634f;

struct Ms {
  float m, s;
};

// 2^x as one MUFU.EX2 (ex2.approx, ~2 ulp like exp2f), results below 2^-126 flushed to 0:
// exp2f's subnormal handling costs ~4 more instructions per element, and these kernels are
// partly bound by instruction issue (ncu, 256 x 128256 fp32: 0.66 issued warps per scheduler).
// A flushed output is below 1.2e-38, far inside every dtype's tolerance.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Sums are relative to max(m, 0 when m is -Inf), so rows of -Inf add 0 instead of a NaN.
__device__ __forceinline__ Ms combine(Ms a, Ms b, float sc2) {
  const float m = fmaxf(a.m, b.m);
  const float ms = m == -INFINITY ? 0.f : m;
  return {m, a.s * ex2((a.m - ms) * sc2) + b.s * ex2((b.m - ms) * sc2)};
}

template <int E>
__device__ __forceinline__ void accumulate(Ms& a, const float (&v)[E], float sc2) {
  float mb = a.m;
#pragma unroll
  for (int e = 0; e < E; ++e) mb = fmaxf(mb, v[e]);
  if (mb > a.m) {
    a.s *= ex2((a.m - mb) * sc2);
    a.m = mb;
  }
  const float ms = a.m == -INFINITY ? 0.f : a.m;
#pragma unroll
  for (int e = 0; e < E; ++e) a.s += ex2((v[e] - ms) * sc2);
}

// Every thread gets the block's combination, reduced in a fixed order.
__device__ __forceinline__ Ms block_reduce(Ms v, float sc2, Ms* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v = combine(v, {__shfl_xor_sync(~0u, v.m, o), __shfl_xor_sync(~0u, v.s, o)}, sc2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x / 32) ? scratch[lane] : Ms{-INFINITY, 0.f};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v = combine(v, {__shfl_xor_sync(~0u, v.m, o), __shfl_xor_sync(~0u, v.s, o)}, sc2);
  return v;
}

template <typename T, bool VEC>
constexpr int kWidth = VEC ? 16 / int(sizeof(T)) : 1;

template <typename T, bool VEC>
__device__ __forceinline__ void unpack(const uint4& raw, float (&f)[kWidth<T, VEC>]) {
  if constexpr (!VEC) {
    f[0] = __uint_as_float(raw.x);  // element loads never go through here
  } else if constexpr (std::is_same_v<T, float>) {
    f[0] = __uint_as_float(raw.x), f[1] = __uint_as_float(raw.y);
    f[2] = __uint_as_float(raw.z), f[3] = __uint_as_float(raw.w);
  } else {
    widen8<T>(raw, f);
  }
}

// 16 bytes of T from fp32, rounded to nearest even.
template <typename T>
__device__ __forceinline__ uint4 pack(const float (&f)[16 / sizeof(T)]) {
  if constexpr (std::is_same_v<T, float>) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (std::is_same_v<T, __half>) {
        const __half2 h = __floats2half2_rn(f[2 * k], f[2 * k + 1]);
        w[k] = *reinterpret_cast<const uint32_t*>(&h);
      } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
        w[k] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void load(const char* row, int64_t i, fmlp_dtype_t t,
                                     float (&f)[kWidth<T, VEC>], uint4* raw_out = nullptr) {
  if constexpr (VEC) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + i * 16);
    if (raw_out) *raw_out = raw;
    unpack<T, VEC>(raw, f);
  } else {
    f[0] = load_scalar(row, t, i);
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void store(char* row, int64_t i, fmlp_dtype_t t,
                                      const float (&f)[kWidth<T, VEC>]) {
  if constexpr (!VEC)
    store_scalar(row, t, i, f[0]);
  else
    *reinterpret_cast<uint4*>(row + i * 16) = pack<T>(f);
}

// A row's (max, sum) as finish() uses it, made once per row rather than per vector.
struct RowOut {
  float m, inv_s, log_s;
};

__device__ __forceinline__ RowOut row_out(Ms tot) {
  return {tot.m, 1.f / tot.s, logf(tot.s)};
}

// The output of inputs f given the row's total: exp((f - max) / T) / sum, or for log
// (f - max) / T - log sum.
template <int E>
__device__ __forceinline__ void finish(float (&f)[E], bool log, float inv_t, float sc2,
                                       const RowOut& o) {
  if (log) {
#pragma unroll
    for (int e = 0; e < E; ++e) f[e] = (f[e] - o.m) * inv_t - o.log_s;
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) f[e] = ex2((f[e] - o.m) * sc2) * o.inv_s;
  }
}

struct SoftmaxParams {
  const void* x;
  void* y;
  int64_t x_ld, y_ld, n;
  int rows;
  fmlp_dtype_t t;
  float sc2;    // log2(e) / T
  float inv_t;  // 1 / T
  int log;
  int chunks;          // split launch: chunks per row (cluster launch: blocks per row)
  int64_t chunk_len;   // split launch: elements per chunk, a multiple of the vector width
  int64_t cache_vecs;  // fused launch: 16-byte vectors of a row kept in shared memory
  float2* partials;    // [rows, chunks]
  float2* stats;       // [rows]: max, sum
  unsigned* counters;  // [rows], zero between calls
  int64_t l2_ahead;    // cluster launch: blocks ahead whose parts a block prefetches
  int evict;           // cluster launch: x copies and y stores (16-byte vectors) L2 evict-first
};

// The views, sizes and output formula every launch of the row kernels takes.
inline SoftmaxParams row_params(const fmlp_softmax_args_t& a, const SoftmaxDesc& d) {
  SoftmaxParams p{};
  p.x = a.x.data;
  p.y = a.y.data;
  p.x_ld = a.x.ndim == 2 ? a.x.stride[0] : 0;
  p.y_ld = a.y.ndim == 2 ? a.y.stride[0] : 0;
  p.n = d.n;
  p.rows = int(d.rows);
  p.t = d.dtype;
  p.inv_t = 1.f / d.temperature;
  p.sc2 = kLog2e / d.temperature;
  p.log = d.log;
  return p;
}

}  // namespace softmax
}  // namespace fmlp::detail
