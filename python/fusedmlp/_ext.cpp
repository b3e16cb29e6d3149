// fusedmlp._ext: the C ABI (fusedmlp.h) for Python. Every tensor arrives through nanobind's
// ndarray caster (DLPack or the buffer protocol) and becomes an fmlp_tensor_t view of the same
// memory; argument parsing and output allocation live in fusedmlp/__init__.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "fusedmlp/fusedmlp.h"

namespace nb = nanobind;

namespace {

std::string dtype_label(nb::dlpack::dtype t) {
  const std::string bits = std::to_string(t.bits);
  switch (nb::dlpack::dtype_code(t.code)) {
    case nb::dlpack::dtype_code::Int: return "int" + bits;
    case nb::dlpack::dtype_code::UInt: return "uint" + bits;
    case nb::dlpack::dtype_code::Float: return "float" + bits;
    case nb::dlpack::dtype_code::Bfloat: return "bfloat" + bits;
    case nb::dlpack::dtype_code::Complex: return "complex" + bits;
    case nb::dlpack::dtype_code::Bool: return "bool";
  }
  return "dtype code " + std::to_string(t.code);
}

fmlp_dtype_t to_fmlp_dtype(nb::dlpack::dtype t) {
  if (t.lanes != 1) return FMLP_DTYPE_INVALID;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 32) return FMLP_DTYPE_F32;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 16) return FMLP_DTYPE_F16;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return FMLP_DTYPE_BF16;
  return FMLP_DTYPE_INVALID;
}

[[noreturn]] void raise_not_implemented(const std::string& message) {
  PyErr_SetString(PyExc_NotImplementedError, message.c_str());
  throw nb::python_error();
}

[[noreturn]] void raise_status(fmlp_status_t status) {
  const std::string message = fmlp_last_error();
  if (status == FMLP_ERROR_NOT_SUPPORTED || status == FMLP_ERROR_BACKEND_UNAVAILABLE)
    raise_not_implemented(message);
  throw nb::value_error(message.c_str());
}

// bf16_bits: a uint16 array that holds bfloat16 bits (numpy cannot export ml_dtypes.bfloat16).
template <typename ARRAY>
fmlp_tensor_t view_of(const char* name, const ARRAY& a, const void* data, bool bf16_bits) {
  const nb::dlpack::dtype dt = a.dtype();
  fmlp_tensor_t t = fmlp_tensor_none();
  t.dtype = bf16_bits && dt == nb::dtype<uint16_t>() ? FMLP_DTYPE_BF16 : to_fmlp_dtype(dt);
  if (t.dtype == FMLP_DTYPE_INVALID)
    throw nb::value_error((std::string(name) + " has dtype " + dtype_label(dt) +
                           "; expected float32, float16 or bfloat16 (cast it first)")
                              .c_str());
  if (a.ndim() > FMLP_MAX_DIMS)
    throw nb::value_error((std::string(name) + " has " + std::to_string(a.ndim()) +
                           " dimensions; fusedmlp takes at most " + std::to_string(FMLP_MAX_DIMS))
                              .c_str());
  if (a.device_type() == nb::device::cuda::value)
    raise_not_implemented(std::string(name) +
                          " is a CUDA tensor; CUDA tensors from Python arrive with the next slice "
                          "(copy it to the host for now)");
  if (a.device_type() != nb::device::cpu::value)
    throw nb::value_error((std::string(name) + " lives on DLPack device type " +
                           std::to_string(a.device_type()) + "; expected host (CPU) memory")
                              .c_str());
  t.data = const_cast<void*>(data);
  t.ndim = int32_t(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    t.shape[i] = int64_t(a.shape(i));
    t.stride[i] = a.stride(i);
  }
  t.device_type = FMLP_DEVICE_CPU;
  t.device_id = int32_t(a.device_id());
  return t;
}

std::string class_name(nb::handle h) {
  return nb::cast<std::string>(nb::getattr(nb::handle(Py_TYPE(h.ptr())), "__name__"));
}

// An input: absent when None, else a read-only view.
fmlp_tensor_t input(const char* name, nb::handle h, bool bf16_bits) {
  if (h.is_none()) return fmlp_tensor_none();
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(h, a, false))
    throw nb::value_error((std::string(name) + " is a " + class_name(h) +
                           "; expected an array that supports DLPack or the buffer protocol")
                              .c_str());
  return view_of(name, a, a.data(), bf16_bits);
}

fmlp_tensor_t output(const char* name, nb::handle h, bool bf16_bits) {
  nb::ndarray<> a;
  if (!nb::try_cast(h, a, false))
    throw nb::value_error((std::string(name) + " is a " + class_name(h) +
                           "; expected a writable array that supports DLPack or the buffer "
                           "protocol")
                              .c_str());
  return view_of(name, a, a.data(), bf16_bits);
}

// Runs (explain = false, returns "") or explains (returns the report) one mlp call.
std::string mlp(nb::handle y, nb::handle x, nb::handle residual, nb::handle w1, nb::handle b1,
                nb::handle w_up, nb::handle b_up, nb::handle w2, nb::handle b2,
                nb::handle norm_weight, nb::handle norm_bias, int activation, bool gated, int norm,
                float eps, bool deterministic, int backend, bool explain,
                const std::vector<std::string>& bf16_bits) {
  const auto bits = [&](const char* name) {
    return std::find(bf16_bits.begin(), bf16_bits.end(), name) != bf16_bits.end();
  };
  fmlp_mlp_args_t args{};
  // x before out: an out allocated from a bad x would only repeat x's problem.
  args.x = input("x", x, bits("x"));
  args.y = output("out", y, bits("out"));
  args.residual = input("residual", residual, bits("residual"));
  fmlp_mlp_weights_t& w = args.weights;
  w.w1 = input("w1", w1, bits("w1"));
  w.w1_scale = fmlp_tensor_none();
  w.b1 = input("b1", b1, bits("b1"));
  w.w_up = input("w_up", w_up, bits("w_up"));
  w.w_up_scale = fmlp_tensor_none();
  w.b_up = input("b_up", b_up, bits("b_up"));
  w.w2 = input("w2", w2, bits("w2"));
  w.w2_scale = fmlp_tensor_none();
  w.b2 = input("b2", b2, bits("b2"));
  w.norm_weight = input("norm_weight", norm_weight, bits("norm_weight"));
  w.norm_bias = input("norm_bias", norm_bias, bits("norm_bias"));
  args.config = fmlp_mlp_config_default();
  args.config.activation = fmlp_activation_t(activation);
  args.config.gated = gated ? 1 : 0;
  args.config.norm = fmlp_norm_t(norm);
  args.config.norm_eps = eps;
  args.config.deterministic = deterministic ? 1 : 0;
  const auto be = fmlp_backend_t(backend);

  if (explain) {
    size_t needed = 0;
    fmlp_status_t st = fmlp_mlp_explain(&args, be, nullptr, 0, &needed);
    if (st != FMLP_SUCCESS) raise_status(st);
    std::string report(needed, '\0');
    st = fmlp_mlp_explain(&args, be, report.data(), report.size(), &needed);
    if (st != FMLP_SUCCESS) raise_status(st);
    report.resize(needed - 1);
    return report;
  }

  size_t bytes = 0;
  fmlp_status_t st = fmlp_mlp_workspace_size(&args, be, &bytes);
  if (st != FMLP_SUCCESS) raise_status(st);
  // Kept per thread so repeated calls of one model shape do not reallocate.
  thread_local std::vector<unsigned char> workspace;
  if (workspace.size() < bytes) workspace.resize(bytes);
  {
    nb::gil_scoped_release release;
    st = fmlp_mlp(&args, be, bytes ? workspace.data() : nullptr, bytes, nullptr);
  }
  if (st != FMLP_SUCCESS) raise_status(st);
  return {};
}

std::tuple<bool, std::string> available(int backend) {
  const fmlp_status_t st = fmlp_backend_available(fmlp_backend_t(backend));
  return {st == FMLP_SUCCESS, st == FMLP_SUCCESS ? std::string() : fmlp_last_error()};
}

std::vector<std::tuple<std::string, std::string>> kernels() {
  std::vector<std::tuple<std::string, std::string>> out;
  for (int i = 0; i < fmlp_mlp_kernel_count(); ++i)
    out.emplace_back(fmlp_mlp_kernel_name(i), fmlp_backend_name(fmlp_mlp_kernel_backend(i)));
  return out;
}

}  // namespace

NB_MODULE(_ext, m) {
  // Optional tensors arrive as None, which nanobind refuses unless the argument says .none().
  m.def("mlp", &mlp, nb::arg("y"), nb::arg("x"), nb::arg("residual").none(), nb::arg("w1"),
        nb::arg("b1").none(), nb::arg("w_up").none(), nb::arg("b_up").none(), nb::arg("w2"),
        nb::arg("b2").none(), nb::arg("norm_weight").none(), nb::arg("norm_bias").none(),
        nb::arg("activation"), nb::arg("gated"), nb::arg("norm"), nb::arg("eps"),
        nb::arg("deterministic"), nb::arg("backend"), nb::arg("explain"), nb::arg("bf16_bits"));
  m.def("available", &available);
  m.def("kernels", &kernels);
  m.def("build_info", [] { return std::string(fmlp_build_info()); });
  m.def("version", [] { return std::string(fmlp_version()); });
}
