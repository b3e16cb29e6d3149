"""fusedmlp.patch: swaps the MLP blocks of a model (Hugging Face or any nn.Module) for fused
modules in place.

Dense MLP blocks are found by what their forward computes, not by attribute names
(fusedmlp/_structure.py states the rule): a module whose traced forward is linear -> act
(-> * linear) -> linear, whatever its children are called (two or three linears, one fused
gate_up linear split in halves, Conv1D or Linear, with or without biases; act any module or
function that equals relu, gelu, gelu_tanh, silu or relu2) becomes a FusedMLP (or a FusedBlock when its
forward also adds a residual input or applies a post-norm); a chain that a layer computes inside
its own forward beside its attention (OPT, BART, Whisper...: fc1, activation_fn, fc2 held by the
decoder layer; BERT: intermediate.dense -> act -> output.dense across two children) is replaced
in place, never the layer. The norm feeding a block moves into the fused op when the parent's
graph shows its output feeds that block alone and it computes LayerNorm or RMSNorm (weight w,
1 + w as in Gemma, or none); the report says why otherwise. Sparse mixture-of-experts blocks
(Mixtral, Qwen3-MoE: router, top-k, experts and weighted sum) become FusedMoE modules
(fusedmlp.torch.FusedMoE.from_module). Other MoE blocks whose experts use the transformers 5
experts registry (@use_experts_implementation: OLMoE, Qwen2-MoE, DeepSeek-V3, ...) keep their
router and get their experts computed by fusedmlp: the model's experts implementation becomes
"fusedmlp" (fusedmlp.torch.register_experts, fusedmlp/_experts.py). The dense MLPs inside MoE
blocks (shared experts) are fused like any other. Every MLP-looking module that is not replaced
is listed in the report with the reason.

Every replacement is probed (the fused module against the original modules on random rows)
before anything is swapped: in strict mode a mismatch, or an error inside the probe, raises
PatchError and leaves the model unchanged; otherwise that block is skipped with the reason.

With linears=True, the projections of attention modules (c_attn/c_proj/q_attn of GPT-2,
q/k/v/o_proj, query/key/value, dense, ...: _ATTENTION_PROJECTIONS under a module whose class
name says Attention or Attn) and every `lm_head` also become FusedLinear modules
(torch.ops.fusedmlp.linear, a GEMV at decode's few rows).
"""

import collections
import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from . import _fp8
from . import _structure as st
from ._blocks import (FusedBlock, NotInPlace, Passthrough, Plan, _norm_choice, block_plan,
                      inline_plan)
from ._experts import experts_probe, is_registry_experts, switch_experts
from .torch import FusedLinear, FusedMLP, FusedMoE, _is_conv1d, call_cost

# Probe tolerance per dtype of the model's weights: an output element passes when
# |fused - original| <= rtol * (|original| + rms(original row)). Both sides carry their own
# rounding: fp32 accumulation order (~1e-6); in 16-bit models torch also rounds every
# intermediate (the activation is several elementwise ops) to the model dtype, while the fused
# kernel keeps them in fp32, so the two differ by a few units of the dtype's rounding.
# MoE blocks are probed on the full block output at the same tolerance, on rows whose routing
# is unambiguous: a row whose top_k-th and next router logits are within PROBE_RTOL[dtype] *
# max|logit| may pick another expert under the other side's rounding (torch rounds the logits
# to the model dtype, the fused router keeps fp32), which no output tolerance covers; such rows
# are left out (the default probe draws 64 rows so that enough remain).
PROBE_RTOL = {torch.float32: 2.0**-12, torch.float16: 2.0**-7, torch.bfloat16: 2.0**-4}


class PatchError(RuntimeError):
    """patch(strict=True) found a replacement whose output differs from the original.

    The model was left unchanged.

    Attributes
    ----------
    report : PatchReport
        What was planned and why each refused replacement failed its probe.
    """

    def __init__(self, message, report):
        super().__init__(message)
        self.report = report


@dataclasses.dataclass
class PatchReport:
    """What patch() did; ``print(report)`` lists it.

    Attributes
    ----------
    replaced : list of str
        Names of the MLP / MoE blocks replaced (FusedMLP, FusedBlock, FusedMoE, or the
        tensor-parallel modules).
    skipped : list of (str, str)
        Names left alone, with the reason.
    details : dict of str to str
        Name -> what it became.
    errors : dict of str to float
        Name -> the probe's largest error relative to the tolerance (1.0: at the limit).
    linears : list of str
        With linears=True, the names now FusedLinear.
    experts : list of str
        Experts modules now run by fusedmlp through the transformers experts registry.
    costs : dict of str to (float, float)
        With mode "eager" or "graph": name -> µs per call of the original and of the fused
        module in that mode, for every block timed (replaced or kept).
    mode : str
        The patch's mode.
    """
    replaced: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)  # (name, reason)
    details: dict = dataclasses.field(default_factory=dict)  # name -> description
    errors: dict = dataclasses.field(default_factory=dict)  # name -> error / tolerance
    linears: list = dataclasses.field(default_factory=list)  # names now FusedLinear
    experts: list = dataclasses.field(default_factory=list)  # experts modules now on fusedmlp
    costs: dict = dataclasses.field(default_factory=dict)  # name -> (original us, fused us)
    mode: str = "always"

    def __str__(self):
        heads = sum(n.rpartition(".")[2] == "lm_head" for n in self.linears)
        lin = ""
        if self.linears:
            lin = (f", {len(self.linears) - heads} projection(s)"
                   f"{' + lm_head' if heads else ''} by FusedLinear")
        if self.experts:
            lin += f", {len(self.experts)} experts module(s) by the experts registry"
        lines = [f"fusedmlp.patch: replaced {len(self.replaced)} MLP block(s){lin}, skipped "
                 f"{len(self.skipped)}"]
        for name in self.replaced + self.experts + self.linears:
            err = self.errors.get(name)
            probe = "" if err is None else f", probe error {err:.3g} of tolerance"
            verb = "switched" if name in self.experts else "replaced"
            cost = self.costs.get(name)
            cost = "" if cost is None else \
                f", {self.mode} {cost[0]:.1f} -> {cost[1]:.1f} us a call"
            lines.append(f"  {verb} {name}: {self.details.get(name, '')}{probe}{cost}")
        for name, reason in self.skipped:
            lines.append(f"  skipped  {name}: {reason}")
        return "\n".join(lines)


def _is_moe(m):
    """A mixture-of-experts block (by structure or class name; not the models and decoder
    layers whose class names also say Moe)."""
    name = type(m).__name__.lower()
    return name.endswith(("moeblock", "moe", "mixtureofexperts")) or (
        hasattr(m, "experts") and (hasattr(m, "gate") or hasattr(m, "router")))


def _first(out):
    """A block's hidden states (transformers 4.x MoE blocks return (y, router_logits))."""
    return out[0] if isinstance(out, tuple) else out


def _moe_plan(name, parent, child_name, block, backend):
    fused = FusedMoE.from_module(block, backend=backend).train(block.training)
    # fp8 experts: x in the dtype the model computes in (its router's)
    x_dtype = _fp8.activation_dtype(block) if fused.w1.dtype == torch.float8_e4m3fn \
        else fused.w1.dtype
    with torch.no_grad():  # NotImplementedError now (a skip with the reason), not at forward
        fused.eval()(torch.zeros(1, fused.d, dtype=x_dtype, device=fused.w1.device))
    fused.train(block.training)
    return Plan(name, [(parent, child_name, fused)],
                lambda x: _first(block(x.unsqueeze(0)))[0], lambda x: _first(fused(x)),
                fused.d, fused.w1, f"{type(block).__name__} -> FusedMoE ({fused.extra_repr()})",
                select=lambda x: fused.routing_margin(x) > PROBE_RTOL.get(x.dtype, 2.0**-4),
                probe_rows=64, covers=(name,), x_dtype=x_dtype)


def _experts_plan(name, experts, block=None):
    """The plan switching a registry experts module to fusedmlp (see experts_probe)."""
    original, fused, d_in, weight, detail = experts_probe(experts)
    return Plan(name, [], original, fused, d_in, weight, detail, probe_rows=32,
                experts=experts, covers=(name,), x_dtype=_fp8.activation_dtype(block, experts))


def _already_switched(m):
    return (getattr(m.config, "_experts_implementation", None) == "fusedmlp"
            and "_fusedmlp_previous" in m.__dict__)


def _moe_or_experts_plan(name, module, child_name, block, backend, moe):
    """FusedMoE for the blocks it maps (unless moe="experts"), else the experts-registry plan
    for a block whose experts use the registry; None when those already run on fusedmlp."""
    experts = getattr(block, "experts", None)
    registry = is_registry_experts(experts)
    if registry and _already_switched(experts):
        return None
    if not (registry and moe == "experts"):
        try:
            return _moe_plan(name, module, child_name, block, backend)
        except NotImplementedError as e:
            if not registry:
                raise
            fused_reason = str(e)
    try:
        return _experts_plan(f"{name}.experts", experts, block)
    except NotImplementedError as e:
        if moe == "experts":
            raise
        raise NotImplementedError(f"{fused_reason}; {e}") from None


def _is_mlp_candidate(m):
    """An MLP block by attribute names: the tensor-parallel path's test (fusedmlp.tp shards
    what fusedmlp.torch._describe maps); patch() itself finds blocks by structure."""
    return (all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj"))
            or all(hasattr(m, a) for a in ("c_fc", "c_proj"))
            or all(hasattr(m, a) for a in ("fc1", "fc2", "activation_fn")))


def _looks_like_mlp(m):
    """A module the report must account for when it is not replaced: named like an MLP, or
    holding two or three linears and an activation module (and not named like attention)."""
    if st.named_like_mlp(m):
        return True
    kids = list(m.children())
    if sum(st.linear_kind(k) is not None for k in kids) not in (2, 3) or _is_attention(m):
        return False
    return any(st.is_simple_leaf(k) and not list(k.parameters())
               and not isinstance(k, (nn.Dropout, nn.Identity))
               and st.identify_activation(k, 8, _device(m))[0] is not None for k in kids)


def _device(m):
    p = next(m.parameters(), None)
    return "cpu" if p is None else p.device


_DONE = (FusedMLP, FusedMoE, FusedLinear, FusedBlock, Passthrough)


class _Collector:
    """Walks the model once: MoE blocks and registry experts first (as before), then dense MLP
    blocks and chains by structure (_structure), each module analysed as a parent of its
    children (for pre-norms and chains inside its forward) before its children are visited."""

    def __init__(self, model, backend, plans, report, fuse_norm, moe):
        self.backend, self.plans, self.report = backend, plans, report
        self.fuse_norm, self.moe = fuse_norm, moe
        self.refs = collections.Counter(id(m) for _, m in
                                        model.named_modules(remove_duplicate=False))
        self.pending = {}  # MLP-looking modules not replaced -> reason (unless a plan covers them)
        self.seen = set()
        self.claimed = set()  # ids of modules a plan takes over
        self.traces = {}  # id(module) -> its standalone Trace, or the Untraceable it raised

    def trace(self, module):
        """module's standalone trace (cached), or raises Untraceable."""
        found = self.traces.get(id(module))
        if found is None:
            try:
                found = st.trace(module)
            except st.Untraceable as e:
                found = e
            self.traces[id(module)] = found
        if isinstance(found, st.Untraceable):
            raise found
        return found

    def traceable(self, module):
        try:
            self.trace(module)
            return True
        except st.Untraceable:
            return False

    def skip(self, name, reason):
        self.report.skipped.append((name, reason))

    def add(self, plan, *modules):
        self.plans.append(plan)
        self.claimed |= {id(m) for m in modules}

    def finish(self):
        covered = {c for p in self.plans for c in p.covers}
        for name, reason in self.pending.items():
            if not any(c == name or c.startswith(name + ".") for c in covered):
                self.skip(name, reason)

    def walk(self, module, prefix):
        if id(module) in self.seen:
            return
        self.seen.add(id(module))
        blocks, descend, unsupported = {}, [], set()
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, _DONE) or id(child) in self.claimed:
                continue
            try:
                if is_registry_experts(child):  # outside a block that _is_moe recognises
                    if not _already_switched(child):
                        self.add(_experts_plan(name, child), child)
                    continue
                if _is_moe(child):
                    plan = _moe_or_experts_plan(name, module, child_name, child, self.backend,
                                                self.moe)
                    if plan is not None:
                        self.add(plan, child if plan.experts is None else plan.experts)
                    if plan is None or plan.experts is not None:
                        descend.append((child, name))  # its shared experts, say
                    continue
            except (NotImplementedError, ValueError) as e:
                self.skip(name, str(e))  # the reason covers its experts too
                self.claimed.add(id(getattr(child, "experts", None)))
                descend.append((child, name))  # its dense MLPs (shared experts) may still fuse
                continue
            kids = list(child.children())
            if st.linear_kind(child) is not None:
                continue
            if not any(st.linear_kind(k) is not None for k in kids) and st.named_like_mlp(child):
                self.pending[name] = ("not replaced: it holds no nn.Linear or Conv1D children (its "
                                      "weights are plain tensors fusedmlp does not map)")
            if not kids:
                continue
            if any(st.linear_kind(k) is not None for k in kids):
                try:
                    blocks[child_name] = (name, st.analyse_block(child, self.trace(child)))
                    continue
                except st.UnsupportedChain as e:
                    self.skip(name, str(e))
                    unsupported.add(child_name)
                    continue
                except (st.NotAChain, st.Untraceable) as e:
                    if _looks_like_mlp(child):
                        self.pending[name] = f"not replaced: {e}"
            descend.append((child, name))
        self.parent(module, prefix, blocks, unsupported)
        for child, name in descend:
            self.walk(child, name)

    def parent(self, module, prefix, blocks, unsupported):
        """Plans for the MLP blocks among module's children (with their pre-norm when module's
        graph shows it feeds only them) and for chains inside module's own forward. Children
        that are blocks, or MLPs fusedmlp cannot express, stay opaque in that graph."""
        kids = dict(module.named_children())
        opaque = {id(kids[b]) for b in list(blocks) + list(unsupported)} | self.claimed
        inline = st.parent_inline_candidates(module, opaque)
        linears = sum(st.linear_kind(k) is not None for k in kids.values()) + sum(
            st.linear_kind(k) is not None for c in inline for k in kids[c].children())
        if not blocks and linears < 2:
            return
        tr, why = None, None
        inline = [c for c in inline if self.traceable(kids[c])]
        for attempt in ([inline] if inline else []) + [[]]:
            try:
                tr = st.trace(module, attempt) if attempt else self.trace(module)
                break
            except st.Untraceable as e:
                why = str(e)
        for child_name, (name, block) in blocks.items():
            child = kids[child_name]
            norm = (None, None, f"no pre-norm fused: {why}")
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                norm = (None, None, f"no pre-norm fused: held in a {type(module).__name__} "
                        "and called from elsewhere")
            if tr is not None:
                calls = [n for n in tr.graph.nodes
                         if n.op == "call_module" and tr.target(n) == child_name]
                reads = st.reads_into(tr, child_name)
                if reads:
                    self.skip(name, f"{type(module).__name__}.forward reads {reads[0]}")
                    continue
                if len(calls) == 1:
                    norm = _norm_choice(tr, st.first_input(calls[0], block.trace.params),
                                        st.in_features(block.trace.submodule(block.chain.l1)),
                                        self.fuse_norm)
                else:
                    norm = (None, None, f"no pre-norm fused: {type(module).__name__}.forward "
                            f"calls it {len(calls)} times")
            inner = [n for n, _ in child.named_children()]
            reads = st.source_reads(module, child_name, inner)
            if reads:
                self.skip(name, f"not replaced: {reads}")
                continue
            try:
                plan = block_plan(name, module, child_name, child, block, norm, self.backend)
            except (NotImplementedError, ValueError) as e:
                self.skip(name, str(e))
                continue
            self.add(plan, child, *(getattr(o, a) for o, a, _ in plan.swaps))
        if tr is None:
            if sum(st.linear_kind(k) is not None for k in kids.values()) >= 2 and \
                    _looks_like_mlp(module) and not blocks:
                self.pending[prefix] = f"its linears are called inside a forward that {why}"
            return
        self.chains(module, prefix, tr)

    def chains(self, module, prefix, tr):
        full = lambda q: f"{prefix}.{q}" if prefix else q  # noqa: E731
        chains, unsupported = st.find_chains(tr)
        taken = set()
        for chain in chains:
            taken |= chain.nodes()
            name = "+".join(full(q) for q in chain.linears(tr))
            owners = {q.rpartition(".")[0] for q in chain.linears(tr)} - {""}
            shared = [o for o in owners if self.refs[id(module.get_submodule(o))] > 1]
            if any(id(module.get_submodule(q)) in self.claimed for q in chain.linears(tr)):
                continue
            if shared:
                self.skip(name, f"{full(shared[0])} is shared with another module")
                continue
            d_in = st.in_features(tr.submodule(chain.l1))
            norm = _norm_choice(tr, chain.x, d_in, self.fuse_norm)
            try:
                plan = inline_plan(prefix, module, tr, chain, norm, self.backend)
            except NotInPlace as e:
                if prefix not in self.pending:  # else the module's own reason says more
                    self.skip(name, str(e))
                continue
            except (NotImplementedError, ValueError) as e:
                self.pending.pop(prefix, None)  # this reason is the one
                self.skip(name, str(e))
                continue
            self.add(plan, *(getattr(o, a) for o, a, _ in plan.swaps))
        for linears, reason in unsupported:
            self.skip("+".join(full(q) for q in linears), reason)
        for linear, _ in st.half_chains(tr, taken):
            owner = linear.rpartition(".")[0]
            name = full(owner) if owner else full(linear)
            self.pending.setdefault(name, f"{full(linear)} -> activation: the rest of this MLP is "
                                    f"not visible in {type(module).__name__}.forward (it goes "
                                    "on in a module that is not traced through)")


def _collect(model, backend, plans, report, fuse_norm=True, moe="fused"):
    collector = _Collector(model, backend, plans, report, fuse_norm, moe)
    collector.walk(model, "")
    collector.finish()


# Linear children of attention modules that linears=True replaces, by attribute name: GPT-2
# (Conv1D), Llama / Mistral / Qwen / Mixtral, Phi-3, BERT (query/key/value in the self-attention,
# dense in its output), GPT-NeoX / Falcon, OPT / BART / CLIP.
_ATTENTION_PROJECTIONS = frozenset({
    "c_attn", "c_proj", "q_attn", "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query",
    "key", "value", "dense", "query_key_value", "out_proj"})


def _is_attention(m):
    """An attention module by class name; not blocks named after their attention
    (ResidualAttentionBlock), and not nn.MultiheadAttention, whose forward reads out_proj's
    weight without calling it."""
    name = type(m).__name__.lower()
    return (("attention" in name or "attn" in name) and not name.endswith(("block", "layer"))
            and not isinstance(m, nn.MultiheadAttention))


def _collect_linears(module, prefix, plans, report, taken, in_attention=False):
    """Plans replacing the attention projections and lm_head under `module` by FusedLinear.
    in_attention: module is an attention module or a direct child of one (BERT's
    attention.output holds the output dense). Modules in `taken` (replaced by an MLP plan, or
    skipped) are left alone, children included."""
    for child_name, child in module.named_children():
        name = f"{prefix}.{child_name}" if prefix else child_name
        if id(child) in taken or isinstance(child, _DONE):
            continue
        if isinstance(child, nn.Linear) or _is_conv1d(child):
            if child_name == "lm_head" or (in_attention and child_name in _ATTENTION_PROJECTIONS):
                try:
                    fused = FusedLinear.from_module(child).train(child.training)
                except (NotImplementedError, ValueError) as e:
                    report.skipped.append((name, str(e)))
                    continue
                plans.append(Plan(name, [(module, child_name, fused)], child, fused,
                                  fused.in_features, fused.weight,
                                  f"{type(child).__name__} -> FusedLinear "
                                  f"({fused.extra_repr()})", linear=True, covers=(name,),
                                  x_dtype=_fp8.activation_dtype(module)))
            continue
        if not isinstance(child, nn.MultiheadAttention):
            _collect_linears(child, name, plans, report, taken,
                             _is_attention(child) or _is_attention(module))


def _probe_input(probe, plan):
    w = plan.weight
    # fp8 weights: the rows are in the dtype the model computes in
    dtype = plan.x_dtype if w.dtype == torch.float8_e4m3fn and plan.x_dtype else w.dtype
    if isinstance(probe, torch.Tensor) and probe.shape[-1] == plan.d_in:
        x = probe.detach().to(device=w.device, dtype=dtype).reshape(-1, plan.d_in)
    else:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(plan.probe_rows, plan.d_in, generator=gen).to(device=w.device,
                                                                      dtype=dtype)
    if plan.select is not None:
        with torch.no_grad():
            keep = plan.select(x).to(x.device)
        if bool(keep.any()):  # else every row is compared (and a routing flip may show)
            x = x[keep]
    return x


def _probe_error(plan, probe):
    """Largest |fused - original| / (rtol * (|original| + rms(original row))); inf (and the
    error) when either side raises: a crash inside the probe refuses the plan like a mismatch."""
    try:
        x = _probe_input(probe, plan)
        with torch.no_grad():
            ref = plan.original(x).float()
            got = plan.fused(x).float()
        if got.shape != ref.shape:
            return float("inf"), f"the fused output has shape {tuple(got.shape)}, the " \
                f"original {tuple(ref.shape)}"
    except Exception as e:  # noqa: BLE001 - whatever fails, the block is not swapped
        return float("inf"), f"the probe raised {type(e).__name__}: {str(e)[:200]}"
    rms = ref.pow(2).mean(dim=-1, keepdim=True).sqrt()
    bound = PROBE_RTOL.get(x.dtype, 2.0**-4) * (ref.abs() + rms) + 1e-30
    err = (got - ref).abs() / bound
    return (float(err.nan_to_num(nan=float("inf")).max()) if err.numel() else 0.0), None


_MODES = ("always", "eager", "graph")


def _plan_cost(plan, mode):
    """(original us, fused us) per call of one decode row in mode, or None for the fused side
    when it cannot be measured there (a CUDA-graph capture that fails)."""
    x = _probe_input(None, plan)[:1]
    graph = mode == "graph" and x.device.type == "cuda"
    out = []
    for fn in (plan.original, plan.fused):
        try:
            c = call_cost(fn, x, calls=20, rounds=3, graph=graph)
        except Exception:  # noqa: BLE001 - an original that cannot run here (an fp8 linear
            if fn is plan.fused:  # without its kernels) loses to a fused module that can
                raise
            out.append(None)
            continue
        out.append(c.device_us if graph else c.wall_us)
    return tuple(out)


def _keep_faster(accepted, mode, report):
    """The plans whose fused module costs less per call than the original in mode (eager: the
    wall time of back-to-back calls, host time included; graph: CUDA-graph replay), timed once
    per kind of block (same description, weight shape, dtype and device); the others are listed
    in report.skipped with both costs."""
    costs, chosen = {}, []
    for plan in accepted:
        key = (plan.detail, tuple(plan.weight.shape), plan.weight.dtype, plan.weight.device)
        if key not in costs:
            try:
                costs[key] = _plan_cost(plan, mode)
            except Exception as e:  # noqa: BLE001 - a block that cannot be timed stays as it is
                costs[key] = e
        c = costs[key]
        if isinstance(c, Exception):
            report.skipped.append((plan.name, f"kept the original: timing it in {mode} mode "
                                   f"raised {type(c).__name__}: {str(c)[:200]}"))
            continue
        orig, fused = c
        if fused is None:
            report.skipped.append((plan.name, "kept the original: the fused module could not "
                                   "be captured in a CUDA graph"))
            continue
        if orig is None:  # the original cannot be captured; the fused one can
            chosen.append(plan)
            continue
        report.costs[plan.name] = (orig, fused)
        if fused < orig:
            chosen.append(plan)
        else:
            report.skipped.append((plan.name, f"kept the original: in {mode} mode it costs "
                                   f"{orig:.1f} us a call, the fused module {fused:.1f} us "
                                   "(mode='always' replaces it regardless)"))
    return chosen


def patch(model: nn.Module, strict: bool = False, probe: Optional[torch.Tensor] = None,
          backend: str = "auto", fuse_norm: bool = True, tp_group: Any = None,
          linears: bool = False, moe: str = "fused", mode: str = "always") -> PatchReport:
    """Replaces the MLP blocks of a Hugging Face model in place by fused modules.

    Dense MLP blocks are found by structure (fusedmlp/_structure.py): modules computing
    linear -> act (-> * linear) -> linear become FusedMLP (packed once for the weights'
    device; FusedBlock when the forward also takes a residual or applies a post-norm); chains
    inside a layer's own forward are replaced in place. Sparse-MoE blocks of Mixtral and
    Qwen3-MoE become FusedMoE modules. Other MoE blocks whose experts module uses the
    transformers 5 experts registry keep their router and their experts run through fusedmlp:
    "fusedmlp" is registered and becomes the model's experts implementation
    (model.set_experts_implementation; the setting is per config, so experts modules that
    fusedmlp cannot express, or that the probe refused, keep the implementation they had);
    they are listed in report.experts. Blocks that cannot be fused (an activation fusedmlp
    lacks, a layout it cannot express, dropout in training mode, other mixtures of experts ...)
    and MLP-looking modules that are not MLP blocks are listed in report.skipped with the
    reason. Inference only: call model.eval() (blocks with an active dropout are skipped).

    Every replacement is probed first: a batch of rows goes through the original modules and
    through the replacement, and an output element passes when it is within
    ``PROBE_RTOL[dtype] * (|original| + rms(original row))`` (float32 2^-12, float16 2^-7,
    bfloat16 2^-4). A MoE block's probe compares the whole block's output on the probe rows
    whose routing is unambiguous; an experts module's probe runs its eager forward and fusedmlp
    on the same seeded routing (32 rows).

    Parameters
    ----------
    model : nn.Module
        The model, changed in place.
    strict : bool
        Raise PatchError, leaving the model unchanged, when any probe fails (a mismatch, or an
        error inside the probe); otherwise the blocks that fail are skipped with the reason and
        the others are swapped.
    probe : torch.Tensor, optional
        Hidden states [..., d_model] for the probes (default: 8 random rows, seeded).
    backend : {"auto", "ref", "cpu", "cuda"}
    fuse_norm : bool
        Also move into the fused op the norm whose output feeds only that block, when it
        computes LayerNorm or RMSNorm (the norm module becomes a passthrough).
    tp_group : torch.distributed.ProcessGroup, optional
        An NCCL process group: each rank replaces the MLP blocks by its tensor-parallel shard
        (fusedmlp.tp.TPFusedMLP, all-reduce over the group) and the sparse-MoE blocks by its
        range of the experts (fusedmlp.tp.TPFusedMoE); every rank must call it on an identical
        model. strict, probe, fuse_norm and mode do not apply, nor the experts registry path.
    linears : bool
        Also replace, after the MLP work, the projections of attention modules (GPT-2 c_attn /
        c_proj as transposed copies of the Conv1D weights; nn.Linear q/k/v/o_proj,
        query/key/value, attention output dense ...) and every ``lm_head`` by FusedLinear
        modules. An nn.Linear keeps its Parameters (a tied lm_head stays tied, no memory is
        added); MoE routers, modules the MLP patch replaced or skipped and linears the op cannot
        take are left alone, the latter listed in report.skipped. strict and probe check them
        like the blocks. Not with tp_group.
    moe : {"fused", "experts"}
        "fused": FusedMoE where it maps the block (the router fused as well); "experts": the
        experts registry path also for Mixtral and Qwen3-MoE.
    mode : {"always", "eager", "graph"}
        "always": every block the probe accepts is replaced. "eager" / "graph": each kind of
        block (one per description, weight shape, dtype and device) is also timed on one row
        against the original, as the model will run it: "eager" by the wall time of
        back-to-back calls, host time included (``model.generate()`` without CUDA graphs), and
        "graph" by CUDA-graph replay (captured decode steps, where host time does not count);
        where the fused module is not faster the original stays, listed in report.skipped with
        both costs. The choice depends on the machine and its load; "always" is deterministic.

    Returns
    -------
    PatchReport
        What was replaced, switched and skipped (print it).

    Raises
    ------
    PatchError
        strict=True and a probe failed.
    ValueError
        moe or mode is not one of its names.
    NotImplementedError
        tp_group together with linears=True.
    RuntimeError
        tp_group given but torch.distributed not initialised.
    """
    if mode not in _MODES:
        raise ValueError(f"mode is {mode!r}; expected 'always' (replace every block the probe "
                         "accepts), 'eager' or 'graph' (keep the original where the fused module "
                         "is not faster in that mode)")
    if tp_group is not None:  # tensor parallel: every rank keeps its shard (fusedmlp.tp)
        if linears:
            raise NotImplementedError("fusedmlp.patch(tp_group=..., linears=True): the attention "
                                      "projections would need sharding with the attention "
                                      "itself, which fusedmlp does not do; pass linears=False")
        from .tp import patch_tp
        return PatchReport(replaced=patch_tp(model, tp_group=tp_group, backend=backend))
    if moe not in ("fused", "experts"):
        raise ValueError(f"moe is {moe!r}; expected 'fused' (FusedMoE where it maps the block) "
                         "or 'experts' (the experts registry where the block's experts use it)")
    report = PatchReport(mode=mode)
    plans = []
    _collect(model, backend, plans, report, fuse_norm=fuse_norm, moe=moe)
    if linears:
        modules = dict(model.named_modules())
        taken = {id(getattr(owner, attr)) for p in plans for owner, attr, _ in p.swaps}
        taken |= {id(modules[n]) for n, _ in report.skipped if n in modules}
        _collect_linears(model, "", plans, report, taken)
    accepted, failures = [], []
    with _fp8.dequantized(model):  # fp8 linears: their weight-only result is the reference
        for plan in plans:
            err, why = _probe_error(plan, probe)
            report.errors[plan.name] = err
            if not err <= 1.0:
                failures.append((plan, why or f"probe error {err:.3g}x tolerance"))
                continue
            accepted.append(plan)
    for p in plans if strict and failures else [f[0] for f in failures]:
        if p.experts is not None:  # drop the probes' converted copies
            p.experts.__dict__.pop("_fusedmlp_layout", None)
    if strict and failures:
        names = ", ".join(f"{p.name} ({why})" for p, why in failures)
        for p, why in failures:
            report.skipped.append((p.name, f"probe refused it: {why}"))
        raise PatchError(f"fusedmlp.patch(strict=True): the probe refused {names}; the model "
                         "is unchanged", report)
    for p, why in failures:
        report.skipped.append((p.name, f"probe refused it: {why}"))
    if mode != "always":
        chosen = _keep_faster(accepted, mode, report)
        ids = {id(p) for p in chosen}
        for p in accepted:
            if id(p) not in ids and p.experts is not None:
                p.experts.__dict__.pop("_fusedmlp_layout", None)
        accepted = chosen
    for plan in accepted:
        for owner, attr, new in plan.swaps:
            setattr(owner, attr, new)
        (report.linears if plan.linear else report.experts if plan.experts is not None
         else report.replaced).append(plan.name)
        report.details[plan.name] = plan.detail
    switch_experts(model, [p.experts for p in accepted if p.experts is not None])
    return report
