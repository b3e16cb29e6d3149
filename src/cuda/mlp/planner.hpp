// The CUDA planner of the mlp op (cuda_mlp_plan, core/planner.hpp): which op-table entry runs a
// request. The decode kernels stream the weights once for all tokens and win while the weights
// dominate the traffic (small M); the cuBLASLt prefill path wins once the GEMMs are compute bound.
// Where the two cross depends on the shape and dtype, so the crossover M comes from a table
// measured on the GPU (bench/mlp_cuda_bench prints rows ready to paste into planner.cpp), with a
// default for shapes never measured.
#pragma once
#include <cstdint>
#include <string>

#include "core/mlp_desc.hpp"
#include "core/planner.hpp"

namespace fmlp::detail {

struct CrossoverEntry {
  int64_t d_in, hidden;
  bool gated;
  fmlp_dtype_t dtype;  // activations (= weights), or F8_E4M3: fp8 weights with 16-bit x
  int64_t m;           // smallest M at which the prefill path is faster
  const char* source;  // where the number comes from, e.g. "measured on H200 (sm_90)"
};

// The table entry for d's shape, or the default entry (d_in = hidden = 0) when none matches.
const CrossoverEntry& cuda_crossover(const MlpDesc& d);
}  // namespace fmlp::detail
