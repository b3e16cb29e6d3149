#!/usr/bin/env python3
"""Generates docs/tuning.md: every FMLP_* environment knob (src/core/knobs.def), the CMake build
options (CMakeLists.txt, tools/ and python/), and the variables the build scripts read.

    python3 scripts/gen_tuning_doc.py            # rewrites docs/tuning.md
    python3 scripts/gen_tuning_doc.py --check    # exits 1 when docs/tuning.md is out of date

The ctest `tuning_doc` runs --check, so a change to the table or to the options fails the suite
until the page is regenerated. Standard library only. parse_knobs() is shared with
tests/check_knobs.py.
"""

import argparse
import difflib
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
KNOBS_DEF = "src/core/knobs.def"
CMAKE_FILES = ["CMakeLists.txt", "tools/CMakeLists.txt", "python/CMakeLists.txt"]
SCRIPTS = ["scripts/setup.sh", "scripts/test.sh"]
OUT = "docs/tuning.md"

SCOPES = [
    ("cuda", "CUDA backend", "Read by the CUDA kernels' planners and launchers (src/cuda)."),
    ("dist", "Tensor parallelism (NCCL)",
     "Read by the multi-GPU ops of include/fusedmlp/fusedmlp_nccl.h (src/dist)."),
    ("python", "Python package", "Read by the fusedmlp package (python/fusedmlp), through the "
     "library's fmlp_knob_info, so it is validated like the others."),
    ("cli", "Command-line tool", "Read by the fusedmlp tool (tools/)."),
    ("test", "Test suite", "Read by the GoogleTest suite (tests/)."),
]
KINDS = {"kBool": "bool", "kInt": "int", "kFloat": "float", "kString": "string"}

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|//[^\n]*|/\*.*?\*/|[A-Za-z_][A-Za-z0-9_]*|\S', re.S)


def _unquote(literal):
    return re.sub(r'\\(.)', r'\1', literal[1:-1])


def parse_knobs(path=None):
    """The rows of knobs.def as dicts (name, kind, default, range, scope, purpose), in order."""
    text = pathlib.Path(path or ROOT / KNOBS_DEF).read_text()
    tokens = [t for t in _TOKEN.findall(text) if not t.startswith(("//", "/*"))]
    rows, i = [], 0
    while i < len(tokens):
        if tokens[i] != "FMLP_KNOB" or i + 1 >= len(tokens) or tokens[i + 1] != "(":
            i += 1
            continue
        i += 2
        args, cur, depth = [], [], 0
        while depth > 0 or tokens[i] != ")":
            t = tokens[i]
            depth += t == "("
            depth -= t == ")"
            if t == "," and depth == 0:
                args.append(cur)
                cur = []
            else:
                cur.append(t)
            i += 1
        args.append(cur)
        i += 1

        def text_of(arg):  # adjacent string literals concatenate, as in C
            if not all(t.startswith('"') for t in arg):
                raise ValueError(f"{KNOBS_DEF}: expected string literals, got {' '.join(arg)}")
            return "".join(_unquote(t) for t in arg)

        if len(args) != 6 or len(args[0]) != 1 or len(args[1]) != 1:
            raise ValueError(f"{KNOBS_DEF}: FMLP_KNOB takes 6 arguments: {args}")
        if args[1][0] not in KINDS:
            raise ValueError(f"{KNOBS_DEF}: {args[0][0]}: unknown kind {args[1][0]}")
        rows.append(dict(name=args[0][0], kind=KINDS[args[1][0]], default=text_of(args[2]),
                         range=text_of(args[3]), scope=text_of(args[4]),
                         purpose=text_of(args[5])))
    return rows


_CMAKE_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|#[^\n]*|\(|\)|[^\s()"#]+')


def _cmake_commands(text):
    """(command, [arguments]) of a CMake file; quoted arguments keep their quotes."""
    tokens = [t for t in _CMAKE_TOKEN.findall(text) if not t.startswith("#")]
    i = 0
    while i + 1 < len(tokens):
        if tokens[i + 1] == "(" and re.fullmatch(r"[A-Za-z_]\w*", tokens[i]):
            name, i, depth, args = tokens[i].lower(), i + 2, 1, []
            while i < len(tokens) and depth:
                depth += tokens[i] == "("
                depth -= tokens[i] == ")"
                if depth:
                    args.append(tokens[i])
                i += 1
            yield name, args
        else:
            i += 1


def _arg(a):
    return _unquote(a) if a.startswith('"') else a


def parse_build_options():
    """The cache options (option() and set(... CACHE ...)) of the CMake files, in order."""
    options, choices = [], {}
    for rel in CMAKE_FILES:
        for cmd, args in _cmake_commands((ROOT / rel).read_text()):
            if cmd == "option" and len(args) >= 2:
                options.append(dict(name=args[0], type="BOOL",
                                    default=_arg(args[2]) if len(args) > 2 else "OFF",
                                    doc=_arg(args[1]), file=rel))
            elif cmd == "set" and "CACHE" in args:
                at = args.index("CACHE")
                options.append(dict(name=args[0], type=args[at + 1],
                                    default=" ".join(_arg(a) for a in args[1:at]),
                                    doc=_arg(args[at + 2]) if len(args) > at + 2 else "",
                                    file=rel))
            elif cmd == "set_property" and "STRINGS" in args and "CACHE" in args:
                name = args[args.index("CACHE") + 1]
                choices[name] = [_arg(a) for a in args[args.index("STRINGS") + 1:]]
    # CMake's own variables given a default here (CMAKE_BUILD_TYPE) are not options of ours.
    options = [o for o in options if not o["name"].startswith("CMAKE_")]
    for o in options:
        o["choices"] = choices.get(o["name"], ["ON", "OFF"] if o["type"] == "BOOL" else [])
    return options


def parse_script_variables():
    """FMLP_* variables the build scripts read, as ${NAME:-default}: name -> (default, files)."""
    found = {}
    for rel in SCRIPTS:
        for name, default in re.findall(r"\$\{(FMLP_\w+)(?::-([^}]*))?\}",
                                        (ROOT / rel).read_text()):
            d, files = found.setdefault(name, [default, []])
            if rel not in files:
                files.append(rel)
    return found


def _cell(text):
    return text.replace("|", "\\|")


def _code(text):
    return f"`{_cell(text)}`" if text else ""


def render():
    knobs, options, script_vars = parse_knobs(), parse_build_options(), parse_script_variables()
    out = [
        "<!-- Generated by scripts/gen_tuning_doc.py from src/core/knobs.def and the CMake files;",
        "     do not edit by hand: change those and run python3 scripts/gen_tuning_doc.py",
        "     (the ctest tuning_doc fails while this page is out of date). -->",
        "# Tuning knobs and build options",
        "",
        "## Environment knobs",
        "",
        "Every `FMLP_*` environment variable that fusedmlp reads is a row of one table,",
        "`src/core/knobs.def`; this page, `fusedmlp info` (values now; `fusedmlp info --knobs` with",
        "what each accepts), `fusedmlp.knobs()` in Python and the C ABI (`fmlp_knob_count`,",
        "`fmlp_knob_info`, `fmlp_knob_find` in `include/fusedmlp/fusedmlp.h`) all come from it.",
        "",
        "- The knobs are for measurements and A/B runs: every default is the measured choice, and",
        "  a run without any of them set is the configuration the benchmarks report.",
        "- A knob is read once, at its first use in the process, unless its purpose says",
        "  otherwise: set it before the first call.",
        "- `auto` as the default means the code decides per call (the rule next to the read site",
        "  says how and where it was measured); setting the knob forces one value.",
        "- Accepts: `lo..hi` is an inclusive range, `a|b` a list of values, an empty cell any",
        "  text. bool knobs take `0` or `1`, numbers are decimal. A value outside that is ignored",
        "  with one line on stderr naming the variable, what it accepts and what came",
        "  (`fusedmlp: FMLP_STREAM_U=7 ignored: expected one of 3, 4; the default (auto)",
        "  applies`), and the default applies.",
        "",
    ]
    for scope, title, about in SCOPES:
        rows = [k for k in knobs if k["scope"] == scope]
        if not rows:
            continue
        out += [f"### {title}", "", about, "",
                "| Variable | Kind | Default | Accepts | Purpose |",
                "| --- | --- | --- | --- | --- |"]
        for k in rows:
            out.append(f"| `{k['name']}` | {k['kind']} | {_code(k['default']) or 'unset'} | "
                       f"{_code(k['range'])} | {_cell(k['purpose'])} |")
        out.append("")
    unknown = sorted({k["scope"] for k in knobs} - {s for s, _, _ in SCOPES})
    if unknown:
        raise ValueError(f"{KNOBS_DEF}: unknown scopes {unknown}")
    out += [
        "## Build options",
        "",
        "CMake cache options (`-DNAME=VALUE`), from " +
        ", ".join(f"`{f}`" for f in CMAKE_FILES) + ".",
        "pyproject.toml sets `FMLP_BUILD_PYTHON=ON`, `FMLP_BUILD_TESTS=OFF`, `FMLP_BUILD_CLI=OFF`",
        "and `FMLP_BUILD_SHARED=OFF` for the wheel; pass others through `CMAKE_ARGS` (e.g.",
        "`CMAKE_ARGS=-DFMLP_CUDA=OFF pip install .`).",
        "",
        "| Option | Default | Choices | Purpose | Defined in |",
        "| --- | --- | --- | --- | --- |",
    ]
    for o in options:
        choices = ", ".join(f"`{_cell(c)}`" for c in o["choices"])
        default = _code(o["default"]) if o["default"] else "empty"
        out.append(f"| `{o['name']}` | {default} | {choices} | {_cell(o['doc'])} | "
                   f"`{o['file']}` |")
    out += [
        "",
        "## Build script variables",
        "",
        "Read by the scripts (as `${NAME:-default}`), besides `BUILD_DIR` and `JOBS`: they pass",
        "through to CMake.",
        "",
        "| Variable | Default | Read by |",
        "| --- | --- | --- |",
    ]
    for name, (default, files) in sorted(script_vars.items()):
        out.append(f"| `{name}` | {_code(default) or 'empty'} | "
                   f"{', '.join(f'`{f}`' for f in files)} |")
    out.append("")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 when {OUT} differs from what this script generates")
    ap.add_argument("--out", default=str(ROOT / OUT), help=f"where to write (default {OUT})")
    a = ap.parse_args()
    text = render()
    path = pathlib.Path(a.out)
    if a.check:
        have = path.read_text() if path.exists() else ""
        if have != text:
            diff = difflib.unified_diff(have.splitlines(), text.splitlines(), str(path),
                                        "generated", lineterm="")
            print("\n".join(list(diff)[:60]))
            print(f"{path} is out of date: run python3 scripts/gen_tuning_doc.py")
            return 1
        print(f"{path} is up to date ({len(parse_knobs())} knobs)")
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
