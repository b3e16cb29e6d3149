// The C ABI of the libfusedmlp inside fusedmlp._ext, as a table of function pointers that _ext
// exports in the capsule fusedmlp._ext._api. The torch extension (fusedmlp._torch_ops) calls the
// library through it, so a process holds one copy of the library (its CUDA kernels, planner
// caches and per-thread error) and _torch_ops needs no link to it.
#ifndef FUSEDMLP_EXT_API_H
#define FUSEDMLP_EXT_API_H

#include "fusedmlp/fusedmlp.h"

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever a field changes; the consumer refuses a table of another version.
#define FMLP_EXT_API_VERSION 1
#define FMLP_EXT_API_CAPSULE "fusedmlp._ext._api"

typedef struct fmlp_ext_api_t {
  uint32_t version;
  uint32_t size;  // sizeof(fmlp_ext_api_t) of the producer
  const char* (*last_error)(void);
  fmlp_mlp_config_t (*mlp_config_default)(void);
  fmlp_moe_config_t (*moe_config_default)(int32_t num_experts, int32_t top_k);
  fmlp_status_t (*mlp_workspace_size)(const fmlp_mlp_args_t*, fmlp_backend_t, size_t*);
  fmlp_status_t (*mlp)(const fmlp_mlp_args_t*, fmlp_backend_t, void*, size_t, void*);
  fmlp_status_t (*mlp_packed_workspace_size)(const fmlp_mlp_packed_t*, const fmlp_tensor_t*,
                                             const fmlp_tensor_t*, size_t*);
  fmlp_status_t (*mlp_packed_run)(const fmlp_mlp_packed_t*, const fmlp_tensor_t*,
                                  const fmlp_tensor_t*, const fmlp_tensor_t*, void*, size_t, void*);
  fmlp_status_t (*moe_workspace_size)(const fmlp_moe_args_t*, fmlp_backend_t, size_t*);
  fmlp_status_t (*moe)(const fmlp_moe_args_t*, fmlp_backend_t, void*, size_t, void*);
  fmlp_status_t (*moe_device_errors)(void*, size_t, void*, int32_t*);
  fmlp_status_t (*linear_workspace_size)(const fmlp_linear_args_t*, fmlp_backend_t, size_t*);
  fmlp_status_t (*linear)(const fmlp_linear_args_t*, fmlp_backend_t, void*, size_t, void*);
  fmlp_status_t (*softmax_workspace_size)(const fmlp_softmax_args_t*, fmlp_backend_t, size_t*);
  fmlp_status_t (*softmax)(const fmlp_softmax_args_t*, fmlp_backend_t, void*, size_t, void*);
  // The live pack that fusedmlp._ext.PackedMlp.handle names, or NULL when that PackedMlp is gone.
  // A non-NULL result stays valid until release_pack(*hold) (the pack may be dropped by Python
  // in the meantime; it is destroyed after the last release).
  const fmlp_mlp_packed_t* (*acquire_pack)(int64_t handle, void** hold);
  void (*release_pack)(void* hold);
  // 1 when a CUDA stream is capturing a graph, 0 when not (or without CUDA), -1 on a CUDA error.
  int (*stream_capturing)(void* stream);
} fmlp_ext_api_t;

#ifdef __cplusplus
}
#endif
#endif  // FUSEDMLP_EXT_API_H
