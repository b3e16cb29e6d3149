#pragma once
#include "core/mlp_desc.hpp"

namespace fmlp::detail {

// Weights and config alone (used by pack). d_out_hint < 0 skips the y cross-check.
fmlp_status_t validate_mlp_weights(const fmlp_mlp_weights_t& w, const fmlp_mlp_config_t& c,
                                   int64_t d_out_hint, MlpDesc* desc);
// x, y, residual against already-validated weights; fills desc->m and the activation fields.
fmlp_status_t validate_mlp_activations(const fmlp_tensor_t& y, const fmlp_tensor_t& x,
                                       const fmlp_tensor_t* residual, const fmlp_mlp_weights_t& w,
                                       MlpDesc* desc);
fmlp_status_t validate_mlp(const fmlp_mlp_args_t* args, MlpDesc* desc);

}  // namespace fmlp::detail
