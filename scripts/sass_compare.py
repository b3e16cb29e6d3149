#!/usr/bin/env python3
"""Compares the SASS of every kernel in two build trees, for changes that should only move code.

    python3 scripts/sass_compare.py BASE_BUILD NEW_BUILD [--rename OLD=NEW ...]

Reads every *.cu.o below each tree with cuobjdump (-sass and -res-usage, every arch it holds),
demangles the function names (kernels in an anonymous namespace then match whatever file they
moved to) and compares the two multisets per (arch, function): the instruction text with addresses
and line information stripped, the same with the 128-bit encodings (control bits: stalls,
barriers, yields), and the resource usage. --rename rewrites a substring of the new tree's names
first (e.g. a parameter struct that moved namespace). Exits 1 when a body differs or a function
is missing on one side. cuobjdump comes from the toolkit, or from the wheels scripts/sass.sh
unpacks into ~/.cache/fusedmlp-sass.
"""
import argparse
import collections
import hashlib
import os
import re
import shutil
import subprocess
import sys


def cuobjdump():
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    if os.path.exists(tool):
        return tool
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    tool = os.path.join(cache, "fusedmlp-sass/nvidia/cu13/bin/cuobjdump")
    if not os.path.exists(tool):
        sys.exit("sass_compare: no cuobjdump; run scripts/sass.sh once to fetch it")
    return tool


def demangle(text):
    return subprocess.run(["c++filt"], input=text, capture_output=True, text=True, check=True).stdout


def kernels(root, renames):
    """{(arch, name): [(text hash, text+encoding hash, resource line), ...]} of every object."""
    tool = cuobjdump()
    out = collections.defaultdict(list)
    objs = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".cu.o"))
    for obj in objs:
        res = {}
        usage = demangle(subprocess.run([tool, "-res-usage", obj], capture_output=True, text=True,
                                        check=True).stdout).splitlines()
        arch = None
        for i, line in enumerate(usage):
            m = re.search(r"arch = (sm_\w+)", line)
            arch = m.group(1) if m else arch
            m = re.match(r"\s*Function (.*):$", line)
            if m and i + 1 < len(usage):
                res[(arch, m.group(1).strip())] = usage[i + 1].strip()
        sass = demangle(subprocess.run([tool, "-sass", obj], capture_output=True, text=True,
                                       check=True).stdout)
        arch = name = None
        body = []

        def flush():
            if name is None:
                return
            text = [re.sub(r"^/\*[0-9a-f]+\*/\s*", "", re.sub(r"/\* 0x[0-9a-f]+ \*/", "", l).strip())
                    for l in body]
            text = "\n".join(t for t in text if t)
            enc = "\n".join(re.findall(r"/\* (0x[0-9a-f]+) \*/", "\n".join(body)))
            key = name
            for old, new in renames:
                key = key.replace(old, new)
            out[(arch, key)].append((hashlib.sha256(text.encode()).hexdigest(),
                                     hashlib.sha256((text + enc).encode()).hexdigest(),
                                     res.get((arch, name), "")))

        for line in sass.splitlines():
            m = re.match(r"\s*code for (sm_\w+)", line)
            if m:
                flush()
                arch, name, body = m.group(1), None, []
                continue
            m = re.match(r"\s*Function : (.*)$", line)
            if m:
                flush()
                name, body = m.group(1).strip(), []
                continue
            if name is not None and "/*" in line:
                body.append(line)
        flush()
    return out, len(objs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW")
    args = ap.parse_args()
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    base, nb = kernels(args.base, [])
    new, nn = kernels(args.new, renames)
    print(f"base: {nb} objects, {sum(map(len, base.values()))} kernels; "
          f"new: {nn} objects, {sum(map(len, new.values()))} kernels")
    bad = False
    for i, what in ((0, "instruction text"), (1, "text and encodings"), (2, "resource usage")):
        differ = sorted(k for k in base.keys() & new.keys()
                        if sorted(x[i] for x in base[k]) != sorted(x[i] for x in new[k]))
        same = len(base.keys() & new.keys()) - len(differ)
        print(f"{what}: {same} identical, {len(differ)} differ")
        for arch, name in differ:
            print(f"  {arch} {name}")
            if i == 2:
                print(f"    base {sorted(x[2] for x in base[(arch, name)])}\n"
                      f"    new  {sorted(x[2] for x in new[(arch, name)])}")
        bad = bad or (i < 2 and bool(differ))
    for side, a, b in (("base", base, new), ("new", new, base)):
        for arch, name in sorted(a.keys() - b.keys()):
            print(f"only in {side}: {arch} {name}")
            bad = True
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
