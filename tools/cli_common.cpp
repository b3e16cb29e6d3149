#include "cli_common.hpp"

#include <omp.h>

#include "blas_shim.hpp"

namespace fmlp_cli {

void check_status(fmlp_status_t status, const std::string& what) {
  if (status == FMLP_SUCCESS) return;
  throw CliError(
      fmt::format("{} failed ({}): {}", what, fmlp_status_name(status), fmlp_last_error()));
}

const std::map<std::string, fmlp_backend_t>& backend_names() {
  static const std::map<std::string, fmlp_backend_t> m = {{"auto", FMLP_BACKEND_AUTO},
                                                          {"ref", FMLP_BACKEND_REF},
                                                          {"cpu", FMLP_BACKEND_CPU},
                                                          {"cuda", FMLP_BACKEND_CUDA}};
  return m;
}

const std::map<std::string, fmlp_dtype_t>& act_dtype_names() {
  static const std::map<std::string, fmlp_dtype_t> m = {
      {"f32", FMLP_DTYPE_F32}, {"f16", FMLP_DTYPE_F16}, {"bf16", FMLP_DTYPE_BF16}};
  return m;
}

const std::map<std::string, fmlp_dtype_t>& weight_dtype_names() {
  static const std::map<std::string, fmlp_dtype_t> m = {{"f32", FMLP_DTYPE_F32},
                                                        {"f16", FMLP_DTYPE_F16},
                                                        {"bf16", FMLP_DTYPE_BF16},
                                                        {"f8", FMLP_DTYPE_F8_E4M3},
                                                        {"f8_e4m3", FMLP_DTYPE_F8_E4M3}};
  return m;
}

const std::map<std::string, fmlp_activation_t>& activation_names() {
  static const std::map<std::string, fmlp_activation_t> m = {{"relu", FMLP_ACT_RELU},
                                                             {"gelu", FMLP_ACT_GELU},
                                                             {"gelu_tanh", FMLP_ACT_GELU_TANH},
                                                             {"silu", FMLP_ACT_SILU},
                                                             {"relu2", FMLP_ACT_RELU2}};
  return m;
}

const std::map<std::string, fmlp_norm_t>& norm_names() {
  static const std::map<std::string, fmlp_norm_t> m = {
      {"none", FMLP_NORM_NONE}, {"layernorm", FMLP_NORM_LAYERNORM}, {"rmsnorm", FMLP_NORM_RMSNORM}};
  return m;
}

int apply_thread_count(int threads) {
  if (threads < 0)
    throw CliError(
        fmt::format("--threads is {}; pass a count >= 1, or 0 for the default", threads));
  if (threads > 0) {
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
  }
  return omp_get_max_threads();
}

std::string format_bytes(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024)
    return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024 * 1024));
  if (bytes >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024));
  if (bytes >= 1024.0) return fmt::format("{:.1f} KiB", bytes / 1024.0);
  return fmt::format("{:.0f} B", bytes);
}

}  // namespace fmlp_cli
