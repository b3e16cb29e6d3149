// C++ quick start: a gated (SwiGLU) MLP with RMSNorm and a residual, on the best host backend.
#include <cstdio>
#include <fusedmlp/fusedmlp.hpp>
#include <random>
#include <vector>

int main() {
  const int64_t M = 4, d = 256, H = 688;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  auto randn = [&](size_t n, float s) {
    std::vector<float> v(n);
    for (float& e : v) e = normal(rng) * s;
    return v;
  };
  std::vector<float> x = randn(M * d, 1.f), gate_up = randn(2 * H * d, 0.05f),
                     down = randn(d * H, 0.03f), gamma(d, 1.f), y(M * d);

  fmlp_mlp_weights_t w{};
  w.w1 = fmlp::view(gate_up.data(), 2 * H, d);  // [gate; up] stacked, nn.Linear layout
  w.w2 = fmlp::view(down.data(), d, H);
  w.norm_weight = fmlp::view(gamma.data(), d);
  fmlp_mlp_config_t cfg = fmlp_mlp_config_default();
  cfg.activation = FMLP_ACT_SILU;
  cfg.gated = 1;
  cfg.norm = FMLP_NORM_RMSNORM;

  fmlp::PackedMlp mlp(w, cfg);  // validates and packs once
  const fmlp_tensor_t xv = fmlp::view(x.data(), M, d), yv = fmlp::view(y.data(), M, d);
  mlp.run(yv, xv, &xv);  // y = x + W2 (silu(Wg rms(x)) * Wu rms(x))
  std::printf("y[0] = %f\n", y[0]);
}
