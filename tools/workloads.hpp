// Problem shapes (the bench presets and custom specs) and random host problems: weights, inputs
// and the reference output of chosen rows, all through the public API.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.h"
#include "host_tensor.hpp"

namespace fmlp_cli {

struct MlpShape {
  std::string name;
  int64_t d_in = 0, hidden = 0, d_out = 0;
  fmlp_activation_t act = FMLP_ACT_GELU;
  bool gated = false;
  bool stacked = false;  // gated only: gate and up rows in one [2*hidden, d_in] w1
  bool bias = false;
  fmlp_norm_t norm = FMLP_NORM_NONE;
};

enum class Residual { kNone, kSeparate, kInPlace };

struct MlpCase {
  MlpShape shape;
  int64_t m = 1;
  fmlp_dtype_t act_dtype = FMLP_DTYPE_F32;
  fmlp_dtype_t w_dtype = FMLP_DTYPE_BF16;
  Residual residual = Residual::kNone;
};

// The bench presets, in their default order.
std::vector<std::string> preset_names();
// A preset name, or a custom spec DINxHIDDEN[xDOUT]:ACT[:gated][:bias], e.g. 1024x4096:gelu:bias.
// `stacked_gate_up` picks the w1 layout of gated shapes.
MlpShape parse_shape(const std::string& spec, bool stacked_gate_up);
// One line: dims, activation, gating, biases.
std::string describe(const MlpShape& s);

// Multiply-adds x2 of one call.
double mlp_flops(const MlpShape& s, int64_t m);

// Every weight-side tensor of one mlp, in the dtypes of one case.
struct WeightSet {
  HostTensor w1, w1_scale, b1, w_up, w_up_scale, b_up, w2, w2_scale, b2, norm_weight, norm_bias;
  fmlp_mlp_weights_t view() const;
  size_t bytes() const;  // what one call reads
  WeightSet clone() const;
};

// Allocates every tensor the shape needs, uninitialised except fp8 scales (1.0): enough for
// validation and explain, which never read weights.
WeightSet allocate_weights(const MlpShape& s, fmlp_dtype_t w_dtype);

// Weights ~ U(-1, 1) / sqrt(fan_in), biases ~ U(-0.1, 0.1), norm gamma ~ 1 + U(-0.1, 0.1).
// Biases share the weight dtype (bf16 for fp8 weights); norm parameters are fp32. fp8 weights
// are drawn in fp32 and quantised by fmlp_quantize_fp8 with per-row scales.
WeightSet random_weights(const MlpShape& s, fmlp_dtype_t w_dtype, uint64_t seed);

// q (fp8 [rows, cols]) and scale (fp32 [rows] per row, or [1]) from w through fmlp_quantize_fp8.
void quantize_weight(const HostTensor& w, HostTensor& q, HostTensor& scale);

fmlp_mlp_config_t make_config(const MlpShape& s);

// A random problem in host memory with `copies` identical weight sets at distinct addresses,
// so timing loops can rotate through more bytes than the last-level cache holds.
class HostMlp {
 public:
  HostMlp(const MlpCase& c, uint64_t seed, int copies = 1);

  const MlpCase& spec() const { return case_; }
  // Clones weight set 0 (or drops sets) to have `copies` of them.
  void set_copies(int copies);
  // Fresh random x (and residual) for batch size m; the weights stay.
  void set_batch(int64_t m);
  int copies() const { return int(weights_.size()); }
  const WeightSet& weights(int copy) const { return weights_[size_t(copy)]; }
  const HostTensor& x() const { return x_; }
  // Args reading weight set `copy`; the output is y (for in-place residual, y += mlp(x)).
  fmlp_mlp_args_t args(int copy) const;
  // Before each run: y = residual for in-place runs, else large random values, so a kernel that
  // skips rows cannot pass on an earlier run's output.
  void reset_output();
  size_t io_bytes() const;  // x and y (and residual) of one call
  size_t weight_bytes() const { return weights_.front().bytes(); }

  std::vector<float> output_rows(const std::vector<int64_t>& rows) const;
  // The ref backend's output for just these rows (rows are independent, so this is exact and
  // cheap even when M is large).
  std::vector<float> reference_rows(const std::vector<int64_t>& rows) const;

 private:
  MlpCase case_;
  uint64_t seed_;
  std::vector<WeightSet> weights_;
  HostTensor x_, y_, residual_;
};

// A few rows spread over [0, m): first, middle, last.
std::vector<int64_t> sample_rows(int64_t m);

}  // namespace fmlp_cli
