#include "accuracy.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace fmlp_cli {

double tolerance_for(fmlp_dtype_t out_dtype) {
  switch (out_dtype) {
    case FMLP_DTYPE_F16: return std::ldexp(1.0, -10);
    case FMLP_DTYPE_BF16: return std::ldexp(1.0, -7);
    default: return 1e-4;
  }
}

ErrorStats compare(const std::vector<float>& got, const std::vector<float>& ref, double rtol) {
  ErrorStats e;
  if (got.size() != ref.size()) {
    e.pass = false;
    return e;
  }
  double sum_sq = 0.0;
  size_t finite = 0;
  for (float r : ref)
    if (std::isfinite(r)) {
      sum_sq += double(r) * double(r);
      ++finite;
    }
  const double rms = finite ? std::sqrt(sum_sq / double(finite)) : 0.0;
  const double floor = std::max(rms, 1e-30);
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], r = ref[i];
    if (!std::isfinite(r)) {
      // Non-finite reference: the kernel must produce the same class of value.
      const bool same = (std::isnan(r) && std::isnan(g)) || g == r;
      if (!same) {
        ++e.nonfinite;
        e.pass = false;
      }
      continue;
    }
    if (!std::isfinite(g)) {
      ++e.nonfinite;
      e.pass = false;
      continue;
    }
    const double abs_err = std::fabs(g - r);
    const double rel = abs_err / std::max(std::fabs(r), floor);
    e.max_abs = std::max(e.max_abs, abs_err);
    if (e.worst < 0 || rel > e.max_rel) {
      e.max_rel = rel;
      e.worst = int64_t(i);
    }
  }
  if (e.max_rel > rtol) e.pass = false;
  return e;
}

std::string summarize(const ErrorStats& e, double rtol) {
  std::string s =
      fmt::format("max abs {:.3e}  max rel {:.3e} (tol {:.1e})", e.max_abs, e.max_rel, rtol);
  if (e.nonfinite) s += fmt::format("  {} non-finite", e.nonfinite);
  return s;
}

}  // namespace fmlp_cli
