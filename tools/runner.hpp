// Runs and times the fused op of a bench problem. bench talks only to this interface: the host
// runner calls the library on the problem's own buffers; the device runner (CUDA) copies the
// weight sets to the device when made and times CUDA-graph replays, behind the same calls.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.h"
#include "workloads.hpp"

namespace fmlp_cli {

class FusedRunner {
 public:
  virtual ~FusedRunner() = default;
  virtual fmlp_backend_t backend() const = 0;  // resolved, never auto
  virtual std::string kernel() const = 0;      // the op-table entry dispatch picks
  // One call on weight set `copy`, finished on return.
  virtual void run(int copy) = 0;
  // Rows of the last call's output, as fp32, on the host.
  virtual std::vector<float> output_rows(const std::vector<int64_t>& rows) = 0;
  // Seconds per call of `reps` back-to-back calls, rotating over the weight sets from `first`.
  virtual std::vector<double> time_calls(int reps, int first) = 0;
};

// Whether bench runs on the GPU: backend cuda, or auto where this CLI has the CUDA runner and a
// usable GPU. Throws CliError when cuda is asked for and cannot run.
bool bench_on_cuda(fmlp_backend_t requested);

// `requested` auto picks cuda (bench_on_cuda), else cpu when a cpu kernel handles the problem,
// else ref with a warning on stderr; an explicit backend that cannot run it is an error.
// `packed` times fmlp_mlp_packed_run on weights packed once per set instead of fmlp_mlp.
std::unique_ptr<FusedRunner> make_fused_runner(HostMlp& problem, fmlp_backend_t requested,
                                               bool packed);

}  // namespace fmlp_cli
