// The op table every op (mlp, linear, softmax, moe) dispatches through: an entry type per op, each
// backend's list of entries, and the select / run / explain / named-kernel / workspace logic with
// its checks (workspace size and CUDA alignment) written once. An op plugs in through a traits
// struct OP with
//   using Args = fmlp_<op>_args_t; using Desc = <Op>Desc;
//   static constexpr const char* kName;        // "linear", for messages
//   static fmlp_status_t validate(const Args*, Desc*);
//   static std::string describe(const Desc&);
//   static bool empty(const Desc&);            // nothing to compute: success without a kernel
//   static std::array<OpKernelList<Args, Desc>, 3> lists();   // cuda, cpu, ref
//   // A planner's pick for backend b (first-supporting order otherwise): null when there is no
//   // planner or it has no opinion; `reason` (may be null) gets its explanation. The cuda
//   // planners share one interface (core/planner.hpp).
//   static const OpKernel<Args, Desc>* plan(const Desc&, fmlp_backend_t b, std::string* reason);
// and optionally
//   // One more explain line for backend b, "" for none: what the caller could change to reach
//   // a faster entry (the unpacked MLP's odd sizes, a linear's unpadded row stride).
//   static std::string explain_note(const Desc&, fmlp_backend_t b);
#pragma once
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.hpp"

namespace fmlp::detail {

template <typename ARGS, typename DESC>
struct OpKernel {
  const char* name;  // op_arch_technique, e.g. mlp_cpu_avx2_decode
  fmlp_backend_t backend;
  // True when the kernel handles `desc`; otherwise *why (never null) says what it lacks.
  bool (*supports)(const DESC& desc, std::string* why);
  size_t (*workspace_bytes)(const DESC& desc);
  // `args` are validated; the workspace holds workspace_bytes(desc). Never throws.
  fmlp_status_t (*run)(const ARGS& args, const DESC& desc, void* workspace, void* stream);
  // CUDA: true when the entry keeps its counters in the zeroed part of the workspace and its
  // scratch past it (cuda_workspace_scratch; workspace_bytes counts both); false when every byte
  // of its workspace is a zero-filled table (see kCudaWorkspaceZeroedBytes).
  bool scratch = false;
};

// One backend's contribution to an op's table, in order of preference.
template <typename ARGS, typename DESC>
struct OpKernelList {
  const OpKernel<ARGS, DESC>* kernels;
  size_t count;
};

// Why the backend cannot run on this machine, or empty when it can.
// Computed once per process; dispatch asks on every call.
const std::string& ref_unavailable_reason();
const std::string& cpu_unavailable_reason();
const std::string& cuda_unavailable_reason();
std::string cuda_device_list();  // one line per device; empty without CUDA or devices

// Resolves AUTO (device memory: cuda; host memory: cpu when this CPU has the ISA, else ref) and
// checks that the backend matches where the data lives and can run here.
fmlp_status_t resolve_backend(fmlp_backend_t requested, fmlp_device_type_t device,
                              int32_t device_id, fmlp_backend_t* out);

// An explain report's line for one table entry, in table order: the first supported entry that is
// the planner's pick (any, without a planner: `planned` false) is chosen, with the workspace
// ws_bytes() gives (asked of the chosen entry alone); *chosen says whether one was chosen yet.
template <typename WS>
void explain_entry(std::string* report, bool* chosen, const char* name, bool supported,
                   const std::string& why, bool planned, bool is_planned, WS ws_bytes) {
  if (supported && !*chosen && (!planned || is_planned)) {
    *chosen = true;
    *report += "  chosen   " + std::string(name) + " (workspace " + std::to_string(ws_bytes()) +
               " bytes)\n";
  } else if (supported) {
    *report += "  skipped  " + std::string(name) + ": " +
               (planned ? "the planner prefers another entry" : "an earlier entry is preferred") +
               "\n";
  } else {
    *report += "  rejected " + std::string(name) + ": " + why + "\n";
  }
}

// Hands a text to a C caller: its size with the NUL into *needed (if given), as much as fits
// into buf (NUL-terminated; nothing when buf_size is 0), and success with the last error cleared.
fmlp_status_t copy_text_out(const std::string& text, char* buf, size_t buf_size, size_t* needed);

// The CUDA kernels lay their tables out on 256-byte boundaries from the workspace's base and store
// 16 bytes at a time into them (fusedmlp.h: FMLP_ERROR_MISALIGNED).
constexpr uintptr_t kCudaWorkspaceAlign = 256;

// The two parts of a CUDA workspace (fusedmlp.h): its first kCudaWorkspaceZeroedBytes hold what
// kernels count and flag in, zero between calls; past them is scratch, which any call may leave
// dirty (h, partial sums, cuBLASLt's workspace), so no call pays for clearing megabytes. Every
// entry's zero-filled tables start at the base; an entry whose tables reach past the zeroed part
// (large split-hidden accumulators) finds scratch there and clears it first (run_entry). 4 MiB
// holds the counters of any shape and the split-hidden accumulators of 64 tokens up to d_out =
// 16384.
constexpr size_t kCudaWorkspaceZeroedBytes = FMLP_CUDA_WORKSPACE_ZEROED_BYTES;

// Where a scratch entry's scratch starts, and the workspace bytes it asks for given its scratch.
inline void* cuda_workspace_scratch(void* workspace) {
  return static_cast<char*>(workspace) + kCudaWorkspaceZeroedBytes;
}
constexpr size_t cuda_scratch_workspace_bytes(size_t scratch) {
  return kCudaWorkspaceZeroedBytes + scratch;
}

// cudaMemsetAsync(p, 0, bytes, stream) with its status (core code is built without CUDA).
fmlp_status_t cuda_workspace_clear(void* p, size_t bytes, void* stream);

// Runs entry k: a CUDA entry whose zero-filled tables reach into the scratch part first clears
// that overhang (another call's scratch may lie there). Every path that runs an entry comes here.
template <typename ARGS, typename DESC>
fmlp_status_t run_entry(const OpKernel<ARGS, DESC>& k, const ARGS& a, const DESC& d, void* ws,
                        void* stream) {
  if (k.backend == FMLP_BACKEND_CUDA && !k.scratch && ws != nullptr) {
    const size_t need = k.workspace_bytes(d);
    if (need > kCudaWorkspaceZeroedBytes)
      if (const fmlp_status_t s =
              cuda_workspace_clear(static_cast<char*>(ws) + kCudaWorkspaceZeroedBytes,
                                   need - kCudaWorkspaceZeroedBytes, stream);
          s != FMLP_SUCCESS)
        return s;
  }
  return k.run(a, d, ws, stream);
}

template <typename OP>
struct OpTable {
  using Args = typename OP::Args;
  using Desc = typename OP::Desc;
  using Kernel = OpKernel<Args, Desc>;

  static std::vector<const Kernel*> all() {
    std::vector<const Kernel*> v;
    for (const auto& l : OP::lists())
      for (size_t i = 0; i < l.count; ++i) v.push_back(&l.kernels[i]);
    return v;
  }

  static fmlp_status_t resolve(fmlp_backend_t requested, const Desc& d, fmlp_backend_t* out) {
    return resolve_backend(requested, d.device, d.device_id, out);
  }

  static fmlp_status_t select(const Desc& d, fmlp_backend_t requested, const Kernel** out) {
    fmlp_backend_t b;
    if (const fmlp_status_t s = resolve(requested, d, &b); s != FMLP_SUCCESS) return s;
    if (const Kernel* k = OP::plan(d, b, nullptr)) {
      *out = k;
      return FMLP_SUCCESS;
    }
    // The common case allocates nothing: the first supporting entry wins and nobody reads `why`.
    std::string why;
    for (const auto& l : OP::lists())
      for (size_t i = 0; i < l.count; ++i)
        if (l.kernels[i].backend == b && l.kernels[i].supports(d, &why)) {
          *out = &l.kernels[i];
          return FMLP_SUCCESS;
        }
    std::string reasons;
    for (const Kernel* k : all()) {
      if (k->backend != b) continue;
      std::string w;
      k->supports(d, &w);
      reasons += fmt::format("\n  {}: {}", k->name, w);
    }
    return fail(FMLP_ERROR_NOT_SUPPORTED, "no {} {} kernel handles {}:{}{}", fmlp_backend_name(b),
                OP::kName, OP::describe(d), reasons.empty() ? " (none registered)" : reasons,
                b == FMLP_BACKEND_REF ? "" : "\n  (backend ref handles every valid host request)");
  }

  // Runs one chosen kernel after the workspace checks; an empty request is a successful no-op.
  static fmlp_status_t run_kernel(const Kernel& k, const Args& a, const Desc& d, void* ws,
                                  size_t ws_bytes, void* stream, const char* size_query) {
    if (OP::empty(d)) {
      clear_last_error();
      return FMLP_SUCCESS;
    }
    const size_t need = k.workspace_bytes(d);
    if (need > 0 && (ws == nullptr || ws_bytes < need))
      return fail(FMLP_ERROR_WORKSPACE_TOO_SMALL,
                  "kernel {} needs a workspace of {} bytes but got {} bytes{}; size it with {}",
                  k.name, need, ws == nullptr ? 0 : ws_bytes, ws == nullptr ? " (NULL)" : "",
                  size_query);
    if (need > 0 && k.backend == FMLP_BACKEND_CUDA &&
        reinterpret_cast<uintptr_t>(ws) % kCudaWorkspaceAlign != 0)
      return fail(FMLP_ERROR_MISALIGNED,
                  "workspace {} is not 256-byte aligned (kernel {}); pass memory as cudaMalloc "
                  "returns it (or offset it by a multiple of 256 bytes)",
                  ws, k.name);
    clear_last_error();
    return run_entry(k, a, d, ws, stream);
  }

  // The workspace size and the run of an already validated request (the packed mlp path
  // validates its activations against the packed weights itself).
  static fmlp_status_t workspace_size_of(const Desc& d, fmlp_backend_t backend, size_t* bytes) {
    const Kernel* k = nullptr;
    if (const fmlp_status_t s = select(d, backend, &k); s != FMLP_SUCCESS) return s;
    *bytes = OP::empty(d) ? 0 : k->workspace_bytes(d);
    clear_last_error();
    return FMLP_SUCCESS;
  }
  static fmlp_status_t run_validated(const Args& a, const Desc& d, fmlp_backend_t backend, void* ws,
                                     size_t ws_bytes, void* stream, const char* size_query) {
    const Kernel* k = nullptr;
    if (const fmlp_status_t s = select(d, backend, &k); s != FMLP_SUCCESS) return s;
    return run_kernel(*k, a, d, ws, ws_bytes, stream, size_query);
  }

  static fmlp_status_t workspace_size(const Args* a, fmlp_backend_t backend, size_t* bytes) {
    if (bytes == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "bytes is NULL");
    Desc d;
    if (const fmlp_status_t s = OP::validate(a, &d); s != FMLP_SUCCESS) return s;
    return workspace_size_of(d, backend, bytes);
  }

  static fmlp_status_t run(const Args* a, fmlp_backend_t backend, void* ws, size_t ws_bytes,
                           void* stream, const char* size_query) {
    Desc d;
    if (const fmlp_status_t s = OP::validate(a, &d); s != FMLP_SUCCESS) return s;
    return run_validated(*a, d, backend, ws, ws_bytes, stream, size_query);
  }

  template <typename O, typename = void>
  struct HasNote : std::false_type {};
  template <typename O>
  struct HasNote<O, std::void_t<decltype(O::explain_note(std::declval<const typename O::Desc&>(),
                                                         FMLP_BACKEND_CUDA))>> : std::true_type {};
  static fmlp_status_t explain(const Args* a, fmlp_backend_t backend, char* buf, size_t buf_size,
                               size_t* needed) {
    Desc d;
    if (const fmlp_status_t s = OP::validate(a, &d); s != FMLP_SUCCESS) return s;
    std::string note;
    if constexpr (HasNote<OP>::value) {
      fmlp_backend_t b;
      if (const fmlp_status_t s = resolve(backend, d, &b); s != FMLP_SUCCESS) return s;
      note = OP::explain_note(d, b);
    }
    return explain_validated(d, backend, note, buf, buf_size, needed);
  }
  // explain for a validated request; `note` (may be empty) is one more line after the planner's.
  static fmlp_status_t explain_validated(const Desc& d, fmlp_backend_t backend,
                                         const std::string& note, char* buf, size_t buf_size,
                                         size_t* needed) {
    fmlp_backend_t b;
    if (const fmlp_status_t s = resolve(backend, d, &b); s != FMLP_SUCCESS) return s;
    std::string report =
        fmt::format("{} {}\nbackend {}\n", OP::kName, OP::describe(d), fmlp_backend_name(b));
    std::string plan;
    const Kernel* planned = OP::plan(d, b, &plan);
    if (!plan.empty()) report += fmt::format("  planner  {}\n", plan);
    if (!note.empty()) report += fmt::format("  note     {}\n", note);
    bool chosen = false;
    for (const Kernel* k : all()) {
      if (k->backend != b) continue;
      std::string why;
      const bool ok = k->supports(d, &why);
      explain_entry(&report, &chosen, k->name, ok, why, planned != nullptr, k == planned,
                    [&] { return k->workspace_bytes(d); });
    }
    if (!chosen) report += "  no kernel of this backend handles the request\n";
    return copy_text_out(report, buf, buf_size, needed);
  }

  // Validates and finds the named kernel; NOT_SUPPORTED (with the kernel's reason) when it cannot
  // handle the request, BACKEND_UNAVAILABLE when its backend cannot run here.
  static fmlp_status_t named(const Args* a, const char* name, Desc* d, const Kernel** out) {
    if (name == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "kernel name is NULL");
    if (const fmlp_status_t s = OP::validate(a, d); s != FMLP_SUCCESS) return s;
    return named_validated(*d, name, out);
  }
  // named() for an already validated request (packed weights).
  static fmlp_status_t named_validated(const Desc& d, const char* name, const Kernel** out) {
    if (name == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "kernel name is NULL");
    for (const Kernel* k : all()) {
      if (std::strcmp(k->name, name) != 0) continue;
      fmlp_backend_t b;
      if (const fmlp_status_t s = resolve(k->backend, d, &b); s != FMLP_SUCCESS) return s;
      std::string why;
      if (!k->supports(d, &why))
        return fail(FMLP_ERROR_NOT_SUPPORTED, "{} does not handle {}: {}", name, OP::describe(d),
                    why);
      *out = k;
      return FMLP_SUCCESS;
    }
    return fail(FMLP_ERROR_INVALID_VALUE, "no {} kernel is named '{}'; fusedmlp info lists them",
                OP::kName, name);
  }

  static int count() { return int(all().size()); }
  static const char* name(int i) {
    const auto v = all();
    return i >= 0 && size_t(i) < v.size() ? v[size_t(i)]->name : nullptr;
  }
  static fmlp_backend_t backend(int i) {
    const auto v = all();
    return i >= 0 && size_t(i) < v.size() ? v[size_t(i)]->backend : FMLP_BACKEND_AUTO;
  }
  static fmlp_status_t kernel_supports(const Args* a, const char* kernel) {
    Desc d;
    const Kernel* k = nullptr;
    if (const fmlp_status_t s = named(a, kernel, &d, &k); s != FMLP_SUCCESS) return s;
    clear_last_error();
    return FMLP_SUCCESS;
  }
  static fmlp_status_t kernel_workspace(const Args* a, const char* kernel, size_t* bytes) {
    if (bytes == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "bytes is NULL");
    Desc d;
    const Kernel* k = nullptr;
    if (const fmlp_status_t s = named(a, kernel, &d, &k); s != FMLP_SUCCESS) return s;
    *bytes = OP::empty(d) ? 0 : k->workspace_bytes(d);
    clear_last_error();
    return FMLP_SUCCESS;
  }
  static fmlp_status_t with_kernel(const Args* a, const char* kernel, void* ws, size_t ws_bytes,
                                   void* stream, const char* size_query) {
    Desc d;
    const Kernel* k = nullptr;
    if (const fmlp_status_t s = named(a, kernel, &d, &k); s != FMLP_SUCCESS) return s;
    return run_kernel(*k, *a, d, ws, ws_bytes, stream, size_query);
  }
};

}  // namespace fmlp::detail

// Declares the three functions of op-table entry NAME that its OpKernel points at: NAME_supports,
// NAME_workspace and NAME_run, defined in the file named after the entry.
#define FMLP_DECLARE_OP_ENTRY(NAME, ARGS, DESC)             \
  bool NAME##_supports(const DESC& desc, std::string* why); \
  size_t NAME##_workspace(const DESC& desc);                \
  fmlp_status_t NAME##_run(const ARGS& args, const DESC& desc, void* workspace, void* stream)

// The op-table calls of fusedmlp.h for op OP (mlp, linear, softmax, moe) with argument struct
// ARGS, dispatching through TABLE (an OpTable): fmlp_OP_workspace_size, fmlp_OP, fmlp_OP_explain,
// fmlp_OP_kernel_count, fmlp_OP_kernel_name, fmlp_OP_kernel_backend, fmlp_OP_kernel_supports,
// fmlp_OP_kernel_workspace_size and fmlp_OP_with_kernel, written once for every op. Expand it
// inside extern "C".
#define FMLP_DEFINE_OP_TABLE_ABI(OP, ARGS, TABLE)                                              \
  fmlp_status_t fmlp_##OP##_workspace_size(const ARGS* args, fmlp_backend_t backend,           \
                                           size_t* bytes) {                                    \
    return TABLE::workspace_size(args, backend, bytes);                                        \
  }                                                                                            \
  fmlp_status_t fmlp_##OP(const ARGS* args, fmlp_backend_t backend, void* workspace,           \
                          size_t workspace_bytes, void* stream) {                              \
    return TABLE::run(args, backend, workspace, workspace_bytes, stream,                       \
                      "fmlp_" #OP "_workspace_size");                                          \
  }                                                                                            \
  fmlp_status_t fmlp_##OP##_explain(const ARGS* args, fmlp_backend_t backend, char* buf,       \
                                    size_t buf_size, size_t* needed) {                         \
    return TABLE::explain(args, backend, buf, buf_size, needed);                               \
  }                                                                                            \
  int fmlp_##OP##_kernel_count(void) {                                                         \
    return TABLE::count();                                                                     \
  }                                                                                            \
  const char* fmlp_##OP##_kernel_name(int index) {                                             \
    return TABLE::name(index);                                                                 \
  }                                                                                            \
  fmlp_backend_t fmlp_##OP##_kernel_backend(int index) {                                       \
    return TABLE::backend(index);                                                              \
  }                                                                                            \
  fmlp_status_t fmlp_##OP##_kernel_supports(const ARGS* args, const char* kernel) {            \
    return TABLE::kernel_supports(args, kernel);                                               \
  }                                                                                            \
  fmlp_status_t fmlp_##OP##_kernel_workspace_size(const ARGS* args, const char* kernel,        \
                                                  size_t* bytes) {                             \
    return TABLE::kernel_workspace(args, kernel, bytes);                                       \
  }                                                                                            \
  fmlp_status_t fmlp_##OP##_with_kernel(const ARGS* args, const char* kernel, void* workspace, \
                                        size_t workspace_bytes, void* stream) {                \
    return TABLE::with_kernel(args, kernel, workspace, workspace_bytes, stream,                \
                              "fmlp_" #OP "_kernel_workspace_size");                           \
  }
