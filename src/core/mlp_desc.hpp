// The mlp op as the kernels see it: a validated, pointer-free description (MlpDesc) and the op
// table entry every backend registers (MlpKernel, core/op_table.hpp). The API layer (api_mlp.cpp)
// validates all arguments once, builds the MlpDesc and hands kernels arguments they may trust.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/op_table.hpp"
#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

// kBlock: one scale per kFp8Block x kFp8Block tile of the weight, [ceil(rows / 128),
// ceil(cols / 128)] (the fine-grained fp8 checkpoints' weight_scale_inv). A stacked [gate; up]
// w1 of 2 * hidden rows has 2 * ceil(hidden / 128) block rows: the gate's, then the up's, so the
// two checkpoint scales concatenate without re-quantising when hidden % 128 != 0.
enum class ScaleKind : uint8_t { kNone, kPerTensor, kPerRow, kBlock };
constexpr int64_t kFp8Block = 128;
constexpr int64_t block_count(int64_t n) {
  return (n + kFp8Block - 1) / kFp8Block;
}
// The block-scale row of weight row `row` of a matrix of `rows` rows in `halves` (1, or 2 for a
// stacked [gate; up] w1) halves.
constexpr int64_t block_row(int64_t row, int64_t rows, int halves) {
  const int64_t half = rows / halves;
  return row / half * block_count(half) + row % half / kFp8Block;
}

// Layout of the weights a kernel receives. kLinear is nn.Linear as the caller gave it; packed
// layouts are private contracts between a backend's pack() and its kernels.
enum class WeightLayout : uint8_t { kLinear = 0, kHostContiguous = 1, kCudaPacked = 2 };

struct MlpTuning;  // cuda/mlp/tuning.hpp

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
  // Packed CUDA weights: the entries timed fastest per token count at pack time (owned by the
  // packed handle), or nullptr: the planner's fixed rules.
  const MlpTuning* tuning = nullptr;
};

std::string describe(const MlpDesc& d);  // one line, for explain and error messages

// The mlp op's op-table entries (core/op_table.hpp); each backend's list in order of preference.
using MlpKernel = OpKernel<fmlp_mlp_args_t, MlpDesc>;
using MlpKernelList = OpKernelList<fmlp_mlp_args_t, MlpDesc>;
MlpKernelList ref_mlp_kernels();
MlpKernelList cpu_mlp_kernels();
MlpKernelList cuda_mlp_kernels();  // empty when CUDA is not built

}  // namespace fmlp::detail

// Owned packed weights behind the opaque C handle.
struct fmlp_mlp_packed_s {
  fmlp_backend_t backend;
  fmlp_mlp_weights_t weights;  // views into `storage`
  fmlp_mlp_config_t config;
  fmlp::detail::MlpDesc desc;  // m = 0; filled per call
  void* storage = nullptr;
  void (*release)(void* storage) = nullptr;
  // CUDA: the pack-time timing of the entries (desc.tuning points into it; shared by the packs of
  // one shape on one device), or empty with the reason in tuning_note.
  std::shared_ptr<const fmlp::detail::MlpTuning> tuning;
  std::string tuning_note;
};

namespace fmlp::detail {
// Packs weights for the CUDA backend into device memory (sets p->weights, storage, release and
// desc.layout). Returns BACKEND_UNAVAILABLE when CUDA is not built.
// Times the cuda entries for freshly packed weights (p->tuning, or the reason in p->tuning_note;
// cuda/mlp/tuning.hpp). A no-op when CUDA is not built.
void cuda_mlp_tune(fmlp_mlp_packed_s* p);
fmlp_status_t cuda_mlp_pack(fmlp_mlp_packed_s* p, const fmlp_mlp_weights_t& w, const MlpDesc& d,
                            void* stream);
}  // namespace fmlp::detail
