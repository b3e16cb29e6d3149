// Device helpers shared by the decode kernels: dtype widening of 16-byte weight
// chunks, warp sums, optional-vector loads.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

#include "core/mlp_desc.hpp"
#include "cuda/common/common.cuh"

namespace fmlp::cuda {

// Eight bf16/fp16 weights of a 16-byte chunk as fp32 (bf16: the bits shifted into place).
template <typename WT>
__device__ __forceinline__ void widen8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<WT, __half>) {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    } else {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

// Two e4m3 values (the first in the low byte) as fp16x2 (the first in the low half), exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
  uint32_t h = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(uint16_t(pair)));
#else
  (void)pair;  // the entries that use it decline fp8 weights below sm_89
#endif
  return h;
}

// Eight e4m3 weights (two words, lowest address in the low byte of lo) as eight fp16.
__device__ __forceinline__ uint4 widen_e4m3x8(uint32_t lo, uint32_t hi) {
  return make_uint4(e4m3x2_to_f16x2(lo), e4m3x2_to_f16x2(lo >> 16), e4m3x2_to_f16x2(hi),
                    e4m3x2_to_f16x2(hi >> 16));
}

// Eight e4m3 weights as eight T (fp16 or bf16), exactly: e4m3 values (3 mantissa bits,
// exponents 2^-9..2^8, NaN) are fp16 values, and fp16 -> fp32 -> bf16 keeps them.
template <typename T>
__device__ __forceinline__ uint4 widen_e4m3x8_to(uint32_t lo, uint32_t hi) {
  const uint4 h = widen_e4m3x8(lo, hi);
  if constexpr (std::is_same_v<T, __half>) {
    return h;
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "fp16 or bf16");
    const uint32_t in[4] = {h.x, h.y, h.z, h.w};
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&in[i]));
      out[i] = pack_bf16x2(f.x, f.y);
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
  }
}

// The exponent s for which amax * 2^s lies in [2^(top - 1), 2^top) (amax a finite |value| as
// float bits; 0: none, s = 0), clamped so 2^s and 2^-s stay normal floats: the power of two per
// token with which 16-bit x or h is staged as fp16 for fp8 weights.
__device__ __forceinline__ int pow2_shift_to(unsigned amax_bits, int top) {
  if (amax_bits == 0) return 0;
  int e = 0;
  frexpf(__uint_as_float(amax_bits), &e);
  return max(-126, min(126, top - e));
}

// The 16 bytes of a row of T from element c: one load where the row allows it (`vec`: 16-byte
// aligned there), else one load per element (misaligned views).
template <typename T>
__device__ __forceinline__ uint4 load_16b(const T* src, int64_t c, bool vec) {
  if (vec) return *reinterpret_cast<const uint4*>(src + c);
  T e[16 / sizeof(T)];
#pragma unroll
  for (int j = 0; j < int(16 / sizeof(T)); ++j) e[j] = src[c + j];
  uint4 v;
  memcpy(&v, e, sizeof(v));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// fmaxf skips NaN: a NaN lane does not win unless every lane is NaN.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// An optional vector (biases, norm parameters): `absent` when there is none.
__device__ __forceinline__ float opt(const void* p, fmlp_dtype_t t, int64_t i, float absent) {
  return p ? load_scalar(p, t, i) : absent;
}

// The operands of one mlp call as the decode kernels read them (kernel parameter structs derive
// from it): stacked gate/up resolved into two row-strided views, absent vectors as nullptr,
// strides in elements. Filled on the host by decode_operands().
struct DecodeOperands {
  const void* x;
  void* y;
  const void* res;
  int64_t x_ld, y_ld, res_ld;
  const void* wg;  // dense: W1; gated: gate rows
  const void* wu;  // gated: up rows
  const void* w2;
  int64_t wg_ld, wu_ld, w2_ld;
  const void *bg, *bu, *b2, *gamma, *beta;
  fmlp_dtype_t act_t, bg_t, bu_t, b2_t, gamma_t, beta_t;
  fmlp_activation_t act;
  fmlp_norm_t norm;
  float eps;
  int m, k, h, n;
  // The weights' row widths the streams may read: columns [k, kp) of the W1 rows and [h, hp) of
  // the W2 rows exist and are zero (packed weights, padded to whole 16-byte loads), so a stream
  // runs over kp / hp columns against x and h staged with zeros past k / h. kp = k, hp = h for
  // weights as the caller laid them out.
  int kp, hp;
};

DecodeOperands decode_operands(const fmlp_mlp_args_t& a, const fmlp::detail::MlpDesc& d);

// fp8 weights: fp32 dequantisation scales of the gate/dense, up and W2 rows; stride 0 is one scale
// per tensor, 1 one per row (indexed by hidden unit for sg/su, by output for s2). Stacked gate/up
// scales ([1] or [2 * hidden]) are resolved into the two halves. Filled by fp8_scales().
struct Fp8Scales {
  const float *sg, *su, *s2;
  int sg_stride, su_stride, s2_stride;
};

Fp8Scales fp8_scales(const fmlp_mlp_args_t& a, const fmlp::detail::MlpDesc& d);

// Sum over a block of THREADS threads; every thread gets the result. `scratch` holds one float
// per warp.
template <int THREADS>
__device__ float block_sum(float v, float* scratch) {
  constexpr int kWarps = THREADS / 32;
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < kWarps ? scratch[lane] : 0.f;
  return warp_sum(t);
}

// Calls fn(c0, n, f) for each run of n elements c0 .. c0 + n - 1 of this thread's share of a row
// of k values of dtype t (fp32, fp16 or bf16), f[0 .. n) their fp32 values. Where the row is
// 16-byte aligned (`vec`), runs are 8 long and a thread requests RUNS of them with 16-byte loads
// before it uses any: one memory latency a round; the last k % 8 values go one by one. One scalar
// load at a time, each used before the next went out (a dtype switch and shared-memory stores
// between them), staging llama3-8b's x (16 values a thread) waited for 16 latencies in a row, so
// rows that are not aligned (odd d_in, strided x) go one by one (n = 1) with 8 loads a thread in
// flight per round.
template <int THREADS, int RUNS = 2, typename Fn>
__device__ __forceinline__ void for_row_runs(const char* row, fmlp_dtype_t t, int k, bool vec,
                                             Fn fn) {
  if (!vec) {
    constexpr int kRound = 8;
    for (int c0 = threadIdx.x; c0 < k; c0 += kRound * THREADS) {
      float v[kRound];
#pragma unroll
      for (int j = 0; j < kRound; ++j) {
        const int c = c0 + j * THREADS;
        v[j] = c < k ? load_scalar(row, t, c) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kRound; ++j) {
        const int c = c0 + j * THREADS;
        if (c >= k) break;
        float f[8] = {v[j]};
        fn(c, 1, f);
      }
    }
    return;
  }
  const bool f32 = t == FMLP_DTYPE_F32;
  const uint4* src = reinterpret_cast<const uint4*>(row);
  const int runs = k / 8;
  for (int i0 = threadIdx.x; i0 < runs; i0 += RUNS * THREADS) {
    uint4 v[RUNS][2];
#pragma unroll
    for (int j = 0; j < RUNS; ++j) {
      const int i = i0 + j * THREADS;
      const bool in = i < runs;
      v[j][0] = in ? src[f32 ? 2 * i : i] : make_uint4(0, 0, 0, 0);
      v[j][1] = in && f32 ? src[2 * i + 1] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < RUNS; ++j) {
      const int i = i0 + j * THREADS;
      if (i >= runs) break;
      float f[8];
      if (f32) {
        const uint4 a = v[j][0], b = v[j][1];
        const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = __uint_as_float(w[e]);
      } else if (t == FMLP_DTYPE_F16) {
        widen8<__half>(v[j][0], f);
      } else {
        widen8<__nv_bfloat16>(v[j][0], f);
      }
      fn(8 * i, 8, f);
    }
  }
  for (int c = runs * 8 + int(threadIdx.x); c < k; c += THREADS) {  // the k % 8 tail
    float f[8] = {load_scalar(row, t, c)};
    fn(c, 1, f);
  }
}

// Whether every token row of x starts 16-byte aligned, so for_row_runs reads it in 16-byte runs
// of 8 values (any k: the last k % 8 go one by one).
__device__ __forceinline__ bool x_rows_vec(const DecodeOperands& p) {
  const int64_t es = p.act_t == FMLP_DTYPE_F32 ? 4 : 2;
  return reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && (p.m == 1 || (p.x_ld * es) % 16 == 0);
}

// The norm's mean and 1 / rms of one token row (mean 0 for RMSNorm; 0 and 1 without a norm), in
// fp32 from x itself: two passes over the row for LayerNorm (the row is in L2 after the first).
template <int THREADS>
__device__ void token_norm_stats(const DecodeOperands& p, const char* row, bool vec, float* scratch,
                                 float& mean, float& inv) {
  mean = 0.f, inv = 1.f;
  if (p.norm == FMLP_NORM_NONE) return;
  if (p.norm == FMLP_NORM_LAYERNORM) {
    float s = 0.f;
    for_row_runs<THREADS>(row, p.act_t, p.k, vec, [&](int, int n, const float(&f)[8]) {
#pragma unroll
      for (int e = 0; e < 8; ++e) s += e < n ? f[e] : 0.f;
    });
    mean = block_sum<THREADS>(s, scratch) / float(p.k);
  }
  float q = 0.f;
  for_row_runs<THREADS>(row, p.act_t, p.k, vec, [&](int, int n, const float(&f)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) q += e < n ? (f[e] - mean) * (f[e] - mean) : 0.f;
  });
  inv = rsqrtf(block_sum<THREADS>(q, scratch) / float(p.k) + p.eps);
}

// Stage the M rows of x in shared memory as XS ([M][ld], ld >= k, zeros past k): fp32, or bf16/fp16
// (half the bytes of fp32 and of the shared-memory reads per weight chunk), normalised when asked.
// The norm's statistics are taken in fp32 from x itself, so XS only rounds the normalised values,
// as a 16-bit model's norm output is rounded.
template <int THREADS, int M, typename XS>
__device__ void stage_tokens_as(const DecodeOperands& p, XS* xs, float* scratch, int ld) {
  const int64_t es = p.act_t == FMLP_DTYPE_F32 ? 4 : 2;
  const bool vec = x_rows_vec(p);
  for (int m = 0; m < M; ++m) {
    const char* row = static_cast<const char*>(p.x) + m * p.x_ld * es;
    float mean, inv;
    token_norm_stats<THREADS>(p, row, vec, scratch, mean, inv);
    XS* xr = xs + m * ld;
    for (int c = p.k + int(threadIdx.x); c < ld; c += THREADS) xr[c] = from_f<XS>(0.f);
    for_row_runs<THREADS>(row, p.act_t, p.k, vec, [&](int c0, int n, const float(&f)[8]) {
      float v[8];
      if (p.norm == FMLP_NORM_NONE) {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = f[e];
      } else {  // gamma and beta of the run loaded before any store (they may not be hoisted past)
        float g[8], b[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          g[e] = e < n ? opt(p.gamma, p.gamma_t, c0 + e, 1.f) : 0.f;
          b[e] = e < n ? opt(p.beta, p.beta_t, c0 + e, 0.f) : 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = (f[e] - mean) * inv * g[e] + b[e];
      }
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (e < n) xr[c0 + e] = from_f<XS>(v[e]);
    });
  }
  __syncthreads();
}

// stage_tokens_as in fp32.
template <int THREADS, int M>
__device__ void stage_tokens(const DecodeOperands& p, float* xs, float* scratch) {
  stage_tokens_as<THREADS, M, float>(p, xs, scratch, p.k);
}

// End of a split-hidden kernel whose blocks added their partial outputs into acc [M, n] (fp32,
// zero between calls): the block that arrives last (counter, zero between calls) adds b2 and the
// residual, writes y and re-zeroes acc and the counter, so the next call or graph replay needs no
// memset. Every thread of every block calls it after its last add into acc.
template <int THREADS, int M>
__device__ void finish_last_block(const DecodeOperands& p, float* acc, unsigned* counter) {
  if (!block_arrive_last(counter, gridDim.x)) return;
  const size_t es = p.act_t == FMLP_DTYPE_F32 ? 4 : 2;
  for (int i = threadIdx.x; i < M * p.n; i += THREADS) {
    const int m = i / p.n, o = i % p.n;
    float r = __ldcg(acc + i) + opt(p.b2, p.b2_t, o, 0.f);
    acc[i] = 0.f;
    if (p.res) r += load_scalar(static_cast<const char*>(p.res) + m * p.res_ld * es, p.act_t, o);
    store_scalar(static_cast<char*>(p.y) + m * p.y_ld * es, p.act_t, o, r);
  }
  if (threadIdx.x == 0) *counter = 0;
}

}  // namespace fmlp::cuda
