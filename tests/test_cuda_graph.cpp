// fmlp_mlp captured in a CUDA graph and replayed on fresh inputs matches the reference each time.
// Skips (with the library's reason) without a CUDA build or a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda_graph.hpp"
#include "mlp_case.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

TEST(CudaGraph, CaptureThenReplayOnNewInputsMatchesReference) {
  if (fmlp_backend_available(FMLP_BACKEND_CUDA) != FMLP_SUCCESS)
    GTEST_SKIP() << "cuda backend: " << fmlp_last_error();
#ifndef FMLP_TEST_WITH_CUDA
  GTEST_SKIP() << device_unavailable_reason();
#else
  std::vector<MlpCase> cases(5);
  cases[0].m = 16, cases[0].d_in = cases[0].d_out = 256, cases[0].hidden = 1024;
  cases[0].b1 = cases[0].b2 = FMLP_DTYPE_F32;
  cases[1].m = 5, cases[1].d_in = cases[1].d_out = 768, cases[1].hidden = 3072;
  cases[1].gate = Gate::kStacked, cases[1].act = FMLP_ACT_SILU;
  cases[1].x_dtype = cases[1].w_dtype = FMLP_DTYPE_BF16, cases[1].residual = Residual::kInPlace;
  cases[1].norm = FMLP_NORM_RMSNORM, cases[1].gamma = FMLP_DTYPE_BF16;
  cases[2].m = 100, cases[2].d_in = cases[2].d_out = 127, cases[2].hidden = 769;
  cases[2].gate = Gate::kSeparate, cases[2].x_dtype = cases[2].w_dtype = FMLP_DTYPE_F16;
  cases[2].misaligned = cases[2].strided = true, cases[2].residual = Residual::kSeparate;
  // Few tokens: the weight streams, two launches with programmatic dependent launch, captured
  // like any other launch.
  cases[3].m = 1, cases[3].d_in = cases[3].d_out = 1024, cases[3].hidden = 2816;
  cases[3].gate = Gate::kStacked, cases[3].act = FMLP_ACT_SILU, cases[3].b2 = FMLP_DTYPE_BF16;
  cases[3].x_dtype = cases[3].w_dtype = FMLP_DTYPE_BF16, cases[3].residual = Residual::kSeparate;
  cases[4].m = 3, cases[4].d_in = cases[4].d_out = 768, cases[4].hidden = 3072;
  cases[4].act = FMLP_ACT_GELU_TANH, cases[4].b1 = cases[4].b2 = FMLP_DTYPE_F16;
  cases[4].x_dtype = cases[4].w_dtype = FMLP_DTYPE_F16, cases[4].norm = FMLP_NORM_LAYERNORM;
  cases[4].gamma = FMLP_DTYPE_F16;
  int ran = 0;
  for (const MlpCase& c : cases) {
    PlacedCase p(c, /*device=*/true);
    size_t bytes = 0;
    const fmlp_status_t s = fmlp_mlp_workspace_size(&p.args(), FMLP_BACKEND_CUDA, &bytes);
    if (s == FMLP_ERROR_NOT_SUPPORTED) continue;
    ASSERT_EQ(s, FMLP_SUCCESS) << fmlp_last_error();
    Buffer ws;
    if (bytes > 0) {
      ws = Buffer(bytes, true);
      ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
    }
    p.upload(make_data(c, mix_seed(test_seed(), 0)));
    MlpGraph graph(p.args(), FMLP_BACKEND_CUDA, ws.data(), bytes);
    ASSERT_TRUE(graph.ready()) << "[" << c.name() << "]: " << fmlp_status_name(graph.status())
                               << ": " << graph.error();
    for (uint64_t replay = 1; replay <= 3; ++replay) {
      const CaseData data = make_data(c, mix_seed(test_seed(), replay));
      p.upload(data);
      ASSERT_TRUE(graph.replay()) << graph.error();
      std::string stray;
      const std::vector<double> out = p.download_y(&stray);
      EXPECT_TRUE(stray.empty()) << stray;
      const CompareOutcome cmp = compare(c, out, reference(c, data));
      EXPECT_TRUE(cmp.ok) << "replay " << replay << " [" << c.name() << "]: " << cmp.bad
                          << " wrong; " << cmp.detail << " (FMLP_TEST_SEED=" << test_seed() << ")";
    }
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no cuda kernel handles the graph cases";
#endif
}

}  // namespace
}  // namespace fmlp_test
