// Expert-parallel moe with sharded tokens (fmlp_tp_moe_a2a, include/fusedmlp/fusedmlp_nccl.h).
//
// Host, any machine: bad input is refused with a message naming the argument, before anything is
// written (and BACKEND_UNAVAILABLE without NCCL).
// Devices, >= 2 GPUs with NCCL: one process, one thread per rank (the op holds two exchanges, so
// it cannot sit in one NCCL group with the other rank's call). The tokens of one moe case are cut
// into uneven per-rank pieces (a rank with 1 token, one with none, ranks whose experts get no
// slot), each rank runs its piece, and the ranks' rows together must match the fp64 reference of
// the whole case (the accuracy contract of tolerance.hpp) and the single-GPU fmlp_moe within twice
// that bound. A capacity below the worst case drops exactly the slots the documented rule names
// (the reference leaves them out) and counts them; graph capture and replay with fresh inputs;
// the workspace is left zero-filled apart from its counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.h"
#include "fusedmlp/fusedmlp_nccl.h"
#include "moe_case.hpp"
#include "tp_fixture.hpp"

namespace {
using namespace tp_test;
using fmlp_test::MoeCase;
using fmlp_test::MoeData;

// ---- host: bad input ----

TEST(TpMoeA2aBadInput, ArgumentsAreNamedAndNothingIsWritten) {
  MoeCase c;
  c.t = 3, c.e = 4, c.k = 2;
  MoeData m;
  fmlp_test::make(c, 5, &m);
  fmlp_moe_args_t local{};
  ASSERT_EQ(fmlp_tp_shard_moe(&m.args, 0, 2, &local), FMLP_SUCCESS) << fmlp_last_error();
  const std::vector<unsigned char> before = m.y.bytes;
  int dummy = 0;
  void* fake_comm = &dummy;  // never dereferenced: every case fails before the comm is queried
  size_t bytes = 0;
  int32_t count = 0;
  if (fmlp_tp_available() != FMLP_SUCCESS) {
    expect_error(
        fmlp_tp_moe_a2a(&local, 3, FMLP_TP_MOE_A2A_NO_DROP, fake_comm, 0, 2, nullptr, 0, nullptr),
        FMLP_ERROR_BACKEND_UNAVAILABLE, "tensor parallel");
    expect_error(fmlp_tp_moe_a2a_workspace_size(&local, 3, FMLP_TP_MOE_A2A_NO_DROP, 0, 2, &bytes),
                 FMLP_ERROR_BACKEND_UNAVAILABLE, "tensor parallel");
    EXPECT_EQ(m.y.bytes, before);
    GTEST_SKIP() << "NCCL unavailable, only the BACKEND_UNAVAILABLE answer checked";
  }
  const auto run = [&](const fmlp_moe_args_t* a, int64_t max_tokens, int64_t capacity, void* comm,
                       int32_t rank) {
    return fmlp_tp_moe_a2a(a, max_tokens, capacity, comm, rank, 2, nullptr, 0, nullptr);
  };
  const int64_t all = FMLP_TP_MOE_A2A_NO_DROP;
  expect_error(run(nullptr, 3, all, fake_comm, 0), FMLP_ERROR_NULL_POINTER, "local_args");
  expect_error(run(&local, 3, all, nullptr, 0), FMLP_ERROR_NULL_POINTER, "comm is NULL");
  expect_error(run(&local, 3, all, fake_comm, 2), FMLP_ERROR_INVALID_VALUE, "rank is 2");
  expect_error(run(&local, 3, 0, fake_comm, 0), FMLP_ERROR_INVALID_VALUE, "capacity is 0");
  expect_error(run(&local, 3, -5, fake_comm, 0), FMLP_ERROR_INVALID_VALUE, "capacity is -5");
  expect_error(run(&local, 3, 7, fake_comm, 0), FMLP_ERROR_INVALID_VALUE, "max_tokens * top_k = 6");
  expect_error(run(&local, 2, all, fake_comm, 0), FMLP_ERROR_INVALID_VALUE,
               "max_tokens is 2 but this rank has T = 3");
  expect_error(run(&local, 3, all, fake_comm, 1), FMLP_ERROR_INVALID_VALUE,
               "rank 1 of 2 holds [2, 4)");
  fmlp_moe_args_t bad = local;
  bad.config.top_k = 9;
  expect_error(run(&bad, 3, all, fake_comm, 0), FMLP_ERROR_INVALID_VALUE, "top_k is 9");
  expect_error(run(&local, 3, all, fake_comm, 0), FMLP_ERROR_DEVICE_MISMATCH,
               "needs CUDA device memory");
  expect_error(fmlp_tp_moe_a2a_workspace_size(&local, 3, 0, 0, 2, &bytes), FMLP_ERROR_INVALID_VALUE,
               "capacity is 0");
  expect_error(fmlp_tp_moe_a2a_workspace_size(&local, 3, all, 0, 2, nullptr),
               FMLP_ERROR_NULL_POINTER, "bytes");
  expect_error(fmlp_tp_moe_a2a_dropped(nullptr, 256, nullptr, &count), FMLP_ERROR_NULL_POINTER,
               "workspace is NULL");
  expect_error(fmlp_tp_moe_a2a_dropped(&dummy, 256, nullptr, nullptr), FMLP_ERROR_NULL_POINTER,
               "count");
  EXPECT_EQ(m.y.bytes, before);
}

// ---- devices: two ranks, one thread each ----

#ifdef FMLP_TEST_WITH_CUDA

constexpr int kRanks = 2;

void moe_on_device(fmlp_moe_args_t* a, int dev) {
  for (fmlp_tensor_t* t :
       {&a->x, &a->y, &a->residual, &a->router_w, &a->router_b, &a->w1, &a->b1, &a->w2, &a->b2})
    if (t->data != nullptr) t->device_id = dev;
}

fmlp_tensor_t rows_of(fmlp_tensor_t t, int64_t first, int64_t count) {
  if (t.data == nullptr) return t;
  t.data = static_cast<char*>(t.data) + first * t.stride[0] * int64_t(fmlp::dtype_size(t.dtype));
  t.shape[0] = count;
  return t;
}

// Rank r's args: its experts (fmlp_tp_shard_moe) and its tokens [first, first + count) of the
// case, its residual included (every rank adds its own tokens' residual).
fmlp_moe_args_t rank_args(const fmlp_moe_args_t& full, int r, int64_t first, int64_t count,
                          int64_t k) {
  fmlp_moe_args_t a{};
  EXPECT_EQ(fmlp_tp_shard_moe(&full, r, kRanks, &a), FMLP_SUCCESS) << fmlp_last_error();
  a.residual = rows_of(full.residual, first, count);
  a.x = rows_of(full.x, first, count);
  a.y = rows_of(full.y, first, count);
  if (full.topk_ids)
    a.topk_ids = full.topk_ids + first * k, a.topk_weights = full.topk_weights + first * k;
  return a;
}

int owner(int64_t e, int64_t experts) {
  int32_t first = 0, count = 0;
  for (int r = 0; r < kRanks; ++r) {
    fmlp_tp_expert_range(int32_t(experts), r, kRanks, &first, &count);
    if (e >= first && e < first + count) return r;
  }
  return -1;
}

// The documented drop rule for given routing: per (rank, receiver), the slots in (expert, slot)
// order beyond `capacity` are dropped. Marks them in *dropped; returns the count per rank.
std::vector<int32_t> drops(const MoeCase& c, const MoeData& m, const std::vector<int64_t>& tokens,
                           int64_t capacity, std::vector<char>* dropped) {
  dropped->assign(size_t(c.t * c.k), 0);
  std::vector<int32_t> per_rank(kRanks, 0);
  int64_t first = 0;
  for (int r = 0; r < kRanks; ++r) {
    std::vector<int64_t> slots(size_t(tokens[size_t(r)] * c.k));
    std::iota(slots.begin(), slots.end(), first * c.k);
    std::stable_sort(slots.begin(), slots.end(),
                     [&](int64_t a, int64_t b) { return m.ids[size_t(a)] < m.ids[size_t(b)]; });
    std::vector<int64_t> taken(kRanks, 0);
    for (int64_t s : slots)
      if (taken[size_t(owner(m.ids[size_t(s)], c.e))]++ >= capacity)
        (*dropped)[size_t(s)] = 1, ++per_rank[size_t(r)];
    first += tokens[size_t(r)];
  }
  return per_rank;
}

struct A2aCase {
  MoeCase c;                    // c.t = the sum of tokens
  std::vector<int64_t> tokens;  // per rank
  int64_t capacity = FMLP_TP_MOE_A2A_NO_DROP;
  bool graph = false;  // also capture both ranks' calls and replay them with fresh inputs
  std::vector<std::pair<int64_t, int32_t>> bad_ids;  // (slot, id outside [0, E)), on the device
};

std::vector<int64_t> nan_rows_of(const A2aCase& ac) {
  std::vector<int64_t> rows;
  for (const auto& [slot, id] : ac.bad_ids) rows.push_back(slot / ac.c.k);
  return rows;
}

// Runs fn(r) for both ranks at once, one thread each (rank r's device current). "" or the errors.
std::string on_ranks(const std::function<std::string(int)>& fn) {
  std::string err[kRanks];
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      err[r] = fn(r);
    });
  for (std::thread& t : threads) t.join();
  std::string all;
  for (int r = 0; r < kRanks; ++r)
    if (!err[r].empty()) all += "rank " + std::to_string(r) + ": " + err[r] + "; ";
  return all;
}

// The ranks' rows of y put together, checked against the reference (dropped slots left out) and,
// without drops, against the single-GPU op. "" or the failure.
std::string check_rows(const A2aCase& ac, const MoeData& m, const std::vector<unsigned char>* ys,
                       const std::vector<char>& dropped) {
  const MoeCase& c = ac.c;
  MoeData got = m;
  for (size_t s = 0; s < dropped.size(); ++s)
    if (dropped[s]) got.wts[s] = 0.f;  // the reference without the dropped terms
  const size_t row = size_t(c.d_out) * fmlp::dtype_size(c.xt);
  int64_t first = 0;
  for (int r = 0; r < kRanks; ++r) {
    const size_t lo = size_t(first) * row, hi = size_t(first + ac.tokens[size_t(r)]) * row;
    for (size_t i = 0; i < ys[r].size(); ++i) {
      if (i >= lo && i < hi)
        got.y.bytes[i] = ys[r][i];
      else if (ys[r][i] != m.y.bytes[i])
        return "rank " + std::to_string(r) + " wrote byte " + std::to_string(i) +
               " outside its rows";
    }
    first += ac.tokens[size_t(r)];
  }
  const std::vector<double> residual = fmlp_test::residual_of(c, m);
  const bool router = c.routing == 0;
  const std::vector<int64_t> nan_rows = nan_rows_of(ac);
  if (std::string e = fmlp_test::check_y(c, got, residual, nan_rows, router); !e.empty())
    return "vs reference: " + e;
  if (ac.capacity != FMLP_TP_MOE_A2A_NO_DROP) return "";
  // The single-GPU op on device 0, on its own stream, finished before y is read.
  if (cudaSetDevice(0) != cudaSuccess) return "cannot select device 0";
  fmlp_test::DeviceCase one(c, m);
  size_t bytes = 0;
  if (fmlp_moe_workspace_size(&one.args(), FMLP_BACKEND_CUDA, &bytes) != FMLP_SUCCESS)
    return fmlp_last_error();
  fmlp_test::Buffer ws(bytes, true);
  ws.fill(0);
  cudaStream_t st = nullptr;
  if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess)
    return "cannot create a stream";
  const fmlp_status_t status = fmlp_moe(&one.args(), FMLP_BACKEND_CUDA, ws.data(), bytes, st);
  const cudaError_t synced = cudaStreamSynchronize(st);
  cudaStreamDestroy(st);
  if (status != FMLP_SUCCESS) return std::string("single gpu: ") + fmlp_last_error();
  if (synced != cudaSuccess) return std::string("single gpu: ") + cudaGetErrorString(synced);
  MoeData single = m;
  single.y.bytes = one.y_bytes();
  std::vector<double> ref, scale;
  std::vector<char> tie;
  fmlp_test::reference(c, m, residual, &ref, &scale, &tie);
  const double rtol = fmlp_test::mlp_rtol(c.xt, c.wt);
  for (int64_t i = 0; i < c.t * c.d_out; ++i) {
    if (router && tie[size_t(i / c.d_out)]) continue;
    if (std::count(nan_rows.begin(), nan_rows.end(), i / c.d_out)) continue;
    const double a = got.y.get(i), b = single.y.get(i);
    const double tol =
        2 * (rtol * (std::fabs(ref[size_t(i)]) + scale[size_t(i)]) + fmlp_test::dtype_atol(c.xt));
    if (!(std::fabs(a - b) <= tol)) {
      int64_t nan_count = 0;
      for (int64_t j = 0; j < c.t * c.d_out; ++j) nan_count += std::isnan(single.y.get(j));
      return "y[" + std::to_string(i) + "] = " + std::to_string(a) + ", single gpu " +
             std::to_string(b) + " (reference " + std::to_string(ref[size_t(i)]) + "; " +
             std::to_string(nan_count) + " NaN elements in the single-GPU y)";
    }
  }
  return "";
}

// The workspace of rank r: zero apart from the counts at its start; then the dropped count read
// (and cleared) must be `want`.
std::string check_workspace(fmlp_test::Buffer& ws, int32_t want, cudaStream_t s) {
  const std::vector<unsigned char> b = ws.download();
  for (size_t i = 0; i < b.size(); ++i)
    if (b[i] != 0 && !(i < 4 || (i >= 16 && i < 20)))  // errors at 0, dropped at 16
      return "workspace byte " + std::to_string(i) + " not zeroed";
  int32_t got = -1;
  if (fmlp_tp_moe_a2a_dropped(ws.data(), ws.size(), s, &got) != FMLP_SUCCESS)
    return fmlp_last_error();
  if (got != want)
    return "dropped count " + std::to_string(got) + ", expected " + std::to_string(want);
  for (unsigned char v : ws.download())
    if (v != 0) return "workspace not zero after reading the count";
  return "";
}

std::string a2a_check(void* const* comms, const A2aCase& ac, uint64_t seed) {
  const MoeCase& c = ac.c;
  MoeData m, fresh;
  fmlp_test::make(c, seed, &m);
  fmlp_test::make(c, seed + 1, &fresh);
  const int64_t max_tokens = *std::max_element(ac.tokens.begin(), ac.tokens.end());
  std::unique_ptr<fmlp_test::DeviceCase> dc[kRanks];
  fmlp_test::Buffer ws[kRanks];
  cudaStream_t streams[kRanks] = {};
  fmlp_moe_args_t args[kRanks];
  cudaGraphExec_t graphs[kRanks] = {};
  std::string err;
  int64_t first = 0;
  for (int r = 0; r < kRanks && err.empty(); ++r) {
    cudaSetDevice(r);
    dc[r] = std::make_unique<fmlp_test::DeviceCase>(c, m);
    fmlp_moe_args_t full = dc[r]->args();
    moe_on_device(&full, r);
    args[r] = rank_args(full, r, first, ac.tokens[size_t(r)], c.k);
    first += ac.tokens[size_t(r)];
    size_t bytes = 0;
    if (fmlp_tp_moe_a2a_workspace_size(&args[r], max_tokens, ac.capacity, r, kRanks, &bytes) !=
        FMLP_SUCCESS)
      err = "rank " + std::to_string(r) + ": " + fmlp_last_error();
    ws[r] = fmlp_test::Buffer(bytes, true);
    ws[r].fill(0);
    cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking);
  }
  std::vector<int32_t> ids = m.ids;  // the bad ids go to the devices only
  std::vector<int32_t> errors(kRanks, 0);
  for (const auto& [slot, id] : ac.bad_ids) {
    ids[size_t(slot)] = id;
    ++errors[slot / c.k < ac.tokens[0] ? 0 : 1];
  }
  for (int r = 0; r < kRanks && err.empty() && !ac.bad_ids.empty(); ++r) {
    cudaSetDevice(r);
    dc[r]->upload(m, &ids);
  }
  const auto call = [&](int r) -> std::string {
    if (fmlp_tp_moe_a2a(&args[r], max_tokens, ac.capacity, comms[r], r, kRanks, ws[r].data(),
                        ws[r].size(), streams[r]) != FMLP_SUCCESS)
      return fmlp_last_error();
    return "";
  };
  if (err.empty())
    err = on_ranks([&](int r) {
      std::string e = call(r);
      if (e.empty() && cudaStreamSynchronize(streams[r]) != cudaSuccess)
        e = std::string("device failure: ") + cudaGetErrorString(cudaGetLastError());
      return e;
    });
  std::vector<char> dropped(size_t(c.t * c.k), 0);
  std::vector<int32_t> want(kRanks, 0);
  if (ac.capacity != FMLP_TP_MOE_A2A_NO_DROP) want = drops(c, m, ac.tokens, ac.capacity, &dropped);
  std::vector<unsigned char> ys[kRanks];
  for (int r = 0; r < kRanks && err.empty(); ++r) {
    cudaSetDevice(r);
    ys[r] = dc[r]->y_bytes();
    int32_t bad = -1;
    if (fmlp_moe_device_errors(ws[r].data(), ws[r].size(), streams[r], &bad) != FMLP_SUCCESS)
      err = "rank " + std::to_string(r) + ": " + fmlp_last_error();
    else if (bad != errors[size_t(r)])
      err = "rank " + std::to_string(r) + ": bad-id count " + std::to_string(bad) + ", expected " +
            std::to_string(errors[size_t(r)]);
    else if (std::string e = check_workspace(ws[r], want[size_t(r)], streams[r]); !e.empty())
      err = "rank " + std::to_string(r) + ": " + e;
  }
  if (err.empty()) err = check_rows(ac, m, ys, dropped);
  if (err.empty() && ac.graph) {
    err = on_ranks([&](int r) -> std::string {
      if (cudaStreamBeginCapture(streams[r], cudaStreamCaptureModeThreadLocal) != cudaSuccess)
        return "begin capture failed";
      std::string e = call(r);
      cudaGraph_t g = nullptr;
      const cudaError_t end = cudaStreamEndCapture(streams[r], &g);
      if (e.empty() && end != cudaSuccess)
        e = std::string("end capture: ") + cudaGetErrorString(end) + " (a host sync inside?)";
      if (e.empty() && cudaGraphInstantiateWithFlags(&graphs[r], g, 0) != cudaSuccess)
        e = "instantiate failed";
      if (g) cudaGraphDestroy(g);
      return e;
    });
    if (ac.capacity != FMLP_TP_MOE_A2A_NO_DROP)
      want = drops(c, fresh, ac.tokens, ac.capacity, &dropped);
    for (int rep = 0; rep < 2 && err.empty(); ++rep) {  // replays see the new inputs
      for (int r = 0; r < kRanks; ++r) {
        cudaSetDevice(r);
        dc[r]->upload(fresh);
        cudaDeviceSynchronize();
      }
      for (int r = 0; r < kRanks; ++r) {  // both graphs in flight: each waits on the other
        cudaSetDevice(r);
        if (cudaGraphLaunch(graphs[r], streams[r]) != cudaSuccess) err = "graph launch failed";
      }
      for (int r = 0; r < kRanks && err.empty(); ++r) {
        cudaSetDevice(r);
        if (cudaStreamSynchronize(streams[r]) != cudaSuccess) err = "replay failed on the device";
        ys[r] = dc[r]->y_bytes();
        if (std::string e = check_workspace(ws[r], want[size_t(r)], streams[r]); !e.empty())
          err = "replay, rank " + std::to_string(r) + ": " + e;
      }
      if (err.empty())
        if (std::string e = check_rows(ac, fresh, ys, dropped); !e.empty()) err = "replay: " + e;
    }
  }
  for (int r = 0; r < kRanks; ++r) {
    cudaSetDevice(r);
    if (graphs[r]) cudaGraphExecDestroy(graphs[r]);
    if (streams[r]) cudaStreamDestroy(streams[r]);
    ws[r] = fmlp_test::Buffer();
    dc[r].reset();
  }
  cudaSetDevice(0);
  return err;
}

MoeCase base_case(int64_t t, int routing) {
  MoeCase c;
  c.t = t, c.e = 8, c.k = 2, c.d = 256, c.hidden = 264, c.d_out = 40, c.gated = true;
  c.routing = routing, c.residual = 1, c.b2 = FMLP_DTYPE_F32;
  c.xt = c.wt = FMLP_DTYPE_BF16;
  return c;
}

A2aCase split(MoeCase c, std::vector<int64_t> tokens) {
  c.t = std::accumulate(tokens.begin(), tokens.end(), int64_t(0));
  return {c, std::move(tokens)};
}

std::string run_case(void* const* comms, const A2aCase& ac, uint64_t n) {
  return a2a_check(comms, ac, fmlp_test::mix_seed(fmlp_test::test_seed(), 500 + n));
}

std::string describe(const A2aCase& ac) {
  std::string s = ac.c.name() + " tokens";
  for (int64_t t : ac.tokens) s += " " + std::to_string(t);
  return s + " capacity " + std::to_string(ac.capacity);
}

TEST_F(TpDevices, MoeA2aMatchesTheWholeOpOnConcatenatedTokens) {
  std::vector<A2aCase> cases;
  for (int routing : {0, 1}) {
    cases.push_back(split(base_case(0, routing), {1, 6}));    // a rank with one token
    cases.push_back(split(base_case(0, routing), {64, 37}));  // uneven
  }
  MoeCase in_place = base_case(0, 1);  // residual in place, no b2, a rank without tokens
  in_place.residual = 2, in_place.b2 = fmlp_test::kAbsent;
  cases.push_back(split(in_place, {0, 9}));
  MoeCase idle = base_case(0, 2);  // every slot on expert 7: rank 0's experts get no slot
  idle.d = 64, idle.hidden = 72, idle.xt = FMLP_DTYPE_F32;
  cases.push_back(split(idle, {16, 3}));
  MoeCase wide = idle;  // 64 experts, k = 8, router, dense, f16 experts
  wide.routing = 0, wide.e = 64, wide.k = 8, wide.gated = false, wide.wt = FMLP_DTYPE_F16;
  cases.push_back(split(wide, {33, 2}));
  A2aCase bad = split(base_case(0, 1), {4, 3});  // ids outside [0, 8): NaN rows, counted
  bad.bad_ids = {{1 * 2 + 1, 8}, {5 * 2 + 0, -1}};
  cases.push_back(bad);
  uint64_t n = 0;
  for (const A2aCase& ac : cases) EXPECT_EQ(run_case(comms_, ac, ++n), "") << describe(ac);
}

TEST_F(TpDevices, MoeA2aSmallCapacityDropsAndCountsTheDocumentedSlots) {
  std::vector<A2aCase> cases;
  A2aCase random = split(base_case(0, 1), {20, 12});  // given ids: the dropped set is known
  random.capacity = 9;
  cases.push_back(random);
  A2aCase one = split(base_case(0, 2), {7, 5});  // every slot to rank 1: both ranks drop
  one.capacity = 4;
  cases.push_back(one);
  uint64_t n = 100;
  for (const A2aCase& ac : cases) EXPECT_EQ(run_case(comms_, ac, ++n), "") << describe(ac);
}

TEST_F(TpDevices, MoeA2aGraphReplayRoutesTheNewInputs) {
  A2aCase router = split(base_case(0, 0), {3, 16});
  router.graph = true;
  EXPECT_EQ(run_case(comms_, router, 200), "") << describe(router);
  A2aCase capped = split(base_case(0, 1), {10, 10});
  capped.graph = true, capped.capacity = 6;
  EXPECT_EQ(run_case(comms_, capped, 201), "") << describe(capped);
}

#endif  // FMLP_TEST_WITH_CUDA

}  // namespace
