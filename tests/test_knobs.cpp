// The environment knob table through the C ABI (fmlp_knob_count, fmlp_knob_info,
// fmlp_knob_find): every row well formed, and the environment's text accepted, or rejected with
// a message naming the variable, what it accepts and what came. tests/check_knobs.py checks the
// table against the sources, scripts/gen_tuning_doc.py --check against docs/tuning.md.
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <string>

#include "fusedmlp/fusedmlp.h"

namespace {

// Sets `name` to `value` (nullptr: unsets it) for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) had_ = true, old_ = old;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

fmlp_knob_info_t info_of(const char* name) {
  fmlp_knob_info_t k{};
  const int i = fmlp_knob_find(name);
  EXPECT_GE(i, 0) << name;
  EXPECT_EQ(fmlp_knob_info(i, &k), FMLP_SUCCESS) << fmlp_last_error();
  return k;
}

TEST(Knobs, EveryRowIsWellFormed) {
  const int n = fmlp_knob_count();
  ASSERT_GT(n, 0);
  std::set<std::string> names;
  const std::set<std::string> scopes = {"cuda", "dist", "python", "cli", "test"};
  for (int i = 0; i < n; ++i) {
    fmlp_knob_info_t k{};
    ASSERT_EQ(fmlp_knob_info(i, &k), FMLP_SUCCESS) << fmlp_last_error();
    const std::string name = k.name;
    EXPECT_EQ(name.rfind("FMLP_", 0), 0u) << name;
    EXPECT_TRUE(names.insert(name).second) << name << " is listed twice";
    EXPECT_EQ(fmlp_knob_find(k.name), i) << name;
    EXPECT_TRUE(scopes.count(k.scope)) << name << ": scope " << k.scope;
    EXPECT_GT(std::string(k.purpose).size(), 20u) << name;
    EXPECT_GE(int(k.kind), int(FMLP_KNOB_BOOL)) << name;
    EXPECT_LE(int(k.kind), int(FMLP_KNOB_STRING)) << name;
    if (k.kind == FMLP_KNOB_BOOL) {
      EXPECT_STREQ(k.range, "0|1") << name;
      EXPECT_TRUE(std::string(k.default_value) == "0" || std::string(k.default_value) == "1")
          << name;
    }
    if (k.kind == FMLP_KNOB_INT || k.kind == FMLP_KNOB_FLOAT) {
      EXPECT_NE(*k.range, '\0') << name;
    }
    if (k.kind == FMLP_KNOB_STRING) {
      EXPECT_STREQ(k.default_value, "") << name;
    }
    if (k.env == nullptr) {  // unset here: the default applies
      EXPECT_STREQ(k.value, k.default_value) << name;
      EXPECT_STREQ(k.error, "") << name;
    }
  }
  EXPECT_EQ(fmlp_knob_find("FMLP_NO_SUCH_KNOB"), -1);
  EXPECT_EQ(fmlp_knob_find(nullptr), -1);
}

TEST(Knobs, BadCallsFail) {
  fmlp_knob_info_t k{};
  EXPECT_EQ(fmlp_knob_info(-1, &k), FMLP_ERROR_INDEX_OUT_OF_RANGE);
  EXPECT_NE(std::string(fmlp_last_error()).find("fmlp_knob_count"), std::string::npos);
  EXPECT_EQ(fmlp_knob_info(fmlp_knob_count(), &k), FMLP_ERROR_INDEX_OUT_OF_RANGE);
  EXPECT_EQ(fmlp_knob_info(0, nullptr), FMLP_ERROR_NULL_POINTER);
}

TEST(Knobs, IntegerInRangeIsAccepted) {
  const ScopedEnv env("FMLP_PREFILL_SCRATCH_MB", "256");
  const fmlp_knob_info_t k = info_of("FMLP_PREFILL_SCRATCH_MB");
  EXPECT_EQ(k.kind, FMLP_KNOB_INT);
  EXPECT_STREQ(k.env, "256");
  EXPECT_STREQ(k.value, "256");
  EXPECT_STREQ(k.error, "");
}

TEST(Knobs, IntegerOutOfRangeIsRejectedWithTheRangeAndWhatCame) {
  const ScopedEnv env("FMLP_PREFILL_SCRATCH_MB", "4");
  const fmlp_knob_info_t k = info_of("FMLP_PREFILL_SCRATCH_MB");
  EXPECT_STREQ(k.env, "4");
  EXPECT_STREQ(k.value, "128");  // the default
  EXPECT_STREQ(k.error,
               "FMLP_PREFILL_SCRATCH_MB=4 ignored: expected an integer in [8, 1024]; the default "
               "(128) applies");
}

TEST(Knobs, NotANumberIsRejected) {
  for (const char* bad : {"12abc", "1.5", " 3", "0x10"}) {
    const ScopedEnv env("FMLP_STREAM_U", bad);
    const fmlp_knob_info_t k = info_of("FMLP_STREAM_U");
    EXPECT_STREQ(k.value, "auto") << bad;
    EXPECT_EQ(std::string(k.error),
              std::string("FMLP_STREAM_U=") + bad +
                  " ignored: expected one of 3, 4; the default (auto) applies");
  }
}

TEST(Knobs, ListedValuesOnly) {
  {
    const ScopedEnv env("FMLP_DECODE_CLUSTER", "4");
    EXPECT_STREQ(info_of("FMLP_DECODE_CLUSTER").value, "4");
  }
  const ScopedEnv env("FMLP_DECODE_CLUSTER", "3");
  const fmlp_knob_info_t k = info_of("FMLP_DECODE_CLUSTER");
  EXPECT_STREQ(k.value, "auto");
  EXPECT_NE(std::string(k.error).find("expected one of 1, 2, 4, 8"), std::string::npos) << k.error;
}

TEST(Knobs, BoolTakesZeroOrOne) {
  {
    const ScopedEnv env("FMLP_PLAN_TUNE", "0");
    EXPECT_STREQ(info_of("FMLP_PLAN_TUNE").value, "0");
  }
  const ScopedEnv env("FMLP_PLAN_TUNE", "yes");
  const fmlp_knob_info_t k = info_of("FMLP_PLAN_TUNE");
  EXPECT_EQ(k.kind, FMLP_KNOB_BOOL);
  EXPECT_STREQ(k.value, "1");
  EXPECT_STREQ(k.error, "FMLP_PLAN_TUNE=yes ignored: expected 0 or 1; the default (1) applies");
}

TEST(Knobs, FloatInRange) {
  {
    const ScopedEnv env("FMLP_MOE_SM90_MIN_ROWS", "0.5");
    const fmlp_knob_info_t k = info_of("FMLP_MOE_SM90_MIN_ROWS");
    EXPECT_EQ(k.kind, FMLP_KNOB_FLOAT);
    EXPECT_STREQ(k.value, "0.5");
  }
  for (const char* bad : {"0", "-1", "nan", "inf", "2e9"}) {
    const ScopedEnv env("FMLP_MOE_SM90_MIN_ROWS", bad);
    const fmlp_knob_info_t k = info_of("FMLP_MOE_SM90_MIN_ROWS");
    EXPECT_STREQ(k.value, k.default_value) << bad;
    EXPECT_NE(std::string(k.error).find("expected a number in [1e-9, 1e9]"), std::string::npos)
        << k.error;
  }
}

TEST(Knobs, StringWordsMatchWithoutCase) {
  {
    const ScopedEnv env("FMLP_TORCH_OPS", "Python");
    const fmlp_knob_info_t k = info_of("FMLP_TORCH_OPS");
    EXPECT_STREQ(k.value, "python");  // as the table spells it
    EXPECT_STREQ(k.error, "");
  }
  const ScopedEnv env("FMLP_TORCH_OPS", "cpp");
  const fmlp_knob_info_t k = info_of("FMLP_TORCH_OPS");
  EXPECT_STREQ(k.value, "");
  EXPECT_STREQ(k.error,
               "FMLP_TORCH_OPS=cpp ignored: expected one of python (or unset); the default "
               "(unset) applies");
}

TEST(Knobs, FreeTextAndEmptyMeansUnset) {
  {
    const ScopedEnv env("FMLP_NCCL_LIBRARY", "/opt/nccl/lib/libnccl.so.2");
    EXPECT_STREQ(info_of("FMLP_NCCL_LIBRARY").value, "/opt/nccl/lib/libnccl.so.2");
  }
  const ScopedEnv env("FMLP_PREFILL_SCRATCH_MB", "");
  const fmlp_knob_info_t k = info_of("FMLP_PREFILL_SCRATCH_MB");
  EXPECT_EQ(k.env, nullptr);
  EXPECT_STREQ(k.value, "128");
}

}  // namespace
