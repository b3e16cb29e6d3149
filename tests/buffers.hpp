// Byte buffers that live either in host memory or on the CUDA device, so one piece of test code
// drives every backend: the data is staged on the host, uploaded, the kernel runs, and the bytes
// come back for checking. Device support exists only when the tests are built with CUDA
// (FMLP_TEST_WITH_CUDA); otherwise asking for a device buffer is a test failure.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fusedmlp/fusedmlp.h"

#ifdef FMLP_TEST_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fmlp_test {

// Why device buffers cannot be used here, or "" when they can.
inline std::string device_unavailable_reason() {
#ifdef FMLP_TEST_WITH_CUDA
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(e);
  if (n == 0) return "no CUDA device";
  return {};
#else
  return "the tests were built without CUDA";
#endif
}

// First statement of a GPU test: skips it, with the reason, where the cuda backend or device
// buffers are unavailable.
#define SKIP_WITHOUT_GPU()                                               \
  do {                                                                   \
    if (fmlp_backend_available(FMLP_BACKEND_CUDA) != FMLP_SUCCESS)       \
      GTEST_SKIP() << "cuda backend unavailable: " << fmlp_last_error(); \
    if (!::fmlp_test::device_unavailable_reason().empty())               \
      GTEST_SKIP() << ::fmlp_test::device_unavailable_reason();          \
  } while (0)

#ifdef FMLP_TEST_WITH_CUDA
inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#endif

// Owns `bytes` bytes, 256-byte aligned (like cudaMalloc), so tests control misalignment exactly by
// adding offsets to data().
// The first byte of a downloaded CUDA workspace's zeroed part that is not zero, or ws.size()
// when the call left that part as the contract of fusedmlp.h wants it (scratch past it may hold
// anything).
inline size_t first_nonzero_in_zeroed_part(const std::vector<unsigned char>& ws) {
  const size_t n =
      ws.size() < FMLP_CUDA_WORKSPACE_ZEROED_BYTES ? ws.size() : FMLP_CUDA_WORKSPACE_ZEROED_BYTES;
  for (size_t i = 0; i < n; ++i)
    if (ws[i] != 0) return i;
  return ws.size();
}

class Buffer {
 public:
  Buffer() = default;
  Buffer(size_t bytes, bool device) : bytes_(bytes), device_(device) {
    const size_t alloc = bytes == 0 ? 256 : (bytes + 255) / 256 * 256;
    if (device) {
#ifdef FMLP_TEST_WITH_CUDA
      cuda_check(cudaMalloc(&data_, alloc), "cudaMalloc");
#else
      throw std::runtime_error("device buffer requested but the tests were built without CUDA");
#endif
    } else {
      data_ = std::aligned_alloc(256, alloc);
      if (data_ == nullptr) throw std::bad_alloc();
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept {
    *this = std::move(o);
  }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(device_, o.device_);
    return *this;
  }
  ~Buffer() {
    if (data_ == nullptr) return;
#ifdef FMLP_TEST_WITH_CUDA
    if (device_) {
      cudaFree(data_);
      return;
    }
#endif
    std::free(data_);
  }

  void* data() const {
    return data_;
  }
  char* bytes_at(size_t offset) const {
    return static_cast<char*>(data_) + offset;
  }
  size_t size() const {
    return bytes_;
  }
  bool device() const {
    return device_;
  }

  // Every byte set to `value`; 0xFF decodes to NaN in f32, f16 and bf16, so unwritten output shows.
  void fill(uint8_t value) {
    if (device_) {
#ifdef FMLP_TEST_WITH_CUDA
      cuda_check(cudaMemset(data_, value, bytes_), "cudaMemset");
#endif
      return;
    }
    if (bytes_) std::memset(data_, value, bytes_);
  }
  // The state a workspace may be in before a call (fusedmlp.h): on the device the zeroed part
  // (the first FMLP_CUDA_WORKSPACE_ZEROED_BYTES) zero and the scratch past it dirty; on the host
  // all of it dirty. Dirty is 0xFF, NaN in every float dtype: an entry that reads scratch it did
  // not write in the same call, or counts in it, fails.
  void init_workspace() {
    if (!device_) return fill(0xFF);
#ifdef FMLP_TEST_WITH_CUDA
    const size_t zeroed =
        bytes_ < FMLP_CUDA_WORKSPACE_ZEROED_BYTES ? bytes_ : FMLP_CUDA_WORKSPACE_ZEROED_BYTES;
    cuda_check(cudaMemset(data_, 0, zeroed), "cudaMemset");
    if (bytes_ > zeroed)
      cuda_check(cudaMemset(bytes_at(zeroed), 0xFF, bytes_ - zeroed), "cudaMemset");
#endif
  }
  // Replaces the whole content with `host` (exactly size() bytes).
  void upload(const std::vector<unsigned char>& host) {
    if (host.size() != bytes_) throw std::logic_error("Buffer::upload: size mismatch");
    if (device_) {
#ifdef FMLP_TEST_WITH_CUDA
      cuda_check(cudaMemcpy(data_, host.data(), bytes_, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
      // From pageable memory cudaMemcpy may return before the DMA has landed, and it is ordered
      // only with the legacy stream: a graph replayed next on a non-blocking stream could read a
      // half-refreshed input (seen once: a 513 KB softmax row with a wrong normaliser).
      cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after H2D");
#endif
      return;
    }
    if (bytes_) std::memcpy(data_, host.data(), bytes_);  // an empty vector's data() may be null
  }
  // The whole content; synchronises with the device first (kernels run asynchronously).
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> host(bytes_);
    if (device_) {
#ifdef FMLP_TEST_WITH_CUDA
      cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      cuda_check(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
#endif
      return host;
    }
    if (bytes_) std::memcpy(host.data(), data_, bytes_);
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool device_ = false;
};

}  // namespace fmlp_test
