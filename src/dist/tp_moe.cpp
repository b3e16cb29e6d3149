// The expert-parallel moe over NCCL: each rank runs its expert range of the moe op on every token
// (replicated x, the same routing everywhere), then one all-reduce of y on the same stream. The
// range split and the args views are pure arithmetic and work in every build; the run needs NCCL
// and reports BACKEND_UNAVAILABLE without it. Everything that can fail is checked before the first
// enqueue, so an error leaves y as it was.
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/moe_desc.hpp"
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

// Experts [first, first + count) of a stacked [E, ...] tensor (absent stays absent).
fmlp_tensor_t experts_of(const fmlp_tensor_t& t, int64_t first, int64_t count) {
  if (tensor_absent(t)) return t;
  fmlp_tensor_t v = t;
  v.data = static_cast<char*>(t.data) + first * t.stride[0] * int64_t(dtype_size(t.dtype));
  v.shape[0] = count;
  return v;
}

// The args rank `rank` runs: the residual is added once, by rank 0.
fmlp_moe_args_t local_moe_args(const fmlp_moe_args_t& a, int32_t rank) {
  fmlp_moe_args_t l = a;
  if (rank != 0) l.residual = fmlp_tensor_none();
  return l;
}

#if FMLP_WITH_NCCL
constexpr const char* kOp = "the expert-parallel moe";

fmlp_status_t check_y(const fmlp_tensor_t& y, const MoeDesc& d) {
  if (d.tokens > 1 && y.stride[0] != d.d_out)
    return fail(FMLP_ERROR_BAD_STRIDE,
                "y has row stride {} for {} columns; the reduction runs over one contiguous "
                "buffer, so pass a contiguous y [T, d_out]",
                y.stride[0], d.d_out);
  ncclDataType_t t;
  return tp_nccl_dtype(d.act_dtype, &t);
}
#endif

}  // namespace
}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {

fmlp_status_t fmlp_tp_expert_range(int32_t global_experts, int32_t rank, int32_t size,
                                   int32_t* first, int32_t* count) {
  if (first == nullptr || count == nullptr)
    return fail(FMLP_ERROR_NULL_POINTER, "{} is NULL", first == nullptr ? "first" : "count");
  FMLP_TP_TRY(tp_check_rank(rank, size));
  if (global_experts < size)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "global_experts is {} for {} ranks; every rank needs at least one expert (use "
                "fewer ranks for the moe, or replicate experts outside this helper)",
                global_experts, size);
  const int64_t g = global_experts;
  *first = int32_t(g * rank / size);
  *count = int32_t(g * (rank + 1) / size - g * rank / size);
  clear_last_error();
  return FMLP_SUCCESS;
}

fmlp_status_t fmlp_tp_shard_moe(const fmlp_moe_args_t* full, int32_t rank, int32_t size,
                                fmlp_moe_args_t* local) {
  if (full == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "full (the unsharded args) is NULL");
  if (local == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "local (the output) is NULL");
  const fmlp_moe_config_t& c = full->config;
  if (c.first_expert != 0 || (c.global_experts != 0 && c.global_experts != c.num_experts))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "full->config already holds a range (first_expert {}, global_experts {}); pass "
                "the whole op's args (every expert, first_expert 0, global_experts 0)",
                c.first_expert, c.global_experts);
  MoeDesc d;
  FMLP_TP_TRY(validate_moe(full, &d));
  int32_t first = 0, count = 0;
  FMLP_TP_TRY(fmlp_tp_expert_range(c.num_experts, rank, size, &first, &count));
  fmlp_moe_args_t l = local_moe_args(*full, rank);
  l.w1 = experts_of(full->w1, first, count);
  l.b1 = experts_of(full->b1, first, count);
  l.w2 = experts_of(full->w2, first, count);
  l.b2 = experts_of(full->b2, first, count);
  l.w1_scale = experts_of(full->w1_scale, first, count);
  l.w2_scale = experts_of(full->w2_scale, first, count);
  l.config.num_experts = count;
  l.config.first_expert = first;
  l.config.global_experts = c.num_experts;
  *local = l;
  clear_last_error();
  return FMLP_SUCCESS;
}

fmlp_status_t fmlp_tp_moe_workspace_size(const fmlp_moe_args_t* local_args, int32_t rank,
                                         size_t* bytes) {
  if (local_args == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "local_args is NULL");
  const fmlp_moe_args_t l = local_moe_args(*local_args, rank);
  return fmlp_moe_workspace_size(&l, FMLP_BACKEND_CUDA, bytes);
}

fmlp_status_t fmlp_tp_moe(const fmlp_moe_args_t* local_args, void* comm, int32_t rank, int32_t size,
                          void* workspace, size_t workspace_bytes, void* stream) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (local_args == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "local_args is NULL");
  FMLP_TP_TRY(tp_check_rank(rank, size));
  const fmlp_moe_args_t l = local_moe_args(*local_args, rank);
  MoeDesc d;
  FMLP_TP_TRY(validate_moe(&l, &d));
  FMLP_TP_TRY(tp_check_comm(*api, comm, rank, size, d.device, d.device_id, kOp));
  FMLP_TP_TRY(check_y(l.y, d));
  DeviceScope scope(d.device_id);
  FMLP_TP_TRY(scope.status());
  FMLP_TP_TRY(fmlp_moe(&l, FMLP_BACKEND_CUDA, workspace, workspace_bytes, stream));
  if (d.tokens > 0) {  // the one-shot p2p kernel when comm is registered and y fits, else NCCL
    const size_t count = size_t(d.tokens) * size_t(d.d_out);
    FMLP_TP_TRY(
        tp_all_reduce(*api, comm, l.y.data, d.act_dtype, count, static_cast<cudaStream_t>(stream)));
  }
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)local_args, (void)comm, (void)rank, (void)size, (void)workspace, (void)workspace_bytes;
  (void)stream;
  return tp_unavailable();
#endif
}

}  // extern "C"
