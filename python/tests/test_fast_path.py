"""The C++ kernels of the torch ops (fusedmlp._torch_ops, built against the installed torch)
against the Python custom ops they stand in for (FMLP_TORCH_OPS=python, in a subprocess): the
same results on the layouts the C++ side handles without ATen (leading dims folded into one row
stride) and on those it copies, the same errors (type and message) for bad input, inputs left
untouched by a failing call, the pack registry, backward refused, concurrent calls, and
call_cost. Tolerance: the two implementations run the same library kernels on the same memory,
so results must agree bitwise; against float64 references as in test_torch.py."""

import importlib.util
import json
import os
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed; fusedmlp.torch needs it")

import fusedmlp  # noqa: E402
import fusedmlp.torch as ft  # noqa: E402
from test_torch import assert_close, mlp_ref, weights  # noqa: E402

BUILT = importlib.util.find_spec("fusedmlp._torch_ops_build") is not None
FORCED_PYTHON = fusedmlp.knob("FMLP_TORCH_OPS") == "python"


def test_cpp_ops_are_used_where_built():
    if not BUILT:
        pytest.skip("fusedmlp._torch_ops is not built here (no torch at build time)")
    if FORCED_PYTHON:
        assert ft.ops_implementation() == "python: FMLP_TORCH_OPS=python"
    else:
        assert ft.ops_implementation() == "c++", ft.ops_implementation()


def test_cpp_ops_refused_under_another_torch(monkeypatch):
    if not BUILT:
        pytest.skip("fusedmlp._torch_ops is not built here (no torch at build time)")
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    monkeypatch.delenv("FMLP_TORCH_OPS", raising=False)
    with pytest.warns(UserWarning, match="built against torch .*this is torch 0.0.1"):
        module, why = ft._load_cpp_ops()
    assert module is None and "reinstall fusedmlp" in why


def _moe_weights(g):
    return (torch.randn(8, 96, 32, generator=g) / 6, torch.randn(8, 32, 48, generator=g) / 7,
            torch.randn(8, 32, generator=g))


def error_cases():
    """name -> (call, inputs that must be unchanged after it fails)."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(48, 32, generator=g), torch.randn(32, 48, generator=g)
    x, r = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    packed = ft.FusedMLP(w1, w2, activation="silu")
    e1, e2, router = _moe_weights(g)
    ids8 = torch.full((4, 2), 8)
    cases = {
        "linear_f64_x": (lambda: ft.linear(x.double(), w1), ()),
        "linear_k": (lambda: ft.linear(torch.randn(4, 31), w1), ()),
        "linear_bias_shape": (lambda: ft.linear(x, w1, torch.randn(47)), (x,)),
        "linear_int_w": (lambda: ft.linear(x, w1.long()), (x,)),
        "linear_0d_x": (lambda: ft.linear(torch.tensor(1.0), w1), ()),
        "linear_0d_w": (lambda: ft.linear(x, torch.tensor(1.0)), (x,)),
        "linear_5d_w": (lambda: ft.linear(x, w1.reshape(1, 1, 1, 1, 48, 32)), (x,)),
        "mlp_activation": (lambda: ft.mlp(x, w1, w2, activation="tanh"), (x,)),
        "mlp_norm": (lambda: ft.mlp(x, w1, w2, norm="batchnorm"), (x,)),
        "mlp_residual_shape": (lambda: ft.mlp(x, w1, w2, residual=torch.randn(4, 31)), (x,)),
        "mlp_w2_0d": (lambda: ft.mlp(x, w1, torch.tensor(1.0)), (x,)),
        "packed_x": (lambda: packed(torch.randn(4, 31)), ()),
        "packed_residual_dtype": (lambda: packed(x, r.bfloat16()), (x,)),
        "packed_residual_shape": (lambda: packed(x, r[:3]), (x, r)),
        "packed_freed": (lambda: torch.ops.fusedmlp.mlp_packed(x, r, 10**9, 32), (x, r)),
        "moe_scoring": (lambda: ft.moe(x, e1, e2, router_w=router, top_k=2, scoring="relu"),
                        (x,)),
        "moe_backend": (lambda: ft.moe(x, e1, e2, router_w=router, top_k=2, backend="gpu"),
                        (x,)),
        "moe_w2_2d": (lambda: ft.moe(x, e1, e2[0], router_w=router, top_k=2), (x,)),
        "moe_ids_float": (lambda: ft.moe(x, e1, e2, topk_ids=torch.zeros(4, 2),
                                         topk_weights=torch.rand(4, 2), top_k=2), (x,)),
        "moe_ids_int32_overflow": (lambda: ft.moe(x, e1, e2, topk_ids=torch.full((4, 2), 2**40),
                                                  topk_weights=torch.rand(4, 2), top_k=2), (x,)),
        "moe_ids_range": (lambda: ft.moe(x, e1, e2, topk_ids=ids8, topk_weights=torch.rand(4, 2),
                                         top_k=2, residual=r), (x, r, ids8)),
        "moe_ids_shape": (lambda: ft.moe(x, e1, e2, topk_ids=torch.zeros(4, 3, dtype=torch.int),
                                         topk_weights=torch.rand(4, 2), top_k=2), (x,)),
        "moe_weights_int": (lambda: ft.moe(x, e1, e2, topk_ids=torch.zeros(4, 2, dtype=torch.int),
                                           topk_weights=torch.ones(4, 2, dtype=torch.long),
                                           top_k=2), (x,)),
        "softmax_temperature": (lambda: ft.softmax(x, 0.0), (x,)),
        "softmax_f64": (lambda: ft.softmax(x.double()), ()),
    }
    return cases


def raised(cases):
    """name -> [exception type, message] of each case (None where it did not raise)."""
    out = {}
    for name, (call, _) in cases.items():
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 (compared below)
            out[name] = [type(e).__name__, str(e)]
    return out


@pytest.fixture(scope="module")
def python_ops_errors():
    """raised(error_cases()) under the Python custom ops, in a fresh process."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json, test_fast_path as t; "
            "print('RESULT' + json.dumps(t.raised(t.error_cases())))")
    env = dict(os.environ, FMLP_TORCH_OPS="python",
               PYTHONPATH=os.pathsep.join([here] + sys.path))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, cwd=here)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(s for s in run.stdout.splitlines() if s.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_errors_as_the_python_ops_give_them(python_ops_errors):
    cases = error_cases()
    got = raised(cases)
    for name, err in got.items():
        assert err is not None, f"{name}: no error"
        assert err[0] in ("ValueError", "NotImplementedError"), (name, err)
        assert err == python_ops_errors[name], (name, err, python_ops_errors[name])


def test_failing_calls_leave_inputs_untouched():
    cases = error_cases()
    for name, (call, inputs) in cases.items():
        before = [t.clone() for t in inputs]
        with pytest.raises((ValueError, NotImplementedError)):
            call()
        for t, b in zip(inputs, before):
            assert torch.equal(t, b), f"{name} wrote an input"


def layouts(k):
    """x layouts: folded into [rows, k] without a copy, and copied ones."""
    return {"1d": torch.randn(k), "3d": torch.randn(2, 3, k), "6d": torch.randn(1, 2, 1, 3, 2, k),
            "rows_strided": torch.randn(5, 2 * k)[:, :k], "leading_1": torch.randn(1, 1, k),
            "inner_strided": torch.randn(2, 3, 2 * k)[..., ::2],
            "unfoldable": torch.randn(4, k, 3).transpose(1, 2).transpose(0, 1),
            "expanded_rows": torch.randn(1, 3, k).expand(2, 3, k), "empty": torch.randn(0, 3, k)}


@pytest.mark.parametrize("layout", list(layouts(8)))
def test_layouts_match_references(layout):
    g = torch.Generator().manual_seed(1)
    x = layouts(32)[layout]
    w = torch.randn(40, 32, generator=g) / 6
    b = torch.randn(40, generator=g)
    y = ft.linear(x, w, b)
    assert y.shape == (*x.shape[:-1], 40) and y.is_contiguous()
    if x.numel():
        assert_close(y, x.double() @ w.double().T + b.double())
    kw = weights(gated=True)
    m = ft.FusedMLP(**kw, activation="silu")
    r = torch.randn(*x.shape[:-1], 32)
    y = m(x, r)
    assert y.shape == (*x.shape[:-1], 32)
    if x.numel():
        ref = mlp_ref(x.reshape(-1, 32), residual=r.reshape(-1, 32), activation="silu", **kw)
        assert_close(y.reshape(-1, 32), ref)
        assert_close(ft.softmax(x, 0.7), torch.softmax(x.double() / 0.7, -1))


def test_pack_lives_while_a_module_holds_it():
    import gc
    m = ft.FusedMLP(**weights(), activation="gelu")
    handle, x = m._handle, torch.randn(2, 32)
    assert handle == m._pack.ext.handle
    y = torch.ops.fusedmlp.mlp_packed(x, None, handle, 32)
    torch.testing.assert_close(y, m(x), rtol=0, atol=0)
    m.repack()  # a new pack, a new handle; the old one is freed
    assert m._handle != handle
    gc.collect()
    with pytest.raises(ValueError, match=f"handle {handle} names no live packed mlp"):
        torch.ops.fusedmlp.mlp_packed(x, None, handle, 32)
    torch.testing.assert_close(m(x), y, rtol=0, atol=0)


def test_backward_through_an_op_raises():
    w = torch.randn(8, 16, requires_grad=True)
    y = ft.linear(torch.randn(2, 16), w)
    assert y.requires_grad
    with pytest.raises(RuntimeError):
        y.sum().backward()
    with torch.no_grad():
        assert not ft.linear(torch.randn(2, 16), w).requires_grad


def test_concurrent_calls_agree():
    kw = weights(64, 96, 64, gated=True)
    mods = [ft.FusedMLP(**kw, activation="silu") for _ in range(2)]
    xs = [torch.randn(3, 64) for _ in range(4)]
    refs = [mods[0](x) for x in xs]
    errors = []

    def work(i):
        try:
            for _ in range(50):
                torch.testing.assert_close(mods[i % 2](xs[i]), refs[i], rtol=0, atol=0)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_call_cost():
    lin = torch.nn.Linear(32, 32)
    fused = ft.FusedLinear.from_module(lin)
    x = torch.randn(1, 1, 32)
    for fn in (lin, fused, lambda t: fused(t) + 1):
        cost = ft.call_cost(fn, x, calls=5, rounds=3, graph=True)
        assert 0 < cost.host_us < 1e6 and 0 < cost.wall_us < 1e6, cost
        assert cost.device_us == cost.wall_us  # host backend: the arithmetic is host time
        assert cost.step_us("eager") == cost.step_us("graph") == cost.wall_us
    with pytest.raises(ValueError, match="mode"):
        cost.step_us("compiled")
