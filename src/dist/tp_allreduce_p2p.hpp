// The one-shot LL peer-to-peer all-reduce's registry (src/dist/tp_allreduce_p2p.cpp): which
// communicators have peer-mapped buffers, and the all-reduce the tensor-parallel ops call.
#pragma once
#include <cstdint>

#include "fusedmlp/fusedmlp.h"

#if FMLP_WITH_NCCL
#include <cuda_runtime.h>

#include "dist/nccl_api.hpp"

namespace fmlp::detail {

// Sums `count` contiguous elements of y in place over comm's ranks on `stream`: the p2p kernel
// (allreduce_sm80_p2p_ll) when comm has a p2p registration that holds the message, else
// ncclAllReduce. Never synchronises; the dtype is f32, f16 or bf16 (checked by the caller).
fmlp_status_t tp_all_reduce(const NcclApi& api, void* comm, void* y, fmlp_dtype_t dtype,
                            size_t count, cudaStream_t stream);

}  // namespace fmlp::detail
#endif
