// Prototype (not in the library): softmax over rows of fp32 as persistent thread-block clusters
// that pipeline rows through shared memory with bulk copies. For the 256 x 128256 fp32 target of
// issue #7 (>= 85 % of copy bandwidth; softmax_sm90_cluster is at ~75 %, docs/linear-softmax.md).
//
// Each cluster of C CTAs owns whole rows (rows ci, ci + clusters, ...); CTA `rank` owns part
// `rank` of each row (<= 64 KB). A CTA keeps NBUF part buffers: while it works on row i, the
// bulk loads of rows i + 1 .. i + NBUF - 1 are in flight and row i - 1's bulk store drains, so
// the HBM sees a steady stream however long the per-row exchange takes. Per row: wait for the
// part, (max, sum of exp) over it, the pair to every CTA of the cluster through DSMEM, a cluster
// barrier, y = exp(x - M) / S written in place, bulk store.
//
// A measurement tool like hbm_probe.cu, not a library entry: built as fusedmlp_softmax_tma_proto
// when CUDA is on (the kernel body is sm_90 code; other devices are told so and it exits).
// Run:   fusedmlp_softmax_tma_proto [rows] [n]   (default 256 x 128256; n a multiple of 4: the
//        bulk copies need 16-byte aligned row parts). Not yet run on a GPU (session 24).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_common.hpp"
#include "cuda/sm90_async.cuh"
#include "cuda/softmax_common.cuh"

namespace {

using fmlp::detail::softmax::combine;
using fmlp::detail::softmax::ex2;
using fmlp::detail::softmax::kLog2e;
using fmlp::detail::softmax::Ms;
using fmlp_bench::copy_bandwidth;
using fmlp_bench::graph_us_per_call;

constexpr int kThreads = 256;

#ifdef FMLP_SM90A
using namespace fmlp::cuda::sm90;

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(b))
      : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_u32(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// Stores v at the same shared-memory offset as `local` in CTA `rank` of the cluster.
__device__ __forceinline__ void st_cluster(float2* local, uint32_t rank, float2 v) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(smem_u32(local)), "r"(rank));
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(remote), "f"(v.x), "f"(v.y)
               : "memory");
}

#endif  // FMLP_SM90A

template <int C, int NBUF>
__global__ void __launch_bounds__(kThreads, 1)
    softmax_sm90_tma_rows(float* __restrict__ y, const float* __restrict__ x, int rows, int n,
                          int part) {
#ifdef FMLP_SM90A
  extern __shared__ __align__(128) unsigned char smem[];
  float* buf = reinterpret_cast<float*>(smem);  // [NBUF][part]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + size_t(NBUF) * part * 4);
  float2* pairs = reinterpret_cast<float2*>(full + NBUF);  // [2][C]: this row's pairs by rank
  __shared__ Ms red[kThreads / 32];
  __shared__ Ms total;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const uint32_t rank = cluster_rank();
  const int ci = blockIdx.x / C, clusters = gridDim.x / C;
  const int my_rows = ci < rows ? (rows - ci + clusters - 1) / clusters : 0;
  const int p0 = int(rank) * part, plen = max(0, min(part, n - p0));  // this CTA's columns
  const uint32_t bytes = uint32_t(plen) * 4;
  auto row_of = [&](int i) { return ci + i * clusters; };
  if (tid == 0) {
    for (int b = 0; b < NBUF; ++b) mbar_init(&full[b], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid == 0 && bytes > 0)
    for (int i = 0; i < NBUF - 1 && i < my_rows; ++i) {
      mbar_expect_tx(&full[i], bytes);
      bulk_load(buf + size_t(i) * part, x + size_t(row_of(i)) * n + p0, bytes, &full[i]);
    }
  cluster_sync();  // every CTA's pair slots exist before any is written
  for (int i = 0; i < my_rows; ++i) {
    const int b = i % NBUF;
    float* v = buf + size_t(b) * part;
    if (tid == 0 && bytes > 0 && i + NBUF - 1 < my_rows) {
      const int bn = (i + NBUF - 1) % NBUF;  // last held row i - 1, whose store must have read it
      bulk_wait_read<0>();
      mbar_expect_tx(&full[bn], bytes);
      bulk_load(buf + size_t(bn) * part, x + size_t(row_of(i + NBUF - 1)) * n + p0, bytes,
                &full[bn]);
    }
    if (bytes > 0) mbar_wait(&full[b], uint32_t(i / NBUF) & 1);
    // (max, sum of exp) over the part: each thread its float4s, then the block.
    const int v4 = plen / 4;
    const float4* v4p = reinterpret_cast<const float4*>(v);
    float m = -INFINITY;
    for (int c = tid; c < v4; c += kThreads) {
      const float4 q = v4p[c];
      m = fmaxf(m, fmaxf(fmaxf(q.x, q.y), fmaxf(q.z, q.w)));
    }
    for (int c = v4 * 4 + tid; c < plen; c += kThreads) m = fmaxf(m, v[c]);
    const float ms = m == -INFINITY ? 0.f : m;
    float s = 0.f;
    for (int c = tid; c < v4; c += kThreads) {
      const float4 q = v4p[c];
      s += ex2((q.x - ms) * kLog2e) + ex2((q.y - ms) * kLog2e) + ex2((q.z - ms) * kLog2e) +
           ex2((q.w - ms) * kLog2e);
    }
    for (int c = v4 * 4 + tid; c < plen; c += kThreads) s += ex2((v[c] - ms) * kLog2e);
    Ms a{m, s};
    for (int o = 16; o > 0; o >>= 1)
      a = combine(a, {__shfl_xor_sync(~0u, a.m, o), __shfl_xor_sync(~0u, a.s, o)}, kLog2e);
    if (lane == 0) red[warp] = a;
    __syncthreads();
    float2* slot = pairs + (i % 2) * C;
    if (tid < C) {
      Ms t{-INFINITY, 0.f};
      for (int w = 0; w < kThreads / 32; ++w) t = combine(t, red[w], kLog2e);
      st_cluster(slot + rank, uint32_t(tid), make_float2(t.m, t.s));
    }
    cluster_sync();
    if (tid == 0) {
      Ms t{-INFINITY, 0.f};
      for (int r = 0; r < C; ++r) t = combine(t, {slot[r].x, slot[r].y}, kLog2e);
      total = t;
    }
    __syncthreads();
    const float M = total.m, inv = 1.f / total.s;
    const float Ms_ = M == -INFINITY ? 0.f : M;
    float4* w4 = reinterpret_cast<float4*>(v);
    for (int c = tid; c < v4; c += kThreads) {
      float4 q = w4[c];
      q.x = ex2((q.x - Ms_) * kLog2e) * inv, q.y = ex2((q.y - Ms_) * kLog2e) * inv;
      q.z = ex2((q.z - Ms_) * kLog2e) * inv, q.w = ex2((q.w - Ms_) * kLog2e) * inv;
      w4[c] = q;
    }
    for (int c = v4 * 4 + tid; c < plen; c += kThreads) v[c] = ex2((v[c] - Ms_) * kLog2e) * inv;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // y visible to the bulk copy
    __syncthreads();
    if (tid == 0 && bytes > 0) bulk_store(y + size_t(row_of(i)) * n + p0, v, bytes);
  }
  if (tid == 0) bulk_wait_all();
  cluster_sync();  // no CTA leaves while a peer may still write its pair slots
#endif
}

// Median µs per call of the kernel for C-CTA clusters and NBUF buffers, graph-replayed like the
// benchmarks; *clusters_out gets the co-resident clusters used.
template <int C, int NBUF>
double run(float* y, const float* x, int rows, int n, int* clusters_out) {
  const int part = ((n + C - 1) / C + 3) / 4 * 4;
  const size_t smem = size_t(NBUF) * part * 4 + NBUF * 8 + 2 * C * 8;
  auto k = softmax_sm90_tma_rows<C, NBUF>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = C, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
  cfg.attrs = &attr, cfg.numAttrs = 1;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cfg.gridDim = dim3(unsigned(sms / C * C));
  int clusters = 0;
  CK(cudaOccupancyMaxActiveClusters(&clusters, k, &cfg));
  clusters = std::max(1, std::min(clusters, rows));
  cfg.gridDim = dim3(unsigned(clusters * C));
  *clusters_out = clusters;
  CK(cudaLaunchKernelEx(&cfg, k, y, x, rows, n, part));  // the run the check reads
  CK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CK(cudaLaunchKernelEx(&cfg, k, y, x, rows, n, part));
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  const double us = graph_us_per_call(ge, s, 1, 21);
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaStreamDestroy(s));
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  int major = 0;
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major != 9) {
    std::printf("fusedmlp_softmax_tma_proto is sm_90a code (clusters, bulk copies)\n");
    return 0;
  }
  const int rows = argc > 1 ? std::atoi(argv[1]) : 256, n = argc > 2 ? std::atoi(argv[2]) : 128256;
  if (rows < 1 || n < 4 || n % 4 != 0) {
    std::printf("rows >= 1 and n a positive multiple of 4, please\n");
    return 1;
  }
  const size_t count = size_t(rows) * n;
  std::vector<float> hx(count);
  uint64_t st = 88172645463325252ull;
  for (auto& v : hx) {
    st ^= st << 13, st ^= st >> 7, st ^= st << 17;
    v = float(int64_t(st >> 40) % 2000 - 1000) / 100.f;  // [-10, 10)
  }
  float *x, *y;
  CK(cudaMalloc(&x, count * 4));
  CK(cudaMalloc(&y, count * 4));
  CK(cudaMemcpy(x, hx.data(), count * 4, cudaMemcpyHostToDevice));
  const double bw = copy_bandwidth();  // bytes/s, read + write counted
  const double floor_us = 2.0 * double(count) * 4 / bw * 1e6;
  std::printf("rows %d n %d: copy %.3f TB/s, floor %.2f us\n", rows, n, bw / 1e12, floor_us);
  struct Variant {
    const char* name;
    double (*fn)(float*, const float*, int, int, int*);
  };
  const Variant variants[] = {{"C8 NBUF3", &run<8, 3>},
                              {"C8 NBUF2", &run<8, 2>},
                              {"C16 NBUF3", &run<16, 3>},
                              {"C16 NBUF6", &run<16, 6>}};
  for (const Variant& v : variants) {
    CK(cudaMemset(y, 0xff, count * 4));  // NaN: an element never written fails the check
    int clusters = 0;
    const double us = v.fn(y, x, rows, n, &clusters);
    std::vector<float> hy(count);
    CK(cudaMemcpy(hy.data(), y, count * 4, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int r = 0; r < rows; r += std::max(1, rows / 16)) {
      const float* xr = hx.data() + size_t(r) * n;
      double mx = -INFINITY, sum = 0;
      for (int c = 0; c < n; ++c) mx = std::max(mx, double(xr[c]));
      for (int c = 0; c < n; ++c) sum += std::exp(double(xr[c]) - mx);
      for (int c = 0; c < n; ++c) {
        const double ref = std::exp(double(xr[c]) - mx) / sum;
        const double err = std::fabs(double(hy[size_t(r) * n + c]) - ref) / ref;
        worst = std::isnan(err) ? INFINITY : std::max(worst, err);
      }
    }
    std::printf("%-10s %4d clusters  %8.2f us  %5.1f %% of the floor  worst rel err %.2e %s\n",
                v.name, clusters, us, 100.0 * floor_us / us, worst, worst < 1e-4 ? "ok" : "FAIL");
  }
  return 0;
}
