# PyTorch peers of the fused MLP at prefill sizes (M = 1..8192), measured like
# fusedmlp_cuda_bench_prefill: bf16, each variant replayed from a CUDA graph, median. Weights are
# rotated over > 3x the L2 where that fits (the small shapes); at large M the GEMMs are compute
# bound and the rotation no longer matters, so big shapes use one copy. The matmul rate (a bf16
# 8192^3 torch.matmul) is measured in the same run for the % of matmul column.
# --wdtype f8: the fp8 serving recipe (W8A8) as the peer of our fp8 prefill path: weights e4m3 with
# per-row scales, x quantised per token (amax / 448, dynamic), torch._scaled_mm rowwise (GEMM1),
# activation (* up), h quantised per token, torch._scaled_mm rowwise (GEMM2), bf16 out; eager and
# torch.compile'd (Inductor fuses the quantisation passes), graph-replayed the same way. The matmul
# rate is then the e4m3 x e4m3 -> bf16 _scaled_mm rate at 8192^3.
# usage: python3 bench/peers_prefill.py [--shapes a,b] [--ms 1,2,...] [--json out.json]
#                                       [--wdtype bf16|f8]
import argparse
import json
import math

import torch
import torch.nn.functional as F

from peers import SHAPES, activation, graphed, median_us, mlp_fn, weight_copies

MS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"
F8 = torch.float8_e4m3fn


def quant_rows(t):
    """Per-row e4m3 codes and fp32 scales [rows, 1]: scale = amax / 448 (at least 1e-12),
    codes saturated to +-448, the usual dynamic per-token recipe."""
    s = (t.abs().amax(dim=-1, keepdim=True).float() / 448.0).clamp(min=1e-12)
    return (t.float() / s).clamp(-448.0, 448.0).to(F8), s


def fp8_mlp_fn(act, gated):
    def mlp(x, w1, s1, w2, s2):
        xq, sx = quant_rows(x)
        h = torch._scaled_mm(xq, w1.t(), scale_a=sx, scale_b=s1, out_dtype=torch.bfloat16)
        hq, sh = quant_rows(activation(h, act, gated))
        return torch._scaled_mm(hq, w2.t(), scale_a=sh, scale_b=s2, out_dtype=torch.bfloat16)
    return mlp


def fp8_weight_copies(name, l2, dev="cuda"):
    """(fp8 weight bytes, [(w1, s1, w2, s2)] * copies): e4m3 weights with per-row scales as
    [1, rows] (the rowwise scale_b layout), enough copies to span 3x the L2."""
    d, h, _, gated = SHAPES[name]
    n1 = 2 * h if gated else h
    wbytes = n1 * d + d * h
    ws = []
    for _ in range(max(1, math.ceil(3 * l2 / wbytes))):
        w1, s1 = quant_rows(torch.randn(n1, d, device=dev, dtype=torch.bfloat16) / math.sqrt(d))
        w2, s2 = quant_rows(torch.randn(d, h, device=dev, dtype=torch.bfloat16) / math.sqrt(h))
        ws.append((w1, s1.view(1, -1), w2, s2.view(1, -1)))
    return wbytes, ws


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=MS)
    ap.add_argument("--json", default="peers_prefill.json")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--wdtype", default="bf16", choices=["bf16", "f8"])
    a = ap.parse_args()
    f8 = a.wdtype == "f8"
    dev = "cuda"
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n = 8192
    ma = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    mb = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    if f8:
        one = torch.ones((), device=dev)
        qa, qb = ma.to(F8), mb.to(F8).t()
        mm = lambda: torch._scaled_mm(qa, qb, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        mm = lambda: ma @ mb
    rate = 2 * n**3 / (median_us(graphed(mm), 300) * 1e-6) / 1e12
    del ma, mb
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
           "wdtype": "f8_e4m3" if f8 else "bf16", "matmul_TFLOPs": rate, "prefill": []}
    print(f"{res['gpu']} torch {res['torch']} {'e4m3' if f8 else 'bf16'} matmul {rate:.1f} "
          "TFLOP/s", flush=True)
    for name in a.shapes.split(","):
        d, h, act, gated = SHAPES[name]
        wbytes, ws = fp8_weight_copies(name, l2, dev) if f8 else weight_copies(name, l2, dev)
        copies = len(ws)
        params = wbytes if f8 else wbytes / 2
        mlp = fp8_mlp_fn(act, gated) if f8 else mlp_fn(act, gated)
        torch._dynamo.reset()
        # dynamic=False: one specialised graph per M, as a serving stack with bucketed shapes.
        cmlp = torch.compile(mlp, dynamic=False)
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, d, device=dev, dtype=torch.bfloat16)
            flops = 2 * m * params
            row = {"shape": name, "M": m, "copies": copies, "flops": flops}
            variants = [("eager", mlp)] + ([] if a.skip_compile else [("inductor", cmlp)])
            for tag, fn in variants:
                try:
                    def run(fn=fn):
                        for w in ws:
                            fn(x, *w)
                    run()
                    torch.cuda.synchronize()
                    row[tag + "_graph_us"] = median_us(graphed(run)) / copies
                except Exception as e:  # report, keep measuring the rest
                    row[tag + "_err"] = repr(e)[:200]
            times = {k[:-3]: v for k, v in row.items() if k.endswith("_us")}
            if times:
                best = min(times, key=times.get)
                row["best_peer"], row["best_us"] = best, times[best]
                row["best_TFLOPs"] = flops / times[best] * 1e-6
                row["best_pct_of_matmul"] = 100 * row["best_TFLOPs"] / rate
            res["prefill"].append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
            with open(a.json, "w") as f:  # after every row: a time limit keeps what was measured
                json.dump(res, f, indent=1)
            del x
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
