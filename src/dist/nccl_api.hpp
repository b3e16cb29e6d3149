// NCCL reached through dlopen: the library is found at run time, so libfusedmlp never links
// libnccl (consumers, the Python extension and static builds stay free of it) and one binary runs
// on machines with and without NCCL. Only the entry points the tensor-parallel ops use.
#pragma once
#if FMLP_WITH_NCCL
#include <nccl.h>

#include <string>

namespace fmlp::detail {

struct NcclApi {
  ncclResult_t (*get_version)(int*);
  ncclResult_t (*get_unique_id)(ncclUniqueId*);
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*comm_init_all)(ncclComm_t*, int, const int*);
  ncclResult_t (*comm_destroy)(ncclComm_t);
  ncclResult_t (*comm_count)(const ncclComm_t, int*);
  ncclResult_t (*comm_cu_device)(const ncclComm_t, int*);
  ncclResult_t (*comm_user_rank)(const ncclComm_t, int*);
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                             cudaStream_t);
  ncclResult_t (*reduce_scatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                 ncclComm_t, cudaStream_t);
  ncclResult_t (*send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*group_start)();
  ncclResult_t (*group_end)();
  const char* (*get_error_string)(ncclResult_t);
  int version = 0;
};

// The loaded API, or nullptr with the reason in *why. Loaded once per process.
const NcclApi* nccl_api(std::string* why);

// NCCL's message for `r`, plus its last-error detail when it has one.
std::string nccl_error(const NcclApi& api, ncclResult_t r);

}  // namespace fmlp::detail
#endif
