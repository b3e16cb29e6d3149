// The FMLP_* environment knobs (core/knobs.def): parsing, validation, the once-per-knob warning,
// and the C ABI that enumerates them (fmlp_knob_count, fmlp_knob_info, fmlp_knob_find). This is
// the only file of the library that calls getenv for an FMLP_ variable (tests/check_knobs.py).
#include "core/knobs.hpp"

#include <fmt/format.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace fmlp::detail {
namespace {

static_assert(int(KnobKind::kBool) == FMLP_KNOB_BOOL && int(KnobKind::kInt) == FMLP_KNOB_INT &&
                  int(KnobKind::kFloat) == FMLP_KNOB_FLOAT &&
                  int(KnobKind::kString) == FMLP_KNOB_STRING,
              "KnobKind mirrors fmlp_knob_kind_t");

// Zero-initialised before any dynamic initialiser runs, so knobs read during static
// initialisation (moe/tuning.cpp) find it ready.
std::atomic<bool> g_warned[kKnobCount];

const KnobRow& row(Knob k) {
  return kKnobRows[int(k)];
}

// "a|b|c" split at '|'.
std::vector<std::string> words(const char* range) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = range; *p; ++p) {
    if (*p == '|') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += *p;
    }
  }
  out.push_back(cur);
  return out;
}

// "lo..hi": the two bounds' text.
bool interval(const char* range, std::string* lo, std::string* hi) {
  const char* dots = std::strstr(range, "..");
  if (dots == nullptr) return false;
  *lo = std::string(range, size_t(dots - range));
  *hi = std::string(dots + 2);
  return true;
}

// Decimal text only: no leading blanks (which strtoll/strtod would skip), no hexadecimal.
bool plain_decimal(const std::string& s) {
  return !s.empty() && !std::isspace((unsigned char)s[0]) &&
         s.find_first_of("xX") == std::string::npos;
}

bool parse_int(const std::string& s, long long* v) {
  if (!plain_decimal(s)) return false;
  char* end = nullptr;
  errno = 0;
  *v = std::strtoll(s.c_str(), &end, 10);
  return errno == 0 && *end == '\0';
}

bool parse_float(const std::string& s, double* v) {
  if (!plain_decimal(s)) return false;
  char* end = nullptr;
  errno = 0;
  *v = std::strtod(s.c_str(), &end);
  return errno == 0 && *end == '\0' && std::isfinite(*v);
}

bool iequal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower((unsigned char)a[i]) != std::tolower((unsigned char)b[i])) return false;
  return true;
}

std::string join_words(const char* range) {
  const std::vector<std::string> w = words(range);
  std::string out;
  for (size_t i = 0; i < w.size(); ++i) out += (i ? ", " : "") + w[i];
  return out;
}

// What the row accepts, for the messages.
std::string expectation(const KnobRow& r) {
  std::string lo, hi;
  switch (r.kind) {
    case KnobKind::kBool: return "0 or 1";
    case KnobKind::kInt:
      if (interval(r.range, &lo, &hi)) return fmt::format("an integer in [{}, {}]", lo, hi);
      return "one of " + join_words(r.range);
    case KnobKind::kFloat:
      if (interval(r.range, &lo, &hi)) return fmt::format("a number in [{}, {}]", lo, hi);
      return "one of " + join_words(r.range);
    case KnobKind::kString:
      return *r.range ? "one of " + join_words(r.range) + " (or unset)" : "any text";
  }
  return "";
}

std::string default_text(const KnobRow& r) {
  return *r.default_value ? std::string(r.default_value) : std::string("unset");
}

std::string rejection(const KnobRow& r, const std::string& env, const std::string& expected) {
  return fmt::format("{}={} ignored: expected {}; the default ({}) applies", r.name, env, expected,
                     default_text(r));
}

// Whether the numeric v lies in the row's range ("lo..hi" or a list of values).
template <typename T, typename PARSE>
bool in_range(const KnobRow& r, T v, PARSE parse) {
  std::string lo, hi;
  if (interval(r.range, &lo, &hi)) {
    T a{}, b{};
    return parse(lo, &a) && parse(hi, &b) && v >= a && v <= b;
  }
  for (const std::string& w : words(r.range)) {
    T a{};
    if (parse(w, &a) && a == v) return true;
  }
  return false;
}

void warn_once(Knob k, const std::string& message) {
  if (g_warned[int(k)].exchange(true)) return;
  std::fprintf(stderr, "fusedmlp: %s\n", message.c_str());
  std::fflush(stderr);
}

}  // namespace

KnobValue knob_evaluate(Knob k) {
  const KnobRow& r = row(k);
  KnobValue out;
  out.value = r.default_value;
  // The default's own number, where it is one ("auto" and text: 0).
  if (r.kind == KnobKind::kFloat) parse_float(r.default_value, &out.f);
  if (r.kind == KnobKind::kBool || r.kind == KnobKind::kInt) parse_int(r.default_value, &out.i);
  const char* e = std::getenv(r.name);
  if (e == nullptr || *e == '\0') return out;
  out.set = true;
  out.env = e;
  bool ok = false;
  std::string value = out.env;
  long long i = 0;
  double f = 0;
  switch (r.kind) {
    case KnobKind::kBool:
    case KnobKind::kInt: ok = parse_int(out.env, &i) && in_range(r, i, parse_int); break;
    case KnobKind::kFloat: ok = parse_float(out.env, &f) && in_range(r, f, parse_float); break;
    case KnobKind::kString:
      if (!*r.range) {
        ok = true;
        break;
      }
      for (const std::string& w : words(r.range))  // the word as the table spells it
        if (iequal(w, out.env)) ok = true, value = w;
      break;
  }
  if (!ok) {
    out.ok = false;
    out.error = rejection(r, out.env, expectation(r));
    return out;
  }
  out.value = value;
  out.i = i;
  if (r.kind == KnobKind::kFloat) out.f = f;
  return out;
}

long long knob_read_int(Knob k, long long automatic) {
  const KnobValue v = knob_evaluate(k);
  if (!v.ok) warn_once(k, v.error);
  if (v.set && v.ok) return v.i;
  return knob_default_is_auto(k) ? automatic : v.i;
}

double knob_read_float(Knob k) {
  const KnobValue v = knob_evaluate(k);
  if (!v.ok) warn_once(k, v.error);
  return v.f;
}

std::string knob_read_string(Knob k) {
  const KnobValue v = knob_evaluate(k);
  if (!v.ok) warn_once(k, v.error);
  return v.value;
}

void knob_reject(Knob k, const std::string& expected) {
  const KnobValue v = knob_evaluate(k);
  warn_once(k, rejection(row(k), v.env, expected));
}

}  // namespace fmlp::detail

using fmlp::detail::kKnobCount;
using fmlp::detail::kKnobRows;
using fmlp::detail::Knob;

extern "C" {

int fmlp_knob_count(void) {
  return kKnobCount;
}

fmlp_status_t fmlp_knob_info(int index, fmlp_knob_info_t* info) {
  if (info == nullptr) return fmlp::detail::fail(FMLP_ERROR_NULL_POINTER, "info is NULL");
  if (index < 0 || index >= kKnobCount)
    return fmlp::detail::fail(FMLP_ERROR_INDEX_OUT_OF_RANGE,
                              "knob index {} is outside [0, {}) (fmlp_knob_count)", index,
                              kKnobCount);
  // The parts that change with the environment live per thread until the next call.
  thread_local fmlp::detail::KnobValue held;
  const fmlp::detail::KnobRow& r = kKnobRows[index];
  held = fmlp::detail::knob_evaluate(Knob(index));
  info->name = r.name;
  info->kind = fmlp_knob_kind_t(int(r.kind));
  info->scope = r.scope;
  info->default_value = r.default_value;
  info->range = r.range;
  info->purpose = r.purpose;
  info->env = held.set ? held.env.c_str() : nullptr;
  info->value = held.value.c_str();
  info->error = held.error.c_str();
  fmlp::detail::clear_last_error();
  return FMLP_SUCCESS;
}

int fmlp_knob_find(const char* name) {
  if (name == nullptr) return -1;
  for (int i = 0; i < kKnobCount; ++i)
    if (std::strcmp(kKnobRows[i].name, name) == 0) return i;
  return -1;
}

}  // extern "C"
