// cuBLASLt for the prefill path: lazily created per-device handles and a mutex-protected cache of
// heuristic answers. Descriptors live on the stack (the *Init forms), so a cached call allocates
// nothing and only launches.
#include "cuda/mlp_prefill_cublaslt.cuh"

#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/cublaslt_handle.hpp"

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

using Key = std::array<int64_t, 18>;
struct Choice {
  cublasLtMatmulAlgo_t algo;
  size_t workspace;
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
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t n) {
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(ds->op, attr, v, n);
  };
  set(CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
  set(CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
  set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
  if (g.bias != nullptr) {
    const int32_t bt = int32_t(t);
    set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias));
    set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt));
  }
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutInit(ds->a, t, uint64_t(g.k), uint64_t(g.m), g.lda);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutInit(ds->b, t, uint64_t(g.k), uint64_t(g.n), ldb);
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

fmlp_status_t lt_matmul(const LtGemm& g, void* ws, size_t ws_bytes, size_t* ws_used,
                        cudaStream_t stream) {
  cublasLtHandle_t h;
  if (const fmlp_status_t st = cublaslt_handle(g.device, &h); st != FMLP_SUCCESS) return st;
  // With one column (one token) the leading dimension is never used; cuBLASLt still wants it to
  // cover the rows.
  const bool one = g.n == 1;
  const int64_t ldb = one ? std::max(g.ldb, g.k) : g.ldb;
  const void* c = g.c ? g.c : g.d;
  const int64_t ldd = one ? std::max(g.ldd, g.m) : g.ldd;
  const int64_t ldc = g.c ? (one ? std::max(g.ldc, g.m) : g.ldc) : ldd;
  Descriptors ds;
  cublasStatus_t s = describe(g, ldb, ldc, ldd, &ds);
  if (s != CUBLAS_STATUS_SUCCESS)
    return fail(FMLP_ERROR_INTERNAL, "cuBLASLt descriptor setup failed: {}",
                cublasLtGetStatusString(s));

  const Key key{g.device,
                int64_t(g.dtype),
                g.m,
                g.n,
                g.k,
                g.lda,
                ldb,
                ldc,
                ldd,
                int64_t(g.c != nullptr) + 2 * int64_t(g.c == g.d),
                int64_t(g.epilogue),
                alignment(g.a, g.lda, g.dtype),
                alignment(g.b, ldb, g.dtype),
                alignment(c, ldc, g.dtype),
                alignment(g.d, ldd, g.dtype),
                g.bias ? alignment(g.bias) : 0,
                int64_t(g.deterministic),
                int64_t(ws_bytes)};
  Choice choice{};
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(cache_mutex());
    const auto it = cache().find(key);
    if (it != cache().end()) choice = it->second, found = true;
  }
  if (!found) {
    cublasLtMatmulPreferenceOpaque_t pref_s;
    cublasLtMatmulPreference_t pref = &pref_s;
    s = cublasLtMatmulPreferenceInit(pref);
    auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, size_t n) {
      if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceSetAttribute(pref, attr, v, n);
    };
    const uint64_t max_ws = ws_bytes;
    const uint32_t al[4] = {uint32_t(key[11]), uint32_t(key[12]), uint32_t(key[13]),
                            uint32_t(key[14])};
    set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], sizeof(al[0]));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], sizeof(al[1]));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], sizeof(al[2]));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[3], sizeof(al[3]));
    if (g.deterministic) {
      // Split-K reductions are the only place where the summation order could depend on the
      // algorithm's scheduling; without them every output is one fixed-order dot product.
      const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
      set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &none, sizeof(none));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulAlgoGetHeuristic(h, ds.op, ds.a, ds.b, ds.c, ds.d, pref, 1, &result,
                                         &count);
    if (s != CUBLAS_STATUS_SUCCESS || count == 0)
      return fail(FMLP_ERROR_NOT_SUPPORTED,
                  "cuBLASLt has no algorithm for the {} GEMM m={} n={} k={} (lda {} ldb {} ldc "
                  "{} ldd {}, pointer alignments A {} B {} C {} D {} bytes): {}; align the "
                  "tensors to 16 bytes or use fmlp_mlp_with_kernel with mlp_decode_sm90_splitk",
                  fmlp_dtype_name(g.dtype), g.m, g.n, g.k, g.lda, ldb, ldc, ldd, al[0], al[1],
                  al[2], al[3],
                  s != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(s) : "no result");
    choice = {result.algo, result.workspaceSize};
    std::lock_guard<std::mutex> lock(cache_mutex());
    cache().emplace(key, choice);
  }

  const float alpha = 1.f, beta = g.c ? 1.f : 0.f;
  s = cublasLtMatmul(h, ds.op, &alpha, g.a, ds.a, g.b, ds.b, &beta, c, ds.c, g.d, ds.d,
                     &choice.algo, ws, choice.workspace, stream);
  if (s != CUBLAS_STATUS_SUCCESS)
    return fail(FMLP_ERROR_CUDA, "cublasLtMatmul ({} m={} n={} k={}) failed: {}",
                fmlp_dtype_name(g.dtype), g.m, g.n, g.k, cublasLtGetStatusString(s));
  *ws_used = choice.workspace;
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
