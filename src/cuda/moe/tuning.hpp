// The thresholds that decide between the cuda moe entries and their tile shapes, measured on the
// GPU (moe/tuning.cpp says where and how; each is overridable by an FMLP_MOE_* knob read once),
// and the expected group sizes under uniform routing they are compared with. Shared by the
// entries' supports() (moe/table.cpp), their plans (moe/plan.cpp) and the planner
// (moe/planner.cpp).
#pragma once
#include "core/moe_desc.hpp"

namespace fmlp::detail {

// moe_sm80_grouped: from this many expected tokens per hit expert, or experts of this many bytes.
extern const double kGroupedMinRows;
constexpr double kGroupedBigExpert = 64.0 * (1 << 20);
// moe_sm80_grouped's 128-row tiles (64 below).
extern const double kGroupedWideRows;
// moe_sm90_grouped: from this many expected tokens per hit expert.
extern const double kGroupedSm90MinRows;
// moe_sm90_grouped's tall tiles: chunks of kGroupedSm90TallChunk slots for expected slots per hit
// local expert in [kGroupedSm90TallRows, kGroupedSm90TallMax].
extern const double kGroupedSm90TallRows;
constexpr double kGroupedSm90TallMax = 160;
constexpr int kGroupedSm90TallChunk = 192;
// moe_sm90_grouped's swapped tiles (chunks of kGroupedSm90SwapChunk tokens as the wgmma's N) up
// to this many expected slots per hit local expert.
extern const double kGroupedSm90SwapRows;
constexpr int kGroupedSm90SwapChunk = 160;
// The planner's bound for moe_sm80_stream: expected slots per hit local expert.
extern const double kStreamMaxShare;

// Expected tokens per hit expert under uniform routing (every slot counted against the local
// experts).
double tokens_per_hit_expert(const MoeDesc& d);
// Expected local slots per local expert that receives any, under uniform routing over the global
// experts.
double local_slots_per_hit_expert(const MoeDesc& d);
// moe_sm90_grouped's tile choice for d: swapped, else tall, else 128-row tiles.
bool grouped_sm90_swapped(const MoeDesc& d);
bool grouped_sm90_tall(const MoeDesc& d);

}  // namespace fmlp::detail
