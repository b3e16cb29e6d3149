// moe_cpu_avx2_grouped: mixture of experts on the host. Tokens are routed in fp64 (the ref routing,
// so both host backends pick the same experts), their (token, expert) slots counting-sorted by
// expert, each expert's rows gathered to fp32 and run through the cpu mlp kernels as one batch,
// then every token's k expert outputs combined in slot order. Slots routed to experts outside the
// local range (expert parallelism) are left out of the groups and add nothing. Nothing depends on
// the thread count, so results are bitwise reproducible.
#include <omp.h>

#include <algorithm>

#include "core/linear_desc.hpp"
#include "core/moe_desc.hpp"
#include "cpu/mlp_common.hpp"

namespace fmlp::detail {
namespace {

size_t align64(size_t n) {
  return (n + 63) / 64 * 64;
}

// The mlp scratch for the largest possible group (every slot on one expert); every cpu mlp
// kernel's workspace grows with m, so this covers each group whichever kernel takes it.
size_t mlp_reserve(const MoeDesc& d) {
  MlpDesc md = d.expert;
  md.m = d.tokens * d.top_k;
  size_t most = 0;
  const MlpKernelList l = cpu_mlp_kernels();
  for (size_t i = 0; i < l.count; ++i) most = std::max(most, l.kernels[i].workspace_bytes(md));
  return most;
}

// Workspace blocks, each 64-byte aligned, in this order.
struct Layout {
  size_t ids, wts, offsets, cursor, order, pos, scores, xg, yg, mlp, total;
};

Layout layout(const MoeDesc& d) {
  const size_t slots = size_t(d.tokens * d.top_k), e = size_t(d.experts);
  Layout l{};
  size_t at = 0;
  const auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align64(bytes);
    return here;
  };
  l.ids = take(slots * sizeof(int32_t));
  l.wts = take(slots * sizeof(float));
  l.offsets = take((e + 1) * sizeof(int64_t));
  l.cursor = take(e * sizeof(int64_t));
  l.order = take(slots * sizeof(int32_t));
  l.pos = take(slots * sizeof(int32_t));
  l.scores = take((size_t(d.global_experts) + size_t(d.top_k)) * sizeof(double));  // + k weights
  l.xg = take(slots * size_t(d.d) * sizeof(float));
  l.yg = take(slots * size_t(d.d_out) * sizeof(float));
  l.mlp = take(mlp_reserve(d));
  l.total = at + 64;  // room to align the base
  return l;
}

bool cpu_supports(const MoeDesc& d, std::string* why) {
  if (d.device != FMLP_DEVICE_CPU) return (*why = "needs host memory", false);
  if (const std::string& isa = cpu_unavailable_reason(); !isa.empty()) return (*why = isa, false);
  return true;
}

size_t cpu_workspace(const MoeDesc& d) {
  return layout(d).total;
}

fmlp_status_t run_experts(const fmlp_moe_args_t& a, const MoeDesc& d, const Layout& l, char* base) {
  const int64_t* off = reinterpret_cast<const int64_t*>(base + l.offsets);
  float* xg = reinterpret_cast<float*>(base + l.xg);
  float* yg = reinterpret_cast<float*>(base + l.yg);
  const size_t reserve = mlp_reserve(d);
  const MlpKernelList kernels = cpu_mlp_kernels();
  const fmlp_mlp_config_t config{d.activation, d.gated ? 1 : 0, FMLP_NORM_NONE, 0.f,
                                 d.deterministic ? 1 : 0};
  for (int64_t e = 0; e < d.experts; ++e) {
    const int64_t g = off[e + 1] - off[e];
    if (g == 0) continue;
    fmlp_mlp_args_t m{};
    m.x = fmlp_tensor_2d(xg + off[e] * d.d, FMLP_DTYPE_F32, g, d.d, d.d);
    m.y = fmlp_tensor_2d(yg + off[e] * d.d_out, FMLP_DTYPE_F32, g, d.d_out, d.d_out);
    m.weights.w1 = expert_slice(a.w1, e);
    m.weights.b1 = expert_slice(a.b1, e);
    m.weights.w2 = expert_slice(a.w2, e);
    m.weights.b2 = expert_slice(a.b2, e);
    m.weights.w1_scale = expert_scale(a.w1_scale, e);
    m.weights.w2_scale = expert_scale(a.w2_scale, e);
    m.config = config;
    MlpDesc md = d.expert;
    md.m = g;
    const MlpKernel* k = nullptr;
    std::string why;
    for (size_t i = 0; i < kernels.count && k == nullptr; ++i)
      if (kernels.kernels[i].supports(md, &why) &&
          kernels.kernels[i].workspace_bytes(md) <= reserve)
        k = &kernels.kernels[i];
    if (k == nullptr)
      return fail(FMLP_ERROR_INTERNAL, "no cpu mlp kernel takes expert {} ({} rows): {}", e, g,
                  why);
    if (const fmlp_status_t s = k->run(m, md, base + l.mlp, nullptr); s != FMLP_SUCCESS) return s;
  }
  return FMLP_SUCCESS;
}

fmlp_status_t cpu_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws, void*) {
  char* base = reinterpret_cast<char*>((uintptr_t(ws) + 63) / 64 * 64);
  const Layout l = layout(d);
  int32_t* ids = reinterpret_cast<int32_t*>(base + l.ids);
  float* wts = reinterpret_cast<float*>(base + l.wts);
  int64_t* off = reinterpret_cast<int64_t*>(base + l.offsets);
  int64_t* cursor = reinterpret_cast<int64_t*>(base + l.cursor);
  int32_t* order = reinterpret_cast<int32_t*>(base + l.order);
  int32_t* pos = reinterpret_cast<int32_t*>(base + l.pos);
  double* scores = reinterpret_cast<double*>(base + l.scores);
  const float* xg = reinterpret_cast<const float*>(base + l.xg);
  const float* yg = reinterpret_cast<const float*>(base + l.yg);
  const int64_t k = d.top_k, slots = d.tokens * k;
  const size_t es = dtype_size(d.act_dtype);

  // Routing costs E*d per token against k*3*hidden*d for the experts: serial fp64 is cheap.
  double* w = scores + d.global_experts;
  for (int64_t t = 0; t < d.tokens; ++t) {
    moe_route_token(a, d, t, scores, ids + t * k, w);
    for (int64_t j = 0; j < k; ++j) {
      wts[t * k + j] = float(w[j]);
      ids[t * k + j] = int32_t(local_expert(d, ids[t * k + j]));  // -1: another range's
    }
  }
  std::fill(off, off + d.experts + 1, 0);
  for (int64_t s = 0; s < slots; ++s)
    if (ids[s] >= 0) ++off[ids[s] + 1];
  for (int64_t e = 0; e < d.experts; ++e) off[e + 1] += off[e];
  std::copy(off, off + d.experts, cursor);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t p = ids[s] >= 0 ? cursor[ids[s]]++ : -1;
    if (p >= 0) order[p] = int32_t(s);
    pos[s] = int32_t(p);
  }
  const int64_t local = off[d.experts];

  const int nt = cpu::thread_count(double(slots) * double(d.d + d.d_out));
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t p = 0; p < local; ++p) {
    const char* x = row_ptr(a.x, order[p] / k, es);
    float* o = const_cast<float*>(xg) + p * d.d;
    for (int64_t c = 0; c < d.d; ++c) o[c] = float(load_as_double(x, d.act_dtype, c));
  }
  if (const fmlp_status_t s = run_experts(a, d, l, base); s != FMLP_SUCCESS) return s;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t t = 0; t < d.tokens; ++t) {
    const char* r = d.has_residual ? row_ptr(a.residual, t, es) : nullptr;
    char* y = const_cast<char*>(row_ptr(a.y, t, es));
    for (int64_t o = 0; o < d.d_out; ++o) {
      float acc = r ? float(load_as_double(r, d.act_dtype, o)) : 0.f;
      for (int64_t j = 0; j < k; ++j)
        if (pos[t * k + j] >= 0) acc += wts[t * k + j] * yg[int64_t(pos[t * k + j]) * d.d_out + o];
      store_from_double(y, d.act_dtype, o, double(acc));
    }
  }
  return FMLP_SUCCESS;
}

const MoeKernel kCpuKernels[] = {
    {"moe_cpu_avx2_grouped", FMLP_BACKEND_CPU, cpu_supports, cpu_workspace, cpu_run},
};

}  // namespace

MoeKernelList cpu_moe_kernels() {
  return {kCpuKernels, 1};
}

}  // namespace fmlp::detail
