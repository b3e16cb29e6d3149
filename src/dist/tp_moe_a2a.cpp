// The expert-parallel moe with sharded tokens (fmlp_tp_moe_a2a): this rank's tokens routed over
// all experts, dispatched to the experts' ranks through fixed-capacity buffers (ncclSend/Recv of
// the whole capacity: the sizes NCCL needs on the host never depend on the routing), the local
// experts run by the moe op itself over the received rows, the results sent back and combined.
// The kernels and the flow are described in src/dist/cuda/moe_a2a.hpp. Everything that can fail is
// checked before the first enqueue, so an error leaves y as it was.
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/moe_desc.hpp"
#include "core/tensor_check.hpp"
#include "dist/tp_common.hpp"
#include "fusedmlp/fusedmlp_nccl.h"

#if FMLP_WITH_NCCL
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <initializer_list>

#include "cuda/common/device_scope.hpp"
#include "cuda/moe/moe_cuda.hpp"
#include "dist/cuda/moe_a2a.hpp"

namespace fmlp::detail {
namespace {

constexpr const char* kOp = "the all-to-all expert-parallel moe";
constexpr int64_t kRouteChunk = 64;  // the route kernel's chunk length here (only its list is read)

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

// The workspace: header, routing of this rank's slots, the exchanged buffers, the moe op's own
// workspace last (its size comes from the moe op, so the other offsets never depend on it).
struct A2aLayout {
  int64_t capacity = 0, slots = 0, sections = 0, max_chunks = 0;
  size_t counts = 0, ids = 0, wts = 0, perm = 0, chunk_expert = 0, chunk_start = 0, chunk_len = 0,
         where = 0, send_x = 0, recv_x = 0, eo = 0, ret = 0, send_ids = 0, recv_ids = 0,
         send_wts = 0, recv_wts = 0, inner = 0;
};

A2aLayout lay_out(const MoeDesc& d, int32_t size, int64_t capacity) {
  A2aLayout L;
  L.capacity = capacity;
  L.slots = d.tokens * d.top_k;
  L.sections = int64_t(size) * capacity;
  const int64_t n = L.slots, c = kRouteChunk;
  L.max_chunks = std::min(n, (n + (c - 1) * std::min(d.global_experts, n)) / c);
  const size_t es = dtype_size(d.act_dtype);
  size_t at = align256(sizeof(MoeA2aHeader));
  const auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align256(bytes);
    return here;
  };
  L.counts = take(size_t(d.global_experts) * 4);
  L.ids = take(size_t(n) * 4);
  L.wts = take(size_t(n) * 4);
  L.perm = take(size_t(n) * 4);
  L.chunk_expert = take(size_t(L.max_chunks) * 4);
  L.chunk_start = take(size_t(L.max_chunks) * 4);
  L.chunk_len = take(size_t(L.max_chunks) * 4);
  L.where = take(size_t(n) * 4);
  L.send_x = take(size_t(L.sections * d.d) * es);
  L.recv_x = take(size_t(L.sections * d.d) * es);
  L.eo = take(size_t(L.sections * d.d_out) * es);
  L.ret = take(size_t(L.sections * d.d_out) * es);
  L.send_ids = take(size_t(L.sections) * 4);
  L.recv_ids = take(size_t(L.sections) * 4);
  L.send_wts = take(size_t(L.sections) * 4);
  L.recv_wts = take(size_t(L.sections) * 4);
  L.inner = at;
  return L;
}

fmlp_tensor_t device_2d(void* data, const MoeDesc& d, int64_t rows, int64_t cols) {
  fmlp_tensor_t t = fmlp_tensor_2d(data, d.act_dtype, rows, cols, cols);
  t.device_type = d.device;
  t.device_id = d.device_id;
  return t;
}

// The moe op over the received rows: given routing (the ids and weights that came with them),
// top_k 1, one more global expert (id G, which no rank holds, marks an unused row), no residual.
fmlp_moe_args_t inner_args(const fmlp_moe_args_t& l, const MoeDesc& d, const A2aLayout& L,
                           char* base) {
  fmlp_moe_args_t in = l;
  in.x = device_2d(base + L.recv_x, d, L.sections, d.d);
  in.y = device_2d(base + L.eo, d, L.sections, d.d_out);
  in.residual = in.router_w = in.router_b = fmlp_tensor_none();
  in.topk_ids = reinterpret_cast<const int32_t*>(base + L.recv_ids);
  in.topk_weights = reinterpret_cast<const float*>(base + L.recv_wts);
  in.config.top_k = 1;
  in.config.global_experts = int32_t(d.global_experts + 1);
  in.config.round_router_logits = 0;
  return in;
}

// The resolved capacity, or the failure naming the argument.
fmlp_status_t check_sizes(const MoeDesc& d, int64_t max_tokens, int64_t capacity, int32_t size,
                          int64_t* resolved) {
  if (max_tokens < 1 || max_tokens < d.tokens || max_tokens > INT32_MAX / d.top_k)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "max_tokens is {} but this rank has T = {} tokens; pass the largest token count "
                "of any rank (>= 1, the same value on every rank, max_tokens * top_k < 2^31)",
                max_tokens, d.tokens);
  const int64_t all = max_tokens * d.top_k;
  if (capacity == FMLP_TP_MOE_A2A_NO_DROP) capacity = all;
  if (capacity < 1 || capacity > all)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "capacity is {}; expected 1 .. max_tokens * top_k = {} slots per pair of ranks "
                "(a rank never sends more), or FMLP_TP_MOE_A2A_NO_DROP for that bound",
                capacity, all);
  if (int64_t(size) * capacity > INT32_MAX / 2)
    return fail(FMLP_ERROR_SIZE_OVERFLOW,
                "size * capacity = {} * {} received rows exceed 2^30; lower the capacity or "
                "split the batch",
                size, capacity);
  *resolved = capacity;
  return FMLP_SUCCESS;
}

// Everything the call needs, checked (comm aside): the description, the layout, the moe op's
// args over the received rows (pointing into `workspace`, or a placeholder base when sizing) and
// its workspace bytes.
struct A2aPlan {
  MoeDesc d;
  A2aLayout L;
  fmlp_moe_args_t inner{};
  size_t inner_bytes = 0, total = 0;
};

fmlp_status_t plan_a2a(const fmlp_moe_args_t* a, int64_t max_tokens, int64_t capacity, int32_t rank,
                       int32_t size, char* base, A2aPlan* p) {
  if (a == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "local_args is NULL");
  FMLP_TP_TRY(tp_check_rank(rank, size));
  FMLP_TP_TRY(validate_moe(a, &p->d));
  const MoeDesc& d = p->d;
  int32_t first = 0, count = 0;
  FMLP_TP_TRY(fmlp_tp_expert_range(int32_t(d.global_experts), rank, size, &first, &count));
  if (d.first_expert != first || d.experts != count)
    return fail(FMLP_ERROR_INVALID_VALUE,
                "local_args holds experts [{}, {}) of {}, but rank {} of {} holds [{}, {}) "
                "(fmlp_tp_expert_range): the ranks find each expert's owner by that split; use "
                "fmlp_tp_shard_moe or set config.first_expert / num_experts to it",
                d.first_expert, d.first_expert + d.experts, d.global_experts, rank, size, first,
                first + count);
  if (d.global_experts + 1 > kMoeMaxExperts)
    return fail(FMLP_ERROR_NOT_SUPPORTED,
                "{} global experts: the exchange marks unused rows with one more expert id and "
                "the routing kernel takes at most {} ids, so at most {} experts",
                d.global_experts, kMoeMaxExperts, kMoeMaxExperts - 1);
  int64_t cap = 0;
  FMLP_TP_TRY(check_sizes(d, max_tokens, capacity, size, &cap));
  if (d.device != FMLP_DEVICE_CUDA)
    return fail(FMLP_ERROR_DEVICE_MISMATCH, "the tensors are on {}; {} needs CUDA device memory",
                device_string(d.device, d.device_id), kOp);
  p->L = lay_out(d, size, cap);
  p->inner = inner_args(*a, d, p->L, base);
  if (const fmlp_status_t s =
          fmlp_moe_workspace_size(&p->inner, FMLP_BACKEND_CUDA, &p->inner_bytes);
      s != FMLP_SUCCESS)
    return fail(s, "the local experts over the received rows: {}", last_error());
  p->total = p->L.inner + p->inner_bytes;
  return FMLP_SUCCESS;
}

// The routing buffers of the workspace (slots' ids and weights, the expert-grouped order and
// the chunk list), which the route kernel (MoeParams) writes and the dispatch and combine
// kernels (MoeA2aParams) read.
template <typename P>
void point_routing(P* p, const A2aLayout& L, char* base) {
  p->ids = reinterpret_cast<int32_t*>(base + L.ids);
  p->wts = reinterpret_cast<float*>(base + L.wts);
  p->perm = reinterpret_cast<int32_t*>(base + L.perm);
  p->chunk_expert = reinterpret_cast<int32_t*>(base + L.chunk_expert);
  p->chunk_start = reinterpret_cast<int32_t*>(base + L.chunk_start);
  p->chunk_len = reinterpret_cast<int32_t*>(base + L.chunk_len);
}

// Route-only moe parameters: this rank's tokens over all G experts as if all were local, so the
// route kernel's perm groups the slots by global expert and so by owning rank.
MoeParams route_params(const fmlp_moe_args_t& a, const MoeDesc& d, const A2aLayout& L, char* base) {
  MoeParams p{};
  p.tokens = int(d.tokens), p.d = int(d.d), p.top_k = int(d.top_k), p.slots = int(L.slots);
  p.experts = p.global_experts = int(d.global_experts), p.first_expert = 0;
  p.chunk = int(kRouteChunk), p.route_tokens = 4, p.max_chunks = int(L.max_chunks);
  p.renormalize = d.renormalize, p.sigmoid = d.scoring == FMLP_MOE_SCORING_SIGMOID;
  p.given = d.given_routing, p.round_logits = d.round_logits;
  p.x = a.x.data, p.x_ld = a.x.stride[0], p.x_t = d.act_dtype, p.x_vec16 = d.x_vec16;
  moe_routing_inputs(&p, a, d);
  p.hdr = &reinterpret_cast<MoeA2aHeader*>(base)->route;
  p.counts = reinterpret_cast<int32_t*>(base + L.counts);
  point_routing(&p, L, base);
  return p;
}

MoeA2aParams a2a_params(const fmlp_moe_args_t& a, const MoeDesc& d, const A2aLayout& L,
                        int32_t rank, int32_t size, char* base) {
  const int64_t es = int64_t(dtype_size(d.act_dtype));
  MoeA2aParams p{};
  p.tokens = int(d.tokens), p.top_k = int(d.top_k), p.d = int(d.d), p.d_out = int(d.d_out);
  p.global_experts = int(d.global_experts), p.ranks = size, p.rank = rank;
  p.max_chunks = int(L.max_chunks), p.capacity = L.capacity, p.x_t = d.act_dtype;
  p.x = a.x.data, p.x_ld = a.x.stride[0];
  p.x_vec16 = d.x_vec16 && (d.d * es) % 16 == 0;
  p.y = a.y.data, p.y_ld = a.y.stride[0];
  if (d.has_residual) p.res = a.residual.data, p.res_ld = a.residual.stride[0];
  p.hdr = reinterpret_cast<MoeA2aHeader*>(base);
  point_routing(&p, L, base);
  p.where = reinterpret_cast<int32_t*>(base + L.where);
  p.send_x = base + L.send_x, p.recv_x = base + L.recv_x;
  p.eo = base + L.eo, p.ret = base + L.ret;
  p.send_ids = reinterpret_cast<int32_t*>(base + L.send_ids);
  p.recv_ids = reinterpret_cast<int32_t*>(base + L.recv_ids);
  p.send_wts = reinterpret_cast<float*>(base + L.send_wts);
  p.recv_wts = reinterpret_cast<float*>(base + L.recv_wts);
  return p;
}

// One exchange: section q of each buffer to rank q, section q of its partner from rank q; the
// rank's own section stays where the kernels put it. Every pair moves the whole capacity.
struct Part {
  char *send, *recv;
  size_t section_bytes;
};

fmlp_status_t exchange(const NcclApi& api, void* comm, int32_t rank, int32_t size,
                       std::initializer_list<Part> parts, cudaStream_t s, const char* what) {
  const auto c = static_cast<ncclComm_t>(comm);
  ncclResult_t e = api.group_start();
  for (int32_t q = 0; q < size && e == ncclSuccess; ++q) {
    if (q == rank) continue;
    for (const Part& p : parts) {
      const size_t at = size_t(q) * p.section_bytes;
      e = api.send(p.send + at, p.section_bytes, ncclUint8, q, c, s);
      if (e == ncclSuccess) e = api.recv(p.recv + at, p.section_bytes, ncclUint8, q, c, s);
      if (e != ncclSuccess) break;
    }
  }
  const ncclResult_t end = api.group_end();  // always: the group must be closed
  if (e == ncclSuccess) e = end;
  if (e != ncclSuccess)
    return fail(FMLP_ERROR_CUDA, "{}: the {} exchange failed: {}", kOp, what, nccl_error(api, e));
  return FMLP_SUCCESS;
}

// A placeholder base for sizing: the moe op's validation needs non-null buffer addresses but
// never dereferences device memory; the page above NULL holds no CUDA allocation.
char* sizing_base() {
  return reinterpret_cast<char*>(uintptr_t(4096));
}

}  // namespace
}  // namespace fmlp::detail
#endif

using namespace fmlp::detail;

extern "C" {

fmlp_status_t fmlp_tp_moe_a2a_workspace_size(const fmlp_moe_args_t* local_args, int64_t max_tokens,
                                             int64_t capacity, int32_t rank, int32_t size,
                                             size_t* bytes) {
#if FMLP_WITH_NCCL
  if (bytes == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "bytes is NULL");
  A2aPlan p;
  FMLP_TP_TRY(plan_a2a(local_args, max_tokens, capacity, rank, size, sizing_base(), &p));
  *bytes = p.total;
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)local_args, (void)max_tokens, (void)capacity, (void)rank, (void)size, (void)bytes;
  return tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_moe_a2a(const fmlp_moe_args_t* local_args, int64_t max_tokens,
                              int64_t capacity, void* comm, int32_t rank, int32_t size,
                              void* workspace, size_t workspace_bytes, void* stream) {
#if FMLP_WITH_NCCL
  const NcclApi* api = nullptr;
  FMLP_TP_TRY(tp_load_api(&api));
  if (comm == nullptr) return tp_check_comm(*api, comm, rank, size, FMLP_DEVICE_CUDA, 0, kOp);
  char* base = static_cast<char*>(workspace);
  A2aPlan p;
  FMLP_TP_TRY(plan_a2a(local_args, max_tokens, capacity, rank, size,
                       base != nullptr ? base : sizing_base(), &p));
  const MoeDesc& d = p.d;
  FMLP_TP_TRY(tp_check_comm(*api, comm, rank, size, d.device, d.device_id, kOp));
  if (workspace == nullptr || workspace_bytes < p.total)
    return fail(FMLP_ERROR_WORKSPACE_TOO_SMALL,
                "{} needs a workspace of {} bytes but got {} bytes{}; size it with "
                "fmlp_tp_moe_a2a_workspace_size (and zero-fill it once)",
                kOp, p.total, workspace == nullptr ? 0 : workspace_bytes,
                workspace == nullptr ? " (NULL)" : "");
  if (uintptr_t(workspace) % 256 != 0)
    return fail(FMLP_ERROR_MISALIGNED,
                "workspace is not 256-byte aligned; pass memory from cudaMalloc (or an offset "
                "that is a multiple of 256)");
  const fmlp_moe_args_t& a = *local_args;
  const A2aLayout& L = p.L;
  DeviceScope scope(d.device_id);
  FMLP_TP_TRY(scope.status());
  const auto s = static_cast<cudaStream_t>(stream);
  const MoeA2aParams ap = a2a_params(a, d, L, rank, size, base);
  if (d.tokens > 0) FMLP_TP_TRY(moe_launch_route(route_params(a, d, L, base), s));
  FMLP_TP_TRY(moe_a2a_launch_dispatch(ap, s));
  const size_t es = dtype_size(d.act_dtype), C = size_t(L.capacity);
  FMLP_TP_TRY(exchange(*api, comm, rank, size,
                       {{base + L.send_x, base + L.recv_x, C * size_t(d.d) * es},
                        {base + L.send_ids, base + L.recv_ids, C * 4},
                        {base + L.send_wts, base + L.recv_wts, C * 4}},
                       s, "dispatch"));
  FMLP_TP_TRY(
      fmlp_moe(&p.inner, FMLP_BACKEND_CUDA, base + L.inner, workspace_bytes - L.inner, stream));
  FMLP_TP_TRY(exchange(*api, comm, rank, size,
                       {{base + L.eo, base + L.ret, C * size_t(d.d_out) * es}}, s, "combine"));
  FMLP_TP_TRY(moe_a2a_launch_combine(ap, s));
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)local_args, (void)max_tokens, (void)capacity, (void)comm, (void)rank, (void)size;
  (void)workspace, (void)workspace_bytes, (void)stream;
  return tp_unavailable();
#endif
}

fmlp_status_t fmlp_tp_moe_a2a_dropped(void* workspace, size_t workspace_bytes, void* stream,
                                      int32_t* count) {
#if FMLP_WITH_NCCL
  if (count == nullptr) return fail(FMLP_ERROR_NULL_POINTER, "count is NULL");
  if (workspace == nullptr)
    return fail(FMLP_ERROR_NULL_POINTER,
                "workspace is NULL; pass the one given to fmlp_tp_moe_a2a");
  if (workspace_bytes < sizeof(MoeA2aHeader))
    return fail(FMLP_ERROR_WORKSPACE_TOO_SMALL,
                "workspace_bytes is {}; an fmlp_tp_moe_a2a workspace holds at least {} bytes",
                workspace_bytes, sizeof(MoeA2aHeader));
  FMLP_TP_TRY(moe_a2a_read_dropped(workspace, stream, count));
  clear_last_error();
  return FMLP_SUCCESS;
#else
  (void)workspace, (void)workspace_bytes, (void)stream, (void)count;
  return tp_unavailable();
#endif
}

}  // extern "C"
