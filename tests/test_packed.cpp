// Packed weights (fmlp_mlp_pack + fmlp_mlp_packed_run, and fmlp::PackedMlp) give the results of
// the unpacked call, for every backend that can run here.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.hpp"
#include "mlp_case.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

// Dense, stacked-gated and separate-gated weights, biases and norm parameters in mixed dtypes.
std::vector<MlpCase> packed_cases() {
  std::vector<MlpCase> v(4);
  v[0].m = 16, v[0].d_in = v[0].d_out = 64, v[0].hidden = 127;
  v[0].w_dtype = FMLP_DTYPE_BF16, v[0].b1 = FMLP_DTYPE_F16, v[0].b2 = FMLP_DTYPE_BF16;
  v[1].m = 3, v[1].d_in = v[1].d_out = 127, v[1].hidden = 64;
  v[1].gate = Gate::kStacked, v[1].act = FMLP_ACT_SILU;
  v[1].x_dtype = v[1].w_dtype = FMLP_DTYPE_BF16;
  v[1].b1 = FMLP_DTYPE_F32, v[1].b2 = FMLP_DTYPE_F16, v[1].residual = Residual::kInPlace;
  v[2].m = 100, v[2].d_in = 64, v[2].hidden = 7, v[2].d_out = 64;
  v[2].gate = Gate::kSeparate, v[2].act = FMLP_ACT_GELU_TANH;
  v[2].x_dtype = v[2].w_dtype = FMLP_DTYPE_F16;
  v[2].b1 = FMLP_DTYPE_BF16, v[2].b_up = FMLP_DTYPE_F32, v[2].b2 = FMLP_DTYPE_F32;
  v[2].norm = FMLP_NORM_LAYERNORM, v[2].gamma = FMLP_DTYPE_F16, v[2].beta = FMLP_DTYPE_BF16;
  v[2].residual = Residual::kSeparate, v[2].strided = v[2].misaligned = true;
  v[3].m = 5, v[3].d_in = v[3].d_out = 64, v[3].hidden = 127;
  v[3].gate = Gate::kSeparate, v[3].act = FMLP_ACT_RELU;
  v[3].w_dtype = FMLP_DTYPE_F8_E4M3, v[3].per_row_scale = true;
  v[3].b1 = FMLP_DTYPE_F16, v[3].b_up = FMLP_DTYPE_BF16, v[3].norm = FMLP_NORM_RMSNORM;
  v[3].gamma = FMLP_DTYPE_F32;
  for (size_t i = 0; i < v.size(); ++i) v[i].data_seed = mix_seed(test_seed(), i);
  return v;
}

class PackedTest : public ::testing::TestWithParam<fmlp_backend_t> {
 protected:
  void SetUp() override {
    backend_ = GetParam();
    device_ = backend_ == FMLP_BACKEND_CUDA;
    if (fmlp_backend_available(backend_) != FMLP_SUCCESS)
      GTEST_SKIP() << "backend " << fmlp_backend_name(backend_)
                   << " is not available here: " << fmlp_last_error();
    if (device_ && !device_unavailable_reason().empty())
      GTEST_SKIP() << device_unavailable_reason();
  }
  // Workspace for the unpacked call on this backend, or NOT_SUPPORTED when no kernel handles it.
  fmlp_status_t workspace(const PlacedCase& p, Buffer* ws) {
    size_t bytes = 0;
    const fmlp_status_t s = fmlp_mlp_workspace_size(&p.args(), backend_, &bytes);
    if (s == FMLP_SUCCESS && bytes > 0) {
      *ws = Buffer(bytes, device_);
      ws->init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
    }
    return s;
  }
  // Out vs the reference, and out vs the unpacked result, both under the suite's tolerance.
  void expect_close(const MlpCase& c, const PlacedCase& p, const Reference& ref,
                    const std::vector<double>& unpacked, const char* what) {
    std::string stray;
    const std::vector<double> out = p.download_y(&stray);
    EXPECT_TRUE(stray.empty()) << what << " [" << c.name() << "]: " << stray;
    const CompareOutcome vs_ref = compare(c, out, ref);
    EXPECT_TRUE(vs_ref.ok) << what << " vs reference [" << c.name() << "]: " << vs_ref.bad
                           << " wrong; " << vs_ref.detail << " (FMLP_TEST_SEED=" << test_seed()
                           << ")";
    const CompareOutcome vs_unpacked = compare(c, out, Reference{unpacked, ref.scale});
    EXPECT_TRUE(vs_unpacked.ok) << what << " vs unpacked [" << c.name() << "]: " << vs_unpacked.bad
                                << " wrong; " << vs_unpacked.detail;
  }
  fmlp_backend_t backend_ = FMLP_BACKEND_REF;
  bool device_ = false;
};

TEST_P(PackedTest, MatchesUnpacked) {
  int ran = 0;
  for (const MlpCase& c : packed_cases()) {
    PlacedCase p(c, device_);
    const CaseData data = make_data(c, c.data_seed);
    const Reference ref = reference(c, data);
    Buffer ws;
    const fmlp_status_t s = workspace(p, &ws);
    if (s == FMLP_ERROR_NOT_SUPPORTED) continue;
    ASSERT_EQ(s, FMLP_SUCCESS) << fmlp_last_error();
    p.upload(data);
    ASSERT_EQ(fmlp_mlp(&p.args(), backend_, ws.data(), ws.size(), nullptr), FMLP_SUCCESS)
        << "[" << c.name() << "]: " << fmlp_last_error();
    std::string stray;
    const std::vector<double> unpacked = p.download_y(&stray);

    fmlp_mlp_packed_t* packed = nullptr;
    ASSERT_EQ(fmlp_mlp_pack(&packed, &p.args().weights, &p.args().config, backend_, nullptr),
              FMLP_SUCCESS)
        << "[" << c.name() << "]: " << fmlp_last_error();
    size_t bytes = 0;
    ASSERT_EQ(fmlp_mlp_packed_workspace_size(packed, &p.args().y, &p.args().x, &bytes),
              FMLP_SUCCESS)
        << fmlp_last_error();
    Buffer pws;
    if (bytes > 0) {
      pws = Buffer(bytes, device_);
      pws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
    }
    p.upload(data);
    EXPECT_EQ(fmlp_mlp_packed_run(packed, &p.args().y, &p.args().x, &p.args().residual, pws.data(),
                                  bytes, nullptr),
              FMLP_SUCCESS)
        << "[" << c.name() << "]: " << fmlp_last_error();
    fmlp_mlp_packed_destroy(packed);
    expect_close(c, p, ref, unpacked, "fmlp_mlp_packed_run");
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no " << fmlp_backend_name(backend_) << " kernel handles the cases";
}

TEST_P(PackedTest, CppPackedMlpMatches) {
  int ran = 0;
  for (const MlpCase& c : packed_cases()) {
    PlacedCase p(c, device_);
    const CaseData data = make_data(c, c.data_seed);
    Buffer ws;
    if (workspace(p, &ws) == FMLP_ERROR_NOT_SUPPORTED) continue;
    p.upload(data);
    fmlp::mlp(p.args(), backend_, ws.data(), ws.size());
    std::string stray;
    const std::vector<double> unpacked = p.download_y(&stray);
    const fmlp::PackedMlp packed(p.args().weights, p.args().config, backend_);
    p.upload(data);
    if (device_) {
      Buffer pws(packed.workspace_size(p.args().y, p.args().x), true);
      pws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
      packed.run(p.args().y, p.args().x, &p.args().residual, pws.data(), pws.size());
    } else {
      packed.run(p.args().y, p.args().x, &p.args().residual);  // allocates its own workspace
    }
    expect_close(c, p, reference(c, data), unpacked, "fmlp::PackedMlp::run");
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no " << fmlp_backend_name(backend_) << " kernel handles the cases";
}

// fmlp_mlp_packed_explain names the entry that runs; on CUDA the planner's line says the pick was
// timed at pack time (and which bucket), and deterministic mode keeps the fixed rules, saying so;
// FMLP_PLAN_TUNE=0 in the environment keeps them too, and the report says that instead.
TEST_P(PackedTest, ExplainSaysWhatRunsAndWhy) {
  for (const bool deterministic : {false, true}) {
    MlpCase c;
    c.m = 3, c.d_in = c.d_out = 256, c.hidden = 512, c.gate = Gate::kStacked;
    c.act = FMLP_ACT_SILU, c.x_dtype = c.w_dtype = FMLP_DTYPE_BF16;
    c.deterministic = deterministic;
    PlacedCase p(c, device_);
    p.upload(make_data(c, mix_seed(test_seed(), 900)));
    const fmlp::PackedMlp packed(p.args().weights, p.args().config, backend_);
    const std::string report = packed.explain(p.args().y, p.args().x);
    EXPECT_NE(report.find("chosen "), std::string::npos) << report;
    EXPECT_NE(report.find("M=3 "), std::string::npos) << report;
    if (device_ && knob_value("FMLP_PLAN_TUNE") == "0") {
      EXPECT_NE(report.find("FMLP_PLAN_TUNE=0: fixed rules"), std::string::npos) << report;
    } else if (device_) {
      if (deterministic)
        EXPECT_NE(report.find("deterministic mode: fixed rules"), std::string::npos) << report;
      else
        EXPECT_NE(report.find("timed at pack time on cuda:0 for M <= 3: "), std::string::npos)
            << report;
    }
    size_t needed = 0;
    EXPECT_EQ(fmlp_mlp_packed_explain(nullptr, &p.args().y, &p.args().x, nullptr, 0, &needed),
              FMLP_ERROR_NULL_POINTER);
    EXPECT_EQ(fmlp_mlp_packed_explain(packed.get(), nullptr, &p.args().x, nullptr, 0, &needed),
              FMLP_ERROR_NULL_POINTER);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, PackedTest,
                         ::testing::Values(FMLP_BACKEND_REF, FMLP_BACKEND_CPU, FMLP_BACKEND_CUDA),
                         [](const ::testing::TestParamInfo<fmlp_backend_t>& info) {
                           return std::string(fmlp_backend_name(info.param));
                         });

}  // namespace
}  // namespace fmlp_test
