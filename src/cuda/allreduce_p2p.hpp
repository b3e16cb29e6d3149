// One-shot all-reduce over peer-mapped device memory (NVLink): the kernel side. The peers' buffers
// are set up by src/dist/tp_allreduce_p2p.cpp; this header only knows their layout.
//
// Every rank owns one buffer, written by its peers and read by itself:
//   counters  uint64[kP2pMaxBlocks]                    the call epoch, one copy per block slot
//   flags     uint64[2][kP2pMaxRanks][kP2pMaxBlocks]   flag[set][source rank][block] = epoch
//   data      [2][size][slot_bytes]                    data[set][source rank] = its partial
// Call n (epoch n, counted on the device) uses set n & 1, so the partials of call n + 1 never
// land on those of call n that a slower rank may still be reading.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

constexpr int kP2pMaxRanks = 8;
constexpr int kP2pMaxBlocks = 64;
constexpr size_t kP2pFlagsOffset = sizeof(uint64_t) * kP2pMaxBlocks;
constexpr size_t kP2pDataOffset =
    kP2pFlagsOffset + sizeof(uint64_t) * 2 * kP2pMaxRanks * kP2pMaxBlocks;

// The per-source slot: max_bytes rounded up to whole 16-byte groups.
inline size_t p2p_slot_bytes(size_t max_bytes) {
  return (max_bytes + 15) / 16 * 16;
}

inline size_t p2p_buffer_bytes(int size, size_t max_bytes) {
  return kP2pDataOffset + 2 * size_t(size) * p2p_slot_bytes(max_bytes);
}

// What the kernel needs of one rank's registration, passed by value (graph-capturable).
struct P2pPeers {
  char* bufs[kP2pMaxRanks];  // bufs[q]: rank q's buffer as mapped in this process; bufs[rank] own
  int rank;
  int size;
  size_t slot_bytes;
};

// Sums y (n contiguous elements of f32, f16 or bf16, in place) over the ranks on `stream`: one
// kernel, no host synchronisation. Every rank must call it with the same n and dtype, in the same
// order as its other p2p calls. Every rank gets bitwise the same y: the partials are summed in
// fp32 in rank order and rounded once. n * element size <= slot_bytes.
fmlp_status_t allreduce_p2p(const P2pPeers& peers, void* y, fmlp_dtype_t dtype, int64_t n,
                            cudaStream_t stream);

}  // namespace fmlp::detail
