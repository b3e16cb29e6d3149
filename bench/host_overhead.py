#!/usr/bin/env python3
"""Host time per call of fusedmlp's torch ops and modules against what they replace, eager.

Tiny shapes (the kernels' arithmetic is small; on a GPU the device idles), x [1, 1, d] as in
decode, back to back, under torch.no_grad() as a decode loop runs. Each case is a callable; the
cases of one group are timed interleaved, round after round, so that a change of machine load hits
all of them alike ("side by side in one run"). A round times --calls back-to-back calls; the
figure is the best round's mean per call in microseconds (us_per_call: on a shared machine the
other rounds measure the neighbours too, as the median beside it shows). On the host backend
the figures include the arithmetic of both sides. The process runs one OpenMP thread by default
(--threads): torch's bundled OpenMP runtime and the system one that fusedmlp's cpu backend uses
each keep spinning threads after a parallel region, and on a small machine the two sets of
spinners slow each other's next region down by orders of magnitude.

Groups (what replaces what):
  linear     F.linear, nn.Linear, torch.ops.fusedmlp.linear, FusedLinear
  linear-0rows  the same on x [1, 0, d]: no arithmetic on either side, the call path alone
  mlp        Linear -> GELU -> Linear (nn.Sequential), FusedMLP, torch.ops.fusedmlp.mlp_packed,
             torch.ops.fusedmlp.mlp, fusedmlp.PackedMlp (the framework-neutral entry)
  swiglu     the Llama MLP (gate, up, down, SiLU, mul) and FusedMLP(gated)
  norm+mlp   RMSNorm + the Llama MLP against FusedMLP(gated, norm="rmsnorm") (patch's fuse_norm)
  softmax    torch.softmax, torch.ops.fusedmlp.softmax
  moe        a Mixtral block (transformers, when installed) and FusedMoE, 4 experts, top-2

The goals of the fast path are printed at the end: FusedLinear <= nn.Linear and FusedMLP <= 0.6x
the module it replaces, in the same run.

Usage: python3 bench/host_overhead.py [--device cpu|cuda] [--out bench/results/host_overhead_2core]
[--compare 'python ops=FMLP_TORCH_OPS=python'] writes OUT.json, OUT.csv and (with matplotlib)
OUT.png; --compare adds the rows of another build or setting, run in a child process.
"""

import argparse
import csv
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time


def _git_commit():
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def time_group(cases, calls, rounds, sync):
    """{name: (median, best) over rounds of the mean us per call}, the cases interleaved."""
    cases = dict(cases)
    for name, fn in list(cases.items()):  # warm-up: first-call costs (workspace, dispatch)
        try:
            for _ in range(max(10, calls // 10)):
                fn()
        except (NotImplementedError, ValueError, RuntimeError) as e:  # recorded, not fatal
            print(f"  {name} left out: {type(e).__name__}: {e}", file=sys.stderr)
            del cases[name]
    sync()
    samples = {name: [] for name in cases}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in cases.items():
                t0 = time.perf_counter_ns()
                for _ in range(calls):
                    fn()
                sync()
                samples[name].append((time.perf_counter_ns() - t0) / calls / 1e3)
    finally:
        if gc_was:
            gc.enable()
    return {name: (statistics.median(s), min(s)) for name, s in samples.items()}


def build_groups(torch, fusedmlp, ft, device, dtype, d, hidden):
    """{group: {case: callable}} and the per-group baseline case names."""
    from torch import nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(1, 1, d, device=device, dtype=dtype)  # [batch, tokens, d] as in decode
    groups, baselines = {}, {}

    lin = nn.Linear(d, d).to(device, dtype).eval()
    flin = ft.FusedLinear.from_module(lin).eval()
    w, b = lin.weight, lin.bias
    groups["linear"] = {
        "F.linear": lambda: F.linear(x, w, b),
        "nn.Linear": lambda: lin(x),
        "torch.ops.fusedmlp.linear": lambda: torch.ops.fusedmlp.linear(x, w, b, None),
        "FusedLinear": lambda: flin(x),
    }
    baselines["linear"] = "nn.Linear"
    # No rows: both sides skip the arithmetic, what is left is the call path alone (on the host
    # backend the rows above include the kernels' fixed costs, e.g. an OpenMP region's).
    x0 = torch.randn(1, 0, d, device=device, dtype=dtype)
    groups["linear-0rows"] = {
        "F.linear": lambda: F.linear(x0, w, b),
        "nn.Linear": lambda: lin(x0),
        "torch.ops.fusedmlp.linear": lambda: torch.ops.fusedmlp.linear(x0, w, b, None),
        "FusedLinear": lambda: flin(x0),
    }
    baselines["linear-0rows"] = "nn.Linear"

    seq = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)).to(device, dtype)
    seq.eval()
    fmlp = ft.FusedMLP.from_module(seq).eval()
    w1, b1, w2, b2 = seq[0].weight, seq[0].bias, seq[2].weight, seq[2].bias
    groups["mlp"] = {
        "Linear+GELU+Linear": lambda: seq(x),
        "FusedMLP": lambda: fmlp(x),
        "torch.ops.fusedmlp.mlp_packed": lambda: torch.ops.fusedmlp.mlp_packed(
            x, None, fmlp._handle, fmlp.d_out),
        "torch.ops.fusedmlp.mlp": lambda: torch.ops.fusedmlp.mlp(x, w1, w2, b1, None, None, b2),
    }
    if device == "cpu":  # the framework-neutral entry (DLPack) for comparison
        packed = fusedmlp.pack(w1.detach(), w2.detach(), b1=b1.detach(), b2=b2.detach())
        x2 = x.view(1, d)
        groups["mlp"]["fusedmlp.PackedMlp"] = lambda: packed(x2)
    baselines["mlp"] = "Linear+GELU+Linear"

    class SwiGLU(nn.Module):  # transformers' LlamaMLP
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(d, hidden, bias=False)
            self.up_proj = nn.Linear(d, hidden, bias=False)
            self.down_proj = nn.Linear(hidden, d, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, h):
            return self.down_proj(self.act_fn(self.gate_proj(h)) * self.up_proj(h))

    class RMSNorm(nn.Module):  # transformers' LlamaRMSNorm
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))
            self.variance_epsilon = 1e-6

        def forward(self, h):
            dt = h.dtype
            h = h.to(torch.float32)
            var = h.pow(2).mean(-1, keepdim=True)
            h = h * torch.rsqrt(var + self.variance_epsilon)
            return self.weight * h.to(dt)

    swiglu = SwiGLU().to(device, dtype).eval()
    fswiglu = ft.FusedMLP.from_module(swiglu).eval()
    groups["swiglu"] = {"LlamaMLP": lambda: swiglu(x), "FusedMLP(gated)": lambda: fswiglu(x)}
    baselines["swiglu"] = "LlamaMLP"

    norm = RMSNorm().to(device, dtype).eval()
    fnorm = ft.FusedMLP(**ft._describe(swiglu), norm="rmsnorm", norm_weight=norm.weight,
                        eps=1e-6).eval()
    groups["norm+mlp"] = {"RMSNorm+LlamaMLP": lambda: swiglu(norm(x)),
                          "FusedMLP(gated, rmsnorm)": lambda: fnorm(x)}
    baselines["norm+mlp"] = "RMSNorm+LlamaMLP"

    z = torch.randn(1, 1, 64, device=device, dtype=dtype)
    groups["softmax"] = {"torch.softmax": lambda: torch.softmax(z, -1),
                         "torch.ops.fusedmlp.softmax": lambda: torch.ops.fusedmlp.softmax(
                             z, 1.0, False)}
    baselines["softmax"] = "torch.softmax"

    try:
        import transformers
        cfg = transformers.MixtralConfig(hidden_size=d, intermediate_size=hidden,
                                         num_local_experts=4, num_experts_per_tok=2)
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        block = MixtralSparseMoeBlock(cfg).to(device, dtype).eval()
        fmoe = ft.FusedMoE.from_module(block).eval()
        groups["moe"] = {"MixtralSparseMoeBlock": lambda: block(x),
                         "FusedMoE": lambda: fmoe(x)}
        baselines["moe"] = "MixtralSparseMoeBlock"
    except Exception as e:  # noqa: BLE001 (the other groups still count)
        print(f"moe group skipped: {type(e).__name__}: {e}", file=sys.stderr)
    return groups, baselines


def plot(path, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r["group"] for r in rows))
    labels = list(dict.fromkeys(r["build"] for r in rows))
    cols = min(4, len(groups))
    nrows = -(-len(groups) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.axis("off")
    height = 0.8 / len(labels)
    for ax, g in zip(axes.flat, groups):
        cases = list(dict.fromkeys(r["case"] for r in rows if r["group"] == g))
        for j, label in enumerate(labels):
            by = {r["case"]: r for r in rows if r["group"] == g and r["build"] == label}
            ys = [i + j * height for i, c in enumerate(cases) if c in by]
            vals = [by[c]["us_per_call"] for c in cases if c in by]
            ax.barh(ys, vals, height=height, label=label if g == groups[0] else None)
        ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))], cases, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(g, fontsize=9)
        ax.set_xlabel("us per call (best round)", fontsize=8)
    fig.legend(loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle("host time per call, eager, tiny shapes: per group torch's cases, then "
                 "fusedmlp's", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)


def measure(args, label):
    import torch
    import fusedmlp
    import fusedmlp.torch as ft

    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    sync = (torch.cuda.synchronize if device.type == "cuda" else (lambda: None))
    groups, baselines = build_groups(torch, fusedmlp, ft, device.type, dtype, args.d,
                                     args.hidden)
    if args.groups:
        keep = args.groups.split(",")
        groups = {g: c for g, c in groups.items() if g in keep}
    rows = []
    with torch.no_grad():
        for g, cases in groups.items():
            result = time_group(cases, args.calls, args.rounds, sync)
            if baselines[g] not in result:
                continue
            base = result[baselines[g]][1]
            for name, (median, best) in result.items():
                rows.append({"build": label, "group": g, "case": name,
                             "us_per_call": round(best, 3),
                             "us_per_call_median": round(median, 3),
                             "vs_replaced": round(best / base, 3),
                             "baseline": name == baselines[g]})
                print(f"{g:12s} {name:32s} {best:8.2f} us  (median {median:7.2f})  "
                      f"{best / base:5.2f}x of {baselines[g]}", file=sys.stderr, flush=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__,
            "fusedmlp": fusedmlp.build_info(),
            "ops_implementation": (ft.ops_implementation() if hasattr(ft, "ops_implementation")
                                   else "python (no fusedmlp._torch_ops yet)"),
            "fusedmlp_path": os.path.dirname(fusedmlp.__file__),
            "torch_threads": torch.get_num_threads(), "loadavg_after": os.getloadavg()}
    return rows, meta


def goals_of(rows):
    """The fast path's goals, each the ratio to its limit's left side: FusedLinear / nn.Linear
    (goal <= 1) and FusedMLP / the module it replaces (goal <= 0.6)."""
    by = {(r["group"], r["case"]): r["us_per_call"] for r in rows}
    base = {r["group"]: (r["case"], r["us_per_call"]) for r in rows if r["baseline"]}
    goals = {}
    for g, case, limit in (("linear", "FusedLinear", 1.0), ("linear-0rows", "FusedLinear", 1.0),
                           ("mlp", "FusedMLP", 0.6),
                           ("swiglu", "FusedMLP(gated)", 0.6),
                           ("norm+mlp", "FusedMLP(gated, rmsnorm)", 0.6)):
        if (g, case) in by:
            goals[f"{g}: {case} / {base[g][0]} <= {limit}"] = round(
                by[(g, case)] / base[g][1], 3)
    return goals


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--d", type=int, default=32, help="model width of the tiny shapes")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--calls", type=int, default=500, help="back-to-back calls per round")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP_NUM_THREADS for torch and fusedmlp's cpu backend (see above)")
    ap.add_argument("--groups", default=None, help="comma-separated subset of the groups")
    ap.add_argument("--label", default="this build", help="the name of this run's rows")
    ap.add_argument("--compare", action="append", default=[], metavar="LABEL=VAR=VALUE",
                    help="also run the cases in a child process with the environment variable "
                         "set, e.g. 'python ops=FMLP_TORCH_OPS=python' or "
                         "'before=PYTHONPATH=/other/site-packages' (one after the other, not "
                         "interleaved with this run's)")
    ap.add_argument("--rows-json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="path prefix of the .json/.csv/.png results")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before the OpenMP runtimes start

    rows, meta = measure(args, args.label)
    if args.rows_json:
        print(json.dumps({"rows": rows, "meta": meta}))
        return 0
    builds = {args.label: meta}
    for spec in args.compare:
        label, _, assignment = spec.partition("=")
        var, _, value = assignment.partition("=")
        child = [a for a in sys.argv[1:] if not a.startswith("--compare") and a not in args.compare]
        child = [a for i, a in enumerate(child)
                 if not (a == "--label" or (i and child[i - 1] == "--label"))]
        run = subprocess.run([sys.executable, os.path.abspath(__file__), *child, "--label", label,
                              "--rows-json"], env=dict(os.environ, **{var: value}),
                             capture_output=True, text=True, check=True)
        sys.stderr.write(run.stderr)
        result = json.loads(run.stdout.strip().splitlines()[-1])
        rows += result["rows"]
        builds[label] = dict(result["meta"], env=f"{var}={value}")
    goals = goals_of([r for r in rows if r["build"] == args.label])
    for k, v in goals.items():
        print(f"goal {k}: {v:.2f}")
    import torch
    meta = {"device": args.device, "dtype": args.dtype, "d": args.d, "hidden": args.hidden,
            "calls": args.calls, "rounds": args.rounds, "threads": args.threads,
            "cpus": os.cpu_count(), "machine": platform.machine(), "commit": _git_commit(),
            "no_grad": True, "torch": torch.__version__,
            "command": shlex.join(["python3", "bench/host_overhead.py"] + sys.argv[1:]),
            "builds": builds, "goals": goals}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(args.out + ".csv", "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        try:
            plot(args.out + ".png", rows)
        except ImportError:
            print("matplotlib is not installed: no PNG", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
