// Device helpers shared by the CUDA kernels: dtype loads/stores, the bf16 hi/lo split that lets
// bf16 tensor cores reach fp32-like accuracy, mma.sync wrappers and the activations (same NaN/Inf
// semantics as src/ref/activation.hpp: the formulas are written the same way, without clamps).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::cuda {

__device__ __forceinline__ float load_scalar(const void* p, fmlp_dtype_t t, int64_t i) {
  switch (t) {
    case FMLP_DTYPE_F32: return static_cast<const float*>(p)[i];
    case FMLP_DTYPE_F16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

__device__ __forceinline__ void store_scalar(void* p, fmlp_dtype_t t, int64_t i, float v) {
  switch (t) {
    case FMLP_DTYPE_F32: static_cast<float*>(p)[i] = v; break;
    case FMLP_DTYPE_F16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo_k, float hi_k) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo_k, hi_k);  // .x = lo_k at the lower address
  return *reinterpret_cast<const uint32_t*>(&v);
}

// An fp32 pair as two values of the 16-bit dtype WT (__half or __nv_bfloat16), lo at the lower
// address.
template <typename WT>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<WT, __half>) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    return pack_bf16x2(lo, hi);
  }
}

// v ~= hi + lo with both bf16: 16 significant bits, enough for fp32-grade results (1e-5). An
// infinite hi takes lo = 0: inf - inf would make lo NaN, and w * NaN turns a dot product the
// reference finds infinite (relu(-inf) = 0 downstream, say) into NaN.
__device__ __forceinline__ void split_bf16(float v, __nv_bfloat16* hi, __nv_bfloat16* lo) {
  *hi = __float2bfloat16_rn(v);
  const float h = __bfloat162float(*hi);
  *lo = __float2bfloat16_rn(isinf(h) ? 0.f : v - h);
}

// Streaming 16-byte weight load: read once per call, so keep it out of L1.
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// The first `bytes` (1..15) bytes of the 16-byte aligned chunk at p, zeros after them: at most
// four naturally aligned loads (8, 4, 2, 1 bytes), none past the last of those bytes.
__device__ __forceinline__ uint4 ld_stream_tail(const void* p, int bytes) {
  const char* b = static_cast<const char*>(p);
  uint64_t half[2] = {0, 0};  // bytes 0..7, 8..15
  // A naturally aligned piece never straddles the two halves; the offsets are constants per
  // branch pair, so `half` stays in registers.
  auto put = [&](uint64_t v, int o) {
    if (o < 8)
      half[0] |= v << (8 * o);
    else
      half[1] |= v << (8 * (o - 8));
  };
  if (bytes & 8) half[0] = __ldg(reinterpret_cast<const unsigned long long*>(b));
  if (bytes & 4) put(__ldg(reinterpret_cast<const unsigned*>(b + (bytes & 8))), bytes & 8);
  if (bytes & 2) put(__ldg(reinterpret_cast<const unsigned short*>(b + (bytes & 12))), bytes & 12);
  if (bytes & 1) put(__ldg(reinterpret_cast<const unsigned char*>(b + (bytes & 14))), bytes & 14);
  return make_uint4(uint32_t(half[0]), uint32_t(half[0] >> 32), uint32_t(half[1]),
                    uint32_t(half[1] >> 32));
}

// 16 bytes from global to shared memory without passing through registers (sm_80+), cached in
// L2 only: for data each block reads once (weights), not for x that every block reads (see
// linear/sm80_stream.cu's stage_x).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most PENDING of this thread's committed groups are in flight; a barrier then
// makes the copies visible to the block.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// C[16x8] += A[16x16] * B[16x8], bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void red_add_f32(float* p, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

// Four consecutive floats at a 16-byte aligned p: one reduction request instead of four on sm_90.
__device__ __forceinline__ void red_add_v4_f32(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c),
               "f"(d)
               : "memory");
#else
  red_add_f32(p, a);
  red_add_f32(p + 1, b);
  red_add_f32(p + 2, c);
  red_add_f32(p + 3, d);
#endif
}

__device__ __forceinline__ void red_add_v2_f32(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  red_add_f32(p, a);
  red_add_f32(p + 1, b);
#endif
}

__device__ __forceinline__ float activate(fmlp_activation_t act, float x) {
  switch (act) {
    case FMLP_ACT_RELU: return x > 0.f ? x : (isnan(x) ? x : 0.f);
    case FMLP_ACT_GELU: return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
    case FMLP_ACT_GELU_TANH:
      return 0.5f * x * (1.f + tanhf(0.79788456080286535588f * (x + 0.044715f * x * x * x)));
    case FMLP_ACT_RELU2: {
      const float r = x > 0.f ? x : (isnan(x) ? x : 0.f);
      return r * r;
    }
    default: return x / (1.f + expf(-x));
  }
}

// A scalar of T (float, __half, __nv_bfloat16) to fp32 and back (round to nearest even).
template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_f(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
// Programmatic dependent launch (sm_90; no-ops before, and in a plain launch): a kernel launched
// with it (launch_ex, launch_util.hpp) may start while the previous kernel on the stream drains.
// pdl_wait_previous_grid() waits until that grid has completed and its memory is visible; only
// what no kernel of the stream writes (weights) may be read before it. pdl_allow_next_grid() lets
// the next such kernel start; called after the wait, it also tells that kernel that every input
// this grid waited for is complete. It shortens the decode MLPs at M = 1 on an H200, most on the
// small ones, where the launch gap is a larger share (docs/decode.md; fusedmlp_cuda_bench --ms 1).
__device__ __forceinline__ void pdl_wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// One arrival of this block on `counter` (zero between calls) out of `total`: true, in every
// thread of the block, for the block that arrives last, which may then read what every other
// block wrote before its arrival. Every thread of the block calls it (with its writes done).
// One fence per block, by the thread that arrives: the barrier orders the block's writes before
// that thread's fence, and the fence is cumulative (the pattern of cooperative groups' grid
// sync); the last block's thread fences again after the atomic, before the barrier releases its
// block's readers. (A fence in every thread measured the same on an H200, with 4096 blocks of
// 256 threads storing a word each.)
__device__ __forceinline__ bool block_arrive_last(unsigned* counter, unsigned total) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    __threadfence();
    last = atomicAdd(counter, 1u) == total - 1;
    if (last) __threadfence();
  }
  __syncthreads();
  return last;
}

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

}  // namespace fmlp::cuda
