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

// The CUDA-core split-hidden kernels (gemv, prefetch): their shared preconditions (CUDA memory,
// not deterministic, M <= max_tokens, bf16/fp16 weights, d_in and hidden multiples of 8, 16-byte
// aligned weight rows), and their workspace: fp32 accumulators [M, d_out] and a block counter,
// both zero between calls (finish_last_block in decode_common.cuh leaves them so).
bool split_hidden_supports(const MlpDesc& d, int max_tokens, std::string* why);
size_t split_hidden_workspace(const MlpDesc& d);
void split_hidden_scratch(void* workspace, const MlpDesc& d, float** acc, unsigned** counter);

// Two memory-order weight streams (mlp_decode_stream.cu): M <= 4, bf16/fp16 weights.
bool mlp_decode_sm80_stream_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm80_stream_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm80_stream_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                         void* workspace, void* stream);

// Two fp8 tensor-core weight streams (mlp_decode_wgmma_fp8.cu): M <= 4, e4m3 weights, sm_90a.
bool mlp_decode_sm90_wgmma_fp8_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm90_wgmma_fp8_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm90_wgmma_fp8_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
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
