// fusedmlp_tp_mlp: the tensor-parallel mlp, one process per GPU, NCCL unique id shared through a
// file (no MPI). Every rank builds the same random full weights from --seed, keeps its shard
// (fmlp_tp_shard_weights + fmlp_mlp_pack), runs fmlp_tp_mlp_packed (fused op + all-reduce) and
// rank 0 checks the all-reduced y against the single-GPU op on the full weights, then both are
// timed: CUDA-graph replay (the all-reduce inside the graph), graphs queued back to back and timed
// between consecutive events (no host skew between the ranks), median, weight copies rotated over
// > 3x the L2 so every call reads HBM.
//
//   rm -f /tmp/tp.id
//   fusedmlp_tp_mlp --rank 0 --size 2 --id-file /tmp/tp.id --shape llama3-70b --m 1,4096 &
//   fusedmlp_tp_mlp --rank 1 --size 2 --id-file /tmp/tp.id --shape llama3-70b --m 1,4096
//
// options: --device D (default: rank) --seed S --reps N --json FILE (rank 0 writes it)
//          --reduce all|scatter
//          --allreduce both|p2p|nccl: time the all-reduce through the one-shot p2p kernel (the
//          communicator's default registration), through NCCL (registration dropped), or both in
//          the same run (default); each row names the all-reduce its message actually took.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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

struct Shape {
  const char* name;
  int64_t d, h;
};
// Gated SwiGLU FFNs, bf16 (the shapes of bench/mlp_cuda_bench.cpp).
const Shape kShapes[] = {{"llama3-70b", 8192, 28672},
                         {"llama3-8b", 4096, 14336},
                         {"mixtral", 4096, 14336},
                         {"tiny", 512, 2048}};

struct Options : fmlp_bench::RankOptions {
  std::string shape = "llama3-70b";
  std::vector<int64_t> ms{1};
  fmlp_tp_reduce_t reduce = FMLP_TP_ALL_REDUCE;
  std::vector<bool> p2p{true, false};  // the all-reduce modes timed, in order
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: fusedmlp_tp_mlp --rank R --size N --id-file FILE [--shape NAME] "
               "[--m 1,4096] [--device D] [--seed S] [--reps N] [--json FILE] "
               "[--reduce all|scatter] [--allreduce both|p2p|nccl]\n",
               why);
  std::exit(1);
}

Options parse(int argc, char** argv) {
  Options o;
  o.parse(
      argc, argv,
      [&](const std::string& a, const char* v) {
        if (a == "--shape") {
          o.shape = v;
        } else if (a == "--reduce") {
          o.reduce = std::string(v) == "scatter" ? FMLP_TP_REDUCE_SCATTER : FMLP_TP_ALL_REDUCE;
        } else if (a == "--allreduce") {
          const std::string m = v;
          if (m != "both" && m != "p2p" && m != "nccl")
            usage("--allreduce takes both, p2p or nccl");
          o.p2p = m == "both" ? std::vector<bool>{true, false} : std::vector<bool>{m == "p2p"};
        } else if (a == "--m") {
          if (!parse_positive_list(v, &o.ms)) usage("--m takes M,M,... (>= 1)");
        } else {
          return false;
        }
        return true;
      },
      usage);
  return o;
}

// Rows of y each rank holds after the reduction.
int64_t my_rows(const Options& o, int64_t m) {
  return o.reduce == FMLP_TP_ALL_REDUCE ? m : m / o.size;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  fmlp_bench::nccl_nvls_off();
  const Shape* sh = nullptr;
  for (const Shape& s : kShapes)
    if (o.shape == s.name) sh = &s;
  if (sh == nullptr) usage(("unknown --shape " + o.shape).c_str());
  const int64_t d = sh->d, H = sh->h, hs = H / o.size;
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

  // Full weights, identical on every rank: W1 = [gate; up] stacked [2H, d], W2 [d, H].
  std::vector<uint16_t> hw1(size_t(2 * H * d)), hw2(size_t(d * H));
  fill_bf16(hw1, o.seed * 3 + 1, 1.f / std::sqrt(float(d)));
  fill_bf16(hw2, o.seed * 3 + 2, 1.f / std::sqrt(float(H)));
  void* dw1 = upload_u16(hw1);
  void* dw2 = upload_u16(hw2);
  hw1 = {};
  hw2 = {};
  fmlp_mlp_weights_t full{};
  full.w1 = device_bf16_2d(dw1, 2 * H, d, o.device);
  full.w2 = device_bf16_2d(dw2, d, H, o.device);
  fmlp_mlp_config_t cfg = fmlp_mlp_config_default();
  cfg.activation = FMLP_ACT_SILU;
  cfg.gated = 1;
  fmlp_mlp_weights_t shard{};
  FK(fmlp_tp_shard_weights(&full, &cfg, o.rank, o.size, &shard));

  // Copies so that one graph's calls stream > 3x the L2 of distinct weights.
  const double shard_bytes = 3.0 * double(hs * d) * 2, full_bytes = 3.0 * double(H * d) * 2;
  const int copies = std::max(2, int(std::ceil(3.0 * prop.l2CacheSize / shard_bytes)));
  std::vector<fmlp_mlp_packed_t*> ps(size_t(copies), nullptr), pf;
  for (fmlp_mlp_packed_t*& p : ps) FK(fmlp_mlp_pack(&p, &shard, &cfg, FMLP_BACKEND_CUDA, s));
  const int full_copies = std::max(2, int(std::ceil(3.0 * prop.l2CacheSize / full_bytes)));
  if (root) {
    pf.resize(size_t(full_copies), nullptr);
    for (fmlp_mlp_packed_t*& p : pf) FK(fmlp_mlp_pack(&p, &full, &cfg, FMLP_BACKEND_CUDA, s));
  }
  CK(cudaStreamSynchronize(s));
  CK(cudaFree(dw1));
  CK(cudaFree(dw2));
  if (root)
    std::printf(
        "tp_mlp %s d=%lld hidden=%lld (%lld per rank) bf16 swiglu, %d ranks, %s, %s, "
        "copy bandwidth %.2f TB/s, weight copies %d (tp) / %d (single)\n",
        sh->name, (long long)d, (long long)H, (long long)hs, o.size, prop.name,
        o.reduce == FMLP_TP_ALL_REDUCE ? "all-reduce" : "reduce-scatter", bw / 1e12, copies,
        full_copies);

  int failures = 0;
  std::string rows;
  for (const int64_t m : o.ms) {
    if (o.reduce == FMLP_TP_REDUCE_SCATTER && m % o.size != 0) {
      if (root) std::printf("M=%lld skipped: reduce-scatter needs M %% size == 0\n", (long long)m);
      continue;
    }
    const int nx = std::max(copies, full_copies);
    std::vector<uint16_t> hx(size_t(m * d));
    fill_bf16(hx, o.seed * 3 + 3 + uint64_t(m), 1.7320508f);  // unit variance
    std::vector<void*> xs(static_cast<size_t>(nx)), ys(static_cast<size_t>(nx));
    std::vector<fmlp_tensor_t> xv(static_cast<size_t>(nx)), yv(static_cast<size_t>(nx));
    for (int i = 0; i < nx; ++i) {
      xs[size_t(i)] = upload_u16(hx);
      CK(cudaMalloc(&ys[size_t(i)], size_t(m * d) * 2));
      xv[size_t(i)] = device_bf16_2d(xs[size_t(i)], m, d, o.device);
      yv[size_t(i)] = device_bf16_2d(ys[size_t(i)], m, d, o.device);
    }
    size_t ws_bytes = 0, b = 0;
    FK(fmlp_mlp_packed_workspace_size(ps[0], &yv[0], &xv[0], &ws_bytes));
    if (root) {
      FK(fmlp_mlp_packed_workspace_size(pf[0], &yv[0], &xv[0], &b));
      ws_bytes = std::max(ws_bytes, b);
    }
    void* ws = nullptr;
    CK(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 256)));
    CK(cudaMemset(ws, 0, std::max<size_t>(ws_bytes, 256)));  // the workspace contract: zeroed once

    // The single-GPU y (rank 0), kept on the host: the timed graphs overwrite every y.
    const int64_t rows_here = my_rows(o, m);  // rank 0's rows are the first ones either way
    const size_t n = size_t(rows_here * d);
    std::vector<uint16_t> ref(root ? n : 0);
    double rms = 0;
    if (root) {
      FK(fmlp_mlp_packed_run(pf[0], &yv[1], &xv[0], nullptr, ws, ws_bytes, s));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(ref.data(), ys[1], n * 2, cudaMemcpyDeviceToHost));
      double ss = 0;
      for (uint16_t v : ref) ss += double(fmlp::bf16_to_float(v)) * fmlp::bf16_to_float(v);
      rms = std::sqrt(ss / double(n));
    }
    double one_us = 0, shard_us = 0;
    for (size_t mode = 0; mode < o.p2p.size(); ++mode) {
      // Every rank switches at the same point: (un)registering is collective.
      if (o.p2p[mode])
        FK(fmlp_tp_p2p_init(comm, o.rank, o.size, FMLP_TP_P2P_DEFAULT_MAX_BYTES));
      else
        FK(fmlp_tp_p2p_destroy(comm));
      size_t cap = 0;
      const char* about_c = "";
      FK(fmlp_tp_p2p_query(comm, &cap, &about_c));
      const std::string about = about_c;
      const bool used_p2p = o.reduce == FMLP_TP_ALL_REDUCE && size_t(m * d) * 2 <= cap;
      const char* path = used_p2p ? "p2p" : "nccl";

      // Correctness on rank 0: the tensor-parallel y (ys[0]) against the single-GPU one.
      double max_err = 0;
      bool ok = true;
      FK(fmlp_tp_mlp_packed(ps[0], &yv[0], &xv[0], nullptr, comm, o.rank, o.size, o.reduce, ws,
                            ws_bytes, s));
      CK(cudaStreamSynchronize(s));
      if (root) {
        // Both outputs are within the accuracy contract (tests/tolerance.hpp, bf16: 2^-7 of |y|
        // + the row's error scale, about its rms) of the exact result, so they differ by at most
        // twice that: 2^-6 of |y| + rms(y).
        std::vector<uint16_t> a(n);
        CK(cudaMemcpy(a.data(), ys[0], n * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; ++i) {
          const double r = fmlp::bf16_to_float(ref[i]), got = fmlp::bf16_to_float(a[i]);
          const double err = std::fabs(got - r) / (std::fabs(r) + rms);
          if (!(err <= 1.0 / 64)) ok = false;  // NaN fails too
          max_err = std::isfinite(err) ? std::max(max_err, err) : INFINITY;
        }
      }

      // Timing: one graph = one call per weight copy.
      cudaGraph_t g;
      cudaGraphExec_t tp_exec;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < copies; ++i)
        FK(fmlp_tp_mlp_packed(ps[size_t(i)], &yv[size_t(i)], &xv[size_t(i)], nullptr, comm, o.rank,
                              o.size, o.reduce, ws, ws_bytes, s));
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&tp_exec, g, 0));
      CK(cudaGraphDestroy(g));
      // One graph of n calls of the packed weights `packs` (no collective), timed.
      auto time_local = [&](const std::vector<fmlp_mlp_packed_t*>& packs, int n) {
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < n; ++i)
          FK(fmlp_mlp_packed_run(packs[size_t(i)], &yv[size_t(i)], &xv[size_t(i)], nullptr, ws,
                                 ws_bytes, s));
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&exec, g, 0));
        CK(cudaGraphDestroy(g));
        const double us = graph_us_bracketed(exec, s, o.reps, n);
        CK(cudaGraphExecDestroy(exec));
        return us;
      };
      // The other ranks wait inside their first all-reduce meanwhile.
      if (root && mode == 0) one_us = time_local(pf, full_copies);
      // This rank's shard alone: tp_us - shard_us is what the reduction costs.
      if (mode == 0) shard_us = time_local(ps, copies);
      const double tp_us = graph_us_bracketed(tp_exec, s, o.reps, copies);
      CK(cudaGetLastError());
      if (root) {
        const double flops = 2.0 * double(m) * 3.0 * double(d) * double(H);
        const double floor_us = shard_bytes / bw * 1e6;
        failures += !ok;
        std::printf(
            "M=%-5lld [%-4s] tp %9.2f us  single %9.2f us  tp/single %.3f  speedup %.2fx  "
            "%.1f TFLOP/s  floor(shard bytes) %.2f us (%.1f%%)  shard alone %.2f us  check %s "
            "(max err %.2e of |y|+rms, tol 2^-6)\n         all-reduce: %s\n",
            (long long)m, path, tp_us, one_us, tp_us / one_us, one_us / tp_us, flops / tp_us * 1e-6,
            floor_us, 100 * floor_us / tp_us, shard_us, ok ? "ok" : "FAIL", max_err, about.c_str());
        std::fflush(stdout);
        char row[1024];
        std::snprintf(row, sizeof row,
                      "%s{\"M\": %lld, \"allreduce\": \"%s\", \"allreduce_requested\": \"%s\", "
                      "\"allreduce_detail\": \"%s\", \"tp_us\": %.3f, \"single_us\": %.3f, "
                      "\"tp_over_single\": %.4f, \"speedup\": %.4f, \"tp_tflops\": %.2f, "
                      "\"shard_floor_us\": %.3f, \"shard_us\": %.3f, \"copies\": %d, "
                      "\"check_ok\": %s, \"max_err\": %.3e}",
                      rows.empty() ? "" : ", ", (long long)m, path, o.p2p[mode] ? "p2p" : "nccl",
                      about.c_str(), tp_us, one_us, tp_us / one_us, one_us / tp_us,
                      flops / tp_us * 1e-6, floor_us, shard_us, copies, ok ? "true" : "false",
                      max_err);
        rows += row;
      }
      CK(cudaGraphExecDestroy(tp_exec));
    }
    CK(cudaFree(ws));
    for (int i = 0; i < nx; ++i) {
      CK(cudaFree(xs[size_t(i)]));
      CK(cudaFree(ys[size_t(i)]));
    }
  }
  if (root && !o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", o.json.c_str());
      return 2;
    }
    std::fprintf(f,
                 "{\"bench\": \"tp_mlp\", \"shape\": \"%s\", \"d\": %lld, \"hidden\": %lld, "
                 "\"ranks\": %d, \"reduce\": \"%s\", \"gpu\": \"%s\", \"copy_TBps\": %.3f, "
                 "\"results\": [%s], \"failures\": %d}\n",
                 sh->name, (long long)d, (long long)H, o.size,
                 o.reduce == FMLP_TP_ALL_REDUCE ? "all_reduce" : "reduce_scatter", prop.name,
                 bw / 1e12, rows.c_str(), failures);
    std::fclose(f);
  }
  for (fmlp_mlp_packed_t* p : ps) fmlp_mlp_packed_destroy(p);
  for (fmlp_mlp_packed_t* p : pf) fmlp_mlp_packed_destroy(p);
  FK(fmlp_tp_comm_destroy(comm));
  CK(cudaStreamDestroy(s));
  return failures == 0 ? 0 : 4;
}
