"""fusedmlp.patch on tiny, randomly initialised Hugging Face models built from configs (nothing
is downloaded): GPT-2, Llama, BERT, and a mixture-of-experts model that must be skipped.
Skipped when torch or transformers is not installed.

Whole-model tolerance: the patched model's output against the unpatched one, both fp32 on CPU,
|a - b| <= 1e-3 * (|b| + rms(b row)); each block is also probed by patch(strict=True) at
fusedmlp.torch.PROBE_RTOL."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed; fusedmlp.patch needs it")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed; the patch() tests build HF models")

import fusedmlp  # noqa: E402
import fusedmlp.torch as ft  # noqa: E402


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
    (bert, ["encoder.layer.0.intermediate+output", "encoder.layer.1.intermediate+output"],
     "BertIntermediate", None),
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


def test_patch_bf16_llama_generate():
    torch.manual_seed(0)
    model = llama().to(torch.bfloat16).eval()
    x = ids(128, (1, 5))
    ref = output(model, x).float()
    fusedmlp.patch(model, strict=True)
    close(output(model, x).float(), ref, rtol=2.0**-4)
    out = model.generate(x, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)


def test_moe_is_skipped():
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                                     max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(cfg).eval()
    report = fusedmlp.patch(model)
    assert report.replaced == []
    assert len(report.skipped) == 2, str(report)
    assert all(reason == "moe op not available yet" for _, reason in report.skipped)


def test_strict_refuses_and_leaves_model_unchanged(monkeypatch):
    model = gpt2().eval()
    before = [id(m) for m in model.modules()]
    real = ft._describe

    def wrong_activation(m):
        return dict(real(m), activation="relu")  # GPT-2 uses gelu_tanh
    monkeypatch.setattr(fusedmlp._patch, "_describe", wrong_activation)
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


def test_compile_patched_gpt2_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = gpt2().eval()
    x = ids(128)
    ref = output(model, x)
    fusedmlp.patch(model)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        close(compiled(input_ids=x).logits, ref)
