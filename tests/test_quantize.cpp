// fmlp_quantize_fp8: the policy documented in fusedmlp.h (scale = amax / 448 over finite values,
// 1 for empty rows; round to nearest even; NaN kept; Inf and overflow saturated), its round-trip
// error bound, bad input (outputs untouched), and the cpu kernels' decoding of every e4m3 code.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.hpp"

namespace {

using fmlp::f8e4m3_to_float;

// w / scale is within half a step of e4m3 from the decoded code: the nearest code, checked
// against both neighbours of the chosen code (independent of the library's rounding routine).
void expect_nearest_code(float quotient, uint8_t code, const std::string& where) {
  ASSERT_NE(code & 0x7f, 0x7f) << where << ": finite input gave NaN";
  const float a = std::fabs(quotient);
  const int mag = code & 0x7f;
  EXPECT_EQ(code & 0x80 ? 1 : 0, std::signbit(quotient) ? 1 : 0) << where << ": sign";
  const double got = f8e4m3_to_float(uint8_t(mag));
  if (a >= 448.0f) {
    EXPECT_EQ(mag, 0x7e) << where << ": " << quotient << " must saturate to 448";
    return;
  }
  const double err = std::fabs(got - a);
  if (mag > 0) {
    EXPECT_LE(err, std::fabs(f8e4m3_to_float(uint8_t(mag - 1)) - a)) << where;
  }
  if (mag < 0x7e) {
    EXPECT_LE(err, std::fabs(f8e4m3_to_float(uint8_t(mag + 1)) - a)) << where;
  }
}

std::vector<float> normal_matrix(int64_t rows, int64_t cols, float sigma, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, sigma);
  std::vector<float> w(size_t(rows * cols));
  for (float& v : w) v = n(rng);
  return w;
}

float finite_amax(const float* p, int64_t n) {
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i)
    if (std::isfinite(p[i])) m = std::max(m, std::fabs(p[i]));
  return m;
}

// Quantises w and checks the whole policy element by element.
void check_policy(const std::vector<float>& w, int64_t rows, int64_t cols, bool per_row) {
  std::vector<uint8_t> q(w.size(), 0xAA);
  std::vector<float> scale(per_row ? size_t(rows) : 1, -1.f);
  float amax = -1.f;
  const fmlp_tensor_t wt = fmlp::view(w.data(), rows, cols);
  const fmlp_tensor_t qt = fmlp_tensor_2d(q.data(), FMLP_DTYPE_F8_E4M3, rows, cols, cols);
  const fmlp_tensor_t st = fmlp::view(scale.data(), int64_t(scale.size()));
  ASSERT_EQ(fmlp_quantize_fp8(&wt, &qt, &st, &amax), FMLP_SUCCESS) << fmlp_last_error();
  EXPECT_EQ(amax, finite_amax(w.data(), int64_t(w.size())));
  for (int64_t r = 0; r < rows; ++r) {
    const float row_amax =
        per_row ? finite_amax(w.data() + r * cols, cols) : finite_amax(w.data(), rows * cols);
    const float want = row_amax / 448.0f > 0.f ? row_amax / 448.0f : 1.0f;
    const float s = scale[per_row ? size_t(r) : 0];
    ASSERT_EQ(s, want) << "row " << r;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = w[size_t(r * cols + c)];
      const uint8_t code = q[size_t(r * cols + c)];
      const std::string where = "w[" + std::to_string(r) + "][" + std::to_string(c) +
                                "] = " + std::to_string(v) + ", scale " + std::to_string(s);
      if (std::isnan(v)) {
        EXPECT_EQ(code & 0x7f, 0x7f) << where;
        continue;
      }
      if (std::isinf(v)) {
        EXPECT_EQ(code, v > 0 ? 0x7e : 0xfe) << where;
        continue;
      }
      expect_nearest_code(v / s, code, where);
      // Round trip: half an e4m3 step (2^-4 relative, 2^-10 absolute in the subnormal codes),
      // plus the fp32 roundings of the quotient and the product.
      const double back = double(f8e4m3_to_float(code)) * double(s);
      const double bound =
          std::max(std::ldexp(double(std::fabs(v)), -4), std::ldexp(double(s), -10));
      EXPECT_LE(std::fabs(back - double(v)), bound * (1 + 1e-6)) << where;
    }
  }
}

TEST(QuantizeFp8, PerTensorPolicyAndRoundTrip) {
  for (float sigma : {1e-3f, 0.02f, 1.0f, 300.0f})
    check_policy(normal_matrix(37, 129, sigma, 1), 37, 129, false);
}

TEST(QuantizeFp8, PerRowPolicyAndRoundTrip) {
  std::vector<float> w = normal_matrix(33, 65, 0.05f, 2);
  for (int64_t c = 0; c < 65; ++c) w[size_t(5 * 65 + c)] *= 1000.f;  // an outlier row
  check_policy(w, 33, 65, true);
}

// Block scales [ceil(rows / 128), ceil(cols / 128)], strided: each 128 x 128 tile (edge tiles
// smaller) by its own amax, an outlier confined to its tile, an all-zero tile scaled 1.
TEST(QuantizeFp8, BlockPolicyAndRoundTrip) {
  const int64_t rows = 300, cols = 257, rb = 3, cb = 3, ld = 5;  // scale row stride 5 > 3
  std::vector<float> w = normal_matrix(rows, cols, 0.05f, 3);
  w[size_t(130 * cols + 140)] = 900.f;  // tile (1, 1)
  for (int64_t r = 256; r < rows; ++r)
    for (int64_t c = 0; c < 128; ++c) w[size_t(r * cols + c)] = 0.f;  // tile (2, 0)
  w[size_t(5 * cols + 7)] = NAN;
  std::vector<uint8_t> q(w.size(), 0xAA);
  std::vector<float> scale(size_t(rb * ld), -1.f);
  float amax = -1.f;
  const fmlp_tensor_t wt = fmlp::view(w.data(), rows, cols);
  const fmlp_tensor_t qt = fmlp_tensor_2d(q.data(), FMLP_DTYPE_F8_E4M3, rows, cols, cols);
  const fmlp_tensor_t st = fmlp_tensor_2d(scale.data(), FMLP_DTYPE_F32, rb, cb, ld);
  ASSERT_EQ(fmlp_quantize_fp8(&wt, &qt, &st, &amax), FMLP_SUCCESS) << fmlp_last_error();
  EXPECT_EQ(amax, 900.f);
  for (int64_t i = 0; i < rb; ++i) {
    for (int64_t j = cb; j < ld; ++j) EXPECT_EQ(scale[size_t(i * ld + j)], -1.f) << "padding";
    for (int64_t j = 0; j < cb; ++j) {
      float m = 0.f;
      for (int64_t r = i * 128; r < std::min(rows, i * 128 + 128); ++r)
        for (int64_t c = j * 128; c < std::min(cols, j * 128 + 128); ++c)
          if (std::isfinite(w[size_t(r * cols + c)]))
            m = std::max(m, std::fabs(w[size_t(r * cols + c)]));
      const float s = scale[size_t(i * ld + j)];
      ASSERT_EQ(s, m / 448.0f > 0.f ? m / 448.0f : 1.0f) << "block " << i << ", " << j;
      for (int64_t r = i * 128; r < std::min(rows, i * 128 + 128); ++r)
        for (int64_t c = j * 128; c < std::min(cols, j * 128 + 128); ++c) {
          const float v = w[size_t(r * cols + c)];
          const uint8_t code = q[size_t(r * cols + c)];
          const std::string where = "w[" + std::to_string(r) + "][" + std::to_string(c) + "]";
          if (std::isnan(v)) {
            EXPECT_EQ(code & 0x7f, 0x7f) << where;
            continue;
          }
          expect_nearest_code(v / s, code, where);
        }
    }
  }
  EXPECT_EQ(scale[size_t(2 * ld + 0)], 1.0f);              // the all-zero tile
  EXPECT_GT(scale[size_t(1 * ld + 1)], 100.f * scale[0]);  // the outlier stays in its tile
}

TEST(QuantizeFp8, PerRowIsTighterThanPerTensorWithAnOutlierRow) {
  std::vector<float> w = normal_matrix(16, 256, 0.05f, 3);
  // e4m3 is floating point: a shared scale only costs precision once it pushes the other rows
  // below 2^-6 (the subnormal codes), so the outlier is 10^5 x sigma.
  w[7] = 5000.f;
  auto rms_err = [&](bool per_row) {
    std::vector<uint8_t> q(w.size());
    std::vector<float> s(per_row ? 16 : 1);
    fmlp::quantize_fp8(fmlp::view(w.data(), 16, 256),
                       fmlp_tensor_2d(q.data(), FMLP_DTYPE_F8_E4M3, 16, 256, 256),
                       fmlp::view(s.data(), int64_t(s.size())));
    double e = 0;
    for (size_t i = 256; i < w.size(); ++i) {  // rows 1..15
      const double d = f8e4m3_to_float(q[i]) * s[per_row ? i / 256 : 0] - w[i];
      e += d * d;
    }
    return std::sqrt(e);
  };
  EXPECT_LT(rms_err(true) * 4, rms_err(false));
}

TEST(QuantizeFp8, NonFiniteSaturationAndZeroRows) {
  const int64_t rows = 5, cols = 8;
  std::vector<float> w = normal_matrix(rows, cols, 1.f, 4);
  w[0] = NAN, w[1] = INFINITY, w[2] = -INFINITY;                     // row 0: amax over the rest
  for (int64_t c = 0; c < cols; ++c) w[size_t(1 * cols + c)] = 0.f;  // row 1: all zero
  for (int64_t c = 0; c < cols; ++c) w[size_t(2 * cols + c)] = c % 2 ? NAN : -INFINITY;
  for (int64_t c = 0; c < cols; ++c) w[size_t(3 * cols + c)] = 1e-45f;  // amax / 448 underflows
  w[size_t(4 * cols)] = -0.f;
  for (bool per_row : {true, false}) check_policy(w, rows, cols, per_row);
  std::vector<uint8_t> q(w.size());
  std::vector<float> s(rows);
  fmlp::quantize_fp8(fmlp::view(w.data(), rows, cols),
                     fmlp_tensor_2d(q.data(), FMLP_DTYPE_F8_E4M3, rows, cols, cols),
                     fmlp::view(s.data(), rows));
  EXPECT_EQ(q[0], 0x7f);
  EXPECT_EQ(q[1], 0x7e);
  EXPECT_EQ(q[2], 0xfe);
  EXPECT_EQ(s[1], 1.f);
  EXPECT_EQ(s[2], 1.f);
  EXPECT_EQ(s[3], 1.f);
  EXPECT_EQ(q[size_t(3 * cols)], 0x00);
  EXPECT_EQ(q[size_t(4 * cols)], 0x80);  // -0 keeps its sign
  // The row maximum maps to 448 exactly.
  const float* r4 = w.data() + 4 * cols;
  int64_t arg = 0;
  for (int64_t c = 0; c < cols; ++c)
    if (std::fabs(r4[c]) > std::fabs(r4[arg])) arg = c;
  EXPECT_EQ(q[size_t(4 * cols + arg)] & 0x7f, 0x7e);
}

TEST(QuantizeFp8, HalfPrecisionInputsAndStridedRows) {
  const int64_t rows = 9, cols = 31, ld = 40, qld = 48;
  const std::vector<float> f = normal_matrix(rows, cols, 0.3f, 5);
  for (fmlp_dtype_t t : {FMLP_DTYPE_F16, FMLP_DTYPE_BF16}) {
    std::vector<uint16_t> w(size_t(rows * ld), 0x7e00);  // NaN in the gaps: must not be read
    std::vector<float> widened(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float v = f[size_t(r * cols + c)];
        const uint16_t b = t == FMLP_DTYPE_F16 ? fmlp::float_to_f16(v) : fmlp::float_to_bf16(v);
        w[size_t(r * ld + c)] = b;
        widened[size_t(r * cols + c)] =
            t == FMLP_DTYPE_F16 ? fmlp::f16_to_float(b) : fmlp::bf16_to_float(b);
      }
    std::vector<uint8_t> q(size_t(rows * qld), 0xAA), q32(size_t(rows * cols));
    std::vector<float> s(rows), s32(rows);
    fmlp::quantize_fp8(fmlp_tensor_2d(w.data(), t, rows, cols, ld),
                       fmlp_tensor_2d(q.data(), FMLP_DTYPE_F8_E4M3, rows, cols, qld),
                       fmlp::view(s.data(), rows));
    fmlp::quantize_fp8(fmlp::view(widened.data(), rows, cols),
                       fmlp_tensor_2d(q32.data(), FMLP_DTYPE_F8_E4M3, rows, cols, cols),
                       fmlp::view(s32.data(), rows));
    EXPECT_EQ(s, s32) << fmlp_dtype_name(t);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < qld; ++c)
        EXPECT_EQ(q[size_t(r * qld + c)], c < cols ? q32[size_t(r * cols + c)] : 0xAA)
            << fmlp_dtype_name(t) << " q[" << r << "][" << c << "]";
  }
}

TEST(QuantizeFp8, ShapesWithNothingToQuantise) {
  float w[4] = {1, 2, 3, 4};
  uint8_t q[4] = {0xAA, 0xAA, 0xAA, 0xAA};
  float s[1] = {-1.f};
  float amax = -1.f;
  const fmlp_tensor_t wt = fmlp_tensor_2d(w, FMLP_DTYPE_F32, 0, 4, 4);
  const fmlp_tensor_t qt = fmlp_tensor_2d(q, FMLP_DTYPE_F8_E4M3, 0, 4, 4);
  const fmlp_tensor_t st = fmlp_tensor_1d(s, FMLP_DTYPE_F32, 1);
  ASSERT_EQ(fmlp_quantize_fp8(&wt, &qt, &st, &amax), FMLP_SUCCESS) << fmlp_last_error();
  EXPECT_EQ(s[0], 1.f);
  EXPECT_EQ(amax, 0.f);
  EXPECT_EQ(q[0], 0xAA);
}

// ---- bad input: status, a message naming the argument, and nothing written ----

struct QFixture {
  alignas(64) float w[12];
  alignas(64) uint8_t q[16];
  alignas(64) float scale[4];
  float amax = -7.f;
  fmlp_tensor_t wt, qt, st;
  QFixture() {
    for (int i = 0; i < 12; ++i) w[i] = float(i) - 5.5f;
    std::memset(q, 0xAA, sizeof q);
    for (float& s : scale) s = -3.f;
    wt = fmlp_tensor_2d(w, FMLP_DTYPE_F32, 3, 4, 4);
    qt = fmlp_tensor_2d(q, FMLP_DTYPE_F8_E4M3, 3, 4, 4);
    st = fmlp_tensor_1d(scale, FMLP_DTYPE_F32, 3);
  }
};

struct QBad {
  const char* name;
  void (*mutate)(QFixture&);
  fmlp_status_t status;
  std::vector<std::string> substrings;
  int null_arg = -1;  // 0: w, 1: q, 2: scale passed as NULL
};

const std::vector<QBad>& q_bad_cases() {
  static const std::vector<QBad> cases = {
      {"NullW", [](QFixture&) {}, FMLP_ERROR_NULL_POINTER, {"w is NULL"}, 0},
      {"NullQ", [](QFixture&) {}, FMLP_ERROR_NULL_POINTER, {"q is NULL"}, 1},
      {"NullScale", [](QFixture&) {}, FMLP_ERROR_NULL_POINTER, {"scale is NULL"}, 2},
      {"NullWData",
       [](QFixture& f) { f.wt.data = nullptr; },
       FMLP_ERROR_NULL_POINTER,
       {"w.data is NULL"}},
      {"WIsFp8",
       [](QFixture& f) { f.wt.dtype = FMLP_DTYPE_F8_E4M3; },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"w has dtype f8_e4m3", "f32, f16 or bf16"}},
      {"WDtypeUnknown",
       [](QFixture& f) { f.wt.dtype = fmlp_dtype_t(42); },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"w.dtype is 42"}},
      {"QNotFp8",
       [](QFixture& f) { f.qt.dtype = FMLP_DTYPE_BF16; },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"q has dtype bf16", "f8_e4m3"}},
      {"ScaleNotF32",
       [](QFixture& f) { f.st.dtype = FMLP_DTYPE_F16; },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"scale has dtype f16", "f32"}},
      {"ScaleWrongLength",
       [](QFixture& f) { f.st.shape[0] = 2; },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"scale has 2 entries", "1 (one scale for the tensor), 3 (one per row of w)",
        "one per 128 x 128 block"}},
      {"Scale2D",
       [](QFixture& f) { f.st = fmlp_tensor_2d(f.scale, FMLP_DTYPE_F32, 3, 1, 1); },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"scale", "ceil(rows / 128), ceil(cols / 128)"}},
      {"QShapeDiffers",
       [](QFixture& f) { f.qt = fmlp_tensor_2d(f.q, FMLP_DTYPE_F8_E4M3, 4, 3, 3); },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"q must have shape", "[3, 4]", "[4, 3]"}},
      {"WNot2D",
       [](QFixture& f) { f.wt = fmlp_tensor_1d(f.w, FMLP_DTYPE_F32, 12); },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"w must be 2-D"}},
      {"WInnerStride",
       [](QFixture& f) {
         f.wt.stride[0] = 8;
         f.wt.stride[1] = 2;
         f.wt.shape[0] = 1;
         f.qt.shape[0] = 1;
         f.st.shape[0] = 1;
       },
       FMLP_ERROR_BAD_STRIDE,
       {"w.stride[1] is 2", "contiguous"}},
      {"QOverlappingRows",
       [](QFixture& f) { f.qt.stride[0] = 2; },
       FMLP_ERROR_BAD_STRIDE,
       {"q.stride[0] is 2"}},
      {"WOnCuda",
       [](QFixture& f) { f.wt.device_type = FMLP_DEVICE_CUDA; },
       FMLP_ERROR_NOT_SUPPORTED,
       {"w is on cuda:0", "host", "once at load time"}},
      {"ScaleOnCuda",
       [](QFixture& f) { f.st.device_type = FMLP_DEVICE_CUDA; },
       FMLP_ERROR_NOT_SUPPORTED,
       {"scale is on cuda:0"}},
      {"QOverlapsW",
       [](QFixture& f) {
         f.qt.data = f.w;
         f.qt.shape[0] = 1;
         f.wt.shape[0] = 1;
         f.st.shape[0] = 1;
       },
       FMLP_ERROR_ALIASING,
       {"q overlaps w"}},
      {"ScaleOverlapsQ",
       [](QFixture& f) { f.st.data = f.q; },
       FMLP_ERROR_ALIASING,
       {"scale overlaps q"}},
  };
  return cases;
}

class QuantizeBadInput : public ::testing::TestWithParam<size_t> {};

TEST_P(QuantizeBadInput, RejectedWithoutWrites) {
  const QBad& bc = q_bad_cases()[GetParam()];
  QFixture f;
  bc.mutate(f);
  uint8_t q_before[16];
  float s_before[4];
  std::memcpy(q_before, f.q, sizeof q_before);
  std::memcpy(s_before, f.scale, sizeof s_before);
  const fmlp_status_t s =
      fmlp_quantize_fp8(bc.null_arg == 0 ? nullptr : &f.wt, bc.null_arg == 1 ? nullptr : &f.qt,
                        bc.null_arg == 2 ? nullptr : &f.st, &f.amax);
  const std::string msg = fmlp_last_error();
  EXPECT_EQ(s, bc.status) << fmlp_status_name(s) << ": " << msg;
  for (const std::string& sub : bc.substrings)
    EXPECT_NE(msg.find(sub), std::string::npos) << "\"" << msg << "\" lacks \"" << sub << "\"";
  EXPECT_EQ(std::memcmp(q_before, f.q, sizeof q_before), 0) << "q was written";
  EXPECT_EQ(std::memcmp(s_before, f.scale, sizeof s_before), 0) << "scale was written";
  EXPECT_EQ(f.amax, -7.f) << "amax_out was written";
}

INSTANTIATE_TEST_SUITE_P(Cases, QuantizeBadInput, ::testing::Range<size_t>(0, q_bad_cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return std::string(q_bad_cases()[info.param].name);
                         });

TEST(QuantizeFp8, CppWrapperThrowsWithTheStatus) {
  QFixture f;
  f.qt.dtype = FMLP_DTYPE_F32;
  try {
    fmlp::quantize_fp8(f.wt, f.qt, f.st);
    FAIL() << "no exception";
  } catch (const fmlp::Error& e) {
    EXPECT_EQ(e.status(), FMLP_ERROR_DTYPE_MISMATCH);
  }
}

// ---- every e4m3 code through every host kernel, exactly ----
// d_in = 1, x = +1 and -1, w1 = the 256 codes (one per hidden unit), relu, w2 = identity (code
// 0x38 = 1.0): y row 0 = relu(code * s), row 1 = relu(-code * s), both exact in fp32, so row 0 -
// row 1 must equal the decoded code times the scale bit for bit. The NaN codes (0x7f, 0xff) would
// poison every output through w2's zeros, so they get their own hidden units in a second run,
// where every output must be NaN.
TEST(Fp8Kernels, DecodeEveryCodeExactly) {
  constexpr int64_t H = 256;
  std::vector<uint8_t> w2(size_t(H * H), 0);
  for (int64_t j = 0; j < H; ++j) w2[size_t(j * H + j)] = 0x38;
  float x[2] = {1.f, -1.f};
  std::vector<float> y(size_t(2 * H));
  for (float s1 : {1.0f, 0.125f, 3.0f})
    for (int variant = 0; variant < 3; ++variant) {
      const bool per_row = variant == 1, nan = variant == 2;
      std::vector<uint8_t> w1(H);
      for (int64_t j = 0; j < H; ++j) w1[size_t(j)] = (j & 0x7f) == 0x7f && !nan ? 0 : uint8_t(j);
      std::vector<float> scale1(per_row ? H : 1, s1), scale2(per_row ? H : 1, 1.f);
      fmlp_mlp_args_t a{};
      a.x = fmlp::view(x, 2, 1);
      a.y = fmlp::view(y.data(), 2, H);
      a.weights.w1 = fmlp_tensor_2d(w1.data(), FMLP_DTYPE_F8_E4M3, H, 1, 1);
      a.weights.w1_scale = fmlp::view(scale1.data(), int64_t(scale1.size()));
      a.weights.w2 = fmlp_tensor_2d(w2.data(), FMLP_DTYPE_F8_E4M3, H, H, H);
      a.weights.w2_scale = fmlp::view(scale2.data(), int64_t(scale2.size()));
      a.config = fmlp_mlp_config_default();
      a.config.activation = FMLP_ACT_RELU;
      int ran = 0;
      for (int k = 0; k < fmlp_mlp_kernel_count(); ++k) {
        const fmlp_backend_t b = fmlp_mlp_kernel_backend(k);
        if (b == FMLP_BACKEND_CUDA || fmlp_backend_available(b) != FMLP_SUCCESS) continue;
        const char* name = fmlp_mlp_kernel_name(k);
        if (fmlp_mlp_kernel_supports(&a, name) != FMLP_SUCCESS) continue;
        size_t bytes = 0;
        ASSERT_EQ(fmlp_mlp_kernel_workspace_size(&a, name, &bytes), FMLP_SUCCESS);
        std::vector<unsigned char> ws(bytes);
        std::fill(y.begin(), y.end(), -123.f);
        ASSERT_EQ(fmlp_mlp_with_kernel(&a, name, ws.data(), ws.size(), nullptr), FMLP_SUCCESS)
            << name << ": " << fmlp_last_error();
        for (int64_t j = 0; j < H; ++j) {
          const float want = f8e4m3_to_float(uint8_t(j)) * s1;
          const float got = y[size_t(j)] - y[size_t(H + j)];
          if (nan)
            EXPECT_TRUE(std::isnan(y[size_t(j)]) && std::isnan(y[size_t(H + j)]))
                << name << " output " << j;
          else if (std::isnan(want))
            EXPECT_EQ(got, 0.f) << name << " (NaN code replaced by 0)";
          else
            EXPECT_EQ(got, want) << name << " code 0x" << std::hex << j << std::dec << " scale "
                                 << s1 << (per_row ? " per row" : " per tensor");
        }
        ++ran;
      }
      EXPECT_GT(ran, 0);
    }
}

}  // namespace
