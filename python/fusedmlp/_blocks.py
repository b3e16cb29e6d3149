"""fusedmlp.patch's dense MLP blocks: the plans for what _structure finds in a module and in
its parent (whole MLP modules, chains inside a layer's forward, and their pre-norms)."""

import dataclasses

import torch
from torch import nn

from . import _fp8
from . import _structure as st
from .torch import FusedMLP


@dataclasses.dataclass
class Plan:
    """One replacement patch() may make: `swaps` (owner module, attribute, new module) are
    set together, after `fused` matched `original` on the probe."""
    name: str
    swaps: list  # [(owner, attribute, replacement)]
    original: object  # callable(x) -> reference output
    fused: object  # callable(x) -> fused output
    d_in: int
    weight: torch.Tensor
    detail: str
    select: object = None  # callable(x) -> bool [rows]: the probe rows to compare
    probe_rows: int = 8  # rows of the default probe
    linear: bool = False  # a FusedLinear (report.linears) rather than an MLP block
    experts: nn.Module = None  # a registry experts module switched to fusedmlp (no swaps)
    covers: tuple = ()  # qualified names of the modules it takes over (for the report)
    x_dtype: torch.dtype = None  # the probe's dtype where it is not the weight's (fp8 weights)


class Passthrough(nn.Module):
    """Stands in for a norm (or an activation, a second linear) whose work moved into a fused
    MLP: returns its first input."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class FusedBlock(nn.Module):
    """A FusedMLP in place of an MLP module whose forward takes more than x: binds the call to
    the original forward's signature, adds the residual input it took (or x itself) in the
    fused op, and applies the post module it had (a norm after the residual add)."""

    def __init__(self, fused, signature, x, residual=None, post=None):
        super().__init__()
        self.fused, self.post = fused, post
        self._signature, self._x, self._residual = signature, x, residual

    def forward(self, *args, **kwargs):
        bound = self._signature.bind(*args, **kwargs).arguments
        x = bound[self._x]
        residual = None if self._residual is None else (
            x if self._residual == "" else bound[self._residual])
        y = self.fused(x, residual)
        return y if self.post is None else self.post(y)

    def extra_repr(self):
        r = {None: "", "": ", residual x"}.get(self._residual, f", residual {self._residual}")
        return f"x={self._x}{r}"


def _norm_choice(tr, value, d_in, fuse_norm):
    """(norm qualified name, FusedMLP norm kwargs, note) for the value a chain or block takes in
    graph tr: a norm module called once whose output feeds nothing else, and that
    identify_norm expresses; (None, None, note) otherwise."""
    if not isinstance(value, torch.fx.Node) or value.op != "call_module" \
            or not st.is_simple_leaf(tr.submodule(value)) \
            or st.linear_kind(tr.submodule(value)) is not None:
        return None, None, "no norm feeds it"
    name = tr.target(value)
    if not fuse_norm:
        return None, None, f"norm {name} not fused (fuse_norm=False)"
    if tr.calls()[name] != 1:
        return None, None, f"norm {name} stays a torch op: it is called more than once"
    reads = st.reads_into(tr, name)
    if reads:  # e.g. x.to(self.norm.weight.dtype): the stand-in has no weight to read
        return None, None, f"norm {name} stays a torch op: the forward also reads {reads[0]}"
    if len(value.users) != 1:
        others = [u for u in value.users]
        return None, None, (f"norm {name} stays a torch op: its output also feeds "
                            f"{st.describe_nodes(tr, others[1:] if len(others) > 1 else others)}")
    kw, why = st.identify_norm(tr.submodule(value), d_in)
    if kw is None:
        return None, None, f"norm {name} stays a torch op: {why}"
    return name, kw, f"pre-norm {name} fused: {why}"


def _owner(root, qualname):
    owner, _, attr = qualname.rpartition(".")
    return (root.get_submodule(owner) if owner else root), attr


def block_plan(name, parent, attr, module, block, norm, backend):
    """The plan replacing MLP module `module` (parent.attr) by a FusedMLP (or a FusedBlock
    when its forward takes more than x); norm = (parent norm name, kwargs, note) from the
    parent's graph, fused when kwargs is given."""
    tr, chain = block.trace, block.chain
    kw = chain.weights(tr)
    notes = []
    if block.pre_norm is not None:
        inner_kw, why = st.identify_norm(module.get_submodule(block.pre_norm),
                                         kw["w1"].shape[1])
        if inner_kw is None:
            raise NotImplementedError(f"its own norm {block.pre_norm}: {why}")
        kw.update(inner_kw)
        notes.append(f"its norm {block.pre_norm} fused: {why}")
    norm_name, norm_kw, norm_note = norm
    if norm_kw is not None and block.pre_norm is not None:
        norm_name, norm_kw, norm_note = None, None, "it has a norm of its own"
    if norm_kw is not None:
        kw.update(norm_kw)
    notes.append(norm_note)
    fused = FusedMLP(**kw, backend=backend).train(module.training)
    sig = st.forward_signature(module)
    simple = (block.residual is None and block.post is None and sig is not None
              and len(sig.parameters) == 1)
    residual_name = block.residual
    new = fused if simple else FusedBlock(
        fused, sig, tr.params[0], residual_name,
        None if block.post is None else module.get_submodule(block.post)).train(module.training)
    swaps = [(parent, attr, new)]
    norm_module = None
    if norm_kw is not None:
        norm_module = parent.get_submodule(norm_name)
        owner, norm_attr = _owner(parent, norm_name)
        swaps.append((owner, norm_attr, Passthrough().train(norm_module.training)))
    d_out = fused.d_out

    def original(x, module=module, norm_module=norm_module):
        h = x if norm_module is None else norm_module(x)
        if residual_name is None:
            return module(h)
        r = _probe_residual(x, d_out)
        return module(h) if residual_name == "" else module(h, r)

    def run_fused(x, new=new):
        if residual_name is None:
            return new(x)
        return new(x) if residual_name == "" else new(x, _probe_residual(x, d_out))

    what = "gated " if fused.gated else ""
    extras = [s for s, on in ((f"+ {residual_name or 'x'}", residual_name is not None),
                              (f"then {block.post}", block.post is not None)) if on]
    detail = (f"{type(module).__name__} ({', '.join(chain.linears(tr))}, {what}"
              f"{fused.activation}{', ' + ' '.join(extras) if extras else ''}) -> FusedMLP "
              f"({fused.extra_repr()}); {'; '.join(notes)}")
    covers = (name,) + ((f"{name.rpartition('.')[0]}.{norm_name}".lstrip("."),)
                        if norm_kw is not None else ())
    return Plan(name, swaps, original, run_fused, fused.d_in, fused.w1, detail, covers=covers,
                x_dtype=_fp8.activation_dtype(parent, module))


def _probe_residual(x, d_out):
    gen = torch.Generator().manual_seed(2)
    return torch.randn(x.shape[0], d_out, generator=gen).to(device=x.device, dtype=x.dtype)


class NotInPlace(NotImplementedError):
    """A chain inside a forward whose ops are not all child modules (a gate product, a torch
    function as activation): swapping modules cannot replace it."""


def inline_plan(prefix, parent, tr, chain, norm, backend):
    """The plan replacing a chain inside parent's forward in place: L1 by the fused MLP (with
    the pre-norm when norm's kwargs are given), the activation and L2 by passthroughs."""
    if chain.gated or chain.act_module is None:
        raise NotInPlace(
            f"it is computed inside {type(parent).__name__}.forward with "
            f"{'a gate product' if chain.gated else 'a torch-function activation'}, which "
            "cannot be swapped without rewriting that forward")
    casts = [n for n in chain.identities if st.is_cast(n)]
    if casts:
        raise NotInPlace(f"it is computed inside {type(parent).__name__}.forward with a cast "
                         f"({st.describe_nodes(tr, casts)}), which would then act on the fused "
                         "output")
    if chain.active_dropout:
        raise NotImplementedError(f"dropout in training mode ({', '.join(chain.active_dropout)});"
                                  " call model.eval() (fusedmlp is inference-only)")
    calls = tr.calls()
    act = tr.target(chain.act_module)
    members = [tr.target(chain.l1), act, tr.target(chain.l2)]
    members += [tr.target(n) for n in chain.identities if n.op == "call_module"]
    for m in members:
        if calls[m] != 1:
            raise NotImplementedError(f"{m} is called {calls[m]} times in "
                                      f"{type(parent).__name__}.forward")
        if st.reads_into(tr, m):
            raise NotImplementedError(f"{type(parent).__name__}.forward reads "
                                      f"{st.reads_into(tr, m)[0]}")
    kw = chain.weights(tr)
    norm_name, norm_kw, norm_note = norm
    if norm_kw is not None:
        kw.update(norm_kw)
    l1 = tr.submodule(chain.l1)
    fused = FusedMLP(**kw, backend=backend).train(l1.training)
    swaps = []
    for qual, new in ((members[0], fused), (members[1], Passthrough()),
                      (members[2], Passthrough())):
        owner, attr = _owner(parent, qual)
        swaps.append((owner, attr, new.train(l1.training)))
    modules = [parent.get_submodule(m) for m in members[:3]]
    norm_module = None
    if norm_kw is not None:
        norm_module = parent.get_submodule(norm_name)
        owner, attr = _owner(parent, norm_name)
        swaps.append((owner, attr, Passthrough().train(norm_module.training)))

    def original(x):
        h = x if norm_module is None else norm_module(x)
        return modules[2](modules[1](modules[0](h)))

    full = [f"{prefix}.{m}" if prefix else m for m in members[:3]]
    name = f"{full[0]}+{full[2]}"
    detail = (f"{type(parent).__name__}'s {members[0]} -> {act} -> {members[2]} ({fused.activation}"
              f") -> FusedMLP ({fused.extra_repr()}) in place; {norm_note}")
    covers = tuple(full) + ((f"{prefix}.{norm_name}" if prefix else norm_name,)
                            if norm_kw is not None else ())
    return Plan(name, swaps, original, fused, fused.d_in, fused.w1, detail, covers=covers,
                x_dtype=_fp8.activation_dtype(parent))
