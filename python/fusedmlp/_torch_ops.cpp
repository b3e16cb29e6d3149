// fusedmlp._torch_ops: the torch.library ops of fusedmlp.torch (fusedmlp::mlp, mlp_packed, moe,
// linear, softmax) as C++ kernels that take at::Tensor, for CPU and CUDA tensors. A call reads
// the tensors' sizes, strides and pointers into fmlp_tensor_t views, allocates the output with
// torch, takes torch's current CUDA stream and a cached workspace, and calls the library; the
// library validates everything else (one place, as for every other surface). The Python custom
// ops that fusedmlp.torch defines without this module build DLPack capsules and dicts per call,
// several times the host time (bench/host_overhead.py).
//
// Built against the installed torch (python/CMakeLists.txt), linked to c10 and torch_cpu only:
// the library is reached through the function table of fusedmlp._ext (_ext_api.h), so the process
// keeps one copy of it, and CUDA through c10's device-guard interface (no CUDA headers here). The
// ops are registered when the module is imported, after that table is found, so a failed import
// leaves the namespace free for the Python ops. Fake kernels are registered in fusedmlp.torch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <Python.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "_ext_api.h"

namespace {

const fmlp_ext_api_t* g_api = nullptr;

using OptTensor = std::optional<at::Tensor>;

// An absent tensor (all zero), as fmlp_tensor_none() gives it.
constexpr fmlp_tensor_t kNone{};

// Bad arguments are ValueError; valid requests nothing here can run are NotImplementedError;
// failures of the machine (CUDA, memory) RuntimeError / torch.OutOfMemoryError: as fusedmlp._ext.
[[noreturn]] void raise_value(const std::string& message) {
  C10_THROW_ERROR(ValueError, message);
}

[[noreturn]] void raise_status(fmlp_status_t status) {
  const std::string message = g_api->last_error();
  switch (status) {
    case FMLP_ERROR_NOT_SUPPORTED:
    case FMLP_ERROR_BACKEND_UNAVAILABLE: C10_THROW_ERROR(NotImplementedError, message);
    case FMLP_ERROR_OUT_OF_MEMORY: C10_THROW_ERROR(OutOfMemoryError, message);
    case FMLP_ERROR_CUDA:
    case FMLP_ERROR_INTERNAL:
    case FMLP_ERROR_CORRUPT_FILE: C10_THROW_ERROR(Error, message);
    default: raise_value(message);
  }
}

void check(fmlp_status_t status) {
  if (status != FMLP_SUCCESS) raise_status(status);
}

// Python's spelling of a shape, as the messages of the Python ops print tuple(t.shape).
std::string py_tuple(at::IntArrayRef shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// numpy / DLPack names, as fusedmlp._ext reports dtypes.
std::string dtype_label(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

fmlp_dtype_t to_fmlp_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return FMLP_DTYPE_F32;
    case at::kHalf: return FMLP_DTYPE_F16;
    case at::kBFloat16: return FMLP_DTYPE_BF16;
    case at::kFloat8_e4m3fn: return FMLP_DTYPE_F8_E4M3;
    default: return FMLP_DTYPE_INVALID;
  }
}

// t's pointer, dtype and device as the library sees them (no shape yet); t must be on x's
// device (`on`).
fmlp_tensor_t placed(const char* name, const at::Tensor& t, const at::Device& on) {
  if (t.device() != on)
    raise_value(std::string(name) + " is on " + t.device().str() + "; expected " + on.str() +
                ", where x is (move it with .to())");
  fmlp_tensor_t v = kNone;
  v.dtype = to_fmlp_dtype(t.scalar_type());
  if (v.dtype == FMLP_DTYPE_INVALID)
    raise_value(std::string(name) + " has dtype " + dtype_label(t.scalar_type()) +
                "; expected float32, float16 or bfloat16 (float8_e4m3fn for weights; cast it "
                "first)");
  if (on.is_cuda()) {
    v.device_type = FMLP_DEVICE_CUDA;
    v.device_id = on.index();
  } else if (!on.is_cpu()) {
    raise_value(std::string(name) + " lives on " + on.str() +
                "; expected host (CPU) memory or CUDA device memory");
  }
  v.data = const_cast<void*>(t.const_data_ptr());
  return v;
}

// t's memory as the library sees it: shapes, strides, dtypes and alignment are the library's to
// check.
fmlp_tensor_t view(const char* name, const at::Tensor& t, const at::Device& on) {
  fmlp_tensor_t v = placed(name, t, on);
  if (t.dim() > FMLP_MAX_DIMS)
    raise_value(std::string(name) + " has " + std::to_string(t.dim()) +
                " dimensions; fusedmlp takes at most " + std::to_string(FMLP_MAX_DIMS) +
                " (flatten leading dims)");
  v.ndim = int32_t(t.dim());
  for (int32_t i = 0; i < v.ndim; ++i) {
    v.shape[i] = t.size(i);
    v.stride[i] = t.stride(i);
  }
  return v;
}

fmlp_tensor_t view(const char* name, const OptTensor& t, const at::Device& on) {
  return t.has_value() ? view(name, *t, on) : kNone;
}

// t as [rows, t.size(-1)] with a contiguous last dim: a view of t's memory when its leading dims
// fold into one row stride (no ATen call: the decode path), else of a copy kept in `copy`.
fmlp_tensor_t rows_view(const char* name, const at::Tensor& t, const at::Device& on,
                        at::Tensor* copy) {
  const int64_t nd = t.dim();
  if (nd == 0) raise_value(std::string(name) + " is a 0-d tensor; expected [..., features]");
  const int64_t cols = t.size(nd - 1);
  int64_t rows = 1, row_stride = cols, next = -1;
  bool folds = cols <= 1 || t.stride(nd - 1) == 1;
  for (int64_t i = nd - 2; i >= 0; --i) {
    const int64_t n = t.size(i);
    rows *= n;
    if (n == 1) continue;
    if (next < 0)
      row_stride = t.stride(i);
    else if (t.stride(i) != next)
      folds = false;
    next = t.stride(i) * n;
  }
  if (!folds && rows > 0) {
    *copy = t.reshape({-1, cols});
    if (cols > 1 && copy->stride(1) != 1) *copy = copy->contiguous();
    return view(name, *copy, on);
  }
  fmlp_tensor_t v = placed(name, t, on);
  v.ndim = 2;
  v.shape[0] = rows;
  v.shape[1] = cols;
  v.stride[0] = rows <= 1 ? cols : row_stride;
  v.stride[1] = 1;
  return v;
}

// A new [..., n] output in x's dtype and device (x's leading dims, `rows` in all) and its
// [rows, n] view.
at::Tensor new_rows(const at::Tensor& x, int64_t rows, int64_t n, fmlp_tensor_t* v) {
  c10::SmallVector<int64_t, FMLP_MAX_DIMS> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  *v = kNone;
  v->data = y.mutable_data_ptr();
  v->dtype = to_fmlp_dtype(y.scalar_type());
  v->ndim = 2;
  v->shape[0] = rows;
  v->shape[1] = n;
  v->stride[0] = n;
  v->stride[1] = 1;
  if (y.is_cuda()) {
    v->device_type = FMLP_DEVICE_CUDA;
    v->device_id = y.get_device();
  }
  return y;
}

// Makes x's CUDA device current for the call (the library launches on the current device).
struct DeviceScope {
  explicit DeviceScope(const at::Device& d) {
    if (d.is_cuda()) guard.reset_device(d);
  }
  c10::OptionalDeviceGuard guard;
};

void* current_stream(const at::Device& d) {
  if (!d.is_cuda()) return nullptr;
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(d).native_handle();
}

// ---- workspaces ----

// Zero-filled device workspaces, allocated through torch once per (device, size class, kind) and
// reused, as fusedmlp.h's contract allows for calls on one stream; one allocated while the
// stream captures a CUDA graph is the graph's own (its zero fill is part of the graph) and is not
// cached. kind "moe" keeps the moe op's apart: they carry its count of bad device expert ids.
// Host calls use a per-thread buffer. Never destroyed: the tensors must not be freed after torch's
// allocator at exit.
struct WorkspaceCache {
  std::mutex mutex;
  std::map<std::tuple<int, size_t, bool>, at::Tensor> tensors;
};
WorkspaceCache& workspace_cache() {
  static WorkspaceCache* cache = new WorkspaceCache();
  return *cache;
}

size_t size_class(size_t bytes) {  // a power of two, at least 4 KiB: few distinct buffers
  size_t n = 4096;
  while (n < bytes) n *= 2;
  return n;
}

struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
  at::Tensor keep;  // a graph's own workspace, alive for the call
};

Workspace workspace(size_t bytes, const at::Device& d, void* stream, bool moe) {
  Workspace ws;
  if (bytes == 0) return ws;
  if (!d.is_cuda()) {
    thread_local std::vector<unsigned char> host;
    if (host.size() < bytes) host.resize(bytes);
    ws.data = host.data();
    ws.bytes = host.size();
    return ws;
  }
  const size_t size = size_class(bytes);
  const auto key = std::make_tuple(int(d.index()), size, moe);
  WorkspaceCache& cache = workspace_cache();
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    const auto it = cache.tensors.find(key);
    if (it != cache.tensors.end()) {
      ws.data = it->second.mutable_data_ptr();
      ws.bytes = size;
      return ws;
    }
  }
  at::Tensor t = at::zeros({int64_t(size)}, at::TensorOptions().dtype(at::kByte).device(d));
  ws.data = t.mutable_data_ptr();
  ws.bytes = size;
  if (g_api->stream_capturing(stream) == 0) {
    std::lock_guard<std::mutex> lock(cache.mutex);
    cache.tensors.emplace(key, t);
  } else {
    ws.keep = t;
  }
  return ws;
}

// Sizes the workspace with SIZE(args), then runs RUN(args) on x's device and current stream.
template <typename ARGS, typename SIZE, typename RUN>
void run_op(const ARGS& args, const at::Device& d, SIZE size, RUN run, bool moe = false) {
  DeviceScope scope(d);
  void* stream = current_stream(d);
  size_t bytes = 0;
  check(size(&args, FMLP_BACKEND_AUTO, &bytes));
  Workspace ws = workspace(bytes, d, stream, moe);
  check(run(&args, FMLP_BACKEND_AUTO, ws.data, ws.bytes, stream));
}

// ---- names of the string arguments, as fusedmlp's Python tables spell them ----

template <size_t N>
int lookup(const char* name, const std::string& value, const char* const (&table)[N],
           const char* choices) {
  for (size_t i = 0; i < N; ++i)
    if (value == table[i]) return int(i);
  raise_value(std::string(name) + " is '" + value + "'; expected one of " + choices);
}

constexpr const char* kActivations[] = {"relu", "gelu", "gelu_tanh", "silu", "relu2"};
constexpr const char* kActivationChoices = "'relu', 'gelu', 'gelu_tanh', 'silu', 'relu2'";
constexpr const char* kNorms[] = {"none", "layernorm", "rmsnorm"};
constexpr const char* kNormChoices = "None, 'none', 'layernorm', 'rmsnorm'";
constexpr const char* kBackends[] = {"auto", "ref", "cpu", "cuda"};
constexpr const char* kBackendChoices = "'auto', 'ref', 'cpu', 'cuda'";
constexpr const char* kScorings[] = {"softmax", "sigmoid"};
constexpr const char* kScoringChoices = "'softmax', 'sigmoid'";

// ---- the ops ----

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w, const OptTensor& bias,
                     const OptTensor& w_scale) {
  const at::Device d = x.device();
  at::Tensor copy;
  fmlp_linear_args_t a{};
  a.x = rows_view("x", x, d, &copy);
  a.w = view("w", w, d);
  a.bias = view("bias", bias, d);
  a.w_scale = view("w_scale", w_scale, d);
  a.x_scale = kNone;
  at::Tensor y = new_rows(x, a.x.shape[0], w.dim() > 0 ? w.size(0) : 0, &a.y);
  run_op(a, d, g_api->linear_workspace_size, g_api->linear);
  return y;
}

at::Tensor softmax_op(const at::Tensor& x, double temperature, bool log) {
  const at::Device d = x.device();
  at::Tensor copy;
  fmlp_softmax_args_t a{};
  a.x = rows_view("x", x, d, &copy);
  a.temperature = float(temperature);
  a.log = log ? 1 : 0;
  at::Tensor y = new_rows(x, a.x.shape[0], x.size(-1), &a.y);
  run_op(a, d, g_api->softmax_workspace_size, g_api->softmax);
  return y;
}

at::Tensor mlp_op(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const OptTensor& b1, const OptTensor& w_up, const OptTensor& b_up,
                  const OptTensor& b2, const OptTensor& residual, const OptTensor& norm_weight,
                  const OptTensor& norm_bias, const OptTensor& w1_scale,
                  const OptTensor& w_up_scale, const OptTensor& w2_scale,
                  const std::string& activation, bool gated, const std::string& norm, double eps) {
  const at::Device d = x.device();
  at::Tensor x_copy, r_copy;
  fmlp_mlp_args_t a{};
  a.config = g_api->mlp_config_default();
  a.config.activation =
      fmlp_activation_t(lookup("activation", activation, kActivations, kActivationChoices));
  a.config.gated = gated ? 1 : 0;
  a.config.norm = fmlp_norm_t(lookup("norm", norm, kNorms, kNormChoices));
  a.config.norm_eps = float(eps);
  a.x = rows_view("x", x, d, &x_copy);
  a.residual = residual.has_value() ? rows_view("residual", *residual, d, &r_copy) : kNone;
  fmlp_mlp_weights_t& w = a.weights;
  w.w1 = view("w1", w1, d);
  w.w1_scale = view("w1_scale", w1_scale, d);
  w.b1 = view("b1", b1, d);
  w.w_up = view("w_up", w_up, d);
  w.w_up_scale = view("w_up_scale", w_up_scale, d);
  w.b_up = view("b_up", b_up, d);
  w.w2 = view("w2", w2, d);
  w.w2_scale = view("w2_scale", w2_scale, d);
  w.b2 = view("b2", b2, d);
  w.norm_weight = view("norm_weight", norm_weight, d);
  w.norm_bias = view("norm_bias", norm_bias, d);
  if (w2.dim() == 0) raise_value("w2 has shape (); expected [d_out, hidden]");
  at::Tensor y = new_rows(x, a.x.shape[0], w2.size(0), &a.y);
  run_op(a, d, g_api->mlp_workspace_size, g_api->mlp);
  return y;
}

// Holds the pack that `handle` names for the call.
class PackHold {
 public:
  explicit PackHold(int64_t handle) : packed_(g_api->acquire_pack(handle, &hold_)) {
    if (packed_ == nullptr)
      raise_value("handle " + std::to_string(handle) +
                  " names no live packed mlp (its FusedMLP was deleted or repacked); rebuild "
                  "the compiled graph from the live module");
  }
  ~PackHold() {
    if (packed_ != nullptr) g_api->release_pack(hold_);
  }
  PackHold(const PackHold&) = delete;
  PackHold& operator=(const PackHold&) = delete;
  const fmlp_mlp_packed_t* get() const { return packed_; }

 private:
  void* hold_ = nullptr;
  const fmlp_mlp_packed_t* packed_;
};

at::Tensor mlp_packed_op(const at::Tensor& x, const OptTensor& residual, int64_t handle,
                         int64_t d_out) {
  const PackHold pack(handle);
  const at::Device d = x.device();
  at::Tensor x_copy, r_copy;
  const fmlp_tensor_t xv = rows_view("x", x, d, &x_copy);
  const fmlp_tensor_t rv =
      residual.has_value() ? rows_view("residual", *residual, d, &r_copy) : kNone;
  fmlp_tensor_t yv;
  at::Tensor y = new_rows(x, xv.shape[0], d_out, &yv);
  DeviceScope scope(d);
  void* stream = current_stream(d);
  size_t bytes = 0;
  check(g_api->mlp_packed_workspace_size(pack.get(), &yv, &xv, &bytes));
  Workspace ws = workspace(bytes, d, stream, false);
  check(g_api->mlp_packed_run(pack.get(), &yv, &xv, residual.has_value() ? &rv : nullptr, ws.data,
                              ws.bytes, stream));
  return y;
}

// The moe op's given routing as the C ABI reads it: [rows, top_k] contiguous on x's device,
// ids int32 (other integer dtypes cast: host values int32 cannot hold are reported, device ones
// clamped to [-1, experts], which keeps them out of range), weights float32.
const void* routing(const char* name, const OptTensor& t, const at::Tensor& x, int64_t rows,
                    int64_t top_k, int64_t experts, bool ids, at::Tensor* keep) {
  if (!t.has_value()) return nullptr;
  if (t->dim() == 0 || t->size(-1) != top_k || t->numel() != rows * top_k) {
    std::vector<int64_t> want(x.sizes().begin(), x.sizes().end() - 1);
    want.push_back(top_k);
    raise_value(std::string(name) + " has shape " + py_tuple(t->sizes()) +
                "; expected [..., top_k] = " + py_tuple(want) + " (x's leading dims)");
  }
  if (t->device() != x.device())
    raise_value(std::string(name) + " is on " + t->device().str() + "; expected " +
                x.device().str() + ", where x is (move it with .to())");
  at::Tensor r = t->reshape({rows, top_k});
  const at::ScalarType st = r.scalar_type();
  const bool integral = at::isIntegralType(st, /*includeBool=*/false);
  if (ids && integral && st != at::kInt) {
    if (r.is_cuda()) {
      r = r.clamp(-1, experts).to(at::kInt);
    } else {
      if (r.numel() > 0) {
        const int64_t lo = r.min().item<int64_t>(), hi = r.max().item<int64_t>();
        if (lo < INT32_MIN || hi > INT32_MAX)
          raise_value("topk_ids holds " + std::to_string(hi > INT32_MAX ? hi : lo) +
                      "; expert ids must be in [0, " + std::to_string(experts) +
                      ") (num_experts = w1.shape[0])");
      }
      r = r.to(at::kInt);
    }
  } else if (!ids && at::isFloatingType(st) && st != at::kFloat) {
    r = r.to(at::kFloat);
  }
  if (r.scalar_type() != (ids ? at::kInt : at::kFloat))
    raise_value(std::string(name) + " has dtype " + dtype_label(r.scalar_type()) + "; expected " +
                (ids ? "int32" : "float32") + " (cast it first)");
  *keep = r.contiguous();
  return keep->const_data_ptr();
}

at::Tensor moe_op(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, int64_t top_k,
                  const OptTensor& router_w, const OptTensor& router_b, const OptTensor& topk_ids,
                  const OptTensor& topk_weights, const OptTensor& b1, const OptTensor& b2,
                  const OptTensor& residual, const std::string& activation, bool gated,
                  const std::string& scoring, bool renormalize, bool deterministic,
                  const std::string& backend, int64_t first_expert, int64_t global_experts,
                  bool round_router_logits, const OptTensor& w1_scale, const OptTensor& w2_scale) {
  const at::Device d = x.device();
  at::Tensor x_copy, r_copy, ids_keep, weights_keep;
  fmlp_moe_args_t a{};
  a.x = rows_view("x", x, d, &x_copy);
  if (w2.dim() != 3)
    raise_value("w2 has shape " + py_tuple(w2.sizes()) + "; expected [num_experts, d_out, hidden]");
  const int64_t rows = a.x.shape[0];
  const int64_t experts = global_experts > 0 ? global_experts : (w1.dim() > 0 ? w1.size(0) : 1);
  a.topk_ids = static_cast<const int32_t*>(
      routing("topk_ids", topk_ids, x, rows, top_k, experts, true, &ids_keep));
  a.topk_weights = static_cast<const float*>(
      routing("topk_weights", topk_weights, x, rows, top_k, experts, false, &weights_keep));
  a.residual = residual.has_value() ? rows_view("residual", *residual, d, &r_copy) : kNone;
  a.router_w = view("router_w", router_w, d);
  a.router_b = view("router_b", router_b, d);
  a.w1 = view("w1", w1, d);
  a.b1 = view("b1", b1, d);
  a.w2 = view("w2", w2, d);
  a.b2 = view("b2", b2, d);
  a.w1_scale = view("w1_scale", w1_scale, d);
  a.w2_scale = view("w2_scale", w2_scale, d);
  a.config = g_api->moe_config_default(a.w1.ndim > 0 ? int32_t(a.w1.shape[0]) : 1, int32_t(top_k));
  a.config.activation =
      fmlp_activation_t(lookup("activation", activation, kActivations, kActivationChoices));
  a.config.gated = gated ? 1 : 0;
  a.config.scoring = fmlp_moe_scoring_t(lookup("scoring", scoring, kScorings, kScoringChoices));
  a.config.renormalize = renormalize ? 1 : 0;
  a.config.deterministic = deterministic ? 1 : 0;
  a.config.first_expert = int32_t(first_expert);
  a.config.global_experts = int32_t(global_experts);
  a.config.round_router_logits = round_router_logits ? 1 : 0;
  const auto b = fmlp_backend_t(lookup("backend", backend, kBackends, kBackendChoices));
  at::Tensor y = new_rows(x, rows, w2.size(1), &a.y);
  DeviceScope scope(d);
  void* stream = current_stream(d);
  size_t bytes = 0;
  check(g_api->moe_workspace_size(&a, b, &bytes));
  Workspace ws = workspace(bytes, d, stream, true);
  check(g_api->moe(&a, b, ws.data, ws.bytes, stream));
  return y;
}

// The count of out-of-range device expert ids in the cached moe workspaces of CUDA device
// `device` since the last read (reset to 0); synchronises its current stream.
int64_t moe_device_errors_op(int64_t device) {
  const at::Device d(c10::DeviceType::CUDA, c10::DeviceIndex(device));
  DeviceScope scope(d);
  void* stream = current_stream(d);
  std::vector<at::Tensor> mine;
  {
    WorkspaceCache& cache = workspace_cache();
    std::lock_guard<std::mutex> lock(cache.mutex);
    for (const auto& [key, t] : cache.tensors)
      if (std::get<0>(key) == device && std::get<2>(key)) mine.push_back(t);
  }
  int64_t total = 0;
  for (const at::Tensor& t : mine) {
    int32_t count = 0;
    check(g_api->moe_device_errors(t.mutable_data_ptr(), size_t(t.numel()), stream, &count));
    total += count;
  }
  return total;
}

void register_ops() {
  // Never destroyed: deregistering at exit could run after torch's own teardown.
  auto* def = new torch::Library(torch::Library::DEF, "fusedmlp", std::nullopt, __FILE__, __LINE__);
  def->set_python_module("fusedmlp.torch");
  def->def(
      "mlp(Tensor x, Tensor w1, Tensor w2, Tensor? b1=None, Tensor? w_up=None, Tensor? b_up=None, "
      "Tensor? b2=None, Tensor? residual=None, Tensor? norm_weight=None, Tensor? norm_bias=None, "
      "Tensor? w1_scale=None, Tensor? w_up_scale=None, Tensor? w2_scale=None, "
      "str activation=\"gelu\", bool gated=False, str norm=\"none\", float eps=1e-05) -> Tensor");
  def->def("mlp_packed(Tensor x, Tensor? residual, SymInt handle, SymInt d_out) -> Tensor");
  def->def(
      "moe(Tensor x, Tensor w1, Tensor w2, SymInt top_k, Tensor? router_w=None, "
      "Tensor? router_b=None, Tensor? topk_ids=None, Tensor? topk_weights=None, Tensor? b1=None, "
      "Tensor? b2=None, Tensor? residual=None, str activation=\"silu\", bool gated=True, "
      "str scoring=\"softmax\", bool renormalize=True, bool deterministic=False, "
      "str backend=\"auto\", SymInt first_expert=0, SymInt global_experts=0, "
      "bool round_router_logits=False, Tensor? w1_scale=None, Tensor? w2_scale=None) -> Tensor");
  def->def("linear(Tensor x, Tensor w, Tensor? bias=None, Tensor? w_scale=None) -> Tensor");
  def->def("softmax(Tensor x, float temperature=1., bool log=False) -> Tensor");
  def->def("_moe_device_errors(int device) -> int", &moe_device_errors_op);
  for (const c10::DispatchKey key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA}) {
    auto* impl = new torch::Library(torch::Library::IMPL, "fusedmlp", key, __FILE__, __LINE__);
    impl->impl("mlp", TORCH_FN(mlp_op));
    impl->impl("mlp_packed", TORCH_FN(mlp_packed_op));
    impl->impl("moe", TORCH_FN(moe_op));
    impl->impl("linear", TORCH_FN(linear_op));
    impl->impl("softmax", TORCH_FN(softmax_op));
  }
  // Inference ops: an output of inputs that require grad gets a node that raises on backward.
  auto* grad = new torch::Library(torch::Library::IMPL, "fusedmlp", c10::DispatchKey::Autograd,
                                  __FILE__, __LINE__);
  for (const char* op : {"mlp", "mlp_packed", "moe", "linear", "softmax"})
    grad->impl(op, torch::autograd::autogradNotImplementedFallback());
}

PyModuleDef g_module = {PyModuleDef_HEAD_INIT,
                        "_torch_ops",
                        "fusedmlp's torch.library ops in C++ (see fusedmlp.torch)",
                        -1,
                        nullptr,
                        nullptr,
                        nullptr,
                        nullptr,
                        nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__torch_ops(void) {
  const auto* api = static_cast<const fmlp_ext_api_t*>(PyCapsule_Import(FMLP_EXT_API_CAPSULE, 0));
  if (api == nullptr) return nullptr;
  if (api->version != FMLP_EXT_API_VERSION || api->size != sizeof(fmlp_ext_api_t)) {
    PyErr_Format(PyExc_ImportError,
                 "fusedmlp._torch_ops was built for fusedmlp._ext API version %d but this _ext "
                 "has version %d; reinstall fusedmlp (pip install . rebuilds both)",
                 FMLP_EXT_API_VERSION, int(api->version));
    return nullptr;
  }
  g_api = api;
  try {
    register_ops();
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_ImportError, "fusedmlp._torch_ops could not register its ops: %s", e.what());
    return nullptr;
  }
  return PyModule_Create(&g_module);
}
