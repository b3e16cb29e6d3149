// The cuda moe entries (moe_sm80_stream, moe_sm90_grouped, moe_sm80_grouped, moe_sm80_chunked) as
// their host code and kernels share them: the plan (chunk size, hidden slices, reduction mode,
// workspace layout; a function of the shapes and the device only, so the launch grids never depend
// on the routing) and the kernel parameters.
//
//   moe_route   (route.cu)    per token block: router logits, scores, top-k over the global
//                                 experts (or the given routing, bad ids counted and flagged),
//                                 per-expert counts of the local ones; the last block to finish
//                                 groups the local slots by expert (stable) and cuts each group
//                                 into chunks of <= chunk tokens.
//                                 Slots of experts outside the local range (expert parallelism)
//                                 are marked kMoeSlotRemote and add nothing.
//   moe_experts (sm80_chunked.cu)  grid max_chunks x slices: one chunk's tokens through one hidden
//                                 slice of its expert on the tensor cores, fp32 partial outputs.
//   moe_grouped (sm80_grouped.cu)  instead of moe_experts for many tokens per expert: two
//   smem-tiled
//                                 tensor-core GEMMs over the chunk list (gate/up + activation into
//                                 a [slots, hidden] workspace in chunk order, then down into the
//                                 per-slot fp32 outputs).
//   moe_grouped_sm90 (sm90_grouped.cu)  the same two GEMMs on TMA + wgmma (sm_90a, gated
//                                 16-bit experts), after x is gathered into chunk order.
//   moe_combine (route.cu)    y = [residual +] sum_j w_j (expert output + b2), j in order;
//                                 re-zeroes the workspace (the grouped path's hidden buffer too).
//   moe_stream  (sm80_stream.cu)   instead of experts + combine for a few tokens: every slot's
//                                 W1 rows, then its W2 rows, as two memory-order weight streams
//                                 (h [slots][hidden] in the hbuf region); the second writes y and
//                                 re-zeroes the workspace.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/moe_desc.hpp"

namespace fmlp::detail {

constexpr int kMoeMaxExperts = 512;  // the route kernel keeps per-expert tables in shared memory
                                     // (global experts: the router's scores are per global id)
// Routed slot ids other than a local expert index: never used as an index.
constexpr int32_t kMoeSlotBad = -1;     // a given id outside [0, global experts): NaN row
constexpr int32_t kMoeSlotRemote = -2;  // an expert of another range: contributes nothing
// The split router (route.cu): router rows per block, and the token blocks up to which a
// route launch splits the rows over grid y (a decode step's router is otherwise one block reading
// every row in passes of kRouteSplitExperts).
constexpr int kRouteSplitExperts = 8;
constexpr int kRouteSplitMaxBlocks = 32;
constexpr int kMoeSubTiles = 16;     // 16-unit hidden tiles a block keeps on chip at a time
constexpr int kMoeHsStride = 288;    // elements per row of h in shared memory: 256 + 32, so the
                                     // 8 rows a fragment load touches fall in distinct banks
constexpr int kMoeHsStrideF8 = 264;  // fp8 experts' fp16 h rows: lanes 16 columns apart read
                                     // them, 264 spreads a quarter-warp over distinct banks
constexpr int kMoeH32Stride = 260;   // fp8 experts' fp32 h rows before the scaled staging
constexpr int kMoeResRows = 64;      // layer-1 rows summed across warps in shared memory (<= 4
                                     // tiles: column splits only happen below 8 tiles)

// At workspace offset 0, so fmlp_moe_device_errors can find the error count without the shapes.
struct MoeHeader {
  int32_t errors;         // given expert ids outside [0, E) since the last read
  uint32_t route_done;    // route blocks finished (the last one plans), back to 0 after
  uint32_t combine_done;  // combine blocks finished (the last one clears), back to 0 after
  int32_t chunks;         // chunks in the list
};

struct MoePlan {
  int chunk = 8;  // tokens per chunk: 8, 16, 32 or 64 (chunked), 64 or 128 (grouped), 128, 160 or
                  // 192 (moe_sm90_grouped)
  int64_t max_chunks = 0;  // bound on sum_e ceil(count_e / chunk) from T, k and E alone
  int slices = 1;          // hidden slices per chunk (grid y)
  int tiles = 0;           // 16-unit tiles of the hidden dimension
  bool partial = true;     // per-slice partials summed in order (deterministic), else red.add
  int route_tokens = 4;    // tokens per route block (route_tokens_for, moe/plan.cpp)
  int route_split = 1;     // router blocks per token block (expert groups of the router rows)
  size_t counts = 0, ids = 0, wts = 0, perm = 0, chunk_expert = 0, chunk_start = 0, chunk_len = 0,
         logits = 0, route_parts = 0, out = 0, hbuf = 0,
         total = 0;  // workspace layout in bytes (hbuf: grouped only)
  // fp8 experts (fp8.cuh), inside the hbuf region (which combine re-zeroes): x as fp16 and
  // its per-token factors; grouped only: h in fp32 before its staging as fp16 (into hbuf) and
  // its per-slot factors. 0 when absent.
  size_t xh = 0, xinv = 0, h32 = 0, hinv = 0;
  // moe_sm90_grouped: x gathered into chunk order, [slots][d] in the weights' dtype, inside the
  // hbuf region after h. 0 when absent.
  size_t xg = 0;
  bool sm90_swap = false;   // moe_sm90_grouped: swapped tiles (tokens as the wgmma N)
  size_t experts_smem = 0;  // dynamic shared memory of the expert kernel
};
// The plans of the entries (moe/plan.cpp): moe_sm80_chunked's, moe_sm80_grouped's,
// moe_sm80_stream's, moe_sm90_grouped's with 128-row or tall (192-row) tiles, and any grouped plan
// of `chunk` slots a chunk (gathered_x: x rows in chunk order after h, as moe_sm90_grouped reads
// them).
MoePlan moe_plan(const MoeDesc& d);
MoePlan moe_plan_grouped(const MoeDesc& d);
MoePlan moe_plan_stream(const MoeDesc& d);
MoePlan moe_plan_grouped_sm90(const MoeDesc& d, bool tall);
MoePlan grouped_plan(const MoeDesc& d, int chunk, bool gathered_x);

// The grouped GEMMs' tiles: hidden (and d) must be multiples of kMoeGroupedK.
constexpr int kMoeGroupedK = 64;

// The width moe_sm80_stream reads of weight rows of `cols` 16-bit columns: whole 16-byte chunks.
// Rows that end inside their last chunk (d or hidden not a multiple of 8, experts stored with a
// 16-byte aligned, padded row stride) have that chunk read by its own bytes, x staged and h kept
// with zeros past the real width (sm80_stream.cu).
constexpr int64_t moe_stream_width(int64_t cols) {
  return (cols + 7) / 8 * 8;
}

struct MoeParams {
  int tokens, d, hidden, d_out, experts, top_k, slots, chunk, slices, tiles, out_slices;
  int dp, hp;  // moe_sm80_stream: d and hidden as moe_stream_width; h is [slots][hp] there
  int first_expert, global_experts;  // local expert i is global id first_expert + i
  int route_tokens;
  int route_split;  // > 1: grid y splits the router rows; logits meet in `logits` (route.cu)
  bool gated, partial, renormalize, sigmoid, given;
  bool ids_only;      // the weight streams follow: the route kernel writes ids and weights only (no
                      // counts per expert, no chunk plan) and lets their launch start early
  bool round_logits;  // router logits rounded to x's dtype (x_t is f16 or bf16 then)
  // Set by moe_launch_route: the top-k by ranks (NaN-free scores), the split router's blocks of a
  // token block as one cluster meeting in distributed shared memory (sm_90).
  bool topk_rank, route_cluster;
  fmlp_activation_t act;
  const void* x;
  int64_t x_ld;
  fmlp_dtype_t x_t;  // x, y and residual
  bool x_vec16;      // x rows may be read with 16-byte loads
  bool x_direct;     // ... and x already has the weights' dtype: its pieces are mma fragments
  void* y;
  int64_t y_ld;
  const void* res;  // nullptr: no residual
  int64_t res_ld;
  const void* rw;  // router [E, d]; nullptr when the routing is given
  int64_t rw_ld;
  fmlp_dtype_t rw_t;
  bool rw_vec16;
  const void* rb;
  fmlp_dtype_t rb_t;
  const int32_t* given_ids;
  const float* given_wts;
  const void *w1, *w2;  // expert stride, row stride in elements
  int64_t w1_e, w1_ld, w2_e, w2_ld;
  const void *b1, *b2;  // nullptr when absent; [E, n] with an expert stride
  int64_t b1_e, b2_e;
  fmlp_dtype_t b1_t, b2_t, w_t;
  // fp8 experts (w_t f8_e4m3): scale of expert e, row r = s[e * s_e + r * s_r] (s_r = 0: one per
  // expert); x staged as fp16 [tokens][d] with xinv[token] undoing its power of two; grouped
  // only: h32 [slots][hidden] fp32, staged as fp16 into hbuf with hinv[position].
  const float *s1, *s2;
  int64_t s1_e, s1_r, s2_e, s2_r;
  uint16_t* xh;  // fp16 bits
  float *xinv, *h32, *hinv;
  MoeHeader* hdr;
  // ids: per slot, the local expert index or a kMoeSlot* value.
  int32_t *counts, *ids, *perm, *chunk_expert, *chunk_start, *chunk_len;
  float *wts, *out;       // out: [out_slices][slots][d_out] fp32
  float* logits;          // split router: [tokens][global experts] fp32, zero between calls
  uint32_t* route_parts;  // split router: router blocks done per token block, zero between calls
  uint4* hbuf;  // grouped: h [slots][hidden] in chunk order, in the weights' dtype (fp8: fp16)
  int64_t hbuf_words;  // its 16-byte words (0 for the chunked path), re-zeroed by combine
  void* xg;            // moe_sm90_grouped: x rows in chunk order (MoePlan::xg), else nullptr
  int max_chunks;
  bool sm90_swap;  // moe_sm90_grouped: swapped tiles (sm90/gemm_swap.cuh), chunks of 192
  size_t experts_smem;
};

// moe_sm80_stream's limits: tokens (grid rows, and the repeated reads of shared experts), top k
// (a row's k slot sums go to one thread of a stream group of at most kStreamWarps rows), and the
// shared memory of one up block's staged x (d in x's dtype): three blocks per multiprocessor. The
// down blocks read h in place (sm80_stream.cu), so h has no such limit.
constexpr int kMoeStreamMaxTokens = 16;
constexpr int kMoeStreamMaxTopK = 8;
constexpr size_t kMoeStreamStageBytes = 64 * 1024;
// The moe down stream's staged h (FMLP_MOE_STREAM_DOWN_STAGE): four blocks per SM still fit.
constexpr size_t kMoeStreamDownStageBytes = 32 * 1024;
// The slots per output row of the down stream: k rounded up to a power of two.
constexpr int moe_stream_pair(int k) {
  return k <= 1 ? 1 : k <= 2 ? 2 : k <= 4 ? 4 : 8;
}

// The router inputs of p (router weights and bias, or the given top-k ids and weights) from the
// call's args; shared by the moe entries and the expert-parallel dispatch (src/dist).
void moe_routing_inputs(MoeParams* p, const fmlp_moe_args_t& a, const MoeDesc& d);
// The kernel parameters of a call under plan pl with workspace ws (moe/plan.cpp).
MoeParams moe_params(const fmlp_moe_args_t& a, const MoeDesc& d, const MoePlan& pl, void* ws);

fmlp_status_t moe_launch_route(const MoeParams& p, cudaStream_t s);
fmlp_status_t moe_launch_experts(const MoeParams& p, cudaStream_t s);
fmlp_status_t moe_launch_grouped(const MoeParams& p, cudaStream_t s);
// moe_sm90_grouped (sm90_grouped.cu): whether its launch takes p (*why says what it lacks
// otherwise), and the launch (gather, gate/up, down; sms: the device's multiprocessors).
bool moe_grouped_sm90_takes(const MoeParams& p, std::string* why);
fmlp_status_t moe_launch_grouped_sm90(const MoeParams& p, int sms, cudaStream_t s);
fmlp_status_t moe_launch_combine(const MoeParams& p, cudaStream_t s);
// moe_sm80_stream's two launches after the route kernel (sm80_stream.cu), on the current device.
fmlp_status_t moe_launch_stream(const MoeParams& p, cudaStream_t s);
// fp8 experts (fp8.cu): dst[r][0, cols) = fp16 bits of src[r][0, cols) * 2^shift_r and
// inv[r] = 2^-shift_r for rows [0, rows) of src (dtype t, row stride ld elements); shift_r = 0
// when t is f16 (already exact), else the power of two that puts the row's largest finite |value|
// in [2^14, 2^15).
fmlp_status_t moe_launch_stage_f16(const void* src, fmlp_dtype_t t, int64_t ld, int rows, int cols,
                                   uint16_t* dst, float* inv, cudaStream_t s);

}  // namespace fmlp::detail
