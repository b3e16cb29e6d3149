"""How fusedmlp.patch finds MLP blocks: by what their forward computes, not by attribute names.

The rule. A module's forward is traced with torch.fx, its children left opaque (each call of a
child is one node; the forward runs with its default arguments on Proxy tensors, so the graph
is the path those defaults take). In such a graph an MLP chain is

    x -> L1 -> act -> [dropout] -> L2             dense
    act(Lg(x)) * Lu(x) -> [dropout] -> L2          gated: Lg and Lu two linears of the same x,
                                                   or the two halves of one linear's output
                                                   (chunk / split in two on the last dim)

where L1, Lg, Lu and L2 are nn.Linear or transformers Conv1D children and act is whatever the
graph computes from L1's (Lg's) output alone (a child module, a torch function, a run of
elementwise ops) provided it equals relu, gelu, gelu_tanh, silu or relu2 numerically on a grid of
inputs (identify_activation). Dropouts are identities in eval mode; an active one (training
mode, p > 0) is a reason to skip.

- analyse_block: a module whose graph is one chain and nothing else is an MLP block. x may
  first pass through a norm child of the module (moved into the fused op when identify_norm
  expresses it), and the chain's output may get `+ residual` (a second forward input, or x
  itself) and then one child module (a post-norm). patch replaces the whole module.
- analyse_parent: in the graph of a module that holds a chain among other work (a decoder layer
  calling fc1, activation_fn and fc2 itself beside its attention; BERT's intermediate.dense ->
  intermediate_act_fn -> output.dense across two small children, which are traced through), the
  chain is replaced in place when every op of it is a child module called once (L1 -> activation
  module -> [dropout] -> L2): L1 becomes the fused MLP, the activation and L2 pass their input
  through. The same graph decides the pre-norm of its MLP blocks and chains: a norm child whose
  output feeds only the block (one call, one user) moves into the fused op when identify_norm
  expresses it (LayerNorm or RMSNorm with weight w, 1 + w or none, found numerically on rows
  of ordinary and of tiny magnitude, where a wrong eps shows), and passes its input through.
  Otherwise the norm stays a torch op; the reason goes to the report.

The numeric identification (identify_activation, identify_norm) lives in _identify.py. patch
confirms every replacement with its probe (fused against the original modules on random rows)
before anything is swapped.
"""

import collections
import dataclasses
import functools
import inspect
import operator
import re
import warnings

import torch
import torch.fx as fx
from torch import nn

from . import _fp8
from ._identify import identify_activation, identify_norm, is_simple_leaf
from .torch import _is_conv1d

# ---- tracing ----


class Untraceable(Exception):
    """torch.fx could not trace the forward (data-dependent control flow, ...)."""


class _Tracer(fx.Tracer):
    """Traces through the root wrapper, its module `m` and the qualified names in `inline`;
    every other module is a leaf."""

    def __init__(self, inline):
        super().__init__()
        self.inline = inline

    def is_leaf_module(self, m, qualname):
        return qualname not in self.inline


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def forward_signature(module):
    """inspect.Signature of module.forward (bound: no self), or None."""
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


class Trace:
    """A traced forward: its graph and the forward parameters that became placeholders."""

    def __init__(self, module, graph, root, params):
        self.module, self.graph, self.root, self.params = module, graph, root, params
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in graph.nodes if n.op == "output")
        self._order = {n: i for i, n in enumerate(graph.nodes)}

    def target(self, node):
        """The qualified name (under the traced module) that a call_module / get_attr names."""
        return node.target[2:] if node.target.startswith("m.") else node.target

    def submodule(self, node):
        return self.module.get_submodule(self.target(node))

    def calls(self):
        """How often each module (qualified name) is called."""
        return collections.Counter(self.target(n) for n in self.graph.nodes
                                   if n.op == "call_module")

    def attributes(self):
        """Qualified names read as attributes (get_attr: parameters, buffers)."""
        return [self.target(n) for n in self.graph.nodes if n.op == "get_attr"]

    def sort(self, nodes):
        return sorted(nodes, key=self._order.get)


def trace(module, inline=()):
    """Trace of module.forward: children opaque except the qualified names in `inline`, traced
    through. The first parameter and the required ones become placeholders, the others keep
    their defaults. Raises Untraceable with the reason."""
    sig = forward_signature(module)
    params = list(sig.parameters.values()) if sig is not None else []
    if not params or params[0].kind not in _POSITIONAL:
        raise Untraceable(f"{type(module).__name__}.forward takes no named first input")
    required = [p for p in params[1:] if p.default is inspect.Parameter.empty
                and p.kind in _POSITIONAL + (inspect.Parameter.KEYWORD_ONLY,)]
    names = [params[0].name] + [p.name for p in required]
    args = [params[0].name] + [p.name if p.kind in _POSITIONAL else f"{p.name}={p.name}"
                               for p in required]
    namespace = {}
    exec(f"def forward(self, {', '.join(names)}):\n    return self.m({', '.join(args)})\n",
         namespace)
    root = type("_TraceRoot", (nn.Module,), {"forward": namespace["forward"]})()
    root.m = module
    tracer = _Tracer({"", "m"} | {f"m.{q}" for q in inline})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = tracer.trace(root)
    except Exception as e:  # noqa: BLE001 - any failure means "not understood"
        line = (str(e).strip().split("\n") or [""])[0][:120]
        raise Untraceable(f"torch.fx cannot trace {type(module).__name__}.forward "
                          f"({type(e).__name__}: {line})") from None
    return Trace(module, graph, root, names)


# ---- module and node kinds ----

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def linear_kind(m):
    """"linear" (an nn.Linear: weight [out, in]), "conv1d" (transformers Conv1D, weight [in,
    out]), "fp8" (an nn.Linear holding e4m3 weights and their scales, _fp8.py) or None. An
    nn.Linear subclass with its own forward counts when its weight is a plain float tensor
    (Falcon's FalconLinear computes x @ W^T itself); other quantized ones, whose weight is a
    tensor subclass or an integer tensor, do not. Either way the probe compares the fused result
    with the modules' own (fp8 ones: with their weights dequantised)."""
    if _fp8.is_fp8_linear(m):
        return "fp8"
    if isinstance(m, nn.Linear):
        w = m.weight
        if type(m).forward is nn.Linear.forward or (
                type(w) in (torch.Tensor, nn.Parameter) and w.dtype in _FLOATS and w.dim() == 2):
            return "linear"
        return None
    if _is_conv1d(m):
        return "conv1d"
    return None


def in_features(m):
    """The input width of a linear (nn.Linear or Conv1D)."""
    return int(m.weight.shape[0] if linear_kind(m) == "conv1d" else m.weight.shape[1])


def linear_weight(m):
    """(weight [out, in], bias) of a linear: nn.Linear's own, a Conv1D's transposed copy."""
    if linear_kind(m) == "conv1d":
        return m.weight.t().contiguous(), m.bias
    return m.weight, m.bias


def linear_scale(m):
    """The fp32 weight scale of an fp8 linear as fusedmlp takes it (_fp8.fp8_scale), or None
    for a float one."""
    return _fp8.fp8_scale(m) if linear_kind(m) == "fp8" else None


# Class names that say MLP (for the report's list of what was not replaced; detection never
# looks at names): the usual suffixes.
_MLP_NAME = re.compile(r"(mlp|feed_?forward|ffn|ffw|experts?|dense(gated)?(act|relu)dense)$",
                       re.IGNORECASE)


def named_like_mlp(m):
    return bool(_MLP_NAME.search(type(m).__name__))


def _is_linear_node(tr, node):
    return node.op == "call_module" and linear_kind(tr.submodule(node)) is not None


_DROPOUT_FUNCTIONS = {torch.nn.functional.dropout, torch.dropout, torch.nn.functional.alpha_dropout}


def _identity_state(tr, node):
    """None when node is no identity op; else (active, description): dropout (active in training
    with p > 0), nn.Identity, .contiguous()."""
    if node.op == "call_module":
        m = tr.submodule(node)
        if isinstance(m, nn.Identity):
            return False, "identity"
        if isinstance(m, nn.modules.dropout._DropoutNd):
            return bool(m.training and m.p > 0), f"{tr.target(node)} (p={m.p})"
        return None
    if node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return bool(training and p), f"dropout(p={p})"
    if node.op == "call_method" and node.target == "contiguous":
        return False, "contiguous"
    if is_cast(node):
        return False, f".{node.target}()"
    return None


_CASTS = ("float", "half", "bfloat16", "double", "type_as")


def is_cast(node):
    """A dtype cast: x.float() / .half() / .bfloat16() / .double(), x.type_as(y), x.to(dtype)
    with a dtype (or another value's .dtype) and nothing else. In fp32 an identity; in 16-bit
    models the fused op keeps these intermediates in fp32 anyway."""
    if node.op != "call_method" or not node.args:
        return False
    if node.target in _CASTS:
        return not node.kwargs and len(node.args) == (2 if node.target == "type_as" else 1)
    if node.target == "to" and len(node.args) == 2 and not node.kwargs:
        dtype = node.args[1]
        return isinstance(dtype, torch.dtype) or (
            isinstance(dtype, fx.Node) and _is_metadata(dtype, "dtype"))
    return False


def _is_metadata(node, attrs=("dtype", "device", "shape")):
    """getattr(x, "dtype"/"device"/"shape") or x.size() / x.dim(): a use of x's metadata, not
    its values."""
    if isinstance(attrs, str):
        attrs = (attrs,)
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return node.args[1] in attrs
    return node.op == "call_method" and node.target in ("size", "dim") and "shape" in attrs


def data_users(node):
    """node's users that read its values (not its dtype, device or shape)."""
    return [u for u in node.users if not _is_metadata(u)]


def _skip_identities(tr, node, stepped, active):
    """node after stepping back over identity ops; the nodes stepped over go to `stepped`, the
    active dropouts among them to `active`."""
    while isinstance(node, fx.Node):
        state = _identity_state(tr, node)
        if state is None or not node.args or not isinstance(node.args[0], fx.Node):
            return node
        if state[0]:
            active.append(state[1])
        stepped.append(node)
        node = node.args[0]
    return node


def _inputs(node):
    found = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


_MUL = {operator.mul, torch.mul, torch.Tensor.mul}
_ADD = {operator.add, torch.add, torch.Tensor.add}


def _is_binary(node, functions, method):
    return ((node.op == "call_function" and node.target in functions)
            or (node.op == "call_method" and node.target == method)) \
        and len(node.args) == 2 and not node.kwargs


def _split_piece(tr, node):
    """(linear node, index) when node is getitem(chunk / split of a linear's output into two
    equal halves along dim -1, index); else None."""
    if not (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and node.args[1] in (0, 1)):
        return None
    split = node.args[0]
    name = split.target if split.op == "call_method" else getattr(split.target, "__name__", "")
    if split.op not in ("call_method", "call_function") or name not in ("chunk", "split") \
            or not split.args or not isinstance(split.args[0], fx.Node) \
            or not _is_linear_node(tr, split.args[0]):
        return None
    source = split.args[0]
    rest = list(split.args[1:])
    size = rest.pop(0) if rest else split.kwargs.get(
        "chunks", split.kwargs.get("split_size", split.kwargs.get("split_size_or_sections")))
    dim = rest.pop(0) if rest else split.kwargs.get("dim", 0)
    out = linear_weight(tr.submodule(source))[0].shape[0]
    halves = (size == 2) if name == "chunk" else (size == out // 2
                                                   or list(size or ()) == [out // 2] * 2)
    return (source, node.args[1]) if dim == -1 and halves and out % 2 == 0 else None


def describe_nodes(tr, nodes):
    out = []
    for n in nodes:
        if n.op == "call_module":
            out.append(f"{tr.target(n)} ({type(tr.submodule(n)).__name__})")
        elif n.op == "call_method":
            out.append(f".{n.target}()")
        elif n.op == "get_attr":
            out.append(f"the attribute {tr.target(n)}")
        else:
            out.append(f"{getattr(n.target, '__name__', str(n.target))}()")
    return ", ".join(out[:4]) + (", ..." if len(out) > 4 else "")


# ---- chains ----

class NotAChain(Exception):
    pass


class UnsupportedChain(Exception):
    """An MLP chain fusedmlp cannot express (its activation, an active dropout, ...)."""


@dataclasses.dataclass
class Chain:
    """An MLP chain of a traced graph (see the module docstring)."""
    l1: fx.Node  # the gate linear (gated) or the first linear (dense)
    l2: fx.Node
    x: fx.Node  # the value both first linears take
    activation: str
    act_nodes: list  # the nodes computing act, in graph order
    top: fx.Node  # the node feeding L2 after the identities: act's output or the product
    up: fx.Node = None  # a separate up linear (gated)
    halves: tuple = None  # (gate index, up index) when L1's output is split (fused gate_up)
    identities: list = dataclasses.field(default_factory=list)
    active_dropout: list = dataclasses.field(default_factory=list)

    @property
    def gated(self):
        return self.up is not None or self.halves is not None

    @property
    def act_module(self):
        """The activation's node when it is one call of a child module, else None."""
        nodes = self.act_nodes
        return nodes[0] if len(nodes) == 1 and nodes[0].op == "call_module" else None

    def nodes(self):
        out = {self.l1, self.l2, self.up, self.top, *self.act_nodes, *self.identities}
        if self.halves is not None:
            split = next(iter(self.l1.users))
            out |= {split, *split.users}
        return {n for n in out if n is not None}

    def linears(self, tr):
        return [tr.target(n) for n in (self.l1, self.up, self.l2) if n is not None]

    def weights(self, tr):
        """FusedMLP keyword arguments for the chain's linears and activation (fp8 linears: their
        scales too)."""
        mods = [tr.submodule(n) for n in (self.l1, self.up, self.l2) if n is not None]
        kinds = {linear_kind(m) == "fp8" for m in mods}
        if len(kinds) > 1:
            raise NotImplementedError("its linears mix e4m3 and float weights; fusedmlp takes "
                                      "one weight dtype per MLP")
        l1 = tr.submodule(self.l1)
        wg, bg = linear_weight(l1)
        sg = linear_scale(l1)
        w2, b2 = linear_weight(tr.submodule(self.l2))
        kw = dict(w2=w2, b2=b2, activation=self.activation, gated=self.gated)
        if sg is not None:
            kw["w2_scale"] = linear_scale(tr.submodule(self.l2))
        if not self.gated:
            return dict(kw, w1=wg, b1=bg, **({} if sg is None else {"w1_scale": sg}))
        if self.up is not None:
            up = tr.submodule(self.up)
            wu, bu = linear_weight(up)
            if (bg is None) != (bu is None):
                raise NotImplementedError("the gate and up linears disagree on having a bias")
            if sg is not None:
                kw.update(w1_scale=sg, w_up_scale=linear_scale(up))
            return dict(kw, w1=wg, b1=bg, w_up=wu, b_up=bu)
        half = wg.shape[0] // 2
        if sg is not None:  # the halves' scales, as separate gate and up scales
            s_lo, s_hi = _fp8.split_rows(sg, wg.shape[0], half)
            first_gate = self.halves[0] == 0
            kw.update(w1_scale=s_lo if first_gate else s_hi,
                      w_up_scale=s_hi if first_gate else s_lo)
        if self.halves[0] == 0:  # gate rows, then up rows
            if sg is None:  # fusedmlp's stacked layout as it is
                return dict(kw, w1=wg, b1=bg)
            return dict(kw, w1=wg[:half], w_up=wg[half:], b1=None if bg is None else bg[:half],
                        b_up=None if bg is None else bg[half:])
        return dict(kw, w1=wg[half:], w_up=wg[:half], b1=None if bg is None else bg[half:],
                    b_up=None if bg is None else bg[:half])


def _act_subgraph(tr, top, source):
    """The nodes computing `top` from `source` alone (source excluded), in graph order. Raises
    NotAChain when top depends on anything else or an inner value is used outside."""
    seen, stack = set(), [top]
    while stack:
        n = stack.pop()
        if n is source or n in seen:
            continue
        if n.op not in ("call_function", "call_method", "call_module") or _is_linear_node(tr, n):
            raise NotAChain(f"{n.name} is not a function of {source.name} alone")
        if n.op == "call_module" and list(tr.submodule(n).parameters()) and \
                _norm_like(tr.submodule(n)):
            raise NotAChain(f"{tr.target(n)} is a norm, not an activation")
        seen.add(n)
        stack.extend(_inputs(n))
    if any(u not in seen for n in seen if n is not top for u in data_users(n)):
        raise NotAChain("a value inside the activation is also used outside it")
    if any(u not in seen for u in data_users(source)):
        raise NotAChain(f"{source.name} is also used outside the activation")
    return tr.sort(seen)


def _norm_like(m):
    """A module identify_norm expresses at its own width (a norm found inside what would be
    an activation: linear -> act -> norm -> linear is a head, not an MLP)."""
    params = list(m.parameters(recurse=False))
    return bool(params) and params[0].dim() == 1 and \
        identify_norm(m, params[0].shape[0])[0] is not None


def _subgraph_fn(tr, nodes, source):
    """A function evaluating `nodes` (the last one's value) from a tensor standing for source,
    node by node (no code generation: this runs once per chain)."""
    def run(x):
        env = {source: x}
        load = lambda a: fx.node.map_arg(a, env.__getitem__)  # noqa: E731
        for n in nodes:
            args, kwargs = load(n.args), load(n.kwargs)
            if n.op == "call_module":
                env[n] = tr.root.get_submodule(n.target)(*args, **kwargs)
            elif n.op == "call_method":
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
            else:
                env[n] = n.target(*args, **kwargs)
        return env[nodes[-1]]
    return run


def _activation_key(tr, nodes, source):
    """A key under which the activation's identity can be cached (the same ops on the same
    parameter-free modules compute the same function), or None."""
    index = {source: -1, **{n: i for i, n in enumerate(nodes)}}
    key = []
    for n in nodes:
        target = n.target
        if n.op == "call_module":
            m = tr.root.get_submodule(n.target)
            if list(m.parameters()) or list(m.buffers()):
                return None
            target = (type(m), repr(m))
        elif n.op == "call_function":
            target = getattr(target, "__qualname__", None) and (target.__module__,
                                                                 target.__qualname__)
            if target is None:
                return None
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", index[a]))
        key.append((n.op, target, repr(args)))
    return tuple(key)


_ACTIVATION_CACHE = {}


def _activation(tr, top, source, width):
    nodes = _act_subgraph(tr, top, source)
    if not nodes:
        raise NotAChain("no activation between the linears")
    key = _activation_key(tr, nodes, source)
    found = _ACTIVATION_CACHE.get(key) if key is not None else None
    if found is None:
        weight = next(tr.module.parameters(), None)
        found = identify_activation(_subgraph_fn(tr, nodes, source), width,
                                    "cpu" if weight is None else weight.device)
        if key is not None and len(_ACTIVATION_CACHE) < 1024:
            _ACTIVATION_CACHE[key] = found
    name, why = found
    if name is None:
        raise UnsupportedChain(f"the activation {describe_nodes(tr, nodes)} has no fusedmlp "
                               f"equivalent: {why}")
    return name, nodes


def _linear_sources(tr, top):
    """The linear nodes (and split pieces of linears) that `top` is computed from."""
    seen, stack, found = set(), [top], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_linear_node(tr, n) or _split_piece(tr, n) is not None:
            found.add(n)
        elif n.op in ("call_function", "call_method", "call_module"):
            stack.extend(_inputs(n))
        else:
            found.add(n)  # a placeholder or an attribute: not a chain
    return found


def _chain_input(tr, linear, stepped, active):
    x = linear.args[0] if len(linear.args) == 1 and not linear.kwargs else None
    if not isinstance(x, fx.Node):
        raise NotAChain(f"{tr.target(linear)} is not called on one tensor")
    return _skip_identities(tr, x, stepped, active)


def chain_ending_at(tr, l2):
    """The chain whose second linear is node l2; NotAChain or UnsupportedChain otherwise."""
    if len(l2.args) != 1 or l2.kwargs or not isinstance(l2.args[0], fx.Node):
        raise NotAChain(f"{tr.target(l2)} is not called on one tensor")
    stepped, active = [], []
    top = _skip_identities(tr, l2.args[0], stepped, active)
    if len(data_users(top)) != 1 or any(len(data_users(n)) != 1 for n in stepped):
        raise NotAChain("the value before the second linear is also used elsewhere")
    if _is_binary(top, _MUL, "mul"):
        chain = _gated(tr, l2, top, stepped, active)
    else:
        sources = _linear_sources(tr, top)
        source = next(iter(sources)) if len(sources) == 1 else None
        if source is None or not _is_linear_node(tr, source):
            raise NotAChain("the second linear's input is not act(linear(x))")
        width = linear_weight(tr.submodule(source))[0].shape[0]
        activation, act_nodes = _activation(tr, top, source, width)
        x = _chain_input(tr, source, stepped, active)
        chain = Chain(source, l2, x, activation, act_nodes, top, identities=stepped,
                      active_dropout=active)
    return chain


def _gated(tr, l2, mul, stepped, active):
    a, b = mul.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        raise NotAChain("a product with a constant before the second linear")
    for act_top, up_value in ((a, b), (b, a)):
        up_stepped = []
        up = _skip_identities(tr, up_value, up_stepped, active)
        if len(data_users(up)) != 1 or any(len(data_users(n)) != 1 for n in up_stepped):
            continue
        piece = _split_piece(tr, up)
        if piece is not None:  # act(half g) * half u of one linear's output
            source, up_index = piece
            sources = _linear_sources(tr, act_top)
            gate = next(iter(sources)) if len(sources) == 1 else None
            if gate is None or _split_piece(tr, gate) != (source, 1 - up_index):
                continue
            split = up.args[0]
            if len(data_users(source)) != 1 or set(data_users(split)) != {up, gate}:
                continue
            width = linear_weight(tr.submodule(source))[0].shape[0] // 2
            activation, act_nodes = _activation(tr, act_top, gate, width)
            stepped += up_stepped
            x = _chain_input(tr, source, stepped, active)
            return Chain(source, l2, x, activation, act_nodes, mul,
                         halves=(1 - up_index, up_index), identities=stepped,
                         active_dropout=active)
        if _is_linear_node(tr, up):  # act(Lg(x)) * Lu(x)
            sources = _linear_sources(tr, act_top)
            gate = next(iter(sources)) if len(sources) == 1 else None
            if gate is None or gate is up or not _is_linear_node(tr, gate):
                continue
            width = linear_weight(tr.submodule(gate))[0].shape[0]
            activation, act_nodes = _activation(tr, act_top, gate, width)
            stepped += up_stepped
            x = _chain_input(tr, gate, stepped, active)
            if _chain_input(tr, up, stepped, active) is not x:
                raise NotAChain("the gate and up linears take different inputs")
            return Chain(gate, l2, x, activation, act_nodes, mul, up=up, identities=stepped,
                         active_dropout=active)
    raise NotAChain("the product before the second linear is not act(gate) * up")


def find_chains(tr):
    """(chains, unsupported): the chains of the graph, and (linear names, reason) for chains
    fusedmlp cannot express."""
    chains, unsupported = [], []
    for node in tr.graph.nodes:
        if _is_linear_node(tr, node):
            try:
                chains.append(chain_ending_at(tr, node))
            except UnsupportedChain as e:
                unsupported.append(([tr.target(node)], str(e)))
            except NotAChain:
                pass
    return chains, unsupported


def half_chains(tr, taken):
    """Linears (names) whose output goes through a supported activation module and then leaves
    the graph or enters a module that is not traced through: an MLP whose second half is out of
    sight. `taken`: nodes already part of a chain."""
    found = []
    for node in tr.graph.nodes:
        if not _is_linear_node(tr, node) or node in taken or len(node.users) != 1:
            continue
        act = next(iter(node.users))
        if act.op != "call_module" or linear_kind(tr.submodule(act)) is not None:
            continue
        opaque = [u for u in act.users if u.op == "output" or (
            u.op == "call_module" and not is_simple_leaf(tr.submodule(u))
            and linear_kind(tr.submodule(u)) is None)]
        if not act.users or len(opaque) != len(act.users):
            continue
        width = linear_weight(tr.submodule(node))[0].shape[0]
        device = linear_weight(tr.submodule(node))[0].device
        if identify_activation(tr.submodule(act), width, device)[0] is not None:
            found.append((tr.target(node), act))
    return found


# ---- blocks ----

@dataclasses.dataclass
class Block:
    """A module whose forward is one MLP chain (analyse_block)."""
    trace: Trace
    chain: Chain
    pre_norm: str = None  # a child norm applied to x first (qualified name)
    residual: str = None  # forward parameter added to the output ("" + x itself)
    post: str = None  # a child module applied last


def _first_param_node(tr):
    return tr.placeholders[0]


def analyse_block(module, tr=None):
    """Block when module's forward is one MLP chain (see the module docstring); raises
    Untraceable, NotAChain (not an MLP block: the reason) or UnsupportedChain (an MLP block
    fusedmlp cannot express: the reason). tr: module's trace when there is one already."""
    tr = trace(module) if tr is None else tr
    chains, unsupported = find_chains(tr)
    if not chains:
        if unsupported:
            raise UnsupportedChain(unsupported[0][1])
        raise NotAChain("its forward has no linear -> activation -> linear chain")
    if len(chains) > 1:
        raise NotAChain(f"its forward has {len(chains)} linear -> activation -> linear chains")
    chain = chains[0]
    x0 = _first_param_node(tr)
    covered = set(chain.nodes()) | {tr.output, *tr.placeholders}
    pre_norm, pre_stepped = None, []
    x = chain.x
    if x is not x0:
        if x.op != "call_module" or not is_simple_leaf(tr.submodule(x)) or len(x.args) != 1 \
                or x.kwargs or tr.calls()[tr.target(x)] != 1:
            raise NotAChain(f"its linears take {describe_nodes(tr, [x])} of the input")
        inner = _skip_identities(tr, x.args[0], pre_stepped, chain.active_dropout)
        if inner is not x0:
            raise NotAChain(f"its linears take {describe_nodes(tr, [x])} of a computed value")
        pre_norm = tr.target(x)
        covered |= {x, *pre_stepped}
    # the tail: [identities] [+ residual] [post module] -> output
    node, residual, post = chain.l2, None, None
    tail = []

    def step(n):
        users = data_users(n)
        return users[0] if len(users) == 1 else None
    nxt = step(node)  # casts stay out of the tail: the output keeps the dtype L2 gave it
    while nxt is not None and _identity_state(tr, nxt) is not None and nxt.args[0] is node \
            and not is_cast(nxt):
        if _identity_state(tr, nxt)[0]:
            chain.active_dropout.append(_identity_state(tr, nxt)[1])
        tail.append(nxt)
        node, nxt = nxt, step(nxt)
    if nxt is not None and _is_binary(nxt, _ADD, "add"):
        other = nxt.args[1] if nxt.args[0] is node else nxt.args[0]
        if isinstance(other, fx.Node) and other.op == "placeholder":
            residual = "" if other is x0 else other.target
            tail.append(nxt)
            node, nxt = nxt, step(nxt)
    if nxt is not None and nxt.op == "call_module" and len(nxt.args) == 1 and not nxt.kwargs \
            and linear_kind(tr.submodule(nxt)) is None:
        post = tr.target(nxt)
        tail.append(nxt)
        node, nxt = nxt, step(nxt)
    if nxt is not tr.output or tr.output.args[0] is not node:
        raise NotAChain(f"its output is not the chain's result ({describe_nodes(tr, [nxt])}"
                        " follows)" if nxt is not None and nxt is not tr.output else
                        "its output is not the chain's result alone")
    covered |= set(tail)
    covered |= {n for n in tr.graph.nodes if _is_metadata(n) and n.args[0] in covered}
    extra = [n for n in tr.graph.nodes if n not in covered]
    if extra:
        raise NotAChain(f"its forward also computes {describe_nodes(tr, extra)}")
    used = [p for p in tr.placeholders[1:] if p.users and p.target != residual]
    if used:
        raise NotAChain(f"its output depends on the input {used[0].target} as well")
    if chain.active_dropout:
        raise UnsupportedChain(f"dropout in training mode ({', '.join(chain.active_dropout)}); "
                               "call model.eval() (fusedmlp is inference-only)")
    return Block(tr, chain, pre_norm, residual, post)


def parent_inline_candidates(module, opaque):
    """Direct children traced through in the parent's graph: halves of an MLP split across two
    modules (BERT's intermediate and output), i.e. modules holding exactly one linear and
    otherwise simple leaves, except those in `opaque` (ids)."""
    out = []
    for name, child in module.named_children():
        kids = list(child.children())
        if id(child) in opaque or linear_kind(child) is not None:
            continue
        if sum(linear_kind(k) is not None for k in kids) == 1 and \
                all(linear_kind(k) is not None or is_simple_leaf(k) for k in kids):
            out.append(name)
    return out


def reads_into(tr, name):
    """Attributes of module `name`'s insides that the traced graph reads (get_attr)."""
    return [a for a in tr.attributes() if a.startswith(name + ".")]


@functools.lru_cache(maxsize=256)
def _class_source(cls):
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def source_reads(parent, child_name, inner_names):
    """Why the parent's class source reads `<child_name>.<inner>` for an inner name (a parent
    that would break once the child is replaced by a module without those), or None."""
    src = _class_source(type(parent))
    for inner in inner_names:
        if re.search(rf"\b{re.escape(child_name)}\s*\.\s*{re.escape(inner)}\b", src):
            return f"{type(parent).__name__}'s code reads {child_name}.{inner}"
    return None


def first_input(node, params):
    """The value a call node passes for the callee's first forward parameter (params: its
    names)."""
    if node.args:
        return node.args[0]
    return node.kwargs.get(params[0]) if params else None
