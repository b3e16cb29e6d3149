// The CUDA implementation of FusedRunner: the problem's weight sets are copied to the device once,
// every call runs on device tensors, and timing replays a CUDA graph of one call per weight set
// (so each call reads its weights from HBM when the sets span > 3x the L2), timed with events.
#include "cuda_runner.hpp"

#include <cuda_runtime.h>

#include <cstring>

#include "cli_common.hpp"
#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.hpp"

namespace fmlp_cli {
namespace {

void check_cuda(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw CliError(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

size_t elem_bytes(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F32 ? 4 : t == FMLP_DTYPE_F8_E4M3 ? 1 : 2;
}

size_t extent_bytes(const fmlp_tensor_t& v) {
  if (v.data == nullptr || v.ndim == 0) return 0;
  const int64_t n = v.ndim == 1 ? v.shape[0] : (v.shape[0] - 1) * v.stride[0] + v.shape[1];
  return size_t(n) * elem_bytes(v.dtype);
}

// Device memory owned by the runner; views keep the host view's shape and strides.
class DeviceArena {
 public:
  ~DeviceArena() {
    for (void* p : blocks_) cudaFree(p);
  }
  fmlp_tensor_t upload(const fmlp_tensor_t& host) {
    fmlp_tensor_t v = host;
    const size_t bytes = extent_bytes(host);
    if (bytes == 0) return v;
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), fmt::format("cudaMalloc of {} bytes", bytes));
    blocks_.push_back(p);
    check_cuda(cudaMemcpy(p, host.data, bytes, cudaMemcpyHostToDevice), "copying to the device");
    v.data = p;
    v.device_type = FMLP_DEVICE_CUDA;
    v.device_id = 0;
    return v;
  }
  void* zeroed(size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), fmt::format("cudaMalloc of {} bytes", bytes));
    blocks_.push_back(p);
    check_cuda(cudaMemset(p, 0, bytes), "zero-filling the workspace");
    return p;
  }

 private:
  std::vector<void*> blocks_;
};

fmlp_mlp_weights_t upload_weights(DeviceArena& arena, const fmlp_mlp_weights_t& w) {
  fmlp_mlp_weights_t d = w;
  for (fmlp_tensor_t* t : {&d.w1, &d.w1_scale, &d.b1, &d.w_up, &d.w_up_scale, &d.b_up, &d.w2,
                           &d.w2_scale, &d.b2, &d.norm_weight, &d.norm_bias})
    *t = arena.upload(*t);
  return d;
}

// The kernel dispatch runs: the "chosen" line of fmlp_mlp_explain (the planner's pick).
std::string chosen_kernel(const fmlp_mlp_args_t& args) {
  size_t needed = 0;
  fmlp_mlp_explain(&args, FMLP_BACKEND_CUDA, nullptr, 0, &needed);
  std::string text(needed, '\0');
  if (fmlp_mlp_explain(&args, FMLP_BACKEND_CUDA, text.data(), text.size(), &needed) != FMLP_SUCCESS)
    return "none";
  const size_t at = text.find("chosen");
  if (at == std::string::npos) return "none";
  const size_t b = text.find_first_not_of(' ', at + 6);
  return text.substr(b, text.find(' ', b) - b);
}

class CudaRunner final : public FusedRunner {
 public:
  CudaRunner(HostMlp& problem, bool packed) : problem_(problem) {
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating a stream");
    const fmlp_mlp_args_t host = problem.args(0);
    x_ = arena_.upload(host.x);
    y_ = arena_.upload(host.y);
    residual_ = host.residual.data == host.y.data ? y_ : arena_.upload(host.residual);
    for (int i = 0; i < problem.copies(); ++i) {
      sets_.push_back(upload_weights(arena_, problem.args(i).weights));
      if (packed) {
        packed_.emplace_back(sets_.back(), host.config, FMLP_BACKEND_CUDA, stream_);
      }
    }
    config_ = host.config;
    const fmlp_mlp_args_t a = args(0);
    kernel_ = chosen_kernel(a);
    size_t bytes = 0;
    if (packed)
      bytes = packed_.front().workspace_size(a.y, a.x);
    else
      check_status(fmlp_mlp_workspace_size(&a, FMLP_BACKEND_CUDA, &bytes),
                   "sizing the workspace on backend cuda");
    workspace_bytes_ = bytes;
    workspace_ = arena_.zeroed(bytes);
  }
  ~CudaRunner() override {
    if (graph_) cudaGraphExecDestroy(graph_);
    cudaStreamDestroy(stream_);
  }

  fmlp_backend_t backend() const override { return FMLP_BACKEND_CUDA; }
  std::string kernel() const override { return kernel_; }

  void run(int copy) override {
    enqueue(copy);
    check_cuda(cudaStreamSynchronize(stream_), "running on the GPU");
  }

  std::vector<float> output_rows(const std::vector<int64_t>& rows) override {
    const size_t es = elem_bytes(y_.dtype);
    std::vector<float> out;
    std::vector<unsigned char> row(size_t(y_.shape[1]) * es);
    for (int64_t r : rows) {
      check_cuda(cudaMemcpy(row.data(), static_cast<char*>(y_.data) + size_t(r * y_.stride[0]) * es,
                            row.size(), cudaMemcpyDeviceToHost),
                 "reading y back");
      for (int64_t c = 0; c < y_.shape[1]; ++c) out.push_back(to_float(row.data(), c));
    }
    return out;
  }

  // One graph holds one call per weight set; a replay's time over the sets is one call's time.
  std::vector<double> time_calls(int reps, int) override {
    if (!graph_) capture();
    cudaEvent_t e0, e1;
    check_cuda(cudaEventCreate(&e0), "cudaEventCreate");
    check_cuda(cudaEventCreate(&e1), "cudaEventCreate");
    std::vector<double> t;
    const int launches = std::max(1, reps / problem_.copies());
    for (int i = 0; i < launches; ++i) {
      cudaEventRecord(e0, stream_);
      cudaGraphLaunch(graph_, stream_);
      cudaEventRecord(e1, stream_);
      check_cuda(cudaEventSynchronize(e1), "replaying the CUDA graph");
      float ms = 0.f;
      cudaEventElapsedTime(&ms, e0, e1);
      t.push_back(double(ms) * 1e-3 / problem_.copies());
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return t;
  }

 private:
  fmlp_mlp_args_t args(int copy) const {
    fmlp_mlp_args_t a{};
    a.y = y_;
    a.x = x_;
    a.residual = residual_;
    a.weights = sets_[size_t(copy)];
    a.config = config_;
    return a;
  }

  void enqueue(int copy) {
    const fmlp_mlp_args_t a = args(copy);
    if (!packed_.empty()) {
      packed_[size_t(copy)].run(a.y, a.x, a.residual.data ? &a.residual : nullptr, workspace_,
                                workspace_bytes_, stream_);
      return;
    }
    check_status(fmlp_mlp(&a, FMLP_BACKEND_CUDA, workspace_, workspace_bytes_, stream_),
                 "fmlp_mlp on backend cuda");
  }

  void capture() {
    cudaGraph_t g = nullptr;
    check_cuda(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "graph capture");
    for (int i = 0; i < problem_.copies(); ++i) enqueue(i);
    check_cuda(cudaStreamEndCapture(stream_, &g), "graph capture");
    check_cuda(cudaGraphInstantiate(&graph_, g, 0), "instantiating the CUDA graph");
    cudaGraphDestroy(g);
    for (int i = 0; i < 3; ++i) cudaGraphLaunch(graph_, stream_);  // warm-up
    check_cuda(cudaStreamSynchronize(stream_), "warming up the CUDA graph");
  }

  float to_float(const unsigned char* row, int64_t c) const {
    switch (y_.dtype) {
      case FMLP_DTYPE_F32: {
        float f;
        std::memcpy(&f, row + 4 * c, 4);
        return f;
      }
      case FMLP_DTYPE_F16: {
        uint16_t h;
        std::memcpy(&h, row + 2 * c, 2);
        return fmlp::f16_to_float(h);
      }
      default: {
        uint16_t h;
        std::memcpy(&h, row + 2 * c, 2);
        return fmlp::bf16_to_float(h);
      }
    }
  }

  HostMlp& problem_;
  DeviceArena arena_;
  cudaStream_t stream_ = nullptr;
  cudaGraphExec_t graph_ = nullptr;
  fmlp_tensor_t x_{}, y_{}, residual_{};
  std::vector<fmlp_mlp_weights_t> sets_;
  std::vector<fmlp::PackedMlp> packed_;
  fmlp_mlp_config_t config_{};
  std::string kernel_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace

bool cuda_runner_built() {
  return true;
}

std::unique_ptr<FusedRunner> make_cuda_runner(HostMlp& problem, bool packed) {
  return std::make_unique<CudaRunner>(problem, packed);
}

CudaDeviceInfo cuda_device_info(size_t copy_bytes) {
  CudaDeviceInfo info;
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  info.name = prop.name;
  info.l2_bytes = size_t(prop.l2CacheSize);
  int driver = 0;
  cudaDriverGetVersion(&driver);
  info.driver = fmt::format("{}.{}", driver / 1000, driver % 1000 / 10);
  // Device-to-device copy of a buffer far larger than the L2: read + write bytes per second.
  DeviceArena arena;
  void* a = arena.zeroed(copy_bytes);
  void* b = arena.zeroed(copy_bytes);
  cudaEvent_t e0, e1;
  check_cuda(cudaEventCreate(&e0), "cudaEventCreate");
  check_cuda(cudaEventCreate(&e1), "cudaEventCreate");
  double best = 0.0;
  for (int i = 0; i < 6; ++i) {
    cudaEventRecord(e0);
    cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    check_cuda(cudaEventSynchronize(e1), "measuring the copy bandwidth");
    float ms = 0.f;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i > 0) best = std::max(best, 2.0 * double(copy_bytes) / (double(ms) * 1e-3) * 1e-9);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  info.copy_gbps = best;
  return info;
}

}  // namespace fmlp_cli
