#include "dist/nccl_api.hpp"

#if FMLP_WITH_NCCL
#include <dlfcn.h>

#include <string>

#include "core/error.hpp"
#include "core/knobs.hpp"

namespace fmlp::detail {
namespace {

struct Loaded {
  NcclApi api{};
  bool ok = false;
  std::string why;
};

template <typename FN>
bool bind(void* lib, const char* name, FN* fn, std::string* why) {
  *fn = reinterpret_cast<FN>(dlsym(lib, name));
  if (*fn == nullptr) *why = fmt::format("the NCCL library lacks {}", name);
  return *fn != nullptr;
}

Loaded load() {
  Loaded l;
  std::string tried;
  void* lib = nullptr;
  const std::string env = knob_string<Knob::FMLP_NCCL_LIBRARY>();
  for (const char* path : {env.c_str(), FMLP_NCCL_LIBRARY_PATH, "libnccl.so.2", "libnccl.so"}) {
    if (path == nullptr || *path == '\0') continue;
    lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
    const char* e = dlerror();
    tried += fmt::format("\n  {}: {}", path, e ? e : "not loadable");
  }
  if (lib == nullptr) {
    l.why =
        "cannot load the NCCL library; install it (pip install nvidia-nccl-cu13, or the "
        "CUDA toolkit's) or point FMLP_NCCL_LIBRARY at libnccl.so.2. Tried:" +
        tried;
    return l;
  }
  NcclApi& a = l.api;
  l.ok = bind(lib, "ncclGetVersion", &a.get_version, &l.why) &&
         bind(lib, "ncclGetUniqueId", &a.get_unique_id, &l.why) &&
         bind(lib, "ncclCommInitRank", &a.comm_init_rank, &l.why) &&
         bind(lib, "ncclCommInitAll", &a.comm_init_all, &l.why) &&
         bind(lib, "ncclCommDestroy", &a.comm_destroy, &l.why) &&
         bind(lib, "ncclCommCount", &a.comm_count, &l.why) &&
         bind(lib, "ncclCommCuDevice", &a.comm_cu_device, &l.why) &&
         bind(lib, "ncclCommUserRank", &a.comm_user_rank, &l.why) &&
         bind(lib, "ncclAllReduce", &a.all_reduce, &l.why) &&
         bind(lib, "ncclReduceScatter", &a.reduce_scatter, &l.why) &&
         bind(lib, "ncclSend", &a.send, &l.why) && bind(lib, "ncclRecv", &a.recv, &l.why) &&
         bind(lib, "ncclGroupStart", &a.group_start, &l.why) &&
         bind(lib, "ncclGroupEnd", &a.group_end, &l.why) &&
         bind(lib, "ncclGetErrorString", &a.get_error_string, &l.why);
  if (l.ok && a.get_version(&a.version) != ncclSuccess) {
    l.ok = false;
    l.why = "ncclGetVersion failed";
  }
  // ncclCommInitAll and the int-sized counts of the collectives below are in every NCCL 2.x;
  // 2.12 is the oldest with the CUDA-graph capture behaviour the ops rely on.
  if (l.ok && a.version < 21200) {
    l.ok = false;
    l.why = fmt::format("NCCL {} is too old; fusedmlp needs 2.12 or newer", a.version);
  }
  // The handle stays open for the process: collectives may be enqueued until exit.
  return l;
}

}  // namespace

const NcclApi* nccl_api(std::string* why) {
  static const Loaded loaded = load();
  if (!loaded.ok) {
    *why = loaded.why;
    return nullptr;
  }
  return &loaded.api;
}

std::string nccl_error(const NcclApi& api, ncclResult_t r) {
  return fmt::format("{} (NCCL error {}; NCCL_DEBUG=WARN prints details)", api.get_error_string(r),
                     int(r));
}

}  // namespace fmlp::detail
#endif
