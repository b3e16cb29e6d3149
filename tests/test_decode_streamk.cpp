// mlp_decode_sm80_mma_streamk against the double reference where its partition has edges: every
// token count 1..64, layers with fewer iterations than blocks (every tile split between blocks)
// and with many per block (runs across tile boundaries), row counts that end inside a 16-row
// group, k tails inside a 32-column step, the stage kernel (pre-norms, misaligned or strided x),
// residuals and biases, NaN/Inf inputs; the workspace's zeroed part is left zero after every call
// (its scratch part handed over dirty), two
// runs are bitwise equal, and a CUDA graph replays on new inputs. The reference suite
// (test_mlp_vs_ref) runs the entry on its grid too. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "mlp_case.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

constexpr const char* kEntry = "mlp_decode_sm80_mma_streamk";

MlpCase base_case(int64_t m, int64_t d_in, int64_t hidden, int64_t d_out, Gate gate,
                  fmlp_dtype_t dt = FMLP_DTYPE_BF16) {
  MlpCase c;
  c.m = m, c.d_in = d_in, c.hidden = hidden, c.d_out = d_out, c.gate = gate;
  c.act = gate == Gate::kDense ? FMLP_ACT_GELU_TANH : FMLP_ACT_SILU;
  c.x_dtype = c.w_dtype = dt;
  return c;
}

// Runs the entry on c (fresh data of `seed`), checks it against the reference, that nothing
// outside y was written and that the workspace's zeroed part is zero again (its scratch starts
// dirty: the entry must not read what it did not write); returns y's bytes.
std::vector<unsigned char> run_checked(MlpCase c, uint64_t seed) {
  normalize(&c);
  PlacedCase p(c, /*device=*/true);
  const fmlp_status_t sup = fmlp_mlp_kernel_supports(&p.args(), kEntry);
  EXPECT_EQ(sup, FMLP_SUCCESS) << "[" << c.name() << "]: " << fmlp_last_error();
  if (sup != FMLP_SUCCESS) return {};
  const CaseData data = make_data(c, mix_seed(test_seed(), seed));
  p.upload(data);
  Buffer ws;
  const RunOutcome run = run_kernel(p, kEntry, &ws);
  EXPECT_EQ(run.status, FMLP_SUCCESS) << "[" << c.name() << "]: " << run.error;
  if (run.status != FMLP_SUCCESS) return {};
  std::string stray;
  const std::vector<double> out = p.download_y(&stray);
  EXPECT_TRUE(stray.empty()) << "[" << c.name() << "]: " << stray;
  const std::vector<unsigned char> left = ws.download();
  const size_t nz = first_nonzero_in_zeroed_part(left);
  EXPECT_EQ(nz, left.size()) << "[" << c.name() << "]: workspace byte " << nz << " of "
                             << left.size() << " left nonzero in the zeroed part";
  const CompareOutcome cmp = compare(c, out, reference(c, data));
  EXPECT_TRUE(cmp.ok) << "[" << c.name() << "]: " << cmp.bad << " of " << out.size()
                      << " outputs wrong; " << cmp.detail << " (FMLP_TEST_SEED=" << test_seed()
                      << ")";
  return p.y_bytes();
}

TEST(DecodeStreamK, EveryTokenCount) {
  SKIP_WITHOUT_GPU();
  for (int64_t m = 1; m <= 64; ++m) {
    MlpCase c = base_case(m, 256, 1024, 256, m % 2 ? Gate::kStacked : Gate::kDense,
                          m % 3 ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F16);
    if (c.gate == Gate::kDense) c.b1 = c.b2 = FMLP_DTYPE_BF16;
    run_checked(c, uint64_t(m));
  }
}

TEST(DecodeStreamK, PartitionEdges) {
  SKIP_WITHOUT_GPU();
  std::vector<MlpCase> cases = {
      base_case(33, 64, 64, 8, Gate::kDense),           // one tile, few iterations
      base_case(7, 776, 776, 776, Gate::kStacked),      // k tails (776 = 24 * 32 + 8)
      base_case(17, 1024, 8200, 4104, Gate::kDense),    // rows end inside 16-row groups
      base_case(64, 2048, 8192, 2048, Gate::kStacked),  // many iterations per block
      base_case(40, 1536, 6144, 1000, Gate::kSeparate),
      base_case(2, 4096, 3000, 4096, Gate::kStacked),  // hidden a multiple of 8, not of 16
  };
  cases[2].act = FMLP_ACT_GELU, cases[2].b1 = cases[2].b2 = FMLP_DTYPE_F32;
  cases[4].act = FMLP_ACT_RELU, cases[4].b1 = cases[4].b_up = FMLP_DTYPE_BF16;
  for (size_t i = 0; i < cases.size(); ++i) run_checked(cases[i], 100 + i);
}

TEST(DecodeStreamK, NormsLayoutsResiduals) {
  SKIP_WITHOUT_GPU();
  int i = 0;
  for (fmlp_norm_t norm : {FMLP_NORM_NONE, FMLP_NORM_RMSNORM, FMLP_NORM_LAYERNORM})
    for (Residual r : {Residual::kNone, Residual::kSeparate, Residual::kInPlace})
      for (int layout = 0; layout < 3; ++layout) {
        MlpCase c = base_case(i % 2 ? 5 : 40, 512, 1536, 512, Gate::kStacked);
        c.norm = norm;
        c.gamma = norm == FMLP_NORM_NONE ? kAbsent : FMLP_DTYPE_BF16;
        c.beta = norm == FMLP_NORM_LAYERNORM ? FMLP_DTYPE_F32 : kAbsent;
        c.residual = r;
        c.misaligned = layout == 1;  // x rows not 16-byte aligned: through the stage kernel
        c.strided = layout == 2;
        c.packed_weights = layout != 0;  // the entry needs 16-byte aligned weight rows
        run_checked(c, 200 + uint64_t(i++));
      }
}

TEST(DecodeStreamK, NonFinite) {
  SKIP_WITHOUT_GPU();
  for (fmlp_activation_t act : {FMLP_ACT_RELU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH, FMLP_ACT_SILU}) {
    MlpCase c = base_case(9, 256, 768, 256, act == FMLP_ACT_SILU ? Gate::kStacked : Gate::kDense);
    c.act = act;
    c.nonfinite = true;
    run_checked(c, 300 + uint64_t(act));
  }
}

// e4m3 weights (weight-only): scales per row and per tensor, every finite code, NaN codes in W2,
// bf16 and fp16 activations, k tails inside a 64-column step.
TEST(DecodeStreamK, Fp8Weights) {
  SKIP_WITHOUT_GPU();
  int i = 0;
  for (int64_t m : {1, 7, 33, 64})
    for (int variant = 0; variant < 4; ++variant) {
      MlpCase c = base_case(m, variant == 3 ? 784 : 512, variant == 2 ? 1552 : 2048, 512,
                            variant % 2 ? Gate::kDense : Gate::kStacked,
                            variant < 2 ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F16);
      c.w_dtype = FMLP_DTYPE_F8_E4M3;
      c.per_row_scale = variant != 1;
      c.fp8_all_codes = variant == 0 || variant == 3;
      c.nan_weights = variant == 2;
      if (c.gate == Gate::kDense) c.b1 = c.b2 = FMLP_DTYPE_BF16;
      if (variant == 3) c.norm = FMLP_NORM_RMSNORM, c.gamma = FMLP_DTYPE_BF16;
      run_checked(c, 600 + uint64_t(i++));
    }
}

TEST(DecodeStreamK, RunsAreBitwiseEqual) {
  SKIP_WITHOUT_GPU();
  MlpCase c = base_case(48, 1024, 4096, 1024, Gate::kStacked);
  c.deterministic = true;
  const std::vector<unsigned char> a = run_checked(c, 400), b = run_checked(c, 400);
  EXPECT_TRUE(!a.empty() && a == b) << "two runs on the same input differ";
}

TEST(DecodeStreamK, GraphReplaysOnNewInputs) {
  SKIP_WITHOUT_GPU();
#ifdef FMLP_TEST_WITH_CUDA
  MlpCase c = base_case(24, 768, 3072, 768, Gate::kStacked);
  c.norm = FMLP_NORM_RMSNORM, c.gamma = FMLP_DTYPE_BF16, c.residual = Residual::kInPlace;
  normalize(&c);
  PlacedCase p(c, true);
  size_t bytes = 0;
  ASSERT_EQ(fmlp_mlp_kernel_workspace_size(&p.args(), kEntry, &bytes), FMLP_SUCCESS)
      << fmlp_last_error();
  Buffer ws(bytes, true);
  ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
  p.upload(make_data(c, mix_seed(test_seed(), 500)));
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const fmlp_status_t st = fmlp_mlp_with_kernel(&p.args(), kEntry, ws.data(), bytes, s);
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  ASSERT_EQ(st, FMLP_SUCCESS) << fmlp_last_error();
  cudaGraphExec_t ge = nullptr;
  ASSERT_EQ(cudaGraphInstantiateWithFlags(&ge, g, 0), cudaSuccess);
  for (uint64_t replay = 1; replay <= 3; ++replay) {
    const CaseData data = make_data(c, mix_seed(test_seed(), 500 + replay));
    p.upload(data);
    ASSERT_EQ(cudaGraphLaunch(ge, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    std::string stray;
    const CompareOutcome cmp = compare(c, p.download_y(&stray), reference(c, data));
    EXPECT_TRUE(cmp.ok && stray.empty()) << "replay " << replay << ": " << cmp.detail << stray;
  }
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
#endif
}

}  // namespace
}  // namespace fmlp_test
