// The planner of the cuda moe op (core/planner.hpp): moe_sm80_stream while few tokens share an
// expert, otherwise the first entry after it that takes the call (table order, moe/table.cpp).
#include "core/planner.hpp"

#include <cstring>

#include "core/error.hpp"
#include "core/moe_desc.hpp"
#include "cuda/moe/tuning.hpp"

namespace fmlp::detail {

const MoeKernel* cuda_moe_plan(const MoeDesc& d, std::string* reason) {
  const MoeKernelList list = cuda_moe_kernels();
  const MoeKernel* stream = &list.kernels[0];
  std::string why;
  if (!stream->supports(d, &why)) return nullptr;  // the first entry that takes it
  const double share = local_slots_per_hit_expert(d);
  if (share <= kStreamMaxShare) {
    if (reason)
      *reason = fmt::format("{:.2f} expected slots per hit expert <= {}: {}", share,
                            kStreamMaxShare, stream->name);
    return stream;
  }
  for (size_t i = 1; i < list.count; ++i)
    if (list.kernels[i].supports(d, &why)) {
      if (reason) {
        *reason = fmt::format(
            "{:.2f} expected slots per hit expert > {}: {} ({} would read a shared expert once "
            "per slot)",
            share, kStreamMaxShare, list.kernels[i].name, stream->name);
        if (std::strcmp(list.kernels[i].name, "moe_sm90_grouped") == 0)
          *reason += grouped_sm90_swapped(d)
                         ? fmt::format(
                               "; swapped tiles ({:.1f} expected slots per hit expert <= {}: "
                               "weights as the wgmma's M, chunks of up to 160 tokens as its N)",
                               share, kGroupedSm90SwapRows)
                     : grouped_sm90_tall(d)
                         ? fmt::format(
                               "; 192-row tiles ({:.1f} expected slots per hit expert in "
                               "[{}, {}]: one chunk per typical expert)",
                               share, kGroupedSm90TallRows, kGroupedSm90TallMax)
                         : "; 128-row tiles";
      }
      return &list.kernels[i];
    }
  return stream;
}

}  // namespace fmlp::detail
