// softmax_sm90_cluster: rows of 16 KB to 3.2 MB, one launch, HBM read once and written once.
// A row is split over a cluster of C blocks (C up to 16: C grows until a block's part is <= 32 KB,
// except that 8 blocks take parts of up to 64 KB rather than become 16, and, for few rows, until
// the grid covers the GPU twice); every block copies its part into shared memory with cp.async
// (all of it in flight at once), reduces it to (max, sum), the blocks of the cluster exchange
// these through distributed shared memory (st.async on mbarriers: no fence) and combine them in
// rank order (every block gets the same bits), and each block writes its part from shared memory. y
// may be x: a block reads all of its part before it writes any of it, and only its own part. Blocks
// run ahead of the DRAM: as it loads its part, each block also requests into L2 the part of the
// block 30 % of the resident blocks after it (cluster_prefetch_ahead), so DRAM keeps reading while
// the resident blocks reduce, wait for their cluster's pairs and write. 30-40 % ahead was the
// fastest on 256 x 128256 rows in fp32 and bf16, about 5 % off no prefetch; more than half a
// wave ahead evicts what the resident blocks are about to read. To measure:
// FMLP_SOFTMAX_L2_AHEAD=0..400 (percent) and FMLP_SOFTMAX_CLUSTER_KB with fusedmlp_ops_bench
// --only softmax (bench/results/softmax_h200.json has the default's figures). Where x fits in
// half the L2, x's copies and
// y's stores are marked L2 evict-first (cluster_evict_first).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/sm90/async.cuh"
#include "cuda/softmax/common.cuh"

namespace fmlp::detail {
namespace {

using namespace softmax;
namespace cg = cooperative_groups;

constexpr int kClusterThreads = 256;
// A block's part: 32 KB (64 KB in a cluster of 8 that would otherwise be 16) unless
// FMLP_SOFTMAX_CLUSTER_KB (4..200) sets it, for measurements.
constexpr int64_t kClusterPartBytes = 32 * 1024;
constexpr int64_t kClusterWidePartBytes = 64 * 1024;
int64_t cluster_part_bytes() {
  static const int64_t bytes = knob_int_or<Knob::FMLP_SOFTMAX_CLUSTER_KB>(0) * 1024;
  return bytes;
}
// How far ahead a block prefetches, in percent of the resident blocks: 30 unless
// FMLP_SOFTMAX_L2_AHEAD (0..400) sets it (0 turns it off).
int cluster_l2_ahead_pct() {
  static const int pct = int(knob_int<Knob::FMLP_SOFTMAX_L2_AHEAD>());
  return pct;
}
// Whether x's loads and y's stores carry an L2 evict-first hint: where x fits in half the L2,
// unless FMLP_SOFTMAX_EVICT=0|1 says: the hints take 2-6 % off the rows that fit (16 MB of fp32,
// 16 MB of bf16, 4 MB of bf16) and add 2-3 % to those that do not (131 MB fp32, 66 MB bf16).
// To measure: fusedmlp_ops_bench --only softmax with FMLP_SOFTMAX_EVICT=0 and 1.
bool cluster_evict_first(const SoftmaxDesc& d) {
  static const int env = int(knob_int_or<Knob::FMLP_SOFTMAX_EVICT>(-1));
  if (env >= 0) return env == 1;
  return d.rows * d.n * int64_t(dtype_size(d.dtype)) * 2 <= cuda_l2_bytes(d.device_id);
}
constexpr int64_t kClusterMaxPartBytes = 200 * 1024;
constexpr int64_t kClusterMinPartBytes = 4 * 1024;
constexpr int64_t kClusterMinRowBytes = 16 * 1024;
constexpr int kClusterMax = 16;  // non-portable: 8 where the device cannot co-schedule 16

// Requests the part of block blockIdx.x + p.l2_ahead (a block that starts once a resident one
// leaves) into L2, one prefetch per 128-byte line: DRAM keeps reading while the resident blocks
// reduce, wait at the cluster barrier and write.
__device__ __forceinline__ void cluster_prefetch_ahead(const SoftmaxParams& p, int64_t es) {
  if (p.l2_ahead <= 0 || blockIdx.x + p.l2_ahead >= gridDim.x) return;
  const int64_t blk = blockIdx.x + p.l2_ahead, r = blk / p.chunks;
  const int64_t b = blk % p.chunks * p.chunk_len, e = min(p.n, b + p.chunk_len);
  if (e <= b) return;
  const uintptr_t x = reinterpret_cast<uintptr_t>(p.x) + uintptr_t((r * p.x_ld + b) * es);
  const uintptr_t end = x + uintptr_t((e - b) * es);
  for (uintptr_t a = (x & ~uintptr_t(127)) + uintptr_t(threadIdx.x) * 128; a < end;
       a += kClusterThreads * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(kClusterThreads) softmax_sm90_cluster(const SoftmaxParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint4 part[];
  __shared__ Ms scratch[32];
  __shared__ Ms total;
  __shared__ alignas(8) Ms pairs[kClusterMax];  // rank q's (max, sum) at q
  __shared__ uint64_t pairs_bar;                // completes once all C pairs landed
  constexpr int E = kWidth<T, VEC>;
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int64_t es = sizeof(T), r = blockIdx.x / C;
  const int64_t b = rank * p.chunk_len, e = min(p.n, b + p.chunk_len);
  const int64_t len = e > b ? e - b : 0, nv = len / E;  // whole vectors when VEC
  const char* x = static_cast<const char*>(p.x) + (r * p.x_ld + b) * es;
  char* y = static_cast<char*>(p.y) + (r * p.y_ld + b) * es;
  if (threadIdx.x == 0) {  // one arrival (thread 0's expect_tx, below) and C pairs of 8 bytes
    fmlp::cuda::sm90::mbar_init(&pairs_bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  uint64_t pol = 0;
  if (p.evict) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  // Distributed shared memory may be written only once every block of the cluster runs and has
  // its mbarrier set up.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  if constexpr (VEC) {
    for (int64_t i = threadIdx.x; i < nv; i += kClusterThreads) {
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(part + i));
      if (p.evict)
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst),
                     "l"(x + i * 16), "l"(pol)
                     : "memory");
      else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(x + i * 16)
                     : "memory");
    }
    cluster_prefetch_ahead(p, es);
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else {
    cluster_prefetch_ahead(p, es);
    T* pt = reinterpret_cast<T*>(part);
    for (int64_t i = threadIdx.x; i < len; i += kClusterThreads)
      pt[i] = reinterpret_cast<const T*>(x)[i];
  }
  __syncthreads();
  Ms acc{-INFINITY, 0.f};
  for (int64_t i = threadIdx.x; i < nv; i += kClusterThreads) {
    float f[E];
    load<T, VEC>(reinterpret_cast<const char*>(part), i, p.t, f);
    accumulate<E>(acc, f, p.sc2);
  }
  acc = block_reduce(acc, p.sc2, scratch);
  // Every block's pair goes into every block of the cluster, so nothing is read remotely later
  // and a block leaves as soon as its writes are issued (with the pairs read remotely instead,
  // each block waited at the end for the whole cluster, measurably slower on small rows). The
  // pairs go by st.async, each counting its 8 bytes on the receiving block's mbarrier, and a
  // block waits on its own mbarrier for all C: no fence. Remote stores and a cluster barrier
  // instead cost a GPU-scope fence (the barrier's release: MEMBAR.ALL.GPU + ERRBAR), which waits
  // for everything the block has in flight, the L2 prefetches included: 4-7 % slower on every
  // measured shape in a same-call A/B (fusedmlp_ops_bench --only softmax). A block leaves only
  // after the C pairs sent to it have landed.
  // (The remote blocks have started: the wait completes the arrive at the kernel's start.)
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  if (C == 1) {  // nothing to exchange (and st.async needs a cluster of two blocks or more)
    if (threadIdx.x == 0) total = combine({-INFINITY, 0.f}, acc, p.sc2);  // as for C > 1
  } else {
    if (int(threadIdx.x) < C) {
      unsigned dst, dst_bar;
      asm("mapa.shared::cluster.u32 %0, %1, %2;"
          : "=r"(dst)
          : "r"(fmlp::cuda::sm90::smem_u32(&pairs[rank])), "r"(int(threadIdx.x)));
      asm("mapa.shared::cluster.u32 %0, %1, %2;"
          : "=r"(dst_bar)
          : "r"(fmlp::cuda::sm90::smem_u32(&pairs_bar)), "r"(int(threadIdx.x)));
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::
              "r"(dst),
          "f"(acc.m), "f"(acc.s), "r"(dst_bar)
          : "memory");
    }
    // The expected bytes may be counted after some pairs have landed (the transaction count goes
    // negative meanwhile; the phase cannot complete before this arrival). Counted before the
    // block's reduce instead, racecheck reported the init and the count as a race (29 warnings).
    if (threadIdx.x == 0) fmlp::cuda::sm90::mbar_expect_tx(&pairs_bar, uint32_t(C) * 8);
    // Once all C pairs have landed, lane q holds rank q's pair and lane 0 combines them in rank
    // order.
    if (threadIdx.x < 32) {
      fmlp::cuda::sm90::mbar_wait(&pairs_bar, 0);
      const Ms got = int(threadIdx.x) < C ? pairs[threadIdx.x] : Ms{-INFINITY, 0.f};
      Ms v{-INFINITY, 0.f};
      for (int q = 0; q < C; ++q)
        v = combine(v, {__shfl_sync(~0u, got.m, q), __shfl_sync(~0u, got.s, q)}, p.sc2);
      if (threadIdx.x == 0) total = v;
    }
  }
  __syncthreads();
  const RowOut tot = row_out(total);
  for (int64_t i = threadIdx.x; i < nv; i += kClusterThreads) {
    float f[E];
    load<T, VEC>(reinterpret_cast<const char*>(part), i, p.t, f);
    finish<E>(f, p.log, p.inv_t, p.sc2, tot);
    if constexpr (VEC) {
      if (p.evict) {
        const uint4 v = pack<T>(f);
        asm volatile(
            "st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(y + i * 16),
            "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol)
            : "memory");
        continue;
      }
    }
    store<T, VEC>(y, i, p.t, f);
  }
#endif
}

// Blocks per row; 0 when the row is outside the kernel's range.
int cluster_size(const SoftmaxDesc& d, int max_c) {
  const int64_t bytes = d.n * int64_t(dtype_size(d.dtype));
  if (bytes < kClusterMinRowBytes) return 0;
  const int64_t sms = std::max(1, cuda_sm_count(d.device_id));
  const int64_t part = cluster_part_bytes() ? cluster_part_bytes() : kClusterPartBytes;
  int fit = 1;
  while (fit < max_c && (bytes + fit - 1) / fit > part) fit *= 2;
  if (fit == 16 && !cluster_part_bytes() && (bytes + 7) / 8 <= kClusterWidePartBytes) fit = 8;
  if ((bytes + fit - 1) / fit > kClusterMaxPartBytes) return 0;
  int par = 1;
  while (par < max_c && d.rows * par < 2 * sms && bytes / (2 * par) >= kClusterMinPartBytes)
    par *= 2;
  return std::max(fit, par);
}

int64_t part_len(const SoftmaxDesc& d, int c) {
  const int64_t width = 16 / int64_t(dtype_size(d.dtype));
  return ((d.n + c - 1) / c + width - 1) / width * width;
}

template <typename T, bool VEC>
cudaError_t cluster_config(int c, size_t smem, cudaLaunchConfig_t* cfg, cudaLaunchAttribute* attr) {
  auto* kernel = &softmax_sm90_cluster<T, VEC>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(std::max<size_t>(smem, 1)));
  if (e == cudaSuccess && c > 8)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cfg->blockDim = dim3(kClusterThreads);
  cfg->dynamicSmemBytes = smem;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = unsigned(c);
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg->attrs = attr;
  cfg->numAttrs = 1;
  return e;
}

// Clusters of c blocks with `smem` bytes each that the device holds at once (0: none).
template <typename T>
int cluster_resident(int c, size_t smem) {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr;
  cfg.gridDim = dim3(unsigned(c));
  int clusters = 0;
  const bool ok = cluster_config<T, true>(c, smem, &cfg, &attr) == cudaSuccess &&
                  cluster_config<T, false>(c, smem, &cfg, &attr) == cudaSuccess &&
                  cudaOccupancyMaxActiveClusters(&clusters, &softmax_sm90_cluster<T, true>, &cfg) ==
                      cudaSuccess;
  cudaGetLastError();
  return ok ? clusters : 0;
}

// Blocks per row that the device can co-schedule (a cluster of 16 is non-portable, and 16 blocks
// with large parts may not fit one GPC): 0 when none; *resident gets the clusters held at once.
// Cached per shape class.
int plan_cluster(const SoftmaxDesc& d, int* resident = nullptr) {
  using Key = std::array<int64_t, 4>;
  static std::mutex mu;
  static std::map<Key, int> cache;
  for (int max_c : {kClusterMax, 8}) {
    const int c = cluster_size(d, max_c);
    if (c == 0) return 0;
    const size_t smem = size_t(part_len(d, c)) * dtype_size(d.dtype);
    const Key key{d.device_id, int64_t(d.dtype), c, int64_t(smem)};
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it == cache.end()) {
      const DeviceScope scope(d.device_id);
      int clusters = 0;
      switch (d.dtype) {
        case FMLP_DTYPE_F16: clusters = cluster_resident<__half>(c, smem); break;
        case FMLP_DTYPE_BF16: clusters = cluster_resident<__nv_bfloat16>(c, smem); break;
        default: clusters = cluster_resident<float>(c, smem); break;
      }
      it = cache.emplace(key, clusters).first;
    }
    if (it->second > 0) {
      if (resident) *resident = it->second;
      return c;
    }
  }
  return 0;
}

}  // namespace

bool softmax_sm90_cluster_supports(const SoftmaxDesc& d, std::string* why) {
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (cuda_compute_capability(d.device_id) < 90)
    return (*why = "thread-block clusters need compute capability 9.0", false);
  const int64_t bytes = d.n * int64_t(dtype_size(d.dtype));
  if (d.rows * kClusterMax >= (int64_t(1) << 31)) return (*why = "rows must be below 2^27", false);
  if (cluster_size(d, kClusterMax) == 0)
    return (
        *why = fmt::format("rows of {} bytes: this kernel takes rows of {} bytes to {} MB; "
                           "softmax_sm80_rows takes the others",
                           bytes, kClusterMinRowBytes, kClusterMax * kClusterMaxPartBytes >> 20),
        false);
  if (plan_cluster(d) == 0)
    return (*why = fmt::format("rows of {} bytes: cuda:{} cannot co-schedule a cluster holding "
                               "one; softmax_sm80_rows takes them",
                               bytes, d.device_id),
            false);
  return true;
}

size_t softmax_sm90_cluster_workspace(const SoftmaxDesc&) {
  return 0;
}

namespace {

template <typename T, bool VEC>
cudaError_t launch_cluster(const SoftmaxParams& p, int c, int64_t rows, cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr;
  const cudaError_t e = cluster_config<T, VEC>(c, size_t(p.chunk_len) * sizeof(T), &cfg, &attr);
  if (e != cudaSuccess) return e;
  cfg.gridDim = dim3(unsigned(rows * c));
  cfg.stream = s;
  return cudaLaunchKernelEx(&cfg, &softmax_sm90_cluster<T, VEC>, p);
}

}  // namespace

fmlp_status_t softmax_sm90_cluster_run(const fmlp_softmax_args_t& a, const SoftmaxDesc& d, void*,
                                       void* stream) {
  const bool vec = softmax_vec16(d, a);  // 16-byte vectors (alignment of x and y)
  int resident = 0;
  const int c = plan_cluster(d, &resident);
  if (c == 0)
    return fail(FMLP_ERROR_NOT_SUPPORTED, "softmax_sm90_cluster cannot take rows of {} elements",
                d.n);
  SoftmaxParams p = row_params(a, d);
  p.chunks = c;
  p.chunk_len = part_len(d, c);
  p.l2_ahead = int64_t(resident) * cluster_l2_ahead_pct() / 100 * c;
  p.evict = cluster_evict_first(d);
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t e;
  switch (d.dtype) {
    case FMLP_DTYPE_F16:
      e = vec ? launch_cluster<__half, true>(p, c, d.rows, s)
              : launch_cluster<__half, false>(p, c, d.rows, s);
      break;
    case FMLP_DTYPE_BF16:
      e = vec ? launch_cluster<__nv_bfloat16, true>(p, c, d.rows, s)
              : launch_cluster<__nv_bfloat16, false>(p, c, d.rows, s);
      break;
    default:
      e = vec ? launch_cluster<float, true>(p, c, d.rows, s)
              : launch_cluster<float, false>(p, c, d.rows, s);
      break;
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA, "softmax_sm90_cluster launch ({} rows, cluster {}) failed: {}",
                d.rows, c, cudaGetErrorString(e));
  }
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
