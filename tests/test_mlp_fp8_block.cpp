// 128 x 128 block-scaled fp8 weights in the mlp op (fusedmlp.h): every host entry against the
// double reference of mlp_case.cpp (which maps blocks itself, the stacked gate/up halves included)
// on sizes across block edges, every activation, gate form and M regime of the cpu kernels; the
// packed path; that gate and up checkpoint scales concatenate for a stacked W1 whatever hidden
// is; that a block's scale reaches exactly its outputs; bad scales rejected by name with y
// untouched; the cuda entries refusing with what to do instead.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.h"
#include "fusedmlp/fusedmlp_nccl.h"
#include "mlp_case.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

constexpr int64_t kMaxMacs = 6'000'000;
const fmlp_activation_t kActs[] = {FMLP_ACT_RELU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH, FMLP_ACT_SILU,
                                   FMLP_ACT_RELU2};
const Gate kGates[] = {Gate::kDense, Gate::kStacked, Gate::kSeparate};
const fmlp_dtype_t kActDtypes[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16};

MlpCase block_case(Rng& rng, int64_t d_in, int64_t hidden, int64_t d_out, int64_t m, Gate g) {
  MlpCase c = random_case(rng, kMaxMacs);
  c.d_in = d_in, c.hidden = hidden, c.d_out = d_out, c.m = m, c.gate = g;
  c.w_dtype = FMLP_DTYPE_F8_E4M3;
  const int which = int(rng() % 4);  // both block-scaled most often, else one of them
  c.block_w1 = which != 2;
  c.block_w2 = which != 1;
  c.per_row_scale = rng() % 2;  // the kind of the matrix that is not block-scaled
  c.fp8_all_codes = rng() % 3 == 0;
  c.nan_weights = rng() % 5 == 0;
  normalize(&c);
  return c;
}

// Sizes on and across the 128 edges (1, 7, 127, 128, 129, 200, 769, 1001), M from 1 through the
// decode kernel's widen-once rows (6) and its limit (16) to the blocked kernel's panels (17, 100),
// every gate form and activation.
std::vector<MlpCase> cases() {
  Rng rng(mix_seed(test_seed(), 54));
  std::vector<MlpCase> v;
  const int64_t sizes[] = {1, 7, 127, 128, 129, 200, 769, 1001};
  int n = 0;
  for (int64_t k : sizes)
    for (int64_t h : sizes) {
      const int64_t ms[] = {1, 3, 6, 16, 17, 100};
      const int64_t m = ms[n % 6];
      MlpCase c = block_case(rng, k, h, sizes[(n * 5) % 8], m, kGates[n % 3]);
      c.act = kActs[n % 5];
      c.x_dtype = kActDtypes[(n / 3) % 3];
      while (c.m > 1 && c.macs() > kMaxMacs) c.m = c.m > 16 ? 16 : c.m > 3 ? 3 : 1;
      normalize(&c);
      v.push_back(c);
      ++n;
    }
  // Larger: a few thousand columns (many blocks a row) at decode and prefill M.
  for (int64_t m : {1, 4, 40}) {
    MlpCase c = block_case(rng, 2000, 640, 300, m, m == 4 ? Gate::kSeparate : Gate::kStacked);
    c.block_w1 = c.block_w2 = true;
    c.act = FMLP_ACT_SILU;
    v.push_back(c);
  }
  // NaN and Inf in x (rows 0 and 1), NaN codes in w2.
  for (Gate g : kGates) {
    MlpCase c = block_case(rng, 300, 200, 129, 5, g);
    c.block_w1 = c.block_w2 = true;
    c.nonfinite = c.nan_weights = true;
    normalize(&c);
    v.push_back(c);
  }
  return v;
}

std::string header(size_t i, const MlpCase& c) {
  return "case #" + std::to_string(i) + " [" + c.name() +
         "] (FMLP_TEST_SEED=" + std::to_string(test_seed()) + ")";
}

std::vector<int> kernel_indices() {
  std::vector<int> v;
  for (int i = 0; i < fmlp_mlp_kernel_count(); ++i) v.push_back(i);
  return v;
}

class BlockKernel : public ::testing::TestWithParam<int> {};

TEST_P(BlockKernel, MatchesReferenceOrRefuses) {
  const char* kernel = fmlp_mlp_kernel_name(GetParam());
  const fmlp_backend_t b = fmlp_mlp_kernel_backend(GetParam());
  if (fmlp_backend_available(b) != FMLP_SUCCESS) GTEST_SKIP() << fmlp_last_error();
  const bool device = b == FMLP_BACKEND_CUDA;
  if (device && !device_unavailable_reason().empty()) GTEST_SKIP() << device_unavailable_reason();
  const std::vector<MlpCase> cs = cases();
  int ran = 0;
  for (size_t i = 0; i < cs.size(); ++i) {
    const MlpCase& c = cs[i];
    PlacedCase p(c, device);
    const fmlp_status_t sup = fmlp_mlp_kernel_supports(&p.args(), kernel);
    if (device) {  // the block-scale refusal comes before any other of the entry's checks
      EXPECT_EQ(sup, FMLP_ERROR_NOT_SUPPORTED) << kernel << " " << header(i, c);
      const std::string why = fmlp_last_error();
      EXPECT_NE(why.find("block scale"), std::string::npos) << why;
      EXPECT_NE(why.find("cpu backend"), std::string::npos) << why;
      continue;
    }
    if (sup == FMLP_ERROR_NOT_SUPPORTED) continue;  // e.g. the decode kernel past M = 16
    ASSERT_EQ(sup, FMLP_SUCCESS) << kernel << " " << header(i, c) << ": " << fmlp_last_error();
    const CaseData data = make_data(c, c.data_seed);
    p.upload(data);
    const RunOutcome run = run_kernel(p, kernel);
    ASSERT_EQ(run.status, FMLP_SUCCESS) << kernel << " " << header(i, c) << ": " << run.error;
    std::string stray;
    const std::vector<double> out = p.download_y(&stray);
    EXPECT_TRUE(stray.empty()) << header(i, c) << ": " << stray;
    const CompareOutcome cmp = compare(c, out, reference(c, data));
    EXPECT_TRUE(cmp.ok) << kernel << " " << header(i, c) << ": " << cmp.bad << " of " << out.size()
                        << " wrong; " << cmp.detail;
    ++ran;
  }
  if (b != FMLP_BACKEND_CUDA) {
    EXPECT_GT(ran, 0) << kernel << " ran none of the block cases";
  }
  std::printf("[fmlp] %s: %d of %zu block-scale cases ran\n", kernel, ran, cs.size());
}

INSTANTIATE_TEST_SUITE_P(Kernels, BlockKernel, ::testing::ValuesIn(kernel_indices()),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(fmlp_mlp_kernel_name(info.param));
                         });

// Equal element by element, NaN matching NaN.
bool same(const std::vector<double>& a, const std::vector<double>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](double p, double q) { return p == q || (std::isnan(p) && std::isnan(q)); });
}

// Runs the case on `kernel` (nullptr: the cpu backend's dispatch) and returns y.
std::vector<double> run_y(const MlpCase& c, const CaseData& data, const char* kernel) {
  PlacedCase p(c, false);
  p.upload(data);
  if (kernel == nullptr) {
    size_t bytes = 0;
    EXPECT_EQ(fmlp_mlp_workspace_size(&p.args(), FMLP_BACKEND_CPU, &bytes), FMLP_SUCCESS)
        << fmlp_last_error();
    std::vector<unsigned char> ws(bytes + 64);
    EXPECT_EQ(fmlp_mlp(&p.args(), FMLP_BACKEND_CPU, ws.data(), bytes, nullptr), FMLP_SUCCESS)
        << fmlp_last_error();
  } else {
    const RunOutcome r = run_kernel(p, kernel);
    EXPECT_EQ(r.status, FMLP_SUCCESS) << r.error;
  }
  std::string stray;
  return p.download_y(&stray);
}

// Packed weights (fmlp_mlp_pack on the cpu backend) carry the block scales: gate and up stacked
// with their block rows concatenated.
TEST(MlpFp8Block, PackedMatchesReference) {
  if (fmlp_backend_available(FMLP_BACKEND_CPU) != FMLP_SUCCESS) GTEST_SKIP() << fmlp_last_error();
  Rng rng(mix_seed(test_seed(), 55));
  for (Gate g : kGates)
    for (int64_t m : {1, 30}) {
      MlpCase c = block_case(rng, 300, 200, 129, m, g);
      c.block_w1 = c.block_w2 = true;
      c.strided = true;
      c.residual = Residual::kNone;
      normalize(&c);
      const CaseData data = make_data(c, c.data_seed);
      PlacedCase p(c, false);
      p.upload(data);
      fmlp_mlp_packed_t* packed = nullptr;
      ASSERT_EQ(
          fmlp_mlp_pack(&packed, &p.args().weights, &p.args().config, FMLP_BACKEND_CPU, nullptr),
          FMLP_SUCCESS)
          << c.name() << ": " << fmlp_last_error();
      size_t bytes = 0;
      ASSERT_EQ(fmlp_mlp_packed_workspace_size(packed, &p.args().y, &p.args().x, &bytes),
                FMLP_SUCCESS);
      std::vector<unsigned char> ws(bytes + 64);
      ASSERT_EQ(
          fmlp_mlp_packed_run(packed, &p.args().y, &p.args().x, nullptr, ws.data(), bytes, nullptr),
          FMLP_SUCCESS)
          << fmlp_last_error();
      fmlp_mlp_packed_destroy(packed);
      std::string stray;
      const std::vector<double> out = p.download_y(&stray);
      const CompareOutcome cmp = compare(c, out, reference(c, data));
      EXPECT_TRUE(cmp.ok) << c.name() << ": " << cmp.detail;
    }
}

// A checkpoint stores gate_proj and up_proj apart, each with its own [ceil(hidden / 128),
// ceil(d_in / 128)] scale. Passed as separate w1 / w_up, or stacked with the two scales
// concatenated, the op computes the same thing, also where hidden % 128 != 0 (one scale over the
// 2 * hidden stacked rows would mix gate and up rows in one block there).
TEST(MlpFp8Block, GateAndUpCheckpointScalesStackWithoutRequantising) {
  if (fmlp_backend_available(FMLP_BACKEND_CPU) != FMLP_SUCCESS) GTEST_SKIP() << fmlp_last_error();
  Rng rng(mix_seed(test_seed(), 56));
  for (int64_t h : {100, 200, 256})
    for (int64_t m : {1, 30}) {
      MlpCase sep = block_case(rng, 260, h, 140, m, Gate::kSeparate);
      sep.block_w1 = sep.block_w2 = true;
      sep.b1 = sep.b_up = kAbsent;
      normalize(&sep);
      const CaseData ds = make_data(sep, sep.data_seed);
      MlpCase st = sep;
      st.gate = Gate::kStacked;
      CaseData dt = ds;
      dt.w1.rows = 2 * h;  // [gate; up] codes, [gate scales; up scales]
      dt.w1.bytes.insert(dt.w1.bytes.end(), ds.w_up.bytes.begin(), ds.w_up.bytes.end());
      dt.w1_scale.rows += ds.w_up_scale.rows;
      dt.w1_scale.bytes.insert(dt.w1_scale.bytes.end(), ds.w_up_scale.bytes.begin(),
                               ds.w_up_scale.bytes.end());
      dt.w_up = dt.w_up_scale = HostMatrix{};
      for (const char* kernel :
           {"mlp_ref_scalar_fp64", "mlp_cpu_avx2_decode", "mlp_cpu_avx2_blocked"}) {
        if (m > 16 && std::string(kernel) == "mlp_cpu_avx2_decode") continue;
        const std::vector<double> a = run_y(sep, ds, kernel), b = run_y(st, dt, kernel);
        EXPECT_TRUE(same(a, b)) << kernel << " h=" << h << " m=" << m;
        EXPECT_TRUE(compare(st, b, reference(st, dt)).ok) << kernel << " h=" << h;
      }
    }
}

// A block's scale reaches exactly the outputs of its rows: doubling w2's scale of block (1, 0)
// changes y in columns [128, 256) and leaves every other column bitwise as it was; a kernel that
// read a neighbouring block would move the wrong columns (and fail the reference).
TEST(MlpFp8Block, OneBlockScaleMovesOnlyItsOutputs) {
  if (fmlp_backend_available(FMLP_BACKEND_CPU) != FMLP_SUCCESS) GTEST_SKIP() << fmlp_last_error();
  Rng rng(mix_seed(test_seed(), 57));
  for (int64_t m : {1, 30}) {
    MlpCase c = block_case(rng, 300, 260, 300, m, Gate::kStacked);
    c.block_w1 = c.block_w2 = true;
    c.nonfinite = c.nan_weights = c.fp8_all_codes = false;
    c.residual = Residual::kNone;
    c.act = FMLP_ACT_GELU;
    normalize(&c);
    const CaseData data = make_data(c, c.data_seed);
    CaseData bumped = data;
    bumped.w2_scale.set(1, 0, 2.0 * data.w2_scale.get(1, 0));
    for (const char* kernel : {"mlp_ref_scalar_fp64", "mlp_cpu_avx2_decode", "mlp_cpu_avx2_blocked",
                               static_cast<const char*>(nullptr)}) {
      if (m > 16 && kernel && std::string(kernel) == "mlp_cpu_avx2_decode") continue;
      const std::vector<double> a = run_y(c, data, kernel), b = run_y(c, bumped, kernel);
      int64_t moved = 0;
      for (int64_t i = 0; i < c.m; ++i)
        for (int64_t o = 0; o < c.d_out; ++o) {
          const size_t e = size_t(i * c.d_out + o);
          if (o >= 128 && o < 256)
            moved += a[e] != b[e];
          else
            EXPECT_EQ(a[e], b[e]) << (kernel ? kernel : "dispatch") << " row " << i << " col " << o;
        }
      EXPECT_GT(moved, c.m * 100) << (kernel ? kernel : "dispatch");
      EXPECT_TRUE(compare(c, b, reference(c, bumped)).ok) << (kernel ? kernel : "dispatch");
      // The up half's first block (w1_scale row 3 = ceil(260 / 128)) reaches y through h[0, 128).
      CaseData up = data;
      up.w1_scale.set(3, 1, 0.5 * data.w1_scale.get(3, 1));
      const std::vector<double> u = run_y(c, up, kernel);
      EXPECT_NE(u, a) << (kernel ? kernel : "dispatch");
      EXPECT_TRUE(compare(c, u, reference(c, up)).ok) << (kernel ? kernel : "dispatch");
    }
  }
}

// Each output's summation order depends on the block layout and K only, not on the threads.
TEST(MlpFp8Block, ThreadCountIndependent) {
  if (fmlp_backend_available(FMLP_BACKEND_CPU) != FMLP_SUCCESS) GTEST_SKIP() << fmlp_last_error();
  Rng rng(mix_seed(test_seed(), 58));
  for (int64_t m : {1, 7, 40}) {
    MlpCase c = block_case(rng, 700, 300, 260, m, kGates[m % 3]);
    c.block_w1 = c.block_w2 = true;
    normalize(&c);
    const CaseData data = make_data(c, c.data_seed);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    const std::vector<double> one = run_y(c, data, nullptr);
    omp_set_num_threads(std::max(2, threads));
    const std::vector<double> many = run_y(c, data, nullptr);
    omp_set_num_threads(threads);
    EXPECT_TRUE(same(one, many)) << c.name();
  }
}

// Bad block scales: rejected by every host entry and by pack, the argument named, nothing written.
struct Spoil {
  const char* what;
  Gate gate;
  void (*apply)(fmlp_mlp_args_t&, std::vector<float>&);
  fmlp_status_t status;
  std::vector<std::string> words;
};

TEST(MlpFp8Block, BadScalesAreRejectedByNameAndYUntouched) {
  // hidden 200: 2 block rows a half; d_in 300: 3 block columns; d_out 129: 2 block rows.
  const std::vector<Spoil> spoils = {
      {"stacked w1 scale over 2 * hidden rows",
       Gate::kStacked,
       [](fmlp_mlp_args_t& a, std::vector<float>& buf) {
         a.weights.w1_scale = fmlp_tensor_2d(buf.data(), FMLP_DTYPE_F32, 3, 3, 3);
       },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.w1_scale", "2 * ceil(hidden / 128)", "[4, 3]", "[3, 3]"}},
      {"w2 scale one block column short",
       Gate::kDense,
       [](fmlp_mlp_args_t& a, std::vector<float>& buf) {
         a.weights.w2_scale = fmlp_tensor_2d(buf.data(), FMLP_DTYPE_F32, 2, 1, 1);
       },
       FMLP_ERROR_SHAPE_MISMATCH,
       {"weights.w2_scale", "[2, 2]", "[2, 1]"}},
      {"NaN block scale",
       Gate::kSeparate,
       [](fmlp_mlp_args_t& a, std::vector<float>&) {
         static_cast<float*>(a.weights.w_up_scale.data)[a.weights.w_up_scale.stride[0] + 2] = NAN;
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w_up_scale[1, 2]", "nan", "finite and > 0"}},
      {"zero block scale",
       Gate::kDense,
       [](fmlp_mlp_args_t& a, std::vector<float>&) {
         static_cast<float*>(a.weights.w1_scale.data)[1] = 0.f;
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w1_scale[0, 1]", "finite and > 0"}},
      {"negative block scale",
       Gate::kDense,
       [](fmlp_mlp_args_t& a, std::vector<float>&) {
         static_cast<float*>(a.weights.w2_scale.data)[a.weights.w2_scale.stride[0]] = -1.f;
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w2_scale[1, 0]", "-1"}},
      {"infinite block scale",
       Gate::kStacked,
       [](fmlp_mlp_args_t& a, std::vector<float>&) {
         static_cast<float*>(a.weights.w1_scale.data)[3 * a.weights.w1_scale.stride[0]] = INFINITY;
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w1_scale[3, 0]", "inf"}},
      {"f16 block scale",
       Gate::kDense,
       [](fmlp_mlp_args_t& a, std::vector<float>&) { a.weights.w2_scale.dtype = FMLP_DTYPE_F16; },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w2_scale", "f16", "f32"}},
      {"block gate with per-row up",
       Gate::kSeparate,
       [](fmlp_mlp_args_t& a, std::vector<float>& buf) {
         std::fill(buf.begin(), buf.end(), 1.f);
         a.weights.w_up_scale = fmlp_tensor_1d(buf.data(), FMLP_DTYPE_F32, 200);
       },
       FMLP_ERROR_BAD_SCALE,
       {"weights.w1_scale is a 2-D block scale", "weights.w_up_scale is [200]", "both"}},
      {"fp8 x",
       Gate::kDense,
       [](fmlp_mlp_args_t& a, std::vector<float>&) { a.x.dtype = FMLP_DTYPE_F8_E4M3; },
       FMLP_ERROR_DTYPE_MISMATCH,
       {"x has dtype f8_e4m3", "f32, f16 or bf16"}},
  };
  for (const Spoil& s : spoils) {
    MlpCase c;
    c.m = 3, c.d_in = 300, c.hidden = 200, c.d_out = 129, c.gate = s.gate;
    c.w_dtype = FMLP_DTYPE_F8_E4M3, c.block_w1 = c.block_w2 = true;
    c.strided = true;
    const CaseData data = make_data(c, 9);
    std::vector<float> buf(256, 1.f);
    // run: 0 ref, 1 cpu dispatch, 2 pack.
    for (int run = 0; run < 3; ++run) {
      PlacedCase p(c, false);
      p.upload(data);
      fmlp_mlp_args_t a = p.args();
      s.apply(a, buf);
      const std::vector<unsigned char> before = p.y_bytes();
      std::vector<unsigned char> ws(1 << 22);
      fmlp_status_t st;
      if (run == 2) {
        fmlp_mlp_packed_t* packed = nullptr;
        st = fmlp_mlp_pack(&packed, &a.weights, &a.config, FMLP_BACKEND_CPU, nullptr);
        if (std::string(s.what) == "fp8 x") {  // pack sees no x
          EXPECT_EQ(st, FMLP_SUCCESS) << fmlp_last_error();
          fmlp_mlp_packed_destroy(packed);
          continue;
        }
        EXPECT_EQ(packed, nullptr);
      } else {
        st = fmlp_mlp(&a, run == 0 ? FMLP_BACKEND_REF : FMLP_BACKEND_CPU, ws.data(), ws.size(),
                      nullptr);
      }
      EXPECT_EQ(st, s.status) << s.what << " (run " << run << "): " << fmlp_last_error();
      const std::string msg = fmlp_last_error();
      for (const std::string& w : s.words)
        EXPECT_NE(msg.find(w), std::string::npos) << s.what << ": '" << w << "' not in: " << msg;
      EXPECT_EQ(p.y_bytes(), before) << s.what << ": y was written";
    }
  }
}

// The cuda pack refuses block scales by name (device weights; needs a GPU).
TEST(MlpFp8Block, CudaPackRefusesBlockScales) {
  if (fmlp_backend_available(FMLP_BACKEND_CUDA) != FMLP_SUCCESS) GTEST_SKIP() << fmlp_last_error();
  if (!device_unavailable_reason().empty()) GTEST_SKIP() << device_unavailable_reason();
  MlpCase c;
  c.m = 1, c.d_in = 256, c.hidden = 256, c.d_out = 256, c.gate = Gate::kSeparate;
  c.w_dtype = FMLP_DTYPE_F8_E4M3, c.block_w1 = true;
  PlacedCase p(c, true);
  p.upload(make_data(c, 4));
  fmlp_mlp_packed_t* packed = nullptr;
  EXPECT_EQ(fmlp_mlp_pack(&packed, &p.args().weights, &p.args().config, FMLP_BACKEND_CUDA, nullptr),
            FMLP_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(packed, nullptr);
  const std::string msg = fmlp_last_error();
  EXPECT_NE(msg.find("weights.w1_scale is a 2-D block scale"), std::string::npos) << msg;
  EXPECT_NE(msg.find("per row"), std::string::npos) << msg;
}

// Tensor-parallel shards run on the cuda entries: block scales are refused by name there too.
TEST(MlpFp8Block, TensorParallelShardRefusesBlockScales) {
  MlpCase c;
  c.m = 1, c.d_in = 256, c.hidden = 256, c.d_out = 256, c.gate = Gate::kStacked;
  c.w_dtype = FMLP_DTYPE_F8_E4M3, c.block_w2 = true;
  PlacedCase p(c, false);
  p.upload(make_data(c, 3));
  fmlp_mlp_weights_t shard{};
  EXPECT_EQ(fmlp_tp_shard_weights(&p.args().weights, &p.args().config, 0, 2, &shard),
            FMLP_ERROR_NOT_SUPPORTED);
  const std::string msg = fmlp_last_error();
  EXPECT_NE(msg.find("weights.w2_scale is a 2-D block scale"), std::string::npos) << msg;
  EXPECT_NE(msg.find("per row"), std::string::npos) << msg;
}

}  // namespace
}  // namespace fmlp_test
