// Argument checks shared by every op's API entry point. Each returns FMLP_SUCCESS or a status
// whose message names the argument, what was expected and what came.
#pragma once
#include <cstdint>
#include <string>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

inline bool tensor_absent(const fmlp_tensor_t& t) {
  return t.data == nullptr && t.ndim == 0;
}

// Whether `rows` rows from `base`, `row_stride_bytes` apart, all start on a 16-byte boundary (one
// row needs only the base): what 16-byte loads and stores of whole rows need besides a row length
// of a multiple of 16 bytes, which callers check where it matters.
inline bool rows_start_16b(const void* base, int64_t rows, int64_t row_stride_bytes) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (rows <= 1 || row_stride_bytes % 16 == 0);
}

std::string shape_string(const fmlp_tensor_t& t);
std::string device_string(fmlp_device_type_t type, int32_t id);
int64_t tensor_numel(const fmlp_tensor_t& t);

// Structural checks: rank, non-negative shape, inner stride 1, non-overlapping rows, byte extent
// without overflow, element alignment, known dtype and device. `shape` gives the expected sizes
// (-1 = any) and the rank.
fmlp_status_t check_tensor(const char* name, const fmlp_tensor_t& t, int ndim,
                           const int64_t* expected_shape, const char* shape_doc);

// [first byte, one past last byte) of the elements a view can touch; empty views give {0, 0}.
struct ByteRange {
  uintptr_t begin = 0, end = 0;
};
ByteRange byte_range(const fmlp_tensor_t& t);
bool ranges_overlap(const ByteRange& a, const ByteRange& b);
bool same_view(const fmlp_tensor_t& a, const fmlp_tensor_t& b);

struct NamedTensor {
  const fmlp_tensor_t* t;
  const char* name;
};

// Every present tensor of [first, last) lives on (device, device_id), the device `owner` has
// ("w is", "the weights are": it completes "<name> is on cuda:1 but <owner> on cpu"); else
// DEVICE_MISMATCH naming the first tensor that does not.
fmlp_status_t check_one_device(const NamedTensor* first, const NamedTensor* last,
                               fmlp_device_type_t device, int32_t device_id, const char* owner);

}  // namespace fmlp::detail
