// Launch contracts of the cuda linear and softmax kernels, shared by their launchers and the op
// table.
#pragma once
#include <cstddef>
#include <string>

#include "core/linear_desc.hpp"

namespace fmlp::detail {

int cuda_sm_count(int device);            // backend.cpp; 0 when unreadable
int64_t cuda_l2_bytes(int device);        // backend.cpp; 0 when unreadable
int cuda_compute_capability(int device);  // backend.cpp; major * 10 + minor, 0 when unreadable

// Common checks of the cuda op kernels: device memory, compute capability 8.0+, 32-bit sizes.
bool cuda_op_device_ok(fmlp_device_type_t device, int device_id, std::string* why);

// linear_sm80_mma (linear_mma.cu): the tensor-core entry, listed in linear_gemv.cu.
bool linear_mma_supports(const LinearDesc& d, std::string* why);
size_t linear_mma_workspace(const LinearDesc& d);
fmlp_status_t linear_mma_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                             void* stream);

// linear_sm80_stream (linear_stream.cu): the memory-order GEMV for M <= 4, 16-bit weights.
bool linear_stream_supports(const LinearDesc& d, std::string* why);
size_t linear_stream_workspace(const LinearDesc& d);
fmlp_status_t linear_stream_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                                void* stream);

// linear_sm90_wgmma_fp8 (linear_wgmma_fp8.cu): fp8 weights on the tensor cores for M <= 4, sm_90a.
bool linear_wgmma_fp8_supports(const LinearDesc& d, std::string* why);
size_t linear_wgmma_fp8_workspace(const LinearDesc& d);
fmlp_status_t linear_wgmma_fp8_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                                   void* stream);

// linear_sm90_cublaslt (linear_cublaslt.cpp): one cuBLASLt GEMM for M >= 2, listed first.
bool linear_cublaslt_supports(const LinearDesc& d, std::string* why);
size_t linear_cublaslt_workspace(const LinearDesc& d);
fmlp_status_t linear_cublaslt_run(const fmlp_linear_args_t& a, const LinearDesc& d, void* ws,
                                  void* stream);

}  // namespace fmlp::detail
