// The host and device buffers of one mlp problem for the cuda benchmarks (fusedmlp_cuda_bench,
// fusedmlp_decode_suite_bench): random data of model scale, the op's arguments over them, a
// runner (dispatch, a named op-table entry or packed weights) and the check of output rows
// against backend ref.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bench_common.hpp"
#include "fusedmlp/fusedmlp.h"

namespace fmlp_bench {

inline size_t esize(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_F32 ? 4 : t == FMLP_DTYPE_F8_E4M3 ? 1 : 2;
}

inline float bf16_to_f(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float f16_to_f(uint16_t h) {
  const uint32_t s = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  uint32_t u;
  if (e == 0x1f)
    u = s | 0x7f800000u | (m << 13);
  else if (e)
    u = s | ((e + 112) << 23) | (m << 13);
  else {
    const float v = std::ldexp(float(m), -24);
    return s ? -v : v;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f_to_f16(float f) {  // round to nearest even, enough for test data
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u;
  if (a < 0x38800000u) {
    float v;
    std::memcpy(&v, &a, 4);
    return uint16_t(sign | uint16_t(std::nearbyint(v * 16777216.0f)));
  }
  const uint32_t m = a + 0xfffu + ((a >> 13) & 1u);
  return uint16_t(sign | uint16_t(((m >> 13) - (112u << 10)) & 0x7fffu));
}

inline float get(const std::vector<uint8_t>& b, fmlp_dtype_t t, size_t i) {
  if (t == FMLP_DTYPE_F32) {
    float f;
    std::memcpy(&f, b.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, b.data() + 2 * i, 2);
  return t == FMLP_DTYPE_BF16 ? bf16_to_f(h) : f16_to_f(h);
}
inline void put(std::vector<uint8_t>& b, fmlp_dtype_t t, size_t i, float v) {
  if (t == FMLP_DTYPE_F32) {
    std::memcpy(b.data() + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = t == FMLP_DTYPE_BF16 ? f_to_bf16(v) : f_to_f16(v);
  std::memcpy(b.data() + 2 * i, &h, 2);
}

// Uniform values of the given width centred on 0, xorshift64 seeded from one mt19937 draw: cheap
// enough for a gigabyte of weights.
struct Uniform {
  uint64_t z;
  float k;
  Uniform(std::mt19937& rng, float width)
      : z(rng() | (uint64_t(rng()) << 32) | 1), k(width / 4294967296.f) {}
  float operator()() {
    z ^= z << 13;
    z ^= z >> 7;
    z ^= z << 17;
    return (float(uint32_t(z >> 32)) - 2147483648.f) * k;
  }
};

// A host buffer of random values and its device twin (same bytes, same offsets).
struct Buf {
  fmlp_dtype_t t = FMLP_DTYPE_BF16;
  size_t n = 0, off = 0;  // elements, element offset of the view (misalignment)
  std::vector<uint8_t> host;
  void* dev = nullptr;
  void alloc(fmlp_dtype_t dt, size_t count, size_t offset = 0) {
    t = dt;
    n = count;
    off = offset;
    host.assign((count + offset) * esize(dt), 0);
    CK(cudaMalloc(&dev, host.size() + 256));
  }
  // Uniform with unit variance.
  void fill(std::mt19937& rng, float scale) {
    Uniform u(rng, scale * 3.4641016f);  // width sqrt(12)
    for (size_t i = 0; i < n + off; ++i) put(host, t, i, u());
  }
  void upload() { CK(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice)); }
  void download() { CK(cudaMemcpy(host.data(), dev, host.size(), cudaMemcpyDeviceToHost)); }
  void* hptr() { return host.data() + off * esize(t); }
  void* dptr() const { return static_cast<char*>(dev) + off * esize(t); }
  void release() {
    if (dev) cudaFree(dev);
    dev = nullptr;
  }
};

inline fmlp_tensor_t view2(void* p, fmlp_dtype_t t, int64_t r, int64_t c, int64_t ld, bool device) {
  fmlp_tensor_t v = fmlp_tensor_2d(p, t, r, c, ld);
  if (device) v.device_type = FMLP_DEVICE_CUDA;
  return v;
}
inline fmlp_tensor_t view1(void* p, fmlp_dtype_t t, int64_t n, bool device) {
  fmlp_tensor_t v = fmlp_tensor_1d(p, t, n);
  if (device) v.device_type = FMLP_DEVICE_CUDA;
  return v;
}

struct Problem {
  int64_t m, d, h, n;
  fmlp_dtype_t at, wt, bt;
  fmlp_activation_t act;
  fmlp_norm_t norm;
  bool gated, separate_up, bias, residual, inplace, packed, deterministic;
  int64_t pad;  // extra elements per row (strided views) and base offset (misalignment)
};

// Owns every tensor of one problem on host and device.
struct Case {
  Problem p;
  Buf x, y, res, w1, wu, w2, b1, bu, b2, gam, bet;
  Buf s1, s2;  // fp8 weights: per-row scales of w1 and w2
  int64_t ld_x, ld_y, ld_w1, ld_w2;
  void make(const Problem& pr, std::mt19937& rng) {
    p = pr;
    const int64_t rows1 = p.gated && !p.separate_up ? 2 * p.h : p.h;
    ld_x = p.d + p.pad;
    ld_y = p.n + p.pad;
    ld_w1 = p.d + p.pad;
    ld_w2 = p.h + p.pad;
    x.alloc(p.at, size_t(p.m * ld_x), size_t(p.pad));
    x.fill(rng, 1.f);
    y.alloc(p.at, size_t(p.m * ld_y), size_t(p.pad));
    if (p.residual && !p.inplace) {
      res.alloc(p.at, size_t(p.m * ld_y), size_t(p.pad));
      res.fill(rng, 1.f);
    }
    w1.alloc(p.wt, size_t(rows1 * ld_w1), size_t(p.pad));
    if (p.wt != FMLP_DTYPE_F8_E4M3) w1.fill(rng, 1.f / std::sqrt(float(p.d)));
    if (p.wt == FMLP_DTYPE_F8_E4M3) {  // model-scale weights quantised per row, as served
      quantize(w1, s1, rows1, p.d, ld_w1, 1.f / std::sqrt(float(p.d)), rng);
      quantize(w2, s2, p.n, p.h, ld_w2, 1.f / std::sqrt(float(p.h)), rng, true);
    }
    if (p.gated && p.separate_up) {
      wu.alloc(p.wt, size_t(p.h * ld_w1), size_t(p.pad));
      wu.fill(rng, 1.f / std::sqrt(float(p.d)));
    }
    if (p.wt != FMLP_DTYPE_F8_E4M3) {
      w2.alloc(p.wt, size_t(p.n * ld_w2), size_t(p.pad));
      w2.fill(rng, 1.f / std::sqrt(float(p.h)));
    }
    if (p.bias) {
      b1.alloc(p.bt, size_t(rows1));
      b1.fill(rng, 0.5f);
      if (p.gated && p.separate_up) {
        bu.alloc(p.bt, size_t(p.h));
        bu.fill(rng, 0.5f);
      }
      b2.alloc(p.bt, size_t(p.n));
      b2.fill(rng, 0.5f);
    }
    if (p.norm != FMLP_NORM_NONE) {
      gam.alloc(p.bt, size_t(p.d));
      gam.fill(rng, 1.f);
      if (p.norm == FMLP_NORM_LAYERNORM) {
        bet.alloc(p.bt, size_t(p.d));
        bet.fill(rng, 0.3f);
      }
    }
    if (p.inplace) y.fill(rng, 1.f);  // y holds the residual
    for (Buf* b : {&x, &y, &res, &w1, &wu, &w2, &b1, &bu, &b2, &gam, &bet, &s1, &s2})
      if (b->dev) b->upload();
  }
  // q (fp8 [rows, cols], row stride ld) and per-row scales from fp32 weights ~ bound * U(-1, 1),
  // through the library's quantiser. Matrices of 16 M elements and more are made once and reused
  // for every M of a shape: drawing (mt19937) and quantising llama3-70b's 705 M weights for each M
  // made most of the 30-55 s its table rows took on the GPU machine.
  static void quantize(Buf& q, Buf& scale, int64_t rows, int64_t cols, int64_t ld, float bound,
                       std::mt19937& rng, bool alloc = false) {
    if (alloc) q.alloc(FMLP_DTYPE_F8_E4M3, size_t(rows * ld));
    scale.alloc(FMLP_DTYPE_F32, size_t(rows));
    struct Made {
      std::vector<uint8_t> q, scale;
    };
    static std::map<std::tuple<int64_t, int64_t, int64_t, float, size_t>, Made> made;
    const auto key = std::make_tuple(rows, cols, ld, bound, q.host.size());
    const bool reuse = rows * ld >= (int64_t(16) << 20);
    if (reuse) {
      if (const auto it = made.find(key); it != made.end()) {
        q.host = it->second.q;
        scale.host = it->second.scale;
        return;
      }
    }
    std::vector<float> w(size_t(rows * ld));
    Uniform u(rng, 2.f * bound);
    for (float& v : w) v = u();
    const fmlp_tensor_t wv = fmlp_tensor_2d(w.data(), FMLP_DTYPE_F32, rows, cols, ld);
    const fmlp_tensor_t qv = fmlp_tensor_2d(q.hptr(), FMLP_DTYPE_F8_E4M3, rows, cols, ld);
    const fmlp_tensor_t sv = fmlp_tensor_1d(scale.hptr(), FMLP_DTYPE_F32, rows);
    FK(fmlp_quantize_fp8(&wv, &qv, &sv, nullptr));
    if (reuse) made[key] = Made{q.host, scale.host};
  }
  fmlp_mlp_args_t args(bool device, int64_t rows = -1, int64_t row0 = 0) {
    const int64_t m = rows < 0 ? p.m : rows;
    auto P = [&](Buf& b, int64_t elem) -> void* {
      return device ? static_cast<char*>(b.dptr()) + elem * esize(b.t)
                    : static_cast<char*>(b.hptr()) + elem * esize(b.t);
    };
    fmlp_mlp_args_t a{};
    const int64_t rows1 = p.gated && !p.separate_up ? 2 * p.h : p.h;
    a.x = view2(P(x, row0 * ld_x), p.at, m, p.d, ld_x, device);
    a.y = view2(P(y, row0 * ld_y), p.at, m, p.n, ld_y, device);
    a.residual = fmlp_tensor_none();
    if (p.residual)
      a.residual = p.inplace ? a.y : view2(P(res, row0 * ld_y), p.at, m, p.n, ld_y, device);
    fmlp_mlp_weights_t& w = a.weights;
    for (fmlp_tensor_t* t : {&w.w1, &w.w1_scale, &w.b1, &w.w_up, &w.w_up_scale, &w.b_up, &w.w2,
                             &w.w2_scale, &w.b2, &w.norm_weight, &w.norm_bias})
      *t = fmlp_tensor_none();
    w.w1 = view2(P(w1, 0), p.wt, rows1, p.d, ld_w1, device);
    if (p.gated && p.separate_up) w.w_up = view2(P(wu, 0), p.wt, p.h, p.d, ld_w1, device);
    w.w2 = view2(P(w2, 0), p.wt, p.n, p.h, ld_w2, device);
    if (p.wt == FMLP_DTYPE_F8_E4M3) {
      w.w1_scale = view1(P(s1, 0), FMLP_DTYPE_F32, rows1, device);
      w.w2_scale = view1(P(s2, 0), FMLP_DTYPE_F32, p.n, device);
    }
    if (p.bias) {
      w.b1 = view1(P(b1, 0), p.bt, rows1, device);
      if (p.gated && p.separate_up) w.b_up = view1(P(bu, 0), p.bt, p.h, device);
      w.b2 = view1(P(b2, 0), p.bt, p.n, device);
    }
    if (p.norm != FMLP_NORM_NONE) w.norm_weight = view1(P(gam, 0), p.bt, p.d, device);
    if (p.norm == FMLP_NORM_LAYERNORM) w.norm_bias = view1(P(bet, 0), p.bt, p.d, device);
    a.config = fmlp_mlp_config_default();
    a.config.activation = p.act;
    a.config.gated = p.gated;
    a.config.norm = p.norm;
    a.config.norm_eps = 1e-5f;
    a.config.deterministic = p.deterministic;
    return a;
  }
  void release() {
    for (Buf* b : {&x, &y, &res, &w1, &wu, &w2, &b1, &bu, &b2, &gam, &bet, &s1, &s2}) b->release();
  }
};

// Runs the cuda op (packed or not) on the whole batch.
struct Runner {
  const char* kernel = nullptr;  // an op-table entry to force, or nullptr: dispatch
  bool pack = false;             // dispatch on packed weights (fmlp_mlp_pack), as users run
  fmlp_mlp_packed_t* packed = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  void setup(Case& c) {
    fmlp_mlp_args_t a = c.args(true);
    if (c.p.packed || (pack && kernel == nullptr)) {
      FK(fmlp_mlp_pack(&packed, &a.weights, &a.config, FMLP_BACKEND_CUDA, nullptr));
      FK(fmlp_mlp_packed_workspace_size(packed, &a.y, &a.x, &ws_bytes));
    } else if (kernel) {
      FK(fmlp_mlp_kernel_workspace_size(&a, kernel, &ws_bytes));
    } else {
      FK(fmlp_mlp_workspace_size(&a, FMLP_BACKEND_CUDA, &ws_bytes));
    }
    if (ws_bytes) {
      CK(cudaMalloc(&ws, ws_bytes));
      CK(cudaMemset(ws, 0, ws_bytes));  // once: the kernel leaves it zeroed after every call
    }
  }
  fmlp_status_t run(Case& c, cudaStream_t s) {
    fmlp_mlp_args_t a = c.args(true);
    if (packed)
      return fmlp_mlp_packed_run(packed, &a.y, &a.x, c.p.residual ? &a.residual : nullptr, ws,
                                 ws_bytes, s);
    if (kernel) return fmlp_mlp_with_kernel(&a, kernel, ws, ws_bytes, s);
    return fmlp_mlp(&a, FMLP_BACKEND_CUDA, ws, ws_bytes, s);
  }
  void release() {
    if (packed) fmlp_mlp_packed_destroy(packed);
    if (ws) cudaFree(ws);
    packed = nullptr;
    ws = nullptr;
  }
};

// Compares device y rows [row0, row0+rows) with ref computed on host; returns worst error in
// units of the output dtype's rounding at |ref| (fp32: relative error / 1e-6).
struct CheckResult {
  double worst_units = 0;
  bool ok = true;
  std::string detail;
};

// The kernel a run of c takes: `forced`, else the planner's choice.
inline std::string ran_kernel(Case& c, const char* forced) {
  return forced ? forced : chosen_kernel(fmlp_mlp_explain, c.args(true));
}

// Whether a run with `wt` weights on `kernel` is W8A8 (the fp8 prefill path).
inline bool is_w8a8(fmlp_dtype_t wt, const std::string& kernel) {
  return wt == FMLP_DTYPE_F8_E4M3 && kernel == "mlp_prefill_sm90_cublaslt";
}

// w8a8: the run took the fp8 prefill path, which quantises the activations by design and is held
// to tests/tolerance.hpp's W8A8 budget (per element 1/4 of |ref| + rms, rms of those <= 1/32).
inline CheckResult check_rows(Case& c, const std::vector<uint8_t>& y_before, int64_t row0,
                              int64_t rows, bool w8a8) {
  // ref on host: y_host holds the residual for in-place, as the device saw it.
  Buf& yb = c.y;
  std::vector<uint8_t> dev_y = yb.host;  // downloaded device result
  yb.host = y_before;
  fmlp_mlp_args_t a = c.args(false, rows, row0);
  a.config.deterministic = 0;
  std::vector<double> dummy;
  size_t ws = 0;
  FK(fmlp_mlp_workspace_size(&a, FMLP_BACKEND_REF, &ws));
  std::vector<uint8_t> wsb(ws + 64);
  FK(fmlp_mlp(&a, FMLP_BACKEND_REF, wsb.data(), ws, nullptr));
  std::vector<uint8_t> ref_y = yb.host;
  yb.host = dev_y;
  CheckResult r;
  const fmlp_dtype_t t = c.p.at;
  double worst_rel = 0, sq_rel = 0;
  int64_t n_rel = 0;
  for (int64_t i = row0; i < row0 + rows; ++i) {
    double rms = 0;
    for (int64_t o = 0; o < c.p.n; ++o) {
      const double v = get(ref_y, t, size_t(yb.off + i * c.ld_y + o));
      rms += v * v;
    }
    rms = std::sqrt(rms / double(c.p.n));
    for (int64_t o = 0; o < c.p.n; ++o) {
      const size_t idx = size_t(yb.off + i * c.ld_y + o);
      const double ref = get(ref_y, t, idx), got = get(dev_y, t, idx);
      if (std::isnan(ref) != std::isnan(got)) {
        r.ok = false;
        r.detail = "NaN mismatch at row " + std::to_string(i) + " col " + std::to_string(o);
        return r;
      }
      if (std::isnan(ref)) continue;
      // units of the output dtype at |ref| + the row's rms: the rounding errors of the sums
      // (and of a 16-bit hidden, as PyTorch rounds it) scale with their terms, about the rms
      // for random data, not with the result (tests/tolerance.hpp states the same model)
      const double scale = std::fabs(ref) + (t == FMLP_DTYPE_F32 ? 0.1 : 1.0) * rms;
      const double unit = t == FMLP_DTYPE_F32    ? 1e-6 * scale
                          : t == FMLP_DTYPE_BF16 ? std::ldexp(1.0, -8) * scale
                                                 : std::ldexp(1.0, -11) * scale;
      const double u = std::fabs(got - ref) / unit;
      if (scale > 0) {
        const double rel = std::fabs(got - ref) / scale;
        worst_rel = std::max(worst_rel, rel);
        sq_rel += rel * rel;
        ++n_rel;
      }
      if (u > r.worst_units) {
        r.worst_units = u;
        char buf[160];
        std::snprintf(buf, sizeof buf, "row %lld col %lld got %.6g ref %.6g", (long long)i,
                      (long long)o, got, ref);
        r.detail = buf;
      }
    }
  }
  // fp32: 1e-4 relative. 16-bit: 4 units of (|ref| + rms) = 2^-6: the gated cuBLASLt path rounds
  // gate, up and h to 16 bits as PyTorch does (three roundings, each up to 2^-9 relative, over
  // tens of thousands of terms); tests/tolerance.hpp states the exact per-element contract.
  const double limit = t == FMLP_DTYPE_F32 ? 100.0 : 4.0;
  r.ok = r.worst_units <= limit;
  if (w8a8) {
    const double rms_rel = n_rel ? std::sqrt(sq_rel / double(n_rel)) : 0.0;
    r.ok = worst_rel <= 0.25 && rms_rel <= 1.0 / 32;
    r.detail += " (W8A8 budget: rms " + std::to_string(rms_rel) + ")";
  }
  return r;
}

}  // namespace fmlp_bench
