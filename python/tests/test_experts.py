"""fusedmlp as a transformers 5 experts implementation (fusedmlp.torch.fusedmlp_experts_forward,
register_experts) and patch() on MoE blocks that FusedMoE does not map (their experts switch to
"fusedmlp" through the registry). Tiny modules built from configs; nothing is downloaded.
Skipped when torch, transformers or its experts registry (transformers.integrations.moe) is
missing.

Tolerance: the experts against their eager forward, fp32 on CPU, |a - b| <= 1e-4 * (|b| +
rms(b row)) (both accumulate in fp32, in other orders); bf16 at PROBE_RTOL (torch rounds each
intermediate to bf16, the op keeps them in fp32). Whole models as in test_patch.py (1e-3)."""

import inspect
import types
import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
moe = pytest.importorskip("transformers.integrations.moe",
                          reason="transformers has no experts registry (integrations.moe)")
if not hasattr(moe, "ALL_EXPERTS_FUNCTIONS") or not hasattr(moe, "use_experts_implementation"):
    pytest.skip("transformers has no experts registry (ALL_EXPERTS_FUNCTIONS)",
                allow_module_level=True)

import fusedmlp  # noqa: E402
import fusedmlp.torch as ft  # noqa: E402  (before _experts, which it imports)
import fusedmlp._experts as fe  # noqa: E402
from test_patch import close, ids, output  # noqa: E402

nn = torch.nn
ft.register_experts()  # the modules below dispatch "fusedmlp" through the registry


def routing(rows, num_experts, top_k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(rows, num_experts, generator=gen).argsort(dim=-1)[:, :top_k]
    return idx, torch.rand(rows, top_k, generator=gen)


def init(module, seed=1):
    """Unit-scale outputs: every parameter ~ N(0, 1 / fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return module


def eager(m, *args):
    return fe._wrapped_forward(m)(m, *args)


def config(**kw):
    return types.SimpleNamespace(_experts_implementation="fusedmlp", num_experts_per_tok=2,
                                 **kw)


def make_experts(act="silu", post_norm=None, gate=None, **flags):
    """A decorated experts class of the given layout flags, whose eager forward reads that
    layout per token (interleaved: gate rows 0, 2, ..., up rows 1, 3, ...)."""
    gated, biased = flags.get("has_gate", True), flags.get("has_bias", False)
    transposed, concat = flags.get("is_transposed", False), flags.get("is_concatenated", True)

    class TinyExperts(nn.Module):
        def __init__(self, cfg, e=5, d=24, inter=40):
            super().__init__()
            self.num_experts, rows = e, (2 * inter if gated else inter)
            up = "gate_up_proj" if gated else "up_proj"
            setattr(self, up, nn.Parameter(torch.empty((e, d, rows) if transposed
                                                       else (e, rows, d))))
            self.down_proj = nn.Parameter(torch.empty((e, inter, d) if transposed
                                                      else (e, d, inter)))
            if biased:
                setattr(self, f"{up}_bias", nn.Parameter(torch.empty(e, rows)))
                self.down_proj_bias = nn.Parameter(torch.empty(e, d))
            self.act_fn = transformers.activations.ACT2FN[act]
            if post_norm is not None:
                self.post_expert_norm = post_norm(d)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            w1 = self.gate_up_proj if gated else self.up_proj
            for t in range(hidden_states.shape[0]):
                for j, e in enumerate(top_k_index[t].tolist()):
                    a, b = w1[e], self.down_proj[e]
                    if transposed:
                        a, b = a.T, b.T
                    h = a @ hidden_states[t]
                    if biased:
                        h = h + (self.gate_up_proj_bias if gated else self.up_proj_bias)[e]
                    if not gated:
                        h = self.act_fn(h)
                    elif concat:
                        h = self._apply_gate(h)
                    else:
                        h = self.act_fn(h[0::2]) * h[1::2]
                    y = b @ h + (self.down_proj_bias[e] if biased else 0)
                    if post_norm is not None:
                        y = self.post_expert_norm(y)
                    out[t] += top_k_weights[t, j] * y
            return out

    if gate is not None:
        TinyExperts._apply_gate = gate
    if post_norm is not None:
        if "has_post_expert_norm" not in inspect.signature(moe.use_experts_implementation).parameters:
            pytest.skip(f"transformers {transformers.__version__} has no post-expert norms")
        flags["has_post_expert_norm"] = True
    cls = moe.use_experts_implementation(**flags)(TinyExperts)
    return init(cls(config()))


def test_register_experts(monkeypatch):
    assert fusedmlp.register_experts() is True
    assert fusedmlp.register_experts() is True  # idempotent
    assert moe.ALL_EXPERTS_FUNCTIONS["fusedmlp"] is ft.fusedmlp_experts_forward
    monkeypatch.setattr(fe, "_moe_module", lambda: None)  # transformers without the registry
    assert ft.register_experts() is False


def olmoe_config(**kw):
    return transformers.OlmoeConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                                    num_experts_per_tok=2, vocab_size=128,
                                    max_position_embeddings=64, eos_token_id=1, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_olmoe_experts_match_eager(dtype):
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts
    ex = init(OlmoeExperts(olmoe_config())).to(dtype)
    assert fe.unsupported(ex) is None and fe.is_registry_experts(ex)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    idx, w = routing(37, 6, 2)
    with torch.no_grad():
        got = ft.fusedmlp_experts_forward(ex, x, idx, w.to(dtype))
        ref = eager(ex, x, idx, w.to(dtype))
    assert got.dtype == dtype and got.shape == (37, 64)
    close(got, ref, rtol=1e-4 if dtype == torch.float32 else ft.PROBE_RTOL[dtype])


def test_aria_experts_transposed():
    aria = pytest.importorskip("transformers.models.aria.modeling_aria")
    cfg = transformers.AriaTextConfig(hidden_size=32, intermediate_size=48, moe_num_experts=4,
                                      moe_topk=2)
    ex = init(aria.AriaExperts(cfg))
    if not fe.is_registry_experts(ex):
        pytest.skip(f"AriaExperts of transformers {transformers.__version__} is not a registry "
                    "experts class")
    assert ex.is_transposed
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(3))
    idx, w = routing(9, 4, 2)
    with torch.no_grad():
        close(ft.fusedmlp_experts_forward(ex, x, idx, w), eager(ex, x, idx, w), rtol=1e-4)


@pytest.mark.parametrize("flags", [
    dict(), dict(is_transposed=True), dict(is_concatenated=False), dict(has_bias=True),
    dict(has_gate=False), dict(has_gate=False, has_bias=True, is_transposed=True),
    dict(is_transposed=True, is_concatenated=False, has_bias=True),
], ids=["default", "transposed", "interleaved", "bias", "dense", "dense_bias_transposed",
        "transposed_interleaved_bias"])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
def test_layouts_match_eager(flags, act):
    ex = make_experts(act=act, **flags)
    x = torch.randn(13, 24, generator=torch.Generator().manual_seed(4))
    idx, w = routing(13, 5, 3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # the supported path must not fall back
        got = ex(x, idx, w)  # dispatched by the registry (config: "fusedmlp")
        ref = eager(ex, x, idx, w)
    close(got, ref, rtol=1e-4)
    converted = flags.get("is_transposed", False) or flags.get("is_concatenated", True) is False
    assert ("_fusedmlp_layout" in ex.__dict__) == converted


def test_converted_copy_is_cached_and_refreshed():
    ex = make_experts(is_transposed=True, has_bias=True)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(5))
    idx, w = routing(6, 5, 2)
    with torch.no_grad():
        ex(x, idx, w)
        first = ex.__dict__["_fusedmlp_layout"]
        ex(x, idx, w)
        assert ex.__dict__["_fusedmlp_layout"] is first  # reused, not recopied
        ex.gate_up_proj.mul_(-0.5)  # in place: the version counter moves
        ex.down_proj_bias.add_(1.0)
        got = ex(x, idx, w)
        assert ex.__dict__["_fusedmlp_layout"] is not first
        close(got, eager(ex, x, idx, w), rtol=1e-4)
        ex.double().float()  # new storage
        close(ex(x, idx, w), eager(ex, x, idx, w), rtol=1e-4)


def test_cached_verdict_follows_the_module():
    """The support verdict is kept per module; a change it depends on after the first call (new
    storage of another dtype, expert parallelism switched on) must send the call to eager."""
    fe._WARNED.clear()
    ex = make_experts()
    x = torch.randn(4, 24, generator=torch.Generator().manual_seed(9))
    idx, w = routing(4, 5, 2)
    with torch.no_grad():
        close(ex(x, idx, w), eager(ex, x, idx, w), rtol=1e-4)
        ex.double()
        with pytest.warns(RuntimeWarning, match="float64"):
            got = ex(x.double(), idx, w.double())
        assert torch.equal(got, eager(ex, x.double(), idx, w.double()))
        ex.float()
        close(ex(x, idx, w), eager(ex, x, idx, w), rtol=1e-4)
        ex._is_expert_parallel = True
        with pytest.warns(RuntimeWarning, match="expert-parallel"):
            got = ex(x, idx, w)
        assert torch.equal(got, eager(ex, x, idx, w))


def _custom_gate(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.sigmoid(gate) * up


@pytest.mark.parametrize("case", ["apply_gate", "post_norm", "expert_parallel", "activation",
                                  "dtype"])
def test_unsupported_fall_back_to_eager_with_warning(case):
    fe._WARNED.clear()
    kw = dict(apply_gate=dict(gate=_custom_gate), post_norm=dict(post_norm=nn.LayerNorm),
              activation=dict(act="quick_gelu")).get(case, {})
    ex = make_experts(**kw)
    if case == "expert_parallel":
        ex._is_expert_parallel = True
    if case == "dtype":
        ex.double()
    dtype = torch.float64 if case == "dtype" else torch.float32
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(6)).to(dtype)
    idx, w = routing(5, 5, 2)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="TinyExperts runs without fusedmlp"):
            got = ex(x, idx, w.to(dtype))
        assert torch.equal(got, eager(ex, x, idx, w.to(dtype)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ex(x, idx, w.to(dtype))  # warned once only


def test_gpt_oss_experts_fall_back():
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    fe._WARNED.clear()
    cfg = transformers.GptOssConfig(hidden_size=32, intermediate_size=48, num_local_experts=4,
                                    num_experts_per_tok=2)
    ex = init(gpt_oss.GptOssExperts(cfg))
    assert "_apply_gate" in fe.unsupported(ex)  # clamped, biased gate: not act(gate) * up
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(7))
    idx, w = routing(5, 4, 2)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="GptOssExperts"):
        assert torch.equal(ft.fusedmlp_experts_forward(ex, x, idx, w), eager(ex, x, idx, w))


@pytest.mark.parametrize("flags", [dict(), dict(is_transposed=True)],
                         ids=["default", "transposed"])
def test_compile_fullgraph(flags):
    torch._dynamo.reset()
    ex = make_experts(**flags).eval()
    x = torch.randn(7, 24, generator=torch.Generator().manual_seed(8))
    idx, w = routing(7, 5, 2)
    compiled = torch.compile(ex, fullgraph=True)
    with torch.no_grad():
        ref = eager(ex, x, idx, w)
        close(compiled(x, idx, w), ref, rtol=1e-4)  # no cached copy yet: converted in-graph
        ex(x, idx, w)  # eager call: caches the converted copy
        torch._dynamo.reset()
        close(torch.compile(ex, fullgraph=True)(x, idx, w), ref, rtol=1e-4)


# ---- patch() ----

def olmoe(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    model = transformers.OlmoeForCausalLM(olmoe_config(**kw))
    for i, layer in enumerate(model.model.layers):
        init(layer.mlp.experts, seed=i)
    return model.to(dtype).eval()


_OLMOE = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "plain"])
def test_patch_olmoe_experts(strict):
    model = olmoe()
    x = ids(128, (3, 9))
    ref = output(model, x)
    before = model.config._experts_implementation
    report = fusedmlp.patch(model, strict=strict)
    assert report.experts == _OLMOE and report.replaced == [], str(report)
    assert "switched model.layers.1.mlp.experts: OlmoeExperts" in str(report)
    if strict:
        assert all(0 <= report.errors[n] <= 1 for n in _OLMOE)
    assert model.config._experts_implementation == "fusedmlp"
    assert all(m._fusedmlp_previous == before for m in model.modules()
               if type(m).__name__ == "OlmoeExperts")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(output(model, x), ref)
    again = fusedmlp.patch(model)  # idempotent
    assert again.experts == [] and again.replaced == [] and again.skipped == []
    out = model.generate(x[:1, :5], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 8)


def test_patch_experts_strict_refuses(monkeypatch):
    model = olmoe()
    before = model.config._experts_implementation

    def wrong(self, hidden_states, top_k_index, top_k_weights):
        return eager(self, hidden_states, top_k_index, top_k_weights) * 1.01
    monkeypatch.setattr(fe, "fusedmlp_experts_forward", wrong)
    with pytest.raises(ft.PatchError, match="unchanged") as info:
        fusedmlp.patch(model, strict=True)
    assert [n for n, _ in info.value.report.skipped] == _OLMOE
    assert model.config._experts_implementation == before
    assert not any("_fusedmlp_previous" in m.__dict__ for m in model.modules())
    report = fusedmlp.patch(model, probe=torch.randn(4, 64))
    assert report.experts == [] and "tolerance" in str(report)
    assert model.config._experts_implementation == before


def test_patch_experts_partly_refused_keep_their_implementation(monkeypatch):
    """The implementation is per config: a refused experts module keeps running the one the
    model had, silently (it is in report.skipped)."""
    model = olmoe()
    x = ids(128, (2, 7))
    ref = output(model, x)
    refused = model.model.layers[1].mlp.experts
    real = fe.fusedmlp_experts_forward

    def wrong_for_one(self, *args):
        return real(self, *args) * (1.01 if self is refused else 1.0)
    monkeypatch.setattr(fe, "fusedmlp_experts_forward", wrong_for_one)
    report = fusedmlp.patch(model, probe=torch.randn(4, 64))
    assert report.experts == _OLMOE[:1] and report.skipped[0][0] == _OLMOE[1], str(report)
    monkeypatch.undo()
    ft.register_experts()  # patch() registered the monkeypatched function
    assert model.config._experts_implementation == "fusedmlp" and refused._fusedmlp_skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(output(model, x), ref)


def test_patch_qwen2_moe_keeps_shared_expert():
    cfg = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=96,
                                      moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, vocab_size=128,
                                      max_position_embeddings=64, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    for i, layer in enumerate(model.model.layers):
        init(layer.mlp.experts, seed=i)
    x = ids(128, (2, 7))
    ref = output(model, x)
    report = fusedmlp.patch(model, strict=True)
    assert report.experts == [f"model.layers.{i}.mlp.experts" for i in range(2)], str(report)
    close(output(model, x), ref)


def test_patch_mixtral_experts_option():
    from test_patch import mixtral
    model = mixtral()
    x = ids(128, (2, 7))
    ref = output(model, x)
    with pytest.raises(ValueError, match="moe is"):
        fusedmlp.patch(model, moe="router")
    report = fusedmlp.patch(model, strict=True, moe="experts")
    assert report.replaced == [] and len(report.experts) == 2, str(report)
    assert not any(isinstance(m, ft.FusedMoE) for m in model.modules())
    close(output(model, x), ref)


def test_patch_skips_unsupported_experts_with_reason():
    model = olmoe(hidden_act="quick_gelu")
    report = fusedmlp.patch(model)
    assert report.experts == [] and len(report.skipped) == 2, str(report)
    assert "not a known sparse-MoE block" in report.skipped[0][1]
    assert "OlmoeExperts cannot run through fusedmlp" in report.skipped[0][1]
    assert model.config._experts_implementation != "fusedmlp"


def test_compile_patched_olmoe_fullgraph():
    torch._dynamo.reset()
    model = olmoe()
    x = ids(128)
    ref = output(model, x)
    assert fusedmlp.patch(model).experts == _OLMOE
    with torch.no_grad():
        close(torch.compile(model, fullgraph=True)(input_ids=x).logits, ref)


def test_op_refusal_falls_back_and_is_remembered(monkeypatch):
    fe._WARNED.clear()
    ex = make_experts()
    x = torch.randn(4, 24, generator=torch.Generator().manual_seed(9))
    idx, w = routing(4, 5, 2)
    calls = []

    def refuse(*args):
        calls.append(1)
        raise NotImplementedError("no kernel takes d=24 (test)")
    monkeypatch.setattr(fe, "_run", refuse)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="refuses it: no kernel takes d=24"):
            got = ex(x, idx, w)
        assert torch.equal(got, eager(ex, x, idx, w))
        ex(x, idx, w)
    assert len(calls) == 1  # remembered: not asked again
    with pytest.raises(NotImplementedError, match="refuses it"):
        fe.experts_probe(make_experts())  # patch() skips such a module with the reason


_NO_CUDA = not torch.cuda.is_available() or not fusedmlp.available("cuda")[0]


@pytest.mark.skipif(_NO_CUDA, reason="no CUDA device or fusedmlp built without CUDA")
@pytest.mark.parametrize("flags", [dict(), dict(is_transposed=True, has_bias=True)],
                         ids=["default", "transposed_bias"])
def test_cuda_bf16_experts_graph_capture(flags):
    """bf16 experts on the GPU against their eager forward (PROBE_RTOL), then captured in a
    CUDA graph (no host syncs) and replayed on new rows and routings."""
    ex = make_experts(**flags).cuda().bfloat16()
    tol = ft.PROBE_RTOL[torch.bfloat16]

    def case(seed):
        x = torch.randn(6, 24, generator=torch.Generator().manual_seed(seed))
        idx, w = routing(6, 5, 2, seed=seed)
        return x.cuda().bfloat16(), idx.cuda(), w.cuda().bfloat16()
    static = case(0)
    with torch.no_grad():
        close(ex(*static), eager(ex, *static), rtol=tol)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside capture: workspace and converted copy
            ex(*static)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ex(*static)
        for seed in range(1, 4):
            new = case(seed)
            for dst, src in zip(static, new):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            close(out, eager(ex, *new), rtol=tol)


@pytest.mark.skipif(_NO_CUDA, reason="no CUDA device or fusedmlp built without CUDA")
def test_cuda_patch_bf16_olmoe():
    fe._WARNED.clear()
    model = olmoe(torch.bfloat16).cuda()
    report = fusedmlp.patch(model, strict=True)
    assert report.experts == _OLMOE, str(report)
    x = ids(128, (1, 5)).cuda()
    out = model.generate(x, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)
    f32 = make_experts().cuda()  # float32 experts: no cuda kernel, falls back with a warning
    args = (torch.randn(3, 24, device="cuda"), torch.tensor([[0, 1]] * 3, device="cuda"),
            torch.rand(3, 2, device="cuda"))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="float32 experts on CUDA"):
        assert torch.equal(f32(*args), eager(f32, *args))
