// Device helpers shared by the prefill path's kernels (prefill_sm90_cublaslt.cu: 16-bit and fp32
// weights; prefill_sm90_cublaslt_fp8.cu: fp8 weights, W8A8): dtype conversion, 8-element vectors,
// block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/error.hpp"
#include "core/op_table.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/launch_util.hpp"

namespace fmlp::detail::prefill {

inline int64_t round8(int64_t n) {
  return (n + 7) / 8 * 8;
}
// Rows per pass: passes of equal size (a short last pass would run its GEMMs on a mostly idle
// GPU) whose scratch, row_bytes a row, stays within 128 MiB (ample to fill the GPU many times).
// FMLP_PREFILL_SCRATCH_MB (8..1024) sets another budget, for measurements.
inline int64_t pass_rows(int64_t m, int64_t row_bytes) {
  static const int64_t budget = knob_int<Knob::FMLP_PREFILL_SCRATCH_MB>() << 20;
  const int64_t max_rows = std::max<int64_t>(64, budget / row_bytes / 64 * 64);
  if (m <= 0) return 0;
  const int64_t passes = (m + max_rows - 1) / max_rows;
  return std::min(m, round8((m + passes - 1) / passes));
}
inline const char* offset(const void* p, int64_t elements, size_t es) {
  return static_cast<const char*>(p) + elements * int64_t(es);
}

using fmlp::cuda::from_f;
using fmlp::cuda::to_f;

// Eight consecutive elements in one (16-bit) or two (fp32) 16-byte accesses.
template <typename T>
struct alignas(8 * sizeof(T)) Vec8 {
  T v[8];
};

// Block-wide sum (MAX = false) or max over THREADS threads, the same order on every run
// (deterministic). red holds THREADS / 32 floats.
template <int THREADS, bool MAX = false>
__device__ __forceinline__ float block_reduce(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = MAX ? fmaxf(v, w) : v + w;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // red may still be read by the previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = red[0];
#pragma unroll
  for (int i = 1; i < THREADS / 32; ++i) s = MAX ? fmaxf(s, red[i]) : s + red[i];
  return s;
}

// The bias + activation (+ gate product) pass over GEMM1's output G.
struct ActParams {
  void* g;      // [rows, ldg]: gate (or dense pre-activation) at column 0, up at column `up`
  int64_t ldg;  // elements
  int64_t up;
  int64_t rows, cols;
  const void *bg, *bu;
  fmlp_dtype_t bg_t, bu_t;
  fmlp_activation_t act;
};

template <bool GATED>
__device__ __forceinline__ float bias_act(const ActParams& p, float g, float u, int64_t j) {
  if (p.bg) g += fmlp::cuda::load_scalar(p.bg, p.bg_t, j);
  const float a = fmlp::cuda::activate(p.act, g);
  if (!GATED) return a;
  if (p.bu) u += fmlp::cuda::load_scalar(p.bu, p.bu_t, j);
  return a * u;
}

// The scratch part of the workspace (core/op_table.hpp), where both prefill paths lay out xn, G,
// h, the bias copies and cuBLASLt's workspace: nothing there needs clearing after the call, so
// the path is its GEMMs and its element-wise passes, no memset.
inline char* scratch_base(void* workspace) {
  return static_cast<char*>(cuda_workspace_scratch(workspace));
}

}  // namespace fmlp::detail::prefill
