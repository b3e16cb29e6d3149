// C ABI: errors, names, tensor helpers, backend availability.
#include <algorithm>
#include <string>

#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#include "core/tensor_check.hpp"

#ifndef FMLP_VERSION_STRING
#define FMLP_VERSION_STRING "0.0.0"
#endif

namespace fmlp::detail {
namespace {
thread_local std::string g_last_error;
}
void set_last_error(std::string message) {
  g_last_error = std::move(message);
}
void clear_last_error() {
  g_last_error.clear();
}
const std::string& last_error() {
  return g_last_error;
}

fmlp_status_t copy_text_out(const std::string& text, char* buf, size_t buf_size, size_t* needed) {
  if (needed) *needed = text.size() + 1;
  if (buf && buf_size > 0) {
    const size_t n = std::min(text.size(), buf_size - 1);
    text.copy(buf, n);
    buf[n] = '\0';
  }
  clear_last_error();
  return FMLP_SUCCESS;
}

const std::string& ref_unavailable_reason() {
  static const std::string none;
  return none;
}

fmlp_status_t resolve_backend(fmlp_backend_t requested, fmlp_device_type_t device,
                              int32_t device_id, fmlp_backend_t* out) {
  if (unsigned(requested) > unsigned(FMLP_BACKEND_CUDA))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "backend is {}; expected auto (0), ref (1), cpu (2) or "
                "cuda (3)",
                int(requested));
  fmlp_backend_t b = requested;
  if (b == FMLP_BACKEND_AUTO)
    b = device == FMLP_DEVICE_CUDA         ? FMLP_BACKEND_CUDA
        : cpu_unavailable_reason().empty() ? FMLP_BACKEND_CPU
                                           : FMLP_BACKEND_REF;
  const bool wants_device = b == FMLP_BACKEND_CUDA;
  if (wants_device != (device == FMLP_DEVICE_CUDA))
    return fail(FMLP_ERROR_DEVICE_MISMATCH,
                "backend {} needs {} memory but the tensors are on {}; "
                "use backend {} or move the tensors",
                fmlp_backend_name(b), wants_device ? "CUDA device" : "host",
                device_string(device, device_id),
                device == FMLP_DEVICE_CUDA ? "cuda" : "cpu or ref");
  const std::string& why = b == FMLP_BACKEND_CUDA  ? cuda_unavailable_reason()
                           : b == FMLP_BACKEND_CPU ? cpu_unavailable_reason()
                                                   : ref_unavailable_reason();
  if (!why.empty())
    return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "backend {}: {}", fmlp_backend_name(b), why);
  *out = b;
  return FMLP_SUCCESS;
}
}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {

const char* fmlp_last_error(void) {
  return last_error().c_str();
}

const char* fmlp_status_name(fmlp_status_t s) {
  switch (s) {
    case FMLP_SUCCESS: return "success";
    case FMLP_ERROR_NULL_POINTER: return "null pointer";
    case FMLP_ERROR_INVALID_VALUE: return "invalid value";
    case FMLP_ERROR_SHAPE_MISMATCH: return "shape mismatch";
    case FMLP_ERROR_DTYPE_MISMATCH: return "dtype mismatch";
    case FMLP_ERROR_BAD_STRIDE: return "bad stride";
    case FMLP_ERROR_MISALIGNED: return "misaligned";
    case FMLP_ERROR_ALIASING: return "aliasing";
    case FMLP_ERROR_SIZE_OVERFLOW: return "size overflow";
    case FMLP_ERROR_DEVICE_MISMATCH: return "device mismatch";
    case FMLP_ERROR_NOT_SUPPORTED: return "not supported";
    case FMLP_ERROR_WORKSPACE_TOO_SMALL: return "workspace too small";
    case FMLP_ERROR_OUT_OF_MEMORY: return "out of memory";
    case FMLP_ERROR_BACKEND_UNAVAILABLE: return "backend unavailable";
    case FMLP_ERROR_CUDA: return "cuda error";
    case FMLP_ERROR_BAD_SCALE: return "bad scale";
    case FMLP_ERROR_INDEX_OUT_OF_RANGE: return "index out of range";
    case FMLP_ERROR_CORRUPT_FILE: return "corrupt file";
    case FMLP_ERROR_INTERNAL: return "internal error";
    case FMLP_STATUS_MAX_ENUM: break;  // not a status
  }
  return "unknown status";
}

const char* fmlp_version(void) {
  return FMLP_VERSION_STRING;
}

const char* fmlp_build_info(void) {
#ifdef FMLP_WITH_CUDA
  return "fusedmlp " FMLP_VERSION_STRING "; cuda on (" FMLP_CUDA_GENCODE_STRING ")";
#else
  return "fusedmlp " FMLP_VERSION_STRING "; cuda off";
#endif
}

fmlp_status_t fmlp_cuda_devices(char* buf, size_t buf_size, size_t* needed) {
  return copy_text_out(cuda_device_list(), buf, buf_size, needed);
}

const char* fmlp_backend_name(fmlp_backend_t b) {
  switch (b) {
    case FMLP_BACKEND_AUTO: return "auto";
    case FMLP_BACKEND_REF: return "ref";
    case FMLP_BACKEND_CPU: return "cpu";
    case FMLP_BACKEND_CUDA: return "cuda";
    case FMLP_BACKEND_MAX_ENUM: break;  // not a backend
  }
  return "unknown";
}

const char* fmlp_dtype_name(fmlp_dtype_t t) {
  switch (t) {
    case FMLP_DTYPE_F32: return "f32";
    case FMLP_DTYPE_F16: return "f16";
    case FMLP_DTYPE_BF16: return "bf16";
    case FMLP_DTYPE_F8_E4M3: return "f8_e4m3";
    default: return "invalid";
  }
}

const char* fmlp_activation_name(fmlp_activation_t a) {
  switch (a) {
    case FMLP_ACT_RELU: return "relu";
    case FMLP_ACT_GELU: return "gelu";
    case FMLP_ACT_GELU_TANH: return "gelu_tanh";
    case FMLP_ACT_SILU: return "silu";
    case FMLP_ACT_RELU2: return "relu2";
    case FMLP_ACT_MAX_ENUM: break;  // not an activation
  }
  return "unknown";
}

fmlp_status_t fmlp_backend_available(fmlp_backend_t backend) {
  const std::string* why = nullptr;
  switch (backend) {
    case FMLP_BACKEND_AUTO:
    case FMLP_BACKEND_REF: why = &ref_unavailable_reason(); break;
    case FMLP_BACKEND_CPU: why = &cpu_unavailable_reason(); break;
    case FMLP_BACKEND_CUDA: why = &cuda_unavailable_reason(); break;
    default:
      return fail(FMLP_ERROR_INVALID_VALUE,
                  "backend is {}; expected auto (0), ref (1), cpu (2) "
                  "or cuda (3)",
                  int(backend));
  }
  if (!why->empty()) return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "{}", *why);
  clear_last_error();
  return FMLP_SUCCESS;
}

fmlp_tensor_t fmlp_tensor_none(void) {
  return fmlp_tensor_t{};
}

fmlp_tensor_t fmlp_tensor_1d(void* data, fmlp_dtype_t dtype, int64_t n) {
  fmlp_tensor_t t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = 1;
  t.shape[0] = n;
  t.stride[0] = 1;
  return t;
}

fmlp_tensor_t fmlp_tensor_2d(void* data, fmlp_dtype_t dtype, int64_t rows, int64_t cols,
                             int64_t row_stride) {
  fmlp_tensor_t t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.stride[0] = row_stride;
  t.stride[1] = 1;
  return t;
}

fmlp_mlp_config_t fmlp_mlp_config_default(void) {
  fmlp_mlp_config_t c{};
  c.activation = FMLP_ACT_GELU;
  c.gated = 0;
  c.norm = FMLP_NORM_NONE;
  c.norm_eps = 1e-5f;
  c.deterministic = 0;
  return c;
}

}  // extern "C"
