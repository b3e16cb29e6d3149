// Host-side scalar conversions between fp32 and the storage dtypes (bf16, fp16, float8_e4m3fn).
// Header-only; handy for preparing weights and for reading results. The rounding is round to
// nearest even everywhere, and NaN stays NaN.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "fusedmlp/fusedmlp.h"

namespace fmlp {

// Bytes per element; 0 for an unknown dtype.
inline size_t dtype_size(fmlp_dtype_t t) {
  switch (t) {
    case FMLP_DTYPE_F32: return 4;
    case FMLP_DTYPE_F16:
    case FMLP_DTYPE_BF16: return 2;
    case FMLP_DTYPE_F8_E4M3: return 1;
    default: return 0;
  }
}

inline float float_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t bits_from_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(uint16_t h) {
  return float_from_bits(uint32_t(h) << 16);
}

// Round to nearest even; a NaN keeps a mantissa bit so it cannot turn into Inf.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = bits_from_float(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return float_from_bits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float v = std::ldexp(float(mantissa), -24);
    return sign ? -v : v;
  }
  return float_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_f16(float f) {
  const uint32_t u = bits_from_float(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (a < 0x38800000u)  // below 2^-14: a multiple of 2^-24 after rounding
    return uint16_t(sign | uint16_t(std::nearbyint(float_from_bits(a) * 16777216.0f)));
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return uint16_t(sign | uint16_t((r >> 13) - (112u << 10)));
}

// float8_e4m3fn: bias 7, no Inf, 0x7f is NaN, largest finite 448.
inline float f8e4m3_to_float(uint8_t v) {
  const int exponent = (v >> 3) & 0xf;
  const int mantissa = v & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::nanf("");
  const float r = exponent == 0 ? std::ldexp(float(mantissa), -9)
                                : std::ldexp(1.0f + float(mantissa) / 8.0f, exponent - 7);
  return (v & 0x80) ? -r : r;
}

// Round to nearest even, saturating finite values to +-448; NaN stays NaN (0x7f). Weights are
// scaled into range before this.
inline uint8_t float_to_f8e4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (std::isnan(a)) return 0x7f;
  if (a >= 448.0f) return uint8_t(sign | 0x7e);
  if (a < 0.015625f)  // below 2^-6: subnormal steps of 2^-9; 8 steps encode 2^-6 itself
    return uint8_t(sign | uint8_t(std::nearbyint(a * 512.0f)));
  int e2 = 0;
  const float fraction = std::frexp(a, &e2);  // a = fraction * 2^e2, fraction in [0.5, 1)
  int exponent = e2 - 1;
  int q = int(std::nearbyint(fraction * 16.0f));  // 1.mmm in eighths: 8..16
  if (q == 16) {
    q = 8;
    ++exponent;
  }
  return uint8_t(sign | ((exponent + 7) << 3) | (q - 8));
}

}  // namespace fmlp
