// The activations and norms as plain double-precision formulas: the specification every other
// backend is tested against. NaN propagates through every activation (relu included, as in
// PyTorch); relu(-inf) = 0, gelu(-inf) = gelu_tanh(-inf) = silu(-inf) = NaN by these formulas.
#pragma once
#include <cmath>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::ref {

inline double activate(fmlp_activation_t act, double x) {
  switch (act) {
    case FMLP_ACT_RELU: return x > 0.0 ? x : (std::isnan(x) ? x : 0.0);
    case FMLP_ACT_GELU: return 0.5 * x * (1.0 + std::erf(x * 0.70710678118654752440));
    case FMLP_ACT_GELU_TANH: {
      const double k = 0.79788456080286535588;  // sqrt(2/pi)
      return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
    }
    case FMLP_ACT_SILU: return x / (1.0 + std::exp(-x));
    case FMLP_ACT_RELU2: {
      const double r = x > 0.0 ? x : (std::isnan(x) ? x : 0.0);
      return r * r;
    }
    case FMLP_ACT_MAX_ENUM: break;  // not an activation (validation rejects it)
  }
  return std::nan("");
}

}  // namespace fmlp::ref
