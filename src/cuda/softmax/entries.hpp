// The launch contracts of the cuda softmax entries in table order (softmax/table.cpp lists them;
// each is defined in the file of its name: softmax_sm80_ticket in softmax/sm80_ticket.cu, ...).
#pragma once
#include <cstddef>
#include <string>

#include "core/linear_desc.hpp"

namespace fmlp::detail {

// One launch for a few long rows, the GPU dealing parts of them by tickets.
bool softmax_sm80_ticket_supports(const SoftmaxDesc& d, std::string* why);
size_t softmax_sm80_ticket_workspace(const SoftmaxDesc& d);
fmlp_status_t softmax_sm80_ticket_run(const fmlp_softmax_args_t& a, const SoftmaxDesc& d, void* ws,
                                      void* stream);

// Rows of 16 KB to 3.2 MB, a cluster of blocks per row meeting in distributed shared memory.
bool softmax_sm90_cluster_supports(const SoftmaxDesc& d, std::string* why);
size_t softmax_sm90_cluster_workspace(const SoftmaxDesc& d);
fmlp_status_t softmax_sm90_cluster_run(const fmlp_softmax_args_t& a, const SoftmaxDesc& d, void* ws,
                                       void* stream);

// Rows of up to 4 KB, one warp per row in registers.
bool softmax_sm80_warp_rows_supports(const SoftmaxDesc& d, std::string* why);
size_t softmax_sm80_warp_rows_workspace(const SoftmaxDesc& d);
fmlp_status_t softmax_sm80_warp_rows_run(const fmlp_softmax_args_t& a, const SoftmaxDesc& d,
                                         void* ws, void* stream);

// Any rows: a block per row, or a row split over blocks in two launches.
bool softmax_sm80_rows_supports(const SoftmaxDesc& d, std::string* why);
size_t softmax_sm80_rows_workspace(const SoftmaxDesc& d);
fmlp_status_t softmax_sm80_rows_run(const fmlp_softmax_args_t& a, const SoftmaxDesc& d, void* ws,
                                    void* stream);

// Whether a call's x and y can be read and written in 16-byte vectors: n fills whole vectors and
// every row starts on a 16-byte boundary (sm80_rows.cu; the row entries' vector decision).
bool softmax_vec16(const SoftmaxDesc& d, const fmlp_softmax_args_t& a);

}  // namespace fmlp::detail
