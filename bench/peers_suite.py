# PyTorch peers of the decode suite (bench/decode_suite.txt), measured like
# fusedmlp_decode_suite_bench: bf16, weights rotated over more than 3x the L2 so each call reads
# HBM (biases on the dense shapes, as there), eager (cuBLAS + separate activation kernels) and
# torch.compile (Inductor), each replayed from a CUDA graph, median. One compiled function per
# activation variant with dynamic shapes, so the suite's 22 shapes x 7 token counts compile a
# handful of times instead of 150 (Inductor's matmuls are cuBLAS calls either way; its fused
# activation kernel takes the sizes as arguments).
# usage: python3 bench/peers_suite.py [--suite FILE] [--shapes a,b] [--ms 1,2,4] [--rep-ms T]
#                                     [--json FILE]
import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

from peers import graphed, median_us, setup_run


def read_suite(path):
    """[(name, d_model, hidden, act, gated)] from the suite file."""
    rows = []
    for line in open(path):
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split()
        rows.append((f[0], int(f[1]), int(f[2]), f[3], f[4] == "1"))
    return rows


def mlp_fn(act, gated):
    def mlp(x, w1, b1, w2, b2):
        h = F.linear(x, w1, b1)
        if gated:
            g, u = h.chunk(2, dim=-1)
            h = (F.silu(g) if act == "silu" else
                 F.gelu(g, approximate="tanh") if act == "gelu_tanh" else
                 F.gelu(g) if act == "gelu" else F.relu(g)) * u
        else:
            h = (F.silu(h) if act == "silu" else
                 F.gelu(h, approximate="tanh") if act == "gelu_tanh" else
                 F.gelu(h) if act == "gelu" else F.relu(h))
        return F.linear(h, w2, b2)
    return mlp


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default=os.path.join(here, "decode_suite.txt"))
    ap.add_argument("--shapes", default="")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--json", default="peers_suite.json")
    ap.add_argument("--rep-ms", type=float, default=200, help="do_bench time per variant")
    a = ap.parse_args()
    suite = read_suite(a.suite)
    names = [s[0] for s in suite]
    wanted = [n for n in a.shapes.split(",") if n]
    for n in wanted:
        if n not in names:
            raise SystemExit(f"--shapes: no shape '{n}' in {a.suite} (expected one of {names})")
    dev = "cuda"
    l2, bw, res = setup_run("rows", dev)
    compiled = {}
    for name, d, h, act, gated in suite:
        if wanted and name not in wanted:
            continue
        n1 = 2 * h if gated else h
        wbytes = (n1 * d + d * h) * 2
        ws = []
        for _ in range(max(1, math.ceil(3 * l2 / wbytes))):
            w1 = torch.randn(n1, d, device=dev, dtype=torch.bfloat16) / math.sqrt(d)
            w2 = torch.randn(d, h, device=dev, dtype=torch.bfloat16) / math.sqrt(h)
            b1 = None if gated else torch.randn(n1, device=dev, dtype=torch.bfloat16) * 0.5
            b2 = None if gated else torch.randn(d, device=dev, dtype=torch.bfloat16) * 0.5
            ws.append((w1, b1, w2, b2))
        eager = mlp_fn(act, gated)
        key = (act, gated)
        if key not in compiled:
            compiled[key] = torch.compile(mlp_fn(act, gated), dynamic=True)
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, d, device=dev, dtype=torch.bfloat16)
            floor = (wbytes + 4 * m * d) / bw * 1e6
            row = {"shape": name, "M": m, "floor_us": floor, "copies": len(ws)}
            for tag, fn in (("eager", eager), ("inductor", compiled[key])):
                try:
                    def run(fn=fn):
                        for w in ws:
                            fn(x, *w)
                    run()
                    torch.cuda.synchronize()
                    row[tag + "_graph_us"] = median_us(graphed(run), a.rep_ms) / len(ws)
                except Exception as e:  # report, keep measuring the rest
                    row[tag + "_err"] = repr(e)[:200]
            times = [v for k, v in row.items() if k.endswith("_graph_us")]
            row["best_peer_us"] = min(times) if times else None
            res["rows"].append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
            with open(a.json, "w") as f:  # after every row: a time limit keeps what was measured
                json.dump(res, f, indent=1)
        del ws


if __name__ == "__main__":
    main()
