"""fusedmlp as an experts implementation of transformers 5 (the experts registry,
transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS).

Experts classes decorated with @use_experts_implementation dispatch their forward(hidden_states
[T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d] on config._experts_implementation;
register_experts() adds "fusedmlp" there, so `model.set_experts_implementation("fusedmlp")` (or
from_pretrained(..., experts_implementation="fusedmlp")) runs the experts through
torch.ops.fusedmlp.moe with the model's own routing (the router stays a torch op).

Weights, as the decorator's flags describe them (E experts, hidden size d, intermediate I):
- gate_up_proj [E, 2I, d], gate rows then up rows (is_concatenated), is fusedmlp's stacked gated
  w1 as it is; down_proj [E, d, I] is w2; gate_up_proj_bias [E, 2I] / down_proj_bias [E, d]
  (has_bias) are b1 / b2. Without a gate (has_gate=False) up_proj [E, I, d] is a dense w1 and
  act_fn the activation.
- is_transposed ([E, d, 2I] / [E, I, d]) and interleaved gate/up rows (is_concatenated=False:
  gate_0, up_0, gate_1, ...; the gate is then act(rows 0, 2, ...) * rows 1, 3, ...) are copied
  once into that layout and cached on the module (`_fusedmlp_layout`): the expert weights' memory
  once more. The copy is remade when a source tensor's (data_ptr, _version) changes, i.e. after
  .to() or an in-place edit (writes through .data bypass the version counter: delete
  `_fusedmlp_layout` after those). Under torch.compile the cached copy is used unchecked, or the
  conversion is traced into the graph when there is none yet.
Modules it cannot express run their own eager forward (or, after patch(), the implementation
the model had), with a one-time warning naming the class and the reason: a custom _apply_gate
(gpt-oss' clamped gate, ...), a post-expert norm, expert parallelism (sentinel ids), an
activation fusedmlp lacks, weights that are not plain float32/float16/bfloat16 tensors (fp8 or
other quantised experts, tensor subclasses), float32 experts on CUDA, shapes that do not fit,
or a call the op refuses (NotImplementedError: no kernel of the device takes the shape or the
alignment; remembered per module, dtype and device). Under torch.compile such a refusal is not
caught (it would be a graph break): run the model once eagerly first, as patch() does. Inference
only: backward through the op raises.
"""

import warnings

import torch
from torch import nn

from . import _fp8
from .torch import _activation

__all__ = ["fusedmlp_experts_forward", "register_experts"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_WARNED = set()


_MOE = []  # [transformers.integrations.moe or None], found once


def _moe_module():
    """transformers.integrations.moe when transformers has the experts registry, else None.
    Looked up once (register_experts does it first): a call traced by torch.compile must not
    import it, since some transformers releases hand dynamo a lazy module there."""
    if not _MOE:
        try:
            from transformers.integrations import moe
        except ImportError:
            return None
        _MOE.append(moe if hasattr(moe, "ALL_EXPERTS_FUNCTIONS") else None)
    return _MOE[0]


def register_experts(name: str = "fusedmlp") -> bool:
    """Registers fusedmlp_experts_forward as the experts implementation ``name`` of
    transformers' experts registry (idempotent).

    Parameters
    ----------
    name : str
        The name models select with set_experts_implementation(name).

    Returns
    -------
    bool
        True when registered, False when the installed transformers has no registry.
    """
    moe = _moe_module()
    if moe is None:
        return False
    moe.ALL_EXPERTS_FUNCTIONS.register(name, fusedmlp_experts_forward)
    fp8 = _fp8_registry()
    if fp8 is not None:  # fine-grained fp8 experts (FP8Experts) dispatch through their own
        fp8.register(name, fusedmlp_experts_forward)
    return True


_FP8_REGISTRY = []  # [ALL_FP8_EXPERTS_FUNCTIONS or None], found once


def _fp8_registry():
    """transformers' registry of fp8 experts implementations (ALL_FP8_EXPERTS_FUNCTIONS), or
    None; looked up once, as _moe_module."""
    if not _FP8_REGISTRY:
        try:
            from transformers.integrations import finegrained_fp8
        except ImportError:
            finegrained_fp8 = None
        _FP8_REGISTRY.append(getattr(finegrained_fp8, "ALL_FP8_EXPERTS_FUNCTIONS", None))
    return _FP8_REGISTRY[0]


def is_registry_experts(m):
    """An experts module whose class forward dispatches through the registry
    (@use_experts_implementation: the wrapped forward, a config with _experts_implementation)."""
    return (isinstance(m, nn.Module) and _wrapped_forward(m) is not None
            and hasattr(getattr(m, "config", None), "_experts_implementation")
            and (hasattr(m, "has_gate") or hasattr(m, "gate_up_proj")))


def _wrapped_forward(m):
    for cls in type(m).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is not None:
            return getattr(forward, "__wrapped__", None)
    return None


def _flags(m):
    gated = bool(getattr(m, "has_gate", True))
    return (gated, bool(getattr(m, "has_bias", False)), bool(getattr(m, "is_transposed", False)),
            gated and not getattr(m, "is_concatenated", True))


def _sources(m):
    """(w1, w2, b1, b2) as the module stores them (None for absent biases)."""
    gated, biased, _, _ = _flags(m)
    up = "gate_up_proj" if gated else "up_proj"
    return (getattr(m, up, None), getattr(m, "down_proj", None),
            getattr(m, f"{up}_bias", None) if biased else None,
            getattr(m, "down_proj_bias", None) if biased else None)


def unsupported(m):
    """Why fusedmlp_experts_forward cannot compute what experts module m computes; None when it
    can."""
    skip = getattr(m, "_fusedmlp_skip", None)
    if skip:
        return skip
    refused = m.__dict__.get("_fusedmlp_refused")
    if refused is not None and refused[0] == _dispatch_key(m):
        return refused[1]
    if getattr(m, "_is_expert_parallel", False):
        return "it is expert-parallel (its sentinel expert ids are not fusedmlp's)"
    if getattr(m, "has_post_expert_norm", False):
        return "it has a post-expert norm"
    gated, biased, transposed, _ = _flags(m)
    gate = getattr(type(m), "_apply_gate", None)
    # FP8Experts' _apply_gate is act(gate) * up unless a softcap, alpha or clamp is set
    plain_fp8_gate = _fp8.is_fp8_experts(m) and all(
        getattr(m, a, None) is None for a in ("gate_softcap", "swiglu_alpha", "limit"))
    if gated and gate is not None and not plain_fp8_gate:
        moe = _moe_module()
        default = getattr(moe, "_default_apply_gate", None)  # no object() here: dynamo traces it
        if default is None or gate is not default:
            return "it has its own _apply_gate (fusedmlp computes act(gate) * up only)"
    try:
        _activation(getattr(m, "act_fn", None))
    except NotImplementedError as e:
        return str(e)
    w1, w2, b1, b2 = _sources(m)
    names = ("gate_up_proj" if gated else "up_proj", "down_proj")
    fp8 = _fp8.is_fp8_experts(m)
    if fp8:  # e4m3 experts with their 128 x 128 block scales (_fp8.experts_scales)
        if transposed or not gated or _flags(m)[3]:
            return "fp8 experts that are transposed, interleaved or not gated"
        try:
            _fp8.experts_scales(m, type(m).__name__)
        except NotImplementedError as e:
            return str(e)
    for name, t in zip(names + tuple(f"{n}_bias" for n in names), (w1, w2, b1, b2)):
        if t is None and (name.endswith("proj") or biased):
            return f"it has no {name}"
        if t is None:
            continue
        if type(t) not in (torch.Tensor, nn.Parameter):
            return f"{name} is a {type(t).__name__} (quantised or sharded weights)"
        if t.dtype not in _DTYPES and not (fp8 and t.dtype == torch.float8_e4m3fn):
            return f"{name} has dtype {t.dtype}; fusedmlp takes float32, float16 or bfloat16"
        if t.device.type not in ("cpu", "cuda"):
            return f"{name} is on {t.device}; fusedmlp runs on cpu or cuda"
    if w1.device.type == "cuda" and w1.dtype == torch.float32:
        return "float32 experts on CUDA (the cuda moe kernels take bfloat16 or float16 ones)"
    if w1.dim() != 3 or w2.dim() != 3 or w1.dtype != w2.dtype:
        return (f"{names[0]} {tuple(w1.shape)} and down_proj {tuple(w2.shape)} are not 3-D "
                "tensors of one dtype")
    rows, d = (w1.shape[2], w1.shape[1]) if transposed else (w1.shape[1], w1.shape[2])
    inter, d2 = (w2.shape[1], w2.shape[2]) if transposed else (w2.shape[2], w2.shape[1])
    if w2.shape[0] != w1.shape[0] or d2 != d or rows != (2 * inter if gated else inter) or (
            b1 is not None and tuple(b1.shape) != (w1.shape[0], rows)) or (
            b2 is not None and tuple(b2.shape) != (w1.shape[0], d)):
        return (f"its shapes do not fit one expert MLP: {names[0]} {tuple(w1.shape)}, down_proj "
                f"{tuple(w2.shape)}, transposed={transposed}")
    return None


def _verdict(m):
    """unsupported(m), kept on the module for as long as what it depends on stays the same (the
    source tensors' storage and dtype, the markers patch() and a refusal leave, the flags, the
    activation): the full check costs more Python time per call than a decode step can spare."""
    key = (tuple(None if t is None else (t.data_ptr(), t.dtype) for t in _sources(m)),
           m.__dict__.get("_fusedmlp_skip"), m.__dict__.get("_fusedmlp_refused"), _flags(m),
           getattr(m, "_is_expert_parallel", False), getattr(m, "has_post_expert_norm", False),
           id(getattr(m, "act_fn", None)))
    cached = m.__dict__.get("_fusedmlp_verdict")
    if cached is None or cached[0] != key:
        cached = (key, unsupported(m))
        m.__dict__["_fusedmlp_verdict"] = cached
    return cached[1]


def _dispatch_key(m):
    w1 = _sources(m)[0]
    return None if w1 is None else (w1.dtype, w1.device, tuple(w1.shape))


def _convert(m):
    """(w1, w2, b1, b2) in fusedmlp's layout: w1 [E, rows, d] (gated: gate rows, then up rows),
    w2 [E, d, I]."""
    w1, w2, b1, b2 = _sources(m)
    _, _, transposed, interleaved = _flags(m)
    if transposed:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    if interleaved:
        w1 = torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1)
        b1 = None if b1 is None else torch.cat([b1[:, 0::2], b1[:, 1::2]], dim=1).contiguous()
    return w1.detach().contiguous(), w2.detach().contiguous(), b1, b2


def _weights(m):
    _, _, transposed, interleaved = _flags(m)
    if not (transposed or interleaved):
        return _sources(m)
    cached = m.__dict__.get("_fusedmlp_layout")
    if torch.compiler.is_compiling():
        return cached[1] if cached is not None else _convert(m)
    key = tuple(None if t is None else (t.data_ptr(), t._version, t.dtype, t.device)
                for t in _sources(m))
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, _convert(m))
        m.__dict__["_fusedmlp_layout"] = cached
    return cached[1]


def _fallback(m, reason, warn):
    """The forward m runs instead: the implementation it had before patch() switched it
    (`_fusedmlp_previous`), else its own eager forward. patch() marks the modules it did not
    take with `_fusedmlp_skip` (reported there, so no warning here)."""
    key = (type(m).__name__, reason)
    if warn and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"fusedmlp experts: {type(m).__name__} runs without fusedmlp: {reason}",
                      RuntimeWarning, stacklevel=3)
    previous = m.__dict__.get("_fusedmlp_previous")
    original = _wrapped_forward(m)
    moe = _moe_module()
    registry = _fp8_registry() if _fp8.is_fp8_experts(m) else (
        moe.ALL_EXPERTS_FUNCTIONS if moe is not None else None)
    if previous not in (None, "eager", "fusedmlp") and registry is not None:
        return registry.get(previous, original)
    return original


def fusedmlp_experts_forward(self: nn.Module, hidden_states: torch.Tensor,
                             top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts computation of a transformers experts module through torch.ops.fusedmlp.moe
    with the routing given.

    ::

        out[t] = sum_j top_k_weights[t, j] * expert_(top_k_index[t, j])(hidden_states[t])

    Modules it cannot express run their own forward (see the module docstring).

    Parameters
    ----------
    self : nn.Module
        The experts module (gate_up_proj / down_proj stacks, act_fn, config).
    hidden_states : torch.Tensor
        [T, d].
    top_k_index : torch.Tensor
        [T, k] expert ids, any integer dtype.
    top_k_weights : torch.Tensor
        [T, k] routing weights, any float dtype.

    Returns
    -------
    torch.Tensor
        [T, d] in hidden_states' dtype.
    """
    reason = unsupported(self) if torch.compiler.is_compiling() else _verdict(self)
    if reason is not None:
        forward = _fallback(self, reason, warn=not getattr(self, "_fusedmlp_skip", None))
        return forward(self, hidden_states, top_k_index, top_k_weights)
    if torch.compiler.is_compiling():
        return _run(self, hidden_states, top_k_index, top_k_weights)
    try:
        return _run(self, hidden_states, top_k_index, top_k_weights)
    except NotImplementedError as e:  # no kernel of the device takes it (shape, alignment)
        reason = f"the fusedmlp op refuses it: {e}"
        self.__dict__["_fusedmlp_refused"] = (_dispatch_key(self), reason)
        self.__dict__.pop("_fusedmlp_layout", None)
        return _fallback(self, reason, True)(self, hidden_states, top_k_index, top_k_weights)


def _scales(m):
    """(w1_scale, w2_scale) of fp8 experts, cached on the module while their scale tensors stay
    the same; (None, None) for float ones."""
    if not _fp8.is_fp8_experts(m):
        return None, None
    key = tuple((t.data_ptr(), t._version) for t in (m.gate_up_proj_scale_inv,
                                                     m.down_proj_scale_inv))
    cached = m.__dict__.get("_fusedmlp_scales")
    if cached is None or cached[0] != key:
        cached = (key, _fp8.experts_scales(m, type(m).__name__))
        m.__dict__["_fusedmlp_scales"] = cached
    return cached[1]


def _run(m, hidden_states, top_k_index, top_k_weights):
    w1, w2, b1, b2 = _weights(m)
    s1, s2 = _scales(m)
    return torch.ops.fusedmlp.moe(hidden_states, w1, w2, top_k_index.shape[-1], None, None,
                                  top_k_index, top_k_weights, b1, b2, None,
                                  _activation(m.act_fn), _flags(m)[0], "softmax", False, False,
                                  "auto", 0, 0, False, s1, s2)


# ---- fusedmlp.patch's use (python/fusedmlp/_patch.py) ----

def _probe_routing(rows, num_experts, top_k, dtype, device):
    """Seeded routing for an experts probe: top_k distinct experts per row, positive weights
    summing to 1 (the same on both sides of the comparison)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.rand(rows, num_experts, generator=gen).argsort(dim=-1)[:, :top_k]
    weights = torch.rand(rows, top_k, generator=gen) + 0.25
    return ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device, dtype)


def experts_probe(experts):
    """(original, fused, d, weight, detail) for patch()'s probe of a registry experts module:
    its eager forward and fusedmlp_experts_forward, each x [rows, d] -> [rows, d] on the same
    seeded routing (the model's router is left out: both sides would get the same top_k_index
    from it). NotImplementedError when fusedmlp cannot express the module."""
    reason = unsupported(experts)
    if reason is not None:
        raise NotImplementedError(f"{type(experts).__name__} cannot run through fusedmlp: "
                                  f"{reason}")
    w1 = _sources(experts)[0]
    gated, biased, transposed, interleaved = _flags(experts)
    num_experts, d = int(w1.shape[0]), int(w1.shape[1] if transposed else w1.shape[2])
    top_k = getattr(experts.config, "num_experts_per_tok", 2)
    top_k = min(max(top_k if isinstance(top_k, int) else 2, 1), num_experts)
    eager = _wrapped_forward(experts)
    # fp8 experts: x in the dtype the model computes in
    x_dtype = _fp8.activation_dtype(experts) if w1.dtype == torch.float8_e4m3fn else w1.dtype
    try:  # NotImplementedError now (a skip with the reason), not at the first forward
        with torch.no_grad():
            _run(experts, torch.zeros(1, d, dtype=x_dtype, device=w1.device),
                 torch.arange(top_k, device=w1.device)[None],
                 torch.ones(1, top_k, dtype=x_dtype, device=w1.device))
    except NotImplementedError as e:
        experts.__dict__.pop("_fusedmlp_layout", None)
        raise NotImplementedError(f"{type(experts).__name__}: the fusedmlp op refuses it: "
                                  f"{e}") from None

    def run(forward, x):
        return forward(experts, x, *_probe_routing(x.shape[0], num_experts, top_k, x.dtype,
                                                   x.device))
    copy = ", a converted copy of the weights" if transposed or interleaved else ""
    detail = (f"{type(experts).__name__} -> experts_implementation 'fusedmlp' (transformers "
              f"experts registry: {num_experts} experts, {'gated ' if gated else ''}"
              f"{_activation(experts.act_fn)}{', biased' if biased else ''}{copy})")
    return (lambda x: run(eager, x), lambda x: run(fusedmlp_experts_forward, x), d, w1, detail)


def switch_experts(model, chosen):
    """Registers "fusedmlp" and makes it the experts implementation of the configs of the
    `chosen` experts modules. Every registry experts module of the model records the
    implementation it had (`_fusedmlp_previous`), which it keeps running whenever fusedmlp does
    not take it; those not chosen are marked `_fusedmlp_skip` (the setting is per config, and
    set_experts_implementation spreads it to the sub-models)."""
    if not chosen:
        return
    register_experts()
    ids = {id(m) for m in chosen}
    for m in model.modules():
        if is_registry_experts(m):
            if "_fusedmlp_previous" not in m.__dict__:
                m._fusedmlp_previous = m.config._experts_implementation
            if id(m) not in ids and not getattr(m, "_fusedmlp_skip", None):
                m._fusedmlp_skip = "fusedmlp.patch did not take it (see its report)"
    setter = getattr(model, "set_experts_implementation", None)
    if callable(setter):
        try:
            setter("fusedmlp")
        except (ValueError, RuntimeError, KeyError):
            pass  # e.g. an implementation locked at load time; the configs are set below
    for m in chosen:
        if m.config._experts_implementation != "fusedmlp":
            m.config._experts_implementation = "fusedmlp"
