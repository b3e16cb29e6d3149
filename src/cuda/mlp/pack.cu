// One-time CUDA weight pack (fmlp_mlp_pack with backend cuda).
//
// Private layout (WeightLayout::kCudaPacked), one cudaMalloc block, each piece 256-byte aligned:
//   w1: [rows1, d_in] with row stride round_up(d_in, 8), rows1 = 2*hidden when gated (gate rows,
//       then up rows), else hidden; the padding columns are zero.
//   w2: [d_out, hidden] with row stride round_up(hidden, 8), padding zero.
//   b1 ([rows1], gate bias then up bias, zeros where absent), b2, norm_weight, norm_bias: fp32.
//   fp8 e4m3 weights: rows padded to 16 elements, and per-row fp32 scales w1_scale [rows1] (gate
//   then up) and w2_scale [d_out], per-tensor scales repeated per row.
// So every row starts 16-byte aligned and can be read in whole groups of 8 elements, whatever
// the caller's strides and alignment were; the views keep nn.Linear shapes for validation.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/mlp_desc.hpp"
#include "core/tensor_check.hpp"
#include "cuda/common/common.cuh"
#include "cuda/mlp/entries.hpp"

namespace fmlp::detail {
namespace {

// dst[i] = src[i], or src[0] for every i when the source is one per-tensor scale.
__global__ void expand_scale(float* dst, const float* src, int64_t src_n, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[src_n == 1 ? 0 : i];
}

// Device scales must be finite and > 0 like host ones (validation reads only host memory): pack
// is the one-time place to read them back.
fmlp_status_t check_device_scale(const char* name, const fmlp_tensor_t& s) {
  if (tensor_absent(s)) return FMLP_SUCCESS;
  std::vector<float> h(size_t(s.shape[0]));
  if (cudaMemcpy(h.data(), s.data, h.size() * 4, cudaMemcpyDeviceToHost) != cudaSuccess) {
    const cudaError_t e = cudaGetLastError();
    return fail(FMLP_ERROR_CUDA, "reading {} back to check it failed: {}", name,
                cudaGetErrorString(e));
  }
  for (size_t i = 0; i < h.size(); ++i)
    if (!(std::isfinite(h[i]) && h[i] > 0.f))
      return fail(FMLP_ERROR_BAD_SCALE, "{}[{}] is {}; scales must be finite and > 0", name, i,
                  h[i]);
  return FMLP_SUCCESS;
}

__global__ void widen_to_f32(float* dst, const void* src, fmlp_dtype_t t, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = fmlp::cuda::load_scalar(src, t, i);
}

size_t round256(size_t n) {
  return (n + 255) / 256 * 256;
}
int64_t round_up(int64_t n, int64_t to) {
  return (n + to - 1) / to * to;
}

fmlp_tensor_t device_view(void* data, fmlp_dtype_t t, int64_t rows, int64_t cols, int64_t ld,
                          int32_t device) {
  fmlp_tensor_t v =
      cols == 0 ? fmlp_tensor_1d(data, t, rows) : fmlp_tensor_2d(data, t, rows, cols, ld);
  v.device_type = FMLP_DEVICE_CUDA;
  v.device_id = device;
  return v;
}

}  // namespace

fmlp_status_t cuda_mlp_pack(fmlp_mlp_packed_s* p, const fmlp_mlp_weights_t& w, const MlpDesc& d,
                            void* stream) {
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;
  std::string why;
  if (mlp_refuses_block_scales(d, &why)) return fail(FMLP_ERROR_NOT_SUPPORTED, "{}", why);
  if (fp8) {
    for (const auto& [name, scale] : {std::pair{"weights.w1_scale", &w.w1_scale},
                                      std::pair{"weights.w_up_scale", &w.w_up_scale},
                                      std::pair{"weights.w2_scale", &w.w2_scale}})
      if (const fmlp_status_t st = check_device_scale(name, *scale); st != FMLP_SUCCESS) return st;
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t H = d.hidden, K = d.d_in, N = d.d_out;
  const size_t es = dtype_size(d.w_dtype);
  const int64_t row_align = int64_t(16 / es);  // rows start on 16-byte boundaries
  const int64_t rows1 = d.gated ? 2 * H : H, ldk = round_up(K, row_align),
                ldh = round_up(H, row_align);
  const bool b1 = d.has_b1 || d.has_b_up;
  const size_t w1_bytes = round256(size_t(rows1 * ldk) * es);
  const size_t w2_bytes = round256(size_t(N * ldh) * es);
  const size_t b1_bytes = b1 ? round256(size_t(rows1) * 4) : 0;
  const size_t b2_bytes = d.has_b2 ? round256(size_t(N) * 4) : 0;
  const size_t g_bytes = d.has_norm_weight ? round256(size_t(K) * 4) : 0;
  const size_t be_bytes = d.has_norm_bias ? round256(size_t(K) * 4) : 0;
  const size_t s1_bytes = fp8 ? round256(size_t(rows1) * 4) : 0;
  const size_t s2_bytes = fp8 ? round256(size_t(N) * 4) : 0;
  const size_t total =
      w1_bytes + w2_bytes + b1_bytes + b2_bytes + g_bytes + be_bytes + s1_bytes + s2_bytes;

  int prev = -1;
  cudaGetDevice(&prev);
  if (prev != d.device_id) cudaSetDevice(d.device_id);
  char* base = nullptr;
  cudaError_t err = cudaMalloc(&base, total);
  if (err != cudaSuccess) {
    if (prev >= 0 && prev != d.device_id) cudaSetDevice(prev);
    cudaGetLastError();
    return fail(FMLP_ERROR_OUT_OF_MEMORY, "packing needs {} bytes on cuda:{}: {}", total,
                d.device_id, cudaGetErrorString(err));
  }
  char* w1p = base;
  char* w2p = w1p + w1_bytes;
  float* b1p = reinterpret_cast<float*>(w2p + w2_bytes);
  float* b2p = reinterpret_cast<float*>(reinterpret_cast<char*>(b1p) + b1_bytes);
  float* gp = reinterpret_cast<float*>(reinterpret_cast<char*>(b2p) + b2_bytes);
  float* bep = reinterpret_cast<float*>(reinterpret_cast<char*>(gp) + g_bytes);
  float* s1p = reinterpret_cast<float*>(reinterpret_cast<char*>(bep) + be_bytes);
  float* s2p = reinterpret_cast<float*>(reinterpret_cast<char*>(s1p) + s1_bytes);

  err = cudaMemsetAsync(base, 0, total, s);
  auto copy_rows = [&](char* dst, int64_t ld, const fmlp_tensor_t& src) {
    if (err == cudaSuccess && src.shape[0] > 0)
      err = cudaMemcpy2DAsync(dst, size_t(ld) * es, src.data, size_t(src.stride[0]) * es,
                              size_t(src.shape[1]) * es, size_t(src.shape[0]),
                              cudaMemcpyDeviceToDevice, s);
  };
  copy_rows(w1p, ldk, w.w1);
  if (d.gated && !d.stacked_gate_up) copy_rows(w1p + size_t(H * ldk) * es, ldk, w.w_up);
  copy_rows(w2p, ldh, w.w2);
  auto widen = [&](float* dst, const fmlp_tensor_t& src) {
    if (err != cudaSuccess || tensor_absent(src)) return;
    const int64_t n = src.shape[0];
    widen_to_f32<<<int((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024), 256, 0, s>>>(dst, src.data,
                                                                                      src.dtype, n);
    err = cudaGetLastError();
  };
  if (b1) {
    widen(b1p, w.b1);
    if (d.gated && !d.stacked_gate_up) widen(b1p + H, w.b_up);
  }
  if (d.has_b2) widen(b2p, w.b2);
  if (d.has_norm_weight) widen(gp, w.norm_weight);
  if (d.has_norm_bias) widen(bep, w.norm_bias);
  auto expand = [&](float* dst, const fmlp_tensor_t& src, int64_t n) {
    if (err != cudaSuccess) return;
    expand_scale<<<int(std::min<int64_t>((n + 255) / 256, 1024)), 256, 0, s>>>(
        dst, static_cast<const float*>(src.data), src.shape[0], n);
    err = cudaGetLastError();
  };
  if (fp8) {
    if (d.gated && !d.stacked_gate_up) {
      expand(s1p, w.w1_scale, H);
      expand(s1p + H, w.w_up_scale, H);
    } else {
      expand(s1p, w.w1_scale, rows1);
    }
    expand(s2p, w.w2_scale, N);
  }
  if (prev >= 0 && prev != d.device_id) cudaSetDevice(prev);
  if (err != cudaSuccess) {
    cudaFree(base);
    return fail(FMLP_ERROR_CUDA, "packing the weights on cuda:{} failed: {}", d.device_id,
                cudaGetErrorString(err));
  }

  const int32_t dev = d.device_id;
  fmlp_mlp_weights_t& o = p->weights;
  o = fmlp_mlp_weights_t{};
  o.w1 = device_view(w1p, d.w_dtype, rows1, K, ldk, dev);
  o.w2 = device_view(w2p, d.w_dtype, N, H, ldh, dev);
  if (b1) o.b1 = device_view(b1p, FMLP_DTYPE_F32, rows1, 0, 0, dev);
  if (d.has_b2) o.b2 = device_view(b2p, FMLP_DTYPE_F32, N, 0, 0, dev);
  if (d.has_norm_weight) o.norm_weight = device_view(gp, FMLP_DTYPE_F32, K, 0, 0, dev);
  if (d.has_norm_bias) o.norm_bias = device_view(bep, FMLP_DTYPE_F32, K, 0, 0, dev);
  if (fp8) {
    o.w1_scale = device_view(s1p, FMLP_DTYPE_F32, rows1, 0, 0, dev);
    o.w2_scale = device_view(s2p, FMLP_DTYPE_F32, N, 0, 0, dev);
  }
  p->storage = base;
  p->release = [](void* storage) { cudaFree(storage); };
  p->desc.layout = WeightLayout::kCudaPacked;
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
