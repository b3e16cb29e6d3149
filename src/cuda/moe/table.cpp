// The cuda moe entries (overview in moe_cuda.hpp): moe_sm80_stream (route, two weight streams in
// moe_stream.cu) for a few tokens, moe_sm80_grouped (route, grouped GEMMs in moe_grouped.cu,
// combine) for many tokens per expert, moe_sm80_chunked (route, moe_experts.cu, combine)
// otherwise; what they take, their plans and workspaces, their launches, and the device error
// count.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor_check.hpp"
#include "cuda/common/device_scope.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/common/ops.cuh"
#include "cuda/moe/moe_cuda.hpp"

namespace fmlp::detail {
namespace {

// Above this the per-slice partials give way to red.add into one buffer (outside deterministic
// mode); decode sizes are far below it.
constexpr size_t kPartialCap = size_t(64) << 20;

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

// What both entries need: the device, 16-bit experts (or fp8 ones on sm_89+), the route kernel's
// expert limit.
bool moe_common_supports(const MoeDesc& d, std::string* why) {
  if (!cuda_op_device_ok(d.device, d.device_id, why)) return false;
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3) {
    if (cuda_compute_capability(d.device_id) < 89)
      return (*why =
                  "f8_e4m3 experts need sm_89 or newer (cvt.rn.f16x2.e4m3x2); run them on "
                  "backend cpu or pass bf16 experts",
              false);
  } else if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16) {
    return (*why = fmt::format("{} experts: the cuda moe entries stream bf16 or f16 experts (or "
                               "f8_e4m3 ones with scales)",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  }
  if (d.global_experts > kMoeMaxExperts)
    return (*why = fmt::format("{} experts routed over: the routing kernel keeps per-expert "
                               "tables in shared memory and takes at most {}",
                               d.global_experts, kMoeMaxExperts),
            false);
  return true;
}

// The weight rows of the streaming entries (chunked, stream) are read with 16-byte loads.
bool moe_rows_vec16(const MoeDesc& d, std::string* why) {
  if (d.d % 8 != 0 || d.hidden % 8 != 0)
    return (*why = fmt::format("d={} and hidden={} must be multiples of 8 (16-byte weight "
                               "loads); pad the experts",
                               d.d, d.hidden),
            false);
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3 && (d.d % 16 != 0 || d.hidden % 16 != 0))
    return (*why = fmt::format("d={} and hidden={} must be multiples of 16 with f8_e4m3 experts "
                               "(16-byte loads of 16 weights); pad the experts",
                               d.d, d.hidden),
            false);
  if (!d.expert.weights_vec16)
    return (*why =
                "an expert's W1 or W2 is not 16-byte aligned (base or row stride); store "
                "the experts with 16-byte aligned rows",
            false);
  return true;
}

bool moe_cuda_supports(const MoeDesc& d, std::string* why) {
  if (!moe_common_supports(d, why)) return false;
  if (!moe_rows_vec16(d, why)) return false;
  if (d.d >= (int64_t(1) << 28) || d.hidden >= (int64_t(1) << 28) || d.d_out > (int64_t(1) << 21))
    return (*why = "d and hidden must be below 2^28 and d_out at most 2^21", false);
  return true;
}

// Measured on an H200 (bench/results/moe_h200.*): the grouped GEMMs beat the weight-streaming
// kernel from about one token per hit expert on big experts (Mixtral T=1: 348 vs 370 us) and from
// 1.2 on small ones (E=64 top-8 2048->1408, T=4: 258 vs 324 us); at one token per expert on small
// experts (same shape, T=1: 148 vs 131 us) streaming wins. Hence: grouped when the expected tokens
// per hit expert reach kGroupedMinRows or one expert's weights reach kGroupedBigExpert bytes; from
// kGroupedWideRows the GEMMs use 128-row tiles. FMLP_MOE_GROUPED_MIN_ROWS /
// FMLP_MOE_GROUPED_WIDE_ROWS override the row thresholds (tuning knobs for the bench, read once).
double tuned(const char* env, double fallback) {
  const char* e = std::getenv(env);
  const double v = e ? std::atof(e) : 0.0;
  return v > 0.0 ? v : fallback;
}
const double kGroupedMinRows = tuned("FMLP_MOE_GROUPED_MIN_ROWS", 1.1);
const double kGroupedWideRows = tuned("FMLP_MOE_GROUPED_WIDE_ROWS", 96);
constexpr double kGroupedBigExpert = 64.0 * (1 << 20);
// moe_sm90_grouped (TMA + wgmma) against moe_sm80_grouped, same device session on an H200
// (session 14, fusedmlp_moe_bench --kernel): Mixtral-like T = 64 (16 tokens per hit expert)
// 722.8 vs 752.5 us, T = 512 1043.1 vs 1413.2; E = 64 top-8 T = 64 (8) 339.6 vs 357.7, T = 512
// 473.8 vs 491.3. Below 8 the swapped tiles (below) win too (session 26, two rounds each, forced
// by FMLP_MOE_SM90_MIN_ROWS=0.5 against the default of 8, us): E = 64 top-8 T = 8 (1.5 expected)
// 227.6 / 230.9 against 251.6 / 251.8, T = 16 (2.2) 271.0 / 270.3 against 301.7 / 302.3, T = 32
// (4) 302.8 / 305.7 against 343.9 / 343.9; Mixtral-like T = 8 (2) 685.7 / 687.1 against 701.4 /
// 700.9, T = 16 (4) 690.0 / 690.7 against 701.9 / 701.8; at T = 4 (1.46) they lose (619.5 / 620.2
// against 615.8 / 616.4). FMLP_MOE_SM90_MIN_ROWS overrides it.
const double kGroupedSm90MinRows = tuned("FMLP_MOE_SM90_MIN_ROWS", 1.5);
// moe_sm90_grouped's tall tiles: chunks of 192 slots on three consumer warpgroups when the expected
// tokens per hit expert lie in [kGroupedSm90TallRows, kGroupedSm90TallMax]. An expert of 129..192
// tokens is then one chunk and its weights are read once, where 128-row tiles add a short second
// chunk that reads them again, from HBM more often than not (Mixtral-like T = 512: W1 read 1.24
// times, docs/moe.md sessions 15 and 24). Measured on an H200 (session 25, fusedmlp_moe_bench,
// two rounds each, tall against 128-row tiles in the same call, us): Mixtral-like T = 512 (128
// expected) 928.9 / 928.6 against 996.9 / 997.9, T = 640 (160) 939.6 / 938.8 against 1185.2 /
// 1178.5; E = 64 top-8 T = 1024 (128) 690.2 / 689.1 against 677.6 / 676.0 (2 % slower), T = 1280
// (160) 809.3 / 810.6 against 822.9 / 823.5. At 192 expected (Mixtral T = 768, E = 64 T = 1536)
// half the experts spill a few rows into a second tall chunk and the tall tiles lose (1482
// against 1162, 1010 against 863, with 96-unit gate/up tiles), hence the upper bound, about 2.5
// standard deviations of a uniform group below 192. FMLP_MOE_SM90_TALL_ROWS overrides the lower
// bound (1e9: never tall).
const double kGroupedSm90TallRows = tuned("FMLP_MOE_SM90_TALL_ROWS", 100);
constexpr double kGroupedSm90TallMax = 160;
constexpr int kGroupedSm90TallChunk = 192;
// moe_sm90_grouped's swapped tiles (sm90_gemm_swap.cuh): the weights as the wgmma's A, a chunk of
// up to 160 tokens as its N (96 or 160), up to kGroupedSm90SwapRows expected slots per hit local
// expert. Measured on an H200 (session 26, fusedmlp_moe_bench, two rounds each, swapped against
// the tokens-as-A tiles in the same binary, us): E = 64 top-8 T = 64 (8 expected) 313.3 / 313.3
// against 336.7 / 335.7, T = 128 (16) 337.6 / 335.8 against 355.6 / 356.4, T = 256 (32) 402.6 /
// 402.1 against 414.0 / 416.2, T = 512 (64) 493.3 / 492.1 against 471.6 / 471.6; Mixtral-like
// T = 64 (16) 705.0 / 700.7 against 721.5 / 711.3, T = 128 (32) 723.6 / 724.2 against 735.4 /
// 726.9, T = 256 (64) 769.8 / 769.9 against 760.5 / 760.7, T = 512 (128) 884.5 / 883.9 against
// 879.9 / 881.4, T = 640 (160: two chunks an expert) 1395 against 929. FMLP_MOE_SM90_SWAP_ROWS
// overrides the bound (1e-9: never swapped).
const double kGroupedSm90SwapRows = tuned("FMLP_MOE_SM90_SWAP_ROWS", 48);
constexpr int kGroupedSm90SwapChunk = 160;
// Expected tokens per hit expert under uniform routing: T*k slots over the E(1 - (1 - k/E)^T)
// experts expected to receive any.
double tokens_per_hit_expert(const MoeDesc& d) {
  const double E = double(std::max<int64_t>(1, d.experts)), n = double(d.tokens * d.top_k);
  const double hit = E * (1.0 - std::pow(1.0 - double(d.top_k) / E, double(d.tokens)));
  return n / std::max(1.0, hit);
}

bool moe_grouped_supports(const MoeDesc& d, std::string* why) {
  if (!moe_common_supports(d, why)) return false;
  const double per = tokens_per_hit_expert(d);
  const double expert_bytes = double(d.hidden * (d.gated ? 2 : 1) * d.d + d.d_out * d.hidden) *
                              double(dtype_size(d.w_dtype));
  if (per < kGroupedMinRows && expert_bytes < kGroupedBigExpert)
    return (*why = fmt::format("{:.2f} expected tokens per hit expert (below {}) on experts of "
                               "{:.1f} MiB (below {:.0f}): moe_sm80_chunked streams such experts "
                               "faster at decode sizes",
                               per, kGroupedMinRows, expert_bytes / (1 << 20),
                               kGroupedBigExpert / (1 << 20)),
            false);
  const bool fp8 = d.w_dtype == FMLP_DTYPE_F8_E4M3;  // x is staged as fp16 first: any dtype
  if (!fp8 && d.act_dtype != d.w_dtype)
    return (*why = fmt::format("x is {} but the experts are {}: the grouped GEMM copies x rows "
                               "as they are (moe_sm80_chunked converts them); pass x in the "
                               "experts' dtype",
                               fmlp_dtype_name(d.act_dtype), fmlp_dtype_name(d.w_dtype)),
            false);
  if (d.d % kMoeGroupedK != 0 || d.hidden % kMoeGroupedK != 0 || d.d_out % 8 != 0)
    return (*why = fmt::format("d={}, hidden={}, d_out={}: the grouped GEMM's tiles need d and "
                               "hidden multiples of {} and d_out a multiple of 8",
                               d.d, d.hidden, d.d_out, kMoeGroupedK),
            false);
  if ((!fp8 && !d.x_vec16) || !d.expert.weights_vec16)
    return (*why =
                "x, W1 or W2 rows are not 16-byte aligned (base or row stride): the grouped "
                "GEMM copies 16-byte pieces; store them with 16-byte aligned rows",
            false);
  if (d.hidden >= (int64_t(1) << 22) || d.d_out >= (int64_t(1) << 22) || d.d >= (int64_t(1) << 28))
    return (*why = "hidden and d_out must be below 2^22 (grid rows) and d below 2^28", false);
  return true;
}

// moe_sm80_stream reads a shared expert once per token that picked it (the repeats mostly from
// L2): past this many expected slots per hit local expert the planner (cuda_moe_plan) prefers the
// entries that read each hit expert once per chunk of its tokens. Measured on an H200 (session 7,
// graph replay): the stream wins at 1.14 (Mixtral T = 2: 366 us, 91 % of floor) and 1.21 (E = 64
// top-8 T = 4: 195 us, torch._grouped_mm 254), loses at 1.46 (Mixtral T = 4: 637 us against 603 for
// the other entries) and 2.3 (E = 64 top-8 T = 16: 571 us, torch._grouped_mm 452).
// FMLP_MOE_STREAM_MAX_SHARE overrides it (a tuning knob for the bench, read once).
const double kStreamMaxShare = tuned("FMLP_MOE_STREAM_MAX_SHARE", 1.3);

// Expected local slots per local expert that receives any, under uniform routing over the global
// experts (each token picks k distinct ones).
double local_slots_per_hit_expert(const MoeDesc& d) {
  const double G = double(std::max<int64_t>(1, d.global_experts));
  const double hit =
      double(d.experts) * (1.0 - std::pow(1.0 - double(d.top_k) / G, double(d.tokens)));
  return double(d.tokens * d.top_k) * double(d.experts) / G / std::max(1.0, hit);
}

bool moe_stream_supports(const MoeDesc& d, std::string* why) {
  if (!moe_common_supports(d, why)) return false;
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3)
    return (*why =
                "f8_e4m3 experts: the stream takes bf16 or f16 experts (moe_sm80_chunked and "
                "moe_sm80_grouped take fp8 ones)",
            false);
  if (d.tokens < 1 || d.tokens > kMoeStreamMaxTokens)
    return (*why = fmt::format("T={}: the stream takes 1 to {} tokens (a grid row each)", d.tokens,
                               kMoeStreamMaxTokens),
            false);
  if (d.top_k > kMoeStreamMaxTopK)
    return (*why = fmt::format("top_k={}: the stream sums a token's k slots in one thread of a "
                               "group of at most {} rows",
                               d.top_k, kMoeStreamMaxTopK),
            false);
  if (!moe_rows_vec16(d, why)) return false;
  if (d.d >= (int64_t(1) << 28) || d.hidden >= (int64_t(1) << 27) ||
      d.d_out * moe_stream_pair(int(d.top_k)) >= (int64_t(1) << 31))
    return (*why = "d must be below 2^28, hidden below 2^27 and d_out below 2^28", false);
  const size_t x_bytes = size_t(d.d) * dtype_size(d.act_dtype);
  if (x_bytes > kMoeStreamStageBytes)
    return (*why = fmt::format("a token's x (d={}, {}) takes {} KiB of shared memory, more than "
                               "the stream's {} KiB",
                               d.d, fmlp_dtype_name(d.act_dtype), x_bytes >> 10,
                               kMoeStreamStageBytes >> 10),
            false);
  return true;
}

// Tokens per route block: one while that keeps the token blocks within kRouteSplitMaxBlocks, so
// a decode step's tokens are routed side by side in their own blocks instead of one after the
// other in one block (a dependent pass over the router rows each); four beyond, where the blocks
// fill the GPU anyway and fewer re-read the router. FMLP_MOE_ROUTE_TOKENS=1..4 forces it (A/B).
int route_tokens_for(int64_t tokens) {
  static const int forced = int(env_knob("FMLP_MOE_ROUTE_TOKENS", 1, 4, 0));
  if (forced) return forced;
  return tokens <= kRouteSplitMaxBlocks ? 1 : 4;
}

// The workspace regions after the header, each on a 256-byte boundary; the hbuf region (h_bytes,
// grouped) is followed by the fp8 staging buffers (h32_bytes: grouped), which combine re-zeroes
// with it.
void lay_out(const MoeDesc& d, size_t out_bytes, size_t h_bytes, size_t h32_bytes, MoePlan* pl) {
  const int64_t n = d.tokens * d.top_k;
  pl->route_tokens = route_tokens_for(d.tokens);
  size_t at = align256(sizeof(MoeHeader));
  const auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align256(bytes);
    return here;
  };
  pl->counts = take(size_t(d.experts) * 4);
  pl->ids = take(size_t(n) * 4);
  pl->wts = take(size_t(n) * 4);
  pl->perm = take(size_t(n) * 4);
  pl->chunk_expert = take(size_t(pl->max_chunks) * 4);
  pl->chunk_start = take(size_t(pl->max_chunks) * 4);
  pl->chunk_len = take(size_t(pl->max_chunks) * 4);
  // The split router's logits and counters (a few KB at decode sizes): 16-bit router rows in
  // 16-byte pieces (router_logits_columns; moe_params falls back to one block per token block
  // when the router's pointer or row stride is not 16-byte aligned), few token blocks.
  const int64_t token_blocks = (d.tokens + pl->route_tokens - 1) / pl->route_tokens;
  const bool split = !d.given_routing && token_blocks <= kRouteSplitMaxBlocks && d.d % 8 == 0 &&
                     (d.router_dtype == FMLP_DTYPE_BF16 || d.router_dtype == FMLP_DTYPE_F16);
  pl->route_split =
      split ? int((d.global_experts + kRouteSplitExperts - 1) / kRouteSplitExperts) : 1;
  if (pl->route_split > 1) {
    pl->logits = take(size_t(d.tokens) * size_t(d.global_experts) * 4);
    pl->route_parts = take(size_t(token_blocks) * 4);
  }
  pl->out = take(out_bytes);
  pl->hbuf = take(h_bytes);
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3) {
    pl->xh = take(size_t(d.tokens) * size_t(d.d) * 2);
    pl->xinv = take(size_t(d.tokens) * 4);
    if (h32_bytes) pl->h32 = take(h32_bytes), pl->hinv = take(size_t(n) * 4);
  }
  pl->total = at;
}

// The most chunks of c slots any routing can make: sum_e ceil(count_e / c) over the T * k slots.
int64_t chunk_bound(const MoeDesc& d, int64_t c) {
  const int64_t n = d.tokens * d.top_k;
  return std::min(n, (n + (c - 1) * std::min<int64_t>(d.experts, n)) / c);
}

// The grouped GEMMs' plan: chunks of `chunk` slots, fp32 per-slot outputs, h [slots][hidden] in
// the hbuf region (fp8 experts: then h in fp32) and, with gathered_x (moe_sm90_grouped), x rows in
// chunk order after h; combine re-zeroes the whole region.
MoePlan grouped_plan(const MoeDesc& d, int chunk, bool gathered_x) {
  MoePlan pl;
  const int64_t n = d.tokens * d.top_k;
  pl.chunk = chunk;
  pl.max_chunks = chunk_bound(d, chunk);
  pl.slices = 1;
  pl.partial = true;
  const size_t h = size_t(n) * size_t(d.hidden), h_bytes = align256(h * 2);
  const size_t xg_bytes = gathered_x ? size_t(n) * size_t(d.d) * 2 : 0;
  lay_out(d, size_t(n) * size_t(d.d_out) * 4, h_bytes + xg_bytes,
          d.w_dtype == FMLP_DTYPE_F8_E4M3 ? h * 4 : 0, &pl);
  if (gathered_x) pl.xg = pl.hbuf + h_bytes;
  return pl;
}

// The route kernel's plan (chunks of 8, unused by the streams but written) and h [slots][hidden]
// in the experts' dtype in the hbuf region.
MoePlan moe_plan_stream(const MoeDesc& d) {
  MoePlan pl;
  const int64_t n = d.tokens * d.top_k;
  pl.max_chunks = chunk_bound(d, pl.chunk);
  lay_out(d, 0, size_t(n) * size_t(d.hidden) * dtype_size(d.w_dtype), 0, &pl);
  return pl;
}

}  // namespace

MoePlan moe_plan(const MoeDesc& d) {
  MoePlan pl;
  const int64_t n = d.tokens * d.top_k, E = d.experts;
  const int sms = std::max(1, cuda_sm_count(d.device_id));
  // Expected local experts with tokens (each token picks k distinct ones of the global experts),
  // expected local slots, and tokens per such expert. The bounds below hold for any routing.
  const double G = double(d.global_experts);
  const double hit =
      std::max(1.0, double(E) * (1.0 - std::pow(1.0 - double(d.top_k) / G, double(d.tokens))));
  const double local = double(n) * double(E) / G;
  const double per = local / hit;
  pl.chunk = per <= 8 ? 8 : per <= 16 ? 16 : per <= 32 ? 32 : 64;
  const int64_t c = pl.chunk;
  pl.max_chunks = chunk_bound(d, c);
  pl.tiles = int((d.hidden + 15) / 16);
  // Two blocks per multiprocessor for the chunks a typical routing gives.
  const double chunks = std::clamp(std::floor(hit + 0.5 * local / double(c)), 1.0,
                                   double(std::max<int64_t>(1, pl.max_chunks)));
  pl.slices = int(std::clamp(std::llround(2.0 * sms / chunks), 1LL, (long long)pl.tiles));
  const size_t slice_bytes = std::max<size_t>(4, size_t(n) * size_t(d.d_out) * 4);
  if (d.deterministic)
    pl.slices = int(std::clamp<size_t>(kPartialCap / slice_bytes, 1, size_t(pl.slices)));
  pl.partial = d.deterministic || size_t(pl.slices) * slice_bytes <= kPartialCap;
  lay_out(d, size_t(pl.partial ? pl.slices : 1) * slice_bytes, 0, 0, &pl);
  pl.experts_smem = size_t(pl.chunk) * kMoeHsStride * 2 + size_t(2 * kMoeResRows) * pl.chunk * 4;
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3)  // other fp16 h rows, h in fp32, 3 floats per row
    pl.experts_smem = size_t(pl.chunk) * (kMoeHsStrideF8 * 2 + kMoeH32Stride * 4) +
                      size_t(2 * kMoeResRows) * pl.chunk * 4 + size_t(pl.chunk) * 3 * 4;
  return pl;
}

MoePlan moe_plan_grouped(const MoeDesc& d) {
  // 128-row tiles waste less of the tensor cores' time once the groups are that large.
  return grouped_plan(d, tokens_per_hit_expert(d) >= kGroupedWideRows ? 128 : 64, false);
}

void moe_routing_inputs(MoeParams* p, const fmlp_moe_args_t& a, const MoeDesc& d) {
  if (!d.given_routing) {
    p->rw = a.router_w.data, p->rw_ld = a.router_w.stride[0], p->rw_t = d.router_dtype;
    p->rw_vec16 = rows_start_16b(p->rw, d.global_experts, p->rw_ld * int64_t(dtype_size(p->rw_t)));
    if (d.router_bias_dtype != FMLP_DTYPE_INVALID)
      p->rb = a.router_b.data, p->rb_t = d.router_bias_dtype;
  } else {
    p->given_ids = a.topk_ids, p->given_wts = a.topk_weights;
  }
}

namespace {

// The sm_90 tiles' rows: 128, or 192 (tall) where the groups are expected to fit one tall chunk.
MoePlan moe_plan_grouped_sm90(const MoeDesc& d, bool tall) {
  return grouped_plan(d, tall ? kGroupedSm90TallChunk : 128, true);
}

// From the expected slots per hit local expert: with expert parallelism, the local experts' share
// of the slots over the local experts hit (tokens_per_hit_expert counts every slot against the
// local experts).
bool grouped_sm90_swapped(const MoeDesc& d) {
  return local_slots_per_hit_expert(d) <= kGroupedSm90SwapRows;
}

bool grouped_sm90_tall(const MoeDesc& d) {
  const double per = local_slots_per_hit_expert(d);
  return per >= kGroupedSm90TallRows && per <= kGroupedSm90TallMax;
}

size_t moe_cuda_workspace(const MoeDesc& d) {
  return moe_plan(d).total;
}

size_t moe_grouped_workspace(const MoeDesc& d) {
  return moe_plan_grouped(d).total;
}

MoeParams moe_params(const fmlp_moe_args_t& a, const MoeDesc& d, const MoePlan& pl, void* ws) {
  const size_t xs = dtype_size(d.act_dtype);
  MoeParams p{};
  p.tokens = int(d.tokens), p.d = int(d.d), p.hidden = int(d.hidden), p.d_out = int(d.d_out);
  p.experts = int(d.experts), p.top_k = int(d.top_k), p.slots = int(d.tokens * d.top_k);
  p.first_expert = int(d.first_expert), p.global_experts = int(d.global_experts);
  p.chunk = pl.chunk, p.slices = pl.slices, p.tiles = pl.tiles;
  p.out_slices = pl.partial ? pl.slices : 1;
  p.route_tokens = pl.route_tokens;
  p.route_split = pl.route_split;
  p.gated = d.gated, p.partial = pl.partial, p.renormalize = d.renormalize;
  p.sigmoid = d.scoring == FMLP_MOE_SCORING_SIGMOID, p.given = d.given_routing;
  p.round_logits = d.round_logits;
  p.act = d.activation;
  p.x = a.x.data, p.x_ld = a.x.stride[0], p.x_t = d.act_dtype;
  p.x_vec16 = rows_start_16b(p.x, d.tokens, p.x_ld * int64_t(xs));
  p.x_direct = p.x_vec16 && d.act_dtype == d.w_dtype;
  p.y = a.y.data, p.y_ld = a.y.stride[0];
  if (d.has_residual) p.res = a.residual.data, p.res_ld = a.residual.stride[0];
  moe_routing_inputs(&p, a, d);
  if (!p.rw_vec16) p.route_split = 1;
  p.w1 = a.w1.data, p.w1_e = a.w1.stride[0], p.w1_ld = a.w1.stride[1];
  p.w2 = a.w2.data, p.w2_e = a.w2.stride[0], p.w2_ld = a.w2.stride[1];
  p.w_t = d.w_dtype;
  if (d.b1_dtype != FMLP_DTYPE_INVALID)
    p.b1 = a.b1.data, p.b1_e = a.b1.stride[0], p.b1_t = d.b1_dtype;
  if (d.b2_dtype != FMLP_DTYPE_INVALID)
    p.b2 = a.b2.data, p.b2_e = a.b2.stride[0], p.b2_t = d.b2_dtype;
  char* base = static_cast<char*>(ws);
  if (d.w_dtype == FMLP_DTYPE_F8_E4M3) {  // scales [E] or [E, rows] (api_moe.cpp checks them)
    p.s1 = static_cast<const float*>(a.w1_scale.data), p.s1_e = a.w1_scale.stride[0];
    p.s1_r = a.w1_scale.ndim == 2 ? a.w1_scale.stride[1] : 0;
    p.s2 = static_cast<const float*>(a.w2_scale.data), p.s2_e = a.w2_scale.stride[0];
    p.s2_r = a.w2_scale.ndim == 2 ? a.w2_scale.stride[1] : 0;
    p.xh = reinterpret_cast<uint16_t*>(base + pl.xh);
    p.xinv = reinterpret_cast<float*>(base + pl.xinv);
    if (pl.h32) {
      p.h32 = reinterpret_cast<float*>(base + pl.h32);
      p.hinv = reinterpret_cast<float*>(base + pl.hinv);
    }
  }
  p.hdr = reinterpret_cast<MoeHeader*>(base);
  p.counts = reinterpret_cast<int32_t*>(base + pl.counts);
  p.ids = reinterpret_cast<int32_t*>(base + pl.ids);
  p.wts = reinterpret_cast<float*>(base + pl.wts);
  p.perm = reinterpret_cast<int32_t*>(base + pl.perm);
  p.chunk_expert = reinterpret_cast<int32_t*>(base + pl.chunk_expert);
  p.chunk_start = reinterpret_cast<int32_t*>(base + pl.chunk_start);
  p.chunk_len = reinterpret_cast<int32_t*>(base + pl.chunk_len);
  if (pl.route_split > 1) {
    p.logits = reinterpret_cast<float*>(base + pl.logits);
    p.route_parts = reinterpret_cast<uint32_t*>(base + pl.route_parts);
  }
  p.out = reinterpret_cast<float*>(base + pl.out);
  p.hbuf = reinterpret_cast<uint4*>(base + pl.hbuf);
  p.hbuf_words = int64_t(pl.total - pl.hbuf) / 16;
  p.xg = pl.xg ? base + pl.xg : nullptr;
  p.max_chunks = int(pl.max_chunks);
  p.sm90_swap = pl.sm90_swap;
  p.experts_smem = pl.experts_smem;
  return p;
}

// Route, [fp8 experts: x staged as fp16,] the experts (launch_experts), combine.
fmlp_status_t moe_run_with(const fmlp_moe_args_t& a, const MoeDesc& d, const MoePlan& pl, void* ws,
                           void* stream,
                           fmlp_status_t (*launch_experts)(const MoeParams&, cudaStream_t)) {
  const MoeParams p = moe_params(a, d, pl, ws);
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const auto s = static_cast<cudaStream_t>(stream);
  if (const fmlp_status_t st = moe_launch_route(p, s); st != FMLP_SUCCESS) return st;
  if (p.w_t == FMLP_DTYPE_F8_E4M3)
    if (const fmlp_status_t st =
            moe_launch_stage_f16(p.x, p.x_t, p.x_ld, p.tokens, p.d, p.xh, p.xinv, s);
        st != FMLP_SUCCESS)
      return st;
  if (const fmlp_status_t st = launch_experts(p, s); st != FMLP_SUCCESS) return st;
  return moe_launch_combine(p, s);
}

size_t moe_stream_workspace(const MoeDesc& d) {
  return moe_plan_stream(d).total;
}

fmlp_status_t moe_stream_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws, void* stream) {
  MoeParams p = moe_params(a, d, moe_plan_stream(d), ws);
  p.ids_only = true;  // the streams read ids and weights; their up launch may start early
  const DeviceScope scope(d.device_id);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const auto s = static_cast<cudaStream_t>(stream);
  if (const fmlp_status_t st = moe_launch_route(p, s); st != FMLP_SUCCESS) return st;
  return moe_launch_stream(p, s);
}

fmlp_status_t moe_cuda_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws, void* stream) {
  return moe_run_with(a, d, moe_plan(d), ws, stream, moe_launch_experts);
}

fmlp_status_t moe_grouped_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws, void* stream) {
  return moe_run_with(a, d, moe_plan_grouped(d), ws, stream, moe_launch_grouped);
}

// moe_sm90_grouped: what moe_sm80_grouped takes, for gated 16-bit experts with x in their dtype on
// an sm_90 device, from kGroupedSm90MinRows expected tokens per hit expert.
bool moe_grouped_sm90_supports(const MoeDesc& d, std::string* why) {
  if (!moe_grouped_supports(d, why)) return false;
  if (const double per = tokens_per_hit_expert(d); per < kGroupedSm90MinRows)
    return (*why = fmt::format("{:.2f} expected tokens per hit expert (below {}): "
                               "moe_sm80_grouped's 64-row tiles, measured faster there",
                               per, kGroupedSm90MinRows),
            false);
  const int cc = cuda_compute_capability(d.device_id);
  if (cc != 90)
    return (*why = fmt::format("moe_sm90_grouped is sm_90a code; device {} has compute capability "
                               "{}.{}",
                               d.device_id, cc / 10, cc % 10),
            false);
  if (d.w_dtype != FMLP_DTYPE_BF16 && d.w_dtype != FMLP_DTYPE_F16)
    return (*why = fmt::format("{} experts: moe_sm90_grouped takes bf16 or f16 (fp8: "
                               "moe_sm80_grouped)",
                               fmlp_dtype_name(d.w_dtype)),
            false);
  if (!d.gated)
    return (*why =
                "dense experts: moe_sm90_grouped's tiles pair gate and up rows "
                "(moe_sm80_grouped takes them)",
            false);
  return true;
}

size_t moe_grouped_sm90_workspace(const MoeDesc& d) {  // room for every plan (see the run)
  return std::max({moe_plan_grouped_sm90(d, false).total, moe_plan_grouped_sm90(d, true).total,
                   grouped_plan(d, kGroupedSm90SwapChunk, true).total});
}

// The sm_90 GEMMs where the call's tensors allow them (one TMA map over every expert's W1 and
// W2: expert stride = rows x row stride, 16-byte aligned), else the mma.sync GEMMs of
// moe_sm80_grouped on the same plan.
fmlp_status_t moe_launch_grouped_sm90_or_sm80(const MoeParams& p, cudaStream_t s) {
  std::string why;
  if (!moe_grouped_sm90_takes(p, &why)) return moe_launch_grouped(p, s);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError(), device = 0;
  return moe_launch_grouped_sm90(p, std::max(1, cuda_sm_count(device)), s);
}

fmlp_status_t moe_grouped_sm90_run(const fmlp_moe_args_t& a, const MoeDesc& d, void* ws,
                                   void* stream) {
  MoePlan pl = moe_plan_grouped_sm90(d, false);
  if (grouped_sm90_swapped(d)) {
    // Swapped tiles only where the sm_90 GEMMs take the tensors (as the tall ones below).
    MoePlan swapped = grouped_plan(d, kGroupedSm90SwapChunk, true);
    swapped.sm90_swap = true;
    std::string why;
    if (moe_grouped_sm90_takes(moe_params(a, d, swapped, ws), &why)) pl = swapped;
  } else if (grouped_sm90_tall(d)) {
    // Tall chunks only where the sm_90 GEMMs take the tensors: the fallback (moe_sm80_grouped's
    // GEMMs on the same plan) tiles at most 128 rows.
    const MoePlan tall = moe_plan_grouped_sm90(d, true);
    std::string why;
    if (moe_grouped_sm90_takes(moe_params(a, d, tall, ws), &why)) pl = tall;
  }
  return moe_run_with(a, d, pl, ws, stream, moe_launch_grouped_sm90_or_sm80);
}

// Dispatch takes the first entry that supports a call: the weight streams for a few tokens, the
// grouped GEMMs at many tokens per expert, the mma streaming kernel otherwise.
const MoeKernel kCudaMoeKernels[] = {
    {"moe_sm80_stream", FMLP_BACKEND_CUDA, moe_stream_supports, moe_stream_workspace,
     moe_stream_run},
    {"moe_sm90_grouped", FMLP_BACKEND_CUDA, moe_grouped_sm90_supports, moe_grouped_sm90_workspace,
     moe_grouped_sm90_run},
    {"moe_sm80_grouped", FMLP_BACKEND_CUDA, moe_grouped_supports, moe_grouped_workspace,
     moe_grouped_run},
    {"moe_sm80_chunked", FMLP_BACKEND_CUDA, moe_cuda_supports, moe_cuda_workspace, moe_cuda_run},
};

}  // namespace

MoeKernelList cuda_moe_kernels() {
  return {kCudaMoeKernels, sizeof(kCudaMoeKernels) / sizeof(kCudaMoeKernels[0])};
}

const MoeKernel* cuda_moe_plan(const MoeDesc& d, std::string* reason) {
  const MoeKernelList list = cuda_moe_kernels();
  const MoeKernel* stream = &list.kernels[0];
  std::string why;
  if (!stream->supports(d, &why)) return nullptr;  // the first entry that takes it
  const double share = local_slots_per_hit_expert(d);
  if (share <= kStreamMaxShare) {
    if (reason)
      *reason = fmt::format("{:.2f} expected slots per hit expert <= {}: {}", share,
                            kStreamMaxShare, stream->name);
    return stream;
  }
  for (size_t i = 1; i < list.count; ++i)
    if (list.kernels[i].supports(d, &why)) {
      if (reason) {
        *reason = fmt::format(
            "{:.2f} expected slots per hit expert > {}: {} ({} would read a shared expert once "
            "per slot)",
            share, kStreamMaxShare, list.kernels[i].name, stream->name);
        if (list.kernels[i].run == moe_grouped_sm90_run)
          *reason += grouped_sm90_swapped(d)
                         ? fmt::format(
                               "; swapped tiles ({:.1f} expected slots per hit expert <= {}: "
                               "weights as the wgmma's M, chunks of up to 160 tokens as its N)",
                               share, kGroupedSm90SwapRows)
                     : grouped_sm90_tall(d)
                         ? fmt::format(
                               "; 192-row tiles ({:.1f} expected slots per hit expert in "
                               "[{}, {}]: one chunk per typical expert)",
                               share, kGroupedSm90TallRows, kGroupedSm90TallMax)
                         : "; 128-row tiles";
      }
      return &list.kernels[i];
    }
  return stream;
}

fmlp_status_t cuda_moe_device_errors(void* workspace, void* stream, int32_t* count) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, workspace) != cudaSuccess ||
      attr.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return fail(FMLP_ERROR_INVALID_VALUE,
                "workspace is not device memory; pass the workspace of a cuda fmlp_moe call");
  }
  const DeviceScope scope(attr.device);
  if (scope.status() != FMLP_SUCCESS) return scope.status();
  const auto s = static_cast<cudaStream_t>(stream);
  int32_t host = 0;
  cudaError_t e = cudaMemcpyAsync(&host, workspace, sizeof host, cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaMemsetAsync(workspace, 0, sizeof host, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(FMLP_ERROR_CUDA,
                "reading the moe error count failed: {} (it synchronises the stream: call it "
                "outside graph capture)",
                cudaGetErrorString(e));
  }
  *count = host;
  return FMLP_SUCCESS;
}

}  // namespace fmlp::detail
