#include "core/tensor_check.hpp"

#include "core/dtype.hpp"
#include "core/error.hpp"

namespace fmlp::detail {

std::string shape_string(const fmlp_tensor_t& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim && i < FMLP_MAX_DIMS; ++i)
    s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

std::string device_string(fmlp_device_type_t type, int32_t id) {
  if (type == FMLP_DEVICE_CPU) return "cpu";
  if (type == FMLP_DEVICE_CUDA) return "cuda:" + std::to_string(id);
  return "unknown device " + std::to_string(int(type));
}

int64_t tensor_numel(const fmlp_tensor_t& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

fmlp_status_t check_tensor(const char* name, const fmlp_tensor_t& t, int ndim,
                           const int64_t* expected, const char* shape_doc) {
  if (t.ndim != ndim)
    return fail(FMLP_ERROR_SHAPE_MISMATCH, "{} must be {}-D {}, got a {}-D tensor", name, ndim,
                shape_doc, t.ndim);
  for (int i = 0; i < ndim; ++i)
    if (t.shape[i] < 0)
      return fail(FMLP_ERROR_SIZE_OVERFLOW, "{}.shape[{}] is {}; sizes must be >= 0", name, i,
                  t.shape[i]);
  for (int i = 0; i < ndim; ++i)
    if (expected[i] >= 0 && t.shape[i] != expected[i])
      return fail(
          FMLP_ERROR_SHAPE_MISMATCH, "{} must have shape {} = [{}], got {}", name, shape_doc,
          [&] {
            std::string s;
            for (int k = 0; k < ndim; ++k)
              s += (k ? ", " : "") + (expected[k] >= 0 ? std::to_string(expected[k]) : "*");
            return s;
          }(),
          shape_string(t));
  const size_t esize = dtype_size(t.dtype);
  if (esize == 0)
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "{}.dtype is {}, which is not a known fmlp_dtype_t",
                name, int(t.dtype));
  if (t.device_type != FMLP_DEVICE_CPU && t.device_type != FMLP_DEVICE_CUDA)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "{}.device_type is {}; expected FMLP_DEVICE_CPU or "
                "FMLP_DEVICE_CUDA",
                name, int(t.device_type));
  // Empty when any size is 0. Not numel == 0: the product can wrap to 0 (2^62 x 4), which would
  // let a huge view skip the extent checks below.
  for (int i = 0; i < ndim; ++i)
    if (t.shape[i] == 0) return FMLP_SUCCESS;
  if (t.data == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "{}.data is NULL", name);
  if (t.stride[ndim - 1] != 1 && t.shape[ndim - 1] > 1)
    return fail(FMLP_ERROR_BAD_STRIDE,
                "{}.stride[{}] is {}; the innermost dimension must be contiguous (stride 1): "
                "make the tensor contiguous first",
                name, ndim - 1, t.stride[ndim - 1]);
  // Every outer stride must step past the whole block inside it, so rows never overlap, and the
  // furthest element's byte offset must fit in int64.
  int64_t inner_extent = t.shape[ndim - 1];
  int64_t last = t.shape[ndim - 1] - 1;
  for (int i = ndim - 2; i >= 0; --i) {
    if (t.shape[i] > 1 && t.stride[i] < inner_extent)
      return fail(FMLP_ERROR_BAD_STRIDE,
                  "{}.stride[{}] is {} but each slice spans {} elements; slices would overlap "
                  "(expected stride >= {})",
                  name, i, t.stride[i], inner_extent, inner_extent);
    int64_t step;
    if (__builtin_mul_overflow(t.shape[i] - 1, t.stride[i], &step) ||
        __builtin_add_overflow(last, step, &last) ||
        __builtin_mul_overflow(t.stride[i], t.shape[i], &inner_extent))
      return fail(FMLP_ERROR_SIZE_OVERFLOW,
                  "{} with shape {} and stride[{}] = {} spans more "
                  "elements than fit in 64 bits",
                  name, shape_string(t), i, t.stride[i]);
  }
  int64_t bytes;
  if (__builtin_mul_overflow(last + 1, int64_t(esize), &bytes) ||
      uintptr_t(t.data) + uint64_t(bytes) < uintptr_t(t.data))
    return fail(FMLP_ERROR_SIZE_OVERFLOW,
                "{} with shape {} spans more bytes than the address "
                "space holds",
                name, shape_string(t));
  if (uintptr_t(t.data) % esize != 0)
    return fail(FMLP_ERROR_MISALIGNED, "{}.data = {} is not aligned to its {}-byte element size",
                name, t.data, esize);
  return FMLP_SUCCESS;
}

ByteRange byte_range(const fmlp_tensor_t& t) {
  if (t.data == nullptr || t.ndim == 0 || tensor_numel(t) == 0) return {};
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) last += (t.shape[i] - 1) * t.stride[i];
  const uintptr_t b = uintptr_t(t.data);
  return {b, b + uintptr_t((last + 1) * int64_t(dtype_size(t.dtype)))};
}

bool ranges_overlap(const ByteRange& a, const ByteRange& b) {
  return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end;
}

bool same_view(const fmlp_tensor_t& a, const fmlp_tensor_t& b) {
  if (a.data != b.data || a.ndim != b.ndim || a.dtype != b.dtype) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.stride[i] != b.stride[i])) return false;
  return true;
}

fmlp_status_t check_one_device(const NamedTensor* first, const NamedTensor* last,
                               fmlp_device_type_t device, int32_t device_id, const char* owner) {
  for (const NamedTensor* n = first; n != last; ++n) {
    if (tensor_absent(*n->t)) continue;
    if (n->t->device_type != device || n->t->device_id != device_id)
      return fail(FMLP_ERROR_DEVICE_MISMATCH,
                  "{} is on {} but {} on {}; put every tensor on one device", n->name,
                  device_string(n->t->device_type, n->t->device_id), owner,
                  device_string(device, device_id));
  }
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
