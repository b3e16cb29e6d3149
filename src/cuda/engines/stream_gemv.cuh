// The memory-order weight stream shared by linear_sm80_stream (linear/sm80_stream.cu) and
// mlp_decode_sm80_stream (mlp/decode_sm80_stream.cu): y_row = W_row . x for a few tokens, W read
// once.
//
// Why this order: at M <= 4 these ops are a read of W, and a plain read of the same bytes
// (bench/hbm_probe.cu: resident blocks reading contiguous pieces in grid-stride order) runs far
// faster than a warp-per-row GEMV that starts every row at once (bench/results/hbm_probe_h200.json
// against linear_sm80_gemv on the same bytes): the GEMV has a few KB of every row in flight at
// the same time, scattered over all of W, while the probe's requests cover one contiguous window
// sliding through it. So:
//   - a block iteration (a "group") is R whole consecutive rows, about stream_group_bytes() of
//     W (R a power of two up to 8); its rows are split between the block's 8 warps (8 / R per
//     row, each a contiguous run of the row's 16-byte chunks, read as batches of U chunks per
//     lane: 4, or 3 where the launcher picks it to fit the run, stream_pick_loads); the resident
//     blocks take consecutive groups, so the bytes in flight stay one window sliding through W,
//   - the next batch (of this group or the block's next one) is requested into the second of two
//     register buffers, which swap roles, before the current one is used: every lane keeps two
//     batches in flight, also across groups; the caller issues the first batch (stream_load)
//     before staging x,
//   - x is staged by the caller in shared memory, [MT][k] in XS (the whole K: blocks are
//     resident and loop over groups),
//   - a row's warps reduce with shuffles and through shared memory in warp order (deterministic),
//     double-buffered by group parity so one __syncthreads per group suffices; then
//     `finish(row, t, sums)` runs for token t and each run of PAIR consecutive rows of the group
//     (threads [0, R / PAIR * MT)), sums[i] the dot product of row + i: PAIR = 2 hands a gated
//     MLP's interleaved gate and up rows to one thread; where a warp holds whole rows (R = 8,
//     one warp per row) and PAIR = 1, its lanes finish the row themselves and the group needs
//     no barrier at all (rows of up to 1-2 KB: the K = 768 lm heads, gpt2's up stream),
//   - fp32 accumulation; fp8 e4m3 chunks (16 weights) are widened exactly to fp16 pairs with
//     cvt.rn.f16x2.e4m3x2 and multiplied with packed fp16 FMAs into one fp16x2 sum per chunk (8
//     products per half) before the fp32 add: widening to fp32 instead costs 16 more conversions
//     per chunk, which the fp8 4096 -> 14336 linear at M = 1 shows against its pure read time
//     (fusedmlp_ops_bench --only linear; bench/results/linear_fp8_h200.json). Measured and
//     dropped, both slower than the fp16-pair FMAs: widening with integer ops (an e4m3 byte moved
//     to fp16 bits 15 and 13..7 is w * 2^-8), and half of each chunk each way; the fp8
//     tensor-core mma.sync is no way around it either: sm_90
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
#include <type_traits>

#include "cuda/common/common.cuh"
#include "cuda/common/decode_common.cuh"
#include "cuda/common/launch_util.hpp"

namespace fmlp::cuda {

constexpr int kStreamWarps = 8;
constexpr int kStreamThreads = kStreamWarps * 32;
constexpr int kStreamU = 4;       // 16-byte loads per lane per batch, unless the launcher picks U
using StreamFp8 = unsigned char;  // e4m3 bits

template <typename WT>
constexpr int kStreamPerChunk = 16 / int(sizeof(WT));  // W elements per 16-byte chunk

// The partition of an [n, k] stream (computed on the host by stream_shape below).
struct StreamShape {
  int n, k;
  int rows;     // R: W rows per group
  int wpr;      // warps per row: kStreamWarps / R
  int cpw;      // 16-byte chunks of a row per warp (the last warp of a row may have fewer)
  int u;        // 16-byte loads per lane and batch: the kernel's U (a batch is 32 * u chunks)
  int batches;  // batches per warp and group
  int groups;   // ceil(n / R)
  // Bytes of W in a row's last chunk when the rows stop inside it (1..15; 0: whole chunks). k is
  // then the row's width rounded up to whole chunks and the caller stages x with zeros past the
  // real width; stream_load reads only the row's own bytes of that chunk and zeros the rest, so
  // neither whatever lies past a row (a padded stride's bytes, NaN included) nor the end of the
  // last row's allocation is touched.
  int tail;
};

// W bytes per group of an [n, row_bytes] stream read for `tokens` tokens. 16-bit rows: 16 KB for
// weights under 16 MiB (few groups per block: a short group keeps more blocks busy), 32 KB up to
// 1 GiB, 64 KB beyond: the size that was fastest per weight size among 16 / 32 / 64 KB (larger
// groups leave blocks idle on small streams, smaller ones pay the per-group overhead on large).
// fp8 rows (elem_bytes 1) where eight fit in 128 KB, at one token or up to 4 KB a row: a row per
// warp (kStreamWarps rows a group), so a warp reads its row in full batches and no block barrier
// combines parts of it; that beat the byte-sized groups above for fp8 at one token, not for 14 KB
// rows at two tokens, and 16-bit rows were slower in bigger groups. To measure a size:
// FMLP_LINEAR_STREAM_KB=k (4..256) forces k KB groups, e.g. with fusedmlp_ops_bench --only
// linear and fusedmlp_cuda_bench --ms 1,2 (bench/ab_device.sh -e runs both settings in one call).
inline int64_t stream_group_bytes(int64_t n, int64_t row_bytes, int elem_bytes, int64_t tokens) {
  static const int env_kb =
      int(fmlp::detail::knob_int_or<fmlp::detail::Knob::FMLP_LINEAR_STREAM_KB>(0));
  if (env_kb) return int64_t(env_kb) * 1024;
  if (elem_bytes == 1 && row_bytes * kStreamWarps <= (int64_t(128) << 10) &&
      (tokens <= 1 || row_bytes <= 4096))
    return row_bytes * kStreamWarps;
  const int64_t weight_bytes = n * row_bytes;
  return weight_bytes < (int64_t(16) << 20)  ? 16 * 1024
         : weight_bytes < (int64_t(1) << 30) ? 32 * 1024
                                             : 64 * 1024;
}

// Batches of U 16-byte loads a lane that take a warp's cpw chunks.
inline int stream_batches(int cpw, int u) {
  return (cpw + 32 * u - 1) / (32 * u);
}

// U loads per lane for shape s, and the batches that follow from it.
inline void stream_set_loads(StreamShape& s, int u) {
  s.u = u;
  s.batches = stream_batches(s.cpw, u);
}

// The partition of an [n, k] stream of `elem_bytes` weights at exactly `rows` rows per group (a
// power of two up to kStreamWarps).
inline StreamShape stream_shape_rows(int64_t n, int64_t k, int elem_bytes, int rows) {
  StreamShape s{};
  s.n = int(n);
  s.k = int(k);
  s.rows = rows;
  s.wpr = kStreamWarps / s.rows;
  const int64_t kchunks = k * elem_bytes / 16;
  s.cpw = int((kchunks + s.wpr - 1) / s.wpr);
  stream_set_loads(s, kStreamU);
  s.groups = int((n + s.rows - 1) / s.rows);
  return s;
}

// The partition of an [n, k] stream of `elem_bytes` weights read for `tokens` tokens, at least
// `min_rows` rows per group (a power of two up to kStreamWarps).
inline StreamShape stream_shape(int64_t n, int64_t k, int elem_bytes, int64_t tokens,
                                int min_rows = 1) {
  const int64_t row_bytes = k * elem_bytes;
  const int64_t group = stream_group_bytes(n, row_bytes, elem_bytes, tokens);
  int rows = 1;
  while (rows < min_rows || (rows < kStreamWarps && row_bytes * rows * 2 <= group)) rows *= 2;
  return stream_shape_rows(n, k, elem_bytes, rows);
}

// Loads per lane (U) for a kernel instantiated for U = 3 and 4: 3 where it reads a warp's part
// of a row in as many batches as 4 with fewer idle lanes and the stream is at least 16 MiB. A
// batch costs about one memory latency however many of its lanes load: K = 768 bf16 rows are 96
// chunks, 75 % of a U = 4 batch (U = 3 is faster on the 50257 x 768 lm head). Measured slower
// and not taken: 3 where it adds a batch (4096 x 4096), 3 on small streams (768 -> 2304), and 7
// (one 224-chunk batch for the 224-chunk parts of K = 14336 rows: 4096 x 14336, at three blocks
// per SM). FMLP_STREAM_U=3|4 forces one (fusedmlp_ops_bench --only linear).
inline void stream_pick_loads(StreamShape& s, int64_t stream_bytes) {
  static const int env_u = int(fmlp::detail::knob_int_or<fmlp::detail::Knob::FMLP_STREAM_U>(0));
  auto batches = [&](int u) { return stream_batches(s.cpw, u); };
  const bool three = stream_bytes >= (int64_t(16) << 20) && batches(3) == batches(4) &&
                     batches(3) * 96 < batches(4) * 128;
  stream_set_loads(s, env_u ? env_u : three ? 3 : 4);
}

// launch(std::integral_constant<int, U>{}) for the shape's U: the one place that maps the picked
// loads per lane to a kernel instantiation.
template <typename Launch>
auto stream_dispatch_u(const StreamShape& s, Launch launch) {
  return s.u == 3 ? launch(std::integral_constant<int, 3>{})
                  : launch(std::integral_constant<int, 4>{});
}

// Blocks of KERNEL (kStreamThreads threads, `smem` dynamic bytes) resident on `device` at once:
// the stream kernels' grid.
template <typename KERNEL>
int stream_resident_blocks(KERNEL kernel, size_t smem, int device, int sms) {
  return fmlp::detail::blocks_per_sm(kernel, kStreamThreads, smem, device) * std::max(1, sms);
}

// The resident grid cut to the fewest blocks that still take every group in the same number of
// rounds: with 7168 groups on 528 resident blocks the last of 14 rounds would run 304 blocks;
// 512 blocks run 14 full rounds, so the bytes in flight stay level to the end.
// FMLP_STREAM_BALANCE=0 keeps the full resident grid.
inline int stream_grid(int groups, int resident) {
  static const bool on = fmlp::detail::knob_bool<fmlp::detail::Knob::FMLP_STREAM_BALANCE>();
  if (groups <= resident || !on) return std::min(groups, resident);
  const int rounds = (groups + resident - 1) / resident;
  return (groups + rounds - 1) / rounds;
}

// This warp's part of a row: chunks [begin, end) of row `row` of every group. The division by
// the runtime wpr happens here once: in the batch's address arithmetic it cost ~25 instructions
// per batch (an integer division is a reciprocal and two corrections).
struct StreamSpan {
  int begin, end;
  int row;
};

template <typename WT>
__device__ __forceinline__ StreamSpan stream_span(const StreamShape& s) {
  const int warp = threadIdx.x / 32;
  const int kchunks = s.k / kStreamPerChunk<WT>;
  const int b = warp % s.wpr * s.cpw;
  return {b, min(kchunks, b + s.cpw), warp / s.wpr};
}

// Batch b of this warp's part of group `group`'s row; row_ptr(row) gives W row `row` (< n).
// SKIP: row_ptr may return nullptr for a row that is not read (its sums are zero). A row's last
// chunk is read by ld_stream_tail where s.tail says the row ends inside it.
template <typename WT, bool SKIP = false, typename RowPtr, int U>
__device__ __forceinline__ void stream_load(uint4 (&v)[U], const StreamShape& s, StreamSpan sp,
                                            RowPtr row_ptr, int group, int b) {
  const int row = group * s.rows + sp.row;
  const WT* wr = row_ptr(min(row, s.n - 1));
  const int lane = threadIdx.x % 32;
  const bool row_in = row < s.n && (!SKIP || wr != nullptr);
  const int tail_c = s.tail ? s.k / kStreamPerChunk<WT> - 1 : -1;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = sp.begin + (b * U + u) * 32 + lane;
    v[u] = row_in && c < sp.end && c != tail_c ? ld_stream_v4(wr + int64_t(c) * kStreamPerChunk<WT>)
                                               : make_uint4(0, 0, 0, 0);
  }
  // The partial chunk apart, behind a branch uniform over the grid: streams of whole-chunk rows
  // keep one predicated load per chunk.
  if (s.tail) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = sp.begin + (b * U + u) * 32 + lane;
      if (row_in && c < sp.end && c == tail_c)
        v[u] = ld_stream_tail(wr + int64_t(c) * kStreamPerChunk<WT>, s.tail);
    }
  }
}

// Requests 16-byte chunks [c0, c1) of the row at `row` into L2, one prefetch per 128-byte line,
// the warp's lanes taking every 32nd line; no registers held.
template <typename WT>
__device__ __forceinline__ void stream_prefetch_chunks_l2(const WT* row, int c0, int c1) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(row);
  const uintptr_t first = (base + uintptr_t(c0) * 16) & ~uintptr_t(127);
  const uintptr_t end = base + uintptr_t(c1) * 16;
  for (uintptr_t a = first + uintptr_t(threadIdx.x % 32) * 128; a < end; a += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
}

// Requests this warp's part of the block's first `groups` groups (from group blockIdx.x, every
// gridDim.x) into L2: a kernel launched early (programmatic dependent launch) issues it before it
// waits for the previous grid, so its first groups arrive while that grid drains instead of after.
template <typename WT, typename RowPtr>
__device__ __forceinline__ void stream_prefetch_l2(const StreamShape& s, StreamSpan sp,
                                                   RowPtr row_ptr, int groups) {
  int g = blockIdx.x;
  for (int i = 0; i < groups && g < s.groups; ++i, g += gridDim.x) {
    const int row = g * s.rows + sp.row;
    if (row >= s.n || sp.begin >= sp.end) return;
    stream_prefetch_chunks_l2(row_ptr(row), sp.begin, sp.end);
  }
}

// Requests batches 1 .. `batches` of this warp's part of group blockIdx.x into L2: where the
// stream waits behind a long staging, HBM keeps reading them while only the first batch is in
// registers.
template <typename WT, typename RowPtr>
__device__ __forceinline__ void stream_prefetch_batches_l2(const StreamShape& s, StreamSpan sp,
                                                           RowPtr row_ptr, int batches) {
  const int row = int(blockIdx.x) * s.rows + sp.row;
  if (batches <= 0 || row >= s.n) return;
  const int width = 32 * s.u;  // chunks per batch
  const int c0 = sp.begin + width, c1 = min(sp.end, sp.begin + width * (1 + batches));
  if (c0 < c1) stream_prefetch_chunks_l2(row_ptr(row), c0, c1);
}

// The prologue of a stream kernel launched with programmatic dependent launch (launch_ex,
// common/launch_util.hpp; weights are never written by a kernel of the caller's stream): the first
// batch of group blockIdx.x into `cur`, the block's first `prefetch_groups` groups into L2 and the
// next `prefetch_batches` batches of its first group into L2 are requested before the wait for the
// previous grid, so they arrive while that grid drains; everything else the kernel reads or
// writes comes after it.
template <typename WT, bool SKIP = false, typename RowPtr, int U>
__device__ __forceinline__ void stream_begin(uint4 (&cur)[U], const StreamShape& s, StreamSpan sp,
                                             RowPtr row_ptr, int prefetch_groups,
                                             int prefetch_batches = 0) {
  stream_load<WT, SKIP>(cur, s, sp, row_ptr, blockIdx.x, 0);
  stream_prefetch_l2<WT>(s, sp, row_ptr, prefetch_groups);
  stream_prefetch_batches_l2<WT>(s, sp, row_ptr, prefetch_batches);
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

// acc += a chunk's 8 weights (widened, wf) times x's values of chunk c (a staged row, XS), in
// order.
template <typename XS>
__device__ __forceinline__ void stream_fma_x8(float& acc, const float (&wf)[8], const XS* xr,
                                              int c) {
  float xf[8];
  stream_x8<XS>(xr, c, xf);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc = fmaf(wf[e], xf[e], acc);
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
    // The halves split inside the asm, so ptxas reads the upper one in place (R.H1) instead of
    // shifting it down first: one instruction fewer per pair.
    asm("{ .reg .b16 lo, hi;\n\t"
        "mov.b32 {lo, hi}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, lo;\n\t"
        "cvt.rn.f16x2.e4m3x2 %1, hi; }"
        : "=r"(h[2 * i]), "=r"(h[2 * i + 1])
        : "r"(ws[i]));
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

// The 16-byte piece of staged fp16 x holding half `half` (x values 8 * half .. + 7) of fp8
// chunk c. Consecutive lanes read consecutive chunks, 32 bytes apart: in order, the 8 lanes of a
// quarter-warp would hit every bank twice per load. Chunks 4..7 of every 8 keep their halves
// swapped, so each load's 8 pieces fall in 8 different 16-byte bank groups.
__device__ __forceinline__ int stream_f16_piece(int c, int half) {
  return 2 * c + (half ^ ((c >> 2) & 1));
}

// The widened chunk h times its 16 staged fp16 x values (xa: piece 0, xb: piece 1 of
// stream_f16_piece), summed in fp16 pairs, as fp32.
__device__ __forceinline__ float stream_dot16_f16(const uint32_t (&h)[8], const uint4& xa,
                                                  const uint4& xb) {
  const uint32_t xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
  __half2 acc = __float2half2_rn(0.f);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    acc = __hfma2(*reinterpret_cast<const __half2*>(&h[i]),
                  *reinterpret_cast<const __half2*>(&xv[i]), acc);
  const float2 f = __half22float2(acc);
  return f.x + f.y;
}

// The largest of `mx` and the finite |v| of eight 16-bit values of AT: NaN and Inf stay out of
// the power of two (they are staged unscaled).
template <typename AT>
__device__ __forceinline__ float stream_finite_amax8(const uint4& in, float mx) {
  float f[8];
  widen8<AT>(in, f);
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (fabsf(f[j]) <= 3.4e38f) mx = fmaxf(mx, fabsf(f[j]));
  return mx;
}

// Eight 16-bit values of AT times `mul` (a power of two: exact unless it leaves fp16's range) as
// fp16.
template <typename AT>
__device__ __forceinline__ uint4 stream_f16_times(const uint4& in, float mul) {
  float f[8];
  widen8<AT>(in, f);
  uint32_t h[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __half2 pair = __floats2half2_rn(f[2 * j] * mul, f[2 * j + 1] * mul);
    h[j] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(h[0], h[1], h[2], h[3]);
}

// For fp8 weights: the staged token rows xs [MT][k] (16-bit values of x's dtype AT, k a multiple
// of 16) become, in place, fp16 times a power of two per token that puts the token's largest
// finite |x| in [8, 16) (file comment), each chunk's halves in stream_f16_piece order; inv[t]
// gets the factor that undoes it. Each thread reads and rewrites the same 32-byte chunks, one
// loop per token (no division by k). Every thread of the block calls it once the rows are staged
// and visible; it ends with a barrier. stream_stage_f16_scaled below does the same from global
// memory without the staged raw rows.
template <typename AT, int MT>
__device__ void stream_f16_scaled_from(__half* xs, int k, float* inv, unsigned* amax) {
  const int vecs = k / 8;
  if (threadIdx.x < MT) amax[threadIdx.x] = 0;
  __syncthreads();
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    float mx = 0.f;
    for (int c = threadIdx.x; c < vecs; c += kStreamThreads)
      mx = stream_finite_amax8<AT>(reinterpret_cast<const uint4*>(xs + int64_t(t) * k)[c], mx);
    mx = warp_max(mx);
    if (threadIdx.x % 32 == 0) atomicMax(amax + t, __float_as_uint(mx));
  }
  __syncthreads();
  if (threadIdx.x < MT) inv[threadIdx.x] = ldexpf(1.f, -pow2_shift_to(amax[threadIdx.x], 4));
  __syncthreads();
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const float mul = 1.f / inv[t];  // a power of two: v * mul is v / inv[t] exactly
    uint4* row = reinterpret_cast<uint4*>(xs + int64_t(t) * k);
    for (int c = threadIdx.x; c < vecs / 2; c += kStreamThreads) {
      const uint4 in[2] = {row[2 * c], row[2 * c + 1]};
#pragma unroll
      for (int half = 0; half < 2; ++half)
        row[stream_f16_piece(c, half)] = stream_f16_times<AT>(in[half], mul);
    }
  }
  __syncthreads();
}

// Copies m token rows of `vecs` 16-byte pieces each (row t at src + t * src_ld pieces) to dst as
// one [m][vecs] block. The rows' pieces are one token-major sequence with four loads a thread in
// flight per round: a loop per row costs a memory latency per token, and a plain copy loop left
// ptxas a serial remainder (one latency per piece; both seen under ncu at gpt2-small M = 4, where
// staging took about half of the 16-bit MLP stream's up and down kernels). MT: the most rows (1:
// no division). L2_ONLY as in stream_stage_f16_scaled. No barrier at the end.
// The same token-major rounds in stream_stage_f16_scaled's two passes made the fp8 streams at
// M = 2..4 slower (a division and a token select per load; fusedmlp_cuda_bench --wdtype f8
// --ms 2,4): they keep a loop per token.
template <int MT, bool L2_ONLY>
__device__ __forceinline__ void stream_copy_rows(uint4* dst, const uint4* src, int64_t src_ld,
                                                 int m, int vecs) {
  constexpr int kRound = 4;
  const int total = m * vecs;
  for (int q0 = threadIdx.x; q0 < total; q0 += kRound * kStreamThreads) {
    uint4 v[kRound];
#pragma unroll
    for (int j = 0; j < kRound; ++j) {
      const int q = q0 + j * kStreamThreads;
      const int t = MT == 1 ? 0 : q / vecs;
      const uint4* a = src + int64_t(t) * src_ld + (q - t * vecs);
      if constexpr (L2_ONLY)
        v[j] = q < total ? __ldcg(a) : make_uint4(0, 0, 0, 0);
      else
        v[j] = q < total ? *a : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kRound; ++j)
      if (q0 + j * kStreamThreads < total) dst[q0 + j * kStreamThreads] = v[j];
  }
}

// stream_f16_scaled_from's result straight from token rows of 16-bit x in global memory (rows m
// .. MT - 1 zero): x at `x` (16-byte aligned, row stride x_ld elements a multiple of 8), k a
// multiple of 16. One pass of batched loads takes each token's largest finite |x|, unless the
// producer of x took it (`amax_given`: [m] float bits, read after the previous grid's wait), a
// second loads x again and stores it scaled, in stream_f16_piece order. Staging the raw rows and
// then scanning and rewriting them moved each block's x through shared memory four times, with
// the stream's first batch waiting behind it. L2_ONLY: x was written by the previous grid; read
// it from L2, as the MLP down kernel always has (through L1 measured no faster, and would rest
// on the wait's visibility guarantee reaching lines an earlier call left in L1). `wmax`
// is [kStreamWarps][MT] shared floats, free until the end barrier; inv[t] as in
// stream_f16_scaled_from. The two passes' batched loads are written out: one loader shared with
// them and linear/sm80_stream.cu's stage_x changed how ptxas scheduled the fp8 instances and ran
// them slower (fusedmlp_ops_bench --only linear, fp8 rows; scripts/sass.sh shows the schedule).
template <typename AT, int MT, bool L2_ONLY>
__device__ void stream_stage_f16_scaled(__half* xs, const AT* x, int64_t x_ld, int m, int k,
                                        const unsigned* amax_given, float (*wmax)[MT], float* inv) {
  constexpr int kRound = 4;  // 16-byte loads a thread requests before it uses any
  const int vecs = k / 8;
  auto load = [](const uint4* src) {
    if constexpr (L2_ONLY) return __ldcg(src);
    return *src;
  };
  if (amax_given == nullptr) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      float mx = 0.f;
      if (t < m) {
        const uint4* src = reinterpret_cast<const uint4*>(x + int64_t(t) * x_ld);
        for (int i0 = threadIdx.x; i0 < vecs; i0 += kRound * kStreamThreads) {
          uint4 v[kRound];
#pragma unroll
          for (int j = 0; j < kRound; ++j) {
            const int i = i0 + j * kStreamThreads;
            v[j] = i < vecs ? load(src + i) : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int j = 0; j < kRound; ++j) mx = stream_finite_amax8<AT>(v[j], mx);
        }
      }
      mx = warp_max(mx);
      if (threadIdx.x % 32 == 0) wmax[threadIdx.x / 32][t] = mx;
    }
    __syncthreads();
  }
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    uint4* dst = reinterpret_cast<uint4*>(xs + int64_t(t) * k);
    if (t >= m) {
      for (int i = threadIdx.x; i < vecs; i += kStreamThreads) dst[i] = make_uint4(0, 0, 0, 0);
      if (threadIdx.x == t) inv[t] = 1.f;
      continue;
    }
    float a = 0.f;
    if (amax_given) {
      a = __uint_as_float(__ldcg(amax_given + t));
    } else {
#pragma unroll
      for (int w = 0; w < kStreamWarps; ++w) a = fmaxf(a, wmax[w][t]);
    }
    const int shift = pow2_shift_to(__float_as_uint(a), 4);
    const float mul = ldexpf(1.f, shift);
    if (threadIdx.x == t) inv[t] = ldexpf(1.f, -shift);
    const uint4* src = reinterpret_cast<const uint4*>(x + int64_t(t) * x_ld);
    for (int i0 = threadIdx.x; i0 < vecs; i0 += kRound * kStreamThreads) {
      uint4 v[kRound];
#pragma unroll
      for (int j = 0; j < kRound; ++j) {
        const int i = i0 + j * kStreamThreads;
        v[j] = i < vecs ? load(src + i) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < kRound; ++j) {
        const int i = i0 + j * kStreamThreads;
        if (i < vecs) dst[stream_f16_piece(i >> 1, i & 1)] = stream_f16_times<AT>(v[j], mul);
      }
    }
  }
  __syncthreads();
}

// stream_f16_scaled_from for x's dtype at run time (fp16 when `f16`, else bf16): the fp8 kernels
// have one instance for both.
template <int MT>
__device__ void stream_f16_scaled(__half* xs, int k, bool f16, float* inv, unsigned* amax) {
  if (f16)
    stream_f16_scaled_from<__half, MT>(xs, k, inv, amax);
  else
    stream_f16_scaled_from<__nv_bfloat16, MT>(xs, k, inv, amax);
}

// The stream itself, from group blockIdx.x on (< s.groups) with `cur` holding its first batch
// (stream_load<WT, SKIP>(cur, s, sp, row_ptr, blockIdx.x, 0)) and x staged; every thread of the
// block calls it. x_rows is the staged x ([MT][k]) of every row, or a functor whose x_rows(row)
// gives row `row`'s own (the moe stream's slots each have theirs). `red` is [2][kStreamWarps][MT]
// shared floats. PAIR divides R.
// `fetch(row, t)` runs in the thread that will call finish(row, t, ...), one group before that
// finish (for the block's first group: before the stream starts), so the epilogue can have its own
// operands (bias, scales) loaded while the weights stream (linear/sm80_stream.cu says where that
// was measured to pay).
struct StreamNoFetch {
  __device__ void operator()(int, int) const {}
};

template <typename WT, typename XS, int MT, int PAIR = 1, bool SKIP = false, typename XRows,
          typename RowPtr, typename Finish, int U, typename Fetch = StreamNoFetch>
__device__ __forceinline__ void stream_run_rows(const StreamShape& s, StreamSpan sp, XRows x_rows,
                                                RowPtr row_ptr, Finish finish, uint4 (&cur)[U],
                                                float (*red)[kStreamWarps][MT], Fetch fetch = {}) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The row this thread finishes in each group is its first one plus gridDim.x groups a step.
  const bool whole_rows = PAIR == 1 && s.wpr == 1;
  const bool finisher = whole_rows ? lane < MT : int(threadIdx.x) < s.rows / PAIR * MT;
  const int row_step = int(gridDim.x) * s.rows;
  if (finisher) {
    const int r = whole_rows ? warp : int(threadIdx.x) / MT * PAIR;
    const int t = whole_rows ? lane : int(threadIdx.x) % MT;
    if (int(blockIdx.x) * s.rows + r < s.n) fetch(int(blockIdx.x) * s.rows + r, t);
  }
  float acc[MT] = {};
  int parity = 0;
  // The half-swap bit of stream_f16_piece for every chunk this lane reads (c moves in steps of
  // 32, a multiple of 8).
  const int swz = ((sp.begin + lane) >> 2) & 1;
  uint4 alt[U];
  bool flip = false;  // false: cur holds the batch to use and alt receives the next; true: swapped
  for (int g = blockIdx.x; g < s.groups; g += gridDim.x) {
    const XS* xs;
    if constexpr (std::is_pointer_v<XRows>)
      xs = x_rows;
    else
      xs = x_rows(min(g * s.rows + sp.row, s.n - 1));
    // Requests batch bn of group gn into `fill`, then adds batch b of this group (in `use`).
    auto batch = [&](const uint4(&use)[U], uint4(&fill)[U], int b, int gn, int bn) {
      if (gn < s.groups) stream_load<WT, SKIP>(fill, s, sp, row_ptr, gn, bn);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = sp.begin + (b * U + u) * 32 + lane;
        if (c >= sp.end) continue;
        if constexpr (std::is_same_v<WT, StreamFp8>) {
          uint32_t h[8];
          const bool finite = stream_widen_e4m3(use[u], h);
          // Chunk c's staged x pieces are 2c + swz and 2c + (swz ^ 1) (stream_f16_piece): so
          // written, a batch's chunks share one address and differ by constants (ncu: the
          // swizzle worked out per chunk was a sixth of the fp8 loop's instructions).
          const uint4* xc = reinterpret_cast<const uint4*>(xs) + 2 * c;
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            const uint4* xt = xc + int64_t(t) * (s.k / 8);
            acc[t] +=
                finite ? stream_dot16_f16(h, xt[swz], xt[swz ^ 1]) : __int_as_float(0x7fffffff);
          }
        } else {
          float wf[8];
          widen8<WT>(use[u], wf);
#pragma unroll
          for (int t = 0; t < MT; ++t) stream_fma_x8<XS>(acc[t], wf, xs + int64_t(t) * s.k, c);
        }
      }
    };
    for (int b = 0; b < s.batches; ++b) {
      const bool last = b + 1 == s.batches;
      const int gn = last ? g + int(gridDim.x) : g, bn = last ? 0 : b + 1;
      // The two buffers swap roles each batch through `flip`, never by copying: a copy
      // (cur = nxt) reads the registers of loads still in flight and waits for them, so the
      // next batch's loads would only be requested once the one before has arrived.
      if (flip)
        batch(alt, cur, b, gn, bn);
      else
        batch(cur, alt, b, gn, bn);
      flip = !flip;
    }
    if constexpr (PAIR == 1) {
      if (s.wpr == 1) {  // whole rows per warp: lane t finishes token t, no block barrier
        const int row = g * s.rows + warp;
        float v[1] = {0.f};
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const float sum = warp_sum(acc[t]);
          if (lane == t) v[0] = sum;
          acc[t] = 0.f;
        }
        if (lane < MT && row < s.n) {
          finish(row, lane, v);
          if (row + row_step < s.n) fetch(row + row_step, lane);
        }
        continue;
      }
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const float v = warp_sum(acc[t]);
      if (lane == 0) red[parity][warp][t] = v;
      acc[t] = 0.f;
    }
    __syncthreads();
    if (threadIdx.x < s.rows / PAIR * MT) {
      const int r = threadIdx.x / MT * PAIR, t = threadIdx.x % MT;
      const int row = g * s.rows + r;
      if (row < s.n) {
        float v[PAIR];
#pragma unroll
        for (int i = 0; i < PAIR; ++i) {
          v[i] = 0.f;
          for (int q = 0; q < s.wpr; ++q) v[i] += red[parity][(r + i) * s.wpr + q][t];
        }
        finish(row, t, v);
        if (row + row_step < s.n) fetch(row + row_step, t);
      }
    }
    parity ^= 1;
  }
}

// stream_run_rows with one staged x ([MT][k] at xs) for every row.
template <typename WT, typename XS, int MT, int PAIR = 1, typename RowPtr, typename Finish, int U,
          typename Fetch = StreamNoFetch>
__device__ __forceinline__ void stream_run(const StreamShape& s, StreamSpan sp, const XS* xs,
                                           RowPtr row_ptr, Finish finish, uint4 (&cur)[U],
                                           float (*red)[kStreamWarps][MT], Fetch fetch = {}) {
  stream_run_rows<WT, XS, MT, PAIR>(s, sp, xs, row_ptr, finish, cur, red, fetch);
}

}  // namespace fmlp::cuda
