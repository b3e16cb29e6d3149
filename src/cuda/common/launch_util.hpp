// Host helpers the CUDA launchers share.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "core/error.hpp"
#include "core/knobs.hpp"

namespace fmlp::detail {

// Workspace parts start on 256-byte boundaries, the alignment cudaMalloc itself gives.
inline size_t align_up(size_t n) {
  return (n + 255) / 256 * 256;
}

// The status of the launch just enqueued: FMLP_ERROR_CUDA naming `name` (and `detail`, e.g. the
// grid) when it failed.
inline fmlp_status_t launch_status(const char* name, const std::string& detail = "") {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return FMLP_SUCCESS;
  return fail(FMLP_ERROR_CUDA, "{} launch{} failed: {}", name,
              detail.empty() ? "" : " (" + detail + ")", cudaGetErrorString(e));
}

// Blocks of KERNEL (`threads` threads, `smem` dynamic bytes) one multiprocessor of the current
// device holds at once, >= 1 (1 when the occupancy query fails): the resident grids of the
// persistent and streaming kernels. Asked once per kernel, block shape and device.
template <typename KERNEL>
int blocks_per_sm(KERNEL kernel, int threads, size_t smem, int device) {
  using Key = std::tuple<const void*, int, size_t, int>;
  static std::mutex mu;
  static std::map<Key, int> cache;
  const Key key{reinterpret_cast<const void*>(kernel), threads, smem, device};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int per_sm = 1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) !=
        cudaSuccess) {
      cudaGetLastError();
      per_sm = 1;
    }
    it = cache.emplace(key, std::max(1, per_sm)).first;
  }
  return it->second;
}

// Whether kernels that support it launch with programmatic dependent launch on a device of
// compute capability cc (major * 10 + minor): sm_90 and newer, unless FMLP_STREAM_PDL=0 (for
// measurements).
inline bool pdl_enabled(int cc) {
  static const bool env_on = knob_bool<Knob::FMLP_STREAM_PDL>();
  return env_on && cc >= 90;
}

// KERNEL<<<grid, block, smem, s>>>(args...), with programmatic dependent launch when pdl (the
// kernel then orders its reads with pdl_wait_previous_grid, common.cuh); FMLP_ERROR_CUDA naming
// `name` when the launch failed.
template <typename KERNEL, typename... ARGS>
fmlp_status_t launch_ex(KERNEL kernel, dim3 grid, dim3 block, size_t smem, bool pdl, cudaStream_t s,
                        const char* name, const ARGS&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  if (const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...); e != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA, "{} launch failed: {}", name, cudaGetErrorString(e));
  }
  return launch_status(name);
}

// Dynamic shared memory one block may opt into on `device`, less `static_bytes` of the kernel's
// static shared memory (cached per device); 48 KiB, the no-opt-in limit, when it cannot be read.
int cuda_max_dynamic_smem(int device, int static_bytes);

// Lets KERNEL launch with `smem` bytes of dynamic shared memory on the current device. The opt-in
// (cudaFuncSetAttribute) is a host call per kernel and device: it is made when a launch needs
// more than the kernel was raised to before, not on every launch. `name` goes into the error.
template <auto KERNEL>
fmlp_status_t allow_dynamic_smem(size_t smem, const char* name) {
  constexpr int kDevices = 64;
  static std::mutex mu;
  static std::array<size_t, kDevices> raised{};
  // Without the opt-in a block gets 48 KiB in all, its static shared memory included, so a
  // launch with 48 KiB of dynamic memory and any static memory fails: opt in well below 48 KiB
  // (kernels keep their static shared memory under 16 KiB).
  if (smem <= 32 * 1024) return FMLP_SUCCESS;
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kDevices) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA, "{}: no usable current CUDA device (index {})", name, device);
  }
  std::lock_guard<std::mutex> lock(mu);
  if (raised[size_t(device)] >= smem) return FMLP_SUCCESS;
  const cudaError_t e =
      cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA, "{}: cannot raise shared memory to {} bytes: {}", name, smem,
                cudaGetErrorString(e));
  }
  raised[size_t(device)] = smem;
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
