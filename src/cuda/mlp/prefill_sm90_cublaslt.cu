// mlp_prefill_sm90_cublaslt: the mlp op for many tokens as two cuBLASLt GEMMs around small
// memory-bound kernels (pre-norm, bias + activation (+ gate product)). At large M the GEMMs are
// compute bound and the tensor-core GEMMs of cuBLASLt are the floor; what this path adds is
// keeping the passes over the [M, hidden] intermediate to one write and one read of it. fp8 e4m3
// weights run as W8A8 in prefill_sm90_cublaslt_fp8.cu (the entry points below hand them over).
//
// Per pass of `chunk` tokens (chunks bound the workspace; at 128 MiB of hidden per pass the GEMMs
// still fill the GPU many times over):
//   1. (norm) xn = norm(x) in the activation dtype                     prefill_norm
//   2. G = xn W1^T: one GEMM over the stacked [2*hidden, d_in] weights when gated (the packed
//      layout and stacked views give it), the tanh-GELU + bias epilogue when dense gelu_tanh
//   3. h = act(G_gate + bg) * (G_up + bu) (gated) or act(G + b1) (dense, unless fused in 2),
//      written in place over the gate half, rounded to the activation dtype as PyTorch does
//   4. y = h W2^T + b2 (+ residual as C with beta = 1; in place when residual is y)
// With FMLP_PREFILL_WGMMA=1, gated 16-bit requests on sm_90a replace 2 and 3 with one kernel
// (sm90/gemm_gated.cu: wgmma, the bias + activation + gate product in its epilogue) writing h
// straight into the gate half of G. Off by default: it is not faster than cuBLASLt's GEMM plus
// the bias/activation pass (llama3-8b at M = 256 and 4096; fusedmlp_cuda_bench_prefill with
// FMLP_PREFILL_WGMMA=0/1, docs/prefill.md).
// Everything the passes write lies in the workspace's scratch part (core/op_table.hpp): the path
// counts in nothing, so it leaves nothing to clear (fusedmlp.h, the workspace contract).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/common/common.cuh"
#include "cuda/common/device.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/common/lt_gemm.hpp"
#include "cuda/mlp/entries.hpp"
#include "cuda/mlp/prefill_common.cuh"
#include "cuda/sm90/gemm_gated.cuh"

namespace fmlp::detail {
namespace {

using fmlp::cuda::load_scalar;
using namespace prefill;  // the helpers both prefill paths share

constexpr int kThreads = 256;

// cuBLASLt's GELU epilogue is the tanh form (torch._addmm_activation relies on it for
// gelu(approximate='tanh')), evaluated with a fast tanh: accurate enough for a 16-bit hidden,
// not for fp32's 1e-4 budget. The ReLU epilogue is not used: max(NaN, 0) may drop a NaN that the
// spec (src/ref/activation.hpp) propagates.
bool gelu_in_epilogue(const MlpDesc& d) {
  return !d.gated && d.activation == FMLP_ACT_GELU_TANH && d.act_dtype != FMLP_DTYPE_F32;
}

bool wgmma_enabled() {
  static const bool on = knob_bool<Knob::FMLP_PREFILL_WGMMA>();
  return on;
}

// GEMM1 + bias/activation as gemm_sm90_wgmma_gated: gated, 16-bit, wgmma switched on (the
// kernel's own supports() then checks the device and the pointers of each pass).
bool wgmma_candidate(const MlpDesc& d) {
  return d.gated && d.act_dtype == d.w_dtype &&
         (d.act_dtype == FMLP_DTYPE_BF16 || d.act_dtype == FMLP_DTYPE_F16) && wgmma_enabled();
}

// The gate and up biases (up: the second half of a stacked b1, or b_up), nullptr when absent.
struct GateUpBias {
  const void* bg = nullptr;
  const void* bu = nullptr;
  fmlp_dtype_t bg_t = FMLP_DTYPE_F32, bu_t = FMLP_DTYPE_F32;
};

GateUpBias gate_up_bias(const MlpDesc& d, const fmlp_mlp_weights_t& w) {
  GateUpBias b;
  b.bg_t = b.bu_t = w.b1.dtype;
  if (d.has_b1) b.bg = w.b1.data;
  if (d.gated && d.stacked_gate_up && d.has_b1)
    b.bu = offset(w.b1.data, d.hidden, dtype_size(w.b1.dtype));
  else if (d.has_b_up)
    b.bu = w.b_up.data, b.bu_t = w.b_up.dtype;
  return b;
}

// The fused GEMM1's arguments for one pass of mc tokens (x rows at xin, stride ldx): the gate and
// up rows and biases as prefill_bias_act reads them, h into the gate half of G.
GatedGemmArgs fused_gemm1_args(const MlpDesc& d, const fmlp_mlp_weights_t& w, const void* xin,
                               int64_t ldx, int64_t mc, void* g, int64_t ldg) {
  const int64_t H = d.hidden;
  GatedGemmArgs ga;
  ga.device = d.device_id;
  ga.dtype = d.act_dtype;
  ga.act = d.activation;
  ga.m = mc, ga.k = d.d_in, ga.h = H;
  ga.x = xin, ga.ldx = ldx;
  ga.wg = w.w1.data, ga.ldwg = w.w1.stride[0];
  if (d.stacked_gate_up) {
    ga.wu = offset(w.w1.data, H * w.w1.stride[0], dtype_size(d.w_dtype));
    ga.ldwu = w.w1.stride[0];
  } else {
    ga.wu = w.w_up.data, ga.ldwu = w.w_up.stride[0];
  }
  const GateUpBias b = gate_up_bias(d, w);
  ga.bg = b.bg, ga.bg_t = b.bg_t, ga.bu = b.bu, ga.bu_t = b.bu_t;
  ga.out = g, ga.ldo = ldg;
  return ga;
}

// Byte offsets of the regions from the base of the workspace's scratch part.
struct Layout {
  int64_t chunk = 0;  // tokens per pass
  int64_t ldn = 0;    // row stride of the normalised x (elements); 0 without a norm
  int64_t ldg = 0;    // row stride of G (elements); the hidden h reuses the gate half
  size_t xn = 0, b1 = 0, b2 = 0, g = 0, lt = 0, end = 0;
  size_t lt_offer = 0;  // cuBLASLt workspace bytes offered to the heuristic
};

// Weights of 64 MiB and more offer cuBLASLt no workspace: their GEMMs have tiles enough without
// split-K, and the algorithms that take none were faster there.
// Measured on an H200 (fusedmlp_cuda_bench_prefill, one run, us with 32 MiB / none): llama3-70b
// M = 4 342.9 / 340.6, 16 348.2 / 340.7, 64 377.8 / 363.4, 256 596.2 / 584.6, 4096 8672 / 8541;
// llama3-8b M = 64 109.3 / 102.5, 4096 2240 / 2224; but gpt2-small M = 16 13.3 / 14.1, 64
// 13.9 / 14.5, so small weights keep it.
constexpr int64_t kLtOfferMinWeightBytes = int64_t(64) << 20;

Layout layout(const MlpDesc& d) {
  const int64_t es = int64_t(dtype_size(d.act_dtype));
  Layout l;
  l.ldg = round8(d.gated ? 2 * d.hidden : d.hidden);
  l.ldn = d.norm != FMLP_NORM_NONE ? round8(d.d_in) : 0;
  const int64_t row_bytes = (l.ldg + l.ldn) * es;
  l.chunk = prefill::pass_rows(d.m, row_bytes);
  size_t off = 0;
  l.xn = off;
  off += align_up(size_t(l.chunk * l.ldn * es));
  l.b1 = off;
  off += gelu_in_epilogue(d) && d.has_b1 ? align_up(size_t(d.hidden * es)) : 0;
  l.b2 = off;
  off += d.has_b2 ? align_up(size_t(d.d_out * es)) : 0;
  l.g = off;
  off += align_up(size_t(l.chunk * l.ldg * es));
  l.lt = off;
  l.end = off + kLtWorkspaceBytes;
  const int64_t rows1 = d.gated ? 2 * d.hidden : d.hidden;
  const int64_t wbytes = (rows1 * d.d_in + d.d_out * d.hidden) * int64_t(dtype_size(d.w_dtype));
  l.lt_offer = wbytes >= kLtOfferMinWeightBytes ? 0 : kLtWorkspaceBytes;
  return l;
}

struct NormParams {
  const void* x;
  int64_t ldx;
  void* out;
  int64_t ldo;
  int64_t rows, k;
  const void *gamma, *beta;
  fmlp_dtype_t gamma_t, beta_t;
  fmlp_norm_t norm;
  float eps;
};

// One block per token row: two passes over the row (mean, then the centred variance: no
// cancellation), then the normalised row in the activation dtype.
template <typename T>
__global__ void __launch_bounds__(kThreads) prefill_norm(NormParams p) {
  __shared__ float red[kThreads / 32];
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.ldx;
    T* out = static_cast<T*>(p.out) + row * p.ldo;
    float mean = 0.f;
    if (p.norm == FMLP_NORM_LAYERNORM) {
      float s = 0.f;
      for (int64_t i = threadIdx.x; i < p.k; i += kThreads) s += to_f(x[i]);
      mean = block_reduce<kThreads>(s, red) / float(p.k);
    }
    float s2 = 0.f;
    for (int64_t i = threadIdx.x; i < p.k; i += kThreads) {
      const float c = to_f(x[i]) - mean;
      s2 += c * c;
    }
    const float inv = 1.f / sqrtf(block_reduce<kThreads>(s2, red) / float(p.k) + p.eps);
    for (int64_t i = threadIdx.x; i < p.k; i += kThreads) {
      const float gm = p.gamma ? load_scalar(p.gamma, p.gamma_t, i) : 1.f;
      const float bt = p.beta ? load_scalar(p.beta, p.beta_t, i) : 0.f;
      out[i] = from_f<T>((to_f(x[i]) - mean) * inv * gm + bt);
    }
  }
}

// h = act(gate + bg) * (up + bu) (GATED) or act(g + b1), in place over the gate columns; each
// thread owns eight consecutive columns of one row. VEC: rows and the up half are 16-byte aligned.
template <typename T, bool GATED, bool VEC>
__global__ void __launch_bounds__(kThreads) prefill_bias_act(ActParams p) {
  const int64_t c0 = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * 8;
  if (c0 >= p.cols) return;
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    T* g = static_cast<T*>(p.g) + row * p.ldg;
    const T* u = g + p.up;
    if (VEC && c0 + 8 <= p.cols) {
      Vec8<T> gv = *reinterpret_cast<const Vec8<T>*>(g + c0);
      Vec8<T> uv{};
      if (GATED) uv = *reinterpret_cast<const Vec8<T>*>(u + c0);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        gv.v[e] = from_f<T>(bias_act<GATED>(p, to_f(gv.v[e]), to_f(uv.v[e]), c0 + e));
      *reinterpret_cast<Vec8<T>*>(g + c0) = gv;
    } else {
      for (int64_t j = c0; j < std::min(c0 + 8, p.cols); ++j)
        g[j] = from_f<T>(bias_act<GATED>(p, to_f(g[j]), GATED ? to_f(u[j]) : 0.f, j));
    }
  }
}

// The bias vectors a cuBLASLt epilogue reads, in the output dtype (it takes no other).
template <typename T>
__global__ void prefill_convert(T* d1, const void* s1, fmlp_dtype_t t1, int64_t n1, T* d2,
                                const void* s2, fmlp_dtype_t t2, int64_t n2) {
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n1 + n2;
       i += int64_t(gridDim.x) * kThreads) {
    if (i < n1)
      d1[i] = from_f<T>(load_scalar(s1, t1, i));
    else
      d2[i - n1] = from_f<T>(load_scalar(s2, t2, i - n1));
  }
}

template <typename T>
fmlp_status_t run_passes(const fmlp_mlp_args_t& a, const MlpDesc& d, char* base, const Layout& l,
                         cudaStream_t s) {
  const fmlp_mlp_weights_t& w = a.weights;
  const size_t es = sizeof(T);
  const int64_t H = d.hidden;

  // Epilogue biases in the activation dtype: the caller's vector when it already is, else a copy.
  const bool gelu_epi = gelu_in_epilogue(d);
  const void* b1_lt = gelu_epi && d.has_b1 ? w.b1.data : nullptr;
  const void* b2_lt = d.has_b2 ? w.b2.data : nullptr;
  const bool conv1 = b1_lt && w.b1.dtype != d.act_dtype;
  const bool conv2 = b2_lt && w.b2.dtype != d.act_dtype;
  if (conv1 || conv2) {
    T* d1 = reinterpret_cast<T*>(base + l.b1);
    T* d2 = reinterpret_cast<T*>(base + l.b2);
    const int64_t n1 = conv1 ? H : 0, n2 = conv2 ? d.d_out : 0;
    const int blocks = int(std::min<int64_t>((n1 + n2 + kThreads - 1) / kThreads, 1024));
    prefill_convert<T>
        <<<blocks, kThreads, 0, s>>>(d1, w.b1.data, w.b1.dtype, n1, d2, w.b2.data, w.b2.dtype, n2);
    if (const fmlp_status_t st = launch_status("prefill_convert"); st != FMLP_SUCCESS) return st;
    if (conv1) b1_lt = d1;
    if (conv2) b2_lt = d2;
  }

  T* g = reinterpret_cast<T*>(base + l.g);
  T* xn = reinterpret_cast<T*>(base + l.xn);
  void* lt_ws = base + l.lt;
  auto gemm = [&](LtGemm lg) {
    lg.device = d.device_id;
    lg.dtype = d.act_dtype;
    lg.deterministic = d.deterministic;
    // An algorithm without workspace is the rule for aligned 16-bit GEMMs; the full offer stays
    // the fallback for anything the heuristic answers only with one.
    lg.ws_fallback = kLtWorkspaceBytes;
    size_t used = 0;
    return lt_matmul(lg, lt_ws, l.lt_offer, &used, s);
  };

  for (int64_t r0 = 0; r0 < d.m; r0 += l.chunk) {
    const int64_t mc = std::min(l.chunk, d.m - r0);
    const void* xin = offset(a.x.data, r0 * a.x.stride[0], es);
    int64_t ldx = a.x.stride[0];
    if (d.norm != FMLP_NORM_NONE) {
      NormParams np{xin,
                    ldx,
                    xn,
                    l.ldn,
                    mc,
                    d.d_in,
                    d.has_norm_weight ? w.norm_weight.data : nullptr,
                    d.has_norm_bias ? w.norm_bias.data : nullptr,
                    w.norm_weight.dtype,
                    w.norm_bias.dtype,
                    d.norm,
                    d.norm_eps};
      prefill_norm<T><<<int(std::min<int64_t>(mc, 1 << 30)), kThreads, 0, s>>>(np);
      if (const fmlp_status_t st = launch_status("prefill_norm"); st != FMLP_SUCCESS) return st;
      xin = xn;
      ldx = l.ldn;
    }

    // h = act(x Wg^T + bg) * (x Wu^T + bu) in one kernel, into the gate half of G, where switched
    // on and this pass's pointers allow it.
    bool fused = false;
    if (wgmma_candidate(d)) {
      const GatedGemmArgs ga = fused_gemm1_args(d, w, xin, ldx, mc, g, l.ldg);
      std::string why;
      if (gemm_sm90_gated_supports(ga, &why)) {
        if (const fmlp_status_t st = gemm_sm90_gated_run(ga, s); st != FMLP_SUCCESS) return st;
        fused = true;
      }
    }

    if (!fused) {
      // GEMM1 into G [mc, ldg].
      LtGemm g1;
      g1.n = mc;
      g1.k = d.d_in;
      g1.b = xin;
      g1.ldb = ldx;
      g1.d = g;
      g1.ldd = l.ldg;
      g1.a = w.w1.data;
      g1.lda = w.w1.stride[0];
      g1.m = d.gated && d.stacked_gate_up ? 2 * H : H;
      if (gelu_epi) {
        g1.epilogue = b1_lt ? LtEpilogue::kGeluTanhBias : LtEpilogue::kGeluTanh;
        g1.bias = b1_lt;
      }
      if (const fmlp_status_t st = gemm(g1); st != FMLP_SUCCESS) return st;
      if (d.gated && !d.stacked_gate_up) {
        LtGemm gu = g1;
        gu.a = w.w_up.data;
        gu.lda = w.w_up.stride[0];
        gu.d = g + H;
        if (const fmlp_status_t st = gemm(gu); st != FMLP_SUCCESS) return st;
      }
    }

    // Bias + activation (+ gate product) in place, unless an epilogue did it.
    if (!gelu_epi && !fused) {
      const GateUpBias b = gate_up_bias(d, w);
      const ActParams ap{g, l.ldg, H, mc, H, b.bg, b.bu, b.bg_t, b.bu_t, d.activation};
      const dim3 grid(unsigned((H + 8 * kThreads - 1) / (8 * kThreads)),
                      unsigned(std::min<int64_t>(mc, 65535)));
      if (!d.gated)
        prefill_bias_act<T, false, true><<<grid, kThreads, 0, s>>>(ap);
      else if (H % 8 == 0)
        prefill_bias_act<T, true, true><<<grid, kThreads, 0, s>>>(ap);
      else
        prefill_bias_act<T, true, false><<<grid, kThreads, 0, s>>>(ap);
      if (const fmlp_status_t st = launch_status("prefill_bias_act"); st != FMLP_SUCCESS) return st;
    }

    // GEMM2: y = h W2^T (+ b2) (+ residual).
    LtGemm g2;
    g2.m = d.d_out;
    g2.n = mc;
    g2.k = H;
    g2.a = w.w2.data;
    g2.lda = w.w2.stride[0];
    g2.b = g;
    g2.ldb = l.ldg;
    g2.d = const_cast<char*>(offset(a.y.data, r0 * a.y.stride[0], es));
    g2.ldd = a.y.stride[0];
    if (d.has_residual) {
      g2.c = offset(a.residual.data, r0 * a.residual.stride[0], es);
      g2.ldc = a.residual.stride[0];
    }
    if (b2_lt) {
      g2.epilogue = LtEpilogue::kBias;
      g2.bias = b2_lt;
    }
    if (const fmlp_status_t st = gemm(g2); st != FMLP_SUCCESS) return st;
  }
  return FMLP_SUCCESS;
}

template <typename T>
fmlp_status_t run_typed(const fmlp_mlp_args_t& a, const MlpDesc& d, void* workspace,
                        cudaStream_t s) {
  const Layout l = layout(d);
  return run_passes<T>(a, d, prefill::scratch_base(workspace), l, s);
}

}  // namespace

const char* mlp_prefill_gemm1_note(const MlpDesc& d) {
  if (!d.gated || d.w_dtype == FMLP_DTYPE_F8_E4M3) return "";
  if (wgmma_candidate(d) && d.weights_vec16 && d.d_in % 8 == 0 &&
      cuda_compute_capability(d.device_id) == 90)
    return "; GEMM1 + bias + activation + gate product: gemm_sm90_wgmma_gated (one sm_90a "
           "kernel; cuBLASLt + prefill_bias_act when x or its row stride is not 16-byte aligned)";
  return "; GEMM1: cuBLASLt, then prefill_bias_act";
}

bool mlp_prefill_sm90_cublaslt_supports(const MlpDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CUDA) return (*why = "needs CUDA device memory", false);
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3) return mlp_prefill_fp8_supports(d, why);
  if (d.act_dtype != d.w_dtype)
    return (*why = fmt::format(
                "x is {} but the weights are {}: the cuBLASLt GEMMs take one dtype for both; cast "
                "x to {} (what autocast does) or the weights to {} (the decode kernels mix them "
                "for M <= 64)",
                fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype),
                fmlp_dtype_name(d.w_dtype), fmlp_dtype_name(d.act_dtype)),
            false);
  return true;
}

size_t mlp_prefill_sm90_cublaslt_workspace(const MlpDesc& d) {
  // The size query comes before any capture of the run: the place to create the handle. A failure
  // here resurfaces with its message from the run.
  lt_prepare(d.device_id);
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3) return mlp_prefill_fp8_workspace(d);
  return cuda_scratch_workspace_bytes(layout(d).end);
}

fmlp_status_t mlp_prefill_sm90_cublaslt_run(const fmlp_mlp_args_t& a, const MlpDesc& d,
                                            void* workspace, void* stream) {
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3) return mlp_prefill_fp8_run(a, d, workspace, stream);
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  fmlp_status_t st;
  switch (d.act_dtype) {
    case FMLP_DTYPE_F32: st = run_typed<float>(a, d, workspace, s); break;
    case FMLP_DTYPE_F16: st = run_typed<__half>(a, d, workspace, s); break;
    default: st = run_typed<__nv_bfloat16>(a, d, workspace, s); break;
  }
  return st;
}

}  // namespace fmlp::detail
