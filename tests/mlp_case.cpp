#include "mlp_case.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/dtype.hpp"
#include "ref/activation.hpp"
#include "tolerance.hpp"

namespace fmlp_test {

using fmlp::detail::dtype_size;

std::string knob_value(const char* name) {
  fmlp_knob_info_t info{};
  if (fmlp_knob_info(fmlp_knob_find(name), &info) != FMLP_SUCCESS) {
    std::fprintf(stderr, "[fmlp] no knob %s: %s\n", name, fmlp_last_error());
    return "";
  }
  if (*info.error) std::fprintf(stderr, "[fmlp] %s\n", info.error);
  return info.value;
}

uint64_t test_seed() {
  static const uint64_t seed = [] {
    uint64_t s;
    const std::string env = knob_value("FMLP_TEST_SEED");
    if (env != "auto")
      s = std::strtoull(env.c_str(), nullptr, 10);
    else
      s = uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
    std::printf("[fmlp] test seed %llu (reproduce with FMLP_TEST_SEED=%llu)\n",
                static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
    std::fflush(stdout);
    return s;
  }();
  return seed;
}

uint64_t mix_seed(uint64_t a, uint64_t b) {  // splitmix64 of the pair
  uint64_t z = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

namespace {

const char* gate_name(Gate g) {
  return g == Gate::kDense ? "dense" : g == Gate::kStacked ? "gated-stacked" : "gated-separate";
}

template <typename T, size_t N>
T pick(Rng& rng, const T (&options)[N]) {
  return options[rng() % N];
}

fmlp_dtype_t pick_act_dtype(Rng& rng) {
  const fmlp_dtype_t t[] = {FMLP_DTYPE_F32, FMLP_DTYPE_F16, FMLP_DTYPE_BF16};
  return pick(rng, t);
}
fmlp_dtype_t maybe_dtype(Rng& rng) {
  return rng() % 2 ? pick_act_dtype(rng) : kAbsent;
}

// float8_e4m3fn: the 127 non-negative finite codes are increasing in value, so the nearest code is
// found by bisection.
uint8_t encode_e4m3(double v) {
  const double a = std::fabs(v);
  int lo = 0, hi = 0x7e;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    (fmlp::detail::f8e4m3_to_float(uint8_t(mid)) <= a ? lo : hi) = mid;
  }
  const double dl = a - fmlp::detail::f8e4m3_to_float(uint8_t(lo));
  const double dh = fmlp::detail::f8e4m3_to_float(uint8_t(hi)) - a;
  return uint8_t((dh < dl ? hi : lo) | (v < 0 ? 0x80 : 0));
}

HostMatrix make_matrix(fmlp_dtype_t t, int64_t rows, int64_t cols) {
  HostMatrix m;
  m.dtype = t;
  m.rows = rows;
  m.cols = cols;
  if (t != kAbsent) m.bytes.resize(size_t(rows * m.width()) * dtype_size(t));
  return m;
}

// U(lo, hi) excluding values that would be stored as zero.
void fill_uniform(HostMatrix* m, Rng& rng, double lo, double hi) {
  if (!m->present()) return;
  std::uniform_real_distribution<double> u(lo, hi);
  for (int64_t r = 0; r < m->rows; ++r)
    for (int64_t c = 0; c < m->width(); ++c) {
      do m->set(r, c, u(rng));
      while (m->get(r, c) == 0.0);
    }
}

void fill_normal(HostMatrix* m, Rng& rng) {
  std::normal_distribution<double> n(0.0, 1.0);
  for (int64_t r = 0; r < m->rows; ++r)
    for (int64_t c = 0; c < m->width(); ++c) {
      do m->set(r, c, n(rng));
      while (m->get(r, c) == 0.0);
    }
}

// Block scales: [halves * ceil(rows / halves / 128), ceil(cols / 128)] (fusedmlp.h).
int64_t blocks(int64_t n) {
  return (n + 127) / 128;
}
int64_t block_row(int64_t r, int64_t rows, int halves) {
  const int64_t half = rows / halves;
  return r / half * blocks(half) + r % half / 128;
}

// The scale of element (r, k) of a weight of `rows` rows: [1], [rows] or 2-D block scales.
double scale_at(const HostMatrix& scale, int64_t r, int64_t k, int64_t rows, int halves) {
  if (!scale.present()) return 1.0;
  if (scale.cols > 0) return scale.get(block_row(r, rows, halves), k / 128);
  return scale.get(scale.rows == 1 ? 0 : r, 0);
}

// A weight matrix ~ U(-1, 1) / sqrt(fan_in); fp8 stores w / scale with fp32 scales (block: one
// per 128 x 128 block of each of `halves` halves of the rows).
void make_weight(HostMatrix* w, HostMatrix* scale, const MlpCase& c, int64_t rows, int64_t fan_in,
                 Rng& rng, bool block = false, int halves = 1) {
  const double bound = 1.0 / std::sqrt(double(fan_in));
  *w = make_matrix(c.w_dtype, rows, fan_in);
  if (c.w_dtype != FMLP_DTYPE_F8_E4M3) {
    fill_uniform(w, rng, -bound, bound);
    return;
  }
  // Stored codes span about +-16, well inside e4m3's range and precise to 3 mantissa bits; or,
  // with fp8_all_codes, any finite non-zero code, so every exponent and subnormal is decoded.
  *scale = block ? make_matrix(FMLP_DTYPE_F32, halves * blocks(rows / halves), blocks(fan_in))
                 : make_matrix(FMLP_DTYPE_F32, c.per_row_scale ? rows : 1, 0);
  std::uniform_real_distribution<double> spread(0.5, 2.0);
  const double top = c.fp8_all_codes ? 448.0 : 16.0;
  for (int64_t r = 0; r < scale->rows; ++r)
    for (int64_t k = 0; k < scale->width(); ++k) scale->set(r, k, bound / top * spread(rng));
  if (c.fp8_all_codes) {
    for (unsigned char& code : w->bytes) {
      do code = uint8_t(rng());
      while ((code & 0x7f) == 0 || (code & 0x7f) == 0x7f);
    }
    return;
  }
  std::uniform_real_distribution<double> u(-bound, bound);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < fan_in; ++k) {
      const double s = scale_at(*scale, r, k, rows, halves);
      do w->set(r, k, u(rng) / s);
      while (w->get(r, k) == 0.0);
    }
}

// Dense double copy of a weight matrix with its fp8 scales applied.
std::vector<double> decode_weight(const HostMatrix& w, const HostMatrix& scale, int halves = 1) {
  std::vector<double> out(size_t(w.rows * w.cols));
  for (int64_t r = 0; r < w.rows; ++r)
    for (int64_t k = 0; k < w.cols; ++k)
      out[size_t(r * w.cols + k)] = w.get(r, k) * scale_at(scale, r, k, w.rows, halves);
  return out;
}

std::vector<double> decode_vector(const HostMatrix& v, int64_t n, double absent) {
  std::vector<double> out(size_t(n), absent);
  if (v.present())
    for (int64_t i = 0; i < n; ++i) out[size_t(i)] = v.get(i, 0);
  return out;
}

}  // namespace

std::string MlpCase::name() const {
  std::string s = "m" + std::to_string(m) + " d_in" + std::to_string(d_in) + " hidden" +
                  std::to_string(hidden) + " d_out" + std::to_string(d_out) + " " +
                  fmlp_activation_name(act) + " " + gate_name(gate) +
                  " x=" + fmlp_dtype_name(x_dtype) + " w=" + fmlp_dtype_name(w_dtype);
  if (w_dtype == FMLP_DTYPE_F8_E4M3) s += per_row_scale ? "(row scales)" : "(tensor scale)";
  if (block_w1 || block_w2)
    s += std::string(" block scales(") + (block_w1 ? "w1" : "") +
         (block_w1 && block_w2 ? "," : "") + (block_w2 ? "w2" : "") + ")";
  if (fp8_all_codes) s += " all-fp8-codes";
  if (nan_weights) s += " nan-weights";
  if (b1 != kAbsent) s += std::string(" b1=") + fmlp_dtype_name(b1);
  if (b_up != kAbsent) s += std::string(" b_up=") + fmlp_dtype_name(b_up);
  if (b2 != kAbsent) s += std::string(" b2=") + fmlp_dtype_name(b2);
  if (norm != FMLP_NORM_NONE) {
    s += norm == FMLP_NORM_LAYERNORM ? " layernorm(" : " rmsnorm(";
    s += std::string("gamma=") + (gamma == kAbsent ? "none" : fmlp_dtype_name(gamma));
    if (norm == FMLP_NORM_LAYERNORM)
      s += std::string(" beta=") + (beta == kAbsent ? "none" : fmlp_dtype_name(beta));
    s += ")";
  }
  if (residual == Residual::kSeparate) s += " residual";
  if (residual == Residual::kInPlace) s += " residual-in-place";
  if (misaligned) s += " misaligned";
  if (strided) s += " strided";
  if (packed_weights && (misaligned || strided)) s += " (weights packed)";
  if (nonfinite) s += " nan+inf-rows";
  if (deterministic) s += " deterministic";
  return s;
}

fmlp_mlp_config_t MlpCase::config() const {
  fmlp_mlp_config_t c = fmlp_mlp_config_default();
  c.activation = act;
  c.gated = gated() ? 1 : 0;
  c.norm = norm;
  c.norm_eps = 1e-5f;
  c.deterministic = deterministic ? 1 : 0;
  return c;
}

void normalize(MlpCase* c) {
  if (c->gate != Gate::kSeparate) c->b_up = kAbsent;
  if (c->norm == FMLP_NORM_NONE) c->gamma = kAbsent;
  if (c->norm != FMLP_NORM_LAYERNORM) c->beta = kAbsent;
  if (c->m < 3) c->nonfinite = false;
  if (c->w_dtype != FMLP_DTYPE_F8_E4M3)
    c->per_row_scale = c->fp8_all_codes = c->nan_weights = c->block_w1 = c->block_w2 = false;
}

MlpCase random_case(Rng& rng, int64_t max_macs) {
  const int64_t sizes[] = {1, 7, 64, 127, 769};
  const int64_t ms[] = {1, 3, 16, 100};
  const fmlp_activation_t acts[] = {FMLP_ACT_RELU, FMLP_ACT_GELU, FMLP_ACT_GELU_TANH, FMLP_ACT_SILU,
                                    FMLP_ACT_RELU2};
  const Gate gates[] = {Gate::kDense, Gate::kStacked, Gate::kSeparate};
  const fmlp_norm_t norms[] = {FMLP_NORM_NONE, FMLP_NORM_LAYERNORM, FMLP_NORM_RMSNORM};
  const Residual residuals[] = {Residual::kNone, Residual::kSeparate, Residual::kInPlace};
  const fmlp_dtype_t w_dtypes[] = {FMLP_DTYPE_F32,    FMLP_DTYPE_F16, FMLP_DTYPE_BF16,
                                   FMLP_DTYPE_F32,    FMLP_DTYPE_F16, FMLP_DTYPE_BF16,
                                   FMLP_DTYPE_F8_E4M3};
  MlpCase c;
  c.d_in = pick(rng, sizes);
  c.hidden = pick(rng, sizes);
  c.d_out = rng() % 4 == 0 ? pick(rng, sizes) : c.d_in;
  c.m = pick(rng, ms);
  c.act = pick(rng, acts);
  c.gate = pick(rng, gates);
  c.x_dtype = pick_act_dtype(rng);
  c.w_dtype = pick(rng, w_dtypes);
  c.per_row_scale = rng() % 2;
  c.b1 = maybe_dtype(rng);
  c.b_up = maybe_dtype(rng);
  c.b2 = maybe_dtype(rng);
  c.norm = pick(rng, norms);
  c.gamma = maybe_dtype(rng);
  c.beta = maybe_dtype(rng);
  c.residual = pick(rng, residuals);
  c.misaligned = rng() % 4 == 0;
  c.strided = rng() % 4 == 0;
  c.nonfinite = rng() % 8 == 0;
  c.deterministic = rng() % 5 == 0;
  c.data_seed = rng();
  while (c.m > 1 && c.macs() > max_macs) c.m = c.m == 100 ? 16 : c.m == 16 ? 3 : 1;
  normalize(&c);
  return c;
}

double HostMatrix::get(int64_t r, int64_t c) const {
  return fmlp::detail::load_as_double(bytes.data(), dtype, r * width() + c);
}

void HostMatrix::set(int64_t r, int64_t c, double v) {
  const int64_t i = r * width() + c;
  if (dtype == FMLP_DTYPE_F8_E4M3)
    bytes[size_t(i)] = encode_e4m3(v);
  else
    fmlp::detail::store_from_double(bytes.data(), dtype, i, v);
}

CaseData make_data(const MlpCase& c, uint64_t seed) {
  Rng rng(seed);
  CaseData d;
  d.x = make_matrix(c.x_dtype, c.m, c.d_in);
  fill_normal(&d.x, rng);
  if (c.nonfinite) {
    d.x.set(0, int64_t(rng() % uint64_t(c.d_in)), NAN);
    d.x.set(1, int64_t(rng() % uint64_t(c.d_in)), INFINITY);
  }
  if (c.residual != Residual::kNone) {
    d.residual = make_matrix(c.x_dtype, c.m, c.d_out);
    fill_normal(&d.residual, rng);
  }
  const bool stacked = c.gate == Gate::kStacked;
  make_weight(&d.w1, &d.w1_scale, c, stacked ? 2 * c.hidden : c.hidden, c.d_in, rng, c.block_w1,
              stacked ? 2 : 1);
  if (c.gate == Gate::kSeparate)
    make_weight(&d.w_up, &d.w_up_scale, c, c.hidden, c.d_in, rng, c.block_w1);
  make_weight(&d.w2, &d.w2_scale, c, c.d_out, c.hidden, rng, c.block_w2);
  if (c.nan_weights) {
    d.w2.bytes[size_t(rng() % uint64_t(c.hidden))] = 0x7f;
    d.w2.bytes[size_t((c.d_out - 1) * c.hidden + int64_t(rng() % uint64_t(c.hidden)))] = 0xff;
  }
  d.b1 = make_matrix(c.b1, c.gate == Gate::kStacked ? 2 * c.hidden : c.hidden, 0);
  fill_uniform(&d.b1, rng, -0.5, 0.5);
  d.b_up = make_matrix(c.b_up, c.hidden, 0);
  fill_uniform(&d.b_up, rng, -0.5, 0.5);
  d.b2 = make_matrix(c.b2, c.d_out, 0);
  fill_uniform(&d.b2, rng, -0.5, 0.5);
  d.gamma = make_matrix(c.gamma, c.d_in, 0);
  fill_uniform(&d.gamma, rng, 0.5, 1.5);
  d.beta = make_matrix(c.beta, c.d_in, 0);
  fill_uniform(&d.beta, rng, -0.5, 0.5);
  return d;
}

Reference reference(const MlpCase& c, const CaseData& d) {
  const int64_t K = c.d_in, H = c.hidden, N = c.d_out;
  const std::vector<double> w1 = decode_weight(d.w1, d.w1_scale, c.gate == Gate::kStacked ? 2 : 1);
  const std::vector<double> wu =
      d.w_up.present() ? decode_weight(d.w_up, d.w_up_scale) : std::vector<double>{};
  const std::vector<double> w2 = decode_weight(d.w2, d.w2_scale);
  const std::vector<double> b1 = decode_vector(d.b1, d.w1.rows, 0.0);
  const std::vector<double> bu = decode_vector(d.b_up, H, 0.0);
  const std::vector<double> b2 = decode_vector(d.b2, N, 0.0);
  const std::vector<double> gamma = decode_vector(d.gamma, K, 1.0);
  const std::vector<double> beta = decode_vector(d.beta, K, 0.0);
  Reference ref;
  ref.y.resize(size_t(c.m * N));
  ref.scale.resize(size_t(c.m * N));
  std::vector<double> xn(static_cast<size_t>(K)), h(static_cast<size_t>(H)),
      hmag(static_cast<size_t>(H));
  // value and l2 norm of the terms of row r of w (k columns) times xn, plus a bias.
  auto dot = [&](const std::vector<double>& w, int64_t r, double bias, double* mag) {
    double acc = 0.0, sq = bias * bias;
    for (int64_t k = 0; k < K; ++k) {
      const double t = w[size_t(r * K + k)] * xn[size_t(k)];
      acc += t;
      sq += t * t;
    }
    *mag = std::sqrt(sq);
    return acc + bias;
  };
  // An error e in the activation's input moves its output by |act'(g)| e: the terms' magnitude
  // grows by that slope where it exceeds 1 (relu2's 2g; gelu and silu stay near 1).
  auto slope = [&](double g) {
    const double e = 1e-6 * std::max(1.0, std::fabs(g));
    const double d =
        std::fabs(fmlp::ref::activate(c.act, g + e) - fmlp::ref::activate(c.act, g - e));
    return std::isfinite(d) ? std::max(1.0, d / (2 * e)) : 1.0;
  };
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t k = 0; k < K; ++k) xn[size_t(k)] = d.x.get(i, k);
    if (c.norm != FMLP_NORM_NONE) {
      double mean = 0.0;
      if (c.norm == FMLP_NORM_LAYERNORM) {
        for (double v : xn) mean += v;
        mean /= double(K);
      }
      double var = 0.0;
      for (double v : xn) var += (v - mean) * (v - mean);
      const double inv = 1.0 / std::sqrt(var / double(K) + double(1e-5f));
      for (int64_t k = 0; k < K; ++k)
        xn[size_t(k)] = (xn[size_t(k)] - mean) * inv * gamma[size_t(k)] + beta[size_t(k)];
    }
    for (int64_t j = 0; j < H; ++j) {
      double gm, um;
      const double g = dot(w1, j, b1[size_t(j)], &gm);
      if (!c.gated()) {
        h[size_t(j)] = fmlp::ref::activate(c.act, g);
        hmag[size_t(j)] = std::max(gm * slope(g), std::fabs(h[size_t(j)]));
        continue;
      }
      const double u = c.gate == Gate::kStacked ? dot(w1, H + j, b1[size_t(H + j)], &um)
                                                : dot(wu, j, bu[size_t(j)], &um);
      h[size_t(j)] = fmlp::ref::activate(c.act, g) * u;
      hmag[size_t(j)] = std::max(std::fabs(g), gm) * slope(g) * std::max(std::fabs(u), um);
    }
    for (int64_t o = 0; o < N; ++o) {
      const double r = d.residual.present() ? d.residual.get(i, o) : 0.0;
      double acc = b2[size_t(o)] + r;
      double sq = b2[size_t(o)] * b2[size_t(o)] + r * r;
      for (int64_t j = 0; j < H; ++j) {
        const double w = w2[size_t(o * H + j)];
        acc += w * h[size_t(j)];
        sq += (w * hmag[size_t(j)]) * (w * hmag[size_t(j)]);
      }
      ref.y[size_t(i * N + o)] = acc;
      ref.scale[size_t(i * N + o)] = std::sqrt(sq);
    }
  }
  return ref;
}

PlacedCase::PlacedCase(const MlpCase& c, bool device) : c_(c), device_(device) {
  const bool fp8 = c.w_dtype == FMLP_DTYPE_F8_E4M3;
  const fmlp_dtype_t scale_t = fp8 ? FMLP_DTYPE_F32 : kAbsent;
  const int64_t rows1 = c.gate == Gate::kStacked ? 2 * c.hidden : c.hidden;
  const fmlp_dtype_t up_t = c.gate == Gate::kSeparate ? c.w_dtype : kAbsent;
  // Distinct pads, so a kernel that mixes up two tensors' strides reads the 0xFF (NaN) gaps.
  place(kX, c.x_dtype, c.m, c.d_in, 3);
  place(kY, c.x_dtype, c.m, c.d_out, 5);
  place(kRes, c.residual == Residual::kSeparate ? c.x_dtype : kAbsent, c.m, c.d_out, 1);
  place(kW1, c.w_dtype, rows1, c.d_in, 7);
  const int64_t rb1 = (c.gate == Gate::kStacked ? 2 : 1) * blocks(c.hidden);
  if (c.block_w1)
    place(kW1s, scale_t, rb1, blocks(c.d_in), 1);
  else
    place(kW1s, scale_t, c.per_row_scale ? rows1 : 1, 0, 0);
  place(kB1, c.b1, rows1, 0, 0);
  place(kWu, up_t, c.hidden, c.d_in, 2);
  const fmlp_dtype_t up_scale_t = c.gate == Gate::kSeparate ? scale_t : kAbsent;
  if (c.block_w1)
    place(kWus, up_scale_t, blocks(c.hidden), blocks(c.d_in), 3);
  else
    place(kWus, up_scale_t, c.per_row_scale ? c.hidden : 1, 0, 0);
  place(kBu, c.b_up, c.hidden, 0, 0);
  place(kW2, c.w_dtype, c.d_out, c.hidden, 4);
  if (c.block_w2)
    place(kW2s, scale_t, blocks(c.d_out), blocks(c.hidden), 2);
  else
    place(kW2s, scale_t, c.per_row_scale ? c.d_out : 1, 0, 0);
  place(kB2, c.b2, c.d_out, 0, 0);
  place(kG, c.gamma, c.d_in, 0, 0);
  place(kBeta, c.beta, c.d_in, 0, 0);
  // Valid scales from the start, so validation and supports() can run before any upload.
  for (Slot s : {kW1s, kWus, kW2s}) {
    if (slots_[s].view.data == nullptr) continue;
    HostMatrix ones = make_matrix(FMLP_DTYPE_F32, slots_[s].rows, slots_[s].cols);
    for (int64_t r = 0; r < ones.rows; ++r)
      for (int64_t k = 0; k < ones.width(); ++k) ones.set(r, k, 1.0);
    write(s, ones);
  }
  args_.x = slots_[kX].view;
  args_.y = slots_[kY].view;
  args_.residual = c.residual == Residual::kInPlace ? args_.y : slots_[kRes].view;
  fmlp_mlp_weights_t& w = args_.weights;
  w.w1 = slots_[kW1].view;
  w.w1_scale = slots_[kW1s].view;
  w.b1 = slots_[kB1].view;
  w.w_up = slots_[kWu].view;
  w.w_up_scale = slots_[kWus].view;
  w.b_up = slots_[kBu].view;
  w.w2 = slots_[kW2].view;
  w.w2_scale = slots_[kW2s].view;
  w.b2 = slots_[kB2].view;
  w.norm_weight = slots_[kG].view;
  w.norm_bias = slots_[kBeta].view;
  args_.config = c.config();
}

void PlacedCase::place(Slot s, fmlp_dtype_t dtype, int64_t rows, int64_t cols, int64_t pad) {
  Placed& p = slots_[s];
  if (dtype == kAbsent) return;
  const int64_t es = int64_t(dtype_size(dtype));
  const bool weight = s == kW1 || s == kWu || s == kW2;
  const bool layout = !(c_.packed_weights && weight);
  p.offset = c_.misaligned && layout ? 1 : 0;
  p.rows = rows;
  p.cols = cols;
  const int64_t width = cols == 0 ? 1 : cols;
  p.stride = width + (c_.strided && layout ? pad : 0);
  // 64 poisoned bytes after the last element catch writes past the end.
  const int64_t elems = p.offset + (rows > 0 ? (rows - 1) * p.stride + width : 0);
  p.buf = Buffer(size_t(elems * es + 64), device_);
  p.buf.fill(0xFF);
  void* base = p.buf.bytes_at(size_t(p.offset * es));
  p.view = cols == 0 ? fmlp_tensor_1d(base, dtype, rows)
                     : fmlp_tensor_2d(base, dtype, rows, cols, p.stride);
  if (device_) p.view.device_type = FMLP_DEVICE_CUDA;
}

void PlacedCase::write(Slot s, const HostMatrix& m) {
  Placed& p = slots_[s];
  if (!m.present()) return;
  const size_t es = dtype_size(m.dtype), row_bytes = size_t(m.width()) * es;
  std::vector<unsigned char> staging(p.buf.size(), 0xFF);
  for (int64_t r = 0; r < m.rows; ++r)
    std::memcpy(staging.data() + size_t(p.offset + r * p.stride) * es,
                m.bytes.data() + size_t(r) * row_bytes, row_bytes);
  p.buf.upload(staging);
}

void PlacedCase::upload(const CaseData& d) {
  write(kX, d.x);
  if (c_.residual == Residual::kSeparate) write(kRes, d.residual);
  write(kW1, d.w1);
  write(kW1s, d.w1_scale);
  write(kB1, d.b1);
  write(kWu, d.w_up);
  write(kWus, d.w_up_scale);
  write(kBu, d.b_up);
  write(kW2, d.w2);
  write(kW2s, d.w2_scale);
  write(kB2, d.b2);
  write(kG, d.gamma);
  write(kBeta, d.beta);
  if (c_.residual == Residual::kInPlace)
    write(kY, d.residual);
  else
    poison_y();
}

std::vector<double> PlacedCase::download_y(std::string* stray) const {
  const Placed& p = slots_[kY];
  const std::vector<unsigned char> bytes = p.buf.download();
  const size_t es = dtype_size(c_.x_dtype);
  std::vector<bool> inside(bytes.size(), false);
  std::vector<double> out(size_t(p.rows * p.cols));
  for (int64_t r = 0; r < p.rows; ++r) {
    const size_t row = size_t(p.offset + r * p.stride) * es;
    std::fill(inside.begin() + long(row), inside.begin() + long(row + size_t(p.cols) * es), true);
    for (int64_t o = 0; o < p.cols; ++o)
      out[size_t(r * p.cols + o)] = fmlp::detail::load_as_double(bytes.data() + row, c_.x_dtype, o);
  }
  stray->clear();
  for (size_t b = 0; b < bytes.size(); ++b)
    if (!inside[b] && bytes[b] != 0xFF) {
      *stray = "byte " + std::to_string(b) + " of y's buffer lies outside the view (offset " +
               std::to_string(p.offset) + ", row stride " + std::to_string(p.stride) +
               " elements) but was written";
      break;
    }
  return out;
}

RunOutcome run_kernel(const PlacedCase& p, const char* kernel, Buffer* ws_out) {
  const fmlp_backend_t backend = p.device() ? FMLP_BACKEND_CUDA : FMLP_BACKEND_AUTO;
  size_t bytes = 0;
  fmlp_status_t s = kernel ? fmlp_mlp_kernel_workspace_size(&p.args(), kernel, &bytes)
                           : fmlp_mlp_workspace_size(&p.args(), backend, &bytes);
  if (s != FMLP_SUCCESS) return {s, fmlp_last_error()};
  Buffer local;
  Buffer& ws = ws_out ? *ws_out : local;
  ws = Buffer();
  if (bytes > 0) {
    ws = Buffer(bytes, p.device());
    ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
  }
  s = kernel ? fmlp_mlp_with_kernel(&p.args(), kernel, ws.data(), bytes, nullptr)
             : fmlp_mlp(&p.args(), backend, ws.data(), bytes, nullptr);
  RunOutcome out{s, fmlp_last_error()};
#ifdef FMLP_TEST_WITH_CUDA
  if (p.device() && s == FMLP_SUCCESS) {
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess)
      out = {FMLP_ERROR_CUDA, std::string("after the run: ") + cudaGetErrorString(e)};
  }
#endif
  return out;
}

CompareOutcome compare(const MlpCase& c, const std::vector<double>& out, const Reference& ref,
                       bool gemm_composed) {
  CompareOutcome r;
  const bool w8a8 = gemm_composed && c.w_dtype == FMLP_DTYPE_F8_E4M3;
  const double rtol = w8a8 ? kW8A8Rtol : mlp_rtol(c.x_dtype, c.w_dtype, gemm_composed);
  double worst_bad = -1.0, sq = 0.0;
  int64_t finite = 0;
  for (size_t e = 0; e < out.size(); ++e) {
    const ElementCheck chk = check_element(out[e], ref.y[e], ref.scale[e], rtol, c.x_dtype);
    if (w8a8 && std::isfinite(out[e]) && std::isfinite(ref.y[e])) {
      const double rel = std::fabs(out[e] - ref.y[e]) / (std::fabs(ref.y[e]) + ref.scale[e]);
      sq += rel * rel;
      ++finite;
    }
    if (std::isfinite(chk.err)) {
      r.max_err = std::max(r.max_err, chk.err);
      if (chk.tol > 0) r.worst_ratio = std::max(r.worst_ratio, chk.err / chk.tol);
    }
    if (chk.ok) continue;
    r.ok = false;
    ++r.bad;
    const double badness = std::isfinite(chk.err) ? chk.err / chk.tol : INFINITY;
    if (badness <= worst_bad) continue;
    worst_bad = badness;
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "worst at row %lld col %lld: out=%.9g ref=%.9g |diff|=%.3g tol=%.3g "
                  "(rtol=%.3g, scale=%.3g): %s",
                  static_cast<long long>(int64_t(e) / c.d_out),
                  static_cast<long long>(int64_t(e) % c.d_out), out[e], ref.y[e],
                  std::fabs(out[e] - ref.y[e]), chk.tol, rtol, ref.scale[e], chk.why);
    r.detail = buf;
  }
  const double rms = finite ? std::sqrt(sq / double(finite)) : 0.0;
  if (w8a8 && rms > kW8A8RmsBound) {
    r.ok = false;
    char buf[160];
    std::snprintf(buf, sizeof buf, "%sW8A8 rms relative error %.4f > %.4f (tolerance.hpp)",
                  r.detail.empty() ? "" : "; ", rms, kW8A8RmsBound);
    r.detail += buf;
  }
  return r;
}

}  // namespace fmlp_test
