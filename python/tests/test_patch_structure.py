"""fusedmlp.patch's structural detection (fusedmlp/_structure.py) on hand-written modules whose
attribute names fusedmlp has never seen, and on the Hugging Face architectures it used to break
or miss (OPT, Phi-3, GPT-NeoX). fp32 on CPU: patched against unpatched within 1e-5 of the row
rms (fp32 accumulation order, ~1e-6); what is not replaced must be in the report with the
reason, and a refusal must leave the model as it was."""

import copy
import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed; fusedmlp.patch needs it")

import fusedmlp  # noqa: E402
import fusedmlp.torch as ft  # noqa: E402
from fusedmlp import _structure as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

D, H = 24, 56


def rel_diff(a, b):
    rms = b.pow(2).mean(-1, keepdim=True).sqrt()
    return float(((a - b).abs() / rms).max())


def patched_matches(model, x, **kw):
    """Patches model (strict unless told), asserts its output is the unpatched one's; the
    report."""
    with torch.no_grad():
        ref = model(x)
        report = fusedmlp.patch(model, **{"strict": True, **kw})
        assert rel_diff(model(x), ref) <= 1e-5, str(report)
    return report


def state(model):
    return [(n, id(m)) for n, m in model.named_modules()]


def rows(n=5):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(1))


def randomise(model):
    """Unit-scale weights and non-trivial norm parameters (so a dropped gamma/beta shows)."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(max(1, p.shape[-1]))
                    + (1 if p.dim() == 1 and p.shape[0] == D else 0))
    return model.eval()


class Dense(nn.Module):  # names nobody listed, activation as a function
    def __init__(self, act=F.gelu):
        super().__init__()
        self.expand, self.shrink, self.act = nn.Linear(D, H), nn.Linear(H, D), act

    def forward(self, hidden):
        return self.shrink(self.act(self.expand(hidden)))


def my_silu(x):  # traced into elementwise ops; identified numerically
    return x * torch.sigmoid(x)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_a = nn.Linear(D, H, bias=False)
        self.w_b = nn.Linear(D, H, bias=False)
        self.w_c = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.w_c(self.w_b(x) * my_silu(self.w_a(x)))


class FusedUpFirst(nn.Module):  # one linear, up half first, then the gate half
    def __init__(self, bias=True):
        super().__init__()
        self.both, self.out = nn.Linear(D, 2 * H, bias=bias), nn.Linear(H, D, bias=bias)

    def forward(self, x):
        up, gate = self.both(x).chunk(2, dim=-1)
        return self.out(up * F.gelu(gate, approximate="tanh"))


class Residual(nn.Module):  # Bloom-style: the block adds its second input
    def __init__(self):
        super().__init__()
        self.p, self.q = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, hidden_states, skip):
        return self.q(torch.relu(self.p(hidden_states))) + skip


class Wrap(nn.Module):
    def __init__(self, *blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


@pytest.mark.parametrize("make,gated,act", [
    (Dense, False, "gelu"), (lambda: Dense(torch.tanh), None, None), (Gated, True, "silu"),
    (FusedUpFirst, True, "gelu_tanh"), (lambda: FusedUpFirst(False), True, "gelu_tanh"),
], ids=["dense", "tanh", "gated_function_act", "fused_up_first", "fused_no_bias"])
def test_blocks_found_by_structure(make, gated, act):
    model = randomise(Wrap(make(), make()))
    x = rows()
    report = patched_matches(model, x, strict=False)
    if gated is None:  # tanh: not an activation fusedmlp has; said so, nothing changed
        assert report.replaced == [] and len(report.skipped) == 2, str(report)
        assert "has no fusedmlp equivalent" in report.skipped[0][1]
        return
    assert report.replaced == ["blocks.0", "blocks.1"], str(report)
    fused = [m for m in model.modules() if isinstance(m, ft.FusedMLP)]
    assert len(fused) == 2 and all(m.gated == gated and m.activation == act for m in fused)
    assert fusedmlp.patch(model).replaced == []  # idempotent


class Holder(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, skip):
        return self.block(x, skip=skip)


def test_residual_block_called_by_keyword():
    model = randomise(Holder(Residual()))
    x, skip = rows(), rows(5) * 0.5
    with torch.no_grad():
        ref = model(x, skip)
        report = fusedmlp.patch(model, strict=True)
        assert report.replaced == ["block"], str(report)
        assert isinstance(model.block, fusedmlp._blocks.FusedBlock)
        assert rel_diff(model(x, skip), ref) <= 1e-5
        copied = copy.deepcopy(model)  # the signature it binds travels with it
        assert rel_diff(copied(x, skip), ref) <= 1e-5


class RMSNormPlusOne(nn.Module):  # Gemma's (1 + w) scale
    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(D)), eps

    def forward(self, x):
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class NoWeightRMS(nn.Module):
    def __init__(self):
        super().__init__()
        self.variance_epsilon = 1e-5

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class Layer(nn.Module):
    """h + mlp(norm(h)), the norm's output used once more when `shared_norm`."""

    def __init__(self, norm, mlp, shared_norm=False):
        super().__init__()
        self.norm, self.mlp, self.mix, self.shared = norm, mlp, nn.Linear(D, D), shared_norm

    def forward(self, h):
        n = self.norm(h)
        h = h + self.mlp(n)
        return h + self.mix(n) if self.shared else h


@pytest.mark.parametrize("norm,kind", [
    (lambda: nn.LayerNorm(D), "layernorm"), (lambda: nn.LayerNorm(D, bias=False), "layernorm"),
    (lambda: nn.LayerNorm(D, elementwise_affine=False), "layernorm"),
    (lambda: nn.RMSNorm(D, eps=1e-5), "rmsnorm"), (RMSNormPlusOne, "rmsnorm"),
    (NoWeightRMS, "rmsnorm"),
], ids=["layernorm", "layernorm_nobias", "layernorm_noaffine", "rmsnorm", "gemma_1_plus_w",
        "rms_no_weight"])
def test_pre_norm_fused_by_structure(norm, kind):
    model = randomise(Layer(norm(), Gated()))
    x = rows() * 3 + 1
    report = patched_matches(model, x)
    assert report.replaced == ["mlp"], str(report)
    assert model.mlp.norm == kind and isinstance(model.norm, fusedmlp._blocks.Passthrough)
    assert "pre-norm norm fused" in report.details["mlp"]


def test_norm_feeding_more_than_the_mlp_stays():
    model = randomise(Layer(nn.LayerNorm(D), Gated(), shared_norm=True))
    report = patched_matches(model, rows())
    assert report.replaced == ["mlp"] and model.mlp.norm is None, str(report)
    assert isinstance(model.norm, nn.LayerNorm)
    assert "norm norm stays a torch op: its output also feeds mix" in report.details["mlp"]


class OptLike(nn.Module):
    """A decoder layer that computes its MLP itself (OPT, BART): fc1, act, fc2 beside the
    attention-like `mix` and its norms."""

    def __init__(self):
        super().__init__()
        self.attn_norm, self.mix = nn.LayerNorm(D), nn.Linear(D, D)
        self.final_norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)
        self.activation_fn, self.drop = nn.ReLU(), nn.Dropout(0.1)

    def forward(self, hidden_states, attention_mask=None):
        h = hidden_states + self.mix(self.attn_norm(hidden_states))
        y = self.fc2(self.drop(self.activation_fn(self.fc1(self.final_norm(h)))))
        return h + F.dropout(y, p=0.1, training=self.training)


def test_chain_inside_a_layer_is_replaced_in_place():
    model = randomise(nn.Sequential(OptLike(), OptLike()))
    x = rows()
    report = patched_matches(model, x)
    assert report.replaced == ["0.fc1+0.fc2", "1.fc1+1.fc2"], str(report)
    assert all(type(layer) is OptLike for layer in model)  # the layers stay, attention and all
    assert isinstance(model[0].fc1, ft.FusedMLP) and model[0].fc1.norm == "layernorm"
    assert isinstance(model[0].fc2, fusedmlp._blocks.Passthrough)
    assert isinstance(model[0].mix, nn.Linear)
    with torch.no_grad():
        model[0](x, attention_mask=torch.ones(5))  # still takes its own arguments
    assert fusedmlp.patch(model).replaced == []


def test_dropout_in_training_mode_is_a_reason():
    model = randomise(nn.Sequential(OptLike()))
    model.train()
    report = fusedmlp.patch(model, strict=True)
    assert report.replaced == [] and "dropout in training mode" in report.skipped[0][1]


class Scaled(nn.Module):  # an MLP with a learned output scale: not the op's computation
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)
        self.scale = nn.Parameter(torch.ones(D) * 2)

    def forward(self, x):
        return self.down(F.silu(self.up(x))) * self.scale


class ScaledMLP(Scaled):
    pass


def test_mlp_that_computes_more_is_listed_not_replaced():
    model = randomise(Wrap(ScaledMLP()))
    report = patched_matches(model, rows())
    assert report.replaced == [] and report.skipped[0][0] == "blocks.0", str(report)
    assert "its output is not the chain's result" in report.skipped[0][1]


class Peeks(nn.Module):  # reads its MLP's insides: replacing the MLP would break it
    def __init__(self):
        super().__init__()
        self.mlp = Dense()

    def forward(self, x):
        return self.mlp(x.to(self.mlp.expand.weight.dtype))


def test_parent_reading_the_block_keeps_it():
    model = randomise(Peeks())
    report = patched_matches(model, rows())
    assert report.replaced == [] and "reads mlp.expand" in report.skipped[0][1], str(report)


def test_probe_crash_refuses_and_leaves_model_unchanged(monkeypatch):
    model = randomise(Wrap(Dense(), Gated()))
    before = state(model)

    def crash(self, x, residual=None):
        raise RuntimeError("kernel exploded (test)")
    monkeypatch.setattr(ft.FusedMLP, "forward", crash)
    with pytest.raises(ft.PatchError, match="kernel exploded") as info:
        fusedmlp.patch(model, strict=True)
    assert state(model) == before
    assert {n for n, _ in info.value.report.skipped} == {"blocks.0", "blocks.1"}
    report = fusedmlp.patch(model)  # loose: each refused block is skipped, the model works
    assert report.replaced == [] and "probe refused it" in report.skipped[0][1]
    assert state(model) == before


def test_strict_is_all_or_nothing(monkeypatch):
    """One block fails its probe: strict changes nothing, loose swaps only the other."""
    model = randomise(Wrap(Dense(), Gated()))
    x = rows()
    with torch.no_grad():
        ref = model(x)
    before = state(model)
    real = st.Chain.weights

    def wrong_for_gated(self, tr):
        kw = real(self, tr)
        return dict(kw, activation="relu") if kw["gated"] else kw
    monkeypatch.setattr(st.Chain, "weights", wrong_for_gated)
    with pytest.raises(ft.PatchError, match="blocks.1"):
        fusedmlp.patch(model, strict=True)
    assert state(model) == before
    report = fusedmlp.patch(model)
    assert report.replaced == ["blocks.0"] and report.skipped[0][0] == "blocks.1", str(report)
    with torch.no_grad():
        assert rel_diff(model(x), ref) <= 1e-5


def test_identify_activation_and_norm():
    for fn, name in ((torch.relu, "relu"), (F.gelu, "gelu"), (my_silu, "silu"),
                     (lambda t: 0.5 * t * (1 + torch.tanh(0.7978845608 * (t + 0.044715 * t**3))),
                      "gelu_tanh"), (lambda t: torch.relu(t) ** 2, "relu2")):
        assert st.identify_activation(fn, 64) == (name, None)
    name, why = st.identify_activation(lambda t: t * torch.sigmoid(1.702 * t), 64)  # quick_gelu
    assert name is None and "nearest" in why
    kw, _ = st.identify_norm(nn.LayerNorm(D, eps=1e-12), D)
    assert kw["norm"] == "layernorm" and kw["eps"] == 1e-12
    kw, why = st.identify_norm(nn.GroupNorm(2, D), D)  # not over the last dim of rows
    assert kw is None


transformers = pytest.importorskip("transformers")


def _tiny(cls_name, **kw):
    import hf_sweep
    model = hf_sweep.build(cls_name)
    return model, hf_sweep.input_ids(model)


@pytest.mark.parametrize("arch,names,detail", [
    ("OPTForCausalLM", [f"model.decoder.layers.{i}.fc1+model.decoder.layers.{i}.fc2"
                        for i in range(2)], "OPTDecoderLayer's fc1 -> activation_fn -> fc2"),
    ("Phi3ForCausalLM", ["model.layers.0.mlp", "model.layers.1.mlp"], "gate_up_proj"),
    ("GPTNeoXForCausalLM", ["gpt_neox.layers.0.mlp", "gpt_neox.layers.1.mlp"],
     "dense_h_to_4h"),
], ids=["opt", "phi3", "gpt_neox"])
def test_issue_architectures(arch, names, detail):
    """OPT's decoder layer was taken for an MLP (and its forward broke); Phi-3 and GPT-NeoX
    came back with nothing replaced and no reason."""
    model, ids = _tiny(arch)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    layers = [type(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")
              or type(m).__name__.endswith("Layer")]
    report = fusedmlp.patch(model, strict=True)
    assert report.replaced == names and report.skipped == [], str(report)
    assert detail in report.details[names[0]] and "pre-norm" in report.details[names[0]]
    assert [type(m) for m in model.modules() if type(m) in layers] == layers
    with torch.no_grad():
        assert rel_diff(model(input_ids=ids).logits, ref) <= 1e-4
        model.generate(ids[:1], max_new_tokens=3, do_sample=False)
