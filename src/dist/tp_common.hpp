// Shared by the tensor- and expert-parallel entry points: loading NCCL, rank and communicator
// checks, the no-NCCL answer.
#pragma once
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "core/tensor_check.hpp"
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

// comm's CUDA device into *device, after checking that comm is rank `rank` of `size` as the
// caller says.
inline fmlp_status_t tp_comm_device(const NcclApi& api, void* comm, int32_t rank, int32_t size,
                                    int* device) {
  const auto c = static_cast<ncclComm_t>(comm);
  int n = 0, r = 0;
  ncclResult_t e = api.comm_count(c, &n);
  if (e == ncclSuccess) e = api.comm_user_rank(c, &r);
  if (e == ncclSuccess) e = api.comm_cu_device(c, device);
  if (e != ncclSuccess)
    return fail(FMLP_ERROR_INVALID_VALUE, "comm cannot be queried: {}", nccl_error(api, e));
  if (n != size || r != rank)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "rank {} of size {} given, but comm is rank {} of {}; pass the communicator's own "
                "rank and size",
                rank, size, r, n);
  return FMLP_SUCCESS;
}

// The communicator must be the one the caller describes: same size, same rank, the tensors'
// device. `op` names the operation in messages ("the tensor-parallel mlp").
inline fmlp_status_t tp_check_comm(const NcclApi& api, void* comm, int32_t rank, int32_t size,
                                   fmlp_device_type_t device, int32_t device_id, const char* op) {
  if (comm == nullptr)
    return fail(FMLP_ERROR_NULL_POINTER,
                "comm is NULL; pass an ncclComm_t (fmlp_tp_comm_init_from_file or "
                "fmlp_tp_comm_init_all create one)");
  if (device != FMLP_DEVICE_CUDA)
    return fail(FMLP_ERROR_DEVICE_MISMATCH, "the tensors are on {}; {} needs CUDA device memory",
                device_string(device, device_id), op);
  int dev = 0;
  if (const fmlp_status_t st = tp_comm_device(api, comm, rank, size, &dev); st != FMLP_SUCCESS)
    return st;
  if (device_id != dev)
    return fail(FMLP_ERROR_DEVICE_MISMATCH,
                "the tensors are on {} but comm (rank {}) is on cuda:{}; give every rank's "
                "tensors the communicator's device",
                device_string(device, device_id), rank, dev);
  return FMLP_SUCCESS;
}

inline fmlp_status_t tp_nccl_dtype(fmlp_dtype_t t, ncclDataType_t* out) {
  switch (t) {
    case FMLP_DTYPE_F32: *out = ncclFloat32; return FMLP_SUCCESS;
    case FMLP_DTYPE_F16: *out = ncclFloat16; return FMLP_SUCCESS;
    case FMLP_DTYPE_BF16: *out = ncclBfloat16; return FMLP_SUCCESS;
    default:
      return fail(FMLP_ERROR_DTYPE_MISMATCH, "y is {}; the reduction takes f32, f16 or bf16",
                  fmlp_dtype_name(t));
  }
}
#endif

}  // namespace fmlp::detail
