// The unfused fp32 OpenBLAS pipeline on a bench problem, the baseline the fused op is measured
// against: h = x W1^T (+b1); a = act(h) (gated: act(gate) * up); y = a W2^T (+b2).
// Weights are widened to fp32 once, when it is made; M = 1 uses sgemv, the faster BLAS path,
// unless `gemm_only` asks for sgemm at every M (the pipeline as issue #2 defines it).
#pragma once
#include <cstdint>
#include <vector>

#include "host_tensor.hpp"
#include "workloads.hpp"

namespace fmlp_cli {

class BlasBaseline {
 public:
  // Uses the problem's weight set 0 and x, repeated over `copies` fp32 weight sets.
  BlasBaseline(const HostMlp& problem, int copies, bool gemm_only = false);

  // Takes the problem's current x (after HostMlp::set_batch).
  void set_batch(const HostMlp& problem);
  void run(int copy);
  std::vector<float> output_rows(const std::vector<int64_t>& rows) const;
  std::vector<double> time_calls(int reps, int first);
  size_t weight_bytes() const;  // one fp32 set
  int copies() const { return int(sets_.size()); }

 private:
  struct Set {
    HostTensor w1, b1, w2, b2;  // w1 stacks gate and up rows when gated
  };
  MlpShape shape_;
  int64_t m_;
  bool gemm_only_;
  std::vector<Set> sets_;
  HostTensor x_, h_, a_, y_;
};

}  // namespace fmlp_cli
