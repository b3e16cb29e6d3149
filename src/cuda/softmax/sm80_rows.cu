// softmax_sm80_rows: softmax / log_softmax over the last dim, in two shapes of launch.
//
// Many rows (>= 2 per multiprocessor, or short rows): one launch, one block per row at a time.
// Pass 1 keeps a running (max, sum of exp) per thread, rescaling the sum when the max grows, and
// reduces the pairs over the block in a fixed order; pass 2 writes exp((x - max) / T) / sum (log:
// (x - max) / T - log sum). Long rows park their first ~200 KB in shared memory during pass 1, so
// pass 2 re-reads only the rest, which the L2 still holds: HBM sees about one read and one write.
//
// Few long rows (e.g. one row of 128256 logits): each row is split over many blocks so the whole
// GPU streams it. Launch 1: every block reduces its chunk to (max, sum) in the workspace; the last
// block of a row to arrive (a counter per row, no spinning) combines the row's chunks in chunk
// order, re-zeroes the partials and the counter. Launch 2 writes the outputs; its blocks count
// themselves again and the last re-zeroes the row's statistics and counter, so the workspace is
// left zero-filled. Two launches: a single one would need every block of a row to wait for that
// combine, i.e. a grid-wide spin.
//
// Non-finite inputs follow the formula, like PyTorch: the max ignores NaN but the sum does not;
// +Inf makes the max +Inf and (Inf - Inf) a NaN; an all -Inf row gives (-Inf - -Inf) = NaN.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/softmax/common.cuh"

namespace fmlp::detail {
namespace {

using namespace softmax;

constexpr int kSplitThreads = 256;
constexpr int kMaxThreads = 1024;
constexpr int kCacheBytes = 200 * 1024;

template <typename T, bool VEC>
__global__ void __launch_bounds__(kMaxThreads) softmax_sm80_fused(const SoftmaxParams p) {
  extern __shared__ uint4 cache[];
  __shared__ Ms scratch[32];
  constexpr int E = kWidth<T, VEC>;
  const int64_t es = sizeof(T), nv = p.n / E;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const char* x = static_cast<const char*>(p.x) + r * p.x_ld * es;
    char* y = static_cast<char*>(p.y) + r * p.y_ld * es;
    Ms acc{-INFINITY, 0.f};
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      float f[E];
      uint4 raw = make_uint4(0, 0, 0, 0);
      load<T, VEC>(x, i, p.t, f, &raw);
      if (VEC && i < p.cache_vecs) cache[i] = raw;  // read back by this same thread below
      accumulate<E>(acc, f, p.sc2);
    }
    const RowOut tot = row_out(block_reduce(acc, p.sc2, scratch));
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      float f[E];
      if (VEC && i < p.cache_vecs)
        unpack<T, VEC>(cache[i], f);
      else
        load<T, VEC>(x, i, p.t, f);
      finish<E>(f, p.log, p.inv_t, p.sc2, tot);
      store<T, VEC>(y, i, p.t, f);
    }
  }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(kSplitThreads) softmax_sm80_split_stats(const SoftmaxParams p) {
  __shared__ Ms scratch[32];
  __shared__ unsigned is_last;
  constexpr int E = kWidth<T, VEC>;
  const int64_t es = sizeof(T);
  const int r = blockIdx.x / p.chunks, c = blockIdx.x % p.chunks;
  const char* x = static_cast<const char*>(p.x) + r * p.x_ld * es;
  const int64_t b = c * p.chunk_len / E, e = min(p.n, (c + 1) * p.chunk_len) / E;
  Ms acc{-INFINITY, 0.f};
  for (int64_t i = b + threadIdx.x; i < e; i += kSplitThreads) {
    float f[E];
    load<T, VEC>(x, i, p.t, f);
    accumulate<E>(acc, f, p.sc2);
  }
  const Ms tot = block_reduce(acc, p.sc2, scratch);
  if (threadIdx.x == 0) {
    p.partials[blockIdx.x] = make_float2(tot.m, tot.s);
    __threadfence();
    is_last = atomicAdd(p.counters + r, 1u) == unsigned(p.chunks - 1);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  Ms v{-INFINITY, 0.f};
  for (int q = threadIdx.x; q < p.chunks; q += kSplitThreads) {
    float2* part = p.partials + int64_t(r) * p.chunks + q;
    const float2 pq = __ldcg(part);
    *part = make_float2(0.f, 0.f);  // its only reader: leave the workspace zero-filled
    v = combine(v, {pq.x, pq.y}, p.sc2);
  }
  v = block_reduce(v, p.sc2, scratch);
  if (threadIdx.x == 0) {
    p.stats[r] = make_float2(v.m, v.s);
    p.counters[r] = 0;
  }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(kSplitThreads) softmax_sm80_split_write(const SoftmaxParams p) {
  constexpr int E = kWidth<T, VEC>;
  const int64_t es = sizeof(T);
  const int r = blockIdx.x / p.chunks, c = blockIdx.x % p.chunks;
  const char* x = static_cast<const char*>(p.x) + r * p.x_ld * es;
  char* y = static_cast<char*>(p.y) + r * p.y_ld * es;
  const float2 st = __ldcg(p.stats + r);
  // Every block of the row has read its statistics once all have counted themselves: the last
  // re-zeroes them and the counter (launch 1 re-zeroed the partials and left the counter at 0).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(p.counters + r, 1u) == unsigned(p.chunks - 1)) {
      p.stats[r] = make_float2(0.f, 0.f);
      p.counters[r] = 0;
    }
  }
  const int64_t b = c * p.chunk_len / E, e = min(p.n, (c + 1) * p.chunk_len) / E;
  const RowOut tot = row_out({st.x, st.y});
  for (int64_t i = b + threadIdx.x; i < e; i += kSplitThreads) {
    float f[E];
    load<T, VEC>(x, i, p.t, f);
    finish<E>(f, p.log, p.inv_t, p.sc2, tot);
    store<T, VEC>(y, i, p.t, f);
  }
}

struct Config {
  bool split, vec;
  int threads, blocks, chunks;
  int64_t chunk_len, cache_vecs;
};

Config config_for(const SoftmaxDesc& d, const fmlp_softmax_args_t* a) {
  Config c{};
  const int64_t es = int64_t(dtype_size(d.dtype)), width = 16 / es;
  c.vec = a ? softmax_vec16(d, *a) : d.n % width == 0;
  const int64_t w = c.vec ? width : 1;
  const int sms = std::max(1, cuda_sm_count(d.device_id));
  c.split = d.rows < 2 * sms && d.n >= 8192;
  if (c.split) {
    c.threads = kSplitThreads;
    const int64_t target = (4 * int64_t(sms) + d.rows - 1) / d.rows;
    // In whole vector sweeps of the block whatever `vec` says, so the workspace size (asked
    // without the pointers) is the one the run uses.
    const int64_t sweep = kSplitThreads * width;
    const int64_t per = std::max<int64_t>((d.n + target - 1) / target, sweep);
    c.chunk_len = (per + sweep - 1) / sweep * sweep;
    c.chunks = int((d.n + c.chunk_len - 1) / c.chunk_len);
    c.blocks = int(d.rows) * c.chunks;
    return c;
  }
  const int64_t vecs = d.n / w;
  int threads = 64;
  while (threads < kMaxThreads && threads * 4 < vecs) threads *= 2;
  c.threads = threads;
  const bool long_rows = d.n * es > 64 * 1024;
  c.cache_vecs = c.vec && long_rows ? std::min<int64_t>(vecs, kCacheBytes / 16) : 0;
  const int per_sm = c.cache_vecs > 0 ? 1 : std::max(1, 2048 / threads);
  c.blocks = int(std::min<int64_t>(d.rows, int64_t(sms) * per_sm));
  return c;
}

}  // namespace

bool softmax_vec16(const SoftmaxDesc& d, const fmlp_softmax_args_t& a) {
  const int64_t es = int64_t(dtype_size(d.dtype));
  if (d.n % (16 / es) != 0) return false;
  for (const fmlp_tensor_t* t : {&a.x, &a.y})
    if (uintptr_t(t->data) % 16 != 0 || (t->ndim == 2 && d.rows > 1 && (t->stride[0] * es) % 16))
      return false;
  return true;
}

bool softmax_sm80_rows_supports(const SoftmaxDesc& d, std::string* why) {
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (d.rows >= (int64_t(1) << 31) || d.n >= (int64_t(1) << 40))
    return (*why = "rows must be below 2^31 and n below 2^40", false);
  return true;
}

size_t softmax_sm80_rows_workspace(const SoftmaxDesc& d) {
  const Config c = config_for(d, nullptr);
  if (!c.split) return 0;
  return align_up(size_t(c.blocks) * 8) + align_up(size_t(d.rows) * 8) +
         align_up(size_t(d.rows) * 4);
}

namespace {

template <typename T, bool VEC>
fmlp_status_t launch(const SoftmaxParams& p, const Config& c, cudaStream_t s) {
  if (c.split) {
    softmax_sm80_split_stats<T, VEC><<<c.blocks, kSplitThreads, 0, s>>>(p);
    softmax_sm80_split_write<T, VEC><<<c.blocks, kSplitThreads, 0, s>>>(p);
  } else {
    const size_t smem = size_t(c.cache_vecs) * 16;
    constexpr auto kernel = &softmax_sm80_fused<T, VEC>;
    if (const fmlp_status_t st = allow_dynamic_smem<kernel>(smem, "softmax_sm80_rows");
        st != FMLP_SUCCESS)
      return st;
    kernel<<<c.blocks, c.threads, smem, s>>>(p);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fail(FMLP_ERROR_CUDA, "softmax_sm80_rows launch failed: {}", cudaGetErrorString(e));
  return FMLP_SUCCESS;
}

template <typename T>
fmlp_status_t dispatch(const SoftmaxParams& p, const Config& c, cudaStream_t s) {
  return c.vec ? launch<T, true>(p, c, s) : launch<T, false>(p, c, s);
}

}  // namespace

fmlp_status_t softmax_sm80_rows_run(const fmlp_softmax_args_t& a, const SoftmaxDesc& d, void* ws,
                                    void* stream) {
  const Config c = config_for(d, &a);
  SoftmaxParams p = row_params(a, d);
  p.chunks = c.chunks;
  p.chunk_len = c.chunk_len;
  p.cache_vecs = c.cache_vecs;
  if (c.split) {
    char* base = static_cast<char*>(ws);
    p.partials = reinterpret_cast<float2*>(base);
    base += align_up(size_t(c.blocks) * 8);
    p.stats = reinterpret_cast<float2*>(base);
    base += align_up(size_t(d.rows) * 8);
    p.counters = reinterpret_cast<unsigned*>(base);
  }
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  auto s = static_cast<cudaStream_t>(stream);
  fmlp_status_t st;
  switch (d.dtype) {
    case FMLP_DTYPE_F16: st = dispatch<__half>(p, c, s); break;
    case FMLP_DTYPE_BF16: st = dispatch<__nv_bfloat16>(p, c, s); break;
    default: st = dispatch<float>(p, c, s); break;
  }
  return st;
}

}  // namespace fmlp::detail
