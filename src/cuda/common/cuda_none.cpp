// Built when CUDA is off: the cuda backend registers no entries, has no planners and says why it
// cannot run.
#include "core/error.hpp"
#include "core/linear_desc.hpp"
#include "core/mlp_desc.hpp"
#include "core/moe_desc.hpp"
#include "core/op_table.hpp"
#include "core/planner.hpp"

namespace fmlp::detail {

const std::string& cuda_unavailable_reason() {
  static const std::string reason =
      "this build of fusedmlp has no CUDA support (configure with -DFMLP_CUDA=ON where nvcc "
      "exists)";
  return reason;
}

std::string cuda_device_list() {
  return {};
}

MlpKernelList cuda_mlp_kernels() {
  return {nullptr, 0};
}

LinearKernelList cuda_linear_kernels() {
  return {nullptr, 0};
}

SoftmaxKernelList cuda_softmax_kernels() {
  return {nullptr, 0};
}

MoeKernelList cuda_moe_kernels() {
  return {nullptr, 0};
}

const MlpKernel* cuda_mlp_plan(const MlpDesc&, std::string*) {
  return nullptr;
}

const LinearKernel* cuda_linear_plan(const LinearDesc&, std::string*) {
  return nullptr;
}

const MoeKernel* cuda_moe_plan(const MoeDesc&, std::string*) {
  return nullptr;
}

void cuda_mlp_tune(fmlp_mlp_packed_s*) {}

fmlp_status_t cuda_mlp_pack(fmlp_mlp_packed_s*, const fmlp_mlp_weights_t&, const MlpDesc&, void*) {
  return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "{}", cuda_unavailable_reason());
}

fmlp_status_t cuda_workspace_clear(void*, size_t, void*) {
  return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "{}", cuda_unavailable_reason());
}

// fmlp_moe_device_errors: no device workspace to read.
fmlp_status_t cuda_moe_device_errors(void*, void*, int32_t*) {
  return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "{}", cuda_unavailable_reason());
}

}  // namespace fmlp::detail
