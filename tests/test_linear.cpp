// Every linear op-table entry against an fp64 reference (linear_case.hpp), plus bad input, explain
// and the CUDA planner's rules; odd sizes on padded weight rows: test_linear_odd.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>

#include "linear_case.hpp"

namespace fmlp_test {
namespace {

std::vector<LinCase> cases() {
  std::vector<LinCase> v;
  Rng rng(test_seed());
  const fmlp_dtype_t acts[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16};
  const fmlp_dtype_t ws[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16, FMLP_DTYPE_F8_E4M3};
  for (int64_t m : {1, 3, 17, 64})
    for (int64_t n : {1, 7, 127, 769})
      for (int64_t k : {1, 7, 127, 769, 4095}) {
        if (m * n * k > 20'000'000) continue;
        LinCase c;
        c.m = m, c.n = n, c.k = k;
        c.xt = acts[rng() % 3];
        c.wt = ws[rng() % 4];
        c.bt = rng() % 2 ? acts[rng() % 3] : kAbsent;
        c.per_row = rng() % 2;
        c.misaligned = rng() % 3 == 0;
        c.strided = rng() % 3 == 0;
        v.push_back(c);
      }
  // fp8 weights at the M where the cpu kernel widens a row group once for all x rows (6 and
  // more; more than one 48-row block at 100), K tails inside a 16-code step and past it.
  for (int64_t m : {6, 16, 100})
    for (int64_t k : {7, 127, 769}) {
      LinCase c;
      c.m = m, c.n = 37, c.k = k;
      c.xt = acts[rng() % 3];
      c.wt = FMLP_DTYPE_F8_E4M3;
      c.bt = rng() % 2 ? FMLP_DTYPE_F32 : kAbsent;
      c.per_row = rng() % 2;
      c.strided = rng() % 2;
      v.push_back(c);
    }
  // Block-scaled fp8 weights (128 x 128 blocks): shapes inside one block, on and across block
  // edges, partial edge blocks, M in and past the cpu kernel's widen-once and 48-row blocks;
  // strided W and scales, misaligned views, NaN/Inf x and NaN codes in W.
  int bv = 0;
  for (int64_t m : {1, 3, 7, 16, 100})
    for (auto [n, k] : {std::pair<int64_t, int64_t>{1, 1},
                        {7, 127},
                        {129, 300},
                        {300, 129},
                        {257, 1000},
                        {769, 4095}}) {
      if (m * n * k > 20'000'000) continue;
      LinCase c;
      c.m = m, c.n = n, c.k = k;
      c.xt = acts[bv % 3];
      c.wt = FMLP_DTYPE_F8_E4M3;
      c.block = true;
      c.bt = bv % 2 ? acts[(bv / 2) % 3] : kAbsent;
      c.strided = bv % 4 == 1;
      c.misaligned = bv % 5 == 2;
      c.nonfinite = bv % 6 == 3;
      c.w_nan = bv % 7 == 4;
      ++bv;
      v.push_back(c);
    }
  for (fmlp_dtype_t x : acts)
    for (fmlp_dtype_t w : ws)
      for (int variant = 0; variant < 4; ++variant) {  // 16-byte friendly and layout variants
        LinCase c;
        c.m = variant == 3 ? 9 : 1 + variant;
        c.n = 264;
        c.k = 4096;
        c.xt = x, c.wt = w;
        c.bt = variant % 2 ? FMLP_DTYPE_F32 : kAbsent;
        c.per_row = variant % 2;
        c.misaligned = variant == 2;
        c.strided = variant == 3;
        c.nonfinite = variant >= 2;
        v.push_back(c);
      }
  // Tensor-core friendly (one dtype, aligned W): every token-tile count, ragged N and K, split K.
  for (fmlp_dtype_t t : {FMLP_DTYPE_F16, FMLP_DTYPE_BF16})
    for (int64_t m : {2, 9, 17, 33, 64})
      for (auto [n, k] :
           {std::pair<int64_t, int64_t>{7, 4096}, {264, 72}, {1000, 264}, {130, 2056}, {33, 8}}) {
        if (m * n * k > 20'000'000) continue;
        LinCase c;
        c.m = m, c.n = n, c.k = k;
        c.xt = c.wt = t;
        c.bt = m % 2 ? t : kAbsent;
        c.x_misaligned = m % 3 == 0;
        c.nonfinite = m % 2 == 1;
        v.push_back(c);
      }
  // W8A8: every output dtype, both scale granularities, the M the brief names, odd sizes and
  // cuBLASLt-friendly ones (K, N multiples of 16).
  int variant = 0;
  for (int64_t m : {1, 7, 64, 300})
    for (auto [n, k] : {std::pair<int64_t, int64_t>{7, 127}, {32, 64}, {264, 4096}, {769, 768}}) {
      if (m * n * k > 20'000'000) continue;
      LinCase c;
      c.m = m, c.n = n, c.k = k;
      c.xt = c.wt = FMLP_DTYPE_F8_E4M3;
      c.yt = acts[variant % 3];
      c.per_row = variant % 2 == 0;
      c.x_per_row = variant % 4 < 2;
      c.bt = variant % 3 == 1 ? c.yt : variant % 3 == 2 ? FMLP_DTYPE_F32 : kAbsent;
      c.x_misaligned = variant % 5 == 4;
      ++variant;
      v.push_back(c);
    }
  // W8A8 cases cuBLASLt's fp8 GEMMs take (K, N multiples of 16, aligned, bias absent or in the
  // output dtype): each scale granularity pair, bf16 and f16 out.
  for (int64_t m : {1, 16, 64})
    for (int q = 0; q < 4; ++q) {
      LinCase c;
      c.m = m, c.n = q % 2 ? 256 : 528, c.k = q < 2 ? 512 : 1024;
      c.xt = c.wt = FMLP_DTYPE_F8_E4M3;
      c.yt = q == 3 ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16;
      c.per_row = q % 2 == 0;
      c.x_per_row = q < 2;
      c.bt = m == 16 ? c.yt : kAbsent;
      v.push_back(c);
    }
  // Over 4096 rows whose warp parts end inside a batch (1800 bf16 = 225 chunks a row, 57 a warp
  // at two rows per group), bf16 and f16 weights, one and three tokens, with a bias.
  for (auto [m, w] : {std::pair<int64_t, fmlp_dtype_t>{1, FMLP_DTYPE_BF16}, {3, FMLP_DTYPE_F16}}) {
    LinCase c;
    c.m = m, c.n = 4100, c.k = 1800;
    c.xt = c.wt = c.bt = w;
    v.push_back(c);
  }
  // More row groups than resident blocks with whole rows per warp (1 KB rows, eight a group):
  // the stream's blocks loop over groups, their warps finishing rows without the block barrier
  // and carrying their two batch buffers' roles from group to group; bf16, f16 and fp8 weights.
  for (auto [m, w] : {std::pair<int64_t, fmlp_dtype_t>{1, FMLP_DTYPE_BF16},
                      {4, FMLP_DTYPE_F16},
                      {2, FMLP_DTYPE_F8_E4M3}}) {
    LinCase c;
    c.m = m, c.n = 8200, c.k = w == FMLP_DTYPE_F8_E4M3 ? 1024 : 512;
    c.xt = w == FMLP_DTYPE_F8_E4M3 ? FMLP_DTYPE_BF16 : w;
    c.wt = w;
    c.bt = m == 4 ? FMLP_DTYPE_F32 : kAbsent;
    c.per_row = true;
    v.push_back(c);
  }
  // x staged in exactly 48 KiB of shared memory by the stream GEMV (the edge where a launch needs
  // the shared-memory opt-in): bf16 and fp8 weights, one and two tokens.
  for (auto [m, k, w] : {std::tuple<int64_t, int64_t, fmlp_dtype_t>{1, 24576, FMLP_DTYPE_BF16},
                         {2, 12288, FMLP_DTYPE_F8_E4M3}}) {
    LinCase c;
    c.m = m, c.n = 7, c.k = k;
    c.xt = FMLP_DTYPE_BF16, c.wt = w;
    c.per_row = true;
    v.push_back(c);
  }
  // fp8 weights in the memory-order stream (linear_sm80_stream): every token count, rows that end
  // inside a batch (33 and 257 chunks of 16 bytes), both scale kinds, bias, misaligned and
  // strided x, NaN and Inf in x (staged from registers where x is aligned, from the raw staged
  // rows where not), NaN codes in W, x spanning 2^-20..2^10 within each row, and x staged in
  // exactly 48 KiB at one and four tokens.
  for (int64_t m = 1; m <= 4; ++m)
    for (int64_t k : {528, 4112})
      for (int variant = 0; variant < 3; ++variant) {
        LinCase c;
        c.m = m, c.n = 37, c.k = k;
        c.xt = (m + variant) % 2 ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F16;
        c.wt = FMLP_DTYPE_F8_E4M3;
        c.per_row = variant != 1;
        c.bt = variant == 1 ? FMLP_DTYPE_F32 : variant == 2 ? c.xt : kAbsent;
        c.wide_x = variant == 0;
        c.x_misaligned = variant == 1;
        c.nonfinite = k == 528 ? variant == 1 : variant == 0;
        c.x_strided = variant == 2;
        c.w_nan = variant == 2 && k == 528;
        v.push_back(c);
      }
  for (auto [m, k] : {std::pair<int64_t, int64_t>{1, 24576}, {4, 6144}}) {
    LinCase c;
    c.m = m, c.n = 9, c.k = k;
    c.xt = FMLP_DTYPE_F16, c.wt = FMLP_DTYPE_F8_E4M3;
    c.wide_x = m == 4;
    v.push_back(c);
  }
  for (int64_t n : {1, 8, 3}) {  // router-like: tiny N, long K (split K on the GPU)
    LinCase c;
    c.m = n == 3 ? 5 : 1, c.n = n, c.k = 8192;
    c.xt = c.wt = FMLP_DTYPE_BF16;
    c.bt = FMLP_DTYPE_BF16;
    v.push_back(c);
  }
  // The weight stream's partition edges (linear_sm80_stream, engines/stream_gemv.cuh): short rows
  // (K = 8, 24, 96, 768, 776: one partial batch per warp), rows that end mid-batch (1408, 2056,
  // 8704, 14336, 14344), N not a multiple of a group's rows, W rows padded past K, bf16 / f16 / fp8
  // weights, fp32 x, M = 1..4, N = 1; one token of few rows and long K reads x in place (x_direct
  // in linear/sm80_stream.cu: 127 x 14344, 33 x 2056, 9 x 4104 and the router-like cases above).
  struct StreamEdge {
    int64_t m, n, k;
    fmlp_dtype_t x, w;
    int64_t pad;
  };
  const fmlp_dtype_t bf = FMLP_DTYPE_BF16, hf = FMLP_DTYPE_F16, f8 = FMLP_DTYPE_F8_E4M3;
  int edge = 0;
  for (const StreamEdge& e : {StreamEdge{1, 16411, 768, bf, bf, 0},
                              {1, 8452, 768, FMLP_DTYPE_F32, bf, 0},
                              {1, 10454, 776, hf, hf, 0},
                              {1, 8191, 1408, bf, bf, 8},
                              {2, 4231, 1408, bf, bf, 0},
                              {1, 4099, 2056, bf, bf, 0},
                              {2, 3062, 2056, hf, hf, 8},
                              {1, 8191, 768, bf, f8, 0},
                              {1, 10454, 1408, hf, f8, 16},
                              {3, 127, 24, hf, hf, 8},
                              {4, 769, 8, bf, bf, 0},
                              {1, 7, 96, FMLP_DTYPE_F32, bf, 0},
                              {4, 5000, 96, bf, bf, 8},
                              {2, 1, 14336, bf, bf, 0},
                              {1, 127, 14344, bf, bf, 8},
                              {1, 263, 14336, hf, hf, 0},
                              {2, 769, 2056, FMLP_DTYPE_F32, hf, 0},
                              {1, 33, 2056, FMLP_DTYPE_F32, bf, 0},
                              {1, 9, 4104, hf, hf, 0},
                              // More row groups than resident blocks, each warp's part of a row
                              // ending inside a batch (224 and 136 chunks at one token, 544 for
                              // fp8's whole rows per warp).
                              {1, 1200, 14336, bf, bf, 0},
                              {1, 1031, 8704, hf, hf, 8},
                              {1, 2100, 8704, bf, f8, 0}}) {
    LinCase c;
    c.m = e.m, c.n = e.n, c.k = e.k;
    c.xt = e.x, c.wt = e.w, c.w_pad = e.pad;
    c.bt = edge % 3 == 1 ? FMLP_DTYPE_F32 : edge % 3 == 2 ? e.x : kAbsent;
    c.per_row = edge % 2;
    c.x_misaligned = edge % 4 == 3;
    ++edge;
    v.push_back(c);
  }
  return v;
}

using LinearKernelTest =
    OpKernelTest<fmlp_linear_kernel_count, fmlp_linear_kernel_name, fmlp_linear_kernel_backend>;

// Every entry but the general ones takes a subset of the cases; each must take some.
TEST_P(LinearKernelTest, MatchesReference) {
  int i = 0, ran = 0;
  std::string last_skip;
  for (const LinCase& c : cases()) {
    const std::string err = run_case(c, kernel_, device_, mix_seed(test_seed(), uint64_t(++i)));
    if (skipped(err)) {
      last_skip = "[" + c.name() + "] " + err;
      continue;
    }
    ++ran;
    EXPECT_TRUE(err.empty()) << "[" << c.name() << "] (FMLP_TEST_SEED=" << test_seed()
                             << "): " << err;
  }
  EXPECT_GT(ran, 0) << kernel_ << " took none of the cases; last reason: " << last_skip;
}

// Captured in a CUDA graph and replayed on refreshed inputs, split-K and tensor-core shapes
// included: the replays must read the new inputs and leave the workspace zero-filled.
TEST_P(LinearKernelTest, GraphReplayMatchesReference) {
  if (!device_) GTEST_SKIP() << "device kernels only";
  std::vector<LinCase> v(5);
  v[0].m = 1, v[0].n = 7, v[0].k = 4095, v[0].xt = FMLP_DTYPE_F16, v[0].wt = FMLP_DTYPE_BF16;
  v[1].m = 3, v[1].n = 1, v[1].k = 4095, v[1].wt = FMLP_DTYPE_F16, v[1].bt = FMLP_DTYPE_F32;
  v[2].m = 1, v[2].n = 264, v[2].k = 4096, v[2].xt = v[2].wt = FMLP_DTYPE_BF16;
  v[3].m = 16, v[3].n = 264, v[3].k = 4096, v[3].xt = v[3].wt = FMLP_DTYPE_BF16;
  v[3].bt = FMLP_DTYPE_BF16;
  v[4].m = 64, v[4].n = 769, v[4].k = 8192, v[4].xt = v[4].wt = FMLP_DTYPE_F16;
  v[4].strided = true;
  for (int64_t m : {1, 4}) {  // fp8 weight-only, k split over slices (linear_sm90_wgmma_fp8)
    LinCase c;
    c.m = m, c.n = 300, c.k = 8192;
    c.xt = m == 1 ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F16, c.wt = FMLP_DTYPE_F8_E4M3;
    c.per_row = m == 1, c.bt = FMLP_DTYPE_F32;
    v.push_back(c);
  }
  for (int q = 0; q < 4; ++q) {  // cuBLASLt's fp8 GEMM (no bias: its fp8 heuristic offers none)
    LinCase c;
    c.m = 16, c.n = q % 2 ? 256 : 528, c.k = q < 2 ? 512 : 1024;
    c.xt = c.wt = FMLP_DTYPE_F8_E4M3;
    c.yt = q == 3 ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16;
    c.per_row = q % 2 == 0, c.x_per_row = q < 2;
    v.push_back(c);
  }
  int ran = 0, i = 0;
  std::string last_skip;
  for (const LinCase& c : v) {
    RunMode mode;
    mode.graph = true;
    const std::string err = run_case(c, kernel_, true, mix_seed(test_seed(), uint64_t(++i)), mode);
    if (skipped(err)) {
      last_skip = "[" + c.name() + "] " + err;
      continue;
    }
    ++ran;
    EXPECT_TRUE(err.empty()) << "[" << c.name() << "] (FMLP_TEST_SEED=" << test_seed()
                             << "): " << err;
  }
  EXPECT_GT(ran, 0) << kernel_ << " took none of the cases; last reason: " << last_skip;
}

// Host kernels give the same bits whatever the thread count.
TEST_P(LinearKernelTest, ThreadCountIndependent) {
  if (device_) GTEST_SKIP() << "host kernels only";
  std::vector<LinCase> v(3);
  v[0].m = 3, v[0].n = 769, v[0].k = 769, v[0].wt = FMLP_DTYPE_BF16, v[0].bt = FMLP_DTYPE_F32;
  v[1].m = 17, v[1].n = 127, v[1].k = 4095, v[1].xt = FMLP_DTYPE_BF16;
  v[1].wt = FMLP_DTYPE_F8_E4M3, v[1].per_row = true;
  v[2].m = 64, v[2].n = 264, v[2].k = 127, v[2].xt = v[2].wt = FMLP_DTYPE_F16;
  expect_thread_count_independent(v, [&](const LinCase& c, const RunMode& mode) {
    return run_case(c, kernel_, false, mix_seed(test_seed(), 77), mode);
  });
}

TEST_P(LinearKernelTest, ZeroRowsAndZeroKWork) {
  for (auto [m, k] : {std::pair<int64_t, int64_t>{0, 64}, {2, 0}}) {
    LinCase c;
    c.m = m, c.k = k, c.n = 5, c.bt = FMLP_DTYPE_F32;
    const std::string err = run_case(c, kernel_, device_, 3);
    if (!skipped(err)) {
      EXPECT_EQ(err, "") << c.name();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, LinearKernelTest,
                         ::testing::ValuesIn(LinearKernelTest::indices()),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(fmlp_linear_kernel_name(info.param));
                         });

// Bad input: every entry point rejects it with a message naming the argument; y is untouched.
struct BadLinear {
  alignas(64) float x[16], y[16], w[16], b[8], s[8];
  alignas(64) uint8_t w8[16], x8[16];
  float xs[4] = {0.25f, 0.25f, 0.25f, 0.25f};
  fmlp_linear_args_t a{};
  BadLinear() {
    std::fill(std::begin(x), std::end(x), 0.5f);
    std::fill(std::begin(w), std::end(w), 0.5f);
    std::fill(std::begin(b), std::end(b), 1.f);
    std::fill(std::begin(s), std::end(s), 1.f);
    std::memset(y, 0x5A, sizeof y);
    std::memset(w8, 0x38, sizeof w8);                  // 1.0
    std::memset(x8, 0x30, sizeof x8);                  // 0.5
    a.x = fmlp_tensor_2d(x, FMLP_DTYPE_F32, 2, 4, 4);  // M = 2, K = 4, N = 3
    a.y = fmlp_tensor_2d(y, FMLP_DTYPE_F32, 2, 3, 3);
    a.w = fmlp_tensor_2d(w, FMLP_DTYPE_F32, 3, 4, 4);
    a.bias = fmlp_tensor_1d(b, FMLP_DTYPE_F32, 3);
  }
};

void expect_rejected(BadLinear& f, fmlp_status_t status, const std::vector<std::string>& words) {
  unsigned char before[sizeof f.y];
  std::memcpy(before, f.y, sizeof f.y);
  size_t bytes = 0;
  EXPECT_EQ(fmlp_linear_workspace_size(&f.a, FMLP_BACKEND_REF, &bytes), status);
  EXPECT_EQ(fmlp_linear(&f.a, FMLP_BACKEND_REF, nullptr, 0, nullptr), status);
  const std::string msg = fmlp_last_error();
  for (const std::string& w : words) EXPECT_NE(msg.find(w), std::string::npos) << msg;
  EXPECT_EQ(fmlp_linear_with_kernel(&f.a, "linear_ref_scalar_fp64", nullptr, 0, nullptr), status);
  EXPECT_EQ(std::memcmp(before, f.y, sizeof f.y), 0) << "y was written";
}

TEST(LinearBadInput, ValidBaseline) {
  BadLinear f;
  ASSERT_EQ(fmlp_linear(&f.a, FMLP_BACKEND_REF, nullptr, 0, nullptr), FMLP_SUCCESS)
      << fmlp_last_error();
  EXPECT_FLOAT_EQ(f.y[0], 0.5f * 0.5f * 4 + 1.f);
}
TEST(LinearBadInput, NullPointers) {
  BadLinear f;
  EXPECT_EQ(fmlp_linear(nullptr, FMLP_BACKEND_REF, nullptr, 0, nullptr), FMLP_ERROR_NULL_POINTER);
  f.a.w = fmlp_tensor_none();
  expect_rejected(f, FMLP_ERROR_NULL_POINTER, {"w is absent"});
  BadLinear g;
  g.a.x.data = nullptr;
  expect_rejected(g, FMLP_ERROR_NULL_POINTER, {"x.data is NULL"});
}
TEST(LinearBadInput, Shapes) {
  BadLinear f;
  f.a.x = fmlp_tensor_2d(f.x, FMLP_DTYPE_F32, 2, 5, 5);
  expect_rejected(f, FMLP_ERROR_SHAPE_MISMATCH, {"x must have shape", "[2, 5]"});
  BadLinear g;
  g.a.y = fmlp_tensor_2d(g.y, FMLP_DTYPE_F32, 2, 4, 4);
  expect_rejected(g, FMLP_ERROR_SHAPE_MISMATCH, {"y must have shape", "[2, 3]"});
  BadLinear h;
  h.a.bias = fmlp_tensor_1d(h.b, FMLP_DTYPE_F32, 4);
  expect_rejected(h, FMLP_ERROR_SHAPE_MISMATCH, {"bias must have shape"});
}
TEST(LinearBadInput, Dtypes) {
  BadLinear f;
  f.a.y.dtype = FMLP_DTYPE_BF16;
  expect_rejected(f, FMLP_ERROR_DTYPE_MISMATCH, {"y is bf16 but x is f32"});
  BadLinear g;
  g.a.x.dtype = FMLP_DTYPE_F8_E4M3;
  g.a.y.dtype = FMLP_DTYPE_F8_E4M3;
  expect_rejected(g, FMLP_ERROR_DTYPE_MISMATCH, {"x is f8_e4m3 but w is f32"});
}
// W8A8: fp8 x needs fp8 W, an x_scale of [1] or [M] with finite positive entries, and a 16- or
// 32-bit output.
TEST(LinearBadInput, W8A8) {
  auto w8a8 = [](BadLinear& f) {
    f.a.x = fmlp_tensor_2d(f.x8, FMLP_DTYPE_F8_E4M3, 2, 4, 4);
    f.a.w = fmlp_tensor_2d(f.w8, FMLP_DTYPE_F8_E4M3, 3, 4, 4);
    f.a.w_scale = fmlp_tensor_1d(f.s, FMLP_DTYPE_F32, 3);
    f.a.x_scale = fmlp_tensor_1d(f.xs, FMLP_DTYPE_F32, 2);
  };
  BadLinear ok;
  w8a8(ok);
  ASSERT_EQ(fmlp_linear(&ok.a, FMLP_BACKEND_REF, nullptr, 0, nullptr), FMLP_SUCCESS)
      << fmlp_last_error();
  EXPECT_FLOAT_EQ(ok.y[0], 0.5f * 4 * 0.25f + 1.f);  // e4m3 0x30 = 0.5, scales 1 and 0.25
  BadLinear f;
  w8a8(f);
  f.a.x_scale = fmlp_tensor_none();
  expect_rejected(f, FMLP_ERROR_BAD_SCALE, {"x is fp8 e4m3 but x_scale is absent", "[2]"});
  BadLinear g;
  w8a8(g);
  g.a.x_scale = fmlp_tensor_1d(g.xs, FMLP_DTYPE_F32, 3);
  expect_rejected(g, FMLP_ERROR_BAD_SCALE, {"x_scale has 3 entries", "1 (per tensor) or 2"});
  BadLinear h;
  w8a8(h);
  h.xs[1] = NAN;
  expect_rejected(h, FMLP_ERROR_BAD_SCALE, {"x_scale[1] is nan", "finite and > 0"});
  h.xs[1] = 0.f;
  expect_rejected(h, FMLP_ERROR_BAD_SCALE, {"x_scale[1] is 0"});
  BadLinear i;
  w8a8(i);
  i.a.w = fmlp_tensor_2d(i.w, FMLP_DTYPE_F32, 3, 4, 4);
  i.a.w_scale = fmlp_tensor_none();
  expect_rejected(i, FMLP_ERROR_DTYPE_MISMATCH, {"x is f8_e4m3 but w is f32"});
  BadLinear j;
  w8a8(j);
  j.a.y.dtype = FMLP_DTYPE_F8_E4M3;
  expect_rejected(j, FMLP_ERROR_DTYPE_MISMATCH, {"y is f8_e4m3 with f8_e4m3 x"});
  BadLinear k;
  k.a.x_scale = fmlp_tensor_1d(k.xs, FMLP_DTYPE_F32, 1);
  expect_rejected(k, FMLP_ERROR_BAD_SCALE, {"x_scale is given but x is f32"});
}
// explain (the op table's, with the planner's line where one has an opinion) names the entry
// dispatch runs and accounts for every other entry of the backend.
TEST(LinearExplain, NamesTheChosenEntryAndEveryOther) {
  BadLinear f;
  for (fmlp_backend_t b : {FMLP_BACKEND_REF, FMLP_BACKEND_CPU}) {
    size_t need = 0;
    ASSERT_EQ(fmlp_linear_explain(&f.a, b, nullptr, 0, &need), FMLP_SUCCESS) << fmlp_last_error();
    std::string report(need, '\0');
    ASSERT_EQ(fmlp_linear_explain(&f.a, b, report.data(), report.size(), &need), FMLP_SUCCESS);
    EXPECT_NE(report.find("linear M=2 N=3 K=4"), std::string::npos) << report;
    EXPECT_EQ(report.find("planner"), std::string::npos) << "no host planner: " << report;
    int chosen = 0, listed = 0;
    for (int i = 0; i < fmlp_linear_kernel_count(); ++i) {
      if (fmlp_linear_kernel_backend(i) != b) continue;
      const std::string name = fmlp_linear_kernel_name(i);
      ++listed;
      EXPECT_NE(report.find(name), std::string::npos) << name << " missing: " << report;
      chosen += report.find("chosen   " + name) != std::string::npos;
    }
    EXPECT_GT(listed, 0);
    EXPECT_EQ(chosen, 1) << report;
  }
}

// The CUDA planner at M = 2..4 (linear/planner.cpp, measured on an H200:
// bench/results/linear_m2_4_h200.json): the weight stream for fp8 weights wherever it runs, for
// 16-bit weights (with x of their dtype) at M = 2 below 256 MiB and at M = 3, 4 for N <= 1024; the
// table order for wider 16-bit outputs at M = 3, 4 (cuBLASLt) and for f32 x (whose first supporting
// entry happens to be the stream too: what is checked is that the rule picked it).
TEST(LinearPlanner, StreamAtTwoToFourTokensWhereMeasured) {
  SKIP_WITHOUT_GPU();
  struct Want {
    int64_t m, n, k;
    fmlp_dtype_t wt;
    bool rule_streams;  // the M = 2..4 rule picks linear_sm80_stream
    bool x_f32 = false;
  };
  const Want wants[] = {
      {2, 4096, 4096, FMLP_DTYPE_BF16, true},        {2, 8, 4096, FMLP_DTYPE_BF16, true},
      {3, 1024, 4096, FMLP_DTYPE_F16, true},         {4, 896, 896, FMLP_DTYPE_BF16, true},
      {4, 4096, 4096, FMLP_DTYPE_BF16, false},       {3, 2304, 768, FMLP_DTYPE_BF16, false},
      {3, 4096, 4096, FMLP_DTYPE_F8_E4M3, true},     {4, 14336, 4096, FMLP_DTYPE_F8_E4M3, true},
      {2, 1024, 4096, FMLP_DTYPE_BF16, false, true},
  };
  for (const Want& w : wants) {
    const fmlp_dtype_t xt = w.x_f32                  ? FMLP_DTYPE_F32
                            : w.wt == FMLP_DTYPE_F16 ? FMLP_DTYPE_F16
                                                     : FMLP_DTYPE_BF16;
    PlacedTensor px(xt, w.m, w.k, true, false, false), pw(w.wt, w.n, w.k, true, false, false);
    PlacedTensor py(xt, w.m, w.n, true, false, false),
        ps(FMLP_DTYPE_F32, 1, w.n, true, false, false);
    fmlp_linear_args_t a{py.view(), px.view(), pw.view(), fmlp_tensor_none(), fmlp_tensor_none()};
    if (w.wt == FMLP_DTYPE_F8_E4M3) a.w_scale = ps.vector_view();
    size_t need = 0;
    ASSERT_EQ(fmlp_linear_explain(&a, FMLP_BACKEND_CUDA, nullptr, 0, &need), FMLP_SUCCESS)
        << fmlp_last_error();
    std::string report(need, '\0');
    ASSERT_EQ(fmlp_linear_explain(&a, FMLP_BACKEND_CUDA, report.data(), report.size(), &need),
              FMLP_SUCCESS);
    const bool stream_by_rule =
        report.find("chosen   linear_sm80_stream") != std::string::npos &&
        report.find("planner  first supporting entry in table order") == std::string::npos;
    EXPECT_EQ(stream_by_rule, w.rule_streams)
        << "M=" << w.m << " N=" << w.n << " K=" << w.k << " x " << fmlp_dtype_name(xt) << " w "
        << fmlp_dtype_name(w.wt) << ": " << report;
  }
}

TEST(LinearBadInput, Scales) {
  BadLinear f;
  f.a.w = fmlp_tensor_2d(f.w8, FMLP_DTYPE_F8_E4M3, 3, 4, 4);
  expect_rejected(f, FMLP_ERROR_BAD_SCALE, {"w_scale is absent"});
  f.a.w_scale = fmlp_tensor_1d(f.s, FMLP_DTYPE_F32, 2);
  expect_rejected(f, FMLP_ERROR_BAD_SCALE, {"w_scale has 2 entries"});
  f.s[1] = -1.f;
  f.a.w_scale = fmlp_tensor_1d(f.s, FMLP_DTYPE_F32, 3);
  expect_rejected(f, FMLP_ERROR_BAD_SCALE, {"w_scale[1] is -1"});
  BadLinear g;
  g.a.w_scale = fmlp_tensor_1d(g.s, FMLP_DTYPE_F32, 1);
  expect_rejected(g, FMLP_ERROR_BAD_SCALE, {"w_scale is given but w is f32"});
}

// Block scales: [ceil(N / 128), ceil(K / 128)] fp32, finite and > 0, fp8 weights, x not fp8.
TEST(LinearBadInput, BlockScales) {
  BadLinear f;  // N = 3, K = 4: one block
  f.a.w = fmlp_tensor_2d(f.w8, FMLP_DTYPE_F8_E4M3, 3, 4, 4);
  f.a.w_scale = fmlp_tensor_2d(f.s, FMLP_DTYPE_F32, 1, 1, 1);
  ASSERT_EQ(fmlp_linear(&f.a, FMLP_BACKEND_REF, nullptr, 0, nullptr), FMLP_SUCCESS)
      << fmlp_last_error();
  EXPECT_FLOAT_EQ(f.y[0], 1.f * 0.5f * 4 + 1.f);
  std::memset(f.y, 0x5A, sizeof f.y);
  f.a.w_scale = fmlp_tensor_2d(f.s, FMLP_DTYPE_F32, 1, 2, 2);
  expect_rejected(f, FMLP_ERROR_SHAPE_MISMATCH, {"w_scale", "ceil(N / 128), ceil(K / 128)"});
  f.s[0] = INFINITY;
  f.a.w_scale = fmlp_tensor_2d(f.s, FMLP_DTYPE_F32, 1, 1, 1);
  expect_rejected(f, FMLP_ERROR_BAD_SCALE, {"w_scale[0, 0] is inf", "finite and > 0"});
  f.s[0] = 1.f;
  f.a.x = fmlp_tensor_2d(f.x8, FMLP_DTYPE_F8_E4M3, 2, 4, 4);  // W8A8 with block scales
  f.a.x_scale = fmlp_tensor_1d(f.xs, FMLP_DTYPE_F32, 1);
  expect_rejected(f, FMLP_ERROR_NOT_SUPPORTED, {"block scales", "weight-only"});
  BadLinear g;  // 2-D scale on a 16-bit weight
  g.a.w_scale = fmlp_tensor_2d(g.s, FMLP_DTYPE_F32, 1, 1, 1);
  expect_rejected(g, FMLP_ERROR_BAD_SCALE, {"w_scale is given but w is f32"});
}
TEST(LinearBadInput, DeviceAndAliasing) {
  BadLinear f;
  f.a.bias.device_type = FMLP_DEVICE_CUDA;
  expect_rejected(f, FMLP_ERROR_DEVICE_MISMATCH, {"bias is on cuda:0 but w is on cpu"});
  BadLinear g;
  g.a.y = fmlp_tensor_2d(g.x + 2, FMLP_DTYPE_F32, 2, 3, 3);
  expect_rejected(g, FMLP_ERROR_ALIASING, {"y overlaps x"});
  BadLinear h;
  h.a.x.stride[1] = 2;
  expect_rejected(h, FMLP_ERROR_BAD_STRIDE, {"x.stride[1]"});
}

}  // namespace
}  // namespace fmlp_test
