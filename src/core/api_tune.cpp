// C ABI of the cuBLASLt tune table (src/cuda/cublaslt_tune.hpp has the mechanism).
#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#if FMLP_WITH_CUDA
#include "cuda/cublaslt_tune.hpp"
#endif

using namespace fmlp::detail;

extern "C" {

fmlp_status_t fmlp_tune_begin(void) {
#if FMLP_WITH_CUDA
  lt_tune_begin();
#endif
  return FMLP_SUCCESS;
}

fmlp_status_t fmlp_tune_end(void) {
#if FMLP_WITH_CUDA
  if (!lt_tune_end())
    return fail(FMLP_ERROR_INVALID_VALUE,
                "fmlp_tune_end without a matching fmlp_tune_begin on this thread");
#endif
  return FMLP_SUCCESS;
}

fmlp_status_t fmlp_tune_save(const char* path) {
#if FMLP_WITH_CUDA
  return lt_tune_save(path);
#else
  (void)path;
  return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "the tune table is cuBLASLt's: {}",
              cuda_unavailable_reason());
#endif
}

fmlp_status_t fmlp_tune_load(const char* path) {
#if FMLP_WITH_CUDA
  return lt_tune_load(path);
#else
  (void)path;
  return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "the tune table is cuBLASLt's: {}",
              cuda_unavailable_reason());
#endif
}

size_t fmlp_tune_count(void) {
#if FMLP_WITH_CUDA
  return lt_tuned_count();
#else
  return 0;
#endif
}

void fmlp_tune_clear(void) {
#if FMLP_WITH_CUDA
  lt_tuned_clear();
#endif
}

}  // extern "C"
