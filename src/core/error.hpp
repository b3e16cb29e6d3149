// Thread-local last-error message shared by every layer. Kernels and launchers report failures by
// returning a status and (optionally) recording why; they never throw.
#pragma once
#include <fmt/format.h>

#include <string>

#include "fusedmlp/fusedmlp.h"

namespace fmlp::detail {

void set_last_error(std::string message);
void clear_last_error();
const std::string& last_error();

// Records the message and returns `status`, so call sites read `return fail(...)`.
template <typename... ARGS>
fmlp_status_t fail(fmlp_status_t status, fmt::format_string<ARGS...> format, ARGS&&... args) {
  set_last_error(fmt::format(format, std::forward<ARGS>(args)...));
  return status;
}

}  // namespace fmlp::detail
