// The promises of fusedmlp.h that every op (mlp, linear, softmax, moe) keeps alike, checked for
// each op on the host backends: the op table's names, unknown and NULL kernel names, NULL args
// and size pointers, wrong and invalid backends, the explain buffer, the last error after
// success, requests with nothing to compute, host workspaces that need no initialisation and
// workspaces that are too small, all without writing the output on error. Then the packed mlp
// path's queries, fmlp_moe_device_errors' arguments, and (on a GPU) the 256-byte alignment of a
// CUDA workspace for fmlp_mlp, fmlp_mlp_with_kernel and fmlp_mlp_packed_run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "buffers.hpp"
#include "fusedmlp/fusedmlp.h"
#include "mlp_case.hpp"

namespace fmlp_test {
namespace {

// One op's C entry points, so one test body serves every op.
template <typename ARGS>
struct OpApi {
  fmlp_status_t (*workspace_size)(const ARGS*, fmlp_backend_t, size_t*);
  fmlp_status_t (*run)(const ARGS*, fmlp_backend_t, void*, size_t, void*);
  fmlp_status_t (*explain)(const ARGS*, fmlp_backend_t, char*, size_t, size_t*);
  int (*count)();
  const char* (*name)(int);
  fmlp_backend_t (*backend)(int);
  fmlp_status_t (*supports)(const ARGS*, const char*);
  fmlp_status_t (*kernel_workspace)(const ARGS*, const char*, size_t*);
  fmlp_status_t (*with_kernel)(const ARGS*, const char*, void*, size_t, void*);
};

#define FMLP_TEST_OP_API(OP)                                                              \
  {                                                                                       \
    fmlp_##OP##_workspace_size, fmlp_##OP, fmlp_##OP##_explain, fmlp_##OP##_kernel_count, \
        fmlp_##OP##_kernel_name, fmlp_##OP##_kernel_backend, fmlp_##OP##_kernel_supports, \
        fmlp_##OP##_kernel_workspace_size, fmlp_##OP##_with_kernel                        \
  }

// An op's f32 output of N elements, poisoned (0x5A bytes) until a kernel writes it.
template <size_t N>
struct Output {
  float y[N];
  Output() { poison(); }
  void poison() { std::memset(y, 0x5A, sizeof y); }
  std::vector<unsigned char> out() const {
    const auto* p = reinterpret_cast<const unsigned char*>(y);
    return {p, p + sizeof y};
  }
};

fmlp_tensor_t t3(void* data, int64_t a, int64_t b, int64_t c) {
  fmlp_tensor_t t = fmlp_tensor_none();
  t.data = data, t.dtype = FMLP_DTYPE_F32, t.ndim = 3;
  t.shape[0] = a, t.shape[1] = b, t.shape[2] = c;
  t.stride[0] = b * c, t.stride[1] = c, t.stride[2] = 1;
  return t;
}

template <size_t N>
void fill(float (&a)[N], float v) {
  for (float& f : a) f = v;
}

// Each op: a valid f32 host request whose output starts poisoned, or with `empty` the same request
// with nothing to compute. Not copyable: the views point into the case.
struct MlpOp {
  using Args = fmlp_mlp_args_t;
  static constexpr const char* kName = "mlp";
  static constexpr OpApi<Args> kApi = FMLP_TEST_OP_API(mlp);
  struct Case : Output<8> {
    float x[8], w1[12], b1[3], w2[12], b2[4];
    Args args{};
    explicit Case(bool empty) {  // M = 2 (0), d_in = 4, hidden = 3, d_out = 4
      fill(x, 0.25f), fill(w1, 0.5f), fill(b1, 0.125f), fill(w2, -0.75f), fill(b2, 1.f);
      const int64_t m = empty ? 0 : 2;
      args.x = fmlp_tensor_2d(x, FMLP_DTYPE_F32, m, 4, 4);
      args.y = fmlp_tensor_2d(y, FMLP_DTYPE_F32, m, 4, 4);
      args.weights.w1 = fmlp_tensor_2d(w1, FMLP_DTYPE_F32, 3, 4, 4);
      args.weights.b1 = fmlp_tensor_1d(b1, FMLP_DTYPE_F32, 3);
      args.weights.w2 = fmlp_tensor_2d(w2, FMLP_DTYPE_F32, 4, 3, 3);
      args.weights.b2 = fmlp_tensor_1d(b2, FMLP_DTYPE_F32, 4);
      args.config = fmlp_mlp_config_default();
    }
    Case(const Case&) = delete;
  };
};

struct LinearOp {
  using Args = fmlp_linear_args_t;
  static constexpr const char* kName = "linear";
  static constexpr OpApi<Args> kApi = FMLP_TEST_OP_API(linear);
  struct Case : Output<6> {
    float x[8], w[12], bias[3];
    Args args{};
    explicit Case(bool empty) {  // M = 2 (0), N = 3, K = 4
      fill(x, 0.25f), fill(w, 0.5f), fill(bias, 1.f);
      const int64_t m = empty ? 0 : 2;
      args.x = fmlp_tensor_2d(x, FMLP_DTYPE_F32, m, 4, 4);
      args.y = fmlp_tensor_2d(y, FMLP_DTYPE_F32, m, 3, 3);
      args.w = fmlp_tensor_2d(w, FMLP_DTYPE_F32, 3, 4, 4);
      args.bias = fmlp_tensor_1d(bias, FMLP_DTYPE_F32, 3);
    }
    Case(const Case&) = delete;
  };
};

struct SoftmaxOp {
  using Args = fmlp_softmax_args_t;
  static constexpr const char* kName = "softmax";
  static constexpr OpApi<Args> kApi = FMLP_TEST_OP_API(softmax);
  struct Case : Output<10> {
    float x[10];
    Args args{};
    explicit Case(bool empty) {  // rows = 2 (0), n = 5
      for (int i = 0; i < 10; ++i) x[i] = 0.25f * float(i % 5) - 0.5f;
      const int64_t rows = empty ? 0 : 2;
      args.x = fmlp_tensor_2d(x, FMLP_DTYPE_F32, rows, 5, 5);
      args.y = fmlp_tensor_2d(y, FMLP_DTYPE_F32, rows, 5, 5);
      args.temperature = 1.f;
    }
    Case(const Case&) = delete;
  };
};

struct MoeOp {
  using Args = fmlp_moe_args_t;
  static constexpr const char* kName = "moe";
  static constexpr OpApi<Args> kApi = FMLP_TEST_OP_API(moe);
  struct Case : Output<8> {
    float x[8], router[8], w1[24], w2[24];
    Args args{};
    explicit Case(bool empty) {  // T = 2 (0), d = 4, hidden = 3, d_out = 4, 2 experts, top 1
      for (int i = 0; i < 8; ++i) x[i] = 0.125f * float(i) - 0.5f, router[i] = float(i % 3) - 1.f;
      fill(w1, 0.5f), fill(w2, -0.25f);
      const int64_t t = empty ? 0 : 2;
      args.x = fmlp_tensor_2d(x, FMLP_DTYPE_F32, t, 4, 4);
      args.y = fmlp_tensor_2d(y, FMLP_DTYPE_F32, t, 4, 4);
      args.router_w = fmlp_tensor_2d(router, FMLP_DTYPE_F32, 2, 4, 4);
      args.w1 = t3(w1, 2, 3, 4);
      args.w2 = t3(w2, 2, 4, 3);
      args.config = fmlp_moe_config_default(2, 1);
    }
    Case(const Case&) = delete;
  };
};

// The host backends that can run here: ref always, cpu where this CPU has the ISA.
std::vector<fmlp_backend_t> host_backends() {
  std::vector<fmlp_backend_t> v{FMLP_BACKEND_REF};
  if (fmlp_backend_available(FMLP_BACKEND_CPU) == FMLP_SUCCESS) v.push_back(FMLP_BACKEND_CPU);
  return v;
}

// Replaces the thread's last error, so a stale message cannot satisfy a check.
void set_some_error() {
  fmlp_backend_available(fmlp_backend_t(99));
  ASSERT_STRNE(fmlp_last_error(), "");
}

bool contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

template <typename OP>
class OpContract : public ::testing::Test {
 protected:
  using Args = typename OP::Args;
  using Case = typename OP::Case;
  static constexpr const OpApi<Args>& api = OP::kApi;
  const std::string op = OP::kName;
  const std::string ref_kernel = op + "_ref_scalar_fp64";
  const std::string size_query = "fmlp_" + op + "_workspace_size";
  const std::string kernel_size_query = "fmlp_" + op + "_kernel_workspace_size";

  // The host entries (ref and, where it can run, cpu) that take the case.
  std::vector<std::string> host_kernels(const Case& c) const {
    std::vector<std::string> v;
    for (int i = 0; i < api.count(); ++i) {
      const fmlp_backend_t b = api.backend(i);
      if (b == FMLP_BACKEND_CUDA || fmlp_backend_available(b) != FMLP_SUCCESS) continue;
      if (api.supports(&c.args, api.name(i)) == FMLP_SUCCESS) v.push_back(api.name(i));
    }
    return v;
  }
  // The call failed with `want`, a message holding every one of `subs`, and c's output untouched.
  void expect_rejected(const char* what, fmlp_status_t got, fmlp_status_t want,
                       const std::vector<std::string>& subs, const Case& c,
                       const std::vector<unsigned char>& before) const {
    const std::string msg = fmlp_last_error();
    EXPECT_EQ(got, want) << op << " " << what << " returned " << fmlp_status_name(got) << ": "
                         << msg;
    for (const std::string& s : subs)
      EXPECT_TRUE(contains(msg, s))
          << op << " " << what << ": \"" << msg << "\" lacks \"" << s << "\"";
    EXPECT_EQ(c.out(), before) << op << " " << what << " wrote its output";
  }
};

using Ops = ::testing::Types<MlpOp, LinearOp, SoftmaxOp, MoeOp>;
struct OpNames {
  template <typename T>
  static std::string GetName(int) {
    return T::kName;
  }
};
TYPED_TEST_SUITE(OpContract, Ops, OpNames);

// fusedmlp.h: every kernel of every backend is an entry with a unique name (op_arch_technique);
// names out of range are NULL. The ref backend has an entry (it handles every valid host request).
TYPED_TEST(OpContract, NamesAreUniqueAndFollowTheScheme) {
  const auto& api = this->api;
  const int n = api.count();
  ASSERT_GE(n, 1);
  std::set<std::string> names;
  for (int i = 0; i < n; ++i) {
    const char* name = api.name(i);
    ASSERT_NE(name, nullptr) << this->op << " entry " << i;
    const fmlp_backend_t b = api.backend(i);
    EXPECT_TRUE(b == FMLP_BACKEND_REF || b == FMLP_BACKEND_CPU || b == FMLP_BACKEND_CUDA) << name;
    const std::string arch =
        b == FMLP_BACKEND_CUDA ? "(cuda|sm[0-9]+[a-z]?)" : fmlp_backend_name(b);
    EXPECT_TRUE(
        std::regex_match(name, std::regex(this->op + "(_[a-z]+)?_" + arch + "(_[a-z0-9]+)+")))
        << name << " does not follow " << this->op << "_arch_technique with arch " << arch;
    EXPECT_TRUE(names.insert(name).second) << name << " is registered twice";
  }
  EXPECT_EQ(names.count(this->ref_kernel), 1u) << this->op << " has no ref entry";
  EXPECT_EQ(api.name(n), nullptr);
  EXPECT_EQ(api.name(-1), nullptr);
}

// An unknown kernel name is INVALID_VALUE naming it and where the names are listed; a NULL name
// is NULL_POINTER; nothing is written.
TYPED_TEST(OpContract, UnknownOrNullKernelNameIsRejected) {
  typename TestFixture::Case c(false);
  const auto before = c.out();
  const auto& api = this->api;
  const std::string bogus = this->op + "_no_such_kernel";
  alignas(256) static unsigned char ws[4096];
  size_t bytes = 7;
  const std::vector<std::string> named = {"'" + bogus + "'", "fusedmlp info"};
  set_some_error();
  this->expect_rejected("with_kernel",
                        api.with_kernel(&c.args, bogus.c_str(), ws, sizeof ws, nullptr),
                        FMLP_ERROR_INVALID_VALUE, named, c, before);
  this->expect_rejected("kernel_supports", api.supports(&c.args, bogus.c_str()),
                        FMLP_ERROR_INVALID_VALUE, named, c, before);
  this->expect_rejected("kernel_workspace_size",
                        api.kernel_workspace(&c.args, bogus.c_str(), &bytes),
                        FMLP_ERROR_INVALID_VALUE, named, c, before);
  EXPECT_EQ(bytes, 7u) << "the size was written on error";
  this->expect_rejected("with_kernel(NULL)",
                        api.with_kernel(&c.args, nullptr, ws, sizeof ws, nullptr),
                        FMLP_ERROR_NULL_POINTER, {"kernel name is NULL"}, c, before);
  this->expect_rejected("kernel_supports(NULL)", api.supports(&c.args, nullptr),
                        FMLP_ERROR_NULL_POINTER, {"kernel name is NULL"}, c, before);
  this->expect_rejected("kernel_workspace_size(NULL)",
                        api.kernel_workspace(&c.args, nullptr, &bytes), FMLP_ERROR_NULL_POINTER,
                        {"kernel name is NULL"}, c, before);
}

// NULL args and NULL size pointers: NULL_POINTER naming them, on every entry point.
TYPED_TEST(OpContract, NullArgsAndBytesAreRejected) {
  typename TestFixture::Case c(false);
  const auto before = c.out();
  const auto& api = this->api;
  const char* ref = this->ref_kernel.c_str();
  alignas(256) static unsigned char ws[4096];
  size_t bytes = 0, needed = 0;
  char buf[64];
  const std::vector<std::string> args_null = {"args is NULL"};
  this->expect_rejected("run", api.run(nullptr, FMLP_BACKEND_REF, ws, sizeof ws, nullptr),
                        FMLP_ERROR_NULL_POINTER, args_null, c, before);
  this->expect_rejected("workspace_size", api.workspace_size(nullptr, FMLP_BACKEND_REF, &bytes),
                        FMLP_ERROR_NULL_POINTER, args_null, c, before);
  this->expect_rejected("explain", api.explain(nullptr, FMLP_BACKEND_REF, buf, sizeof buf, &needed),
                        FMLP_ERROR_NULL_POINTER, args_null, c, before);
  this->expect_rejected("kernel_supports", api.supports(nullptr, ref), FMLP_ERROR_NULL_POINTER,
                        args_null, c, before);
  this->expect_rejected("kernel_workspace_size", api.kernel_workspace(nullptr, ref, &bytes),
                        FMLP_ERROR_NULL_POINTER, args_null, c, before);
  this->expect_rejected("with_kernel", api.with_kernel(nullptr, ref, ws, sizeof ws, nullptr),
                        FMLP_ERROR_NULL_POINTER, args_null, c, before);
  this->expect_rejected("workspace_size(bytes NULL)",
                        api.workspace_size(&c.args, FMLP_BACKEND_REF, nullptr),
                        FMLP_ERROR_NULL_POINTER, {"bytes is NULL"}, c, before);
  this->expect_rejected("kernel_workspace_size(bytes NULL)",
                        api.kernel_workspace(&c.args, ref, nullptr), FMLP_ERROR_NULL_POINTER,
                        {"bytes is NULL"}, c, before);
}

// The cuda backend with host tensors is DEVICE_MISMATCH saying what to use instead; a backend
// value outside the enum is INVALID_VALUE; both before anything is written.
TYPED_TEST(OpContract, WrongOrInvalidBackendIsRejected) {
  typename TestFixture::Case c(false);
  const auto before = c.out();
  const auto& api = this->api;
  alignas(256) static unsigned char ws[4096];
  size_t bytes = 0, needed = 0;
  char buf[64];
  const std::vector<std::string> mismatch = {"backend cuda", "cpu or ref"};
  this->expect_rejected("run(cuda)", api.run(&c.args, FMLP_BACKEND_CUDA, ws, sizeof ws, nullptr),
                        FMLP_ERROR_DEVICE_MISMATCH, mismatch, c, before);
  this->expect_rejected("workspace_size(cuda)",
                        api.workspace_size(&c.args, FMLP_BACKEND_CUDA, &bytes),
                        FMLP_ERROR_DEVICE_MISMATCH, mismatch, c, before);
  this->expect_rejected("explain(cuda)",
                        api.explain(&c.args, FMLP_BACKEND_CUDA, buf, sizeof buf, &needed),
                        FMLP_ERROR_DEVICE_MISMATCH, mismatch, c, before);
  for (int b : {4, 9, 1000}) {
    const std::vector<std::string> invalid = {"backend is " + std::to_string(b)};
    this->expect_rejected("run", api.run(&c.args, fmlp_backend_t(b), ws, sizeof ws, nullptr),
                          FMLP_ERROR_INVALID_VALUE, invalid, c, before);
    this->expect_rejected("workspace_size", api.workspace_size(&c.args, fmlp_backend_t(b), &bytes),
                          FMLP_ERROR_INVALID_VALUE, invalid, c, before);
  }
}

// explain: always NUL-terminated, *needed the full length + 1 whatever the buffer, nothing written
// into a buffer of size 0; the report names the backend and the entry dispatch runs.
TYPED_TEST(OpContract, ExplainBufferIsTruncatedTerminatedAndNeededIsExact) {
  typename TestFixture::Case c(false);
  const auto& api = this->api;
  size_t needed = 0;
  ASSERT_EQ(api.explain(&c.args, FMLP_BACKEND_REF, nullptr, 0, &needed), FMLP_SUCCESS)
      << fmlp_last_error();
  ASSERT_GT(needed, 16u);
  std::string full(needed, 'X');
  size_t again = 0;
  ASSERT_EQ(api.explain(&c.args, FMLP_BACKEND_REF, full.data(), full.size(), &again), FMLP_SUCCESS);
  EXPECT_EQ(again, needed);
  EXPECT_EQ(full[needed - 1], '\0');
  EXPECT_EQ(std::strlen(full.c_str()), needed - 1);
  EXPECT_TRUE(contains(full, "backend ref")) << full;
  EXPECT_TRUE(contains(full, "chosen   " + this->ref_kernel)) << full;
  for (size_t size : {size_t(1), size_t(10), needed - 1}) {
    std::string buf(size + 8, 'X');
    size_t n = 0;
    ASSERT_EQ(api.explain(&c.args, FMLP_BACKEND_REF, buf.data(), size, &n), FMLP_SUCCESS);
    EXPECT_EQ(n, needed) << "buffer of " << size;
    EXPECT_EQ(buf[size - 1], '\0') << "buffer of " << size;
    EXPECT_EQ(buf.compare(0, size - 1, full, 0, size - 1), 0) << "buffer of " << size;
    EXPECT_EQ(buf[size], 'X') << "wrote past a buffer of " << size;
  }
  char untouched = 'X';
  ASSERT_EQ(api.explain(&c.args, FMLP_BACKEND_REF, &untouched, 0, &needed), FMLP_SUCCESS);
  EXPECT_EQ(untouched, 'X');
  EXPECT_EQ(api.explain(&c.args, FMLP_BACKEND_REF, nullptr, 0, nullptr), FMLP_SUCCESS)
      << "needed may be NULL";
}

// fmlp_last_error is "" after any successful call, also one that had nothing to compute.
TYPED_TEST(OpContract, SuccessClearsTheLastError) {
  const auto& api = this->api;
  const char* ref = this->ref_kernel.c_str();
  for (bool empty : {false, true}) {
    typename TestFixture::Case c(empty);
    size_t bytes = 0, needed = 0;
    ASSERT_EQ(api.kernel_workspace(&c.args, ref, &bytes), FMLP_SUCCESS) << fmlp_last_error();
    std::vector<unsigned char> ws(bytes + 1);
    auto expect_cleared = [&](const char* what, fmlp_status_t s) {
      EXPECT_EQ(s, FMLP_SUCCESS) << this->op << " " << what << ": " << fmlp_last_error();
      EXPECT_STREQ(fmlp_last_error(), "")
          << this->op << " " << what << (empty ? " (nothing to compute)" : "")
          << " succeeded but left the previous error";
    };
    set_some_error();
    expect_cleared("run", api.run(&c.args, FMLP_BACKEND_REF, ws.data(), ws.size(), nullptr));
    set_some_error();
    expect_cleared("workspace_size", api.workspace_size(&c.args, FMLP_BACKEND_REF, &bytes));
    set_some_error();
    expect_cleared("explain", api.explain(&c.args, FMLP_BACKEND_REF, nullptr, 0, &needed));
    set_some_error();
    expect_cleared("kernel_supports", api.supports(&c.args, ref));
    set_some_error();
    expect_cleared("kernel_workspace_size", api.kernel_workspace(&c.args, ref, &bytes));
    set_some_error();
    expect_cleared("with_kernel", api.with_kernel(&c.args, ref, ws.data(), ws.size(), nullptr));
  }
}

// A request with nothing to compute (M, rows or T = 0) needs no workspace and succeeds with a
// NULL one on every host backend and entry, writing nothing.
TYPED_TEST(OpContract, EmptyRequestIsANoOpWithNoWorkspace) {
  const auto& api = this->api;
  typename TestFixture::Case c(true);
  const auto before = c.out();
  for (fmlp_backend_t b : host_backends()) {
    size_t bytes = 1;
    ASSERT_EQ(api.workspace_size(&c.args, b, &bytes), FMLP_SUCCESS) << fmlp_last_error();
    EXPECT_EQ(bytes, 0u) << this->op << " on " << fmlp_backend_name(b);
    EXPECT_EQ(api.run(&c.args, b, nullptr, 0, nullptr), FMLP_SUCCESS) << fmlp_last_error();
    EXPECT_EQ(c.out(), before) << this->op << " on " << fmlp_backend_name(b) << " wrote y";
  }
  const std::vector<std::string> kernels = this->host_kernels(c);
  ASSERT_FALSE(kernels.empty()) << "no host " << this->op << " entry takes the empty request";
  for (const std::string& k : kernels) {
    size_t bytes = 1;
    ASSERT_EQ(api.kernel_workspace(&c.args, k.c_str(), &bytes), FMLP_SUCCESS) << fmlp_last_error();
    EXPECT_EQ(bytes, 0u) << k;
    EXPECT_EQ(api.with_kernel(&c.args, k.c_str(), nullptr, 0, nullptr), FMLP_SUCCESS)
        << k << ": " << fmlp_last_error();
    EXPECT_EQ(c.out(), before) << k << " wrote y";
  }
}

// fusedmlp.h: host workspaces need no initialisation. Every host entry that uses one gives the
// same bits with a zeroed workspace, a workspace of 0xFF bytes (NaN in every float dtype) and the
// workspace a previous call left.
TYPED_TEST(OpContract, HostWorkspaceNeedsNoInitialisation) {
  const auto& api = this->api;
  typename TestFixture::Case c(false);
  int checked = 0;
  for (const std::string& k : this->host_kernels(c)) {
    size_t need = 0;
    ASSERT_EQ(api.kernel_workspace(&c.args, k.c_str(), &need), FMLP_SUCCESS) << fmlp_last_error();
    if (need == 0) continue;
    std::vector<unsigned char> ws(need, 0);
    c.poison();
    ASSERT_EQ(api.with_kernel(&c.args, k.c_str(), ws.data(), ws.size(), nullptr), FMLP_SUCCESS)
        << k << ": " << fmlp_last_error();
    const auto zeroed = c.out();
    c.poison();
    EXPECT_NE(c.out(), zeroed) << k << " wrote nothing";
    ASSERT_EQ(api.with_kernel(&c.args, k.c_str(), ws.data(), ws.size(), nullptr), FMLP_SUCCESS);
    EXPECT_EQ(c.out(), zeroed) << k << " with the workspace its previous call left";
    std::fill(ws.begin(), ws.end(), 0xFF);
    c.poison();
    ASSERT_EQ(api.with_kernel(&c.args, k.c_str(), ws.data(), ws.size(), nullptr), FMLP_SUCCESS);
    EXPECT_EQ(c.out(), zeroed) << k << " with a workspace of 0xFF bytes";
    ++checked;
  }
  if (checked == 0)
    GTEST_SKIP() << "no host " << this->op << " entry uses a workspace for this request";
}

// A NULL or too small workspace is WORKSPACE_TOO_SMALL naming the entry, the size it needs and
// the query that gives it; neither the output nor the workspace is written.
TYPED_TEST(OpContract, TooSmallWorkspaceNamesTheSizeAndItsQuery) {
  const auto& api = this->api;
  typename TestFixture::Case c(false);
  const auto before = c.out();
  int checked = 0;
  for (const std::string& k : this->host_kernels(c)) {
    size_t need = 0;
    ASSERT_EQ(api.kernel_workspace(&c.args, k.c_str(), &need), FMLP_SUCCESS) << fmlp_last_error();
    if (need == 0) continue;
    const std::string n = std::to_string(need);
    std::vector<unsigned char> ws(need - 1, 0xCD);
    this->expect_rejected(
        "with_kernel(short)", api.with_kernel(&c.args, k.c_str(), ws.data(), ws.size(), nullptr),
        FMLP_ERROR_WORKSPACE_TOO_SMALL,
        {k, n + " bytes", "got " + std::to_string(need - 1), this->kernel_size_query}, c, before);
    this->expect_rejected("with_kernel(NULL)",
                          api.with_kernel(&c.args, k.c_str(), nullptr, need, nullptr),
                          FMLP_ERROR_WORKSPACE_TOO_SMALL, {k, n + " bytes", "(NULL)"}, c, before);
    EXPECT_TRUE(std::all_of(ws.begin(), ws.end(), [](unsigned char b) { return b == 0xCD; }))
        << k << " wrote into a workspace it rejected";
    ++checked;
  }
  size_t need = 0;
  ASSERT_EQ(api.workspace_size(&c.args, FMLP_BACKEND_REF, &need), FMLP_SUCCESS);
  if (need > 0) {
    std::vector<unsigned char> ws(need - 1, 0xCD);
    this->expect_rejected("run(short)",
                          api.run(&c.args, FMLP_BACKEND_REF, ws.data(), ws.size(), nullptr),
                          FMLP_ERROR_WORKSPACE_TOO_SMALL,
                          {std::to_string(need) + " bytes", this->size_query}, c, before);
    ++checked;
  }
  if (checked == 0)
    GTEST_SKIP() << "no host " << this->op << " entry uses a workspace for this request";
}

// The packed mlp path keeps the same promises: NULL handles and size pointers, M = 0 (no
// workspace, nothing written), a short workspace naming fmlp_mlp_packed_workspace_size.
TEST(MlpPackedContract, QueriesEmptyRequestsAndShortWorkspaces) {
  MlpOp::Case c(false);
  MlpOp::Case empty(true);
  for (fmlp_backend_t b : host_backends()) {
    SCOPED_TRACE(fmlp_backend_name(b));
    fmlp_mlp_packed_t* p = nullptr;
    ASSERT_EQ(fmlp_mlp_pack(&p, &c.args.weights, &c.args.config, b, nullptr), FMLP_SUCCESS)
        << fmlp_last_error();
    size_t bytes = 7;
    EXPECT_EQ(fmlp_mlp_packed_workspace_size(p, &c.args.y, &c.args.x, nullptr),
              FMLP_ERROR_NULL_POINTER);
    EXPECT_TRUE(contains(fmlp_last_error(), "bytes is NULL")) << fmlp_last_error();
    EXPECT_EQ(fmlp_mlp_packed_workspace_size(nullptr, &c.args.y, &c.args.x, &bytes),
              FMLP_ERROR_NULL_POINTER);
    EXPECT_TRUE(contains(fmlp_last_error(), "packed is NULL")) << fmlp_last_error();
    EXPECT_EQ(bytes, 7u);
    // M = 0.
    const auto empty_before = empty.out();
    set_some_error();
    ASSERT_EQ(fmlp_mlp_packed_workspace_size(p, &empty.args.y, &empty.args.x, &bytes), FMLP_SUCCESS)
        << fmlp_last_error();
    EXPECT_EQ(bytes, 0u);
    set_some_error();
    EXPECT_EQ(fmlp_mlp_packed_run(p, &empty.args.y, &empty.args.x, nullptr, nullptr, 0, nullptr),
              FMLP_SUCCESS)
        << fmlp_last_error();
    EXPECT_STREQ(fmlp_last_error(), "");
    EXPECT_EQ(empty.out(), empty_before);
    // A short workspace.
    ASSERT_EQ(fmlp_mlp_packed_workspace_size(p, &c.args.y, &c.args.x, &bytes), FMLP_SUCCESS);
    if (bytes > 0) {
      const auto before = c.out();
      std::vector<unsigned char> ws(bytes - 1, 0xCD);
      EXPECT_EQ(
          fmlp_mlp_packed_run(p, &c.args.y, &c.args.x, nullptr, ws.data(), ws.size(), nullptr),
          FMLP_ERROR_WORKSPACE_TOO_SMALL);
      EXPECT_TRUE(contains(fmlp_last_error(), "fmlp_mlp_packed_workspace_size"))
          << fmlp_last_error();
      EXPECT_EQ(c.out(), before);
    }
    fmlp_mlp_packed_destroy(p);
  }
  fmlp_mlp_packed_destroy(nullptr);  // a no-op, like free(NULL)
}

// fmlp_moe_device_errors checks its arguments before it reads anything.
TEST(MoeDeviceErrors, ArgumentsAreCheckedFirst) {
  alignas(256) static unsigned char ws[64];
  int32_t count = -3;
  EXPECT_EQ(fmlp_moe_device_errors(ws, sizeof ws, nullptr, nullptr), FMLP_ERROR_NULL_POINTER);
  EXPECT_TRUE(contains(fmlp_last_error(), "count is NULL")) << fmlp_last_error();
  EXPECT_EQ(fmlp_moe_device_errors(nullptr, sizeof ws, nullptr, &count), FMLP_ERROR_NULL_POINTER);
  EXPECT_TRUE(contains(fmlp_last_error(), "workspace is NULL")) << fmlp_last_error();
  EXPECT_EQ(fmlp_moe_device_errors(ws, 15, nullptr, &count), FMLP_ERROR_WORKSPACE_TOO_SMALL);
  EXPECT_TRUE(contains(fmlp_last_error(), "workspace_bytes is 15")) << fmlp_last_error();
  EXPECT_EQ(count, -3) << "count was written on error";
  // Host memory: INVALID_VALUE where CUDA is built (with or without a device), else the backend
  // is unavailable.
  if (contains(fmlp_build_info(), "cuda on")) {
    EXPECT_EQ(fmlp_moe_device_errors(ws, sizeof ws, nullptr, &count), FMLP_ERROR_INVALID_VALUE);
    EXPECT_TRUE(contains(fmlp_last_error(), "not device memory")) << fmlp_last_error();
  } else {
    EXPECT_EQ(fmlp_moe_device_errors(ws, sizeof ws, nullptr, &count),
              FMLP_ERROR_BACKEND_UNAVAILABLE);
  }
  EXPECT_EQ(count, -3);
}

// fusedmlp.h: CUDA workspaces start on a 256-byte boundary, FMLP_ERROR_MISALIGNED otherwise.
// fmlp_mlp, fmlp_mlp_with_kernel (every cuda entry that takes the request and uses a workspace)
// and fmlp_mlp_packed_run reject a workspace off that boundary, naming it, and write neither y nor
// the workspace; offset by 256 bytes it runs.
TEST(MlpCudaWorkspace, MisalignedIsRejectedAndNothingIsWritten) {
  SKIP_WITHOUT_GPU();
  MlpCase c;
  c.m = 1, c.d_in = 64, c.hidden = 128, c.d_out = 64;
  c.x_dtype = c.w_dtype = FMLP_DTYPE_BF16;
  c.act = FMLP_ACT_SILU;
  PlacedCase p(c, true);
  p.upload(make_data(c, mix_seed(test_seed(), 55)));
  const fmlp_mlp_args_t& a = p.args();
  size_t need = 0;
  ASSERT_EQ(fmlp_mlp_workspace_size(&a, FMLP_BACKEND_CUDA, &need), FMLP_SUCCESS)
      << fmlp_last_error();
  ASSERT_GT(need, 0u) << "the check applies to entries that use a workspace; this request's "
                         "dispatch is expected to take one (mlp_decode_sm80_stream stages h)";
  Buffer ws(need + 512, true);
  ws.init_workspace();  // zeroed part zero, scratch dirty (fusedmlp.h)
  const std::vector<unsigned char> y_before = p.y_bytes(), ws_before = ws.download();
  auto expect_misaligned = [&](const std::string& what, fmlp_status_t s) {
    const std::string msg = fmlp_last_error();
    EXPECT_EQ(s, FMLP_ERROR_MISALIGNED) << what << ": " << fmlp_status_name(s) << ": " << msg;
    EXPECT_TRUE(contains(msg, "workspace") && contains(msg, "not 256-byte aligned"))
        << what << ": " << msg;
    EXPECT_EQ(p.y_bytes(), y_before) << what << " wrote y";
    EXPECT_EQ(ws.download(), ws_before) << what << " wrote the workspace";
  };
  for (size_t off : {size_t(16), size_t(128)})
    expect_misaligned("fmlp_mlp at +" + std::to_string(off),
                      fmlp_mlp(&a, FMLP_BACKEND_CUDA, ws.bytes_at(off), need, nullptr));
  int entries = 0;
  for (int i = 0; i < fmlp_mlp_kernel_count(); ++i) {
    const char* k = fmlp_mlp_kernel_name(i);
    size_t kneed = 0;
    if (fmlp_mlp_kernel_backend(i) != FMLP_BACKEND_CUDA ||
        fmlp_mlp_kernel_supports(&a, k) != FMLP_SUCCESS ||
        fmlp_mlp_kernel_workspace_size(&a, k, &kneed) != FMLP_SUCCESS || kneed == 0 ||
        kneed > need + 256)
      continue;
    expect_misaligned(std::string("fmlp_mlp_with_kernel ") + k,
                      fmlp_mlp_with_kernel(&a, k, ws.bytes_at(16), kneed, nullptr));
    ++entries;
  }
  EXPECT_GE(entries, 1) << "no cuda entry with a workspace took the request";
  fmlp_mlp_packed_t* packed = nullptr;
  ASSERT_EQ(fmlp_mlp_pack(&packed, &a.weights, &a.config, FMLP_BACKEND_CUDA, nullptr), FMLP_SUCCESS)
      << fmlp_last_error();
  size_t pneed = 0;
  ASSERT_EQ(fmlp_mlp_packed_workspace_size(packed, &a.y, &a.x, &pneed), FMLP_SUCCESS)
      << fmlp_last_error();
  if (pneed > 0 && pneed <= need + 256)
    expect_misaligned("fmlp_mlp_packed_run", fmlp_mlp_packed_run(packed, &a.y, &a.x, nullptr,
                                                                 ws.bytes_at(16), pneed, nullptr));
  fmlp_mlp_packed_destroy(packed);
  // A multiple of 256 bytes past cudaMalloc's boundary is fine.
  ASSERT_EQ(fmlp_mlp(&a, FMLP_BACKEND_CUDA, ws.bytes_at(256), need, nullptr), FMLP_SUCCESS)
      << fmlp_last_error();
  EXPECT_NE(p.y_bytes(), y_before) << "the aligned call wrote nothing";
}

}  // namespace
}  // namespace fmlp_test
