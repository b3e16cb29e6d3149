// softmax_sm80_ticket: softmax / log_softmax of long rows (>= 16 KB) in one launch, any number of
// rows, HBM read once and written once, no co-residency assumption.
//
// Work is cut into parts: part q of row r (P parts per row, `part_len` elements each, the last
// one shorter) is ticket t = r * P + q. The grid is what the multiprocessors hold at once; each
// block takes tickets in increasing order from a counter in the workspace. For ticket t a block
// loads its part into registers (16-byte loads, all issued before any use), reduces it to
// (max, sum of exp), publishes that to slot t and counts itself on the row's `arrived` counter
// (release). It then takes its next ticket and issues that part's loads into a second register
// set BEFORE it waits (acquire, polling with a short sleep) for `arrived` to reach P. Then it
// combines the row's P pairs, every block in the same fixed order (same bits: deterministic), and
// writes its part from registers. So each block keeps two parts in flight while it waits. y may
// be x: a part is read whole before it is written, and only its own block reads it.
//
// No deadlock: a block waits on row r only once its next ticket lies beyond row r (a next
// ticket in row r is published at once: the rare "extra" parts, written at the end by re-reading
// them), so every ticket of r has been taken, and only running blocks take tickets. Take the
// lowest row r any block would wait on forever: each ticket u of r is held by a running block
// that has published u, or holds u as its next ticket while it writes or waits on a row below r
// (which completes, as r is the lowest), after which it publishes u. So r completes. Blocks that
// are not resident hold no tickets; the blocks that are drain them all.
//
// Workspace (zero-filled between calls, fusedmlp.h): the ticket counter, a slot per ticket,
// `arrived` and `done` per row. The blocks of a row count themselves on `done` once they have
// read its slots; the last re-zeroes the slots and both counters. Every block stops at its first
// ticket past the end, so the one that draws ticket (total + grid - 1) re-zeroes the counter.
//
// Launched with programmatic dependent launch: the blocks become resident while the previous
// kernel drains and touch x, y or the workspace only after griddepcontrol.wait, which returns once
// the previous grid (maybe this kernel, on the same workspace) has completed and its writes are
// visible.
//
// FMLP_SOFTMAX_TICKET=0 turns the entry off (A/B measurements); FMLP_SOFTMAX_PART_KB=k sets
// the part size to k KB (1..32) for every shape (the part-size sweep).
#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor_check.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/softmax/common.cuh"

namespace fmlp::detail {
namespace {

using namespace softmax;
using fmlp::cuda::from_f;
using fmlp::cuda::pdl_allow_next_grid;
using fmlp::cuda::pdl_wait_previous_grid;

constexpr int kThreads = 256;
constexpr int kMaxParts = 2048;               // the block's list of extra parts in shared memory
constexpr int64_t kMinRowBytes = 16 * 1024;   // shorter rows: softmax_sm80_rows
constexpr int64_t kMaxPartBytes = 32 * 1024;  // 8 vectors per thread and register set
constexpr int64_t kMinPartBytes = 4 * 1024;
constexpr int64_t kTargetTickets = 128;
// Every ticket is an atomic on one counter, which serialises the tickets: on many rows (256 x
// 128256 fp32, thousands of tickets) it ran several times slower than softmax_sm90_cluster, the
// more so the smaller the parts. So this kernel takes few rows only, where its one launch over
// the whole GPU wins (one 128256- or 1M-wide fp32 row; fusedmlp_ops_bench --only softmax,
// bench/results/softmax_h200.json).
constexpr int64_t kMaxRows = 4;
constexpr int64_t kPartGrain = 512;  // a warp's 16-byte vectors

struct TicketParams {
  const void* x;
  void* y;
  int64_t x_ld, y_ld, n;  // elements
  int64_t part_len;       // elements, whole 512-byte units
  unsigned parts;         // per row
  unsigned total;         // rows * parts
  float sc2;              // log2(e) / T
  float inv_t;
  int log;
  unsigned* ticket;   // next ticket
  float2* slots;      // [total]: (max, sum) of each part
  unsigned* arrived;  // [rows]: parts published
  unsigned* done;     // [rows]: parts whose block has read the row's slots
};

struct TicketShared {
  Ms warp[32];
  unsigned first, next;
  int last;
  unsigned short extra[kMaxParts];
};

template <typename T>
__device__ __forceinline__ uint32_t neg_inf_word() {
  if constexpr (sizeof(T) == 4) return 0xff800000u;
  if constexpr (std::is_same_v<T, __half>) return 0xfc00fc00u;
  return 0xff80ff80u;
}

// Elements [i, i + valid) of a row as a 16-byte vector, -Inf in the rest: -Inf adds nothing to
// a (max, sum) pair, whatever the row holds.
template <typename T>
__device__ __forceinline__ uint4 load_elems(const T* x, int64_t i, int valid) {
  constexpr int E = 16 / int(sizeof(T));
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = neg_inf_word<T>();
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (e >= valid) break;
    if constexpr (sizeof(T) == 4) {
      w[e] = __ldcs(reinterpret_cast<const unsigned*>(x + i) + e);
    } else {
      const uint32_t b = __ldcs(reinterpret_cast<const unsigned short*>(x + i) + e);
      w[e / 2] = e % 2 ? (w[e / 2] & 0xffffu) | (b << 16) : (w[e / 2] & 0xffff0000u) | b;
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Thread vector k of a part covers elements [i, i + E) of the row, i = b + (tid + k * kThreads) *
// E.
template <typename T, bool VEC>
__device__ __forceinline__ uint4 load_vec(const T* x, int64_t i, int64_t e) {
  constexpr int E = 16 / int(sizeof(T));
  if (VEC && i + E <= e) return __ldcs(reinterpret_cast<const uint4*>(x + i));
  return load_elems<T>(x, i, int(std::min<int64_t>(std::max<int64_t>(e - i, 0), E)));
}

template <typename T, bool VEC>
__device__ __forceinline__ void store_vec(T* y, int64_t i, int64_t e,
                                          const float (&f)[16 / sizeof(T)]) {
  constexpr int E = 16 / int(sizeof(T));
  if (VEC && i + E <= e) {
    __stcs(reinterpret_cast<uint4*>(y + i), pack<T>(f));
    return;
  }
#pragma unroll
  for (int k = 0; k < E; ++k)
    if (i + k < e) y[i + k] = from_f<T>(f[k]);
}

struct PartSpan {
  int64_t b, e;  // elements of the row
  const char* x;
  char* y;
};

template <typename T>
__device__ __forceinline__ PartSpan span_of(const TicketParams& p, unsigned t) {
  const unsigned r = t / p.parts, q = t % p.parts;
  const int64_t b = int64_t(q) * p.part_len;
  return {b, std::min(p.n, b + p.part_len),
          static_cast<const char*>(p.x) + int64_t(r) * p.x_ld * int64_t(sizeof(T)),
          static_cast<char*>(p.y) + int64_t(r) * p.y_ld * int64_t(sizeof(T))};
}

template <typename T, bool VEC, int V>
__device__ __forceinline__ void load_part(uint4 (&v)[V], const TicketParams& p, unsigned t) {
  constexpr int E = 16 / int(sizeof(T));
  const PartSpan s = span_of<T>(p, t);
  const T* x = reinterpret_cast<const T*>(s.x);
#pragma unroll
  for (int k = 0; k < V; ++k)
    v[k] = load_vec<T, VEC>(x, s.b + int64_t(threadIdx.x + k * kThreads) * E, s.e);
}

template <typename T, int V>
__device__ __forceinline__ Ms part_stats(const uint4 (&v)[V], float sc2) {
  Ms acc{-INFINITY, 0.f};
#pragma unroll
  for (int k = 0; k < V; ++k) {
    float f[16 / sizeof(T)];
    unpack<T, true>(v[k], f);
    accumulate(acc, f, sc2);
  }
  return acc;
}

template <typename T, bool VEC, int V>
__device__ __forceinline__ void store_part(const uint4 (&v)[V], const TicketParams& p, unsigned t,
                                           const RowOut& tot) {
  constexpr int E = 16 / int(sizeof(T));
  const PartSpan s = span_of<T>(p, t);
  T* y = reinterpret_cast<T*>(s.y);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t i = s.b + int64_t(threadIdx.x + k * kThreads) * E;
    if (i >= s.e) break;
    float f[E];
    unpack<T, true>(v[k], f);
    finish(f, p.log, p.inv_t, p.sc2, tot);
    store_vec<T, VEC>(y, i, s.e, f);
  }
}

// An extra part: its registers went to later tickets, so it is read again (likely from L2).
template <typename T, bool VEC, int V>
__device__ void rewrite_part(const TicketParams& p, unsigned t, const RowOut& tot) {
  constexpr int E = 16 / int(sizeof(T));
  const PartSpan s = span_of<T>(p, t);
  const T* x = reinterpret_cast<const T*>(s.x);
  T* y = reinterpret_cast<T*>(s.y);
  for (int k = 0; k < V; ++k) {
    const int64_t i = s.b + int64_t(threadIdx.x + k * kThreads) * E;
    if (i >= s.e) break;
    float f[E];
    unpack<T, true>(load_vec<T, VEC>(x, i, s.e), f);
    finish(f, p.log, p.inv_t, p.sc2, tot);
    store_vec<T, VEC>(y, i, s.e, f);
  }
}

// The part this block will most likely get first, requested into L2 while the ticket counter
// answers: the first tickets go out about in block order.
template <typename T>
__device__ __forceinline__ void prefetch_first(const TicketParams& p) {
  if (blockIdx.x >= p.total) return;
  const PartSpan s = span_of<T>(p, blockIdx.x);
  const uintptr_t first = uintptr_t(s.x + s.b * int64_t(sizeof(T))) & ~uintptr_t(127);
  const uintptr_t end = uintptr_t(s.x + s.e * int64_t(sizeof(T)));
  const uintptr_t a = first + uintptr_t(threadIdx.x) * 128;
  if (a < end) asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
}

// Thread 0 takes a ticket; every thread gets it after the barrier. `at` must not be read by a
// thread still reading the previous ticket taken through it (the caller alternates or syncs).
__device__ __forceinline__ unsigned take(const TicketParams& p, unsigned* at) {
  if (threadIdx.x == 0) *at = atomicAdd(p.ticket, 1u);
  __syncthreads();
  return *at;
}

__device__ __forceinline__ void publish(const TicketParams& p, unsigned t, Ms m) {
  p.slots[t] = make_float2(m.m, m.s);
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p.arrived + t / p.parts) : "memory");
}

__device__ __forceinline__ void wait_row(const TicketParams& p, unsigned r) {
  unsigned ns = 0;
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p.arrived + r) : "memory");
    if (v >= p.parts) return;
    if (ns) __nanosleep(ns);
    ns = std::min(ns + 32u, 128u);
  }
}

// The row's P pairs combined: thread j takes parts j, j + 256, ..., then the block reduction;
// both orders are fixed, so every block of the row gets the same bits.
__device__ __forceinline__ Ms row_total(const TicketParams& p, unsigned r, TicketShared& sh) {
  Ms v{-INFINITY, 0.f};
  const float2* slots = p.slots + size_t(r) * p.parts;
  for (unsigned q = threadIdx.x; q < p.parts; q += kThreads) {
    const float2 s = __ldcg(slots + q);
    v = combine(v, {s.x, s.y}, p.sc2);
  }
  return block_reduce(v, p.sc2, sh.warp);
}

// Ticket t, whose part `cur` holds (loads issued), from its (max, sum) to its output; `nxt` is
// left holding the next ticket's loads. Returns that ticket (>= p.total: none left).
template <typename T, bool VEC, int V>
__device__ __forceinline__ unsigned ticket_step(uint4 (&cur)[V], uint4 (&nxt)[V], unsigned t,
                                                const TicketParams& p, TicketShared& sh) {
  const unsigned r = t / p.parts;
  unsigned nt = take(p, &sh.next);  // its round trip overlaps cur's loads
  Ms m = block_reduce(part_stats<T, V>(cur, p.sc2), p.sc2, sh.warp);
  if (threadIdx.x == 0) publish(p, t, m);
  int extras = 0;
  while (nt < p.total && nt / p.parts == r) {  // r cannot complete before this block takes more
    load_part<T, VEC, V>(nxt, p, nt);
    const unsigned after = take(p, &sh.next);
    m = block_reduce(part_stats<T, V>(nxt, p.sc2), p.sc2, sh.warp);
    if (threadIdx.x == 0) {
      publish(p, nt, m);
      sh.extra[extras] = static_cast<unsigned short>(nt % p.parts);
    }
    ++extras;
    nt = after;
  }
  if (nt < p.total) load_part<T, VEC, V>(nxt, p, nt);
  if (threadIdx.x == 0) wait_row(p, r);
  __syncthreads();
  const RowOut tot = row_out(row_total(p, r, sh));
  store_part<T, VEC, V>(cur, p, t, tot);
  for (int k = 0; k < extras; ++k) rewrite_part<T, VEC, V>(p, r * p.parts + sh.extra[k], tot);
  if (threadIdx.x == 0) {  // after its stores, so the round trip overlaps their drain
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
                 : "=r"(before)
                 : "l"(p.done + r), "r"(unsigned(1 + extras))
                 : "memory");
    sh.last = before + unsigned(1 + extras) == p.parts;
  }
  __syncthreads();
  if (sh.last) {  // every block of the row has read its slots
    for (unsigned q = threadIdx.x; q < p.parts; q += kThreads)
      p.slots[size_t(r) * p.parts + q] = make_float2(0.f, 0.f);
    if (threadIdx.x == 0) p.arrived[r] = 0, p.done[r] = 0;
  }
  return nt;
}

template <typename T, bool VEC, int V>
__global__ void __launch_bounds__(kThreads) softmax_sm80_ticket(const TicketParams p) {
  __shared__ TicketShared sh;
  uint4 a[V], b[V];
  pdl_wait_previous_grid();
  pdl_allow_next_grid();
  prefetch_first<T>(p);
  unsigned t = take(p, &sh.first);  // ticket_step takes through sh.next: no barrier between
  if (t < p.total) {
    load_part<T, VEC, V>(a, p, t);
    for (;;) {
      t = ticket_step<T, VEC, V>(a, b, t, p, sh);
      if (t >= p.total) break;
      t = ticket_step<T, VEC, V>(b, a, t, p, sh);
      if (t >= p.total) break;
    }
  }
  // Each block takes exactly one ticket past the end, its last: the block that takes the last
  // of those knows every other block is done with the counter.
  if (threadIdx.x == 0 && t == p.total + gridDim.x - 1) *p.ticket = 0;
}

struct Plan {
  int64_t part_len = 0;  // elements
  int64_t parts = 0;     // per row
  int v = 0;             // 16-byte vectors per thread and register set: 1, 2, 4 or 8
};

int64_t env_part_bytes() {
  static const int64_t kb = knob_int_or<Knob::FMLP_SOFTMAX_PART_KB>(0);
  return kb * 1024;
}

bool ticket_enabled() {
  static const bool on = knob_bool<Knob::FMLP_SOFTMAX_TICKET>();
  return on;
}

int64_t round_up(int64_t v, int64_t g) {
  return (v + g - 1) / g * g;
}

// FMLP_SOFTMAX_PART_KB overrides the part size. Parts only grow past it to keep P <= kMaxParts.
Plan plan_for(const SoftmaxDesc& d) {
  const int64_t es = int64_t(dtype_size(d.dtype)), row = d.n * es;
  int64_t part = env_part_bytes();
  if (part == 0) {
    // ~128 tickets in all, 4-32 KB each: the best of a part sweep on an H200 (one 128256-wide
    // fp32 row fastest at 4 KB, a 1M-wide one at 32 KB; FMLP_SOFTMAX_PART_KB with
    // fusedmlp_ops_bench --only softmax repeats it).
    part = std::clamp(round_up((d.rows * row + kTargetTickets - 1) / kTargetTickets, kPartGrain),
                      kMinPartBytes, kMaxPartBytes);
  }
  part = std::min(kMaxPartBytes,
                  std::max(part, round_up((row + kMaxParts - 1) / kMaxParts, kPartGrain)));
  Plan p;
  p.part_len = part / es;
  p.parts = (d.n + p.part_len - 1) / p.part_len;
  const int64_t vecs = (part / 16 + kThreads - 1) / kThreads;
  p.v = vecs <= 1 ? 1 : vecs <= 2 ? 2 : vecs <= 4 ? 4 : 8;
  return p;
}

struct Layout {
  size_t counters, slots, arrived, done, bytes;
};

Layout layout_for(const SoftmaxDesc& d, const Plan& pl) {
  Layout l{};
  l.counters = 0;
  l.slots = align_up(sizeof(unsigned));
  l.arrived = l.slots + align_up(size_t(d.rows * pl.parts) * sizeof(float2));
  l.done = l.arrived + align_up(size_t(d.rows) * sizeof(unsigned));
  l.bytes = l.done + align_up(size_t(d.rows) * sizeof(unsigned));
  return l;
}

template <typename T, bool VEC, int V>
fmlp_status_t launch(const TicketParams& p, int device, cudaStream_t s) {
  constexpr auto kernel = &softmax_sm80_ticket<T, VEC, V>;
  const int resident =
      blocks_per_sm(kernel, kThreads, 0, device) * std::max(1, cuda_sm_count(device));
  const unsigned grid = std::min(unsigned(resident), p.total);
  return launch_ex(kernel, dim3(grid), dim3(kThreads), 0,
                   pdl_enabled(cuda_compute_capability(device)), s, "softmax_sm80_ticket", p);
}

template <typename T, bool VEC>
fmlp_status_t launch_v(const TicketParams& p, int v, int device, cudaStream_t s) {
  switch (v) {
    case 1: return launch<T, VEC, 1>(p, device, s);
    case 2: return launch<T, VEC, 2>(p, device, s);
    case 4: return launch<T, VEC, 4>(p, device, s);
    default: return launch<T, VEC, 8>(p, device, s);
  }
}

template <typename T>
fmlp_status_t launch_t(const TicketParams& p, bool vec, int v, int device, cudaStream_t s) {
  return vec ? launch_v<T, true>(p, v, device, s) : launch_v<T, false>(p, v, device, s);
}

// 16-byte loads and stores where every row of x and y starts on a 16-byte boundary.
bool rows_aligned(const fmlp_tensor_t& t, const SoftmaxDesc& d) {
  const int64_t es = int64_t(dtype_size(d.dtype));
  return rows_start_16b(t.data, t.ndim == 2 ? d.rows : 1, t.stride[0] * es);
}

}  // namespace

bool softmax_sm80_ticket_supports(const SoftmaxDesc& d, std::string* why) {
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (!ticket_enabled()) return (*why = "turned off by FMLP_SOFTMAX_TICKET=0", false);
  const int64_t row = d.n * int64_t(dtype_size(d.dtype));
  if (d.rows > kMaxRows)
    return (*why = fmt::format("{} rows: this kernel takes up to {} (one atomic ticket per part "
                               "serialises many rows); softmax_sm90_cluster and "
                               "softmax_sm80_rows take more",
                               d.rows, kMaxRows),
            false);
  if (row < kMinRowBytes)
    return (*why = fmt::format("rows of {} bytes: this kernel takes rows of >= {} bytes; "
                               "softmax_sm80_rows takes shorter ones",
                               row, kMinRowBytes),
            false);
  const Plan pl = plan_for(d);
  if (pl.parts > kMaxParts)
    return (*why = fmt::format("rows of {} bytes: this kernel takes rows of up to {} MB; "
                               "softmax_sm80_rows takes longer ones",
                               row, (kMaxParts * kMaxPartBytes) >> 20),
            false);
  if (d.rows * pl.parts >= (int64_t(1) << 31))
    return (*why = fmt::format("{} rows of {} parts: this kernel takes fewer than 2^31 parts "
                               "in all; softmax_sm80_rows takes more",
                               d.rows, pl.parts),
            false);
  return true;
}

size_t softmax_sm80_ticket_workspace(const SoftmaxDesc& d) {
  return layout_for(d, plan_for(d)).bytes;
}

fmlp_status_t softmax_sm80_ticket_run(const fmlp_softmax_args_t& a, const SoftmaxDesc& d, void* ws,
                                      void* stream) {
  const Plan pl = plan_for(d);
  const Layout l = layout_for(d, pl);
  char* base = static_cast<char*>(ws);
  TicketParams p{};
  p.x = a.x.data;
  p.y = a.y.data;
  p.x_ld = a.x.ndim == 2 ? a.x.stride[0] : 0;
  p.y_ld = a.y.ndim == 2 ? a.y.stride[0] : 0;
  p.n = d.n;
  p.part_len = pl.part_len;
  p.parts = unsigned(pl.parts);
  p.total = unsigned(d.rows * pl.parts);
  p.sc2 = kLog2e / d.temperature;
  p.inv_t = 1.f / d.temperature;
  p.log = d.log;
  p.ticket = reinterpret_cast<unsigned*>(base + l.counters);
  p.slots = reinterpret_cast<float2*>(base + l.slots);
  p.arrived = reinterpret_cast<unsigned*>(base + l.arrived);
  p.done = reinterpret_cast<unsigned*>(base + l.done);
  const bool vec = rows_aligned(a.x, d) && rows_aligned(a.y, d);
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  switch (d.dtype) {
    case FMLP_DTYPE_F16: return launch_t<__half>(p, vec, pl.v, d.device_id, s);
    case FMLP_DTYPE_BF16: return launch_t<__nv_bfloat16>(p, vec, pl.v, d.device_id, s);
    default: return launch_t<float>(p, vec, pl.v, d.device_id, s);
  }
}

}  // namespace fmlp::detail
