#include "host_tensor.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

#include "cli_common.hpp"
#include "dtype_convert.hpp"

namespace fmlp_cli {
namespace {

constexpr size_t kAlign = 64;

uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// U(-1, 1) from a counter, so any element can be generated on any thread.
float uniform_at(uint64_t key, uint64_t index) {
  const uint64_t r = splitmix64(key ^ splitmix64(index));
  return float(r >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

void store(void* base, fmlp_dtype_t t, int64_t i, float v) {
  switch (t) {
    case FMLP_DTYPE_F32: static_cast<float*>(base)[i] = v; break;
    case FMLP_DTYPE_F16: static_cast<uint16_t*>(base)[i] = float_to_f16(v); break;
    case FMLP_DTYPE_BF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    case FMLP_DTYPE_F8_E4M3: static_cast<uint8_t*>(base)[i] = float_to_f8e4m3(v); break;
    default: break;
  }
}

float load(const void* base, fmlp_dtype_t t, int64_t i) {
  switch (t) {
    case FMLP_DTYPE_F32: return static_cast<const float*>(base)[i];
    case FMLP_DTYPE_F16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    case FMLP_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case FMLP_DTYPE_F8_E4M3: return f8e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    default: return std::nanf("");
  }
}

}  // namespace

HostTensor::HostTensor(fmlp_dtype_t dtype, int64_t rows, int64_t cols)
    : dtype_(dtype), rows_(rows), cols_(cols) {
  const size_t n = std::max<size_t>(bytes(), 1);
  void* p = std::aligned_alloc(kAlign, (n + kAlign - 1) / kAlign * kAlign);
  if (p == nullptr)
    throw CliError(
        fmt::format("cannot allocate {} of host memory for a {}x{} {} tensor; use "
                    "smaller --shapes/--ms or free memory",
                    format_bytes(double(n)), rows, cols, fmlp_dtype_name(dtype)));
  data_.reset(static_cast<unsigned char*>(p));
}

size_t HostTensor::bytes() const {
  return size_t(numel()) * dtype_bytes(dtype_);
}

fmlp_tensor_t HostTensor::view() const {
  if (empty()) return fmlp_tensor_none();
  if (cols_ == 0) return fmlp_tensor_1d(data(), dtype_, rows_);
  return fmlp_tensor_2d(data(), dtype_, rows_, cols_, cols_);
}

float HostTensor::get(int64_t i) const {
  return load(data(), dtype_, i);
}
void HostTensor::set(int64_t i, float v) {
  store(data(), dtype_, i, v);
}

HostTensor HostTensor::clone() const {
  if (empty()) return {};
  HostTensor c(dtype_, rows_, cols_);
  std::memcpy(c.data(), data(), bytes());
  return c;
}

void fill_uniform(HostTensor& t, float bound, uint64_t seed, uint64_t stream) {
  const uint64_t key = splitmix64(seed * 0x100000001b3ull + stream);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, bound * uniform_at(key, uint64_t(i)));
}

void fill_normal(HostTensor& t, float sigma, uint64_t seed, uint64_t stream) {
  const uint64_t key = splitmix64(seed * 0x100000001b3ull + stream);
  // Box-Muller on two counter-based uniforms; u1 in (0, 1] keeps the log finite.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double u1 = 0.5 * (1.0 + double(uniform_at(key, 2 * uint64_t(i)))) + 0x1p-25;
    const double u2 = 0.5 * (1.0 + double(uniform_at(key, 2 * uint64_t(i) + 1)));
    const double n =
        std::sqrt(-2.0 * std::log(std::min(u1, 1.0))) * std::cos(6.283185307179586 * u2);
    t.set(i, float(sigma * n));
  }
}

void widen_to_f32(const HostTensor& t, const HostTensor* scales, float* dst) {
  const int64_t rows = t.cols() == 0 ? 1 : t.rows();
  const int64_t cols = t.cols() == 0 ? t.rows() : t.cols();
  const bool scaled = scales != nullptr && !scales->empty();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float s = scaled ? scales->get(r) : 1.0f;
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = t.get(r * cols + c) * s;
  }
}

}  // namespace fmlp_cli
