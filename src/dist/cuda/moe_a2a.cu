// moe_a2a_sm80_dispatch and moe_a2a_sm80_combine (the flow is in moe_a2a.hpp).
//
// Dispatch: one warp per position of the route kernel's perm (slots grouped by expert, so by
// owning rank: ranks hold contiguous expert ranges in order). A slot's place in its rank's section
// is its perm position minus the section's start, found by binary search of the chunk list (chunks
// are in expert order; the first chunk of an expert >= the rank's first expert starts the
// section). Positions are thus deterministic: a slot keeps its place from run to run. Every
// thread also writes the "no expert" id into the unused positions of the metadata, so the
// receivers never read stale or zero (= expert 0) entries.
//
// Combine: one (token, column tile) per block, the token's k returned rows summed in slot order in
// fp32, + residual. Each returned value has exactly one reader, which re-zeroes it; the other
// buffers are re-zeroed from the metadata (rows that were written) and the last block clears the
// per-slot arrays, so a replay finds the workspace as the first call did.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "dist/cuda/moe_a2a.hpp"

namespace fmlp::detail {
namespace {

using fmlp::cuda::load_scalar;
using fmlp::cuda::store_scalar;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPadBlocks = 1024;  // grid-stride blocks for the metadata padding

__device__ __forceinline__ size_t elem_size(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F32 ? 4 : 2;
}

// The rank holding global expert e under fmlp_tp_expert_range's split (first_r = G*r/P).
__device__ __forceinline__ int owner(const MoeA2aParams& p, int e) {
  return int((int64_t(e + 1) * p.ranks - 1) / p.global_experts);
}

// Perm position where rank r's slots start (valid for r == ranks).
__device__ int section_start(const MoeA2aParams& p, int chunks, int valid, int r) {
  if (r >= p.ranks) return valid;
  const int first = int(int64_t(p.global_experts) * r / p.ranks);
  int lo = 0, hi = chunks;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (p.chunk_expert[mid] < first)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < chunks ? p.chunk_start[lo] : valid;
}

// Copies `bytes` (a multiple of the element size) with one warp; vec16: both rows 16-byte aligned
// and bytes a multiple of 16.
__device__ void warp_copy(void* dst, const void* src, int64_t bytes, bool vec16, size_t es) {
  const int lane = threadIdx.x % 32;
  if (vec16) {
    for (int64_t i = lane; i < bytes / 16; i += 32)
      static_cast<uint4*>(dst)[i] = static_cast<const uint4*>(src)[i];
  } else if (es == 4) {
    for (int64_t i = lane; i < bytes / 4; i += 32)
      static_cast<uint32_t*>(dst)[i] = static_cast<const uint32_t*>(src)[i];
  } else {
    for (int64_t i = lane; i < bytes / 2; i += 32)
      static_cast<uint16_t*>(dst)[i] = static_cast<const uint16_t*>(src)[i];
  }
}

// Zeroes pieces first, first + step, ... of a workspace row of `bytes` (even; 16-byte pieces when
// it is a multiple of 16: workspace rows then start on 16-byte boundaries).
__device__ void zero_row(void* row, int64_t bytes, int64_t first, int64_t step) {
  if (bytes % 16 == 0) {
    for (int64_t i = first; i < bytes / 16; i += step)
      static_cast<uint4*>(row)[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t i = first; i < bytes / 2; i += step) static_cast<uint16_t*>(row)[i] = 0;
  }
}

__global__ void __launch_bounds__(kThreads) moe_a2a_sm80_dispatch(const MoeA2aParams p) {
  // The route kernel left the chunk count in the header (0, from the zeroed workspace, when this
  // rank has no tokens and it did not run).
  const int chunks = p.hdr->route.chunks;
  const int valid = chunks > 0 ? p.chunk_start[chunks - 1] + p.chunk_len[chunks - 1] : 0;
  const int64_t C = p.capacity;
  const size_t es = elem_size(p.x_t);
  const int64_t warp = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp < valid) {
    const int slot = p.perm[warp], e = p.ids[slot], r = owner(p, e);
    const int64_t pos = warp - section_start(p, chunks, valid, r);
    if (pos < C) {
      const int64_t row = r * C + pos;
      const bool self = r == p.rank;  // this rank's own section is the receive buffer's
      char* dst = static_cast<char*>(self ? p.recv_x : p.send_x) + row * p.d * int64_t(es);
      const char* src = static_cast<const char*>(p.x) + int64_t(slot / p.top_k) * p.x_ld * es;
      warp_copy(dst, src, int64_t(p.d) * int64_t(es), p.x_vec16, es);
      if (lane == 0) {
        (self ? p.recv_ids : p.send_ids)[row] = e;
        (self ? p.recv_wts : p.send_wts)[row] = p.wts[slot];
        p.where[slot] = int32_t(row + 1);
      }
    } else if (lane == 0) {
      atomicAdd(&p.hdr->dropped, 1);  // its contribution is missing from y
    }
  }
  const int64_t n = int64_t(p.ranks) * C;
  for (int64_t g = int64_t(blockIdx.x) * kThreads + threadIdx.x; g < n;
       g += int64_t(gridDim.x) * kThreads) {
    const int r = int(g / C);
    const int count = section_start(p, chunks, valid, r + 1) - section_start(p, chunks, valid, r);
    if (g % C < count) continue;  // a slot's entry
    const bool self = r == p.rank;
    (self ? p.recv_ids : p.send_ids)[g] = p.global_experts;  // held by no rank: nothing runs
    (self ? p.recv_wts : p.send_wts)[g] = 0.f;
  }
}

__global__ void __launch_bounds__(kThreads) moe_a2a_sm80_combine(const MoeA2aParams p) {
  __shared__ int64_t rows[kMoeMaxExperts];
  __shared__ bool bad;
  const int t = blockIdx.x, k = p.top_k;
  const int64_t C = p.capacity, sections = int64_t(p.ranks) * C;
  const size_t es = elem_size(p.x_t);
  const int64_t x_bytes = int64_t(p.d) * int64_t(es), o_bytes = int64_t(p.d_out) * int64_t(es);
  if (t < p.tokens) {  // block-uniform
    if (threadIdx.x == 0) bad = false;
    __syncthreads();
    for (int j = threadIdx.x; j < k; j += kThreads) {
      rows[j] = int64_t(p.where[t * k + j]) - 1;
      if (p.ids[t * k + j] == kMoeSlotBad) bad = true;
    }
    __syncthreads();
    const int o = blockIdx.y * kThreads + threadIdx.x;
    if (o < p.d_out) {
      float acc = 0.f;
      for (int j = 0; j < k; ++j) {
        if (rows[j] < 0) continue;  // dropped, or a bad id
        const bool self = rows[j] / C == p.rank;
        char* src = static_cast<char*>(self ? p.eo : p.ret) + rows[j] * o_bytes;
        acc += load_scalar(src, p.x_t, o);
        store_scalar(src, p.x_t, o, 0.f);
      }
      if (p.res) acc += load_scalar(static_cast<const char*>(p.res) + t * p.res_ld * es, p.x_t, o);
      if (bad) acc = __int_as_float(0x7fc00000);  // an expert id was out of range: never silent
      store_scalar(static_cast<char*>(p.y) + t * p.y_ld * es, p.x_t, o, acc);
    }
    // The x rows this token's slots were packed into, shared among the token's column blocks.
    for (int j = 0; j < k; ++j) {
      if (rows[j] < 0) continue;
      const bool self = rows[j] / C == p.rank;
      zero_row(static_cast<char*>(self ? p.recv_x : p.send_x) + rows[j] * x_bytes, x_bytes,
               int64_t(blockIdx.y) * kThreads + threadIdx.x, int64_t(gridDim.y) * kThreads);
    }
  }
  // Rows the peers sent (and this rank's expert outputs for them): only real entries were written
  // (padding rows arrive as the zeros the sender's buffer holds).
  const int64_t nb = int64_t(gridDim.x) * gridDim.y, b = int64_t(blockIdx.y) * gridDim.x + t;
  for (int64_t row = b; row < sections; row += nb) {
    if (row / C == p.rank || p.recv_ids[row] == p.global_experts) continue;
    zero_row(static_cast<char*>(p.recv_x) + row * x_bytes, x_bytes, threadIdx.x, kThreads);
    zero_row(static_cast<char*>(p.eo) + row * o_bytes, o_bytes, threadIdx.x, kThreads);
  }
  const int64_t slots = int64_t(p.tokens) * k;
  for (int64_t i = b * kThreads + threadIdx.x; i < slots; i += nb * kThreads) p.perm[i] = 0;
  for (int64_t i = b * kThreads + threadIdx.x; i < p.max_chunks; i += nb * kThreads)
    p.chunk_expert[i] = p.chunk_start[i] = p.chunk_len[i] = 0;
  if (!fmlp::cuda::block_arrive_last(&p.hdr->done, unsigned(nb))) return;
  for (int64_t i = threadIdx.x; i < slots; i += kThreads) p.ids[i] = p.where[i] = 0, p.wts[i] = 0.f;
  for (int64_t i = threadIdx.x; i < sections; i += kThreads) {
    p.send_ids[i] = p.recv_ids[i] = 0;
    p.send_wts[i] = p.recv_wts[i] = 0.f;
  }
  if (threadIdx.x == 0) p.hdr->route.chunks = 0, p.hdr->done = 0;
}

}  // namespace

fmlp_status_t moe_a2a_launch_dispatch(const MoeA2aParams& p, cudaStream_t s) {
  const int64_t slots = int64_t(p.tokens) * p.top_k, entries = int64_t(p.ranks) * p.capacity;
  const int64_t blocks =
      std::max<int64_t>({1, (slots + kWarps - 1) / kWarps,
                         std::min<int64_t>(kMaxPadBlocks, (entries + kThreads - 1) / kThreads)});
  moe_a2a_sm80_dispatch<<<unsigned(blocks), kThreads, 0, s>>>(p);
  return launch_status("moe_a2a_sm80_dispatch");
}

fmlp_status_t moe_a2a_launch_combine(const MoeA2aParams& p, cudaStream_t s) {
  // At least one block: the clearing runs even on a rank without tokens.
  const dim3 grid(unsigned(std::max(1, p.tokens)), unsigned((p.d_out + kThreads - 1) / kThreads));
  moe_a2a_sm80_combine<<<grid, kThreads, 0, s>>>(p);
  return launch_status("moe_a2a_sm80_combine");
}

fmlp_status_t moe_a2a_read_dropped(void* workspace, void* stream, int32_t* count) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, workspace) != cudaSuccess ||
      attr.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return fail(FMLP_ERROR_INVALID_VALUE,
                "workspace is not device memory; pass the workspace of an fmlp_tp_moe_a2a call");
  }
  const DeviceScope scope(attr.device);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const auto s = static_cast<cudaStream_t>(stream);
  int32_t* at = &static_cast<MoeA2aHeader*>(workspace)->dropped;
  int32_t host = 0;
  cudaError_t e = cudaMemcpyAsync(&host, at, sizeof host, cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaMemsetAsync(at, 0, sizeof host, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA,
                "reading the dropped-slot count failed: {} (it synchronises the stream: call it "
                "outside graph capture)",
                cudaGetErrorString(e));
  }
  *count = host;
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
