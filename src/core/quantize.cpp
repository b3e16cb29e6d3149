// fmlp_quantize_fp8: host-side fp8 e4m3 weight quantisation (the policy is documented in
// fusedmlp.h). Everything is validated before the first write, and the math cannot fail, so an
// error leaves the outputs untouched.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor_check.hpp"

namespace fmlp::detail {
namespace {

constexpr float kE4m3Max = 448.0f;
constexpr int64_t kBlock = 128;  // block scales: one per 128 x 128 tile (the fine-grained format)

enum class Granularity { kTensor, kRow, kBlock };

#define FMLP_TRY(expr)                           \
  do {                                           \
    const fmlp_status_t status_ = (expr);        \
    if (status_ != FMLP_SUCCESS) return status_; \
  } while (0)

float load_float(const char* row, fmlp_dtype_t t, int64_t i) {
  switch (t) {
    case FMLP_DTYPE_F16: return f16_to_float(reinterpret_cast<const uint16_t*>(row)[i]);
    case FMLP_DTYPE_BF16: return bf16_to_float(reinterpret_cast<const uint16_t*>(row)[i]);
    default: return reinterpret_cast<const float*>(row)[i];
  }
}

fmlp_status_t validate(const fmlp_tensor_t* w, const fmlp_tensor_t* q, const fmlp_tensor_t* scale,
                       Granularity* g) {
  if (w == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "w is NULL; pass the [rows, cols] weight");
  if (q == nullptr)
    return fail(FMLP_ERROR_NULL_POINTER, "q is NULL; pass a [rows, cols] f8_e4m3 output");
  if (scale == nullptr)
    return fail(FMLP_ERROR_NULL_POINTER,
                "scale is NULL; pass an f32 [1], [rows] or [ceil(rows / 128), ceil(cols / 128)] "
                "output");
  const int64_t any2[2] = {-1, -1};
  FMLP_TRY(check_tensor("w", *w, 2, any2, "[rows, cols]"));
  if (w->dtype != FMLP_DTYPE_F32 && w->dtype != FMLP_DTYPE_F16 && w->dtype != FMLP_DTYPE_BF16)
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "w has dtype {}; quantise from f32, f16 or bf16",
                fmlp_dtype_name(w->dtype));
  const int64_t rows = w->shape[0], cols = w->shape[1];
  const int64_t q_shape[2] = {rows, cols};
  FMLP_TRY(check_tensor("q", *q, 2, q_shape, "[rows, cols] of w"));
  if (q->dtype != FMLP_DTYPE_F8_E4M3)
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "q has dtype {}; the output must be f8_e4m3",
                fmlp_dtype_name(q->dtype));
  if (scale->ndim == 2) {
    const int64_t blocks[2] = {(rows + kBlock - 1) / kBlock, (cols + kBlock - 1) / kBlock};
    FMLP_TRY(check_tensor("scale", *scale, 2, blocks,
                          "[ceil(rows / 128), ceil(cols / 128)] (one per 128 x 128 block of w)"));
    *g = Granularity::kBlock;
  } else {
    const int64_t any1[1] = {-1};
    FMLP_TRY(check_tensor("scale", *scale, 1, any1,
                          "[1], [rows] or [ceil(rows / 128), ceil(cols / 128)]"));
    if (scale->shape[0] != 1 && scale->shape[0] != rows)
      return fail(FMLP_ERROR_SHAPE_MISMATCH,
                  "scale has {} entries; pass 1 (one scale for the tensor), {} (one per row of "
                  "w) or a 2-D [ceil(rows / 128), ceil(cols / 128)] (one per 128 x 128 block)",
                  scale->shape[0], rows);
    *g = scale->shape[0] == rows && rows != 1 ? Granularity::kRow : Granularity::kTensor;
  }
  if (scale->dtype != FMLP_DTYPE_F32)
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "scale has dtype {}; scales are f32",
                fmlp_dtype_name(scale->dtype));
  const fmlp_tensor_t* all[3] = {w, q, scale};
  const char* names[3] = {"w", "q", "scale"};
  for (int i = 0; i < 3; ++i)
    if (all[i]->device_type != FMLP_DEVICE_CPU)
      return fail(FMLP_ERROR_NOT_SUPPORTED,
                  "{} is on {}; fmlp_quantize_fp8 runs on the host: quantise the weights there "
                  "once at load time, then copy q and scale to the device",
                  names[i], device_string(all[i]->device_type, all[i]->device_id));
  const ByteRange wr = byte_range(*w), qr = byte_range(*q), sr = byte_range(*scale);
  if (ranges_overlap(qr, wr) || ranges_overlap(sr, wr) || ranges_overlap(qr, sr))
    return fail(FMLP_ERROR_ALIASING,
                "{} overlaps {}; w, q and scale must be separate buffers (no in-place "
                "quantisation)",
                ranges_overlap(sr, wr) || ranges_overlap(qr, sr) ? "scale" : "q",
                ranges_overlap(qr, sr) ? "q" : "w");
  return FMLP_SUCCESS;
}

// max |v| over the finite values of row r, columns [c0, c1) (0 when none).
float row_amax(const fmlp_tensor_t& w, int64_t r, int64_t c0, int64_t c1) {
  const size_t es = dtype_size(w.dtype);
  const char* row = static_cast<const char*>(w.data) + r * w.stride[0] * int64_t(es);
  float m = 0.f;
  for (int64_t c = c0; c < c1; ++c) {
    const float a = std::fabs(load_float(row, w.dtype, c));
    if (a <= std::numeric_limits<float>::max()) m = std::max(m, a);  // skips NaN and Inf
  }
  return m;
}

float scale_for(float amax) {
  const float s = amax / kE4m3Max;
  return s > 0.f ? s : 1.0f;
}

}  // namespace
}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {

fmlp_status_t fmlp_quantize_fp8(const fmlp_tensor_t* w, const fmlp_tensor_t* q,
                                const fmlp_tensor_t* scale, float* amax_out) {
  Granularity g = Granularity::kTensor;
  if (const fmlp_status_t s = validate(w, q, scale, &g); s != FMLP_SUCCESS) return s;
  const int64_t rows = w->shape[0], cols = w->shape[1];
  const size_t es = dtype_size(w->dtype);
  float* s = static_cast<float*>(scale->data);
  if (g == Granularity::kBlock) {  // each 128 x 128 tile quantised with its own scale
    const int64_t rb = (rows + kBlock - 1) / kBlock, cb = (cols + kBlock - 1) / kBlock;
    float total = 0.f;
    const bool parallel = double(rows) * double(cols) > 1e5;
#pragma omp parallel for schedule(static) if (parallel) reduction(max : total)
    for (int64_t b = 0; b < rb * cb; ++b) {
      const int64_t r0 = (b / cb) * kBlock, c0 = (b % cb) * kBlock;
      const int64_t r1 = std::min(rows, r0 + kBlock), c1 = std::min(cols, c0 + kBlock);
      float amax = 0.f;
      for (int64_t r = r0; r < r1; ++r) amax = std::max(amax, row_amax(*w, r, c0, c1));
      total = std::max(total, amax);
      const float sb = scale_for(amax);
      s[(b / cb) * scale->stride[0] + (b % cb) * scale->stride[1]] = sb;
      for (int64_t r = r0; r < r1; ++r) {
        const char* src = static_cast<const char*>(w->data) + r * w->stride[0] * int64_t(es);
        uint8_t* dst = static_cast<uint8_t*>(q->data) + r * q->stride[0];
        for (int64_t c = c0; c < c1; ++c)
          dst[c] = fmlp::float_to_f8e4m3(load_float(src, w->dtype, c) / sb);
      }
    }
    if (amax_out != nullptr) *amax_out = total;
    clear_last_error();
    return FMLP_SUCCESS;
  }
  const bool per_row = g == Granularity::kRow;
  std::vector<float> amax;
  try {
    amax.resize(size_t(rows));
  } catch (const std::bad_alloc&) {
    return fail(FMLP_ERROR_OUT_OF_MEMORY, "cannot allocate {} row maxima", rows);
  }
  const bool parallel = double(rows) * double(cols) > 1e5;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; ++r) amax[size_t(r)] = row_amax(*w, r, 0, cols);
  const float total = amax.empty() ? 0.f : *std::max_element(amax.begin(), amax.end());
  if (!per_row) s[0] = scale_for(total);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    const float sr = per_row ? scale_for(amax[size_t(r)]) : s[0];
    if (per_row) s[r] = sr;
    const char* src = static_cast<const char*>(w->data) + r * w->stride[0] * int64_t(es);
    uint8_t* dst = static_cast<uint8_t*>(q->data) + r * q->stride[0];
    for (int64_t c = 0; c < cols; ++c)
      dst[c] = fmlp::float_to_f8e4m3(load_float(src, w->dtype, c) / sr);
  }
  if (amax_out != nullptr) *amax_out = total;
  clear_last_error();
  return FMLP_SUCCESS;
}

}  // extern "C"
