// linear_sm90_cublaslt: y[M, N] = x[M, K] W^T + b as one cuBLASLt GEMM with the bias in its
// epilogue. Once a weight is read for more than one token, a plain GEMM is the job and cuBLASLt's
// tensor-core kernels are the reference implementation; at M = 1 the planner
// (planner.cpp) picks it or the GEMV by shape. The GEMV entries keep everything this one
// does not take (mixed or fp8 dtypes, misaligned views, other bias dtypes).
#include <cuda_runtime.h>

#include "core/error.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/lt_gemm.hpp"
#include "cuda/linear/entries.hpp"

namespace fmlp::detail {

bool linear_sm90_cublaslt_supports(const LinearDesc& d, std::string* why) {
  if (refuses_block_scales(d, why)) return false;
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (d.k == 0 || d.n == 0)
    return (*why = "K = 0 or N = 0: nothing to multiply; the GEMV entry writes y = bias", false);
  if ((d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16) || d.act_dtype != d.w_dtype)
    return (*why = fmt::format("x {} with {} weights: this entry runs bf16 or fp16 GEMMs with x "
                               "and W of one dtype",
                               fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype)),
            false);
  if (d.bias_dtype != FMLP_DTYPE_INVALID && d.bias_dtype != d.w_dtype)
    return (*why = fmt::format("a {} bias with {} weights: the GEMM epilogue takes the bias in the "
                               "weights' dtype",
                               fmlp_dtype_name(d.bias_dtype), fmlp_dtype_name(d.w_dtype)),
            false);
  if (!d.w_vec16 || !d.io_vec16)
    return (*why = "W, x or y is not 16-byte aligned (base or row stride)", false);
  return true;
}

size_t linear_sm90_cublaslt_workspace(const LinearDesc& d) {
  lt_prepare(d.device_id);  // the size query precedes any graph capture: create the handle here
  return cuda_scratch_workspace_bytes(kLtWorkspaceBytes);  // cuBLASLt's workspace is scratch
}

fmlp_status_t linear_sm90_cublaslt_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                                       void* stream) {
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  LtGemm g;
  g.device = d.device_id;
  g.dtype = d.w_dtype;
  g.m = d.n;
  g.n = d.m;
  g.k = d.k;
  g.a = a.w.data;
  g.lda = d.n > 1 ? a.w.stride[0] : d.k;
  g.b = a.x.data;
  g.ldb = a.x.stride[0];
  g.d = a.y.data;
  g.ldd = a.y.stride[0];
  g.bias = d.bias_dtype != FMLP_DTYPE_INVALID ? a.bias.data : nullptr;
  g.epilogue = g.bias ? LtEpilogue::kBias : LtEpilogue::kNone;
  const auto s = static_cast<cudaStream_t>(stream);
  // Split-K algorithms leave partial sums behind: in the scratch part, where nothing needs
  // clearing (fusedmlp.h, the workspace contract).
  size_t used = 0;
  return lt_matmul(g, cuda_workspace_scratch(ws), kLtWorkspaceBytes, &used, s);
}

}  // namespace fmlp::detail
