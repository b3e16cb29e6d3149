// Every moe op-table entry against an fp64 reference computed here (routing, experts and combine
// written out independently of src/ref; tolerance rule of tolerance.hpp with the scale of each
// output the l2 norm of the terms summed into it), plus bad input with untouched outputs.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "fusedmlp/fusedmlp.hpp"
#include "mlp_case.hpp"
#include "ref/activation.hpp"
#include "tolerance.hpp"

namespace fmlp_test {
namespace {

using fmlp::detail::load_as_double;
using fmlp::detail::store_from_double;

constexpr size_t kGuard = 64;  // poisoned bytes after every tensor, checked for stray writes

// A contiguous host tensor of up to 3 dims followed by poisoned guard bytes.
struct HostTensor {
  fmlp_dtype_t t = kAbsent;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
  fmlp_tensor_t view = fmlp_tensor_none();

  HostTensor() = default;
  HostTensor(fmlp_dtype_t dt, std::vector<int64_t> s) : t(dt), shape(std::move(s)) {
    bytes.assign(size_t(numel()) * fmlp::dtype_size(t) + kGuard, 0xFF);
    view.data = bytes.data();
    view.dtype = t;
    view.ndim = int32_t(shape.size());
    int64_t stride = 1;
    for (int i = view.ndim - 1; i >= 0; --i) {
      view.shape[i] = shape[size_t(i)];
      view.stride[i] = stride;
      stride *= shape[size_t(i)];
    }
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  void set(int64_t i, double v) { store_from_double(bytes.data(), t, i, v); }
  double get(int64_t i) const { return load_as_double(bytes.data(), t, i); }
  bool guard_intact() const {
    for (size_t i = bytes.size() - kGuard; i < bytes.size(); ++i)
      if (bytes[i] != 0xFF) return false;
    return true;
  }
};

struct MoeCase {
  int64_t t = 1, d = 7, hidden = 9, d_out = 7, e = 4, k = 2;
  fmlp_dtype_t xt = FMLP_DTYPE_F32, wt = FMLP_DTYPE_F32, rt = FMLP_DTYPE_F32;
  fmlp_dtype_t b1 = kAbsent, b2 = kAbsent, rb = kAbsent;
  fmlp_activation_t act = FMLP_ACT_SILU;
  bool gated = false, renorm = true, sigmoid = false;
  int residual = 0;  // 0 none, 1 separate, 2 in place (the very view of y)
  int routing = 0;   // 0 router, 1 random given ids, 2 all to expert e-1, 3 only experts 0 and e/2
  std::string name() const {
    return "T=" + std::to_string(t) + " d=" + std::to_string(d) + " h=" + std::to_string(hidden) +
           " d_out=" + std::to_string(d_out) + " E=" + std::to_string(e) +
           " k=" + std::to_string(k) + " x=" + fmlp_dtype_name(xt) + " w=" + fmlp_dtype_name(wt) +
           (gated ? " gated " : " dense ") + fmlp_activation_name(act) +
           (routing ? " routing=" + std::to_string(routing)
                    : std::string(sigmoid ? " sigmoid" : " softmax") + (renorm ? " renorm" : "")) +
           (residual ? " residual=" + std::to_string(residual) : "") + (b1 ? " b1" : "") +
           (b2 ? " b2" : "") + (rb ? " router_b" : "");
  }
};

// Inputs of one case, filled with random data.
struct MoeData {
  HostTensor x, y, res, rw, rb, w1, b1, w2, b2;
  std::vector<int32_t> ids;
  std::vector<float> wts;
  fmlp_moe_args_t args{};
};

void fill(HostTensor& h, Rng& rng, double scale) {
  std::normal_distribution<double> nd;
  for (int64_t i = 0; i < h.numel(); ++i) h.set(i, nd(rng) * scale);
}

void make(const MoeCase& c, uint64_t seed, MoeData* m) {
  Rng rng(seed);
  const int64_t rows1 = c.gated ? 2 * c.hidden : c.hidden;
  m->x = HostTensor(c.xt, {c.t, c.d});
  m->y = HostTensor(c.xt, {c.t, c.d_out});
  m->w1 = HostTensor(c.wt, {c.e, rows1, c.d});
  m->w2 = HostTensor(c.wt, {c.e, c.d_out, c.hidden});
  fill(m->x, rng, 1.0);
  fill(m->w1, rng, 1.0 / std::sqrt(double(c.d)));
  fill(m->w2, rng, 1.0 / std::sqrt(double(c.hidden)));
  fmlp_moe_args_t& a = m->args;
  a = fmlp_moe_args_t{};
  a.x = m->x.view, a.y = m->y.view, a.w1 = m->w1.view, a.w2 = m->w2.view;
  if (c.b1) m->b1 = HostTensor(c.b1, {c.e, rows1}), fill(m->b1, rng, 0.1), a.b1 = m->b1.view;
  if (c.b2) m->b2 = HostTensor(c.b2, {c.e, c.d_out}), fill(m->b2, rng, 0.1), a.b2 = m->b2.view;
  if (c.residual == 1) m->res = HostTensor(c.xt, {c.t, c.d_out}), fill(m->res, rng, 1.0);
  if (c.residual == 2) fill(m->y, rng, 1.0);  // y holds the residual
  a.residual = c.residual == 1 ? m->res.view : c.residual == 2 ? m->y.view : fmlp_tensor_none();
  if (c.routing == 0) {
    m->rw = HostTensor(c.rt, {c.e, c.d});
    fill(m->rw, rng, 1.0 / std::sqrt(double(c.d)));
    a.router_w = m->rw.view;
    if (c.rb) m->rb = HostTensor(c.rb, {c.e}), fill(m->rb, rng, 0.5), a.router_b = m->rb.view;
  } else {
    std::uniform_real_distribution<double> ud(0.1, 1.0);
    m->ids.resize(size_t(c.t * c.k));
    m->wts.resize(m->ids.size());
    for (size_t i = 0; i < m->ids.size(); ++i) {
      const int64_t j = int64_t(i) % c.k;
      m->ids[i] = c.routing == 2   ? int32_t(c.e - 1)
                  : c.routing == 3 ? int32_t(j % 2 ? c.e / 2 : 0)
                                   : int32_t(rng() % uint64_t(c.e));
      m->wts[i] = float(ud(rng));
    }
    a.topk_ids = m->ids.data();
    a.topk_weights = m->wts.data();
  }
  a.config = fmlp_moe_config_default(int32_t(c.e), int32_t(c.k));
  a.config.activation = c.act;
  a.config.gated = c.gated;
  a.config.scoring = c.sigmoid ? FMLP_MOE_SCORING_SIGMOID : FMLP_MOE_SCORING_SOFTMAX;
  a.config.renormalize = c.renorm;
}

// The reference, written from the spec in fusedmlp.h: ref[t*d_out + o] and the l2 norm of the
// terms summed into it (magnitudes of h propagated through both layers).
void reference(const MoeCase& c, const MoeData& m, const std::vector<double>& residual,
               std::vector<double>* ref, std::vector<double>* scale) {
  ref->assign(size_t(c.t * c.d_out), 0.0);
  scale->assign(ref->size(), 0.0);
  std::vector<double> h(size_t(c.hidden)), hmag(size_t(c.hidden));
  for (int64_t t = 0; t < c.t; ++t) {
    std::vector<int64_t> ids(size_t(c.k));
    std::vector<double> w(size_t(c.k));
    if (c.routing) {
      for (int64_t j = 0; j < c.k; ++j)
        ids[size_t(j)] = m.ids[size_t(t * c.k + j)], w[size_t(j)] = m.wts[size_t(t * c.k + j)];
    } else {
      std::vector<double> s(size_t(c.e));
      for (int64_t e = 0; e < c.e; ++e) {
        double acc = c.rb ? m.rb.get(e) : 0.0;
        for (int64_t i = 0; i < c.d; ++i) acc += m.rw.get(e * c.d + i) * m.x.get(t * c.d + i);
        s[size_t(e)] = acc;
      }
      if (c.sigmoid) {
        for (double& v : s) v = 1.0 / (1.0 + std::exp(-v));
      } else {
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0.0;
        for (double& v : s) sum += (v = std::exp(v - mx));
        for (double& v : s) v /= sum;
      }
      std::vector<int64_t> order(size_t(c.e));
      for (int64_t e = 0; e < c.e; ++e) order[size_t(e)] = e;
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t p, int64_t q) { return s[size_t(p)] > s[size_t(q)]; });
      double sum = 0.0;
      for (int64_t j = 0; j < c.k; ++j)
        ids[size_t(j)] = order[size_t(j)], sum += (w[size_t(j)] = s[size_t(order[size_t(j)])]);
      if (c.renorm)
        for (double& v : w) v /= sum;
    }
    for (int64_t o = 0; o < c.d_out; ++o) {
      const double r = c.residual ? residual[size_t(t * c.d_out + o)] : 0.0;
      (*ref)[size_t(t * c.d_out + o)] = r;
      (*scale)[size_t(t * c.d_out + o)] = r * r;
    }
    const int64_t rows1 = c.gated ? 2 * c.hidden : c.hidden;
    for (int64_t j = 0; j < c.k; ++j) {
      const int64_t e = ids[size_t(j)];
      auto layer1 = [&](int64_t r, double* mag) {
        double acc = c.b1 ? m.b1.get(e * rows1 + r) : 0.0, l2 = acc * acc;
        for (int64_t i = 0; i < c.d; ++i) {
          const double p = m.w1.get((e * rows1 + r) * c.d + i) * m.x.get(t * c.d + i);
          acc += p, l2 += p * p;
        }
        *mag = std::sqrt(l2);
        return acc;
      };
      for (int64_t r = 0; r < c.hidden; ++r) {
        double gm, um = 0.0;
        const double g = layer1(r, &gm), u = c.gated ? layer1(c.hidden + r, &um) : 1.0;
        const double ag = fmlp::ref::activate(c.act, g);
        h[size_t(r)] = c.gated ? ag * u : ag;
        hmag[size_t(r)] = c.gated ? 1.2 * gm * std::fabs(u) + std::fabs(ag) * um + std::fabs(ag)
                                  : 1.2 * gm + std::fabs(ag);
      }
      for (int64_t o = 0; o < c.d_out; ++o) {
        double acc = c.b2 ? m.b2.get(e * c.d_out + o) : 0.0, l2 = acc * acc;
        for (int64_t i = 0; i < c.hidden; ++i) {
          const double wv = m.w2.get((e * c.d_out + o) * c.hidden + i);
          acc += wv * h[size_t(i)];
          l2 += wv * hmag[size_t(i)] * wv * hmag[size_t(i)];
        }
        const double wj = w[size_t(j)];
        (*ref)[size_t(t * c.d_out + o)] += wj * acc;
        (*scale)[size_t(t * c.d_out + o)] += wj * wj * l2;
      }
    }
  }
  for (double& s : *scale) s = std::sqrt(s);
}

std::string run_case(const MoeCase& c, const char* kernel, uint64_t seed,
                     std::vector<unsigned char>* y_bytes = nullptr) {
  MoeData m;
  make(c, seed, &m);
  std::vector<double> residual;
  const HostTensor& r = c.residual == 2 ? m.y : m.res;
  for (int64_t i = 0; c.residual && i < c.t * c.d_out; ++i) residual.push_back(r.get(i));
  if (fmlp_moe_kernel_supports(&m.args, kernel) != FMLP_SUCCESS)
    return std::string("skipped: ") + fmlp_last_error();
  size_t bytes = 0;
  if (fmlp_moe_kernel_workspace_size(&m.args, kernel, &bytes) != FMLP_SUCCESS)
    return fmlp_last_error();
  std::vector<unsigned char> ws(bytes + 1);
  if (const fmlp_status_t s = fmlp_moe_with_kernel(&m.args, kernel, ws.data(), bytes, nullptr);
      s != FMLP_SUCCESS)
    return std::string(fmlp_status_name(s)) + ": " + fmlp_last_error();
  if (!m.y.guard_intact()) return "bytes after y were written";
  if (y_bytes) *y_bytes = m.y.bytes;
  std::vector<double> ref, scale;
  reference(c, m, residual, &ref, &scale);
  const double rtol = mlp_rtol(c.xt, c.wt);
  int bad = 0;
  std::string first;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double out = m.y.get(int64_t(i));
    const ElementCheck e = check_element(out, ref[i], scale[i], rtol, c.xt);
    if (!e.ok && bad++ == 0)
      first = "y[" + std::to_string(int64_t(i) / c.d_out) + "][" +
              std::to_string(int64_t(i) % c.d_out) + "] = " + std::to_string(out) + ", ref " +
              std::to_string(ref[i]) + ": " + e.why;
  }
  return bad ? std::to_string(bad) + " wrong outputs; first " + first : "";
}

std::vector<MoeCase> cases() {
  std::vector<MoeCase> v;
  Rng rng(test_seed());
  const fmlp_dtype_t types[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16};
  const auto pick = [&] { return types[rng() % 3]; };
  const auto size = [&] { return int64_t(7 + rng() % 121); };  // 7..127
  for (int64_t t : {1, 7, 33})
    for (int64_t e : {1, 4, 8})
      for (int64_t k : {int64_t(1), int64_t(2), e}) {
        if (k > e) continue;
        MoeCase c;
        c.t = t, c.e = e, c.k = k;
        c.d = size(), c.hidden = size(), c.d_out = rng() % 2 ? c.d : size();
        c.xt = pick(), c.wt = pick(), c.rt = pick();
        c.b1 = rng() % 2 ? pick() : kAbsent;
        c.b2 = rng() % 2 ? pick() : kAbsent;
        c.rb = rng() % 2 ? pick() : kAbsent;
        c.act = fmlp_activation_t(rng() % 4);
        c.gated = rng() % 2;
        c.renorm = rng() % 2;
        c.sigmoid = rng() % 3 == 0;
        c.residual = int(rng() % 3);
        c.routing = rng() % 3 == 0 ? 1 : 0;
        v.push_back(c);
      }
  for (int routing : {2, 3})  // every slot on one expert; most experts without tokens
    for (bool gated : {false, true}) {
      MoeCase c;
      c.t = 33, c.e = 8, c.k = 2, c.d = 31, c.hidden = 45, c.d_out = 17;
      c.routing = routing, c.gated = gated, c.residual = gated ? 2 : 1;
      c.xt = FMLP_DTYPE_BF16, c.wt = FMLP_DTYPE_BF16;
      v.push_back(c);
    }
  for (bool renorm : {false, true}) {  // sigmoid scoring, with and without renormalisation
    MoeCase c;
    c.t = 7, c.e = 8, c.k = 2, c.d = 64, c.hidden = 96, c.d_out = 64;
    c.sigmoid = true, c.renorm = renorm, c.gated = true, c.rb = FMLP_DTYPE_F32;
    v.push_back(c);
  }
  return v;
}

class MoeVsRef : public ::testing::TestWithParam<int> {};

TEST_P(MoeVsRef, AllCases) {
  const char* kernel = fmlp_moe_kernel_name(GetParam());
  int skipped = 0, n = 0;
  for (const MoeCase& c : cases()) {
    const std::string err = run_case(c, kernel, test_seed() + uint64_t(n++));
    if (err.rfind("skipped: ", 0) == 0) {
      ++skipped;
      continue;
    }
    EXPECT_EQ(err, "") << kernel << " " << c.name();
  }
  if (skipped == n) GTEST_SKIP() << kernel << " handles none of the cases here";
}

INSTANTIATE_TEST_SUITE_P(Kernels, MoeVsRef, ::testing::Range(0, fmlp_moe_kernel_count()),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(fmlp_moe_kernel_name(i.param));
                         });

TEST(Moe, CpuIsBitwiseReproducibleAcrossThreadCounts) {
  if (fmlp_backend_available(FMLP_BACKEND_CPU) != FMLP_SUCCESS) GTEST_SKIP() << fmlp_last_error();
  MoeCase c;
  c.t = 33, c.e = 8, c.k = 2, c.d = 100, c.hidden = 120, c.d_out = 100, c.gated = true;
  std::vector<unsigned char> one, many;
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  EXPECT_EQ(run_case(c, "moe_cpu_avx2_grouped", 7, &one), "");
  omp_set_num_threads(std::max(threads, 4));
  EXPECT_EQ(run_case(c, "moe_cpu_avx2_grouped", 7, &many), "");
  omp_set_num_threads(threads);
  EXPECT_EQ(one, many);
}

TEST(Moe, CppWrapperAndExplain) {
  MoeCase c;
  c.t = 7, c.e = 4, c.k = 2;
  MoeData m;
  make(c, 3, &m);
  EXPECT_NO_THROW(fmlp::moe(m.args));
  size_t needed = 0;
  ASSERT_EQ(fmlp_moe_explain(&m.args, FMLP_BACKEND_REF, nullptr, 0, &needed), FMLP_SUCCESS);
  std::string s(needed, '\0');
  ASSERT_EQ(fmlp_moe_explain(&m.args, FMLP_BACKEND_REF, s.data(), s.size(), &needed), FMLP_SUCCESS);
  EXPECT_NE(s.find("chosen   moe_ref_scalar_fp64"), std::string::npos) << s;
  EXPECT_NE(s.find("E=4 k=2"), std::string::npos) << s;
  m.args.config.top_k = 5;
  EXPECT_THROW(fmlp::moe(m.args), fmlp::Error);
}

// Each bad input: the status, words the message must contain, and y left untouched.
struct BadCase {
  const char* what;
  std::function<void(MoeData&)> spoil;
  fmlp_status_t status;
  std::vector<std::string> words;
};

TEST(Moe, BadInputNamesTheArgumentAndLeavesYUntouched) {
  MoeCase c;
  c.t = 7, c.e = 4, c.k = 2, c.d = 9, c.hidden = 11, c.d_out = 9;
  MoeCase given = c;
  given.routing = 1;
  const std::vector<std::pair<MoeCase, BadCase>> bad = {
      {c,
       {"k > E",
        [](MoeData& m) { m.args.config.top_k = 5; },
        FMLP_ERROR_INVALID_VALUE,
        {"top_k is 5", "num_experts is 4"}}},
      {c,
       {"k = 0", [](MoeData& m) { m.args.config.top_k = 0; }, FMLP_ERROR_INVALID_VALUE, {"top_k"}}},
      {given,
       {"id too large",
        [](MoeData& m) { m.ids[3 * 2 + 1] = 4; },
        FMLP_ERROR_INDEX_OUT_OF_RANGE,
        {"token 3", "is 4", "[0, 4)"}}},
      {given,
       {"negative id",
        [](MoeData& m) { m.ids[0] = -1; },
        FMLP_ERROR_INDEX_OUT_OF_RANGE,
        {"token 0", "is -1"}}},
      {given,
       {"ids without weights",
        [](MoeData& m) { m.args.topk_weights = nullptr; },
        FMLP_ERROR_NULL_POINTER,
        {"topk_weights"}}},
      {c,
       {"no routing",
        [](MoeData& m) { m.args.router_w = fmlp_tensor_none(); },
        FMLP_ERROR_NULL_POINTER,
        {"router_w"}}},
      {c,
       {"null x",
        [](MoeData& m) { m.args.x = fmlp_tensor_none(); },
        FMLP_ERROR_NULL_POINTER,
        {"x is absent"}}},
      {c,
       {"null w2",
        [](MoeData& m) { m.args.w2 = fmlp_tensor_none(); },
        FMLP_ERROR_NULL_POINTER,
        {"w2"}}},
      {c,
       {"w1 inner dim",
        [](MoeData& m) { m.args.w1.shape[2] = 8; },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"w1"}}},
      {c,
       {"experts vs E",
        [](MoeData& m) { m.args.w2.shape[0] = 3; },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"w2"}}},
      {c,
       {"y rows",
        [](MoeData& m) { m.args.y.shape[0] = 6; },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"y must have shape"}}},
      {c,
       {"router shape",
        [](MoeData& m) { m.args.router_w.shape[0] = 3; },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"router_w"}}},
      {c,
       {"fp8 experts",
        [](MoeData& m) { m.args.w1.dtype = m.args.w2.dtype = FMLP_DTYPE_F8_E4M3; },
        FMLP_ERROR_NOT_SUPPORTED,
        {"fp8"}}},
      {c,
       {"y overlaps x",
        [](MoeData& m) { m.args.y.data = m.args.x.data; },
        FMLP_ERROR_ALIASING,
        {"y overlaps x"}}},
      {c,
       {"bad scoring",
        [](MoeData& m) { m.args.config.scoring = fmlp_moe_scoring_t(7); },
        FMLP_ERROR_INVALID_VALUE,
        {"config.scoring"}}},
  };
  for (const auto& [mc, b] : bad)
    for (fmlp_backend_t backend : {FMLP_BACKEND_REF, FMLP_BACKEND_AUTO}) {
      MoeData m;
      make(mc, 11, &m);
      b.spoil(m);
      const std::vector<unsigned char> before = m.y.bytes;
      std::vector<unsigned char> ws(1 << 20);
      const fmlp_status_t s = fmlp_moe(&m.args, backend, ws.data(), ws.size(), nullptr);
      EXPECT_EQ(s, b.status) << b.what << ": " << fmlp_last_error();
      const std::string msg = fmlp_last_error();
      for (const std::string& w : b.words)
        EXPECT_NE(msg.find(w), std::string::npos) << b.what << ": '" << w << "' not in: " << msg;
      EXPECT_EQ(m.y.bytes, before) << b.what << ": y was written";
    }
  EXPECT_EQ(fmlp_moe(nullptr, FMLP_BACKEND_REF, nullptr, 0, nullptr), FMLP_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fmlp_last_error()).find("args"), std::string::npos);
}

TEST(Moe, ZeroTokensIsANoOp) {
  MoeCase c;
  c.t = 0;
  MoeData m;
  make(c, 5, &m);
  size_t bytes = 1;
  ASSERT_EQ(fmlp_moe_workspace_size(&m.args, FMLP_BACKEND_AUTO, &bytes), FMLP_SUCCESS)
      << fmlp_last_error();
  EXPECT_EQ(bytes, 0u);
  EXPECT_EQ(fmlp_moe(&m.args, FMLP_BACKEND_AUTO, nullptr, 0, nullptr), FMLP_SUCCESS);
}

}  // namespace
}  // namespace fmlp_test
