"""numpy (host) tests of pack, linear, softmax, quantize_fp8 and the info calls, against float64
numpy references. Tolerances as in test_mlp.py: |y - ref| <= rtol * (|ref| + rms(ref row))."""

import numpy as np
import pytest

import fusedmlp
from test_mlp import assert_close, make_case, mlp_ref, rand


@pytest.mark.parametrize("variant", ["dense", "gated_stacked", "gated_separate", "layernorm",
                                     "rmsnorm"])
@pytest.mark.parametrize("m", [1, 5])
def test_packed_matches_reference(variant, m):
    rng = np.random.default_rng(11)
    x, kw = make_case(rng, np.float32, m, 24, 40, 24, variant)
    packed = fusedmlp.pack(activation="silu", **kw)
    assert (packed.d_in, packed.hidden, packed.d_out) == (24, 40, 24)
    assert packed.device == "cpu" and "PackedMlp(24 -> 40 -> 24" in repr(packed)
    ref = mlp_ref(x, activation="silu", **kw)
    assert_close(packed(x), ref)
    residual = rand(rng, (m, 24), np.float32)
    assert_close(packed(x, residual), ref + residual)
    assert isinstance(packed.workspace_size(x), int)
    # The pack owns its copy: changing the source weights afterwards changes nothing.
    kw["w2"][:] = 0
    assert_close(packed(x), ref)


def test_packed_rejects_wrong_width():
    x, kw = make_case(np.random.default_rng(1), np.float32, 3, 24, 40, 24, "dense")
    packed = fusedmlp.pack(**kw)
    with pytest.raises(ValueError, match="x"):
        packed(np.zeros((3, 25), np.float32))


def test_workspace_size_and_mlp_fp8_weights():
    x, kw = make_case(np.random.default_rng(2), np.float32, 3, 32, 48, 32, "dense")
    assert isinstance(fusedmlp.mlp_workspace_size(x, **kw), int)
    q1, s1, _ = fusedmlp.quantize_fp8(kw["w1"])
    q2, s2, _ = fusedmlp.quantize_fp8(kw["w2"])
    deq = dict(kw, w1=_dequant(q1, s1), w2=_dequant(q2, s2))
    try:
        y = fusedmlp.mlp(x, **dict(kw, w1=q1, w2=q2, w1_scale=s1, w2_scale=s2))
    except NotImplementedError as e:
        pytest.skip(f"no host kernel takes fp8 mlp weights: {e}")
    assert_close(y, mlp_ref(x, **deq), rtol=2.0**-7)


def _block_dequant(q, scale, halves=1):
    """code * scale[r / 128, c / 128]; halves=2: a stacked [gate; up] whose halves start their
    own block rows."""
    q = _bits_as_float(q)
    s = np.asarray(scale, np.float64)
    parts = np.split(q, halves)
    sparts = np.split(s, halves)
    out = [p * np.repeat(np.repeat(sp, 128, 0), 128, 1)[:p.shape[0], :p.shape[1]]
           for p, sp in zip(parts, sparts)]
    return np.concatenate(out)


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("m", [1, 40])
@pytest.mark.parametrize("form", ["dense", "stacked", "separate"])
def test_mlp_fp8_block_scales(backend, m, form):
    """mlp with [ceil(rows / 128), ceil(cols / 128)] scales from quantize_fp8(block=True): gate
    and up quantised apart (hidden 200, not a multiple of 128), the stacked w1 taking their
    scales concatenated, against the fp64 mlp of the dequantised weights; a scale over the 2 *
    hidden stacked rows is refused by shape."""
    rng = np.random.default_rng(11)
    d_in, hidden, d_out = 300, 200, 140
    x = rand(rng, (m, d_in), np.float32)
    gate = rand(rng, (hidden, d_in), np.float32, d_in**-0.5)
    up = rand(rng, (hidden, d_in), np.float32, d_in**-0.5)
    down = rand(rng, (d_out, hidden), np.float32, hidden**-0.5)
    gate[:128, 128:256] *= 30  # one block far larger than the rest
    qg, sg, _ = fusedmlp.quantize_fp8(gate, block=True)
    qu, su, _ = fusedmlp.quantize_fp8(up, block=True)
    q2, s2, _ = fusedmlp.quantize_fp8(down, block=True)
    assert sg.shape == (2, 3) and s2.shape == (2, 2)
    deq2 = _block_dequant(q2, s2)
    if form == "dense":
        kw = dict(w1=qg, w1_scale=sg, gated=False)
        ref = mlp_ref(x, _block_dequant(qg, sg), deq2, activation="silu")
    else:
        ref = mlp_ref(x, np.concatenate([_block_dequant(qg, sg), _block_dequant(qu, su)]), deq2,
                      activation="silu", gated=True)
        if form == "stacked":
            kw = dict(w1=np.concatenate([qg, qu]), w1_scale=np.concatenate([sg, su]), gated=True)
        else:
            kw = dict(w1=qg, w1_scale=sg, w_up=qu, w_up_scale=su, gated=True)
    y = fusedmlp.mlp(x, w2=q2, w2_scale=s2, activation="silu", backend=backend, **kw)
    assert_close(y, ref, rtol=2.0**-12)
    if form == "stacked":
        q_gu, s_gu, _ = fusedmlp.quantize_fp8(np.concatenate([gate, up]), block=True, gate_up=True)
        assert np.array_equal(s_gu, np.concatenate([sg, su]))
        assert np.array_equal(_bits_as_float(q_gu), _bits_as_float(kw["w1"]), equal_nan=True)
        bad = np.concatenate([sg, su])[:3]
        with pytest.raises(ValueError, match=r"2 \* ceil\(hidden / 128\)"):
            fusedmlp.mlp(x, w2=q2, w2_scale=s2, activation="silu", backend=backend,
                         **dict(kw, w1_scale=bad))


def test_mlp_fp8_block_scales_packed_and_rejected():
    """pack() keeps block scales (cpu); a NaN block scale is refused naming the block."""
    rng = np.random.default_rng(12)
    x = rand(rng, (3, 260), np.float32)
    w1 = rand(rng, (2 * 130, 260), np.float32, 260**-0.5)
    w2 = rand(rng, (129, 130), np.float32, 130**-0.5)
    q1a, s1a, _ = fusedmlp.quantize_fp8(w1[:130], block=True)
    q1b, s1b, _ = fusedmlp.quantize_fp8(w1[130:], block=True)
    q2, s2, _ = fusedmlp.quantize_fp8(w2, block=True)
    kw = dict(w1=np.concatenate([q1a, q1b]), w1_scale=np.concatenate([s1a, s1b]), w2=q2,
              w2_scale=s2, gated=True, activation="gelu")
    y = fusedmlp.mlp(x, backend="cpu", **kw)
    packed = fusedmlp.pack(backend="cpu", **kw)
    assert np.array_equal(packed(x), y)
    bad = s2.copy()
    bad[1, 0] = np.nan
    with pytest.raises(ValueError, match=r"w2_scale\[1, 0\] is nan"):
        fusedmlp.mlp(x, backend="cpu", **dict(kw, w2_scale=bad))


def _bits_as_float(q):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return np.asarray(q).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _dequant(q, scale):
    return _bits_as_float(q) * np.asarray(scale, np.float64).reshape(-1, 1)


def linear_ref(x, w, bias=None):
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    return y if bias is None else y + np.asarray(bias, np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("shape", [(1, 7, 13), (5, 64, 96), (17, 127, 33)],
                         ids=lambda s: "x".join(map(str, s)))
def test_linear_matches_reference(dtype, shape):
    m, n, k = shape
    rng = np.random.default_rng(m * n * k)
    x = rand(rng, (m, k), dtype)
    w = rand(rng, (n, k), dtype, k**-0.5)
    bias = rand(rng, (n,), np.float32, 0.1)
    assert_close(fusedmlp.linear(x, w, bias), linear_ref(x, w, bias))
    assert_close(fusedmlp.linear(x, w), linear_ref(x, w))
    assert isinstance(fusedmlp.linear_workspace_size(x, w, bias), int)
    report = fusedmlp.linear_explain(x, w, bias)
    assert any(name in report for name, _ in fusedmlp.kernels("linear"))


def test_linear_fp8_weights():
    rng = np.random.default_rng(3)
    x = rand(rng, (4, 64), np.float32)
    w = rand(rng, (48, 64), np.float32, 0.125)
    q, scale, amax = fusedmlp.quantize_fp8(w)
    assert amax == pytest.approx(np.abs(w).max(), rel=1e-6)
    y = fusedmlp.linear(x, q, w_scale=scale)
    assert_close(y, linear_ref(x, _dequant(q, scale)), rtol=2.0**-7)


@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_linear_fp8_block_scales(backend):
    """quantize_fp8(block=True) -> [ceil(N / 128), ceil(K / 128)] scales, and linear on them
    (edge blocks of 1 and 44 rows, 16 columns) against the fp64 product of the dequantised W."""
    rng = np.random.default_rng(6)
    x = rand(rng, (5, 272), np.float32)
    w = rand(rng, (300, 272), np.float32, 0.125)
    w[:128, 128:256] *= 40  # one block far larger than the rest
    q, scale, _ = fusedmlp.quantize_fp8(w, block=True)
    assert scale.shape == (3, 3) and np.all(scale > 0)
    assert scale[0, 1] > 10 * scale[0, 0]
    full = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:300, :272]
    wq = _bits_as_float(q) * full
    y = fusedmlp.linear(x, q, w_scale=scale, backend=backend)
    assert_close(y, linear_ref(x, wq), rtol=2.0**-12)
    with pytest.raises(ValueError, match="ceil"):
        fusedmlp.linear(x, q, w_scale=scale[:, :2], backend=backend)


@pytest.mark.parametrize("per_row", [True, False], ids=["x_scale_per_row", "x_scale_per_tensor"])
def test_linear_w8a8(per_row):
    """fp8 x and fp8 w with fp32 scales (torch._scaled_mm semantics) against the exact
    dequantised fp64 product: only fp32 accumulation error is allowed."""
    rng = np.random.default_rng(5)
    x = rand(rng, (3, 64), np.float32)
    w = rand(rng, (40, 64), np.float32, 0.125)
    bias = rand(rng, (40,), np.float32, 0.1)
    xq, xs, _ = fusedmlp.quantize_fp8(x, per_row=per_row)
    wq, ws, _ = fusedmlp.quantize_fp8(w)
    y = np.full((3, 40), np.nan, np.float32)
    fusedmlp.linear(xq, wq, bias, w_scale=ws, x_scale=xs, out=y)
    assert_close(y, linear_ref(_dequant(xq, xs), _dequant(wq, ws), bias))
    with pytest.raises(ValueError, match="out="):
        fusedmlp.linear(xq, wq, w_scale=ws, x_scale=xs)
    with pytest.raises(ValueError, match="x_scale"):
        fusedmlp.linear(xq, wq, w_scale=ws, out=y)


def test_linear_rejects_mismatched_k():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="w|x"):
        fusedmlp.linear(x, np.zeros((4, 9), np.float32))


def softmax_ref(x, temperature=1.0, log=False):
    z = np.asarray(x, np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    if log:
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("n", [1, 7, 769])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_matches_reference(dtype, n, log):
    rng = np.random.default_rng(n)
    x = rand(rng, (5, n), dtype, 3.0)
    fn = fusedmlp.log_softmax if log else fusedmlp.softmax
    assert_close(fn(x, temperature=0.7), softmax_ref(x, 0.7, log))
    inplace = x.copy()
    assert fn(inplace, out=inplace) is inplace
    assert_close(inplace, softmax_ref(x, 1.0, log))
    assert isinstance(fusedmlp.softmax_workspace_size(x, log=log), int)
    assert any(k in fusedmlp.softmax_explain(x, log=log) for k, _ in fusedmlp.kernels("softmax"))


def test_softmax_rejects_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        fusedmlp.softmax(np.zeros((2, 3), np.float32), temperature=0.0)


@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
def test_quantize_fp8_round_trip(per_row):
    rng = np.random.default_rng(4)
    w = rand(rng, (9, 33), np.float32)
    w[2] *= 50  # an outlier row
    q, scale, amax = fusedmlp.quantize_fp8(w, per_row=per_row)
    assert q.shape == w.shape and scale.shape == ((9,) if per_row else (1,))
    assert np.all(scale > 0) and amax == pytest.approx(np.abs(w).max(), rel=1e-6)
    back = _dequant(q, np.broadcast_to(scale, (9,)))
    s = np.broadcast_to(scale, (9,)).reshape(-1, 1)
    # fusedmlp.h: |q*scale - w| <= 2^-4 |w| for |w| >= 2^-6 scale, <= 2^-10 scale below.
    bound = np.where(np.abs(w) >= 2.0**-6 * s, 2.0**-4 * np.abs(w), 2.0**-10 * s) * (1 + 1e-6)
    assert np.all(np.abs(back - w) <= bound)


def test_quantize_fp8_rejects_bad_input():
    with pytest.raises(ValueError, match="w"):
        fusedmlp.quantize_fp8(np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="w has dtype int32"):
        fusedmlp.quantize_fp8(np.zeros((2, 2), np.int32))


def test_info_calls():
    assert isinstance(fusedmlp.devices(), list)
    for op in ("mlp", "linear", "softmax"):
        assert fusedmlp.kernels(op), op
    with pytest.raises(ValueError, match="op"):
        fusedmlp.kernels("conv")
    assert "fusedmlp" in fusedmlp.build_info()


def test_too_many_dims_and_unknown_object():
    x, kw = make_case(np.random.default_rng(5), np.float32, 3, 7, 13, 7, "dense")
    with pytest.raises(ValueError, match="dimensions"):
        fusedmlp.mlp(x, out=np.zeros((1, 1, 1, 3, 7), np.float32), **kw)
    with pytest.raises(ValueError, match="fusedmlp allocates outputs"):
        fusedmlp.mlp(memoryview(x), **kw)


def test_misaligned_and_bad_stride_raise_value_error():
    x, kw = make_case(np.random.default_rng(6), np.float32, 3, 7, 13, 7, "dense")
    raw = np.zeros(x.nbytes + 4, np.uint8)
    misaligned = np.frombuffer(raw.data, np.float32, x.size, offset=2).reshape(x.shape)
    with pytest.raises(ValueError, match="align"):
        fusedmlp.mlp(misaligned, **kw)
    with pytest.raises(ValueError, match="stride"):
        fusedmlp.mlp(np.asfortranarray(x), **kw)  # inner stride != 1
