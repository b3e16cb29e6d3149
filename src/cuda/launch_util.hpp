// Host helpers the CUDA launchers share.
#pragma once
#include <cstddef>

namespace fmlp::detail {

// Workspace parts start on 256-byte boundaries, the alignment cudaMalloc itself gives.
inline size_t align_up(size_t n) {
  return (n + 255) / 256 * 256;
}

// Dynamic shared memory one block may opt into on `device`, less `static_bytes` of the kernel's
// static shared memory (cached per device); 48 KiB, the no-opt-in limit, when it cannot be read.
int cuda_max_dynamic_smem(int device, int static_bytes);

}  // namespace fmlp::detail
