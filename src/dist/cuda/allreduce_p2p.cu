// allreduce_sm80_p2p_ll: every rank pushes its partial into each peer's buffer over NVLink as LL
// ("low latency") lines and sums the P partials locally once its peers' lines are there. One
// one-way NVLink trip on the critical path, where NCCL's ring pays 2(P-1) steps: what a
// latency-bound decode all-reduce (16 KB) is made of.
//
// LL lines: each 16-byte line carries 8 bytes of the message as two 64-bit halves
// {data word | flag << 32}, written with one st.relaxed.sys.global.v2.u64 and polled with
// ld.relaxed.sys.global.v2.u64 until both halves carry this call's flag. PTX models a vector
// access as one access per element, each 64-bit element single-copy atomic: a half that shows the
// flag shows its own data word with it, whatever order the halves arrive in. So there is no fence
// and no separate flag (which cost a system fence, i.e. an NVLink round trip, plus a second
// one-way trip for the flag); the price is twice the bytes on the link, nothing at decode sizes.
//
// Epochs and reuse: epoch n of a call is kept on the device (graph replay advances it), the same
// on every rank because every rank makes the same sequence of calls; the flag is derived from it
// (never 0). A rank can start pushing call n + 1 only after its call n completed, which needed
// every peer's call-n lines, which each peer pushed after its call n - 1 finished reading; so
// call n + 1's lines (set (n + 1) & 1) can only overlap a peer still reading call n (set n & 1):
// the two sets never collide. The reader zeroes each line once it has taken it (a local store,
// issued while it still waits for others), so when call n polls a line it holds zeros or call n's
// line: never an older call's, whichever sizes earlier calls had and however far the 32-bit flag
// has wrapped. flag == this call's flag is the test.
//
// Launch: with programmatic dependent launch (sm_90+, launch_ex) the kernel is resident before
// the grid that writes y has drained, so the launch latency between the last mlp kernel and the
// exchange is hidden; it waits for that grid before touching anything, then lets the next kernel
// of the stream start (a weight stream then requests its first weights while this one waits for
// the peers' lines).
//
// Blocks: the message splits into per-block chunks of lines that depend only on n and the dtype
// (never on a rank's pointer alignment), so block b of every rank covers the same lines and waits
// only for block b of its peers. One line per thread while that needs at most kP2pMaxBlocks (64)
// blocks: a decode y of 16 KB (2048 lines) takes 4 blocks of 512 threads, so its 32 KB of pushes
// and its polling leave from 4 SMs at once (one SM's store and L2 bandwidth would add latency)
// and every thread waits for a single line per peer. Larger messages keep 64 blocks and give
// each thread up to kLinesPerThread lines per batch, their loads in flight together.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/launch_util.hpp"
#include "dist/cuda/allreduce_p2p.hpp"

namespace fmlp::detail {
namespace {

constexpr int kThreads = 512;
constexpr int kLinesPerThread = 4;
constexpr int64_t kBatchLines = int64_t(kThreads) * kLinesPerThread;

struct Line {
  uint64_t lo, hi;
};

__device__ __forceinline__ void st_line(char* p, uint64_t lo, uint64_t hi) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(lo), "l"(hi)
               : "memory");
}

__device__ __forceinline__ Line ld_line(const char* p) {
  Line l;
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];"
               : "=l"(l.lo), "=l"(l.hi)
               : "l"(p)
               : "memory");
  return l;
}

__device__ __forceinline__ uint64_t with_flag(uint32_t data, uint32_t flag) {
  return uint64_t(data) | uint64_t(flag) << 32;
}

__device__ __forceinline__ bool carries(const Line& l, uint32_t flag) {
  return uint32_t(l.lo >> 32) == flag && uint32_t(l.hi >> 32) == flag;
}

using fmlp::cuda::from_f;
using fmlp::cuda::to_f;

// The 8 bytes of elements one line carries; the part of the last unit past n is zero (pushed,
// never stored back).
template <typename T>
union Unit {
  static constexpr int kElems = 8 / int(sizeof(T));
  uint2 raw;
  T e[kElems];
};

template <typename T>
__device__ __forceinline__ Unit<T> load_unit(const T* y, int64_t u, int64_t n, bool vec) {
  constexpr int E = Unit<T>::kElems;
  Unit<T> v;
  const int64_t first = u * E;
  if (vec && first + E <= n) {
    v.raw = *reinterpret_cast<const uint2*>(y + first);
    return v;
  }
  v.raw = make_uint2(0, 0);
  for (int i = 0; i < E; ++i)
    if (first + i < n) v.e[i] = y[first + i];
  return v;
}

template <typename T>
__device__ __forceinline__ void store_unit(T* y, int64_t u, int64_t n, bool vec, const Unit<T>& v) {
  constexpr int E = Unit<T>::kElems;
  const int64_t first = u * E;
  if (vec && first + E <= n) {
    *reinterpret_cast<uint2*>(y + first) = v.raw;
    return;
  }
  for (int i = 0; i < E; ++i)
    if (first + i < n) y[first + i] = v.e[i];
}

// Takes this thread's lines of one source slot (line first + k * kThreads, below end) once they
// carry `flag`, then zeroes them for the next call of this set. Bounded back-off: tight polling
// first (a peer usually arrives within a microsecond), then sleeps growing to 1 us so a long wait
// (a peer still in its previous kernel) leaves the SM's issue slots to others.
template <typename T>
__device__ __forceinline__ void take_lines(char* slot, int64_t first, int64_t end, uint32_t flag,
                                           Unit<T> (&v)[kLinesPerThread]) {
  bool pending[kLinesPerThread];
#pragma unroll
  for (int k = 0; k < kLinesPerThread; ++k) {
    pending[k] = first + int64_t(k) * kThreads < end;
    v[k].raw = make_uint2(0, 0);
  }
  unsigned sleep_ns = 0;
  for (int spins = 0;; ++spins) {
    bool waiting = false;
#pragma unroll
    for (int k = 0; k < kLinesPerThread; ++k) {
      if (!pending[k]) continue;
      char* line = slot + (first + int64_t(k) * kThreads) * int64_t(kP2pLineBytes);
      const Line l = ld_line(line);
      if (carries(l, flag)) {
        v[k].raw = make_uint2(uint32_t(l.lo), uint32_t(l.hi));
        pending[k] = false;
        st_line(line, 0, 0);
      } else {
        waiting = true;
      }
    }
    if (!waiting) return;
    if (spins < 256) continue;
    sleep_ns = sleep_ns == 0 ? 32 : min(sleep_ns * 2, 1024u);
    __nanosleep(sleep_ns);
  }
}

// y: n elements; vec: y is 8-byte aligned (a rank-local choice: it only changes how this rank
// touches its own y, never the chunking). lines_per_block: ceil(lines / gridDim.x).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    allreduce_sm80_p2p_ll(const __grid_constant__ P2pPeers p, T* y, int64_t n, bool vec,
                          int64_t lines_per_block) {
  constexpr int E = Unit<T>::kElems;
  fmlp::cuda::pdl_wait_previous_grid();
  fmlp::cuda::pdl_allow_next_grid();
  const int b = int(blockIdx.x), tid = int(threadIdx.x);
  char* own = p.bufs[p.rank];
  volatile uint64_t* counters = reinterpret_cast<volatile uint64_t*>(own);
  // Every thread reads the count itself, while its first units of y load; the block barrier of
  // the first batch orders all these reads before thread 0 advances it.
  const uint64_t epoch = counters[b] + 1;
  const uint32_t flag = uint32_t(epoch % 0xffffffffu) + 1u;  // never 0: zeroed lines never match
  const size_t set_offset = kP2pDataOffset + size_t(epoch & 1) * size_t(p.size) * p.slot_bytes;
  const int64_t lines = (n + E - 1) / E;
  const int64_t l0 = int64_t(b) * lines_per_block;
  const int64_t l1 = min(lines, l0 + lines_per_block);

  // The same number of batches in every block and thread (the barrier is in the first).
  for (int64_t base = l0; base < l0 + lines_per_block; base += kBatchLines) {
    const int64_t first = base + tid;
    Unit<T> mine[kLinesPerThread];
#pragma unroll
    for (int k = 0; k < kLinesPerThread; ++k) {
      mine[k].raw = make_uint2(0, 0);
      if (first + int64_t(k) * kThreads < l1)
        mine[k] = load_unit(y, first + int64_t(k) * kThreads, n, vec);
    }
    if (base == l0) {
      __syncthreads();
      if (tid == 0) {
        counters[b] = epoch;
        // Block slots this launch leaves idle advance too, so every slot holds the call count.
        if (b == 0)
          for (int i = int(gridDim.x); i < kP2pMaxBlocks; ++i) counters[i] = epoch;
      }
    }
    // Rank r pushes to r + 1 first, so the ranks do not all queue on rank 0's links at once.
    for (int i = 1; i < p.size; ++i) {
      const int q = (p.rank + i) % p.size;
      char* slot = p.bufs[q] + set_offset + size_t(p.rank) * p.slot_bytes;
#pragma unroll
      for (int k = 0; k < kLinesPerThread; ++k) {
        const int64_t line = first + int64_t(k) * kThreads;
        if (line < l1)
          st_line(slot + line * int64_t(kP2pLineBytes), with_flag(mine[k].raw.x, flag),
                  with_flag(mine[k].raw.y, flag));
      }
    }

    float acc[kLinesPerThread][E];
    // Unrolled over the rank bound so that acc stays in registers; waits in rank order, which
    // costs nothing: the sum needs every peer's lines anyway.
#pragma unroll
    for (int q = 0; q < kP2pMaxRanks; ++q) {
      if (q >= p.size) break;
      Unit<T> v[kLinesPerThread];
      if (q == p.rank) {
#pragma unroll
        for (int k = 0; k < kLinesPerThread; ++k) v[k] = mine[k];
      } else {
        take_lines(own + set_offset + size_t(q) * p.slot_bytes, first, l1, flag, v);
      }
#pragma unroll
      for (int k = 0; k < kLinesPerThread; ++k)
#pragma unroll
        for (int i = 0; i < E; ++i)  // from the first partial on: -0 + -0 stays -0
          acc[k][i] = q == 0 ? to_f(v[k].e[i]) : acc[k][i] + to_f(v[k].e[i]);
    }
#pragma unroll
    for (int k = 0; k < kLinesPerThread; ++k) {
      const int64_t line = first + int64_t(k) * kThreads;
      if (line >= l1) continue;
      Unit<T> out;
#pragma unroll
      for (int i = 0; i < E; ++i) out.e[i] = from_f<T>(acc[k][i]);
      store_unit(y, line, n, vec, out);
    }
  }
}

template <typename T>
fmlp_status_t launch(const P2pPeers& p, void* y, int64_t n, cudaStream_t stream) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA, "allreduce_sm80_p2p_ll: no current CUDA device");
  }
  constexpr int64_t E = Unit<T>::kElems;
  const int64_t lines = (n + E - 1) / E;
  const int64_t blocks =
      std::min<int64_t>(kP2pMaxBlocks, std::max<int64_t>(1, (lines + kThreads - 1) / kThreads));
  const int64_t per_block = (lines + blocks - 1) / blocks;
  const bool vec = reinterpret_cast<uintptr_t>(y) % 8 == 0;
  return launch_ex(allreduce_sm80_p2p_ll<T>, dim3(unsigned(blocks)), dim3(kThreads), 0,
                   pdl_enabled(cuda_compute_capability(device)), stream, "allreduce_sm80_p2p_ll", p,
                   static_cast<T*>(y), n, vec, per_block);
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
