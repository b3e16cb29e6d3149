// The measured thresholds of the cuda moe entries (moe/tuning.hpp): where each measurement came
// from, and the FMLP_MOE_* knob that overrides it for the bench.
#include "cuda/moe/tuning.hpp"

#include <algorithm>
#include <cmath>

#include "core/knobs.hpp"

namespace fmlp::detail {

// Measured on an H200 (bench/results/moe_h200.*): the grouped GEMMs beat the weight-streaming
// kernel from about one token per hit expert on big experts (Mixtral T=1) and from 1.2 on small
// ones (E=64 top-8 2048->1408, T=4); at one token per expert on small experts (same shape, T=1)
// streaming wins. Hence: grouped when the expected tokens
// per hit expert reach kGroupedMinRows or one expert's weights reach kGroupedBigExpert bytes; from
// kGroupedWideRows the GEMMs use 128-row tiles. FMLP_MOE_GROUPED_MIN_ROWS /
// FMLP_MOE_GROUPED_WIDE_ROWS override the row thresholds (tuning knobs for the bench, read once).
const double kGroupedMinRows = knob_float<Knob::FMLP_MOE_GROUPED_MIN_ROWS>();
const double kGroupedWideRows = knob_float<Knob::FMLP_MOE_GROUPED_WIDE_ROWS>();
// moe_sm90_grouped (TMA + wgmma) beats moe_sm80_grouped on an H200 from 8 tokens per hit expert
// up, on Mixtral-like and E = 64 top-8 layers (fusedmlp_moe_bench --kernel, each entry forced in
// one call; bench/results/moe_sm90_ab_h200.json). Below 8 its swapped tiles (below) win too, down
// to about 2 expected tokens per hit expert, and lose at 1.46 (Mixtral-like T = 4): forced by
// FMLP_MOE_SM90_MIN_ROWS=0.5 against the default of 8 (bench/results/moe_swap_ab_h200.json).
// FMLP_MOE_SM90_MIN_ROWS overrides it.
const double kGroupedSm90MinRows = knob_float<Knob::FMLP_MOE_SM90_MIN_ROWS>();
// moe_sm90_grouped's tall tiles: chunks of 192 slots on three consumer warpgroups when the expected
// tokens per hit expert lie in [kGroupedSm90TallRows, kGroupedSm90TallMax]. An expert of 129..192
// tokens is then one chunk and its weights are read once, where 128-row tiles add a short second
// chunk that reads them again, from HBM more often than not (Mixtral-like T = 512: W1 read 1.24
// times, docs/moe.md). Tall against 128-row tiles on an H200, in the same call
// (bench/results/moe_tall_ab_h200.json, bench/ab_device.sh with fusedmlp_moe_bench): faster at 128
// and 160 expected tokens on Mixtral-like layers and at 160 on E = 64 top-8 (slightly slower
// there at 128). At 192 expected (Mixtral T = 768, E = 64 T = 1536) half the experts spill a few
// rows into a second tall chunk and the tall tiles lose by far, hence the upper bound, about 2.5
// standard deviations of a uniform group below 192. FMLP_MOE_SM90_TALL_ROWS overrides the lower
// bound (1e9: never tall).
const double kGroupedSm90TallRows = knob_float<Knob::FMLP_MOE_SM90_TALL_ROWS>();
// moe_sm90_grouped's swapped tiles (sm90/gemm_swap.cuh): the weights as the wgmma's A, a chunk of
// up to 160 tokens as its N (96 or 160), up to kGroupedSm90SwapRows expected slots per hit local
// expert. Swapped against the tokens-as-A tiles in the same binary on an H200 (fusedmlp_moe_bench
// with each forced; bench/results/moe_swap_ab_h200.json): faster up to 32 expected
// tokens on both E = 64 top-8 and Mixtral-like layers, slower from 64 on, and far slower at 160
// (two chunks an expert). FMLP_MOE_SM90_SWAP_ROWS overrides the bound (1e-9: never swapped).
const double kGroupedSm90SwapRows = knob_float<Knob::FMLP_MOE_SM90_SWAP_ROWS>();

// moe_sm80_stream reads a shared expert once per token that picked it (the repeats mostly from
// L2): past this many expected slots per hit local expert the planner (cuda_moe_plan) prefers the
// entries that read each hit expert once per chunk of its tokens. Measured on an H200 (graph
// replay, bench/results/moe_h200.json): the stream wins at 1.14 (Mixtral T = 2) and 1.21 (E = 64
// top-8 T = 4, also against torch._grouped_mm), loses at 1.46 (Mixtral T = 4) and 2.3 (E = 64
// top-8 T = 16).
// FMLP_MOE_STREAM_MAX_SHARE overrides it (a tuning knob for the bench, read once).
const double kStreamMaxShare = knob_float<Knob::FMLP_MOE_STREAM_MAX_SHARE>();

// Expected tokens per hit expert under uniform routing: T*k slots over the E(1 - (1 - k/E)^T)
// experts expected to receive any.
double tokens_per_hit_expert(const MoeDesc& d) {
  const double E = double(std::max<int64_t>(1, d.experts)), n = double(d.tokens * d.top_k);
  const double hit = E * (1.0 - std::pow(1.0 - double(d.top_k) / E, double(d.tokens)));
  return n / std::max(1.0, hit);
}

// Expected local slots per local expert that receives any, under uniform routing over the global
// experts (each token picks k distinct ones).
double local_slots_per_hit_expert(const MoeDesc& d) {
  const double G = double(std::max<int64_t>(1, d.global_experts));
  const double hit =
      double(d.experts) * (1.0 - std::pow(1.0 - double(d.top_k) / G, double(d.tokens)));
  return double(d.tokens * d.top_k) * double(d.experts) / G / std::max(1.0, hit);
}

// From the expected slots per hit local expert: with expert parallelism, the local experts' share
// of the slots over the local experts hit (tokens_per_hit_expert counts every slot against the
// local experts).
bool grouped_sm90_swapped(const MoeDesc& d) {
  return local_slots_per_hit_expert(d) <= kGroupedSm90SwapRows;
}

bool grouped_sm90_tall(const MoeDesc& d) {
  const double per = local_slots_per_hit_expert(d);
  return per >= kGroupedSm90TallRows && per <= kGroupedSm90TallMax;
}

}  // namespace fmlp::detail
