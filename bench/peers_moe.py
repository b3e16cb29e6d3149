# PyTorch peers of fusedmlp's moe op, measured like fusedmlp_moe_bench: the same two layers (bf16,
# SwiGLU experts, softmax top-k router with renormalisation, random router weights), weights
# rotated so the experts a call hits exceed 3x the L2, CUDA-graph replay, median (bench/peers.py).
# Variants:
#   loop:       the HF Mixtral block: one_hot mask, per expert torch.where + index_select, the
#               expert MLP, index_add_ (data-dependent shapes: not capturable, timed eagerly)
#   grouped_mm: torch._grouped_mm over the slots sorted by expert, offsets from the routing
#               (skipped with a message where this torch lacks it)
# With --ours (fusedmlp_moe_bench's JSON) it prints our time over the best peer's.
# usage: python3 bench/peers_moe.py [--json peers_moe.json] [--ours moe.json] [--ts 1,4,16,64,512]
import argparse
import json
import math

import torch
import torch.nn.functional as F

from peers import graphed, median_us, setup_run

LAYERS = {"mixtral": (8, 2, 4096, 14336), "e64k8": (64, 8, 2048, 1408)}  # E, k, d, hidden


def route(x, wr, k):
    probs = torch.softmax(F.linear(x, wr).float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(x.dtype), ids


def moe_loop(x, wr, w1, w2, k):
    e_count = w1.shape[0]
    w, ids = route(x, wr, k)
    y = torch.zeros_like(x)
    mask = F.one_hot(ids, e_count).permute(2, 1, 0)  # [E, k, T]
    for e in range(e_count):
        j, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        xe = x.index_select(0, tok)
        g, u = F.linear(xe, w1[e]).chunk(2, dim=-1)
        out = F.linear(F.silu(g) * u, w2[e]) * w[tok, j, None]
        y.index_add_(0, tok, out)
    return y


def moe_grouped(x, wr, w1t, w2t, k):
    e_count = w1t.shape[0]
    w, ids = route(x, wr, k)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e_count, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // k
    xs = x.index_select(0, tok)
    g, u = torch._grouped_mm(xs, w1t, offs=offs).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(g) * u, w2t, offs=offs)
    out = out * w.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, tok, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="peers_moe.json")
    ap.add_argument("--ours", default=None)
    ap.add_argument("--ts", default="1,4,16,64,512")
    a = ap.parse_args()
    dev = "cuda"
    l2, _, res = setup_run("rows", dev)
    has_grouped = hasattr(torch, "_grouped_mm")
    if not has_grouped:
        print("torch._grouped_mm is not available in this torch: grouped_mm peer skipped")
    ours = {}
    if a.ours:
        for r in json.load(open(a.ours))["rows"]:
            ours[(r["layer"], r["T"])] = r["us"]
    for name, (e, k, d, h) in LAYERS.items():
        expert_bytes = 3 * h * d * 2
        for t in [int(v) for v in a.ts.split(",")]:
            hit_min = expert_bytes * min(e, k * t)
            copies = max(1, min(math.ceil(3 * l2 / hit_min), int(6e9 // (e * expert_bytes))))
            sets = []
            for _ in range(copies):
                w1 = torch.randn(e, 2 * h, d, device=dev, dtype=torch.bfloat16) / math.sqrt(d)
                w2 = torch.randn(e, d, h, device=dev, dtype=torch.bfloat16) / math.sqrt(h)
                x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
                sets.append((x, w1, w2))
            wr = torch.randn(e, d, device=dev, dtype=torch.bfloat16) / math.sqrt(d)
            row = {"layer": name, "T": t, "copies": copies}
            variants = [("loop", lambda x, w1, w2: moe_loop(x, wr, w1, w2, k))]
            if has_grouped:
                variants.append(("grouped_mm", lambda x, w1, w2: moe_grouped(
                    x, wr, w1.transpose(-2, -1), w2.transpose(-2, -1), k)))
            for tag, fn in variants:
                def run(fn=fn):
                    for x, w1, w2 in sets:
                        fn(x, w1, w2)
                try:
                    run()
                    torch.cuda.synchronize()
                    row[tag + "_us"] = median_us(run) / copies
                except Exception as ex:  # report, keep measuring the rest
                    row[tag + "_err"] = repr(ex)[:200]
                    continue
                try:
                    row[tag + "_graph_us"] = median_us(graphed(run)) / copies
                except Exception as ex:  # the loop's torch.where cannot be captured
                    row[tag + "_graph_err"] = repr(ex)[:120]
            times = [v for kk, v in row.items() if kk.endswith("_us")]
            row["best_us"] = min(times) if times else None
            if (name, t) in ours and times:
                row["ours_us"] = ours[(name, t)]
                row["speedup_vs_best"] = row["best_us"] / ours[(name, t)]
            res["rows"].append(row)
            print(json.dumps({kk: round(v, 2) if isinstance(v, float) else v
                              for kk, v in row.items()}), flush=True)
            with open(a.json, "w") as f:  # after every row: a time limit keeps what was measured
                json.dump(res, f, indent=1)
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
