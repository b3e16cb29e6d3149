// mlp_decode_sm90_bulk: the whole MLP of up to eight tokens in one launch, its weights streamed by
// bulk asynchronous copies into a ring of shared-memory stages and multiplied on the tensor cores.
//
// At decode the MLP is a weight stream, and reaching the copy bandwidth takes tens of KB in flight
// per multiprocessor at every moment. The register-stream kernels hold their loads in registers,
// so the bytes in flight dip whenever warps compute, reduce or change phase (ncu, llama3-8b M = 1:
// 54 % of DRAM peak, against 83 % for cuBLASLt's TMA-fed GEMV). Here one producer warp keeps a
// ring of ~190 KB of stages full, and eight consumer warps compute from shared memory with
// mma.sync (CUDA-core FMAs were tried first: 8 warps could not issue them fast enough, 35 % of
// the floor). The producer runs ahead across the phase change, so the first W2 stages are in
// flight while the hidden slice is being finished.
//
// Work split: one block per multiprocessor owns a contiguous slice of whole 8-unit tiles of the
// hidden dimension (8 units = one 16-byte piece of a W2 row).
//   phase 1: a stage is one tile's 16 W1 rows (gated: its 8 gate rows, then its 8 up rows; dense:
//            its 8 rows, the other 8 mma rows zero) over a chunk of kc columns, one bulk copy per
//            row. Warps take 32-column steps of the chunk: A = the weight rows from shared memory
//            (the k-permuted 16-byte fragments of mma_stream.cuh), B = the staged tokens split
//            into hi + lo halves of the weights' type. Per-tile sums go to shared memory; then
//            h = act(gate + bg) [* (up + bu)] for the slice, split hi + lo, shared memory only.
//   phase 2: a stage is Q rows of W2, each row's piece the block's slice of columns (16-byte
//            cp.async by the producer's lanes: ~200-byte pieces are too short for a bulk copy
//            each), completion tracked on the same mbarrier. Warps take 16-row groups: A = the
//            W2 rows, B = h; the fp32 results go to the workspace with red.global. Blocks start
//            at staggered rows so their adds do not queue on the same addresses.
//   finish:  the last block to finish adds b2 and the residual, writes y and re-zeroes the
//            workspace (the next call or a graph replay needs no memset), its loads batched.
// Shared-memory rows are padded to a stride of 64 mod 128 bytes, so the two rows an 8-lane
// phase of a fragment load touches fall in different banks. Weights enter the tensor cores
// exactly; tokens and h carry ~16 significant bits (hi + lo); accumulation is fp32.
// Not deterministic (atomic reduction order); deterministic mode goes to the splitk kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/decode_common.cuh"
#include "cuda/device_scope.hpp"
#include "cuda/launch_util.hpp"
#include "cuda/mlp_decode.cuh"
#include "cuda/mma_stream.cuh"

namespace fmlp::detail {
namespace {

using fmlp::cuda::activate;
using fmlp::cuda::block_sum;
using fmlp::cuda::load_scalar;
using fmlp::cuda::mma_step;
using fmlp::cuda::opt;
using fmlp::cuda::red_add_f32;
using fmlp::cuda::store_scalar;

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kThreads = kConsumers + 32;  // + one producer warp
constexpr int kMaxTokens = 8;              // one n8 tile of the mma
constexpr int kTile = 8;
constexpr int kSlotTarget = 32 * 1024;  // bytes per stage
constexpr int kMaxStages = 12;
constexpr int kMinStages = 3;
constexpr int kStaticSmem = 512;  // >= the mbarriers, the staging scratch and a flag (~240 B)

// Row stride (elements of 2 bytes) of at least n elements with stride % 128 bytes == 64.
__host__ __device__ constexpr int padded_ld(int n) {
  return (n + 63) / 64 * 64 + 32;
}

struct BulkParams : fmlp::cuda::DecodeOperands {
  float* acc;         // [m, n] fp32 accumulators, zero between calls
  unsigned* counter;  // blocks done, zero between calls
  int kc;             // phase-1 chunk of columns, a multiple of 64
  int rows2;          // Q: W2 rows per phase-2 stage, a multiple of 16
  int slot_bytes;     // ring slot size, a multiple of 128
  int stages;         // ring depth
  int max_slice;      // the largest hidden slice of any block (shared-memory layout)
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
// Arrives (the producer's one arrival) and announces the bytes the stage's copies will deliver.
__device__ __forceinline__ void mbar_arrive_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile(
      "{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" ::"r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n"
      "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "\t@!p bra WAIT;\n\t}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src)
               : "memory");
}
// One pending arrival on `bar` now, performed when this thread's earlier cp.async copies land.
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// The consumer warps only: the producer never waits on them outside the ring.
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}
#endif

template <typename WT>
__device__ __forceinline__ void split_store(WT* hi, WT* lo, float v) {
  if constexpr (std::is_same_v<WT, __half>) {
    *hi = __float2half_rn(v);
    *lo = __float2half_rn(v - __half2float(*hi));
  } else {
    *hi = __float2bfloat16_rn(v);
    *lo = __float2bfloat16_rn(v - __bfloat162float(*hi));
  }
}

__device__ __forceinline__ uint4 lds128(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// The p.m token rows, normalised when asked, as hi + lo halves in WT ([m][ld] each). Every
// thread of the block calls it (block sums).
template <typename WT>
__device__ void stage_split_tokens(const BulkParams& p, WT* hi, WT* lo, int ld, float* scratch) {
  const size_t es = p.act_t == FMLP_DTYPE_F32 ? 4 : 2;
  for (int m = 0; m < p.m; ++m) {
    const char* row = static_cast<const char*>(p.x) + m * p.x_ld * int64_t(es);
    float mean = 0.f, inv = 1.f;
    if (p.norm != FMLP_NORM_NONE) {
      float s = 0.f;
      if (p.norm == FMLP_NORM_LAYERNORM)
        for (int c = threadIdx.x; c < p.k; c += kThreads) s += load_scalar(row, p.act_t, c);
      mean = p.norm == FMLP_NORM_LAYERNORM ? block_sum<kThreads>(s, scratch) / float(p.k) : 0.f;
      float q = 0.f;
      for (int c = threadIdx.x; c < p.k; c += kThreads) {
        const float d = load_scalar(row, p.act_t, c) - mean;
        q += d * d;
      }
      inv = rsqrtf(block_sum<kThreads>(q, scratch) / float(p.k) + p.eps);
    }
    for (int c = threadIdx.x; c < p.k; c += kThreads) {
      float v = load_scalar(row, p.act_t, c);
      if (p.norm != FMLP_NORM_NONE)
        v = (v - mean) * inv * opt(p.gamma, p.gamma_t, c, 1.f) + opt(p.beta, p.beta_t, c, 0.f);
      split_store(hi + m * ld + c, lo + m * ld + c, v);
    }
  }
}

// M: the token capacity the shared memory is laid out for (1, 2, 4 or 8); p.m <= M tokens are real.
template <int M, typename WT, bool GATED>
__global__ void __launch_bounds__(kThreads, 1) mlp_decode_sm90_bulk(const BulkParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ float scratch[kThreads / 32];
  __shared__ unsigned is_last;
  constexpr int kRows1 = GATED ? 16 : 8;  // W1 rows of a tile
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int tiles = p.h / kTile;
  const int t0 = int(int64_t(tiles) * blockIdx.x / gridDim.x);
  const int t1 = int(int64_t(tiles) * (blockIdx.x + 1) / gridDim.x);
  const int h0 = t0 * kTile, nt = t1 - t0, slice = nt * kTile;
  const int S = p.stages, Q = p.rows2, kc = p.kc;
  const int nkc = (p.k + kc - 1) / kc;
  const int items1 = nt * nkc, items2 = (p.n + Q - 1) / Q;
  const int first2 = int(int64_t(items2) * blockIdx.x / gridDim.x);  // staggered W2 start
  const int rs1 = padded_ld(kc) * 2, xld = padded_ld(p.k), hld = padded_ld(p.max_slice);
  const int rs2 = padded_ld(slice) * 2, nv2 = slice / 8;

  unsigned char* ring = smem;
  WT* xs_hi = reinterpret_cast<WT*>(smem + size_t(S) * p.slot_bytes);  // [M][xld]
  WT* xs_lo = xs_hi + M * xld;
  WT* hs_hi = xs_lo + M * xld;  // [M][hld]
  WT* hs_lo = hs_hi + M * hld;
  float* dots = reinterpret_cast<float*>(hs_lo + M * hld);  // [tile][16 rows][M]

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], kConsumerWarps);
    asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::
                     : "memory");
  }
  for (int i = threadIdx.x; i < (p.max_slice / kTile) * 16 * M; i += kThreads) dots[i] = 0.f;
  __syncthreads();

  const WT* wg = static_cast<const WT*>(p.wg);
  const WT* wu = static_cast<const WT*>(p.wu);
  const WT* w2 = static_cast<const WT*>(p.w2) + h0;
  auto issue = [&](int it) {  // producer warp: the copies of ring item `it`
    const int s = it % S;
    unsigned char* dst = ring + size_t(s) * p.slot_bytes;
    if (it < items1) {
      const int tile = it / nkc, c0 = (it % nkc) * kc, cols = min(kc, p.k - c0);
      if (lane == 0) mbar_arrive_expect(&full[s], unsigned(kRows1 * cols * 2));
      __syncwarp();
      if (lane < kRows1) {
        const int64_t u = h0 + tile * kTile + lane % 8;
        const WT* src = (GATED && lane >= 8 ? wu + u * p.wu_ld : wg + u * p.wg_ld) + c0;
        bulk_copy(dst + lane * rs1, src, unsigned(cols * 2), &full[s]);
      }
    } else {
      const int o0 = ((it - items1 + first2) % items2) * Q, nq = min(Q, p.n - o0);
      const int per_pass = nv2 <= 32 ? 32 / nv2 : 1, lq = nv2 <= 32 ? lane / nv2 : 0;
      const int lv = nv2 <= 32 ? lane % nv2 : lane, vstep = nv2 <= 32 ? nv2 : 32;
      if (lq < per_pass)
        for (int q = lq; q < nq; q += per_pass) {
          const WT* src = w2 + int64_t(o0 + q) * p.w2_ld;
          for (int v = lv; v < nv2; v += vstep) cp_async16(dst + q * rs2 + v * 16, src + v * 8);
        }
      cp_async_arrive(&full[s]);
      __syncwarp();
      if (lane == 0) mbar_arrive(&full[s]);
    }
  };

  const int items = items1 + items2;
  if (warp == kConsumerWarps) {
    // The first S stages need no free slot: in flight before the tokens are even staged.
    for (int it = 0; it < min(S, items); ++it) issue(it);
    stage_split_tokens<WT>(p, xs_hi, xs_lo, xld, scratch);
    __syncthreads();
    for (int it = S; it < items; ++it) {
      mbar_wait(&empty[it % S], unsigned((it / S - 1) & 1));
      issue(it);
    }
    return;  // nothing after this waits on the producer
  }
  stage_split_tokens<WT>(p, xs_hi, xs_lo, xld, scratch);
  __syncthreads();

  const uint4 zero = make_uint4(0, 0, 0, 0);
  const int mm = p.m;
  const bool tok = g < mm;  // this lane's B column is a real token
  // Phase 1: per tile, warps accumulate their steps of every chunk, then add into dots.
  float c[4] = {};
  for (int it = 0; it < items1; ++it) {
    const int s = it % S, tile = it / nkc, chunk = it % nkc;
    const int c0 = chunk * kc, cols = min(kc, p.k - c0);
    mbar_wait(&full[s], unsigned((it / S) & 1));
    const unsigned char* st = ring + size_t(s) * p.slot_bytes;
    for (int step = warp; step * 32 < cols; step += kConsumerWarps) {
      const int col = step * 32 + 8 * t;
      const bool in = col < cols;
      const uint4 a0 = in ? lds128(st + g * rs1 + col * 2) : zero;
      const uint4 a1 = in && GATED ? lds128(st + (g + 8) * rs1 + col * 2) : zero;
      const uint4 bh = in && tok ? lds128(xs_hi + g * xld + c0 + col) : zero;
      const uint4 bl = in && tok ? lds128(xs_lo + g * xld + c0 + col) : zero;
      mma_step<WT>(c, a0, a1, bh);
      mma_step<WT>(c, a0, a1, bl);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
    if (chunk == nkc - 1) {  // rows g (gate/dense) and g + 8 (up), tokens 2t and 2t + 1
      float* d = dots + tile * 16 * M;
      if (2 * t < mm) atomicAdd(d + g * M + 2 * t, c[0]), atomicAdd(d + (g + 8) * M + 2 * t, c[2]);
      if (2 * t + 1 < mm)
        atomicAdd(d + g * M + 2 * t + 1, c[1]), atomicAdd(d + (g + 8) * M + 2 * t + 1, c[3]);
      c[0] = c[1] = c[2] = c[3] = 0.f;
    }
  }
  consumers_sync();
  for (int i = threadIdx.x; i < mm * slice; i += kConsumers) {
    const int m = i / slice, u = i % slice;
    const float* d = dots + (u / kTile) * 16 * M + (u % kTile) * M + m;
    float v = activate(p.act, d[0] + opt(p.bg, p.bg_t, h0 + u, 0.f));
    if constexpr (GATED) v *= d[8 * M] + opt(p.bu, p.bu_t, h0 + u, 0.f);
    split_store(hs_hi + m * hld + u, hs_lo + m * hld + u, v);
  }
  consumers_sync();

  // Phase 2: warps take 16-row groups of each stage.
  for (int i2 = 0; i2 < items2; ++i2) {
    const int it = items1 + i2, s = it % S;
    const int o0 = ((i2 + first2) % items2) * Q, nq = min(Q, p.n - o0);
    mbar_wait(&full[s], unsigned((it / S) & 1));
    const unsigned char* st = ring + size_t(s) * p.slot_bytes;
    for (int grp = warp; grp * 16 < nq; grp += kConsumerWarps) {
      const int r0 = grp * 16 + g, r1 = r0 + 8;
      float acc[4] = {};
      for (int col0 = 0; col0 < slice; col0 += 32) {
        const int col = col0 + 8 * t;
        const bool in = col < slice;
        const uint4 a0 = in && r0 < nq ? lds128(st + r0 * rs2 + col * 2) : zero;
        const uint4 a1 = in && r1 < nq ? lds128(st + r1 * rs2 + col * 2) : zero;
        const uint4 bh = in && tok ? lds128(hs_hi + g * hld + col) : zero;
        const uint4 bl = in && tok ? lds128(hs_lo + g * hld + col) : zero;
        mma_step<WT>(acc, a0, a1, bh);
        mma_step<WT>(acc, a0, a1, bl);
      }
      float* out = p.acc + o0;
      if (2 * t < mm) {
        if (r0 < nq) red_add_f32(out + int64_t(2 * t) * p.n + r0, acc[0]);
        if (r1 < nq) red_add_f32(out + int64_t(2 * t) * p.n + r1, acc[2]);
      }
      if (2 * t + 1 < mm) {
        if (r0 < nq) red_add_f32(out + int64_t(2 * t + 1) * p.n + r0, acc[1]);
        if (r1 < nq) red_add_f32(out + int64_t(2 * t + 1) * p.n + r1, acc[3]);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
  }

  // One fence per thread here, not one per stage: a fence waits for the thread's adds to drain.
  __threadfence();
  consumers_sync();
  if (threadIdx.x == 0) is_last = atomicAdd(p.counter, 1u) == gridDim.x - 1;
  consumers_sync();
  if (!is_last) return;
  __threadfence();
  constexpr int kBatch = 8;  // independent loads in flight per thread
  const int total = mm * p.n;
  const size_t es = p.act_t == FMLP_DTYPE_F32 ? 4 : 2;
  for (int base = 0; base < total; base += kBatch * kConsumers) {
    float v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + j * kConsumers + int(threadIdx.x);
      v[j] = i < total ? __ldcg(p.acc + i) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + j * kConsumers + int(threadIdx.x);
      if (i >= total) break;
      const int m = i / p.n, o = i % p.n;
      p.acc[i] = 0.f;
      float r = v[j] + opt(p.b2, p.b2_t, o, 0.f);
      if (p.res) r += load_scalar(static_cast<const char*>(p.res) + m * p.res_ld * es, p.act_t, o);
      store_scalar(static_cast<char*>(p.y) + m * p.y_ld * es, p.act_t, o, r);
    }
  }
  if (threadIdx.x == 0) *p.counter = 0;
#endif
}

struct Plan {
  int blocks = 0, kc = 0, rows2 = 0, slot_bytes = 0, stages = 0, max_slice = 0;
  size_t smem = 0;
};

// The token capacity the kernel is instantiated for.
int capacity(int64_t m) {
  return m <= 1 ? 1 : m <= 2 ? 2 : m <= 4 ? 4 : 8;
}

Plan plan_for(const MlpDesc& d) {
  Plan pl;
  const int64_t mc = capacity(d.m);
  const int64_t tiles = d.hidden / kTile;
  pl.blocks = int(std::max<int64_t>(1, std::min<int64_t>(tiles, cuda_sm_count(d.device_id))));
  pl.max_slice = int((tiles + pl.blocks - 1) / pl.blocks * kTile);
  const int rows1 = d.gated ? 16 : 8;
  // Phase-1 chunk: ~kSlotTarget bytes of the tile's rows, a multiple of 64 columns.
  pl.kc = int(std::min<int64_t>((d.d_in + 63) / 64 * 64,
                                std::max(64, kSlotTarget / (rows1 * 2) / 64 * 64)));
  const int64_t rs2 = int64_t(padded_ld(pl.max_slice)) * 2;
  const int64_t slot1 = int64_t(rows1) * padded_ld(pl.kc) * 2;
  const int64_t slot = std::max<int64_t>({slot1, 16 * rs2, kSlotTarget});
  pl.slot_bytes = int((slot + 127) / 128 * 128);
  pl.rows2 = int(pl.slot_bytes / rs2 / 16 * 16);
  const int64_t fixed = 2 * mc * 2 * (int64_t(padded_ld(int(d.d_in))) + padded_ld(pl.max_slice)) +
                        (pl.max_slice / kTile) * 16 * mc * 4;
  const int64_t avail = cuda_max_dynamic_smem(d.device_id, kStaticSmem) - fixed;
  pl.stages = int(std::clamp<int64_t>(avail / pl.slot_bytes, 0, kMaxStages));
  pl.smem = size_t(fixed + int64_t(pl.stages) * pl.slot_bytes);
  return pl;
}

template <int M, typename WT, bool GATED>
fmlp_status_t launch(const BulkParams& p, const Plan& pl, cudaStream_t stream) {
  constexpr auto kernel = &mlp_decode_sm90_bulk<M, WT, GATED>;
  if (const fmlp_status_t st = allow_dynamic_smem<kernel>(pl.smem, "mlp_decode_sm90_bulk");
      st != FMLP_SUCCESS)
    return st;
  kernel<<<pl.blocks, kThreads, pl.smem, stream>>>(p);
  return launch_status("mlp_decode_sm90_bulk");
}

template <typename WT, bool GATED>
fmlp_status_t dispatch_m(const BulkParams& p, const Plan& pl, int m, cudaStream_t s) {
  switch (capacity(m)) {
    case 1: return launch<1, WT, GATED>(p, pl, s);
    case 2: return launch<2, WT, GATED>(p, pl, s);
    case 4: return launch<4, WT, GATED>(p, pl, s);
    default: return launch<8, WT, GATED>(p, pl, s);
  }
}

template <typename WT>
fmlp_status_t dispatch(const BulkParams& p, const Plan& pl, const MlpDesc& d, cudaStream_t s) {
  return d.gated ? dispatch_m<WT, true>(p, pl, int(d.m), s)
                 : dispatch_m<WT, false>(p, pl, int(d.m), s);
}

}  // namespace

bool mlp_decode_sm90_bulk_supports(const MlpDesc& d, std::string* why) {
  if (!split_hidden_supports(d, kMaxTokens, why)) return false;
  if (d.d_in > (int64_t(1) << 24) || d.hidden > (int64_t(1) << 30) || d.d_out > (int64_t(1) << 30))
    return (*why = "sizes above 2^24 (d_in) or 2^30 need 64-bit indexing", false);
  const Plan pl = plan_for(d);
  if (pl.stages < kMinStages)
    return (*why = fmt::format("M x d_in = {} x {} leaves shared memory for {} stages of {} bytes "
                               "(needs {}); the cluster and splitk kernels take it",
                               d.m, d.d_in, pl.stages, pl.slot_bytes, kMinStages),
            false);
  return true;
}

size_t mlp_decode_sm90_bulk_workspace(const MlpDesc& d) {
  return split_hidden_workspace(d);
}

fmlp_status_t mlp_decode_sm90_bulk_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws,
                                       void* stream) {
  BulkParams p{};
  static_cast<fmlp::cuda::DecodeOperands&>(p) = fmlp::cuda::decode_operands(a, d);
  const Plan pl = plan_for(d);
  split_hidden_scratch(ws, d, &p.acc, &p.counter);
  p.kc = pl.kc, p.rows2 = pl.rows2, p.slot_bytes = pl.slot_bytes;
  p.stages = pl.stages, p.max_slice = pl.max_slice;

  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  return d.w_dtype == FMLP_DTYPE_F16 ? dispatch<__half>(p, pl, d, s)
                                     : dispatch<__nv_bfloat16>(p, pl, d, s);
}

}  // namespace fmlp::detail
