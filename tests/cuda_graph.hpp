// CUDA-graph capture of one fmlp_mlp call, for tests of the cuda backend. A graph bakes in every
// pointer of the captured call, so replays read whatever those buffers hold at launch: refresh the
// inputs in place (same buffers, same layout), then replay().
#pragma once
#ifdef FMLP_TEST_WITH_CUDA
#include <cuda_runtime.h>

#include <string>

#include "fusedmlp/fusedmlp.h"

namespace fmlp_test {

class MlpGraph {
 public:
  // Captures fmlp_mlp(args, backend, workspace, stream) on a new stream. status() is the status
  // fmlp_mlp returned during capture; error() describes any failure, capture or CUDA.
  MlpGraph(const fmlp_mlp_args_t& args, fmlp_backend_t backend, void* workspace,
           size_t workspace_bytes) {
    if (!ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate")) return;
    if (!ok(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin capture"))
      return;
    status_ = fmlp_mlp(&args, backend, workspace, workspace_bytes, stream_);
    if (status_ != FMLP_SUCCESS) error_ = fmlp_last_error();
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    if (status_ != FMLP_SUCCESS) {
      if (graph) cudaGraphDestroy(graph);
      return;
    }
    if (!ok(end, "end capture (did fmlp_mlp synchronise or use another stream?)")) return;
    const bool inst = ok(cudaGraphInstantiateWithFlags(&exec_, graph, 0), "instantiate");
    cudaGraphDestroy(graph);
    if (!inst) exec_ = nullptr;
  }
  MlpGraph(const MlpGraph&) = delete;
  MlpGraph& operator=(const MlpGraph&) = delete;
  ~MlpGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  fmlp_status_t status() const { return status_; }
  bool ready() const { return exec_ != nullptr; }
  const std::string& error() const { return error_; }
  // Launches the graph and waits for it; false (with error()) on a CUDA failure.
  bool replay() {
    return ok(cudaGraphLaunch(exec_, stream_), "cudaGraphLaunch") &&
           ok(cudaStreamSynchronize(stream_), "replay");
  }

 private:
  bool ok(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return true;
    error_ = std::string(what) + ": " + cudaGetErrorString(e);
    status_ = status_ == FMLP_SUCCESS ? FMLP_ERROR_CUDA : status_;
    return false;
  }
  cudaStream_t stream_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  fmlp_status_t status_ = FMLP_SUCCESS;
  std::string error_;
};

}  // namespace fmlp_test
#endif
