// 128 x 128 block-scaled fp8 experts in the moe op (fusedmlp.h): w1_scale [E, 2 * ceil(hidden /
// 128), ceil(d / 128)] gated (each expert's gate and up halves quantised apart, their block rows
// concatenated) or [E, ceil(hidden / 128), ceil(d / 128)] dense, w2_scale [E, ceil(d_out / 128),
// ceil(hidden / 128)]. Every host entry against the fp64 reference of moe_case.hpp, an expert's
// block reaching only that expert's tokens, bad scales rejected by name with y untouched, and the
// cuda entries refusing with what to do instead.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.h"
#include "mlp_case.hpp"
#include "moe_case.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

// Sizes across the block edges (hidden 1 .. 1001, d and d_out 7 .. 769), dense and gated, every
// activation, T from 1 to 200 (groups from one row to past the cpu decode kernel's 16).
std::vector<MoeCase> cases() {
  const int64_t hs[] = {1, 7, 127, 128, 129, 200, 1001};
  const int64_t ds[] = {7, 129, 300, 769};
  const fmlp_dtype_t xts[] = {FMLP_DTYPE_BF16, FMLP_DTYPE_F32, FMLP_DTYPE_F16};
  std::vector<MoeCase> v;
  int n = 0;
  for (int64_t h : hs)
    for (bool gated : {false, true}) {
      MoeCase c;
      c.t = n % 3 == 0 ? 1 : n % 3 == 1 ? 9 : 200;
      c.e = 4, c.k = 2;
      c.d = ds[n % 4], c.hidden = h, c.d_out = ds[(n + 1) % 4];
      if (h == 1001) c.t = std::min<int64_t>(c.t, 9), c.d = 129;
      c.wt = FMLP_DTYPE_F8_E4M3, c.fp8_block = true, c.xt = xts[n % 3];
      c.gated = gated, c.act = fmlp_activation_t(n % 5);
      c.b1 = n % 2 ? FMLP_DTYPE_F32 : kAbsent, c.b2 = n % 3 ? kAbsent : FMLP_DTYPE_BF16;
      c.residual = n % 3, c.routing = n % 2 ? 0 : 1;
      v.push_back(c);
      ++n;
    }
  return v;
}

TEST(MoeFp8Block, EveryEntryMatchesReferenceOrRefuses) {
  const std::vector<MoeCase> cs = cases();
  for (int i = 0; i < fmlp_moe_kernel_count(); ++i) {
    const char* kernel = fmlp_moe_kernel_name(i);
    const fmlp_backend_t b = fmlp_moe_kernel_backend(i);
    if (fmlp_backend_available(b) != FMLP_SUCCESS) continue;
    const bool device = b == FMLP_BACKEND_CUDA;
    if (device && !device_unavailable_reason().empty()) continue;
    for (size_t n = 0; n < cs.size(); ++n) {
      MoeData m;
      make(cs[n], mix_seed(test_seed(), n + 1), &m);
      if (device) {  // the block-scale refusal comes before any other of the entry's checks
        DeviceCase dc(cs[n], m);
        EXPECT_EQ(fmlp_moe_kernel_supports(&dc.args(), kernel), FMLP_ERROR_NOT_SUPPORTED)
            << kernel << " [" << cs[n].name() << "]";
        const std::string err = fmlp_last_error();
        EXPECT_NE(err.find("block scale"), std::string::npos) << kernel << ": " << err;
        EXPECT_NE(err.find("cpu backend"), std::string::npos) << kernel << ": " << err;
        continue;
      }
      const std::string err = run_host(cs[n], m, kernel);
      EXPECT_EQ(err, "") << kernel << " [" << cs[n].name() << "] (FMLP_TEST_SEED=" << test_seed()
                         << ")";
    }
  }
}

// NaN and Inf in x (two tokens), a NaN code in one expert's w2: the reference's NaN/Inf pattern.
TEST(MoeFp8Block, NonFiniteInputsAndCodes) {
  MoeCase c;
  c.t = 6, c.e = 3, c.k = 2, c.d = 200, c.hidden = 150, c.d_out = 140, c.gated = true;
  c.wt = FMLP_DTYPE_F8_E4M3, c.fp8_block = true, c.routing = 1, c.xt = FMLP_DTYPE_BF16;
  for (const char* kernel : {"moe_ref_scalar_fp64", "moe_cpu_avx2_grouped"}) {
    MoeData m;
    make(c, mix_seed(test_seed(), 77), &m);
    m.x.set(0 * c.d + 5, NAN);
    m.x.set(3 * c.d + 199, INFINITY);
    m.w2.bytes[size_t(1 * c.d_out * c.hidden + 7 * c.hidden + 130)] = 0x7f;  // expert 1, row 7
    EXPECT_EQ(run_host(c, m, kernel), "") << kernel;
  }
}

// Doubling one block scale of expert 2's w2 moves only tokens routed to expert 2, and only their
// outputs in that block's 128 rows.
TEST(MoeFp8Block, OneExpertBlockMovesOnlyItsTokensAndRows) {
  MoeCase c;
  c.t = 12, c.e = 4, c.k = 1, c.d = 140, c.hidden = 260, c.d_out = 300, c.gated = true;
  c.wt = FMLP_DTYPE_F8_E4M3, c.fp8_block = true, c.routing = 1;
  for (const char* kernel : {"moe_ref_scalar_fp64", "moe_cpu_avx2_grouped"}) {
    MoeData a, b;
    make(c, mix_seed(test_seed(), 78), &a);
    make(c, mix_seed(test_seed(), 78), &b);
    // w2_scale [4, 3, 3]: expert 2, block (1, 2).
    const int64_t at = (2 * 3 + 1) * 3 + 2;
    b.s2.set(at, 2.0 * b.s2.get(at));
    ASSERT_EQ(run_host(c, a, kernel), "") << kernel;
    ASSERT_EQ(run_host(c, b, kernel), "") << kernel;
    int64_t moved = 0;
    for (int64_t t = 0; t < c.t; ++t)
      for (int64_t o = 0; o < c.d_out; ++o) {
        const double ya = a.y.get(t * c.d_out + o), yb = b.y.get(t * c.d_out + o);
        if (a.ids[size_t(t)] == 2 && o >= 128 && o < 256)
          moved += ya != yb;
        else
          EXPECT_EQ(ya, yb) << kernel << " token " << t << " col " << o;
      }
    EXPECT_GT(moved, 0) << kernel << ": no token of expert 2 moved";
  }
}

TEST(MoeFp8Block, BadScalesAreRejectedByNameAndYUntouched) {
  MoeCase dense;
  dense.t = 5, dense.e = 3, dense.k = 2, dense.d = 140, dense.hidden = 200, dense.d_out = 130;
  dense.wt = FMLP_DTYPE_F8_E4M3, dense.fp8_block = true;
  MoeCase gated = dense;
  gated.gated = true;
  static float spare[64];
  const std::vector<std::pair<MoeCase, BadCase>> bad = {
      {gated,
       {"gated w1 scale over 2 * hidden rows",
        [](MoeData& m) {
          m.args.w1_scale.shape[1] = 3;  // ceil(400 / 128) rather than 2 * ceil(200 / 128)
        },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"w1_scale", "2 * ceil(hidden / 128)", "[3, 4, 2]", "[3, 3, 2]"}}},
      {dense,
       {"w2 scale with one expert too few",
        [](MoeData& m) { m.args.w2_scale.shape[0] = 2; },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"w2_scale", "[3, 2, 2]"}}},
      {dense,
       {"NaN block scale of expert 1",
        [](MoeData& m) { m.s1.set(1 * 2 * 2 + 3, NAN); },
        FMLP_ERROR_BAD_SCALE,
        {"expert 1", "weights.w1_scale[1, 1]", "finite and > 0"}}},
      {gated,
       {"zero block scale of expert 2's up half",
        [](MoeData& m) { m.s1.set(2 * 4 * 2 + 2 * 2, 0.0); },
        FMLP_ERROR_BAD_SCALE,
        {"expert 2", "weights.w1_scale[2, 0]", "is 0"}}},
      {dense,
       {"negative w2 block scale",
        [](MoeData& m) { m.s2.set(0, -2.0); },
        FMLP_ERROR_BAD_SCALE,
        {"expert 0", "weights.w2_scale[0, 0]", "-2"}}},
      {dense,
       {"block scales of bf16 experts",
        [](MoeData& m) { m.args.w1.dtype = m.args.w2.dtype = FMLP_DTYPE_BF16; },
        FMLP_ERROR_BAD_SCALE,
        {"w1_scale is given", "bf16", "drop the scale"}}},
      {dense,
       {"2-D block scale for stacked experts",
        [](MoeData& m) {
          m.args.w2_scale = fmlp_tensor_2d(spare, FMLP_DTYPE_F32, 2, 2, 2);  // one expert's
        },
        FMLP_ERROR_BAD_SCALE,
        {"w2_scale has shape [2, 2]", "[3]", "[3, 130]", "3-D [3, 2, 2]"}}},
      {dense,
       {"fp8 x",
        [](MoeData& m) { m.args.x.dtype = FMLP_DTYPE_F8_E4M3; },
        FMLP_ERROR_DTYPE_MISMATCH,
        {"x has dtype f8_e4m3", "f32, f16 or bf16"}}},
  };
  for (const auto& [c, b] : bad) expect_rejected(c, b);
}

}  // namespace
}  // namespace fmlp_test
