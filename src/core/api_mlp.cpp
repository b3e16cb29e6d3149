// C ABI of the mlp op: validate once, pick a kernel from the op table, run it.
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#include "core/mlp_validate.hpp"
#include "core/planner.hpp"
#include "core/tensor_check.hpp"

namespace fmlp::detail {

std::string describe(const MlpDesc& d) {
  std::string s =
      fmt::format("M={} d_in={} hidden={} d_out={} x={} w={} {}{}", d.m, d.d_in, d.hidden, d.d_out,
                  fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype), d.gated ? "gated-" : "",
                  fmlp_activation_name(d.activation));
  if (d.norm == FMLP_NORM_LAYERNORM) s += " layernorm";
  if (d.norm == FMLP_NORM_RMSNORM) s += " rmsnorm";
  if (d.has_b1 || d.has_b_up || d.has_b2) s += " bias";
  if (d.has_residual) s += d.residual_is_y ? " residual(in-place)" : " residual";
  if (d.deterministic) s += " deterministic";
  s += " on " + device_string(d.device, d.device_id);
  return s;
}

std::vector<Candidate> mlp_candidates(const MlpDesc& desc, fmlp_backend_t backend) {
  std::vector<Candidate> out;
  const MlpKernelList lists[3] = {cuda_mlp_kernels(), cpu_mlp_kernels(), ref_mlp_kernels()};
  for (const MlpKernelList& list : lists)
    for (size_t i = 0; i < list.count; ++i) {
      const MlpKernel& k = list.kernels[i];
      if (k.backend != backend) continue;
      Candidate c{&k, false, {}};
      c.supported = k.supports(desc, &c.why);
      out.push_back(std::move(c));
    }
  return out;
}

fmlp_status_t resolve_backend(fmlp_backend_t requested, const MlpDesc& d, fmlp_backend_t* out) {
  if (unsigned(requested) > unsigned(FMLP_BACKEND_CUDA))
    return fail(FMLP_ERROR_INVALID_VALUE,
                "backend is {}; expected auto (0), ref (1), cpu (2) or "
                "cuda (3)",
                int(requested));
  fmlp_backend_t b = requested;
  if (b == FMLP_BACKEND_AUTO)
    b = d.device == FMLP_DEVICE_CUDA       ? FMLP_BACKEND_CUDA
        : cpu_unavailable_reason().empty() ? FMLP_BACKEND_CPU
                                           : FMLP_BACKEND_REF;
  const bool wants_device = b == FMLP_BACKEND_CUDA;
  if (wants_device != (d.device == FMLP_DEVICE_CUDA))
    return fail(FMLP_ERROR_DEVICE_MISMATCH,
                "backend {} needs {} memory but the tensors are on {}; "
                "use backend {} or move the tensors",
                fmlp_backend_name(b), wants_device ? "CUDA device" : "host",
                device_string(d.device, d.device_id),
                d.device == FMLP_DEVICE_CUDA ? "cuda" : "cpu or ref");
  const std::string& why = b == FMLP_BACKEND_CUDA  ? cuda_unavailable_reason()
                           : b == FMLP_BACKEND_CPU ? cpu_unavailable_reason()
                                                   : ref_unavailable_reason();
  if (!why.empty())
    return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "backend {}: {}", fmlp_backend_name(b), why);
  *out = b;
  return FMLP_SUCCESS;
}

namespace {

fmlp_status_t select_kernel(const MlpDesc& d, fmlp_backend_t requested, const MlpKernel** out) {
  fmlp_backend_t b;
  if (const fmlp_status_t s = resolve_backend(requested, d, &b); s != FMLP_SUCCESS) return s;
  // The CUDA planner picks decode or prefill entries by M and shape (core/planner.hpp).
  if (b == FMLP_BACKEND_CUDA)
    if (const MlpKernel* k = cuda_mlp_plan(d, nullptr)) {
      *out = k;
      return FMLP_SUCCESS;
    }
  // The common case allocates nothing: the first supporting entry wins and nobody reads `why`.
  std::string why;
  for (const MlpKernelList& list : {cuda_mlp_kernels(), cpu_mlp_kernels(), ref_mlp_kernels()})
    for (size_t i = 0; i < list.count; ++i)
      if (list.kernels[i].backend == b && list.kernels[i].supports(d, &why)) {
        *out = &list.kernels[i];
        return FMLP_SUCCESS;
      }
  std::string reasons;
  for (const Candidate& c : mlp_candidates(d, b))
    reasons += fmt::format("\n  {}: {}", c.kernel->name, c.why);
  return fail(FMLP_ERROR_NOT_SUPPORTED, "no {} kernel handles {}:{}{}", fmlp_backend_name(b),
              describe(d), reasons.empty() ? " (none registered)" : reasons.c_str(),
              b == FMLP_BACKEND_REF ? "" : "\n  (backend ref handles every valid host request)");
}

// Runs one chosen kernel after the workspace check; M = 0 is a successful no-op.
fmlp_status_t run_kernel(const MlpKernel& k, const fmlp_mlp_args_t& args, const MlpDesc& d,
                         void* workspace, size_t workspace_bytes, void* stream,
                         const char* size_query) {
  if (d.m == 0) {
    clear_last_error();
    return FMLP_SUCCESS;
  }
  const size_t need = k.workspace_bytes(d);
  if (need > 0 && (workspace == nullptr || workspace_bytes < need))
    return fail(FMLP_ERROR_WORKSPACE_TOO_SMALL,
                "kernel {} needs a workspace of {} bytes but got {} bytes{}; size it with {}",
                k.name, need, workspace == nullptr ? 0 : workspace_bytes,
                workspace == nullptr ? " (NULL)" : "", size_query);
  clear_last_error();
  return k.run(args, d, workspace, stream);
}

fmlp_status_t run_selected(const fmlp_mlp_args_t& args, const MlpDesc& d, fmlp_backend_t backend,
                           void* workspace, size_t workspace_bytes, void* stream,
                           const char* size_query) {
  const MlpKernel* k = nullptr;
  if (const fmlp_status_t s = select_kernel(d, backend, &k); s != FMLP_SUCCESS) return s;
  return run_kernel(*k, args, d, workspace, workspace_bytes, stream, size_query);
}

}  // namespace
}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {

fmlp_status_t fmlp_mlp_workspace_size(const fmlp_mlp_args_t* args, fmlp_backend_t backend,
                                      size_t* bytes) {
  if (bytes == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "bytes is NULL");
  MlpDesc d;
  if (const fmlp_status_t s = validate_mlp(args, &d); s != FMLP_SUCCESS) return s;
  const MlpKernel* k = nullptr;
  if (const fmlp_status_t s = select_kernel(d, backend, &k); s != FMLP_SUCCESS) return s;
  *bytes = d.m == 0 ? 0 : k->workspace_bytes(d);
  clear_last_error();
  return FMLP_SUCCESS;
}

fmlp_status_t fmlp_mlp(const fmlp_mlp_args_t* args, fmlp_backend_t backend, void* workspace,
                       size_t workspace_bytes, void* stream) {
  MlpDesc d;
  if (const fmlp_status_t s = validate_mlp(args, &d); s != FMLP_SUCCESS) return s;
  return run_selected(*args, d, backend, workspace, workspace_bytes, stream,
                      "fmlp_mlp_workspace_size");
}

fmlp_status_t fmlp_mlp_explain(const fmlp_mlp_args_t* args, fmlp_backend_t backend, char* buf,
                               size_t buf_size, size_t* needed) {
  MlpDesc d;
  if (const fmlp_status_t s = validate_mlp(args, &d); s != FMLP_SUCCESS) return s;
  fmlp_backend_t b;
  if (const fmlp_status_t s = resolve_backend(backend, d, &b); s != FMLP_SUCCESS) return s;
  std::string report = fmt::format("mlp {}\nbackend {}\n", describe(d), fmlp_backend_name(b));
  const MlpKernel* planned = nullptr;
  if (b == FMLP_BACKEND_CUDA) {
    std::string plan;
    planned = cuda_mlp_plan(d, &plan);
    report += fmt::format("  planner  {}\n", plan);
  }
  bool chosen = false;
  for (const Candidate& c : mlp_candidates(d, b))
    explain_entry(&report, &chosen, c.kernel->name, c.supported, c.why, planned != nullptr,
                  c.kernel == planned, [&] { return c.kernel->workspace_bytes(d); });
  if (!chosen) report += "  no kernel of this backend handles the request\n";
  return copy_text_out(report, buf, buf_size, needed);
}

}  // extern "C"

namespace {

fmlp_status_t packed_args(const fmlp_mlp_packed_t* p, const fmlp_tensor_t* y,
                          const fmlp_tensor_t* x, const fmlp_tensor_t* residual,
                          fmlp_mlp_args_t* args, MlpDesc* d) {
  if (p == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "packed is NULL");
  if (y == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "y is NULL");
  if (x == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "x is NULL");
  args->y = *y;
  args->x = *x;
  args->residual = residual ? *residual : fmlp_tensor_none();
  args->weights = p->weights;
  args->config = p->config;
  *d = p->desc;
  if (const fmlp_status_t s =
          validate_mlp_activations(args->y, args->x, &args->residual, args->weights, d);
      s != FMLP_SUCCESS)
    return s;
  return FMLP_SUCCESS;
}

}  // namespace

extern "C" {

fmlp_status_t fmlp_mlp_packed_workspace_size(const fmlp_mlp_packed_t* packed,
                                             const fmlp_tensor_t* y, const fmlp_tensor_t* x,
                                             size_t* bytes) {
  if (bytes == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "bytes is NULL");
  fmlp_mlp_args_t args{};
  MlpDesc d;
  if (const fmlp_status_t s = packed_args(packed, y, x, nullptr, &args, &d); s != FMLP_SUCCESS)
    return s;
  const MlpKernel* k = nullptr;
  if (const fmlp_status_t s = select_kernel(d, packed->backend, &k); s != FMLP_SUCCESS) return s;
  *bytes = d.m == 0 ? 0 : k->workspace_bytes(d);
  clear_last_error();
  return FMLP_SUCCESS;
}

fmlp_status_t fmlp_mlp_packed_run(const fmlp_mlp_packed_t* packed, const fmlp_tensor_t* y,
                                  const fmlp_tensor_t* x, const fmlp_tensor_t* residual,
                                  void* workspace, size_t workspace_bytes, void* stream) {
  fmlp_mlp_args_t args{};
  MlpDesc d;
  if (const fmlp_status_t s = packed_args(packed, y, x, residual, &args, &d); s != FMLP_SUCCESS)
    return s;
  return run_selected(args, d, packed->backend, workspace, workspace_bytes, stream,
                      "fmlp_mlp_packed_workspace_size");
}

}  // extern "C"

namespace {

std::vector<const MlpKernel*> all_kernels() {
  std::vector<const MlpKernel*> v;
  for (const MlpKernelList& l : {cuda_mlp_kernels(), cpu_mlp_kernels(), ref_mlp_kernels()})
    for (size_t i = 0; i < l.count; ++i) v.push_back(&l.kernels[i]);
  return v;
}

// Validates args and finds the named kernel; NOT_SUPPORTED (with the kernel's reason) when it
// cannot handle them, BACKEND_UNAVAILABLE when its backend cannot run here.
fmlp_status_t named_kernel(const fmlp_mlp_args_t* args, const char* name, MlpDesc* d,
                           const MlpKernel** out) {
  if (name == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "kernel name is NULL");
  if (const fmlp_status_t s = validate_mlp(args, d); s != FMLP_SUCCESS) return s;
  for (const MlpKernel* k : all_kernels()) {
    if (std::strcmp(k->name, name) != 0) continue;
    fmlp_backend_t b;
    if (const fmlp_status_t s = resolve_backend(k->backend, *d, &b); s != FMLP_SUCCESS) return s;
    std::string why;
    if (!k->supports(*d, &why))
      return fail(FMLP_ERROR_NOT_SUPPORTED, "{} does not handle {}: {}", name, describe(*d), why);
    *out = k;
    return FMLP_SUCCESS;
  }
  return fail(FMLP_ERROR_INVALID_VALUE, "no mlp kernel is named '{}'; fusedmlp info lists them",
              name);
}

}  // namespace

extern "C" {

int fmlp_mlp_kernel_count(void) {
  return int(all_kernels().size());
}

const char* fmlp_mlp_kernel_name(int i) {
  const auto v = all_kernels();
  return i >= 0 && size_t(i) < v.size() ? v[size_t(i)]->name : nullptr;
}

fmlp_backend_t fmlp_mlp_kernel_backend(int i) {
  const auto v = all_kernels();
  return i >= 0 && size_t(i) < v.size() ? v[size_t(i)]->backend : FMLP_BACKEND_AUTO;
}

fmlp_status_t fmlp_mlp_kernel_supports(const fmlp_mlp_args_t* args, const char* kernel) {
  MlpDesc d;
  const MlpKernel* k = nullptr;
  if (const fmlp_status_t s = named_kernel(args, kernel, &d, &k); s != FMLP_SUCCESS) return s;
  clear_last_error();
  return FMLP_SUCCESS;
}

fmlp_status_t fmlp_mlp_kernel_workspace_size(const fmlp_mlp_args_t* args, const char* kernel,
                                             size_t* bytes) {
  if (bytes == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "bytes is NULL");
  MlpDesc d;
  const MlpKernel* k = nullptr;
  if (const fmlp_status_t s = named_kernel(args, kernel, &d, &k); s != FMLP_SUCCESS) return s;
  *bytes = d.m == 0 ? 0 : k->workspace_bytes(d);
  clear_last_error();
  return FMLP_SUCCESS;
}

fmlp_status_t fmlp_mlp_with_kernel(const fmlp_mlp_args_t* args, const char* kernel, void* workspace,
                                   size_t workspace_bytes, void* stream) {
  MlpDesc d;
  const MlpKernel* k = nullptr;
  if (const fmlp_status_t s = named_kernel(args, kernel, &d, &k); s != FMLP_SUCCESS) return s;
  return run_kernel(*k, *args, d, workspace, workspace_bytes, stream,
                    "fmlp_mlp_kernel_workspace_size");
}

}  // extern "C"
