// Streaming weights through mma.sync, shared by the tensor-core kernels that read a weight
// matrix once for a few tokens (mlp_decode_sm90_cluster, linear_sm80_mma).
//
// The weights are the A operand, loaded straight from global memory: lane (g, t) of a warp
// loads 16 bytes of rows g and g + 8 of a 16-row group (columns 8t..8t+7 of a 32-column step),
// and mapping the k slots 2t, 2t+1 / 2t+8, 2t+9 of the first m16n8k16 to columns 8t..8t+3 and of
// the second to 8t+4..8t+7 makes those plain loads valid fragments. The tokens (B operand) use the
// same permutation, so a lane's 16-byte piece of a token row is its B fragment.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "cuda/common/common.cuh"

namespace fmlp::cuda {

// C[16x8] += A[16x16] * B[16x8] in WT (bf16 or fp16), fp32 accumulators.
template <typename WT>
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<WT, __half>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    mma_bf16(c, a0, a1, a2, a3, b0, b1);
}

// One 32-column step of rows g and g + 8 against one token fragment (see the file comment).
template <typename WT>
__device__ __forceinline__ void mma_step(float (&c)[4], const uint4& row_g, const uint4& row_g8,
                                         const uint4& b) {
  mma<WT>(c, row_g.x, row_g8.x, row_g.y, row_g8.y, b.x, b.y);
  mma<WT>(c, row_g.z, row_g8.z, row_g.w, row_g8.w, b.z, b.w);
}

// Rows g and g + 8 of a 16-row group, one 16-byte piece per step.
template <int STEPS>
struct Frags {
  uint4 v[STEPS][2];
};

// Issues the first DEPTH - 1 loads of a ring of register buffers.
template <int DEPTH, typename Buf, typename Load>
__device__ __forceinline__ void prime(int n, Buf (&ring)[DEPTH], Load load) {
#pragma unroll
  for (int d = 0; d < DEPTH - 1; ++d)
    if (d < n) load(ring[d], d);
}

// Runs body(ring[i % DEPTH], i) for i in [0, n) on a primed ring, requesting batch i + DEPTH - 1
// before batch i is used (slot indices stay compile-time constants, so the ring stays in
// registers).
template <int DEPTH, typename Buf, typename Load, typename Body>
__device__ __forceinline__ void pipelined(int n, Buf (&ring)[DEPTH], Load load, Body body) {
  for (int i0 = 0; i0 < n; i0 += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int i = i0 + d;
      if (i >= n) break;
      if (i + DEPTH - 1 < n) load(ring[(d + DEPTH - 1) % DEPTH], i + DEPTH - 1);
      body(ring[d], i);
    }
  }
}

}  // namespace fmlp::cuda
