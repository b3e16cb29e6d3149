// The CUDA prefill path (mlp_prefill_sm90_cublaslt) and the planner that routes to it: odd and
// large M against the double reference, every activation, gating form, bias, residual and layout;
// its rejections; a CUDA graph captured after a warm call; the workspace left zero-filled; and
// the planner's choice at M = 1 versus M = 4096. Skips without a CUDA build or a GPU.
//
// Tolerance: tests/tolerance.hpp unchanged. The path rounds G (gate/up pre-activations) and h to
// the activation dtype before GEMM2, as PyTorch does; each such rounding is one unit roundoff u
// of a layer-1 magnitude, so y picks up about sqrt(3) u * scale (u = 2^-8 bf16, 2^-11 f16),
// inside the 2^-7 / 2^-9 rtol of the activation dtype that budgets "intermediates rounded before
// a tensor-core GEMM". fp32 keeps fp32 intermediates and non-TF32 GEMMs (1e-4 budget).
// fp8 weights run W8A8 (x and h quantised per token to e4m3): their budget is tolerance.hpp's
// kW8A8Rtol per element plus kW8A8RmsBound over each case, from the error model stated there.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cuda_graph.hpp"
#include "mlp_case.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

#ifndef FMLP_TEST_WITH_CUDA
TEST(Prefill, NeedsCuda) {
  GTEST_SKIP() << device_unavailable_reason();
}
#else
constexpr const char* kPrefill = "mlp_prefill_sm90_cublaslt";

MlpCase base_case(int64_t m, int64_t d_in, int64_t hidden, int64_t d_out, fmlp_dtype_t t) {
  MlpCase c;
  c.m = m, c.d_in = d_in, c.hidden = hidden, c.d_out = d_out;
  c.x_dtype = c.w_dtype = t;
  return c;
}

// Runs kernel on c (fresh data) and checks it against the reference; "" when it matches.
std::string check_case(const MlpCase& c, const char* kernel, uint64_t salt) {
  PlacedCase p(c, /*device=*/true);
  const CaseData data = make_data(c, mix_seed(test_seed(), salt));
  p.upload(data);
  const RunOutcome run = run_kernel(p, kernel);
  if (run.status != FMLP_SUCCESS)
    return std::string(fmlp_status_name(run.status)) + ": " + run.error;
  std::string stray;
  const std::vector<double> out = p.download_y(&stray);
  if (!stray.empty()) return stray;
  const CompareOutcome cmp = compare(c, out, reference(c, data), /*gemm_composed=*/true);
  if (!cmp.ok)
    return std::to_string(cmp.bad) + " of " + std::to_string(out.size()) + " outputs wrong; " +
           cmp.detail;
  return {};
}

std::vector<MlpCase> prefill_cases() {
  std::vector<MlpCase> v;
  const fmlp_dtype_t dtypes[] = {FMLP_DTYPE_BF16, FMLP_DTYPE_F16, FMLP_DTYPE_F32};
  const fmlp_activation_t acts[] = {FMLP_ACT_RELU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH,
                                    FMLP_ACT_SILU};
  const Gate gates[] = {Gate::kDense, Gate::kStacked, Gate::kSeparate};
  uint64_t k = 0;
  // M in {1, 3, 300, 1000} x gate x activation x dtype over a tile-unfriendly shape.
  for (const int64_t m : {1, 3, 300, 1000})
    for (const Gate g : gates)
      for (const fmlp_activation_t act : acts) {
        MlpCase c = base_case(m, 136, 200, 72, dtypes[k++ % 3]);
        c.gate = g, c.act = act;
        c.b1 = FMLP_DTYPE_F32;
        if (g == Gate::kSeparate) c.b_up = FMLP_DTYPE_BF16;
        c.b2 = k % 2 ? FMLP_DTYPE_BF16 : c.x_dtype;
        v.push_back(c);
      }
  // Epilogue and layout axes at M = 300.
  for (const fmlp_dtype_t t : dtypes)
    for (int variant = 0; variant < 6; ++variant) {
      MlpCase c = base_case(300, 256, 512, 256, t);
      c.gate = variant % 2 ? Gate::kStacked : Gate::kDense;
      c.act = variant % 2 ? FMLP_ACT_SILU : FMLP_ACT_GELU_TANH;
      c.residual = variant < 2   ? Residual::kInPlace
                   : variant < 4 ? Residual::kSeparate
                                 : Residual::kNone;
      c.norm = variant % 3 == 0   ? FMLP_NORM_LAYERNORM
               : variant % 3 == 1 ? FMLP_NORM_RMSNORM
                                  : FMLP_NORM_NONE;
      c.gamma = c.norm != FMLP_NORM_NONE ? FMLP_DTYPE_F32 : kAbsent;
      c.beta = c.norm == FMLP_NORM_LAYERNORM ? t : kAbsent;
      c.b1 = variant == 5 ? kAbsent : t;
      c.b2 = variant >= 4 ? FMLP_DTYPE_F32 : t;
      c.strided = variant >= 3;
      v.push_back(c);
    }
  // Larger, realistic-ratio shapes.
  MlpCase big = base_case(1000, 1024, 2816, 1024, FMLP_DTYPE_BF16);
  big.gate = Gate::kStacked, big.act = FMLP_ACT_SILU, big.residual = Residual::kInPlace;
  v.push_back(big);
  MlpCase gpt = base_case(257, 768, 3072, 768, FMLP_DTYPE_F16);
  gpt.act = FMLP_ACT_GELU_TANH, gpt.b1 = gpt.b2 = FMLP_DTYPE_F16, gpt.norm = FMLP_NORM_LAYERNORM;
  gpt.gamma = gpt.beta = FMLP_DTYPE_F16;
  v.push_back(gpt);
  for (MlpCase& c : v) normalize(&c);
  return v;
}

TEST(Prefill, MatchesReference) {
  SKIP_WITHOUT_GPU();
  int i = 0;
  for (const MlpCase& c : prefill_cases()) {
    const std::string err = check_case(c, kPrefill, uint64_t(++i));
    EXPECT_TRUE(err.empty()) << "[" << c.name() << "]: " << err
                             << " (FMLP_TEST_SEED=" << test_seed() << ")";
  }
}

// Sizes that are not multiples of 8 (d_in = 769: rows of 1538 bytes) and pointers one element past
// a 256-byte boundary. cuBLASLt is told the real alignments; where it has no algorithm the run is
// refused with a reason and y stays untouched, otherwise the result must match.
TEST(Prefill, OddSizesAndMisalignedPointers) {
  SKIP_WITHOUT_GPU();
  int i = 100;
  for (const bool mis : {false, true})
    for (const Gate g : {Gate::kDense, Gate::kStacked, Gate::kSeparate}) {
      MlpCase c = base_case(300, 769, 127, 7, FMLP_DTYPE_BF16);
      c.gate = g, c.act = FMLP_ACT_GELU, c.misaligned = mis, c.strided = mis;
      c.b1 = c.b2 = FMLP_DTYPE_BF16;
      c.residual = mis ? Residual::kSeparate : Residual::kInPlace;
      normalize(&c);
      PlacedCase p(c, true);
      const CaseData data = make_data(c, mix_seed(test_seed(), uint64_t(++i)));
      p.upload(data);
      const std::vector<unsigned char> before = p.y_bytes();
      const RunOutcome run = run_kernel(p, kPrefill);
      if (run.status == FMLP_ERROR_NOT_SUPPORTED) {
        EXPECT_NE(run.error.find("cuBLASLt has no algorithm"), std::string::npos) << run.error;
        EXPECT_EQ(p.y_bytes(), before) << "[" << c.name() << "]: y written on refusal";
        std::printf("[fmlp] %s refused: %s\n", c.name().c_str(), run.error.c_str());
        continue;
      }
      ASSERT_EQ(run.status, FMLP_SUCCESS) << run.error;
      std::string stray;
      const std::vector<double> out = p.download_y(&stray);
      EXPECT_TRUE(stray.empty()) << stray;
      const CompareOutcome cmp = compare(c, out, reference(c, data), /*gemm_composed=*/true);
      EXPECT_TRUE(cmp.ok) << "[" << c.name() << "]: " << cmp.bad << " wrong; " << cmp.detail;
    }
}

TEST(Prefill, NonFiniteInputsPropagate) {
  SKIP_WITHOUT_GPU();
  int i = 200;
  for (const fmlp_activation_t act :
       {FMLP_ACT_RELU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH, FMLP_ACT_SILU})
    for (const Gate g : {Gate::kDense, Gate::kStacked}) {
      MlpCase c = base_case(5, 64, 96, 64, FMLP_DTYPE_BF16);
      c.gate = g, c.act = act, c.nonfinite = true, c.b1 = FMLP_DTYPE_BF16;
      normalize(&c);
      const std::string err = check_case(c, kPrefill, uint64_t(++i));
      EXPECT_TRUE(err.empty()) << "[" << c.name() << "]: " << err;
    }
}

TEST(Prefill, RejectsWithReasons) {
  SKIP_WITHOUT_GPU();
  MlpCase mixed = base_case(300, 64, 64, 64, FMLP_DTYPE_F32);
  mixed.w_dtype = FMLP_DTYPE_BF16;
  MlpCase fp8_f32 = base_case(300, 64, 64, 64, FMLP_DTYPE_F32);
  fp8_f32.w_dtype = FMLP_DTYPE_F8_E4M3;
  MlpCase fp8_odd = base_case(300, 72, 200, 64, FMLP_DTYPE_BF16);  // d_in 72: not a multiple of 16
  fp8_odd.w_dtype = FMLP_DTYPE_F8_E4M3;
  MlpCase fp8_mis = base_case(300, 64, 64, 64, FMLP_DTYPE_BF16);
  fp8_mis.w_dtype = FMLP_DTYPE_F8_E4M3, fp8_mis.misaligned = true;
  const std::pair<MlpCase, const char*> cases[] = {{mixed, "cast x to"},
                                                   {fp8_f32, "cast x to bf16"},
                                                   {fp8_odd, "multiples of 16"},
                                                   {fp8_mis, "16-byte aligned"}};
  for (const auto& [c, hint] : cases) {
    PlacedCase p(c, true);
    EXPECT_EQ(fmlp_mlp_kernel_supports(&p.args(), kPrefill), FMLP_ERROR_NOT_SUPPORTED);
    EXPECT_NE(std::string(fmlp_last_error()).find(hint), std::string::npos) << fmlp_last_error();
  }
}

// One prefill run of c on a fresh workspace (zeroed part zero, scratch dirty), whose zeroed part
// the contract (fusedmlp.h) wants left zero.
void expect_workspace_left_zeroed(const MlpCase& c, uint64_t salt) {
  PlacedCase p(c, true);
  p.upload(make_data(c, mix_seed(test_seed(), salt)));
  Buffer ws;
  const RunOutcome run = run_kernel(p, kPrefill, &ws);
  ASSERT_EQ(run.status, FMLP_SUCCESS) << run.error;
  const std::vector<unsigned char> after = ws.download();
  EXPECT_EQ(first_nonzero_in_zeroed_part(after), after.size())
      << "the workspace contract (fusedmlp.h) wants its zeroed part left zero";
  EXPECT_GT(after.size(), size_t(FMLP_CUDA_WORKSPACE_ZEROED_BYTES))
      << "the prefill path keeps its passes in the scratch part, past the zeroed one";
}

TEST(Prefill, LeavesZeroedPartZero) {
  SKIP_WITHOUT_GPU();
  MlpCase c = base_case(333, 128, 384, 128, FMLP_DTYPE_BF16);
  c.gate = Gate::kStacked, c.act = FMLP_ACT_SILU, c.norm = FMLP_NORM_RMSNORM, c.b2 = FMLP_DTYPE_F32;
  normalize(&c);
  expect_workspace_left_zeroed(c, 300);
}

// Weights of 64 MiB and more (here 2 x 8200 x 2048 + 2048 x 8200 bf16: 96 MiB) offer cuBLASLt no
// workspace (mlp/prefill_sm90_cublaslt.cu): still right, and the workspace still left zero-filled.
TEST(Prefill, LargeWeightsWithoutLtWorkspace) {
  SKIP_WITHOUT_GPU();
  MlpCase c = base_case(67, 2048, 8200, 2048, FMLP_DTYPE_BF16);
  c.gate = Gate::kStacked, c.act = FMLP_ACT_SILU, c.residual = Residual::kSeparate;
  normalize(&c);
  EXPECT_EQ(check_case(c, kPrefill, 310), "") << " (FMLP_TEST_SEED=" << test_seed() << ")";
  expect_workspace_left_zeroed(c, 311);
}

// A warm call through dispatch (it creates the cuBLASLt handle and caches the heuristic answers,
// so the captured graph holds only launches), then a graph replayed on three new inputs;
// check(out, ref) judges each replay ("" when right).
void expect_graph_replays_after_warm_call(
    const MlpCase& c, uint64_t seed,
    const std::function<std::string(const std::vector<double>&, const Reference&)>& check) {
  PlacedCase p(c, true);
  p.upload(make_data(c, mix_seed(test_seed(), seed)));
  Buffer ws;
  const RunOutcome run = run_kernel(p, nullptr, &ws);
  ASSERT_EQ(run.status, FMLP_SUCCESS) << run.error;
  MlpGraph graph(p.args(), FMLP_BACKEND_CUDA, ws.data(), ws.size());
  ASSERT_TRUE(graph.ready()) << fmlp_status_name(graph.status()) << ": " << graph.error();
  for (uint64_t replay = 1; replay <= 3; ++replay) {
    const CaseData data = make_data(c, mix_seed(test_seed(), seed + replay));
    p.upload(data);  // an in-place residual: y holds the new residual again
    ASSERT_TRUE(graph.replay()) << graph.error();
    std::string stray;
    const std::vector<double> out = p.download_y(&stray);
    EXPECT_TRUE(stray.empty()) << stray;
    const std::string err = check(out, reference(c, data));
    EXPECT_TRUE(err.empty()) << "replay " << replay << ": " << err;
  }
}

TEST(Prefill, GraphCaptureAfterWarmCall) {
  SKIP_WITHOUT_GPU();
  MlpCase c = base_case(300, 256, 704, 256, FMLP_DTYPE_BF16);
  c.gate = Gate::kStacked, c.act = FMLP_ACT_SILU, c.residual = Residual::kSeparate;
  c.norm = FMLP_NORM_RMSNORM, c.gamma = FMLP_DTYPE_BF16, c.b2 = FMLP_DTYPE_F32;
  normalize(&c);
  expect_graph_replays_after_warm_call(
      c, 400, [&](const std::vector<double>& out, const Reference& ref) {
        const CompareOutcome cmp = compare(c, out, ref, /*gemm_composed=*/true);
        return cmp.ok ? std::string() : std::to_string(cmp.bad) + " wrong; " + cmp.detail;
      });
}

std::string explain(const fmlp_mlp_args_t& args) {
  size_t needed = 0;
  EXPECT_EQ(fmlp_mlp_explain(&args, FMLP_BACKEND_CUDA, nullptr, 0, &needed), FMLP_SUCCESS);
  std::string s(needed, '\0');
  EXPECT_EQ(fmlp_mlp_explain(&args, FMLP_BACKEND_CUDA, s.data(), s.size(), &needed), FMLP_SUCCESS);
  s.resize(needed - 1);
  return s;
}

TEST(Planner, DecodeAtOneTokenPrefillAtManyTokens) {
  SKIP_WITHOUT_GPU();
  for (const int64_t m : {1, 4096}) {
    MlpCase c = base_case(m, 512, 1024, 512, FMLP_DTYPE_BF16);
    c.gate = Gate::kStacked, c.act = FMLP_ACT_SILU;
    normalize(&c);
    PlacedCase p(c, true);
    const std::string report = explain(p.args());
    EXPECT_NE(report.find("planner  M=" + std::to_string(m)), std::string::npos) << report;
    const bool prefill = report.find(std::string("chosen   ") + kPrefill) != std::string::npos;
    EXPECT_EQ(prefill, m > 1) << report;
    if (m == 1) {
      EXPECT_NE(report.find("chosen   mlp_decode"), std::string::npos) << report;
      EXPECT_NE(report.find("< crossover"), std::string::npos) << report;
    } else {
      EXPECT_NE(report.find(">= crossover"), std::string::npos) << report;
    }
    // Dispatch runs what explain reports.
    const CaseData data = make_data(c, mix_seed(test_seed(), 500 + uint64_t(m)));
    p.upload(data);
    Buffer ws;
    const RunOutcome run = run_kernel(p, nullptr, &ws);
    ASSERT_EQ(run.status, FMLP_SUCCESS) << run.error;
    std::string stray;
    const CompareOutcome cmp =
        compare(c, p.download_y(&stray), reference(c, data), /*gemm_composed=*/true);
    EXPECT_TRUE(cmp.ok) << "M=" << m << ": " << cmp.detail;
  }
}

// ---- fp8 e4m3 weights: the W8A8 path ----

MlpCase fp8_case(int64_t m, int64_t d_in, int64_t hidden, int64_t d_out, fmlp_dtype_t t) {
  MlpCase c = base_case(m, d_in, hidden, d_out, t);
  c.w_dtype = FMLP_DTYPE_F8_E4M3;
  return c;
}

// A llama-style fp8 MLP (stacked gate/up, SiLU, per-row scales, d_out = d_in), normalised.
MlpCase fp8_swiglu_case(int64_t m, int64_t d_in, int64_t hidden, fmlp_dtype_t t) {
  MlpCase c = fp8_case(m, d_in, hidden, d_in, t);
  c.gate = Gate::kStacked, c.act = FMLP_ACT_SILU, c.per_row_scale = true;
  normalize(&c);
  return c;
}

// tolerance.hpp's W8A8 budget (compare() applies it to gemm-composed kernels with fp8 weights):
// every element within kW8A8Rtol and the non-finite classes of the reference, and the case's rms
// of |out - ref| / (|ref| + scale) within kW8A8RmsBound.
std::string compare_w8a8(const MlpCase& c, const std::vector<double>& out, const Reference& ref) {
  const CompareOutcome cmp = compare(c, out, ref, /*gemm_composed=*/true);
  return cmp.ok ? std::string()
                : std::to_string(cmp.bad) + " of " + std::to_string(out.size()) +
                      " outputs wrong; " + cmp.detail;
}

std::string check_fp8_case(const MlpCase& c, uint64_t salt) {
  PlacedCase p(c, /*device=*/true);
  const CaseData data = make_data(c, mix_seed(test_seed(), salt));
  p.upload(data);
  const RunOutcome run = run_kernel(p, kPrefill);
  if (run.status != FMLP_SUCCESS)
    return std::string(fmlp_status_name(run.status)) + ": " + run.error;
  std::string stray;
  const std::vector<double> out = p.download_y(&stray);
  if (!stray.empty()) return stray;
  return compare_w8a8(c, out, reference(c, data));
}

std::vector<MlpCase> fp8_cases() {
  std::vector<MlpCase> v;
  const fmlp_activation_t acts[] = {FMLP_ACT_RELU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH,
                                    FMLP_ACT_SILU};
  uint64_t k = 0;
  // M x gate x activation, alternating dtype, scale kind, norm, biases and residual form.
  for (const int64_t m : {1, 127, 769})
    for (const Gate g : {Gate::kDense, Gate::kStacked, Gate::kSeparate})
      for (const fmlp_activation_t act : acts) {
        ++k;
        MlpCase c = fp8_case(m, 256, 512, 128, k % 3 == 0 ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16);
        c.gate = g, c.act = act;
        c.per_row_scale = k % 2 == 0;
        c.norm = k % 3 == 0 ? FMLP_NORM_LAYERNORM : k % 3 == 1 ? FMLP_NORM_RMSNORM : FMLP_NORM_NONE;
        c.gamma = c.norm != FMLP_NORM_NONE ? FMLP_DTYPE_F32 : kAbsent;
        c.beta = c.norm == FMLP_NORM_LAYERNORM ? c.x_dtype : kAbsent;
        c.b1 = k % 4 == 0 ? kAbsent : FMLP_DTYPE_F32;
        if (g == Gate::kSeparate) c.b_up = FMLP_DTYPE_BF16;
        c.b2 = k % 5 < 2 ? kAbsent : k % 2 ? FMLP_DTYPE_BF16 : c.x_dtype;
        c.residual = k % 3 == 0   ? Residual::kInPlace
                     : k % 3 == 1 ? Residual::kSeparate
                                  : Residual::kNone;
        c.fp8_all_codes = k % 7 == 0;
        v.push_back(c);
      }
  // A realistic ratio, and a hidden whose h row needs more than 48 KiB of shared memory.
  MlpCase big = fp8_case(300, 1024, 2816, 1024, FMLP_DTYPE_BF16);
  big.gate = Gate::kStacked, big.act = FMLP_ACT_SILU, big.residual = Residual::kInPlace;
  big.per_row_scale = true, big.norm = FMLP_NORM_RMSNORM, big.gamma = FMLP_DTYPE_BF16;
  v.push_back(big);
  MlpCase wide = fp8_case(33, 64, 28672, 64, FMLP_DTYPE_BF16);
  wide.gate = Gate::kStacked, wide.act = FMLP_ACT_SILU, wide.per_row_scale = true;
  v.push_back(wide);
  // Deterministic mode, and NaN codes in W2 (rows 0 and d_out - 1 of y are NaN in every token).
  MlpCase det = fp8_case(200, 128, 256, 128, FMLP_DTYPE_BF16);
  det.gate = Gate::kStacked, det.act = FMLP_ACT_GELU, det.deterministic = true;
  det.nan_weights = true, det.b2 = FMLP_DTYPE_F32;
  v.push_back(det);
  for (MlpCase& c : v) normalize(&c);
  return v;
}

TEST(PrefillFp8, MatchesReferenceWithinW8A8Budget) {
  SKIP_WITHOUT_GPU();
  int i = 600;
  for (const MlpCase& c : fp8_cases()) {
    const std::string err = check_fp8_case(c, uint64_t(++i));
    EXPECT_TRUE(err.empty()) << "[" << c.name() << "]: " << err
                             << " (FMLP_TEST_SEED=" << test_seed() << ")";
  }
}

// A NaN row and an +Inf row (rows 0 and 1): their scales become NaN, so those tokens' outputs are
// NaN wherever the reference is non-finite; the other tokens stay exact to the budget.
TEST(PrefillFp8, NonFiniteRowsPropagate) {
  SKIP_WITHOUT_GPU();
  int i = 700;
  for (const fmlp_activation_t act :
       {FMLP_ACT_RELU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH, FMLP_ACT_SILU})
    for (const Gate g : {Gate::kDense, Gate::kStacked})
      for (const fmlp_norm_t norm : {FMLP_NORM_NONE, FMLP_NORM_LAYERNORM}) {
        MlpCase c = fp8_case(5, 64, 96, 64, FMLP_DTYPE_BF16);
        c.gate = g, c.act = act, c.nonfinite = true, c.b1 = FMLP_DTYPE_BF16, c.norm = norm;
        c.per_row_scale = act == FMLP_ACT_SILU;
        c.residual = g == Gate::kDense ? Residual::kInPlace : Residual::kNone;
        normalize(&c);
        const std::string err = check_fp8_case(c, uint64_t(++i));
        EXPECT_TRUE(err.empty()) << "[" << c.name() << "]: " << err;
      }
}

TEST(PrefillFp8, LeavesZeroedPartZero) {
  SKIP_WITHOUT_GPU();
  for (const bool b2 : {false, true}) {  // b2: GEMM2's D goes through scratch
    MlpCase c = fp8_case(333, 128, 384, 128, FMLP_DTYPE_BF16);
    c.gate = Gate::kStacked, c.act = FMLP_ACT_SILU, c.norm = FMLP_NORM_RMSNORM;
    c.residual = Residual::kInPlace, c.b2 = b2 ? FMLP_DTYPE_F32 : kAbsent;
    normalize(&c);
    PlacedCase p(c, true);
    p.upload(make_data(c, mix_seed(test_seed(), 800 + b2)));
    Buffer ws;
    const RunOutcome run = run_kernel(p, kPrefill, &ws);
    ASSERT_EQ(run.status, FMLP_SUCCESS) << run.error;
    const std::vector<unsigned char> after = ws.download();
    EXPECT_EQ(first_nonzero_in_zeroed_part(after), after.size())
        << "b2=" << b2 << ": the workspace contract wants its zeroed part left zero";
  }
}

// Through dispatch (the planner picks the path at M = 300): a warm call, then a captured graph
// replayed on new inputs, with the in-place residual (GEMM2's C when cuBLASLt offers it).
TEST(PrefillFp8, GraphCaptureAfterWarmCall) {
  SKIP_WITHOUT_GPU();
  MlpCase c = fp8_case(300, 256, 704, 256, FMLP_DTYPE_BF16);
  c.gate = Gate::kStacked, c.act = FMLP_ACT_SILU, c.residual = Residual::kInPlace;
  c.norm = FMLP_NORM_RMSNORM, c.gamma = FMLP_DTYPE_BF16;
  normalize(&c);
  expect_graph_replays_after_warm_call(c, 900,
                                       [&](const std::vector<double>& out, const Reference& ref) {
                                         return compare_w8a8(c, out, ref);
                                       });
}

// A scale vector of the wrong length never reaches the kernel: validation names it.
TEST(PrefillFp8, WrongScaleLengthRejected) {
  SKIP_WITHOUT_GPU();
  MlpCase c = fp8_swiglu_case(64, 64, 64, FMLP_DTYPE_BF16);
  PlacedCase p(c, true);
  fmlp_mlp_args_t args = p.args();
  args.weights.w1_scale.shape[0] = c.hidden;  // stacked gated weights need 2 * hidden
  EXPECT_EQ(fmlp_mlp_kernel_supports(&args, kPrefill), FMLP_ERROR_BAD_SCALE);
  EXPECT_NE(std::string(fmlp_last_error()).find("w1_scale"), std::string::npos)
      << fmlp_last_error();
}

TEST(Planner, Fp8DecodeAtFewTokensW8A8AtMany) {
  SKIP_WITHOUT_GPU();
  for (const int64_t m : {1, 300}) {
    MlpCase c = fp8_swiglu_case(m, 512, 1024, FMLP_DTYPE_BF16);
    PlacedCase p(c, true);
    const std::string report = explain(p.args());
    const bool prefill = report.find(std::string("chosen   ") + kPrefill) != std::string::npos;
    EXPECT_EQ(prefill, m > 1) << report;
    EXPECT_NE(report.find(m > 1 ? "W8A8" : "weight-only fp8"), std::string::npos) << report;
    const CaseData data = make_data(c, mix_seed(test_seed(), 950 + uint64_t(m)));
    p.upload(data);
    Buffer ws;
    const RunOutcome run = run_kernel(p, nullptr, &ws);
    ASSERT_EQ(run.status, FMLP_SUCCESS) << run.error;
    std::string stray;
    const std::vector<double> out = p.download_y(&stray);
    if (prefill) {
      const std::string err = compare_w8a8(c, out, reference(c, data));
      EXPECT_TRUE(err.empty()) << "M=" << m << ": " << err;
    } else {
      const CompareOutcome cmp = compare(c, out, reference(c, data));
      EXPECT_TRUE(cmp.ok) << "M=" << m << ": " << cmp.detail;
    }
  }
}

// fp8 crossovers measured per shape (src/cuda/mlp/planner.cpp,
// bench/results/cuda_decode_fp8_h200.*): the cluster kernel keeps gpt2-small and llama3-8b at M =
// 16, 4096 -> 4096 takes the W8A8 path from M = 16.
TEST(Planner, Fp8MeasuredCrossovers) {
  SKIP_WITHOUT_GPU();
  struct Want {
    int64_t m, d_in, hidden;
    bool gated, prefill;
  };
  for (const Want w : {Want{16, 768, 3072, false, false}, Want{17, 768, 3072, false, true},
                       Want{15, 4096, 4096, false, false}, Want{16, 4096, 4096, false, true},
                       Want{16, 4096, 14336, true, false}, Want{17, 4096, 14336, true, true}}) {
    MlpCase c = w.gated ? fp8_swiglu_case(w.m, w.d_in, w.hidden, FMLP_DTYPE_BF16)
                        : fp8_case(w.m, w.d_in, w.hidden, w.d_in, FMLP_DTYPE_BF16);
    PlacedCase p(c, true);
    const std::string report = explain(p.args());
    const std::string at =
        "M=" + std::to_string(w.m) + " hidden=" + std::to_string(w.hidden) + ": ";
    EXPECT_EQ(report.find(std::string("chosen   ") + kPrefill) != std::string::npos, w.prefill)
        << at << report;
    EXPECT_NE(report.find("measured on NVIDIA H200"), std::string::npos) << at << report;
  }
}

// fp8 weights below the crossover: the weight streams at every M they take (1..4 where x and h fit
// their shared memory), the next decode entry where they do not (src/cuda/mlp/planner.cpp, measured
// on an H200); the small shape's picks run against the reference.
TEST(Planner, Fp8StreamsWhereverTheyFit) {
  SKIP_WITHOUT_GPU();
  struct Want {
    int64_t m, d_in, hidden;
    bool stream;
  };
  // 512 x 1024 gated: 1.5 MiB of fp8 weights; 4096 x 8192 gated: 96 MiB, h of four tokens 64 KiB;
  // 4096 x 14336 at M = 4: h takes 112 KiB, more than the streams' 96.
  for (const Want w :
       {Want{1, 512, 1024, true}, Want{2, 512, 1024, true}, Want{3, 512, 1024, true},
        Want{4, 512, 1024, true}, Want{4, 4096, 8192, true}, Want{4, 4096, 14336, false}}) {
    MlpCase c = fp8_swiglu_case(w.m, w.d_in, w.hidden, FMLP_DTYPE_BF16);
    PlacedCase p(c, true);
    const std::string report = explain(p.args());
    const std::string at = "M=" + std::to_string(w.m) + " d_in=" + std::to_string(w.d_in) +
                           " hidden=" + std::to_string(w.hidden) + ": ";
    EXPECT_EQ(report.find("chosen   mlp_decode_sm80_stream") != std::string::npos, w.stream)
        << at << report;
    EXPECT_EQ(report.find(std::string("chosen   ") + kPrefill), std::string::npos) << at << report;
    if (w.d_in > 512) continue;  // the large shapes' runs are covered by the kernels' sections
    const CaseData data = make_data(c, mix_seed(test_seed(), 970 + uint64_t(w.m)));
    p.upload(data);
    Buffer ws;
    const RunOutcome run = run_kernel(p, nullptr, &ws);
    ASSERT_EQ(run.status, FMLP_SUCCESS) << at << run.error;
    std::string stray;
    const CompareOutcome cmp = compare(c, p.download_y(&stray), reference(c, data));
    EXPECT_TRUE(cmp.ok) << at << cmp.detail;
    EXPECT_TRUE(stray.empty()) << at << stray;
  }
}

// The weight streams stage x and h in 16 bits: fp8 weights with fp32 activations are declined with
// a reason that names the activations, and the splitk kernel (bf16 tensor cores, x split hi + lo,
// the e4m3 weights exact in bf16) runs the call.
TEST(Planner, Fp8StreamsDeclineF32Activations) {
  SKIP_WITHOUT_GPU();
  MlpCase c = fp8_swiglu_case(1, 512, 1024, FMLP_DTYPE_F32);
  PlacedCase p(c, true);
  EXPECT_EQ(fmlp_mlp_kernel_supports(&p.args(), "mlp_decode_sm80_stream"),
            FMLP_ERROR_NOT_SUPPORTED);
  EXPECT_NE(std::string(fmlp_last_error()).find("f32 activations with fp8 weights"),
            std::string::npos)
      << fmlp_last_error();
  const std::string report = explain(p.args());
  EXPECT_NE(report.find("chosen   mlp_decode_sm90_splitk"), std::string::npos) << report;
  const CaseData data = make_data(c, mix_seed(test_seed(), 990));
  p.upload(data);
  Buffer ws;
  const RunOutcome run = run_kernel(p, nullptr, &ws);
  ASSERT_EQ(run.status, FMLP_SUCCESS) << run.error;
  std::string stray;
  const CompareOutcome cmp = compare(c, p.download_y(&stray), reference(c, data));
  EXPECT_TRUE(cmp.ok) << cmp.detail;
  EXPECT_TRUE(stray.empty()) << stray;
}

// ---- gated 16-bit GEMM1 as one sm_90a kernel (gemm_sm90_wgmma_gated) ----
// Gated bf16/f16 requests with 16-byte aligned x, weights and rows run GEMM1 + bias + activation
// + gate product as one wgmma kernel on compute capability 9.0 when FMLP_PREFILL_WGMMA=1 (ctest
// runs these tests that way too: tests/CMakeLists.txt); elsewhere, and for misaligned views, the
// cuBLASLt path. Same tolerance as above: the
// fused kernel rounds only h (not G) to the activation dtype, one rounding fewer.

bool device_is_sm90() {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess)
    return false;
  return major == 9 && minor == 0;
}

bool wgmma_switched_on() {
  return knob_value("FMLP_PREFILL_WGMMA") == "1";
}

// run_kernel with explicit arguments (views narrowed or shifted from a PlacedCase's buffers).
RunOutcome run_args(const fmlp_mlp_args_t& args, const char* kernel) {
  size_t bytes = 0;
  fmlp_status_t s = fmlp_mlp_kernel_workspace_size(&args, kernel, &bytes);
  if (s != FMLP_SUCCESS) return {s, fmlp_last_error()};
  Buffer ws(bytes, true);
  ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
  s = fmlp_mlp_with_kernel(&args, kernel, ws.data(), bytes, nullptr);
  RunOutcome out{s, fmlp_last_error()};
  if (s == FMLP_SUCCESS) {
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess)
      out = {FMLP_ERROR_CUDA, std::string("after the run: ") + cudaGetErrorString(e)};
  }
  return out;
}

std::vector<MlpCase> wgmma_cases() {
  struct Shape {
    int64_t m, k, h;
  };
  // Tile edges (M 127/128/129, H not a multiple of 128, K below one 64-wide k block and not a
  // multiple of it) and one deep K.
  const Shape shapes[] = {{1, 64, 128},     {7, 72, 200},     {127, 200, 1000}, {128, 64, 1408},
                          {129, 4096, 200}, {769, 200, 1000}, {769, 72, 1408},  {128, 4096, 128},
                          {129, 64, 200},   {4096, 200, 1000}};
  const fmlp_activation_t acts[] = {FMLP_ACT_SILU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH,
                                    FMLP_ACT_RELU};
  std::vector<MlpCase> v;
  uint64_t k = 0;
  for (const Shape& sh : shapes)
    for (const Gate g : {Gate::kStacked, Gate::kSeparate}) {
      MlpCase c = base_case(sh.m, sh.k, sh.h, 64, k % 2 ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16);
      c.gate = g, c.act = acts[k % 4];
      c.b1 = k % 3 == 0 ? kAbsent : k % 3 == 1 ? FMLP_DTYPE_F32 : c.x_dtype;
      if (g == Gate::kSeparate) c.b_up = k % 5 == 0 ? kAbsent : FMLP_DTYPE_BF16;
      c.b2 = k % 2 ? c.x_dtype : kAbsent;
      c.residual = k % 3 == 0   ? Residual::kInPlace
                   : k % 3 == 1 ? Residual::kSeparate
                                : Residual::kNone;
      c.norm = k % 4 == 3 ? FMLP_NORM_RMSNORM : FMLP_NORM_NONE;  // x from the norm's scratch
      c.gamma = c.norm != FMLP_NORM_NONE ? FMLP_DTYPE_F32 : kAbsent;
      ++k;
      v.push_back(c);
    }
  for (MlpCase& c : v) normalize(&c);
  return v;
}

TEST(PrefillWgmma, MatchesReference) {
  SKIP_WITHOUT_GPU();
  int i = 1000;
  for (const MlpCase& c : wgmma_cases()) {
    const std::string err = check_case(c, kPrefill, uint64_t(++i));
    EXPECT_TRUE(err.empty()) << "[" << c.name() << "]: " << err
                             << " (FMLP_TEST_SEED=" << test_seed() << ")";
  }
}

TEST(PrefillWgmma, ExplainNamesTheFusedGemm1) {
  SKIP_WITHOUT_GPU();
  MlpCase c = base_case(512, 256, 512, 256, FMLP_DTYPE_BF16);
  c.gate = Gate::kStacked, c.act = FMLP_ACT_SILU;
  normalize(&c);
  PlacedCase p(c, true);
  const std::string report = explain(p.args());
  const bool fused = device_is_sm90() && wgmma_switched_on();
  EXPECT_EQ(report.find("gemm_sm90_wgmma_gated") != std::string::npos, fused) << report;
  EXPECT_EQ(report.find("GEMM1: cuBLASLt") != std::string::npos, !fused) << report;
}

// NaN and +Inf rows of x through the wgmma accumulators and the epilogue.
TEST(PrefillWgmma, NonFiniteInputsPropagate) {
  SKIP_WITHOUT_GPU();
  int i = 1100;
  for (const fmlp_activation_t act :
       {FMLP_ACT_RELU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH, FMLP_ACT_SILU})
    for (const Gate g : {Gate::kStacked, Gate::kSeparate}) {
      MlpCase c =
          base_case(130, 72, 200, 64, g == Gate::kStacked ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F16);
      c.gate = g, c.act = act, c.nonfinite = true, c.b1 = FMLP_DTYPE_F32;
      normalize(&c);
      const std::string err = check_case(c, kPrefill, uint64_t(++i));
      EXPECT_TRUE(err.empty()) << "[" << c.name() << "]: " << err;
    }
}

// Row strides above d_in (ldx = ldw = d_in + 8, 16-byte multiples, so the fused kernel takes
// them): a case with 8 more input columns whose x columns are zero, run on views narrowed to the
// first d_in columns; the reference of the wide case is the narrow case's.
// shift_x: x's view starts one element in (misaligned: the fused kernel declines, cuBLASLt runs
// or refuses with a reason and y untouched); the reference then reads x shifted by one column.
void check_narrowed(Gate g, fmlp_dtype_t t, bool shift_x, uint64_t salt) {
  const int64_t k = 136;
  MlpCase c = base_case(300, k + 8, 264, 72, t);
  c.gate = g, c.act = FMLP_ACT_SILU, c.b1 = FMLP_DTYPE_F32, c.b2 = t;
  c.residual = Residual::kSeparate;
  if (g == Gate::kSeparate) c.b_up = t;
  normalize(&c);
  PlacedCase p(c, true);
  CaseData data = make_data(c, mix_seed(test_seed(), salt));
  for (int64_t r = 0; r < c.m; ++r)
    for (int64_t j = k; j < k + 8; ++j) data.x.set(r, j, 0.0);
  p.upload(data);
  CaseData ref_data = data;
  if (shift_x)
    for (int64_t r = 0; r < c.m; ++r)
      for (int64_t j = 0; j < k; ++j) ref_data.x.set(r, j, data.x.get(r, j + 1));
  fmlp_mlp_args_t args = p.args();
  args.x.shape[1] = k;
  if (shift_x) args.x.data = static_cast<char*>(args.x.data) + 2;
  args.weights.w1.shape[1] = k;
  if (g == Gate::kSeparate) args.weights.w_up.shape[1] = k;
  const std::vector<unsigned char> before = p.y_bytes();
  const RunOutcome run = run_args(args, kPrefill);
  const std::string name = c.name() + (shift_x ? " x+1" : "");
  if (shift_x && run.status == FMLP_ERROR_NOT_SUPPORTED) {
    EXPECT_NE(run.error.find("cuBLASLt has no algorithm"), std::string::npos) << run.error;
    EXPECT_EQ(p.y_bytes(), before) << "[" << name << "]: y written on refusal";
    std::printf("[fmlp] %s refused: %s\n", name.c_str(), run.error.c_str());
    return;
  }
  ASSERT_EQ(run.status, FMLP_SUCCESS) << "[" << name << "]: " << run.error;
  std::string stray;
  const std::vector<double> out = p.download_y(&stray);
  EXPECT_TRUE(stray.empty()) << stray;
  const CompareOutcome cmp = compare(c, out, reference(c, ref_data), /*gemm_composed=*/true);
  EXPECT_TRUE(cmp.ok) << "[" << name << "]: " << cmp.bad << " wrong; " << cmp.detail;
}

TEST(PrefillWgmma, StridedViews) {
  SKIP_WITHOUT_GPU();
  check_narrowed(Gate::kStacked, FMLP_DTYPE_BF16, false, 1200);
  check_narrowed(Gate::kSeparate, FMLP_DTYPE_F16, false, 1201);
}

TEST(PrefillWgmma, MisalignedXFallsBackToCublasLt) {
  SKIP_WITHOUT_GPU();
  check_narrowed(Gate::kStacked, FMLP_DTYPE_BF16, true, 1210);
  check_narrowed(Gate::kSeparate, FMLP_DTYPE_F16, true, 1211);
}

TEST(PrefillWgmma, GraphCaptureAfterWarmCall) {
  SKIP_WITHOUT_GPU();
  MlpCase c = base_case(769, 200, 1000, 128, FMLP_DTYPE_F16);
  c.gate = Gate::kSeparate, c.act = FMLP_ACT_GELU, c.residual = Residual::kInPlace;
  c.b1 = FMLP_DTYPE_F32, c.b_up = FMLP_DTYPE_F16, c.b2 = FMLP_DTYPE_F16;
  normalize(&c);
  expect_graph_replays_after_warm_call(
      c, 1300, [&](const std::vector<double>& out, const Reference& ref) {
        const CompareOutcome cmp = compare(c, out, ref, /*gemm_composed=*/true);
        return cmp.ok ? std::string() : std::to_string(cmp.bad) + " wrong; " + cmp.detail;
      });
}

#endif  // FMLP_TEST_WITH_CUDA

}  // namespace
}  // namespace fmlp_test
