// Runs a small SwiGLU block with residual through the installed fusedmlp C++ API on the ref and
// cpu backends and checks it against a direct double-precision computation.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "fusedmlp/fusedmlp.hpp"

namespace {

constexpr int kM = 3, kDim = 8, kHidden = 16;

double silu(double v) {
  return v / (1.0 + std::exp(-v));
}

// Whether this build registers any kernel for `backend` (a build may ship a backend's ISA check
// before its kernels).
bool has_kernels(fmlp_backend_t backend) {
  for (int i = 0; i < fmlp_mlp_kernel_count(); ++i)
    if (fmlp_mlp_kernel_backend(i) == backend) return true;
  return false;
}

}  // namespace

int main() {
  std::vector<float> x(kM * kDim), w1(2 * kHidden * kDim), w2(kDim * kHidden), res(kM * kDim);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7f * float(i) + 0.3f);
  for (size_t i = 0; i < w1.size(); ++i) w1[i] = 0.3f * std::cos(0.37f * float(i));
  for (size_t i = 0; i < w2.size(); ++i) w2[i] = 0.25f * std::sin(0.53f * float(i) + 1.0f);
  for (size_t i = 0; i < res.size(); ++i) res[i] = 0.1f * float(i % 5);

  std::vector<double> expected(kM * kDim);
  for (int i = 0; i < kM; ++i)
    for (int o = 0; o < kDim; ++o) {
      double acc = res[i * kDim + o];
      for (int j = 0; j < kHidden; ++j) {
        double g = 0, u = 0;
        for (int k = 0; k < kDim; ++k) {
          g += double(w1[j * kDim + k]) * x[i * kDim + k];
          u += double(w1[(kHidden + j) * kDim + k]) * x[i * kDim + k];
        }
        acc += double(w2[o * kHidden + j]) * silu(g) * u;
      }
      expected[i * kDim + o] = acc;
    }

  std::printf("fusedmlp %s\n", fmlp_version());
  int failures = 0;
  for (fmlp_backend_t backend : {FMLP_BACKEND_REF, FMLP_BACKEND_CPU}) {
    const char* name = fmlp_backend_name(backend);
    if (fmlp_backend_available(backend) != FMLP_SUCCESS) {
      std::printf("%s: skipped, %s\n", name, fmlp_last_error());
      continue;
    }
    if (!has_kernels(backend)) {
      std::printf("%s: skipped, this build registers no %s kernel\n", name, name);
      continue;
    }
    std::vector<float> y(kM * kDim, NAN);
    fmlp_mlp_args_t args{};
    args.x = fmlp::view(x.data(), kM, kDim);
    args.y = fmlp::view(y.data(), kM, kDim);
    args.residual = fmlp::view(res.data(), kM, kDim);
    args.weights.w1 = fmlp::view(w1.data(), 2 * kHidden, kDim);
    args.weights.w2 = fmlp::view(w2.data(), kDim, kHidden);
    args.config = fmlp_mlp_config_default();
    args.config.activation = FMLP_ACT_SILU;
    args.config.gated = 1;
    try {
      fmlp::mlp(args, backend);
    } catch (const fmlp::Error& e) {
      std::printf("%s: FAILED: %s\n", name, e.what());
      ++failures;
      continue;
    }
    double worst = 0;
    for (size_t i = 0; i < y.size(); ++i)
      worst = std::fmax(worst, std::fabs(y[i] - expected[i]) / (1.0 + std::fabs(expected[i])));
    const bool ok = worst < 1e-5;  // fp32 output of an 8 x 16 problem
    std::printf("%s: %s (max relative error %.3g)\n", name, ok ? "ok" : "FAILED", worst);
    failures += ok ? 0 : 1;
  }
  return failures == 0 ? 0 : 1;
}
