"""fusedmlp.patch on tiny, randomly initialised Hugging Face models built from configs (nothing
is downloaded): GPT-2, Llama, BERT and Mixtral (sparse-MoE blocks -> FusedMoE).
Skipped when torch or transformers is not installed.

Whole-model tolerance: the patched model's output against the unpatched one, both fp32 on CPU,
|a - b| <= 1e-3 * (|b| + rms(b row)); each block (and with linears=True each replaced attention
projection and lm_head) is also probed by patch(strict=True) at fusedmlp.torch.PROBE_RTOL."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed; fusedmlp.patch needs it")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed; the patch() tests build HF models")

import fusedmlp  # noqa: E402
import fusedmlp.torch as ft  # noqa: E402
from test_moe import _spread, clear_prefix, moe_logits_hooks  # noqa: E402


def close(a, b, rtol=1e-3):
    a, b = a.double(), b.double()
    rms = b.pow(2).mean(dim=-1, keepdim=True).sqrt()
    err = (a - b).abs() / (rtol * (b.abs() + rms))
    assert float(err.max()) <= 1.0, f"max error {float(err.max()):.3g}x tolerance"


def ids(vocab, shape=(2, 7)):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def bert():
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=128,
                                  max_position_embeddings=64)
    return transformers.BertModel(cfg)


def output(model, x):
    with torch.no_grad():
        out = model(input_ids=x)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("fuse_norm", [True, False], ids=["fuse_norm", "mlp_only"])
@pytest.mark.parametrize("make,names,kind,norm", [
    (gpt2, ["transformer.h.0.mlp", "transformer.h.1.mlp"], "GPT2MLP", "layernorm"),
    (llama, ["model.layers.0.mlp", "model.layers.1.mlp"], "LlamaMLP", "rmsnorm"),
    (bert, [f"encoder.layer.{i}.intermediate.dense+encoder.layer.{i}.output.dense"
            for i in range(2)], "BertLayer's intermediate.dense", None),
], ids=["gpt2", "llama", "bert"])
def test_patch_matches_unpatched(make, names, kind, norm, fuse_norm):
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():  # non-trivial norm parameters, so a dropped gamma/beta shows
        for m in model.modules():
            if "Norm" in type(m).__name__:
                for p in m.parameters():
                    p.add_(0.3 * torch.randn_like(p))
    x = ids(128)
    ref = output(model, x)
    report = fusedmlp.patch(model, strict=True, fuse_norm=fuse_norm)
    assert report.replaced == names, str(report)
    assert kind in str(report) and "probe error" in str(report)
    assert all(0 <= report.errors[n] <= 1 for n in names)
    fused = [m for m in model.modules() if isinstance(m, ft.FusedMLP)]
    assert len(fused) == 2
    expected = norm if fuse_norm and norm else None
    assert all(m.norm == expected for m in fused), [m.norm for m in fused]
    close(output(model, x), ref)
    assert fusedmlp.patch(model).replaced == []  # idempotent: nothing left to swap


@pytest.mark.parametrize("linears", [False, True], ids=["mlp", "mlp+linears"])
def test_patch_bf16_llama_generate(linears):
    torch.manual_seed(0)
    model = llama().to(torch.bfloat16).eval()
    x = ids(128, (1, 5))
    ref = output(model, x).float()
    report = fusedmlp.patch(model, strict=True, linears=linears)
    assert len(report.linears) == (9 if linears else 0), str(report)
    close(output(model, x).float(), ref, rtol=2.0**-4)
    out = model.generate(x, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)


def mixtral(dtype=torch.float32):
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    for m in model.modules():
        if type(m).__name__ == "MixtralSparseMoeBlock":
            _spread(torch, m)  # unit-scale routing and experts instead of std 0.02
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_patch_mixtral(dtype):
    """The sparse-MoE blocks become FusedMoE; the logits match the unpatched model's (fp32:
    1e-3, bf16: 2^-4) at the positions before the first token whose routing is within
    margin * max|logit| of a tie in some layer, where either side may pick either expert: bf16
    2^-6 (torch rounds the logits to bf16, 2^-9 relative, and the upstream hidden states differ
    by a few bf16 units), fp32 1e-4."""
    model = mixtral(dtype)
    x = ids(128, (8, 9))
    seen = []
    hooks = moe_logits_hooks(torch, model, seen)
    ref = output(model, x).float()
    for h in hooks:
        h.remove()
    keep = clear_prefix(torch, seen, (8, 9), 2, 2.0**-6 if dtype == torch.bfloat16 else 1e-4)
    assert int(keep.sum()) >= 12, keep
    report = fusedmlp.patch(model, strict=True)
    assert report.replaced == ["model.layers.0.mlp", "model.layers.1.mlp"], str(report)
    assert "MixtralSparseMoeBlock -> FusedMoE" in str(report)
    assert all(0 <= report.errors[n] <= 1 for n in report.replaced)
    assert sum(isinstance(m, ft.FusedMoE) for m in model.modules()) == 2
    close(output(model, x).float()[keep], ref[keep],
          rtol=2.0**-4 if dtype == torch.bfloat16 else 1e-3)
    assert fusedmlp.patch(model).replaced == []  # idempotent
    out = model.generate(x[:1, :5], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 8)


def test_unknown_moe_block_is_skipped():
    class TinyMoe(torch.nn.Module):  # a block fusedmlp has no routing mapping for
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 4)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    report = fusedmlp.patch(torch.nn.Sequential(TinyMoe()))
    assert report.replaced == []
    assert report.skipped[0][0] == "0" and "not a known sparse-MoE block" in report.skipped[0][1]


def test_strict_refuses_and_leaves_model_unchanged(monkeypatch):
    model = gpt2().eval()
    before = [id(m) for m in model.modules()]
    real = fusedmlp._structure.Chain.weights

    def wrong_activation(self, tr):
        return dict(real(self, tr), activation="relu")  # GPT-2 uses gelu_tanh
    monkeypatch.setattr(fusedmlp._structure.Chain, "weights", wrong_activation)
    with pytest.raises(ft.PatchError, match="unchanged") as info:
        fusedmlp.patch(model, strict=True)
    assert [id(m) for m in model.modules()] == before
    assert len(info.value.report.skipped) == 2
    # Without strict but with a probe, the failing blocks are skipped instead.
    report = fusedmlp.patch(model, probe=torch.randn(4, 64))
    assert report.replaced == [] and "tolerance" in str(report)
    assert [id(m) for m in model.modules()] == before


def test_unknown_activation_is_skipped():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                  activation_function="quick_gelu")
    report = fusedmlp.patch(transformers.GPT2LMHeadModel(cfg).eval())
    assert report.replaced == []
    assert "QuickGELUActivation" in report.skipped[0][1]


@pytest.mark.parametrize("linears", [False, True], ids=["mlp", "mlp+linears"])
def test_compile_patched_gpt2_fullgraph(linears):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = gpt2().eval()
    x = ids(128)
    ref = output(model, x)
    fusedmlp.patch(model, linears=linears)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        close(compiled(input_ids=x).logits, ref)


def _gpt2_odd():  # Conv1D widths the vector paths do not divide: 63 -> 189, vocab 97
    cfg = transformers.GPT2Config(n_layer=2, n_embd=63, n_head=7, vocab_size=97, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg)


_GPT2_ATTN = [f"transformer.h.{i}.attn.{p}" for i in range(2) for p in ("c_attn", "c_proj")]
_LLAMA_ATTN = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
_BERT_ATTN = [f"encoder.layer.{i}.attention.{p}" for i in range(2)
              for p in ("self.query", "self.key", "self.value", "output.dense")]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "plain"])
@pytest.mark.parametrize("make,vocab,names,mlps", [
    (gpt2, 128, _GPT2_ATTN + ["lm_head"], 2),
    (_gpt2_odd, 97, _GPT2_ATTN + ["lm_head"], 2),
    (llama, 128, _LLAMA_ATTN + ["lm_head"], 2),
    (bert, 128, _BERT_ATTN, 2),
], ids=["gpt2", "gpt2_odd", "llama", "bert"])
def test_patch_linears_matches_unpatched(make, vocab, names, mlps, strict):
    torch.manual_seed(0)
    model = make().eval()
    x = ids(vocab)
    ref = output(model, x)
    head = getattr(model, "lm_head", None)
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    params = sum(p.numel() for p in model.parameters())
    report = fusedmlp.patch(model, strict=strict, linears=True)
    assert len(report.replaced) == mlps and report.linears == names, str(report)
    assert report.skipped == [] and "FusedLinear" in str(report)
    assert all(0 <= report.errors[n] <= 1 for n in names)  # probed in either mode
    fused = {n for n, m in model.named_modules() if isinstance(m, ft.FusedLinear)}
    assert fused == set(names)
    if head is not None:  # the same Parameter: tying and memory as before
        assert model.lm_head.weight is head.weight
        assert tied == (model.lm_head.weight is model.get_input_embeddings().weight)
    assert sum(p.numel() for p in model.parameters()) == params
    close(output(model, x), ref)
    again = fusedmlp.patch(model, linears=True)  # idempotent
    assert again.replaced == [] and again.linears == []


def test_gpt2_lm_head_stays_tied():
    model = gpt2().eval()
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte
    fusedmlp.patch(model, linears=True)
    assert isinstance(model.lm_head, ft.FusedLinear) and model.lm_head.weight is wte


def test_linears_off_leaves_attention_alone():
    for make in (gpt2, llama, bert):
        model = make().eval()
        report = fusedmlp.patch(model)
        assert report.linears == [] and len(report.replaced) == 2
        assert not any(isinstance(m, ft.FusedLinear) for m in model.modules())
        assert "FusedLinear" not in str(report)


def test_linears_leave_router_and_experts_alone():
    model = mixtral()
    report = fusedmlp.patch(model, linears=True)
    assert report.replaced == ["model.layers.0.mlp", "model.layers.1.mlp"], str(report)
    assert report.linears == _LLAMA_ATTN + ["lm_head"], str(report)


def test_linears_unsupported_are_skipped_with_reason():
    class Quantized(torch.nn.Linear):  # a subclass with its own forward, e.g. a quantized one
        def forward(self, x):
            return super().forward(x)

    class TinyAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 8)
            self.k_proj = torch.nn.Linear(8, 8).double()
            self.v_proj = Quantized(8, 8)
            self.rotary = torch.nn.Linear(8, 8)  # not a projection name: left alone

    model = torch.nn.Sequential(TinyAttention())
    report = fusedmlp.patch(model, strict=True, linears=True)
    assert report.linears == ["0.q_proj"], str(report)
    reasons = dict(report.skipped)
    assert "float64" in reasons["0.k_proj"] and "own forward" in reasons["0.v_proj"]
    assert "0.rotary" not in reasons
    assert type(model[0].k_proj) is torch.nn.Linear and type(model[0].v_proj) is Quantized
    assert type(model[0].rotary) is torch.nn.Linear


def test_linears_under_skipped_block_are_left_alone():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                  activation_function="quick_gelu")
    model = transformers.GPT2LMHeadModel(cfg).eval()
    report = fusedmlp.patch(model, linears=True)  # the MLP (quick_gelu) is skipped
    assert report.replaced == [] and report.skipped[0][0] == "transformer.h.0.mlp"
    assert report.linears == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                              "lm_head"]
    assert type(model.transformer.h[0].mlp.c_fc).__name__ == "Conv1D"
    assert type(model.transformer.h[0].mlp.c_proj).__name__ == "Conv1D"


def test_linears_strict_refuses_and_leaves_model_unchanged(monkeypatch):
    model = llama().eval()
    before = [id(m) for m in model.modules()]
    real = ft.FusedLinear.forward
    monkeypatch.setattr(ft.FusedLinear, "forward", lambda self, x: real(self, x) * 1.01)
    with pytest.raises(ft.PatchError, match="self_attn.q_proj") as info:
        fusedmlp.patch(model, strict=True, linears=True)
    assert [id(m) for m in model.modules()] == before
    assert len(info.value.report.skipped) == len(_LLAMA_ATTN) + 1


def test_linears_with_tp_group_raise():
    with pytest.raises(NotImplementedError, match="linears"):
        fusedmlp.patch(gpt2(), tp_group=object(), linears=True)


def test_mode_keeps_the_original_where_the_fused_module_is_slower(monkeypatch):
    """mode="eager": each kind of block is timed once (same description, weight shape, dtype,
    device); where the fused module is not faster the original stays, listed with both costs,
    and the model still matches the unpatched one."""
    import fusedmlp._patch as fp
    timed = []

    def fake_cost(plan, mode):  # linears slower when fused, MLP blocks faster
        timed.append((plan.detail, tuple(plan.weight.shape)))
        assert mode == "eager"
        return (1.0, 2.0) if plan.linear else (2.0, 1.0)

    monkeypatch.setattr(fp, "_plan_cost", fake_cost)
    torch.manual_seed(0)
    model = gpt2().eval()
    x = ids(128)
    ref = output(model, x)
    report = fusedmlp.patch(model, linears=True, mode="eager")
    assert report.replaced == ["transformer.h.0.mlp", "transformer.h.1.mlp"], str(report)
    assert report.linears == [], str(report)
    assert len(timed) == len(set(timed)) == 4, timed  # mlp, c_attn, c_proj, lm_head kinds
    kept = [n for n, why in report.skipped if why.startswith("kept the original: in eager mode")]
    assert len(kept) == 5 and "transformer.h.1.attn.c_attn" in kept, str(report)  # 4 + lm_head
    assert "eager 2.0 -> 1.0 us a call" in str(report)
    assert all(type(m).__name__ != "FusedLinear" for m in model.modules())
    close(output(model, x), ref)


def test_mode_times_the_blocks_for_real():
    """mode="eager" and "graph" with the real timing (cpu): every candidate either replaced or
    kept with its costs, and the model unchanged in what it computes."""
    for mode in ("eager", "graph"):
        torch.manual_seed(0)
        model = llama().eval()
        x = ids(128)
        ref = output(model, x)
        report = fusedmlp.patch(model, linears=True, mode=mode)
        names = report.replaced + report.linears
        kept = [n for n, why in report.skipped if why.startswith("kept the original")]
        assert len(names) + len(kept) == 2 + 2 * 4 + 1, str(report)  # mlps, q/k/v/o, lm_head
        assert set(report.costs) == set(names) | set(kept), str(report)
        assert all(o > 0 and f > 0 for o, f in report.costs.values())
        close(output(model, x), ref)


def test_mode_must_be_known():
    with pytest.raises(ValueError, match="mode is 'fast'; expected 'always'"):
        fusedmlp.patch(gpt2().eval(), mode="fast")
