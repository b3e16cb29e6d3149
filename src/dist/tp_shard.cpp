// fmlp_tp_shard_weights: the Megatron split of full mlp weights into one rank's views. Pure view
// arithmetic, so it is available in every build (with or without NCCL, host or device memory).
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#include "core/mlp_validate.hpp"
#include "core/tensor_check.hpp"
#include "fusedmlp/fusedmlp_nccl.h"

namespace fmlp::detail {
namespace {

// Rows [first, first + count) of a 1-D or 2-D view.
fmlp_tensor_t rows_of(const fmlp_tensor_t& t, int64_t first, int64_t count) {
  fmlp_tensor_t v = t;
  v.data = static_cast<char*>(t.data) + first * t.stride[0] * int64_t(dtype_size(t.dtype));
  v.shape[0] = count;
  return v;
}

// Columns [first, first + count) of a 2-D view (rows keep their stride).
fmlp_tensor_t cols_of(const fmlp_tensor_t& t, int64_t first, int64_t count) {
  fmlp_tensor_t v = t;
  v.data = static_cast<char*>(t.data) + first * int64_t(dtype_size(t.dtype));
  v.shape[1] = count;
  return v;
}

// A per-row scale follows its rows; a per-tensor one ([1]) applies to every shard as it is.
fmlp_tensor_t scale_rows(const fmlp_tensor_t& s, ScaleKind kind, int64_t first, int64_t count) {
  return kind == ScaleKind::kPerRow ? rows_of(s, first, count) : s;
}

}  // namespace
}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {

fmlp_status_t fmlp_tp_shard_weights(const fmlp_mlp_weights_t* full, const fmlp_mlp_config_t* config,
                                    int32_t rank, int32_t size, fmlp_mlp_weights_t* shard) {
  if (full == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "full (the unsharded weights) is NULL");
  if (config == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "config is NULL");
  if (shard == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "shard (the output) is NULL");
  if (size < 1)
    return fail(FMLP_ERROR_INVALID_VALUE, "size is {}; the number of ranks must be >= 1", size);
  if (rank < 0 || rank >= size)
    return fail(FMLP_ERROR_INVALID_VALUE, "rank is {}; expected 0 <= rank < size = {}", rank, size);
  MlpDesc d;
  if (const fmlp_status_t s = validate_mlp_weights(*full, *config, -1, &d); s != FMLP_SUCCESS)
    return s;
  if (d.w1_scale == ScaleKind::kBlock || d.w_up_scale == ScaleKind::kBlock ||
      d.w2_scale == ScaleKind::kBlock)
    return fail(FMLP_ERROR_NOT_SUPPORTED,
                "weights.{} is a 2-D block scale (128 x 128 blocks); tensor-parallel shards run "
                "on the cuda mlp entries, which take per-row or per-tensor fp8 scales: "
                "re-quantise the weights per row (fmlp_quantize_fp8 with a [rows] scale)",
                d.w1_scale == ScaleKind::kBlock     ? "w1_scale"
                : d.w_up_scale == ScaleKind::kBlock ? "w_up_scale"
                                                    : "w2_scale");
  const int64_t H = d.hidden, unit = int64_t(size) * 8;
  if (H % unit != 0)
    return fail(FMLP_ERROR_SHAPE_MISMATCH,
                "hidden is {}, not a multiple of size * 8 = {}: every rank's shard must start on "
                "a 16-byte boundary; pad hidden to {} (append zero rows to W1/up and b1/b_up and "
                "zero columns to W2: those units add exactly nothing)",
                H, unit, (H + unit - 1) / unit * unit);
  const int64_t hs = H / size, first = int64_t(rank) * hs;
  fmlp_mlp_weights_t o = *full;
  o.w1 = rows_of(full->w1, first, hs);
  o.w1_scale = scale_rows(full->w1_scale, d.w1_scale, first, hs);
  o.b1 = d.has_b1 ? rows_of(full->b1, first, hs) : full->b1;
  if (d.stacked_gate_up) {  // the up rows follow all H gate rows
    o.w_up = rows_of(full->w1, H + first, hs);
    o.w_up_scale = scale_rows(full->w1_scale, d.w1_scale, H + first, hs);
    o.b_up = d.has_b1 ? rows_of(full->b1, H + first, hs) : fmlp_tensor_none();
  } else if (d.gated) {
    o.w_up = rows_of(full->w_up, first, hs);
    o.w_up_scale = scale_rows(full->w_up_scale, d.w_up_scale, first, hs);
    o.b_up = d.has_b_up ? rows_of(full->b_up, first, hs) : full->b_up;
  }
  o.w2 = cols_of(full->w2, first, hs);
  if (rank != 0) o.b2 = fmlp_tensor_none();
  *shard = o;
  clear_last_error();
  return FMLP_SUCCESS;
}

}  // extern "C"
