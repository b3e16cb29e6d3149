// The cuBLASLt GEMMs of the prefill path, behind a small interface so the launcher (a .cu file)
// does not depend on cublasLt.h: one handle per device, heuristic answers cached per shape.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

enum class LtEpilogue : uint8_t { kNone, kBias, kGeluTanhBias, kGeluTanh };

// D[m, n] = A^T B (+ C) (+ epilogue) in cuBLASLt's column-major terms, which for row-major
// nn.Linear operands reads: rows of D are tokens, A is the [m, k] weight (row stride lda), B the
// [n, k] activations (row stride ldb). A, B, C, D and the bias share `dtype`, except with fp8:
// then A and B are e4m3 and D = (a_scale[i] * b_scale[j]) A^T B (+ C), cuBLASLt's outer-vector
// scale mode (the semantics of torch._scaled_mm with rowwise scales), C and D in `dtype`.
struct LtGemm {
  int device = 0;
  fmlp_dtype_t dtype = FMLP_DTYPE_INVALID;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  const void* c = nullptr;  // nullptr: beta = 0
  int64_t ldc = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  LtEpilogue epilogue = LtEpilogue::kNone;
  const void* bias = nullptr;  // [m], for the *Bias epilogues
  bool deterministic = false;  // restricts the heuristic to algorithms without split-K
  bool fp8 = false;
  // Workspace bytes to offer instead when the heuristic has no algorithm within the call's
  // ws_bytes (asked once per problem, cached with the answer); 0: no second offer. The buffer
  // given to lt_matmul must then hold this many bytes.
  size_t ws_fallback = 0;
  const float* a_scale = nullptr;  // fp8: [m], per weight row
  const float* b_scale = nullptr;  // fp8: [n], per token
};

// Bytes of cuBLASLt workspace the prefill path offers each GEMM (32 MiB: the size NVIDIA
// recommends for Hopper; the split-K and stream-K kernels need it at small M).
constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

// Creates the device's cuBLASLt handle if needed. cublasLtCreate must not run inside a CUDA-graph
// capture, so the workspace-size query calls this before any capture can begin.
fmlp_status_t lt_prepare(int device);

// Runs the GEMM on `stream`; *ws_used gets the workspace bytes the chosen algorithm touched.
// The algorithm is chosen by cublasLtMatmulAlgoGetHeuristic once per distinct problem (shapes,
// strides, alignments, epilogue) and cached, so later calls (and graph captures) only launch.
fmlp_status_t lt_matmul(const LtGemm& g, void* ws, size_t ws_bytes, size_t* ws_used,
                        cudaStream_t stream);

// Whether the heuristic offers an algorithm for g (pointers are read for their alignment only;
// the answer is cached like lt_matmul's, so asking first costs nothing later). Sets no error.
bool lt_available(const LtGemm& g, size_t ws_bytes);

}  // namespace fmlp::detail
