# PyTorch peers of the fused MLP, measured like fusedmlp_cuda_bench: bf16, weights rotated over
# more than 3x the L2 so each call reads HBM, each variant replayed from a CUDA graph, median.
# Variants: eager (cuBLAS + separate activation kernels) and torch.compile (Inductor).
# usage: python3 bench/peers.py [--shapes a,b] [--ms 1,4,16,64] [--json out.json]
import argparse
import json
import math

import torch
import torch.nn.functional as F
from triton.testing import do_bench

SHAPES = {  # name: (d_model, d_hidden, activation, gated)
    "gpt2-small": (768, 3072, "gelu_tanh", False),
    "seed-4096": (4096, 4096, "gelu", False),
    "llama3-8b": (4096, 14336, "silu", True),
    "llama3-70b": (8192, 28672, "silu", True),
}


def median_us(fn, rep_ms=200):
    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def graphed(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def activation(h, act, gated):
    """The hidden activation of the bench shapes: act(gate) * up when gated (h = [gate, up])."""
    if gated:
        g, u = h.chunk(2, dim=-1)
        return F.silu(g) * u if act == "silu" else F.gelu(g, approximate="tanh") * u
    if act == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    return F.gelu(h) if act == "gelu" else F.relu(h)


def mlp_fn(act, gated):
    def mlp(x, w1, b1, w2, b2):
        return F.linear(activation(F.linear(x, w1, b1), act, gated), w2, b2)
    return mlp


def weight_copies(name, l2, dev="cuda"):
    """(weight bytes, [(w1, b1, w2, b2)] * copies) for a bench shape, bf16 random weights of
    nn.Linear scale (biases only for dense shapes), enough copies to span 3x the L2 so every call
    reads HBM."""
    d, h, _, gated = SHAPES[name]
    n1 = 2 * h if gated else h
    wbytes = (n1 * d + d * h) * 2
    ws = []
    for _ in range(max(1, math.ceil(3 * l2 / wbytes))):
        w1 = torch.randn(n1, d, device=dev, dtype=torch.bfloat16) / math.sqrt(d)
        w2 = torch.randn(d, h, device=dev, dtype=torch.bfloat16) / math.sqrt(h)
        b1 = None if gated else torch.randn(n1, device=dev, dtype=torch.bfloat16) * 0.1
        b2 = None if gated else torch.randn(d, device=dev, dtype=torch.bfloat16) * 0.1
        ws.append((w1, b1, w2, b2))
    return wbytes, ws


def copy_bandwidth(dev="cuda"):
    """Device copy bandwidth in bytes/s (read + write of a 2 GiB buffer, median of 100): the
    floor every peer script reports against."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_us(lambda: dst.copy_(src), 100) * 1e-6)


def setup_run(rows_key, dev="cuda"):
    """What every peer script measures first: the L2 size (for weight rotation), the copy
    bandwidth (the floor), and the result dict with the run's torch, GPU and bandwidth and an
    empty list under rows_key; prints the header line."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = copy_bandwidth(dev)
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "l2_bytes": l2,
           "copy_TBps": bw / 1e12, rows_key: []}
    print(f"{res['gpu']} torch {res['torch']} copy {bw / 1e12:.3f} TB/s", flush=True)
    return l2, bw, res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--json", default="peers.json")
    ap.add_argument("--skip-compile", action="store_true")
    a = ap.parse_args()
    dev = "cuda"
    l2, bw, res = setup_run("mlp", dev)
    for name in a.shapes.split(","):
        d, h, act, gated = SHAPES[name]
        wbytes, ws = weight_copies(name, l2, dev)
        copies = len(ws)
        mlp = mlp_fn(act, gated)
        torch._dynamo.reset()
        cmlp = torch.compile(mlp, dynamic=False)
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, d, device=dev, dtype=torch.bfloat16)
            floor = (wbytes + 4 * m * d) / bw * 1e6
            row = {"shape": name, "M": m, "floor_us": floor, "copies": copies}
            variants = [("eager", mlp)] + ([] if a.skip_compile else [("inductor", cmlp)])
            for tag, fn in variants:
                try:
                    def run(fn=fn):
                        for w in ws:
                            fn(x, *w)
                    run()
                    torch.cuda.synchronize()
                    row[tag + "_us"] = median_us(run) / copies
                    row[tag + "_graph_us"] = median_us(graphed(run)) / copies
                except Exception as e:  # report, keep measuring the rest
                    row[tag + "_err"] = repr(e)[:200]
            times = [v for k, v in row.items() if k.endswith("_us") and k != "floor_us"]
            row["best_us"] = min(times) if times else None
            row["best_pct_of_floor"] = 100 * floor / min(times) if times else None
            res["mlp"].append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
            with open(a.json, "w") as f:  # after every row: a time limit keeps what was measured
                json.dump(res, f, indent=1)
        del ws


if __name__ == "__main__":
    main()
