// The moe cases on device memory for the cuda entries (test_moe.cpp, test_moe_stream.cpp): one
// call of a named entry, optionally graph-captured and replayed on new data, with bad device ids,
// a NaN token or an expert range, checked against the fp64 reference of moe_case.hpp.
#pragma once
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "moe_case.hpp"

namespace fmlp_test {

// ---- cuda backend: the cases on device memory ----
// Tolerances: those of tolerance.hpp (rtol of the output dtype, or of the weight dtype when larger:
// x and h are rounded to the bf16/f16 weights for the tensor cores); tokens whose k-th and
// (k+1)-th router scores are within 1e-4 are not compared (the fp32 router may pick either).
// fp8 e4m3 experts: rtol 2^-7 (f8_e4m3 counts like bf16 in tolerance.hpp): the weights are exact
// (fp16 holds every e4m3 value) and x and h are staged as fp16 times a power of two per row (11
// significant bits, finer than the bf16 rounding of 16-bit experts), fp32 accumulation.

struct DeviceRun {
  bool graph = false;  // capture, replay, refresh the inputs with other data, replay twice
  std::vector<std::pair<size_t, int32_t>> bad_ids;  // (slot, id outside [0, E)) on the device
  std::vector<unsigned char>* y_bytes = nullptr;
  int64_t nan_token = -1;  // x[nan_token][d / 2] = NaN: that row of y must be all NaN
  ExpertRange range;       // expert parallelism: the call holds these experts only
  // > 0: router row e is a copy of row e - e % tied_router_rows, so experts tie exactly (no
  // router bias) and every token is compared, a tie at the k-th pick included (both sides give it
  // to the lower id).
  int64_t tied_router_rows = 0;
};

// The args of a call holding only the experts of r (views into the same buffers).
inline fmlp_moe_args_t range_of(const MoeCase& c, fmlp_moe_args_t a, const ExpertRange& r) {
  if (r.count < 0) return a;
  for (fmlp_tensor_t* t : {&a.w1, &a.b1, &a.w2, &a.b2}) {
    if (t->data == nullptr) continue;
    t->data =
        static_cast<char*>(t->data) + r.first * t->stride[0] * int64_t(fmlp::dtype_size(t->dtype));
    t->shape[0] = r.count;
  }
  a.config.num_experts = int32_t(r.count);
  a.config.first_expert = int32_t(r.first);
  a.config.global_experts = int32_t(c.e);
  if (!r.residual) a.residual = fmlp_tensor_none();
  return a;
}

inline std::string run_device(const MoeCase& c, const char* kernel, uint64_t seed,
                              const DeviceRun& run = {}) {
  MoeData m;
  make(c, seed, &m);
  const auto spoil_x = [&](MoeData& d) {
    if (run.nan_token >= 0) d.x.set(run.nan_token * c.d + c.d / 2, std::nan(""));
    if (run.tied_router_rows > 0)
      for (int64_t e = 0; e < c.e; ++e)
        for (int64_t i = 0; i < c.d; ++i)
          d.rw.set(e * c.d + i, d.rw.get((e - e % run.tied_router_rows) * c.d + i));
  };
  spoil_x(m);
  DeviceCase dc(c, m);
  const fmlp_moe_args_t args = range_of(c, dc.args(), run.range);
  if (fmlp_moe_kernel_supports(&args, kernel) != FMLP_SUCCESS)
    return std::string(kSkipped) + fmlp_last_error();
  size_t bytes = 0;
  if (fmlp_moe_kernel_workspace_size(&args, kernel, &bytes) != FMLP_SUCCESS)
    return fmlp_last_error();
  Buffer ws(bytes, true);
  ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
  std::vector<int32_t> ids = m.ids;
  std::vector<int64_t> nan_rows;
  for (const auto& [slot, id] : run.bad_ids)
    ids[slot] = id, nan_rows.push_back(int64_t(slot) / c.k);
  if (run.nan_token >= 0) nan_rows.push_back(run.nan_token);
  if (!run.bad_ids.empty()) dc.upload(m, &ids);
  auto call = [&](void* stream) {
    return fmlp_moe_with_kernel(&args, kernel, ws.data(), bytes, stream);
  };
  MoeData fresh;
  if (run.graph && c.residual == 2)  // the refreshed y would get two replays' sums
    return "test setup: a graph run replays twice after its refresh; give it residual 0 or 1";
  if (run.graph) {  // the refreshed data routes differently: new x, router, ids and weights
    make(c, seed + 1000, &fresh);
    spoil_x(fresh);
    const std::string err = capture_and_replay(call, [&] { dc.upload(fresh); });
    if (!err.empty()) return err;
  } else if (const fmlp_status_t st = call(nullptr); st != FMLP_SUCCESS) {
    return std::string(fmlp_status_name(st)) + ": " + fmlp_last_error();
  }
  MoeData& used = run.graph ? fresh : m;
  const std::vector<double> residual = residual_of(c, used);
  used.y.bytes = dc.y_bytes();
  if (!used.y.guard_intact()) return "bytes after y were written";
  if (run.y_bytes) *run.y_bytes = used.y.bytes;
  int32_t errors = -1;
  if (fmlp_moe_device_errors(ws.data(), bytes, nullptr, &errors) != FMLP_SUCCESS)
    return std::string("fmlp_moe_device_errors: ") + fmlp_last_error();
  if (errors != int32_t(run.bad_ids.size()))
    return "the device error count is " + std::to_string(errors) + ", expected " +
           std::to_string(run.bad_ids.size());
  for (unsigned char v : ws.download())
    if (v != 0) return "the workspace was not left zero-filled";
  return check_y(c, used, residual, nan_rows, c.routing == 0 && run.tied_router_rows == 0,
                 run.range);
}

}  // namespace fmlp_test
