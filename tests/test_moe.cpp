// Every moe op-table entry against an fp64 reference computed here (routing, experts and combine
// written out independently of src/ref; tolerance rule of tolerance.hpp with the scale of each
// output the l2 norm of the terms summed into it), plus bad input with untouched outputs.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "fusedmlp/fusedmlp.hpp"
#include "mlp_case.hpp"
#include "moe_case.hpp"
#include "moe_device_run.hpp"
#include "op_tensor.hpp"
#include "ref/activation.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

std::string run_case(const MoeCase& c, const char* kernel, uint64_t seed,
                     std::vector<unsigned char>* y_bytes = nullptr) {
  MoeData m;
  make(c, seed, &m);
  return run_host(c, m, kernel, y_bytes);
}

std::vector<MoeCase> cases() {
  std::vector<MoeCase> v;
  Rng rng(test_seed());
  const fmlp_dtype_t types[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16};
  const auto pick = [&] { return types[rng() % 3]; };
  const auto size = [&] { return int64_t(7 + rng() % 121); };  // 7..127
  for (int64_t t : {1, 7, 33})
    for (int64_t e : {1, 4, 8})
      for (int64_t k : {int64_t(1), int64_t(2), e}) {
        if (k > e) continue;
        MoeCase c;
        c.t = t, c.e = e, c.k = k;
        c.d = size(), c.hidden = size(), c.d_out = rng() % 2 ? c.d : size();
        c.xt = pick(), c.wt = pick(), c.rt = pick();
        c.b1 = rng() % 2 ? pick() : kAbsent;
        c.b2 = rng() % 2 ? pick() : kAbsent;
        c.rb = rng() % 2 ? pick() : kAbsent;
        c.act = fmlp_activation_t(rng() % 4);
        c.gated = rng() % 2;
        c.renorm = rng() % 2;
        c.sigmoid = rng() % 3 == 0;
        c.residual = int(rng() % 3);
        c.routing = rng() % 3 == 0 ? 1 : 0;
        c.round = rng() % 2;
        v.push_back(c);
      }
  for (int routing : {2, 3})  // every slot on one expert; most experts without tokens
    for (bool gated : {false, true}) {
      MoeCase c;
      c.t = 33, c.e = 8, c.k = 2, c.d = 31, c.hidden = 45, c.d_out = 17;
      c.routing = routing, c.gated = gated, c.residual = gated ? 2 : 1;
      c.xt = FMLP_DTYPE_BF16, c.wt = FMLP_DTYPE_BF16;
      v.push_back(c);
    }
  for (bool renorm : {false, true}) {  // sigmoid scoring, with and without renormalisation
    MoeCase c;
    c.t = 7, c.e = 8, c.k = 2, c.d = 64, c.hidden = 96, c.d_out = 64;
    c.sigmoid = true, c.renorm = renorm, c.gated = true, c.rb = FMLP_DTYPE_F32;
    v.push_back(c);
  }
  for (bool gated : {false, true}) {  // unused rows between the experts (expert stride > rows)
    MoeCase c;
    c.t = 12, c.e = 4, c.k = 2, c.d = 40, c.hidden = 24, c.d_out = 19, c.expert_pad = 5;
    c.gated = gated, c.wt = gated ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F32, c.b1 = FMLP_DTYPE_F32;
    v.push_back(c);
  }
  for (bool rows : {true, false})  // fp8 experts: scales per row and per expert
    for (bool gated : {false, true}) {
      MoeCase c;
      c.t = rows ? 9 : 1, c.e = 4, c.k = 2, c.d = 37, c.hidden = 23, c.d_out = 33;
      c.wt = FMLP_DTYPE_F8_E4M3, c.fp8_rows = rows, c.gated = gated;
      c.xt = gated ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F32;
      c.b1 = FMLP_DTYPE_F32, c.residual = 1, c.routing = rows ? 0 : 1;
      v.push_back(c);
    }
  return v;
}

class MoeVsRef : public ::testing::TestWithParam<int> {};

TEST_P(MoeVsRef, AllCases) {
  const char* kernel = fmlp_moe_kernel_name(GetParam());
  int skipped = 0, n = 0;
  for (const MoeCase& c : cases()) {
    const std::string err = run_case(c, kernel, test_seed() + uint64_t(n++));
    if (err.rfind("skipped: ", 0) == 0) {
      ++skipped;
      continue;
    }
    EXPECT_EQ(err, "") << kernel << " " << c.name();
  }
  if (skipped == n) GTEST_SKIP() << kernel << " handles none of the cases here";
}

INSTANTIATE_TEST_SUITE_P(Kernels, MoeVsRef, ::testing::Range(0, fmlp_moe_kernel_count()),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(fmlp_moe_kernel_name(i.param));
                         });

TEST(Moe, CpuIsBitwiseReproducibleAcrossThreadCounts) {
  if (fmlp_backend_available(FMLP_BACKEND_CPU) != FMLP_SUCCESS) GTEST_SKIP() << fmlp_last_error();
  MoeCase c;
  c.t = 33, c.e = 8, c.k = 2, c.d = 100, c.hidden = 120, c.d_out = 100, c.gated = true;
  std::vector<unsigned char> one, many;
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  EXPECT_EQ(run_case(c, "moe_cpu_avx2_grouped", 7, &one), "");
  omp_set_num_threads(std::max(threads, 4));
  EXPECT_EQ(run_case(c, "moe_cpu_avx2_grouped", 7, &many), "");
  omp_set_num_threads(threads);
  EXPECT_EQ(one, many);
}

TEST(Moe, CppWrapperAndExplain) {
  MoeCase c;
  c.t = 7, c.e = 4, c.k = 2;
  MoeData m;
  make(c, 3, &m);
  EXPECT_NO_THROW(fmlp::moe(m.args));
  size_t needed = 0;
  ASSERT_EQ(fmlp_moe_explain(&m.args, FMLP_BACKEND_REF, nullptr, 0, &needed), FMLP_SUCCESS);
  std::string s(needed, '\0');
  ASSERT_EQ(fmlp_moe_explain(&m.args, FMLP_BACKEND_REF, s.data(), s.size(), &needed), FMLP_SUCCESS);
  EXPECT_NE(s.find("chosen   moe_ref_scalar_fp64"), std::string::npos) << s;
  EXPECT_NE(s.find("E=4 k=2"), std::string::npos) << s;
  m.args.config.top_k = 5;
  EXPECT_THROW(fmlp::moe(m.args), fmlp::Error);
}

// Each bad input: the status, words the message must contain, and y left untouched.
TEST(Moe, BadInputNamesTheArgumentAndLeavesYUntouched) {
  MoeCase c;
  c.t = 7, c.e = 4, c.k = 2, c.d = 9, c.hidden = 11, c.d_out = 9;
  MoeCase given = c;
  given.routing = 1;
  MoeCase fp8 = c;
  fp8.wt = FMLP_DTYPE_F8_E4M3;
  const std::vector<std::pair<MoeCase, BadCase>> bad = {
      {c,
       {"k > E",
        [](MoeData& m) { m.args.config.top_k = 5; },
        FMLP_ERROR_INVALID_VALUE,
        {"top_k is 5", "num_experts is 4"}}},
      {c,
       {"k = 0", [](MoeData& m) { m.args.config.top_k = 0; }, FMLP_ERROR_INVALID_VALUE, {"top_k"}}},
      {given,
       {"id too large",
        [](MoeData& m) { m.ids[3 * 2 + 1] = 4; },
        FMLP_ERROR_INDEX_OUT_OF_RANGE,
        {"token 3", "is 4", "[0, 4)"}}},
      {given,
       {"negative id",
        [](MoeData& m) { m.ids[0] = -1; },
        FMLP_ERROR_INDEX_OUT_OF_RANGE,
        {"token 0", "is -1"}}},
      {given,
       {"ids without weights",
        [](MoeData& m) { m.args.topk_weights = nullptr; },
        FMLP_ERROR_NULL_POINTER,
        {"topk_weights"}}},
      {c,
       {"no routing",
        [](MoeData& m) { m.args.router_w = fmlp_tensor_none(); },
        FMLP_ERROR_NULL_POINTER,
        {"router_w"}}},
      {c,
       {"null x",
        [](MoeData& m) { m.args.x = fmlp_tensor_none(); },
        FMLP_ERROR_NULL_POINTER,
        {"x is absent"}}},
      {c,
       {"null w2",
        [](MoeData& m) { m.args.w2 = fmlp_tensor_none(); },
        FMLP_ERROR_NULL_POINTER,
        {"w2"}}},
      {c,
       {"w1 inner dim",
        [](MoeData& m) { m.args.w1.shape[2] = 8; },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"w1"}}},
      {c,
       {"experts vs E",
        [](MoeData& m) { m.args.w2.shape[0] = 3; },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"w2"}}},
      {c,
       {"y rows",
        [](MoeData& m) { m.args.y.shape[0] = 6; },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"y must have shape"}}},
      {c,
       {"router shape",
        [](MoeData& m) { m.args.router_w.shape[0] = 3; },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"router_w"}}},
      {fp8,
       {"fp8 experts without scales",
        [](MoeData& m) { m.args.w1_scale = fmlp_tensor_none(); },
        FMLP_ERROR_BAD_SCALE,
        {"w1 is fp8 e4m3 but w1_scale is absent"}}},
      {fp8,
       {"fp8 scale shape",
        [](MoeData& m) { m.args.w2_scale.shape[1] = 5; },
        FMLP_ERROR_BAD_SCALE,
        {"w2_scale has shape [4, 5]", "[4, 9]"}}},
      {fp8,
       {"fp8 scale not finite",
        [](MoeData& m) { m.s1.set(3, std::nan("")); },
        FMLP_ERROR_BAD_SCALE,
        {"expert 0", "finite"}}},
      {fp8,
       {"fp8 w1 with 16-bit w2",
        [](MoeData& m) { m.args.w2.dtype = FMLP_DTYPE_BF16; },
        FMLP_ERROR_DTYPE_MISMATCH,
        {"w2 is bf16 but w1 is f8_e4m3"}}},
      {c,
       {"scales for 16-bit experts",
        [](MoeData& m) { m.args.w2_scale = fmlp_tensor_1d(m.x.bytes.data(), FMLP_DTYPE_F32, 4); },
        FMLP_ERROR_BAD_SCALE,
        {"w2_scale is given", "drop the scale"}}},
      {c,
       {"y overlaps x",
        [](MoeData& m) { m.args.y.data = m.args.x.data; },
        FMLP_ERROR_ALIASING,
        {"y overlaps x"}}},
      {c,
       {"bad scoring",
        [](MoeData& m) { m.args.config.scoring = fmlp_moe_scoring_t(7); },
        FMLP_ERROR_INVALID_VALUE,
        {"config.scoring"}}},
  };
  for (const auto& [mc, b] : bad) expect_rejected(mc, b);
  EXPECT_EQ(fmlp_moe(nullptr, FMLP_BACKEND_REF, nullptr, 0, nullptr), FMLP_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fmlp_last_error()).find("args"), std::string::npos);
}

TEST(Moe, ZeroTokensIsANoOp) {
  MoeCase c;
  c.t = 0;
  MoeData m;
  make(c, 5, &m);
  size_t bytes = 1;
  ASSERT_EQ(fmlp_moe_workspace_size(&m.args, FMLP_BACKEND_AUTO, &bytes), FMLP_SUCCESS)
      << fmlp_last_error();
  EXPECT_EQ(bytes, 0u);
  EXPECT_EQ(fmlp_moe(&m.args, FMLP_BACKEND_AUTO, nullptr, 0, nullptr), FMLP_SUCCESS);
}

// round_router_logits: logits 1 and 1 + 2^-9 (an f32 router row, bf16 x) are distinct in fp32
// but one bf16 value: rounded, the tie goes to expert 0; kept wide, expert 1 wins. Each host
// backend's y must then equal the y of the given routing to that expert (k = 1, weight 1).
TEST(Moe, RoundedRouterLogitsRouteLikeA16BitRouter) {
  MoeCase c;
  c.t = 1, c.e = 2, c.k = 1, c.d = 8, c.hidden = 8, c.d_out = 8;
  c.xt = c.wt = FMLP_DTYPE_BF16, c.rt = FMLP_DTYPE_F32;
  for (fmlp_backend_t b : {FMLP_BACKEND_REF, FMLP_BACKEND_CPU}) {
    if (fmlp_backend_available(b) != FMLP_SUCCESS) continue;
    const auto run = [&](bool round, int32_t given) {
      MoeCase cc = c;
      cc.round = round;
      MoeData m;
      make(cc, 9, &m);
      for (int64_t i = 0; i < c.d; ++i) m.x.set(i, i == 0 ? 1.0 : 0.0);
      for (int64_t e = 0; e < c.e; ++e)
        for (int64_t i = 0; i < c.d; ++i) m.rw.set(e * c.d + i, i ? 0.0 : e ? 1.0 + 0x1p-9 : 1.0);
      int32_t id = given;
      float w = 1.f;
      if (given >= 0) m.args.router_w = fmlp_tensor_none(), m.args.topk_ids = &id;
      if (given >= 0) m.args.topk_weights = &w;
      size_t bytes = 0;
      EXPECT_EQ(fmlp_moe_workspace_size(&m.args, b, &bytes), FMLP_SUCCESS) << fmlp_last_error();
      std::vector<unsigned char> ws(bytes);
      EXPECT_EQ(fmlp_moe(&m.args, b, ws.data(), bytes, nullptr), FMLP_SUCCESS) << fmlp_last_error();
      return std::vector<unsigned char>(m.y.bytes.begin(), m.y.bytes.end() - kGuard);
    };
    const auto to0 = run(false, 0), to1 = run(false, 1);
    ASSERT_NE(to0, to1) << "the two experts must give different outputs";
    EXPECT_EQ(run(true, -1), to0) << fmlp_backend_name(b) << ": rounded logits tie -> expert 0";
    EXPECT_EQ(run(false, -1), to1) << fmlp_backend_name(b) << ": fp32 logits -> expert 1";
  }
}

// Cases moe_sm80_grouped takes (>= 32 tokens per hit expert, x in the experts' dtype, d and hidden
// multiples of 64): its 64- and 128-row tiles, partial chunks, partial N tiles (dense hidden and
// d_out not multiples of 128), uneven groups, one expert, mostly empty experts.
std::vector<MoeCase> grouped_cases() {
  const auto mk = [](int64_t t, int64_t e, int64_t k, int64_t d, int64_t h, int64_t d_out,
                     fmlp_dtype_t wt, bool gated, fmlp_activation_t act) {
    MoeCase c;
    c.t = t, c.e = e, c.k = k, c.d = d, c.hidden = h, c.d_out = d_out;
    c.xt = c.wt = c.rt = wt, c.gated = gated, c.act = act;
    return c;
  };
  const fmlp_dtype_t bf = FMLP_DTYPE_BF16, f16 = FMLP_DTYPE_F16;
  std::vector<MoeCase> v;
  v.push_back(mk(300, 8, 2, 256, 1408, 256, bf, true, FMLP_ACT_SILU));  // 64-row tiles, uneven
  MoeCase c = mk(160, 8, 2, 128, 192, 136, bf, true, FMLP_ACT_SILU);
  c.routing = 2, c.residual = 2, c.b1 = bf;  // 320 slots on one expert: 5 full chunks
  v.push_back(c);
  c = mk(160, 8, 2, 128, 192, 136, f16, false, FMLP_ACT_GELU);
  c.routing = 3, c.residual = 1, c.b2 = FMLP_DTYPE_F32;  // experts 0 and 4 only
  v.push_back(c);
  c = mk(200, 4, 2, 192, 320, 64, f16, true, FMLP_ACT_GELU_TANH);  // 128-row tiles, partial
  c.b1 = c.b2 = f16, c.rt = bf, c.rb = FMLP_DTYPE_F32, c.deterministic = false;
  v.push_back(c);
  c = mk(512, 8, 2, 64, 320, 200, bf, false, FMLP_ACT_RELU);  // partial N tiles in both GEMMs
  c.routing = 1, c.b1 = FMLP_DTYPE_F32, c.residual = 2;
  v.push_back(c);
  c = mk(100, 2, 1, 64, 128, 8, bf, false, FMLP_ACT_GELU);
  c.sigmoid = true, c.renorm = false;
  v.push_back(c);
  // Few chunks, hidden 2048 (long k loops), a partial N tile in the down GEMM, non-deterministic.
  c = mk(96, 4, 2, 128, 2048, 264, bf, true, FMLP_ACT_SILU);
  c.b2 = bf, c.deterministic = false;
  v.push_back(c);
  // Experts with padding rows between them: not one matrix each (moe_sm90_grouped falls back).
  c = mk(64, 4, 2, 128, 192, 136, f16, true, FMLP_ACT_SILU);
  c.expert_pad = 3, c.b1 = f16;
  v.push_back(c);
  // moe_sm90_grouped's tall tiles (192-row chunks at 100..160 expected tokens per hit expert):
  // groups of ~150, hidden 320 and d_out 200 partial N tiles of both GEMMs (88 units, 128
  // outputs); experts under 128 / 64 tokens leave one or two consumer warpgroups without rows.
  c = mk(300, 4, 2, 128, 320, 200, bf, true, FMLP_ACT_SILU);
  c.b1 = bf, c.residual = 1;
  v.push_back(c);
  c = mk(256, 4, 2, 192, 192, 136, f16, true, FMLP_ACT_GELU);  // 512 slots on one expert
  c.routing = 2, c.b2 = FMLP_DTYPE_F32, c.deterministic = false;
  v.push_back(c);
  c = mk(512, 8, 2, 64, 448, 64, bf, true, FMLP_ACT_RELU);  // experts 0 and 4: 512 slots each
  c.routing = 3, c.residual = 2;
  v.push_back(c);
  c = mk(200, 4, 2, 128, 192, 136, bf, true, FMLP_ACT_SILU);  // padded experts: 128-row fallback
  c.expert_pad = 3;
  v.push_back(c);
  return v;
}

// fp8 e4m3 experts (sm_89+): per-row and per-expert scales, router and given routing, T = 1, 7,
// 64, 300 (and 400 tokens on 4 experts: the grouped GEMMs' 128-row tiles), x bf16, f32 or f16;
// hidden 272 is a multiple of 16 but not of 64 (the chunked entry only), d 272 likewise. Both
// entries see every case they take.
std::vector<MoeCase> fp8_cases() {
  const fmlp_dtype_t xts[] = {FMLP_DTYPE_BF16, FMLP_DTYPE_F32, FMLP_DTYPE_F16};
  std::vector<MoeCase> v;
  int n = 0;
  for (int64_t t : {1, 7, 64, 300, 400})
    for (bool rows : {true, false}) {
      MoeCase c;
      c.t = t, c.e = t == 400 ? 4 : 8, c.k = t == 400 ? 1 : 2;
      c.d = n % 3 == 2 ? 272 : 256, c.hidden = t == 7 ? 272 : 320, c.d_out = n % 2 ? 264 : 40;
      c.wt = FMLP_DTYPE_F8_E4M3, c.fp8_rows = rows, c.xt = xts[n % 3], c.rt = FMLP_DTYPE_BF16;
      c.gated = (n / 2) % 2 == 0, c.act = fmlp_activation_t(n % 4);
      c.b1 = rows ? FMLP_DTYPE_F32 : kAbsent, c.b2 = rows ? kAbsent : FMLP_DTYPE_BF16;
      c.residual = n % 3, c.routing = rows ? 0 : 1, c.deterministic = t != 300;
      v.push_back(c);
      ++n;
    }
  return v;
}

std::vector<MoeCase> device_cases() {
  std::vector<MoeCase> v;
  Rng rng(mix_seed(test_seed(), 6));
  const fmlp_dtype_t any[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16};
  const int64_t ds[] = {64, 136, 256}, hs[] = {72, 264, 520}, outs[] = {8, 40, 264};
  for (int64_t t : {1, 3, 16, 64, 300})
    for (int64_t e : {1, 8, 64})
      for (int64_t k : {1, 2, 8}) {
        if (k > e) continue;
        MoeCase c;
        c.t = t, c.e = e, c.k = k;
        c.d = ds[rng() % 3], c.hidden = hs[rng() % 3], c.d_out = outs[rng() % 3];
        c.xt = rng() % 2 ? FMLP_DTYPE_F32 : FMLP_DTYPE_BF16;
        c.wt = rng() % 2 ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16;
        c.rt = any[rng() % 3];
        c.b1 = rng() % 2 ? any[rng() % 3] : kAbsent;
        c.b2 = rng() % 2 ? any[rng() % 3] : kAbsent;
        c.rb = rng() % 2 ? any[rng() % 3] : kAbsent;
        c.act = fmlp_activation_t(rng() % 4);
        c.gated = rng() % 2, c.renorm = rng() % 2, c.sigmoid = rng() % 3 == 0;
        c.deterministic = rng() % 2;
        c.residual = int(rng() % 3);
        c.routing = rng() % 3 == 0 ? 1 : 0;
        c.round = rng() % 2;
        v.push_back(c);
      }
  for (int routing : {2, 3})  // every slot on one expert; most experts without tokens
    for (bool gated : {false, true}) {
      MoeCase c;
      c.t = 64, c.e = 8, c.k = 2, c.d = 256, c.hidden = 264, c.d_out = 40;
      c.routing = routing, c.gated = gated, c.residual = gated ? 2 : 1;
      c.xt = FMLP_DTYPE_BF16, c.wt = gated ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F16;
      v.push_back(c);
    }
  for (bool renorm : {false, true}) {  // sigmoid scoring, with and without renormalisation
    MoeCase c;
    c.t = 16, c.e = 64, c.k = 8, c.d = 136, c.hidden = 72, c.d_out = 40;
    c.sigmoid = true, c.renorm = renorm, c.gated = true, c.rb = FMLP_DTYPE_F32;
    c.xt = c.wt = FMLP_DTYPE_BF16;
    v.push_back(c);
  }
  for (bool det : {false, true}) {  // T*k*d_out large: red.add path, and the partials of det mode
    MoeCase c;
    c.t = 512, c.e = 64, c.k = 8, c.d = 64, c.hidden = 64, c.d_out = 8192;
    c.xt = c.wt = FMLP_DTYPE_BF16, c.gated = true, c.deterministic = det;
    v.push_back(c);
  }
  for (MoeCase c : grouped_cases()) v.push_back(c);
  for (MoeCase c : fp8_cases()) v.push_back(c);
  return v;
}

// run(kernel, case, index) for every cuda entry and case: "" or a skip, and every entry takes one.
void each_entry(const std::vector<MoeCase>& cs,
                const std::function<std::string(const char*, const MoeCase&, int)>& run) {
  for (const char* kernel : cuda_moe_kernels()) {
    int ran = 0, n = 0;
    bool other_arch = false;  // an sm_90a entry on another device takes no case
    for (const MoeCase& c : cs) {
      const std::string err = run(kernel, c, n++);
      if (skipped(err)) {
        other_arch = other_arch || err.find("compute capability") != std::string::npos;
        continue;
      }
      ++ran;
      EXPECT_EQ(err, "") << kernel << " [" << c.name() << "] (FMLP_TEST_SEED=" << test_seed()
                         << ")";
    }
    if (!other_arch) {
      EXPECT_GT(ran, 0) << kernel << " took none of the cases";
    }
  }
}

TEST(MoeCuda, MatchesReference) {
  SKIP_WITHOUT_GPU();
  each_entry(device_cases(), [](const char* kernel, const MoeCase& c, int n) {
    return run_device(c, kernel, mix_seed(test_seed(), uint64_t(n + 1)));
  });
}

TEST(MoeCuda, GraphReplaysRouteTheNewInputs) {
  SKIP_WITHOUT_GPU();
  MoeCase router, given;
  router.t = 16, router.e = 8, router.k = 2, router.d = 256, router.hidden = 520;
  router.d_out = 264, router.gated = true, router.residual = 1;
  router.xt = router.wt = FMLP_DTYPE_BF16;
  given = router;
  given.t = 64, given.e = 64, given.k = 8, given.routing = 1, given.deterministic = false;
  given.xt = FMLP_DTYPE_F32, given.wt = FMLP_DTYPE_F16;
  MoeCase many = router;  // 64 tokens per expert: the grouped GEMMs
  many.t = 256, many.d = 128, many.hidden = 256, many.d_out = 136;
  MoeCase many_given = many;
  many_given.t = 128, many_given.e = 4, many_given.routing = 1, many_given.gated = false;
  many_given.xt = many_given.wt = FMLP_DTYPE_F16;
  MoeCase fp8 = router, fp8_many = many;  // fp8 experts: the x staging and (grouped) h staging
  fp8.wt = fp8_many.wt = FMLP_DTYPE_F8_E4M3, fp8_many.fp8_rows = false, fp8.hidden = 528;
  MoeCase few = router;  // two tokens: the stream entry too
  few.t = 2;
  DeviceRun graph;
  graph.graph = true;
  each_entry({router, given, many, many_given, fp8, fp8_many, few},
             [&](const char* kernel, const MoeCase& c, int) {
               return run_device(c, kernel, mix_seed(test_seed(), 21), graph);
             });
}

// Router rows in groups of three equal rows: every score ties with two others, and the k-th pick
// falls inside a group (k = 2 of E = 8, k = 8 of E = 64), where the lower ids must win (the
// ranked top-k and the arg-max rounds alike; E = 64 also takes the cluster hand-off on sm_90).
TEST(MoeCuda, TiedRouterScoresGoToTheLowerIds) {
  SKIP_WITHOUT_GPU();
  std::vector<MoeCase> cs;
  for (int64_t e : {8, 64})
    for (bool sigmoid : {false, true}) {
      MoeCase c;
      c.t = e == 8 ? 5 : 3, c.e = e, c.k = e == 8 ? 2 : 8, c.d = 256, c.hidden = 72, c.d_out = 40;
      c.xt = c.wt = c.rt = FMLP_DTYPE_BF16, c.gated = true, c.sigmoid = sigmoid;
      cs.push_back(c);
    }
  MoeCase many = cs[0];  // 64 tokens per expert: the grouped entries
  many.t = 256, many.hidden = 128;
  cs.push_back(many);
  DeviceRun tied;
  tied.tied_router_rows = 3;
  each_entry(cs, [&](const char* kernel, const MoeCase& c, int n) {
    return run_device(c, kernel, mix_seed(test_seed(), uint64_t(n + 40)), tied);
  });
}

TEST(MoeCuda, DeterministicModeIsBitwiseReproducible) {
  SKIP_WITHOUT_GPU();
  MoeCase c;
  c.t = 300, c.e = 64, c.k = 8, c.d = 256, c.hidden = 264, c.d_out = 264, c.gated = true;
  c.xt = c.wt = FMLP_DTYPE_BF16;
  MoeCase few = c;  // few experts, narrow hidden slices: warps split K within a block
  few.t = 7, few.e = 8, few.k = 2, few.hidden = 352, few.d_out = 256,
  few.xt = few.wt = FMLP_DTYPE_F16;
  MoeCase many = c;  // 75 tokens per expert: the grouped GEMMs
  many.e = 8, many.k = 2, many.hidden = 512;
  MoeCase fp8 = few, fp8_many = many;
  fp8.wt = fp8_many.wt = FMLP_DTYPE_F8_E4M3;
  each_entry({c, few, many, fp8, fp8_many}, [](const char* kernel, const MoeCase& cc, int) {
    std::vector<unsigned char> a, b;
    DeviceRun ra, rb;
    ra.y_bytes = &a, rb.y_bytes = &b;
    std::string err = run_device(cc, kernel, 5, ra);
    if (err.empty()) err = run_device(cc, kernel, 5, rb);
    return err.empty() && a != b ? "two deterministic runs differ" : err;
  });
}

TEST(MoeCuda, DeviceIdsOutOfRangeGiveNanRowsAndACount) {
  SKIP_WITHOUT_GPU();
  MoeCase c;
  c.t = 7, c.e = 8, c.k = 2, c.d = 64, c.hidden = 72, c.d_out = 40, c.routing = 1;
  c.xt = c.wt = FMLP_DTYPE_BF16, c.residual = 1;
  MoeCase many = c;  // 32 tokens per expert: the grouped GEMMs
  many.t = 128, many.hidden = 64;
  MoeCase many_gated = many;  // ... and moe_sm90_grouped
  many_gated.gated = true;
  MoeCase fp8 = c, fp8_many = many;
  fp8.wt = fp8_many.wt = FMLP_DTYPE_F8_E4M3, fp8.hidden = 80;
  DeviceRun bad;
  bad.bad_ids = {{1 * 2 + 1, 8}, {3 * 2 + 0, -1}, {3 * 2 + 1, 1 << 30}};
  each_entry({c, many, many_gated, fp8, fp8_many}, [&](const char* kernel, const MoeCase& cc, int) {
    return run_device(cc, kernel, 9, bad);
  });
}

TEST(MoeCuda, BadInputIsRejectedAndDeviceYUntouched) {
  SKIP_WITHOUT_GPU();
  MoeCase c;
  c.t = 7, c.e = 8, c.k = 2, c.d = 64, c.hidden = 72, c.d_out = 40;
  c.xt = c.wt = FMLP_DTYPE_BF16;
  const std::vector<std::pair<std::function<void(fmlp_moe_args_t&)>, fmlp_status_t>> bad = {
      {[](fmlp_moe_args_t& a) { a.config.top_k = 9; }, FMLP_ERROR_INVALID_VALUE},
      {[](fmlp_moe_args_t& a) { a.w2.shape[0] = 7; }, FMLP_ERROR_SHAPE_MISMATCH},
      {[](fmlp_moe_args_t& a) { a.w1.shape[2] = 56; }, FMLP_ERROR_SHAPE_MISMATCH},
      {[](fmlp_moe_args_t& a) { a.router_w.shape[0] = 4; }, FMLP_ERROR_SHAPE_MISMATCH},
  };
  MoeData m;
  make(c, 13, &m);
  DeviceCase dc(c, m);
  const std::vector<unsigned char> before = dc.y_bytes();
  Buffer ws(size_t(1) << 20, true);
  ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
  for (const auto& [spoil, status] : bad) {
    fmlp_moe_args_t a = dc.args();
    spoil(a);
    EXPECT_EQ(fmlp_moe(&a, FMLP_BACKEND_CUDA, ws.data(), ws.size(), nullptr), status)
        << fmlp_last_error();
    EXPECT_EQ(dc.y_bytes(), before) << "y was written: " << fmlp_last_error();
  }
  // Valid but outside the kernels' reach: NOT_SUPPORTED with the reason.
  fmlp_moe_args_t a = dc.args();
  a.w1.dtype = a.w2.dtype = FMLP_DTYPE_F32;
  a.w1.shape[2] = a.x.shape[1] = a.router_w.shape[1] = 32;  // the bytes of 64 bf16 per row
  EXPECT_EQ(fmlp_moe(&a, FMLP_BACKEND_CUDA, ws.data(), ws.size(), nullptr),
            FMLP_ERROR_NOT_SUPPORTED);
  EXPECT_NE(std::string(fmlp_last_error()).find("bf16 or f16"), std::string::npos)
      << fmlp_last_error();
  EXPECT_EQ(dc.y_bytes(), before);
  // A workspace off its 256-byte boundary (the kernels' tables are laid out from the base).
  a = dc.args();
  EXPECT_EQ(
      fmlp_moe(&a, FMLP_BACKEND_CUDA, static_cast<char*>(ws.data()) + 16, ws.size() - 16, nullptr),
      FMLP_ERROR_MISALIGNED);
  EXPECT_NE(std::string(fmlp_last_error()).find("not 256-byte aligned"), std::string::npos)
      << fmlp_last_error();
  EXPECT_EQ(dc.y_bytes(), before);
}

// moe_sm80_grouped names why it declines a valid call (and moe_sm80_chunked then takes it).
TEST(MoeCuda, GroupedEntrySaysWhyItDeclines) {
  SKIP_WITHOUT_GPU();
  MoeCase base;
  base.t = 64, base.e = 8, base.k = 2, base.d = 128, base.hidden = 128, base.d_out = 40;
  base.xt = base.wt = FMLP_DTYPE_BF16;
  MoeCase f32_x = base, odd_hidden = base, one_token = base;
  f32_x.xt = FMLP_DTYPE_F32;
  odd_hidden.hidden = 72;
  one_token.t = 1;  // one token per hit expert on 0.1 MiB experts: streaming wins
  const std::pair<MoeCase, const char*> cases[] = {{f32_x, "experts' dtype"},
                                                   {odd_hidden, "multiples of"},
                                                   {one_token, "expected tokens per hit expert"}};
  for (const auto& [c, hint] : cases) {
    MoeData m;
    make(c, 17, &m);
    DeviceCase dc(c, m);
    const fmlp_moe_args_t a = dc.args();
    EXPECT_EQ(fmlp_moe_kernel_supports(&a, "moe_sm80_grouped"), FMLP_ERROR_NOT_SUPPORTED)
        << c.name();
    EXPECT_NE(std::string(fmlp_last_error()).find(hint), std::string::npos) << fmlp_last_error();
    EXPECT_EQ(fmlp_moe_kernel_supports(&a, "moe_sm80_chunked"), FMLP_SUCCESS)
        << c.name() << ": " << fmlp_last_error();
  }
}

// moe_sm80_grouped multiplies only the m16 tiles of a chunk that hold one of its len rows
// (moe/sm80_grouped.cu). Given routing hands each expert an exact slot count, so the chunk lengths
// (the last chunk of an expert: count % BM, or BM) are 1 and 16 q - 1, 16 q, 16 q + 1 for every
// m16 edge of both tile heights: one, some or all tiles of a warp row live, the other warp row
// dead or partly live, the trimmed and the untrimmed loop (len > BM - 16), and chunks that start
// past an expert's first BM slots (counts BM + 1, 2 BM + 1, ...). It fails when a live tile is
// skipped in the copies (its rows are multiplied as stale smem of another chunk or k stage), in
// ldmatrix or in the mma (the rows lack terms), e.g. live counted as (len - row0) / 16, and when
// rows of a dead tile are stored (they land on the next chunk's h rows or other slots' outputs).
// BM follows the expected tokens per hit expert (moe_plan_grouped, threshold 96 unless
// FMLP_MOE_GROUPED_WIDE_ROWS, read once at load, moves it): about 42 here for BM = 64, 102 for
// BM = 128 (the 768-slot expert lifts the mean).
TEST(MoeCuda, GroupedTrimsChunksAtEveryTileEdge) {
  SKIP_WITHOUT_GPU();
  const std::vector<int64_t> bm64 = {1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 113};
  const std::vector<int64_t> bm128 = {1,  15, 16, 17, 31, 32,  33,  47,  48,  49,  63,  64,  65, 79,
                                      80, 81, 95, 96, 97, 111, 112, 113, 127, 128, 129, 257, 768};
  int n = 0;
  for (const std::vector<int64_t>* slots : {&bm64, &bm128})
    for (bool gated : {false, true}) {
      MoeCase c;
      c.slots = *slots, c.routing = 4, c.e = int64_t(slots->size()), c.k = 2;
      int64_t total = 0;
      for (int64_t s : *slots) total += s;
      ASSERT_EQ(total % c.k, 0);
      c.t = total / c.k, c.d = 128, c.hidden = 128, c.d_out = 72;
      c.xt = c.wt = FMLP_DTYPE_BF16, c.gated = gated;
      c.act = gated ? FMLP_ACT_SILU : FMLP_ACT_GELU;
      // "" only: a skip (the entry declined the case) fails too.
      EXPECT_EQ(run_device(c, "moe_sm80_grouped", mix_seed(test_seed(), uint64_t(40 + n++))), "")
          << c.name() << " (FMLP_TEST_SEED=" << test_seed() << ")";
    }
}

// moe_sm90_grouped's tall tiles: 192-row chunks over three consumer warpgroups of 64 rows, one
// skipping its wgmmas when its rows all lie past the chunk (sm90/gemm_pipe.cuh). Exact slot counts
// put every chunk length at a consumer edge (1, 64 q - 1, 64 q, 64 q + 1, a full 192, a 193rd
// row in a second chunk, 385 = two full chunks and one row); 140 expected tokens per hit expert,
// so the plan takes the tall tiles. hidden 320 and d_out 200 leave partial N tiles. It fails when
// a live consumer is skipped (its rows keep stale or missing sums), when a skipped one stores
// rows, and when the 64-row A boxes land in the wrong consumer's part.
TEST(MoeCuda, Sm90TallTilesAtEveryConsumerEdge) {
  SKIP_WITHOUT_GPU();
  MoeCase c;
  c.slots = {1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 385};
  c.routing = 4, c.e = int64_t(c.slots.size()), c.k = 2;
  int64_t total = 0;
  for (int64_t s : c.slots) total += s;
  ASSERT_EQ(total % c.k, 0);
  c.t = total / c.k, c.d = 128, c.hidden = 320, c.d_out = 200;
  c.xt = c.wt = FMLP_DTYPE_BF16, c.gated = true, c.act = FMLP_ACT_SILU, c.b1 = FMLP_DTYPE_BF16;
  const std::string err = run_device(c, "moe_sm90_grouped", mix_seed(test_seed(), 60));
  if (err.find("compute capability") != std::string::npos) GTEST_SKIP() << err;
  EXPECT_EQ(err, "") << c.name() << " (FMLP_TEST_SEED=" << test_seed() << ")";
}

// moe_sm90_grouped's swapped tiles (tokens as the wgmma N, chunks of up to 160): chunk lengths at
// every 32-row token box edge and at both instantiated N (96 and 160), a 161st row in a second
// chunk and 321 = two full chunks and one row, in one launch; the empty experts keep the expected
// slots per hit expert in the swapped range. hidden 320 makes five 64-unit
// gate/up tiles, d_out 200 a partial second 128-row down tile. It fails when the gate and up rows
// of a unit are not the ones the 5-d W1 map interleaves, when a box past the chunk is not copied
// or a stale column is stored, and when an expert's tokens land in another chunk's rows.
TEST(MoeCuda, Sm90SwappedTilesAtEveryBoxEdge) {
  SKIP_WITHOUT_GPU();
  MoeCase c;
  c.slots = {1, 31, 32, 33, 95, 96, 97, 159, 160, 161, 321};
  c.slots.resize(32, 0);  // 21 experts without tokens: 43 expected slots per hit expert (<= 48)
  c.routing = 4, c.e = int64_t(c.slots.size()), c.k = 2;
  int64_t total = 0;
  for (int64_t s : c.slots) total += s;
  ASSERT_EQ(total % c.k, 0);
  c.t = total / c.k, c.d = 192, c.hidden = 320, c.d_out = 200;
  c.xt = c.wt = FMLP_DTYPE_BF16, c.gated = true, c.act = FMLP_ACT_GELU_TANH, c.b1 = FMLP_DTYPE_BF16;
  for (const fmlp_dtype_t t : {FMLP_DTYPE_BF16, FMLP_DTYPE_F16}) {
    c.xt = c.wt = c.b1 = t;
    const std::string err = run_device(c, "moe_sm90_grouped", mix_seed(test_seed(), 61 + int(t)));
    if (err.find("compute capability") != std::string::npos) GTEST_SKIP() << err;
    EXPECT_EQ(err, "") << c.name() << " (FMLP_TEST_SEED=" << test_seed() << ")";
  }
}

// ---- moe_sm80_stream: cases it must take ("" only: a skip fails too) ----

}  // namespace
}  // namespace fmlp_test
