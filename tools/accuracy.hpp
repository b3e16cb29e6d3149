// Comparing an output against the reference, with the project's tolerances.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.h"

namespace fmlp_cli {

// Allowed relative error for an output dtype: fp32 1e-4; fp16 and bf16 twice the unit roundoff
// (2^-10 and 2^-7).
double tolerance_for(fmlp_dtype_t out_dtype);

struct ErrorStats {
  double max_abs = 0.0;
  double max_rel = 0.0;   // max |got - ref| / max(|ref|, rms(ref))
  int64_t worst = -1;     // index of the element with max_rel
  int64_t nonfinite = 0;  // got is NaN/Inf where ref is finite
  bool pass = true;
};

// Relative to max(|ref|, rms(ref)) so that outputs near zero (cancellation) are judged against
// the output's scale rather than their own tiny magnitude.
ErrorStats compare(const std::vector<float>& got, const std::vector<float>& ref, double rtol);

std::string summarize(const ErrorStats& e, double rtol);

}  // namespace fmlp_cli
