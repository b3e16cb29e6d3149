"""fusedmlp/_ext.pyi against the built extension: the same functions, classes, members and
parameter names (nanobind's __nb_signature__ of each), and the stub shipped in the installed
package (with py.typed, so type checkers read it)."""

import ast
import pathlib
import re

import fusedmlp
import fusedmlp._ext as ext

PACKAGE = pathlib.Path(fusedmlp.__file__).parent
STUB = PACKAGE / "_ext.pyi"


def _stub_tree():
    assert STUB.exists(), f"{STUB} is not installed with the package (pyproject wheel rules)"
    return ast.parse(STUB.read_text())


def _params(fn):
    """Parameter names of a def, positional-only marker '/' and '*' included."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs] + (["/"] if a.posonlyargs else [])
    names += [p.arg for p in a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        names.append("*")
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def _stub_defs(body):
    """name -> parameter names of the defs in a stub body (overloads must agree)."""
    out = {}
    for node in body:
        if isinstance(node, ast.FunctionDef):
            params = _params(node)
            assert out.setdefault(node.name, params) == params, (
                f"the overloads of {node.name} take different parameters")
    return out


def _runtime_params(obj):
    sig = obj.__nb_signature__[0][0]  # a default shows as \0, \1 ...
    return _params(ast.parse(re.sub(r"\\\d+", "None", sig) + ": ...").body[0])


def _public(names):
    return {n for n in names if not n.startswith("__")}


def test_stub_names_match_the_extension():
    tree = _stub_tree()
    functions = _stub_defs(tree.body)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    variables = {t.id for n in tree.body if isinstance(n, (ast.AnnAssign, ast.Assign))
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                 if not t.id.startswith("_Workspace")}
    stub = set(functions) | set(classes) | variables
    runtime = _public(dir(ext))
    assert stub == runtime, (f"in the stub only: {sorted(stub - runtime)}; in the extension "
                             f"only: {sorted(runtime - stub)}")
    for name, params in functions.items():
        assert params == _runtime_params(getattr(ext, name)), name


def test_stub_classes_match_the_extension():
    tree = _stub_tree()
    for node in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        cls = getattr(ext, node.name)
        defs = _stub_defs(node.body)
        runtime = {n for n in vars(cls) if not n.startswith("_")} | {"__init__"}
        assert set(defs) == runtime, (f"{node.name}: stub {sorted(defs)}, extension "
                                      f"{sorted(runtime)}")
        for name, params in defs.items():
            member = vars(cls)[name]
            if isinstance(member, property):
                assert params == ["self"], f"{node.name}.{name}"
            else:
                assert params == _runtime_params(member), f"{node.name}.{name}"


def test_package_is_typed():
    assert (PACKAGE / "py.typed").exists()
