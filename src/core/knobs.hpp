// The FMLP_* environment knobs (core/knobs.def): the one place the library reads them.
//
//   static const bool on = knob_bool<Knob::FMLP_STREAM_PDL>();
//   static const int u = int(knob_int_or<Knob::FMLP_STREAM_U>(0));  // "auto": 0 when unset
//
// A read validates the environment's text against the row's kind and range; a value it rejects
// is reported once per knob and process on stderr ("fusedmlp: FMLP_STREAM_U=7 ignored: expected
// one of 3, 4; the default (auto) applies") and the default applies. The templates check at
// compile time that the read matches the row's kind and whether its default is "auto". Callers
// that read once keep the value in a function-local static.
#pragma once
#include <string>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

enum class Knob : int {
#define FMLP_KNOB(NAME, KIND, DEFAULT, RANGE, SCOPE, PURPOSE) NAME,
#include "core/knobs.def"
#undef FMLP_KNOB
};

enum class KnobKind : int { kBool, kInt, kFloat, kString };

struct KnobRow {
  const char* name;
  KnobKind kind;
  const char* default_value;
  const char* range;
  const char* scope;
  const char* purpose;
};

inline constexpr KnobRow kKnobRows[] = {
#define FMLP_KNOB(NAME, KIND, DEFAULT, RANGE, SCOPE, PURPOSE) \
  {#NAME, KnobKind::KIND, DEFAULT, RANGE, SCOPE, PURPOSE},
#include "core/knobs.def"
#undef FMLP_KNOB
};
inline constexpr int kKnobCount = int(sizeof(kKnobRows) / sizeof(kKnobRows[0]));

constexpr bool knob_default_is_auto(Knob k) {
  const char* d = kKnobRows[int(k)].default_value;
  return d[0] == 'a' && d[1] == 'u' && d[2] == 't' && d[3] == 'o' && d[4] == '\0';
}

// A knob evaluated against the environment now.
struct KnobValue {
  bool set = false;   // the variable is set and not empty
  bool ok = true;     // false: set but rejected (error says why); the default applies
  std::string env;    // the environment's text ("" when unset)
  std::string value;  // the value that applies, as text (the default when unset or rejected)
  long long i = 0;    // kBool / kInt: the value when set and ok
  double f = 0;       // kFloat: the value that applies
  std::string error;  // why env is rejected: "FMLP_STREAM_U=7 ignored: expected ..."
};
KnobValue knob_evaluate(Knob k);

// The reads behind the templates below (each warns once on stderr when it rejects a value).
// Exported from the shared library although internal: the in-tree probes (bench/hbm_probe.cu,
// bench/streamk_probe.cu) compile engine headers that read knobs.
FMLP_API long long knob_read_int(Knob k, long long automatic);
FMLP_API double knob_read_float(Knob k);
std::string knob_read_string(Knob k);
// For checks only the read site can make (a string's format, an entry name): reports once on
// stderr that the value of k was ignored because `expected` did not hold.
void knob_reject(Knob k, const std::string& expected);

template <Knob K>
bool knob_bool() {
  static_assert(kKnobRows[int(K)].kind == KnobKind::kBool && !knob_default_is_auto(K),
                "knob_bool reads a kBool knob with a 0 or 1 default");
  return knob_read_int(K, 0) != 0;
}

template <Knob K>
long long knob_int() {
  static_assert(kKnobRows[int(K)].kind == KnobKind::kInt && !knob_default_is_auto(K),
                "knob_int reads a kInt knob with a numeric default; use knob_int_or for auto");
  return knob_read_int(K, 0);
}

// A knob whose default is "auto": its value when set and accepted, else `automatic`.
template <Knob K>
long long knob_int_or(long long automatic) {
  static_assert(kKnobRows[int(K)].kind == KnobKind::kInt && knob_default_is_auto(K),
                "knob_int_or reads a kInt knob whose default is auto");
  return knob_read_int(K, automatic);
}

template <Knob K>
double knob_float() {
  static_assert(kKnobRows[int(K)].kind == KnobKind::kFloat && !knob_default_is_auto(K),
                "knob_float reads a kFloat knob with a numeric default");
  return knob_read_float(K);
}

// "" when unset.
template <Knob K>
std::string knob_string() {
  static_assert(kKnobRows[int(K)].kind == KnobKind::kString, "knob_string reads a kString knob");
  return knob_read_string(K);
}

}  // namespace fmlp::detail
