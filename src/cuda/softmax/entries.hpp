// The launch contracts of the cuda softmax entries in table order (softmax/table.cpp lists them;
// each is defined in the file of its name: softmax_sm80_ticket in softmax/sm80_ticket.cu, ...).
#pragma once
#include <cstddef>
#include <string>

#include "core/linear_desc.hpp"

namespace fmlp::detail {

// One launch for a few long rows, the GPU dealing parts of them by tickets.
FMLP_DECLARE_OP_ENTRY(softmax_sm80_ticket, fmlp_softmax_args_t, SoftmaxDesc);

// Rows of 16 KB to 3.2 MB, a cluster of blocks per row meeting in distributed shared memory.
FMLP_DECLARE_OP_ENTRY(softmax_sm90_cluster, fmlp_softmax_args_t, SoftmaxDesc);

// Rows of up to 4 KB, one warp per row in registers.
FMLP_DECLARE_OP_ENTRY(softmax_sm80_warp_rows, fmlp_softmax_args_t, SoftmaxDesc);

// Any rows: a block per row, or a row split over blocks in two launches.
FMLP_DECLARE_OP_ENTRY(softmax_sm80_rows, fmlp_softmax_args_t, SoftmaxDesc);

// Whether a call's x and y can be read and written in 16-byte vectors: n fills whole vectors and
// every row starts on a 16-byte boundary (sm80_rows.cu; the row entries' vector decision).
bool softmax_vec16(const SoftmaxDesc& d, const fmlp_softmax_args_t& a);

}  // namespace fmlp::detail
