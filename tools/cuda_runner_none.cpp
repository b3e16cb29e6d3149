// `fusedmlp bench` built without the CUDA backend: no device runner.
#include "cli_common.hpp"
#include "cuda_runner.hpp"

namespace fmlp_cli {

bool cuda_runner_built() {
  return false;
}

std::unique_ptr<FusedRunner> make_cuda_runner(HostMlp&, bool) {
  throw CliError("this fusedmlp was built without CUDA; rebuild with -DFMLP_CUDA=ON");
}

CudaDeviceInfo cuda_device_info(size_t) {
  throw CliError("this fusedmlp was built without CUDA; rebuild with -DFMLP_CUDA=ON");
}

}  // namespace fmlp_cli
