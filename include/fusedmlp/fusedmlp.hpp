// fusedmlp C++17 API: a thin layer over the C ABI (fusedmlp.h) that turns status codes into
// exceptions and owns packed weights and workspaces. Everything underneath returns status.
#pragma once
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.h"

namespace fmlp {

// Raw 16-bit storage types so callers can hand typed pointers to the view helpers.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};
struct f8e4m3_t {
  uint8_t bits;
};

template <typename T>
constexpr fmlp_dtype_t dtype_of();
template <>
constexpr fmlp_dtype_t dtype_of<float>() {
  return FMLP_DTYPE_F32;
}
template <>
constexpr fmlp_dtype_t dtype_of<f16_t>() {
  return FMLP_DTYPE_F16;
}
template <>
constexpr fmlp_dtype_t dtype_of<bf16_t>() {
  return FMLP_DTYPE_BF16;
}
template <>
constexpr fmlp_dtype_t dtype_of<f8e4m3_t>() {
  return FMLP_DTYPE_F8_E4M3;
}

class Error : public std::runtime_error {
 public:
  Error(fmlp_status_t status, const std::string& message)
      : std::runtime_error(std::string(fmlp_status_name(status)) + ": " + message),
        status_(status) {}
  fmlp_status_t status() const noexcept { return status_; }

 private:
  fmlp_status_t status_;
};

inline void check(fmlp_status_t status) {
  if (status != FMLP_SUCCESS) throw Error(status, fmlp_last_error());
}

// Host views. row_stride < 0 means contiguous rows.
template <typename T>
fmlp_tensor_t view(T* data, int64_t n) {
  return fmlp_tensor_1d(const_cast<std::remove_const_t<T>*>(data),
                        dtype_of<std::remove_const_t<T>>(), n);
}
template <typename T>
fmlp_tensor_t view(T* data, int64_t rows, int64_t cols, int64_t row_stride = -1) {
  return fmlp_tensor_2d(const_cast<std::remove_const_t<T>*>(data),
                        dtype_of<std::remove_const_t<T>>(), rows, cols,
                        row_stride < 0 ? cols : row_stride);
}
// The same view on a CUDA device.
inline fmlp_tensor_t on_cuda(fmlp_tensor_t t, int device_id = 0) {
  t.device_type = FMLP_DEVICE_CUDA;
  t.device_id = device_id;
  return t;
}

inline size_t mlp_workspace_size(const fmlp_mlp_args_t& args,
                                 fmlp_backend_t backend = FMLP_BACKEND_AUTO) {
  size_t bytes = 0;
  check(fmlp_mlp_workspace_size(&args, backend, &bytes));
  return bytes;
}

// Runs the mlp op; on the host, allocates the workspace when none is given.
inline void mlp(const fmlp_mlp_args_t& args, fmlp_backend_t backend = FMLP_BACKEND_AUTO,
                void* workspace = nullptr, size_t workspace_bytes = 0, void* stream = nullptr) {
  std::vector<unsigned char> owned;
  if (workspace == nullptr && args.x.device_type == FMLP_DEVICE_CPU) {
    owned.resize(mlp_workspace_size(args, backend));
    workspace = owned.empty() ? nullptr : owned.data();
    workspace_bytes = owned.size();
  }
  check(fmlp_mlp(&args, backend, workspace, workspace_bytes, stream));
}

inline std::string explain(const fmlp_mlp_args_t& args,
                           fmlp_backend_t backend = FMLP_BACKEND_AUTO) {
  size_t needed = 0;
  check(fmlp_mlp_explain(&args, backend, nullptr, 0, &needed));
  std::string s(needed, '\0');
  check(fmlp_mlp_explain(&args, backend, s.data(), s.size(), &needed));
  s.resize(needed - 1);
  return s;
}

// Weights packed once for one backend; run() many times.
class PackedMlp {
 public:
  PackedMlp(const fmlp_mlp_weights_t& weights, const fmlp_mlp_config_t& config,
            fmlp_backend_t backend = FMLP_BACKEND_AUTO, void* stream = nullptr) {
    fmlp_mlp_packed_t* p = nullptr;
    check(fmlp_mlp_pack(&p, &weights, &config, backend, stream));
    handle_.reset(p);
  }
  size_t workspace_size(const fmlp_tensor_t& y, const fmlp_tensor_t& x) const {
    size_t bytes = 0;
    check(fmlp_mlp_packed_workspace_size(handle_.get(), &y, &x, &bytes));
    return bytes;
  }
  // y = [residual +] mlp(x). On the host a workspace is allocated when none is given.
  void run(const fmlp_tensor_t& y, const fmlp_tensor_t& x, const fmlp_tensor_t* residual = nullptr,
           void* workspace = nullptr, size_t workspace_bytes = 0, void* stream = nullptr) const {
    std::vector<unsigned char> owned;
    if (workspace == nullptr && x.device_type == FMLP_DEVICE_CPU) {
      owned.resize(workspace_size(y, x));
      workspace = owned.empty() ? nullptr : owned.data();
      workspace_bytes = owned.size();
    }
    check(fmlp_mlp_packed_run(handle_.get(), &y, &x, residual, workspace, workspace_bytes, stream));
  }
  // The dispatch report of a call of x into y (fmlp_mlp_packed_explain).
  std::string explain(const fmlp_tensor_t& y, const fmlp_tensor_t& x) const {
    size_t needed = 0;
    check(fmlp_mlp_packed_explain(handle_.get(), &y, &x, nullptr, 0, &needed));
    std::string s(needed, '\0');
    check(fmlp_mlp_packed_explain(handle_.get(), &y, &x, s.data(), s.size(), &needed));
    s.resize(needed - 1);
    return s;
  }
  const fmlp_mlp_packed_t* get() const { return handle_.get(); }

 private:
  struct Deleter {
    void operator()(fmlp_mlp_packed_t* p) const { fmlp_mlp_packed_destroy(p); }
  };
  std::unique_ptr<fmlp_mlp_packed_t, Deleter> handle_;
};

// fp8 e4m3 quantisation on the host (policy: fmlp_quantize_fp8 in fusedmlp.h). scale is f32 [1]
// (per tensor) or [rows] (per row); returns the largest |w| over the finite values.
inline float quantize_fp8(const fmlp_tensor_t& w, const fmlp_tensor_t& q,
                          const fmlp_tensor_t& scale) {
  float amax = 0.f;
  check(fmlp_quantize_fp8(&w, &q, &scale, &amax));
  return amax;
}

// ---- linear and softmax ----
namespace detail {
template <typename ARGS, typename SIZE, typename RUN>
void run_with_host_workspace(const ARGS& args, fmlp_backend_t backend, void* workspace,
                             size_t workspace_bytes, void* stream, SIZE size, RUN run) {
  std::vector<unsigned char> owned;
  if (workspace == nullptr && args.x.device_type == FMLP_DEVICE_CPU) {
    size_t bytes = 0;
    check(size(&args, backend, &bytes));
    owned.resize(bytes);
    workspace = owned.empty() ? nullptr : owned.data();
    workspace_bytes = owned.size();
  }
  check(run(&args, backend, workspace, workspace_bytes, stream));
}
}  // namespace detail

// y = x W^T + bias; w_scale only for fp8 weights. On the host a workspace is allocated when none
// is given.
inline fmlp_linear_args_t linear_args(const fmlp_tensor_t& y, const fmlp_tensor_t& x,
                                      const fmlp_tensor_t& w,
                                      const fmlp_tensor_t& bias = fmlp_tensor_none(),
                                      const fmlp_tensor_t& w_scale = fmlp_tensor_none()) {
  return fmlp_linear_args_t{y, x, w, w_scale, bias};
}
inline void linear(const fmlp_linear_args_t& args, fmlp_backend_t backend = FMLP_BACKEND_AUTO,
                   void* workspace = nullptr, size_t workspace_bytes = 0, void* stream = nullptr) {
  detail::run_with_host_workspace(args, backend, workspace, workspace_bytes, stream,
                                  fmlp_linear_workspace_size, fmlp_linear);
}

// y = softmax(x / temperature) over the last dim (log_softmax when log is true).
inline fmlp_softmax_args_t softmax_args(const fmlp_tensor_t& y, const fmlp_tensor_t& x,
                                        float temperature = 1.f, bool log = false) {
  return fmlp_softmax_args_t{y, x, temperature, log ? 1 : 0};
}
inline void softmax(const fmlp_softmax_args_t& args, fmlp_backend_t backend = FMLP_BACKEND_AUTO,
                    void* workspace = nullptr, size_t workspace_bytes = 0, void* stream = nullptr) {
  detail::run_with_host_workspace(args, backend, workspace, workspace_bytes, stream,
                                  fmlp_softmax_workspace_size, fmlp_softmax);
}

// ---- mixture of experts (semantics: fmlp_moe in fusedmlp.h) ----
// Routing by the router router_w (pass topk_ids / topk_weights in args to give it instead). On
// the host a workspace is allocated when none is given.
inline fmlp_moe_args_t moe_args(const fmlp_tensor_t& y, const fmlp_tensor_t& x,
                                const fmlp_tensor_t& router_w, const fmlp_tensor_t& w1,
                                const fmlp_tensor_t& w2, const fmlp_moe_config_t& config) {
  fmlp_moe_args_t a{};
  a.y = y, a.x = x, a.router_w = router_w, a.w1 = w1, a.w2 = w2, a.config = config;
  return a;
}
inline void moe(const fmlp_moe_args_t& args, fmlp_backend_t backend = FMLP_BACKEND_AUTO,
                void* workspace = nullptr, size_t workspace_bytes = 0, void* stream = nullptr) {
  detail::run_with_host_workspace(args, backend, workspace, workspace_bytes, stream,
                                  fmlp_moe_workspace_size, fmlp_moe);
}

}  // namespace fmlp
