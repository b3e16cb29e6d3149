// fusedmlp_hbm_probe: what reading N bytes of HBM costs on this GPU, measured the way the op
// benchmarks measure (CUDA-graph replay of back-to-back calls over buffers rotated through > 3x
// the L2, median of replays), for N from 1 MB to 256 MB and a few ways to stream:
//   - ldg:  16-byte non-allocating loads, U in flight per thread, a resident grid (blocks per SM
//           x SMs) walking the buffer in block-contiguous chunks,
//   - bulk: cp.async.bulk copies of C bytes into an S-slot shared-memory ring on mbarriers (one
//           issuing thread per block), the whole block consuming each slot,
//   - pdl:  ldg launched with programmatic stream serialization, so a call may start while the
//           previous one drains (griddepcontrol.wait before its only write).
// The decode kernels are such streams plus arithmetic: this is the floor they can reach at each
// size (fixed launch and ramp costs included), next to the copy-bandwidth floor the benchmarks
// divide by. usage: fusedmlp_hbm_probe [--json FILE] [--reps N] [--variant NAME] [--mb SIZE]
// (--variant / --mb: that variant / size alone, e.g. under a profiler).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "cuda/common.cuh"

namespace {

using fmlp_bench::copy_bandwidth;
using fmlp_bench::graph_us_per_call;

// The xor of everything read lands in sink only if it equals an impossible value, so the loads
// stay live and nothing is written in practice.
template <int U, bool PDL>
__global__ void probe_ldg(unsigned* sink, const uint4* p, size_t n16) {
  unsigned acc = 0;
  const size_t chunk = size_t(blockDim.x) * U;
  for (size_t base = size_t(blockIdx.x) * chunk; base < n16; base += size_t(gridDim.x) * chunk) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = base + size_t(u) * blockDim.x + threadIdx.x;
      v[u] = i < n16 ? fmlp::cuda::ld_stream_v4(p + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if constexpr (PDL) {
    fmlp::cuda::pdl_allow_next_grid();
    fmlp::cuda::pdl_wait_previous_grid();
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_u32(const void* q) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(q));
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes,
                                          uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n"
      "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "\t@!p bra WAIT;\n\t}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
#endif

// Each block streams a contiguous share of the buffer in C-byte copies through S slots.
__global__ void probe_bulk(unsigned* sink, const char* p, size_t bytes, int c, int s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) char ring[];
  __shared__ uint64_t bars[32];
  const size_t chunks = (bytes + c - 1) / c;
  const size_t per = (chunks + gridDim.x - 1) / gridDim.x;
  const size_t first = size_t(blockIdx.x) * per;
  const size_t last = first + per < chunks ? first + per : chunks;
  if (threadIdx.x == 0) {
    for (int i = 0; i < s; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bars[i])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](size_t ch) {
    const size_t off = ch * size_t(c);
    const unsigned n = unsigned(bytes - off < size_t(c) ? bytes - off : size_t(c));
    const int slot = int((ch - first) % size_t(s));
    bulk_load(ring + size_t(slot) * c, p + off, n, &bars[slot]);
  };
  if (threadIdx.x == 0)
    for (size_t ch = first; ch < last && ch < first + size_t(s); ++ch) issue(ch);
  unsigned acc = 0;
  for (size_t ch = first; ch < last; ++ch) {
    const int slot = int((ch - first) % size_t(s));
    bar_wait(&bars[slot], unsigned(((ch - first) / size_t(s)) & 1));
    const uint4* q = reinterpret_cast<const uint4*>(ring + size_t(slot) * c);
    for (int i = threadIdx.x; i < c / 16; i += blockDim.x) {
      const uint4 v = q[i];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncthreads();  // the slot is free again
    if (threadIdx.x == 0 && ch + s < last) issue(ch + s);
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
#else
  (void)sink, (void)p, (void)bytes, (void)c, (void)s;
#endif
}

__global__ void probe_empty(unsigned* sink) {
  if (sink == nullptr) sink[threadIdx.x] = 0;
}

struct Variant {
  std::string name;
  int kind;  // 0 ldg, 1 bulk, 2 pdl, 3 empty
  int unroll, threads, blocks_per_sm, c, s;
};

template <int U, bool PDL>
void launch_ldg(const Variant& v, int sms, unsigned* sink, const void* p, size_t bytes,
                cudaStream_t st) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(sms * v.blocks_per_sm));
  cfg.blockDim = dim3(unsigned(v.threads));
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = PDL ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, probe_ldg<U, PDL>, sink, static_cast<const uint4*>(p), bytes / 16));
}

void launch(const Variant& v, int sms, unsigned* sink, const void* p, size_t bytes,
            cudaStream_t st) {
  switch (v.kind) {
    case 0:
      if (v.unroll == 4)
        launch_ldg<4, false>(v, sms, sink, p, bytes, st);
      else
        launch_ldg<8, false>(v, sms, sink, p, bytes, st);
      break;
    case 2: launch_ldg<4, true>(v, sms, sink, p, bytes, st); break;
    case 1:
      probe_bulk<<<unsigned(sms * v.blocks_per_sm), unsigned(v.threads), size_t(v.c) * v.s, st>>>(
          sink, static_cast<const char*>(p), bytes, v.c, v.s);
      break;
    default: probe_empty<<<1, 32, 0, st>>>(sink);
  }
  CK(cudaGetLastError());
}

}  // namespace

int main(int argc, char** argv) {
  std::string json = "hbm_probe.json";
  std::string only_variant;
  double only_mb = 0;
  int reps = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--variant" && i + 1 < argc)
      only_variant = argv[++i];
    else if (a == "--mb" && i + 1 < argc)
      only_mb = std::atof(argv[++i]);
    else if (a == "--reps" && i + 1 < argc)
      reps = std::atoi(argv[++i]);
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const size_t l2 = size_t(prop.l2CacheSize);
  CK(cudaFuncSetAttribute(probe_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  const double bw = copy_bandwidth();
  std::printf("%s, %d SMs, copy %.3f TB/s, L2 %zu MB\n", prop.name, sms, bw * 1e-12, l2 >> 20);
  const std::vector<Variant> variants = {
      {"empty", 3, 0, 32, 0, 0, 0},
      {"ldg_u4_t256_b4", 0, 4, 256, 4, 0, 0},
      {"ldg_u8_t256_b4", 0, 8, 256, 4, 0, 0},
      {"ldg_u4_t512_b4", 0, 4, 512, 4, 0, 0},
      {"ldg_u8_t256_b8", 0, 8, 256, 8, 0, 0},
      {"pdl_u4_t512_b4", 2, 4, 512, 4, 0, 0},
      {"bulk_c16k_s8_b1", 1, 0, 256, 1, 16384, 8},
      {"bulk_c32k_s6_b1", 1, 0, 256, 1, 32768, 6},
      {"bulk_c8k_s12_b2", 1, 0, 256, 2, 8192, 10},
  };
  std::vector<double> mbs = {1, 2, 4, 8, 9.4, 16, 33.5, 58.7, 117.4, 235};
  if (only_mb > 0) mbs = {only_mb};
  // One pool, rotated: the largest buffer, or > 3x L2 worth of the smaller ones.
  const size_t pool_bytes = std::max<size_t>(size_t(std::max(235.0, only_mb) * 1e6) + 4096, 4 * l2);
  void* pool;
  CK(cudaMalloc(&pool, pool_bytes));
  {
    std::vector<uint32_t> h(pool_bytes / 4);
    uint32_t x = 12345u;
    for (auto& e : h) x = x * 1664525u + 1013904223u, e = x;
    CK(cudaMemcpy(pool, h.data(), pool_bytes, cudaMemcpyHostToDevice));
  }
  unsigned* sink;
  CK(cudaMalloc(&sink, 1 << 20));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  FILE* f = std::fopen(json.c_str(), "w");
  if (!f) return 1;
  std::fprintf(f, "{\"gpu\": \"%s\", \"sms\": %d, \"copy_TBps\": %.4f, \"rows\": [\n", prop.name,
               sms, bw * 1e-12);
  bool first_row = true;
  std::printf("%-18s", "MB ->");
  for (double mb : mbs) std::printf(" %8.1f", mb);
  std::printf("   (us per call; copy floor below)\n%-18s", "copy floor");
  for (double mb : mbs) std::printf(" %8.2f", mb * 1e6 / bw * 1e6);
  std::printf("\n");
  for (const Variant& v : variants) {
    if (!only_variant.empty() && v.name != only_variant) continue;
    std::printf("%-18s", v.name.c_str());
    for (double mb : mbs) {
      const size_t bytes = (size_t(mb * 1e6) + 255) / 256 * 256;
      const int copies = int(
          std::max<size_t>(1, std::min<size_t>(pool_bytes / bytes, (4 * l2 + bytes - 1) / bytes)));
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      const int calls = std::max(copies, 8);
      for (int c = 0; c < calls; ++c)
        launch(v, sms, sink, static_cast<char*>(pool) + size_t(c % copies) * bytes, bytes, st);
      CK(cudaStreamEndCapture(st, &g));
      cudaGraphExec_t ge;
      CK(cudaGraphInstantiate(&ge, g, 0));
      const double us = graph_us_per_call(ge, st, calls, reps);
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
      std::printf(" %8.2f", us);
      const double floor_us = double(bytes) / bw * 1e6;
      std::fprintf(f,
                   "%s  {\"variant\": \"%s\", \"MB\": %.1f, \"us\": %.3f, \"GBps\": %.1f, "
                   "\"pct_of_copy\": %.1f}",
                   first_row ? "" : ",\n", v.name.c_str(), mb, us, double(bytes) / us * 1e-3,
                   100.0 * floor_us / us);
      first_row = false;
    }
    std::printf("\n");
  }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
  CK(cudaFree(pool));
  CK(cudaFree(sink));
  return 0;
}
