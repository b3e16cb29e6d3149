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

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* b, uint32_t n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra "
      "W;\n}\n" ::"r"(smem_u32(b)),
      "r"(parity)
      : "memory");
}
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

struct Ms {
  float m, s;
};
__device__ __forceinline__ Ms combine(Ms a, Ms b) {
  const float m = fmaxf(a.m, b.m);
  const float ms = m == -INFINITY ? 0.f : m;
  return {m, a.s * ex2((a.m - ms) * kLog2e) + b.s * ex2((b.m - ms) * kLog2e)};
}

template <int C, int NBUF>
__global__ void __launch_bounds__(kThreads, 1)
    softmax_sm90_tma_rows(float* __restrict__ y, const float* __restrict__ x, int rows, int n,
                          int part) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
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
      a = combine(a, {__shfl_xor_sync(~0u, a.m, o), __shfl_xor_sync(~0u, a.s, o)});
    if (lane == 0) red[warp] = a;
    __syncthreads();
    float2* slot = pairs + (i % 2) * C;
    if (tid < C) {
      Ms t{-INFINITY, 0.f};
      for (int w = 0; w < kThreads / 32; ++w) t = combine(t, red[w]);
      st_cluster(slot + rank, uint32_t(tid), make_float2(t.m, t.s));
    }
    cluster_sync();
    if (tid == 0) {
      Ms t{-INFINITY, 0.f};
      for (int r = 0; r < C; ++r) t = combine(t, {slot[r].x, slot[r].y});
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

template <int C, int NBUF>
float run(float* y, const float* x, int rows, int n, int reps, int* grid_out) {
  const int part = ((n + C - 1) / C + 3) / 4 * 4;
  const size_t smem = size_t(NBUF) * part * 4 + NBUF * 8 + 2 * C * 8;
  auto k = softmax_sm90_tma_rows<C, NBUF>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = C, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
  cfg.attrs = &attr, cfg.numAttrs = 1;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cfg.gridDim = dim3(unsigned(sms / C * C));
  int clusters = 0;
  CK(cudaOccupancyMaxActiveClusters(&clusters, k, &cfg));
  clusters = std::min(clusters, rows);
  cfg.gridDim = dim3(unsigned(clusters * C));
  *grid_out = clusters;
  CK(cudaLaunchKernelEx(&cfg, k, y, x, rows, n, part));
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a));
    CK(cudaLaunchKernelEx(&cfg, k, y, x, rows, n, part));
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.f);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  int major = 0;
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 9) {
    std::printf(
        "fusedmlp_softmax_tma_proto needs compute capability 9.0 (clusters, bulk copies)\n");
    return 0;
  }
  const int rows = argc > 1 ? std::atoi(argv[1]) : 256, n = argc > 2 ? std::atoi(argv[2]) : 128256;
  const size_t count = size_t(rows) * n;
  std::vector<float> hx(count);
  uint64_t st = 88172645463325252ull;
  for (auto& v : hx) {
    st ^= st << 13, st ^= st >> 7, st ^= st << 17;
    v = float(int64_t(st >> 40) % 2000 - 1000) / 100.f;  // [-10, 10)
  }
  float *x, *y, *cp;
  CK(cudaMalloc(&x, count * 4));
  CK(cudaMalloc(&y, count * 4));
  CK(cudaMalloc(&cp, count * 4));
  CK(cudaMemcpy(x, hx.data(), count * 4, cudaMemcpyHostToDevice));
  // Copy bandwidth in the same run (read + write of the same bytes), median of 20.
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> tc;
  for (int r = 0; r < 21; ++r) {
    CK(cudaEventRecord(a));
    CK(cudaMemcpyAsync(cp, x, count * 4, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    tc.push_back(ms * 1000.f);
  }
  std::sort(tc.begin(), tc.end());
  const double copy_us = tc[tc.size() / 2];
  std::printf("rows %d n %d: copy %.2f us (%.3f TB/s)\n", rows, n, copy_us,
              2.0 * count * 4 / copy_us / 1e6);
  auto check = [&](const char* name, float us, int clusters) {
    std::vector<float> hy(count);
    CK(cudaMemcpy(hy.data(), y, count * 4, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int r = 0; r < rows; r += std::max(1, rows / 16)) {
      const float* xr = hx.data() + size_t(r) * n;
      double mx = -INFINITY, s = 0;
      for (int c = 0; c < n; ++c) mx = std::max(mx, double(xr[c]));
      for (int c = 0; c < n; ++c) s += std::exp(double(xr[c]) - mx);
      for (int c = 0; c < n; ++c) {
        const double ref = std::exp(double(xr[c]) - mx) / s;
        worst = std::max(worst, std::fabs(hy[size_t(r) * n + c] - ref) / (ref + 1e-30));
      }
    }
    std::printf("%-12s %4d clusters  %8.2f us  %5.1f %% of copy  worst rel err %.2e %s\n", name,
                clusters, us, 100.0 * copy_us / us, worst, worst < 1e-4 ? "ok" : "FAIL");
  };
  int g = 0;
  float us;
  CK(cudaMemset(y, 0xff, count * 4));
  us = run<8, 3>(y, x, rows, n, 21, &g);
  check("C8 NBUF3", us, g);
  CK(cudaMemset(y, 0xff, count * 4));
  us = run<8, 2>(y, x, rows, n, 21, &g);
  check("C8 NBUF2", us, g);
  CK(cudaMemset(y, 0xff, count * 4));
  us = run<16, 3>(y, x, rows, n, 21, &g);
  check("C16 NBUF3", us, g);
  CK(cudaMemset(y, 0xff, count * 4));
  us = run<16, 6>(y, x, rows, n, 21, &g);
  check("C16 NBUF6", us, g);
  return 0;
}
