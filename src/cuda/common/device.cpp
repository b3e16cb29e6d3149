// The cuda backend's entry in the op table, and whether it can run on this machine.
#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/mlp/decode.cuh"
#include "cuda/mlp/prefill.cuh"

namespace fmlp::detail {
namespace {

constexpr int kMaxDevices = 64;

// Compute capability major * 10 + minor, cached; 0 when unreadable.
int compute_capability(int device) {
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  if (device < 0 || device >= kMaxDevices) return 0;
  int v = cache[size_t(device)].load(std::memory_order_relaxed);
  if (v != 0) return v;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  v = major * 10 + minor;
  cache[size_t(device)].store(v, std::memory_order_relaxed);
  return v;
}

// Both decode kernels need bf16 tensor cores / cp.async-era hardware: compute capability 8.0+.
bool device_supported(const MlpDesc& d, std::string* why) {
  if (d.device == FMLP_DEVICE_CUDA) {
    const int cc = compute_capability(d.device_id);
    if (cc < 80) {
      *why = cc == 0 ? fmt::format("cannot query cuda:{}", d.device_id)
                     : fmt::format(
                           "cuda:{} has compute capability {}.{}; the kernel needs bf16 "
                           "tensor cores (8.0 or newer); use backend cpu",
                           d.device_id, cc / 10, cc % 10);
      return false;
    }
  }
  return true;
}

bool splitk_supports(const MlpDesc& d, std::string* why) {
  return device_supported(d, why) && mlp_decode_sm90_splitk_supports(d, why);
}

bool cluster_supports(const MlpDesc& d, std::string* why) {
  if (!device_supported(d, why)) return false;
  if (const int cc = compute_capability(d.device_id); cc < 90)
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

bool prefetch_supports(const MlpDesc& d, std::string* why) {
  return device_supported(d, why) && mlp_decode_sm80_prefetch_supports(d, why);
}

bool prefill_supports(const MlpDesc& d, std::string* why) {
  return device_supported(d, why) && mlp_prefill_sm90_cublaslt_supports(d, why);
}

// Decode preference below the planner's crossover, measured on an H200: the two weight streams for
// up to four tokens (mlp_decode_stream.cu), whole-slice prefetch into
// shared memory for MLPs whose weights fit on chip (gpt2-small), the register-stream kernel for one
// token (gpt2-small M = 1: 11.4 us against 16.4 for the cluster kernel), the
// tensor-core cluster kernel for up to 64 tokens of matching dtypes, the fp8 tensor-core streams
// (mlp_decode_wgmma_fp8.cu: llama3-8b M = 1 99.7 us against the cluster kernel's 72.3, so behind
// it), splitk for the rest (fp32 activations, odd sizes, deterministic mode).
const MlpKernel kCudaKernels[] = {
    {"mlp_decode_sm80_stream", FMLP_BACKEND_CUDA, stream_supports, mlp_decode_sm80_stream_workspace,
     mlp_decode_sm80_stream_run},
    {"mlp_decode_sm80_prefetch", FMLP_BACKEND_CUDA, prefetch_supports,
     mlp_decode_sm80_prefetch_workspace, mlp_decode_sm80_prefetch_run},
    {"mlp_decode_sm80_gemv", FMLP_BACKEND_CUDA, gemv_supports, mlp_decode_sm80_gemv_workspace,
     mlp_decode_sm80_gemv_run},
    {"mlp_decode_sm90_cluster", FMLP_BACKEND_CUDA, cluster_supports,
     mlp_decode_sm90_cluster_workspace, mlp_decode_sm90_cluster_run},
    {"mlp_decode_sm90_wgmma_fp8", FMLP_BACKEND_CUDA, wgmma_fp8_supports,
     mlp_decode_sm90_wgmma_fp8_workspace, mlp_decode_sm90_wgmma_fp8_run},
    {"mlp_decode_sm90_splitk", FMLP_BACKEND_CUDA, splitk_supports, mlp_decode_sm90_splitk_workspace,
     mlp_decode_sm90_splitk_run},
    // Any M; dispatch reaches it through the planner (src/cuda/planner.cpp) from the crossover M.
    {kPrefillKernelName, FMLP_BACKEND_CUDA, prefill_supports, mlp_prefill_sm90_cublaslt_workspace,
     mlp_prefill_sm90_cublaslt_run},
};

std::string probe_devices() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("no CUDA device found (cudaGetDeviceCount: {}); use backend cpu",
                       cudaGetErrorString(err));
  }
  if (count == 0) return "no CUDA device found (cudaGetDeviceCount: 0 devices); use backend cpu";
  for (int i = 0; i < count; ++i)
    if (compute_capability(i) >= 80) return {};
  return fmt::format(
      "none of the {} CUDA devices has compute capability 8.0 or newer (cuda:0 has "
      "{}.{}); use backend cpu",
      count, compute_capability(0) / 10, compute_capability(0) % 10);
}

}  // namespace

namespace {

// Device attribute ATTR of `device`, read once per device; 0 when unreadable.
template <cudaDeviceAttr ATTR>
int cached_attribute(int device) {
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  if (device < 0 || device >= kMaxDevices) return 0;
  int v = cache[size_t(device)].load(std::memory_order_relaxed);
  if (v != 0) return v;
  if (cudaDeviceGetAttribute(&v, ATTR, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cache[size_t(device)].store(v, std::memory_order_relaxed);
  return v;
}

}  // namespace

int cuda_sm_count(int device) {
  return cached_attribute<cudaDevAttrMultiProcessorCount>(device);
}

int64_t cuda_l2_bytes(int device) {
  return cached_attribute<cudaDevAttrL2CacheSize>(device);
}

int cuda_max_dynamic_smem(int device, int static_bytes) {
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  if (device < 0 || device >= kMaxDevices) return 48 * 1024;
  int v = cache[size_t(device)].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
        cudaSuccess) {
      cudaGetLastError();
      return 48 * 1024;
    }
    cache[size_t(device)].store(v, std::memory_order_relaxed);
  }
  return v - static_bytes;
}

MlpKernelList cuda_mlp_kernels() {
  return {kCudaKernels, sizeof(kCudaKernels) / sizeof(kCudaKernels[0])};
}

std::string cuda_device_list() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  std::string out;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    out += fmt::format("cuda:{} {}, sm_{}{}, {} SMs, {:.1f} GiB, L2 {} MiB\n", i, prop.name,
                       prop.major, prop.minor, prop.multiProcessorCount,
                       double(prop.totalGlobalMem) / double(1ull << 30), prop.l2CacheSize >> 20);
  }
  return out;
}

const std::string& cuda_unavailable_reason() {
  static const std::string reason = probe_devices();
  return reason;
}

}  // namespace fmlp::detail

// ---- linear and softmax ops (src/cuda/linear_gemv.cu, softmax.cu) ----
#include "cuda/common/ops.cuh"

namespace fmlp::detail {

int cuda_compute_capability(int device) {
  return compute_capability(device);
}

bool cuda_op_device_ok(fmlp_device_type_t device, int device_id, std::string* why) {
  if (device != FMLP_DEVICE_CUDA) return (*why = "needs CUDA device memory", false);
  MlpDesc d;
  d.device = device;
  d.device_id = device_id;
  return device_supported(d, why);
}

}  // namespace fmlp::detail
