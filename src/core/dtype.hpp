// Element access by runtime dtype for the ref backend, packing and tests (the scalar conversions
// are the public ones in fusedmlp/dtype.hpp; the CPU and CUDA kernels have vectorised versions).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

using fmlp::bf16_to_float;
using fmlp::dtype_size;
using fmlp::f16_to_float;
using fmlp::f8e4m3_to_float;
using fmlp::float_to_bf16;
using fmlp::float_to_f16;

inline double load_as_double(const void* base, fmlp_dtype_t t, int64_t index) {
  switch (t) {
    case FMLP_DTYPE_F32: return static_cast<const float*>(base)[index];
    case FMLP_DTYPE_F16: return f16_to_float(static_cast<const uint16_t*>(base)[index]);
    case FMLP_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[index]);
    case FMLP_DTYPE_F8_E4M3: return f8e4m3_to_float(static_cast<const uint8_t*>(base)[index]);
    default: return std::nan("");
  }
}

// Rounds once from double to the storage dtype (double -> float -> narrow is a double rounding
// for fp16/bf16, but its effect is below every tolerance we use and matches what GPUs do).
inline void store_from_double(void* base, fmlp_dtype_t t, int64_t index, double v) {
  switch (t) {
    case FMLP_DTYPE_F32: static_cast<float*>(base)[index] = float(v); break;
    case FMLP_DTYPE_F16: static_cast<uint16_t*>(base)[index] = float_to_f16(float(v)); break;
    case FMLP_DTYPE_BF16: static_cast<uint16_t*>(base)[index] = float_to_bf16(float(v)); break;
    default: break;
  }
}

// v as stored in t and read back (f32, f16, bf16; other dtypes leave v as it is).
inline double round_to_dtype(double v, fmlp_dtype_t t) {
  uint16_t h = 0;
  switch (t) {
    case FMLP_DTYPE_F32: return double(float(v));
    case FMLP_DTYPE_F16: store_from_double(&h, t, 0, v); return load_as_double(&h, t, 0);
    case FMLP_DTYPE_BF16: store_from_double(&h, t, 0, v); return load_as_double(&h, t, 0);
    default: return v;
  }
}

}  // namespace fmlp::detail
