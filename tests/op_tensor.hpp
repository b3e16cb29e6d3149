// A 2-D test tensor for the linear and softmax tests: values staged on the host (HostMatrix),
// placed in host or device memory at an optional one-element offset and padded row stride, every
// byte outside the view 0xFF so stray writes and unwritten outputs show.
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <functional>
#include <string>
#include <vector>
#ifdef FMLP_TEST_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "buffers.hpp"
#include "core/dtype.hpp"
#include "fusedmlp/fusedmlp.h"
#include "mlp_case.hpp"

namespace fmlp_test {

class PlacedTensor {
 public:
  PlacedTensor() = default;
  PlacedTensor(fmlp_dtype_t t, int64_t rows, int64_t cols, bool device, bool misaligned,
               bool strided)
      : t_(t), rows_(rows), cols_(cols), off_(misaligned ? 1 : 0), ld_(cols + (strided ? 3 : 0)) {
    es_ = int64_t(fmlp::dtype_size(t));
    buf_ = Buffer(size_t((off_ + std::max<int64_t>(rows, 1) * ld_) * es_), device);
    buf_.fill(0xFF);
    view_ = fmlp_tensor_2d(buf_.bytes_at(size_t(off_ * es_)), t, rows, cols, ld_);
    if (device) view_.device_type = FMLP_DEVICE_CUDA;
  }
  void upload(const HostMatrix& m) {
    std::vector<unsigned char> host(buf_.size(), 0xFF);
    for (int64_t r = 0; r < rows_ && cols_ > 0; ++r)  // no memcpy from an empty vector's null
      std::memcpy(host.data() + (off_ + r * ld_) * es_, m.bytes.data() + r * cols_ * es_,
                  size_t(cols_ * es_));
    buf_.upload(host);
  }
  // The view's values; *stray names a changed byte outside the view.
  std::vector<double> download(std::string* stray) const {
    const std::vector<unsigned char> host = buf_.download();
    std::vector<double> out(size_t(rows_ * cols_));
    for (size_t i = 0; i < host.size(); ++i) {
      const int64_t e = int64_t(i) / es_ - off_;
      const bool inside = int64_t(i) >= off_ * es_ && e / ld_ < rows_ && e % ld_ < cols_;
      if (!inside && host[i] != 0xFF && stray->empty())
        *stray = "byte " + std::to_string(i) + " outside the output view was written";
    }
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = 0; c < cols_; ++c)
        out[size_t(r * cols_ + c)] =
            fmlp::detail::load_as_double(host.data() + (off_ + r * ld_) * es_, t_, c);
    return out;
  }
  std::vector<unsigned char> raw() const { return buf_.download(); }
  const fmlp_tensor_t& view() const { return view_; }
  fmlp_tensor_t vector_view() const {  // [cols] view of a one-row tensor
    fmlp_tensor_t v = fmlp_tensor_1d(view_.data, t_, cols_);
    v.device_type = view_.device_type;
    return v;
  }

 private:
  fmlp_dtype_t t_ = FMLP_DTYPE_F32;
  int64_t rows_ = 0, cols_ = 0, off_ = 0, ld_ = 0, es_ = 4;
  Buffer buf_;
  fmlp_tensor_t view_{};
};

// Captures call(stream) into a CUDA graph on a new stream and replays it: once, then
// refresh() (which must put the real inputs in place, in the same buffers), then twice more, so
// the result also shows that a replay leaves the workspace ready for the next one. "" or the
// failure.
inline std::string capture_and_replay(const std::function<fmlp_status_t(void*)>& call,
                                      const std::function<void()>& refresh) {
#ifdef FMLP_TEST_WITH_CUDA
  cudaStream_t s = nullptr;
  std::string err;
  auto ok = [&](cudaError_t e, const char* what) {
    if (e != cudaSuccess && err.empty()) err = std::string(what) + ": " + cudaGetErrorString(e);
    return e == cudaSuccess;
  };
  if (!ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate")) return err;
  cudaGraph_t g = nullptr;
  cudaGraphExec_t ex = nullptr;
  if (ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture")) {
    const fmlp_status_t st = call(s);
    if (st != FMLP_SUCCESS)
      err = std::string("during capture: ") + fmlp_status_name(st) + ": " + fmlp_last_error();
    ok(cudaStreamEndCapture(s, &g), "end capture (did the call synchronise?)");
  }
  if (err.empty() && ok(cudaGraphInstantiateWithFlags(&ex, g, 0), "instantiate")) {
    if (ok(cudaGraphLaunch(ex, s), "launch") && ok(cudaStreamSynchronize(s), "replay 1")) {
      refresh();
      for (int i = 0; i < 2 && err.empty(); ++i)
        ok(cudaGraphLaunch(ex, s), "launch") && ok(cudaStreamSynchronize(s), "replay");
    }
  }
  if (ex) cudaGraphExecDestroy(ex);
  if (g) cudaGraphDestroy(g);
  cudaStreamDestroy(s);
  return err;
#else
  (void)call, (void)refresh;
  return "built without CUDA";
#endif
}

// The op-table fixtures of the linear and softmax suites: one test instance per kernel entry of
// the op (COUNT / NAME / BACKEND are its fmlp_<op>_kernel_* functions), skipped with the reason
// where the entry's backend cannot run here.
constexpr const char* kSkipped = "skipped: ";  // prefix of a run_case result: entry took no case

inline bool skipped(const std::string& err) {
  return err.rfind(kSkipped, 0) == 0;
}

template <int (*COUNT)(), const char* (*NAME)(int), fmlp_backend_t (*BACKEND)(int)>
class OpKernelTest : public ::testing::TestWithParam<int> {
 public:
  static std::vector<int> indices() {
    std::vector<int> v;
    for (int i = 0; i < COUNT(); ++i) v.push_back(i);
    return v;
  }

 protected:
  void SetUp() override {
    kernel_ = NAME(GetParam());
    const fmlp_backend_t b = BACKEND(GetParam());
    device_ = b == FMLP_BACKEND_CUDA;
    if (fmlp_backend_available(b) != FMLP_SUCCESS)
      GTEST_SKIP() << kernel_ << ": backend unavailable: " << fmlp_last_error();
    if (device_ && !device_unavailable_reason().empty())
      GTEST_SKIP() << kernel_ << ": " << device_unavailable_reason();
  }
  const char* kernel_ = nullptr;
  bool device_ = false;
};

// How a suite's run_case runs one case: eagerly or captured in a CUDA graph and replayed, and
// where to keep y's bytes (for comparing runs).
struct RunMode {
  bool graph = false;
  std::vector<unsigned char>* y_bytes = nullptr;
};

// Host kernels give the same bits whatever the thread count: `run(case, mode)` (a suite's
// run_case) with 1, 2 and 3 OpenMP threads, each result against the 1-thread bytes.
template <typename CASE, typename RUN>
void expect_thread_count_independent(const std::vector<CASE>& cases, RUN run) {
  const int before = omp_get_max_threads();
  for (const CASE& c : cases) {
    std::vector<unsigned char> one, other;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      RunMode mode;
      mode.y_bytes = threads == 1 ? &one : &other;
      const std::string err = run(c, mode);
      if (skipped(err)) break;
      EXPECT_TRUE(err.empty()) << "[" << c.name() << "]: " << err;
      if (threads > 1) {
        EXPECT_TRUE(one == other) << "[" << c.name() << "]: " << threads
                                  << " threads differ from 1 (FMLP_TEST_SEED=" << test_seed()
                                  << ")";
      }
    }
  }
  omp_set_num_threads(before);
}

}  // namespace fmlp_test
