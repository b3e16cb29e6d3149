// cuBLASLt for the prefill path: lazily created per-device handles and a mutex-protected cache of
// heuristic answers. Descriptors live on the stack (the *Init forms), so a cached call allocates
// nothing and only launches.
#include "cuda/mlp_prefill_cublaslt.cuh"

#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/cublaslt_handle.hpp"
#include "cuda/cublaslt_tune.hpp"

namespace fmlp::detail {
namespace {

constexpr int kMaxDevices = 64;

cudaDataType_t cuda_type(fmlp_dtype_t t) {
  switch (t) {
    case FMLP_DTYPE_F32: return CUDA_R_32F;
    case FMLP_DTYPE_F16: return CUDA_R_16F;
    default: return CUDA_R_16BF;
  }
}

// Largest power of two (up to 256) dividing the address: what the heuristic must assume.
uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

// The alignment every column (token row) of a matrix keeps: its base and its stride in bytes.
uint32_t alignment(const void* p, int64_t ld, fmlp_dtype_t t) {
  const uint32_t base = alignment(p);
  const uint32_t stride = alignment(reinterpret_cast<const void*>(uintptr_t(ld) * dtype_size(t)));
  return std::min(base, stride);
}

cublasLtEpilogue_t lt_epilogue(LtEpilogue e) {
  switch (e) {
    case LtEpilogue::kBias: return CUBLASLT_EPILOGUE_BIAS;
    case LtEpilogue::kGeluTanhBias: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case LtEpilogue::kGeluTanh: return CUBLASLT_EPILOGUE_GELU;
    default: return CUBLASLT_EPILOGUE_DEFAULT;
  }
}

using Key = LtKey;
struct Choice {
  bool ok;  // false: the heuristic had no algorithm (cached too, so supports() asks once)
  cublasLtMatmulAlgo_t algo;
  size_t workspace;
  size_t offer;  // the workspace bytes offered when it was chosen
};

std::mutex& cache_mutex() {
  static std::mutex m;
  return m;
}
std::map<Key, Choice>& cache() {
  static std::map<Key, Choice> c;
  return c;
}

// The operation and layouts of one GEMM, in stack storage.
struct Descriptors {
  cublasLtMatmulDescOpaque_t op_s;
  cublasLtMatrixLayoutOpaque_t a_s, b_s, c_s, d_s;
  cublasLtMatmulDesc_t op = &op_s;
  cublasLtMatrixLayout_t a = &a_s, b = &b_s, c = &c_s, d = &d_s;
};

cublasStatus_t describe(const LtGemm& g, int64_t ldb, int64_t ldc, int64_t ldd, Descriptors* ds) {
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // never TF32 (tolerance.hpp)
  cublasStatus_t s = cublasLtMatmulDescInit(ds->op, compute, CUDA_R_32F);
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const cublasLtEpilogue_t epi = lt_epilogue(g.epilogue);
  const cudaDataType_t t = cuda_type(g.dtype);
  const cudaDataType_t ab = g.fp8 ? CUDA_R_8F_E4M3 : t;
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t n) {
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(ds->op, attr, v, n);
  };
  set(CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));  // TN: the layout fp8 kernels require
  set(CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
  set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
  if (g.fp8) {
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode));
    set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode));
    set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.a_scale, sizeof(g.a_scale));
    set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.b_scale, sizeof(g.b_scale));
  }
  if (g.bias != nullptr) {
    const int32_t bt = int32_t(t);
    set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias));
    set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt));
  }
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutInit(ds->a, ab, uint64_t(g.k), uint64_t(g.m), g.lda);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutInit(ds->b, ab, uint64_t(g.k), uint64_t(g.n), ldb);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutInit(ds->c, t, uint64_t(g.m), uint64_t(g.n), ldc);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutInit(ds->d, t, uint64_t(g.m), uint64_t(g.n), ldd);
  return s;
}

}  // namespace

fmlp_status_t lt_prepare(int device) {
  cublasLtHandle_t h;
  return cublaslt_handle(device, &h);
}

namespace {

// One GEMM's descriptors, leading dimensions and cached answer.
struct Prepared {
  Descriptors ds;
  int64_t ldb = 0, ldc = 0, ldd = 0;
  const void* c = nullptr;
  uint32_t al[4] = {};  // alignments of A, B, C, D in bytes
  Key key{};
  Choice choice{};
};

// Up to `want` heuristic answers for the prepared problem within `offer` workspace bytes.
cublasStatus_t heuristic(const LtGemm& g, cublasLtHandle_t h, const Prepared& p, uint64_t offer,
                         int want, cublasLtMatmulHeuristicResult_t* results, int* count) {
  cublasLtMatmulPreferenceOpaque_t pref_s;
  cublasLtMatmulPreference_t pref = &pref_s;
  cublasStatus_t s = cublasLtMatmulPreferenceInit(pref);
  auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, size_t n) {
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceSetAttribute(pref, attr, v, n);
  };
  set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &offer, sizeof(offer));
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &p.al[0], sizeof(p.al[0]));
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &p.al[1], sizeof(p.al[1]));
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &p.al[2], sizeof(p.al[2]));
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &p.al[3], sizeof(p.al[3]));
  if (g.deterministic) {
    // Split-K reductions are the only place where the summation order could depend on the
    // algorithm's scheduling; without them every output is one fixed-order dot product.
    const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &none, sizeof(none));
  }
  *count = 0;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(h, p.ds.op, p.ds.a, p.ds.b, p.ds.c, p.ds.d, pref, want,
                                       results, count);
  return s;
}

// The algorithm for the prepared problem within `offer` workspace bytes: the tune table's, when it
// has one that this cuBLASLt accepts for these descriptors, else the heuristic's first answer
// (c->ok false when there is none).
cublasStatus_t choose(const LtGemm& g, cublasLtHandle_t h, const Prepared& p, size_t offer,
                      Choice* c) {
  LtTuned t;
  cublasLtMatmulHeuristicResult_t r{};
  if (lt_tuned_find(p.key, &t) &&
      cublasLtMatmulAlgoCheck(h, p.ds.op, p.ds.a, p.ds.b, p.ds.c, p.ds.d, &t.algo, &r) ==
          CUBLAS_STATUS_SUCCESS &&
      r.workspaceSize <= offer)
    return *c = {true, t.algo, r.workspaceSize, offer}, CUBLAS_STATUS_SUCCESS;
  int count = 0;
  const cublasStatus_t s = heuristic(g, h, p, offer, 1, &r, &count);
  *c = {s == CUBLAS_STATUS_SUCCESS && count > 0, r.algo, r.workspaceSize, offer};
  return s;
}

cublasStatus_t prepare(const LtGemm& g, cublasLtHandle_t h, size_t ws_bytes, Prepared* p) {
  // With one column (one token) the leading dimension is never used; cuBLASLt still wants it to
  // cover the rows.
  const bool one = g.n == 1;
  p->ldb = one ? std::max(g.ldb, g.k) : g.ldb;
  p->c = g.c ? g.c : g.d;
  p->ldd = one ? std::max(g.ldd, g.m) : g.ldd;
  p->ldc = g.c ? (one ? std::max(g.ldc, g.m) : g.ldc) : p->ldd;
  cublasStatus_t s = describe(g, p->ldb, p->ldc, p->ldd, &p->ds);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const fmlp_dtype_t ab = g.fp8 ? FMLP_DTYPE_F8_E4M3 : g.dtype;
  p->al[0] = alignment(g.a, g.lda, ab);
  p->al[1] = alignment(g.b, p->ldb, ab);
  p->al[2] = alignment(p->c, p->ldc, g.dtype);
  p->al[3] = alignment(g.d, p->ldd, g.dtype);
  const Key& key = p->key = Key{g.device,
                                int64_t(g.dtype),
                                g.m,
                                g.n,
                                g.k,
                                g.lda,
                                p->ldb,
                                p->ldc,
                                p->ldd,
                                int64_t(g.c != nullptr) + 2 * int64_t(g.c == g.d),
                                int64_t(g.epilogue),
                                p->al[0],
                                p->al[1],
                                p->al[2],
                                p->al[3],
                                g.bias ? alignment(g.bias) : 0,
                                int64_t(g.deterministic),
                                int64_t(ws_bytes),
                                int64_t(g.fp8),
                                int64_t(g.ws_fallback)};
  {
    std::lock_guard<std::mutex> lock(cache_mutex());
    const auto it = cache().find(key);
    if (it != cache().end()) return p->choice = it->second, CUBLAS_STATUS_SUCCESS;
  }
  Choice c{};
  s = choose(g, h, *p, ws_bytes, &c);
  if ((s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && !c.ok)) &&
      g.ws_fallback > ws_bytes)
    s = choose(g, h, *p, g.ws_fallback, &c);
  // A refusal (NOT_SUPPORTED or no result) is an answer worth caching; other failures are not.
  if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED) return s;
  p->choice = c;
  std::lock_guard<std::mutex> lock(cache_mutex());
  cache().emplace(key, p->choice);
  return CUBLAS_STATUS_SUCCESS;
}

constexpr int kTuneCandidates = 16;
constexpr int kTuneRounds = 3;
constexpr double kTuneTurnUs = 20000;  // back-to-back runs per candidate and round

// Microseconds per run of `runs` back-to-back runs of `run` (which enqueues one GEMM), by CUDA
// events; synchronises the stream.
template <typename RUN>
cudaError_t time_runs(cudaStream_t stream, cudaEvent_t e0, cudaEvent_t e1, int runs, RUN run,
                      double* us) {
  cudaEventRecord(e0, stream);
  for (int i = 0; i < runs; ++i) run();
  cudaEventRecord(e1, stream);
  cudaError_t e = cudaEventSynchronize(e1);
  float ms = 0.f;
  if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
  *us = double(ms) * 1e3 / runs;
  return e;
}

// Tuning (cublaslt_tune.hpp): every heuristic answer within the choice's offer runs on g's
// operands, D going to a scratch buffer so the call's output (and C where it is D) stays as it
// was; the fastest becomes the choice, in the cache and the tune table. The candidates take turns
// of ~20 ms of back-to-back runs, three rounds, and each is scored by its median turn: they all
// run under the sustained load of a prefill call (clocks under the power limit). Timed instead by a
// few isolated runs, the choices favoured kernels that are fast in a burst and slower sustained
// (H200, session 32: llama3-70b M = 4096 8414 -> 8691 us). The offered workspace is zeroed
// afterwards (candidates may touch more of it than the choice), as the contract asks.
fmlp_status_t tune(const LtGemm& g, cublasLtHandle_t h, void* ws, Prepared* p,
                   cudaStream_t stream) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "tuning times GEMMs on the stream and cannot run while it is captured into a "
                "CUDA graph; tune before the capture (the capture then records the tuned choice)");
  std::vector<cublasLtMatmulHeuristicResult_t> res(kTuneCandidates);
  int count = 0;
  const cublasStatus_t hs =
      heuristic(g, h, *p, p->choice.offer, kTuneCandidates, res.data(), &count);
  if (hs != CUBLAS_STATUS_SUCCESS || count == 0) return FMLP_SUCCESS;  // keep the current choice
  const size_t d_bytes = size_t((g.n - 1) * p->ldd + g.m) * dtype_size(g.dtype);
  void* scratch = nullptr;
  if (cudaMalloc(&scratch, d_bytes) != cudaSuccess)
    return cudaGetLastError(),
           fail(FMLP_ERROR_OUT_OF_MEMORY, "tuning needs {} bytes of scratch for the GEMM's output",
                d_bytes);
  const float alpha = 1.f, beta = g.c ? 1.f : 0.f;
  // C is the call's own C (D itself when the GEMM runs in place), which no candidate writes.
  const void* c = p->c;
  auto run = [&](int i) {
    return cublasLtMatmul(h, p->ds.op, &alpha, g.a, p->ds.a, g.b, p->ds.b, &beta, c, p->ds.c,
                          scratch, p->ds.d, &res[size_t(i)].algo, ws, res[size_t(i)].workspaceSize,
                          stream);
  };
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  cudaError_t ce = cudaEventCreate(&e0);
  if (ce == cudaSuccess) ce = cudaEventCreate(&e1);
  std::vector<int> cand, runs;  // candidates that launch, and their runs per turn
  std::vector<std::vector<double>> turns;
  for (int i = 0; i < count && ce == cudaSuccess; ++i) {
    if (run(i) != CUBLAS_STATUS_SUCCESS) continue;  // an answer this problem cannot launch
    double one = 0;
    ce = time_runs(
        stream, e0, e1, 1, [&] { run(i); }, &one);
    cand.push_back(i);
    runs.push_back(std::clamp(int(kTuneTurnUs / std::max(one, 1.0)), 2, 1000));
  }
  turns.resize(cand.size());
  for (int r = 0; r < kTuneRounds && ce == cudaSuccess; ++r)
    for (size_t q = 0; q < cand.size() && ce == cudaSuccess; ++q) {
      double us = 0;
      ce = time_runs(
          stream, e0, e1, runs[q], [&] { run(cand[q]); }, &us);
      turns[q].push_back(us);
    }
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  double best = 0;
  int best_i = -1;
  for (size_t q = 0; q < cand.size() && ce == cudaSuccess; ++q) {
    std::sort(turns[q].begin(), turns[q].end());
    const double us = turns[q][turns[q].size() / 2];
    if (best_i < 0 || us < best) best = us, best_i = cand[q];
  }
  if (ce == cudaSuccess && p->choice.offer > 0)
    ce = cudaMemsetAsync(ws, 0, p->choice.offer, stream);
  if (ce == cudaSuccess) ce = cudaStreamSynchronize(stream);
  cudaFree(scratch);
  if (ce != cudaSuccess)
    return fail(FMLP_ERROR_CUDA, "tuning the {} GEMM m={} n={} k={} failed: {}",
                fmlp_dtype_name(g.dtype), g.m, g.n, g.k, cudaGetErrorString(ce));
  if (best_i < 0) return FMLP_SUCCESS;
  const cublasLtMatmulHeuristicResult_t& r = res[size_t(best_i)];
  p->choice = {true, r.algo, r.workspaceSize, p->choice.offer};
  lt_tuned_put(p->key, {r.algo, r.workspaceSize, best});
  std::lock_guard<std::mutex> lock(cache_mutex());
  cache()[p->key] = p->choice;
  return FMLP_SUCCESS;
}

}  // namespace

void lt_cache_clear() {
  std::lock_guard<std::mutex> lock(cache_mutex());
  cache().clear();
}

bool lt_available(const LtGemm& g, size_t ws_bytes) {
  cublasLtHandle_t h;
  Prepared p;
  return cublaslt_handle(g.device, &h) == FMLP_SUCCESS &&
         prepare(g, h, ws_bytes, &p) == CUBLAS_STATUS_SUCCESS && p.choice.ok;
}

fmlp_status_t lt_matmul(const LtGemm& g, void* ws, size_t ws_bytes, size_t* ws_used,
                        cudaStream_t stream) {
  cublasLtHandle_t h;
  if (const fmlp_status_t st = cublaslt_handle(g.device, &h); st != FMLP_SUCCESS) return st;
  if (const fmlp_status_t st = lt_tune_env_status(); st != FMLP_SUCCESS) return st;
  Prepared p;
  const cublasStatus_t s = prepare(g, h, ws_bytes, &p);
  if (s != CUBLAS_STATUS_SUCCESS || !p.choice.ok)
    return fail(FMLP_ERROR_NOT_SUPPORTED,
                "cuBLASLt has no algorithm for the {}{} GEMM m={} n={} k={} (lda {} ldb {} ldc "
                "{} ldd {}, pointer alignments A {} B {} C {} D {} bytes): {}; align the "
                "tensors to 16 bytes or use fmlp_mlp_with_kernel with mlp_decode_sm90_splitk",
                g.fp8 ? "fp8 e4m3 -> " : "", fmlp_dtype_name(g.dtype), g.m, g.n, g.k, g.lda, p.ldb,
                p.ldc, p.ldd, p.al[0], p.al[1], p.al[2], p.al[3],
                s != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(s) : "no result");
  if (lt_tuning() && lt_tune_first_in_scope(p.key))
    if (const fmlp_status_t st = tune(g, h, ws, &p, stream); st != FMLP_SUCCESS) return st;
  const float alpha = 1.f, beta = g.c ? 1.f : 0.f;
  const cublasStatus_t r =
      cublasLtMatmul(h, p.ds.op, &alpha, g.a, p.ds.a, g.b, p.ds.b, &beta, p.c, p.ds.c, g.d, p.ds.d,
                     &p.choice.algo, ws, p.choice.workspace, stream);
  if (r != CUBLAS_STATUS_SUCCESS)
    return fail(FMLP_ERROR_CUDA, "cublasLtMatmul ({}{} m={} n={} k={}) failed: {}",
                g.fp8 ? "fp8 e4m3 -> " : "", fmlp_dtype_name(g.dtype), g.m, g.n, g.k,
                cublasLtGetStatusString(r));
  *ws_used = p.choice.workspace;
  return FMLP_SUCCESS;
}

namespace {

std::mutex& handle_mutex() {
  static std::mutex m;
  return m;
}

// Handles live for the process: destroying them from a static destructor can run after the
// CUDA driver has shut down.
std::array<cublasLtHandle_t, kMaxDevices>& handles() {
  static std::array<cublasLtHandle_t, kMaxDevices> h{};
  return h;
}

}  // namespace

fmlp_status_t cublaslt_handle(int device, cublasLtHandle_t* out) {
  if (device < 0 || device >= kMaxDevices)
    return fail(FMLP_ERROR_NOT_SUPPORTED, "cuda:{}: the cuBLASLt entries handle devices 0..{}",
                device, kMaxDevices - 1);
  std::lock_guard<std::mutex> lock(handle_mutex());
  cublasLtHandle_t& h = handles()[size_t(device)];
  if (h == nullptr) {
    int prev = -1;
    cudaGetDevice(&prev);
    if (prev != device) cudaSetDevice(device);
    const cublasStatus_t s = cublasLtCreate(&h);
    if (prev >= 0 && prev != device) cudaSetDevice(prev);
    if (s != CUBLAS_STATUS_SUCCESS) {
      h = nullptr;
      return fail(FMLP_ERROR_CUDA, "cublasLtCreate on cuda:{} failed: {}", device,
                  cublasLtGetStatusString(s));
    }
  }
  *out = h;
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
