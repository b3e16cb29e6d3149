// linear_sm90_cublaslt_fp8: W8A8 y[M, N] = (x_scale[m] w_scale[n]) x[M, K] W^T + b as one
// cuBLASLt fp8 GEMM (e4m3 x e4m3, fp32 accumulation), the semantics of torch._scaled_mm. Per-row
// scales are cuBLASLt's outer-vector scale mode (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F: the
// A vector scales the N weight rows, the B vector the M tokens), per-tensor ones its scalar mode;
// the bias rides in the epilogue. For the few tokens of decode the fp8 tensor-core stream
// (linear_sm80_mma) reads the weights faster; this entry is for prefill-sized M.
// Whether the library has an algorithm for a scale-mode combination depends on its version and
// the GPU, so supports() asks its heuristic once per problem class and caches the answer.
#include <cublasLt.h>

#include <array>
#include <map>
#include <mutex>

#include "core/error.hpp"
#include "cuda/common/cublaslt_handle.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/linear/entries.hpp"

namespace fmlp::detail {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;

cudaDataType_t cuda_type(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F32 ? CUDA_R_32F : t == FMLP_DTYPE_F16 ? CUDA_R_16F : CUDA_R_16BF;
}

int32_t scale_mode(ScaleKind k) {
  return k == ScaleKind::kPerRow ? CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
                                 : CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

struct Descriptors {
  cublasLtMatmulDescOpaque_t op_s;
  cublasLtMatrixLayoutOpaque_t a_s, b_s, d_s;
  cublasLtMatmulDesc_t op = &op_s;
  cublasLtMatrixLayout_t a = &a_s, b = &b_s, d = &d_s;
};

// D[N, M] (column-major) = W (A, transposed: [K, N] with columns the weight rows) times x (B,
// [K, M] with columns the tokens): the TN layout cuBLASLt's fp8 kernels require.
cublasStatus_t describe(const LinearDesc& d, int64_t lda, int64_t ldb, int64_t ldd,
                        const void* w_scale, const void* x_scale, const void* bias,
                        Descriptors* ds) {
  cublasStatus_t s = cublasLtMatmulDescInit(ds->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t n) {
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(ds->op, attr, v, n);
  };
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const int32_t am = scale_mode(d.w_scale), bm = scale_mode(d.x_scale);
  const cublasLtEpilogue_t epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  set(CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
  set(CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
  set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof(am));
  set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof(bm));
  set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof(w_scale));
  set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof(x_scale));
  set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
  if (bias) {
    const int32_t bt = int32_t(cuda_type(d.bias_dtype));
    set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
    set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt));
  }
  const cudaDataType_t yt = cuda_type(d.out_dtype);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutInit(ds->a, CUDA_R_8F_E4M3, uint64_t(d.k), uint64_t(d.n), lda);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutInit(ds->b, CUDA_R_8F_E4M3, uint64_t(d.k), uint64_t(d.m), ldb);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutInit(ds->d, yt, uint64_t(d.n), uint64_t(d.m), ldd);
  return s;
}

using Key = std::array<int64_t, 11>;
struct Choice {
  bool ok;
  cublasLtMatmulAlgo_t algo;
  size_t workspace;
};

// The heuristic's answer for this problem, asked once (16-byte aligned operands: supports()
// requires them) and cached.
fmlp_status_t choose(const LinearDesc& d, int64_t lda, int64_t ldb, int64_t ldd, Choice* out) {
  static std::mutex mu;
  static std::map<Key, Choice> cache;
  const Key key{d.device_id,
                d.m,
                d.n,
                d.k,
                lda,
                ldb,
                ldd,
                int64_t(d.out_dtype),
                int64_t(d.bias_dtype),
                int64_t(d.w_scale) * 4 + int64_t(d.x_scale),
                int64_t(kWorkspaceBytes)};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (const auto it = cache.find(key); it != cache.end()) return *out = it->second, FMLP_SUCCESS;
  }
  cublasLtHandle_t h;
  if (const fmlp_status_t st = cublaslt_handle(d.device_id, &h); st != FMLP_SUCCESS) return st;
  const float dummy = 1.f;  // the heuristic reads the scale modes, not the pointers
  Descriptors ds;
  cublasStatus_t s = describe(d, lda, ldb, ldd, &dummy, &dummy,
                              d.bias_dtype != FMLP_DTYPE_INVALID ? &dummy : nullptr, &ds);
  cublasLtMatmulPreferenceOpaque_t pref_s;
  cublasLtMatmulPreference_t pref = &pref_s;
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceInit(pref);
  const uint64_t max_ws = kWorkspaceBytes;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &max_ws, sizeof(max_ws));
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(h, ds.op, ds.a, ds.b, ds.d, ds.d, pref, 1, &result, &count);
  const Choice c{s == CUBLAS_STATUS_SUCCESS && count > 0, result.algo, result.workspaceSize};
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace(key, c);
  *out = c;
  return FMLP_SUCCESS;
}

}  // namespace

bool linear_sm90_cublaslt_fp8_supports(const LinearDesc& d, std::string* why) {
  if (refuses_block_scales(d, why)) return false;
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (!d.w8a8())
    return (*why = "fp8 x and fp8 W (W8A8) only; weight-only fp8 goes to the streaming entries",
            false);
  if (cuda_compute_capability(d.device_id) < 89)
    return (*why = "cuBLASLt's fp8 GEMMs need sm_89 or newer", false);
  if (d.k == 0 || d.k % 16 != 0 || d.n % 16 != 0 || !d.w_vec16 || !d.io_vec16)
    return (*why =
                "cuBLASLt's fp8 GEMMs need K and N multiples of 16 and 16-byte aligned x, W "
                "and y (base and row stride)",
            false);
  if (d.bias_dtype != FMLP_DTYPE_INVALID &&
      (d.bias_dtype != d.out_dtype || d.out_dtype == FMLP_DTYPE_F32))
    return (*why = fmt::format("a {} bias with {} output: the fp8 GEMM epilogue takes a bias in "
                               "the output dtype, bf16 or f16",
                               fmlp_dtype_name(d.bias_dtype), fmlp_dtype_name(d.out_dtype)),
            false);
  Choice c{};
  if (choose(d, d.k, d.k, d.n, &c) != FMLP_SUCCESS || !c.ok)
    return (*why = fmt::format("this cuBLASLt has no fp8 algorithm for scales w {} / x {} with {} "
                               "output on this GPU",
                               d.w_scale == ScaleKind::kPerRow ? "per row" : "per tensor",
                               d.x_scale == ScaleKind::kPerRow ? "per row" : "per tensor",
                               fmlp_dtype_name(d.out_dtype)),
            false);
  return true;
}

size_t linear_sm90_cublaslt_fp8_workspace(const LinearDesc& d) {
  cublasLtHandle_t h;
  cublaslt_handle(d.device_id,
                  &h);  // the size query precedes any graph capture: create the handle here
  return cuda_scratch_workspace_bytes(kWorkspaceBytes);  // cuBLASLt's workspace is scratch
}

fmlp_status_t linear_sm90_cublaslt_fp8_run(const fmlp_linear_args_t& a, const LinearDesc& d,
                                           void* ws, void* stream) {
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  // With one row (token or weight) the leading dimension is never used; cuBLASLt still wants it
  // to cover the column.
  const int64_t lda = d.n > 1 ? a.w.stride[0] : d.k;
  const int64_t ldb = d.m > 1 ? a.x.stride[0] : d.k;
  const int64_t ldd = d.m > 1 ? a.y.stride[0] : d.n;
  Choice c{};
  if (const fmlp_status_t st = choose(d, lda, ldb, ldd, &c); st != FMLP_SUCCESS) return st;
  if (!c.ok)
    return fail(FMLP_ERROR_NOT_SUPPORTED,
                "cuBLASLt has no fp8 algorithm for M={} N={} K={} with these strides; use "
                "fmlp_linear_with_kernel with linear_sm80_gemv",
                d.m, d.n, d.k);
  cublasLtHandle_t h;
  if (const fmlp_status_t st = cublaslt_handle(d.device_id, &h); st != FMLP_SUCCESS) return st;
  Descriptors ds;
  const void* bias = d.bias_dtype != FMLP_DTYPE_INVALID ? a.bias.data : nullptr;
  cublasStatus_t s = describe(d, lda, ldb, ldd, a.w_scale.data, a.x_scale.data, bias, &ds);
  const float alpha = 1.f, beta = 0.f;
  const auto st = static_cast<cudaStream_t>(stream);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmul(h, ds.op, &alpha, a.w.data, ds.a, a.x.data, ds.b, &beta, a.y.data, ds.d,
                       a.y.data, ds.d, &c.algo, cuda_workspace_scratch(ws), c.workspace, st);
  if (s != CUBLAS_STATUS_SUCCESS)
    return fail(FMLP_ERROR_CUDA, "cublasLtMatmul (fp8 M={} N={} K={}) failed: {}", d.m, d.n, d.k,
                cublasLtGetStatusString(s));
  return FMLP_SUCCESS;  // split-K partial sums stay in the scratch part: nothing to clear
}

}  // namespace fmlp::detail
