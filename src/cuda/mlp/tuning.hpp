// The mlp planner's pack-time tuning: which cuda entry is fastest for one packed MLP on one GPU,
// at each token count of decode (M = 1 .. 64), found by timing every entry that takes the call.
//
// Why time instead of model: where the weight streams, the stream-K tensor-core streams and the
// cuBLASLt path cross depends on the shape (launch and ramp costs dominate small layers, HBM
// large ones) and on the GPU (an H200 moves 1.4 times an H100's bytes per multiprocessor cycle,
// which moves the compute-bound points): the fixed crossovers, four shapes measured on an H200,
// send M = 2 of other shapes to the cuBLASLt path, which an H100 ran 10-27 % slower than the
// weight streams (bench/decode_suite_bench). fmlp_mlp_pack times the candidates once
// per shape and device (cached for the process: a model's layers share a few shapes) the way the
// benchmarks do: each call captured in a CUDA graph and replayed, the L2 flushed before each
// replay so the weights come from HBM, median of a few replays. Deterministic mode and
// FMLP_PLAN_TUNE=0 keep the planner's fixed rules (mlp/planner.cpp).
#pragma once
#include <memory>
#include <string>

#include "core/mlp_desc.hpp"

namespace fmlp::detail {

struct MlpTuning {
  static constexpr int kBuckets = 8;
  // A call of M tokens uses the pick of the first bucket with kBucketM >= M.
  static constexpr int kBucketM[kBuckets] = {1, 2, 3, 4, 8, 16, 32, 64};
  const MlpKernel* pick[kBuckets] = {};  // nullptr: no entry timed (the rules decide)
  std::string detail[kBuckets];          // "entry us, entry us, ..." fastest first, for explain
  int device = -1;
  fmlp_dtype_t act_dtype = FMLP_DTYPE_INVALID;  // the activations the timing assumed
};

// The bucket of M tokens, or -1 past the last.
int mlp_tuning_bucket(int64_t m);

// cuda_mlp_tune (core/mlp_desc.hpp) fills fmlp_mlp_packed_s::tuning for freshly packed CUDA
// weights, or leaves it empty with the reason in tuning_note (the fixed rules then decide); it
// synchronises the device, a one-time cost of packing.

}  // namespace fmlp::detail
