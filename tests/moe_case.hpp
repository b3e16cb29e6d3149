// The moe test machinery shared by test_moe.cpp and test_moe_ep.cpp: host tensors with poisoned
// guards, random cases, the fp64 reference written from the spec in fusedmlp.h (independent of
// src/ref), the output check, and the same case copied to device memory.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "buffers.hpp"
#include "mlp_case.hpp"
#include "op_tensor.hpp"
#include "ref/activation.hpp"
#include "tolerance.hpp"

namespace fmlp_test {

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
  bool gated = false, renorm = true, sigmoid = false, deterministic = true;
  bool round = false;  // config.round_router_logits (takes effect with 16-bit x)
  int residual = 0;    // 0 none, 1 separate, 2 in place (the very view of y)
  int routing = 0;  // 0 router, 1 random given ids, 2 all to expert e-1, 3 only experts 0 and e/2,
                    // 4 expert i gets exactly slots[i] of the t*k slots (given ids, shuffled)
  std::vector<int64_t> slots;  // routing 4: sums to t*k
  bool fp8_rows = true;        // wt == F8_E4M3: scales [E, rows] (per row) or [E] (per expert)
  // wt == F8_E4M3: 128 x 128 block scales [E, row blocks, col blocks] instead (gated W1: the
  // gate half and the up half quantised apart, their block rows concatenated, fusedmlp.h)
  bool fp8_block = false;
  int64_t expert_pad = 0;  // 16-bit experts: W1 and W2 keep this many unused (random) rows after
                           // each expert, so the experts are not one matrix each
  bool pad_rows = false;   // 16-bit experts: W1 and W2 rows padded with NaN past d and hidden to
                           // whole 16-byte chunks (row stride a multiple of 8): never to count
  std::string name() const {
    return "T=" + std::to_string(t) + " d=" + std::to_string(d) + " h=" + std::to_string(hidden) +
           " d_out=" + std::to_string(d_out) + " E=" + std::to_string(e) +
           " k=" + std::to_string(k) + " x=" + fmlp_dtype_name(xt) + " w=" + fmlp_dtype_name(wt) +
           (gated ? " gated " : " dense ") + fmlp_activation_name(act) +
           (routing ? " routing=" + std::to_string(routing)
                    : std::string(sigmoid ? " sigmoid" : " softmax") + (renorm ? " renorm" : "")) +
           (residual ? " residual=" + std::to_string(residual) : "") + (b1 ? " b1" : "") +
           (b2 ? " b2" : "") + (rb ? " router_b" : "") + (deterministic ? "" : " nondet") +
           (round ? " round-logits" : "") +
           (wt == FMLP_DTYPE_F8_E4M3 ? (fp8_block  ? " block-scales"
                                        : fp8_rows ? " row-scales"
                                                   : " expert-scales")
                                     : "") +
           (expert_pad ? " expert-pad=" + std::to_string(expert_pad) : "") +
           (pad_rows ? " padded-rows" : "");
  }
};

// Inputs of one case, filled with random data.
struct MoeData {
  HostTensor x, y, res, rw, rb, w1, b1, w2, b2, s1, s2;  // s1, s2: fp8 scales
  std::vector<int32_t> ids;
  std::vector<float> wts;
  fmlp_moe_args_t args{};
};

inline void fill(HostTensor& h, Rng& rng, double scale) {
  std::normal_distribution<double> nd;
  for (int64_t i = 0; i < h.numel(); ++i) h.set(i, nd(rng) * scale);
}

inline void make(const MoeCase& c, uint64_t seed, MoeData* m) {
  Rng rng(seed);
  const int64_t rows1 = c.gated ? 2 * c.hidden : c.hidden;
  m->x = HostTensor(c.xt, {c.t, c.d});
  m->y = HostTensor(c.xt, {c.t, c.d_out});
  fill(m->x, rng, 1.0);
  // fp8 experts: random fp32 weights quantised expert by expert with the library's quantiser.
  const auto weights = [&](HostTensor* w, HostTensor* s, int64_t rows, int64_t cols, int halves) {
    const double sd = 1.0 / std::sqrt(double(cols));
    if (c.wt != FMLP_DTYPE_F8_E4M3) {
      const int64_t ld = c.pad_rows ? (cols + 7) / 8 * 8 : cols;
      *w = HostTensor(c.wt, {c.e, rows + c.expert_pad, ld});
      fill(*w, rng, sd);
      for (int64_t r = 0; r < c.e * (rows + c.expert_pad); ++r)
        for (int64_t i = cols; i < ld; ++i) w->set(r * ld + i, NAN);
      w->view.shape[1] = rows;  // the expert stride keeps the padding rows
      w->view.shape[2] = cols;  // and the row stride the padding columns
      return;
    }
    EXPECT_TRUE(c.expert_pad == 0 && !c.pad_rows) << "expert_pad, pad_rows: 16-bit experts only";
    *w = HostTensor(c.wt, {c.e, rows, cols});
    HostTensor f(FMLP_DTYPE_F32, {c.e, rows, cols});
    fill(f, rng, sd);
    if (c.fp8_block) {
      const int64_t half = rows / halves, rb = (half + 127) / 128, cb = (cols + 127) / 128;
      *s = HostTensor(FMLP_DTYPE_F32, {c.e, halves * rb, cb});
      for (int64_t e = 0; e < c.e; ++e)
        for (int64_t p = 0; p < halves; ++p) {
          const int64_t r0 = e * rows + p * half;
          const fmlp_tensor_t fe =
              fmlp_tensor_2d(f.bytes.data() + r0 * cols * 4, FMLP_DTYPE_F32, half, cols, cols);
          const fmlp_tensor_t qe =
              fmlp_tensor_2d(w->bytes.data() + r0 * cols, c.wt, half, cols, cols);
          const fmlp_tensor_t se = fmlp_tensor_2d(s->bytes.data() + (e * halves + p) * rb * cb * 4,
                                                  FMLP_DTYPE_F32, rb, cb, cb);
          EXPECT_EQ(fmlp_quantize_fp8(&fe, &qe, &se, nullptr), FMLP_SUCCESS) << fmlp_last_error();
        }
      return;
    }
    *s = c.fp8_rows ? HostTensor(FMLP_DTYPE_F32, {c.e, rows}) : HostTensor(FMLP_DTYPE_F32, {c.e});
    for (int64_t e = 0; e < c.e; ++e) {
      const fmlp_tensor_t fe =
          fmlp_tensor_2d(f.bytes.data() + e * rows * cols * 4, FMLP_DTYPE_F32, rows, cols, cols);
      const fmlp_tensor_t qe =
          fmlp_tensor_2d(w->bytes.data() + e * rows * cols, c.wt, rows, cols, cols);
      const int64_t n = c.fp8_rows ? rows : 1;
      const fmlp_tensor_t se = fmlp_tensor_1d(s->bytes.data() + e * n * 4, FMLP_DTYPE_F32, n);
      EXPECT_EQ(fmlp_quantize_fp8(&fe, &qe, &se, nullptr), FMLP_SUCCESS) << fmlp_last_error();
    }
  };
  weights(&m->w1, &m->s1, rows1, c.d, c.gated ? 2 : 1);
  weights(&m->w2, &m->s2, c.d_out, c.hidden, 1);
  fmlp_moe_args_t& a = m->args;
  a = fmlp_moe_args_t{};
  a.x = m->x.view, a.y = m->y.view, a.w1 = m->w1.view, a.w2 = m->w2.view;
  if (m->s1.t != kAbsent) a.w1_scale = m->s1.view, a.w2_scale = m->s2.view;
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
    std::vector<int32_t> dealt;  // routing 4: the ids in some order
    for (size_t e = 0; c.routing == 4 && e < c.slots.size(); ++e)
      dealt.insert(dealt.end(), size_t(c.slots[e]), int32_t(e));
    std::shuffle(dealt.begin(), dealt.end(), rng);
    m->ids.resize(size_t(c.t * c.k));
    m->wts.resize(m->ids.size());
    for (size_t i = 0; i < m->ids.size(); ++i) {
      const int64_t j = int64_t(i) % c.k;
      m->ids[i] = c.routing == 4   ? dealt.at(i)
                  : c.routing == 2 ? int32_t(c.e - 1)
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
  a.config.deterministic = c.deterministic;
  a.config.round_router_logits = c.round;
}

// Experts [first, first + count) of the case's c.e (count < 0: all of them): what one rank holds
// under expert parallelism; `residual`: this range's output carries the residual.
struct ExpertRange {
  int64_t first = 0, count = -1;
  bool residual = true;
  bool holds(int64_t e) const { return count < 0 || (e >= first && e < first + count); }
};

inline bool rounds_logits(const MoeCase& c) {
  return c.round && !c.routing && (c.xt == FMLP_DTYPE_BF16 || c.xt == FMLP_DTYPE_F16);
}

// The reference, written from the spec in fusedmlp.h: ref[t*d_out + o] and the l2 norm of the
// terms summed into it (magnitudes of h propagated through both layers).
// *near_tie (optional) marks tokens whose k-th and (k+1)-th router scores are within 1e-4 of each
// other (relative): an fp32 router may pick either expert there, so device results skip them.
// range (expert parallelism): only the slots of experts in it add, the residual only when it has
// it; the routing is over all c.e experts as before.
inline void reference(const MoeCase& c, const MoeData& m, const std::vector<double>& residual,
                      std::vector<double>* ref, std::vector<double>* scale,
                      std::vector<char>* near_tie = nullptr, const ExpertRange& range = {}) {
  if (near_tie) near_tie->assign(size_t(c.t), 0);
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
      std::vector<double> logit(size_t(c.e));
      std::vector<char> at_midpoint(size_t(c.e), 0);  // the device may round to the neighbour
      for (int64_t e = 0; e < c.e; ++e) {
        double acc = c.rb ? m.rb.get(e) : 0.0, mag = std::fabs(acc);
        for (int64_t i = 0; i < c.d; ++i) {
          const double term = m.rw.get(e * c.d + i) * m.x.get(t * c.d + i);
          acc += term, mag += std::fabs(term);
        }
        // round_router_logits: the logit as a 16-bit nn.Linear router stores it
        s[size_t(e)] = logit[size_t(e)] =
            rounds_logits(c) ? fmlp::detail::round_to_dtype(acc, c.xt) : acc;
        if (rounds_logits(c)) {
          // fp32 summation error stays far below 2^-22 of the sum of |terms| (about 48x margin
          // at d = 256); within that of a rounding midpoint the device may store the neighbour.
          const double slack = std::ldexp(mag, -22);
          at_midpoint[size_t(e)] = fmlp::detail::round_to_dtype(acc - slack, c.xt) !=
                                   fmlp::detail::round_to_dtype(acc + slack, c.xt);
        }
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
      if (near_tie && c.k < c.e) {
        const double a = s[size_t(order[size_t(c.k - 1)])], b = s[size_t(order[size_t(c.k)])];
        bool tie = a - b <= 1e-4 * std::fabs(a);
        if (rounds_logits(c)) {
          // The device rounds the same logits unless one sits at a rounding midpoint, where it
          // may store the neighbour, one ulp away: that matters for the selected experts (their
          // weights) and for any that one ulp could lift into the top k. Equal rounded logits
          // give equal scores and both sides send the tie to the lower id: checked, not skipped.
          const double kth = logit[size_t(order[size_t(c.k - 1)])];
          const double ulp = std::ldexp(std::fabs(kth), c.xt == FMLP_DTYPE_BF16 ? -7 : -10);
          tie = false;
          for (int64_t e = 0; e < c.e; ++e)
            tie |= at_midpoint[size_t(e)] && logit[size_t(e)] >= kth - 2 * ulp;
        }
        (*near_tie)[size_t(t)] = tie;
      }
      double sum = 0.0;
      for (int64_t j = 0; j < c.k; ++j)
        ids[size_t(j)] = order[size_t(j)], sum += (w[size_t(j)] = s[size_t(order[size_t(j)])]);
      if (c.renorm)
        for (double& v : w) v /= sum;
    }
    for (int64_t o = 0; o < c.d_out; ++o) {
      const double r = c.residual && range.residual ? residual[size_t(t * c.d_out + o)] : 0.0;
      (*ref)[size_t(t * c.d_out + o)] = r;
      (*scale)[size_t(t * c.d_out + o)] = r * r;
    }
    const int64_t rows1 = c.gated ? 2 * c.hidden : c.hidden;
    for (int64_t j = 0; j < c.k; ++j) {
      const int64_t e = ids[size_t(j)];
      if (!range.holds(e)) continue;
      // fp8 experts: the weights as fmlp_moe dequantises them, code * scale.
      // Block scales: [E, halves * ceil(rows / halves / 128), ceil(cols / 128)].
      const auto scale_of = [&](const HostTensor& sc, int64_t rows, int64_t r, int64_t i,
                                int halves) {
        if (sc.t == kAbsent) return 1.0;
        if (sc.shape.size() == 3) {
          const int64_t half = rows / halves, br = r / half * ((half + 127) / 128) + r % half / 128;
          return sc.get((e * sc.shape[1] + br) * sc.shape[2] + i / 128);
        }
        return sc.shape.size() == 2 ? sc.get(e * rows + r) : sc.get(e);
      };
      auto layer1 = [&](int64_t r, double* mag) {
        double acc = c.b1 ? m.b1.get(e * rows1 + r) : 0.0, l2 = acc * acc;
        for (int64_t i = 0; i < c.d; ++i) {
          const double s1 = scale_of(m.s1, rows1, r, i, c.gated ? 2 : 1);
          const double p = m.w1.get(e * m.w1.view.stride[0] + r * m.w1.view.stride[1] + i) * s1 *
                           m.x.get(t * c.d + i);
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
          const double wv = m.w2.get(e * m.w2.view.stride[0] + o * m.w2.view.stride[1] + i) *
                            scale_of(m.s2, c.d_out, o, i, 1);
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

// m.y against the reference; rows in nan_rows must be all NaN (device ids out of range) and are
// left out of the reference, as are near-tie tokens when the router ran in fp32 (device).
inline std::string check_y(const MoeCase& c, const MoeData& m, const std::vector<double>& residual,
                           const std::vector<int64_t>& nan_rows, bool fp32_router = false,
                           const ExpertRange& range = {}) {
  std::vector<double> ref, scale;
  std::vector<char> near_tie;
  reference(c, m, residual, &ref, &scale, &near_tie, range);
  const double rtol = mlp_rtol(c.xt, c.wt);
  int bad = 0, ties = 0;
  std::string first;
  for (int64_t t = 0; t < c.t; ++t) {
    const bool nan_row = std::find(nan_rows.begin(), nan_rows.end(), t) != nan_rows.end();
    if (!nan_row && fp32_router && near_tie[size_t(t)]) {
      ++ties;
      continue;
    }
    for (int64_t o = 0; o < c.d_out; ++o) {
      const size_t i = size_t(t * c.d_out + o);
      const double out = m.y.get(int64_t(i));
      const ElementCheck e = nan_row ? ElementCheck{std::isnan(out), 0, 0, "expected a NaN row"}
                                     : check_element(out, ref[i], scale[i], rtol, c.xt);
      if (!e.ok && bad++ == 0)
        first = "y[" + std::to_string(t) + "][" + std::to_string(o) + "] = " + std::to_string(out) +
                ", ref " + std::to_string(ref[i]) + ": " + e.why;
    }
  }
  if (ties * 10 > c.t + 10)
    return std::to_string(ties) + " near-tie tokens: the case checks little";
  return bad ? std::to_string(bad) + " wrong outputs; first " + first : "";
}

// Runs `kernel` on host data m (made by make(), maybe edited since) and checks y against the
// reference: "", "skipped: " + why when the entry declines the call, or what failed.
inline std::string run_host(const MoeCase& c, MoeData& m, const char* kernel,
                            std::vector<unsigned char>* y_bytes = nullptr) {
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
  return check_y(c, m, residual, {});
}

// A case's tensors copied into device buffers (guard bytes included) and its args pointing there.
class DeviceCase {
 public:
  DeviceCase(const MoeCase& c, const MoeData& m) {
    const auto alloc = [](const HostTensor& h) {
      return h.t == kAbsent ? Buffer() : Buffer(h.bytes.size(), true);
    };
    const auto view = [](const HostTensor& h, const Buffer& b) {
      if (h.t == kAbsent) return fmlp_tensor_none();
      fmlp_tensor_t v = h.view;
      v.data = b.data();
      v.device_type = FMLP_DEVICE_CUDA;
      return v;
    };
    const HostTensor* host[] = {&m.x,  &m.y,  &m.res, &m.rw, &m.rb, &m.w1,
                                &m.b1, &m.w2, &m.b2,  &m.s1, &m.s2};
    for (int i = 0; i < kBuffers; ++i) buf_[i] = alloc(*host[i]);
    args_ = m.args;
    args_.x = view(m.x, buf_[0]), args_.y = view(m.y, buf_[1]);
    args_.residual = c.residual == 1   ? view(m.res, buf_[2])
                     : c.residual == 2 ? args_.y
                                       : args_.residual;
    args_.router_w = view(m.rw, buf_[3]), args_.router_b = view(m.rb, buf_[4]);
    args_.w1 = view(m.w1, buf_[5]), args_.b1 = view(m.b1, buf_[6]);
    args_.w2 = view(m.w2, buf_[7]), args_.b2 = view(m.b2, buf_[8]);
    args_.w1_scale = view(m.s1, buf_[9]), args_.w2_scale = view(m.s2, buf_[10]);
    if (!m.ids.empty()) {
      ids_ = Buffer(m.ids.size() * 4, true), wts_ = Buffer(m.wts.size() * 4, true);
      args_.topk_ids = static_cast<const int32_t*>(ids_.data());
      args_.topk_weights = static_cast<const float*>(wts_.data());
    }
    upload(m);
  }
  // Every input (and y) from m into the same buffers, ids optionally replaced.
  void upload(const MoeData& m, const std::vector<int32_t>* ids = nullptr) {
    const HostTensor* host[] = {&m.x,  &m.y,  &m.res, &m.rw, &m.rb, &m.w1,
                                &m.b1, &m.w2, &m.b2,  &m.s1, &m.s2};
    for (int i = 0; i < kBuffers; ++i)
      if (host[i]->t != kAbsent) buf_[i].upload(host[i]->bytes);
    if (m.ids.empty()) return;
    const std::vector<int32_t>& id = ids ? *ids : m.ids;
    std::vector<unsigned char> b(id.size() * 4), w(m.wts.size() * 4);
    std::memcpy(b.data(), id.data(), b.size());
    std::memcpy(w.data(), m.wts.data(), w.size());
    ids_.upload(b), wts_.upload(w);
  }
  std::vector<unsigned char> y_bytes() const { return buf_[1].download(); }
  const fmlp_moe_args_t& args() const { return args_; }

 private:
  static constexpr int kBuffers = 11;
  Buffer buf_[kBuffers], ids_, wts_;
  fmlp_moe_args_t args_{};
};

inline std::vector<double> residual_of(const MoeCase& c, const MoeData& m) {
  std::vector<double> r;
  const HostTensor& h = c.residual == 2 ? m.y : m.res;
  for (int64_t i = 0; c.residual && i < c.t * c.d_out; ++i) r.push_back(h.get(i));
  return r;
}

inline std::vector<const char*> cuda_moe_kernels() {
  std::vector<const char*> v;
  for (int i = 0; i < fmlp_moe_kernel_count(); ++i)
    if (fmlp_moe_kernel_backend(i) == FMLP_BACKEND_CUDA) v.push_back(fmlp_moe_kernel_name(i));
  return v;
}

// A bad-input case: spoil(m) breaks valid args; the call must fail with `status`, its message
// must hold every one of `words`, and y must keep its poison.
struct BadCase {
  const char* what;
  std::function<void(MoeData&)> spoil;
  fmlp_status_t status;
  std::vector<std::string> words;
};

// Makes c's data, spoils it as b says and checks the rejection on the ref backend and through
// dispatch.
inline void expect_rejected(const MoeCase& c, const BadCase& b) {
  for (fmlp_backend_t backend : {FMLP_BACKEND_REF, FMLP_BACKEND_AUTO}) {
    MoeData m;
    make(c, 11, &m);
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
}

}  // namespace fmlp_test
