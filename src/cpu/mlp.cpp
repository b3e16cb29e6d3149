// placeholder: replaced by the AVX2 kernels
#include "core/mlp_desc.hpp"
namespace fmlp::detail {
MlpKernelList cpu_mlp_kernels() { return {nullptr, 0}; }
}  // namespace fmlp::detail
