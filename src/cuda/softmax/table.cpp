// The cuda softmax entries in table order (their contracts: softmax/entries.hpp). Softmax has no
// planner (core/planner.hpp): dispatch takes the first entry that supports a call.
#include "core/linear_desc.hpp"
#include "cuda/softmax/entries.hpp"

namespace fmlp::detail {
namespace {

// The ticket entry first, then the cluster entry, then one warp per short row: each is preferred
// wherever it applies.
const SoftmaxKernel kCudaKernels[] = {
    {"softmax_sm80_ticket", FMLP_BACKEND_CUDA, softmax_sm80_ticket_supports,
     softmax_sm80_ticket_workspace, softmax_sm80_ticket_run},
    {"softmax_sm90_cluster", FMLP_BACKEND_CUDA, softmax_sm90_cluster_supports,
     softmax_sm90_cluster_workspace, softmax_sm90_cluster_run},
    {"softmax_sm80_warp_rows", FMLP_BACKEND_CUDA, softmax_sm80_warp_rows_supports,
     softmax_sm80_warp_rows_workspace, softmax_sm80_warp_rows_run},
    {"softmax_sm80_rows", FMLP_BACKEND_CUDA, softmax_sm80_rows_supports,
     softmax_sm80_rows_workspace, softmax_sm80_rows_run},
};

}  // namespace

SoftmaxKernelList cuda_softmax_kernels() {
  return {kCudaKernels, sizeof(kCudaKernels) / sizeof(kCudaKernels[0])};
}

}  // namespace fmlp::detail
