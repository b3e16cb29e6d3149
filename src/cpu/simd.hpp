// AVX2/FMA/F16C building blocks shared by the cpu mlp kernels: dtype-aware 8-lane loads and
// stores, fp32 activations with the NaN/Inf behaviour of src/ref/activation.hpp, and the one
// horizontal reduction every dot product goes through (so results never depend on which code
// path or thread produced them).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail::cpu {

inline size_t elem_size(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F32 ? 4 : t == FMLP_DTYPE_F8_E4M3 ? 1 : 2;
}

template <fmlp_dtype_t T>
inline __m256 load8(const void* p) {
  if constexpr (T == FMLP_DTYPE_F32) {
    return _mm256_loadu_ps(static_cast<const float*>(p));
  } else if constexpr (T == FMLP_DTYPE_F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  } else {  // bf16 is the high half of an fp32
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}

inline __m256 load8(const void* p, fmlp_dtype_t t) {
  switch (t) {
    case FMLP_DTYPE_F16: return load8<FMLP_DTYPE_F16>(p);
    case FMLP_DTYPE_BF16: return load8<FMLP_DTYPE_BF16>(p);
    default: return load8<FMLP_DTYPE_F32>(p);
  }
}

// n < 8 elements, the other lanes 0; the same conversion as the full load.
template <fmlp_dtype_t T>
inline __m256 load_partial(const void* p, int64_t n) {
  alignas(32) unsigned char buf[32] = {};
  std::memcpy(buf, p, size_t(n) * (T == FMLP_DTYPE_F32 ? 4 : 2));
  return load8<T>(buf);
}

inline __m256 load_partial(const void* p, fmlp_dtype_t t, int64_t n) {
  alignas(32) unsigned char buf[32] = {};
  std::memcpy(buf, p, size_t(n) * elem_size(t));
  return load8(buf, t);
}

// Up to 8 elements (n >= 8 means a full load) of a vector that may be absent (then `fill`).
inline __m256 load_upto8(const void* p, fmlp_dtype_t t, int64_t n, float fill) {
  if (p == nullptr) return _mm256_set1_ps(fill);
  return n >= 8 ? load8(p, t) : load_partial(p, t, n);
}

// fp32 -> bf16, round to nearest even; NaN stays NaN (quiet bit set), as float_to_bf16 does.
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, nan, is_nan);
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

inline void store8(void* p, fmlp_dtype_t t, __m256 v) {
  switch (t) {
    case FMLP_DTYPE_F16:
      _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
      break;
    case FMLP_DTYPE_BF16: _mm_storeu_si128(static_cast<__m128i*>(p), to_bf16(v)); break;
    default: _mm256_storeu_ps(static_cast<float*>(p), v); break;
  }
}

inline void store_upto8(void* p, fmlp_dtype_t t, __m256 v, int64_t n) {
  if (n >= 8) return store8(p, t, v);
  alignas(32) unsigned char buf[32];
  store8(buf, t, v);
  std::memcpy(p, buf, size_t(n) * elem_size(t));
}

// Sums of four 8-lane accumulators as lanes 0..3, each reduced as
// ((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7)) whatever the other three hold.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// e^x to ~2e-7 relative; +inf above the fp32 range, 0 below it, NaN kept. min/max take x as the
// second operand so a NaN passes through them.
inline __m256 exp8(__m256 x) {
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.3f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  // Taylor series to r^7: truncation below 6e-9 for |r| <= ln2/2.
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()),
                       _mm256_cmp_ps(x, _mm256_set1_ps(88.72f), _CMP_GT_OQ));
  return _mm256_blendv_ps(y, _mm256_setzero_ps(),
                          _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
}

// erf by Abramowitz-Stegun 7.1.26 (1.5e-7 absolute): gelu only needs 1 + erf, which that keeps
// to 1.5e-7 relative near 0 where gelu is largest relative to its error.
inline __m256 erf8(__m256 z) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign_mask, z);
  const __m256 t = _mm256_div_ps(
      _mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), a, _mm256_set1_ps(1.f)));
  __m256 p = _mm256_set1_ps(1.061405429f);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
  p = _mm256_mul_ps(p, t);
  const __m256 e = exp8(_mm256_mul_ps(_mm256_xor_ps(a, sign_mask), a));
  const __m256 r = _mm256_fnmadd_ps(p, e, _mm256_set1_ps(1.0f));
  return _mm256_or_ps(r, _mm256_and_ps(z, sign_mask));
}

inline __m256 activate8(fmlp_activation_t act, __m256 x) {
  switch (act) {
    case FMLP_ACT_RELU: return _mm256_max_ps(_mm256_setzero_ps(), x);  // NaN kept, -inf -> 0
    case FMLP_ACT_GELU: {
      const __m256 e = erf8(_mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f)));
      return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x),
                           _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    }
    case FMLP_ACT_GELU_TANH: {
      // 0.5 x (1 + tanh u) = x / (1 + e^(-2u)); the non-finite cases match the tanh form.
      const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.79788456080286535588f),
                                     _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
      const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u));
      return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    }
    case FMLP_ACT_SILU: {
      const __m256 e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
      return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    }
    case FMLP_ACT_RELU2: {
      const __m256 r = _mm256_max_ps(_mm256_setzero_ps(), x);  // NaN kept, -inf -> 0
      return _mm256_mul_ps(r, r);
    }
    case FMLP_ACT_MAX_ENUM: break;  // not an activation (validation rejects it)
  }
  return x;
}

}  // namespace fmlp::detail::cpu
