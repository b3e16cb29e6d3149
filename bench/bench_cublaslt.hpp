// The fail-fast check of bench_common.hpp for cuBLASLt calls, for the benches that call cuBLASLt
// themselves (the matmul rate, the algorithm sweep).
#pragma once
#include <cublasLt.h>

#include <cstdio>
#include <cstdlib>

#define LK(call)                                                        \
  do {                                                                  \
    const cublasStatus_t s_ = (call);                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, \
                   cublasLtGetStatusString(s_));                        \
      std::exit(2);                                                     \
    }                                                                   \
  } while (0)
