// The cuda moe entry moe_sm80_chunked (kernels in moe_route.cu and moe_experts.cu, overview in
// moe_cuda.hpp): what it takes, its plan and workspace, its launches, and the device error count.
#include <algorithm>
#include <cmath>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/device_scope.hpp"
#include "cuda/moe_cuda.hpp"
#include "cuda/ops.cuh"

namespace fmlp::detail {
namespace {

// Above this the per-slice partials give way to red.add into one buffer (outside deterministic
// mode); decode sizes are far below it.
constexpr size_t kPartialCap = size_t(64) << 20;

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

bool moe_cuda_supports(const MoeDesc& d, std::string* why) {
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16)
    return (*why = fmt::format("{} experts: the tensor-core kernel takes bf16 or f16 experts",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  if (d.global_experts > kMoeMaxExperts)
    return (*why = fmt::format("{} experts routed over: the routing kernel keeps per-expert "
                               "tables in shared memory and takes at most {}",
                               d.global_experts, kMoeMaxExperts),
            false);
  if (d.d % 8 != 0 || d.hidden % 8 != 0)
    return (*why = fmt::format("d={} and hidden={} must be multiples of 8 (16-byte weight "
                               "loads); pad the experts",
                               d.d, d.hidden),
            false);
  if (!d.expert.weights_vec16)
    return (*why =
                "an expert's W1 or W2 is not 16-byte aligned (base or row stride); store "
                "the experts with 16-byte aligned rows",
            false);
  if (d.d >= (int64_t(1) << 28) || d.hidden >= (int64_t(1) << 28) || d.d_out > (int64_t(1) << 21))
    return (*why = "d and hidden must be below 2^28 and d_out at most 2^21", false);
  return true;
}

}  // namespace

MoePlan moe_plan(const MoeDesc& d) {
  MoePlan pl;
  const int64_t n = d.tokens * d.top_k, E = d.experts;
  const int sms = std::max(1, cuda_sm_count(d.device_id));
  // Expected local experts with tokens (each token picks k distinct ones of the global experts),
  // expected local slots, and tokens per such expert. The bounds below hold for any routing.
  const double G = double(d.global_experts);
  const double hit =
      std::max(1.0, double(E) * (1.0 - std::pow(1.0 - double(d.top_k) / G, double(d.tokens))));
  const double local = double(n) * double(E) / G;
  const double per = local / hit;
  pl.chunk = per <= 8 ? 8 : per <= 16 ? 16 : per <= 32 ? 32 : 64;
  const int64_t c = pl.chunk;
  pl.max_chunks = std::min(n, (n + (c - 1) * std::min(E, n)) / c);
  pl.tiles = int((d.hidden + 15) / 16);
  // Two blocks per multiprocessor for the chunks a typical routing gives.
  const double chunks = std::clamp(std::floor(hit + 0.5 * local / double(c)), 1.0,
                                   double(std::max<int64_t>(1, pl.max_chunks)));
  pl.slices = int(std::clamp(std::llround(2.0 * sms / chunks), 1LL, (long long)pl.tiles));
  const size_t slice_bytes = std::max<size_t>(4, size_t(n) * size_t(d.d_out) * 4);
  if (d.deterministic)
    pl.slices = int(std::clamp<size_t>(kPartialCap / slice_bytes, 1, size_t(pl.slices)));
  pl.partial = d.deterministic || size_t(pl.slices) * slice_bytes <= kPartialCap;
  size_t at = align256(sizeof(MoeHeader));
  const auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align256(bytes);
    return here;
  };
  pl.counts = take(size_t(E) * 4);
  pl.ids = take(size_t(n) * 4);
  pl.wts = take(size_t(n) * 4);
  pl.perm = take(size_t(n) * 4);
  pl.chunk_expert = take(size_t(pl.max_chunks) * 4);
  pl.chunk_start = take(size_t(pl.max_chunks) * 4);
  pl.chunk_len = take(size_t(pl.max_chunks) * 4);
  pl.out = take(size_t(pl.partial ? pl.slices : 1) * slice_bytes);
  pl.total = at;
  pl.experts_smem = size_t(pl.chunk) * kMoeHsStride * 2 + size_t(2 * kMoeResRows) * pl.chunk * 4;
  return pl;
}

namespace {

size_t moe_cuda_workspace(const MoeDesc& d) {
  return moe_plan(d).total;
}

fmlp_status_t moe_cuda_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws, void* stream) {
  const MoePlan pl = moe_plan(d);
  const size_t xs = dtype_size(d.act_dtype);
  MoeParams p{};
  p.tokens = int(d.tokens), p.d = int(d.d), p.hidden = int(d.hidden), p.d_out = int(d.d_out);
  p.experts = int(d.experts), p.top_k = int(d.top_k), p.slots = int(d.tokens * d.top_k);
  p.first_expert = int(d.first_expert), p.global_experts = int(d.global_experts);
  p.chunk = pl.chunk, p.slices = pl.slices, p.tiles = pl.tiles;
  p.out_slices = pl.partial ? pl.slices : 1;
  p.route_tokens = pl.route_tokens;
  p.gated = d.gated, p.partial = pl.partial, p.renormalize = d.renormalize;
  p.sigmoid = d.scoring == FMLP_MOE_SCORING_SIGMOID, p.given = d.given_routing;
  p.act = d.activation;
  p.x = a.x.data, p.x_ld = a.x.stride[0], p.x_t = d.act_dtype;
  p.x_vec16 = uintptr_t(p.x) % 16 == 0 && (d.tokens == 1 || (p.x_ld * int64_t(xs)) % 16 == 0);
  p.x_direct = p.x_vec16 && d.act_dtype == d.w_dtype;
  p.y = a.y.data, p.y_ld = a.y.stride[0];
  if (d.has_residual) p.res = a.residual.data, p.res_ld = a.residual.stride[0];
  if (!d.given_routing) {
    p.rw = a.router_w.data, p.rw_ld = a.router_w.stride[0], p.rw_t = d.router_dtype;
    p.rw_vec16 = uintptr_t(p.rw) % 16 == 0 &&
                 (d.global_experts == 1 || (p.rw_ld * int64_t(dtype_size(p.rw_t))) % 16 == 0);
    if (d.router_bias_dtype != FMLP_DTYPE_INVALID)
      p.rb = a.router_b.data, p.rb_t = d.router_bias_dtype;
  } else {
    p.given_ids = a.topk_ids, p.given_wts = a.topk_weights;
  }
  p.w1 = a.w1.data, p.w1_e = a.w1.stride[0], p.w1_ld = a.w1.stride[1];
  p.w2 = a.w2.data, p.w2_e = a.w2.stride[0], p.w2_ld = a.w2.stride[1];
  p.w_t = d.w_dtype;
  if (d.b1_dtype != FMLP_DTYPE_INVALID)
    p.b1 = a.b1.data, p.b1_e = a.b1.stride[0], p.b1_t = d.b1_dtype;
  if (d.b2_dtype != FMLP_DTYPE_INVALID)
    p.b2 = a.b2.data, p.b2_e = a.b2.stride[0], p.b2_t = d.b2_dtype;
  char* base = static_cast<char*>(ws);
  p.hdr = reinterpret_cast<MoeHeader*>(base);
  p.counts = reinterpret_cast<int32_t*>(base + pl.counts);
  p.ids = reinterpret_cast<int32_t*>(base + pl.ids);
  p.wts = reinterpret_cast<float*>(base + pl.wts);
  p.perm = reinterpret_cast<int32_t*>(base + pl.perm);
  p.chunk_expert = reinterpret_cast<int32_t*>(base + pl.chunk_expert);
  p.chunk_start = reinterpret_cast<int32_t*>(base + pl.chunk_start);
  p.chunk_len = reinterpret_cast<int32_t*>(base + pl.chunk_len);
  p.out = reinterpret_cast<float*>(base + pl.out);
  p.max_chunks = int(pl.max_chunks);
  p.experts_smem = pl.experts_smem;

  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const auto s = static_cast<cudaStream_t>(stream);
  if (const fmlp_status_t st = moe_launch_route(p, s); st != FMLP_SUCCESS) return st;
  if (const fmlp_status_t st = moe_launch_experts(p, s); st != FMLP_SUCCESS) return st;
  return moe_launch_combine(p, s);
}

const MoeKernel kCudaMoeKernels[] = {
    {"moe_sm80_chunked", FMLP_BACKEND_CUDA, moe_cuda_supports, moe_cuda_workspace, moe_cuda_run},
};

}  // namespace

MoeKernelList cuda_moe_kernels() {
  return {kCudaMoeKernels, sizeof(kCudaMoeKernels) / sizeof(kCudaMoeKernels[0])};
}

fmlp_status_t cuda_moe_device_errors(void* workspace, void* stream, int32_t* count) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, workspace) != cudaSuccess ||
      attr.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return fail(FMLP_ERROR_INVALID_VALUE,
                "workspace is not device memory; pass the workspace of a cuda fmlp_moe call");
  }
  const DeviceScope scope(attr.device);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const auto s = static_cast<cudaStream_t>(stream);
  int32_t host = 0;
  cudaError_t e = cudaMemcpyAsync(&host, workspace, sizeof host, cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaMemsetAsync(workspace, 0, sizeof host, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA,
                "reading the moe error count failed: {} (it synchronises the stream: call it "
                "outside graph capture)",
                cudaGetErrorString(e));
  }
  *count = host;
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
