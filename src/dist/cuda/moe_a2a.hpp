// The kernels of the all-to-all expert-parallel moe (fmlp_tp_moe_a2a, src/dist/tp_moe_a2a.cpp),
// around the exchanges the host enqueues:
//
//   moe_route          (src/cuda/moe/route.cu, unchanged) this rank's tokens over all G experts as
//   if
//                      every expert were local: ids = global ids, perm = slots grouped by expert,
//                      the chunk list (start of each expert's group in perm).
//   moe_a2a_dispatch   each routed slot, in perm order, to position pos of the capacity-C section
//                      of the rank owning its expert (pos = its place among that rank's slots):
//                      the x row, the expert id and the combine weight; pos >= C is dropped and
//                      counted. Unused positions get the id G ("no expert").
//   ncclSend/Recv      the sections to their ranks (the rank's own one is written in place).
//   fmlp_moe           the local experts over the P*C received rows, given routing, top_k 1,
//                      global experts G + 1: id G is another range's expert, so padding costs no
//                      expert weight read; y row = weight * (expert output + b2).
//   ncclSend/Recv      the result rows back to the ranks that sent them.
//   moe_a2a_combine    y = [residual +] sum_j result of slot j (j in order), NaN for a bad given
//                      id; re-zeroes everything written since the route, so the workspace is left
//                      zero-filled except the two counts in its header.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/moe/moe_cuda.hpp"

namespace fmlp::detail {

// At workspace offset 0: errors first, so fmlp_moe_device_errors reads this workspace too.
struct MoeA2aHeader {
  MoeHeader route;  // the route kernel's header: bad given ids, its counters
  int32_t dropped;  // slots beyond the capacity since the last read
  uint32_t done;    // combine blocks finished (the last one clears), back to 0 after
};

struct MoeA2aParams {
  int tokens, top_k, d, d_out, global_experts, ranks, rank, max_chunks;
  int64_t capacity;  // C: slots per (sender, receiver) pair
  fmlp_dtype_t x_t;  // x, y, residual and the exchanged rows
  const void* x;
  int64_t x_ld;
  bool x_vec16;  // x rows copy in 16-byte pieces (base, row stride and row bytes)
  void* y;
  int64_t y_ld;
  const void* res;  // nullptr: no residual
  int64_t res_ld;
  MoeA2aHeader* hdr;
  // The route kernel's output (MoeParams of the routing-only call).
  int32_t *ids, *perm, *chunk_expert, *chunk_start, *chunk_len;
  float* wts;
  int32_t* where;  // per slot: 1 + row of its section in [0, P*C), 0 when dropped or bad
  // [P*C] rows / entries, section q = positions [q*C, (q+1)*C).
  void *send_x, *recv_x, *eo, *ret;  // eo: expert outputs of the received rows, ret: returned
  int32_t *send_ids, *recv_ids;
  float *send_wts, *recv_wts;
};

fmlp_status_t moe_a2a_launch_dispatch(const MoeA2aParams& p, cudaStream_t s);
fmlp_status_t moe_a2a_launch_combine(const MoeA2aParams& p, cudaStream_t s);

// Reads and clears the dropped-slot count of an a2a workspace (synchronises `stream`).
fmlp_status_t moe_a2a_read_dropped(void* workspace, void* stream, int32_t* count);

}  // namespace fmlp::detail
