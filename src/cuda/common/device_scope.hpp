// Launchers run on the tensors' device and leave the caller's current device as it was.
#pragma once
#include <cuda_runtime.h>

#include "core/error.hpp"

namespace fmlp::detail {

class DeviceScope {
 public:
  // Makes `device` current; on failure status() is FMLP_ERROR_CUDA with the message set.
  explicit DeviceScope(int device) {
    cudaGetDevice(&prev_);
    if (prev_ == device) return;
    if (cudaSetDevice(device) != cudaSuccess) {
      const cudaError_t e = cudaGetLastError();
      status_ =
          fail(FMLP_ERROR_CUDA, "cudaSetDevice({}) failed: {}", device, cudaGetErrorString(e));
      return;
    }
    switched_ = true;
  }
  ~DeviceScope() {
    if (switched_ && prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  fmlp_status_t status() const { return status_; }

 private:
  int prev_ = -1;
  bool switched_ = false;
  fmlp_status_t status_ = FMLP_SUCCESS;
};

}  // namespace fmlp::detail
