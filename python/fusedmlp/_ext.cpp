// fusedmlp._ext: the C ABI (fusedmlp.h) for Python. Every tensor arrives through nanobind's
// ndarray caster (DLPack or the buffer protocol), on the host or on a CUDA device, and becomes an
// fmlp_tensor_t view of the same memory; the library validates shapes, dtypes, strides,
// alignment and devices. Argument parsing, output allocation and framework glue (streams,
// workspaces) live in fusedmlp/__init__.py and fusedmlp/torch.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#if FMLP_EXT_CUDA
#include <cuda_runtime_api.h>
#endif

#include "_ext_api.h"
#include "fusedmlp/fusedmlp.h"

namespace nb = nanobind;

namespace {

// Names of arrays that carry another dtype's bits: numpy exports neither ml_dtypes.bfloat16 nor
// float8 through DLPack, so such arrays travel as uint16 / uint8 views named here ("bf16", "f8").
using Bits = std::map<std::string, std::string>;

// DLPack's kDLFloat8_e4m3fn; spelled out because older nanobind releases lack the enumerator.
constexpr uint8_t kDlpackFloat8E4m3fn = 10;

std::string dtype_label(nb::dlpack::dtype t) {
  const std::string bits = std::to_string(t.bits);
  switch (t.code) {
    case uint8_t(nb::dlpack::dtype_code::Int): return "int" + bits;
    case uint8_t(nb::dlpack::dtype_code::UInt): return "uint" + bits;
    case uint8_t(nb::dlpack::dtype_code::Float): return "float" + bits;
    case uint8_t(nb::dlpack::dtype_code::Bfloat): return "bfloat" + bits;
    case uint8_t(nb::dlpack::dtype_code::Complex): return "complex" + bits;
    case uint8_t(nb::dlpack::dtype_code::Bool): return "bool";
    case kDlpackFloat8E4m3fn: return "float8_e4m3fn";
  }
  return "dtype code " + std::to_string(t.code) + " of " + bits + " bits";
}

fmlp_dtype_t to_fmlp_dtype(nb::dlpack::dtype t, const std::string& bits_as) {
  if (t.lanes != 1) return FMLP_DTYPE_INVALID;
  if (bits_as == "bf16")
    return t == nb::dtype<uint16_t>() || t == nb::dtype<int16_t>() ? FMLP_DTYPE_BF16
                                                                   : FMLP_DTYPE_INVALID;
  if (bits_as == "f8")
    return t == nb::dtype<uint8_t>() || t == nb::dtype<int8_t>() ? FMLP_DTYPE_F8_E4M3
                                                                 : FMLP_DTYPE_INVALID;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 32) return FMLP_DTYPE_F32;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 16) return FMLP_DTYPE_F16;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return FMLP_DTYPE_BF16;
  if (t.code == kDlpackFloat8E4m3fn && t.bits == 8) return FMLP_DTYPE_F8_E4M3;
  return FMLP_DTYPE_INVALID;
}

[[noreturn]] void raise(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw nb::python_error();
}

// Bad arguments are ValueError; valid requests nothing here can run are NotImplementedError;
// failures of the machine (CUDA, memory) are RuntimeError / MemoryError.
[[noreturn]] void raise_status(fmlp_status_t status) {
  const std::string message = fmlp_last_error();
  switch (status) {
    case FMLP_ERROR_NOT_SUPPORTED:
    case FMLP_ERROR_BACKEND_UNAVAILABLE: raise(PyExc_NotImplementedError, message);
    case FMLP_ERROR_OUT_OF_MEMORY: raise(PyExc_MemoryError, message);
    case FMLP_ERROR_CUDA:
    case FMLP_ERROR_INTERNAL:
    case FMLP_ERROR_CORRUPT_FILE: raise(PyExc_RuntimeError, message);
    default: raise(PyExc_ValueError, message);
  }
}

void check(fmlp_status_t status) {
  if (status != FMLP_SUCCESS) raise_status(status);
}

std::string class_name(nb::handle h) {
  return nb::cast<std::string>(nb::getattr(nb::handle(Py_TYPE(h.ptr())), "__name__"));
}

std::string device_label(int32_t type, int32_t id) {
  if (type == nb::device::cpu::value) return "cpu";
  if (type == nb::device::cuda::value) return "cuda:" + std::to_string(id);
  if (type == nb::device::cuda_host::value) return "pinned host memory (DLPack kDLCUDAHost)";
  if (type == nb::device::cuda_managed::value) return "CUDA managed memory (DLPack kDLCUDAManaged)";
  return "DLPack device type " + std::to_string(type);
}

// Turns the Python arguments of one call into fmlp_tensor_t views. The imported arrays are kept
// until the call ends so that every view's memory stays referenced.
class Views {
 public:
  Views(nb::dict tensors, const Bits& bits) : tensors_(tensors), bits_(bits) {}

  fmlp_tensor_t input(const char* name) { return view(name, false); }
  fmlp_tensor_t output(const char* name) { return view(name, true); }

  // The moe op's given routing (topk_ids int32, topk_weights float32), which the C ABI takes as
  // bare pointers to [T, top_k] row-major arrays in x's memory: everything a pointer cannot
  // say (dtype, shape, layout, device) is checked here. NULL when the name is absent.
  const void* routing(const char* name, nb::dlpack::dtype want, const char* want_label,
                      const fmlp_tensor_t& x, int64_t top_k) {
    if (!tensors_.contains(name) || tensors_[name].is_none()) return nullptr;
    nb::handle h = tensors_[name];
    nb::ndarray<nb::ro> a;
    if (!nb::try_cast(h, a, false))
      raise(PyExc_ValueError, std::string(name) + " is a " + class_name(h) +
                                  "; expected an array that supports DLPack or the buffer "
                                  "protocol");
    if (a.dtype() != want)
      raise(PyExc_ValueError, std::string(name) + " has dtype " + dtype_label(a.dtype()) +
                                  "; expected " + want_label + " (cast it first)");
    const int64_t tokens = x.ndim == 2 ? x.shape[0] : -1;
    const std::string expected = "[" + (tokens < 0 ? std::string("T") : std::to_string(tokens)) +
                                 ", " + std::to_string(top_k) + "] (T = rows of x, top_k)";
    std::string got = "[";
    for (size_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
    got += "]";
    if (a.ndim() != 2 || (tokens >= 0 && int64_t(a.shape(0)) != tokens) ||
        int64_t(a.shape(1)) != top_k)
      raise(PyExc_ValueError, std::string(name) + " has shape " + got + "; expected " + expected);
    if ((a.shape(1) > 1 && a.stride(1) != 1) ||
        (a.shape(0) > 1 && a.stride(0) != int64_t(a.shape(1))))
      raise(PyExc_ValueError, std::string(name) +
                                  " is not contiguous (row-major); pass a contiguous array "
                                  "(e.g. .contiguous() or np.ascontiguousarray)");
    const int32_t type = a.device_type();
    const bool on_x = x.device_type == FMLP_DEVICE_CUDA
                          ? type == nb::device::cuda::value && int32_t(a.device_id()) == x.device_id
                          : type == nb::device::cpu::value;
    if (!on_x)
      raise(PyExc_ValueError,
            std::string(name) + " lives in " + device_label(type, a.device_id()) +
                "; expected it where x is (" +
                device_label(x.device_type == FMLP_DEVICE_CUDA ? nb::device::cuda::value
                                                               : nb::device::cpu::value,
                             x.device_id) +
                ")");
    const void* data = a.data();
    keep_.push_back(nb::ndarray<>(a));
    return data;
  }

 private:
  fmlp_tensor_t view(const char* name, bool writable) {
    if (!tensors_.contains(name)) return fmlp_tensor_none();
    nb::handle h = tensors_[name];
    if (h.is_none()) return fmlp_tensor_none();
    nb::ndarray<> a;
    bool ok;
    if (writable) {
      ok = nb::try_cast(h, a, false);
    } else {
      nb::ndarray<nb::ro> r;
      ok = nb::try_cast(h, r, false);
      if (ok) a = nb::ndarray<>(r);
    }
    if (!ok)
      raise(PyExc_ValueError, std::string(name) + " is a " + class_name(h) + "; expected a " +
                                  (writable ? "writable " : "") +
                                  "array that supports DLPack or the buffer protocol");
    const auto it = bits_.find(name);
    const std::string bits_as = it == bits_.end() ? "" : it->second;
    fmlp_tensor_t t = fmlp_tensor_none();
    t.dtype = to_fmlp_dtype(a.dtype(), bits_as);
    if (t.dtype == FMLP_DTYPE_INVALID)
      raise(PyExc_ValueError,
            std::string(name) + " has dtype " + dtype_label(a.dtype()) +
                (bits_as.empty() ? "; expected float32, float16 or bfloat16 (float8_e4m3fn for "
                                   "weights; cast it first)"
                                 : " but is named as carrying " + bits_as + " bits"));
    if (a.ndim() > FMLP_MAX_DIMS)
      raise(PyExc_ValueError, std::string(name) + " has " + std::to_string(a.ndim()) +
                                  " dimensions; fusedmlp takes at most " +
                                  std::to_string(FMLP_MAX_DIMS) + " (flatten leading dims)");
    const int32_t type = a.device_type();
    if (type == nb::device::cuda::value) {
      t.device_type = FMLP_DEVICE_CUDA;
    } else if (type == nb::device::cpu::value) {
      t.device_type = FMLP_DEVICE_CPU;
    } else {
      raise(PyExc_ValueError, std::string(name) + " lives in " + device_label(type, a.device_id()) +
                                  "; expected host (CPU) memory or CUDA device memory");
    }
    t.device_id = type == nb::device::cpu::value ? 0 : int32_t(a.device_id());
    t.data = a.data();
    t.ndim = int32_t(a.ndim());
    for (size_t i = 0; i < a.ndim(); ++i) {
      t.shape[i] = int64_t(a.shape(i));
      t.stride[i] = a.stride(i);
    }
    keep_.push_back(std::move(a));
    return t;
  }

  nb::dict tensors_;
  const Bits& bits_;
  std::vector<nb::ndarray<>> keep_;
};

// Makes the tensor's device current for the call (the library launches on the current device)
// and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(const fmlp_tensor_t& t) {
#if FMLP_EXT_CUDA
    if (t.device_type != FMLP_DEVICE_CUDA) return;
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != t.device_id)
      changed_ = cudaSetDevice(t.device_id) == cudaSuccess;
#else
    (void)t;
#endif
  }
  ~DeviceGuard() {
#if FMLP_EXT_CUDA
    if (changed_) cudaSetDevice(prev_);
#endif
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  bool changed_ = false;
};

// Scratch memory for one call. `ws` is None, an array (any dtype, contiguous, on the op's
// device) or a callable (bytes, device_type, device_id) -> array that the framework layer uses
// to allocate and cache zero-filled device workspaces. Host calls without a workspace use a
// per-thread buffer; CUDA calls need one from the caller (the zero-once contract is the
// caller's: fusedmlp.h).
class Workspace {
 public:
  Workspace(nb::handle ws, size_t bytes, const fmlp_tensor_t& on) : bytes_(bytes) {
    if (bytes == 0) return;
    nb::object source = nb::borrow(ws);
    if (!ws.is_none() && PyCallable_Check(ws.ptr()) && !nb::hasattr(ws, "__dlpack__"))
      source =
          nb::borrow(ws)(bytes, on.device_type == FMLP_DEVICE_CUDA ? "cuda" : "cpu", on.device_id);
    if (source.is_none()) {
      if (on.device_type == FMLP_DEVICE_CUDA)
        raise(PyExc_ValueError,
              "the call needs a CUDA workspace of " + std::to_string(bytes) +
                  " bytes and workspace is None; pass workspace= (a uint8 device array of at "
                  "least that size, zero-filled once and reused: fusedmlp's *_workspace_size "
                  "tells the size)");
      thread_local std::vector<unsigned char> host;
      if (host.size() < bytes) host.resize(bytes);
      data_ = host.data();
      return;
    }
    if (!nb::try_cast(source, array_, false))
      raise(PyExc_ValueError, "workspace is a " + class_name(source) +
                                  "; expected a writable array that supports DLPack");
    const int32_t type = array_.device_type();
    const bool same_device =
        on.device_type == FMLP_DEVICE_CUDA
            ? type == nb::device::cuda::value && array_.device_id() == on.device_id
            : type == nb::device::cpu::value;
    if (!same_device)
      raise(PyExc_ValueError,
            "workspace lives on " + device_label(type, array_.device_id()) +
                "; expected it on the tensors' device (" +
                (on.device_type == FMLP_DEVICE_CUDA ? "cuda:" + std::to_string(on.device_id)
                                                    : std::string("cpu")) +
                ")");
    size_t elements = 1;
    int64_t expected_stride = 1;
    bool contiguous = true;
    for (size_t i = array_.ndim(); i-- > 0;) {
      if (array_.shape(i) > 1 && array_.stride(i) != expected_stride) contiguous = false;
      expected_stride *= int64_t(array_.shape(i));
      elements *= array_.shape(i);
    }
    if (!contiguous)
      raise(PyExc_ValueError, "workspace is not contiguous; pass a contiguous array");
    const size_t have = elements * ((array_.dtype().bits + 7) / 8);
    if (have < bytes)
      raise(PyExc_ValueError, "workspace has " + std::to_string(have) + " bytes; the call needs " +
                                  std::to_string(bytes) + " (allocate it from *_workspace_size)");
    bytes_ = have;
    data_ = array_.data();
  }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  nb::ndarray<> array_;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

void* stream_ptr(uintptr_t stream) {
  return reinterpret_cast<void*>(stream);
}

// ---- mlp ----

fmlp_mlp_config_t mlp_config(int activation, bool gated, int norm, float eps, bool deterministic) {
  fmlp_mlp_config_t c = fmlp_mlp_config_default();
  c.activation = fmlp_activation_t(activation);
  c.gated = gated ? 1 : 0;
  c.norm = fmlp_norm_t(norm);
  c.norm_eps = eps;
  c.deterministic = deterministic ? 1 : 0;
  return c;
}

fmlp_mlp_weights_t mlp_weights(Views& v) {
  fmlp_mlp_weights_t w;
  w.w1 = v.input("w1");
  w.w1_scale = v.input("w1_scale");
  w.b1 = v.input("b1");
  w.w_up = v.input("w_up");
  w.w_up_scale = v.input("w_up_scale");
  w.b_up = v.input("b_up");
  w.w2 = v.input("w2");
  w.w2_scale = v.input("w2_scale");
  w.b2 = v.input("b2");
  w.norm_weight = v.input("norm_weight");
  w.norm_bias = v.input("norm_bias");
  return w;
}

fmlp_mlp_args_t mlp_args(Views& v, const fmlp_mlp_config_t& config) {
  fmlp_mlp_args_t a{};
  // x before out: an out allocated from a bad x would only repeat x's problem.
  a.x = v.input("x");
  a.y = v.output("out");
  a.residual = v.input("residual");
  a.weights = mlp_weights(v);
  a.config = config;
  return a;
}

template <typename ARGS, typename EXPLAIN>
std::string explain_text(const ARGS& args, int backend, EXPLAIN fn) {
  size_t needed = 0;
  check(fn(&args, fmlp_backend_t(backend), nullptr, 0, &needed));
  std::string report(needed, '\0');
  check(fn(&args, fmlp_backend_t(backend), report.data(), report.size(), &needed));
  report.resize(needed - 1);
  return report;
}

// The three modes every op binding has: "explain" returns the dispatch report, "workspace_size"
// the byte count, "run" None (the op runs with the GIL released, on the tensors' device).
template <typename ARGS, typename EXPLAIN, typename SIZE, typename RUN>
nb::object run_mode(const std::string& mode, const ARGS& args, int backend, nb::handle workspace,
                    uintptr_t stream, EXPLAIN explain, SIZE workspace_size, RUN run) {
  if (mode == "explain") return nb::cast(explain_text(args, backend, explain));
  DeviceGuard guard(args.x);
  size_t bytes = 0;
  check(workspace_size(&args, fmlp_backend_t(backend), &bytes));
  if (mode == "workspace_size") return nb::int_(bytes);
  Workspace ws(workspace, bytes, args.x);
  fmlp_status_t st;
  {
    nb::gil_scoped_release release;
    st = run(&args, fmlp_backend_t(backend), ws.data(), ws.bytes(), stream_ptr(stream));
  }
  check(st);
  return nb::none();
}

nb::object mlp(const std::string& mode, nb::dict tensors, const Bits& bits, int activation,
               bool gated, int norm, float eps, bool deterministic, int backend,
               nb::handle workspace, uintptr_t stream) {
  Views v(tensors, bits);
  const fmlp_mlp_args_t args = mlp_args(v, mlp_config(activation, gated, norm, eps, deterministic));
  return run_mode(mode, args, backend, workspace, stream, fmlp_mlp_explain, fmlp_mlp_workspace_size,
                  fmlp_mlp);
}

// The packs alive, by handle: the torch extension's ops name a pack by this integer (custom ops
// take tensors and scalars only) and hold it for the call through acquire_pack.
class PackRegistry {
 public:
  using Pack = std::shared_ptr<fmlp_mlp_packed_t>;
  int64_t add(const Pack& p) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t handle = next_++;
    packs_[handle] = p;
    return handle;
  }
  void remove(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    packs_.erase(handle);
  }
  Pack find(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = packs_.find(handle);
    return it == packs_.end() ? nullptr : it->second.lock();
  }
  static PackRegistry& get() {
    static PackRegistry* r = new PackRegistry();  // outlives every PackedMlp (never destroyed)
    return *r;
  }

 private:
  std::mutex mutex_;
  int64_t next_ = 1;
  std::unordered_map<int64_t, std::weak_ptr<fmlp_mlp_packed_t>> packs_;
};

// Weights validated and copied once into the backend's layout; run() then takes only x, out and
// residual. Owns the library's packed handle (host memory or device memory on the weights'
// device), shared with the torch ops that run it at the moment.
class PackedMlp {
 public:
  PackedMlp(nb::dict tensors, const Bits& bits, int activation, bool gated, int norm, float eps,
            bool deterministic, int backend, uintptr_t stream) {
    Views v(tensors, bits);
    const fmlp_mlp_weights_t w = mlp_weights(v);
    const fmlp_mlp_config_t c = mlp_config(activation, gated, norm, eps, deterministic);
    DeviceGuard guard(w.w1);
    fmlp_mlp_packed_t* packed = nullptr;
    fmlp_status_t st;
    {
      nb::gil_scoped_release release;
      st = fmlp_mlp_pack(&packed, &w, &c, fmlp_backend_t(backend), stream_ptr(stream));
    }
    check(st);
    packed_.reset(packed, fmlp_mlp_packed_destroy);
    handle_ = PackRegistry::get().add(packed_);
    d_in_ = w.w1.shape[1];
    d_out_ = w.w2.shape[0];
    hidden_ = w.w2.shape[1];
    device_type_ = w.w1.device_type;
    device_id_ = w.w1.device_id;
  }
  ~PackedMlp() { PackRegistry::get().remove(handle_); }
  PackedMlp(const PackedMlp&) = delete;
  PackedMlp& operator=(const PackedMlp&) = delete;

  nb::object run(const std::string& mode, nb::dict tensors, const Bits& bits, nb::handle workspace,
                 uintptr_t stream) const {
    Views v(tensors, bits);
    const fmlp_tensor_t x = v.input("x");
    const fmlp_tensor_t y = v.output("out");
    const fmlp_tensor_t residual = v.input("residual");
    DeviceGuard guard(x);
    if (mode == "explain") {
      size_t needed = 0;
      check(fmlp_mlp_packed_explain(packed_.get(), &y, &x, nullptr, 0, &needed));
      std::string text(needed, '\0');
      check(fmlp_mlp_packed_explain(packed_.get(), &y, &x, text.data(), text.size(), &needed));
      text.resize(needed - 1);
      return nb::cast(text);
    }
    size_t bytes = 0;
    check(fmlp_mlp_packed_workspace_size(packed_.get(), &y, &x, &bytes));
    if (mode == "workspace_size") return nb::int_(bytes);
    Workspace ws(workspace, bytes, x);
    fmlp_status_t st;
    {
      nb::gil_scoped_release release;
      st = fmlp_mlp_packed_run(packed_.get(), &y, &x, residual.ndim ? &residual : nullptr,
                               ws.data(), ws.bytes(), stream_ptr(stream));
    }
    check(st);
    return nb::none();
  }

  int64_t handle() const { return handle_; }
  int64_t d_in() const { return d_in_; }
  int64_t hidden() const { return hidden_; }
  int64_t d_out() const { return d_out_; }
  std::string device() const {
    return device_type_ == FMLP_DEVICE_CUDA ? "cuda:" + std::to_string(device_id_) : "cpu";
  }

 private:
  PackRegistry::Pack packed_;
  int64_t handle_ = 0;
  int64_t d_in_ = 0, hidden_ = 0, d_out_ = 0;
  fmlp_device_type_t device_type_ = FMLP_DEVICE_CPU;
  int32_t device_id_ = 0;
};

// ---- moe ----

// num_experts is w1's leading dimension (validation then checks w2, router_w and b1/b2 against
// it); an absent or 0-d w1 leaves it 1 so that validation reports w1 itself. first_expert and
// global_experts: the local expert range (expert parallelism; 0 and 0 without one).
// round_logits: config.round_router_logits.
nb::object moe(const std::string& mode, nb::dict tensors, const Bits& bits, int top_k,
               int activation, bool gated, int scoring, bool renormalize, bool deterministic,
               int first_expert, int global_experts, bool round_logits, int backend,
               nb::handle workspace, uintptr_t stream) {
  Views v(tensors, bits);
  fmlp_moe_args_t args{};
  args.x = v.input("x");
  args.y = v.output("out");
  args.residual = v.input("residual");
  args.router_w = v.input("router_w");
  args.router_b = v.input("router_b");
  args.w1 = v.input("w1");
  args.b1 = v.input("b1");
  args.w2 = v.input("w2");
  args.b2 = v.input("b2");
  args.w1_scale = v.input("w1_scale");
  args.w2_scale = v.input("w2_scale");
  args.topk_ids = static_cast<const int32_t*>(
      v.routing("topk_ids", nb::dtype<int32_t>(), "int32", args.x, top_k));
  args.topk_weights = static_cast<const float*>(
      v.routing("topk_weights", nb::dtype<float>(), "float32", args.x, top_k));
  args.config = fmlp_moe_config_default(args.w1.ndim > 0 ? int32_t(args.w1.shape[0]) : 1, top_k);
  args.config.activation = fmlp_activation_t(activation);
  args.config.gated = gated ? 1 : 0;
  args.config.scoring = fmlp_moe_scoring_t(scoring);
  args.config.renormalize = renormalize ? 1 : 0;
  args.config.deterministic = deterministic ? 1 : 0;
  args.config.first_expert = first_expert;
  args.config.global_experts = global_experts;
  args.config.round_router_logits = round_logits ? 1 : 0;
  return run_mode(mode, args, backend, workspace, stream, fmlp_moe_explain, fmlp_moe_workspace_size,
                  fmlp_moe);
}

// Reads and clears the out-of-range device expert id count of a cuda moe workspace
// (synchronises `stream`).
int moe_device_errors(nb::handle workspace, uintptr_t stream) {
  nb::ndarray<> a;
  if (!nb::try_cast(workspace, a, false))
    raise(PyExc_ValueError, "workspace is a " + class_name(workspace) +
                                "; expected the writable device array given to moe");
  if (a.device_type() != nb::device::cuda::value)
    raise(PyExc_ValueError, "workspace lives in " + device_label(a.device_type(), a.device_id()) +
                                "; only cuda moe workspaces count bad expert ids (host ids are "
                                "checked before the call)");
  fmlp_tensor_t on = fmlp_tensor_none();
  on.device_type = FMLP_DEVICE_CUDA;
  on.device_id = int32_t(a.device_id());
  DeviceGuard guard(on);
  size_t elements = 1;
  for (size_t i = 0; i < a.ndim(); ++i) elements *= a.shape(i);
  int32_t count = 0;
  fmlp_status_t st;
  {
    nb::gil_scoped_release release;
    st = fmlp_moe_device_errors(a.data(), elements * ((a.dtype().bits + 7) / 8), stream_ptr(stream),
                                &count);
  }
  check(st);
  return count;
}

// ---- linear and softmax ----

nb::object linear(const std::string& mode, nb::dict tensors, const Bits& bits, int backend,
                  nb::handle workspace, uintptr_t stream) {
  Views v(tensors, bits);
  fmlp_linear_args_t args{};
  args.x = v.input("x");
  args.y = v.output("out");
  args.w = v.input("w");
  args.w_scale = v.input("w_scale");
  args.x_scale = v.input("x_scale");
  args.bias = v.input("bias");
  return run_mode(mode, args, backend, workspace, stream, fmlp_linear_explain,
                  fmlp_linear_workspace_size, fmlp_linear);
}

nb::object softmax(const std::string& mode, nb::dict tensors, const Bits& bits, float temperature,
                   bool log, int backend, nb::handle workspace, uintptr_t stream) {
  Views v(tensors, bits);
  fmlp_softmax_args_t args{};
  args.x = v.input("x");
  args.y = v.output("out");
  args.temperature = temperature;
  args.log = log ? 1 : 0;
  return run_mode(mode, args, backend, workspace, stream, fmlp_softmax_explain,
                  fmlp_softmax_workspace_size, fmlp_softmax);
}

float quantize_fp8(nb::dict tensors, const Bits& bits) {
  Views v(tensors, bits);
  const fmlp_tensor_t w = v.input("w");
  const fmlp_tensor_t q = v.output("q");
  const fmlp_tensor_t scale = v.output("scale");
  float amax = 0.f;
  fmlp_status_t st;
  {
    nb::gil_scoped_release release;
    st = fmlp_quantize_fp8(&w, &q, &scale, &amax);
  }
  check(st);
  return amax;
}

// ---- info ----

std::tuple<bool, std::string> available(int backend) {
  const fmlp_status_t st = fmlp_backend_available(fmlp_backend_t(backend));
  return {st == FMLP_SUCCESS, st == FMLP_SUCCESS ? std::string() : fmlp_last_error()};
}

std::vector<std::tuple<std::string, std::string>> kernels(const std::string& op) {
  int (*count)() = fmlp_mlp_kernel_count;
  const char* (*name)(int) = fmlp_mlp_kernel_name;
  fmlp_backend_t (*backend)(int) = fmlp_mlp_kernel_backend;
  if (op == "linear") {
    count = fmlp_linear_kernel_count;
    name = fmlp_linear_kernel_name;
    backend = fmlp_linear_kernel_backend;
  } else if (op == "softmax") {
    count = fmlp_softmax_kernel_count;
    name = fmlp_softmax_kernel_name;
    backend = fmlp_softmax_kernel_backend;
  } else if (op == "moe") {
    count = fmlp_moe_kernel_count;
    name = fmlp_moe_kernel_name;
    backend = fmlp_moe_kernel_backend;
  } else if (op != "mlp") {
    raise(PyExc_ValueError, "op is '" + op + "'; expected 'mlp', 'moe', 'linear' or 'softmax'");
  }
  std::vector<std::tuple<std::string, std::string>> out;
  for (int i = 0; i < count(); ++i) out.emplace_back(name(i), fmlp_backend_name(backend(i)));
  return out;
}

std::string devices() {
  size_t needed = 0;
  check(fmlp_cuda_devices(nullptr, 0, &needed));
  std::string text(needed, '\0');
  check(fmlp_cuda_devices(text.data(), text.size(), &needed));
  text.resize(needed - 1);
  return text;
}

// ---- environment knobs (fmlp_knob_info) ----

// One knob as a dict; env is None when unset.
nb::dict knob_dict(int index) {
  fmlp_knob_info_t k{};
  check(fmlp_knob_info(index, &k));
  static const char* const kKinds[] = {"bool", "int", "float", "string"};
  nb::dict d;
  d["name"] = k.name;
  d["kind"] = unsigned(k.kind) < 4 ? kKinds[k.kind] : "unknown";
  d["scope"] = k.scope;
  d["default"] = k.default_value;
  d["range"] = k.range;
  d["purpose"] = k.purpose;
  d["env"] = k.env ? nb::object(nb::str(k.env)) : nb::none();
  d["value"] = k.value;
  d["error"] = k.error;
  return d;
}

std::vector<nb::dict> knobs() {
  std::vector<nb::dict> out;
  for (int i = 0; i < fmlp_knob_count(); ++i) out.push_back(knob_dict(i));
  return out;
}

nb::dict knob(const std::string& name) {
  const int i = fmlp_knob_find(name.c_str());
  if (i < 0)
    raise(PyExc_KeyError,
          name + " is not a fusedmlp knob (fusedmlp.knobs() lists them; docs/tuning.md)");
  return knob_dict(i);
}

// ---- the C ABI for the torch extension (_ext_api.h) ----

const fmlp_mlp_packed_t* acquire_pack(int64_t handle, void** hold) {
  PackRegistry::Pack p = PackRegistry::get().find(handle);
  if (!p) return nullptr;
  const fmlp_mlp_packed_t* raw = p.get();
  *hold = new PackRegistry::Pack(std::move(p));
  return raw;
}

void release_pack(void* hold) {
  delete static_cast<PackRegistry::Pack*>(hold);
}

int stream_capturing(void* stream) {
#if FMLP_EXT_CUDA
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) != cudaSuccess) return -1;
  return status == cudaStreamCaptureStatusNone ? 0 : 1;
#else
  (void)stream;
  return 0;
#endif
}

const fmlp_ext_api_t kApi = {FMLP_EXT_API_VERSION,
                             sizeof(fmlp_ext_api_t),
                             fmlp_last_error,
                             fmlp_mlp_config_default,
                             fmlp_moe_config_default,
                             fmlp_mlp_workspace_size,
                             fmlp_mlp,
                             fmlp_mlp_packed_workspace_size,
                             fmlp_mlp_packed_run,
                             fmlp_moe_workspace_size,
                             fmlp_moe,
                             fmlp_moe_device_errors,
                             fmlp_linear_workspace_size,
                             fmlp_linear,
                             fmlp_softmax_workspace_size,
                             fmlp_softmax,
                             acquire_pack,
                             release_pack,
                             stream_capturing};

}  // namespace

NB_MODULE(_ext, m) {
  using namespace nb::literals;
  // Optional arrays are None, which nanobind refuses unless the argument says .none().
  m.def("mlp", &mlp, "mode"_a, "tensors"_a, "bits"_a, "activation"_a, "gated"_a, "norm"_a, "eps"_a,
        "deterministic"_a, "backend"_a, "workspace"_a.none(), "stream"_a);
  nb::class_<PackedMlp>(m, "PackedMlp")
      .def(nb::init<nb::dict, const Bits&, int, bool, int, float, bool, int, uintptr_t>(),
           "tensors"_a, "bits"_a, "activation"_a, "gated"_a, "norm"_a, "eps"_a, "deterministic"_a,
           "backend"_a, "stream"_a)
      .def("run", &PackedMlp::run, "mode"_a, "tensors"_a, "bits"_a, "workspace"_a.none(),
           "stream"_a)
      .def_prop_ro("handle", &PackedMlp::handle)
      .def_prop_ro("d_in", &PackedMlp::d_in)
      .def_prop_ro("hidden", &PackedMlp::hidden)
      .def_prop_ro("d_out", &PackedMlp::d_out)
      .def_prop_ro("device", &PackedMlp::device);
  m.def("moe", &moe, "mode"_a, "tensors"_a, "bits"_a, "top_k"_a, "activation"_a, "gated"_a,
        "scoring"_a, "renormalize"_a, "deterministic"_a, "first_expert"_a, "global_experts"_a,
        "round_logits"_a, "backend"_a, "workspace"_a.none(), "stream"_a);
  m.def("moe_device_errors", &moe_device_errors, "workspace"_a, "stream"_a);
  m.def("linear", &linear, "mode"_a, "tensors"_a, "bits"_a, "backend"_a, "workspace"_a.none(),
        "stream"_a);
  m.def("softmax", &softmax, "mode"_a, "tensors"_a, "bits"_a, "temperature"_a, "log"_a, "backend"_a,
        "workspace"_a.none(), "stream"_a);
  m.def("quantize_fp8", &quantize_fp8, "tensors"_a, "bits"_a);
  m.def("available", &available);
  m.def("kernels", &kernels, "op"_a = "mlp");
  m.def("devices", &devices);
  m.def("build_info", [] { return std::string(fmlp_build_info()); });
  m.def("version", [] { return std::string(fmlp_version()); });
  m.def("with_cuda", [] { return bool(FMLP_EXT_CUDA); });
  m.def("knobs", &knobs);
  m.def("knob", &knob, "name"_a);
  m.attr("_api") = nb::capsule(&kApi, FMLP_EXT_API_CAPSULE);
}
