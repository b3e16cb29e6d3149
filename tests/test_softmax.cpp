// Every softmax op-table entry against an fp64 reference computed here, plus bad input.
// Tolerance per element (relative, like tests/tolerance.hpp's dtypes: f32 1e-4, f16 2^-9,
// bf16 2^-7): softmax |out - ref| <= rtol * |ref| * (1 + |z - max|) + atol, log_softmax
// |out - ref| <= rtol * (1 + |z - max| + |log sum|); the |z - max| terms budget the fp32 rounding
// of the exponent argument, which grows with it. Non-finite refs must be matched in class.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "op_tensor.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

struct SmCase {
  int64_t rows = 1, n = 7;
  fmlp_dtype_t t = FMLP_DTYPE_F32;
  float temperature = 1.f;
  bool log = false, misaligned = false, strided = false, nonfinite = false, in_place = false;
  std::string name() const {
    return std::string(log ? "log_softmax" : "softmax") + " rows=" + std::to_string(rows) +
           " n=" + std::to_string(n) + " " + fmlp_dtype_name(t) +
           " T=" + std::to_string(temperature) + (misaligned ? " misaligned" : "") +
           (strided ? " strided" : "") + (nonfinite ? " nonfinite" : "") +
           (in_place ? " in-place" : "");
  }
};

// How run_case calls the kernel: directly or captured in a CUDA graph (replayed after the input
// is refreshed); `y_bytes` receives y's buffer.
// Runs one case through `kernel`; returns "", the failure, or kSkipped + why when the kernel
// does not take the case.
std::string run_case(const SmCase& c, const char* kernel, bool device, uint64_t seed,
                     RunMode mode = {}) {
  Rng rng(seed);
  std::normal_distribution<double> nd(0.0, 3.0);
  HostMatrix x;
  x.dtype = c.t, x.rows = c.rows, x.cols = c.n;
  x.bytes.resize(size_t(c.rows * c.n) * fmlp::dtype_size(c.t));
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t i = 0; i < c.n; ++i) x.set(r, i, nd(rng));
  const double inf = std::numeric_limits<double>::infinity();
  // row 0: NaN; 1: +Inf; 2: all -Inf; 3: some -Inf; 4: its first three quarters -Inf (masked
  // logits: in long rows whole chunks and parts of -Inf, whose partial sums must add 0, not NaN)
  if (c.nonfinite) {
    for (int64_t r = 0; r < std::min<int64_t>(c.rows, 5); ++r) {
      const int64_t at = int64_t(rng() % uint64_t(c.n));
      if (r == 0) x.set(r, at, NAN);
      if (r == 1) x.set(r, at, inf);
      if (r == 2)
        for (int64_t i = 0; i < c.n; ++i) x.set(r, i, -inf);
      if (r == 3) x.set(r, at, -inf), x.set(r, (at + 1) % c.n, -inf);
      if (r == 4)
        for (int64_t i = 0; i < c.n * 3 / 4; ++i) x.set(r, i, -inf);
    }
  }
  PlacedTensor px(c.t, c.rows, c.n, device, c.misaligned, c.strided);
  PlacedTensor py(c.t, c.rows, c.n, device, c.misaligned, c.strided);
  HostMatrix stale = x;  // what a captured graph finds before its input is refreshed
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t i = 0; i < c.n; ++i) stale.set(r, i, nd(rng));
  px.upload(mode.graph ? stale : x);
  fmlp_softmax_args_t a{c.in_place ? px.view() : py.view(), px.view(), c.temperature,
                        c.log ? 1 : 0};
  if (fmlp_softmax_kernel_supports(&a, kernel) != FMLP_SUCCESS)
    return std::string(kSkipped) + fmlp_last_error();
  size_t bytes = 0;
  if (fmlp_softmax_kernel_workspace_size(&a, kernel, &bytes) != FMLP_SUCCESS)
    return fmlp_last_error();
  Buffer ws(bytes, device);
  ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
  auto call = [&](void* stream) {
    return fmlp_softmax_with_kernel(&a, kernel, bytes ? ws.data() : nullptr, bytes, stream);
  };
  if (mode.graph) {
    // Graph cases are never in place: every replay would consume its own input.
    const std::string err = capture_and_replay(call, [&] { px.upload(x); });
    if (!err.empty()) return err;
  } else if (const fmlp_status_t st = call(nullptr); st != FMLP_SUCCESS) {
    return std::string(fmlp_status_name(st)) + ": " + fmlp_last_error();
  }
  if (mode.y_bytes) *mode.y_bytes = (c.in_place ? px : py).raw();
  std::string stray;
  const std::vector<double> out = (c.in_place ? px : py).download(&stray);
  if (!stray.empty()) return stray;
  if (device)
    for (unsigned char v : ws.download())
      if (v != 0) return "the workspace was not left zero-filled";
  const double rtol = dtype_rtol(c.t), t = c.temperature;
  int bad = 0;
  std::string first;
  for (int64_t r = 0; r < c.rows; ++r) {
    double m = -inf;
    bool nan = false;
    for (int64_t i = 0; i < c.n; ++i) {
      const double v = x.get(r, i);
      nan |= std::isnan(v);
      m = std::max(m, v);
    }
    double s = 0.0;
    for (int64_t i = 0; i < c.n; ++i) s += std::exp((x.get(r, i) - m) / t);
    if (nan) s = NAN;
    for (int64_t i = 0; i < c.n; ++i) {
      const double z = (x.get(r, i) - m) / t;
      const double ref = c.log ? z - std::log(s) : std::exp(z) / s;
      const double o = out[size_t(r * c.n + i)];
      const double expected = round_to_dtype(ref, c.t);
      bool ok;
      if (std::isnan(expected))
        ok = std::isnan(o);
      else if (std::isinf(z))  // a -Inf input of a finite row: exactly 0 (log: -Inf)
        ok = o == expected;
      else if (std::isinf(expected))
        ok = o == expected;
      else {
        const double tol = c.log ? rtol * (1.0 + std::fabs(z) + std::fabs(std::log(s)))
                                 : rtol * std::fabs(ref) * (1.0 + std::fabs(z)) + dtype_atol(c.t);
        ok = std::isfinite(o) && std::fabs(o - ref) <= tol;
      }
      if (!ok && bad++ == 0)
        first = "y[" + std::to_string(r) + "][" + std::to_string(i) + "] = " + std::to_string(o) +
                ", ref " + std::to_string(ref);
    }
  }
  return bad ? std::to_string(bad) + " wrong outputs; first " + first : "";
}

std::vector<SmCase> cases() {
  std::vector<SmCase> v;
  Rng rng(mix_seed(test_seed(), 99));
  const fmlp_dtype_t ts[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16};
  for (int64_t n : {1, 7, 127, 769, 4096, 8200, 128256})
    for (int64_t rows : {1, 3, 300}) {
      if (rows * n > 4'000'000) continue;
      SmCase c;
      c.rows = rows, c.n = n;
      c.t = ts[rng() % 3];
      c.log = rng() % 2;
      c.temperature = rng() % 3 == 0 ? 0.7f : 1.f;
      c.misaligned = rng() % 3 == 0;
      c.strided = rng() % 3 == 0;
      c.nonfinite = rows >= 4 || rng() % 2;
      c.in_place = rng() % 4 == 0;
      v.push_back(c);
    }
  for (fmlp_dtype_t t : ts)
    for (bool log : {false, true}) {
      SmCase c;  // one long row, split over many blocks on the GPU
      c.rows = 1, c.n = 1 << 20, c.t = t, c.log = log, c.temperature = 2.f;
      v.push_back(c);
      c.rows = 5, c.n = 128256, c.nonfinite = true, c.temperature = 1.f;
      v.push_back(c);
      c.rows = 600, c.n = 1000, c.nonfinite = false, c.misaligned = true;
      v.push_back(c);
    }
  // More 160 KB rows than an H200 holds clusters of their eight blocks at once, so the cluster
  // entry's rows run in several waves (a kernel whose resident clusters loop over rows would carry
  // its part buffers from row to row: this case is the one to break it); fp32 softmax and bf16
  // log_softmax in place.
  for (fmlp_dtype_t t : {FMLP_DTYPE_F32, FMLP_DTYPE_BF16}) {
    SmCase c;
    c.rows = 300, c.n = t == FMLP_DTYPE_F32 ? 40000 : 80000, c.t = t;
    c.log = c.in_place = t == FMLP_DTYPE_BF16;
    c.nonfinite = true;
    v.push_back(c);
  }
  // Rows of 16-32 KB, more of them than twice the multiprocessors: the cluster entry runs
  // clusters of one block, which exchange nothing (st.async needs two blocks or more).
  for (fmlp_dtype_t t : {FMLP_DTYPE_BF16, FMLP_DTYPE_F32}) {
    SmCase c;
    c.rows = 300, c.n = t == FMLP_DTYPE_F32 ? 7000 : 8200, c.t = t;
    c.log = t == FMLP_DTYPE_F32;
    c.nonfinite = true;
    v.push_back(c);
  }
  // 513 KB fp32 rows, enough of them for clusters of eight 64 KB parts whose blocks prefetch the
  // parts of later blocks into L2 (48 rows: 384 blocks, more than 30 % of those resident ahead).
  {
    SmCase c;
    c.rows = 48, c.n = 128256, c.t = FMLP_DTYPE_F32, c.nonfinite = true;
    v.push_back(c);
  }
  // Rows of 16-byte vectors up to 4 KB, the warp-per-row entry's (softmax_sm80_warp_rows): one
  // vector a row, a lane round left partial, exactly 4 KB in fp32 and in bf16; non-finite rows,
  // both outputs, a temperature, strided views, in place.
  const std::pair<int64_t, fmlp_dtype_t> short_rows[] = {{8, FMLP_DTYPE_BF16},
                                                         {200, FMLP_DTYPE_F32},
                                                         {1000, FMLP_DTYPE_F16},
                                                         {1024, FMLP_DTYPE_F32},
                                                         {2048, FMLP_DTYPE_BF16}};
  int q = 0;
  for (const auto& [n, t] : short_rows)
    for (bool log : {false, true}) {
      SmCase c;
      c.rows = 261, c.n = n, c.t = t, c.log = log, c.nonfinite = true;
      c.temperature = log ? 0.7f : 1.f;
      c.strided = q % 3 == 1;
      c.in_place = q % 4 == 3;
      ++q;
      v.push_back(c);
    }
  return v;
}

using SoftmaxKernelTest =
    OpKernelTest<fmlp_softmax_kernel_count, fmlp_softmax_kernel_name, fmlp_softmax_kernel_backend>;

// Every entry but the general ones takes a subset of the cases; each must take some.
TEST_P(SoftmaxKernelTest, MatchesReference) {
  int i = 0, ran = 0;
  for (const SmCase& c : cases()) {
    const std::string err = run_case(c, kernel_, device_, mix_seed(test_seed(), uint64_t(++i)));
    if (skipped(err)) continue;
    ++ran;
    EXPECT_TRUE(err.empty()) << "[" << c.name() << "] (FMLP_TEST_SEED=" << test_seed()
                             << "): " << err;
  }
  EXPECT_GT(ran, 0) << kernel_ << " took none of the cases";
}

// Captured in a CUDA graph and replayed on a refreshed input (one long row split over blocks,
// a few long rows, many rows): the replays must read the new input and leave the workspace
// zero-filled.
TEST_P(SoftmaxKernelTest, GraphReplayMatchesReference) {
  if (!device_) GTEST_SKIP() << "device kernels only";
  std::vector<SmCase> v(5);
  v[0].rows = 1, v[0].n = 128256, v[0].log = true;
  v[1].rows = 3, v[1].n = 8200, v[1].t = FMLP_DTYPE_BF16, v[1].temperature = 0.7f;
  v[1].misaligned = true;
  v[2].rows = 300, v[2].n = 769, v[2].t = FMLP_DTYPE_F16;
  v[3].rows = 5, v[3].n = 32000, v[3].strided = true;
  v[4].rows = 97, v[4].n = 1024, v[4].log = true;  // rows of 4 KB: one warp each
  int ran = 0, i = 0;
  for (const SmCase& c : v) {
    RunMode mode;
    mode.graph = true;
    const std::string err = run_case(c, kernel_, true, mix_seed(test_seed(), uint64_t(++i)), mode);
    if (skipped(err)) continue;
    ++ran;
    EXPECT_TRUE(err.empty()) << "[" << c.name() << "] (FMLP_TEST_SEED=" << test_seed()
                             << "): " << err;
  }
  EXPECT_GT(ran, 0) << kernel_ << " took none of the cases";
}

// Host kernels give the same bits whatever the thread count.
TEST_P(SoftmaxKernelTest, ThreadCountIndependent) {
  if (device_) GTEST_SKIP() << "host kernels only";
  std::vector<SmCase> v(3);
  v[0].rows = 1, v[0].n = 128256;
  v[1].rows = 300, v[1].n = 769, v[1].t = FMLP_DTYPE_BF16, v[1].log = true;
  v[2].rows = 3, v[2].n = 8200, v[2].t = FMLP_DTYPE_F16, v[2].temperature = 0.7f;
  expect_thread_count_independent(v, [&](const SmCase& c, const RunMode& mode) {
    return run_case(c, kernel_, false, mix_seed(test_seed(), 77), mode);
  });
}

INSTANTIATE_TEST_SUITE_P(Kernels, SoftmaxKernelTest,
                         ::testing::ValuesIn(SoftmaxKernelTest::indices()),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(fmlp_softmax_kernel_name(info.param));
                         });

struct BadSoftmax {
  alignas(64) float x[16], y[16];
  fmlp_softmax_args_t a{};
  BadSoftmax() {
    std::fill(std::begin(x), std::end(x), 0.5f);
    std::memset(y, 0x5A, sizeof y);
    a.x = fmlp_tensor_2d(x, FMLP_DTYPE_F32, 2, 4, 4);
    a.y = fmlp_tensor_2d(y, FMLP_DTYPE_F32, 2, 4, 4);
    a.temperature = 1.f;
  }
};

void expect_rejected(BadSoftmax& f, fmlp_status_t status, const std::string& words) {
  unsigned char before[sizeof f.y];
  std::memcpy(before, f.y, sizeof f.y);
  size_t bytes = 0;
  EXPECT_EQ(fmlp_softmax_workspace_size(&f.a, FMLP_BACKEND_REF, &bytes), status);
  EXPECT_EQ(fmlp_softmax(&f.a, FMLP_BACKEND_REF, nullptr, 0, nullptr), status);
  EXPECT_NE(std::string(fmlp_last_error()).find(words), std::string::npos) << fmlp_last_error();
  EXPECT_EQ(std::memcmp(before, f.y, sizeof f.y), 0) << "y was written";
}

TEST(SoftmaxBadInput, Rejected) {
  {
    BadSoftmax f;
    ASSERT_EQ(fmlp_softmax(&f.a, FMLP_BACKEND_REF, nullptr, 0, nullptr), FMLP_SUCCESS);
    EXPECT_FLOAT_EQ(f.y[0], 0.25f);
  }
  EXPECT_EQ(fmlp_softmax(nullptr, FMLP_BACKEND_REF, nullptr, 0, nullptr), FMLP_ERROR_NULL_POINTER);
  BadSoftmax f;
  f.a.x.data = nullptr;
  expect_rejected(f, FMLP_ERROR_NULL_POINTER, "x.data is NULL");
  for (float t : {0.f, -1.f, NAN, INFINITY}) {
    BadSoftmax g;
    g.a.temperature = t;
    expect_rejected(g, FMLP_ERROR_INVALID_VALUE, "temperature");
  }
  BadSoftmax h;
  h.a.log = 2;
  expect_rejected(h, FMLP_ERROR_INVALID_VALUE, "log is 2");
  BadSoftmax i;
  i.a.y = fmlp_tensor_2d(i.y, FMLP_DTYPE_F32, 2, 3, 3);
  expect_rejected(i, FMLP_ERROR_SHAPE_MISMATCH, "y must have shape");
  BadSoftmax j;
  j.a.y.dtype = FMLP_DTYPE_F16;
  expect_rejected(j, FMLP_ERROR_DTYPE_MISMATCH, "y is f16 but x is f32");
  BadSoftmax k;
  k.a.y.device_type = FMLP_DEVICE_CUDA;
  expect_rejected(k, FMLP_ERROR_DEVICE_MISMATCH, "y is on cuda:0 but x is on cpu");
  BadSoftmax l;
  l.a.y = fmlp_tensor_2d(l.x + 1, FMLP_DTYPE_F32, 2, 4, 4);
  expect_rejected(l, FMLP_ERROR_ALIASING, "y overlaps x");
}

TEST(SoftmaxSemantics, PlusInfRowIsNaNLikeTorch) {
  float x[2] = {INFINITY, 1.f}, y[2] = {0.f, 0.f};
  fmlp_softmax_args_t a{fmlp_tensor_1d(y, FMLP_DTYPE_F32, 2), fmlp_tensor_1d(x, FMLP_DTYPE_F32, 2),
                        1.f, 0};
  for (fmlp_backend_t b : {FMLP_BACKEND_REF, FMLP_BACKEND_CPU}) {
    if (fmlp_backend_available(b) != FMLP_SUCCESS) continue;
    y[0] = y[1] = 0.f;
    size_t bytes = 0;
    ASSERT_EQ(fmlp_softmax_workspace_size(&a, b, &bytes), FMLP_SUCCESS);
    std::vector<unsigned char> ws(bytes);
    ASSERT_EQ(fmlp_softmax(&a, b, ws.data(), bytes, nullptr), FMLP_SUCCESS) << fmlp_last_error();
    EXPECT_TRUE(std::isnan(y[0]) && std::isnan(y[1])) << fmlp_backend_name(b);
  }
}

// softmax_sm80_warp_rows takes rows of whole 16-byte vectors up to 4 KB and declines the others
// with a reason naming the entry that takes them (unless FMLP_SOFTMAX_WARP_ROWS=0 turns it off).
TEST(SoftmaxWarpRows, TakesShortRowsAndSaysWhyItDeclines) {
  if (fmlp_backend_available(FMLP_BACKEND_CUDA) != FMLP_SUCCESS)
    GTEST_SKIP() << "cuda backend unavailable: " << fmlp_last_error();
  if (!device_unavailable_reason().empty()) GTEST_SKIP() << device_unavailable_reason();
  constexpr const char* kWarpRows = "softmax_sm80_warp_rows";
  SmCase edge;  // exactly 4 KB
  edge.rows = 33, edge.n = 1024;
  const std::string ran = run_case(edge, kWarpRows, true, mix_seed(test_seed(), 501));
  if (skipped(ran) && ran.find("FMLP_SOFTMAX_WARP_ROWS=0") != std::string::npos)
    GTEST_SKIP() << ran;
  EXPECT_EQ(ran, "") << edge.name();
  SmCase longer = edge, odd = edge;
  longer.n = 1028;  // 4112 bytes
  odd.n = 7;        // 28 bytes: not whole vectors
  for (const auto& [c, words] :
       {std::pair<SmCase, const char*>{longer, "up to 4096 bytes"}, {odd, "16-byte vectors"}}) {
    const std::string err = run_case(c, kWarpRows, true, mix_seed(test_seed(), 502));
    EXPECT_TRUE(skipped(err)) << c.name() << ": " << err;
    EXPECT_NE(err.find(words), std::string::npos) << err;
  }
}

// softmax_sm80_ticket on the shapes of its targets and its corner cases; its op-table instance
// above also runs the shared cases. Each of these shapes must be taken (unless
// FMLP_SOFTMAX_TICKET=0 turns the entry off). The two longest rows have more parts than the grid
// has blocks, so blocks hold several parts of one row (the "extra" parts, re-read at the end).
constexpr const char* kTicket = "softmax_sm80_ticket";

class SoftmaxTicket : public ::testing::Test {
 protected:
  void SetUp() override {
    if (fmlp_backend_available(FMLP_BACKEND_CUDA) != FMLP_SUCCESS)
      GTEST_SKIP() << "cuda backend unavailable: " << fmlp_last_error();
    if (!device_unavailable_reason().empty()) GTEST_SKIP() << device_unavailable_reason();
  }
  // "" when the case ran and matched; a skip (entry off) or failure otherwise.
  static void check(const SmCase& c, uint64_t seed, RunMode mode = {}) {
    const std::string err = run_case(c, kTicket, true, mix_seed(test_seed(), seed), mode);
    if (skipped(err) && err.find("FMLP_SOFTMAX_TICKET=0") != std::string::npos) GTEST_SKIP() << err;
    EXPECT_TRUE(err.empty()) << "[" << c.name() << "] (FMLP_TEST_SEED=" << test_seed()
                             << "): " << err;
  }
};

SmCase sm_case(int64_t rows, int64_t n, fmlp_dtype_t t = FMLP_DTYPE_F32) {
  SmCase c;
  c.rows = rows, c.n = n, c.t = t;
  return c;
}

TEST_F(SoftmaxTicket, MatchesReference) {
  std::vector<SmCase> v;
  v.push_back(sm_case(1, 128256));
  v.push_back(sm_case(1, 128256)), v.back().log = true;
  v.push_back(sm_case(1, 1000003)), v.back().temperature = 2.f;
  v.push_back(sm_case(3, 100003)), v.back().log = true, v.back().temperature = 0.7f;
  v.push_back(sm_case(4, 128256));
  v.push_back(sm_case(2, 128256)), v.back().in_place = true;
  v.push_back(sm_case(4, 100003)), v.back().nonfinite = true;  // NaN, +Inf, all -Inf, some -Inf
  v.push_back(sm_case(4, 128256, FMLP_DTYPE_BF16)), v.back().log = true;
  v.push_back(sm_case(3, 65537, FMLP_DTYPE_F16)), v.back().temperature = 0.7f;
  v.push_back(sm_case(4, 65537, FMLP_DTYPE_BF16)), v.back().nonfinite = true;
  v.push_back(sm_case(3, 50000)), v.back().strided = true;  // rows off 16 bytes: scalar path
  v.push_back(sm_case(4, 40000, FMLP_DTYPE_F16)), v.back().misaligned = true;
  v.push_back(sm_case(2, 32768)), v.back().strided = true, v.back().in_place = true;
  v.push_back(sm_case(1, 15000001));  // 60 MB: more parts than blocks
  v.push_back(sm_case(1, 20000001, FMLP_DTYPE_BF16)), v.back().log = true;
  uint64_t seed = 500;
  for (const SmCase& c : v) check(c, ++seed);
}

// The same input gives the same bits: every block of a row combines the row's partials in one
// fixed order, whichever blocks took which parts.
TEST_F(SoftmaxTicket, RerunsAreBitwiseEqual) {
  for (const SmCase& c : {sm_case(1, 128256), sm_case(4, 128256), sm_case(1, 15000001),
                          sm_case(3, 65537, FMLP_DTYPE_BF16)}) {
    std::vector<unsigned char> first, second;
    RunMode mode;
    mode.y_bytes = &first;
    check(c, 600, mode);
    mode.y_bytes = &second;
    check(c, 600, mode);
    EXPECT_TRUE(first == second) << "[" << c.name() << "]: two runs differ";
  }
}

// Captured once, replayed on refreshed inputs: each replay reads the new input and leaves the
// workspace zero-filled for the next.
TEST_F(SoftmaxTicket, GraphReplayMatchesReference) {
  RunMode mode;
  mode.graph = true;
  SmCase log1 = sm_case(1, 128256);
  log1.log = true;
  uint64_t seed = 700;
  for (const SmCase& c : {log1, sm_case(4, 128256), sm_case(3, 262147), sm_case(1, 15000001)})
    check(c, ++seed, mode);
}

}  // namespace
}  // namespace fmlp_test
