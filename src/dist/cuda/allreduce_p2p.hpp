// One-shot all-reduce over peer-mapped device memory (NVLink) with the LL protocol: the kernel
// side. The peers' buffers are set up by src/dist/tp_allreduce_p2p.cpp; this header only knows
// their layout.
//
// Every rank owns one buffer, written by its peers and read (and cleared) by itself:
//   counters  uint64[kP2pMaxBlocks]            the call epoch, one copy per block slot
//   lines     [2][size][slot_bytes]            lines[set][source rank] = its partial, as LL lines
// An LL line is 16 bytes carrying 8 bytes of data: two 64-bit halves {data word, flag}, so a slot
// takes twice the message bytes. Call n (epoch n, counted on the device) uses set n & 1, so the
// lines of call n + 1 never land on those of call n that a slower rank may still be reading.
// The buffer starts zeroed and the reader zeroes every line it consumed, so a line holds either
// zeros or the call now in flight (see allreduce_p2p.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

constexpr int kP2pMaxRanks = 8;
constexpr int kP2pMaxBlocks = 64;
constexpr size_t kP2pLineBytes = 16;     // one LL line ...
constexpr size_t kP2pLineDataBytes = 8;  // ... carries this much of the message
constexpr size_t kP2pDataOffset = sizeof(uint64_t) * kP2pMaxBlocks;

// The per-source slot for messages of up to max_bytes: one line per 8 message bytes.
inline size_t p2p_slot_bytes(size_t max_bytes) {
  return (max_bytes + kP2pLineDataBytes - 1) / kP2pLineDataBytes * kP2pLineBytes;
}

inline size_t p2p_buffer_bytes(int size, size_t max_bytes) {
  return kP2pDataOffset + 2 * size_t(size) * p2p_slot_bytes(max_bytes);
}

// What the kernel needs of one rank's registration, passed by value (graph-capturable).
struct P2pPeers {
  char* bufs[kP2pMaxRanks];  // bufs[q]: rank q's buffer as mapped in this process; bufs[rank] own
  int rank;
  int size;
  size_t slot_bytes;  // p2p_slot_bytes(max_bytes): line bytes, not message bytes
};

// Sums y (n contiguous elements of f32, f16 or bf16, in place) over the ranks on `stream`: one
// kernel, no host synchronisation. Every rank must call it with the same n and dtype, in the same
// order as its other p2p calls. Every rank gets bitwise the same y: the partials are summed in
// fp32 in rank order and rounded once. n * element size <= the registration's max_bytes.
fmlp_status_t allreduce_p2p(const P2pPeers& peers, void* y, fmlp_dtype_t dtype, int64_t n,
                            cudaStream_t stream);

}  // namespace fmlp::detail
