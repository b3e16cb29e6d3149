"""fp8 linears as checkpoints store them, read for fusedmlp's weight-only fp8 path.

Two layouts are recognised by their tensors, not by class names:

- transformers' fine-grained fp8 (``FP8Linear``: DeepSeek-V3/R1, the Qwen3 FP8 releases):
  ``weight`` float8_e4m3fn [out, in] and ``weight_scale_inv`` float32 (or ue8m0), one value per
  tensor (``block_size`` None) or one per ``block_size`` block, W = weight * scale;
- compressed-tensors style (``weight_scale`` beside an e4m3 ``weight``): one value per tensor
  ([1] or a scalar), per output channel ([out, 1] or [out]) or per 128 x 128 block.

fusedmlp takes the weights as they are, with their scales as fp32 [1], [out] or
[ceil(out / 128), ceil(in / 128)]: the weights are dequantised exactly in the kernels and the
activations stay in the model's dtype (weight-only). The modules' own forward instead quantises
the activations to e4m3 (per token group, or with a static scale) and on a machine without the
kernels it calls may not run at all; so the probe compares the fused modules with the same
modules computing x @ (weight * scale)^T (``dequantized``), the weight-only result they
approximate.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 128  # the block edge fusedmlp's block scales use


def _scale_attr(m):
    for name in ("weight_scale_inv", "weight_scale"):
        s = getattr(m, name, None)
        if isinstance(s, torch.Tensor):
            return name, s
    return None, None


def is_fp8_linear(m):
    """An nn.Linear (or subclass) holding float8_e4m3fn weights and a scale tensor."""
    return (isinstance(m, nn.Linear) and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dtype == torch.float8_e4m3fn and _scale_attr(m)[1] is not None)


def fp8_scale(m):
    """The scale of an fp8 linear as fusedmlp takes it: fp32 [1], [out] or [ceil(out/128),
    ceil(in/128)]; raises NotImplementedError saying why a layout does not fit."""
    name, s = _scale_attr(m)
    n, k = m.weight.shape
    if s.dtype != torch.float32:  # ue8m0 (powers of two) and the like convert exactly
        if not s.dtype.is_floating_point:
            raise NotImplementedError(f"{name} has dtype {s.dtype}; fusedmlp takes float scales")
        s = s.float()
    s = s.detach()
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    block = getattr(m, "block_size", None) or getattr(m, "weight_block_size", None)
    if s.numel() == 1 and not block:
        return s.reshape(1).contiguous()
    if block:
        block = tuple(int(b) for b in block)
        if block != (BLOCK, BLOCK):
            raise NotImplementedError(f"{name} holds {block[0]} x {block[1]} block scales; "
                                      f"fusedmlp takes {BLOCK} x {BLOCK} blocks (or per-row "
                                      "scales: re-quantise with fusedmlp.quantize_fp8)")
        if tuple(s.shape) != (nb, kb):
            raise NotImplementedError(f"{name} has shape {tuple(s.shape)}; {BLOCK} x {BLOCK} "
                                      f"blocks of a [{n}, {k}] weight need [{nb}, {kb}]")
        return s.contiguous()
    if tuple(s.shape) in ((n, 1), (n,)):
        return s.reshape(n).contiguous()
    if tuple(s.shape) == (nb, kb):
        return s.contiguous()
    raise NotImplementedError(f"{name} has shape {tuple(s.shape)} for a [{n}, {k}] weight; "
                              f"fusedmlp takes one scale, one per output row or one per "
                              f"{BLOCK} x {BLOCK} block")


def scale_kind(scale):
    """What a scale tensor in fusedmlp's layout is, for reports and reprs."""
    return ("a per-tensor scale" if scale.numel() == 1 and scale.dim() == 1 else
            "per-row scales" if scale.dim() == 1 else f"{BLOCK} x {BLOCK} block scales")


def split_rows(scale, rows, at):
    """The scales of rows [0, at) and [at, rows) of a weight (a fused gate_up linear's halves);
    raises NotImplementedError where blocks straddle the cut."""
    if scale.numel() == 1 and scale.dim() == 1 and rows != 1:
        return scale, scale
    if scale.dim() == 1:
        return scale[:at].contiguous(), scale[at:].contiguous()
    if at % BLOCK:
        raise NotImplementedError(f"the fused gate/up linear's halves of {at} rows cut "
                                  f"through its {BLOCK}-row scale blocks")
    return scale[:at // BLOCK].contiguous(), scale[at // BLOCK:].contiguous()


def dequantize(weight, scale):
    """weight * scale in float32 ([out, in]; scale as fp8_scale gives it)."""
    w = weight.float()
    if scale.dim() == 1:  # per row, or one per tensor
        return w * (scale.reshape(-1, 1) if scale.numel() == w.shape[0] else scale.reshape(1, 1))
    rows = scale.repeat_interleave(BLOCK, 0)[:w.shape[0]]
    return w * rows.repeat_interleave(BLOCK, 1)[:, :w.shape[1]]


def _reference_forward(m):
    cache = []  # the dequantised weight, made at the first call (only probed linears pay)

    def forward(x):
        if not cache:
            cache.append(dequantize(m.weight, fp8_scale(m)).to(x.device))
        b = None if m.bias is None else m.bias.float()
        return F.linear(x.float(), cache[0], b).to(x.dtype)
    return forward


def is_fp8_experts(m):
    """transformers' fine-grained fp8 experts (FP8Experts): stacked e4m3 gate_up_proj
    [E, 2I, H] and down_proj [E, H, I] with *_scale_inv, each expert's projections computed by
    its `linear` method."""
    w = getattr(m, "gate_up_proj", None)
    return (isinstance(w, torch.Tensor) and w.dtype == torch.float8_e4m3fn and w.dim() == 3
            and isinstance(getattr(m, "gate_up_proj_scale_inv", None), torch.Tensor)
            and isinstance(getattr(m, "down_proj_scale_inv", None), torch.Tensor)
            and callable(getattr(m, "linear", None)))


def experts_scales(m, owner):
    """(w1_scale, w2_scale) of fp8 experts as fusedmlp.moe takes them: [E, 2 * ceil(I / 128),
    ceil(H / 128)] (each expert's gate block rows, then its up block rows) and [E,
    ceil(H / 128), ceil(I / 128)]; raises NotImplementedError where the layout differs."""
    block = tuple(getattr(m, "block_size", None) or ())
    if block != (BLOCK, BLOCK):
        raise NotImplementedError(f"{owner}.experts are fp8 with "
                                  f"{'per-tensor scales' if not block else f'{block} blocks'}; "
                                  f"fusedmlp's fp8 experts take {BLOCK} x {BLOCK} block scales")
    e, two_i, hd = m.gate_up_proj.shape
    inter = two_i // 2
    if inter % BLOCK:
        raise NotImplementedError(f"{owner}.experts: intermediate size {inter} is not a multiple "
                                  f"of {BLOCK}, so gate_up_proj's scale blocks straddle the gate "
                                  "and up halves, which fusedmlp's block scales keep apart")
    s1, s2 = m.gate_up_proj_scale_inv.detach().float(), m.down_proj_scale_inv.detach().float()
    want1 = (e, 2 * (inter // BLOCK), -(-hd // BLOCK))
    want2 = (e, -(-m.down_proj.shape[1] // BLOCK), -(-m.down_proj.shape[2] // BLOCK))
    if tuple(s1.shape) != want1 or tuple(s2.shape) != want2:
        raise NotImplementedError(f"{owner}.experts: scales {tuple(s1.shape)} and "
                                  f"{tuple(s2.shape)}; {BLOCK} x {BLOCK} blocks need {want1} and "
                                  f"{want2}")
    return s1.contiguous(), s2.contiguous()


def _reference_linear(input, weight, weight_scale_inv, activation_scale=None):
    w = dequantize(weight, weight_scale_inv.float()).to(input.device)
    return F.linear(input.float(), w).to(input.dtype)


@contextlib.contextmanager
def dequantized(model):
    """Within the block, every fp8 linear under `model` computes x @ (weight * scale)^T + b in
    float32, rounded to x's dtype (what fusedmlp's weight-only fp8 path computes), instead of
    its own forward; fp8 experts compute each projection the same way."""
    changed = []
    for m in model.modules():
        if is_fp8_linear(m):
            try:
                fp8_scale(m)
            except NotImplementedError:
                continue
            changed.append((m, "forward", m.__dict__.get("forward")))
            m.forward = _reference_forward(m)
        elif is_fp8_experts(m):
            changed.append((m, "linear", m.__dict__.get("linear")))
            m.linear = _reference_linear
    try:
        yield
    finally:
        for m, attr, old in changed:
            if old is None:
                m.__dict__.pop(attr, None)
            else:
                setattr(m, attr, old)


def activation_dtype(*modules):
    """The dtype an fp8 model computes in: that of the first floating parameter or buffer that
    is neither fp8 nor a scale (norms, biases, a router), else the model config's dtype, else
    the default dtype."""
    for mod in modules:
        if mod is None:
            continue
        for name, t in list(mod.named_parameters()) + list(mod.named_buffers()):
            if "scale" not in name.rsplit(".", 1)[-1] and t.dtype in (
                    torch.float32, torch.float16, torch.bfloat16):
                return t.dtype
    for mod in modules:
        dtype = getattr(getattr(mod, "config", None), "dtype", None)
        if isinstance(dtype, torch.dtype) and dtype in (torch.float32, torch.float16,
                                                        torch.bfloat16):
            return dtype
    return torch.get_default_dtype()
