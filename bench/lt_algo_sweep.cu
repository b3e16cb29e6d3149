// How far cuBLASLt's first heuristic answer is from the best of its top answers, for the GEMMs the
// prefill and cuBLASLt decode paths run (layout as src/cuda/common/lt_gemm.cpp: D[out, tok]
// = W[out, K]^T-op x X[K, tok], bf16 in and out, fp32 compute). Each candidate is checked against
// the first answer's output before it is timed (max |diff| relative to max |ref|), then timed with
// CUDA events over 20 back-to-back calls, weights rotated over > 3x the L2 when they are small,
// median of 9. Prints one line per (shape, workspace offer): the first answer's µs, the best
// answer's index and µs, and their ratio.
//   fusedmlp_lt_algo_sweep [--shapes 8b,70b,4096] [--tokens 16,64,256,1024,2048] [--top 16]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_cublaslt.hpp"

namespace {

struct Gemm {
  const char* name;
  int64_t out, k;
};

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = __float2bfloat16((float(h & 0xffff) / 32768.f - 1.f) * scale);
  }
}

float max_abs(const std::vector<__nv_bfloat16>& v) {
  float m = 0.f;
  for (auto x : v) m = std::fmax(m, std::fabs(__bfloat162float(x)));
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shapes = "8b,70b,4096", tokens_s = "16,64,256,1024,2048";
  int top = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--shapes")
      shapes = argv[i + 1];
    else if (a == "--tokens")
      tokens_s = argv[i + 1];
    else if (a == "--top")
      top = std::max(1, std::atoi(argv[i + 1]));
  }
  std::vector<Gemm> gemms;
  if (shapes.find("8b") != std::string::npos)
    gemms.push_back({"8b gate/up", 28672, 4096}), gemms.push_back({"8b down", 4096, 14336});
  if (shapes.find("70b") != std::string::npos)
    gemms.push_back({"70b gate/up", 57344, 8192}), gemms.push_back({"70b down", 8192, 28672});
  if (shapes.find("4096") != std::string::npos) gemms.push_back({"4096 dense", 4096, 4096});
  std::vector<int64_t> toks;
  if (!fmlp_bench::parse_positive_list(tokens_s.c_str(), &toks)) {
    std::fprintf(stderr, "--tokens: '%s' is not a list of positive integers (16,64,256)\n",
                 tokens_s.c_str());
    return 2;
  }

  cublasLtHandle_t h;
  LK(cublasLtCreate(&h));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  const int64_t l2 = prop.l2CacheSize;
  std::printf("# %s, cuBLASLt %zu; first heuristic answer against the best of the top %d\n",
              prop.name, cublasLtGetVersion(), top);
  std::printf("%-12s %6s %8s %5s %10s %5s %10s %7s\n", "gemm", "tokens", "ws MiB", "algos",
              "first us", "best", "best us", "ratio");
  const size_t ws_max = size_t(32) << 20;
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_max));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  for (const Gemm& g : gemms) {
    const int64_t wbytes = g.out * g.k * 2;
    const int copies = int(std::max<int64_t>(1, (3 * l2 + wbytes - 1) / wbytes + (wbytes < l2)));
    std::vector<__nv_bfloat16*> w(static_cast<size_t>(copies));
    for (auto& p : w) {
      CK(cudaMalloc(&p, size_t(wbytes)));
      fill_bf16<<<1024, 256, 0, st>>>(p, g.out * g.k, 7u, 0.02f);
    }
    for (int64_t n : toks) {
      __nv_bfloat16 *x = nullptr, *d = nullptr, *dref = nullptr;
      CK(cudaMalloc(&x, size_t(g.k * n * 2)));
      CK(cudaMalloc(&d, size_t(g.out * n * 2)));
      CK(cudaMalloc(&dref, size_t(g.out * n * 2)));
      fill_bf16<<<1024, 256, 0, st>>>(x, g.k * n, 11u, 1.f);
      cublasLtMatmulDesc_t op;
      LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
      LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
      cublasLtMatrixLayout_t la, lb, ld;
      LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, uint64_t(g.k), uint64_t(g.out), g.k));
      LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, uint64_t(g.k), uint64_t(n), g.k));
      LK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, uint64_t(g.out), uint64_t(n), g.out));
      for (size_t offer : {size_t(0), ws_max}) {
        cublasLtMatmulPreference_t pref;
        LK(cublasLtMatmulPreferenceCreate(&pref));
        const uint64_t o = offer;
        LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &o,
                                                sizeof(o)));
        std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(top));
        int count = 0;
        LK(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, top, res.data(), &count));
        cublasLtMatmulPreferenceDestroy(pref);
        const float alpha = 1.f, beta = 0.f;
        auto call = [&](int a, int i, __nv_bfloat16* out) {
          return cublasLtMatmul(h, op, &alpha, w[size_t(i % copies)], la, x, lb, &beta, out, ld,
                                out, ld, &res[size_t(a)].algo, ws, res[size_t(a)].workspaceSize,
                                st);
        };
        std::vector<__nv_bfloat16> ref(size_t(g.out * n)), got(ref.size());
        double first = 0, best = 1e30;
        int best_i = -1;
        for (int a = 0; a < count; ++a) {
          CK(cudaMemsetAsync(a == 0 ? dref : d, 0xff, size_t(g.out * n * 2), st));
          if (call(a, 0, a == 0 ? dref : d) != CUBLAS_STATUS_SUCCESS) {
            std::printf("# %s tokens %lld algo %d: does not launch\n", g.name, (long long)n, a);
            if (a == 0) break;  // the others are checked against its output
            continue;
          }
          CK(cudaStreamSynchronize(st));
          if (a == 0) {
            CK(cudaMemcpy(ref.data(), dref, ref.size() * 2, cudaMemcpyDeviceToHost));
          } else {
            CK(cudaMemcpy(got.data(), d, got.size() * 2, cudaMemcpyDeviceToHost));
            float err = 0.f;
            for (size_t i = 0; i < got.size(); ++i)
              err = std::fmax(err, std::fabs(__bfloat162float(got[i]) - __bfloat162float(ref[i])));
            if (!(err <= 0.02f * max_abs(ref))) {
              std::printf("# %s tokens %lld algo %d: differs from the first answer (%g)\n", g.name,
                          (long long)n, a, double(err));
              continue;
            }
          }
          for (int i = 0; i < 5; ++i) call(a, i, d);
          std::vector<double> t;
          cudaEvent_t e0, e1;
          CK(cudaEventCreate(&e0));
          CK(cudaEventCreate(&e1));
          for (int r = 0; r < 9; ++r) {
            CK(cudaEventRecord(e0, st));
            for (int i = 0; i < 20; ++i) call(a, i, d);
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms = 0.f;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            t.push_back(ms * 1000.0 / 20);
          }
          cudaEventDestroy(e0);
          cudaEventDestroy(e1);
          const double us = fmlp_bench::median(t);
          if (a == 0) first = us;
          if (us < best) best = us, best_i = a;
        }
        std::printf("%-12s %6lld %8zu %5d %10.1f %5d %10.1f %7.3f\n", g.name, (long long)n,
                    offer >> 20, count, first, best_i, best, first > 0 ? best / first : 0.0);
        std::fflush(stdout);
      }
      cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(ld);
      cublasLtMatmulDescDestroy(op);
      CK(cudaFree(x));
      CK(cudaFree(d));
      CK(cudaFree(dref));
    }
    for (auto p : w) CK(cudaFree(p));
  }
  return 0;
}
