// Pack-time tuning of the mlp planner (tuning.hpp says why and how).
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/mlp_validate.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/mlp/tuning.hpp"

namespace fmlp::detail {
namespace {

constexpr int kWarmups = 2, kReps = 5;

// Pseudo-random 16-bit values of modest size (never zeros: they hide slow paths and run faster
// than real data) or fp32 ones.
__global__ void fill_random(void* p, int64_t n, bool f32) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u;
    h ^= h >> 15;
    const float v = (float(h & 0xffff) - 32768.f) / 32768.f;
    if (f32)
      static_cast<float*>(p)[i] = v;
    else
      static_cast<uint16_t*>(p)[i] = uint16_t(0x3c00 ^ (h & 0x83ff));  // fp16 in +-[1, 2)
  }
}

// Owns device buffers for one tuning run; frees them on every path.
struct DeviceBuffers {
  std::vector<void*> ptrs;
  void* take(size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(bytes, 256)) != cudaSuccess) return nullptr;
    ptrs.push_back(p);
    return p;
  }
  ~DeviceBuffers() {
    for (void* p : ptrs) cudaFree(p);
  }
};

struct GraphTimer {
  cudaStream_t stream = nullptr;
  cudaEvent_t a = nullptr, b = nullptr;
  ~GraphTimer() {
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
    if (stream) cudaStreamDestroy(stream);
  }
};

// Median device time of one call of `k`, captured in a graph and replayed with the L2 flushed
// before each replay (flush: `flush_bytes` at `flush`, or none); < 0 when it cannot be timed.
float time_entry(const MlpKernel& k, const fmlp_mlp_args_t& a, const MlpDesc& d, void* ws,
                 GraphTimer& t, void* flush, size_t flush_bytes) {
  cudaGraph_t g = nullptr;
  cudaGraphExec_t ge = nullptr;
  // One eager call first: what an entry sets up on first use (a cuBLASLt handle, its heuristic's
  // answer) must not happen inside the capture.
  if (run_entry(k, a, d, ws, t.stream) != FMLP_SUCCESS ||
      cudaStreamSynchronize(t.stream) != cudaSuccess) {
    cudaGetLastError();
    clear_last_error();
    return -1;
  }
  if (cudaStreamBeginCapture(t.stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return -1;
  const fmlp_status_t st = run_entry(k, a, d, ws, t.stream);
  const cudaError_t end = cudaStreamEndCapture(t.stream, &g);
  float result = -1;
  if (st == FMLP_SUCCESS && end == cudaSuccess && g != nullptr &&
      cudaGraphInstantiate(&ge, g, 0) == cudaSuccess) {
    std::vector<float> ms;
    bool ok = true;
    for (int r = 0; r < kWarmups + kReps && ok; ++r) {
      if (flush) ok = cudaMemsetAsync(flush, r & 0xff, flush_bytes, t.stream) == cudaSuccess;
      ok = ok && cudaEventRecord(t.a, t.stream) == cudaSuccess &&
           cudaGraphLaunch(ge, t.stream) == cudaSuccess &&
           cudaEventRecord(t.b, t.stream) == cudaSuccess &&
           cudaEventSynchronize(t.b) == cudaSuccess;
      float v = 0;
      if (ok && r >= kWarmups && cudaEventElapsedTime(&v, t.a, t.b) == cudaSuccess) ms.push_back(v);
    }
    if (ok && !ms.empty()) {
      std::sort(ms.begin(), ms.end());
      result = ms[ms.size() / 2] * 1000.f;
    }
  }
  if (ge) cudaGraphExecDestroy(ge);
  if (g) cudaGraphDestroy(g);
  cudaGetLastError();  // a failed candidate is skipped, not reported
  clear_last_error();
  return result;
}

// The activations a packed MLP is assumed to take: the weights' 16-bit dtype, bf16 with fp8
// weights, fp32 with fp32 ones.
fmlp_dtype_t assumed_act(const MlpDesc& d) {
  return d.w_dtype == FMLP_DTYPE_F8_E4M3 ? FMLP_DTYPE_BF16 : d.w_dtype;
}

// Times every entry at every bucket; the reason on failure.
std::string tune(const fmlp_mlp_packed_s& p, MlpTuning* out) {
  const MlpDesc& pd = p.desc;
  const fmlp_dtype_t at = assumed_act(pd);
  const size_t es = dtype_size(at);
  const int64_t m_max = MlpTuning::kBucketM[MlpTuning::kBuckets - 1];
  const DeviceScope scope(pd.device_id);
  if (scope.status() != FMLP_SUCCESS) return "cannot select the weights' device";
  DeviceBuffers buf;
  void* x = buf.take(size_t(m_max * pd.d_in) * es);
  void* y = buf.take(size_t(m_max * pd.d_out) * es);
  if (x == nullptr || y == nullptr) return "cannot allocate the timing buffers";
  const int64_t rows1 = pd.gated ? 2 * pd.hidden : pd.hidden;
  const double wbytes = double(rows1 * pd.d_in + pd.d_out * pd.hidden) * dtype_size(pd.w_dtype);
  const size_t l2 = size_t(std::max<int64_t>(cuda_l2_bytes(pd.device_id), 1 << 20));
  // Weights that the L2 could hold are flushed out of it before each replay, as another layer's
  // would be in a model.
  const size_t flush_bytes = wbytes < 3.0 * double(l2) ? 2 * l2 : 0;
  void* flush = flush_bytes ? buf.take(flush_bytes) : nullptr;
  GraphTimer t;
  if (cudaStreamCreateWithFlags(&t.stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreate(&t.a) != cudaSuccess || cudaEventCreate(&t.b) != cudaSuccess ||
      (flush_bytes && flush == nullptr)) {
    cudaGetLastError();
    return "cannot create the timing stream, events or L2 flush buffer";
  }
  fill_random<<<256, 256, 0, t.stream>>>(x, m_max * pd.d_in, at == FMLP_DTYPE_F32);
  void* ws = nullptr;
  size_t ws_bytes = 0;
  const MlpKernelList list = cuda_mlp_kernels();
  for (int b = 0; b < MlpTuning::kBuckets; ++b) {
    const int64_t m = MlpTuning::kBucketM[b];
    fmlp_mlp_args_t a{};
    a.x = fmlp_tensor_2d(x, at, m, pd.d_in, pd.d_in);
    a.y = fmlp_tensor_2d(y, at, m, pd.d_out, pd.d_out);
    for (fmlp_tensor_t* v : {&a.x, &a.y})
      v->device_type = FMLP_DEVICE_CUDA, v->device_id = pd.device_id;
    a.residual = fmlp_tensor_none();
    a.weights = p.weights;
    a.config = p.config;
    MlpDesc d = pd;
    if (validate_mlp_activations(a.y, a.x, &a.residual, a.weights, &d) != FMLP_SUCCESS) {
      clear_last_error();
      return fmt::format("the timing call at M={} is not valid", m);
    }
    std::vector<std::pair<float, const MlpKernel*>> times;
    for (size_t i = 0; i < list.count; ++i) {
      const MlpKernel& k = list.kernels[i];
      std::string why;
      if (!k.supports(d, &why)) continue;
      const size_t need = k.workspace_bytes(d);
      if (need > ws_bytes) {
        void* grown = buf.take(need);
        if (grown == nullptr || cudaMemsetAsync(grown, 0, need, t.stream) != cudaSuccess) continue;
        ws = grown, ws_bytes = need;
      }
      const float us = time_entry(k, a, d, ws, t, flush, flush_bytes);
      if (us > 0) times.emplace_back(us, &k);
    }
    std::sort(times.begin(), times.end(),
              [](const auto& l, const auto& r) { return l.first < r.first; });
    if (!times.empty()) out->pick[b] = times[0].second;
    for (const auto& [us, k] : times)
      out->detail[b] +=
          fmt::format("{}{} {:.1f} us", out->detail[b].empty() ? "" : ", ", k->name, us);
  }
  if (cudaStreamSynchronize(t.stream) != cudaSuccess) {
    cudaGetLastError();
    return "the timing stream failed";
  }
  out->device = pd.device_id;
  out->act_dtype = at;
  return {};
}

}  // namespace

int mlp_tuning_bucket(int64_t m) {
  for (int b = 0; b < MlpTuning::kBuckets; ++b)
    if (m <= MlpTuning::kBucketM[b]) return b;
  return -1;
}

void cuda_mlp_tune(fmlp_mlp_packed_s* p) {
  // FMLP_PLAN_TUNE=0 keeps the fixed rules for packed weights too (and skips the timing).
  static const bool on = knob_bool<Knob::FMLP_PLAN_TUNE>();
  if (!on) return void(p->tuning_note = "FMLP_PLAN_TUNE=0: fixed rules");
  if (p->desc.deterministic)
    return void(p->tuning_note = "deterministic mode: fixed rules (the same entry every process)");
  // One timing per shape, dtype, epilogue and device for the process.
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const MlpTuning>> cache;
  MlpDesc key_desc = p->desc;
  key_desc.m = 0;
  const std::string key = describe(key_desc) + fmt::format(" layout {}", int(p->desc.layout));
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = cache.find(key); it != cache.end()) {
    p->tuning = it->second;
    return;
  }
  auto t = std::make_shared<MlpTuning>();
  const std::string why = tune(*p, t.get());
  if (!why.empty()) return void(p->tuning_note = "pack-time timing skipped: " + why);
  cache.emplace(key, t);
  p->tuning = std::move(t);
}

}  // namespace fmlp::detail
