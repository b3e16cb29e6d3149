// The tensor-parallel mlp over NCCL: the rank's fused op into y, then one collective on the same
// stream. Everything that can fail is checked before the first enqueue, so an error leaves y as it
// was. Builds without NCCL keep the entry points and report BACKEND_UNAVAILABLE.
#include <cstdlib>
#include <string>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#include "core/mlp_validate.hpp"
#include "core/tensor_check.hpp"
#include "dist/tp_allreduce_p2p.hpp"
#include "dist/tp_common.hpp"
#include "fusedmlp/fusedmlp_nccl.h"

#if FMLP_WITH_NCCL
#include <cuda_runtime.h>

#include "cuda/common/device_scope.hpp"
#endif

namespace fmlp::detail {
namespace {

#if FMLP_WITH_NCCL

// What the collective needs of y, checked before anything runs.
fmlp_status_t check_output(const fmlp_tensor_t& y, const MlpDesc& d, int32_t size,
                           fmlp_tp_reduce_t reduce) {
  if (reduce != FMLP_TP_ALL_REDUCE && reduce != FMLP_TP_REDUCE_SCATTER)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "reduce is {}; expected FMLP_TP_ALL_REDUCE (0) or FMLP_TP_REDUCE_SCATTER (1)",
                int(reduce));
  if (d.m > 1 && y.stride[0] != d.d_out)
    return fail(FMLP_ERROR_BAD_STRIDE,
                "y has row stride {} for {} columns; the reduction runs over one contiguous "
                "buffer, so pass a contiguous y [M, d_out]",
                y.stride[0], d.d_out);
  if (reduce == FMLP_TP_REDUCE_SCATTER && d.m % size != 0)
    return fail(FMLP_ERROR_SHAPE_MISMATCH,
                "M = {} rows cannot be scattered over {} ranks; reduce-scatter needs M to be a "
                "multiple of size (pad the tokens) or use FMLP_TP_ALL_REDUCE",
                d.m, size);
  ncclDataType_t t;
  return tp_nccl_dtype(d.act_dtype, &t);
}

// Enqueues the sum of every rank's y on `stream` (y already holds this rank's partial).
fmlp_status_t reduce_y(const NcclApi& api, const fmlp_tensor_t& y, const MlpDesc& d, void* comm,
                       int32_t rank, int32_t size, fmlp_tp_reduce_t reduce, void* stream) {
  if (d.m == 0) return FMLP_SUCCESS;
  ncclDataType_t t;
  FMLP_TP_TRY(tp_nccl_dtype(d.act_dtype, &t));
  const auto c = static_cast<ncclComm_t>(comm);
  const auto s = static_cast<cudaStream_t>(stream);
  const size_t count = size_t(d.m) * size_t(d.d_out);
  // The one-shot p2p kernel when comm is registered for it and y fits, else ncclAllReduce.
  if (reduce == FMLP_TP_ALL_REDUCE) return tp_all_reduce(api, comm, y.data, d.act_dtype, count, s);
  // in place: rank r's block of the send buffer is its receive buffer
  const size_t chunk = count / size_t(size);
  void* mine = static_cast<char*>(y.data) + size_t(rank) * chunk * dtype_size(d.act_dtype);
  if (const ncclResult_t e = api.reduce_scatter(y.data, mine, chunk, t, ncclSum, c, s);
      e != ncclSuccess)
    return fail(FMLP_ERROR_CUDA,
                "ncclReduceScatter of y ({} elements) failed after the mlp ran: {}", count,
                nccl_error(api, e));
  return FMLP_SUCCESS;
}

#endif  // FMLP_WITH_NCCL

// The args rank `rank` runs: b2 and the residual are added once, by rank 0.
fmlp_mlp_args_t local_args(const fmlp_mlp_args_t& a, int32_t rank) {
  fmlp_mlp_args_t l = a;
  if (rank != 0) {
    l.weights.b2 = fmlp_tensor_none();
    l.residual = fmlp_tensor_none();
  }
  return l;
}

}  // namespace
}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {

fmlp_status_t fmlp_tp_available(void) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  clear_last_error();
  return FMLP_SUCCESS;
#else
  return tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_mlp_workspace_size(const fmlp_mlp_args_t* shard_args, int32_t rank,
                                         fmlp_backend_t backend, size_t* bytes) {
  if (shard_args == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "shard_args is NULL");
  const fmlp_mlp_args_t l = local_args(*shard_args, rank);
  return fmlp_mlp_workspace_size(&l, backend, bytes);
}

fmlp_status_t fmlp_tp_mlp(const fmlp_mlp_args_t* shard_args, void* comm, int32_t rank, int32_t size,
                          fmlp_tp_reduce_t reduce, fmlp_backend_t backend, void* workspace,
                          size_t workspace_bytes, void* stream) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (shard_args == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "shard_args is NULL");
  FMLP_TP_TRY(tp_check_rank(rank, size));
  const fmlp_mlp_args_t l = local_args(*shard_args, rank);
  MlpDesc d;
  FMLP_TP_TRY(validate_mlp(&l, &d));
  FMLP_TP_TRY(
      tp_check_comm(*api, comm, rank, size, d.device, d.device_id, "the tensor-parallel mlp"));
  FMLP_TP_TRY(check_output(l.y, d, size, reduce));
  if (backend != FMLP_BACKEND_AUTO && backend != FMLP_BACKEND_CUDA)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "backend is {}; the tensor-parallel mlp runs on cuda (pass auto or cuda)",
                fmlp_backend_name(backend));
  DeviceScope scope(d.device_id);
  FMLP_TP_TRY(scope.status());
  FMLP_TP_TRY(fmlp_mlp(&l, backend, workspace, workspace_bytes, stream));
  FMLP_TP_TRY(reduce_y(*api, l.y, d, comm, rank, size, reduce, stream));
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)shard_args, (void)comm, (void)rank, (void)size, (void)reduce, (void)backend;
  (void)workspace, (void)workspace_bytes, (void)stream;
  return tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_mlp_packed(const fmlp_mlp_packed_t* shard, const fmlp_tensor_t* y,
                                 const fmlp_tensor_t* x, const fmlp_tensor_t* residual, void* comm,
                                 int32_t rank, int32_t size, fmlp_tp_reduce_t reduce,
                                 void* workspace, size_t workspace_bytes, void* stream) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (shard == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "shard (packed weights) is NULL");
  if (y == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "y is NULL");
  if (x == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "x is NULL");
  FMLP_TP_TRY(tp_check_rank(rank, size));
  if (rank != 0 && shard->desc.has_b2)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "the packed shard of rank {} holds b2, which rank 0 already adds; pack the views "
                "of fmlp_tp_shard_weights (b2 on rank 0 only)",
                rank);
  const fmlp_tensor_t* res = rank == 0 ? residual : nullptr;
  MlpDesc d = shard->desc;
  FMLP_TP_TRY(validate_mlp_activations(*y, *x, res, shard->weights, &d));
  FMLP_TP_TRY(
      tp_check_comm(*api, comm, rank, size, d.device, d.device_id, "the tensor-parallel mlp"));
  FMLP_TP_TRY(check_output(*y, d, size, reduce));
  DeviceScope scope(d.device_id);
  FMLP_TP_TRY(scope.status());
  FMLP_TP_TRY(fmlp_mlp_packed_run(shard, y, x, res, workspace, workspace_bytes, stream));
  FMLP_TP_TRY(reduce_y(*api, *y, d, comm, rank, size, reduce, stream));
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)shard, (void)y, (void)x, (void)residual, (void)comm, (void)rank, (void)size;
  (void)reduce, (void)workspace, (void)workspace_bytes, (void)stream;
  return tp_unavailable();
#endif
}

}  // extern "C"
