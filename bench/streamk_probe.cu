// fusedmlp_streamk_probe: what the stream-K weight loader's order of reads costs, with the
// arithmetic taken out. The loader of engines/mma_streamk.cuh reads, per warp instruction, one
// 16-byte piece (two with WIDE) of rows g and g + 8 of its 16-row mma group for each lane (g, t):
// 16 rows x 64 (or 128) bytes an instruction, DEPTH steps in flight, and its block's stream-K run
// walks tile (16 x WARPS rows) by chunk (kc columns). This probe walks a bf16 [n, k] matrix in
// exactly that order (same partition, same ring of DEPTH steps, a __syncthreads per chunk as the
// kernel has) over three layouts of the same bytes:
//   - rowmajor: nn.Linear's layout (what the packed weights are today),
//   - tiled:    each (tile, chunk) block contiguous, row-major inside it (row stride kc),
//   - frag:     each (tile, chunk) block contiguous, in the order the loader consumes it: every
//               warp instruction reads 512 contiguous bytes and a block's run is one range,
// next to a plain grid-stride read of the same bytes (the floor a weight stream can reach). If
// rowmajor is far below frag, a packed fragment-order layout is what the batched decode streams
// need; if not, their time goes elsewhere (the arithmetic, the barriers, the epilogues).
// usage: fusedmlp_streamk_probe [--json FILE] [--matrices NxK,...] [--kc 256,512,...] [--reps N]
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "cuda/common/common.cuh"
#include "cuda/engines/mma_streamk.cuh"

namespace {

using fmlp::cuda::MmaStreamKShape;
using fmlp_bench::copy_bandwidth;
using fmlp_bench::graph_us_per_call;

constexpr int kWarps = 8;
constexpr int kRows = 16 * kWarps;

enum Layout : int { kRowMajor = 0, kTiled = 1, kFrag = 2 };
const char* layout_name(int l) {
  return l == kRowMajor ? "rowmajor" : l == kTiled ? "tiled" : "frag";
}

template <int PIECES>
struct Ring {
  uint4 v[PIECES][2];
};

// The loader of mma_streamk_run, element offsets by layout; n a multiple of 16 * kWarps, k of kc.
template <int DEPTH, int PIECES, int LAYOUT>
__global__ void __launch_bounds__(kWarps * 32, 2)
    probe_streamk(unsigned* sink, const __nv_bfloat16* w, const MmaStreamKShape s) {
  constexpr int kLaneCols = 8 * PIECES, kStepCols = 4 * kLaneCols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int b = blockIdx.x;
  const int it0 = fmlp::cuda::mma_streamk_begin(s, b),
            it1 = fmlp::cuda::mma_streamk_begin(s, b + 1);
  if (it0 >= it1) return;
  const int spc = s.kc / kStepCols;
  const int nsteps = (it1 - it0) * spc;
  int l_tile = it0 / s.chunks, l_chunk = it0 % s.chunks, l_sub = 0;
  auto load = [&](Ring<PIECES>& f) {
#pragma unroll
    for (int q = 0; q < PIECES; ++q)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int64_t off;
        if constexpr (LAYOUT == kRowMajor) {
          off = int64_t(l_tile * kRows + warp * 16 + g + 8 * h) * s.k + l_chunk * s.kc +
                l_sub * kStepCols + t * kLaneCols + 8 * q;
        } else {
          const int64_t base = (int64_t(l_tile) * s.chunks + l_chunk) * kRows * s.kc;
          if constexpr (LAYOUT == kTiled)
            off = base + int64_t(warp * 16 + g + 8 * h) * s.kc + l_sub * kStepCols + t * kLaneCols +
                  8 * q;
          else
            off =
                base + (int64_t(l_sub * kWarps + warp) * (PIECES * 2) + q * 2 + h) * 256 + lane * 8;
        }
        f.v[q][h] = fmlp::cuda::ld_stream_v4(w + off);
      }
    if (++l_sub == spc) {
      l_sub = 0;
      if (++l_chunk == s.chunks) {
        l_chunk = 0;
        ++l_tile;
      }
    }
  };
  Ring<PIECES> ring[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH - 1; ++d)
    if (d < nsteps) load(ring[d]);
  unsigned acc = 0;
  for (int c_it = it0; c_it < it1; ++c_it) {
    __syncthreads();  // the kernel's barrier at each chunk (its staged tokens)
    const int j = c_it - it0;
    for (int s0 = 0; s0 < spc; s0 += DEPTH) {
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) {
        const int i = j * spc + s0 + d;
        if (i + DEPTH - 1 < nsteps) load(ring[(d + DEPTH - 1) % DEPTH]);
#pragma unroll
        for (int q = 0; q < PIECES; ++q)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            acc ^= ring[d].v[q][h].x ^ ring[d].v[q][h].y ^ ring[d].v[q][h].z ^ ring[d].v[q][h].w;
      }
    }
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
}

// A resident grid reading the bytes in block-contiguous pieces, grid-stride (hbm_probe's ldg).
__global__ void __launch_bounds__(256) probe_plain(unsigned* sink, const uint4* p, size_t n16) {
  unsigned acc = 0;
  constexpr int U = 4;
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
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
}

using ProbeKernel = void (*)(unsigned*, const __nv_bfloat16*, MmaStreamKShape);
template <int PIECES>
ProbeKernel probe_for(int layout) {
  constexpr int kDepth = 4;
  return layout == kRowMajor ? probe_streamk<kDepth, PIECES, kRowMajor>
         : layout == kTiled  ? probe_streamk<kDepth, PIECES, kTiled>
                             : probe_streamk<kDepth, PIECES, kFrag>;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json = "streamk_probe.json";
  std::string matrices = "28672x4096,4096x14336,8192x4096,4096x4096,6144x768,768x3072";
  std::string kcs = "256,512,1024";
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--matrices" && i + 1 < argc)
      matrices = argv[++i];
    else if (a == "--kc" && i + 1 < argc)
      kcs = argv[++i];
    else if (a == "--reps" && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  std::vector<int64_t> kc_list;
  if (!fmlp_bench::parse_int_list(kcs.c_str(), 64, 8192, &kc_list)) {
    std::fprintf(stderr, "--kc: '%s' is not a list of integers in [64, 8192]\n", kcs.c_str());
    return 2;
  }
  std::vector<std::pair<int64_t, int64_t>> mats;
  for (size_t pos = 0; pos < matrices.size();) {
    const size_t end = std::min(matrices.find(',', pos), matrices.size());
    long long n = 0, k = 0;
    if (std::sscanf(matrices.substr(pos, end - pos).c_str(), "%lldx%lld", &n, &k) != 2 ||
        n % kRows != 0 || n < 1 || k < 64) {
      std::fprintf(stderr, "--matrices: '%s' is not NxK with N a multiple of %d\n",
                   matrices.substr(pos, end - pos).c_str(), kRows);
      return 2;
    }
    mats.push_back({n, k});
    pos = end + 1;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const size_t l2 = size_t(prop.l2CacheSize);
  const double bw = copy_bandwidth();
  std::printf("%s, %d SMs, copy %.3f TB/s, L2 %zu MB\n", prop.name, sms, bw * 1e-12, l2 >> 20);
  size_t max_bytes = 0;
  for (auto [n, k] : mats) max_bytes = std::max(max_bytes, size_t(n * k * 2));
  const size_t pool_bytes = std::max(max_bytes + 4096, 4 * l2);
  void* pool;
  CK(cudaMalloc(&pool, pool_bytes));
  CK(cudaMemset(pool, 0x3c, pool_bytes));
  unsigned* sink;
  CK(cudaMalloc(&sink, 1 << 20));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto time_us = [&](size_t bytes, auto&& issue) {
    const int copies = int(
        std::max<size_t>(1, std::min<size_t>(pool_bytes / bytes, (4 * l2 + bytes - 1) / bytes)));
    cudaGraph_t gr;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    const int calls = std::max(copies, 8);
    for (int c = 0; c < calls; ++c) issue(static_cast<char*>(pool) + size_t(c % copies) * bytes);
    CK(cudaStreamEndCapture(st, &gr));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, gr, 0));
    const double us = graph_us_per_call(ge, st, calls, reps);
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(gr));
    return us;
  };
  FILE* f = std::fopen(json.c_str(), "w");
  if (!f) return 1;
  std::fprintf(f, "{\"gpu\": \"%s\", \"sms\": %d, \"copy_TBps\": %.4f, \"rows\": [\n", prop.name,
               sms, bw * 1e-12);
  bool first = true;
  std::printf("%-12s %6s %5s %6s %6s | %9s %9s %9s %9s  (us; %% of copy)\n", "matrix", "MB", "kc",
              "lane", "blocks", "plain", "rowmajor", "tiled", "frag");
  for (auto [n, k] : mats) {
    const size_t bytes = size_t(n * k * 2);
    const double floor_us = double(bytes) / bw * 1e6;
    int plain_per_sm = 1;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&plain_per_sm, probe_plain, 256, 0));
    const double plain = time_us(bytes, [&](const void* p) {
      probe_plain<<<unsigned(sms * plain_per_sm), 256, 0, st>>>(sink, static_cast<const uint4*>(p),
                                                                bytes / 16);
    });
    for (int64_t kc : kc_list)
      for (int pieces : {1, 2}) {
        if (k % kc != 0 || kc % (32 * pieces * 4) != 0) continue;
        const MmaStreamKShape s = fmlp::cuda::mma_streamk_shape(n, k, kWarps, int(kc), 2 * sms);
        double us[3];
        for (int layout = 0; layout < 3; ++layout) {
          const ProbeKernel kern = pieces == 1 ? probe_for<1>(layout) : probe_for<2>(layout);
          us[layout] = time_us(bytes, [&](const void* p) {
            kern<<<unsigned(s.blocks), kWarps * 32, 0, st>>>(
                sink, static_cast<const __nv_bfloat16*>(p), s);
          });
          CK(cudaGetLastError());
        }
        std::printf(
            "%5lldx%-6lld %6.1f %5lld %5dB %6d | %9.2f %9.2f %9.2f %9.2f\n%40s | %8.1f%% "
            "%8.1f%% %8.1f%% %8.1f%%\n",
            (long long)n, (long long)k, double(bytes) * 1e-6, (long long)kc, 16 * pieces, s.blocks,
            plain, us[0], us[1], us[2], "", 100 * floor_us / plain, 100 * floor_us / us[0],
            100 * floor_us / us[1], 100 * floor_us / us[2]);
        for (int layout = 0; layout < 3; ++layout) {
          std::fprintf(f,
                       "%s  {\"matrix\": \"%lldx%lld\", \"MB\": %.1f, \"kc\": %lld, "
                       "\"lane_bytes\": %d, \"blocks\": %d, \"layout\": \"%s\", \"us\": %.3f, "
                       "\"pct_of_copy\": %.1f, \"plain_us\": %.3f}",
                       first ? "" : ",\n", (long long)n, (long long)k, double(bytes) * 1e-6,
                       (long long)kc, 16 * pieces, s.blocks, layout_name(layout), us[layout],
                       100 * floor_us / us[layout], plain);
          first = false;
        }
      }
  }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
  CK(cudaFree(pool));
  CK(cudaFree(sink));
  return 0;
}
