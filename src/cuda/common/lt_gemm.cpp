// cuBLASLt for the prefill path: lazily created per-device handles and a mutex-protected cache of
// heuristic answers. Descriptors live on the stack (the *Init forms), so a cached call allocates
// nothing and only launches.
#include "cuda/common/lt_gemm.hpp"

#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/cublaslt_handle.hpp"

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

using Key = std::array<int64_t, 20>;
struct Choice {
  bool ok;  // false: the heuristic had no algorithm (cached too, so supports() asks once)
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

// One GEMM's descriptors, leading dimensions and cached heuristic answer.
struct Prepared {
  Descriptors ds;
  int64_t ldb = 0, ldc = 0, ldd = 0;
  const void* c = nullptr;
  uint32_t al[4] = {};  // alignments of A, B, C, D in bytes
  Choice choice{};
};

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
  const Key key{g.device,
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
  cublasLtMatmulPreferenceOpaque_t pref_s;
  cublasLtMatmulPreference_t pref = &pref_s;
  s = cublasLtMatmulPreferenceInit(pref);
  auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, size_t n) {
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceSetAttribute(pref, attr, v, n);
  };
  const uint64_t max_ws = ws_bytes;
  set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws));
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &p->al[0], sizeof(p->al[0]));
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &p->al[1], sizeof(p->al[1]));
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &p->al[2], sizeof(p->al[2]));
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &p->al[3], sizeof(p->al[3]));
  if (g.deterministic) {
    // Split-K reductions are the only place where the summation order could depend on the
    // algorithm's scheduling; without them every output is one fixed-order dot product.
    const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &none, sizeof(none));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(h, p->ds.op, p->ds.a, p->ds.b, p->ds.c, p->ds.d, pref, 1,
                                       &result, &count);
  if ((s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && count == 0)) &&
      g.ws_fallback > ws_bytes) {
    const uint64_t more = g.ws_fallback;
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &more,
                                             sizeof(more));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulAlgoGetHeuristic(h, p->ds.op, p->ds.a, p->ds.b, p->ds.c, p->ds.d, pref, 1,
                                         &result, &count);
  }
  // A refusal (NOT_SUPPORTED or no result) is an answer worth caching; other failures are not.
  if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED) return s;
  p->choice = {s == CUBLAS_STATUS_SUCCESS && count > 0, result.algo, result.workspaceSize};
  std::lock_guard<std::mutex> lock(cache_mutex());
  cache().emplace(key, p->choice);
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

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
