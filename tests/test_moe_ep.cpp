// Expert parallelism of the moe op (config.first_expert / global_experts), one device: the
// experts are partitioned into ranges; each range run on its own (routing over all experts, only
// its slots added, the residual on range 0) must match the fp64 reference restricted to it, and
// the sum over the ranges must match the whole op within the sum of the ranges' tolerances
// (triangle inequality: each partial is within its own bound of its own exact value, and the exact
// values add up to the whole op). ref, cpu and cuda entries; the new fields' bad input.
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "fusedmlp/fusedmlp.h"
#include "moe_case.hpp"

namespace fmlp_test {
namespace {

// Ranges of the given sizes covering [0, sum) in order; range 0 carries the residual.
std::vector<ExpertRange> partition(std::initializer_list<int64_t> counts) {
  std::vector<ExpertRange> v;
  int64_t first = 0;
  for (int64_t n : counts) {
    v.push_back({first, n, v.empty()});
    first += n;
  }
  return v;
}

fmlp_tensor_t experts_of(fmlp_tensor_t t, int64_t first, int64_t count) {
  if (t.data == nullptr) return t;
  t.data = static_cast<char*>(t.data) + first * t.stride[0] * int64_t(fmlp::dtype_size(t.dtype));
  t.shape[0] = count;
  return t;
}

// The whole op's args cut down to range r (views of the same buffers).
fmlp_moe_args_t range_args(const MoeCase& c, const fmlp_moe_args_t& full, const ExpertRange& r) {
  fmlp_moe_args_t a = full;
  a.w1 = experts_of(a.w1, r.first, r.count), a.b1 = experts_of(a.b1, r.first, r.count);
  a.w2 = experts_of(a.w2, r.first, r.count), a.b2 = experts_of(a.b2, r.first, r.count);
  a.config.num_experts = int32_t(r.count);
  a.config.first_expert = int32_t(r.first);
  a.config.global_experts = int32_t(c.e);
  if (!r.residual) a.residual = fmlp_tensor_none();
  return a;
}

struct RangeCase {
  MoeCase c;
  std::vector<ExpertRange> ranges;
  std::vector<std::pair<size_t, int32_t>> bad_ids;  // (slot, id outside [0, E)), device only
};

// Every range of rc through `kernel` (host or device memory), then the sum. "" or the failure.
std::string run_ranges(const RangeCase& rc, const char* kernel, bool device, uint64_t seed) {
  const MoeCase& c = rc.c;
  MoeData m;
  make(c, seed, &m);
  const std::vector<double> residual = residual_of(c, m);
  const std::vector<unsigned char> y0 = m.y.bytes;
  std::vector<int32_t> ids = m.ids;  // the bad ids go to the device only; m keeps valid ones
  std::vector<int64_t> nan_rows;
  for (const auto& [slot, id] : rc.bad_ids) ids[slot] = id, nan_rows.push_back(int64_t(slot) / c.k);
  std::unique_ptr<DeviceCase> dc;
  if (device) dc = std::make_unique<DeviceCase>(c, m);
  const bool fp32_router = device && c.routing == 0;
  const size_t n = size_t(c.t * c.d_out);
  const double rtol = mlp_rtol(c.xt, c.wt);
  std::vector<double> sum(n, 0.0), tol(n, 0.0), ref, scale;
  std::vector<char> near_tie;
  for (const ExpertRange& r : rc.ranges) {
    const std::string where =
        "range [" + std::to_string(r.first) + ", " + std::to_string(r.first + r.count) + "): ";
    m.y.bytes = y0;
    const fmlp_moe_args_t a = range_args(c, device ? dc->args() : m.args, r);
    if (fmlp_moe_kernel_supports(&a, kernel) != FMLP_SUCCESS)
      return std::string(kSkipped) + fmlp_last_error();
    size_t bytes = 0;
    if (fmlp_moe_kernel_workspace_size(&a, kernel, &bytes) != FMLP_SUCCESS)
      return where + fmlp_last_error();
    Buffer ws(bytes, device);
    ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
    if (device) dc->upload(m, &ids);
    if (const fmlp_status_t s = fmlp_moe_with_kernel(&a, kernel, ws.data(), bytes, nullptr);
        s != FMLP_SUCCESS)
      return where + fmlp_status_name(s) + ": " + fmlp_last_error();
    if (device) {
      m.y.bytes = dc->y_bytes();
      int32_t errors = -1;
      if (fmlp_moe_device_errors(ws.data(), bytes, nullptr, &errors) != FMLP_SUCCESS)
        return where + "fmlp_moe_device_errors: " + fmlp_last_error();
      if (errors != int32_t(rc.bad_ids.size()))  // every range meets every bad id
        return where + "the device error count is " + std::to_string(errors) + ", expected " +
               std::to_string(rc.bad_ids.size());
      for (unsigned char v : ws.download())
        if (v != 0) return where + "the workspace was not left zero-filled";
    }
    if (!m.y.guard_intact()) return where + "bytes after y were written";
    if (const std::string err = check_y(c, m, residual, nan_rows, fp32_router, r); !err.empty())
      return where + err;
    reference(c, m, residual, &ref, &scale, &near_tie, r);
    for (size_t i = 0; i < n; ++i) {
      sum[i] += m.y.get(int64_t(i));
      tol[i] += rtol * (std::fabs(ref[i]) + scale[i]) + dtype_atol(c.xt);
    }
  }
  reference(c, m, residual, &ref, &scale, &near_tie);
  int bad = 0;
  std::string first;
  for (int64_t t = 0; t < c.t; ++t) {
    const bool nan_row = std::find(nan_rows.begin(), nan_rows.end(), t) != nan_rows.end();
    if (!nan_row && fp32_router && near_tie[size_t(t)]) continue;
    for (int64_t o = 0; o < c.d_out; ++o) {
      const size_t i = size_t(t * c.d_out + o);
      const bool ok = nan_row ? std::isnan(sum[i]) : std::fabs(sum[i] - ref[i]) <= tol[i];
      if (!ok && bad++ == 0)
        first = "sum y[" + std::to_string(t) + "][" + std::to_string(o) +
                "] = " + std::to_string(sum[i]) + ", whole op " + std::to_string(ref[i]) +
                ", allowed " + std::to_string(tol[i]);
    }
  }
  return bad ? std::to_string(bad) + " wrong sums over the ranges; first " + first : "";
}

MoeCase ep_case(int64_t t, int64_t e, int64_t k, int routing) {
  MoeCase c;
  c.t = t, c.e = e, c.k = k, c.routing = routing;
  c.d = 31, c.hidden = 45, c.d_out = 17;
  return c;
}

// Shapes for every entry: on device the dims become multiples of 8 and the experts 16-bit.
std::vector<RangeCase> range_cases(bool device) {
  std::vector<RangeCase> v;
  {  // router, uneven ranges, every bias
    MoeCase c = ep_case(33, 8, 2, 0);
    c.gated = true, c.b1 = FMLP_DTYPE_F32, c.b2 = FMLP_DTYPE_BF16, c.rb = FMLP_DTYPE_F16;
    c.residual = 1;
    v.push_back({c, partition({3, 5}), {}});
  }
  {  // every expert picked by every token, one expert per range, residual in place
    MoeCase c = ep_case(7, 8, 8, 0);
    c.residual = 2, c.xt = FMLP_DTYPE_BF16;
    v.push_back({c, partition({1, 1, 1, 1, 1, 1, 1, 1}), {}});
  }
  {  // random given routing: many tokens have no expert in a range
    MoeCase c = ep_case(33, 8, 2, 1);
    c.residual = 1, c.b2 = FMLP_DTYPE_F32;
    v.push_back({c, partition({2, 2, 2, 2}), {}});
  }
  for (bool gated : {false, true}) {  // every slot on expert 7: range 0 gets no token at all
    MoeCase c = ep_case(33, 8, 2, 2);
    c.gated = gated, c.residual = gated ? 2 : 1;
    v.push_back({c, partition({4, 4}), {}});
    v.push_back({c, partition({7, 1}), {}});
  }
  {  // only experts 0 and 4 used: ranges [1, 4) and [5, 8) idle
    MoeCase c = ep_case(33, 8, 2, 3);
    c.residual = 1;
    v.push_back({c, partition({1, 3, 1, 3}), {}});
  }
  {  // top_k above a range's expert count; sigmoid without renormalisation
    MoeCase c = ep_case(16, 8, 4, 0);
    c.sigmoid = true, c.renorm = false, c.rb = FMLP_DTYPE_F32, c.gated = true;
    v.push_back({c, partition({1, 7}), {}});
  }
  {  // one token
    MoeCase c = ep_case(1, 4, 2, 0);
    c.residual = 1;
    v.push_back({c, partition({1, 1, 1, 1}), {}});
  }
  if (device) {
    bool same = true;  // every other case with x in the experts' dtype: moe_sm80_grouped takes it
    for (RangeCase& rc : v) {
      rc.c.d = 64, rc.c.hidden = 128, rc.c.d_out = 40;
      if (rc.c.wt == FMLP_DTYPE_F32) rc.c.wt = FMLP_DTYPE_BF16;
      if (same) rc.c.xt = rc.c.wt;
      same = !same;
    }
    MoeCase big = ep_case(300, 64, 8, 0);  // many chunks per range, atomic partial sums
    big.d = 256, big.hidden = 320, big.d_out = 264, big.gated = true, big.deterministic = false;
    big.xt = big.wt = FMLP_DTYPE_BF16, big.residual = 1;
    v.push_back({big, partition({8, 8, 8, 8, 8, 8, 8, 8}), {}});
    MoeCase wide = ep_case(16, 64, 8, 1);  // given routing, f16 experts, f32 activations
    wide.d = 136, wide.hidden = 72, wide.d_out = 40, wide.wt = FMLP_DTYPE_F16;
    v.push_back({wide, partition({5, 27, 32}), {}});
    MoeCase bad = ep_case(7, 8, 2, 1);  // ids outside [0, 8): a NaN row in every range's output
    bad.d = 64, bad.hidden = 72, bad.d_out = 40, bad.wt = FMLP_DTYPE_BF16, bad.residual = 1;
    v.push_back({bad, partition({4, 4}), {{1 * 2 + 1, 8}, {3 * 2 + 0, -1}}});
  }
  return v;
}

TEST(MoeExpertRange, HostEntriesMatchTheRestrictedReferenceAndSumToTheWholeOp) {
  int ran = 0;
  for (int i = 0; i < fmlp_moe_kernel_count(); ++i) {
    if (fmlp_moe_kernel_backend(i) == FMLP_BACKEND_CUDA) continue;
    const char* kernel = fmlp_moe_kernel_name(i);
    uint64_t n = 0;
    for (const RangeCase& rc : range_cases(false)) {
      const std::string err = run_ranges(rc, kernel, false, mix_seed(test_seed(), 100 + ++n));
      if (skipped(err)) continue;
      ++ran;
      EXPECT_EQ(err, "") << kernel << " [" << rc.c.name() << "] (FMLP_TEST_SEED=" << test_seed()
                         << ")";
    }
  }
  EXPECT_GT(ran, 0);
}

TEST(MoeExpertRange, CudaEntriesMatchTheRestrictedReferenceAndSumToTheWholeOp) {
  SKIP_WITHOUT_GPU();
  for (const char* kernel : cuda_moe_kernels()) {
    int ran = 0;
    uint64_t n = 0;
    for (const RangeCase& rc : range_cases(true)) {
      const std::string err = run_ranges(rc, kernel, true, mix_seed(test_seed(), 200 + ++n));
      if (skipped(err)) continue;
      ++ran;
      EXPECT_EQ(err, "") << kernel << " [" << rc.c.name() << "] (FMLP_TEST_SEED=" << test_seed()
                         << ")";
    }
    EXPECT_GT(ran, 0) << kernel << " took none of the cases";
  }
}

TEST(MoeExpertRange, GraphReplayOfARangeRoutesTheNewInputs) {
  SKIP_WITHOUT_GPU();
  MoeCase c = ep_case(16, 8, 2, 0);
  c.d = 256, c.hidden = 320, c.d_out = 40, c.gated = true, c.residual = 1;
  c.xt = c.wt = FMLP_DTYPE_BF16;  // a shape the grouped and chunked entries take
  const ExpertRange r{2, 3, true};
  int ran = 0;
  for (const char* kernel : cuda_moe_kernels()) {
    MoeData m, fresh;
    make(c, 31, &m);
    make(c, 32, &fresh);
    DeviceCase dc(c, m);
    const fmlp_moe_args_t a = range_args(c, dc.args(), r);
    if (fmlp_moe_kernel_supports(&a, kernel) != FMLP_SUCCESS) continue;  // too many tokens
    ++ran;
    size_t bytes = 0;
    ASSERT_EQ(fmlp_moe_kernel_workspace_size(&a, kernel, &bytes), FMLP_SUCCESS)
        << fmlp_last_error();
    Buffer ws(bytes, true);
    ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
    const std::string err = capture_and_replay(
        [&](void* s) { return fmlp_moe_with_kernel(&a, kernel, ws.data(), bytes, s); },
        [&] { dc.upload(fresh); });
    ASSERT_EQ(err, "") << kernel;
    fresh.y.bytes = dc.y_bytes();
    EXPECT_EQ(check_y(c, fresh, residual_of(c, fresh), {}, true, r), "") << kernel;
    for (unsigned char v : ws.download()) ASSERT_EQ(v, 0) << kernel << ": workspace not zeroed";
  }
  EXPECT_GE(ran, 2) << "the grouped and chunked entries should both take this case";
}

TEST(MoeExpertRange, BadInputNamesTheFieldAndLeavesYUntouched) {
  struct Bad {
    int routing;
    BadCase bad;
  };
  const auto range = [](MoeData& m, int32_t first, int32_t global) {
    m.args.config.first_expert = first, m.args.config.global_experts = global;
  };
  const std::vector<Bad> bad = {
      {0,
       {"negative first",
        [](MoeData& m) { m.args.config.first_expert = -1; },
        FMLP_ERROR_INVALID_VALUE,
        {"config.first_expert is -1"}}},
      {0,
       {"negative global",
        [](MoeData& m) { m.args.config.global_experts = -3; },
        FMLP_ERROR_INVALID_VALUE,
        {"config.global_experts is -3"}}},
      {0,
       {"first without global",
        [](MoeData& m) { m.args.config.first_expert = 1; },
        FMLP_ERROR_INVALID_VALUE,
        {"exceeds the global expert count 4", "global_experts is 0"}}},
      {1,
       {"range past global",
        [&](MoeData& m) { range(m, 3, 6); },
        FMLP_ERROR_INVALID_VALUE,
        {"first_expert 3 + config.num_experts 4 exceeds the global expert count 6"}}},
      {1,
       {"top_k above global",
        [&](MoeData& m) { range(m, 2, 6), m.args.config.top_k = 7; },
        FMLP_ERROR_INVALID_VALUE,
        {"top_k is 7", "global_experts is 6"}}},
      {0,
       {"router rows != global",
        [&](MoeData& m) { range(m, 2, 6); },
        FMLP_ERROR_SHAPE_MISMATCH,
        {"router_w", "global_experts"}}},
      {1,
       {"given id past global",
        [&](MoeData& m) { range(m, 2, 6), m.ids[3] = 6; },
        FMLP_ERROR_INDEX_OUT_OF_RANGE,
        {"is 6", "[0, 6)", "global_experts"}}},
  };
  for (const Bad& b : bad) expect_rejected(ep_case(7, 4, 2, b.routing), b.bad);
  // Ids of other ranges' experts are valid: experts [2, 6) of 6, ids 0, 1 and 5 among them.
  MoeData m;
  make(ep_case(7, 4, 2, 1), 12, &m);
  m.args.config.first_expert = 2, m.args.config.global_experts = 6;
  m.ids[0] = 0, m.ids[1] = 5, m.ids[4] = 1;
  std::vector<unsigned char> ws(1 << 20);
  EXPECT_EQ(fmlp_moe(&m.args, FMLP_BACKEND_AUTO, ws.data(), ws.size(), nullptr), FMLP_SUCCESS)
      << fmlp_last_error();
}

TEST(MoeExpertRange, ExplainNamesTheRange) {
  MoeData m;
  make(ep_case(7, 4, 2, 1), 3, &m);
  m.args.config.first_expert = 4, m.args.config.global_experts = 8;
  size_t needed = 0;
  ASSERT_EQ(fmlp_moe_explain(&m.args, FMLP_BACKEND_REF, nullptr, 0, &needed), FMLP_SUCCESS)
      << fmlp_last_error();
  std::string s(needed, '\0');
  ASSERT_EQ(fmlp_moe_explain(&m.args, FMLP_BACKEND_REF, s.data(), s.size(), &needed), FMLP_SUCCESS);
  EXPECT_NE(s.find("experts [4, 8) of 8"), std::string::npos) << s;
}

}  // namespace
}  // namespace fmlp_test
