// gemm_sm90_wgmma_gated: h = act(x Wg^T + bg) * (x Wu^T + bu) in one Hopper kernel (TMA loads,
// wgmma, the bias + activation + gate product in the epilogue), so the prefill path's GEMM1 never
// writes the [M, 2H] pre-activations. sm_90a only; the launcher never throws, syncs or allocates.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

struct GatedGemmArgs {
  int device = 0;
  fmlp_dtype_t dtype = FMLP_DTYPE_BF16;  // x, Wg, Wu and h: bf16 or f16
  fmlp_activation_t act = FMLP_ACT_SILU;
  int64_t m = 0, k = 0, h = 0;  // tokens, d_in, hidden units
  const void* x = nullptr;      // [m, k], row stride ldx (elements)
  int64_t ldx = 0;
  const void* wg = nullptr;  // [h, k] gate rows (nn.Linear layout)
  int64_t ldwg = 0;
  const void* wu = nullptr;  // [h, k] up rows (Wg + h rows for stacked [2h, k] weights)
  int64_t ldwu = 0;
  const void* bg = nullptr;  // optional [h] biases of any float dtype
  fmlp_dtype_t bg_t = FMLP_DTYPE_F32;
  const void* bu = nullptr;
  fmlp_dtype_t bu_t = FMLP_DTYPE_F32;
  void* out = nullptr;  // h [m, h], row stride ldo (elements), rounded once to dtype
  int64_t ldo = 0;
};

// Whether the kernel runs `a` on its device; *why (never null) says what it lacks otherwise.
bool gemm_sm90_gated_supports(const GatedGemmArgs& a, std::string* why);
// Enqueues the kernel on s; `a` must pass supports().
fmlp_status_t gemm_sm90_gated_run(const GatedGemmArgs& a, cudaStream_t s);

}  // namespace fmlp::detail
