// The launch contracts of the cuda mlp entries, one block per entry in table order
// (mlp/table.cpp lists them; each is defined in the file of its name: mlp_decode_sm80_stream in
// mlp/decode_sm80_stream.cu, ...), shared by their launchers, the table and the planner.
#pragma once
#include <cstddef>
#include <string>

#include "core/mlp_desc.hpp"

namespace fmlp::detail {

// No cuda mlp entry reads 128 x 128 block scales yet: every supports() (mlp/table.cpp) and the
// cuda pack start here. Names the first block-scaled argument.
inline bool mlp_refuses_block_scales(const MlpDesc& d, std::string* why) {
  const char* name = d.w1_scale == ScaleKind::kBlock     ? "weights.w1_scale"
                     : d.w_up_scale == ScaleKind::kBlock ? "weights.w_up_scale"
                     : d.w2_scale == ScaleKind::kBlock   ? "weights.w2_scale"
                                                         : nullptr;
  if (name == nullptr) return false;
  *why = std::string(name) +
         " is a 2-D block scale (128 x 128 blocks): the cuda mlp entries take per-row or "
         "per-tensor fp8 scales only; run on the cpu backend, or re-quantise the weights per "
         "row (fmlp_quantize_fp8 with a [rows] scale, fusedmlp.quantize_fp8(w)) for cuda";
  return true;
}

// Two memory-order weight streams (decode_sm80_stream.cu): M <= 4, bf16/fp16 or fp8 weights.
FMLP_DECLARE_OP_ENTRY(mlp_decode_sm80_stream, fmlp_mlp_args_t, MlpDesc);
// The hidden slice's weights prefetched into shared memory across the GPU (M <= 4).
FMLP_DECLARE_OP_ENTRY(mlp_decode_sm80_prefetch, fmlp_mlp_args_t, MlpDesc);
// The register-stream GEMV for one token.
FMLP_DECLARE_OP_ENTRY(mlp_decode_sm80_gemv, fmlp_mlp_args_t, MlpDesc);
// Two stream-K tensor-core weight streams (decode_sm80_mma_streamk.cu): M <= 64, bf16/fp16
// weights with activations of their dtype, or e4m3 weights with bf16/fp16 activations.
FMLP_DECLARE_OP_ENTRY(mlp_decode_sm80_mma_streamk, fmlp_mlp_args_t, MlpDesc);
// Tensor cores with thread-block clusters sharing the hidden slice (M <= 64, sm_90).
FMLP_DECLARE_OP_ENTRY(mlp_decode_sm90_cluster, fmlp_mlp_args_t, MlpDesc);
// Two fp8 tensor-core weight streams (decode_sm90_wgmma_fp8.cu): M <= 4, e4m3 weights, sm_90a.
FMLP_DECLARE_OP_ENTRY(mlp_decode_sm90_wgmma_fp8, fmlp_mlp_args_t, MlpDesc);
// Split-K over the hidden dimension for every other dtype and size, and the deterministic mode.
FMLP_DECLARE_OP_ENTRY(mlp_decode_sm90_splitk, fmlp_mlp_args_t, MlpDesc);
// The prefill path (prefill_sm90_cublaslt.cu), which the planner (mlp/planner.cpp) picks from
// the crossover M on.
FMLP_DECLARE_OP_ENTRY(mlp_prefill_sm90_cublaslt, fmlp_mlp_args_t, MlpDesc);
constexpr const char* kPrefillKernelName = "mlp_prefill_sm90_cublaslt";
// For explain (the planner): which GEMM1 the path runs for d ("" when not gated).
const char* mlp_prefill_gemm1_note(const MlpDesc& d);
// The same entry for fp8 e4m3 weights (prefill_sm90_cublaslt_fp8.cu: W8A8 with per-token
// activation scales); mlp_prefill_sm90_cublaslt_* hand fp8 requests to these.
FMLP_DECLARE_OP_ENTRY(mlp_prefill_fp8, fmlp_mlp_args_t, MlpDesc);

// The width a stream may read of weight rows of `cols` columns: packed weights (cuda/mlp/pack.cu)
// pad every row with zeros to whole 16-byte loads, so d_in and hidden that are not multiples of
// 8 (16-bit) or 16 (e4m3) still run on the 16-byte streams; `cols` itself otherwise. In
// decode_operands.cu, which fills DecodeOperands::kp / hp with it.
int64_t padded_width(const MlpDesc& d, int64_t cols);

// The CUDA-core split-hidden kernels (gemv, prefetch): their shared preconditions (CUDA memory,
// not deterministic, M <= max_tokens, bf16/fp16 weights, d_in and hidden multiples of 8, 16-byte
// aligned weight rows), and their workspace: fp32 accumulators [M, d_out] and a block counter,
// both zero between calls (finish_last_block in common/decode_common.cuh leaves them so). In
// decode_operands.cu.
bool split_hidden_supports(const MlpDesc& d, int max_tokens, std::string* why);
size_t split_hidden_workspace(const MlpDesc& d);
void split_hidden_scratch(void* workspace, const MlpDesc& d, float** acc, unsigned** counter);

}  // namespace fmlp::detail
