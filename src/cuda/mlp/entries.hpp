// The launch contracts of the cuda mlp entries, one block per entry in table order
// (mlp/table.cpp lists them; each is defined in the file of its name: mlp_decode_sm80_stream in
// mlp/decode_sm80_stream.cu, ...), shared by their launchers, the table and the planner.
#pragma once
#include <cstddef>
#include <string>

#include "core/mlp_desc.hpp"

namespace fmlp::detail {

// Two memory-order weight streams (decode_sm80_stream.cu): M <= 4, bf16/fp16 weights.
bool mlp_decode_sm80_stream_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm80_stream_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm80_stream_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                         void* workspace, void* stream);

bool mlp_decode_sm80_prefetch_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm80_prefetch_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm80_prefetch_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                           void* workspace, void* stream);

bool mlp_decode_sm80_gemv_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm80_gemv_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm80_gemv_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* workspace,
                                       void* stream);

// The CUDA-core split-hidden kernels (gemv, prefetch): their shared preconditions (CUDA memory,
// not deterministic, M <= max_tokens, bf16/fp16 weights, d_in and hidden multiples of 8, 16-byte
// aligned weight rows), and their workspace: fp32 accumulators [M, d_out] and a block counter,
// both zero between calls (finish_last_block in common/decode_common.cuh leaves them so). In
// decode_operands.cu.
bool split_hidden_supports(const MlpDesc& d, int max_tokens, std::string* why);
size_t split_hidden_workspace(const MlpDesc& d);
void split_hidden_scratch(void* workspace, const MlpDesc& d, float** acc, unsigned** counter);

bool mlp_decode_sm90_cluster_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm90_cluster_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm90_cluster_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                          void* workspace, void* stream);

// Two fp8 tensor-core weight streams (decode_sm90_wgmma_fp8.cu): M <= 4, e4m3 weights, sm_90a.
bool mlp_decode_sm90_wgmma_fp8_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm90_wgmma_fp8_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm90_wgmma_fp8_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                            void* workspace, void* stream);

bool mlp_decode_sm90_splitk_supports(const MlpDesc& d, std::string* why);
size_t mlp_decode_sm90_splitk_workspace(const MlpDesc& d);
fmlp_status_t mlp_decode_sm90_splitk_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                         void* workspace, void* stream);

// The prefill path (prefill_sm90_cublaslt.cu), which the planner (mlp/planner.cpp) picks from
// the crossover M on.
constexpr const char* kPrefillKernelName = "mlp_prefill_sm90_cublaslt";

bool mlp_prefill_sm90_cublaslt_supports(const MlpDesc& d, std::string* why);
size_t mlp_prefill_sm90_cublaslt_workspace(const MlpDesc& d);
fmlp_status_t mlp_prefill_sm90_cublaslt_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                            void* workspace, void* stream);
// For explain (the planner): which GEMM1 the path runs for d ("" when not gated).
const char* mlp_prefill_gemm1_note(const MlpDesc& d);

// The same entry for fp8 e4m3 weights (prefill_sm90_cublaslt_fp8.cu: W8A8 with per-token
// activation scales); the three functions above hand fp8 requests to these.
bool mlp_prefill_fp8_supports(const MlpDesc& d, std::string* why);
size_t mlp_prefill_fp8_workspace(const MlpDesc& d);
fmlp_status_t mlp_prefill_fp8_run(const fmlp_mlp_args_t& a, const MlpDesc& d, void* workspace,
                                  void* stream);

}  // namespace fmlp::detail
