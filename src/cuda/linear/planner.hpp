// The CUDA planner of the linear op (cuda_linear_plan, core/planner.hpp): which op-table entry runs
// a request. At M = 1 both the streaming GEMV and cuBLASLt (a tile GEMM) read W once; which one
// reaches the byte floor sooner depends on the shape, so the choice comes from a table measured on
// the GPU (bench/linear_cuda_bench prints rows ready to paste into linear/planner.cpp), with a
// default by weight bytes for shapes never measured. At M = 2..4 a rule measured the same way sends
// what the weight stream reads faster to it, and the rest goes to the first entry of the op table
// that takes it. FMLP_LINEAR_KERNEL=<entry> forces an entry (for measuring); an entry that cannot
// run the request is ignored and explain says why.
#pragma once
#include <cstdint>
#include <string>

#include "core/linear_desc.hpp"
#include "core/planner.hpp"

namespace fmlp::detail {

struct LinearChoice {
  int64_t n, k;        // W is [n, k]
  fmlp_dtype_t w;      // bf16 rows serve f16 alike (same bytes, same math)
  const char* kernel;  // the entry to run at M = 1
  const char* source;  // where the choice comes from
};
}  // namespace fmlp::detail
