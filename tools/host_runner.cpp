// The host implementation of FusedRunner (backends ref and cpu).
#include "cli_common.hpp"
#include "cuda_runner.hpp"
#include "fusedmlp/fusedmlp.hpp"
#include "host_timer.hpp"
#include "runner.hpp"

namespace fmlp_cli {
namespace {

// The first op-table entry of `backend` that handles args: the one dispatch runs.
std::string dispatched_kernel(const fmlp_mlp_args_t& args, fmlp_backend_t backend) {
  for (int i = 0; i < fmlp_mlp_kernel_count(); ++i)
    if (fmlp_mlp_kernel_backend(i) == backend &&
        fmlp_mlp_kernel_supports(&args, fmlp_mlp_kernel_name(i)) == FMLP_SUCCESS)
      return fmlp_mlp_kernel_name(i);
  return "none";
}

fmlp_backend_t resolve_host_backend(const fmlp_mlp_args_t& args, fmlp_backend_t requested) {
  size_t bytes = 0;
  if (requested == FMLP_BACKEND_AUTO) {
    if (fmlp_backend_available(FMLP_BACKEND_CPU) != FMLP_SUCCESS) {
      progress(
          "warning: backend auto: the cpu backend is unavailable ({}); timing ref, which is "
          "slow",
          fmlp_last_error());
      return FMLP_BACKEND_REF;
    }
    if (fmlp_mlp_workspace_size(&args, FMLP_BACKEND_CPU, &bytes) != FMLP_SUCCESS) {
      progress(
          "warning: backend auto: no cpu kernel handles this problem; timing ref, which is "
          "slow. The library says: {}",
          fmlp_last_error());
      return FMLP_BACKEND_REF;
    }
    return FMLP_BACKEND_CPU;
  }
  check_status(fmlp_mlp_workspace_size(&args, requested, &bytes),
               fmt::format("backend {} on this problem (try --backend auto or ref)",
                           fmlp_backend_name(requested)));
  return requested;
}

class HostRunner final : public FusedRunner {
 public:
  HostRunner(HostMlp& problem, fmlp_backend_t backend, bool packed)
      : problem_(problem), backend_(backend) {
    const fmlp_mlp_args_t a = problem.args(0);
    kernel_ = dispatched_kernel(a, backend);
    size_t bytes = 0;
    if (packed) {
      for (int i = 0; i < problem.copies(); ++i) {
        const fmlp_mlp_args_t ai = problem.args(i);
        packed_.emplace_back(ai.weights, ai.config, backend);
      }
      bytes = packed_.front().workspace_size(a.y, a.x);
    } else {
      check_status(fmlp_mlp_workspace_size(&a, backend, &bytes), "sizing the workspace");
    }
    workspace_.resize(bytes);
  }

  fmlp_backend_t backend() const override { return backend_; }
  std::string kernel() const override { return kernel_; }

  void run(int copy) override {
    const fmlp_mlp_args_t a = problem_.args(copy);
    void* ws = workspace_.empty() ? nullptr : workspace_.data();
    if (!packed_.empty()) {
      packed_[size_t(copy)].run(a.y, a.x, a.residual.data ? &a.residual : nullptr, ws,
                                workspace_.size());
      return;
    }
    check_status(fmlp_mlp(&a, backend_, ws, workspace_.size(), nullptr),
                 fmt::format("fmlp_mlp on backend {}", fmlp_backend_name(backend_)));
  }

  std::vector<float> output_rows(const std::vector<int64_t>& rows) override {
    return problem_.output_rows(rows);
  }

  std::vector<double> time_calls(int reps, int first) override {
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      const HostTimer timer;
      run((first + i) % problem_.copies());
      t.push_back(timer.seconds());
    }
    return t;
  }

 private:
  HostMlp& problem_;
  fmlp_backend_t backend_;
  std::string kernel_;
  std::vector<fmlp::PackedMlp> packed_;
  std::vector<unsigned char> workspace_;
};

}  // namespace

bool bench_on_cuda(fmlp_backend_t requested) {
  if (requested == FMLP_BACKEND_AUTO)
    return cuda_runner_built() && fmlp_backend_available(FMLP_BACKEND_CUDA) == FMLP_SUCCESS;
  if (requested != FMLP_BACKEND_CUDA) return false;
  if (!cuda_runner_built())
    throw CliError(
        "this fusedmlp was built without CUDA; rebuild with -DFMLP_CUDA=ON or use "
        "--backend cpu, ref or auto");
  if (fmlp_backend_available(FMLP_BACKEND_CUDA) != FMLP_SUCCESS)
    throw CliError(fmt::format("backend cuda cannot run here: {}", fmlp_last_error()));
  return true;
}

std::unique_ptr<FusedRunner> make_fused_runner(HostMlp& problem, fmlp_backend_t requested,
                                               bool packed) {
  if (bench_on_cuda(requested)) return make_cuda_runner(problem, packed);
  const fmlp_backend_t b = resolve_host_backend(problem.args(0), requested);
  return std::make_unique<HostRunner>(problem, b, packed);
}

}  // namespace fmlp_cli
