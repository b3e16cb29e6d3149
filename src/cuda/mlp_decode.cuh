// The decode kernel's launch contract, shared by its launcher (mlp_decode.cu) and the op table
// (backend.cpp).
#pragma once
#include <cstddef>
#include <string>

#include "core/mlp_desc.hpp"

namespace fmlp::detail {

// Multiprocessor count of a device (cached); 0 when it cannot be read.
int cuda_sm_count(int device);

bool mlp_decode_sm90_splitk_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm90_splitk_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm90_splitk_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                         void* workspace, void* stream);

bool mlp_decode_sm90_cluster_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm90_cluster_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm90_cluster_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                          void* workspace, void* stream);

bool mlp_decode_sm80_prefetch_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm80_prefetch_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm80_prefetch_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                           void* workspace, void* stream);

bool mlp_decode_sm80_gemv_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm80_gemv_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm80_gemv_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* workspace,
                                       void* stream);

}  // namespace fmlp::detail
