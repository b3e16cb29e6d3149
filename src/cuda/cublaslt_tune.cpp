// The cuBLASLt tune table and its file (cublaslt_tune.hpp).
#include "cuda/cublaslt_tune.hpp"

#include <cuda_runtime.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <utility>

#include "core/error.hpp"

namespace fmlp::detail {
namespace {

constexpr const char* kFormat = "fusedmlp-cublaslt-tune";
constexpr int kVersion = 1;
constexpr int kMaxDevices = 64;
constexpr size_t kAlgoWords = sizeof(cublasLtMatmulAlgo_t) / sizeof(uint64_t);
static_assert(sizeof(cublasLtMatmulAlgo_t) % sizeof(uint64_t) == 0, "opaque algo of 64-bit words");

thread_local int t_tuning = 0;  // depth of fmlp_tune_begin on this thread
thread_local std::set<LtKey> t_tuned_in_scope;

// Key without the ordinal (key[0] = 0), per device name.
using TableKey = std::pair<std::string, LtKey>;

std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}
std::map<TableKey, LtTuned>& table() {
  static std::map<TableKey, LtTuned> t;
  return t;
}

// The device's name, asked once per ordinal ("" when the runtime cannot say).
std::string device_name(int device) {
  static std::mutex mu;
  static std::array<std::string, kMaxDevices> names;
  static std::array<bool, kMaxDevices> known{};
  if (device < 0 || device >= kMaxDevices) return {};
  std::lock_guard<std::mutex> lock(mu);
  if (!known[size_t(device)]) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) names[size_t(device)] = prop.name;
    cudaGetLastError();
    known[size_t(device)] = true;
  }
  return names[size_t(device)];
}

TableKey table_key(const LtKey& key) {
  LtKey k = key;
  k[0] = 0;
  return {device_name(int(key[0])), k};
}

std::string algo_hex(const cublasLtMatmulAlgo_t& a) {
  uint64_t w[kAlgoWords];
  std::memcpy(w, &a, sizeof a);
  std::string s;
  char buf[17];
  for (uint64_t v : w) {
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
    s += buf;
  }
  return s;
}

bool algo_from_hex(const std::string& s, cublasLtMatmulAlgo_t* a) {
  if (s.size() != kAlgoWords * 16) return false;
  uint64_t w[kAlgoWords];
  for (size_t i = 0; i < kAlgoWords; ++i) {
    uint64_t v = 0;
    for (size_t j = 0; j < 16; ++j) {
      const char c = s[i * 16 + j];
      const int d = c >= '0' && c <= '9'   ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
      if (d < 0) return false;
      v = v << 4 | uint64_t(d);
    }
    w[i] = v;
  }
  std::memcpy(a, w, sizeof *a);
  return true;
}

template <typename... ARGS>
fmlp_status_t corrupt(const char* path, fmt::format_string<ARGS...> what, ARGS&&... args) {
  return fail(FMLP_ERROR_CORRUPT_FILE, "tune file '{}': {}; re-create it with `fusedmlp tune`",
              path, fmt::format(what, std::forward<ARGS>(args)...));
}

struct EnvLoad {
  std::once_flag once;
  fmlp_status_t status = FMLP_SUCCESS;
  std::string message;
};
EnvLoad& env_load() {
  static EnvLoad e;
  return e;
}

}  // namespace

bool lt_tuning() {
  return t_tuning > 0;
}
void lt_tune_begin() {
  if (t_tuning++ == 0) t_tuned_in_scope.clear();
}
bool lt_tune_first_in_scope(const LtKey& key) {
  return t_tuned_in_scope.insert(key).second;
}
bool lt_tune_end() {
  if (t_tuning == 0) return false;
  --t_tuning;
  return true;
}

bool lt_tuned_find(const LtKey& key, LtTuned* out) {
  const TableKey k = table_key(key);
  std::lock_guard<std::mutex> lock(table_mutex());
  const auto it = table().find(k);
  if (it == table().end()) return false;
  *out = it->second;
  return true;
}

void lt_tuned_put(const LtKey& key, const LtTuned& t) {
  const TableKey k = table_key(key);
  std::lock_guard<std::mutex> lock(table_mutex());
  table()[k] = t;
}

size_t lt_tuned_count() {
  std::lock_guard<std::mutex> lock(table_mutex());
  return table().size();
}

void lt_tuned_clear() {
  {
    std::lock_guard<std::mutex> lock(table_mutex());
    table().clear();
  }
  lt_cache_clear();
}

fmlp_status_t lt_tune_save(const char* path) {
  if (path == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "path is NULL");
  nlohmann::json entries = nlohmann::json::array();
  {
    std::lock_guard<std::mutex> lock(table_mutex());
    for (const auto& [k, t] : table()) {
      nlohmann::json key = nlohmann::json::array();
      for (size_t i = 1; i < k.second.size(); ++i) key.push_back(k.second[i]);
      entries.push_back({{"device", k.first},
                         {"key", key},
                         {"algo", algo_hex(t.algo)},
                         {"workspace", t.workspace},
                         {"us", t.us}});
    }
  }
  const nlohmann::json doc = {{"format", kFormat},
                              {"version", kVersion},
                              {"cublaslt_version", cublasLtGetVersion()},
                              {"entries", entries}};
  std::ofstream f(path, std::ios::trunc);
  f << doc.dump(1) << "\n";
  f.close();
  if (!f)
    return fail(FMLP_ERROR_INVALID_VALUE, "cannot write tune file '{}': {}", path,
                std::strerror(errno));
  return FMLP_SUCCESS;
}

fmlp_status_t lt_tune_load(const char* path) {
  if (path == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "path is NULL");
  std::ifstream f(path);
  if (!f)
    return fail(FMLP_ERROR_INVALID_VALUE, "cannot read tune file '{}': {}", path,
                std::strerror(errno));
  std::stringstream text;
  text << f.rdbuf();
  const nlohmann::json doc = nlohmann::json::parse(text.str(), nullptr, false);
  if (doc.is_discarded()) return corrupt(path, "not valid JSON");
  if (!doc.is_object()) return corrupt(path, "the top level is not an object");
  const auto format = doc.find("format");
  const auto version = doc.find("version");
  if (format == doc.end() || !format->is_string() || *format != kFormat)
    return corrupt(path, "\"format\" is not \"{}\"", kFormat);
  if (version == doc.end() || !version->is_number_integer() || *version != kVersion)
    return corrupt(path, "\"version\" is not {} (this library reads version {} only)", kVersion,
                   kVersion);
  const auto lt = doc.find("cublaslt_version");
  if (lt == doc.end() || !lt->is_number_unsigned())
    return corrupt(path, "\"cublaslt_version\" is missing or not a number");
  if (lt->get<uint64_t>() != uint64_t(cublasLtGetVersion()))
    return fail(FMLP_ERROR_NOT_SUPPORTED,
                "tune file '{}' was measured with cuBLASLt {}, this process has {}: its "
                "algorithm descriptors belong to that version; re-run `fusedmlp tune`",
                path, lt->get<uint64_t>(), cublasLtGetVersion());
  const auto entries = doc.find("entries");
  if (entries == doc.end() || !entries->is_array())
    return corrupt(path, "\"entries\" is missing or not an array");
  std::map<TableKey, LtTuned> got;
  for (size_t i = 0; i < entries->size(); ++i) {
    const nlohmann::json& e = (*entries)[i];
    if (!e.is_object()) return corrupt(path, "entry {} is not an object", i);
    const auto dev = e.find("device"), key = e.find("key"), algo = e.find("algo");
    const auto ws = e.find("workspace"), us = e.find("us");
    if (dev == e.end() || !dev->is_string())
      return corrupt(path, "entry {}: \"device\" is missing or not a string", i);
    const size_t want = std::tuple_size<LtKey>::value - 1;
    if (key == e.end() || !key->is_array() || key->size() != want)
      return corrupt(path, "entry {}: \"key\" is not an array of {} integers", i, want);
    TableKey k{dev->get<std::string>(), LtKey{}};
    for (size_t j = 0; j < want; ++j) {
      if (!(*key)[j].is_number_integer())
        return corrupt(path, "entry {}: key element {} is not an integer", i, j);
      k.second[j + 1] = (*key)[j].get<int64_t>();
    }
    LtTuned t{};
    if (algo == e.end() || !algo->is_string() || !algo_from_hex(algo->get<std::string>(), &t.algo))
      return corrupt(path, "entry {}: \"algo\" is not {} hex digits", i, kAlgoWords * 16);
    if (ws == e.end() || !ws->is_number_unsigned())
      return corrupt(path, "entry {}: \"workspace\" is not a non-negative integer", i);
    if (us == e.end() || !us->is_number() || !(us->get<double>() >= 0))
      return corrupt(path, "entry {}: \"us\" is not a non-negative number", i);
    t.workspace = ws->get<size_t>();
    t.us = us->get<double>();
    got[k] = t;
  }
  {
    std::lock_guard<std::mutex> lock(table_mutex());
    for (const auto& [k, t] : got) table()[k] = t;
  }
  lt_cache_clear();
  return FMLP_SUCCESS;
}

fmlp_status_t lt_tune_env_status() {
  EnvLoad& e = env_load();
  std::call_once(e.once, [&] {
    const char* path = std::getenv("FMLP_TUNE_FILE");
    if (path == nullptr || *path == '\0') return;
    e.status = lt_tune_load(path);
    if (e.status != FMLP_SUCCESS) e.message = std::string("FMLP_TUNE_FILE: ") + last_error();
  });
  if (e.status != FMLP_SUCCESS) return fail(e.status, "{}", e.message);
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
