"""README.md and docs/ against their sources.

- The generated files and sections (scripts/gen_docs.py: results tables from bench/results/*.json,
  the op table and the planners' tables from src/) are what the generator writes now.
- The pages describe the design as it is: no work-history wording ("session"), no references to
  work branches.
- Every relative link and every repository path named in backticks exists.
- Where the extension is installed, its op table (fusedmlp.kernels) lists the same entries in the
  same order as docs/kernels.md's source parse, for the backends this build has.
"""

import glob
import itertools
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import docgen_kernels  # noqa: E402
import gen_docs  # noqa: E402

PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# Files another branch adds (the knob registry's generated page, the license text).
PENDING = {"docs/tuning.md", "LICENSE"}
TOP = ("src", "include", "python", "bench", "tests", "tools", "scripts", "docs", "examples",
       "cmake", ".ci")


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_generated_parts_are_current():
    stale = gen_docs.stale(gen_docs.render_all())
    assert not stale, ("out of date with scripts/gen_docs.py (run python3 scripts/gen_docs.py): "
                       + ", ".join(stale))


@pytest.mark.parametrize("page", PAGES)
def test_no_work_history(page):
    for n, line in enumerate(read(page).splitlines(), 1):
        assert not re.search(r"\bsessions?\b", line, re.I), f"{page}:{n}: {line.strip()}"
        assert "wip/" not in line, f"{page}:{n}: names a work branch: {line.strip()}"


def _expand(path):
    """a/{b,c}.x -> [a/b.x, a/c.x]"""
    parts = re.split(r"\{([^{}]*,[^{}]*)\}", path)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*options)]


def _exists(path):
    if path in PENDING:
        return True
    return bool(glob.glob(os.path.join(ROOT, path)))


@pytest.mark.parametrize("page", PAGES)
def test_links_and_paths_exist(page):
    text = read(page)
    base = os.path.dirname(page)
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = os.path.normpath(os.path.join(base, target.split("#", 1)[0]))
        if not _exists(path):
            missing.append(f"link {target}")
    for code in re.findall(r"`([^`\n]+)`", text):
        token = code.split()[0] if code.split() else ""
        token = token.rstrip(".,:;)")
        if not token.startswith(tuple(t + "/" for t in TOP)):
            continue
        if any(c in token for c in "<>*$") or "..." in token:
            continue
        for path in _expand(token):
            if not _exists(path.rstrip("/")):
                missing.append(f"path {path}")
    assert not missing, f"{page} names what does not exist: " + ", ".join(sorted(set(missing)))


def test_kernel_records_match_the_tables():
    # rows() fails (SystemExit) when an entry lacks a record or a record names no entry.
    rows = docgen_kernels.rows(ROOT)
    assert {r["op"] for r in rows} == set(docgen_kernels.OPS)


def test_op_table_of_the_build_matches_the_source():
    fusedmlp = pytest.importorskip("fusedmlp", reason="the fusedmlp extension is not installed")
    parsed = docgen_kernels.table(ROOT)
    for op in docgen_kernels.OPS:
        built = [(name, backend) for name, backend in fusedmlp.kernels(op)]
        backends = {b for _, b in built}
        want = [(name, backend) for o, backend, _, name, _ in parsed
                if o == op and backend in backends]
        assert built == want, f"{op}: the build lists {built}, the source {want}"
