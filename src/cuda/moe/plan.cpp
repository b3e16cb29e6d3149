// The cuda moe entries' plans (moe_cuda.hpp): chunk sizes, hidden slices, reduction mode and the
// workspace layout, from the shapes and the device alone, and the kernel parameters of a call.
#include <algorithm>
#include <cmath>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor_check.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/launch_util.hpp"
#include "cuda/moe/moe_cuda.hpp"
#include "cuda/moe/tuning.hpp"

namespace fmlp::detail {
namespace {

// Above this the per-slice partials give way to red.add into one buffer (outside deterministic
// mode); decode sizes are far below it.
constexpr size_t kPartialCap = size_t(64) << 20;

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

// Tokens per route block: one while that keeps the token blocks within kRouteSplitMaxBlocks, so
// a decode step's tokens are routed side by side in their own blocks instead of one after the
// other in one block (a dependent pass over the router rows each); four beyond, where the blocks
// fill the GPU anyway and fewer re-read the router. FMLP_MOE_ROUTE_TOKENS=1..4 forces it (A/B).
int route_tokens_for(int64_t tokens) {
  static const int forced = int(knob_int_or<Knob::FMLP_MOE_ROUTE_TOKENS>(0));
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

}  // namespace

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

// The route kernel's plan (chunks of 8, unused by the streams but written) and h [slots][hp]
// (hidden padded to whole 16-byte chunks, moe_stream_width) in the experts' dtype in the hbuf
// region: the padding stays zero, as the whole region is between calls.
MoePlan moe_plan_stream(const MoeDesc& d) {
  MoePlan pl;
  const int64_t n = d.tokens * d.top_k;
  pl.max_chunks = chunk_bound(d, pl.chunk);
  lay_out(d, 0, size_t(n) * size_t(moe_stream_width(d.hidden)) * dtype_size(d.w_dtype), 0, &pl);
  return pl;
}

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

// The sm_90 tiles' rows: 128, or 192 (tall) where the groups are expected to fit one tall chunk.
MoePlan moe_plan_grouped_sm90(const MoeDesc& d, bool tall) {
  return grouped_plan(d, tall ? kGroupedSm90TallChunk : 128, true);
}

MoeParams moe_params(const fmlp_moe_args_t& a, const MoeDesc& d, const MoePlan& pl, void* ws) {
  const size_t xs = dtype_size(d.act_dtype);
  MoeParams p{};
  p.tokens = int(d.tokens), p.d = int(d.d), p.hidden = int(d.hidden), p.d_out = int(d.d_out);
  p.dp = int(moe_stream_width(d.d)), p.hp = int(moe_stream_width(d.hidden));
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

}  // namespace fmlp::detail
