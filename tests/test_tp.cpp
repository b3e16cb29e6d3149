// Tensor-parallel mlp (include/fusedmlp/fusedmlp_nccl.h).
//
// Host, any machine: the shard views of fmlp_tp_shard_weights, run through the ref backend and
// summed, give the full op (so the split itself is right: dense, stacked and separate gate/up,
// biases, fp8 row scales, norms, residual, strided and misaligned views); bad input is refused
// with its message and nothing written.
// Devices, >= 2 GPUs with NCCL: one process drives ranks 0 and 1 (ncclCommInitAll, the calls
// grouped); every rank's reduced y is checked against the fp64 reference with the accuracy
// contract of tolerance.hpp (which also bounds its distance to the single-GPU fmlp_mlp).
// Expert-parallel moe (fmlp_tp_moe): the same, the experts split over the ranks, against the fp64
// reference and the single-GPU fmlp_moe; the shard helpers and bad input on the host.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.h"
#include "fusedmlp/fusedmlp_nccl.h"
#include "mlp_case.hpp"
#include "moe_case.hpp"
#include "tolerance.hpp"
#include "tp_fixture.hpp"

namespace {
using namespace tp_test;

// ---- host: the split itself ----

// Sum over ranks of the ref backend on each shard (residual on rank 0 only, as fmlp_tp_mlp does).
void check_split_on_host(const MlpCase& c, int size) {
  SCOPED_TRACE(c.name() + " size " + std::to_string(size));
  const CaseData data = fmlp_test::make_data(c, c.data_seed);
  const Reference ref = fmlp_test::reference(c, data);
  PlacedCase p(c, false);
  std::vector<double> sum(size_t(c.m * c.d_out), 0.0);
  for (int r = 0; r < size; ++r) {
    p.upload(data);
    fmlp_mlp_args_t a = p.args();
    ASSERT_EQ(fmlp_tp_shard_weights(&p.args().weights, &a.config, r, size, &a.weights),
              FMLP_SUCCESS)
        << fmlp_last_error();
    EXPECT_EQ(a.weights.w2.shape[1], c.hidden / size);
    EXPECT_EQ(a.weights.b2.data != nullptr, r == 0);  // b2 is added once, by rank 0
    if (r != 0) a.residual = fmlp_tensor_none();
    size_t bytes = 0;
    ASSERT_EQ(fmlp_mlp_workspace_size(&a, FMLP_BACKEND_REF, &bytes), FMLP_SUCCESS)
        << fmlp_last_error();
    std::vector<unsigned char> ws(bytes);
    ASSERT_EQ(fmlp_mlp(&a, FMLP_BACKEND_REF, ws.data(), bytes, nullptr), FMLP_SUCCESS)
        << fmlp_last_error();
    std::string stray;
    const std::vector<double> part = p.download_y(&stray);
    EXPECT_EQ(stray, "");
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  }
  // f32 partials: one more f32 rounding per rank, far inside the f32 budget (1e-4).
  const fmlp_test::CompareOutcome out = fmlp_test::compare(c, sum, ref);
  EXPECT_TRUE(out.ok) << out.bad << " bad elements; " << out.detail;
}

TEST(TpShard, SumOfShardsIsTheFullOp) {
  for (Gate g : {Gate::kDense, Gate::kStacked, Gate::kSeparate})
    for (int size : {1, 2, 4}) {
      MlpCase c = tp_case(g, FMLP_DTYPE_F32, FMLP_DTYPE_F32, 5);
      c.hidden = 64;
      c.d_in = 24;
      c.d_out = 40;
      c.residual = Residual::kSeparate;
      c.norm = FMLP_NORM_LAYERNORM;
      c.beta = FMLP_DTYPE_F16;
      c.strided = g == Gate::kSeparate;
      c.misaligned = g == Gate::kDense;
      fmlp_test::normalize(&c);
      check_split_on_host(c, size);
    }
}

TEST(TpShard, Fp8ScalesFollowTheirRows) {
  for (Gate g : {Gate::kStacked, Gate::kSeparate, Gate::kDense})
    for (bool per_row : {true, false}) {
      MlpCase c = tp_case(g, FMLP_DTYPE_F32, FMLP_DTYPE_F8_E4M3, 3);
      c.hidden = 32;
      c.d_in = 16;
      c.d_out = 24;
      c.per_row_scale = per_row;
      c.residual = Residual::kNone;
      fmlp_test::normalize(&c);
      check_split_on_host(c, 2);
    }
}

TEST(TpBadInput, ShardWeights) {
  Small s;
  fmlp_mlp_weights_t out{};
  const fmlp_mlp_config_t& cfg = s.args.config;
  expect_error(fmlp_tp_shard_weights(nullptr, &cfg, 0, 2, &out), FMLP_ERROR_NULL_POINTER, "full");
  expect_error(fmlp_tp_shard_weights(&s.args.weights, nullptr, 0, 2, &out), FMLP_ERROR_NULL_POINTER,
               "config");
  expect_error(fmlp_tp_shard_weights(&s.args.weights, &cfg, 0, 2, nullptr), FMLP_ERROR_NULL_POINTER,
               "shard");
  expect_error(fmlp_tp_shard_weights(&s.args.weights, &cfg, 0, 0, &out), FMLP_ERROR_INVALID_VALUE,
               "size is 0");
  expect_error(fmlp_tp_shard_weights(&s.args.weights, &cfg, 2, 2, &out), FMLP_ERROR_INVALID_VALUE,
               "rank is 2; expected 0 <= rank < size = 2");
  expect_error(fmlp_tp_shard_weights(&s.args.weights, &cfg, -1, 2, &out), FMLP_ERROR_INVALID_VALUE,
               "rank is -1");
  // hidden 16 splits over 2 ranks (8 each) but not over 4: pad to 32.
  EXPECT_EQ(fmlp_tp_shard_weights(&s.args.weights, &cfg, 1, 2, &out), FMLP_SUCCESS);
  expect_error(fmlp_tp_shard_weights(&s.args.weights, &cfg, 1, 4, &out), FMLP_ERROR_SHAPE_MISMATCH,
               "pad hidden to 32");
  // Invalid weights are reported by the mlp validation.
  fmlp_mlp_weights_t bad = s.args.weights;
  bad.w2 = fmlp_tensor_2d(s.w2, FMLP_DTYPE_F32, 4, 8, 8);
  expect_error(fmlp_tp_shard_weights(&bad, &cfg, 0, 2, &out), FMLP_ERROR_SHAPE_MISMATCH,
               "weights.w2");
}

TEST(TpBadInput, RunAndCommunicators) {
  Small s;
  int dummy = 0;
  void* fake_comm = &dummy;  // never dereferenced: every case fails before the comm is queried
  const bool have = fmlp_tp_available() == FMLP_SUCCESS;
  if (!have) {
    const std::string why = fmlp_last_error();
    EXPECT_NE(why.find("tensor parallel"), std::string::npos) << why;
    expect_error(fmlp_tp_mlp(&s.args, fake_comm, 0, 2, FMLP_TP_ALL_REDUCE, FMLP_BACKEND_AUTO,
                             nullptr, 0, nullptr),
                 FMLP_ERROR_BACKEND_UNAVAILABLE, "tensor parallel");
    void* c = nullptr;
    expect_error(fmlp_tp_comm_init_from_file("/tmp/x", 0, 2, 0, &c), FMLP_ERROR_BACKEND_UNAVAILABLE,
                 "tensor parallel");
    EXPECT_TRUE(s.y_untouched());
    GTEST_SKIP() << "NCCL unavailable, only the BACKEND_UNAVAILABLE answers checked: " << why;
  }
  expect_error(fmlp_tp_mlp(nullptr, fake_comm, 0, 2, FMLP_TP_ALL_REDUCE, FMLP_BACKEND_AUTO, nullptr,
                           0, nullptr),
               FMLP_ERROR_NULL_POINTER, "shard_args");
  expect_error(fmlp_tp_mlp(&s.args, nullptr, 0, 2, FMLP_TP_ALL_REDUCE, FMLP_BACKEND_AUTO, nullptr,
                           0, nullptr),
               FMLP_ERROR_NULL_POINTER, "comm is NULL");
  expect_error(fmlp_tp_mlp(&s.args, fake_comm, 3, 2, FMLP_TP_ALL_REDUCE, FMLP_BACKEND_AUTO, nullptr,
                           0, nullptr),
               FMLP_ERROR_INVALID_VALUE, "rank is 3");
  expect_error(fmlp_tp_mlp(&s.args, fake_comm, 0, 2, FMLP_TP_ALL_REDUCE, FMLP_BACKEND_AUTO, nullptr,
                           0, nullptr),
               FMLP_ERROR_DEVICE_MISMATCH, "needs CUDA device memory");
  fmlp_mlp_args_t wrong = s.args;
  wrong.x = fmlp_tensor_2d(s.x, FMLP_DTYPE_F32, 2, 3, 3);
  expect_error(fmlp_tp_mlp(&wrong, fake_comm, 0, 2, FMLP_TP_ALL_REDUCE, FMLP_BACKEND_AUTO, nullptr,
                           0, nullptr),
               FMLP_ERROR_SHAPE_MISMATCH, "x");
  expect_error(fmlp_tp_mlp_packed(nullptr, &s.args.y, &s.args.x, nullptr, fake_comm, 0, 2,
                                  FMLP_TP_ALL_REDUCE, nullptr, 0, nullptr),
               FMLP_ERROR_NULL_POINTER, "shard");
  EXPECT_TRUE(s.y_untouched());

  void* c = nullptr;
  expect_error(fmlp_tp_comm_init_from_file(nullptr, 0, 2, 0, &c), FMLP_ERROR_NULL_POINTER, "path");
  expect_error(fmlp_tp_comm_init_from_file("/tmp/x", 0, 2, 0, nullptr), FMLP_ERROR_NULL_POINTER,
               "comm");
  expect_error(fmlp_tp_comm_init_from_file("/tmp/x", 2, 2, 0, &c), FMLP_ERROR_INVALID_VALUE,
               "rank is 2");
  const fmlp_status_t st = fmlp_tp_comm_init_from_file("/tmp/x", 0, 2, 999, &c);
  EXPECT_TRUE(st == FMLP_ERROR_INVALID_VALUE || st == FMLP_ERROR_BACKEND_UNAVAILABLE)
      << fmlp_status_name(st);
  EXPECT_NE(std::string(fmlp_last_error()).find("999"), std::string::npos) << fmlp_last_error();
  const int32_t devs[2] = {0, 0};
  void* comms[2] = {};
  const fmlp_status_t st2 = fmlp_tp_comm_init_all(2, devs, comms);
  EXPECT_TRUE(st2 == FMLP_ERROR_INVALID_VALUE || st2 == FMLP_ERROR_BACKEND_UNAVAILABLE)
      << fmlp_status_name(st2) << ": " << fmlp_last_error();
  EXPECT_EQ(comms[0], nullptr);
  EXPECT_EQ(fmlp_tp_comm_destroy(nullptr), FMLP_SUCCESS);
}

// ---- expert-parallel moe, host: the split helpers ----

TEST(TpMoeShard, ExpertRangesPartitionTheExperts) {
  for (int32_t g : {1, 2, 7, 8, 64, 257})
    for (int32_t size : {1, 2, 3, 8}) {
      if (g < size) continue;
      int32_t next = 0;
      for (int32_t r = 0; r < size; ++r) {
        int32_t first = -1, count = -1;
        ASSERT_EQ(fmlp_tp_expert_range(g, r, size, &first, &count), FMLP_SUCCESS)
            << fmlp_last_error();
        EXPECT_EQ(first, next);
        EXPECT_TRUE(count == g / size || count == g / size + 1) << g << " " << size;
        next = first + count;
      }
      EXPECT_EQ(next, g);
    }
}

// Sum over ranks of the ref backend on each rank's fmlp_tp_shard_moe args = the whole op (f32:
// the extra roundings of P partials are far inside the f32 budget).
TEST(TpMoeShard, SumOfShardsIsTheWholeOp) {
  for (int routing : {0, 1, 2})
    for (int32_t size : {1, 2, 3, 8}) {
      fmlp_test::MoeCase c;
      c.t = 9, c.e = 8, c.k = 2, c.d = 24, c.hidden = 40, c.d_out = 16, c.routing = routing;
      c.gated = routing != 1, c.b1 = fmlp_test::kAbsent, c.b2 = FMLP_DTYPE_F32;
      c.residual = routing == 2 ? 2 : 1;
      SCOPED_TRACE(c.name() + " size " + std::to_string(size));
      fmlp_test::MoeData m;
      fmlp_test::make(c, 41 + uint64_t(routing), &m);
      const std::vector<double> residual = fmlp_test::residual_of(c, m);
      const std::vector<unsigned char> y0 = m.y.bytes;
      std::vector<double> sum(size_t(c.t * c.d_out), 0.0);
      for (int32_t r = 0; r < size; ++r) {
        m.y.bytes = y0;
        fmlp_moe_args_t a{};
        ASSERT_EQ(fmlp_tp_shard_moe(&m.args, r, size, &a), FMLP_SUCCESS) << fmlp_last_error();
        EXPECT_EQ(a.config.global_experts, 8);
        EXPECT_EQ(a.residual.data != nullptr, r == 0);  // the residual is added once
        size_t bytes = 0;
        ASSERT_EQ(fmlp_moe_workspace_size(&a, FMLP_BACKEND_REF, &bytes), FMLP_SUCCESS);
        std::vector<unsigned char> ws(bytes);
        ASSERT_EQ(fmlp_moe(&a, FMLP_BACKEND_REF, ws.data(), bytes, nullptr), FMLP_SUCCESS)
            << fmlp_last_error();
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += m.y.get(int64_t(i));
      }
      for (size_t i = 0; i < sum.size(); ++i) m.y.set(int64_t(i), sum[i]);
      EXPECT_EQ(fmlp_test::check_y(c, m, residual, {}), "");
    }
}

TEST(TpBadInput, MoeHelpersAndRun) {
  int32_t first = 0, count = 0;
  expect_error(fmlp_tp_expert_range(8, 2, 2, &first, &count), FMLP_ERROR_INVALID_VALUE,
               "rank is 2");
  expect_error(fmlp_tp_expert_range(1, 0, 2, &first, &count), FMLP_ERROR_INVALID_VALUE,
               "global_experts is 1 for 2 ranks");
  expect_error(fmlp_tp_expert_range(8, 0, 2, nullptr, &count), FMLP_ERROR_NULL_POINTER, "first");
  fmlp_test::MoeCase c;
  c.t = 3, c.e = 4, c.k = 2;
  fmlp_test::MoeData m;
  fmlp_test::make(c, 5, &m);
  fmlp_moe_args_t local{};
  expect_error(fmlp_tp_shard_moe(nullptr, 0, 2, &local), FMLP_ERROR_NULL_POINTER, "full");
  expect_error(fmlp_tp_shard_moe(&m.args, 0, 2, nullptr), FMLP_ERROR_NULL_POINTER, "local");
  expect_error(fmlp_tp_shard_moe(&m.args, 0, 8, &local), FMLP_ERROR_INVALID_VALUE,
               "global_experts is 4 for 8 ranks");
  fmlp_moe_args_t ranged = m.args;
  ranged.config.first_expert = 1;
  expect_error(fmlp_tp_shard_moe(&ranged, 0, 2, &local), FMLP_ERROR_INVALID_VALUE,
               "already holds a range");
  fmlp_moe_args_t wrong = m.args;
  wrong.router_w.shape[0] = 3;
  expect_error(fmlp_tp_shard_moe(&wrong, 0, 2, &local), FMLP_ERROR_SHAPE_MISMATCH, "router_w");

  const std::vector<unsigned char> before = m.y.bytes;
  int dummy = 0;
  void* fake_comm = &dummy;  // never dereferenced: every case fails before the comm is queried
  ASSERT_EQ(fmlp_tp_shard_moe(&m.args, 0, 2, &local), FMLP_SUCCESS) << fmlp_last_error();
  if (fmlp_tp_available() != FMLP_SUCCESS) {
    expect_error(fmlp_tp_moe(&local, fake_comm, 0, 2, nullptr, 0, nullptr),
                 FMLP_ERROR_BACKEND_UNAVAILABLE, "tensor parallel");
    EXPECT_EQ(m.y.bytes, before);
    GTEST_SKIP() << "NCCL unavailable, only the BACKEND_UNAVAILABLE answer checked";
  }
  expect_error(fmlp_tp_moe(nullptr, fake_comm, 0, 2, nullptr, 0, nullptr), FMLP_ERROR_NULL_POINTER,
               "local_args");
  expect_error(fmlp_tp_moe(&local, fake_comm, 2, 2, nullptr, 0, nullptr), FMLP_ERROR_INVALID_VALUE,
               "rank is 2");
  expect_error(fmlp_tp_moe(&local, nullptr, 0, 2, nullptr, 0, nullptr), FMLP_ERROR_NULL_POINTER,
               "comm is NULL");
  expect_error(fmlp_tp_moe(&local, fake_comm, 0, 2, nullptr, 0, nullptr),
               FMLP_ERROR_DEVICE_MISMATCH, "expert-parallel moe needs CUDA device memory");
  fmlp_moe_args_t bad = local;
  bad.config.top_k = 9;
  expect_error(fmlp_tp_moe(&bad, fake_comm, 0, 2, nullptr, 0, nullptr), FMLP_ERROR_INVALID_VALUE,
               "top_k is 9");
  EXPECT_EQ(m.y.bytes, before);
}

// ---- devices: two ranks driven by one process ----

#ifdef FMLP_TEST_WITH_CUDA

TEST_F(TpDevices, AllReduceMatchesReference) {
  for (fmlp_dtype_t t : {FMLP_DTYPE_BF16, FMLP_DTYPE_F32})
    for (Gate g : {Gate::kDense, Gate::kStacked, Gate::kSeparate})
      for (int64_t m : {1, 7, 64, 300}) {
        const MlpCase c = tp_case(g, t, t, m);
        SCOPED_TRACE(c.name());
        const Reference ref = fmlp_test::reference(c, fmlp_test::make_data(c, c.data_seed));
        const std::vector<std::vector<double>> ys = run(c, FMLP_TP_ALL_REDUCE);
        for (int r = 0; r < kRanks; ++r) {
          const fmlp_test::CompareOutcome out =
              fmlp_test::compare(c, ys[size_t(r)], ref, kTpComposed);
          EXPECT_TRUE(out.ok) << "rank " << r << ": " << out.bad << " bad; " << out.detail;
        }
      }
}

TEST_F(TpDevices, ReduceScatterGivesEachRankItsRows) {
  for (int64_t m : {2, 64, 300}) {
    const MlpCase c = tp_case(Gate::kStacked, FMLP_DTYPE_BF16, FMLP_DTYPE_BF16, m);
    SCOPED_TRACE(c.name());
    const Reference ref = fmlp_test::reference(c, fmlp_test::make_data(c, c.data_seed));
    const std::vector<std::vector<double>> ys = run(c, FMLP_TP_REDUCE_SCATTER);
    std::vector<double> owned(size_t(c.m * c.d_out));
    const int64_t rows = c.m / kRanks;
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t o = 0; o < c.d_out; ++o)
        owned[size_t(i * c.d_out + o)] = ys[size_t(i / rows)][size_t(i * c.d_out + o)];
    const fmlp_test::CompareOutcome out = fmlp_test::compare(c, owned, ref, kTpComposed);
    EXPECT_TRUE(out.ok) << out.bad << " bad; " << out.detail;
  }
}

TEST_F(TpDevices, MismatchedRankOrDeviceIsRefused) {
  const MlpCase c = tp_case(Gate::kDense, FMLP_DTYPE_BF16, FMLP_DTYPE_BF16, 4);
  EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
  PlacedCase p(c, true);
  p.upload(fmlp_test::make_data(c, c.data_seed));
  fmlp_mlp_args_t a = p.args();
  ASSERT_EQ(fmlp_tp_shard_weights(&a.weights, &a.config, 0, kRanks, &a.weights), FMLP_SUCCESS);
  // comm of rank 1 with rank 0's claim, then rank 0's comm with tensors said to be on cuda:1.
  expect_error(fmlp_tp_mlp(&a, comms_[1], 0, kRanks, FMLP_TP_ALL_REDUCE, FMLP_BACKEND_CUDA, nullptr,
                           0, nullptr),
               FMLP_ERROR_INVALID_VALUE, "but comm is rank 1 of 2");
  fmlp_mlp_args_t moved = a;
  on_device(&moved, 1);
  expect_error(fmlp_tp_mlp(&moved, comms_[0], 0, kRanks, FMLP_TP_ALL_REDUCE, FMLP_BACKEND_CUDA,
                           nullptr, 0, nullptr),
               FMLP_ERROR_DEVICE_MISMATCH, "comm (rank 0) is on cuda:0");
  fmlp_mlp_args_t odd = a;  // 3 rows do not scatter over 2 ranks
  odd.x.shape[0] = odd.y.shape[0] = odd.residual.shape[0] = 3;
  expect_error(fmlp_tp_mlp(&odd, comms_[0], 0, kRanks, FMLP_TP_REDUCE_SCATTER, FMLP_BACKEND_CUDA,
                           nullptr, 0, nullptr),
               FMLP_ERROR_SHAPE_MISMATCH, "multiple of size");
  std::string stray;
  const std::vector<double> y = p.download_y(&stray);
  EXPECT_EQ(stray, "");
  for (double v : y) EXPECT_TRUE(std::isnan(v)) << "y was written";  // still the 0xFF poison
}

void moe_on_device(fmlp_moe_args_t* a, int dev) {
  for (fmlp_tensor_t* t :
       {&a->x, &a->y, &a->residual, &a->router_w, &a->router_b, &a->w1, &a->b1, &a->w2, &a->b2})
    if (t->data != nullptr) t->device_id = dev;
}

// The moe case through fmlp_tp_moe on both ranks (the same data on each, its experts split) and
// through fmlp_moe on device 0. "" or the failure.
std::string tp_moe_check(void* const* comms, const fmlp_test::MoeCase& c, uint64_t seed) {
  using fmlp_test::Buffer;
  constexpr int kRanks = 2;
  fmlp_test::MoeData m;
  fmlp_test::make(c, seed, &m);
  const std::vector<double> residual = fmlp_test::residual_of(c, m);
  std::unique_ptr<fmlp_test::DeviceCase> dc[kRanks];
  Buffer ws[kRanks];
  cudaStream_t streams[kRanks];
  fmlp_moe_args_t args[kRanks];
  std::string err;
  for (int r = 0; r < kRanks && err.empty(); ++r) {
    cudaSetDevice(r);
    dc[r] = std::make_unique<fmlp_test::DeviceCase>(c, m);
    fmlp_moe_args_t full = dc[r]->args();
    moe_on_device(&full, r);
    size_t bytes = 0;
    if (fmlp_tp_shard_moe(&full, r, kRanks, &args[r]) != FMLP_SUCCESS ||
        fmlp_tp_moe_workspace_size(&args[r], r, &bytes) != FMLP_SUCCESS)
      err = "rank " + std::to_string(r) + ": " + fmlp_last_error();
    ws[r] = Buffer(bytes, true);
    ws[r].init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
    cudaStreamCreate(&streams[r]);
  }
  if (!err.empty()) return err;
  fmlp_tp_group_start();
  for (int r = 0; r < kRanks; ++r)
    if (fmlp_tp_moe(&args[r], comms[r], r, kRanks, ws[r].data(), ws[r].size(), streams[r]) !=
            FMLP_SUCCESS &&
        err.empty())
      err = "rank " + std::to_string(r) + ": " + fmlp_last_error();
  if (fmlp_tp_group_end() != FMLP_SUCCESS && err.empty()) err = fmlp_last_error();
  std::vector<unsigned char> ys[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    cudaSetDevice(r);
    if (cudaStreamSynchronize(streams[r]) != cudaSuccess && err.empty())
      err = "rank " + std::to_string(r) + " failed on the device";
    cudaStreamDestroy(streams[r]);
    ys[r] = dc[r]->y_bytes();
    const std::vector<unsigned char> left = ws[r].download();
    if (fmlp_test::first_nonzero_in_zeroed_part(left) != left.size() && err.empty())
      err = "rank " + std::to_string(r) + ": the workspace's zeroed part not left zero";
    ws[r] = Buffer();
    dc[r].reset();
  }
  cudaSetDevice(0);
  if (!err.empty()) return err;
  // The single-GPU op on device 0.
  fmlp_test::DeviceCase one(c, m);
  size_t bytes = 0;
  if (fmlp_moe_workspace_size(&one.args(), FMLP_BACKEND_CUDA, &bytes) != FMLP_SUCCESS)
    return fmlp_last_error();
  Buffer ws1(bytes, true);
  ws1.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
  if (fmlp_moe(&one.args(), FMLP_BACKEND_CUDA, ws1.data(), bytes, nullptr) != FMLP_SUCCESS)
    return std::string("single gpu: ") + fmlp_last_error();
  fmlp_test::MoeData single = m;  // only its y bytes are used
  single.y.bytes = one.y_bytes();
  // Every rank's y within the contract of the fp64 reference, and so within twice that bound of
  // the single-GPU y (which is checked against the same reference).
  std::vector<double> ref, scale;
  std::vector<char> tie;
  fmlp_test::reference(c, m, residual, &ref, &scale, &tie);
  const double rtol = fmlp_test::mlp_rtol(c.xt, c.wt);
  const bool router = c.routing == 0;
  if (std::string e = fmlp_test::check_y(c, single, residual, {}, router); !e.empty())
    return "single gpu: " + e;
  for (int r = 0; r < kRanks; ++r) {
    fmlp_test::MoeData got = m;
    got.y.bytes = ys[r];
    if (!got.y.guard_intact()) return "rank " + std::to_string(r) + ": bytes after y written";
    if (std::string e = fmlp_test::check_y(c, got, residual, {}, router); !e.empty())
      return "rank " + std::to_string(r) + " vs reference: " + e;
    for (int64_t i = 0; i < c.t * c.d_out; ++i) {
      if (router && tie[size_t(i / c.d_out)]) continue;
      const double a = got.y.get(i), b = single.y.get(i);
      const double tol =
          2 * (rtol * (std::fabs(ref[size_t(i)]) + scale[size_t(i)]) + fmlp_test::dtype_atol(c.xt));
      if (!(std::fabs(a - b) <= tol))
        return "rank " + std::to_string(r) + " y[" + std::to_string(i) +
               "] = " + std::to_string(a) + ", single gpu " + std::to_string(b);
    }
  }
  return "";
}

TEST_F(TpDevices, MoeMatchesSingleGpuAndReference) {
  std::vector<fmlp_test::MoeCase> cases;
  for (int64_t t : {1, 7, 64, 300})
    for (int routing : {0, 1}) {
      fmlp_test::MoeCase c;
      c.t = t, c.e = 8, c.k = 2, c.d = 256, c.hidden = 264, c.d_out = 40, c.gated = true;
      c.routing = routing, c.residual = t % 2 ? 2 : 1, c.b2 = FMLP_DTYPE_F32;
      c.xt = c.wt = FMLP_DTYPE_BF16;
      cases.push_back(c);
    }
  fmlp_test::MoeCase idle;  // every slot on expert 7: rank 0 holds no token's expert
  idle.t = 16, idle.e = 8, idle.k = 2, idle.d = 64, idle.hidden = 72, idle.d_out = 40;
  idle.routing = 2, idle.residual = 1, idle.xt = FMLP_DTYPE_F32, idle.wt = FMLP_DTYPE_BF16;
  cases.push_back(idle);
  fmlp_test::MoeCase wide = idle;  // 64 experts, k = 8, dense, f16
  wide.routing = 0, wide.e = 64, wide.k = 8, wide.t = 33, wide.wt = FMLP_DTYPE_F16;
  cases.push_back(wide);
  uint64_t n = 0;
  for (const fmlp_test::MoeCase& c : cases)
    EXPECT_EQ(tp_moe_check(comms_, c, fmlp_test::mix_seed(fmlp_test::test_seed(), 300 + ++n)), "")
        << c.name();
}

#endif  // FMLP_TEST_WITH_CUDA

}  // namespace
