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

}  // namespace fmlp::detail
