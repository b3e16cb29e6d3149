"""fusedmlp.patch on fp8 models: tiny random-init Hugging Face models whose linears are made fp8
in-process (nothing is downloaded), in the two layouts fp8 checkpoints use:

- transformers' fine-grained fp8 (FP8Linear: e4m3 weight + weight_scale_inv, 128 x 128 blocks
  as DeepSeek-V3 / Qwen3 FP8, or one scale per tensor);
- compressed-tensors' per-channel fp8 (e4m3 weight + weight_scale [out, 1]). The
  compressed-tensors package is not a dependency, so these tests build an equivalent module
  (CompressedFp8Linear below: the tensors that format stores, dequantising in its forward).

Reference: the same model with every fp8 linear replaced by an nn.Linear holding the exact
dequantised weight (weight * scale, fp32), which is what fusedmlp's weight-only fp8 path
computes; fp32 on the CPU backend, |patched - reference| <= 1e-4 * (|ref| + rms(ref row)).
FP8Linear's own forward quantises the activations too and needs the `kernels` package (absent
here: it raises), so it is not the reference."""

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed; fusedmlp.patch needs it")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed; the patch() tests build HF models")
fg = pytest.importorskip("transformers.integrations.finegrained_fp8",
                         reason="this transformers has no fine-grained fp8 integration")

import fusedmlp  # noqa: E402
import fusedmlp.torch as ft  # noqa: E402
from torch import nn  # noqa: E402


class CompressedFp8Linear(nn.Linear):
    """compressed-tensors' fp8 layout: weight e4m3 [out, in], weight_scale fp32 [out, 1]
    (channel strategy) or [1] (tensor strategy); forward dequantises (weight-only)."""

    def __init__(self, in_features, out_features, bias):
        super().__init__(in_features, out_features, bias=bias)
        self.weight = nn.Parameter(torch.empty(out_features, in_features,
                                               dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, 1), requires_grad=False)

    def forward(self, x):
        w = self.weight.float() * self.weight_scale.float()
        return nn.functional.linear(x, w.to(x.dtype), self.bias)


def _quantize(w, layout):
    """(e4m3 weight, scale in the module's layout, fp32 dequantised weight)."""
    w = w.detach().float().contiguous()
    if layout == "block":
        q, s, _ = fusedmlp.quantize_fp8(w, block=True)
        deq = q.float() * s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(
            128, 1)[:, :w.shape[1]]
    elif layout == "tensor":
        q, s, _ = fusedmlp.quantize_fp8(w, per_row=False)
        s = s.reshape(())
        deq = q.float() * s
    else:  # channel
        q, s, _ = fusedmlp.quantize_fp8(w, per_row=True)
        s = s.reshape(-1, 1)
        deq = q.float() * s
    return q, s, deq


def _fp8_module(lin, layout):
    """(fp8 module, reference nn.Linear with the dequantised weight) for nn.Linear lin."""
    q, s, deq = _quantize(lin.weight, layout)
    has_bias = lin.bias is not None
    if layout == "channel":
        m = CompressedFp8Linear(lin.in_features, lin.out_features, has_bias)
        m.weight.data, m.weight_scale.data = q, s
    else:
        m = fg.FP8Linear(lin.in_features, lin.out_features,
                         block_size=(128, 128) if layout == "block" else None, has_bias=has_bias)
        m.weight.data, m.weight_scale_inv.data = q, s.float()
    ref = nn.Linear(lin.in_features, lin.out_features, bias=has_bias)
    ref.weight.data = deq
    if has_bias:
        m.bias.data = lin.bias.detach().clone()
        ref.bias.data = lin.bias.detach().clone()
    return m, ref


def _fp8_model(model, layout, names):
    """(fp8 model, reference model): every nn.Linear whose qualified name ends with one of
    `names` becomes fp8 in the first and its dequantised nn.Linear in the second."""
    ref = copy.deepcopy(model)
    for root, is_ref in ((model, False), (ref, True)):
        for qual, mod in list(root.named_modules()):
            if type(mod) is nn.Linear and qual.rsplit(".", 1)[-1] in names:
                owner, _, attr = qual.rpartition(".")
                fp8, deq = _fp8_module(mod, layout)
                setattr(root.get_submodule(owner), attr, deq if is_ref else fp8)
    return model.eval(), ref.eval()


def close(a, b, rtol=1e-4):
    a, b = a.double(), b.double()
    rms = b.pow(2).mean(dim=-1, keepdim=True).sqrt()
    err = (a - b).abs() / (rtol * (b.abs() + rms))
    assert float(err.max()) <= 1.0, f"max error {float(err.max()):.3g}x tolerance"


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ids(vocab):
    return torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(0))


def llama(hidden=256, inter=600, bias=False):
    # intermediate 600: the last 128-row block of gate/up and 128-column block of down are
    # partial, so a scale misindexed at the edge shows
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=160,
                                   max_position_embeddings=64, mlp_bias=bias)
    return transformers.LlamaForCausalLM(cfg)


MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("layout", ["block", "tensor", "channel"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fp8_mlp_blocks_patch_and_match(layout, bias):
    model, ref = _fp8_model(llama(bias=bias), layout, MLP)
    want = logits(ref, _ids(160))
    report = fusedmlp.patch(model, strict=True, backend="cpu")
    assert report.replaced == ["model.layers.0.mlp", "model.layers.1.mlp"], str(report)
    mlp = model.model.layers[0].mlp
    fused = mlp if isinstance(mlp, ft.FusedMLP) else mlp.fused
    assert fused.w1.dtype == torch.float8_e4m3fn and fused.w1_scale is not None
    assert "e4m3 weights" in report.details["model.layers.0.mlp"]
    close(logits(model, _ids(160)), want)


def test_fp8_fused_gate_up_halves():
    """A Phi-3-style gate_up_proj in fp8: the halves' block scales split at the 128-row cut."""
    torch.manual_seed(1)
    cfg = transformers.Phi3Config(hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=160,
                                  max_position_embeddings=64, pad_token_id=0)
    model, ref = _fp8_model(transformers.Phi3ForCausalLM(cfg), "block",
                            ("gate_up_proj", "down_proj"))
    want = logits(ref, _ids(160))
    report = fusedmlp.patch(model, strict=True, backend="cpu")
    assert report.replaced == ["model.layers.0.mlp"], str(report)
    close(logits(model, _ids(160)), want)


def test_fp8_linears_and_lm_head():
    """patch(linears=True): fp8 attention projections and lm_head become FusedLinear with their
    block scales (the fp8 linear's bias stays fp32 beside fp32 activations)."""
    names = MLP + ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head")
    model, ref = _fp8_model(llama(), "block", names)
    want = logits(ref, _ids(160))
    report = fusedmlp.patch(model, strict=True, backend="cpu", linears=True)
    assert len(report.replaced) == 2 and "lm_head" in report.linears, str(report)
    assert len(report.linears) == 9, str(report)
    assert isinstance(model.lm_head, ft.FusedLinear) and \
        model.lm_head.weight.dtype == torch.float8_e4m3fn
    close(logits(model, _ids(160)), want)


def test_fp8_other_block_shapes_are_listed_not_broken():
    """64 x 64 blocks (not fusedmlp's): the blocks stay as they are, each listed with the
    reason, and the model still computes what it did."""
    model, _ = _fp8_model(llama(), "block", MLP)
    for layer in model.model.layers:
        for name in MLP:
            lin = getattr(layer.mlp, name)
            lin.block_size = (64, 64)
            n, k = lin.weight.shape
            lin.weight_scale_inv = nn.Parameter(torch.ones(-(-n // 64), -(-k // 64)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = fusedmlp.patch(model, strict=True, backend="cpu")
    assert report.replaced == []
    reasons = dict(report.skipped)
    assert "64 x 64 block scales" in reasons["model.layers.0.mlp"], str(report)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fp8_mixed_with_float_linears_is_listed():
    model, _ = _fp8_model(llama(), "block", ("gate_proj", "up_proj"))  # down_proj stays fp32
    report = fusedmlp.patch(model, strict=True, backend="cpu")
    assert report.replaced == []
    assert "mix e4m3 and float" in dict(report.skipped)["model.layers.0.mlp"], str(report)


def test_fused_linear_fp8_checks_its_arguments():
    w = torch.randn(32, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="weight_scale goes with"):
        ft.FusedLinear(w)
    with pytest.raises(ValueError, match="weight_scale goes with"):
        ft.FusedLinear(torch.randn(32, 64), weight_scale=torch.ones(32))
    lin = ft.FusedLinear(w, weight_scale=torch.full((32,), 0.5))
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), x @ (w.float() * 0.5).t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="w_scale"):
        ft.FusedLinear(w, weight_scale=torch.ones(31))(x)


def _block_q(w):
    q, s, _ = fusedmlp.quantize_fp8(w.detach().float().contiguous(), block=True)
    return q, s


def _deq(q, s):
    return q.float() * s.repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(
        128, 1)[:, :q.shape[1]]


def _fp8_experts(model, ref, make):
    """Every layer's experts of `model` replaced by make(config) filled with the block-quantised
    weights (gate and up halves apart); `ref`'s experts get the dequantised weights."""
    for layer, ref_layer in zip(model.model.layers, ref.model.layers):
        old = layer.mlp.experts
        new = make(old.config)
        inter = old.gate_up_proj.shape[1] // 2
        for i in range(old.gate_up_proj.shape[0]):
            gq, gs = _block_q(old.gate_up_proj[i, :inter])
            uq, us = _block_q(old.gate_up_proj[i, inter:])
            dq, ds = _block_q(old.down_proj[i])
            new.gate_up_proj.data[i] = torch.cat([gq, uq])
            new.gate_up_proj_scale_inv.data[i] = torch.cat([gs, us])
            new.down_proj.data[i], new.down_proj_scale_inv.data[i] = dq, ds
            with torch.no_grad():
                ref_layer.mlp.experts.gate_up_proj[i] = torch.cat([_deq(gq, gs), _deq(uq, us)])
                ref_layer.mlp.experts.down_proj[i] = _deq(dq, ds)
        layer.mlp.experts = new


def test_fp8_experts_moe_blocks_patch_and_match():
    """Mixtral with fine-grained fp8 experts (FP8Experts: gate_up_proj / down_proj in e4m3 with
    128 x 128 *_scale_inv): its sparse-MoE blocks become FusedMoE on the e4m3 experts, and the
    logits match the model whose experts hold the dequantised weights."""
    torch.manual_seed(2)
    cfg = transformers.MixtralConfig(hidden_size=256, intermediate_size=256,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=160, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(cfg).eval()
    ref = copy.deepcopy(model)
    _fp8_experts(model, ref, lambda c: fg.FP8Experts(c, block_size=(128, 128)))
    want = logits(ref, _ids(160))
    report = fusedmlp.patch(model, strict=True, backend="cpu")
    assert report.replaced == ["model.layers.0.mlp", "model.layers.1.mlp"], str(report)
    moe = model.model.layers[0].mlp
    assert isinstance(moe, ft.FusedMoE) and moe.w1.dtype == torch.float8_e4m3fn
    assert moe.w1_scale.shape == (4, 4, 2)
    close(logits(model, _ids(160)), want)


def test_fp8_registry_experts_switch_to_fusedmlp():
    """Qwen2-MoE (shared expert beside the routed ones, the experts-registry path) with
    fine-grained fp8 experts: patch registers "fusedmlp" in the fp8 experts registry too, the
    experts run through fusedmlp.moe with their block scales, and the logits match the model
    whose experts hold the dequantised weights."""
    torch.manual_seed(3)
    cfg = transformers.Qwen2MoeConfig(hidden_size=256, intermediate_size=256,
                                      moe_intermediate_size=256,
                                      shared_expert_intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=160, num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=64)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    ref = copy.deepcopy(model)
    # as transformers' fp8 loading builds them: FP8Experts under the fp8 experts registry
    from transformers.integrations.moe import use_experts_implementation
    fp8_experts = use_experts_implementation(experts_class=fg.FP8Experts,
                                             experts_interface=fg.ALL_FP8_EXPERTS_FUNCTIONS)
    _fp8_experts(model, ref, lambda c: fp8_experts(c, block_size=(128, 128)))
    want = logits(ref, _ids(160))
    report = fusedmlp.patch(model, strict=True, backend="cpu")
    assert report.experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], \
        str(report)
    assert model.config._experts_implementation == "fusedmlp"
    close(logits(model, _ids(160)), want)
