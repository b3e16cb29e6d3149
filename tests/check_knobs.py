#!/usr/bin/env python3
"""Checks the environment knob table (src/core/knobs.def) against the sources (ctest
knob_registry; standard library only):

1. No raw reads: C/C++ sources call getenv only in src/core/knobs.cpp (and the save/restore of
   tests/test_knobs.cpp); Python sources read no FMLP_ variable through os.environ / os.getenv.
   Every read goes through the registry (core/knobs.hpp in the library, fmlp_knob_info or
   fusedmlp.knobs() outside it), so it is validated and documented.
2. Every FMLP_ name in src/, python/, tools/, tests/ and include/ is a knob of the table, a name
   the public headers or the sources define (enumerators, macros), a CMake variable, option or
   compile definition, or one of ALLOWED; an FMLP_ name that is none of those is an environment
   variable missing from the table (or a dead one still mentioned).
3. Every row of the table is read where its scope says: Knob::NAME in src/ (cuda, dist),
   knob("NAME") in python/fusedmlp (python), fmlp_knob_find("NAME") in tools/ (cli),
   knob_value("NAME") in tests/ (test). A row that nothing reads is a dead knob.

    python3 tests/check_knobs.py [ROOT]
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else
                    pathlib.Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(ROOT / "scripts"))
from gen_tuning_doc import KNOBS_DEF, parse_knobs  # noqa: E402

CODE = {".c", ".h", ".cpp", ".hpp", ".cu", ".cuh", ".py", ".pyi"}
C_LIKE = {".c", ".h", ".cpp", ".hpp", ".cu", ".cuh"}
DIRS = ["src", "python", "tools", "tests", "include"]
GETENV_ALLOWED = {"src/core/knobs.cpp", "tests/test_knobs.cpp"}
# FMLP_ names that are neither knobs nor defined anywhere, on purpose.
ALLOWED = {
    "FMLP_NO_SUCH_KNOB",  # tests/test_knobs.cpp: the name fmlp_knob_find does not know
}
# Where each scope's knobs must be read, and how.
READS = {
    "cuda": ("src", r"Knob::{}\b"),
    "dist": ("src", r"Knob::{}\b"),
    "python": ("python/fusedmlp", r"""knob\(\s*["']{}["']"""),
    "cli": ("tools", r"""fmlp_knob_find\(\s*"{}"\s*\)"""),
    "test": ("tests", r"""knob_value\(\s*"{}"\s*\)"""),
}
NAME = re.compile(r"(?<![#\w])FMLP_[A-Z0-9_]*[A-Z0-9](?![\w#])")


def sources():
    for d in DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in CODE and "__pycache__" not in p.parts:
                yield p.relative_to(ROOT).as_posix(), p.read_text(errors="replace")


def cmake_names():
    """FMLP_ names of the CMake files, less those they set in a test's environment."""
    names = set()
    for p in [*ROOT.glob("CMakeLists.txt"), *ROOT.glob("cmake/*"),
              *[q for d in DIRS for q in (ROOT / d).rglob("CMakeLists.txt")],
              ROOT / "pyproject.toml"]:
        text = p.read_text()
        env = set()
        for line in text.splitlines():
            if "ENVIRONMENT" in line or "fmlp_env_test(" in line:
                env |= set(re.findall(r"(FMLP_\w+)=", line))
        env |= set(re.findall(r"\$ENV\{(FMLP_\w+)\}", text))
        names |= set(NAME.findall(text)) - env
    return names


def main():
    rows = parse_knobs(ROOT / KNOBS_DEF)
    knobs = {r["name"]: r for r in rows}
    problems = []
    if len(knobs) != len(rows):
        problems.append(f"{KNOBS_DEF}: a knob is listed twice")

    files = dict(sources())
    defined = set()
    for rel, text in files.items():
        defined |= set(re.findall(r"#\s*define\s+(FMLP_\w+)", text))
        if rel.startswith("include/"):  # enumerators of the public headers
            defined |= set(re.findall(r"^\s*(FMLP_\w+)\s*(?:=|,)", text, re.M))
    defined |= cmake_names()

    for rel, text in files.items():
        suffix = pathlib.PurePath(rel).suffix
        # 1. raw reads
        if suffix in C_LIKE and rel not in GETENV_ALLOWED:
            for m in re.finditer(r"\bgetenv\s*\(", text):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}:{line}: getenv outside src/core/knobs.cpp; read the "
                                "variable as a knob (core/knobs.hpp, or fmlp_knob_info outside "
                                "the library)")
        if suffix == ".py":
            for m in re.finditer(r"""os\.(?:environ(?:\.get)?\s*[\[(]|getenv\s*\()\s*["']"""
                                 r"""(FMLP_\w+)""", text):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}:{line}: {m.group(1)} read through os.environ; read it "
                                "through fusedmlp.knob() / _ext.knob() (the registry)")
        # 2. names
        for m in NAME.finditer(text):
            name = m.group(0)
            if name in knobs or name in defined or name in ALLOWED:
                continue
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"{rel}:{line}: {name} is not in {KNOBS_DEF} (an environment "
                            "variable must be a row there; a dead one is removed)")

    # 3. every row read where its scope says
    for r in rows:
        if r["scope"] not in READS:
            problems.append(f"{KNOBS_DEF}: {r['name']}: unknown scope {r['scope']!r}")
            continue
        where, pattern = READS[r["scope"]]
        pat = re.compile(pattern.format(re.escape(r["name"])))
        if not any(rel.startswith(where + "/") and pat.search(text)
                   for rel, text in files.items()):
            problems.append(f"{KNOBS_DEF}: {r['name']} (scope {r['scope']}) is read nowhere in "
                            f"{where}/ (expected {pattern.format(r['name'])}): a dead knob")

    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s)")
        return 1
    print(f"{len(rows)} knobs: each read through the registry, no FMLP_ variable outside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
