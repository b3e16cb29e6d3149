// The accuracy of fp8 e4m3 weights, as the README states it: a model's bf16 weights quantised by
// fmlp_quantize_fp8, run through the fp8 kernels, against the fp64 ref on the bf16 weights.
#pragma once
#include <cstdint>

namespace fmlp_cli {

// Prints the report for the gpt2-small and llama3-8b shapes; returns false when a cpu kernel's
// fp8 output strays from the ref backend's fp8 output by more than fp32 accumulation allows.
bool print_fp8_accuracy_report(uint64_t seed, int64_t m);

}  // namespace fmlp_cli
