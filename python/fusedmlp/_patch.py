"""fusedmlp.patch: swaps the MLP blocks of a Hugging Face model for FusedMLP modules in place.

Handled: GPT-2 style blocks (c_fc/act/c_proj, Conv1D weights transposed at pack time), gated
blocks (gate_proj/up_proj/down_proj/act_fn: Llama, Mistral, Qwen2, ... as SwiGLU with gate and
up stacked by the pack), fc1/activation_fn/fc2 blocks, and BERT-style encoder layers
(intermediate.dense + act, then output.dense + dropout + LayerNorm(h + input)): the two linears,
the activation and the residual add are fused, the LayerNorm stays a torch op. Sparse
mixture-of-experts blocks (Mixtral, Qwen3-MoE: router, top-k, experts and weighted sum) become
FusedMoE modules (fusedmlp.torch.FusedMoE.from_module). Other MoE blocks whose experts use the
transformers 5 experts registry (@use_experts_implementation: OLMoE, Qwen2-MoE, DeepSeek-V3, ...)
keep their router and get their experts computed by fusedmlp: the model's experts implementation
becomes "fusedmlp" (fusedmlp.torch.register_experts, fusedmlp/_experts.py). The remaining MoE
blocks are skipped with the reason.

With fuse_norm (default), the pre-MLP norm of decoder blocks whose wiring is known to be
`h + mlp(norm(h))` (GPT2Block's ln_2; post_attention_layernorm of Llama, Mistral, Qwen2, Qwen3
decoder layers) moves into the fused op: the norm module becomes a passthrough and the fused MLP
normalises its input itself, one launch fewer per layer (several for the eager RMSNorm).

With linears=True, the projections of attention modules (c_attn/c_proj/q_attn of GPT-2,
q/k/v/o_proj, query/key/value, dense, ...: _ATTENTION_PROJECTIONS under a module whose class
name says Attention or Attn) and every `lm_head` also become FusedLinear modules
(torch.ops.fusedmlp.linear, a GEMV at decode's few rows).
"""

import dataclasses

import torch
from torch import nn

from ._experts import experts_probe, is_registry_experts, switch_experts
from .torch import (FusedLinear, FusedMLP, FusedMoE, _activation, _describe, _is_conv1d,
                    _linear_weight)

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
    """patch(strict=True) found a replacement whose output differs from the original; the model
    was left unchanged. .report holds the details."""

    def __init__(self, message, report):
        super().__init__(message)
        self.report = report


@dataclasses.dataclass
class PatchReport:
    """What patch() did: replaced MLP/MoE blocks (`replaced`), experts modules now run by
    fusedmlp through the transformers experts registry (`experts`) and, with linears=True,
    linears (`linears`), each with what it became and, when probed, the largest error relative
    to the tolerance (1.0 = at the limit); skipped ones with reasons."""
    replaced: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)  # (name, reason)
    details: dict = dataclasses.field(default_factory=dict)  # name -> description
    errors: dict = dataclasses.field(default_factory=dict)  # name -> error / tolerance
    linears: list = dataclasses.field(default_factory=list)  # names now FusedLinear
    experts: list = dataclasses.field(default_factory=list)  # experts modules now on fusedmlp

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
            lines.append(f"  {verb} {name}: {self.details.get(name, '')}{probe}")
        for name, reason in self.skipped:
            lines.append(f"  skipped  {name}: {reason}")
        return "\n".join(lines)


class _Passthrough(nn.Module):
    """Stands in for a BERT intermediate whose work moved into the fused output."""

    def forward(self, hidden_states):
        return hidden_states


class FusedBertOutput(nn.Module):
    """LayerNorm(dense2(act(dense1(x))) + x) with everything before the LayerNorm fused; the
    layer's intermediate becomes a passthrough, so this module receives x twice."""

    def __init__(self, fused, layer_norm):
        super().__init__()
        self.fused = fused
        self.LayerNorm = layer_norm

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.fused(hidden_states, residual=input_tensor))


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
    with torch.no_grad():  # NotImplementedError now (a skip with the reason), not at forward
        fused.eval()(torch.zeros(1, fused.d, dtype=fused.w1.dtype, device=fused.w1.device))
    fused.train(block.training)
    return _Plan(name, parent, {child_name: fused},
                 lambda x: _first(block(x.unsqueeze(0)))[0], lambda x: _first(fused(x)),
                 fused.d, fused.w1,
                 f"{type(block).__name__} -> FusedMoE ({fused.extra_repr()})",
                 select=lambda x: fused.routing_margin(x) > PROBE_RTOL.get(x.dtype, 2.0**-4),
                 probe_rows=64)


def _experts_plan(name, experts):
    """The plan switching a registry experts module to fusedmlp (see experts_probe)."""
    original, fused, d_in, weight, detail = experts_probe(experts)
    return _Plan(name, experts, {}, original, fused, d_in, weight, detail, probe_rows=32,
                 experts=experts)


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
        return _experts_plan(f"{name}.experts", experts)
    except NotImplementedError as e:
        if moe == "experts":
            raise
        raise NotImplementedError(f"{fused_reason}; {e}") from None


def _is_bert_layer(m):
    inter, out = getattr(m, "intermediate", None), getattr(m, "output", None)
    return (isinstance(getattr(inter, "dense", None), nn.Linear)
            and hasattr(inter, "intermediate_act_fn")
            and isinstance(getattr(out, "dense", None), nn.Linear)
            and isinstance(getattr(out, "LayerNorm", None), nn.LayerNorm))


# Decoder blocks whose `mlp` child is fed by exactly this norm and nothing else reads the norm's
# output; listed by class because the attribute names alone are ambiguous (Gemma 2 has a
# post_attention_layernorm that normalises the attention output, not the MLP input).
_NORM_BEFORE_MLP = {
    "GPT2Block": "ln_2",
    "LlamaDecoderLayer": "post_attention_layernorm",
    "MistralDecoderLayer": "post_attention_layernorm",
    "Qwen2DecoderLayer": "post_attention_layernorm",
    "Qwen3DecoderLayer": "post_attention_layernorm",
}


def _norm_kwargs(norm):
    """FusedMLP norm arguments computing what `norm` computes, or None when it does not fit."""
    if isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1:
        return dict(norm="layernorm", norm_weight=norm.weight, norm_bias=norm.bias,
                    eps=float(norm.eps))
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if (type(norm).__name__.endswith("RMSNorm") and eps is not None
            and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and len(list(norm.parameters())) == 1):
        return dict(norm="rmsnorm", norm_weight=weight, eps=float(eps))
    return None


def _fused_norm_plan(name, block, backend):
    """The plan for a known block: its norm and mlp replaced by one FusedMLP, or None."""
    attr = _NORM_BEFORE_MLP.get(type(block).__name__)
    norm, mlp = getattr(block, attr or "", None), getattr(block, "mlp", None)
    if attr is None or norm is None or mlp is None or not _is_mlp_candidate(mlp):
        return None
    kwargs = _norm_kwargs(norm)
    if kwargs is None:
        return None
    fused = FusedMLP(**_describe(mlp), **kwargs, backend=backend).train(mlp.training)
    return _Plan(f"{name}.mlp" if name else "mlp", block,
                 {attr: _Passthrough().train(norm.training), "mlp": fused},
                 lambda x: mlp(norm(x)), fused, fused.d_in, fused.w1,
                 f"{type(norm).__name__}+{type(mlp).__name__} -> FusedMLP ({fused.extra_repr()})")


def _is_mlp_candidate(m):
    return (all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj"))
            or all(hasattr(m, a) for a in ("c_fc", "c_proj"))
            or all(hasattr(m, a) for a in ("fc1", "fc2", "activation_fn")))


@dataclasses.dataclass
class _Plan:
    name: str
    parent: nn.Module
    attrs: dict  # attribute of parent -> replacement module
    original: object  # callable(x) -> reference output
    fused: object  # callable(x) -> fused output
    d_in: int
    weight: torch.Tensor
    detail: str
    select: object = None  # callable(x) -> bool [rows]: the probe rows to compare
    probe_rows: int = 8  # rows of the default probe
    linear: bool = False  # a FusedLinear (report.linears) rather than an MLP block
    experts: nn.Module = None  # a registry experts module switched to fusedmlp (no attrs)


def _bert_plan(name, layer, backend):
    inter, out = layer.intermediate, layer.output
    w1, b1 = _linear_weight(inter.dense, "intermediate.dense")
    w2, b2 = _linear_weight(out.dense, "output.dense")
    fused = FusedMLP(w1, w2, b1=b1, b2=b2, activation=_activation(inter.intermediate_act_fn),
                     dropout=out.dropout if isinstance(getattr(out, "dropout", None),
                                                       nn.Dropout) else None,
                     backend=backend)
    new_out = FusedBertOutput(fused, out.LayerNorm).train(out.training)
    return _Plan(f"{name}.intermediate+output" if name else "intermediate+output", layer,
                 {"intermediate": _Passthrough().train(inter.training), "output": new_out},
                 lambda x: out(inter(x), x), lambda x: new_out(x, x), w1.shape[1], w1,
                 f"{type(inter).__name__}+{type(out).__name__} -> FusedMLP "
                 f"({fused.extra_repr()}) + LayerNorm")


def _collect(module, prefix, backend, plans, report, skip=(), fuse_norm=True, moe="fused"):
    for child_name, child in module.named_children():
        if child_name in skip:
            continue
        name = f"{prefix}.{child_name}" if prefix else child_name
        if isinstance(child, (FusedMLP, FusedMoE)):  # patched before
            continue
        try:
            if is_registry_experts(child):  # outside a block that _is_moe recognises
                if not _already_switched(child):
                    plans.append(_experts_plan(name, child))
                continue
            if _is_moe(child):
                plan = _moe_or_experts_plan(name, module, child_name, child, backend, moe)
                if plan is not None:
                    plans.append(plan)
                continue
            if _is_bert_layer(child):
                plans.append(_bert_plan(name, child, backend))
                _collect(child, name, backend, plans, report, skip=("intermediate", "output"),
                         fuse_norm=fuse_norm, moe=moe)
                continue
            plan = _fused_norm_plan(name, child, backend) if fuse_norm else None
            if plan is not None:
                plans.append(plan)
                _collect(child, name, backend, plans, report, skip=tuple(plan.attrs),
                         fuse_norm=fuse_norm, moe=moe)
                continue
            if _is_mlp_candidate(child):
                fused = FusedMLP(**_describe(child), backend=backend).train(child.training)
                plans.append(_Plan(name, module, {child_name: fused}, child, fused,
                                   fused.d_in, fused.w1,
                                   f"{type(child).__name__} -> FusedMLP ({fused.extra_repr()})"))
                continue
        except (NotImplementedError, ValueError) as e:
            report.skipped.append((name, str(e)))
            continue
        _collect(child, name, backend, plans, report, fuse_norm=fuse_norm, moe=moe)


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
        if id(child) in taken or isinstance(child, (FusedLinear, FusedMLP, FusedMoE)):
            continue
        if isinstance(child, nn.Linear) or _is_conv1d(child):
            if child_name == "lm_head" or (in_attention and child_name in _ATTENTION_PROJECTIONS):
                try:
                    fused = FusedLinear.from_module(child).train(child.training)
                except (NotImplementedError, ValueError) as e:
                    report.skipped.append((name, str(e)))
                    continue
                plans.append(_Plan(name, module, {child_name: fused}, child, fused,
                                   fused.in_features, fused.weight,
                                   f"{type(child).__name__} -> FusedLinear "
                                   f"({fused.extra_repr()})", linear=True))
            continue
        if not isinstance(child, nn.MultiheadAttention):
            _collect_linears(child, name, plans, report, taken,
                             _is_attention(child) or _is_attention(module))


def _probe_input(probe, plan):
    w = plan.weight
    if isinstance(probe, torch.Tensor) and probe.shape[-1] == plan.d_in:
        x = probe.detach().to(device=w.device, dtype=w.dtype).reshape(-1, plan.d_in)
    else:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(plan.probe_rows, plan.d_in, generator=gen).to(device=w.device,
                                                                      dtype=w.dtype)
    if plan.select is not None:
        with torch.no_grad():
            keep = plan.select(x).to(x.device)
        if bool(keep.any()):  # else every row is compared (and a routing flip may show)
            x = x[keep]
    return x


def _probe_error(plan, probe):
    """Largest |fused - original| / (rtol * (|original| + rms(original row)))."""
    x = _probe_input(probe, plan)
    with torch.no_grad():
        ref = plan.original(x).float()
        got = plan.fused(x).float()
    rms = ref.pow(2).mean(dim=-1, keepdim=True).sqrt()
    bound = PROBE_RTOL.get(plan.weight.dtype, 2.0**-4) * (ref.abs() + rms) + 1e-30
    err = (got - ref).abs() / bound
    return float(err.nan_to_num(nan=float("inf")).max()) if err.numel() else 0.0


def patch(model, strict=False, probe=None, backend="auto", fuse_norm=True, tp_group=None,
          linears=False, moe="fused"):
    """Replaces the MLP blocks of `model` in place by FusedMLP modules (packed once for the
    weights' device) and returns a PatchReport (print it).

    strict=True runs a probe batch through each original block and its replacement first and
    raises PatchError, leaving the model unchanged, when any output element differs by more
    than PROBE_RTOL[dtype] * (|original| + rms(original row)) (fp32 2^-12, fp16 2^-7, bf16 2^-4).
    probe: a tensor of hidden states [..., d_model] for that check (default: 8 random rows,
    seeded); given with strict=False, blocks that fail it are skipped instead of replaced.
    fuse_norm: also fuse the pre-MLP LayerNorm/RMSNorm of the decoder blocks listed in
    _NORM_BEFORE_MLP (the norm module becomes a passthrough). Sparse-MoE blocks of Mixtral and
    Qwen3-MoE become FusedMoE modules (their probe compares the whole block's output on the
    probe rows whose routing is unambiguous: see PROBE_RTOL). Other MoE blocks whose experts
    module uses the transformers 5 experts registry keep their router and their experts run
    through fusedmlp: "fusedmlp" is registered and becomes the model's experts implementation
    (model.set_experts_implementation; the setting is per config, so experts modules that
    fusedmlp cannot express, or that the probe refused, keep the implementation they had). Their
    probe runs the experts module's eager forward and fusedmlp on the same seeded routing
    (32 rows); they are listed in report.experts. moe="experts" takes that path for Mixtral and
    Qwen3-MoE too (default "fused": FusedMoE, which fuses the router as well). Blocks that
    cannot be fused (unknown activation, other mixtures of experts, ...) are skipped with the
    reason.
    tp_group: a torch.distributed NCCL process group: each rank replaces the MLP blocks by its
    tensor-parallel shard (fusedmlp.tp.TPFusedMLP, all-reduce over the group) and the sparse-MoE
    blocks by its range of the experts (fusedmlp.tp.TPFusedMoE, likewise); every rank must
    call it on an identical model; strict, probe and fuse_norm do not apply, and the experts
    registry path is not taken (its experts would not be sharded).
    linears=True: also replaces, after the MLP work, the projections of attention modules (GPT-2
    c_attn/c_proj as transposed copies of the Conv1D weights; nn.Linear q/k/v/o_proj,
    query/key/value, attention output dense, ...) and every `lm_head` by fusedmlp.torch.FusedLinear
    modules (torch.ops.fusedmlp.linear). An nn.Linear keeps its Parameters (a tied lm_head stays
    tied, no memory is added); MoE routers, modules the MLP patch replaced or skipped and linears
    the op cannot take (dtype, tensor subclass, nn.Linear subclass) are left alone, the latter
    listed in report.skipped. Replaced names go to report.linears (report.replaced keeps the MLP
    blocks); strict and probe check them like the blocks. Not with tp_group.
    Inference only: call model.eval() (dropout before a fused residual add raises).
    """
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
    report = PatchReport()
    plans = []
    _collect(model, "", backend, plans, report, fuse_norm=fuse_norm, moe=moe)
    if linears:
        modules = dict(model.named_modules())
        taken = {id(getattr(p.parent, a)) for p in plans for a in p.attrs}
        taken |= {id(modules[n]) for n, _ in report.skipped if n in modules}
        _collect_linears(model, "", plans, report, taken)
    check = strict or probe is not None
    accepted, failures = [], []
    for plan in plans:
        if check:
            err = _probe_error(plan, probe)
            report.errors[plan.name] = err
            if not err <= 1.0:
                failures.append(plan)
                continue
        accepted.append(plan)
    for p in plans if strict and failures else failures:  # drop the probes' converted copies
        if p.experts is not None:
            p.experts.__dict__.pop("_fusedmlp_layout", None)
    if strict and failures:
        names = ", ".join(f"{p.name} ({report.errors[p.name]:.3g}x tolerance)" for p in failures)
        for p in failures:
            report.skipped.append((p.name, "probe output differs from the original"))
        raise PatchError(f"fusedmlp.patch(strict=True): outputs differ beyond tolerance in "
                         f"{names}; the model is unchanged", report)
    for p in failures:
        report.skipped.append((p.name, f"probe error {report.errors[p.name]:.3g}x tolerance"))
    for plan in accepted:
        for attr, new in plan.attrs.items():
            setattr(plan.parent, attr, new)
        (report.linears if plan.linear else report.experts if plan.experts is not None
         else report.replaced).append(plan.name)
        report.details[plan.name] = plan.detail
    switch_experts(model, [p.experts for p in accepted if p.experts is not None])
    return report
