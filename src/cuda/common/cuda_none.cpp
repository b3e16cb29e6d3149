// Built when CUDA is off: the cuda backend registers nothing and says why.
#include "core/error.hpp"
#include "core/mlp_desc.hpp"

namespace fmlp::detail {

MlpKernelList cuda_mlp_kernels() {
  return {nullptr, 0};
}

const std::string& cuda_unavailable_reason() {
  static const std::string reason =
      "this build of fusedmlp has no CUDA support (configure with -DFMLP_CUDA=ON where nvcc "
      "exists)";
  return reason;
}

std::string cuda_device_list() {
  return {};
}

fmlp_status_t cuda_mlp_pack(fmlp_mlp_packed_s*, const fmlp_mlp_weights_t&, const MlpDesc&, void*) {
  return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "{}", cuda_unavailable_reason());
}

}  // namespace fmlp::detail

// ---- linear and softmax ops: nothing to register without CUDA ----
#include "core/linear_desc.hpp"

namespace fmlp::detail {

LinearKernelList cuda_linear_kernels() {
  return {nullptr, 0};
}

SoftmaxKernelList cuda_softmax_kernels() {
  return {nullptr, 0};
}

}  // namespace fmlp::detail

// ---- moe op: nothing to register, no device workspace to read ----
#include "core/moe_desc.hpp"

namespace fmlp::detail {

MoeKernelList cuda_moe_kernels() {
  return {nullptr, 0};
}

const MoeKernel* cuda_moe_plan(const MoeDesc&, std::string*) {
  return nullptr;
}

fmlp_status_t cuda_moe_device_errors(void*, void*, int32_t*) {
  return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "{}", cuda_unavailable_reason());
}

}  // namespace fmlp::detail
