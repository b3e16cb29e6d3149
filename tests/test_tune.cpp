// The cuBLASLt tune table (fusedmlp.h, "cuBLASLt algorithm tuning"): its file is rejected with a
// message naming what did not parse, and the table is unchanged after a rejected load; begin/end
// pair up; and on a GPU, tuned calls give the op's results (in-place residual included: the
// candidates write a scratch output), the table round-trips through a file, and tuning refuses to
// run inside a graph capture. The file tests need a CUDA build (the table is cuBLASLt's), not a
// GPU.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "mlp_case.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "fmlp_tune_" + name + ".json";
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::trunc) << text;
}

// The "cublaslt_version" line of a file this library wrote, so crafted files match it.
std::string version_field() {
  const std::string path = temp_path("empty");
  fmlp_tune_clear();
  EXPECT_EQ(fmlp_tune_save(path.c_str()), FMLP_SUCCESS) << fmlp_last_error();
  const std::string text = read_file(path);
  const size_t at = text.find("\"cublaslt_version\"");
  EXPECT_NE(at, std::string::npos) << text;
  return text.substr(at, text.find_first_of(",\n}", at) - at);
}

std::string entry(const std::string& key, const std::string& algo, const std::string& ws,
                  const std::string& us) {
  return "{\"device\": \"NVIDIA Test GPU\", \"key\": " + key + ", \"algo\": " + algo +
         ", \"workspace\": " + ws + ", \"us\": " + us + "}";
}

std::string key_of(int n) {
  std::string k = "[";
  for (int i = 0; i < n; ++i) k += (i ? ", " : "") + std::to_string(i + 1);
  return k + "]";
}

const std::string kAlgo = "\"" + std::string(128, 'a') + "\"";

std::string file_with(const std::string& version, const std::string& entries) {
  return "{\"format\": \"fusedmlp-cublaslt-tune\", \"version\": 1, " + version +
         ", \"entries\": [" + entries + "]}";
}

#define SKIP_WITHOUT_TABLE()                                                          \
  do {                                                                                \
    if (fmlp_tune_save(temp_path("probe").c_str()) == FMLP_ERROR_BACKEND_UNAVAILABLE) \
      GTEST_SKIP() << fmlp_last_error();                                              \
  } while (0)

TEST(TuneFile, RoundTripsAnEntry) {
  SKIP_WITHOUT_TABLE();
  const std::string path = temp_path("one");
  write_file(path, file_with(version_field(), entry(key_of(19), kAlgo, "1024", "12.5")));
  ASSERT_EQ(fmlp_tune_load(path.c_str()), FMLP_SUCCESS) << fmlp_last_error();
  EXPECT_EQ(fmlp_tune_count(), 1u);
  const std::string again = temp_path("again");
  ASSERT_EQ(fmlp_tune_save(again.c_str()), FMLP_SUCCESS) << fmlp_last_error();
  fmlp_tune_clear();
  EXPECT_EQ(fmlp_tune_count(), 0u);
  ASSERT_EQ(fmlp_tune_load(again.c_str()), FMLP_SUCCESS) << fmlp_last_error();
  EXPECT_EQ(fmlp_tune_count(), 1u);
  const std::string text = read_file(again);
  EXPECT_NE(text.find("NVIDIA Test GPU"), std::string::npos) << text;
  EXPECT_NE(text.find(std::string(128, 'a')), std::string::npos) << text;
  fmlp_tune_clear();
}

TEST(TuneFile, CorruptFilesAreRejectedWithTheFieldAndLeaveTheTable) {
  SKIP_WITHOUT_TABLE();
  const std::string v = version_field();
  const std::string good = entry(key_of(19), kAlgo, "0", "1");
  struct Bad {
    std::string text, says;
  };
  const std::vector<Bad> bad = {
      {"{\"format\": ", "not valid JSON"},
      {"[1, 2]", "top level"},
      {"{\"format\": \"other\", \"version\": 1, " + v + ", \"entries\": []}", "\"format\""},
      {"{\"format\": \"fusedmlp-cublaslt-tune\", \"version\": 2, " + v + ", \"entries\": []}",
       "\"version\""},
      {"{\"format\": \"fusedmlp-cublaslt-tune\", \"version\": 1, \"entries\": []}",
       "cublaslt_version"},
      {"{\"format\": \"fusedmlp-cublaslt-tune\", \"version\": 1, " + v + ", \"entries\": 3}",
       "\"entries\""},
      {file_with(v, good + ", 7"), "entry 1 is not an object"},
      {file_with(v, entry(key_of(18), kAlgo, "0", "1")), "entry 0: \"key\""},
      {file_with(v, entry("[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, \"x\"]",
                          kAlgo, "0", "1")),
       "key element 18"},
      {file_with(v, entry(key_of(19), "\"abc\"", "0", "1")), "\"algo\""},
      {file_with(v, entry(key_of(19), "\"" + std::string(127, 'a') + "g\"", "0", "1")), "\"algo\""},
      {file_with(v, good + ", " + entry(key_of(19), kAlgo, "-5", "1")), "entry 1: \"workspace\""},
      {file_with(v, entry(key_of(19), kAlgo, "0", "-1")), "\"us\""},
      {file_with(v, entry(key_of(19), kAlgo, "0", "\"fast\"")), "\"us\""},
  };
  const std::string kept = temp_path("kept");
  write_file(kept, file_with(v, good));
  fmlp_tune_clear();
  ASSERT_EQ(fmlp_tune_load(kept.c_str()), FMLP_SUCCESS) << fmlp_last_error();
  for (size_t i = 0; i < bad.size(); ++i) {
    const std::string path = temp_path("bad" + std::to_string(i));
    write_file(path, bad[i].text);
    EXPECT_EQ(fmlp_tune_load(path.c_str()), FMLP_ERROR_CORRUPT_FILE) << bad[i].text;
    const std::string msg = fmlp_last_error();
    EXPECT_NE(msg.find(bad[i].says), std::string::npos) << "case " << i << ": " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("fusedmlp tune"), std::string::npos) << msg;
    EXPECT_EQ(fmlp_tune_count(), 1u) << "a rejected file changed the table (case " << i << ")";
  }
  fmlp_tune_clear();
}

TEST(TuneFile, OtherCuBlasLtVersionMissingFileAndNullPath) {
  SKIP_WITHOUT_TABLE();
  const std::string path = temp_path("other");
  write_file(path, file_with("\"cublaslt_version\": 1", ""));
  EXPECT_EQ(fmlp_tune_load(path.c_str()), FMLP_ERROR_NOT_SUPPORTED);
  EXPECT_NE(std::string(fmlp_last_error()).find("re-run `fusedmlp tune`"), std::string::npos)
      << fmlp_last_error();
  const std::string missing = temp_path("does_not_exist");
  std::remove(missing.c_str());
  EXPECT_EQ(fmlp_tune_load(missing.c_str()), FMLP_ERROR_INVALID_VALUE);
  EXPECT_NE(std::string(fmlp_last_error()).find("cannot read"), std::string::npos);
  EXPECT_EQ(fmlp_tune_load(nullptr), FMLP_ERROR_NULL_POINTER);
  EXPECT_EQ(fmlp_tune_save(nullptr), FMLP_ERROR_NULL_POINTER);
}

TEST(TuneScope, BeginAndEndPairUp) {
  EXPECT_EQ(fmlp_tune_begin(), FMLP_SUCCESS);
  EXPECT_EQ(fmlp_tune_begin(), FMLP_SUCCESS);
  EXPECT_EQ(fmlp_tune_end(), FMLP_SUCCESS);
  EXPECT_EQ(fmlp_tune_end(), FMLP_SUCCESS);
#ifdef FMLP_TEST_WITH_CUDA
  EXPECT_EQ(fmlp_tune_end(), FMLP_ERROR_INVALID_VALUE);
  EXPECT_NE(std::string(fmlp_last_error()).find("without a matching fmlp_tune_begin"),
            std::string::npos);
#endif
}

#ifdef FMLP_TEST_WITH_CUDA
// Prefill-sized gated and dense cases (the cuBLASLt path), one with the residual in place.
std::vector<MlpCase> tune_cases() {
  std::vector<MlpCase> v;
  for (int i = 0; i < 3; ++i) {
    MlpCase c;
    c.m = i == 0 ? 300 : 513, c.d_in = 256, c.hidden = i == 2 ? 1000 : 512, c.d_out = 264;
    c.x_dtype = c.w_dtype = i == 1 ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16;
    c.gate = i == 2 ? Gate::kDense : Gate::kStacked;
    c.act = i == 2 ? FMLP_ACT_GELU : FMLP_ACT_SILU;
    c.b2 = c.x_dtype;
    c.residual = i == 0 ? Residual::kInPlace : Residual::kSeparate;
    normalize(&c);
    v.push_back(c);
  }
  return v;
}

std::string run_and_check(const MlpCase& c, uint64_t salt, bool tuning) {
  PlacedCase p(c, /*device=*/true);
  const CaseData data = make_data(c, mix_seed(test_seed(), salt));
  p.upload(data);
  if (tuning) fmlp_tune_begin();
  const RunOutcome run = run_kernel(p, "mlp_prefill_sm90_cublaslt");
  if (tuning) fmlp_tune_end();
  if (run.status != FMLP_SUCCESS)
    return std::string(fmlp_status_name(run.status)) + ": " + run.error;
  std::string stray;
  const std::vector<double> out = p.download_y(&stray);
  if (!stray.empty()) return stray;
  const CompareOutcome cmp = compare(c, out, reference(c, data), /*gemm_composed=*/true);
  return cmp.ok ? std::string() : std::to_string(cmp.bad) + " outputs wrong; " + cmp.detail;
}

// Tuned calls compute the op (the in-place residual added once: no candidate wrote y), fill the
// table, and later untuned calls, on the table's algorithms, still match; so do calls after the
// table went through a file.
TEST(TuneCuda, TunedCallsMatchTheReferenceAndTheTableRoundTrips) {
  SKIP_WITHOUT_GPU();
  fmlp_tune_clear();
  uint64_t salt = 0;
  for (const MlpCase& c : tune_cases()) {
    EXPECT_EQ(run_and_check(c, ++salt, true), "") << "[" << c.name() << "] tuned";
    EXPECT_EQ(run_and_check(c, ++salt, false), "") << "[" << c.name() << "] after tuning";
  }
  const size_t n = fmlp_tune_count();
  EXPECT_GE(n, 2u) << "every case runs two cuBLASLt GEMMs";
  const std::string path = temp_path("gpu");
  ASSERT_EQ(fmlp_tune_save(path.c_str()), FMLP_SUCCESS) << fmlp_last_error();
  fmlp_tune_clear();
  ASSERT_EQ(fmlp_tune_load(path.c_str()), FMLP_SUCCESS) << fmlp_last_error();
  EXPECT_EQ(fmlp_tune_count(), n);
  for (const MlpCase& c : tune_cases())
    EXPECT_EQ(run_and_check(c, ++salt, false), "") << "[" << c.name() << "] loaded";
  fmlp_tune_clear();
}

// Timing needs a synchronised stream: inside a capture, tuning is refused with a reason.
TEST(TuneCuda, RefusedDuringCapture) {
  SKIP_WITHOUT_GPU();
  const MlpCase c = tune_cases()[1];
  PlacedCase p(c, true);
  p.upload(make_data(c, mix_seed(test_seed(), 99)));
  Buffer ws;
  ASSERT_EQ(run_kernel(p, "mlp_prefill_sm90_cublaslt", &ws).status, FMLP_SUCCESS);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  fmlp_tune_begin();
  const fmlp_status_t st =
      fmlp_mlp_with_kernel(&p.args(), "mlp_prefill_sm90_cublaslt", ws.data(), ws.size(), s);
  const std::string msg = fmlp_last_error();
  fmlp_tune_end();
  cudaGraph_t g = nullptr;
  cudaStreamEndCapture(s, &g);
  if (g) cudaGraphDestroy(g);
  cudaGetLastError();
  cudaStreamDestroy(s);
  EXPECT_EQ(st, FMLP_ERROR_INVALID_VALUE);
  EXPECT_NE(msg.find("tune before the capture"), std::string::npos) << msg;
}

// FMLP_TUNE_FILE (ctest entry tune_env_bad_file) naming a file that is not there: every cuBLASLt
// GEMM fails with that reason rather than running untuned in silence.
TEST(TuneEnv, BadFileFailsTheGemms) {
  const char* env = std::getenv("FMLP_TUNE_FILE");
  if (env == nullptr) GTEST_SKIP() << "runs with FMLP_TUNE_FILE set (ctest tune_env_bad_file)";
  SKIP_WITHOUT_GPU();
  const MlpCase c = tune_cases()[1];
  PlacedCase p(c, true);
  p.upload(make_data(c, mix_seed(test_seed(), 7)));
  const std::vector<unsigned char> before = p.y_bytes();
  const RunOutcome run = run_kernel(p, "mlp_prefill_sm90_cublaslt");
  EXPECT_EQ(run.status, FMLP_ERROR_INVALID_VALUE) << run.error;
  EXPECT_NE(run.error.find("FMLP_TUNE_FILE"), std::string::npos) << run.error;
  EXPECT_EQ(p.y_bytes(), before) << "y written on error";
}
#endif

}  // namespace
}  // namespace fmlp_test
