// OpenBLAS as the CLI uses it. The CLI builds without it (-DFMLP_CLI_OPENBLAS=OFF, e.g. on GPU
// machines without the package) and then has no host baseline.
#pragma once
#if FMLP_CLI_HAVE_OPENBLAS
#include <cblas.h>
#else
inline char* openblas_get_config() {
  static char none[] = "none (built without OpenBLAS)";
  return none;
}
inline void openblas_set_num_threads(int) {}
inline int openblas_get_num_threads() {
  return 0;
}
#endif
