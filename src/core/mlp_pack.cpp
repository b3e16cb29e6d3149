// One-time weight packing. Host backends get one 64-byte-aligned contiguous block: gate and up
// stacked into w1 as [2*hidden, d_in] (one stream for the kernels), biases and norm parameters
// widened to fp32, fp8 scales per row (per-tensor ones repeated) or kept as 128 x 128 blocks. CUDA
// packs through its own hook into device memory.
#include <cstdlib>
#include <cstring>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#include "core/mlp_validate.hpp"
#include "core/tensor_check.hpp"

namespace fmlp::detail {
namespace {

constexpr size_t kAlign = 64;
size_t round_up(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

struct HostArena {
  char* base = nullptr;
  size_t used = 0;
  void* take(size_t bytes) {
    void* p = base + used;
    used += round_up(bytes);
    return p;
  }
};

// Copies `rows` rows of a 2-D view into dst (contiguous), keeping the dtype.
void copy_rows(void* dst, const fmlp_tensor_t& src) {
  const size_t row_bytes = size_t(src.shape[1]) * dtype_size(src.dtype);
  for (int64_t r = 0; r < src.shape[0]; ++r)
    std::memcpy(static_cast<char*>(dst) + r * row_bytes,
                static_cast<const char*>(src.data) + r * src.stride[0] * dtype_size(src.dtype),
                row_bytes);
}

// Writes n fp32 values from a 1-D view (absent: `fill`) at dst.
void widen(float* dst, const fmlp_tensor_t& src, int64_t n, float fill) {
  for (int64_t i = 0; i < n; ++i)
    dst[i] = tensor_absent(src) ? fill : float(load_as_double(src.data, src.dtype, i));
}

// fp8 scales as fp32 per row (per-tensor scales are broadcast so the kernels see one form).
void widen_scale(float* dst, const fmlp_tensor_t& s, int64_t rows) {
  const float* p = static_cast<const float*>(s.data);
  for (int64_t i = 0; i < rows; ++i) dst[i] = s.shape[0] == 1 ? p[0] : p[i];
}

// 2-D block scales copied contiguous; returns the floats written.
int64_t copy_block_scale(float* dst, const fmlp_tensor_t& s) {
  const float* p = static_cast<const float*>(s.data);
  for (int64_t r = 0; r < s.shape[0]; ++r)
    for (int64_t c = 0; c < s.shape[1]; ++c) dst[r * s.shape[1] + c] = p[r * s.stride[0] + c];
  return s.shape[0] * s.shape[1];
}

fmlp_tensor_t host_view(void* data, fmlp_dtype_t t, int64_t rows, int64_t cols) {
  return rows == 0   ? fmlp_tensor_none()
         : cols == 0 ? fmlp_tensor_1d(data, t, rows)
                     : fmlp_tensor_2d(data, t, rows, cols, cols);
}

fmlp_status_t pack_host(fmlp_mlp_packed_s* p, const fmlp_mlp_weights_t& w, const MlpDesc& d) {
  const int64_t H = d.hidden, K = d.d_in, N = d.d_out;
  const int64_t rows1 = d.gated ? 2 * H : H;
  const size_t es = dtype_size(d.w_dtype);
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  const bool b1 = d.has_b1 || d.has_b_up;
  size_t total = round_up(size_t(rows1 * K) * es) + round_up(size_t(N * H) * es);
  // Block scales stay blocks: the gate's block rows, then the up's (the stacked w1's layout).
  const bool block1 = d.w1_scale == ScaleKind::kBlock, block2 = d.w2_scale == ScaleKind::kBlock;
  const int64_t rb1 = (d.gated ? 2 : 1) * block_count(H), cb1 = block_count(K);
  const int64_t s1_floats = block1 ? rb1 * cb1 : rows1;
  const int64_t s2_floats = block2 ? block_count(N) * block_count(H) : N;
  if (fp8) total += round_up(size_t(s1_floats) * 4) + round_up(size_t(s2_floats) * 4);
  if (b1) total += round_up(size_t(rows1) * 4);
  if (d.has_b2) total += round_up(size_t(N) * 4);
  if (d.has_norm_weight) total += round_up(size_t(K) * 4);
  if (d.has_norm_bias) total += round_up(size_t(K) * 4);
  HostArena arena{static_cast<char*>(std::aligned_alloc(kAlign, total)), 0};
  if (arena.base == nullptr)
    return fail(FMLP_ERROR_OUT_OF_MEMORY, "packing needs {} bytes of host memory", total);

  fmlp_mlp_weights_t& o = p->weights;
  o = fmlp_mlp_weights_t{};
  char* w1 = static_cast<char*>(arena.take(size_t(rows1 * K) * es));
  const bool separate_up = d.gated && !d.stacked_gate_up;
  copy_rows(w1, w.w1);
  if (separate_up) copy_rows(w1 + size_t(H * K) * es, w.w_up);
  o.w1 = host_view(w1, d.w_dtype, rows1, K);
  void* w2 = arena.take(size_t(N * H) * es);
  copy_rows(w2, w.w2);
  o.w2 = host_view(w2, d.w_dtype, N, H);
  if (fp8) {
    float* s1 = static_cast<float*>(arena.take(size_t(s1_floats) * 4));
    if (block1) {
      const int64_t gate = copy_block_scale(s1, w.w1_scale);
      if (separate_up) copy_block_scale(s1 + gate, w.w_up_scale);
      o.w1_scale = host_view(s1, FMLP_DTYPE_F32, rb1, cb1);
    } else {
      widen_scale(s1, w.w1_scale, w.w1.shape[0]);
      if (separate_up) widen_scale(s1 + H, w.w_up_scale, H);
      o.w1_scale = host_view(s1, FMLP_DTYPE_F32, rows1, 0);
    }
    float* s2 = static_cast<float*>(arena.take(size_t(s2_floats) * 4));
    if (block2) {
      copy_block_scale(s2, w.w2_scale);
      o.w2_scale = host_view(s2, FMLP_DTYPE_F32, block_count(N), block_count(H));
    } else {
      widen_scale(s2, w.w2_scale, N);
      o.w2_scale = host_view(s2, FMLP_DTYPE_F32, N, 0);
    }
  }
  if (b1) {
    float* b = static_cast<float*>(arena.take(size_t(rows1) * 4));
    widen(b, w.b1, w.b1.ndim ? w.b1.shape[0] : (separate_up ? H : rows1), 0.f);
    if (separate_up) widen(b + H, w.b_up, H, 0.f);
    o.b1 = host_view(b, FMLP_DTYPE_F32, rows1, 0);
  }
  if (d.has_b2) {
    float* b = static_cast<float*>(arena.take(size_t(N) * 4));
    widen(b, w.b2, N, 0.f);
    o.b2 = host_view(b, FMLP_DTYPE_F32, N, 0);
  }
  if (d.has_norm_weight) {
    float* g = static_cast<float*>(arena.take(size_t(K) * 4));
    widen(g, w.norm_weight, K, 1.f);
    o.norm_weight = host_view(g, FMLP_DTYPE_F32, K, 0);
  }
  if (d.has_norm_bias) {
    float* g = static_cast<float*>(arena.take(size_t(K) * 4));
    widen(g, w.norm_bias, K, 0.f);
    o.norm_bias = host_view(g, FMLP_DTYPE_F32, K, 0);
  }
  p->storage = arena.base;
  p->release = [](void* s) { std::free(s); };
  p->desc.layout = WeightLayout::kHostContiguous;
  return FMLP_SUCCESS;
}

}  // namespace
}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {

fmlp_status_t fmlp_mlp_pack(fmlp_mlp_packed_t** packed, const fmlp_mlp_weights_t* weights,
                            const fmlp_mlp_config_t* config, fmlp_backend_t backend, void* stream) {
  if (packed == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "packed is NULL");
  if (weights == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "weights is NULL");
  if (config == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "config is NULL");
  *packed = nullptr;
  MlpDesc d;
  if (const fmlp_status_t s = validate_mlp_weights(*weights, *config, -1, &d); s != FMLP_SUCCESS)
    return s;
  if (const fmlp_status_t s = resolve_backend(backend, d.device, d.device_id, &backend);
      s != FMLP_SUCCESS)
    return s;
  auto* p = new (std::nothrow) fmlp_mlp_packed_s{};
  if (p == nullptr) return fail(FMLP_ERROR_OUT_OF_MEMORY, "cannot allocate the packed handle");
  p->backend = backend;
  p->config = *config;
  p->desc = d;
  const fmlp_status_t s = backend == FMLP_BACKEND_CUDA ? cuda_mlp_pack(p, *weights, d, stream)
                                                       : pack_host(p, *weights, d);
  if (s != FMLP_SUCCESS) {
    delete p;
    return s;
  }
  // Describe the packed views themselves (stacked gate/up, widened biases, alignment), keeping
  // the layout tag the backend's pack chose.
  const WeightLayout layout = p->desc.layout;
  if (const fmlp_status_t v = validate_mlp_weights(p->weights, p->config, -1, &p->desc);
      v != FMLP_SUCCESS) {
    fmlp_mlp_packed_destroy(p);
    return fail(FMLP_ERROR_INTERNAL, "packed weights failed validation: {}", last_error());
  }
  p->desc.layout = layout;
  if (backend == FMLP_BACKEND_CUDA) {  // the planner's per-M timing (cuda/mlp/tuning.hpp)
    cuda_mlp_tune(p);
    p->desc.tuning = p->tuning.get();
    clear_last_error();
  }
  *packed = p;
  clear_last_error();
  return FMLP_SUCCESS;
}

void fmlp_mlp_packed_destroy(fmlp_mlp_packed_t* packed) {
  if (packed == nullptr) return;
  if (packed->release) packed->release(packed->storage);
  delete packed;
}

}  // extern "C"
