"""fusedmlp: a transformer FFN block as one fused op, on any DLPack tensor.

Math of the mlp op (row i of x, one token):

    xn = norm(x_i)         none | LayerNorm(gamma, beta, eps) | RMSNorm(gamma, eps)
    dense: h = act(W1 xn + b1)                     W1: [hidden, d_in] (nn.Linear: [out, in])
    gated: h = act(Wg xn + bg) * (Wu xn + bu)
    y_i = [residual_i +] W2 h + b2        W2: [d_out, hidden]

act: relu | gelu (erf) | gelu_tanh | silu. Gated with silu is SwiGLU, with gelu GeGLU.
"""

import numpy as np

from . import _ext

__all__ = ["mlp", "explain", "available", "build_info", "kernels", "__version__"]
__version__ = _ext.version()

_ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}
_NORMS = {None: 0, "none": 0, "layernorm": 1, "rmsnorm": 2}
_BACKENDS = {"auto": 0, "ref": 1, "cpu": 2, "cuda": 3}


def _lookup(table, name, value):
    try:
        return table[value]
    except (KeyError, TypeError):
        choices = ", ".join(repr(k) for k in table)
        raise ValueError(f"{name} is {value!r}; expected one of {choices}") from None


def _output(x, w2, out):
    if out is not None:
        return out
    if not isinstance(x, np.ndarray):
        raise ValueError(
            f"out is None but x is a {type(x).__name__}; fusedmlp allocates the output only for "
            "numpy arrays, pass out= (an [M, d_out] array of x's dtype on x's device)")
    if getattr(w2, "ndim", None) != 2:
        raise ValueError(f"w2 has shape {getattr(w2, 'shape', None)}; expected [d_out, hidden]")
    if x.ndim != 2:
        raise ValueError(f"x has shape {x.shape}; expected [M, d_in]")
    return np.empty((x.shape[0], w2.shape[0]), dtype=x.dtype)


def _call(explain, x, w1, w2, b1, w_up, b_up, b2, residual, norm_weight, norm_bias, activation,
          gated, norm, eps, out, backend, deterministic):
    y = _output(x, w2, out)
    t = dict(out=y, x=x, residual=residual, w1=w1, b1=b1, w_up=w_up, b_up=b_up, w2=w2, b2=b2,
             norm_weight=norm_weight, norm_bias=norm_bias)
    # numpy exports ml_dtypes.bfloat16 through neither DLPack nor the buffer protocol: such
    # arrays travel as uint16 views of their bits, named in bf16_bits.
    bf16_bits = [k for k, v in t.items()
                 if isinstance(v, np.ndarray) and v.dtype.name == "bfloat16"]
    for k in bf16_bits:
        t[k] = t[k].view(np.uint16)
    report = _ext.mlp(t["out"], t["x"], t["residual"], t["w1"], t["b1"], t["w_up"], t["b_up"],
                      t["w2"], t["b2"], t["norm_weight"], t["norm_bias"],
                      _lookup(_ACTIVATIONS, "activation", activation), bool(gated),
                      _lookup(_NORMS, "norm", norm), float(eps), bool(deterministic),
                      _lookup(_BACKENDS, "backend", backend), explain, bf16_bits)
    return report if explain else y


def mlp(x, w1, w2, *, b1=None, w_up=None, b_up=None, b2=None, residual=None, norm_weight=None,
        norm_bias=None, activation="gelu", gated=False, norm=None, eps=1e-5, out=None,
        backend="auto", deterministic=False):
    """Runs the fused FFN block on x's device and returns y.

    For each row x_i of x:

        xn = norm(x_i)         none | LayerNorm(gamma, beta, eps) | RMSNorm(gamma, eps)
        dense: h = act(W1 xn + b1)                     W1: [hidden, d_in] (nn.Linear: [out, in])
        gated: h = act(Wg xn + bg) * (Wu xn + bu)
        y_i = [residual_i +] W2 h + b2        W2: [d_out, hidden]

    Shapes: x [M, d_in]; w1 [hidden, d_in], or for gated without w_up the stacked
    [2*hidden, d_in] (gate rows first, then up rows) with b1 then [2*hidden]; w_up [hidden, d_in];
    b1, b_up [hidden]; w2 [d_out, hidden]; b2 [d_out]; norm_weight (gamma), norm_bias (beta,
    layernorm only) [d_in]; residual and out [M, d_out]. out may be residual itself (in-place
    residual add).

    x, residual and out share one dtype: float32, float16 or bfloat16; weights are float32,
    float16 or bfloat16, biases and norm parameters any of those. Rows may be strided (e.g.
    x[::2]) but the last dimension must be contiguous. Any object that supports DLPack or the
    buffer protocol is accepted; out is allocated (with numpy) only when x is a numpy array.

    activation: "relu", "gelu" (erf), "gelu_tanh" or "silu" (gated silu is SwiGLU, gated gelu is
    GeGLU). norm: None, "layernorm" or "rmsnorm", with eps > 0. backend: "auto", "ref", "cpu" or
    "cuda". deterministic: bitwise-identical results on reruns.

    Raises ValueError for bad arguments (the message names the argument), NotImplementedError
    when the backend is unavailable or none of its kernels handles the request.
    """
    return _call(False, x, w1, w2, b1, w_up, b_up, b2, residual, norm_weight, norm_bias,
                 activation, gated, norm, eps, out, backend, deterministic)


def explain(x, w1, w2, *, b1=None, w_up=None, b_up=None, b2=None, residual=None,
            norm_weight=None, norm_bias=None, activation="gelu", gated=False, norm=None, eps=1e-5,
            out=None, backend="auto", deterministic=False):
    """Same arguments as mlp(); runs nothing and returns the dispatch report: the kernel that
    would run and, for every other candidate, why it was rejected."""
    return _call(True, x, w1, w2, b1, w_up, b_up, b2, residual, norm_weight, norm_bias,
                 activation, gated, norm, eps, out, backend, deterministic)


def available(backend):
    """(True, "") when backend ("auto", "ref", "cpu" or "cuda") can run here, else
    (False, reason)."""
    return _ext.available(_lookup(_BACKENDS, "backend", backend))


def build_info():
    """How the library was built: version, CUDA on/off and the GPU code it carries."""
    return _ext.build_info()


def kernels():
    """Every kernel of the op table as (name, backend) pairs, in dispatch order."""
    return _ext.kernels()
