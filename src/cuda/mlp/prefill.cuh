// The prefill path's launch contract, shared by its launcher (mlp_prefill.cu), the op table
// (backend.cpp) and the planner (planner.cpp).
#pragma once
#include <cstddef>
#include <string>

#include "core/mlp_desc.hpp"

namespace fmlp::detail {

constexpr const char* kPrefillKernelName = "mlp_prefill_sm90_cublaslt";

bool mlp_prefill_sm90_cublaslt_supports(const MlpDesc& d, std::string* why);
size_t mlp_prefill_sm90_cublaslt_workspace(const MlpDesc& d);
fmlp_status_t mlp_prefill_sm90_cublaslt_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                            void* workspace, void* stream);
// For explain (the planner): which GEMM1 the path runs for d ("" when not gated).
const char* mlp_prefill_gemm1_note(const MlpDesc& d);

// The same entry for fp8 e4m3 weights (mlp_prefill_fp8.cu: W8A8 with per-token activation
// scales); the three functions above hand fp8 requests to these.
bool mlp_prefill_fp8_supports(const MlpDesc& d, std::string* why);
size_t mlp_prefill_fp8_workspace(const MlpDesc& d);
fmlp_status_t mlp_prefill_fp8_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* workspace,
                                  void* stream);

}  // namespace fmlp::detail
