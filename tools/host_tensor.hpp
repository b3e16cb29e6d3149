// Owned, 64-byte-aligned host tensors of any storage dtype, with random fills and fp32 reads.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "fusedmlp/fusedmlp.h"

namespace fmlp_cli {

class HostTensor {
 public:
  HostTensor() = default;
  // cols == 0 makes a 1-D tensor of `rows` elements. The memory is left uninitialised.
  HostTensor(fmlp_dtype_t dtype, int64_t rows, int64_t cols);

  bool empty() const { return data_ == nullptr; }
  fmlp_dtype_t dtype() const { return dtype_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t numel() const { return cols_ == 0 ? rows_ : rows_ * cols_; }
  size_t bytes() const;
  void* data() const { return data_.get(); }
  // A view for the C API; fmlp_tensor_none() when empty.
  fmlp_tensor_t view() const;

  float get(int64_t i) const;
  void set(int64_t i, float v);
  HostTensor clone() const;

 private:
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char, Free> data_;
  fmlp_dtype_t dtype_ = FMLP_DTYPE_INVALID;
  int64_t rows_ = 0, cols_ = 0;
};

// Fills t with bound * U(-1, 1), deterministic in (seed, stream) whatever the thread count.
// (fp8 weights are drawn in fp32 and quantised with fmlp_quantize_fp8: see workloads.cpp.)
void fill_uniform(HostTensor& t, float bound, uint64_t seed, uint64_t stream);

// Fills t with N(0, sigma^2), deterministic in (seed, stream) whatever the thread count.
void fill_normal(HostTensor& t, float sigma, uint64_t seed, uint64_t stream);

// Writes t as fp32 (row-major) to dst, applying per-row fp8 scales when given.
void widen_to_f32(const HostTensor& t, const HostTensor* scales, float* dst);

}  // namespace fmlp_cli
