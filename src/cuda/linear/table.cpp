// The cuda linear entries in table order (their contracts: linear/entries.hpp).
#include "core/linear_desc.hpp"
#include "cuda/linear/entries.hpp"

namespace fmlp::detail {
namespace {

// Table order is the planner's order past its M = 1 choice (linear/planner.cpp): cuBLASLt first
// for 16-bit M >= 2 (measured on an H200: our tensor-core entry reached 0.15-0.9x of cuBLAS at
// M = 4..64), then the tensor-core entry (fp8 weights at M <= 64, W8A8 included), cuBLASLt's fp8
// GEMM for W8A8 beyond, the streams, the GEMV for everything else. The fp8 wgmma stream sits
// behind the entries it has not beaten yet (linear/planner.cpp); FMLP_LINEAR_KERNEL forces it.
const LinearKernel kCudaKernels[] = {
    {"linear_sm90_cublaslt", FMLP_BACKEND_CUDA, linear_sm90_cublaslt_supports,
     linear_sm90_cublaslt_workspace, linear_sm90_cublaslt_run, /*scratch=*/true},
    {"linear_sm80_mma", FMLP_BACKEND_CUDA, linear_sm80_mma_supports, linear_sm80_mma_workspace,
     linear_sm80_mma_run},
    {"linear_sm90_cublaslt_fp8", FMLP_BACKEND_CUDA, linear_sm90_cublaslt_fp8_supports,
     linear_sm90_cublaslt_fp8_workspace, linear_sm90_cublaslt_fp8_run, /*scratch=*/true},
    {"linear_sm80_stream", FMLP_BACKEND_CUDA, linear_sm80_stream_supports,
     linear_sm80_stream_workspace, linear_sm80_stream_run},
    {"linear_sm90_wgmma_fp8", FMLP_BACKEND_CUDA, linear_sm90_wgmma_fp8_supports,
     linear_sm90_wgmma_fp8_workspace, linear_sm90_wgmma_fp8_run},
    {"linear_sm80_gemv", FMLP_BACKEND_CUDA, linear_sm80_gemv_supports, linear_sm80_gemv_workspace,
     linear_sm80_gemv_run},
};

}  // namespace

LinearKernelList cuda_linear_kernels() {
  return {kCudaKernels, sizeof(kCudaKernels) / sizeof(kCudaKernels[0])};
}

}  // namespace fmlp::detail
