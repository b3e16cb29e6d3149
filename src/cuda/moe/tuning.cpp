// The measured thresholds of the cuda moe entries (moe/tuning.hpp): where each measurement came
// from, and the FMLP_MOE_* knob that overrides it for the bench.
#include "cuda/moe/tuning.hpp"

#include <algorithm>
#include <cmath>

#include "core/knobs.hpp"

namespace fmlp::detail {

// Measured on an H200 (bench/results/moe_h200.*): the grouped GEMMs beat the weight-streaming
// kernel from about one token per hit expert on big experts (Mixtral T=1: 348 vs 370 us) and from
// 1.2 on small ones (E=64 top-8 2048->1408, T=4: 258 vs 324 us); at one token per expert on small
// experts (same shape, T=1: 148 vs 131 us) streaming wins. Hence: grouped when the expected tokens
// per hit expert reach kGroupedMinRows or one expert's weights reach kGroupedBigExpert bytes; from
// kGroupedWideRows the GEMMs use 128-row tiles. FMLP_MOE_GROUPED_MIN_ROWS /
// FMLP_MOE_GROUPED_WIDE_ROWS override the row thresholds (tuning knobs for the bench, read once).
const double kGroupedMinRows = knob_float<Knob::FMLP_MOE_GROUPED_MIN_ROWS>();
const double kGroupedWideRows = knob_float<Knob::FMLP_MOE_GROUPED_WIDE_ROWS>();
// moe_sm90_grouped (TMA + wgmma) against moe_sm80_grouped, same device session on an H200
// (session 14, fusedmlp_moe_bench --kernel): Mixtral-like T = 64 (16 tokens per hit expert)
// 722.8 vs 752.5 us, T = 512 1043.1 vs 1413.2; E = 64 top-8 T = 64 (8) 339.6 vs 357.7, T = 512
// 473.8 vs 491.3. Below 8 the swapped tiles (below) win too (session 26, two rounds each, forced
// by FMLP_MOE_SM90_MIN_ROWS=0.5 against the default of 8, us): E = 64 top-8 T = 8 (1.5 expected)
// 227.6 / 230.9 against 251.6 / 251.8, T = 16 (2.2) 271.0 / 270.3 against 301.7 / 302.3, T = 32
// (4) 302.8 / 305.7 against 343.9 / 343.9; Mixtral-like T = 8 (2) 685.7 / 687.1 against 701.4 /
// 700.9, T = 16 (4) 690.0 / 690.7 against 701.9 / 701.8; at T = 4 (1.46) they lose (619.5 / 620.2
// against 615.8 / 616.4). FMLP_MOE_SM90_MIN_ROWS overrides it.
const double kGroupedSm90MinRows = knob_float<Knob::FMLP_MOE_SM90_MIN_ROWS>();
// moe_sm90_grouped's tall tiles: chunks of 192 slots on three consumer warpgroups when the expected
// tokens per hit expert lie in [kGroupedSm90TallRows, kGroupedSm90TallMax]. An expert of 129..192
// tokens is then one chunk and its weights are read once, where 128-row tiles add a short second
// chunk that reads them again, from HBM more often than not (Mixtral-like T = 512: W1 read 1.24
// times, docs/moe.md sessions 15 and 24). Measured on an H200 (session 25, fusedmlp_moe_bench,
// two rounds each, tall against 128-row tiles in the same call, us): Mixtral-like T = 512 (128
// expected) 928.9 / 928.6 against 996.9 / 997.9, T = 640 (160) 939.6 / 938.8 against 1185.2 /
// 1178.5; E = 64 top-8 T = 1024 (128) 690.2 / 689.1 against 677.6 / 676.0 (2 % slower), T = 1280
// (160) 809.3 / 810.6 against 822.9 / 823.5. At 192 expected (Mixtral T = 768, E = 64 T = 1536)
// half the experts spill a few rows into a second tall chunk and the tall tiles lose (1482
// against 1162, 1010 against 863, with 96-unit gate/up tiles), hence the upper bound, about 2.5
// standard deviations of a uniform group below 192. FMLP_MOE_SM90_TALL_ROWS overrides the lower
// bound (1e9: never tall).
const double kGroupedSm90TallRows = knob_float<Knob::FMLP_MOE_SM90_TALL_ROWS>();
// moe_sm90_grouped's swapped tiles (sm90/gemm_swap.cuh): the weights as the wgmma's A, a chunk of
// up to 160 tokens as its N (96 or 160), up to kGroupedSm90SwapRows expected slots per hit local
// expert. Measured on an H200 (session 26, fusedmlp_moe_bench, two rounds each, swapped against
// the tokens-as-A tiles in the same binary, us): E = 64 top-8 T = 64 (8 expected) 313.3 / 313.3
// against 336.7 / 335.7, T = 128 (16) 337.6 / 335.8 against 355.6 / 356.4, T = 256 (32) 402.6 /
// 402.1 against 414.0 / 416.2, T = 512 (64) 493.3 / 492.1 against 471.6 / 471.6; Mixtral-like
// T = 64 (16) 705.0 / 700.7 against 721.5 / 711.3, T = 128 (32) 723.6 / 724.2 against 735.4 /
// 726.9, T = 256 (64) 769.8 / 769.9 against 760.5 / 760.7, T = 512 (128) 884.5 / 883.9 against
// 879.9 / 881.4, T = 640 (160: two chunks an expert) 1395 against 929. FMLP_MOE_SM90_SWAP_ROWS
// overrides the bound (1e-9: never swapped).
const double kGroupedSm90SwapRows = knob_float<Knob::FMLP_MOE_SM90_SWAP_ROWS>();

// moe_sm80_stream reads a shared expert once per token that picked it (the repeats mostly from
// L2): past this many expected slots per hit local expert the planner (cuda_moe_plan) prefers the
// entries that read each hit expert once per chunk of its tokens. Measured on an H200 (session 7,
// graph replay): the stream wins at 1.14 (Mixtral T = 2: 366 us, 91 % of floor) and 1.21 (E = 64
// top-8 T = 4: 195 us, torch._grouped_mm 254), loses at 1.46 (Mixtral T = 4: 637 us against 603 for
// the other entries) and 2.3 (E = 64 top-8 T = 16: 571 us, torch._grouped_mm 452).
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
