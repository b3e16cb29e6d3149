/* fusedmlp tensor-parallel mlp and expert-parallel moe over NCCL (issue #9).
 *
 * The Megatron split of the mlp op over P ranks (one GPU each). Rank r holds the hidden units
 * [r*H/P, (r+1)*H/P): those rows of W1 (gate and up: the gated product stays local) and of b1,
 * and those columns of W2. Every rank holds the whole x (replicated), so a norm of x is computed
 * redundantly on each rank and needs nothing special. Each rank runs the ordinary fused op
 * (fmlp_mlp: decode and prefill kernels alike) on its shard, writing the partial
 *   y_r = W2[:, slice_r] h_slice_r      (+ b2 + residual on rank 0 only)
 * into its y, then one ncclAllReduce (sum, in place on y, y's dtype) leaves the full y on every
 * rank; the reduce-scatter variant (sequence parallelism) leaves rank r rows
 * [r*M/P, (r+1)*M/P) of the sum in those rows of its y.
 *
 * Precision: each partial is rounded to y's dtype before the sum, and the sum is rounded again,
 * so a bf16 y carries about one more bf16 rounding than the single-GPU op (still inside the
 * accuracy contract of tests/tolerance.hpp); an f32 y is unaffected.
 *
 * NCCL types stay out of this header: a communicator is passed as void* (an ncclComm_t, which
 * is a pointer). The library loads NCCL at run time (dlopen), so linking fusedmlp never needs
 * libnccl; a build without NCCL (FMLP_NCCL=OFF or not found) keeps these entry points and they
 * return FMLP_ERROR_BACKEND_UNAVAILABLE with the reason, except fmlp_tp_shard_weights, which
 * only computes views and always works. The run-time library is, in order: $FMLP_NCCL_LIBRARY,
 * the libnccl found at configure time, libnccl.so.2 from the loader's search path.
 *
 * NVLink SHARP / multicast stays off: the communicator helpers set NCCL_NVLS_ENABLE=0 unless
 * the environment already sets it (set it to 0 yourself for communicators you create).
 */
#ifndef FUSEDMLP_FUSEDMLP_NCCL_H
#define FUSEDMLP_FUSEDMLP_NCCL_H

#include "fusedmlp/fusedmlp.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fmlp_tp_reduce_t {
  FMLP_TP_ALL_REDUCE = 0,              /* every rank gets the whole y */
  FMLP_TP_REDUCE_SCATTER = 1,          /* rank r gets rows [r*M/P, (r+1)*M/P) of y; M % P == 0 */
  FMLP_TP_REDUCE_MAX_ENUM = 0x7fffffff /* not a value (see FMLP_DTYPE_MAX_ENUM) */
} fmlp_tp_reduce_t;

/* FMLP_SUCCESS when this build has NCCL support and the library loads; else
 * FMLP_ERROR_BACKEND_UNAVAILABLE and fmlp_last_error() says why. */
FMLP_API fmlp_status_t fmlp_tp_available(void);

/* Rank `rank` of `size`'s shard of full mlp weights, as views into `full` (no copy, no
 * allocation, any memory). The full weights' hidden H must be a multiple of size * 8 so that
 * every shard starts on a 16-byte boundary and keeps the fast kernels; pad H otherwise (extra
 * hidden units with zero columns in W2 contribute nothing). The shard is always gated with a
 * separate up (the stacked [gate; up] rows of one rank are not adjacent): w1 = gate rows, w_up =
 * up rows, b1/b_up and per-row fp8 scales split the same way (128 x 128 block scales are refused,
 * FMLP_ERROR_NOT_SUPPORTED: the shards run on the cuda entries, which take per-row scales); w2 =
 * columns of W2 (a view with row stride H); b2 only on rank 0 (absent elsewhere); norm parameters
 * whole on every rank.
 * Pass the shard to fmlp_mlp_pack (on the rank's device) for contiguous copies in the layout the
 * kernels read fastest, or use it as it is in fmlp_tp_mlp's args. */
FMLP_API fmlp_status_t fmlp_tp_shard_weights(const fmlp_mlp_weights_t* full,
                                             const fmlp_mlp_config_t* config, int32_t rank,
                                             int32_t size, fmlp_mlp_weights_t* shard);

/* Workspace bytes for fmlp_tp_mlp with these (sharded) args on rank `rank`. */
FMLP_API fmlp_status_t fmlp_tp_mlp_workspace_size(const fmlp_mlp_args_t* shard_args, int32_t rank,
                                                  fmlp_backend_t backend, size_t* bytes);

/* Runs rank `rank`'s part of the tensor-parallel mlp on `stream` (a cudaStream_t on the
 * communicator's device) and enqueues the reduction on the same stream. shard_args: y, x and
 * residual as for the whole op (x replicated, y [M, d_out] contiguous), weights the rank's shard
 * (fmlp_tp_shard_weights). On ranks other than 0, b2 and residual are ignored, so every rank may
 * pass the same activations and residual. comm: an ncclComm_t of `size` ranks on which this
 * process is `rank`, on y's device. backend: AUTO or CUDA. Asynchronous and capturable in a
 * CUDA graph (every rank must replay its graph the same number of times). When one thread drives
 * several ranks, bracket their calls with fmlp_tp_group_start / fmlp_tp_group_end. On error
 * (checked before anything is enqueued) nothing is written; a failing NCCL enqueue after the
 * mlp ran gives FMLP_ERROR_CUDA with NCCL's message. */
FMLP_API fmlp_status_t fmlp_tp_mlp(const fmlp_mlp_args_t* shard_args, void* comm, int32_t rank,
                                   int32_t size, fmlp_tp_reduce_t reduce, fmlp_backend_t backend,
                                   void* workspace, size_t workspace_bytes, void* stream);

/* The same with weights packed by fmlp_mlp_pack from the rank's shard (workspace from
 * fmlp_mlp_packed_workspace_size). residual may be NULL; it is ignored on ranks other than 0,
 * and a shard packed with b2 on a rank other than 0 is refused (b2 would be added twice). */
FMLP_API fmlp_status_t fmlp_tp_mlp_packed(const fmlp_mlp_packed_t* shard, const fmlp_tensor_t* y,
                                          const fmlp_tensor_t* x, const fmlp_tensor_t* residual,
                                          void* comm, int32_t rank, int32_t size,
                                          fmlp_tp_reduce_t reduce, void* workspace,
                                          size_t workspace_bytes, void* stream);

/* ---- communicators (no MPI needed) ----
 * One process per GPU sharing the NCCL unique id through a file: rank 0 creates the id and
 * writes it to `path` atomically (write + rename); the other ranks wait (up to 300 s) for the
 * file. Delete a stale file before launching. Makes `device` current, then ncclCommInitRank;
 * *comm gets the ncclComm_t. */
FMLP_API fmlp_status_t fmlp_tp_comm_init_from_file(const char* path, int32_t rank, int32_t size,
                                                   int32_t device, void** comm);
/* One process driving `size` GPUs: comms[i] becomes rank i on devices[i] (ncclCommInitAll). */
FMLP_API fmlp_status_t fmlp_tp_comm_init_all(int32_t size, const int32_t* devices, void** comms);
FMLP_API fmlp_status_t fmlp_tp_comm_destroy(void* comm); /* NULL is a no-op */
/* ncclGroupStart / ncclGroupEnd, for one thread enqueuing the reductions of several ranks. */
FMLP_API fmlp_status_t fmlp_tp_group_start(void);
FMLP_API fmlp_status_t fmlp_tp_group_end(void);

/* ---- one-shot all-reduce over peer memory (decode-sized messages) ----
 * With a p2p registration, fmlp_tp_mlp / fmlp_tp_mlp_packed (FMLP_TP_ALL_REDUCE) and
 * fmlp_tp_all_reduce sum messages of up to max_bytes with one kernel instead of ncclAllReduce:
 * each rank stores its partial into every peer's buffer over NVLink as LL lines (data and flag in
 * each 16-byte store), waits for its peers' lines and sums the partials in fp32 in rank order, so
 * every rank gets bitwise the same y (within one rounding of NCCL's sum, whose order is its own).
 * About one one-way NVLink trip, several times faster than NCCL's all-reduce for 16 KB
 * (bench/tp_bench.sh; bench/results/tp_h200x2.json). Larger messages and
 * FMLP_TP_REDUCE_SCATTER use NCCL. Asynchronous, no host synchronisation, capturable in a CUDA
 * graph (state lives on the device, so replays advance it); the ranks must make the same sequence
 * of calls (as with any collective), keep a communicator's calls in one stream order, and run
 * them concurrently: a rank waits inside the kernel for its peers. A graph captured while
 * registered holds the registration's buffers: do not replay it after fmlp_tp_p2p_destroy or a new
 * registration of the communicator.
 * Used only when every rank is on one host and every pair of GPUs has peer access; peers in other
 * processes map each other's buffer through CUDA IPC. Environment, read at registration:
 * FMLP_TP_P2P=0 turns it off (NCCL only), FMLP_TP_P2P=1 requires it (registration fails with the
 * reason when it cannot be used); otherwise it is on where possible and off silently.
 * fmlp_tp_comm_init_from_file and fmlp_tp_comm_init_all register their communicators with
 * FMLP_TP_P2P_DEFAULT_MAX_BYTES; fmlp_tp_comm_destroy unregisters. */
#define FMLP_TP_P2P_DEFAULT_MAX_BYTES ((size_t)1 << 20)

/* Registers comm (rank `rank` of `size`, on its CUDA device) for messages up to max_bytes
 * (1 .. 64 MiB; the buffer is 4 x size x max_bytes). Collective: every rank calls it, each from its
 * own thread or process (a thread driving several ranks uses fmlp_tp_p2p_init_all). Replaces an
 * earlier registration of comm. Synchronises; not while capturing. Returns FMLP_SUCCESS also when
 * the path stays off (ranks on several hosts, no peer access, FMLP_TP_P2P=0, one rank, more than
 * 8 ranks): fmlp_tp_p2p_query says which and why. */
FMLP_API fmlp_status_t fmlp_tp_p2p_init(void* comm, int32_t rank, int32_t size, size_t max_bytes);
/* The same for comms[0..size) (rank i = comms[i]) held by this one process and thread, e.g. from
 * fmlp_tp_comm_init_all; no NCCL traffic. Replaces earlier registrations made this way; ones made
 * by fmlp_tp_p2p_init must be destroyed by their ranks first (their teardown is a barrier). */
FMLP_API fmlp_status_t fmlp_tp_p2p_init_all(int32_t size, void* const* comms, size_t max_bytes);
/* Unregisters comm (no-op when not registered). Collective like the init (registrations of
 * fmlp_tp_p2p_init_all: the whole group goes at once, later calls for its other comms are no-ops).
 * Waits for the device's work; call before ncclCommDestroy. */
FMLP_API fmlp_status_t fmlp_tp_p2p_destroy(void* comm);
/* Which all-reduce comm gets: *max_bytes = the largest message the p2p path takes (0 when off or
 * unregistered); *description (either may be NULL) = one line naming the path, or why it is off;
 * valid until this thread's next query. */
FMLP_API fmlp_status_t fmlp_tp_p2p_query(void* comm, size_t* max_bytes, const char** description);

/* Sums y (f32, f16 or bf16; 1-D, or 2-D with contiguous rows; on comm's device) in place over the
 * ranks on `stream`: p2p when registered and y fits, else ncclAllReduce. For the all-reduces
 * around the mlp (e.g. the attention output projection's). A thread driving several ranks brackets
 * the ranks' calls with fmlp_tp_group_start / fmlp_tp_group_end (for the NCCL path). */
FMLP_API fmlp_status_t fmlp_tp_all_reduce(const fmlp_tensor_t* y, void* comm, int32_t rank,
                                          int32_t size, void* stream);

/* ==== expert-parallel moe ====
 * For the serving case where every rank holds every token (x replicated, e.g. after a
 * tensor-parallel attention block): rank r holds a contiguous range of the G experts, every rank
 * routes every token over all G experts (the whole router, same result everywhere), runs only the
 * slots whose expert it holds (fmlp_moe_config_t.first_expert / global_experts), and one
 * ncclAllReduce (sum, in place on y, y's dtype) adds the partial outputs: y = sum over ranks,
 * the residual added once (by rank 0). Tokens never move, so no all-to-all and no host-visible
 * counts: asynchronous and capturable in a CUDA graph. Precision as for fmlp_tp_mlp: each rank's
 * partial is rounded to y's dtype before the sum (bf16: about one more rounding than one GPU). */

/* The balanced contiguous split of `global_experts` over `size` ranks: rank r holds
 * [r*G/size, (r+1)*G/size) (integer division; counts differ by at most one). G >= size. */
FMLP_API fmlp_status_t fmlp_tp_expert_range(int32_t global_experts, int32_t rank, int32_t size,
                                            int32_t* first, int32_t* count);

/* Rank `rank` of `size`'s args from whole-op moe args (every expert stacked in w1/b1/w2/b2, no
 * range in full->config): views (no copy) of the rank's experts (fmlp_tp_expert_range of
 * config.num_experts), config.first_expert / num_experts / global_experts set, router and
 * activations as they are, the residual only on rank 0. Any memory, every build. When each rank
 * loads only its own experts, set the three config fields yourself instead. */
FMLP_API fmlp_status_t fmlp_tp_shard_moe(const fmlp_moe_args_t* full, int32_t rank, int32_t size,
                                         fmlp_moe_args_t* local);

/* Workspace bytes (cuda moe workspace contract: zeroed once, left zeroed) for fmlp_tp_moe. */
FMLP_API fmlp_status_t fmlp_tp_moe_workspace_size(const fmlp_moe_args_t* local_args, int32_t rank,
                                                  size_t* bytes);

/* Runs rank `rank`'s experts on `stream` (a cudaStream_t on the communicator's device) and
 * enqueues the all-reduce of y on the same stream. local_args: the rank's expert range (config
 * first_expert, num_experts, global_experts; router_w the whole [G, d] or the same given routing
 * on every rank), x replicated, y [T, d_out] contiguous. x (and the router) must be bitwise
 * equal on every rank, as an all-reduce or broadcast leaves them: the routing is recomputed on
 * each rank, and different bits could pick different experts at a near tie (a slot counted twice
 * or never). The ranks' ranges must partition [0, G) (each expert on exactly one rank; not
 * checked: that would need communication). The residual is
 * ignored on ranks other than 0, so every rank may pass the same activations and residual; b2
 * belongs to its expert and is added by the rank holding it. A rank that holds none of a token's
 * experts contributes zeros and still takes part in the reduction. Checks as fmlp_tp_mlp's,
 * before anything is enqueued (nothing written on error). Given device ids outside [0, G) give a
 * NaN row (on every rank, so in the sum) and are counted in each rank's workspace. */
FMLP_API fmlp_status_t fmlp_tp_moe(const fmlp_moe_args_t* local_args, void* comm, int32_t rank,
                                   int32_t size, void* workspace, size_t workspace_bytes,
                                   void* stream);

/* ==== expert-parallel moe with sharded tokens: all-to-all dispatch and combine ====
 * For the case where each rank owns different tokens (data-parallel attention, sequence-parallel
 * activations): rank r holds its own T_r tokens (x [T_r, d], y [T_r, d_out], residual, given
 * routing [T_r, k]) and the experts fmlp_tp_expert_range(G, r, size) gives it (config
 * first_expert / num_experts / global_experts = G; fmlp_tp_shard_moe makes such args, then point
 * x / y / residual / routing at the rank's own tokens). Each rank routes its own tokens (the
 * router over all G experts, as fmlp_moe; or the given routing), sends each (token, expert) slot
 * -- the x row, the expert id, the combine weight -- to the rank holding the expert, runs its
 * experts over the rows it received (the moe op's kernels; rows of other ranks' buffers that hold
 * no slot cost no weight reads), sends the results back, and writes
 *   y_t = [residual_t +] sum_j w_j (mlp_{e_j}(x_t) + b2[e_j])       (j in order 1..k)
 * for its own tokens: the moe op's definition, every rank adding its own residual.
 * NCCL's sizes are host values, so the exchanges move fixed-capacity buffers (ncclSend/ncclRecv
 * of the whole capacity in a group, twice: dispatch and combine) and nothing is read on the host:
 * asynchronous, no host synchronisation, capturable in a CUDA graph (every rank replays its graph
 * the same number of times).
 * Capacity: `capacity` slots per (sender, receiver) pair, the same on every rank.
 * FMLP_TP_MOE_A2A_NO_DROP gives max_tokens * top_k, where no slot is ever dropped (a rank never
 * has more slots than that). With a smaller capacity, the slots a rank routes to one receiver
 * beyond the first `capacity` of them (in expert order, then token order) are dropped: their term
 * is missing from y (the token keeps its other experts' terms and its residual, weights not
 * renormalised), and they are counted in the workspace (fmlp_tp_moe_a2a_dropped reads the count).
 * max_tokens: the largest T_r of any rank, the same value on every rank (it sizes the buffers;
 * not checked across ranks: that would need communication); T_r = 0 is fine, the rank still
 * takes part in both exchanges and runs its experts for the others.
 * Cost per rank and call: 2 x (size - 1) x capacity rows sent and received (x rows out, d_out rows
 * back, in x's dtype) whatever the routing, plus the experts over the rows received.
 * Precision: each returned term w_j (mlp + b2) is rounded to y's dtype before the sum over j
 * (bf16: about one more rounding than one GPU; f32 unaffected).
 * Calls: the op enqueues two groups of NCCL calls with its kernels between them, so it must NOT
 * be bracketed by fmlp_tp_group_start / fmlp_tp_group_end (NCCL would defer the exchanges past
 * the kernels): drive each rank from its own thread or process. G + 1 <= 512 (the routing
 * kernel's tables), cuda backend only (the experts as the cuda fmlp_moe takes them). Given device
 * ids outside [0, G) give the token a NaN row, counted as fmlp_moe_device_errors reads from this
 * workspace (the count sits at its start, as in the moe workspace). */
#define FMLP_TP_MOE_A2A_NO_DROP ((int64_t)-1)

/* Workspace bytes for fmlp_tp_moe_a2a with these args on rank `rank` of `size` (cuda moe
 * workspace contract: zero-filled once, left zero-filled except the two counts at its start). */
FMLP_API fmlp_status_t fmlp_tp_moe_a2a_workspace_size(const fmlp_moe_args_t* local_args,
                                                      int64_t max_tokens, int64_t capacity,
                                                      int32_t rank, int32_t size, size_t* bytes);

/* Runs rank `rank`'s part on `stream` (a cudaStream_t on the communicator's device). local_args:
 * this rank's tokens and its expert range (see above); max_tokens, capacity: as above, the same on
 * every rank; comm: an ncclComm_t of `size` ranks on which this process is `rank`. Every argument
 * is checked before anything is enqueued (nothing written on error). A failing NCCL enqueue gives
 * FMLP_ERROR_CUDA with NCCL's message. */
FMLP_API fmlp_status_t fmlp_tp_moe_a2a(const fmlp_moe_args_t* local_args, int64_t max_tokens,
                                       int64_t capacity, void* comm, int32_t rank, int32_t size,
                                       void* workspace, size_t workspace_bytes, void* stream);

/* The number of slots dropped for the capacity by the fmlp_tp_moe_a2a calls that used this
 * workspace since the last read (this rank's slots only), then reset to 0. Synchronises `stream`
 * (the stream of those calls): call it outside graph capture. */
FMLP_API fmlp_status_t fmlp_tp_moe_a2a_dropped(void* workspace, size_t workspace_bytes,
                                               void* stream, int32_t* count);

#ifdef __cplusplus
}
#endif
#endif /* FUSEDMLP_FUSEDMLP_NCCL_H */
