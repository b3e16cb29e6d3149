// Packed weights (fmlp_mlp_pack + fmlp_mlp_packed_run, and fmlp::PackedMlp) give the results of
// the unpacked call, for every backend that can run here.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
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

// The unpacked call's explain says what skipping the pack costs where the sizes keep the 16-byte
// weight streams out (CUDA: a note naming fmlp_mlp_pack); aligned sizes, the packed call's
// explain and the host backends carry no such note.
TEST_P(PackedTest, UnpackedExplainSaysPackingPadsOddSizes) {
  for (const bool odd : {true, false}) {
    MlpCase c;
    c.m = 1, c.d_in = odd ? 1001 : 1008, c.hidden = odd ? 769 : 776, c.d_out = 127;
    c.gate = Gate::kStacked, c.act = FMLP_ACT_SILU, c.x_dtype = c.w_dtype = FMLP_DTYPE_BF16;
    PlacedCase p(c, device_);
    p.upload(make_data(c, mix_seed(test_seed(), 950)));
    size_t need = 0;
    ASSERT_EQ(fmlp_mlp_explain(&p.args(), backend_, nullptr, 0, &need), FMLP_SUCCESS)
        << fmlp_last_error();
    std::string report(need, '\0');
    ASSERT_EQ(fmlp_mlp_explain(&p.args(), backend_, report.data(), report.size(), &need),
              FMLP_SUCCESS);
    const bool note =
        report.find("  note     unpacked weights: d_in 1001 and hidden 769") != std::string::npos &&
        report.find("fmlp_mlp_pack, fusedmlp.pack") != std::string::npos;
    EXPECT_EQ(note, device_ && odd) << report;
    const fmlp::PackedMlp packed(p.args().weights, p.args().config, backend_);
    const std::string packed_report = packed.explain(p.args().y, p.args().x);
    EXPECT_EQ(packed_report.find("unpacked weights"), std::string::npos) << packed_report;
  }
}

// Sizes that are not multiples of 8 or 16 (1, 7, 127, 769, 1001 and 8 * odd for fp8), dense and
// gated, M from 1 to 64, norms, misaligned and strided x, non-finite x: every entry of the
// backend that takes the packed call (fmlp_mlp_packed_with_kernel) matches the reference. Packing
// pads the weight rows with zeros, so on CUDA the 16-byte weight streams must take these shapes:
// the test fails if they decline one they are listed for.
std::vector<MlpCase> odd_cases() {
  std::vector<MlpCase> v(8);
  v[0].m = 1, v[0].d_in = 1001, v[0].hidden = 769, v[0].d_out = 127;
  v[0].x_dtype = v[0].w_dtype = FMLP_DTYPE_BF16, v[0].b1 = FMLP_DTYPE_F32,
  v[0].b2 = FMLP_DTYPE_BF16;
  v[1].m = 3, v[1].d_in = 127, v[1].hidden = 7, v[1].d_out = 1001;
  v[1].gate = Gate::kStacked, v[1].act = FMLP_ACT_SILU;
  v[1].x_dtype = v[1].w_dtype = FMLP_DTYPE_F16, v[1].norm = FMLP_NORM_LAYERNORM;
  v[1].gamma = FMLP_DTYPE_F16, v[1].beta = FMLP_DTYPE_F32, v[1].residual = Residual::kSeparate;
  v[1].nonfinite = true;
  v[2].m = 16, v[2].d_in = 769, v[2].hidden = 1001, v[2].d_out = 769;
  v[2].gate = Gate::kSeparate, v[2].act = FMLP_ACT_GELU_TANH, v[2].b_up = FMLP_DTYPE_BF16;
  v[2].x_dtype = v[2].w_dtype = FMLP_DTYPE_BF16, v[2].norm = FMLP_NORM_RMSNORM;
  v[2].gamma = FMLP_DTYPE_BF16, v[2].misaligned = v[2].strided = true;
  v[3].m = 33, v[3].d_in = 7, v[3].hidden = 127, v[3].d_out = 1, v[3].act = FMLP_ACT_RELU;
  v[3].x_dtype = v[3].w_dtype = FMLP_DTYPE_BF16, v[3].residual = Residual::kInPlace;
  v[4] = v[0], v[4].m = 64, v[4].nonfinite = true;
  v[5].m = 4, v[5].d_in = 1000, v[5].hidden = 776, v[5].d_out = 127;
  v[5].gate = Gate::kStacked, v[5].act = FMLP_ACT_SILU, v[5].x_dtype = FMLP_DTYPE_BF16;
  v[5].w_dtype = FMLP_DTYPE_F8_E4M3, v[5].per_row_scale = true, v[5].b1 = FMLP_DTYPE_F32;
  v[6].m = 2, v[6].d_in = 127, v[6].hidden = 769, v[6].d_out = 64, v[6].act = FMLP_ACT_GELU;
  v[6].x_dtype = FMLP_DTYPE_F16, v[6].w_dtype = FMLP_DTYPE_F8_E4M3, v[6].b2 = FMLP_DTYPE_F16;
  v[7].m = 7, v[7].d_in = 1, v[7].hidden = 1, v[7].d_out = 7;
  v[7].x_dtype = v[7].w_dtype = FMLP_DTYPE_F16, v[7].gate = Gate::kSeparate;
  for (size_t i = 0; i < v.size(); ++i) {
    normalize(&v[i]);
    v[i].data_seed = mix_seed(test_seed(), 1000 + i);
  }
  return v;
}

TEST_P(PackedTest, EveryEntryTakesOddSizesOnPackedWeights) {
  const std::vector<MlpCase> cases = odd_cases();
  // On CUDA, the cases (by index) each weight stream must take.
  const std::vector<std::pair<std::string, std::vector<size_t>>> must = {
      {"mlp_decode_sm80_stream", {0, 1, 5, 6}},
      {"mlp_decode_sm80_mma_streamk", {0, 1, 2, 3, 4, 5, 6, 7}}};
  int ran = 0;
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const MlpCase& c = cases[ci];
    PlacedCase p(c, device_);
    const CaseData data = make_data(c, c.data_seed);
    const Reference ref = reference(c, data);
    p.upload(data);
    fmlp_mlp_packed_t* packed = nullptr;
    ASSERT_EQ(fmlp_mlp_pack(&packed, &p.args().weights, &p.args().config, backend_, nullptr),
              FMLP_SUCCESS)
        << "[" << c.name() << "]: " << fmlp_last_error();
    for (int i = 0; i < fmlp_mlp_kernel_count(); ++i) {
      if (fmlp_mlp_kernel_backend(i) != backend_) continue;
      const std::string name = fmlp_mlp_kernel_name(i);
      size_t bytes = 0;
      const fmlp_status_t ws = fmlp_mlp_packed_kernel_workspace_size(
          packed, name.c_str(), &p.args().y, &p.args().x, &bytes);
      const std::string why = ws == FMLP_SUCCESS ? "" : fmlp_last_error();
      for (const auto& [entry, idx] : must)
        if (device_ && entry == name && std::find(idx.begin(), idx.end(), ci) != idx.end()) {
          EXPECT_EQ(ws, FMLP_SUCCESS) << name << " declines packed [" << c.name() << "]: " << why;
        }
      if (ws == FMLP_ERROR_NOT_SUPPORTED) continue;
      ASSERT_EQ(ws, FMLP_SUCCESS) << name << " [" << c.name() << "]: " << why;
      Buffer pws;
      if (bytes > 0) {
        pws = Buffer(bytes, device_);
        pws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
      }
      p.upload(data);  // y poisoned again
      ASSERT_EQ(fmlp_mlp_packed_with_kernel(packed, name.c_str(), &p.args().y, &p.args().x,
                                            &p.args().residual, pws.data(), bytes, nullptr),
                FMLP_SUCCESS)
          << name << " [" << c.name() << "]: " << fmlp_last_error();
      std::string stray;
      const std::vector<double> out = p.download_y(&stray);
      EXPECT_TRUE(stray.empty()) << name << " [" << c.name() << "]: " << stray;
      const CompareOutcome vs_ref = compare(c, out, ref);
      EXPECT_TRUE(vs_ref.ok) << name << " on packed [" << c.name() << "]: " << vs_ref.bad
                             << " wrong; " << vs_ref.detail << " (FMLP_TEST_SEED=" << test_seed()
                             << ")";
      ++ran;
    }
    fmlp_mlp_packed_destroy(packed);
  }
  EXPECT_GT(ran, 0);
}

// The named-entry calls on packed weights refuse what they cannot run, saying why.
TEST_P(PackedTest, NamedEntryErrors) {
  MlpCase c;
  c.m = 2, c.d_in = 16, c.hidden = 24, c.d_out = 8;
  PlacedCase p(c, device_);
  p.upload(make_data(c, mix_seed(test_seed(), 1100)));
  fmlp_mlp_packed_t* packed = nullptr;
  ASSERT_EQ(fmlp_mlp_pack(&packed, &p.args().weights, &p.args().config, backend_, nullptr),
            FMLP_SUCCESS)
      << fmlp_last_error();
  size_t bytes = 0;
  EXPECT_EQ(fmlp_mlp_packed_kernel_workspace_size(packed, "no_such_entry", &p.args().y, &p.args().x,
                                                  &bytes),
            FMLP_ERROR_INVALID_VALUE);
  EXPECT_NE(std::string(fmlp_last_error()).find("no_such_entry"), std::string::npos);
  EXPECT_EQ(
      fmlp_mlp_packed_kernel_workspace_size(packed, nullptr, &p.args().y, &p.args().x, &bytes),
      FMLP_ERROR_NULL_POINTER);
  EXPECT_EQ(fmlp_mlp_packed_kernel_workspace_size(packed, "mlp_ref_scalar_fp64", &p.args().y,
                                                  &p.args().x, nullptr),
            FMLP_ERROR_NULL_POINTER);
  EXPECT_EQ(fmlp_mlp_packed_with_kernel(nullptr, "mlp_ref_scalar_fp64", &p.args().y, &p.args().x,
                                        nullptr, nullptr, 0, nullptr),
            FMLP_ERROR_NULL_POINTER);
  // fp32 activations: the 16-bit streams decline, naming the dtype.
  if (device_) {
    EXPECT_EQ(fmlp_mlp_packed_kernel_workspace_size(packed, "mlp_decode_sm80_stream", &p.args().y,
                                                    &p.args().x, &bytes),
              FMLP_ERROR_NOT_SUPPORTED);
    EXPECT_NE(std::string(fmlp_last_error()).find("mlp_decode_sm80_stream"), std::string::npos);
  }
  fmlp_mlp_packed_destroy(packed);
}

INSTANTIATE_TEST_SUITE_P(Backends, PackedTest,
                         ::testing::Values(FMLP_BACKEND_REF, FMLP_BACKEND_CPU, FMLP_BACKEND_CUDA),
                         [](const ::testing::TestParamInfo<fmlp_backend_t>& info) {
                           return std::string(fmlp_backend_name(info.param));
                         });

}  // namespace
}  // namespace fmlp_test
