// float8_e4m3fn -> fp32 in AVX2 registers, for the cpu kernels' fp8 weight paths.
//
// Why bit manipulation + F16C rather than a 256-entry table and _mm256_i32gather_ps: an e4m3 code
// shifted left by 7 is an fp16 bit pattern whose value is exactly code / 256, subnormal codes
// included (e4m3's 4-bit exponent with bias 7 lands in fp16's 5-bit field with bias 15, and e = 0
// becomes an fp16 subnormal of the same mantissa). So 16 codes take a widening move, three
// integer ops, a NaN fix-up (three ops) and two vcvtph2ps: ~11 uops, all on pipelined ports.
// A gather of 8 lanes costs ~8 load uops and issues about once every 4-5 cycles on Skylake and
// Zen 3 (much worse on Zen 2), so the table would cap a core below the ~3 codes/cycle that the
// M = 1 decode loop must convert to keep up with memory. F16C converts fp16 subnormals whatever
// MXCSR.DAZ says, so callers that flush denormals still get the subnormal codes exactly.
//
// The 1/256 is folded into the scale: the kernels multiply a dot product (decode) or a packed
// weight (blocked) by 256 and then by the row's scale.
//
// NaN: e4m3fn has no Inf; 0x7f and 0xff are NaN, which the shift alone would turn into
// +-1.875. Those lanes are forced to all-ones (an fp16 NaN) before the conversion.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace fmlp::detail::cpu {

// What the fp8 loaders return times this is the weight's value.
constexpr float kF8Unscale = 256.0f;

// 16 e4m3 codes (as 16-bit lanes 0x00cc) -> fp16 bit patterns of code / 256.
inline __m256i f8_codes_to_f16(__m256i x) {
  // x << 8 puts the sign at bit 15 and the 7 magnitude bits at 14..8; an arithmetic shift right
  // by 1 moves the magnitude to 13..7 and copies the sign into bit 14, which the mask clears.
  const __m256i s = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1);
  const __m256i h = _mm256_and_si256(s, _mm256_set1_epi16(int16_t(0xBFFF)));
  // NaN codes are the ones whose magnitude bits (now 13..7) are all set.
  const __m256i nan =
      _mm256_cmpeq_epi16(_mm256_and_si256(s, _mm256_set1_epi16(0x3F80)), _mm256_set1_epi16(0x3F80));
  return _mm256_or_si256(h, nan);
}

// 16 codes at p -> lanes 0..7 in *lo, 8..15 in *hi, each code / 256 as fp32.
inline void load16_f8(const void* p, __m256* lo, __m256* hi) {
  const __m256i h =
      f8_codes_to_f16(_mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p))));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// n < 16 codes, the other lanes 0; the same conversion as the full load.
inline void load16_f8_partial(const void* p, int64_t n, __m256* lo, __m256* hi) {
  alignas(16) unsigned char buf[16] = {};
  std::memcpy(buf, p, size_t(n));
  load16_f8(buf, lo, hi);
}

// 8 codes at p -> code / 256 as fp32.
inline __m256 load8_f8(const void* p) {
  const __m256i h =
      f8_codes_to_f16(_mm256_cvtepu8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(p))));
  return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
}

// n < 8 codes, the other lanes 0.
inline __m256 load8_f8_partial(const void* p, int64_t n) {
  alignas(16) unsigned char buf[16] = {};
  std::memcpy(buf, p, size_t(n));
  return load8_f8(buf);
}

}  // namespace fmlp::detail::cpu
