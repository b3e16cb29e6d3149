# PyTorch peers of the fused MLP at prefill sizes (M = 1..8192), measured like
# fusedmlp_cuda_bench_prefill: bf16, each variant replayed from a CUDA graph, median. Weights are
# rotated over > 3x the L2 where that fits (the small shapes); at large M the GEMMs are compute
# bound and the rotation no longer matters, so big shapes use one copy. The matmul rate (a bf16
# 8192^3 torch.matmul) is measured in the same run for the % of matmul column.
# usage: python3 bench/peers_prefill.py [--shapes a,b] [--ms 1,2,...] [--json out.json]
import argparse
import json
import math

import torch

from peers import SHAPES, graphed, median_us, mlp_fn, weight_copies

MS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=MS)
    ap.add_argument("--json", default="peers_prefill.json")
    ap.add_argument("--skip-compile", action="store_true")
    a = ap.parse_args()
    dev = "cuda"
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n = 8192
    ma = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    mb = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    rate = 2 * n**3 / (median_us(graphed(lambda: ma @ mb), 300) * 1e-6) / 1e12
    del ma, mb
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
           "matmul_TFLOPs": rate, "prefill": []}
    print(f"{res['gpu']} torch {res['torch']} bf16 matmul {rate:.1f} TFLOP/s", flush=True)
    for name in a.shapes.split(","):
        d, h, act, gated = SHAPES[name]
        wbytes, ws = weight_copies(name, l2, dev)
        copies = len(ws)
        mlp = mlp_fn(act, gated)
        torch._dynamo.reset()
        # dynamic=False: one specialised graph per M, as a serving stack with bucketed shapes.
        cmlp = torch.compile(mlp, dynamic=False)
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, d, device=dev, dtype=torch.bfloat16)
            flops = 2 * m * wbytes / 2
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
