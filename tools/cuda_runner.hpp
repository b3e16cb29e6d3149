// The CUDA side of `fusedmlp bench` (built when the library has the CUDA backend).
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "runner.hpp"

namespace fmlp_cli {

// True when this CLI was built with the CUDA runner.
bool cuda_runner_built();

// Copies the problem's x, y, residual and every weight set to device 0 (packing them with
// `packed`), and times by replaying a CUDA graph of one call per weight set.
std::unique_ptr<FusedRunner> make_cuda_runner(HostMlp& problem, bool packed);

struct CudaDeviceInfo {
  std::string name, driver;
  size_t l2_bytes = 0;
  double copy_gbps = 0.0;  // device-to-device copy: (read + write bytes) / time, best of 5
};
CudaDeviceInfo cuda_device_info(size_t copy_bytes);

}  // namespace fmlp_cli
