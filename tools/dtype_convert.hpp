// The CLI's scalar dtype conversions come from the public header; the short names here keep the
// call sites readable.
#pragma once
#include "fusedmlp/dtype.hpp"

namespace fmlp_cli {

using fmlp::bf16_to_float;
using fmlp::f16_to_float;
using fmlp::f8e4m3_to_float;
using fmlp::float_to_bf16;
using fmlp::float_to_f16;
using fmlp::float_to_f8e4m3;
inline size_t dtype_bytes(fmlp_dtype_t t) {
  return fmlp::dtype_size(t);
}

}  // namespace fmlp_cli
