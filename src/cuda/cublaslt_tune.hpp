// The cuBLASLt tune table: measured algorithm choices per GEMM problem, which lt_matmul
// (mlp_prefill_cublaslt.cpp) prefers to the heuristic's first answer.
//
// Why: on an H200 the first answer is up to 13 % slower than the best of the heuristic's top eight
// for the prefill GEMMs (bench/lt_algo_sweep.cu: llama3-8b gate/up at 2048 tokens 687.5 against
// 598.2 us, down 334.8 against 292.6; docs/cuda-prefill.md, session 32). Timing needs a
// synchronised stream, which an op call must never do, so tuning is an explicit step
// (op calls between fmlp_tune_begin and fmlp_tune_end, `fusedmlp tune`) and its answers persist
// in a versioned file
// (fmlp_tune_save / fmlp_tune_load, or FMLP_TUNE_FILE read at the first GEMM of the process).
#pragma once
#include <cublasLt.h>

#include <array>
#include <cstddef>
#include <cstdint>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

// A GEMM problem as the algorithm cache keys it: the device ordinal first, then shapes, strides,
// C/D aliasing, epilogue, alignments, determinism, the workspace offer, fp8.
using LtKey = std::array<int64_t, 20>;

struct LtTuned {
  cublasLtMatmulAlgo_t algo;
  size_t workspace;  // bytes the algorithm uses
  double us;         // its median time when it was measured
};

// Between lt_tune_begin() and lt_tune_end() (fmlp_tune_begin / fmlp_tune_end, this thread only)
// lt_matmul times the heuristic's answers on the call's own operands before it runs,
// synchronising the stream, and records the fastest. Nests; lt_tune_end() is false when nothing
// was begun.
bool lt_tuning();
void lt_tune_begin();
bool lt_tune_end();
// True the first time a problem is met inside the outermost begin/end pair on this thread: a
// call that runs the same GEMM in several passes (the prefill path's chunks) tunes it once.
bool lt_tune_first_in_scope(const LtKey& key);

// Entries are per device name (a file serves every GPU of that model); key[0] is the ordinal.
bool lt_tuned_find(const LtKey& key, LtTuned* out);
void lt_tuned_put(const LtKey& key, const LtTuned& t);
size_t lt_tuned_count();
void lt_tuned_clear();

// JSON, {"format": "fusedmlp-cublaslt-tune", "version": 1, "cublaslt_version": N, "entries":
// [...]}. Load merges a file into the table, all or nothing: FMLP_ERROR_CORRUPT_FILE names the
// entry and field that did not parse; a file of another cuBLASLt version is
// FMLP_ERROR_NOT_SUPPORTED (its algorithm descriptors are that version's).
fmlp_status_t lt_tune_save(const char* path);
fmlp_status_t lt_tune_load(const char* path);
// FMLP_TUNE_FILE, loaded once by the first GEMM of the process; its status on every later call,
// so a bad file fails every cuBLASLt GEMM with the same message rather than being ignored.
fmlp_status_t lt_tune_env_status();

// The heuristic-answer cache of mlp_prefill_cublaslt.cpp, cleared when a file is loaded so that
// problems answered before the load take the file's choices.
void lt_cache_clear();

}  // namespace fmlp::detail
