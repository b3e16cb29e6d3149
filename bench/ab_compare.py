#!/usr/bin/env python3
"""Tables of an A/B run (bench/ab_device.sh): per command, every row's best time over the rounds
for each variant, as µs for the first variant and time ratios for the others, with the geometric
mean of the ratios over the rows all variants have.

  python3 bench/ab_compare.py OUT [--variants base,pp,ring] [--filter KEY=VALUE ...] [--min-change 0.02]

Reads OUT/<variant>.<command>.<round>.json written by fusedmlp_ops_bench, fusedmlp_cuda_bench or
fusedmlp_moe_bench (rows with "us" under "rows", or "mlp" for fusedmlp_cuda_bench). A row is named
by whichever of op, shape, layer, dtype, M, T it has. --min-change hides rows whose ratios all lie
within that fraction of 1.
"""
import argparse
import glob
import json
import math
import os
import re
import sys

KEYS = ("op", "shape", "layer", "dtype", "M", "T")


def row_key(row):
    return " ".join(f"{row[k]}" if k in ("op", "shape", "layer", "dtype") else f"{k}={row[k]}"
                    for k in KEYS if k in row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--variants", help="comma-separated order; the first is the reference")
    ap.add_argument("--filter", action="append", default=[], help="KEY=VALUE a row must have")
    ap.add_argument("--min-change", type=float, default=0.0)
    a = ap.parse_args()
    best = {}  # command -> variant -> key -> us
    for path in glob.glob(os.path.join(a.out, "*.json")):
        m = re.fullmatch(r"(.+?)\.(.+)\.(\d+)\.json", os.path.basename(path))
        if not m:
            continue
        variant, command = m.group(1), m.group(2)
        try:
            doc = json.load(open(path))
            rows = doc["rows"] if "rows" in doc else doc["mlp"]
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: skipped ({e})", file=sys.stderr)
            continue
        for row in rows:
            if "us" not in row or any(str(row.get(k)) != v for k, v in
                                      (f.split("=", 1) for f in a.filter)):
                continue
            d = best.setdefault(command, {}).setdefault(variant, {})
            key = row_key(row)
            d[key] = min(d.get(key, math.inf), row["us"])
    if not best:
        print(f"no <variant>.<command>.<round>.json files in {a.out}", file=sys.stderr)
        return 1
    for command, per_variant in sorted(best.items()):
        order = a.variants.split(",") if a.variants else sorted(per_variant)
        order = [v for v in order if v in per_variant]
        ref, others = order[0], order[1:]
        keys = [k for k in per_variant[ref] if all(k in per_variant[v] for v in others)]
        print(f"## {command}: µs of {ref}, time ratios against it")
        print(f"{'row':40s} {ref:>10s} " + " ".join(f"{v:>8s}" for v in others))
        logs = {v: 0.0 for v in others}
        for k in keys:
            base = per_variant[ref][k]
            ratios = [per_variant[v][k] / base for v in others]
            for v, r in zip(others, ratios):
                logs[v] += math.log(r)
            if all(abs(r - 1) < a.min_change for r in ratios):
                continue
            print(f"{k:40s} {base:10.2f} " + " ".join(f"{r:8.3f}" for r in ratios))
        if keys:
            print(f"{'geomean over ' + str(len(keys)) + ' rows':40s} {'':10s} " +
                  " ".join(f"{math.exp(logs[v] / len(keys)):8.3f}" for v in others))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
