"""The fusedmlp.patch sweep's table: runs python/tests/hf_sweep.py over every causal-LM, MoE
and encoder class of the installed transformers (tiny random-init models, patched vs
unpatched), writes bench/results/patch_sweep.json (the rows) and patch_sweep.md (the table),
then regenerates the docs (scripts/gen_docs.py), whose patch-sweep sections in README.md and
docs/ quote that file's summary.

    python3 bench/patch_sweep.py                  # fp32 on the CPU backend (what CI checks)
    python3 bench/patch_sweep.py --readme-only    # table and docs from the recorded rows
    python3 bench/patch_sweep.py --dtype bf16 --device cuda --out /tmp/sweep_bf16

The sweep's pass/fail conditions are python/tests/test_patch_sweep.py's; this only records.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def rewrite_docs():
    """The generated sections quoting patch_sweep.md (README.md, docs/) brought up to date."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gen_docs
    if gen_docs.main([]) != 0:
        sys.exit("scripts/gen_docs.py failed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=os.path.join(RESULTS, "patch_sweep"),
                    help="path prefix of the .json and .md written")
    ap.add_argument("--readme-only", action="store_true",
                    help="only remake <out>.md and the docs from <out>.json")
    ap.add_argument("--only", nargs="*", help="class names (default: all)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
    import hf_sweep
    if args.readme_only:  # the table again from the recorded rows (no model is run)
        with open(args.out + ".json") as f:
            saved = json.load(f)
        rows = [hf_sweep.Row(**r) for r in saved["rows"]]
        write(args, rows, saved["seconds"], saved["transformers"], saved["torch"], hf_sweep)
        return
    import torch
    import transformers
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rtol = {"fp32": 1e-3, "bf16": 2.0**-4}[args.dtype]
    rows, start = [], time.perf_counter()
    for kind, arch in hf_sweep.classes():
        if args.only and arch not in args.only:
            continue
        row = hf_sweep.run(kind, arch, dtype=dtype, device=args.device, rtol=rtol)
        rows.append(row)
        print(f"{arch}: {'built' if row.built else row.reason[:80]} "
              f"replaced {len(row.replaced) + len(row.experts)} skipped {len(row.skipped)} "
              f"diff {row.max_diff:.2g} {row.strict[:30]} {row.error[:80]}", flush=True)
    write(args, rows, round(time.perf_counter() - start, 1), transformers.__version__,
          torch.__version__, hf_sweep)


def write(args, rows, seconds, transformers_version, torch_version, hf_sweep):
    header = (f"{args.dtype} on the {args.device} backend, torch {torch_version}, {seconds:.0f} s "
              f"(`python3 bench/patch_sweep.py`).")
    markdown = header + " " + hf_sweep.table(rows, transformers_version)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"transformers": transformers_version, "torch": torch_version,
                   "dtype": args.dtype, "device": args.device, "seconds": seconds,
                   "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown + "\n")
    if args.out == os.path.join(RESULTS, "patch_sweep") and not args.only:
        rewrite_docs()
    print(markdown.split("\n")[0])


if __name__ == "__main__":
    main()
