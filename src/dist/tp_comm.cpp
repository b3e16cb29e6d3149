// Communicator helpers: one process per GPU sharing the NCCL unique id through a file (no MPI),
// or one process driving several GPUs. NVLink SHARP / multicast stays off (NCCL_NVLS_ENABLE=0
// unless the caller set it).
#include <cstdlib>
#include <string>

#include "core/error.hpp"
#include "dist/tp_common.hpp"
#include "fusedmlp/fusedmlp_nccl.h"

#if FMLP_WITH_NCCL
#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <set>
#include <thread>
#include <vector>

#include "cuda/common/device_scope.hpp"
#endif

namespace fmlp::detail {
namespace {

#if FMLP_WITH_NCCL

constexpr double kWaitSeconds = 300;

void nvls_off() {
  setenv("NCCL_NVLS_ENABLE", "0", 0);
}

fmlp_status_t check_device(int32_t device, const char* name) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_BACKEND_UNAVAILABLE, "no CUDA device for {} = {}: {}", name, device,
                cudaGetErrorString(e));
  }
  if (device < 0 || device >= count)
    return fail(FMLP_ERROR_INVALID_VALUE, "{} is {}; this process sees {} CUDA devices (0..{})",
                name, device, count, count - 1);
  return FMLP_SUCCESS;
}

// Rank 0: write + rename, so a reader never sees half an id.
fmlp_status_t write_id(const std::string& path, const ncclUniqueId& id) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "cannot create {} (for the NCCL unique id); pass a path "
                "in a writable directory that every rank can read",
                tmp);
  const bool ok = std::fwrite(&id, sizeof id, 1, f) == 1;
  if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return fail(FMLP_ERROR_INVALID_VALUE, "cannot write the NCCL unique id to {}", path);
  }
  return FMLP_SUCCESS;
}

fmlp_status_t read_id(const std::string& path, int32_t rank, ncclUniqueId* id) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      const bool ok = std::fread(id, sizeof *id, 1, f) == 1;
      std::fclose(f);
      if (ok) return FMLP_SUCCESS;
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > kWaitSeconds)
      return fail(FMLP_ERROR_INVALID_VALUE,
                  "rank {} waited {:.0f} s for rank 0 to write the NCCL unique id to {}; start "
                  "rank 0 with the same --id-file (on a file system every rank sees)",
                  rank, waited, path);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

#endif  // FMLP_WITH_NCCL

}  // namespace
}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {

fmlp_status_t fmlp_tp_comm_init_from_file(const char* path, int32_t rank, int32_t size,
                                          int32_t device, void** comm) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (path == nullptr || *path == '\0')
    return fail(FMLP_ERROR_NULL_POINTER, "path is NULL or empty; pass the id file's path");
  if (comm == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "comm (the output) is NULL");
  FMLP_TP_TRY(tp_check_rank(rank, size));
  FMLP_TP_TRY(check_device(device, "device"));
  nvls_off();
  ncclUniqueId id;
  if (rank == 0) {
    if (const ncclResult_t e = api->get_unique_id(&id); e != ncclSuccess)
      return fail(FMLP_ERROR_CUDA, "ncclGetUniqueId failed: {}", nccl_error(*api, e));
    FMLP_TP_TRY(write_id(path, id));
  } else {
    FMLP_TP_TRY(read_id(path, rank, &id));
  }
  DeviceScope scope(device);
  FMLP_TP_TRY(scope.status());
  ncclComm_t c = nullptr;
  if (const ncclResult_t e = api->comm_init_rank(&c, size, id, rank); e != ncclSuccess)
    return fail(FMLP_ERROR_CUDA, "ncclCommInitRank (rank {} of {} on cuda:{}) failed: {}", rank,
                size, device, nccl_error(*api, e));
  if (const fmlp_status_t s = fmlp_tp_p2p_init(c, rank, size, FMLP_TP_P2P_DEFAULT_MAX_BYTES);
      s != FMLP_SUCCESS) {
    const std::string why = last_error();
    api->comm_destroy(c);
    return fail(s, "{}", why);
  }
  *comm = c;
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)path, (void)rank, (void)size, (void)device, (void)comm;
  return tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_comm_init_all(int32_t size, const int32_t* devices, void** comms) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (devices == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "devices is NULL");
  if (comms == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "comms (the output) is NULL");
  FMLP_TP_TRY(tp_check_rank(0, size));
  std::set<int32_t> seen;
  for (int32_t i = 0; i < size; ++i) {
    FMLP_TP_TRY(check_device(devices[i], "a device"));
    if (!seen.insert(devices[i]).second)
      return fail(FMLP_ERROR_INVALID_VALUE,
                  "devices[{}] = {} appears twice; every rank needs its own GPU", i, devices[i]);
  }
  nvls_off();
  std::vector<ncclComm_t> c(size_t(size), nullptr);
  if (const ncclResult_t e = api->comm_init_all(c.data(), size, devices); e != ncclSuccess)
    return fail(FMLP_ERROR_CUDA, "ncclCommInitAll over {} devices failed: {}", size,
                nccl_error(*api, e));
  if (const fmlp_status_t s = fmlp_tp_p2p_init_all(size, reinterpret_cast<void* const*>(c.data()),
                                                   FMLP_TP_P2P_DEFAULT_MAX_BYTES);
      s != FMLP_SUCCESS) {
    const std::string why = last_error();
    for (ncclComm_t x : c) api->comm_destroy(x);
    return fail(s, "{}", why);
  }
  for (int32_t i = 0; i < size; ++i) comms[i] = c[size_t(i)];
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)size, (void)devices, (void)comms;
  return tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_comm_destroy(void* comm) {
#if FMLP_WITH_NCCL
  if (comm == nullptr) return FMLP_SUCCESS;
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  FMLP_TP_TRY(fmlp_tp_p2p_destroy(comm));
  if (const ncclResult_t e = api->comm_destroy(static_cast<ncclComm_t>(comm)); e != ncclSuccess)
    return fail(FMLP_ERROR_CUDA, "ncclCommDestroy failed: {}", nccl_error(*api, e));
  clear_last_error();
  return FMLP_SUCCESS;
#else
  return comm == nullptr ? FMLP_SUCCESS : tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_group_start(void) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (const ncclResult_t e = api->group_start(); e != ncclSuccess)
    return fail(FMLP_ERROR_CUDA, "ncclGroupStart failed: {}", nccl_error(*api, e));
  return FMLP_SUCCESS;
#else
  return tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_group_end(void) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (const ncclResult_t e = api->group_end(); e != ncclSuccess)
    return fail(FMLP_ERROR_CUDA, "ncclGroupEnd failed: {}", nccl_error(*api, e));
  return FMLP_SUCCESS;
#else
  return tp_unavailable();
#endif
}

}  // extern "C"
