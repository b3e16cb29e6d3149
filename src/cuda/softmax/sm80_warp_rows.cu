// softmax_sm80_warp_rows: rows of up to 4 KB, one warp per row held in registers (at most 8
// 16-byte vectors a lane, all requested at once), so each row is one read and one write with no
// barrier: the max, the sum and the outputs come from registers, reduced with shuffles in a fixed
// order. softmax_sm80_rows spends a block, two block reductions and a second read (from L1) on
// such rows, which left it behind torch on 4096 x 1024 fp32 (fusedmlp_ops_bench --only softmax;
// bench/results/softmax_h200.json).
#include <cuda_runtime.h>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/softmax/common.cuh"

namespace fmlp::detail {
namespace {

using namespace softmax;
using fmlp::cuda::warp_max;
using fmlp::cuda::warp_sum;

constexpr int kWarpRowsThreads = 256;
constexpr int64_t kWarpRowsMaxBytes = 4096;

// f(j, values) for each of this lane's 16-byte pieces of the row held in raw (the row's max, its
// sum and the outputs are three passes over the same registers).
template <typename T, int VPL, typename F>
__device__ __forceinline__ void warp_rows_each(const uint4 (&raw)[VPL], int nv, int lane, F f) {
  constexpr int E = kWidth<T, true>;
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    if (j * 32 + lane >= nv) continue;
    float v[E];
    unpack<T, true>(raw[j], v);
    f(j, v);
  }
}

template <typename T, int VPL>
__global__ void __launch_bounds__(kWarpRowsThreads) softmax_sm80_warp_rows(const SoftmaxParams p) {
  constexpr int E = kWidth<T, true>;
  const int lane = threadIdx.x % 32;
  const int64_t r = int64_t(blockIdx.x) * (kWarpRowsThreads / 32) + threadIdx.x / 32;
  if (r >= p.rows) return;
  const int64_t es = sizeof(T);
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const char*>(p.x) + r * p.x_ld * es);
  uint4* y = reinterpret_cast<uint4*>(static_cast<char*>(p.y) + r * p.y_ld * es);
  const int nv = int(p.n / E);
  uint4 raw[VPL];
#pragma unroll
  for (int j = 0; j < VPL; ++j)
    raw[j] = j * 32 + lane < nv ? x[j * 32 + lane] : make_uint4(0, 0, 0, 0);
  float m = -INFINITY;  // fmaxf skips NaN, as the other kernels' max does
  warp_rows_each<T>(raw, nv, lane, [&](int, const float(&f)[E]) {
#pragma unroll
    for (int e = 0; e < E; ++e) m = fmaxf(m, f[e]);
  });
  m = warp_max(m);
  const float ms = m == -INFINITY ? 0.f : m;  // a row of -Inf sums 0, not NaN (combine's rule)
  float sum = 0.f;
  warp_rows_each<T>(raw, nv, lane, [&](int, const float(&f)[E]) {
#pragma unroll
    for (int e = 0; e < E; ++e) sum += ex2((f[e] - ms) * p.sc2);
  });
  sum = warp_sum(sum);
  const RowOut tot = row_out({m, sum});
  warp_rows_each<T>(raw, nv, lane, [&](int j, float(&f)[E]) {
    finish<E>(f, p.log, p.inv_t, p.sc2, tot);
    y[j * 32 + lane] = pack<T>(f);
  });
}

}  // namespace

bool softmax_sm80_warp_rows_supports(const SoftmaxDesc& d, std::string* why) {
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  // FMLP_SOFTMAX_WARP_ROWS=0 turns the entry off (A/B measurements).
  static const bool on = knob_bool<Knob::FMLP_SOFTMAX_WARP_ROWS>();
  if (!on) return (*why = "switched off by FMLP_SOFTMAX_WARP_ROWS=0", false);
  const int64_t es = int64_t(dtype_size(d.dtype));
  if (d.n * es > kWarpRowsMaxBytes)
    return (*why = fmt::format("rows of {} bytes: this kernel holds rows of up to {} bytes in one "
                               "warp's registers; softmax_sm90_cluster and softmax_sm80_rows take "
                               "longer ones",
                               d.n * es, kWarpRowsMaxBytes),
            false);
  if ((d.n * es) % 16 != 0)
    return (*why = fmt::format("rows of {} bytes are not whole 16-byte vectors; softmax_sm80_rows "
                               "takes them",
                               d.n * es),
            false);
  if (d.rows >= (int64_t(1) << 31)) return (*why = "rows must be below 2^31", false);
  return true;
}

// Its fallback for views that are not 16-byte aligned (below) is softmax_sm80_rows.
size_t softmax_sm80_warp_rows_workspace(const SoftmaxDesc& d) {
  return softmax_sm80_rows_workspace(d);
}

namespace {

template <typename T>
cudaError_t launch_warp_rows(const SoftmaxParams& p, cudaStream_t s) {
  constexpr int E = kWidth<T, true>;
  const int64_t lanes = (p.n / E + 31) / 32;  // vectors a lane holds: at most 8
  const unsigned blocks =
      unsigned((int64_t(p.rows) + kWarpRowsThreads / 32 - 1) / (kWarpRowsThreads / 32));
  if (lanes <= 1)
    softmax_sm80_warp_rows<T, 1><<<blocks, kWarpRowsThreads, 0, s>>>(p);
  else if (lanes <= 2)
    softmax_sm80_warp_rows<T, 2><<<blocks, kWarpRowsThreads, 0, s>>>(p);
  else if (lanes <= 4)
    softmax_sm80_warp_rows<T, 4><<<blocks, kWarpRowsThreads, 0, s>>>(p);
  else
    softmax_sm80_warp_rows<T, 8><<<blocks, kWarpRowsThreads, 0, s>>>(p);
  return cudaGetLastError();
}

}  // namespace

// Views whose rows are not 16-byte aligned (base or stride) run as softmax_sm80_rows: supports()
// sees the shapes only, and the element path would hold up to 64 values a lane.
fmlp_status_t softmax_sm80_warp_rows_run(const fmlp_softmax_args_t& a, const SoftmaxDesc& d,
                                         void* ws, void* stream) {
  if (!softmax_vec16(d, a) || d.rows == 0) return softmax_sm80_rows_run(a, d, ws, stream);
  SoftmaxParams p = row_params(a, d);
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t e;
  switch (d.dtype) {
    case FMLP_DTYPE_F16: e = launch_warp_rows<__half>(p, s); break;
    case FMLP_DTYPE_BF16: e = launch_warp_rows<__nv_bfloat16>(p, s); break;
    default: e = launch_warp_rows<float>(p, s); break;
  }
  if (e != cudaSuccess)
    return fail(FMLP_ERROR_CUDA, "softmax_sm80_warp_rows launch failed: {}", cudaGetErrorString(e));
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
