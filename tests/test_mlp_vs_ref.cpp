// Every op-table entry against the double reference over a grid of cases (see tolerance.hpp for the
// accuracy rule). New kernels are picked up automatically: the suite is instantiated once per
// entry of fmlp_mlp_kernel_name(). Full cross products cover the important axes section by
// section; the remaining axes of each case are drawn from a seeded generator, so every run covers
// fresh combinations and a failure is reproduced with FMLP_TEST_SEED.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mlp_case.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

enum class Section {
  kShapes,
  kDtypes,
  kEpilogue,
  kLayout,
  kNonFinite,
  kDOut,
  kRealistic,
  kRandom,
  kVectorFriendly,
  kLargeM,
  kFp8,
  kFp8Stream
};
constexpr Section kAllSections[] = {
    Section::kShapes,         Section::kDtypes, Section::kEpilogue,  Section::kLayout,
    Section::kNonFinite,      Section::kDOut,   Section::kRealistic, Section::kRandom,
    Section::kVectorFriendly, Section::kFp8,    Section::kFp8Stream};
constexpr int64_t kMaxMacs = 4'000'000;  // per sampled case; keeps the suite within its budget

const char* section_name(Section s) {
  const char* names[] = {"Shapes",         "Dtypes", "Epilogue",  "Layout",
                         "NonFinite",      "DOut",   "Realistic", "Random",
                         "VectorFriendly", "LargeM", "Fp8",       "Fp8Stream"};
  return names[int(s)];
}

const fmlp_activation_t kActs[] = {FMLP_ACT_RELU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH, FMLP_ACT_SILU,
                                   FMLP_ACT_RELU2};
const Gate kGates[] = {Gate::kDense, Gate::kStacked, Gate::kSeparate};
const fmlp_dtype_t kActDtypes[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16};
const Residual kResiduals[] = {Residual::kNone, Residual::kSeparate, Residual::kInPlace};

// Turns c into a case that the 16-byte streaming and tensor-core decode entries take (16-bit
// weights with x in their dtype, sizes in whole 16-byte chunks, aligned contiguous rows, at most
// 16 tokens, not deterministic), keeping its epilogue, norm, gate and non-finite rows: the
// sections whose own axes are epilogues or NaN/Inf make every other case this way, so those
// entries are checked on them too instead of skipping the whole section.
void make_vector_friendly(MlpCase* c, Rng& rng) {
  const int64_t vsizes[] = {64, 256, 512};
  c->d_in = c->d_out = vsizes[rng() % 3];
  c->hidden = vsizes[rng() % 3];
  c->m = std::min<int64_t>(c->m, 16);
  c->w_dtype = c->x_dtype = rng() % 2 ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F16;
  c->misaligned = c->strided = c->deterministic = false;
  while (c->macs() > kMaxMacs && c->m > 1) c->m = c->m == 16 ? 3 : 1;
}

// The cases of one section. Deterministic for a given test seed.
std::vector<MlpCase> section_cases(Section s) {
  Rng rng(mix_seed(test_seed(), uint64_t(s) + 1));
  std::vector<MlpCase> v;
  auto add = [&](MlpCase c) {
    normalize(&c);
    v.push_back(c);
  };
  const int64_t sizes[] = {1, 7, 64, 127, 769};
  switch (s) {
    case Section::kShapes:  // d_in x hidden x M, d_out = d_in
      for (int64_t k : sizes)
        for (int64_t h : sizes)
          for (int64_t m : {1, 3, 16, 100}) {
            MlpCase c = random_case(rng, kMaxMacs);
            c.d_in = c.d_out = k;
            c.hidden = h;
            c.m = m;
            add(c);
          }
      // fp8 at the M where the cpu kernels widen a weight row group once for all rows (6 and
      // more), with K tails inside a 16-code step and past it.
      for (int64_t m : {6, 7, 16})
        for (int64_t k : {7, 127, 769}) {
          MlpCase c = random_case(rng, kMaxMacs);
          c.d_in = c.d_out = k;
          c.hidden = k == 769 ? 64 : 127;
          c.m = m;
          c.w_dtype = FMLP_DTYPE_F8_E4M3;
          add(c);
        }
      break;
    case Section::kVectorFriendly:  // what 16-byte streaming kernels take: sizes % 8 == 0,
                                    // aligned 16-bit or fp8 weights, up to 64 tokens (every
                                    // token-tile count), x in the weights' dtype half the time
                                    // (what the tensor-core decode kernel takes); epilogues at
                                    // random
      for (int64_t m : {1, 2, 3, 4, 16, 33, 64})
        for (Gate g : kGates)
          for (fmlp_activation_t a : kActs) {
            MlpCase c = random_case(rng, kMaxMacs);
            const int64_t vsizes[] = {64, 256, 512, 776};
            c.d_in = vsizes[rng() % 4];
            c.hidden = vsizes[rng() % 4];
            c.d_out = rng() % 4 == 0 ? vsizes[rng() % 4] : c.d_in;
            c.m = m;
            c.gate = g;
            c.act = a;
            const int kind = int(rng() % 6);
            c.w_dtype = kind == 5  ? FMLP_DTYPE_F8_E4M3
                        : kind % 2 ? FMLP_DTYPE_BF16
                                   : FMLP_DTYPE_F16;
            if (kind >= 3)
              c.x_dtype = kind == 5 ? (rng() % 2 ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F16) : c.w_dtype;
            c.per_row_scale = rng() % 2;
            c.misaligned = c.strided = false;
            for (int64_t* d : {&c.d_in, &c.hidden, &c.d_out})
              if (c.macs() > kMaxMacs && *d > 64) *d = 64;
            add(c);
          }
      // Over a thousand row groups per weight stream (more than the blocks resident on a large
      // GPU), past the MAC budget: the stream kernels' blocks loop over groups, carrying their
      // batch buffers and reduction state across them; gated (the up stream's gate/up pairs) with
      // two-warp rows in the down stream, and dense with whole-row warps in the up stream.
      // The last two at one token: down rows of 8704 (136 chunks a warp, 544 for fp8's whole
      // rows per warp) that end inside a batch, over more row groups than resident blocks.
      for (int i = 0; i < 4; ++i) {
        MlpCase c = random_case(rng, kMaxMacs);
        c.gate = i == 1 ? Gate::kDense : Gate::kStacked;
        c.d_in = i < 2 ? 1024 : 256;
        c.hidden = i == 0 ? 4096 : i == 1 ? 8200 : 8704;
        c.d_out = i == 0 ? 4104 : i == 1 ? 1024 : 1100;
        c.m = i == 1 ? 3 : 1;
        c.w_dtype = c.x_dtype = i == 1 ? FMLP_DTYPE_F16 : FMLP_DTYPE_BF16;
        if (i == 3) c.w_dtype = FMLP_DTYPE_F8_E4M3, c.per_row_scale = true;
        c.misaligned = c.strided = false;
        add(c);
      }
      break;
    case Section::kLargeM:  // more rows than one cache block of the GEMM-style kernels
      for (int64_t m : {145, 300})
        for (Gate g : kGates) {
          MlpCase c = random_case(rng, kMaxMacs);
          const int64_t ksizes[] = {7, 64, 127};
          c.d_in = c.d_out = ksizes[rng() % 3];
          c.hidden = ksizes[rng() % 3];
          c.m = m;
          c.gate = g;
          add(c);
        }
      break;
    case Section::kDtypes:  // activation dtype x weight dtype x gate x activation
      for (fmlp_dtype_t x : kActDtypes)
        for (fmlp_dtype_t w : {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16, FMLP_DTYPE_F8_E4M3})
          for (Gate g : kGates)
            for (fmlp_activation_t a : kActs) {
              MlpCase c = random_case(rng, 300'000);
              c.x_dtype = x;
              c.w_dtype = w;
              c.gate = g;
              c.act = a;
              add(c);
            }
      break;
    case Section::kEpilogue:  // biases x residual x norm, every other case vector-friendly
      for (int bias = 0; bias < 4; ++bias)
        for (Residual r : kResiduals)
          for (int norm = 0; norm < 6; ++norm) {
            MlpCase c = random_case(rng, 1'000'000);
            if ((bias + norm) % 2) make_vector_friendly(&c, rng);
            const bool b1 = bias & 1, b2 = bias & 2;
            c.b1 = b1 ? kActDtypes[rng() % 3] : kAbsent;
            c.b_up = b1 ? kActDtypes[rng() % 3] : kAbsent;
            c.b2 = b2 ? kActDtypes[rng() % 3] : kAbsent;
            c.residual = r;
            c.norm = norm == 0   ? FMLP_NORM_NONE
                     : norm <= 3 ? FMLP_NORM_LAYERNORM
                                 : FMLP_NORM_RMSNORM;
            c.gamma = (norm == 2 || norm == 3 || norm == 5) ? kActDtypes[rng() % 3] : kAbsent;
            c.beta = norm == 3 ? kActDtypes[rng() % 3] : kAbsent;
            add(c);
          }
      break;
    case Section::kLayout:  // misaligned x strided x residual x activation dtype; then the same
                            // layouts of x, y and residual with packed vector-friendly weights
      for (bool mis : {false, true})
        for (bool str : {false, true})
          for (Residual r : kResiduals)
            for (fmlp_dtype_t x : kActDtypes) {
              MlpCase c = random_case(rng, 1'000'000);
              c.misaligned = mis;
              c.strided = str;
              c.residual = r;
              c.x_dtype = x;
              add(c);
            }
      for (bool mis : {false, true})
        for (bool str : {false, true})
          for (Residual r : kResiduals) {
            if (!mis && !str) continue;
            MlpCase c = random_case(rng, 1'000'000);
            make_vector_friendly(&c, rng);
            c.misaligned = mis;
            c.strided = str;
            c.packed_weights = true;
            c.residual = r;
            add(c);
          }
      break;
    case Section::kNonFinite:  // NaN row + Inf row, every activation x norm x gate, each
                               // combination once as drawn and once vector-friendly
      for (fmlp_activation_t a : kActs)
        for (fmlp_norm_t n : {FMLP_NORM_NONE, FMLP_NORM_LAYERNORM, FMLP_NORM_RMSNORM})
          for (Gate g : kGates)
            for (const bool friendly : {false, true}) {
              MlpCase c = random_case(rng, 1'000'000);
              if (friendly) make_vector_friendly(&c, rng);
              c.act = a;
              c.norm = n;
              c.gate = g;
              c.m = std::max<int64_t>(c.m, 3);
              c.nonfinite = true;
              add(c);
            }
      break;
    case Section::kDOut:  // d_out != d_in, no residual; each also with vector-friendly d_in,
                          // hidden and weights (d_out stays odd: it is never a load width)
      for (auto [k, n] :
           {std::pair<int64_t, int64_t>{64, 1}, {64, 7}, {7, 130}, {769, 64}, {1, 127}, {127, 769}})
        for (Gate g : {Gate::kDense, Gate::kStacked})
          for (const bool friendly : {false, true}) {
            MlpCase c = random_case(rng, 1'000'000);
            if (friendly) make_vector_friendly(&c, rng);
            if (!friendly) c.d_in = k;
            c.d_out = n;
            c.gate = g;
            c.residual = Residual::kNone;
            while (c.macs() > kMaxMacs && c.m > 1) c.m = c.m == 16 ? 3 : 1;
            add(c);
          }
      break;
    case Section::kRealistic:  // a GPT-2-sized block at decode and small-prefill M (M = 4: a
                               // staged h of exactly 48 KiB, the shared-memory opt-in edge)
      for (int64_t m : {1, 4, 5})
        for (int variant = 0; variant < 4; ++variant) {
          MlpCase c;
          c.m = m;
          c.d_in = c.d_out = 768;
          c.hidden = 3072;
          c.data_seed = rng();
          if (variant == 0) {
            c.act = FMLP_ACT_GELU;
            c.b1 = c.b2 = FMLP_DTYPE_F32;
          } else if (variant == 1) {
            c.act = FMLP_ACT_SILU;
            c.gate = Gate::kStacked;
            c.x_dtype = c.w_dtype = FMLP_DTYPE_BF16;
            c.norm = FMLP_NORM_RMSNORM;
            c.gamma = FMLP_DTYPE_BF16;
            c.residual = Residual::kInPlace;
          } else if (variant == 2) {
            c.act = FMLP_ACT_GELU_TANH;
            c.gate = Gate::kSeparate;
            c.x_dtype = c.w_dtype = FMLP_DTYPE_F16;
            c.b1 = c.b_up = c.b2 = FMLP_DTYPE_F16;
            c.norm = FMLP_NORM_LAYERNORM;
            c.gamma = c.beta = FMLP_DTYPE_F32;
            c.residual = Residual::kSeparate;
          } else {
            c.act = FMLP_ACT_RELU;
            c.x_dtype = FMLP_DTYPE_BF16;
            c.w_dtype = FMLP_DTYPE_F8_E4M3;
            c.per_row_scale = true;
            c.b2 = FMLP_DTYPE_BF16;
          }
          add(c);
        }
      break;
    case Section::kRandom:
      for (int i = 0; i < 250; ++i) add(random_case(rng, kMaxMacs));
      break;
    case Section::kFp8:  // fp8 weights: M x gate x scale granularity, odd sizes, every code, NaN
      for (int64_t m : {1, 3, 16, 17, 300})
        for (Gate g : kGates)
          for (bool per_row : {false, true}) {
            MlpCase c = random_case(rng, kMaxMacs);
            const int64_t fsizes[] = {1, 7, 64, 127, 769};
            const int n = m > 17 ? 4 : 5;  // M = 300 keeps the dims at 127 and below
            c.d_in = fsizes[rng() % n];
            c.hidden = fsizes[rng() % n];
            c.d_out = rng() % 2 ? fsizes[rng() % n] : c.d_in;
            c.m = m;
            c.gate = g;
            c.w_dtype = FMLP_DTYPE_F8_E4M3;
            c.per_row_scale = per_row;
            c.fp8_all_codes = rng() % 2;
            c.nan_weights = rng() % 3 == 0;
            for (int64_t* d : {&c.d_in, &c.hidden, &c.d_out})
              if (c.macs() > kMaxMacs && *d > 127) *d = 127;
            add(c);
          }
      break;
    case Section::kFp8Stream:  // fp8 weights the way decode streams them: 16-bit x, M = 1..4,
                               // weight rows in whole 16-byte chunks, k slices of 128..2064,
                               // every gate / norm / epilogue, NaN and Inf rows, deterministic
      for (int64_t m = 1; m <= 4; ++m)
        for (Gate g : kGates)
          for (int variant = 0; variant < 3; ++variant) {
            MlpCase c;
            const int64_t ins[] = {16, 272, 1040}, hids[] = {144, 784, 2064},
                          outs[] = {7, 127, 769};
            c.m = m;
            c.gate = g;
            c.d_in = ins[(m + variant) % 3];
            c.hidden = hids[(m + 2 * variant) % 3];
            c.d_out = variant == 0 ? c.d_in : outs[(m + variant) % 3];
            c.act = kActs[(m + variant) % 5];
            c.x_dtype = (m + variant) % 2 ? FMLP_DTYPE_BF16 : FMLP_DTYPE_F16;
            c.w_dtype = FMLP_DTYPE_F8_E4M3;
            c.per_row_scale = variant != 1;
            c.fp8_all_codes = variant == 2;
            c.norm = variant == 0   ? FMLP_NORM_NONE
                     : variant == 1 ? FMLP_NORM_LAYERNORM
                                    : FMLP_NORM_RMSNORM;
            c.gamma = variant ? FMLP_DTYPE_F32 : kAbsent;
            c.beta = variant == 1 ? c.x_dtype : kAbsent;
            c.b1 = c.b_up = variant == 1 ? FMLP_DTYPE_F32 : kAbsent;
            c.b2 = variant ? c.x_dtype : kAbsent;
            c.residual = variant == 0 ? Residual::kInPlace : kResiduals[(m + variant) % 3];
            if (c.d_out != c.d_in) c.residual = Residual::kNone;
            c.nonfinite = m >= 3 && variant != 1;  // without a norm and with RMSNorm
            c.nan_weights = m == 2 && variant == 1;
            c.deterministic = variant == 0;
            c.data_seed = rng();
            add(c);
          }
      break;
  }
  return v;
}

std::string case_header(Section s, size_t i, const MlpCase& c) {
  return std::string(section_name(s)) + " case #" + std::to_string(i) + " [" + c.name() +
         "] (FMLP_TEST_SEED=" + std::to_string(test_seed()) + ")";
}

std::vector<int> kernel_indices() {
  std::vector<int> v;
  for (int i = 0; i < fmlp_mlp_kernel_count(); ++i) v.push_back(i);
  return v;
}

class KernelTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    kernel_ = fmlp_mlp_kernel_name(GetParam());
    const fmlp_backend_t b = fmlp_mlp_kernel_backend(GetParam());
    device_ = b == FMLP_BACKEND_CUDA;
    if (fmlp_backend_available(b) != FMLP_SUCCESS)
      GTEST_SKIP() << kernel_ << ": backend " << fmlp_backend_name(b)
                   << " is not available here: " << fmlp_last_error();
    if (device_ && !device_unavailable_reason().empty())
      GTEST_SKIP() << kernel_ << ": " << device_unavailable_reason();
  }
  void run_section(Section s);

  const char* kernel_ = nullptr;
  bool device_ = false;
};

void KernelTest::run_section(Section s) {
  const std::vector<MlpCase> cases = section_cases(s);
  int ran = 0, unsupported = 0, failed = 0;
  double worst = 0.0;
  std::string unsupported_why;
  for (size_t i = 0; i < cases.size(); ++i) {
    const MlpCase& c = cases[i];
    PlacedCase p(c, device_);
    const fmlp_status_t sup = fmlp_mlp_kernel_supports(&p.args(), kernel_);
    if (sup == FMLP_ERROR_NOT_SUPPORTED) {
      if (unsupported++ == 0) unsupported_why = fmlp_last_error();
      continue;
    }
    if (sup != FMLP_SUCCESS) {
      ADD_FAILURE() << case_header(s, i, c)
                    << ": a valid case was rejected: " << fmlp_status_name(sup) << ": "
                    << fmlp_last_error();
      continue;
    }
    // FMLP_TEST_TRACE: each case named before it runs, so a case that hangs is the last line.
    static const bool trace = knob_value("FMLP_TEST_TRACE") == "1";
    if (trace) {
      std::printf("[fmlp] %s: running\n", case_header(s, i, c).c_str());
      std::fflush(stdout);
    }
    const CaseData data = make_data(c, c.data_seed);
    p.upload(data);
    Buffer ws;
    const RunOutcome run = run_kernel(p, kernel_, &ws);
    if (run.status != FMLP_SUCCESS) {
      ADD_FAILURE() << case_header(s, i, c) << ": " << fmlp_status_name(run.status) << ": "
                    << run.error;
      continue;
    }
    std::string stray;
    const std::vector<double> out = p.download_y(&stray);
    EXPECT_TRUE(stray.empty()) << case_header(s, i, c) << ": " << stray;
    if (device_) {  // fusedmlp.h: a CUDA workspace's zeroed part is left zero for the next call
      const std::vector<unsigned char> left = ws.download();
      const size_t nz = first_nonzero_in_zeroed_part(left);
      EXPECT_EQ(nz, left.size())
          << case_header(s, i, c) << ": workspace byte " << nz << " of " << left.size()
          << " left nonzero in the zeroed part (the next call would read it)";
    }
    const bool gemm_composed = std::string(kernel_).find("prefill") != std::string::npos;
    const CompareOutcome cmp = compare(c, out, reference(c, data), gemm_composed);
    ++ran;
    worst = std::max(worst, cmp.worst_ratio);
    if (cmp.ok) continue;
    if (++failed <= 8)
      ADD_FAILURE() << case_header(s, i, c) << ": " << cmp.bad << " of " << out.size()
                    << " outputs wrong; " << cmp.detail << "; max |diff| over finite outputs "
                    << cmp.max_err;
  }
  if (failed > 8) ADD_FAILURE() << failed - 8 << " more failing cases not shown";
  std::printf("[fmlp] %s %s: %d of %zu cases ran (%d unsupported), worst err/tol %.3g\n", kernel_,
              section_name(s), ran, cases.size(), unsupported, worst);
  if (ran == 0 && unsupported > 0)
    GTEST_SKIP() << kernel_ << " supports none of the " << cases.size() << " cases of section "
                 << section_name(s) << "; first reason: " << unsupported_why;
}

TEST_P(KernelTest, Shapes) {
  run_section(Section::kShapes);
}
TEST_P(KernelTest, LargeM) {
  run_section(Section::kLargeM);
}
TEST_P(KernelTest, VectorFriendly) {
  run_section(Section::kVectorFriendly);
}
TEST_P(KernelTest, Dtypes) {
  run_section(Section::kDtypes);
}
TEST_P(KernelTest, Epilogue) {
  run_section(Section::kEpilogue);
}
TEST_P(KernelTest, Layout) {
  run_section(Section::kLayout);
}
TEST_P(KernelTest, NonFinite) {
  run_section(Section::kNonFinite);
}
TEST_P(KernelTest, DOutDiffers) {
  run_section(Section::kDOut);
}
TEST_P(KernelTest, Realistic) {
  run_section(Section::kRealistic);
}
TEST_P(KernelTest, Random) {
  run_section(Section::kRandom);
}
TEST_P(KernelTest, Fp8) {
  run_section(Section::kFp8);
}
TEST_P(KernelTest, Fp8Stream) {
  run_section(Section::kFp8Stream);
}

// A kernel that handles none of the grid is a defect (dead code in the op table).
TEST_P(KernelTest, SupportsSomeGridCase) {
  int supported = 0, total = 0;
  std::string why;
  for (Section s : kAllSections)
    for (const MlpCase& c : section_cases(s)) {
      ++total;
      PlacedCase p(c, device_);
      const fmlp_status_t st = fmlp_mlp_kernel_supports(&p.args(), kernel_);
      if (st == FMLP_SUCCESS)
        ++supported;
      else if (st == FMLP_ERROR_NOT_SUPPORTED && why.empty())
        why = fmlp_last_error();
      else if (st != FMLP_ERROR_NOT_SUPPORTED)
        ADD_FAILURE() << "[" << c.name() << "]: " << fmlp_status_name(st) << ": "
                      << fmlp_last_error();
    }
  std::printf("[fmlp] %s supports %d of %d grid cases\n", kernel_, supported, total);
  EXPECT_GT(supported, 0) << kernel_ << " supports none of the " << total
                          << " grid cases; first reason: " << why;
}

// deterministic = 1: two runs on the same input give the same bits.
TEST_P(KernelTest, DeterministicIsBitwiseReproducible) {
  std::vector<MlpCase> cases(3);
  cases[0].m = 16, cases[0].d_in = cases[0].d_out = 256, cases[0].hidden = 1024;
  cases[0].gate = Gate::kStacked, cases[0].act = FMLP_ACT_SILU;
  cases[0].x_dtype = cases[0].w_dtype = FMLP_DTYPE_BF16;
  cases[1].m = 100, cases[1].d_in = cases[1].d_out = 127, cases[1].hidden = 769;
  cases[1].b1 = cases[1].b2 = FMLP_DTYPE_F32, cases[1].residual = Residual::kInPlace;
  cases[2].m = 3, cases[2].d_in = cases[2].d_out = 769, cases[2].hidden = 127;
  cases[2].gate = Gate::kSeparate, cases[2].x_dtype = cases[2].w_dtype = FMLP_DTYPE_F16;
  cases[2].norm = FMLP_NORM_LAYERNORM;
  MlpCase f8;  // fp8 weights split over k slices (the wgmma decode streams' combine order)
  f8.m = 2, f8.d_in = f8.d_out = 256, f8.hidden = 2064;
  f8.gate = Gate::kStacked, f8.act = FMLP_ACT_SILU, f8.per_row_scale = true;
  f8.x_dtype = FMLP_DTYPE_BF16, f8.w_dtype = FMLP_DTYPE_F8_E4M3;
  cases.push_back(f8);
  int ran = 0;
  for (MlpCase& c : cases) {
    c.deterministic = true;
    c.data_seed = mix_seed(test_seed(), uint64_t(ran) + 100);
    PlacedCase p(c, device_);
    if (fmlp_mlp_kernel_supports(&p.args(), kernel_) != FMLP_SUCCESS) continue;
    const CaseData data = make_data(c, c.data_seed);
    std::vector<unsigned char> first;
    for (int rep = 0; rep < 2; ++rep) {
      p.upload(data);
      const RunOutcome run = run_kernel(p, kernel_);
      ASSERT_EQ(run.status, FMLP_SUCCESS) << "[" << c.name() << "]: " << run.error;
      if (rep == 0)
        first = p.y_bytes();
      else
        EXPECT_TRUE(first == p.y_bytes()) << "[" << c.name() << "]: two deterministic runs differ "
                                          << "(FMLP_TEST_SEED=" << test_seed() << ")";
    }
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << kernel_ << " supports none of the determinism cases";
}

// Host kernels give the same bits whatever the thread count (the work split never changes an
// element's summation order).
TEST_P(KernelTest, ThreadCountIndependent) {
  if (device_) GTEST_SKIP() << "host kernels only";
  MlpCase cases[4];
  cases[0].m = 150, cases[0].d_in = cases[0].d_out = 127, cases[0].hidden = 769;
  cases[0].gate = Gate::kStacked, cases[0].act = FMLP_ACT_SILU;
  cases[0].w_dtype = FMLP_DTYPE_BF16, cases[0].norm = FMLP_NORM_RMSNORM;
  cases[1].m = 5, cases[1].d_in = cases[1].d_out = 769, cases[1].hidden = 127;
  cases[1].b1 = cases[1].b2 = FMLP_DTYPE_F32, cases[1].residual = Residual::kInPlace;
  for (MlpCase* c : {&cases[2], &cases[3]}) {  // fp8: row scales, every code
    *c = c == &cases[2] ? cases[0] : cases[1];
    c->w_dtype = FMLP_DTYPE_F8_E4M3, c->per_row_scale = c->fp8_all_codes = true;
  }
  const int threads_before = omp_get_max_threads();
  int ran = 0;
  for (MlpCase& c : cases) {
    c.data_seed = mix_seed(test_seed(), uint64_t(ran) + 200);
    PlacedCase p(c, false);
    if (fmlp_mlp_kernel_supports(&p.args(), kernel_) != FMLP_SUCCESS) continue;
    const CaseData data = make_data(c, c.data_seed);
    std::vector<unsigned char> one;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      p.upload(data);
      const RunOutcome run = run_kernel(p, kernel_);
      ASSERT_EQ(run.status, FMLP_SUCCESS) << "[" << c.name() << "]: " << run.error;
      if (threads == 1)
        one = p.y_bytes();
      else
        EXPECT_TRUE(one == p.y_bytes())
            << "[" << c.name() << "]: " << threads
            << " threads differ from 1 (FMLP_TEST_SEED=" << test_seed() << ")";
    }
    ++ran;
  }
  omp_set_num_threads(threads_before);
  if (ran == 0) GTEST_SKIP() << kernel_ << " supports none of the thread-count cases";
}

// M = 0 succeeds and writes nothing (y's buffer stays 0xFF, or keeps the in-place residual).
TEST_P(KernelTest, ZeroRowsIsNoOp) {
  int ran = 0;
  for (int variant = 0; variant < 4; ++variant) {
    MlpCase c;
    c.m = 0;
    c.d_in = 64, c.hidden = 127, c.d_out = 7;
    c.gate = variant == 1 ? Gate::kStacked : variant == 2 ? Gate::kSeparate : Gate::kDense;
    c.residual = variant == 3 ? Residual::kInPlace : Residual::kSeparate;
    c.misaligned = c.strided = variant >= 2;
    c.x_dtype = kActDtypes[variant % 3];
    PlacedCase p(c, device_);
    if (fmlp_mlp_kernel_supports(&p.args(), kernel_) != FMLP_SUCCESS) continue;
    p.upload(make_data(c, 1));
    size_t ws = 1;
    ASSERT_EQ(fmlp_mlp_kernel_workspace_size(&p.args(), kernel_, &ws), FMLP_SUCCESS);
    EXPECT_EQ(ws, 0u) << "[" << c.name() << "]";
    EXPECT_EQ(fmlp_mlp_with_kernel(&p.args(), kernel_, nullptr, 0, nullptr), FMLP_SUCCESS)
        << "[" << c.name() << "]: " << fmlp_last_error();
    std::string stray;
    p.download_y(&stray);
    EXPECT_TRUE(stray.empty()) << "[" << c.name() << "]: " << stray;
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << kernel_ << " supports none of the M = 0 cases";
}

// The comparison is not vacuous: it flags unwritten (poisoned) output, an error just above the
// tolerance, and a finite value where the reference is NaN.
TEST(Harness, FlagsUnwrittenPerturbedAndNonFiniteMismatches) {
  MlpCase c;
  c.m = 3, c.d_in = 64, c.hidden = 127, c.d_out = 7, c.nonfinite = true;
  const CaseData data = make_data(c, mix_seed(test_seed(), 7));
  const Reference ref = reference(c, data);
  PlacedCase p(c, false);
  p.upload(data);
  ASSERT_EQ(run_kernel(p, "mlp_ref_scalar_fp64").status, FMLP_SUCCESS);
  std::string stray;
  std::vector<double> out = p.download_y(&stray);
  ASSERT_TRUE(compare(c, out, ref).ok);
  p.poison_y();
  EXPECT_FALSE(compare(c, p.download_y(&stray), ref).ok) << "poisoned output passed";
  const size_t e = size_t(2 * c.d_out);  // row 2 is finite
  const double tol = mlp_rtol(c.x_dtype, c.w_dtype) * (std::fabs(ref.y[e]) + ref.scale[e]);
  std::vector<double> bad = out;
  bad[e] += 1.5 * tol;
  EXPECT_FALSE(compare(c, bad, ref).ok) << "an error of 1.5 x tol passed";
  bad = out;
  bad[e] += 0.5 * tol;
  EXPECT_TRUE(compare(c, bad, ref).ok) << "an error of 0.5 x tol failed";
  bad = out;
  ASSERT_TRUE(std::isnan(ref.y[0])) << "row 0 holds a NaN input";
  bad[0] = 0.0;
  EXPECT_FALSE(compare(c, bad, ref).ok) << "a finite value where NaN is expected passed";
}

INSTANTIATE_TEST_SUITE_P(Kernels, KernelTest, ::testing::ValuesIn(kernel_indices()),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(fmlp_mlp_kernel_name(info.param));
                         });

}  // namespace
}  // namespace fmlp_test
