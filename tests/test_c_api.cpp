// The C ABI around the op: thread-local errors, names, version, the op table, explain, and the C++
// wrapper's exceptions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fusedmlp/dtype.hpp"
#include "fusedmlp/fusedmlp.h"
#include "fusedmlp/fusedmlp.hpp"

namespace {

// y = W2 relu(W1 x + b1) + b2 with M = 2, d_in = 3, hidden = 2, d_out = 3, in f32.
struct Tiny {
  float x[6] = {1, -2, 3, 0.5f, 0.25f, -1};
  float w1[6] = {0.5f, -1, 0.25f, 1, 1, -0.5f};
  float b1[2] = {0.125f, -0.25f};
  float w2[6] = {1, -1, 0.5f, 2, -0.25f, 0.75f};
  float b2[3] = {0.5f, 0, -1};
  float y[6] = {};
  fmlp_mlp_args_t args{};
  Tiny() {
    args.x = fmlp::view(x, 2, 3);
    args.y = fmlp::view(y, 2, 3);
    args.weights.w1 = fmlp::view(w1, 2, 3);
    args.weights.b1 = fmlp::view(b1, 2);
    args.weights.w2 = fmlp::view(w2, 3, 2);
    args.weights.b2 = fmlp::view(b2, 3);
    args.config = fmlp_mlp_config_default();
    args.config.activation = FMLP_ACT_RELU;
  }
  double expected(int i, int o) const {
    double out = b2[o];
    for (int j = 0; j < 2; ++j) {
      double g = b1[j];
      for (int k = 0; k < 3; ++k) g += double(w1[j * 3 + k]) * x[i * 3 + k];
      out += double(w2[o * 2 + j]) * std::max(g, 0.0);
    }
    return out;
  }
};

// A call that fails with a message naming `tag`.
void make_error(const char* tag) {
  Tiny t;
  t.args.x.shape[1] = 3 + int64_t(std::strlen(tag));
  t.args.x.stride[0] = t.args.x.shape[1];
  fmlp_mlp(&t.args, FMLP_BACKEND_REF, nullptr, 0, nullptr);
}

TEST(LastError, IsThreadLocal) {
  make_error("main");
  const std::string main_msg = fmlp_last_error();
  ASSERT_FALSE(main_msg.empty());
  std::string thread_msg, thread_after_success;
  std::thread other([&] {
    EXPECT_STREQ(fmlp_last_error(), "") << "a new thread starts without an error";
    make_error("other thread");
    thread_msg = fmlp_last_error();
    EXPECT_EQ(fmlp_backend_available(FMLP_BACKEND_REF), FMLP_SUCCESS);
    thread_after_success = fmlp_last_error();
  });
  other.join();
  EXPECT_NE(thread_msg, main_msg);
  EXPECT_FALSE(thread_msg.empty());
  EXPECT_EQ(thread_after_success, "");
  EXPECT_EQ(fmlp_last_error(), main_msg) << "another thread's calls changed this thread's error";
}

TEST(LastError, SuccessClearsIt) {
  Tiny t;
  std::vector<unsigned char> ws(4096);
  size_t bytes = 0;
  auto after_error = [](const char* api, fmlp_status_t s) {
    EXPECT_EQ(s, FMLP_SUCCESS) << api << ": " << fmlp_last_error();
    EXPECT_STREQ(fmlp_last_error(), "") << api << " succeeded but left the previous error";
  };
  make_error("x");
  after_error("fmlp_mlp", fmlp_mlp(&t.args, FMLP_BACKEND_REF, ws.data(), ws.size(), nullptr));
  make_error("x");
  after_error("fmlp_mlp_workspace_size",
              fmlp_mlp_workspace_size(&t.args, FMLP_BACKEND_REF, &bytes));
  make_error("x");
  after_error("fmlp_mlp_explain", fmlp_mlp_explain(&t.args, FMLP_BACKEND_REF, nullptr, 0, &bytes));
  make_error("x");
  after_error("fmlp_mlp_kernel_supports", fmlp_mlp_kernel_supports(&t.args, "mlp_ref_scalar_fp64"));
  make_error("x");
  after_error("fmlp_mlp_with_kernel",
              fmlp_mlp_with_kernel(&t.args, "mlp_ref_scalar_fp64", ws.data(), ws.size(), nullptr));
  make_error("x");
  after_error("fmlp_backend_available", fmlp_backend_available(FMLP_BACKEND_REF));
  fmlp_mlp_packed_t* p = nullptr;
  make_error("x");
  after_error("fmlp_mlp_pack",
              fmlp_mlp_pack(&p, &t.args.weights, &t.args.config, FMLP_BACKEND_REF, nullptr));
  make_error("x");
  after_error("fmlp_mlp_packed_run",
              fmlp_mlp_packed_run(p, &t.args.y, &t.args.x, nullptr, ws.data(), ws.size(), nullptr));
  fmlp_mlp_packed_destroy(p);
  // M = 0 returns early in several places; it must still clear.
  t.args.x.shape[0] = t.args.y.shape[0] = 0;
  make_error("x");
  after_error("fmlp_mlp (M = 0)", fmlp_mlp(&t.args, FMLP_BACKEND_REF, nullptr, 0, nullptr));
  make_error("x");
  after_error("fmlp_mlp_with_kernel (M = 0)",
              fmlp_mlp_with_kernel(&t.args, "mlp_ref_scalar_fp64", nullptr, 0, nullptr));
}

TEST(Names, EveryStatusHasItsOwnName) {
  std::set<std::string> seen;
  for (int s = FMLP_SUCCESS; s <= FMLP_ERROR_INTERNAL; ++s) {
    const char* name = fmlp_status_name(fmlp_status_t(s));
    ASSERT_NE(name, nullptr);
    EXPECT_STRNE(name, "unknown status") << "status " << s;
    EXPECT_TRUE(seen.insert(name).second) << "status " << s << " repeats the name " << name;
  }
  EXPECT_STREQ(fmlp_status_name(FMLP_SUCCESS), "success");
  EXPECT_STREQ(fmlp_status_name(fmlp_status_t(FMLP_ERROR_INTERNAL + 1)), "unknown status");
  EXPECT_STREQ(fmlp_status_name(fmlp_status_t(1000)), "unknown status");
}

TEST(Names, BackendsDtypesActivations) {
  EXPECT_STREQ(fmlp_backend_name(FMLP_BACKEND_AUTO), "auto");
  EXPECT_STREQ(fmlp_backend_name(FMLP_BACKEND_REF), "ref");
  EXPECT_STREQ(fmlp_backend_name(FMLP_BACKEND_CPU), "cpu");
  EXPECT_STREQ(fmlp_backend_name(FMLP_BACKEND_CUDA), "cuda");
  EXPECT_STREQ(fmlp_dtype_name(FMLP_DTYPE_F32), "f32");
  EXPECT_STREQ(fmlp_dtype_name(FMLP_DTYPE_F16), "f16");
  EXPECT_STREQ(fmlp_dtype_name(FMLP_DTYPE_BF16), "bf16");
  EXPECT_STREQ(fmlp_dtype_name(FMLP_DTYPE_F8_E4M3), "f8_e4m3");
  EXPECT_STREQ(fmlp_dtype_name(fmlp_dtype_t(77)), "invalid");
  EXPECT_STREQ(fmlp_activation_name(FMLP_ACT_RELU), "relu");
  EXPECT_STREQ(fmlp_activation_name(FMLP_ACT_GELU), "gelu");
  EXPECT_STREQ(fmlp_activation_name(FMLP_ACT_GELU_TANH), "gelu_tanh");
  EXPECT_STREQ(fmlp_activation_name(FMLP_ACT_SILU), "silu");
  EXPECT_STREQ(fmlp_activation_name(FMLP_ACT_RELU2), "relu2");
}

TEST(Version, MatchesTheProject) {
  const std::string v = fmlp_version();
  EXPECT_TRUE(std::regex_match(v, std::regex(R"(\d+\.\d+\.\d+.*)"))) << v;
  EXPECT_EQ(v, FMLP_TEST_VERSION);
}

TEST(Backends, RefIsAlwaysAvailableOthersSayWhyNot) {
  EXPECT_EQ(fmlp_backend_available(FMLP_BACKEND_REF), FMLP_SUCCESS);
  EXPECT_EQ(fmlp_backend_available(FMLP_BACKEND_AUTO), FMLP_SUCCESS);
  for (fmlp_backend_t b : {FMLP_BACKEND_CPU, FMLP_BACKEND_CUDA}) {
    const fmlp_status_t s = fmlp_backend_available(b);
    if (s == FMLP_SUCCESS) continue;
    EXPECT_EQ(s, FMLP_ERROR_BACKEND_UNAVAILABLE);
    EXPECT_GT(std::strlen(fmlp_last_error()), 10u) << fmlp_backend_name(b) << " gives no reason";
  }
}

TEST(OpTable, NamesAreUniqueAndFollowTheScheme) {
  const int n = fmlp_mlp_kernel_count();
  ASSERT_GE(n, 1);
  std::set<std::string> names;
  bool has_ref = false;
  for (int i = 0; i < n; ++i) {
    const char* name = fmlp_mlp_kernel_name(i);
    ASSERT_NE(name, nullptr) << "entry " << i;
    const fmlp_backend_t b = fmlp_mlp_kernel_backend(i);
    EXPECT_TRUE(b == FMLP_BACKEND_REF || b == FMLP_BACKEND_CPU || b == FMLP_BACKEND_CUDA) << name;
    // op[_phase]_arch_technique: mlp_cpu_avx2_decode, mlp_decode_sm90_splitk, mlp_ref_scalar_fp64.
    const std::string arch =
        b == FMLP_BACKEND_CUDA ? "(cuda|sm[0-9]+[a-z]?)" : fmlp_backend_name(b);
    EXPECT_TRUE(std::regex_match(name, std::regex("mlp(_[a-z]+)?_" + arch + "(_[a-z0-9]+)+")))
        << name << " does not follow op_arch_technique with arch " << arch;
    EXPECT_TRUE(names.insert(name).second) << name << " is registered twice";
    has_ref = has_ref || std::strcmp(name, "mlp_ref_scalar_fp64") == 0;
  }
  EXPECT_TRUE(has_ref);
  EXPECT_EQ(fmlp_mlp_kernel_name(n), nullptr);
  EXPECT_EQ(fmlp_mlp_kernel_name(-1), nullptr);
}

// explain names the kernel dispatch would run: the first entry of the backend that supports args.
TEST(Explain, NamesTheChosenKernel) {
  Tiny t;
  for (fmlp_backend_t b : {FMLP_BACKEND_REF, FMLP_BACKEND_CPU, FMLP_BACKEND_AUTO}) {
    if (fmlp_backend_available(b) != FMLP_SUCCESS) continue;
    const fmlp_backend_t resolved = b != FMLP_BACKEND_AUTO ? b
                                    : fmlp_backend_available(FMLP_BACKEND_CPU) == FMLP_SUCCESS
                                        ? FMLP_BACKEND_CPU
                                        : FMLP_BACKEND_REF;
    std::string first;
    for (int i = 0; i < fmlp_mlp_kernel_count() && first.empty(); ++i)
      if (fmlp_mlp_kernel_backend(i) == resolved &&
          fmlp_mlp_kernel_supports(&t.args, fmlp_mlp_kernel_name(i)) == FMLP_SUCCESS)
        first = fmlp_mlp_kernel_name(i);
    const std::string report = fmlp::explain(t.args, b);
    SCOPED_TRACE(report);
    EXPECT_NE(report.find(std::string("backend ") + fmlp_backend_name(resolved)),
              std::string::npos);
    if (first.empty())
      EXPECT_NE(report.find("no kernel of this backend handles the request"), std::string::npos);
    else
      EXPECT_NE(report.find("chosen   " + first), std::string::npos) << "expected " << first;
  }
}

TEST(CppApi, RunsAndMatchesHandComputedValues) {
  Tiny t;
  fmlp::mlp(t.args, FMLP_BACKEND_REF);
  for (int i = 0; i < 2; ++i)
    for (int o = 0; o < 3; ++o) EXPECT_NEAR(t.y[i * 3 + o], t.expected(i, o), 1e-6);
}

TEST(CppApi, ThrowsErrorWithStatusAndMessage) {
  Tiny t;
  t.args.weights.b2.shape[0] = 2;
  try {
    fmlp::mlp(t.args, FMLP_BACKEND_REF);
    FAIL() << "no exception";
  } catch (const fmlp::Error& e) {
    EXPECT_EQ(e.status(), FMLP_ERROR_SHAPE_MISMATCH);
    EXPECT_NE(std::string(e.what()).find("shape mismatch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("weights.b2"), std::string::npos) << e.what();
  }
  try {
    const fmlp::PackedMlp packed(t.args.weights, t.args.config, FMLP_BACKEND_REF);
    FAIL() << "no exception";
  } catch (const fmlp::Error& e) {
    EXPECT_EQ(e.status(), FMLP_ERROR_SHAPE_MISMATCH);
  }
  EXPECT_THROW(fmlp::check(FMLP_ERROR_INTERNAL), fmlp::Error);
  EXPECT_NO_THROW(fmlp::check(FMLP_SUCCESS));
  Tiny good;
  const fmlp::PackedMlp packed(good.args.weights, good.args.config, FMLP_BACKEND_REF);
  good.args.x.shape[1] = 2;
  try {
    packed.run(good.args.y, good.args.x);
    FAIL() << "no exception";
  } catch (const fmlp::Error& e) {
    EXPECT_EQ(e.status(), FMLP_ERROR_SHAPE_MISMATCH);
    EXPECT_NE(std::string(e.what()).find("x must have shape"), std::string::npos) << e.what();
  }
}

TEST(TensorHelpers, ViewsAndDefaults) {
  const fmlp_tensor_t none = fmlp_tensor_none();
  EXPECT_EQ(none.data, nullptr);
  EXPECT_EQ(none.ndim, 0);
  float buf[12];
  const fmlp_tensor_t t = fmlp_tensor_2d(buf, FMLP_DTYPE_F32, 3, 2, 4);
  EXPECT_EQ(t.ndim, 2);
  EXPECT_EQ(t.shape[0], 3);
  EXPECT_EQ(t.shape[1], 2);
  EXPECT_EQ(t.stride[0], 4);
  EXPECT_EQ(t.stride[1], 1);
  EXPECT_EQ(t.device_type, FMLP_DEVICE_CPU);
  const fmlp_tensor_t v = fmlp_tensor_1d(buf, FMLP_DTYPE_BF16, 5);
  EXPECT_EQ(v.ndim, 1);
  EXPECT_EQ(v.shape[0], 5);
  EXPECT_EQ(v.stride[0], 1);
  const fmlp_mlp_config_t c = fmlp_mlp_config_default();
  EXPECT_EQ(c.gated, 0);
  EXPECT_EQ(c.norm, FMLP_NORM_NONE);
  EXPECT_GT(c.norm_eps, 0.f);
  EXPECT_EQ(fmlp::on_cuda(t, 1).device_type, FMLP_DEVICE_CUDA);
  EXPECT_EQ(fmlp::on_cuda(t, 1).device_id, 1);
}

}  // namespace

// The build string says whether CUDA is in; the device list is well formed either way.
TEST(Info, BuildInfoAndDeviceList) {
  const std::string build = fmlp_build_info();
  EXPECT_NE(build.find(fmlp_version()), std::string::npos) << build;
  EXPECT_TRUE(build.find("cuda on") != std::string::npos ||
              build.find("cuda off") != std::string::npos)
      << build;
  size_t needed = 0;
  ASSERT_EQ(fmlp_cuda_devices(nullptr, 0, &needed), FMLP_SUCCESS);
  ASSERT_GE(needed, 1u);
  std::string list(needed, 'x');
  ASSERT_EQ(fmlp_cuda_devices(list.data(), list.size(), &needed), FMLP_SUCCESS);
  EXPECT_EQ(list.back(), '\0');
  char tiny[4];
  ASSERT_EQ(fmlp_cuda_devices(tiny, sizeof tiny, &needed), FMLP_SUCCESS);
  EXPECT_LT(std::strlen(tiny), sizeof tiny);
  if (fmlp_backend_available(FMLP_BACKEND_CUDA) == FMLP_SUCCESS) {
    EXPECT_NE(list.find("cuda:0"), std::string::npos) << list;
  }
}

// The public host conversions round to nearest even, keep NaN a NaN and saturate fp8 at 448.
TEST(Dtype, PublicConversions) {
  EXPECT_EQ(fmlp::float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(fmlp::float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(fmlp::float_to_f16(1e6f), 0x7c00);  // overflow: +Inf
  EXPECT_TRUE(std::isnan(fmlp::bf16_to_float(fmlp::float_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(fmlp::f16_to_float(fmlp::float_to_f16(std::nanf("")))));
  EXPECT_EQ(fmlp::float_to_f8e4m3(448.0f), 0x7e);
  EXPECT_EQ(fmlp::float_to_f8e4m3(1000.0f), 0x7e);  // finite overflow saturates
  EXPECT_EQ(fmlp::float_to_f8e4m3(-1000.0f), 0xfe);
  EXPECT_TRUE(std::isnan(fmlp::f8e4m3_to_float(fmlp::float_to_f8e4m3(std::nanf("")))));
  for (float v : {0.0f, 0.5f, -1.75f, 3.0e-3f, 100.0f}) {
    const float b = fmlp::bf16_to_float(fmlp::float_to_bf16(v));
    const float h = fmlp::f16_to_float(fmlp::float_to_f16(v));
    EXPECT_LE(std::fabs(b - v), std::fabs(v) * 0x1p-8f) << v;  // half a bf16 ulp at most
    EXPECT_LE(std::fabs(h - v), std::fabs(v) * 0x1p-11f + 0x1p-25f) << v;
  }
  EXPECT_EQ(fmlp::f8e4m3_to_float(fmlp::float_to_f8e4m3(0.1015625f)), 0.1015625f);  // 13/128
  EXPECT_EQ(fmlp::dtype_size(FMLP_DTYPE_BF16), 2u);
}
