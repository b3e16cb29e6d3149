// Whether the cuda backend can run on this machine, and the device queries its entries share
// (common/device.hpp).
#include "cuda/common/device.hpp"

#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#include "core/op_table.hpp"
#include "cuda/common/launch_util.hpp"

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

int cuda_compute_capability(int device) {
  return compute_capability(device);
}

fmlp_status_t cuda_workspace_clear(void* p, size_t bytes, void* stream) {
  if (const cudaError_t e = cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(stream));
      e != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA, "clearing {} bytes of the workspace's scratch part failed: {}",
                bytes, cudaGetErrorString(e));
  }
  return FMLP_SUCCESS;
}

bool cuda_device_sm80(int device, std::string* why) {
  const int cc = compute_capability(device);
  if (cc >= 80) return true;
  *why = cc == 0 ? fmt::format("cannot query cuda:{}", device)
                 : fmt::format(
                       "cuda:{} has compute capability {}.{}; the kernel needs bf16 "
                       "tensor cores (8.0 or newer); use backend cpu",
                       device, cc / 10, cc % 10);
  return false;
}

bool cuda_op_device_ok(fmlp_device_type_t device, int device_id, std::string* why) {
  if (device != FMLP_DEVICE_CUDA) return (*why = "needs CUDA device memory", false);
  return cuda_device_sm80(device_id, why);
}

}  // namespace fmlp::detail
