// The one-shot LL all-reduce's setup and registry (kernel allreduce_sm80_p2p_ll:
// src/dist/cuda/allreduce_p2p.cu).
//
// A registration belongs to one communicator and holds this rank's peer-mapped buffer plus the
// peers' buffers as mapped here. Setup is collective and agreed: every rank gathers every rank's
// facts (host, process, FMLP_TP_P2P, max_bytes, IPC handle) and derives the same verdict from
// them, then the ranks gather each other's mapping outcome, so the p2p path is either on for all
// ranks or off for all (a rank on p2p and a peer on NCCL would wait for each other forever).
// The exchange is an in-place uint8 sum all-reduce over a zeroed buffer in which each rank filled
// only its own slot (x + 0 = x): an all-gather through the entry points already bound.
//
// Peers in the same process (one thread per rank, or fmlp_tp_p2p_init_all) use each other's
// device pointers directly with peer access enabled: CUDA IPC handles cannot be opened by the
// process that exported them. Peers in other processes open the handle
// (cudaIpcMemLazyEnablePeerAccess).
#include "dist/tp_allreduce_p2p.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/knobs.hpp"
#include "core/tensor_check.hpp"
#include "dist/tp_common.hpp"
#include "fusedmlp/fusedmlp_nccl.h"

#if FMLP_WITH_NCCL
#include <unistd.h>

#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <unordered_map>
#include <vector>

#include "cuda/common/device_scope.hpp"
#include "dist/cuda/allreduce_p2p.hpp"
#endif

namespace fmlp::detail {

#if FMLP_WITH_NCCL
namespace {

// In message bytes, as max_bytes everywhere: the buffer holds 2 sets x size slots of twice that
// (LL lines carry 8 bytes in 16), 2 GiB per GPU at 8 ranks and this bound.
constexpr size_t kMaxCapacity = size_t(64) << 20;

enum Mode : int32_t { kAuto = 0, kOff = 1, kForce = 2 };

Mode env_mode() {
  const long long v = knob_int_or<Knob::FMLP_TP_P2P>(-1);
  return v == 0 ? kOff : v == 1 ? kForce : kAuto;
}

// One process-local group made by fmlp_tp_p2p_init_all: its buffers live and die together.
struct LocalGroup {
  std::vector<void*> comms;
  std::vector<std::pair<int, void*>> buffers;  // (device, buffer)
};

struct Registration {
  bool on = false;
  std::string about;  // the description, or why the path is off
  size_t max_bytes = 0;
  P2pPeers peers{};
  int device = -1;
  void* own = nullptr;                // per-rank registrations: this rank's buffer
  std::vector<void*> opened;          // peers' buffers opened through IPC
  std::shared_ptr<LocalGroup> group;  // fmlp_tp_p2p_init_all registrations
};

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}

// Never destroyed: a registration may be looked up until the process exits.
std::unordered_map<void*, Registration>& registry() {
  static auto* r = new std::unordered_map<void*, Registration>();
  return *r;
}

void put(void* comm, Registration r) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[comm] = std::move(r);
}

bool take(void* comm, Registration* out) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(comm);
  if (it == registry().end()) return false;
  *out = std::move(it->second);
  registry().erase(it);
  return true;
}

std::string off(const std::string& why) {
  return "ncclAllReduce (p2p all-reduce off: " + why + ")";
}

fmlp_status_t cuda_fail(cudaError_t e, const char* what) {
  cudaGetLastError();
  return fail(FMLP_ERROR_CUDA, "p2p all-reduce setup: {} failed: {}", what, cudaGetErrorString(e));
}

#define FMLP_P2P_CUDA(call)                                                            \
  do {                                                                                 \
    if (const cudaError_t e_ = (call); e_ != cudaSuccess) return cuda_fail(e_, #call); \
  } while (0)

// The communicator as the caller describes it: its size, rank and CUDA device.
fmlp_status_t comm_device(const NcclApi& api, void* comm, int32_t rank, int32_t size, int* device) {
  if (comm == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "comm is NULL; pass an ncclComm_t");
  FMLP_TP_TRY(tp_check_rank(rank, size));
  return tp_comm_device(api, comm, rank, size, device);
}

// Collective exchange on one communicator (the rank's device current, `stream` on it).
struct Exchange {
  const NcclApi& api;
  ncclComm_t comm;
  int rank, size;
  cudaStream_t stream;

  // Every rank's `bytes` of `mine` into `all` (size * bytes), in rank order.
  fmlp_status_t gather(const void* mine, size_t bytes, void* all) const {
    const size_t total = bytes * size_t(size);
    std::vector<unsigned char> h(total, 0);
    std::memcpy(h.data() + size_t(rank) * bytes, mine, bytes);
    void* d = nullptr;
    FMLP_P2P_CUDA(cudaMalloc(&d, total));
    const std::unique_ptr<void, void (*)(void*)> hold(d, [](void* p) { cudaFree(p); });
    FMLP_P2P_CUDA(cudaMemcpyAsync(d, h.data(), total, cudaMemcpyHostToDevice, stream));
    if (const ncclResult_t e = api.all_reduce(d, d, total, ncclUint8, ncclSum, comm, stream);
        e != ncclSuccess)
      return fail(FMLP_ERROR_CUDA, "p2p all-reduce setup: the exchange failed: {}",
                  nccl_error(api, e));
    FMLP_P2P_CUDA(cudaMemcpyAsync(all, d, total, cudaMemcpyDeviceToHost, stream));
    FMLP_P2P_CUDA(cudaStreamSynchronize(stream));
    return FMLP_SUCCESS;
  }

  fmlp_status_t barrier() const {
    const unsigned char one = 1;
    std::vector<unsigned char> all(static_cast<size_t>(size));
    return gather(&one, 1, all.data());
  }
};

// Hostname and boot id: two ranks with the same value share the machine (and its NVLink).
uint64_t host_hash() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  std::string id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> id;
  return std::hash<std::string>()(std::string(name) + "|" + id);
}

// Random per process: pids repeat across containers sharing a host.
uint64_t process_token() {
  static const uint64_t token = [] {
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(getpid());
  }();
  return token;
}

struct RankFacts {
  uint64_t host, process, max_bytes, buffer;
  int32_t mode, allocated;
  char bus_id[32];
  cudaIpcMemHandle_t handle;
  char why[160];  // when not allocated
};

struct Outcome {
  int32_t ok;
  char why[200];
};

void copy_why(char* dst, size_t n, const std::string& s) {
  std::snprintf(dst, n, "%s", s.c_str());
}

// The verdict every rank derives alike from the gathered facts; empty when p2p can go on.
std::string agreed_off(const std::vector<RankFacts>& f) {
  for (size_t q = 0; q < f.size(); ++q) {
    if (f[q].mode == kOff) return fmt::format("FMLP_TP_P2P=0 on rank {}", q);
    if (f[q].host != f[0].host)
      return fmt::format("rank {} runs on another host than rank 0 (peer memory is one host's)", q);
    if (f[q].max_bytes != f[0].max_bytes)
      return fmt::format("max_bytes differs between rank 0 ({}) and rank {} ({})", f[0].max_bytes,
                         q, f[q].max_bytes);
    if (!f[q].allocated) return fmt::format("rank {}: {}", q, f[q].why);
  }
  return "";
}

// Maps peer q's buffer into this process; empty string on success, else why not.
std::string map_peer(const RankFacts& me, const RankFacts& peer, int device, int q, char** ptr,
                     std::vector<void*>* opened) {
  int peer_device = -1;
  const bool visible = cudaDeviceGetByPCIBusId(&peer_device, peer.bus_id) == cudaSuccess;
  cudaGetLastError();
  if (visible && peer_device != device) {
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, device, peer_device) != cudaSuccess || !can) {
      cudaGetLastError();
      return fmt::format("cuda:{} cannot access rank {}'s GPU cuda:{} ({}) as a peer", device, q,
                         peer_device, peer.bus_id);
    }
  }
  if (peer.process == me.process) {  // same process: the pointer itself, with peer access on
    if (!visible) return fmt::format("rank {}'s GPU {} is not visible", q, peer.bus_id);
    if (peer_device != device) {
      const cudaError_t e = cudaDeviceEnablePeerAccess(peer_device, 0);
      cudaGetLastError();
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
        return fmt::format("cudaDeviceEnablePeerAccess(cuda:{} -> cuda:{}) failed: {}", device,
                           peer_device, cudaGetErrorString(e));
    }
    *ptr = reinterpret_cast<char*>(uintptr_t(peer.buffer));
    return "";
  }
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, peer.handle, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("cudaIpcOpenMemHandle of rank {}'s buffer failed: {}", q,
                       cudaGetErrorString(e));
  }
  opened->push_back(p);
  *ptr = static_cast<char*>(p);
  return "";
}

void close_opened(const std::vector<void*>& opened) {
  for (void* p : opened) cudaIpcCloseMemHandle(p);
  cudaGetLastError();
}

std::string describe_on(int size, size_t max_bytes, const char* how) {
  return fmt::format(
      "one-shot LL all-reduce over peer memory (allreduce_sm80_p2p_ll, {} ranks, {}) up to {} "
      "bytes, ncclAllReduce above",
      size, how, max_bytes);
}

// Per-rank setup after any old registration is gone. *r gets the registration to store.
fmlp_status_t setup_rank(const Exchange& x, int device, size_t max_bytes, Mode mode,
                         Registration* r) {
  r->device = device;
  r->max_bytes = max_bytes;
  RankFacts me{};
  me.host = host_hash();
  me.process = process_token();
  me.max_bytes = max_bytes;
  me.mode = mode;
  FMLP_P2P_CUDA(cudaDeviceGetPCIBusId(me.bus_id, sizeof me.bus_id, device));
  if (mode != kOff) {
    const size_t bytes = p2p_buffer_bytes(x.size, max_bytes);
    cudaError_t e = cudaMalloc(&r->own, bytes);
    // Zeroed (the LL lines' flags start at 0, which no call's flag is) on the exchange's stream:
    // done before this rank's gather completes, so before any peer can push (after the second
    // exchange).
    if (e == cudaSuccess) e = cudaMemsetAsync(r->own, 0, bytes, x.stream);
    if (e == cudaSuccess) e = cudaIpcGetMemHandle(&me.handle, r->own);
    if (e == cudaSuccess) {
      me.allocated = 1;
      me.buffer = uint64_t(reinterpret_cast<uintptr_t>(r->own));
    } else {
      cudaGetLastError();
      copy_why(me.why, sizeof me.why,
               fmt::format("{} bytes of peer buffer on cuda:{}: {}", bytes, device,
                           cudaGetErrorString(e)));
    }
  }
  std::vector<RankFacts> facts(size_t(x.size));
  fmlp_status_t s = x.gather(&me, sizeof me, facts.data());
  std::string why = s == FMLP_SUCCESS ? agreed_off(facts) : "";
  if (s != FMLP_SUCCESS || !why.empty()) {
    if (r->own != nullptr) cudaFree(r->own);  // no peer opened it: nobody mapped anything yet
    r->own = nullptr;
    r->about = off(why);
    return s;
  }
  P2pPeers& p = r->peers;
  p.rank = x.rank;
  p.size = x.size;
  p.slot_bytes = p2p_slot_bytes(max_bytes);
  Outcome mine{};
  mine.ok = 1;
  for (int q = 0; q < x.size && mine.ok; ++q) {
    if (q == x.rank) {
      p.bufs[q] = static_cast<char*>(r->own);
      continue;
    }
    const std::string e = map_peer(me, facts[size_t(q)], device, q, &p.bufs[q], &r->opened);
    if (!e.empty()) {
      mine.ok = 0;
      copy_why(mine.why, sizeof mine.why, e);
    }
  }
  std::vector<Outcome> all(size_t(x.size));
  s = x.gather(&mine, sizeof mine, all.data());
  for (int q = 0; q < x.size && why.empty(); ++q)
    if (s != FMLP_SUCCESS || !all[size_t(q)].ok)
      why = s != FMLP_SUCCESS ? "the exchange failed"
                              : fmt::format("rank {}: {}", q, all[size_t(q)].why);
  if (why.empty()) {
    r->on = true;
    r->about =
        describe_on(x.size, max_bytes, r->opened.empty() ? "peers in this process" : "CUDA IPC");
    return FMLP_SUCCESS;
  }
  // Peers may have mapped this buffer: every rank closes its mappings before any frees.
  close_opened(r->opened);
  r->opened.clear();
  const fmlp_status_t b = s == FMLP_SUCCESS ? x.barrier() : s;
  if (b == FMLP_SUCCESS) cudaFree(r->own);  // else leaked: a peer may still map it
  r->own = nullptr;
  r->about = off(why);
  return b;
}

// Undoes a registration (taken out of the registry already). Per-rank ones on several ranks are
// collective: after this rank's work is done, its mappings close, then a barrier, then its buffer
// (which peers mapped) is freed.
fmlp_status_t teardown(const NcclApi& api, void* comm, Registration& r) {
  if (r.group) {
    {
      std::lock_guard<std::mutex> lock(registry_mutex());
      for (void* c : r.group->comms) registry().erase(c);
    }
    for (const auto& [device, buf] : r.group->buffers) {
      DeviceScope scope(device);
      cudaDeviceSynchronize();
      cudaFree(buf);
    }
    cudaGetLastError();
    return FMLP_SUCCESS;
  }
  if (!r.on) return FMLP_SUCCESS;
  DeviceScope scope(r.device);
  FMLP_TP_TRY(scope.status());
  FMLP_P2P_CUDA(cudaDeviceSynchronize());
  close_opened(r.opened);
  cudaStream_t stream = nullptr;
  FMLP_P2P_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Exchange x{api, static_cast<ncclComm_t>(comm), r.peers.rank, r.peers.size, stream};
  const fmlp_status_t s = x.barrier();
  cudaStreamDestroy(stream);
  if (s == FMLP_SUCCESS) cudaFree(r.own);
  return s;
}

fmlp_status_t check_capacity(size_t max_bytes) {
  if (max_bytes == 0 || max_bytes > kMaxCapacity)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "max_bytes is {}; expected 1 .. {} (the largest message the p2p all-reduce takes; "
                "{} is the default)",
                max_bytes, kMaxCapacity, FMLP_TP_P2P_DEFAULT_MAX_BYTES);
  return FMLP_SUCCESS;
}

// Why the path is off whatever the ranks find; empty when it may go on.
std::string off_by_config(int size, Mode mode) {
  if (mode == kOff) return "FMLP_TP_P2P=0";
  if (size == 1) return "one rank has nothing to exchange";
  if (size > kP2pMaxRanks)
    return fmt::format("{} ranks; allreduce_sm80_p2p_ll takes up to {}", size, kP2pMaxRanks);
  return "";
}

fmlp_status_t forced_but_off(const std::string& about) {
  return fail(FMLP_ERROR_BACKEND_UNAVAILABLE,
              "FMLP_TP_P2P=1 requires the p2p all-reduce, but it is {}; unset FMLP_TP_P2P to "
              "fall back to NCCL",
              about);
}

}  // namespace

fmlp_status_t tp_all_reduce(const NcclApi& api, void* comm, void* y, fmlp_dtype_t dtype,
                            size_t count, cudaStream_t stream) {
  if (count == 0) return FMLP_SUCCESS;
  P2pPeers peers{};
  bool p2p = false;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    const auto it = registry().find(comm);
    if (it != registry().end() && it->second.on &&
        count * dtype_size(dtype) <= it->second.max_bytes) {
      peers = it->second.peers;
      p2p = true;
    }
  }
  if (p2p) return allreduce_p2p(peers, y, dtype, int64_t(count), stream);
  const ncclDataType_t t = dtype == FMLP_DTYPE_F32   ? ncclFloat32
                           : dtype == FMLP_DTYPE_F16 ? ncclFloat16
                                                     : ncclBfloat16;
  if (const ncclResult_t e =
          api.all_reduce(y, y, count, t, ncclSum, static_cast<ncclComm_t>(comm), stream);
      e != ncclSuccess)
    return fail(FMLP_ERROR_CUDA, "ncclAllReduce of {} elements failed: {}", count,
                nccl_error(api, e));
  return FMLP_SUCCESS;
}

#endif  // FMLP_WITH_NCCL

}  // namespace fmlp::detail

using namespace fmlp::detail;

extern "C" {

fmlp_status_t fmlp_tp_p2p_init(void* comm, int32_t rank, int32_t size, size_t max_bytes) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (comm == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "comm is NULL; pass an ncclComm_t");
  FMLP_TP_TRY(tp_check_rank(rank, size));
  FMLP_TP_TRY(check_capacity(max_bytes));
  int device = -1;
  FMLP_TP_TRY(comm_device(*api, comm, rank, size, &device));
  FMLP_TP_TRY(fmlp_tp_p2p_destroy(comm));
  const Mode mode = env_mode();
  Registration r;
  r.device = device;
  if (const std::string why = off_by_config(size, mode); !why.empty()) {
    r.about = off(why);
  } else {
    DeviceScope scope(device);
    FMLP_TP_TRY(scope.status());
    cudaStream_t stream = nullptr;
    FMLP_P2P_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const Exchange x{*api, static_cast<ncclComm_t>(comm), rank, size, stream};
    const fmlp_status_t s = setup_rank(x, device, max_bytes, mode, &r);
    cudaStreamDestroy(stream);
    if (s != FMLP_SUCCESS) return s;
  }
  if (mode == kForce && !r.on) return forced_but_off(r.about);
  put(comm, std::move(r));
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)comm, (void)rank, (void)size, (void)max_bytes;
  return tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_p2p_init_all(int32_t size, void* const* comms, size_t max_bytes) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (comms == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "comms is NULL");
  FMLP_TP_TRY(tp_check_rank(0, size));
  FMLP_TP_TRY(check_capacity(max_bytes));
  std::vector<int> devices(static_cast<size_t>(size));
  for (int32_t i = 0; i < size; ++i)
    FMLP_TP_TRY(comm_device(*api, comms[i], i, size, &devices[size_t(i)]));
  for (int32_t i = 0; i < size; ++i) FMLP_TP_TRY(fmlp_tp_p2p_destroy(comms[i]));
  const Mode mode = env_mode();
  std::string why = off_by_config(size, mode);
  for (int32_t i = 0; i < size && why.empty(); ++i)
    for (int32_t j = 0; j < size && why.empty(); ++j) {
      int can = 0;
      if (i == j) continue;
      if (devices[size_t(i)] == devices[size_t(j)])
        why = fmt::format("ranks {} and {} share cuda:{}", i, j, devices[size_t(i)]);
      else if (cudaDeviceCanAccessPeer(&can, devices[size_t(i)], devices[size_t(j)]) !=
                   cudaSuccess ||
               !can)
        why = fmt::format("cuda:{} cannot access cuda:{} as a peer", devices[size_t(i)],
                          devices[size_t(j)]);
    }
  cudaGetLastError();
  auto group = std::make_shared<LocalGroup>();
  group->comms.assign(comms, comms + size);
  const size_t bytes = p2p_buffer_bytes(size, max_bytes);
  for (int32_t i = 0; i < size && why.empty(); ++i) {
    DeviceScope scope(devices[size_t(i)]);
    FMLP_TP_TRY(scope.status());
    for (int32_t j = 0; j < size; ++j) {
      if (j == i) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(devices[size_t(j)], 0);
      cudaGetLastError();
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
        why = fmt::format("cudaDeviceEnablePeerAccess(cuda:{} -> cuda:{}) failed: {}",
                          devices[size_t(i)], devices[size_t(j)], cudaGetErrorString(e));
    }
    void* buf = nullptr;
    cudaError_t e = cudaMalloc(&buf, bytes);
    if (e == cudaSuccess) e = cudaMemset(buf, 0, bytes);  // LL flags start at 0, no call's
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (buf != nullptr) group->buffers.emplace_back(devices[size_t(i)], buf);
    if (e != cudaSuccess && why.empty()) {
      cudaGetLastError();
      why = fmt::format("{} bytes of peer buffer on cuda:{}: {}", bytes, devices[size_t(i)],
                        cudaGetErrorString(e));
    }
  }
  if (!why.empty()) {
    for (const auto& [device, buf] : group->buffers) {
      DeviceScope scope(device);
      cudaFree(buf);
    }
    if (mode == kForce) return forced_but_off(off(why));
    for (int32_t i = 0; i < size; ++i) {
      Registration r;
      r.device = devices[size_t(i)];
      r.about = off(why);
      put(comms[i], std::move(r));
    }
    clear_last_error();
    return FMLP_SUCCESS;
  }
  for (int32_t i = 0; i < size; ++i) {
    Registration r;
    r.on = true;
    r.max_bytes = max_bytes;
    r.device = devices[size_t(i)];
    r.about = describe_on(size, max_bytes, "one process");
    r.peers.rank = i;
    r.peers.size = size;
    r.peers.slot_bytes = p2p_slot_bytes(max_bytes);
    for (int32_t q = 0; q < size; ++q)
      r.peers.bufs[q] = static_cast<char*>(group->buffers[size_t(q)].second);
    r.group = group;
    put(comms[i], std::move(r));
  }
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)size, (void)comms, (void)max_bytes;
  return tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_p2p_destroy(void* comm) {
#if FMLP_WITH_NCCL
  if (comm == nullptr) return FMLP_SUCCESS;
  Registration r;
  if (!take(comm, &r)) return FMLP_SUCCESS;
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  FMLP_TP_TRY(teardown(*api, comm, r));
  clear_last_error();
  return FMLP_SUCCESS;
#else
  return comm == nullptr ? FMLP_SUCCESS : tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_p2p_query(void* comm, size_t* max_bytes, const char** description) {
#if FMLP_WITH_NCCL
  thread_local std::string about;
  size_t cap = 0;
  about = "ncclAllReduce (no p2p registration for this communicator; fmlp_tp_p2p_init makes one)";
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    const auto it = registry().find(comm);
    if (it != registry().end()) {
      about = it->second.about;
      cap = it->second.on ? it->second.max_bytes : 0;
    }
  }
  if (max_bytes != nullptr) *max_bytes = cap;
  if (description != nullptr) *description = about.c_str();
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)comm;
  if (max_bytes != nullptr) *max_bytes = 0;
  if (description != nullptr) *description = "";
  return tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_all_reduce(const fmlp_tensor_t* y, void* comm, int32_t rank, int32_t size,
                                 void* stream) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (y == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "y is NULL");
  const int64_t any[2] = {-1, -1};
  if (y->ndim != 1 && y->ndim != 2)
    return fail(FMLP_ERROR_SHAPE_MISMATCH, "y has {} dimensions; pass a 1-D or 2-D tensor",
                y->ndim);
  FMLP_TP_TRY(check_tensor("y", *y, y->ndim, any, y->ndim == 1 ? "[n]" : "[rows, cols]"));
  if (y->dtype != FMLP_DTYPE_F32 && y->dtype != FMLP_DTYPE_F16 && y->dtype != FMLP_DTYPE_BF16)
    return fail(FMLP_ERROR_DTYPE_MISMATCH, "y is {}; the all-reduce takes f32, f16 or bf16",
                fmlp_dtype_name(y->dtype));
  if (y->ndim == 2 && y->shape[0] > 1 && y->stride[0] != y->shape[1])
    return fail(FMLP_ERROR_BAD_STRIDE,
                "y has row stride {} for {} columns; pass a contiguous y (the all-reduce runs "
                "over one buffer)",
                y->stride[0], y->shape[1]);
  if (y->device_type != FMLP_DEVICE_CUDA)
    return fail(FMLP_ERROR_DEVICE_MISMATCH, "y is on {}; the all-reduce needs CUDA device memory",
                device_string(y->device_type, y->device_id));
  int device = -1;
  FMLP_TP_TRY(comm_device(*api, comm, rank, size, &device));
  if (device != y->device_id)
    return fail(FMLP_ERROR_DEVICE_MISMATCH,
                "y is on cuda:{} but comm (rank {}) is on cuda:{}; pass y on the communicator's "
                "device",
                y->device_id, rank, device);
  DeviceScope scope(device);
  FMLP_TP_TRY(scope.status());
  FMLP_TP_TRY(tp_all_reduce(*api, comm, y->data, y->dtype, size_t(tensor_numel(*y)),
                            static_cast<cudaStream_t>(stream)));
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)y, (void)comm, (void)rank, (void)size, (void)stream;
  return tp_unavailable();
#endif
}

}  // extern "C"
