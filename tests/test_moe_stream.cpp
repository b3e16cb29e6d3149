// moe_sm80_stream (the weight-stream entry for a few tokens) against the fp64 reference of
// moe_case.hpp on the GPU: odd shapes, every dtype mix, given and router routing, expert ranges,
// graph replay, determinism, NaN and bad ids, the planner's choice and the reasons it declines.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.hpp"
#include "moe_case.hpp"
#include "moe_device_run.hpp"

namespace fmlp_test {
namespace {

// T = 1..4 over E = 8 and 64 and top-1/2/4/8, d and hidden odd multiples of 8, any d_out, every
// dtype mix, biases, residual (separate and in place), router and given routing; then all slots
// on one expert, two experts only, top-k not a power of two (padded slot pairs), T = 16 at top-8.
std::vector<MoeCase> stream_cases() {
  const fmlp_dtype_t any[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16};
  const int64_t ds[] = {136, 264, 8}, hs[] = {72, 520, 264}, outs[] = {33, 264, 7};
  std::vector<MoeCase> v;
  int n = 0;
  for (int64_t t : {1, 2, 3, 4})
    for (int64_t e : {8, 64})
      for (int64_t k : {1, 2, e == 8 ? 4 : 8}) {
        MoeCase c;
        c.t = t, c.e = e, c.k = k;
        c.d = ds[n % 3], c.hidden = hs[(n / 3) % 3], c.d_out = outs[(n / 2) % 3];
        c.xt = any[n % 3], c.wt = n % 2 ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16, c.rt = any[(n / 3) % 3];
        c.b1 = n % 4 == 0 ? any[(n / 4) % 3] : kAbsent;
        c.b2 = n % 4 == 1 ? any[(n / 4) % 3] : kAbsent;
        c.rb = n % 5 == 0 ? FMLP_DTYPE_F32 : kAbsent;
        c.act = fmlp_activation_t(n % 4), c.gated = (n / 2) % 2 == 0;
        c.renorm = n % 3 != 0, c.sigmoid = n % 5 == 2, c.round = n % 2;
        c.residual = n % 3, c.routing = n % 4 == 3 ? 1 : 0, c.deterministic = n % 2;
        v.push_back(c);
        ++n;
      }
  for (int routing : {2, 3})  // every slot on one expert; experts 0 and e/2 only
    for (bool gated : {false, true}) {
      MoeCase c;
      c.t = 4, c.e = 8, c.k = 2, c.d = 264, c.hidden = 136, c.d_out = 40;
      c.routing = routing, c.gated = gated, c.residual = gated ? 2 : 1;
      c.xt = FMLP_DTYPE_BF16, c.wt = gated ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F16;
      c.b1 = c.b2 = FMLP_DTYPE_BF16;
      v.push_back(c);
    }
  for (int64_t k : {3, 6}) {  // k slots padded to 4 and 8 per output row
    MoeCase c;
    c.t = k == 3 ? 3 : 2, c.e = k == 3 ? 16 : 64, c.k = k, c.d = 136, c.hidden = 264;
    c.d_out = 65, c.gated = true, c.xt = c.wt = FMLP_DTYPE_BF16, c.residual = 1;
    c.b2 = FMLP_DTYPE_F32;
    v.push_back(c);
  }
  MoeCase big;  // the most tokens the entry takes at top-8 of 64 (2.3 slots per hit expert)
  big.t = 16, big.e = 64, big.k = 8, big.d = 256, big.hidden = 136, big.d_out = 264;
  big.gated = true, big.xt = big.wt = FMLP_DTYPE_BF16, big.rt = FMLP_DTYPE_BF16, big.residual = 1;
  v.push_back(big);
  // Short down-stream rows: hidden 24 and 40 (3 and 5 chunks), and 1408 (176 chunks: 1.375
  // batches per warp; top-6 padded to 8 slots).
  for (int64_t h : {24, 40, 1408}) {
    MoeCase c;
    c.t = h == 1408 ? 4 : 2, c.e = 64, c.k = h == 40 ? 8 : 6;
    c.d = h == 1408 ? 256 : 136, c.hidden = h, c.d_out = h == 1408 ? 520 : 33;
    c.gated = h != 40, c.xt = h == 24 ? FMLP_DTYPE_F32 : FMLP_DTYPE_BF16;
    c.wt = h == 40 ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16, c.residual = 1;
    c.b2 = h == 24 ? FMLP_DTYPE_F32 : kAbsent;
    v.push_back(c);
  }
  // A token's k rows of h past 64 KiB (8 x 4104 bf16: 64.1 KiB), which the down stream reads in
  // place rather than staging them in shared memory; T = 2 so two tokens' blocks share each SM.
  MoeCase wide;
  wide.t = 2, wide.e = 16, wide.k = 8, wide.d = 136, wide.hidden = 4104, wide.d_out = 72;
  wide.gated = true, wide.xt = wide.wt = FMLP_DTYPE_BF16, wide.residual = 1;
  v.push_back(wide);
  // Over a thousand row groups in the down stream (more than the blocks resident on a large
  // GPU): top-1, whose down rows are finished by whole-row warps without the block barrier, and
  // top-8 (eight slot rows a group); the blocks loop over groups.
  for (int64_t k : {1, 8}) {
    MoeCase c;
    c.t = k == 1 ? 1 : 2, c.e = k == 1 ? 2 : 8, c.k = k, c.d = 256, c.hidden = 1032;
    c.d_out = k == 1 ? 8200 : 1032;
    c.gated = true, c.xt = c.wt = FMLP_DTYPE_BF16, c.residual = 1;
    c.b2 = k == 1 ? FMLP_DTYPE_F32 : kAbsent;
    v.push_back(c);
  }
  return v;
}

TEST(MoeCudaStream, MatchesReference) {
  SKIP_WITHOUT_GPU();
  int n = 0;
  for (const MoeCase& c : stream_cases())
    EXPECT_EQ(run_device(c, "moe_sm80_stream", mix_seed(test_seed(), uint64_t(60 + n++))), "")
        << c.name() << " (FMLP_TEST_SEED=" << test_seed() << ")";
}

// d and hidden that are not multiples of 8 (1, 7, 127, 769, 1001) on experts stored with a padded
// row stride (NaN past each row), T = 1 .. 16, dense and gated, every x dtype, biases, residual,
// router and given routing, graph replay, a NaN token: the stream must take every case (a
// decline fails it) and match the reference, leaving y's guard and the workspace as they were.
TEST(MoeCudaStream, OddSizesOnPaddedRowsMatchReference) {
  SKIP_WITHOUT_GPU();
  const fmlp_dtype_t any[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16};
  struct Row {
    int64_t t, e, k, d, hidden, d_out;
    bool gated;
  };
  const Row rows[] = {{1, 8, 2, 1001, 769, 127, true},  {2, 64, 8, 127, 1001, 7, false},
                      {3, 8, 1, 7, 127, 1001, true},    {4, 16, 6, 769, 7, 33, true},
                      {1, 4, 2, 1, 1, 1, false},        {16, 64, 2, 1001, 127, 769, true},
                      {8, 64, 8, 769, 1001, 127, false}};
  int n = 0;
  for (const Row& r : rows) {
    MoeCase c;
    c.t = r.t, c.e = r.e, c.k = r.k, c.d = r.d, c.hidden = r.hidden, c.d_out = r.d_out;
    c.gated = r.gated, c.xt = any[n % 3], c.wt = n % 2 ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16;
    c.rt = any[(n + 1) % 3];
    c.pad_rows = true;
    c.b1 = n % 3 == 0 ? any[n % 3] : kAbsent, c.b2 = n % 3 == 1 ? FMLP_DTYPE_F32 : kAbsent;
    c.act = fmlp_activation_t(n % 4), c.residual = n % 3, c.routing = n % 2;
    c.deterministic = n % 2 == 0;
    ++n;
    DeviceRun run;
    run.graph = n % 3 == 0;
    // A graph run replays twice after its refresh: y as its own residual would get the op added
    // twice, so graph runs take a separate residual.
    if (run.graph && c.residual == 2) c.residual = 1;
    run.nan_token = n % 4 == 1 ? 0 : -1;
    EXPECT_EQ(run_device(c, "moe_sm80_stream", mix_seed(test_seed(), uint64_t(700 + n)), run), "")
        << c.name() << (run.graph ? " graph" : "") << " (FMLP_TEST_SEED=" << test_seed() << ")";
  }
}

// fmlp_moe_explain's report for the cuda backend on a small Mixtral-like call (E = 8, top-2,
// gated) of t tokens; *stream_why: "" when moe_sm80_stream supports it when named, else why not.
std::string explain_tokens(int64_t t, uint64_t seed, std::string* stream_why) {
  MoeCase c;
  c.t = t, c.e = 8, c.k = 2, c.d = 256, c.hidden = 512, c.d_out = 256, c.gated = true;
  c.xt = c.wt = c.rt = FMLP_DTYPE_BF16;
  MoeData m;
  make(c, seed, &m);
  DeviceCase dc(c, m);
  *stream_why = fmlp_moe_kernel_supports(&dc.args(), "moe_sm80_stream") == FMLP_SUCCESS
                    ? ""
                    : fmlp_last_error();
  size_t needed = 0;
  EXPECT_EQ(fmlp_moe_explain(&dc.args(), FMLP_BACKEND_CUDA, nullptr, 0, &needed), FMLP_SUCCESS)
      << fmlp_last_error();
  std::string s(needed, '\0');
  EXPECT_EQ(fmlp_moe_explain(&dc.args(), FMLP_BACKEND_CUDA, s.data(), s.size(), &needed),
            FMLP_SUCCESS);
  return s;
}

// Dispatch picks the stream for decode shapes (the planner: one slot per hit expert).
TEST(MoeCudaStream, IsTheDefaultAtDecodeSizes) {
  SKIP_WITHOUT_GPU();
  std::string why;
  const std::string s = explain_tokens(1, 3, &why);
  EXPECT_NE(s.find("chosen   moe_sm80_stream"), std::string::npos) << s;
}

// Where many slots share an expert the planner prefers the entries that read it once per chunk
// (the stream reads it once per slot), and explain says why.
TEST(MoeCudaStream, PlannerPrefersChunkEntriesWhenExpertsAreShared) {
  SKIP_WITHOUT_GPU();
  std::string why;
  const std::string s = explain_tokens(16, 4, &why);
  ASSERT_EQ(why, "");
  EXPECT_EQ(s.find("chosen   moe_sm80_stream"), std::string::npos) << s;
  EXPECT_NE(s.find("expected slots per hit expert >"), std::string::npos) << s;
}

// Graph capture, replay with other inputs (x, router, given ids and weights all change, so the
// routing does); router and given routing, dense and gated.
TEST(MoeCudaStream, GraphReplaysRouteTheNewInputs) {
  SKIP_WITHOUT_GPU();
  MoeCase router;
  router.t = 2, router.e = 8, router.k = 2, router.d = 264, router.hidden = 520;
  router.d_out = 136, router.gated = true, router.residual = 1;
  router.xt = router.wt = FMLP_DTYPE_BF16;
  MoeCase given = router;
  given.t = 4, given.e = 64, given.k = 8, given.routing = 1, given.gated = false;
  given.xt = FMLP_DTYPE_F32, given.wt = FMLP_DTYPE_F16;  // residual 1: replays add it once
  DeviceRun graph;
  graph.graph = true;
  for (const MoeCase& c : {router, given})
    EXPECT_EQ(run_device(c, "moe_sm80_stream", mix_seed(test_seed(), 22), graph), "") << c.name();
}

// Always deterministic (fixed summation order, no atomics on values), deterministic flag or not.
TEST(MoeCudaStream, IsBitwiseReproducible) {
  SKIP_WITHOUT_GPU();
  MoeCase c;
  c.t = 4, c.e = 64, c.k = 8, c.d = 256, c.hidden = 264, c.d_out = 264, c.gated = true;
  c.xt = c.wt = FMLP_DTYPE_BF16, c.deterministic = false;
  MoeCase mix = c;
  mix.t = 3, mix.e = 8, mix.k = 2, mix.xt = FMLP_DTYPE_F32, mix.wt = FMLP_DTYPE_F16;
  for (const MoeCase& cc : {c, mix}) {
    std::vector<unsigned char> a, b;
    DeviceRun ra, rb;
    ra.y_bytes = &a, rb.y_bytes = &b;
    EXPECT_EQ(run_device(cc, "moe_sm80_stream", 5, ra), "") << cc.name();
    EXPECT_EQ(run_device(cc, "moe_sm80_stream", 5, rb), "") << cc.name();
    EXPECT_EQ(a, b) << cc.name() << ": two runs differ";
  }
}

// A NaN in x makes its token's row of y NaN (every h of its slots is NaN) and no other row; device
// ids out of range give NaN rows and the error count.
TEST(MoeCudaStream, NanInputAndBadIdsGiveNanRows) {
  SKIP_WITHOUT_GPU();
  MoeCase c;
  c.t = 4, c.e = 8, c.k = 2, c.d = 136, c.hidden = 72, c.d_out = 40, c.routing = 1;
  c.xt = c.wt = FMLP_DTYPE_BF16, c.residual = 1, c.gated = true;
  DeviceRun nan;
  nan.nan_token = 2;
  EXPECT_EQ(run_device(c, "moe_sm80_stream", 9, nan), "");
  MoeCase router = c;
  router.routing = 0;
  EXPECT_EQ(run_device(router, "moe_sm80_stream", 10, nan), "");
  DeviceRun bad;
  bad.bad_ids = {{1 * 2 + 1, 8}, {3 * 2 + 0, -1}, {3 * 2 + 1, 1 << 30}};
  EXPECT_EQ(run_device(c, "moe_sm80_stream", 11, bad), "");
}

// Expert parallelism: a call holding experts [first, first + count) of the global ones adds only
// their slots (the rest are skipped without reads), router and given routing, graph replay too.
TEST(MoeCudaStream, ExpertRangeMatchesTheRestrictedReference) {
  SKIP_WITHOUT_GPU();
  MoeCase c;
  c.t = 3, c.e = 16, c.k = 4, c.d = 136, c.hidden = 264, c.d_out = 72, c.gated = true;
  c.xt = c.wt = FMLP_DTYPE_BF16, c.residual = 1, c.b1 = c.b2 = FMLP_DTYPE_F32;
  MoeCase given = c;
  given.routing = 1, given.t = 4, given.e = 64, given.k = 8, given.gated = false;
  int n = 0;
  for (const MoeCase& mc : {c, given})
    for (const ExpertRange& r :
         {ExpertRange{0, 4, true}, ExpertRange{5, 7, false}, ExpertRange{mc.e - 2, 2, true}})
      for (bool graph : {false, true}) {
        DeviceRun run;
        run.range = r, run.graph = graph;
        EXPECT_EQ(run_device(mc, "moe_sm80_stream", mix_seed(test_seed(), uint64_t(80 + n++)), run),
                  "")
            << mc.name() << " experts [" << r.first << ", " << r.first + r.count << ")"
            << (graph ? " graph" : "");
      }
}

// What the stream declines, with the reason (another entry takes each of these). Shared experts
// are the planner's business, not a limit of the stream (PlannerPrefersChunkEntries... above).
TEST(MoeCudaStream, SaysWhyItDeclines) {
  SKIP_WITHOUT_GPU();
  MoeCase base;
  base.t = 4, base.e = 8, base.k = 2, base.d = 128, base.hidden = 128, base.d_out = 40;
  base.xt = base.wt = FMLP_DTYPE_BF16;
  MoeCase fp8 = base, many = base, odd = base, wide_x = base, topk = base;
  fp8.wt = FMLP_DTYPE_F8_E4M3;
  many.t = 17, many.e = 64, many.k = 1;
  odd.hidden = 76;
  wide_x.d = 32776;  // x staged in bf16: 64.02 KiB
  topk.e = 16, topk.k = 9, topk.t = 1;
  const std::pair<MoeCase, const char*> cases[] = {
      {fp8, "f8_e4m3"}, {many, "T=17"}, {odd, "multiple"}, {wide_x, "KiB"}, {topk, "top_k=9"}};
  for (const auto& [c, hint] : cases) {
    MoeData m;
    make(c, 17, &m);
    DeviceCase dc(c, m);
    EXPECT_EQ(fmlp_moe_kernel_supports(&dc.args(), "moe_sm80_stream"), FMLP_ERROR_NOT_SUPPORTED)
        << c.name();
    EXPECT_NE(std::string(fmlp_last_error()).find(hint), std::string::npos) << fmlp_last_error();
  }
}

}  // namespace
}  // namespace fmlp_test
