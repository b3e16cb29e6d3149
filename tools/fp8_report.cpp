#include "fp8_report.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "accuracy.hpp"
#include "cli_common.hpp"
#include "workloads.hpp"

namespace fmlp_cli {
namespace {

// Weights ~ N(0, 1/fan_in) (std 1/sqrt(fan_in), the scale of nn.Linear's init with Gaussian
// tails, so each row has a few 4-sigma outliers that set its fp8 scale), biases ~ N(0, 0.02^2),
// stored as bf16: the "model" the fp8 weights are quantised from.
WeightSet model_weights(const MlpShape& s, uint64_t seed) {
  WeightSet w = allocate_weights(s, FMLP_DTYPE_BF16);
  fill_normal(w.w1, 1.0f / std::sqrt(float(s.d_in)), seed, 1);
  if (!w.w_up.empty()) fill_normal(w.w_up, 1.0f / std::sqrt(float(s.d_in)), seed, 2);
  fill_normal(w.w2, 1.0f / std::sqrt(float(s.hidden)), seed, 3);
  for (auto [t, stream] : {std::pair{&w.b1, 4}, {&w.b_up, 5}, {&w.b2, 6}})
    if (!t->empty()) fill_normal(*t, 0.02f, seed, uint64_t(stream));
  return w;
}

// The same model with fp8 matrices; per_row picks [rows] or [1] scales.
WeightSet quantized(const WeightSet& m, bool per_row) {
  WeightSet q;
  auto one = [&](const HostTensor& w, HostTensor& out, HostTensor& scale) {
    if (w.empty()) return;
    out = HostTensor(FMLP_DTYPE_F8_E4M3, w.rows(), w.cols());
    scale = HostTensor(FMLP_DTYPE_F32, per_row ? w.rows() : 1, 0);
    quantize_weight(w, out, scale);
  };
  one(m.w1, q.w1, q.w1_scale);
  one(m.w_up, q.w_up, q.w_up_scale);
  one(m.w2, q.w2, q.w2_scale);
  q.b1 = m.b1.clone();
  q.b_up = m.b_up.clone();
  q.b2 = m.b2.clone();
  return q;
}

// sqrt(sum (q * scale - w)^2 / sum w^2) over all weight matrices.
double weight_rms_rel_error(const WeightSet& m, const WeightSet& q) {
  double num = 0, den = 0;
  auto one = [&](const HostTensor& w, const HostTensor& wq, const HostTensor& s) {
    if (w.empty()) return;
    for (int64_t r = 0; r < w.rows(); ++r) {
      const double sc = s.get(s.numel() == 1 ? 0 : r);
      for (int64_t c = 0; c < w.cols(); ++c) {
        const double a = w.get(r * w.cols() + c), d = wq.get(r * w.cols() + c) * sc - a;
        num += d * d;
        den += a * a;
      }
    }
  };
  one(m.w1, q.w1, q.w1_scale);
  one(m.w_up, q.w_up, q.w_up_scale);
  one(m.w2, q.w2, q.w2_scale);
  return std::sqrt(num / den);
}

double activate(fmlp_activation_t a, double x) {
  switch (a) {
    case FMLP_ACT_RELU: return x > 0 ? x : 0;
    case FMLP_ACT_GELU: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case FMLP_ACT_GELU_TANH:
      return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    case FMLP_ACT_SILU: return x / (1 + std::exp(-x));
    case FMLP_ACT_RELU2: return x > 0 ? x * x : 0;
    case FMLP_ACT_MAX_ENUM: break;  // not an activation
  }
  return x;
}

// Per output, the l2 norm of the terms summed into it (tests/tolerance.hpp's error scale): the
// natural size of any error made while summing, so errors are not inflated where terms cancel.
std::vector<double> term_magnitudes(const MlpShape& s, const WeightSet& w, const HostTensor& x) {
  const int64_t m = x.rows(), K = s.d_in, H = s.hidden, N = s.d_out;
  std::vector<double> out(size_t(m * N));
  const bool stacked = s.gated && w.w_up.empty();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    std::vector<double> xi(static_cast<size_t>(K)), hmag(static_cast<size_t>(H));
    for (int64_t k = 0; k < K; ++k) xi[size_t(k)] = x.get(i * K + k);
    auto dot = [&](const HostTensor& wt, int64_t row, const HostTensor& b, double* mag) {
      double acc = 0, sq = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double t = wt.get(row * K + k) * xi[size_t(k)];
        acc += t;
        sq += t * t;
      }
      const double bias = b.empty() ? 0.0 : b.get(row);
      *mag = std::sqrt(sq + bias * bias);
      return acc + bias;
    };
    for (int64_t j = 0; j < H; ++j) {
      double gm, um;
      const double g = dot(w.w1, j, w.b1, &gm);
      if (!s.gated) {
        hmag[size_t(j)] = std::max(gm, std::fabs(activate(s.act, g)));
        continue;
      }
      const double u = stacked ? dot(w.w1, H + j, w.b1, &um) : dot(w.w_up, j, w.b_up, &um);
      hmag[size_t(j)] = std::max(std::fabs(g), gm) * std::max(std::fabs(u), um);
    }
    for (int64_t o = 0; o < N; ++o) {
      const double b = w.b2.empty() ? 0.0 : w.b2.get(o);
      double sq = b * b;
      for (int64_t j = 0; j < H; ++j) {
        const double t = w.w2.get(o * H + j) * hmag[size_t(j)];
        sq += t * t;
      }
      out[size_t(i * N + o)] = std::sqrt(sq);
    }
  }
  return out;
}

std::vector<float> run(const MlpShape& s, const WeightSet& w, const HostTensor& x,
                       fmlp_backend_t backend) {
  HostTensor y(FMLP_DTYPE_F32, x.rows(), s.d_out);
  fmlp_mlp_args_t a{};
  a.x = x.view();
  a.y = y.view();
  a.weights = w.view();
  a.config = make_config(s);
  size_t bytes = 0;
  check_status(fmlp_mlp_workspace_size(&a, backend, &bytes), "sizing the workspace");
  std::vector<unsigned char> ws(bytes);
  check_status(fmlp_mlp(&a, backend, ws.data(), ws.size(), nullptr),
               fmt::format("fmlp_mlp on backend {}", fmlp_backend_name(backend)));
  std::vector<float> out(size_t(y.numel()));
  for (int64_t i = 0; i < y.numel(); ++i) out[size_t(i)] = y.get(i);
  return out;
}

struct Err {
  double max_abs = 0, max_rel = 0, rms_rel = 0;
};

// max |d|, max |d| / term magnitude, sqrt(sum d^2 / sum ref^2).
Err errors(const std::vector<float>& got, const std::vector<float>& ref,
           const std::vector<double>& mag) {
  Err e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(double(got[i]) - double(ref[i]));
    e.max_abs = std::max(e.max_abs, d);
    e.max_rel = std::max(e.max_rel, d / mag[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  e.rms_rel = std::sqrt(num / den);
  return e;
}

}  // namespace

bool print_fp8_accuracy_report(uint64_t seed, int64_t m) {
  const bool cpu = fmlp_backend_available(FMLP_BACKEND_CPU) == FMLP_SUCCESS;
  fmt::print(
      "\nfp8 e4m3 accuracy: bf16 weights ~ N(0, 1/fan_in) quantised by fmlp_quantize_fp8, "
      "f32 activations x ~ N(0, 1), M={};\nerrors against the fp64 ref on the bf16 weights; "
      "rel = |err| / l2 norm of the summed terms, rms = rms(err) / rms(ref)\n",
      m);
  fmt::print("{:<12} {:<10} {:<7} {:>10} {:>10} {:>10} {:>10}\n", "shape", "scales", "backend",
             "w rms rel", "max abs", "max rel", "rms rel");
  bool ok = true;
  for (const char* name : {"gpt2-small", "llama3-8b"}) {
    const MlpShape s = parse_shape(name, false);
    progress("fp8 accuracy: {} ({}): weights, reference", name, describe(s));
    const WeightSet model = model_weights(s, seed);
    HostTensor x(FMLP_DTYPE_F32, m, s.d_in);
    fill_normal(x, 1.0f, seed, 9);
    const std::vector<float> ref = run(s, model, x, FMLP_BACKEND_REF);
    const std::vector<double> mag = term_magnitudes(s, model, x);
    for (bool per_row : {true, false}) {
      const WeightSet q = quantized(model, per_row);
      const double wq = weight_rms_rel_error(model, q);
      const std::vector<float> ref8 = run(s, q, x, FMLP_BACKEND_REF);
      auto line = [&](const char* backend, const Err& e) {
        fmt::print("{:<12} {:<10} {:<7} {:>10.3e} {:>10.3e} {:>10.3e} {:>10.3e}\n", name,
                   per_row ? "per-row" : "per-tensor", backend, wq, e.max_abs, e.max_rel,
                   e.rms_rel);
      };
      line("ref", errors(ref8, ref, mag));
      if (!cpu) continue;
      const std::vector<float> cpu8 = run(s, q, x, FMLP_BACKEND_CPU);
      line("cpu", errors(cpu8, ref, mag));
      // The cpu kernels decode fp8 exactly, so against the ref's fp8 result only their fp32
      // accumulation differs.
      const Err vs_ref8 = errors(cpu8, ref8, mag);
      if (vs_ref8.max_rel > tolerance_for(FMLP_DTYPE_F32)) {
        ok = false;
        fmt::print("FAIL  cpu fp8 vs ref fp8 on {}: max rel {:.3e} > {:.1e}\n", name,
                   vs_ref8.max_rel, tolerance_for(FMLP_DTYPE_F32));
      }
    }
    std::fflush(stdout);
  }
  return ok;
}

}  // namespace fmlp_cli
