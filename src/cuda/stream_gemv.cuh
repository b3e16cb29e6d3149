// The memory-order weight stream shared by linear_sm80_stream (linear_stream.cu) and
// mlp_decode_sm80_stream (mlp_decode_stream.cu): y_row = W_row . x for a few tokens, W read once.
//
// Why this order: at M <= 4 these ops are a read of W, and a plain read of the same bytes
// (bench/hbm_probe.cu: resident blocks reading contiguous pieces in grid-stride order) runs far
// faster than a warp-per-row GEMV that starts every row at once (33.5 MB on an H200: 9.1 us
// against 15.6): the GEMV has a few KB of every row in flight at the same time, scattered over
// all of W, while the probe's requests cover one contiguous window sliding through it. So:
//   - a block iteration (a "group") is R whole consecutive rows; each of the block's 8 warps
//     reads one contiguous run of the group's 16-byte chunks as batches of 4 chunks per lane
//     (2 KB); the resident blocks take consecutive groups, so the bytes in flight stay one
//     window sliding through W,
//   - the partition (stream_shape): a warp keeps one batch in flight, so what a lane leaves idle
//     in a batch is lost from the bytes in flight, and on an H200 those are just enough when
//     full (~4.3 TB/s x ~2 us loaded latency ~ 8.6 MB ~ 528 resident blocks x 8 warps x 2 KB).
//     Session 8's row runs (R a power of two up to 8, each row split over 8 / R warps) leave
//     partial batches where a warp's part of a row is not whole batches, and measure so on an
//     H200 (M = 1, % of the copy floor): rows of 768 bf16 (96 chunks, one batch 75 % used) 73 %,
//     14336 / 18944 (1.75 / 2.3 batches per warp) 86-88 %, whole batches 90-100 %, the moe down
//     stream's rows of 1408 (1.375 batches) ~1.8 TB/s. Flat runs cut the group's R * kc chunks
//     (kc: chunks per row; R any multiple of the rows a finish needs) into whole batches per
//     warp, a run crossing rows where it ends mid-row, so only a warp's last batch of a group
//     may be partial. R (and the kind of run) is the candidate with the fewest batch round trips
//     per warp, ceil(groups / resident blocks) x batches per group, for rows shorter than one
//     batch (the only case where it measured faster: stream_shape): 768 -> 50257 gets R = 32
//     (3 whole batches per warp, 4 rows each: 9 round trips against 12; 29.2 -> 24.4 us).
//     FMLP_STREAM_FLAT=0 keeps session 8's partition everywhere, =2 takes flat runs wherever
//     they fit (stream_flat_mode),
//   - the next batch (of this group or the block's next one) is requested before the current
//     one is used, so every lane has a batch in flight also across groups; the caller issues the
//     first batch (stream_load) before staging x,
//   - x is staged by the caller in shared memory, [MT][k] in XS (the whole K: blocks are
//     resident and loop over groups),
//   - a lane of a flat run keeps one accumulator per row of its run (at most stream_slots) and
//     token; per row, the warps reduce with shuffles and through shared memory, summed in warp
//     order (deterministic), double-buffered by group parity so one __syncthreads per group
//     suffices; then
//     `finish(row, t, sums)` runs for token t and each run of PAIR consecutive rows of the group
//     (threads [0, R / PAIR * MT)), sums[i] the dot product of row + i: PAIR = 2 hands a gated
//     MLP's interleaved gate and up rows to one thread,
//   - fp32 accumulation; fp8 e4m3 chunks (16 weights) are widened exactly to fp16 pairs with
//     cvt.rn.f16x2.e4m3x2 and multiplied with packed fp16 FMAs into one fp16x2 sum per chunk (8
//     products per half) before the fp32 add: widening to fp32 instead costs 16 more conversions
//     per chunk, and conversions bound this loop (4096 -> 14336 at M = 1: 26.8 us against a
//     14.9 us read on an H200). Measured and dropped (session 7): widening with integer ops
//     (an e4m3 byte moved to fp16 bits 15 and 13..7 is w * 2^-8), 31.0 us, and half of each
//     chunk each way, 29.7 us; the fp8 tensor-core mma.sync is no way around it either: sm_90
//     has none, ptxas expands each m16n8k32 .e4m3 into 12 conversions and two fp16 HMMAs. The
//     integer widening remains for devices without the conversion (sm_80 code, which an sm_89
//     device may also run), put in order and scaled back by 2^8 (exact); an e4m3 NaN
//     (s.1111.111) would widen to a finite 1.875 there, so a chunk holding one gives NaN (its
//     magnitude field plus one carries into the sign position). x is staged as fp16 times a
//     power of two per token that puts its largest finite |x| in [8, 16): eight products of
//     |w| <= 448 stay below 8 * 448 * 16 = 57344 < 65504, values below 2^-28 of the largest
//     flush (negligible in the sum), and each chunk's fp16 sum rounds to 11 bits, about 2^-12 of
//     the chunk's magnitude, random across chunks: far below the weights' own e4m3 rounding
//     (2^-4) and within the 2^-7 test tolerance of fp8.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/decode_common.cuh"

namespace fmlp::cuda {

constexpr int kStreamWarps = 8;
constexpr int kStreamThreads = kStreamWarps * 32;
constexpr int kStreamU = 4;                  // 16-byte loads per lane per batch
constexpr int kStreamBatch = 32 * kStreamU;  // chunks per warp batch (2 KB)
using StreamFp8 = unsigned char;             // e4m3 bits

template <typename WT>
constexpr int kStreamPerChunk = 16 / int(sizeof(WT));  // W elements per 16-byte chunk

// The partition of an [n, k] stream (computed on the host by stream_shape below). Positions in a
// group are flat: chunk f of a group is column f % kc of its row f / kc.
struct StreamShape {
  int n, k;
  int kc;        // 16-byte chunks per row
  int rows;      // R: W rows per group
  int flat;      // 1: flat runs (warp w reads [w * cpw, (w + 1) * cpw)); 0: row runs
  int wpr;       // row runs: warps per row, kStreamWarps / R
  int cpw;       // chunks per warp (row runs: of its row; the last warp of a row may have fewer)
  int batches;   // batches per warp and group
  int groups;    // ceil(n / R)
  uint32_t div;  // flat runs: f / kc == umulhi(f, div) for every f of a group (stream_shape)
};

// Rows of a group one warp's flat run may touch, at most (the per-row accumulators a lane keeps
// for them cost registers: 4 tokens of fp32 x already fill 64).
constexpr int stream_slots(int tokens) {
  return tokens <= 1 ? 4 : tokens == 2 ? 2 : 1;
}

// W bytes per group: 16 KB for weights under 16 MiB (few groups per block: a short group keeps
// more blocks busy), 32 KB up to 1 GiB, 64 KB beyond. Measured on an H200 (the session of
// commit 0bcccd9), us at 16 / 32 / 64 KB: 4096x4096 bf16 11.9 / 11.0 / 10.9; 14336x4096
// 32.7 / 31.0 / 32.5; 1024x4096 5.2 / 5.1 / 5.8; 768x3072 4.1 / 4.2 / 4.6; qwen2.5-7b lm head
// 268 / 249 / 245. FMLP_LINEAR_STREAM_KB overrides it for measurements. Row runs use it as is;
// flat runs may take groups up to four times it (stream_shape).
inline int64_t stream_group_bytes(int64_t weight_bytes) {
  static const int env_kb = [] {
    const char* e = std::getenv("FMLP_LINEAR_STREAM_KB");
    const int kb = e ? std::atoi(e) : 0;
    return kb >= 4 && kb <= 256 ? kb : 0;
  }();
  if (env_kb) return int64_t(env_kb) * 1024;
  return weight_bytes < (int64_t(16) << 20)  ? 16 * 1024
         : weight_bytes < (int64_t(1) << 30) ? 32 * 1024
                                             : 64 * 1024;
}

// Row runs of R rows per group: each row split between kStreamWarps / R warps.
inline StreamShape stream_shape_rows(int64_t n, int64_t k, int64_t kc, int rows) {
  StreamShape s{};
  s.n = int(n), s.k = int(k), s.kc = int(kc), s.rows = rows;
  s.wpr = kStreamWarps / rows;
  s.cpw = int((kc + s.wpr - 1) / s.wpr);
  s.batches = (s.cpw + kStreamBatch - 1) / kStreamBatch;
  s.groups = int((n + rows - 1) / rows);
  return s;
}

// Flat runs of R rows per group: the group's R * kc chunks in whole batches per warp.
inline StreamShape stream_shape_flat(int64_t n, int64_t k, int64_t kc, int rows) {
  StreamShape s{};
  s.n = int(n), s.k = int(k), s.kc = int(kc), s.rows = rows, s.flat = 1;
  const int64_t total = int64_t(rows) * kc, span = int64_t(kStreamWarps) * kStreamBatch;
  s.batches = int((total + span - 1) / span);
  s.cpw = s.batches * kStreamBatch;
  s.groups = int((n + rows - 1) / rows);
  s.div = uint32_t((uint64_t(1) << 32) / uint64_t(kc) + 1);  // exact while f * kc < 2^32, kc > 1
  return s;
}

// Rows the widest flat run of `s` touches.
inline int stream_flat_rows(const StreamShape& s) {
  const int64_t total = int64_t(s.rows) * s.kc;
  int most = 0;
  for (int w = 0; w < kStreamWarps; ++w) {
    const int64_t b = std::min<int64_t>(total, int64_t(w) * s.cpw);
    const int64_t e = std::min<int64_t>(total, b + s.cpw);
    if (b < e) most = std::max(most, int((e - 1) / s.kc - b / s.kc + 1));
  }
  return most;
}

// FMLP_STREAM_FLAT (read once): 0 keeps session 8's row runs (an A/B on the GPU), 2 takes flat
// runs wherever they fit (tests: every stream through the flat loop, also at sizes the costing
// leaves to row runs); otherwise stream_shape's choice.
inline int stream_flat_mode() {
  static const int mode = [] {
    const char* e = std::getenv("FMLP_STREAM_FLAT");
    return e && e[0] == '0' ? 0 : e && e[0] == '2' ? 2 : 1;
  }();
  return mode;
}

// The partition of an [n, k] stream of `elem_bytes` weights for blocks of `tokens` staged rows,
// at least `min_rows` rows per group (a power of two up to kStreamWarps that R must be a multiple
// of), `resident` blocks running at once (the grid stream_grid gives).
// Session 8's rule (row runs, R from stream_group_bytes) is the reference; with flat runs on,
// every row-run R and every flat R (multiples of min_rows, groups up to 4x the group bytes, runs
// within stream_slots(tokens) rows) is costed as the batch rounds a warp waits for: each batch
// round trip moves what the warps have in flight, so the time is about
// ceil(groups / resident) * batches. The cheapest wins; the reference unless another is over
// 3 % cheaper (the model leaves out the per-group barrier and reduction: mixtral's up stream,
// 56 -> 55, keeps it); among equals the smaller group (FMLP_STREAM_FLAT=2: the larger, for more
// rows per run).
inline StreamShape stream_shape(int64_t n, int64_t k, int elem_bytes, int min_rows, int tokens,
                                int resident) {
  const int64_t row_bytes = k * elem_bytes, kc = row_bytes / 16;
  const int64_t group = stream_group_bytes(n * row_bytes);
  int rows = 1;
  while (rows < min_rows || (rows < kStreamWarps && row_bytes * rows * 2 <= group)) rows *= 2;
  StreamShape best = stream_shape_rows(n, k, kc, rows);
  const int mode = stream_flat_mode();
  // Measured on an H200 (session 9, FMLP_STREAM_FLAT=0 against the costed choice, M = 1 bf16):
  // the costed choice won only where a row is shorter than one batch (768 -> 50257: 29.2 ->
  // 24.4 us) and lost where it re-partitioned longer rows (14336 -> 4096 34.7 -> 36.8,
  // mistral's 4096 -> 32000 lm head 70.1 -> 85.2, 18944 -> 3584 40.6 -> 49.2, the moe down of
  // hidden 1408 at E = 64 T = 1 67.9 -> 73.4 us): the model leaves out what a group's barrier
  // and reduction cost. So only rows of less than one batch leave the reference.
  if (mode == 0 || kc == 0 || n == 0 || (mode == 1 && kc >= kStreamBatch)) return best;
  const int64_t res = std::max(1, resident);
  auto cost = [&](const StreamShape& s) { return (s.groups + res - 1) / res * s.batches; };
  int64_t best_cost = mode == 2 ? INT64_MAX : cost(best);
  bool reference = mode != 2;
  auto consider = [&](const StreamShape& s) {
    const int64_t c = cost(s);
    const int64_t t = s.rows * int64_t(s.kc), bt = best.rows * int64_t(best.kc);
    const bool better = reference
                            ? c * 100 < best_cost * 97
                            : c < best_cost || (c == best_cost && (mode == 2 ? t > bt : t < bt));
    if (better) best = s, best_cost = c, reference = false;
  };
  for (int r = std::max(1, min_rows); r <= kStreamWarps && mode == 1; r *= 2)
    consider(stream_shape_rows(n, k, kc, r));
  const int slots = stream_slots(tokens), step = std::max(1, min_rows);
  for (int64_t r = step; r <= kStreamWarps * slots && r * row_bytes <= 4 * group &&
                         r < std::max<int64_t>(n, 1) + step;
       r += step) {
    const StreamShape s = stream_shape_flat(n, k, kc, int(r));
    if (kc >= 2 && (int64_t(s.cpw) * kStreamWarps + kStreamBatch) * kc < (int64_t(1) << 32) &&
        stream_flat_rows(s) <= slots)
      consider(s);
  }
  return best;
}

// Blocks of KERNEL (kStreamThreads threads, `smem` dynamic bytes) resident on `device` at once:
// the stream kernels' grid. Asked once per kernel, size and device.
template <typename KERNEL>
int stream_resident_blocks(KERNEL kernel, size_t smem, int device, int sms) {
  using Key = std::tuple<const void*, size_t, int>;
  static std::mutex mu;
  static std::map<Key, int> cache;
  const Key key{reinterpret_cast<const void*>(kernel), smem, device};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int per_sm = 1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kStreamThreads, smem) !=
        cudaSuccess) {
      cudaGetLastError();
      per_sm = 1;
    }
    it = cache.emplace(key, std::max(1, per_sm) * std::max(1, sms)).first;
  }
  return it->second;
}

// The resident grid cut to the fewest blocks that still take every group in the same number of
// rounds: with 7168 groups on 528 resident blocks the last of 14 rounds would run 304 blocks;
// 512 blocks run 14 full rounds, so the bytes in flight stay level to the end.
// FMLP_STREAM_BALANCE=0 keeps the full resident grid.
inline int stream_grid(int groups, int resident) {
  static const bool on = [] {
    const char* e = std::getenv("FMLP_STREAM_BALANCE");
    return !(e && e[0] == '0');
  }();
  if (groups <= resident || !on) return std::min(groups, resident);
  const int rounds = (groups + resident - 1) / resident;
  return (groups + rounds - 1) / rounds;
}

// This warp's run of a group: flat chunks [begin, end), rows r0 .. r0 + slots - 1 of the group
// (slots = 0: an empty run); col0 = begin - r0 * kc (row runs read columns [col0, end - r0 * kc)).
struct StreamSpan {
  int begin, end, r0, slots, col0;
};

// Row f / kc of flat chunk f of a group (flat runs; exact: stream_shape_flat).
__host__ __device__ __forceinline__ int stream_row_of(const StreamShape& s, int f) {
  return int((uint64_t(uint32_t(f)) * s.div) >> 32);
}

// Warp w's run.
__host__ __device__ __forceinline__ StreamSpan stream_span_of(const StreamShape& s, int w) {
  StreamSpan sp;
  if (s.flat) {
    const int total = s.rows * s.kc;
    sp.begin = w * s.cpw < total ? w * s.cpw : total;
    sp.end = sp.begin + s.cpw < total ? sp.begin + s.cpw : total;
    sp.r0 = stream_row_of(s, sp.begin);
    sp.slots = sp.begin < sp.end ? stream_row_of(s, sp.end - 1) - sp.r0 + 1 : 0;
  } else {
    sp.r0 = w / s.wpr;
    const int sub = w % s.wpr, a = sub * s.cpw, b = a + s.cpw;
    sp.begin = sp.r0 * s.kc + (a < s.kc ? a : s.kc);
    sp.end = sp.r0 * s.kc + (b < s.kc ? b : s.kc);
    sp.slots = sp.begin < sp.end ? 1 : 0;
  }
  sp.col0 = sp.begin - sp.r0 * s.kc;
  return sp;
}

// This warp's run.
__device__ __forceinline__ StreamSpan stream_span(const StreamShape& s) {
  return stream_span_of(s, threadIdx.x / 32);
}

// Batch b of this warp's run of group `group`; row_ptr(row) gives W row `row` (< n).
// SKIP: row_ptr may return nullptr for a row that is not read (its sums are zero).
template <typename WT, bool SKIP = false, typename RowPtr>
__device__ __forceinline__ void stream_load(uint4 (&v)[kStreamU], const StreamShape& s,
                                            const StreamSpan& sp, RowPtr row_ptr, int group,
                                            int b) {
  const int lane = threadIdx.x % 32, row0 = group * s.rows;
  const int f0 = sp.begin + b * kStreamBatch + lane;
  if (!s.flat) {  // one row: one row pointer per batch
    const int row = row0 + sp.r0;
    const WT* wr = row_ptr(min(row, s.n - 1));
#pragma unroll
    for (int u = 0; u < kStreamU; ++u) {
      const int f = f0 + u * 32;
      v[u] = row < s.n && (!SKIP || wr != nullptr) && f < sp.end
                 ? ld_stream_v4(wr + int64_t(f - sp.r0 * s.kc) * kStreamPerChunk<WT>)
                 : make_uint4(0, 0, 0, 0);
    }
    return;
  }
#pragma unroll
  for (int u = 0; u < kStreamU; ++u) {
    const int f = f0 + u * 32, r = stream_row_of(s, f), row = row0 + r;
    const WT* wr = row_ptr(min(row, s.n - 1));
    v[u] = row < s.n && (!SKIP || wr != nullptr) && f < sp.end
               ? ld_stream_v4(wr + int64_t(f - r * s.kc) * kStreamPerChunk<WT>)
               : make_uint4(0, 0, 0, 0);
  }
}

// Requests this warp's run of the block's first `groups` groups (from group blockIdx.x, every
// gridDim.x) into L2, one prefetch per 128-byte line, no registers held: a kernel launched
// early (programmatic dependent launch) issues it before it waits for the previous grid, so its
// first groups arrive while that grid drains instead of after.
template <typename WT, typename RowPtr>
__device__ __forceinline__ void stream_prefetch_l2(const StreamShape& s, const StreamSpan& sp,
                                                   RowPtr row_ptr, int groups) {
  const int lane = threadIdx.x % 32;
  int g = blockIdx.x;
  for (int i = 0; i < groups && g < s.groups; ++i, g += gridDim.x) {
    for (int r = sp.r0; r < sp.r0 + sp.slots; ++r) {
      const int row = g * s.rows + r;
      if (row >= s.n) return;
      const char* base = reinterpret_cast<const char*>(row_ptr(row));
      if (base == nullptr) continue;
      const int cb = max(sp.begin, r * s.kc) - r * s.kc,
                ce = min(sp.end, (r + 1) * s.kc) - r * s.kc;
      const uintptr_t first =
          (reinterpret_cast<uintptr_t>(base) + uintptr_t(cb) * 16) & ~uintptr_t(127);
      const uintptr_t end = reinterpret_cast<uintptr_t>(base) + uintptr_t(ce) * 16;
      for (uintptr_t a = first + uintptr_t(lane) * 128; a < end; a += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
    }
  }
}

// The prologue of a stream kernel launched with programmatic dependent launch (launch_ex,
// launch_util.hpp; weights are never written by a kernel of the caller's stream): the first batch
// of group blockIdx.x into `cur` and the block's first `prefetch_groups` groups into L2 are
// requested before the wait for the previous grid, so they arrive while that grid drains;
// everything else the kernel reads or writes comes after it.
template <typename WT, bool SKIP = false, typename RowPtr>
__device__ __forceinline__ void stream_begin(uint4 (&cur)[kStreamU], const StreamShape& s,
                                             const StreamSpan& sp, RowPtr row_ptr,
                                             int prefetch_groups) {
  stream_load<WT, SKIP>(cur, s, sp, row_ptr, blockIdx.x, 0);
  stream_prefetch_l2<WT>(s, sp, row_ptr, prefetch_groups);
  pdl_wait_previous_grid();
  pdl_allow_next_grid();
}

// Eight x values of chunk c of a staged token row as fp32.
template <typename XS>
__device__ __forceinline__ void stream_x8(const XS* xr, int c, float (&f)[8]) {
  if constexpr (std::is_same_v<XS, float>) {
    const float4 a = reinterpret_cast<const float4*>(xr)[2 * c];
    const float4 b = reinterpret_cast<const float4*>(xr)[2 * c + 1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  } else {
    widen8<XS>(reinterpret_cast<const uint4*>(xr)[c], f);
  }
}

// The e4m3 bytes 1 and 3 of `w` as the fp16 pair {w1, w3} * 2^-8 (file comment); `nan` gets bit
// 15 or 31 set when one of them is NaN.
__device__ __forceinline__ uint32_t stream_e4m3_odd(uint32_t w, uint32_t& nan) {
  const uint32_t mag = w & 0x7f007f00u;
  nan |= mag + 0x01000100u;
  return (w & 0x80008000u) | (mag >> 1);
}

// The 16 e4m3 weights of a chunk as 8 fp16 pairs in order ({w0, w1} .. {w14, w15}), exactly;
// false when the chunk holds a NaN and the widening cannot carry it (sm_80 only; the conversion
// turns a NaN into a NaN itself).
__device__ __forceinline__ bool stream_widen_e4m3(const uint4& w, uint32_t (&h)[8]) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
  uint32_t nan = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h[2 * i]) : "h"(uint16_t(ws[i])));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h[2 * i + 1]) : "h"(uint16_t(ws[i] >> 16)));
#else  // integer widening ({w0, w2}, {w1, w3} times 2^-8), put in order, scaled back (exact)
    const uint32_t even = stream_e4m3_odd(ws[i] << 8, nan), odd = stream_e4m3_odd(ws[i], nan);
    uint32_t lo = __byte_perm(even, odd, 0x5410), hi = __byte_perm(even, odd, 0x7632);
    const __half2 k256 = __float2half2_rn(256.f);
    const __half2 l = __hmul2(*reinterpret_cast<const __half2*>(&lo), k256);
    const __half2 u = __hmul2(*reinterpret_cast<const __half2*>(&hi), k256);
    h[2 * i] = *reinterpret_cast<const uint32_t*>(&l);
    h[2 * i + 1] = *reinterpret_cast<const uint32_t*>(&u);
#endif
  }
  return !(nan & 0x80008000u);
}

// The widened chunk h times the 16 staged fp16 x values of chunk c, summed in fp16 pairs, as
// fp32.
__device__ __forceinline__ float stream_dot16_f16(const uint32_t (&h)[8], const __half* xr, int c) {
  const uint4 xa = reinterpret_cast<const uint4*>(xr)[2 * c];
  const uint4 xb = reinterpret_cast<const uint4*>(xr)[2 * c + 1];
  const uint32_t xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
  __half2 acc = __float2half2_rn(0.f);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    acc = __hfma2(*reinterpret_cast<const __half2*>(&h[i]),
                  *reinterpret_cast<const __half2*>(&xv[i]), acc);
  const float2 f = __half22float2(acc);
  return f.x + f.y;
}

// The reduction buffer of stream_run_rows, in shared memory: the warps' sums per row of their run
// and token, double-buffered by group parity, and the rows each warp's run covers.
template <int MT>
struct StreamRed {
  float v[2][kStreamWarps][stream_slots(MT)][MT];
  int lo[kStreamWarps], hi[kStreamWarps];
};

// Row `row`'s staged x: x_rows itself (one x for every row) or x_rows(row).
template <typename XS, typename XRows>
__device__ __forceinline__ const XS* stream_xrow(XRows x_rows, int row) {
  if constexpr (std::is_pointer_v<XRows>)
    return x_rows;
  else
    return x_rows(row);
}

// Chunk c (a column) of row xs's staged tokens times the 16-byte chunk w, one fp32 sum per token
// added to acc (fp8: through fp16 pairs, file comment).
template <typename WT, typename XS, int MT>
__device__ __forceinline__ void stream_chunk(const uint4& w, const XS* xs, int k, int c,
                                             float (&acc)[MT]) {
  if constexpr (std::is_same_v<WT, StreamFp8>) {
    uint32_t h[8];
    const bool finite = stream_widen_e4m3(w, h);
#pragma unroll
    for (int t = 0; t < MT; ++t)
      acc[t] += finite ? stream_dot16_f16(h, xs + int64_t(t) * k, c) : __int_as_float(0x7fffffff);
  } else {
    float wf[8];
    widen8<WT>(w, wf);
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      float xf[8];
      stream_x8<XS>(xs + int64_t(t) * k, c, xf);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t] = fmaf(wf[e], xf[e], acc[t]);
    }
  }
}

// The stream itself, from group blockIdx.x on (< s.groups) with `cur` holding its first batch
// (stream_load<WT, SKIP>(cur, s, sp, row_ptr, blockIdx.x, 0)) and x staged; every thread of the
// block calls it. x_rows is the staged x ([MT][k]) of every row, or a functor whose x_rows(row)
// gives row `row`'s own (the moe stream's slots each have theirs). PAIR divides R.
// Row runs accumulate each lane's chunks in one chain per token (session 8's loop); flat runs
// sum each chunk on its own and add it to the accumulator of its row (one per row of the run and
// token, chosen by unrolled compares: no local memory). Then, per row of the run, a warp sum into
// red; finish adds the warps' sums of a row in warp order: deterministic.
template <typename WT, typename XS, int MT, int PAIR = 1, bool SKIP = false, typename XRows,
          typename RowPtr, typename Finish>
__device__ __forceinline__ void stream_run_rows(const StreamShape& s, const StreamSpan& sp,
                                                XRows x_rows, RowPtr row_ptr, Finish finish,
                                                uint4 (&cur)[kStreamU], StreamRed<MT>& red) {
  constexpr int kSlots = stream_slots(MT);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) red.lo[warp] = sp.r0, red.hi[warp] = sp.r0 + sp.slots - 1;
  float acc[kSlots][MT] = {};
  int parity = 0;
  for (int g = blockIdx.x; g < s.groups; g += gridDim.x) {
    const int row0 = g * s.rows;
    const XS* xg = stream_xrow<XS>(x_rows, min(row0 + sp.r0, s.n - 1));
    for (int b = 0; b < s.batches; ++b) {
      const bool last = b + 1 == s.batches;
      const int gn = last ? g + int(gridDim.x) : g, bn = last ? 0 : b + 1;
      uint4 nxt[kStreamU];
      if (gn < s.groups) stream_load<WT, SKIP>(nxt, s, sp, row_ptr, gn, bn);
      const int f0 = sp.begin + b * kStreamBatch + lane;
      if (kSlots == 1 || !s.flat) {
#pragma unroll
        for (int u = 0; u < kStreamU; ++u) {
          const int f = f0 + u * 32;
          if (f < sp.end)
            stream_chunk<WT, XS, MT>(cur[u], xg, s.k, sp.col0 + (f - sp.begin), acc[0]);
        }
      } else {
#pragma unroll
        for (int u = 0; u < kStreamU; ++u) {
          const int f = f0 + u * 32;
          if (f >= sp.end) continue;
          const int r = stream_row_of(s, f), slot = r - sp.r0;
          float d[MT] = {};
          stream_chunk<WT, XS, MT>(cur[u], stream_xrow<XS>(x_rows, min(row0 + r, s.n - 1)), s.k,
                                   f - r * s.kc, d);
#pragma unroll
          for (int j = 0; j < kSlots; ++j)
#pragma unroll
            for (int t = 0; t < MT; ++t)
              if (slot == j) acc[j][t] += d[t];
        }
      }
#pragma unroll
      for (int u = 0; u < kStreamU; ++u) cur[u] = nxt[u];
    }
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      if (j >= sp.slots) break;  // warp-uniform
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const float v = warp_sum(acc[j][t]);
        if (lane == 0) red.v[parity][warp][j][t] = v;
        acc[j][t] = 0.f;
      }
    }
    __syncthreads();
    // R <= kStreamWarps * stream_slots(MT) (stream_shape), so R / PAIR * MT <= 32 threads.
    if (threadIdx.x < s.rows / PAIR * MT) {
      const int r = threadIdx.x / MT * PAIR, t = threadIdx.x % MT;
      const int row = row0 + r;
      if (row < s.n) {
        float v[PAIR];
#pragma unroll
        for (int q = 0; q < PAIR; ++q) v[q] = 0.f;
#pragma unroll 1
        for (int w = 0; w < kStreamWarps; ++w) {
          const int lo = red.lo[w], hi = red.hi[w];
#pragma unroll
          for (int q = 0; q < PAIR; ++q)
            if (lo <= r + q && r + q <= hi) v[q] += red.v[parity][w][r + q - lo][t];
        }
        finish(row, t, v);
      }
    }
    parity ^= 1;
  }
}

// stream_run_rows with one staged x ([MT][k] at xs) for every row.
template <typename WT, typename XS, int MT, int PAIR = 1, typename RowPtr, typename Finish>
__device__ __forceinline__ void stream_run(const StreamShape& s, const StreamSpan& sp, const XS* xs,
                                           RowPtr row_ptr, Finish finish, uint4 (&cur)[kStreamU],
                                           StreamRed<MT>& red) {
  stream_run_rows<WT, XS, MT, PAIR>(s, sp, xs, row_ptr, finish, cur, red);
}

}  // namespace fmlp::cuda
