// The process's cuBLASLt handle per device, shared by every cuBLASLt entry (mlp prefill, linear,
// linear fp8). Created on first use with the device made current; cublasLtCreate must not run
// inside a CUDA-graph capture, so the entries' workspace-size queries create it.
#pragma once
#include <cublasLt.h>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

fmlp_status_t cublaslt_handle(int device, cublasLtHandle_t* out);

}  // namespace fmlp::detail
