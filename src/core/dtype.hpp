// Host-side scalar conversions for the storage dtypes. Used by the ref backend, packing and tests;
// the CPU and CUDA kernels have their own vectorised versions.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

inline size_t dtype_size(fmlp_dtype_t t) {
  switch (t) {
    case FMLP_DTYPE_F32: return 4;
    case FMLP_DTYPE_F16:
    case FMLP_DTYPE_BF16: return 2;
    case FMLP_DTYPE_F8_E4M3: return 1;
    default: return 0;
  }
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(uint16_t h) {
  return bits_to_float(uint32_t(h) << 16);
}

// Round to nearest even; NaN stays NaN (quiet bit forced so truncation cannot make it Inf).
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
  // subnormal: mant * 2^-24
  const float v = std::ldexp(float(mant), -24);
  return sign ? -v : v;
}

inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (abs < 0x38800000u) {                                  // below 2^-14: subnormal or zero
    const float a = bits_to_float(abs);
    const float scaled = a * 16777216.0f;  // a / 2^-24, exact
    return uint16_t(sign | uint16_t(std::nearbyint(scaled)));
  }
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even at bit 13
  return uint16_t(sign | uint16_t(((m >> 13) - (112u << 10)) & 0x7fffu));
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no Inf; 0x7f/0xff are NaN; max 448.
inline float f8e4m3_to_float(uint8_t v) {
  const bool neg = v & 0x80;
  const int exp = (v >> 3) & 0xf;
  const int mant = v & 0x7;
  float r;
  if (exp == 0xf && mant == 0x7) return std::nanf("");
  if (exp == 0)
    r = std::ldexp(float(mant), -9);  // subnormal: mant/8 * 2^-6
  else
    r = std::ldexp(1.0f + float(mant) / 8.0f, exp - 7);
  return neg ? -r : r;
}

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

}  // namespace fmlp::detail
