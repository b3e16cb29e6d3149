// allreduce_sm80_p2p_oneshot: every rank pushes its partial into each peer's buffer over NVLink
// (16-byte stores through the peer mappings), raises one flag per peer, waits for every peer's
// flag and sums the P partials locally. One round trip instead of NCCL's 2(P-1) ring steps, which
// is what a latency-bound decode all-reduce (16 KB) pays for.
//
// Ordering: the pushes are made visible system-wide (fence.sc.sys per thread, then the block
// barrier) before the flag is stored with release semantics at system scope; the reader polls
// with acquire at system scope and reads the partials past L1 (ld.cg), so neither a stale line
// nor a reordered load can show it an older call's data.
//
// Epochs and reuse: epoch n of a call is kept on the device (graph replay advances it), the same
// on every rank because every rank makes the same sequence of calls. Flags only grow, so a flag
// >= n means "call n's partial is here". A rank can start pushing call n + 1 only after its call n
// completed, which needed every peer's call-n flag, which each peer raised after its call n - 1
// finished reading; so call n + 1's pushes (set (n + 1) & 1) can only overlap a peer still reading
// call n (set n & 1): the two sets never collide, and no flag can run ahead by two (no ABA).
//
// Launch: with programmatic dependent launch (sm_90+, launch_ex) the kernel is resident before
// the grid that writes y has drained, so the launch latency between the last mlp kernel and the
// exchange is hidden; it waits for that grid before touching anything, then lets the next kernel
// of the stream start (a weight stream then requests its first weights while this one waits for
// the peers' flags).
//
// Blocks: the message splits into per-block chunks that depend only on n and the dtype (never on
// a rank's pointer alignment), so block b of every rank covers the same elements and waits only
// for block b of its peers. At most kP2pMaxBlocks (64) blocks, all resident on a Hopper GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "core/error.hpp"
#include "cuda/allreduce_p2p.hpp"
#include "cuda/common.cuh"
#include "cuda/launch_util.hpp"
#include "cuda/ops.cuh"

namespace fmlp::detail {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kChunkBytes = 16 * 1024;  // per block: one block for a decode-sized y

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Bounded back-off: tight polling first (a peer usually arrives within a microsecond), then
// sleeps growing to 1 us so a long wait (a peer still in its previous kernel) leaves the SM's
// issue slots to others.
__device__ __forceinline__ void wait_flag(const uint64_t* p, uint64_t epoch) {
  unsigned sleep_ns = 0;
  for (int spins = 0; ld_acquire_sys(p) < epoch; ++spins) {
    if (spins < 256) continue;
    sleep_ns = sleep_ns == 0 ? 32 : min(sleep_ns * 2, 1024u);
    __nanosleep(sleep_ns);
  }
}

using fmlp::cuda::from_f;
using fmlp::cuda::to_f;

// 16 bytes of elements; the part of the last group past n is zero (pushed, never stored back).
template <typename T>
union Group {
  static constexpr int kElems = 16 / int(sizeof(T));
  uint4 raw;
  T e[kElems];
};

template <typename T>
__device__ __forceinline__ Group<T> load_group(const T* y, int64_t g, int64_t n, bool vec) {
  constexpr int E = Group<T>::kElems;
  Group<T> v;
  const int64_t first = g * E;
  if (vec && first + E <= n) {
    v.raw = *reinterpret_cast<const uint4*>(y + first);
    return v;
  }
  v.raw = make_uint4(0, 0, 0, 0);
  for (int i = 0; i < E; ++i)
    if (first + i < n) v.e[i] = y[first + i];
  return v;
}

template <typename T>
__device__ __forceinline__ void store_group(T* y, int64_t g, int64_t n, bool vec,
                                            const Group<T>& v) {
  constexpr int E = Group<T>::kElems;
  const int64_t first = g * E;
  if (vec && first + E <= n) {
    *reinterpret_cast<uint4*>(y + first) = v.raw;
    return;
  }
  for (int i = 0; i < E; ++i)
    if (first + i < n) y[first + i] = v.e[i];
}

__device__ __forceinline__ uint64_t* flag_at(char* buf, int set, int source, int block) {
  return reinterpret_cast<uint64_t*>(buf + kP2pFlagsOffset) +
         (size_t(set) * kP2pMaxRanks + size_t(source)) * kP2pMaxBlocks + size_t(block);
}

__device__ __forceinline__ uint4* group_at(const P2pPeers& p, char* buf, int set, int source,
                                           int64_t g) {
  return reinterpret_cast<uint4*>(buf + kP2pDataOffset +
                                  (size_t(set) * size_t(p.size) + size_t(source)) * p.slot_bytes) +
         g;
}

// y: n elements; vec: y is 16-byte aligned (a rank-local choice: it only changes how this rank
// touches its own y, never the chunking). groups_per_block: ceil(groups / gridDim.x).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    allreduce_sm80_p2p_oneshot(const __grid_constant__ P2pPeers p, T* y, int64_t n, bool vec,
                               int64_t groups_per_block) {
  fmlp::cuda::pdl_wait_previous_grid();
  fmlp::cuda::pdl_allow_next_grid();
  const int b = int(blockIdx.x), tid = int(threadIdx.x);
  char* own = p.bufs[p.rank];
  volatile uint64_t* counters = reinterpret_cast<volatile uint64_t*>(own);
  __shared__ uint64_t epoch_s;
  if (tid == 0) {
    const uint64_t e = counters[b] + 1;
    counters[b] = e;
    // Block slots this launch leaves idle advance too, so every slot holds the call count.
    if (b == 0)
      for (int i = int(gridDim.x); i < kP2pMaxBlocks; ++i) counters[i] = e;
    epoch_s = e;
  }
  __syncthreads();
  const uint64_t epoch = epoch_s;
  const int set = int(epoch & 1);
  const int64_t groups = (n + Group<T>::kElems - 1) / Group<T>::kElems;
  const int64_t g0 = int64_t(b) * groups_per_block;
  const int64_t g1 = min(groups, g0 + groups_per_block);

  for (int64_t g = g0 + tid; g < g1; g += kThreads) {
    const Group<T> v = load_group(y, g, n, vec);
    for (int q = 0; q < p.size; ++q)
      if (q != p.rank) *group_at(p, p.bufs[q], set, p.rank, g) = v.raw;
  }
  __threadfence_system();
  __syncthreads();
  if (tid < p.size && tid != p.rank) {
    st_release_sys(flag_at(p.bufs[tid], set, p.rank, b), epoch);
    wait_flag(flag_at(own, set, tid, b), epoch);
  }
  __syncthreads();

  for (int64_t g = g0 + tid; g < g1; g += kThreads) {
    // Unrolled over the rank bound so that the P loads issue together and acc stays in registers.
    float acc[Group<T>::kElems];
#pragma unroll
    for (int q = 0; q < kP2pMaxRanks; ++q) {
      if (q >= p.size) break;
      Group<T> v;
      if (q == p.rank)
        v = load_group(y, g, n, vec);
      else
        v.raw = __ldcg(group_at(p, own, set, q, g));
#pragma unroll
      for (int i = 0; i < Group<T>::kElems; ++i)  // from the first partial on: -0 + -0 stays -0
        acc[i] = q == 0 ? to_f(v.e[i]) : acc[i] + to_f(v.e[i]);
    }
    Group<T> out;
#pragma unroll
    for (int i = 0; i < Group<T>::kElems; ++i) out.e[i] = from_f<T>(acc[i]);
    store_group(y, g, n, vec, out);
  }
}

template <typename T>
fmlp_status_t launch(const P2pPeers& p, void* y, int64_t n, cudaStream_t stream) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA, "allreduce_sm80_p2p_oneshot: no current CUDA device");
  }
  constexpr int64_t E = Group<T>::kElems;
  const int64_t groups = (n + E - 1) / E;
  const int64_t blocks = std::min<int64_t>(
      kP2pMaxBlocks, std::max<int64_t>(1, (groups * 16 + kChunkBytes - 1) / kChunkBytes));
  const int64_t per_block = (groups + blocks - 1) / blocks;
  const bool vec = reinterpret_cast<uintptr_t>(y) % 16 == 0;
  return launch_ex(allreduce_sm80_p2p_oneshot<T>, dim3(unsigned(blocks)), dim3(kThreads), 0,
                   pdl_enabled(cuda_compute_capability(device)), stream,
                   "allreduce_sm80_p2p_oneshot", p, static_cast<T*>(y), n, vec, per_block);
}

}  // namespace

fmlp_status_t allreduce_p2p(const P2pPeers& peers, void* y, fmlp_dtype_t dtype, int64_t n,
                            cudaStream_t stream) {
  if (n <= 0) return FMLP_SUCCESS;
  switch (dtype) {
    case FMLP_DTYPE_F32: return launch<float>(peers, y, n, stream);
    case FMLP_DTYPE_F16: return launch<__half>(peers, y, n, stream);
    case FMLP_DTYPE_BF16: return launch<__nv_bfloat16>(peers, y, n, stream);
    default:
      return fail(FMLP_ERROR_DTYPE_MISMATCH, "the p2p all-reduce takes f32, f16 or bf16, not {}",
                  fmlp_dtype_name(dtype));
  }
}

}  // namespace fmlp::detail
