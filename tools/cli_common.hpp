// Shared pieces of the fusedmlp CLI: the error type every subcommand throws, the option value
// maps, status checking and progress output.
#pragma once
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>

#include "fusedmlp/fusedmlp.h"

namespace fmlp_cli {

// A user-facing failure: the message says what went wrong and what to do instead.
class CliError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A computed result disagrees with the reference: exit code kExitWrongResult.
class WrongResult : public CliError {
 public:
  using CliError::CliError;
};

// Exit codes: 0 success, 1 usage or runtime error, 2 a result was wrong (check/bench mismatch).
constexpr int kExitError = 1;
constexpr int kExitWrongResult = 2;

// The action of the subcommand the user picked; set while parsing, run after.
using Command = std::function<int()>;

// Throws CliError naming `what` with the library's message when status is not success.
void check_status(fmlp_status_t status, const std::string& what);

template <typename... ARGS>
void progress(fmt::format_string<ARGS...> format, ARGS&&... args) {
  fmt::print(stderr, format, std::forward<ARGS>(args)...);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

// Option value names -> enums, for CLI11's CheckedTransformer (which lists them on a bad value).
const std::map<std::string, fmlp_backend_t>& backend_names();
const std::map<std::string, fmlp_dtype_t>& act_dtype_names();
const std::map<std::string, fmlp_dtype_t>& weight_dtype_names();
const std::map<std::string, fmlp_activation_t>& activation_names();
const std::map<std::string, fmlp_norm_t>& norm_names();

// Accepts one of the map's names (any case) for an enum option and says which exist otherwise.
template <typename E>
CLI::Validator choice_of(const std::map<std::string, E>& names) {
  std::string list;
  for (const auto& entry : names) list += (list.empty() ? "" : ", ") + entry.first;
  return CLI::Validator(
      [&names, list](std::string& value) -> std::string {
        const auto it = names.find(CLI::detail::to_lower(value));
        if (it == names.end()) return fmt::format("'{}' is not one of {}", value, list);
        value = std::to_string(int(it->second));
        return {};
      },
      "{" + list + "}");
}

// Sets the OpenMP and OpenBLAS thread counts; 0 keeps the defaults. Returns the count in use.
int apply_thread_count(int threads);

std::string format_bytes(double bytes);

}  // namespace fmlp_cli
