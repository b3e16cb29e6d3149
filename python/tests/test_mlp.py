"""fusedmlp.mlp against a float64 numpy reference, plus the Python-side error contract.

Tolerance: |y - ref| <= rtol * (|ref| + rms(ref row)), rtol per output dtype below; the rms term
keeps outputs that cancel to ~0 from demanding an impossible relative accuracy.
"""

import math
import zlib

import numpy as np
import pytest

import fusedmlp

RTOL = {np.float32: 1e-4, np.float16: 2.0**-9}

_erf = np.frompyfunc(math.erf, 1, 1)


def act_ref(name, v):
    if name == "relu":
        return np.maximum(v, 0.0)
    if name == "gelu":
        return 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)).astype(np.float64))
    if name == "gelu_tanh":
        return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))
    if name == "relu2":
        return np.maximum(v, 0.0) ** 2
    assert name == "silu"
    return v / (1.0 + np.exp(-v))


def f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def mlp_ref(x, w1, w2, *, b1=None, w_up=None, b_up=None, b2=None, residual=None,
            norm_weight=None, norm_bias=None, activation="gelu", gated=False, norm=None,
            eps=1e-5):
    x, w1, w2 = f64(x), f64(w1), f64(w2)
    eps = float(np.float32(eps))  # the C ABI carries eps as float
    if norm == "layernorm":
        x = x - x.mean(axis=1, keepdims=True)
    if norm is not None:
        x = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
        if norm_weight is not None:
            x = x * f64(norm_weight)
        if norm_bias is not None:
            x = x + f64(norm_bias)
    g = x @ w1.T + (0.0 if b1 is None else f64(b1))
    if not gated:
        h = act_ref(activation, g)
    else:
        if w_up is None:
            hidden = w1.shape[0] // 2
            g, u = g[:, :hidden], g[:, hidden:]
        else:
            u = x @ f64(w_up).T + (0.0 if b_up is None else f64(b_up))
        h = act_ref(activation, g) * u
    y = h @ w2.T + (0.0 if b2 is None else f64(b2))
    return y if residual is None else y + f64(residual)


def assert_close(y, ref, rtol=None):
    assert y.shape == ref.shape
    rtol = rtol or RTOL[y.dtype.type]
    rms = np.sqrt((ref * ref).mean(axis=1, keepdims=True))
    err = np.abs(y.astype(np.float64) - ref)
    bound = rtol * (np.abs(ref) + rms)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (
        f"at {worst}: got {y[worst]}, ref {ref[worst]}, "
        f"|err| {err[worst]:.3g} > {bound[worst]:.3g}")


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def make_case(rng, dtype, m, d_in, hidden, d_out, variant):
    """Arguments of one call; weights scaled so activations stay O(1)."""
    x = rand(rng, (m, d_in), dtype)
    w1_rows = 2 * hidden if variant == "gated_stacked" else hidden
    kw = dict(w1=rand(rng, (w1_rows, d_in), dtype, d_in**-0.5),
              w2=rand(rng, (d_out, hidden), dtype, hidden**-0.5),
              b1=rand(rng, (w1_rows,), dtype, 0.1), b2=rand(rng, (d_out,), dtype, 0.1))
    if variant == "gated_stacked":
        kw["gated"] = True
    elif variant == "gated_separate":
        kw.update(gated=True, w_up=rand(rng, (hidden, d_in), dtype, d_in**-0.5),
                  b_up=rand(rng, (hidden,), dtype, 0.1))
    elif variant == "layernorm":
        x = x * 3 + 1  # an offset and scale the norm must remove
        kw.update(norm="layernorm", norm_weight=rand(rng, (d_in,), np.float32) + 1,
                  norm_bias=rand(rng, (d_in,), np.float32, 0.1))
    elif variant == "rmsnorm":
        x = x * 3
        kw.update(norm="rmsnorm", norm_weight=rand(rng, (d_in,), dtype) + 1)
    elif variant == "residual":
        kw["residual"] = rand(rng, (m, d_out), dtype)
    elif variant == "strided_rows":
        # Row stride > cols for x and for w1 (a column slice of a wider matrix).
        x = np.ascontiguousarray(np.repeat(x, 2, axis=0))[::2]
        wide = rand(rng, (w1_rows, d_in + 5), dtype, d_in**-0.5)
        kw["w1"] = wide[:, :d_in]
    return x.astype(dtype, copy=False), kw


VARIANTS = ["dense", "gated_stacked", "gated_separate", "layernorm", "rmsnorm", "residual",
            "strided_rows"]
SIZES = [(7, 13, 7), (7, 13, 11), (64, 96, 64)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "relu2"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference(dtype, m, size, activation, variant):
    rng = np.random.default_rng(zlib.crc32(repr((m, size, activation, variant)).encode()))
    x, kw = make_case(rng, dtype, m, *size, variant)
    y = fusedmlp.mlp(x, activation=activation, **kw)
    assert y.dtype == dtype and y.shape == (m, size[2])
    assert_close(y, mlp_ref(x, activation=activation, **kw))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("backend", ["auto", "cpu", "ref"])
def test_backends_and_out_buffers(dtype, backend):
    ok, why = fusedmlp.available(backend)
    if not ok:
        pytest.skip(why)
    rng = np.random.default_rng(7)
    x, kw = make_case(rng, dtype, 17, 64, 96, 64, "gated_separate")
    residual = rand(rng, (17, 64), dtype)
    ref = mlp_ref(x, residual=residual, activation="silu", **kw)

    out = np.full((17, 64), np.nan, dtype=dtype)  # separate x-sized output buffer
    y = fusedmlp.mlp(x, residual=residual, activation="silu", out=out, backend=backend, **kw)
    assert y is out
    assert_close(out, ref)

    inplace = residual.copy()  # out is residual: in-place residual add
    fusedmlp.mlp(x, residual=inplace, activation="silu", out=inplace, backend=backend, **kw)
    assert_close(inplace, ref)

    strided = np.full((34, 64), np.nan, dtype=dtype)
    fusedmlp.mlp(x, residual=residual, activation="silu", out=strided[::2], backend=backend, **kw)
    assert_close(strided[::2], ref)
    assert np.isnan(strided[1::2]).all(), "rows between the strided output rows were written"


def test_bfloat16_from_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    x, kw = make_case(np.random.default_rng(5), np.float32, 17, 64, 96, 64, "gated_separate")
    x = x.astype(bf16)
    kw = {k: v.astype(bf16) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    residual = rand(np.random.default_rng(6), (17, 64), np.float32).astype(bf16)
    ref = mlp_ref(x, residual=residual, activation="silu", **kw)
    y = fusedmlp.mlp(x, residual=residual, activation="silu", **kw)
    assert y.dtype == bf16
    assert_close(y, ref, rtol=2.0**-6)  # bf16 keeps 8 significant bits
    out = np.zeros((17, 64), bf16)
    mixed = {**kw, "b1": kw["b1"].astype(np.float32), "b2": kw["b2"].astype(np.float16)}
    fusedmlp.mlp(x, residual=residual, activation="silu", out=out, **mixed)  # biases of any dtype
    assert_close(out, ref, rtol=2.0**-6)


def test_zero_rows():
    rng = np.random.default_rng(1)
    x, kw = make_case(rng, np.float32, 1, 7, 13, 7, "dense")
    y = fusedmlp.mlp(x[:0], **kw)
    assert y.shape == (0, 7)


def test_deterministic_reruns_are_bitwise_equal():
    rng = np.random.default_rng(2)
    x, kw = make_case(rng, np.float32, 17, 64, 96, 64, "gated_stacked")
    a = fusedmlp.mlp(x, deterministic=True, **kw)
    b = fusedmlp.mlp(x, deterministic=True, **kw)
    assert np.array_equal(a, b)


def test_explain_info_and_kernels():
    rng = np.random.default_rng(3)
    x, kw = make_case(rng, np.float32, 3, 64, 96, 64, "dense")
    report = fusedmlp.explain(x, **kw)
    names = [name for name, _ in fusedmlp.kernels()]
    assert isinstance(report, str) and any(name in report for name in names)
    assert "mlp_ref_scalar_fp64" in names
    assert {backend for _, backend in fusedmlp.kernels()} <= {"ref", "cpu", "cuda"}
    assert fusedmlp.available("ref") == (True, "")
    assert fusedmlp.build_info().startswith("fusedmlp ")
    assert fusedmlp.__version__ in fusedmlp.build_info()


def small_case():
    return make_case(np.random.default_rng(4), np.float32, 3, 7, 13, 7, "dense")


def test_w2_shape_mismatch_names_w2():
    x, kw = small_case()
    kw["w2"] = np.zeros((7, 14), np.float32)
    with pytest.raises(ValueError, match="w2"):
        fusedmlp.mlp(x, **kw)


def test_out_shape_mismatch_raises():
    x, kw = small_case()
    with pytest.raises(ValueError, match="y|out"):
        fusedmlp.mlp(x, out=np.zeros((3, 8), np.float32), **kw)


def test_wrong_dtype_names_argument():
    x, kw = small_case()
    with pytest.raises(ValueError, match="x has dtype float64"):
        fusedmlp.mlp(x.astype(np.float64), **kw)
    kw["b1"] = kw["b1"].astype(np.int32)
    with pytest.raises(ValueError, match="b1 has dtype int32"):
        fusedmlp.mlp(x, **kw)


def test_non_array_and_read_only_out():
    x, kw = small_case()
    with pytest.raises(ValueError, match="w1 is a list"):
        fusedmlp.mlp(x, **{**kw, "w1": kw["w1"].tolist()})
    read_only = {k: v.copy() for k, v in kw.items()}
    for v in read_only.values():
        v.flags.writeable = False  # inputs may be read-only, out may not
    assert_close(fusedmlp.mlp(x, **read_only), mlp_ref(x, **kw))
    out = np.zeros((3, 7), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        fusedmlp.mlp(x, out=out, **kw)


def test_bad_strings_and_eps():
    x, kw = small_case()
    with pytest.raises(ValueError, match="activation"):
        fusedmlp.mlp(x, activation="tanh", **kw)
    with pytest.raises(ValueError, match="norm"):
        fusedmlp.mlp(x, norm="batchnorm", **kw)
    with pytest.raises(ValueError, match="backend"):
        fusedmlp.available("tpu")
    with pytest.raises(ValueError, match="eps"):
        fusedmlp.mlp(x, norm="rmsnorm", eps=0.0, **kw)


def test_host_tensors_with_cuda_backend_raise_value_error():
    x, kw = small_case()
    with pytest.raises(ValueError, match="backend cuda needs CUDA device memory"):
        fusedmlp.mlp(x, backend="cuda", **kw)
