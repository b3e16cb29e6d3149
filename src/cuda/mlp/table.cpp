// The cuda mlp entries in table order (their contracts: mlp/entries.hpp), each behind the device
// and scale-layout checks every cuda entry shares.
#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#include "cuda/common/device.hpp"
#include "cuda/mlp/entries.hpp"

namespace fmlp::detail {
namespace {

// Every entry needs bf16 tensor cores / cp.async-era hardware: compute capability 8.0+.
bool device_supported(const MlpDesc& d, std::string* why) {
  if (mlp_refuses_block_scales(d, why)) return false;
  return d.device != FMLP_DEVICE_CUDA || cuda_device_sm80(d.device_id, why);
}

bool splitk_supports(const MlpDesc& d, std::string* why) {
  return device_supported(d, why) && mlp_decode_sm90_splitk_supports(d, why);
}

bool cluster_supports(const MlpDesc& d, std::string* why) {
  if (!device_supported(d, why)) return false;
  if (const int cc = cuda_compute_capability(d.device_id); cc < 90)
    return (*why = fmt::format("cuda:{} has compute capability {}.{}; thread-block clusters need "
                               "9.0 (Hopper) or newer",
                               d.device_id, cc / 10, cc % 10),
            false);
  return mlp_decode_sm90_cluster_supports(d, why);
}

bool gemv_supports(const MlpDesc& d, std::string* why) {
  return device_supported(d, why) && mlp_decode_sm80_gemv_supports(d, why);
}

bool stream_supports(const MlpDesc& d, std::string* why) {
  return device_supported(d, why) && mlp_decode_sm80_stream_supports(d, why);
}

bool wgmma_fp8_supports(const MlpDesc& d, std::string* why) {
  return device_supported(d, why) && mlp_decode_sm90_wgmma_fp8_supports(d, why);
}

bool mma_streamk_supports(const MlpDesc& d, std::string* why) {
  return device_supported(d, why) && mlp_decode_sm80_mma_streamk_supports(d, why);
}

bool prefetch_supports(const MlpDesc& d, std::string* why) {
  return device_supported(d, why) && mlp_decode_sm80_prefetch_supports(d, why);
}

bool prefill_supports(const MlpDesc& d, std::string* why) {
  return device_supported(d, why) && mlp_prefill_sm90_cublaslt_supports(d, why);
}

// Decode preference below the planner's crossover, measured on an H200: the two weight streams for
// up to four tokens (decode_sm80_stream.cu), whole-slice prefetch into
// shared memory for MLPs whose weights fit on chip (gpt2-small), the register-stream kernel for one
// token (faster than the cluster kernel on gpt2-small at M = 1), the
// tensor-core cluster kernel for up to 64 tokens of matching dtypes, the fp8 tensor-core streams
// (decode_sm90_wgmma_fp8.cu: slower than the cluster kernel on llama3-8b at M = 1, so behind
// it), the stream-K tensor-core streams (decode_sm80_mma_streamk.cu: up to 64 tokens, 16-bit or
// fp8 weights, deterministic mode too; reached by name until they win somewhere:
// bench/decode_suite_bench), splitk for the rest (fp32 activations, odd sizes).
const MlpKernel kCudaKernels[] = {
    {"mlp_decode_sm80_stream", FMLP_BACKEND_CUDA, stream_supports, mlp_decode_sm80_stream_workspace,
     mlp_decode_sm80_stream_run, /*scratch=*/true},
    {"mlp_decode_sm80_prefetch", FMLP_BACKEND_CUDA, prefetch_supports,
     mlp_decode_sm80_prefetch_workspace, mlp_decode_sm80_prefetch_run},
    {"mlp_decode_sm80_gemv", FMLP_BACKEND_CUDA, gemv_supports, mlp_decode_sm80_gemv_workspace,
     mlp_decode_sm80_gemv_run},
    {"mlp_decode_sm90_cluster", FMLP_BACKEND_CUDA, cluster_supports,
     mlp_decode_sm90_cluster_workspace, mlp_decode_sm90_cluster_run},
    {"mlp_decode_sm90_wgmma_fp8", FMLP_BACKEND_CUDA, wgmma_fp8_supports,
     mlp_decode_sm90_wgmma_fp8_workspace, mlp_decode_sm90_wgmma_fp8_run},
    {"mlp_decode_sm80_mma_streamk", FMLP_BACKEND_CUDA, mma_streamk_supports,
     mlp_decode_sm80_mma_streamk_workspace, mlp_decode_sm80_mma_streamk_run, /*scratch=*/true},
    {"mlp_decode_sm90_splitk", FMLP_BACKEND_CUDA, splitk_supports, mlp_decode_sm90_splitk_workspace,
     mlp_decode_sm90_splitk_run},
    // Any M; dispatch reaches it through the planner (mlp/planner.cpp) from the crossover M.
    {kPrefillKernelName, FMLP_BACKEND_CUDA, prefill_supports, mlp_prefill_sm90_cublaslt_workspace,
     mlp_prefill_sm90_cublaslt_run, /*scratch=*/true},
};

}  // namespace

MlpKernelList cuda_mlp_kernels() {
  return {kCudaKernels, sizeof(kCudaKernels) / sizeof(kCudaKernels[0])};
}

}  // namespace fmlp::detail
