// Every bad input is rejected with its own status and a message naming the argument, the expected
// and the actual value, identically by every entry point, and without writing any memory.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.h"

namespace {

constexpr const char* kRefKernel = "mlp_ref_scalar_fp64";

// All memory a case can point at, so one memcmp proves nothing was written.
struct Storage {
  alignas(64) float x[16], y[16], res[16], w1[16], wu[16], w2[16];
  alignas(64) float b1[8], bu[8], b2[8], gamma[8], beta[8], scale[8];
  alignas(64) uint8_t w8[64];
};

// A valid dense f32 problem: M = 2, d_in = 4, hidden = 3, d_out = 4, with b1 and b2.
struct Fixture {
  Storage s;
  fmlp_mlp_args_t args{};
  Fixture() {
    for (float* a : {s.x, s.res, s.w1, s.wu, s.w2}) std::fill(a, a + 16, 0.25f);
    for (float* a : {s.b1, s.bu, s.b2, s.gamma, s.beta, s.scale}) std::fill(a, a + 8, 1.0f);
    std::memset(s.y, 0x5A, sizeof s.y);
    std::memset(s.w8, 0x38, sizeof s.w8);  // e4m3 1.0
    args.x = fmlp_tensor_2d(s.x, FMLP_DTYPE_F32, 2, 4, 4);
    args.y = fmlp_tensor_2d(s.y, FMLP_DTYPE_F32, 2, 4, 4);
    args.weights.w1 = fmlp_tensor_2d(s.w1, FMLP_DTYPE_F32, 3, 4, 4);
    args.weights.b1 = fmlp_tensor_1d(s.b1, FMLP_DTYPE_F32, 3);
    args.weights.w2 = fmlp_tensor_2d(s.w2, FMLP_DTYPE_F32, 4, 3, 3);
    args.weights.b2 = fmlp_tensor_1d(s.b2, FMLP_DTYPE_F32, 4);
    args.config = fmlp_mlp_config_default();
  }
  fmlp_mlp_weights_t& w() { return args.weights; }
  // fp8 weights with per-tensor host scales.
  void use_fp8() {
    w().w1 = fmlp_tensor_2d(s.w8, FMLP_DTYPE_F8_E4M3, 3, 4, 4);
    w().w2 = fmlp_tensor_2d(s.w8 + 16, FMLP_DTYPE_F8_E4M3, 4, 3, 3);
    w().w1_scale = fmlp_tensor_1d(s.scale, FMLP_DTYPE_F32, 1);
    w().w2_scale = fmlp_tensor_1d(s.scale + 4, FMLP_DTYPE_F32, 1);
  }
  // Every tensor marked as living on CUDA device 0 (pointers never dereferenced).
  void all_on_cuda() {
    for (fmlp_tensor_t* t : {&args.x, &args.y, &w().w1, &w().b1, &w().w2, &w().b2})
      t->device_type = FMLP_DEVICE_CUDA;
  }
};

// What the library may touch before failing: nothing.
void* bogus_device_pointer() {
  return reinterpret_cast<void*>(uintptr_t(0x1000));
}

struct BadCase {
  const char* name;
  std::function<void(Fixture&)> mutate;
  fmlp_status_t status;
  std::vector<std::string> substrings;
  enum Scope { kAll, kWeightsOnly, kActivationsOnly, kArgsNull } scope = kAll;
};

using F = Fixture&;
const std::vector<BadCase>& bad_cases() {
  static const std::vector<BadCase> cases = {
      // shapes
      {"XColsVsW1",
       [](F f) { f.args.x = fmlp_tensor_2d(f.s.x, FMLP_DTYPE_F32, 2, 5, 5); },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"x must have shape", "[*, 4]", "[2, 5]"},
       BadCase::kActivationsOnly},
      {"W2RowsVsYCols",
       [](F f) { f.args.y = fmlp_tensor_2d(f.s.y, FMLP_DTYPE_F32, 2, 3, 3); },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.w2 has 4 rows", "y has 3 columns"}},
      {"W2ColsVsHidden",
       [](F f) { f.w().w2 = fmlp_tensor_2d(f.s.w2, FMLP_DTYPE_F32, 4, 2, 2); },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.w2 must have shape", "[4, 3]", "[4, 2]"},
       BadCase::kWeightsOnly},
      {"B1Length",
       [](F f) { f.w().b1.shape[0] = 4; },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.b1", "[3]", "[4]"},
       BadCase::kWeightsOnly},
      {"B2Length",
       [](F f) { f.w().b2.shape[0] = 5; },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.b2", "[4]", "[5]"},
       BadCase::kWeightsOnly},
      {"B1Not1D",
       [](F f) { f.w().b1 = fmlp_tensor_2d(f.s.b1, FMLP_DTYPE_F32, 1, 3, 3); },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.b1 must be 1-D", "2-D"},
       BadCase::kWeightsOnly},
      {"StackedW1OddRows",
       [](F f) { f.args.config.gated = 1; },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.w1 has 3 rows", "even"},
       BadCase::kWeightsOnly},
      {"SeparateUpShape",
       [](F f) {
         f.args.config.gated = 1;
         f.w().w_up = fmlp_tensor_2d(f.s.wu, FMLP_DTYPE_F32, 2, 4, 4);
       },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.w_up must have shape", "[3, 4]", "[2, 4]"},
       BadCase::kWeightsOnly},
      {"ResidualShape",
       [](F f) { f.args.residual = fmlp_tensor_2d(f.s.res, FMLP_DTYPE_F32, 2, 3, 3); },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"residual must have shape", "[2, 4]", "[2, 3]"},
       BadCase::kActivationsOnly},
      {"XNot2D",
       [](F f) { f.args.x = fmlp_tensor_1d(f.s.x, FMLP_DTYPE_F32, 8); },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"x must be 2-D", "1-D"},
       BadCase::kActivationsOnly},
      {"ZeroHidden",
       [](F f) {
         f.w().w1.shape[0] = 0;
         f.w().w2.shape[1] = 0;
       },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"hidden (0)", "> 0"},
       BadCase::kWeightsOnly},
      // dtypes
      {"YDtypeDiffers",
       [](F f) { f.args.y.dtype = FMLP_DTYPE_BF16; },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"y is bf16 but x is f32"},
       BadCase::kActivationsOnly},
      {"ResidualDtypeDiffers",
       [](F f) { f.args.residual = fmlp_tensor_2d(f.s.res, FMLP_DTYPE_F16, 2, 4, 4); },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"residual is f16 but x is f32"},
       BadCase::kActivationsOnly},
      {"MixedWeightDtypes",
       [](F f) { f.w().w2.dtype = FMLP_DTYPE_F16; },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"weights.w2 is f16 but weights.w1 is f32"},
       BadCase::kWeightsOnly},
      {"Fp8Activations",
       [](F f) { f.args.x.dtype = f.args.y.dtype = FMLP_DTYPE_F8_E4M3; },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"x has dtype f8_e4m3", "f32, f16 or bf16"},
       BadCase::kActivationsOnly},
      {"InvalidActivationDtype",
       [](F f) { f.args.x.dtype = fmlp_dtype_t(42); },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"x.dtype is 42"},
       BadCase::kActivationsOnly},
      {"InvalidWeightDtype",
       [](F f) { f.w().w1.dtype = FMLP_DTYPE_INVALID; },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"weights.w1.dtype is 0"},
       BadCase::kWeightsOnly},
      {"Fp8Bias",
       [](F f) { f.w().b1.dtype = FMLP_DTYPE_F8_E4M3; },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"weights.b1 has dtype f8_e4m3"},
       BadCase::kWeightsOnly},
      // enums and config
      {"InvalidActivation",
       [](F f) { f.args.config.activation = fmlp_activation_t(9); },
       FMLP_ERROR_INVALID_VALUE,
       {"config.activation is 9"},
       BadCase::kWeightsOnly},
      {"InvalidNorm",
       [](F f) { f.args.config.norm = fmlp_norm_t(5); },
       FMLP_ERROR_INVALID_VALUE,
       {"config.norm is 5"},
       BadCase::kWeightsOnly},
      {"InvalidDeviceType",
       [](F f) { f.args.x.device_type = fmlp_device_type_t(7); },
       FMLP_ERROR_INVALID_VALUE,
       {"x.device_type is 7"},
       BadCase::kActivationsOnly},
      {"GatedIsTwo",
       [](F f) { f.args.config.gated = 2; },
       FMLP_ERROR_INVALID_VALUE,
       {"config.gated is 2", "0 or 1"},
       BadCase::kWeightsOnly},
      {"LayerNormEpsZero",
       [](F f) {
         f.args.config.norm = FMLP_NORM_LAYERNORM;
         f.args.config.norm_eps = 0.f;
       },
       FMLP_ERROR_INVALID_VALUE,
       {"config.norm_eps is 0", "> 0"},
       BadCase::kWeightsOnly},
      {"RmsNormEpsNegative",
       [](F f) {
         f.args.config.norm = FMLP_NORM_RMSNORM;
         f.args.config.norm_eps = -1.f;
       },
       FMLP_ERROR_INVALID_VALUE,
       {"config.norm_eps is -1"},
       BadCase::kWeightsOnly},
      {"NormEpsNaN",
       [](F f) {
         f.args.config.norm = FMLP_NORM_RMSNORM;
         f.args.config.norm_eps = NAN;
       },
       FMLP_ERROR_INVALID_VALUE,
       {"config.norm_eps is nan"},
       BadCase::kWeightsOnly},
      {"NormBiasWithRmsNorm",
       [](F f) {
         f.args.config.norm = FMLP_NORM_RMSNORM;
         f.w().norm_bias = fmlp_tensor_1d(f.s.beta, FMLP_DTYPE_F32, 4);
       },
       FMLP_ERROR_INVALID_VALUE,
       {"weights.norm_bias", "RMSNorm"},
       BadCase::kWeightsOnly},
      {"NormWeightWithoutNorm",
       [](F f) { f.w().norm_weight = fmlp_tensor_1d(f.s.gamma, FMLP_DTYPE_F32, 4); },
       FMLP_ERROR_INVALID_VALUE,
       {"weights.norm_weight", "config.norm is none"},
       BadCase::kWeightsOnly},
      {"WUpWithDense",
       [](F f) { f.w().w_up = fmlp_tensor_2d(f.s.wu, FMLP_DTYPE_F32, 3, 4, 4); },
       FMLP_ERROR_INVALID_VALUE,
       {"weights.w_up is given but config.gated is 0"},
       BadCase::kWeightsOnly},
      {"BUpWithDense",
       [](F f) { f.w().b_up = fmlp_tensor_1d(f.s.bu, FMLP_DTYPE_F32, 3); },
       FMLP_ERROR_INVALID_VALUE,
       {"weights.b_up is given", "dense"},
       BadCase::kWeightsOnly},
      // null and absent
      {"ArgsNull", [](F) {}, FMLP_ERROR_NULL_POINTER, {"args is NULL"}, BadCase::kArgsNull},
      {"XDataNull",
       [](F f) { f.args.x.data = nullptr; },
       FMLP_ERROR_NULL_POINTER,
       {"x.data is NULL"},
       BadCase::kActivationsOnly},
      {"XAbsent",
       [](F f) { f.args.x = fmlp_tensor_none(); },
       FMLP_ERROR_NULL_POINTER,
       {"x is absent", "[M, d_in]"},
       BadCase::kActivationsOnly},
      {"YAbsent",
       [](F f) { f.args.y = fmlp_tensor_none(); },
       FMLP_ERROR_NULL_POINTER,
       {"y is absent", "[M, d_out]"}},
      {"W1Absent",
       [](F f) { f.w().w1 = fmlp_tensor_none(); },
       FMLP_ERROR_NULL_POINTER,
       {"weights.w1 is absent"},
       BadCase::kWeightsOnly},
      {"W2Absent",
       [](F f) { f.w().w2 = fmlp_tensor_none(); },
       FMLP_ERROR_NULL_POINTER,
       {"weights.w2 is absent"},
       BadCase::kWeightsOnly},
      {"W2DataNull",
       [](F f) { f.w().w2.data = nullptr; },
       FMLP_ERROR_NULL_POINTER,
       {"weights.w2.data is NULL"},
       BadCase::kWeightsOnly},
      // sizes
      {"NegativeRows",
       [](F f) { f.args.x.shape[0] = -2; },
       FMLP_ERROR_SIZE_OVERFLOW,
       {"x.shape[0] is -2", ">= 0"},
       BadCase::kActivationsOnly},
      {"NegativeDIn",
       [](F f) { f.w().w1.shape[1] = -4; },
       FMLP_ERROR_SIZE_OVERFLOW,
       {"weights.w1.shape[1] is -4"},
       BadCase::kWeightsOnly},
      {"NegativeHidden",
       [](F f) { f.w().w1.shape[0] = -3; },
       FMLP_ERROR_SIZE_OVERFLOW,
       {"weights.w1.shape[0] is -3"},
       BadCase::kWeightsOnly},
      {"ElementExtentOverflows",
       [](F f) { f.args.x.shape[0] = int64_t(1) << 61; },
       FMLP_ERROR_SIZE_OVERFLOW,
       {"x with shape [2305843009213693952, 4]", "64 bits"},
       BadCase::kActivationsOnly},
      {"ByteExtentOverflows",
       [](F f) { f.args.x.shape[0] = int64_t(1) << 60; },
       FMLP_ERROR_SIZE_OVERFLOW,
       {"x with shape [1152921504606846976, 4]", "bytes"},
       BadCase::kActivationsOnly},
      {"ElementCountWrapsToZero",  // 2^62 * 4 elements is 0 modulo 2^64
       [](F f) { f.args.x.shape[0] = f.args.y.shape[0] = int64_t(1) << 62; },
       FMLP_ERROR_SIZE_OVERFLOW,
       {"x with shape [4611686018427387904, 4]"},
       BadCase::kActivationsOnly},
      {"HugeRowStride",
       [](F f) { f.w().w1.stride[0] = int64_t(1) << 62; },
       FMLP_ERROR_SIZE_OVERFLOW,
       {"weights.w1", "stride[0] = 4611686018427387904"},
       BadCase::kWeightsOnly},
      // strides
      {"InnerStrideNotOne",
       [](F f) { f.args.x.stride[1] = 2; },
       FMLP_ERROR_BAD_STRIDE,
       {"x.stride[1] is 2", "contiguous"},
       BadCase::kActivationsOnly},
      {"OverlappingRows",
       [](F f) { f.args.x.stride[0] = 3; },
       FMLP_ERROR_BAD_STRIDE,
       {"x.stride[0] is 3", "stride >= 4"},
       BadCase::kActivationsOnly},
      {"ZeroRowStride",
       [](F f) { f.args.y.stride[0] = 0; },
       FMLP_ERROR_BAD_STRIDE,
       {"y.stride[0] is 0", "stride >= 4"},
       BadCase::kActivationsOnly},
      {"WeightRowsOverlap",
       [](F f) { f.w().w2.stride[0] = 2; },
       FMLP_ERROR_BAD_STRIDE,
       {"weights.w2.stride[0] is 2", "stride >= 3"},
       BadCase::kWeightsOnly},
      // alignment
      {"MisalignedX",
       [](F f) { f.args.x.data = reinterpret_cast<char*>(f.s.x) + 2; },
       FMLP_ERROR_MISALIGNED,
       {"x.data", "4-byte element size"},
       BadCase::kActivationsOnly},
      {"MisalignedBias",
       [](F f) { f.w().b2.data = reinterpret_cast<char*>(f.s.b2) + 1; },
       FMLP_ERROR_MISALIGNED,
       {"weights.b2.data", "4-byte element size"},
       BadCase::kWeightsOnly},
      {"MisalignedBf16",
       [](F f) {
         f.args.x.dtype = f.args.y.dtype = FMLP_DTYPE_BF16;
         f.args.x.data = reinterpret_cast<char*>(f.s.x) + 1;
       },
       FMLP_ERROR_MISALIGNED,
       {"x.data", "2-byte element size"},
       BadCase::kActivationsOnly},
      // aliasing
      {"YOverlapsX",
       [](F f) { f.args.y.data = f.s.x + 4; },
       FMLP_ERROR_ALIASING,
       {"y overlaps x"},
       BadCase::kActivationsOnly},
      {"YOverlapsW1",
       [](F f) { f.args.y.data = f.s.w1 + 2; },
       FMLP_ERROR_ALIASING,
       {"y overlaps weights.w1"}},
      {"YOverlapsB2",
       [](F f) { f.args.y.data = f.s.b2; },
       FMLP_ERROR_ALIASING,
       {"y overlaps weights.b2"}},
      {"ResidualPartiallyOverlapsY",
       [](F f) { f.args.residual = fmlp_tensor_2d(f.s.y + 1, FMLP_DTYPE_F32, 2, 4, 4); },
       FMLP_ERROR_ALIASING,
       {"residual overlaps y", "same view"},
       BadCase::kActivationsOnly},
      {"ResidualSameDataOtherStride",
       [](F f) { f.args.residual = fmlp_tensor_2d(f.s.y, FMLP_DTYPE_F32, 2, 4, 5); },
       FMLP_ERROR_ALIASING,
       {"residual overlaps y"},
       BadCase::kActivationsOnly},
      // devices: rejected before any memory is touched (bogus pointers would crash)
      {"XOnCudaOthersOnHost",
       [](F f) { f.args.x.device_type = FMLP_DEVICE_CUDA; },
       FMLP_ERROR_DEVICE_MISMATCH,
       {"x is on cuda:0", "weights are on cpu"},
       BadCase::kActivationsOnly},
      {"B2OnCudaOthersOnHost",
       [](F f) {
         f.w().b2.data = bogus_device_pointer();
         f.w().b2.device_type = FMLP_DEVICE_CUDA;
       },
       FMLP_ERROR_DEVICE_MISMATCH,
       {"weights.b2 is on cuda:0", "weights.w1 is on cpu"},
       BadCase::kWeightsOnly},
      {"Fp8ScaleOnCudaOthersOnHost",
       [](F f) {
         f.use_fp8();
         f.w().w1_scale.data = bogus_device_pointer();
         f.w().w1_scale.device_type = FMLP_DEVICE_CUDA;
       },
       FMLP_ERROR_DEVICE_MISMATCH,
       {"weights.w1_scale is on cuda:0", "cpu"},
       BadCase::kWeightsOnly},
      {"XOnOtherCudaDevice",
       [](F f) {
         f.all_on_cuda();
         f.args.x.device_id = 1;
       },
       FMLP_ERROR_DEVICE_MISMATCH,
       {"x is on cuda:1", "weights are on cuda:0"}},
      // fp8 scales
      {"Fp8WithoutScales",
       [](F f) {
         f.use_fp8();
         f.w().w1_scale = fmlp_tensor_none();
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w1 is fp8 e4m3 but weights.w1_scale is absent"},
       BadCase::kWeightsOnly},
      {"ScaleWithBf16Weights",
       [](F f) {
         f.w().w1.dtype = f.w().w2.dtype = FMLP_DTYPE_BF16;
         f.w().w1_scale = fmlp_tensor_1d(f.s.scale, FMLP_DTYPE_F32, 1);
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w1_scale is given but weights.w1 is bf16"},
       BadCase::kWeightsOnly},
      {"ScaleWrongLength",
       [](F f) {
         f.use_fp8();
         f.w().w1_scale.shape[0] = 2;
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w1_scale has 2 entries", "1 (per tensor) or 3"},
       BadCase::kWeightsOnly},
      {"ScaleZero",
       [](F f) {
         f.use_fp8();
         f.w().w2_scale = fmlp_tensor_1d(f.s.scale, FMLP_DTYPE_F32, 4);
         f.s.scale[1] = 0.f;
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w2_scale[1] is 0", "finite and > 0"},
       BadCase::kWeightsOnly},
      {"ScaleNegative",
       [](F f) {
         f.use_fp8();
         f.s.scale[0] = -1.f;
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w1_scale[0] is -1"},
       BadCase::kWeightsOnly},
      {"ScaleNaN",
       [](F f) {
         f.use_fp8();
         f.s.scale[4] = NAN;
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w2_scale[0] is nan"},
       BadCase::kWeightsOnly},
      {"ScaleInf",
       [](F f) {
         f.use_fp8();
         f.s.scale[0] = INFINITY;
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w1_scale[0] is inf"},
       BadCase::kWeightsOnly},
      {"ScaleNotF32",
       [](F f) {
         f.use_fp8();
         f.w().w1_scale.dtype = FMLP_DTYPE_F16;
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w1_scale has dtype f16", "f32"},
       BadCase::kWeightsOnly},
      {"UpScaleWithStackedGate",
       [](F f) {
         f.use_fp8();
         f.args.config.gated = 1;
         f.w().w1 = fmlp_tensor_2d(f.s.w8, FMLP_DTYPE_F8_E4M3, 6, 4, 4);
         f.w().b1.shape[0] = 6;
         f.w().w_up_scale = fmlp_tensor_1d(f.s.scale, FMLP_DTYPE_F32, 1);
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w_up_scale is given", "weights.w1_scale"},
       BadCase::kWeightsOnly},
      {"Fp8W2WithoutScale",
       [](F f) {
         f.use_fp8();
         f.w().w2_scale = fmlp_tensor_none();
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w2 is fp8 e4m3 but weights.w2_scale is absent", "[1]", "[4]"},
       BadCase::kWeightsOnly},
      {"Fp8SeparateUpWithoutScale",
       [](F f) {
         f.use_fp8();
         f.args.config.gated = 1;
         f.w().w_up = fmlp_tensor_2d(f.s.w8 + 32, FMLP_DTYPE_F8_E4M3, 3, 4, 4);
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w_up is fp8 e4m3 but weights.w_up_scale is absent"},
       BadCase::kWeightsOnly},
      {"UpScaleWrongLength",
       [](F f) {
         f.use_fp8();
         f.args.config.gated = 1;
         f.w().w_up = fmlp_tensor_2d(f.s.w8 + 32, FMLP_DTYPE_F8_E4M3, 3, 4, 4);
         f.w().w_up_scale = fmlp_tensor_1d(f.s.scale, FMLP_DTYPE_F32, 4);
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w_up_scale has 4 entries", "1 (per tensor) or 3"},
       BadCase::kWeightsOnly},
      {"ScaleNot1D",  // a 2-D scale is a block scale: one per 128 x 128 block
       [](F f) {
         f.use_fp8();
         f.w().w1_scale = fmlp_tensor_2d(f.s.scale, FMLP_DTYPE_F32, 3, 1, 1);
       },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.w1_scale must have shape", "128 x 128 block", "[1, 1]", "got [3, 1]"},
       BadCase::kWeightsOnly},
      {"Scale3D",
       [](F f) {
         f.use_fp8();
         fmlp_tensor_t t = fmlp_tensor_2d(f.s.scale, FMLP_DTYPE_F32, 1, 1, 1);
         t.ndim = 3, t.shape[2] = 1, t.stride[2] = 1;
         f.w().w1_scale = t;
       },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.w1_scale must be 1-D", "2-D", "got a 3-D tensor"},
       BadCase::kWeightsOnly},
      {"ScaleDataNull",
       [](F f) {
         f.use_fp8();
         f.w().w2_scale.data = nullptr;
         f.w().w2_scale.ndim = 1;
       },
       FMLP_ERROR_NULL_POINTER,
       {"weights.w2_scale.data is NULL"},
       BadCase::kWeightsOnly},
      {"Fp8WeightsMixedWithBf16",
       [](F f) {
         f.use_fp8();
         f.w().w2 = fmlp_tensor_2d(f.s.w2, FMLP_DTYPE_BF16, 4, 3, 3);
         f.w().w2_scale = fmlp_tensor_none();
       },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"weights.w2 is bf16 but weights.w1 is f8_e4m3"},
       BadCase::kWeightsOnly},
  };
  return cases;
}

// Replaces the thread's last error, so a stale message cannot satisfy the substring checks.
void scramble_last_error() {
  fmlp_backend_available(fmlp_backend_t(99));
}

class BadInput : public ::testing::TestWithParam<size_t> {};

TEST_P(BadInput, RejectedEverywhereWithoutWrites) {
  const BadCase& bc = bad_cases()[GetParam()];
  Fixture f;
  bc.mutate(f);
  const Storage before = f.s;
  alignas(64) static unsigned char ws[4096];
  const fmlp_mlp_args_t* a = bc.scope == BadCase::kArgsNull ? nullptr : &f.args;
  auto expect = [&](const char* api, fmlp_status_t got) {
    const std::string msg = fmlp_last_error();
    EXPECT_EQ(got, bc.status) << api << " returned " << fmlp_status_name(got) << ": " << msg;
    for (const std::string& sub : bc.substrings)
      EXPECT_NE(msg.find(sub), std::string::npos)
          << api << ": message \"" << msg << "\" does not contain \"" << sub << "\"";
    EXPECT_EQ(std::memcmp(&before, &f.s, sizeof before), 0) << api << " wrote to memory";
    scramble_last_error();
  };
  scramble_last_error();
  expect("fmlp_mlp(ref)", fmlp_mlp(a, FMLP_BACKEND_REF, ws, sizeof ws, nullptr));
  expect("fmlp_mlp(auto)", fmlp_mlp(a, FMLP_BACKEND_AUTO, ws, sizeof ws, nullptr));
  size_t bytes = 0;
  expect("fmlp_mlp_workspace_size", fmlp_mlp_workspace_size(a, FMLP_BACKEND_REF, &bytes));
  char buf[64];
  size_t needed = 0;
  expect("fmlp_mlp_explain", fmlp_mlp_explain(a, FMLP_BACKEND_REF, buf, sizeof buf, &needed));
  expect("fmlp_mlp_kernel_supports", fmlp_mlp_kernel_supports(a, kRefKernel));
  expect("fmlp_mlp_with_kernel", fmlp_mlp_with_kernel(a, kRefKernel, ws, sizeof ws, nullptr));
  if (bc.scope == BadCase::kWeightsOnly) {
    fmlp_mlp_packed_t* packed = nullptr;
    expect("fmlp_mlp_pack",
           fmlp_mlp_pack(&packed, &f.args.weights, &f.args.config, FMLP_BACKEND_REF, nullptr));
    EXPECT_EQ(packed, nullptr);
    fmlp_mlp_packed_destroy(packed);
  }
  if (bc.scope == BadCase::kActivationsOnly) {  // the weights are fine: pack them, then run
    const Fixture good;
    fmlp_mlp_packed_t* packed = nullptr;
    ASSERT_EQ(
        fmlp_mlp_pack(&packed, &good.args.weights, &good.args.config, FMLP_BACKEND_REF, nullptr),
        FMLP_SUCCESS)
        << fmlp_last_error();
    expect("fmlp_mlp_packed_run", fmlp_mlp_packed_run(packed, &f.args.y, &f.args.x,
                                                      &f.args.residual, ws, sizeof ws, nullptr));
    fmlp_mlp_packed_destroy(packed);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, BadInput, ::testing::Range<size_t>(0, bad_cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return std::string(bad_cases()[info.param].name);
                         });

// Status + message checks for one call, and y untouched.
void expect_failure(const Fixture& f, const Storage& before, fmlp_status_t got, fmlp_status_t want,
                    std::vector<std::string> subs) {
  const std::string msg = fmlp_last_error();
  EXPECT_EQ(got, want) << fmlp_status_name(got) << ": " << msg;
  for (const std::string& sub : subs)
    EXPECT_NE(msg.find(sub), std::string::npos) << "\"" << msg << "\" lacks \"" << sub << "\"";
  EXPECT_EQ(std::memcmp(&before, &f.s, sizeof before), 0) << "memory was written";
}

TEST(BadBackend, CudaBackendWithHostTensors) {
  Fixture f;
  const Storage before = f.s;
  expect_failure(f, before, fmlp_mlp(&f.args, FMLP_BACKEND_CUDA, nullptr, 0, nullptr),
                 FMLP_ERROR_DEVICE_MISMATCH, {"backend cuda", "cpu"});
  fmlp_mlp_packed_t* p = nullptr;
  expect_failure(f, before,
                 fmlp_mlp_pack(&p, &f.args.weights, &f.args.config, FMLP_BACKEND_CUDA, nullptr),
                 FMLP_ERROR_DEVICE_MISMATCH, {"backend cuda", "cpu"});
}

TEST(BadBackend, HostBackendsWithDeviceTensors) {
  Fixture f;
  f.all_on_cuda();
  const Storage before = f.s;
  for (fmlp_backend_t b : {FMLP_BACKEND_REF, FMLP_BACKEND_CPU})
    expect_failure(f, before, fmlp_mlp(&f.args, b, nullptr, 0, nullptr), FMLP_ERROR_DEVICE_MISMATCH,
                   {fmlp_backend_name(b), "cuda:0"});
}

TEST(BadBackend, InvalidBackendValue) {
  Fixture f;
  const Storage before = f.s;
  expect_failure(f, before, fmlp_mlp(&f.args, fmlp_backend_t(9), nullptr, 0, nullptr),
                 FMLP_ERROR_INVALID_VALUE, {"backend is 9"});
  EXPECT_EQ(fmlp_backend_available(fmlp_backend_t(9)), FMLP_ERROR_INVALID_VALUE);
}

TEST(BadWorkspace, NullOrTooSmall) {
  Fixture f;
  const Storage before = f.s;
  size_t need = 0;
  ASSERT_EQ(fmlp_mlp_workspace_size(&f.args, FMLP_BACKEND_REF, &need), FMLP_SUCCESS);
  ASSERT_GT(need, 1u) << "the ref kernel is expected to need scratch memory";
  const std::string n = std::to_string(need);
  std::vector<unsigned char> ws(need - 1, 0xCD);
  expect_failure(f, before, fmlp_mlp(&f.args, FMLP_BACKEND_REF, nullptr, 0, nullptr),
                 FMLP_ERROR_WORKSPACE_TOO_SMALL, {"workspace of " + n + " bytes", "NULL"});
  expect_failure(f, before, fmlp_mlp(&f.args, FMLP_BACKEND_REF, ws.data(), ws.size(), nullptr),
                 FMLP_ERROR_WORKSPACE_TOO_SMALL,
                 {"workspace of " + n + " bytes", "got " + std::to_string(need - 1)});
  expect_failure(f, before,
                 fmlp_mlp_with_kernel(&f.args, kRefKernel, ws.data(), ws.size(), nullptr),
                 FMLP_ERROR_WORKSPACE_TOO_SMALL, {kRefKernel, n + " bytes"});
  expect_failure(f, before, fmlp_mlp_with_kernel(&f.args, kRefKernel, nullptr, need, nullptr),
                 FMLP_ERROR_WORKSPACE_TOO_SMALL, {kRefKernel, n + " bytes"});
  EXPECT_TRUE(std::all_of(ws.begin(), ws.end(), [](unsigned char c) { return c == 0xCD; }));
}

TEST(BadKernelName, UnknownOrNull) {
  Fixture f;
  const Storage before = f.s;
  alignas(64) static unsigned char ws[4096];
  size_t bytes = 0;
  expect_failure(f, before,
                 fmlp_mlp_with_kernel(&f.args, "mlp_no_such_kernel", ws, sizeof ws, nullptr),
                 FMLP_ERROR_INVALID_VALUE, {"'mlp_no_such_kernel'"});
  expect_failure(f, before, fmlp_mlp_kernel_supports(&f.args, "mlp_no_such_kernel"),
                 FMLP_ERROR_INVALID_VALUE, {"'mlp_no_such_kernel'"});
  expect_failure(f, before, fmlp_mlp_kernel_workspace_size(&f.args, "mlp_no_such_kernel", &bytes),
                 FMLP_ERROR_INVALID_VALUE, {"'mlp_no_such_kernel'"});
  expect_failure(f, before, fmlp_mlp_with_kernel(&f.args, nullptr, ws, sizeof ws, nullptr),
                 FMLP_ERROR_NULL_POINTER, {"kernel name is NULL"});
  expect_failure(f, before, fmlp_mlp_kernel_workspace_size(&f.args, kRefKernel, nullptr),
                 FMLP_ERROR_NULL_POINTER, {"bytes is NULL"});
  expect_failure(f, before, fmlp_mlp_workspace_size(&f.args, FMLP_BACKEND_REF, nullptr),
                 FMLP_ERROR_NULL_POINTER, {"bytes is NULL"});
}

TEST(BadPack, NullArguments) {
  Fixture f;
  fmlp_mlp_packed_t* p = nullptr;
  EXPECT_EQ(fmlp_mlp_pack(nullptr, &f.args.weights, &f.args.config, FMLP_BACKEND_REF, nullptr),
            FMLP_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fmlp_last_error()).find("packed is NULL"), std::string::npos);
  EXPECT_EQ(fmlp_mlp_pack(&p, nullptr, &f.args.config, FMLP_BACKEND_REF, nullptr),
            FMLP_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fmlp_last_error()).find("weights is NULL"), std::string::npos);
  EXPECT_EQ(fmlp_mlp_pack(&p, &f.args.weights, nullptr, FMLP_BACKEND_REF, nullptr),
            FMLP_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fmlp_last_error()).find("config is NULL"), std::string::npos);
  EXPECT_EQ(fmlp_mlp_packed_run(nullptr, &f.args.y, &f.args.x, nullptr, nullptr, 0, nullptr),
            FMLP_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fmlp_last_error()).find("packed is NULL"), std::string::npos);
  ASSERT_EQ(fmlp_mlp_pack(&p, &f.args.weights, &f.args.config, FMLP_BACKEND_REF, nullptr),
            FMLP_SUCCESS);
  EXPECT_EQ(fmlp_mlp_packed_run(p, nullptr, &f.args.x, nullptr, nullptr, 0, nullptr),
            FMLP_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fmlp_last_error()).find("y is NULL"), std::string::npos);
  EXPECT_EQ(fmlp_mlp_packed_run(p, &f.args.y, nullptr, nullptr, nullptr, 0, nullptr),
            FMLP_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fmlp_last_error()).find("x is NULL"), std::string::npos);
  fmlp_mlp_packed_destroy(p);
}

TEST(ExplainBuffer, TruncatedButTerminatedAndNeededIsExact) {
  Fixture f;
  size_t needed = 0;
  ASSERT_EQ(fmlp_mlp_explain(&f.args, FMLP_BACKEND_REF, nullptr, 0, &needed), FMLP_SUCCESS);
  ASSERT_GT(needed, 16u);
  std::string full(needed, 'X');
  size_t again = 0;
  ASSERT_EQ(fmlp_mlp_explain(&f.args, FMLP_BACKEND_REF, full.data(), full.size(), &again),
            FMLP_SUCCESS);
  EXPECT_EQ(again, needed);
  EXPECT_EQ(full[needed - 1], '\0');
  EXPECT_EQ(std::strlen(full.c_str()), needed - 1);
  for (size_t size : {size_t(1), size_t(10), needed - 1}) {
    std::string buf(size + 8, 'X');
    size_t n = 0;
    ASSERT_EQ(fmlp_mlp_explain(&f.args, FMLP_BACKEND_REF, buf.data(), size, &n), FMLP_SUCCESS);
    EXPECT_EQ(n, needed) << "buffer of " << size;
    EXPECT_EQ(buf[size - 1], '\0') << "buffer of " << size;
    EXPECT_EQ(buf.compare(0, size - 1, full, 0, size - 1), 0) << "buffer of " << size;
    EXPECT_EQ(buf[size], 'X') << "wrote past a buffer of " << size;
  }
  char untouched = 'X';
  ASSERT_EQ(fmlp_mlp_explain(&f.args, FMLP_BACKEND_REF, &untouched, 0, &needed), FMLP_SUCCESS);
  EXPECT_EQ(untouched, 'X');
}

}  // namespace
