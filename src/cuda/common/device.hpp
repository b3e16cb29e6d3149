// The device queries every cuda entry shares (common/device.cpp): attributes read once per
// device, and the device checks of the entries' supports().
#pragma once
#include <cstdint>
#include <string>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

int cuda_sm_count(int device);            // 0 when unreadable
int64_t cuda_l2_bytes(int device);        // 0 when unreadable
int cuda_compute_capability(int device);  // major * 10 + minor, 0 when unreadable

// True when cuda:device has compute capability 8.0 or newer (bf16 tensor cores, cp.async), which
// every cuda entry needs; otherwise *why says what the device has and what to do instead.
bool cuda_device_sm80(int device, std::string* why);

// The device checks of the cuda linear, softmax and moe entries: device memory on a device of
// compute capability 8.0 or newer.
bool cuda_op_device_ok(fmlp_device_type_t device, int device_id, std::string* why);

}  // namespace fmlp::detail
