"""Tensor-parallel fusedmlp from PyTorch: correctness and speed on N GPUs.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/tp_python_check.py [--json out.json]

Every rank builds the same Llama-style MLP (gate/up/down, SiLU, bf16; llama3-8b sizes by
default, --d/--hidden to change), fusedmlp.patch(model, tp_group=...) replaces it by the rank's TPFusedMLP
shard, and the all-reduced output is compared with the unsharded PyTorch module on the same
input: |tp - ref| <= 2^-6 (|ref| + rms(ref row)) (both sides round to bf16 at least once, plus
the partial sums; twice the bf16 budget of tests/tolerance.hpp). Then both are timed with CUDA
graphs (median of replays; the TP graph includes the all-reduce). Rank 0 prints and writes JSON.
"""

import argparse
import json
import os
import statistics

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402


class LlamaMLP(nn.Module):  # the transformers layout, without needing transformers
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def graph_us(fn, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=14336)
    ap.add_argument("--ms", default="1,16,512")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    import fusedmlp

    torch.manual_seed(0)  # identical weights and inputs on every rank
    ref = LlamaMLP(a.d, a.hidden).to(device="cuda", dtype=torch.bfloat16).eval()
    model = nn.Sequential(LlamaMLP(a.d, a.hidden)).to(device="cuda", dtype=torch.bfloat16)
    model[0].load_state_dict(ref.state_dict())
    replaced = fusedmlp.patch(model, tp_group=dist.group.WORLD).replaced
    assert replaced == ["0"], replaced
    rows, failures = [], 0
    for m in [int(v) for v in a.ms.split(",")]:
        x = torch.randn(m, a.d, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            y_ref = ref(x).float()
            y_tp = model(x).float()
            rms = y_ref.pow(2).mean(dim=-1, keepdim=True).sqrt()
            err = float(((y_tp - y_ref).abs() / (y_ref.abs() + rms)).max())
            ok = err <= 2.0**-6
            failures += not ok
            tp_us = graph_us(lambda: model(x), a.reps)
            dist.barrier()
            one_us = graph_us(lambda: ref(x), a.reps) if rank == 0 else float("nan")
            dist.barrier()
        if rank == 0:
            print(f"M={m:5d} tp(fusedmlp x{world}) {tp_us:9.1f} us  torch 1 GPU {one_us:9.1f} us "
                  f" speedup {one_us / tp_us:.2f}x  max err {err:.2e} ({'ok' if ok else 'FAIL'})",
                  flush=True)
        rows.append(dict(M=m, tp_us=tp_us, torch_single_us=one_us, max_err=err, ok=ok))
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump(dict(bench="tp_python_check", d=a.d, hidden=a.hidden, ranks=world,
                           results=rows, failures=failures), f, indent=1)
    dist.destroy_process_group()
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
