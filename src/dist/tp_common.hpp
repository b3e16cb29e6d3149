// Shared by the tensor-parallel entry points: loading NCCL, rank checks, the no-NCCL answer.
#pragma once
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "dist/nccl_api.hpp"

#define FMLP_TP_TRY(expr)                        \
  do {                                           \
    const fmlp_status_t status_ = (expr);        \
    if (status_ != FMLP_SUCCESS) return status_; \
  } while (0)

namespace fmlp::detail {

[[maybe_unused]] inline fmlp_status_t tp_unavailable() {
  return fail(FMLP_ERROR_BACKEND_UNAVAILABLE,
              "tensor parallel: this fusedmlp was built without NCCL (configure with CUDA on and "
              "-DFMLP_NCCL=ON; NCCL is found through NCCL_ROOT, the pip package nvidia-nccl-cu13 "
              "or the CUDA toolkit)");
}

inline fmlp_status_t tp_check_rank(int32_t rank, int32_t size) {
  if (size < 1)
    return fail(FMLP_ERROR_INVALID_VALUE, "size is {}; the number of ranks must be >= 1", size);
  if (rank < 0 || rank >= size)
    return fail(FMLP_ERROR_INVALID_VALUE, "rank is {}; expected 0 <= rank < size = {}", rank, size);
  return FMLP_SUCCESS;
}

#if FMLP_WITH_NCCL
inline fmlp_status_t tp_load_api(const NcclApi** api) {
  std::string why;
  *api = nccl_api(&why);
  if (*api == nullptr) return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "tensor parallel: {}", why);
  return FMLP_SUCCESS;
}
#endif

}  // namespace fmlp::detail
