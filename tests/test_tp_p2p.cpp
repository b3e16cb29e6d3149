// The one-shot LL p2p all-reduce of the tensor-parallel ops (fmlp_tp_all_reduce, fmlp_tp_p2p_*):
// bad input on any machine; on >= 2 GPUs with NCCL, its sums against NCCL's and the host's,
// fallbacks, the environment switch, back-to-back calls, graph replay and per-rank setup.
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

TEST(TpBadInput, P2pAndAllReduce) {
  Small s;
  int dummy = 0;
  void* fake_comm = &dummy;  // never dereferenced: every case fails before the comm is queried
  if (fmlp_tp_available() != FMLP_SUCCESS) {
    expect_error(fmlp_tp_all_reduce(&s.args.y, fake_comm, 0, 2, nullptr),
                 FMLP_ERROR_BACKEND_UNAVAILABLE, "tensor parallel");
    expect_error(fmlp_tp_p2p_init(fake_comm, 0, 2, 1024), FMLP_ERROR_BACKEND_UNAVAILABLE,
                 "tensor parallel");
    GTEST_SKIP() << "NCCL unavailable, only the BACKEND_UNAVAILABLE answers checked";
  }
  expect_error(fmlp_tp_all_reduce(nullptr, fake_comm, 0, 2, nullptr), FMLP_ERROR_NULL_POINTER,
               "y is NULL");
  expect_error(fmlp_tp_all_reduce(&s.args.y, fake_comm, 0, 2, nullptr), FMLP_ERROR_DEVICE_MISMATCH,
               "needs CUDA device memory");
  const fmlp_tensor_t f8 = fmlp_tensor_1d(s.y, FMLP_DTYPE_F8_E4M3, 8);
  expect_error(fmlp_tp_all_reduce(&f8, fake_comm, 0, 2, nullptr), FMLP_ERROR_DTYPE_MISMATCH,
               "f32, f16 or bf16");
  fmlp_tensor_t strided = s.args.y;
  strided.shape[1] = 2;  // rows of 2 columns, 4 apart
  expect_error(fmlp_tp_all_reduce(&strided, fake_comm, 0, 2, nullptr), FMLP_ERROR_BAD_STRIDE,
               "contiguous");
  expect_error(fmlp_tp_p2p_init(nullptr, 0, 2, 1024), FMLP_ERROR_NULL_POINTER, "comm is NULL");
  expect_error(fmlp_tp_p2p_init(fake_comm, 2, 2, 1024), FMLP_ERROR_INVALID_VALUE, "rank is 2");
  expect_error(fmlp_tp_p2p_init(fake_comm, 0, 2, 0), FMLP_ERROR_INVALID_VALUE, "max_bytes is 0");
  expect_error(fmlp_tp_p2p_init_all(2, nullptr, 1024), FMLP_ERROR_NULL_POINTER, "comms");
  size_t cap = 1;
  const char* about = nullptr;
  EXPECT_EQ(fmlp_tp_p2p_query(fake_comm, &cap, &about), FMLP_SUCCESS);
  EXPECT_EQ(cap, 0u);
  EXPECT_NE(std::string(about).find("no p2p registration"), std::string::npos) << about;
  EXPECT_EQ(fmlp_tp_p2p_destroy(fake_comm), FMLP_SUCCESS);  // not registered: nothing to do
  EXPECT_EQ(fmlp_tp_p2p_destroy(nullptr), FMLP_SUCCESS);
  EXPECT_TRUE(s.y_untouched());
}

#ifdef FMLP_TEST_WITH_CUDA

// ---- devices: the one-shot LL p2p all-reduce (fmlp_tp_all_reduce, fmlp_tp_p2p_*) ----

std::vector<unsigned char> encode(const std::vector<float>& v, fmlp_dtype_t t) {
  const size_t es = fmlp::dtype_size(t);
  std::vector<unsigned char> b(v.size() * es);
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == FMLP_DTYPE_F32) {
      std::memcpy(&b[i * es], &v[i], 4);
    } else {
      const uint16_t h =
          t == FMLP_DTYPE_BF16 ? fmlp::float_to_bf16(v[i]) : fmlp::float_to_f16(v[i]);
      std::memcpy(&b[i * es], &h, 2);
    }
  }
  return b;
}

float decode_one(const unsigned char* p, fmlp_dtype_t t) {
  if (t == FMLP_DTYPE_F32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == FMLP_DTYPE_BF16 ? fmlp::bf16_to_float(h) : fmlp::f16_to_float(h);
}

float round_to(float v, fmlp_dtype_t t) {
  return decode_one(encode({v}, t).data(), t);
}

// Unit roundoff of the dtype: a correctly rounded sum is within it (relative) of the exact one.
double unit_roundoff(fmlp_dtype_t t) {
  return t == FMLP_DTYPE_BF16 ? 0x1p-8 : t == FMLP_DTYPE_F16 ? 0x1p-11 : 0x1p-24;
}

class TpP2p : public TpDevices {
 protected:
  // One tensor of n elements per rank, on the rank's device, `offset` elements past a 256-byte
  // boundary (ranks may differ: the kernel's chunking must not depend on a rank's alignment).
  struct Ranked {
    fmlp_test::Buffer buf[kRanks];
    fmlp_tensor_t t[kRanks];
  };

  void SetUp() override {
    TpDevices::SetUp();
    if (IsSkipped()) return;
    size_t cap = 0;
    const char* about = "";
    ASSERT_EQ(fmlp_tp_p2p_query(comms_[0], &cap, &about), FMLP_SUCCESS) << fmlp_last_error();
    if (cap == 0) GTEST_SKIP() << "p2p all-reduce off here: " << about;
    EXPECT_EQ(cap, FMLP_TP_P2P_DEFAULT_MAX_BYTES) << about;
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      ASSERT_EQ(cudaStreamCreate(&streams_[r]), cudaSuccess);
    }
  }
  void TearDown() override {
    if (!skip_.empty()) return;  // no devices
    for (int r = 0; r < kRanks; ++r)
      if (streams_[r] != nullptr) {
        EXPECT_EQ(cudaSetDevice(r), cudaSuccess);
        EXPECT_EQ(cudaStreamDestroy(streams_[r]), cudaSuccess);
      }
    unsetenv("FMLP_TP_P2P");
    // The default registration for the next test.
    EXPECT_EQ(fmlp_tp_p2p_init_all(kRanks, comms_, FMLP_TP_P2P_DEFAULT_MAX_BYTES), FMLP_SUCCESS)
        << fmlp_last_error();
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
  }

  // Random values of dtype t in [-2, 2), different per rank.
  static std::vector<float> random_values(fmlp_dtype_t t, int64_t n, uint64_t seed) {
    std::mt19937_64 gen(fmlp_test::mix_seed(fmlp_test::test_seed(), seed));
    std::uniform_real_distribution<float> u(-2.f, 2.f);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = round_to(u(gen), t);
    return v;
  }

  static void make(Ranked* y, fmlp_dtype_t t, const std::vector<float> (&vals)[kRanks],
                   const int64_t (&offset)[kRanks]) {
    const size_t es = fmlp::dtype_size(t);
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      const std::vector<unsigned char> bytes = encode(vals[r], t);
      y->buf[r] = fmlp_test::Buffer(bytes.size() + size_t(offset[r]) * es, true);
      char* p = y->buf[r].bytes_at(size_t(offset[r]) * es);
      ASSERT_EQ(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the DMA may land after cudaMemcpy returns
      y->t[r] = fmlp_tensor_1d(p, t, int64_t(vals[r].size()));
      y->t[r].device_type = FMLP_DEVICE_CUDA;
      y->t[r].device_id = r;
    }
  }

  // Both ranks' all-reduce of y, enqueued (grouped: the NCCL path needs it), not synchronised.
  void enqueue(Ranked& y) {
    ASSERT_EQ(fmlp_tp_group_start(), FMLP_SUCCESS);
    for (int r = 0; r < kRanks; ++r)
      EXPECT_EQ(fmlp_tp_all_reduce(&y.t[r], comms_[r], r, kRanks, streams_[r]), FMLP_SUCCESS)
          << "rank " << r << ": " << fmlp_last_error();
    ASSERT_EQ(fmlp_tp_group_end(), FMLP_SUCCESS) << fmlp_last_error();
  }

  // Captures the all-reduce of every y (in order) into one graph per rank and replays it
  // `replays` times on every rank, then synchronises.
  void replay_graph(std::vector<Ranked>& ys, int replays) {
    cudaGraphExec_t exec[kRanks] = {};
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      cudaGraph_t g;
      ASSERT_EQ(cudaStreamBeginCapture(streams_[r], cudaStreamCaptureModeThreadLocal), cudaSuccess);
      for (Ranked& y : ys)
        EXPECT_EQ(fmlp_tp_all_reduce(&y.t[r], comms_[r], r, kRanks, streams_[r]), FMLP_SUCCESS)
            << fmlp_last_error();
      ASSERT_EQ(cudaStreamEndCapture(streams_[r], &g), cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&exec[r], g, 0), cudaSuccess);
      ASSERT_EQ(cudaGraphDestroy(g), cudaSuccess);
    }
    for (int i = 0; i < replays; ++i)
      for (int r = 0; r < kRanks; ++r) {
        ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
        ASSERT_EQ(cudaGraphLaunch(exec[r], streams_[r]), cudaSuccess);
      }
    sync();
    for (int r = 0; r < kRanks; ++r) EXPECT_EQ(cudaGraphExecDestroy(exec[r]), cudaSuccess);
  }

  void sync() {
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(streams_[r]), cudaSuccess);
    }
  }

  static std::vector<unsigned char> download(const Ranked& y, int r) {
    std::vector<unsigned char> h(size_t(y.t[r].shape[0]) * fmlp::dtype_size(y.t[r].dtype));
    EXPECT_EQ(cudaSetDevice(r), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), y.t[r].data, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

  // Every rank holds bitwise `want` (the fp32 sum in rank order, rounded once, maybe scaled).
  static void expect_bitwise(const Ranked& y, const std::vector<float>& want) {
    const fmlp_dtype_t t = y.t[0].dtype;
    const std::vector<unsigned char> w = encode(want, t);
    for (int r = 0; r < kRanks; ++r) {
      const std::vector<unsigned char> got = download(y, r);
      const size_t es = fmlp::dtype_size(t);
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < want.size(); ++i)
        if (std::memcmp(&got[i * es], &w[i * es], es) != 0 && bad++ == 0) first = i;
      EXPECT_EQ(bad, 0u) << "rank " << r << ", " << fmlp_dtype_name(t) << " n " << want.size()
                         << ": first at " << first << " got " << decode_one(&got[first * es], t)
                         << " want " << want[first];
    }
  }

  static std::vector<float> rank_order_sum(const std::vector<float> (&vals)[kRanks],
                                           fmlp_dtype_t t) {
    std::vector<float> s(vals[0].size());
    for (size_t i = 0; i < s.size(); ++i) {
      float acc = vals[0][i];
      for (int r = 1; r < kRanks; ++r) acc += vals[r][i];
      s[i] = round_to(acc, t);
    }
    return s;
  }

  static size_t max_elems(fmlp_dtype_t t) {
    return FMLP_TP_P2P_DEFAULT_MAX_BYTES / fmlp::dtype_size(t);
  }

  // The sum through the registration in place now: bitwise the rank-order sum when p2p takes
  // it; within one rounding of the exact sum otherwise (NCCL sums in its own order).
  void check_sum(fmlp_dtype_t t, int64_t n, bool p2p, const int64_t (&offset)[kRanks]) {
    SCOPED_TRACE(std::string(fmlp_dtype_name(t)) + " n " + std::to_string(n) +
                 (p2p ? " p2p" : " nccl"));
    std::vector<float> vals[kRanks];
    for (int r = 0; r < kRanks; ++r) vals[r] = random_values(t, n, uint64_t(n) * 31 + uint64_t(r));
    Ranked y;
    make(&y, t, vals, offset);
    enqueue(y);
    sync();
    if (p2p) return expect_bitwise(y, rank_order_sum(vals, t));
    const std::vector<unsigned char> g0 = download(y, 0);
    EXPECT_TRUE(g0 == download(y, 1)) << "ranks differ";
    const size_t es = fmlp::dtype_size(t);
    size_t bad = 0;
    for (size_t i = 0; i < size_t(n); ++i) {
      double exact = 0, mag = 0;
      for (int r = 0; r < kRanks; ++r) {
        exact += vals[r][i];
        mag = std::max(mag, std::fabs(double(vals[r][i])));
      }
      const double got = decode_one(&g0[i * es], t);
      if (!(std::fabs(got - exact) <= 2 * kRanks * unit_roundoff(t) * mag)) ++bad;
    }
    EXPECT_EQ(bad, 0u);
  }

  cudaStream_t streams_[kRanks] = {};
};

TEST_F(TpP2p, SumsAreBitwiseTheRankOrderSumOnEveryRank) {
  for (fmlp_dtype_t t : {FMLP_DTYPE_BF16, FMLP_DTYPE_F16, FMLP_DTYPE_F32})
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(8192), int64_t(max_elems(t))}) {
      check_sum(t, n, true, {0, 0});
      check_sum(t, n, true, {1, 0});  // rank 0's y misaligned, rank 1's 16-byte aligned
    }
  check_sum(FMLP_DTYPE_BF16, 4099, true, {3, 5});
}

TEST_F(TpP2p, LargerMessagesFallBackToNccl) {
  for (fmlp_dtype_t t : {FMLP_DTYPE_BF16, FMLP_DTYPE_F32})
    check_sum(t, int64_t(max_elems(t)) + 1, false, {0, 0});
  // A smaller registration: 4 KB fits in it, 16 KB goes to NCCL.
  ASSERT_EQ(fmlp_tp_p2p_init_all(kRanks, comms_, 4096), FMLP_SUCCESS) << fmlp_last_error();
  size_t cap = 0;
  ASSERT_EQ(fmlp_tp_p2p_query(comms_[1], &cap, nullptr), FMLP_SUCCESS);
  EXPECT_EQ(cap, 4096u);
  check_sum(FMLP_DTYPE_F32, 1024, true, {0, 0});
  check_sum(FMLP_DTYPE_BF16, 8192, false, {0, 0});
}

TEST_F(TpP2p, EnvironmentTurnsItOffOrRequiresIt) {
  setenv("FMLP_TP_P2P", "0", 1);
  ASSERT_EQ(fmlp_tp_p2p_init_all(kRanks, comms_, FMLP_TP_P2P_DEFAULT_MAX_BYTES), FMLP_SUCCESS);
  size_t cap = 1;
  const char* about = "";
  ASSERT_EQ(fmlp_tp_p2p_query(comms_[0], &cap, &about), FMLP_SUCCESS);
  EXPECT_EQ(cap, 0u);
  EXPECT_NE(std::string(about).find("FMLP_TP_P2P=0"), std::string::npos) << about;
  check_sum(FMLP_DTYPE_BF16, 8192, false, {0, 0});
  check_sum(FMLP_DTYPE_F32, 7, false, {0, 0});
  setenv("FMLP_TP_P2P", "1", 1);  // these GPUs can: required is granted
  ASSERT_EQ(fmlp_tp_p2p_init_all(kRanks, comms_, FMLP_TP_P2P_DEFAULT_MAX_BYTES), FMLP_SUCCESS)
      << fmlp_last_error();
  ASSERT_EQ(fmlp_tp_p2p_query(comms_[0], &cap, &about), FMLP_SUCCESS);
  EXPECT_EQ(cap, FMLP_TP_P2P_DEFAULT_MAX_BYTES) << about;
  check_sum(FMLP_DTYPE_BF16, 8192, true, {0, 0});
}

// Every call doubles a buffer's sum (both ranks then hold the same value, which sums exactly to
// twice itself), so after k calls it is 2^(k-1) * round(a + b) exactly; a call that read a stale
// slot (an earlier call's partial) would be off by a power of two.
TEST_F(TpP2p, ManyBackToBackCallsOfMixedSizes) {
  const fmlp_dtype_t t = FMLP_DTYPE_F32;
  const int64_t sizes[] = {1, 7, 8192, 65541, int64_t(max_elems(t))};
  constexpr int kCalls = 150;  // 30 per buffer: magnitudes 2^-40 .. 2^-9
  std::vector<Ranked> ys(std::size(sizes));
  std::vector<std::vector<float>> want(std::size(sizes));
  for (size_t b = 0; b < std::size(sizes); ++b) {
    std::vector<float> vals[kRanks];
    for (int r = 0; r < kRanks; ++r)
      vals[r] = random_values(t, sizes[b], 1000 + b * 2 + uint64_t(r));
    for (int r = 0; r < kRanks; ++r)
      for (float& v : vals[r]) v = std::ldexp(v, -40);
    make(&ys[b], t, vals, {int64_t(b % 2), 0});
    want[b] = rank_order_sum(vals, t);
    for (float& v : want[b]) v = std::ldexp(v, kCalls / int(std::size(sizes)) - 1);
  }
  for (int k = 0; k < kCalls; ++k) enqueue(ys[size_t(k) % ys.size()]);  // no host sync between
  sync();
  for (size_t b = 0; b < ys.size(); ++b) {
    SCOPED_TRACE("n " + std::to_string(sizes[b]));
    expect_bitwise(ys[b], want[b]);
  }
}

TEST_F(TpP2p, CapturedGraphReplaysAdvanceTheEpoch) {
  const fmlp_dtype_t t = FMLP_DTYPE_BF16;
  const int64_t sizes[] = {8192, 7, int64_t(max_elems(t))};  // 3 calls: slots alternate per replay
  constexpr int kReplays = 100;
  std::vector<Ranked> ys(std::size(sizes));
  std::vector<std::vector<float>> want(std::size(sizes));
  for (size_t b = 0; b < std::size(sizes); ++b) {
    std::vector<float> vals[kRanks];
    for (int r = 0; r < kRanks; ++r) {
      vals[r] = random_values(t, sizes[b], 2000 + b * 2 + uint64_t(r));
      for (float& v : vals[r]) v = std::ldexp(v, -60);
    }
    make(&ys[b], t, vals, {0, 0});
    want[b] = rank_order_sum(vals, t);
    for (float& v : want[b]) v = std::ldexp(v, kReplays - 1);
  }
  replay_graph(ys, kReplays);
  for (size_t b = 0; b < ys.size(); ++b) {
    SCOPED_TRACE("n " + std::to_string(sizes[b]));
    expect_bitwise(ys[b], want[b]);
  }
}

// LL lines: every call's lines must be told from those of any earlier call of the same slot set,
// whatever its size and dtype. Five calls per replay, so a buffer's call alternates between the
// two sets from one replay to the next; sizes shrink and grow (the largest leaves lines that the
// smaller ones never rewrite), units end mid-line (f32 n odd, f16 and bf16 n not a multiple of 4)
// and y is 8-byte aligned on one rank, not on the other.
TEST_F(TpP2p, GraphOfMixedDtypesAndOddSizesReusesBothSets) {
  struct Call {
    fmlp_dtype_t t;
    int64_t n;
    int64_t offset[kRanks];
  };
  const Call calls[] = {{FMLP_DTYPE_F32, int64_t(max_elems(FMLP_DTYPE_F32)) - 1, {1, 0}},
                        {FMLP_DTYPE_BF16, 8191, {0, 3}},
                        {FMLP_DTYPE_F32, 7, {0, 1}},
                        {FMLP_DTYPE_F16, 4099, {2, 1}},
                        {FMLP_DTYPE_BF16, 1, {0, 0}}};
  constexpr int kReplays = 24;
  std::vector<Ranked> ys(std::size(calls));
  std::vector<std::vector<float>> want(std::size(calls));
  for (size_t c = 0; c < std::size(calls); ++c) {
    const fmlp_dtype_t t = calls[c].t;
    std::vector<float> vals[kRanks];
    for (int r = 0; r < kRanks; ++r) {
      vals[r] = random_values(t, calls[c].n, 3000 + c * 2 + uint64_t(r));
      // 2^(kReplays + 1) * 2^-12 stays below f16's 65504; re-rounded where f16 goes subnormal.
      for (float& v : vals[r]) v = round_to(std::ldexp(v, -12), t);
    }
    make(&ys[c], t, vals, calls[c].offset);
    want[c] = rank_order_sum(vals, t);
    for (float& v : want[c]) v = std::ldexp(v, kReplays - 1);
  }
  replay_graph(ys, kReplays);
  for (size_t c = 0; c < ys.size(); ++c) {
    SCOPED_TRACE(std::string(fmlp_dtype_name(calls[c].t)) + " n " + std::to_string(calls[c].n));
    expect_bitwise(ys[c], want[c]);
  }
}

// fmlp_tp_p2p_init / destroy are collective per rank: one thread per rank (the exchange, the
// agreed verdict and the teardown barrier run over NCCL, as between processes).
TEST_F(TpP2p, PerRankSetupFromOneThreadPerRank) {
  auto each_rank = [&](auto&& fn) {
    fmlp_status_t st[kRanks];
    std::string err[kRanks];
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r)
      threads.emplace_back([&, r] {
        cudaSetDevice(r);
        st[r] = fn(r);
        err[r] = fmlp_last_error();
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < kRanks; ++r)
      EXPECT_EQ(st[r], FMLP_SUCCESS) << "rank " << r << ": " << err[r];
  };
  ASSERT_EQ(fmlp_tp_p2p_destroy(comms_[0]), FMLP_SUCCESS);  // the one-process group
  each_rank([&](int r) { return fmlp_tp_p2p_init(comms_[r], r, kRanks, 65536); });
  size_t cap = 0;
  const char* about = "";
  EXPECT_EQ(fmlp_tp_p2p_query(comms_[1], &cap, &about), FMLP_SUCCESS);
  EXPECT_EQ(cap, 65536u) << about;
  check_sum(FMLP_DTYPE_BF16, 8192, true, {0, 1});
  check_sum(FMLP_DTYPE_BF16, 65536, false, {0, 0});
  // Before the fixture's one-thread re-registration, which could not join a barrier.
  each_rank([&](int r) { return fmlp_tp_p2p_destroy(comms_[r]); });
}

TEST_F(TpP2p, MlpThroughP2pMatchesMlpThroughNccl) {
  const MlpCase c = tp_case(Gate::kStacked, FMLP_DTYPE_BF16, FMLP_DTYPE_BF16, 1);
  const std::vector<std::vector<double>> p2p = run(c, FMLP_TP_ALL_REDUCE);
  ASSERT_EQ(fmlp_tp_p2p_destroy(comms_[0]), FMLP_SUCCESS);  // the whole one-process group
  size_t cap = 1;
  ASSERT_EQ(fmlp_tp_p2p_query(comms_[1], &cap, nullptr), FMLP_SUCCESS);
  EXPECT_EQ(cap, 0u);
  const std::vector<std::vector<double>> nccl = run(c, FMLP_TP_ALL_REDUCE);
  EXPECT_TRUE(p2p[0] == p2p[1]) << "ranks differ";
  // The partials may differ by a rounding between runs (split-K order), each sum is rounded once
  // to bf16: within the bf16 accuracy contract's 2^-7 (|y| + rms) of each other, twice over.
  double ss = 0;
  for (double v : nccl[0]) ss += v * v;
  const double rms = std::sqrt(ss / double(nccl[0].size()));
  for (size_t i = 0; i < p2p[0].size(); ++i)
    EXPECT_LE(std::fabs(p2p[0][i] - nccl[0][i]), 0x1p-6 * (std::fabs(nccl[0][i]) + rms)) << i;
}

#endif  // FMLP_TEST_WITH_CUDA

}  // namespace
