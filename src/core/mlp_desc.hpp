// The mlp op as the kernels see it: a validated, pointer-free description (MlpDesc) and the op
// table entry every backend registers (MlpKernel). The API layer (api_mlp.cpp) validates all
// arguments once, builds the MlpDesc and hands kernels arguments they may trust.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

enum class ScaleKind : uint8_t { kNone, kPerTensor, kPerRow };

// Layout of the weights a kernel receives. kLinear is nn.Linear as the caller gave it; packed
// layouts are private contracts between a backend's pack() and its kernels.
enum class WeightLayout : uint8_t { kLinear = 0, kHostContiguous = 1, kCudaPacked = 2 };

struct MlpDesc {
  int64_t m = 0, d_in = 0, hidden = 0, d_out = 0;
  fmlp_dtype_t act_dtype = FMLP_DTYPE_INVALID;  // x, y, residual
  fmlp_dtype_t w_dtype = FMLP_DTYPE_INVALID;    // every weight matrix
  fmlp_activation_t activation = FMLP_ACT_RELU;
  fmlp_norm_t norm = FMLP_NORM_NONE;
  float norm_eps = 0.f;
  bool gated = false;
  bool stacked_gate_up = false;  // gated and w1 holds [gate; up] as [2*hidden, d_in]
  bool has_b1 = false, has_b_up = false, has_b2 = false;
  bool has_norm_weight = false, has_norm_bias = false;
  bool has_residual = false, residual_is_y = false;
  bool deterministic = false;
  ScaleKind w1_scale = ScaleKind::kNone, w_up_scale = ScaleKind::kNone, w2_scale = ScaleKind::kNone;
  fmlp_device_type_t device = FMLP_DEVICE_CPU;
  int32_t device_id = 0;
  WeightLayout layout = WeightLayout::kLinear;
  // Every weight matrix starts on a 16-byte boundary and its row stride is a multiple of 16 bytes,
  // so kernels may stream it with 16-byte vector loads.
  bool weights_vec16 = false;
};

std::string describe(const MlpDesc& d);  // one line, for explain and error messages

struct MlpKernel {
  const char* name;  // op_arch_technique, e.g. mlp_cpu_avx2_decode
  fmlp_backend_t backend;
  // True when the kernel handles `desc`; otherwise *why (never null) says what it lacks.
  bool (*supports)(const MlpDesc& desc, std::string* why);
  size_t (*workspace_bytes)(const MlpDesc& desc);
  // `args` are validated; the workspace holds workspace_bytes(desc). Never throws.
  fmlp_status_t (*run)(const fmlp_mlp_args_t& args, const MlpDesc& desc, void* workspace,
                       void* stream);
};

// One backend's contribution to the op table, in order of preference.
struct MlpKernelList {
  const MlpKernel* kernels;
  size_t count;
};
MlpKernelList ref_mlp_kernels();
MlpKernelList cpu_mlp_kernels();
MlpKernelList cuda_mlp_kernels();  // empty when CUDA is not built

// Why the backend cannot run on this machine, or empty when it can.
// Computed once per process; dispatch asks on every call.
const std::string& ref_unavailable_reason();
const std::string& cpu_unavailable_reason();
const std::string& cuda_unavailable_reason();
std::string cuda_device_list();  // one line per device; empty without CUDA or devices

struct Candidate {
  const MlpKernel* kernel;
  bool supported;
  std::string why;
};
std::vector<Candidate> mlp_candidates(const MlpDesc& desc, fmlp_backend_t backend);

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

// Resolves AUTO (device memory: cuda; host memory: cpu when this CPU has the ISA, else ref) and
// checks that the backend matches where the data lives and can run here.
fmlp_status_t resolve_backend(fmlp_backend_t requested, const MlpDesc& desc, fmlp_backend_t* out);

}  // namespace fmlp::detail

// Owned packed weights behind the opaque C handle.
struct fmlp_mlp_packed_s {
  fmlp_backend_t backend;
  fmlp_mlp_weights_t weights;  // views into `storage`
  fmlp_mlp_config_t config;
  fmlp::detail::MlpDesc desc;  // m = 0; filled per call
  void* storage = nullptr;
  void (*release)(void* storage) = nullptr;
};

namespace fmlp::detail {
// Packs weights for the CUDA backend into device memory (sets p->weights, storage, release and
// desc.layout). Returns BACKEND_UNAVAILABLE when CUDA is not built.
fmlp_status_t cuda_mlp_pack(fmlp_mlp_packed_s* p, const fmlp_mlp_weights_t& w, const MlpDesc& d,
                            void* stream);
}  // namespace fmlp::detail
