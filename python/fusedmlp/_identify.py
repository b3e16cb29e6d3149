"""Numeric identification for fusedmlp.patch (_structure.py): which of fusedmlp's activations
a function computes, and which norm a module computes, found by evaluating them rather than by
their names, so that any implementation of the same math is recognised (BloomGelu, a Python
gelu function, x * sigmoid(x), Gemma's RMSNorm with its (1 + w) scale, a norm without weight)
and a near miss (quick_gelu, relu^2, a wrong eps) is not."""

import math

import torch


def is_simple_leaf(m):
    """A module without children and with at most two 1-D parameters: a norm, an activation,
    a dropout (what a small MLP half holds besides its linears)."""
    params = list(m.parameters(recurse=False))
    return not list(m.children()) and len(params) <= 2 and all(p.dim() == 1 for p in params)


_ACT_REFERENCES = {
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "relu2": lambda x: torch.relu(x).square(),
}
# |f(x) - ref(x)| <= ACT_TOLERANCE * (1 + |ref(x)|) over the grid, f evaluated in float32
# (~1e-7 from ref); gelu and gelu_tanh differ by up to 4.7e-4, so neither passes for the other.
ACT_TOLERANCE = 2e-5


def identify_activation(fn, width, device="cpu"):
    """(name, None) when fn computes relu, gelu, gelu_tanh, silu or relu2 elementwise on a grid of
    inputs in [-12, 12] (float32 rows of `width`, in shuffled order, on `device`); else (None,
    reason)."""
    grid = torch.linspace(-12.0, 12.0, 4099, dtype=torch.float64)
    rows = -(-grid.numel() // width)
    x = torch.cat([grid, torch.zeros(rows * width - grid.numel(), dtype=torch.float64)])
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    x = x.reshape(rows, width)
    try:
        with torch.no_grad():
            y = fn(x.float().to(device))
    except Exception as e:  # noqa: BLE001
        return None, f"evaluating it failed ({type(e).__name__}: {str(e)[:100]})"
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None, "it does not map its input elementwise"
    y, best = y.double().cpu(), None
    for name, ref_fn in _ACT_REFERENCES.items():
        ref = ref_fn(x)
        err = float(((y - ref).abs() / (1 + ref.abs())).nan_to_num(nan=math.inf).max())
        if err <= ACT_TOLERANCE:
            return name, None
        if best is None or err < best[1]:
            best = (name, err)
    return None, (f"it is not relu, gelu, gelu_tanh, silu or relu2 (nearest {best[0]}, off by "
                  f"{best[1]:.2g})")


_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps",
              "layer_norm_epsilon", "rms_norm_eps")
# fp32: accumulation order only; 16-bit: the module rounds its intermediates to the dtype.
_NORM_RTOL = {torch.float32: 1e-4, torch.float16: 2.0**-8, torch.bfloat16: 2.0**-5}


def _norm_eps(norm):
    for attr in _EPS_ATTRS:
        v = getattr(norm, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return [float(v)]
    return [1e-5, 1e-6, 1e-12, 1e-8]


def identify_norm(norm, d):
    """(FusedMLP norm keyword arguments, description) when module `norm` computes LayerNorm or
    RMSNorm over the last dim of [rows, d] (scale: its 1-D weight w, 1 + w, or none; bias: its
    1-D bias), else (None, reason). Found by evaluating the module on rows of unit scale and of
    scale 1e-3 and 1e-6 (there eps dominates) with a nonzero mean (which LayerNorm removes)."""
    name = type(norm).__name__
    params = dict(norm.named_parameters(recurse=False))
    if not is_simple_leaf(norm) or any(p.shape[0] != d for p in params.values()):
        return None, f"{name} is not a norm over the last dim (children or other parameters)"
    weight, bias = params.get("weight"), params.get("bias")
    if len(params) != (weight is not None) + (bias is not None):
        return None, f"{name} has parameters {sorted(params)} (expected weight and bias)"
    like = weight if weight is not None else bias
    dtype = like.dtype if like is not None else torch.float32
    device = like.device if like is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, d, generator=gen, dtype=torch.float64) + 0.5
    x[3:6] *= 1e-3
    x[6:] *= 1e-6
    try:
        with torch.no_grad():
            got = norm(x.to(device=device, dtype=dtype))
    except Exception as e:  # noqa: BLE001
        return None, f"{name} failed on [rows, {d}] ({type(e).__name__}: {str(e)[:80]})"
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        return None, f"{name} does not map [rows, {d}] to [rows, {d}]"
    got, x = got.double().cpu(), x.to(dtype).double()
    w = None if weight is None else weight.detach().double().cpu()
    b = None if bias is None else bias.detach().double().cpu()
    rtol = _NORM_RTOL.get(dtype, 1e-3)
    scales = [("none", None)] if w is None else [("weight", w), ("1 + weight", 1 + w)]
    for eps in _norm_eps(norm):
        centred = x - x.mean(-1, keepdim=True)
        candidates = [("layernorm", centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True)
                                                         + eps))]
        if b is None:
            candidates.append(("rmsnorm", x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)))
        for kind, xn in candidates:
            for scale_name, scale in scales:
                ref = (xn if scale is None else xn * scale) + (0 if b is None else b)
                rms = ref.pow(2).mean(-1, keepdim=True).sqrt()
                if float(((got - ref).abs() / (ref.abs() + rms + 1e-30)).max()) > rtol:
                    continue
                kw = dict(norm=kind, eps=eps)
                if scale_name == "weight":
                    kw["norm_weight"] = weight
                elif scale_name == "1 + weight":
                    kw["norm_weight"] = (1 + weight.detach().float()).to(weight.dtype)
                if bias is not None:
                    kw["norm_bias"] = bias
                return kw, f"{name} ({kind}, scale {scale_name}, eps {eps:g})"
    return None, (f"{name} computes neither LayerNorm nor RMSNorm over the last dim (scale "
                  "weight, 1 + weight or none)")
