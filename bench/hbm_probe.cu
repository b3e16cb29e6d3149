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
//
// --matrices NxK,... reads [N, K] bf16 matrices in the weight streams' own order instead
// (engines/stream_gemv.cuh: stream_shape, stream_load, the resident grid of stream_grid), with
// nothing else: no x, no arithmetic but an xor, optionally the per-group __syncthreads, with the
// batch buffers copied (as the streams do) or swapped by role, at the rows per group of --rows
// (default 0,1,2,4,8; 0 = stream_shape's choice) and at most --blocks-per-sm blocks per SM (default
// 0 = as many as fit). It separates what the access order costs from what the kernels add: the 4096
// x 14336 downs stream at 84 % of copy where 14336 x 4096 runs at 92 % with the same kernel. This
// loop needs ~40 registers, so 6 blocks fit per SM on an H200 where the 64-register stream kernels
// fit 4: compare at --blocks-per-sm 4 (docs/linear-softmax.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "cuda/common/common.cuh"
#include "cuda/engines/stream_gemv.cuh"

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

// The weight stream's loop with the arithmetic taken out: group blockIdx.x, then every gridDim.x;
// each warp's part of its row in batches of U loads per lane, the next batch requested before the
// current one is used (as stream_run_rows does); SYNC: a __syncthreads per group, where the
// stream reduces the group's rows. SWAP: the two buffers trade roles each batch instead of the
// copy cur = nxt, which waits for the loads just requested (one batch in flight per warp, not
// two: docs/linear-softmax.md).
template <int U, bool SYNC, bool SWAP>
__global__ void __launch_bounds__(fmlp::cuda::kStreamThreads, 4)
    probe_rows(unsigned* sink, const __nv_bfloat16* w, const fmlp::cuda::StreamShape s) {
  using fmlp::cuda::stream_load;
  if (int(blockIdx.x) >= s.groups) return;
  const auto sp = fmlp::cuda::stream_span<__nv_bfloat16>(s);
  auto row_ptr = [&](int row) { return w + int64_t(row) * s.k; };
  uint4 cur[U], alt[U];
  stream_load<__nv_bfloat16>(cur, s, sp, row_ptr, blockIdx.x, 0);
  unsigned acc = 0;
  bool flip = false;
  for (int g = blockIdx.x; g < s.groups; g += gridDim.x) {
    for (int b = 0; b < s.batches; ++b) {
      const bool last = b + 1 == s.batches;
      const int gn = last ? g + int(gridDim.x) : g, bn = last ? 0 : b + 1;
      auto step = [&](const uint4(&use)[U], uint4(&fill)[U]) {
        if (gn < s.groups) stream_load<__nv_bfloat16>(fill, s, sp, row_ptr, gn, bn);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= use[u].x ^ use[u].y ^ use[u].z ^ use[u].w;
      };
      if constexpr (SWAP) {
        if (flip)
          step(alt, cur);
        else
          step(cur, alt);
        flip = !flip;
      } else {
        step(cur, alt);
#pragma unroll
        for (int u = 0; u < U; ++u) cur[u] = alt[u];
      }
    }
    if constexpr (SYNC) __syncthreads();
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
}

// One [n, k] bf16 matrix read by probe_rows at `rows` rows per group (0: stream_shape's choice),
// at most `blocks_per_sm` blocks per SM (0: as many as fit).
struct MatrixRun {
  int64_t n, k;
  int rows;
  bool sync;
  int blocks_per_sm;
  bool swap;
};

using RowsKernel = void (*)(unsigned*, const __nv_bfloat16*, fmlp::cuda::StreamShape);
RowsKernel rows_kernel(const MatrixRun& m) {
  return m.swap ? (m.sync ? probe_rows<4, true, true> : probe_rows<4, false, true>)
                : (m.sync ? probe_rows<4, true, false> : probe_rows<4, false, false>);
}

fmlp::cuda::StreamShape matrix_shape(const MatrixRun& m) {
  return m.rows ? fmlp::cuda::stream_shape_rows(m.n, m.k, 2, m.rows)
                : fmlp::cuda::stream_shape(m.n, m.k, 2, 1);
}

// Blocks of probe_rows per SM for m: what fits (its 36-40 registers: 6 on an H200, where the
// 64-register stream kernels fit 4), or m's cap below that.
int rows_per_sm(const MatrixRun& m) {
  int per_sm = 1;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, rows_kernel(m),
                                                   fmlp::cuda::kStreamThreads, 0));
  return m.blocks_per_sm > 0 ? std::min(per_sm, m.blocks_per_sm) : per_sm;
}

void launch_rows(const MatrixRun& m, const fmlp::cuda::StreamShape& s, int grid, unsigned* sink,
                 const void* p, cudaStream_t st) {
  rows_kernel(m)<<<unsigned(grid), unsigned(fmlp::cuda::kStreamThreads), 0, st>>>(
      sink, static_cast<const __nv_bfloat16*>(p), s);
  CK(cudaGetLastError());
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
  std::string only_variant, matrices, rows_list = "0,1,2,4,8", caps_list = "0";
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
    else if (a == "--matrices" && i + 1 < argc)
      matrices = argv[++i];
    else if (a == "--rows" && i + 1 < argc)
      rows_list = argv[++i];
    else if (a == "--blocks-per-sm" && i + 1 < argc)
      caps_list = argv[++i];
  }
  std::vector<int64_t> row_counts, caps;
  if (!fmlp_bench::parse_int_list(rows_list.c_str(), 0, 8, &row_counts)) {
    std::fprintf(stderr, "--rows: '%s' is not a list of integers in [0, 8]\n", rows_list.c_str());
    return 2;
  }
  if (!fmlp_bench::parse_int_list(caps_list.c_str(), 0, 32, &caps)) {
    std::fprintf(stderr, "--blocks-per-sm: '%s' is not a list of integers in [0, 32]\n",
                 caps_list.c_str());
    return 2;
  }
  for (int64_t r : row_counts)
    if (r & (r - 1)) {
      std::fprintf(stderr, "--rows: %lld is not 0 (the stream's choice) or a power of two\n",
                   (long long)r);
      return 2;
    }
  std::vector<MatrixRun> runs;
  for (size_t pos = 0; pos < matrices.size();) {
    const size_t end = std::min(matrices.find(',', pos), matrices.size());
    long long n = 0, k = 0;
    if (std::sscanf(matrices.substr(pos, end - pos).c_str(), "%lldx%lld", &n, &k) != 2 || n < 1 ||
        k < 8 || k % 8 != 0) {
      std::fprintf(stderr, "--matrices: '%s' is not NxK with K a multiple of 8\n",
                   matrices.substr(pos, end - pos).c_str());
      return 2;
    }
    for (int64_t cap : caps)
      for (int64_t rows : row_counts)
        for (bool sync : {true, false})
          for (bool swap : {false, true}) runs.push_back({n, k, int(rows), sync, int(cap), swap});
    pos = end + 1;
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
  double max_mb = std::max(235.0, only_mb);
  for (const MatrixRun& m : runs) max_mb = std::max(max_mb, double(m.n * m.k * 2) * 1e-6);
  // One pool, rotated: the largest buffer, or > 3x L2 worth of the smaller ones.
  const size_t pool_bytes = std::max<size_t>(size_t(max_mb * 1e6) + 4096, 4 * l2);
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
  // Microseconds per call of issue(buffer) over `bytes`-sized buffers rotated through the pool.
  auto time_us = [&](size_t bytes, auto&& issue) {
    const int copies = int(
        std::max<size_t>(1, std::min<size_t>(pool_bytes / bytes, (4 * l2 + bytes - 1) / bytes)));
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    const int calls = std::max(copies, 8);
    for (int c = 0; c < calls; ++c) issue(static_cast<char*>(pool) + size_t(c % copies) * bytes);
    CK(cudaStreamEndCapture(st, &g));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    const double us = graph_us_per_call(ge, st, calls, reps);
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return us;
  };
  FILE* f = std::fopen(json.c_str(), "w");
  if (!f) return 1;
  std::fprintf(f, "{\"gpu\": \"%s\", \"sms\": %d, \"copy_TBps\": %.4f, \"rows\": [\n", prop.name,
               sms, bw * 1e-12);
  bool first_row = true;
  if (!runs.empty()) {  // the weight streams' order over whole matrices
    std::printf("%-14s %5s %4s %5s %6s %5s %5s %5s %9s %7s\n", "matrix", "rows", "wpr", "cpw",
                "groups", "b/SM", "sync", "bufs", "us", "% copy");
    for (const MatrixRun& m : runs) {
      const fmlp::cuda::StreamShape s = matrix_shape(m);
      const int per_sm = rows_per_sm(m);
      const int grid = fmlp::cuda::stream_grid(s.groups, per_sm * sms);  // as the streams take it
      const size_t bytes = size_t(m.n * m.k * 2);
      const double us =
          time_us(bytes, [&](const void* p) { launch_rows(m, s, grid, sink, p, st); });
      const double pct = 100.0 * double(bytes) / bw / (us * 1e-6);
      const std::string name = std::to_string(m.n) + "x" + std::to_string(m.k);
      std::printf("%-14s %4d%s %4d %5d %6d %5d %5s %5s %9.2f %6.1f%%\n", name.c_str(), s.rows,
                  m.rows ? " " : "*", s.wpr, s.cpw, s.groups, per_sm, m.sync ? "yes" : "no",
                  m.swap ? "swap" : "copy", us, pct);
      std::fprintf(
          f,
          "%s  {\"matrix\": \"%s\", \"rows\": %d, \"stream_choice\": %s, \"sync\": %s, "
          "\"blocks_per_sm\": %d, \"buffers\": \"%s\", \"us\": %.3f, \"pct_of_copy\": %.1f}",
          first_row ? "" : ",\n", name.c_str(), s.rows, m.rows ? "false" : "true",
          m.sync ? "true" : "false", per_sm, m.swap ? "swap" : "copy", us, pct);
      first_row = false;
    }
    std::printf("(* = the rows per group stream_shape picks)\n");
  } else {
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
        const double us =
            time_us(bytes, [&](const void* p) { launch(v, sms, sink, p, bytes, st); });
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
  }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
  CK(cudaFree(pool));
  CK(cudaFree(sink));
  return 0;
}
