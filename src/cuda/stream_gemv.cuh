// The memory-order weight stream shared by linear_sm80_stream (linear_stream.cu) and
// mlp_decode_sm80_stream (mlp_decode_stream.cu): y_row = W_row . x for a few tokens, W read once.
//
// Why this order: at M <= 4 these ops are a read of W, and a plain read of the same bytes
// (bench/hbm_probe.cu: resident blocks reading contiguous pieces in grid-stride order) runs far
// faster than a warp-per-row GEMV that starts every row at once (33.5 MB on an H200: 9.1 us
// against 15.6): the GEMV has a few KB of every row in flight at the same time, scattered over
// all of W, while the probe's requests cover one contiguous window sliding through it. So:
//   - a block iteration (a "group") is R whole consecutive rows, about stream_group_bytes() of
//     W (R a power of two up to 8); its rows are split between the block's 8 warps (8 / R per
//     row, each a contiguous run of the row's 16-byte chunks, read as batches of 4 chunks per
//     lane); the resident blocks take consecutive groups, so the bytes in flight stay one
//     window sliding through W,
//   - the next batch (of this group or the block's next one) is requested before the current
//     one is used, so every lane has a batch in flight also across groups; the caller issues the
//     first batch (stream_load) before staging x,
//   - x is staged by the caller in shared memory, [MT][k] in XS (the whole K: blocks are
//     resident and loop over groups),
//   - a row's warps reduce with shuffles and through shared memory in warp order (deterministic),
//     double-buffered by group parity so one __syncthreads per group suffices; then
//     `finish(row, t, sums)` runs for token t and each run of PAIR consecutive rows of the group
//     (threads [0, R / PAIR * MT)), sums[i] the dot product of row + i: PAIR = 2 hands a gated
//     MLP's interleaved gate and up rows to one thread,
//   - fp32 accumulation; fp8 e4m3 chunks (16 weights) are widened exactly to fp16 pairs with
//     cvt.rn.f16x2.e4m3x2 and multiplied with packed fp16 FMAs into one fp16x2 sum per chunk (8
//     products per half) before the fp32 add: widening to fp32 instead costs 16 more conversions
//     per chunk, and conversions bounded the older fp8 GEMV. x is then staged as fp16 times a
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

// The partition of an [n, k] stream (computed on the host by stream_shape below).
struct StreamShape {
  int n, k;
  int rows;     // R: W rows per group
  int wpr;      // warps per row: kStreamWarps / R
  int cpw;      // 16-byte chunks of a row per warp (the last warp of a row may have fewer)
  int batches;  // batches per warp and group
  int groups;   // ceil(n / R)
};

// W bytes per group: 16 KB for weights under 16 MiB (few groups per block: a short group keeps
// more blocks busy), 32 KB up to 1 GiB, 64 KB beyond. Measured on an H200 (the session of
// commit 0bcccd9), us at 16 / 32 / 64 KB: 4096x4096 bf16 11.9 / 11.0 / 10.9; 14336x4096
// 32.7 / 31.0 / 32.5; 1024x4096 5.2 / 5.1 / 5.8; 768x3072 4.1 / 4.2 / 4.6; qwen2.5-7b lm head
// 268 / 249 / 245. FMLP_LINEAR_STREAM_KB overrides it for measurements.
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

// The partition of an [n, k] stream of `elem_bytes` weights, at least `min_rows` rows per group
// (a power of two up to kStreamWarps).
inline StreamShape stream_shape(int64_t n, int64_t k, int elem_bytes, int min_rows = 1) {
  StreamShape s{};
  s.n = int(n);
  s.k = int(k);
  const int64_t row_bytes = k * elem_bytes;
  const int64_t group = stream_group_bytes(n * row_bytes);
  s.rows = 1;
  while (s.rows < min_rows || (s.rows < kStreamWarps && row_bytes * s.rows * 2 <= group))
    s.rows *= 2;
  s.wpr = kStreamWarps / s.rows;
  const int64_t kchunks = row_bytes / 16;
  s.cpw = int((kchunks + s.wpr - 1) / s.wpr);
  s.batches = (s.cpw + kStreamBatch - 1) / kStreamBatch;
  s.groups = int((n + s.rows - 1) / s.rows);
  return s;
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

// This warp's part of a row: chunks [begin, end).
struct StreamSpan {
  int begin, end;
};

template <typename WT>
__device__ __forceinline__ StreamSpan stream_span(const StreamShape& s) {
  const int sub = (threadIdx.x / 32) % s.wpr;
  const int kchunks = s.k / kStreamPerChunk<WT>;
  const int b = sub * s.cpw;
  return {b, min(kchunks, b + s.cpw)};
}

// Batch b of this warp's part of group `group`'s row; row_ptr(row) gives W row `row` (< n).
template <typename WT, typename RowPtr>
__device__ __forceinline__ void stream_load(uint4 (&v)[kStreamU], const StreamShape& s,
                                            StreamSpan sp, RowPtr row_ptr, int group, int b) {
  const int row = group * s.rows + (threadIdx.x / 32) / s.wpr;
  const WT* wr = row_ptr(min(row, s.n - 1));
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < kStreamU; ++u) {
    const int c = sp.begin + b * kStreamBatch + u * 32 + lane;
    v[u] = row < s.n && c < sp.end ? ld_stream_v4(wr + int64_t(c) * kStreamPerChunk<WT>)
                                   : make_uint4(0, 0, 0, 0);
  }
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

// Sixteen e4m3 weights (one chunk) times the 16 staged fp16 x values of chunk c, summed in fp16
// pairs (see the file comment), as fp32.
__device__ __forceinline__ float stream_dot16_e4m3(const uint4& w, const __half* xr, int c) {
  __half2 acc = __float2half2_rn(0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint4 xa = reinterpret_cast<const uint4*>(xr)[2 * c];
  const uint4 xb = reinterpret_cast<const uint4*>(xr)[2 * c + 1];
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
  const uint32_t xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(uint16_t(ws[i / 2] >> (16 * (i % 2)))));
    acc = __hfma2(*reinterpret_cast<const __half2*>(&h), *reinterpret_cast<const __half2*>(&xv[i]),
                  acc);
  }
#else
  (void)w, (void)xr, (void)c;  // the entries keep fp8 off devices below sm_89
#endif
  const float2 f = __half22float2(acc);
  return f.x + f.y;
}

// The stream itself, from group blockIdx.x on (< s.groups) with `cur` holding its first batch
// (stream_load(cur, s, sp, row_ptr, blockIdx.x, 0)) and xs staged; every thread of the block
// calls it. `red` is [2][kStreamWarps][MT] shared floats. PAIR divides R.
template <typename WT, typename XS, int MT, int PAIR = 1, typename RowPtr, typename Finish>
__device__ __forceinline__ void stream_run(const StreamShape& s, StreamSpan sp, const XS* xs,
                                           RowPtr row_ptr, Finish finish, uint4 (&cur)[kStreamU],
                                           float (*red)[kStreamWarps][MT]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float acc[MT] = {};
  int parity = 0;
  for (int g = blockIdx.x; g < s.groups; g += gridDim.x) {
    for (int b = 0; b < s.batches; ++b) {
      const bool last = b + 1 == s.batches;
      const int gn = last ? g + int(gridDim.x) : g, bn = last ? 0 : b + 1;
      uint4 nxt[kStreamU];
      if (gn < s.groups) stream_load<WT>(nxt, s, sp, row_ptr, gn, bn);
#pragma unroll
      for (int u = 0; u < kStreamU; ++u) {
        const int c = sp.begin + b * kStreamBatch + u * 32 + lane;
        if (c >= sp.end) continue;
        if constexpr (std::is_same_v<WT, StreamFp8>) {
#pragma unroll
          for (int t = 0; t < MT; ++t)
            acc[t] += stream_dot16_e4m3(cur[u], xs + int64_t(t) * s.k, c);
        } else {
          float wf[8];
          widen8<WT>(cur[u], wf);
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            float xf[8];
            stream_x8<XS>(xs + int64_t(t) * s.k, c, xf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[t] = fmaf(wf[e], xf[e], acc[t]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kStreamU; ++u) cur[u] = nxt[u];
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
      }
    }
    parity ^= 1;
  }
}

}  // namespace fmlp::cuda
