// The planner interface: for each op, the cuda entry its planner picks for a request (`reason`,
// when not null, gets one line for explain), or nullptr when it has no opinion; dispatch then
// takes the first entry of the table that supports the request (core/op_table.hpp). The OP traits'
// plan() calls these for the cuda backend; the host backends have no planner. Each is defined in
// src/cuda/<op>/planner.cpp, and returns nullptr without CUDA (src/cuda/common/cuda_none.cpp).
//   mlp     the decode entries below a crossover M measured per shape, the cuBLASLt prefill path
//           from it (cuda/mlp/planner.cpp).
//   linear  per-shape choices at M = 1..4, then table order; FMLP_LINEAR_KERNEL forces an entry
//           (cuda/linear/planner.cpp).
//   moe     moe_sm80_stream while few tokens share an expert, then table order
//           (cuda/moe/planner.cpp).
//   softmax no planner: its entries are ordered so that the first one that takes a request is the
//           one to run (cuda/softmax/table.cpp).
#pragma once
#include <string>

#include "core/linear_desc.hpp"
#include "core/mlp_desc.hpp"
#include "core/moe_desc.hpp"

namespace fmlp::detail {

const MlpKernel* cuda_mlp_plan(const MlpDesc& d, std::string* reason);
const LinearKernel* cuda_linear_plan(const LinearDesc& d, std::string* reason);
const MoeKernel* cuda_moe_plan(const MoeDesc& d, std::string* reason);

}  // namespace fmlp::detail
