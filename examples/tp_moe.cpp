// fusedmlp_tp_moe: the expert-parallel moe on several GPUs, one process per GPU, NCCL unique id
// shared through a file. Mixtral-like layer (d 4096, hidden 14336, 8 experts, top-2, SwiGLU,
// bf16, softmax router). For each T (tokens per rank) three ways of computing the moe of the
// size*T tokens x_all (identical on every rank, from --seed):
//   a2a         fmlp_tp_moe_a2a: rank r holds rows [r*T, (r+1)*T) and its experts; all-to-all
//               dispatch and combine (capacity: --capacity, default no drop)
//   replicated  fmlp_tp_moe: every rank holds all size*T tokens, its experts; one all-reduce
//   single      fmlp_moe of all size*T tokens on rank 0's GPU, every expert there
// Rank 0 checks its a2a and replicated rows against the single-GPU y, then each is timed as a
// CUDA graph of one call, replays queued back to back between events (median). Every call reads
// its experts' weights from HBM (one layer of 8 experts is 2.8 GB, far above the 60 MB L2).
//
//   rm -f /tmp/moe.id
//   fusedmlp_tp_moe --rank 1 --size 2 --id-file /tmp/moe.id --t 1,16,256 &
//   fusedmlp_tp_moe --rank 0 --size 2 --id-file /tmp/moe.id --t 1,16,256 --json out.json
//
// options: --device D (default: rank) --seed S --reps N --capacity C (slots per pair of ranks,
//          clamped to T*k; default: no drop)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.h"
#include "fusedmlp/fusedmlp_nccl.h"

namespace {

using fmlp_bench::device_bf16_2d;
using fmlp_bench::fill_bf16;
using fmlp_bench::graph_us_bracketed;
using fmlp_bench::parse_positive_list;
using fmlp_bench::upload_u16;

constexpr int64_t kD = 4096, kH = 14336, kE = 8, kK = 2;

struct Options : fmlp_bench::RankOptions {
  Options() { reps = 50; }
  int64_t capacity = FMLP_TP_MOE_A2A_NO_DROP;
  std::vector<int64_t> ts{1, 16, 256};
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: fusedmlp_tp_moe --rank R --size N --id-file FILE [--t 1,16,256] "
               "[--capacity C] [--device D] [--seed S] [--reps N] [--json FILE]\n",
               why);
  std::exit(1);
}

Options parse(int argc, char** argv) {
  Options o;
  o.parse(
      argc, argv,
      [&](const std::string& a, const char* v) {
        if (a == "--capacity") {
          o.capacity = std::strtoll(v, nullptr, 10);
        } else if (a == "--t") {
          if (!parse_positive_list(v, &o.ts)) usage("--t takes T,T,... (>= 1)");
        } else {
          return false;
        }
        return true;
      },
      usage);
  return o;
}

void* dev_alloc(size_t bytes) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(bytes, 256)));
  return p;
}

fmlp_tensor_t dev_3d(void* p, int64_t e, int64_t rows, int64_t cols, int device) {
  fmlp_tensor_t t = device_bf16_2d(p, rows, cols, device);
  t.ndim = 3;
  t.shape[0] = e, t.shape[1] = rows, t.shape[2] = cols;
  t.stride[0] = rows * cols, t.stride[1] = cols, t.stride[2] = 1;
  return t;
}

// Experts [first, first + count) uploaded; expert e's values depend on e alone.
void upload_experts(int64_t first, int64_t count, uint64_t seed, void** w1, void** w2) {
  *w1 = dev_alloc(size_t(count * 2 * kH * kD) * 2);
  *w2 = dev_alloc(size_t(count * kD * kH) * 2);
  std::vector<uint16_t> h(size_t(2 * kH * kD));
  for (int64_t i = 0; i < count; ++i) {
    fill_bf16(h, seed * 131 + uint64_t(first + i) * 2, 1.f / std::sqrt(float(kD)));
    CK(cudaMemcpy(static_cast<uint16_t*>(*w1) + i * 2 * kH * kD, h.data(), h.size() * 2,
                  cudaMemcpyHostToDevice));
    std::vector<uint16_t> h2(size_t(kD * kH));
    fill_bf16(h2, seed * 131 + uint64_t(first + i) * 2 + 1, 1.f / std::sqrt(float(kH)));
    CK(cudaMemcpy(static_cast<uint16_t*>(*w2) + i * kD * kH, h2.data(), h2.size() * 2,
                  cudaMemcpyHostToDevice));
  }
}

cudaGraphExec_t capture(cudaStream_t s, const std::function<fmlp_status_t()>& call) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  FK(call());
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphDestroy(g));
  return ge;
}

// Largest |a - ref| / (|ref| + rms(ref)) over the first n values.
double max_rel_err(const void* a, const void* ref, size_t n) {
  std::vector<uint16_t> ha(n), hr(n);
  CK(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hr.data(), ref, n * 2, cudaMemcpyDeviceToHost));
  double ss = 0, worst = 0;
  for (uint16_t v : hr) ss += double(fmlp::bf16_to_float(v)) * fmlp::bf16_to_float(v);
  const double rms = std::sqrt(ss / double(std::max<size_t>(1, n)));
  for (size_t i = 0; i < n; ++i) {
    const double r = fmlp::bf16_to_float(hr[i]), e = std::fabs(fmlp::bf16_to_float(ha[i]) - r);
    const double rel = e / (std::fabs(r) + rms);
    worst = std::isfinite(rel) ? std::max(worst, rel) : INFINITY;
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  fmlp_bench::nccl_nvls_off();
  const bool root = o.rank == 0;
  FK(fmlp_tp_available());
  CK(cudaSetDevice(o.device));
  void* comm = nullptr;
  FK(fmlp_tp_comm_init_from_file(o.id_file.c_str(), o.rank, o.size, o.device, &comm));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, o.device));
  const double bw = fmlp_bench::copy_bandwidth();

  int32_t first = 0, count = 0;
  FK(fmlp_tp_expert_range(int32_t(kE), o.rank, o.size, &first, &count));
  void *w1 = nullptr, *w2 = nullptr, *w1_all = nullptr, *w2_all = nullptr;
  upload_experts(first, count, o.seed, &w1, &w2);
  if (root) upload_experts(0, kE, o.seed, &w1_all, &w2_all);
  std::vector<uint16_t> hr(size_t(kE * kD));
  fill_bf16(hr, o.seed * 7 + 5, 1.f / std::sqrt(float(kD)));
  void* router = upload_u16(hr);
  fmlp_moe_args_t base{};
  base.router_w = device_bf16_2d(router, kE, kD, o.device);
  base.config = fmlp_moe_config_default(int32_t(kE), int32_t(kK));
  base.config.gated = 1;
  fmlp_moe_args_t local = base;  // this rank's experts
  local.w1 = dev_3d(w1, count, 2 * kH, kD, o.device);
  local.w2 = dev_3d(w2, count, kD, kH, o.device);
  local.config.num_experts = count, local.config.first_expert = first;
  local.config.global_experts = int32_t(kE);
  fmlp_moe_args_t whole = base;
  if (root) {
    whole.w1 = dev_3d(w1_all, kE, 2 * kH, kD, o.device);
    whole.w2 = dev_3d(w2_all, kE, kD, kH, o.device);
  }
  const double local_bytes = double(count) * 3.0 * double(kH * kD) * 2;
  if (root)
    std::printf(
        "tp_moe mixtral-like d=%lld hidden=%lld E=%lld top-%lld bf16 swiglu, %d ranks "
        "(%d experts on rank 0), %s, copy bandwidth %.2f TB/s, capacity %s\n",
        (long long)kD, (long long)kH, (long long)kE, (long long)kK, o.size, count, prop.name,
        bw / 1e12,
        o.capacity == FMLP_TP_MOE_A2A_NO_DROP ? "no drop" : std::to_string(o.capacity).c_str());

  int failures = 0;
  std::string rows;
  for (const int64_t T : o.ts) {
    const int64_t all = T * o.size;
    // --capacity is clamped to the no-drop bound of this T (it may not exceed it).
    const int64_t cap =
        o.capacity == FMLP_TP_MOE_A2A_NO_DROP ? o.capacity : std::min(o.capacity, T * kK);
    std::vector<uint16_t> hx(size_t(all * kD));
    fill_bf16(hx, o.seed * 7 + 11 + uint64_t(T), 1.7320508f);  // unit variance, all ranks equal
    void* x_all = upload_u16(hx);
    void* y_rep = dev_alloc(size_t(all * kD) * 2);
    void* y_a2a = dev_alloc(size_t(T * kD) * 2);
    void* y_one = root ? dev_alloc(size_t(all * kD) * 2) : nullptr;
    fmlp_moe_args_t a2a = local, rep = local, one = whole;
    a2a.x = device_bf16_2d(static_cast<uint16_t*>(x_all) + o.rank * T * kD, T, kD, o.device);
    a2a.y = device_bf16_2d(y_a2a, T, kD, o.device);
    rep.x = one.x = device_bf16_2d(x_all, all, kD, o.device);
    rep.y = device_bf16_2d(y_rep, all, kD, o.device);
    one.y = device_bf16_2d(y_one, all, kD, o.device);
    size_t b_a2a = 0, b_rep = 0, b_one = 0;
    FK(fmlp_tp_moe_a2a_workspace_size(&a2a, T, cap, o.rank, o.size, &b_a2a));
    FK(fmlp_tp_moe_workspace_size(&rep, o.rank, &b_rep));
    if (root) FK(fmlp_moe_workspace_size(&one, FMLP_BACKEND_CUDA, &b_one));
    void* ws_a2a = dev_alloc(b_a2a);
    void* ws_rep = dev_alloc(b_rep);
    void* ws_one = root ? dev_alloc(b_one) : nullptr;
    CK(cudaMemset(ws_a2a, 0, std::max<size_t>(b_a2a, 256)));  // zeroed once (the contract)
    CK(cudaMemset(ws_rep, 0, std::max<size_t>(b_rep, 256)));
    if (root) CK(cudaMemset(ws_one, 0, std::max<size_t>(b_one, 256)));
    const auto run_a2a = [&] {
      return fmlp_tp_moe_a2a(&a2a, T, cap, comm, o.rank, o.size, ws_a2a, b_a2a, s);
    };
    const auto run_rep = [&] { return fmlp_tp_moe(&rep, comm, o.rank, o.size, ws_rep, b_rep, s); };
    const auto run_one = [&] { return fmlp_moe(&one, FMLP_BACKEND_CUDA, ws_one, b_one, s); };

    // Correctness (rank 0): its rows of both multi-GPU results against the single-GPU y, both
    // within the accuracy contract (bf16: 2^-7 of |y| + the row's error scale) of the exact one.
    FK(run_a2a());
    FK(run_rep());
    CK(cudaStreamSynchronize(s));
    int32_t dropped = 0;
    FK(fmlp_tp_moe_a2a_dropped(ws_a2a, b_a2a, s, &dropped));
    double err_a2a = 0, err_rep = 0;
    double one_us = 0;
    if (root) {
      FK(run_one());
      CK(cudaStreamSynchronize(s));
      err_a2a = max_rel_err(y_a2a, y_one, size_t(T * kD));
      err_rep = max_rel_err(y_rep, y_one, size_t(all * kD));
      cudaGraphExec_t g1 = capture(s, run_one);  // the other ranks wait in their first exchange
      one_us = graph_us_bracketed(g1, s, o.reps);
      CK(cudaGraphExecDestroy(g1));
    }
    cudaGraphExec_t ga = capture(s, run_a2a);
    const double a2a_us = graph_us_bracketed(ga, s, o.reps);
    CK(cudaGraphExecDestroy(ga));
    cudaGraphExec_t gr = capture(s, run_rep);
    const double rep_us = graph_us_bracketed(gr, s, o.reps);
    CK(cudaGraphExecDestroy(gr));
    CK(cudaGetLastError());
    if (root) {
      // Drops are expected only with a capacity below the bound; then the check is not one.
      const bool ok = err_rep <= 1.0 / 64 && (dropped > 0 || err_a2a <= 1.0 / 64);
      failures += !ok;
      const double floor_us = local_bytes / bw * 1e6;
      std::printf(
          "T=%-4lld per rank (%lld in all): a2a %9.2f us  replicated %9.2f us  single "
          "%9.2f us  a2a/replicated %.3f  a2a/single %.3f  floor(local experts) %.1f us  "
          "dropped %d  check %s (max err a2a %.2e, replicated %.2e of |y|+rms)\n",
          (long long)T, (long long)all, a2a_us, rep_us, one_us, a2a_us / rep_us, a2a_us / one_us,
          floor_us, dropped, ok ? "ok" : "FAIL", err_a2a, err_rep);
      std::fflush(stdout);
      char row[768];
      std::snprintf(row, sizeof row,
                    "%s{\"T_local\": %lld, \"T_all\": %lld, \"a2a_us\": %.3f, "
                    "\"replicated_us\": %.3f, \"single_us\": %.3f, \"a2a_over_replicated\": %.4f, "
                    "\"a2a_over_single\": %.4f, \"local_expert_floor_us\": %.3f, "
                    "\"dropped_rank0\": %d, \"check_ok\": %s, \"max_err_a2a\": %.3e, "
                    "\"max_err_replicated\": %.3e}",
                    rows.empty() ? "" : ", ", (long long)T, (long long)all, a2a_us, rep_us, one_us,
                    a2a_us / rep_us, a2a_us / one_us, floor_us, dropped, ok ? "true" : "false",
                    err_a2a, err_rep);
      rows += row;
    }
    for (void* p : {x_all, y_rep, y_a2a, y_one, ws_a2a, ws_rep, ws_one})
      if (p) CK(cudaFree(p));
  }
  if (root && !o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", o.json.c_str());
      return 2;
    }
    std::fprintf(f,
                 "{\"bench\": \"tp_moe\", \"shape\": \"mixtral\", \"d\": %lld, \"hidden\": %lld, "
                 "\"experts\": %lld, \"top_k\": %lld, \"ranks\": %d, \"capacity\": %lld, "
                 "\"gpu\": \"%s\", \"copy_TBps\": %.3f, \"results\": [%s], \"failures\": %d}\n",
                 (long long)kD, (long long)kH, (long long)kE, (long long)kK, o.size,
                 (long long)o.capacity, prop.name, bw / 1e12, rows.c_str(), failures);
    std::fclose(f);
  }
  for (void* p : {w1, w2, w1_all, w2_all, router})
    if (p) CK(cudaFree(p));
  FK(fmlp_tp_comm_destroy(comm));
  CK(cudaStreamDestroy(s));
  return failures == 0 ? 0 : 4;
}
