"""fusedmlp.moe against a float64 numpy reference (router and given routing, dense and gated,
biases, residual), its error contract, and, where torch is installed, the fusedmlp::moe op
(opcheck, torch.compile(fullgraph=True)) and FusedMoE against Hugging Face sparse-MoE blocks.

Tolerance as in test_mlp.py: |y - ref| <= rtol * (|ref| + rms(ref row)), rtol f32 1e-4, f16
2^-9 (the cpu backend accumulates in fp32 and rounds only the output). Routing: the reference
routes in fp64 like the library (ties to the lower id); random fp32/f16 inputs give no ties
at that precision. FusedMoE against Hugging Face blocks (fp32, torch routes in fp32): rows
whose top_k-th and next router logits are within 1e-4 of max|logit| are left out (either
side may pick either expert)."""

import numpy as np
import pytest

import fusedmlp
from test_mlp import act_ref, assert_close, f64, rand


def moe_ref(x, w1, w2, *, top_k, router_w=None, router_b=None, topk_ids=None,
            topk_weights=None, b1=None, b2=None, residual=None, activation="silu", gated=True,
            scoring="softmax", renormalize=True, **_):
    x, w1, w2 = f64(x), f64(w1), f64(w2)
    if topk_ids is None:
        logits = x @ f64(router_w).T + (0.0 if router_b is None else f64(router_b))
        if scoring == "softmax":
            s = np.exp(logits - logits.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
        else:
            s = 1.0 / (1.0 + np.exp(-logits))
        ids = np.argsort(-s, axis=1, kind="stable")[:, :top_k]  # ties: lower id first
        wts = np.take_along_axis(s, ids, axis=1)
        if renormalize:
            wts = wts / wts.sum(axis=1, keepdims=True)
    else:
        ids, wts = np.asarray(topk_ids), f64(topk_weights)
    hidden = w2.shape[2]
    y = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            g = w1[e] @ x[t] + (0.0 if b1 is None else f64(b1)[e])
            h = act_ref(activation, g[:hidden]) * g[hidden:] if gated else act_ref(activation, g)
            y[t] += wts[t, j] * (w2[e] @ h + (0.0 if b2 is None else f64(b2)[e]))
    return y if residual is None else y + f64(residual)


def make_moe(rng, t=7, d=40, hidden=56, d_out=40, experts=8, top_k=2, dtype=np.float32,
             gated=True, biases=True, router_bias=True):
    """Arguments of one moe call; weights scaled so activations stay O(1) and router logits
    spread over a few units (clear top-k choices)."""
    rows = 2 * hidden if gated else hidden
    kw = dict(x=rand(rng, (t, d), dtype), w1=rand(rng, (experts, rows, d), dtype, d**-0.5),
              w2=rand(rng, (experts, d_out, hidden), dtype, hidden**-0.5),
              router_w=rand(rng, (experts, d), dtype, 2 * d**-0.5), top_k=top_k, gated=gated)
    if biases:
        kw.update(b1=rand(rng, (experts, rows), dtype, 0.1),
                  b2=rand(rng, (experts, d_out), dtype, 0.1))
    if router_bias:
        kw["router_b"] = rand(rng, (experts,), dtype, 0.5)
    return kw


def call(kw, **extra):
    args = {**kw, **extra}
    return fusedmlp.moe(args.pop("x"), args.pop("w1"), args.pop("w2"), **args)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("gated", [False, True], ids=["dense", "gated"])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False),
                                                 ("sigmoid", True), ("sigmoid", False)])
@pytest.mark.parametrize("t,experts,top_k", [(1, 8, 2), (7, 8, 2), (33, 4, 1), (5, 4, 4)])
def test_router_vs_ref(dtype, gated, scoring, renormalize, t, experts, top_k):
    rng = np.random.default_rng(t * 100 + experts * 10 + top_k)
    kw = make_moe(rng, t=t, experts=experts, top_k=top_k, dtype=dtype, gated=gated)
    kw.update(scoring=scoring, renormalize=renormalize, activation="gelu" if gated else "silu")
    y = call(kw)
    assert y.dtype == dtype and y.shape == (t, 40)
    assert_close(y, moe_ref(**kw))


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "relu2"])
def test_odd_sizes_residual_backends(backend, activation):
    rng = np.random.default_rng(3)
    kw = make_moe(rng, t=13, d=37, hidden=23, d_out=19, experts=5, top_k=3, router_bias=False)
    kw["activation"] = activation
    residual = rand(rng, (13, 19), np.float32)
    ref = moe_ref(**kw, residual=residual)
    assert_close(call(kw, residual=residual, backend=backend), ref)
    out = residual.copy()  # in place: out is residual
    assert call(kw, residual=out, out=out, backend=backend) is out
    assert_close(out, ref)


def test_given_routing():
    rng = np.random.default_rng(4)
    kw = make_moe(rng, t=9, experts=6, top_k=3)
    del kw["router_w"], kw["router_b"]
    ids = rng.integers(0, 6, (9, 3))  # int64, repeats within a token allowed
    ids[0] = [2, 2, 5]
    wts = rng.random((9, 3))  # float64, used as given (no renormalisation)
    ref = moe_ref(**kw, topk_ids=ids, topk_weights=wts)
    assert_close(call(kw, topk_ids=ids, topk_weights=wts), ref)
    assert_close(call(kw, topk_ids=ids.astype(np.int32), topk_weights=wts.astype(np.float32)),
                 ref)


def test_zero_tokens_explain_and_kernels():
    rng = np.random.default_rng(5)
    kw = make_moe(rng, t=0)
    assert call(kw).shape == (0, 40)
    kw = make_moe(rng)
    report = fusedmlp.moe_explain(kw.pop("x"), kw.pop("w1"), kw.pop("w2"), **kw)
    assert "moe_cpu_avx2_grouped" in report or "moe_ref" in report
    names = [n for n, _ in fusedmlp.kernels("moe")]
    assert "moe_ref_scalar_fp64" in names and "moe_cpu_avx2_grouped" in names
    kw = make_moe(rng)
    assert fusedmlp.moe_workspace_size(kw.pop("x"), kw.pop("w1"), kw.pop("w2"), **kw) >= 0


@pytest.mark.parametrize("change,name", [
    (lambda kw: kw.update(w1=kw["w1"][:, :, :-1]), "w1"),
    (lambda kw: kw.update(w1=kw["w1"][0]), "w1"),
    (lambda kw: kw.update(w2=kw["w2"][:-1]), "w2"),
    (lambda kw: kw.update(router_w=kw["router_w"][:, :-1]), "router_w"),
    (lambda kw: kw.update(router_b=kw["router_b"][:-1]), "router_b"),
    (lambda kw: kw.update(b1=kw["b1"][:, :-1]), "b1"),
    (lambda kw: kw.update(b2=kw["b2"][:-1]), "b2"),
    (lambda kw: kw.update(x=kw["x"].astype(np.int32)), "x"),
    (lambda kw: kw.update(w2=kw["w2"].astype(np.float16)), "w2"),
    (lambda kw: kw.update(top_k=0), "top_k"),
    (lambda kw: kw.update(top_k=9), "top_k"),
    (lambda kw: kw.update(top_k=2.0), "top_k"),
    (lambda kw: kw.update(scoring="relu"), "scoring"),
    (lambda kw: kw.update(activation="tanh"), "activation"),
    (lambda kw: kw.update(backend="gpu"), "backend"),
    (lambda kw: kw.update(router_w=None), "router_w"),
    (lambda kw: kw.update(topk_ids=np.zeros((7, 2), np.int32)), "topk_weights"),
    (lambda kw: kw.update(router_w=None, topk_ids=np.zeros((7, 3), np.int32),
                          topk_weights=np.ones((7, 3), np.float32)), "topk_ids"),
    (lambda kw: kw.update(router_w=None, topk_ids=np.zeros((7, 2), np.float32),
                          topk_weights=np.ones((7, 2), np.float32)), "topk_ids"),
    (lambda kw: kw.update(router_w=None, topk_ids=np.zeros((2, 7), np.int32).T,
                          topk_weights=np.ones((7, 2), np.float32)), "topk_ids"),
    (lambda kw: kw.update(router_w=None, topk_ids=np.zeros((7, 2), np.int32),
                          topk_weights=np.ones((7, 4), np.float32)), "topk_weights"),
    (lambda kw: kw.update(residual=np.zeros((7, 39), np.float32)), "residual"),
])
def test_bad_input_names_the_argument(change, name):
    rng = np.random.default_rng(6)
    kw = make_moe(rng)
    change(kw)
    if kw.get("router_w") is None:
        kw.pop("router_b", None)
    out = np.full((7, 40), 7.0, np.float32)
    with pytest.raises(ValueError, match=name):
        call(kw, out=out)
    assert np.all(out == 7.0), "nothing may be written on error"


def test_host_expert_ids_out_of_range():
    rng = np.random.default_rng(7)
    kw = make_moe(rng, experts=4)
    del kw["router_w"], kw["router_b"]
    ids = np.zeros((7, 2), np.int32)
    ids[3, 1] = 4
    out = np.full((7, 40), 7.0, np.float32)
    with pytest.raises(ValueError, match=r"token 3\) is 4"):
        call(kw, topk_ids=ids, topk_weights=np.ones((7, 2), np.float32), out=out)
    assert np.all(out == 7.0)
    ids[3, 1] = -1
    with pytest.raises(ValueError, match="is -1"):
        call(kw, topk_ids=ids, topk_weights=np.ones((7, 2), np.float32))
    big = np.zeros((7, 2), np.int64)
    big[0, 0] = 2**40  # int32 cannot hold it: reported, not wrapped into range
    with pytest.raises(ValueError, match="topk_ids holds 1099511627776"):
        call(kw, topk_ids=big, topk_weights=np.ones((7, 2), np.float32))


def quantize_experts(w, per_row):
    """fp8 experts as moe() takes them: q [E, rows, cols] float8_e4m3fn and scales [E, rows]
    (per_row) or [E], each expert through quantize_fp8; also the dequantised float64 weights."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    scales = []
    for e in range(w.shape[0]):
        q[e], s, _ = fusedmlp.quantize_fp8(w[e], per_row=per_row)
        scales.append(s)
    scale = np.stack(scales) if per_row else np.concatenate(scales)
    deq = q.astype(np.float64) * (scale[:, :, None] if per_row else scale[:, None, None])
    return q, scale, deq


@pytest.mark.parametrize("per_row", [True, False], ids=["row-scales", "expert-scales"])
@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_fp8_experts(per_row, backend):
    rng = np.random.default_rng(8)
    kw = make_moe(rng, t=9, d=40, hidden=24, d_out=33, experts=4, top_k=2)
    q1, s1, deq1 = quantize_experts(kw["w1"], per_row)
    q2, s2, deq2 = quantize_experts(kw["w2"], per_row)
    y = call(dict(kw, w1=q1, w2=q2), w1_scale=s1, w2_scale=s2, backend=backend)
    assert_close(y, moe_ref(**dict(kw, w1=deq1, w2=deq2)))
    with pytest.raises(ValueError, match="w2_scale is absent"):
        call(dict(kw, w1=q1, w2=q2), w1_scale=s1, backend=backend)
    with pytest.raises(ValueError, match="w1_scale is given"):
        call(kw, w1_scale=s1, backend=backend)


def quantize_experts_block(w, gated):
    """fp8 experts with 128 x 128 block scales [E, row blocks, col blocks] (gated: each expert's
    gate and up halves quantised apart, quantize_fp8(gate_up=True)); also the dequantised float64
    weights."""
    pytest.importorskip("ml_dtypes")
    qs, scales = zip(*[fusedmlp.quantize_fp8(w[e], block=True, gate_up=gated)[:2]
                       for e in range(w.shape[0])])
    q, scale = np.stack(qs), np.stack(scales)
    deq = np.empty(w.shape)
    for e in range(w.shape[0]):
        for p, (rows, sp) in enumerate(zip(np.split(np.arange(w.shape[1]), 2 if gated else 1),
                                           np.split(scale[e], 2 if gated else 1))):
            full = np.repeat(np.repeat(sp, 128, 0), 128, 1)[:len(rows), :w.shape[2]]
            deq[e, rows] = q[e, rows].astype(np.float64) * full
    return q, scale, deq


@pytest.mark.parametrize("gated", [False, True], ids=["dense", "gated"])
@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_fp8_experts_block_scales(gated, backend):
    """[E, ceil(rows / 128), ceil(cols / 128)] expert scales (gated w1: gate block rows, then up
    block rows; hidden 150 is not a multiple of 128) against the fp64 moe of the dequantised
    experts; the cuda-only refusal and a wrong shape name the argument."""
    rng = np.random.default_rng(9)
    kw = make_moe(rng, t=20, d=140, hidden=150, d_out=130, experts=4, top_k=2, gated=gated)
    q1, s1, deq1 = quantize_experts_block(kw["w1"], gated)
    q2, s2, deq2 = quantize_experts_block(kw["w2"], False)
    assert s1.shape == (4, 4 if gated else 2, 2) and s2.shape == (4, 2, 2)
    y = call(dict(kw, w1=q1, w2=q2), w1_scale=s1, w2_scale=s2, backend=backend)
    assert_close(y, moe_ref(**dict(kw, w1=deq1, w2=deq2)))
    with pytest.raises(ValueError, match="w2_scale must have shape"):
        call(dict(kw, w1=q1, w2=q2), w1_scale=s1, w2_scale=s2[:, :1], backend=backend)


# ---- torch ----

def _torch():
    return pytest.importorskip("torch", reason="torch is not installed; fusedmlp.torch needs it")


def torch_moe_case(torch, t=(2, 3), d=32, hidden=48, experts=8, top_k=2, dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype or torch.float32)
    return dict(x=r(*t, d), w1=r(experts, 2 * hidden, d, scale=d**-0.5),
                w2=r(experts, d, hidden, scale=hidden**-0.5), router_w=r(experts, d, scale=0.5),
                router_b=r(experts, scale=0.3), b1=r(experts, 2 * hidden, scale=0.1),
                b2=r(experts, d, scale=0.1), top_k=top_k)


def numpy_args(kw):
    return {k: v.double().numpy() if hasattr(v, "numpy") else v for k, v in kw.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_op_vs_ref(dtype):
    torch = _torch()
    import fusedmlp.torch as ft
    from test_torch import RTOL
    from test_torch import assert_close as t_close
    dt = getattr(torch, dtype)
    kw = torch_moe_case(torch, dtype=dt)
    residual = torch.randn(2, 3, 32).to(dt)
    y = ft.moe(**kw, residual=residual)
    assert y.shape == (2, 3, 32) and y.dtype == dt
    flat = {k: v.reshape(6, 32) if k == "x" else v for k, v in kw.items()}
    ref = moe_ref(**numpy_args(flat), residual=residual.reshape(6, 32).double().numpy())
    # bf16: the reference routes the bf16 values in fp64 like the library; rows near a tie are
    # absent by construction of the seed (checked by the margin assertion).
    t_close(y.reshape(6, 32), torch.from_numpy(ref), rtol=RTOL[dt] * 2)
    # Given routing in torch's own dtypes (int64 ids, bf16 weights): cast by the op.
    ids = torch.tensor([[0, 3], [7, 7], [1, 2], [5, 0], [6, 4], [2, 1]]).reshape(2, 3, 2)
    wts = torch.rand(2, 3, 2).to(dt)
    given = {k: v for k, v in kw.items() if k not in ("router_w", "router_b")}
    y = ft.moe(**given, topk_ids=ids, topk_weights=wts)
    ref = moe_ref(**numpy_args({k: v.reshape(6, 32) if k == "x" else v
                                for k, v in given.items()}),
                  topk_ids=ids.reshape(6, 2).numpy(), topk_weights=wts.reshape(6, 2).double())
    t_close(y.reshape(6, 32), torch.from_numpy(ref), rtol=RTOL[dt] * 2)
    # The generic entry point takes torch tensors too and allocates out with torch.
    y2 = fusedmlp.moe(flat["x"], flat["w1"], flat["w2"], router_w=kw["router_w"],
                      router_b=kw["router_b"], b1=kw["b1"], b2=kw["b2"], top_k=2)
    assert isinstance(y2, torch.Tensor)
    torch.testing.assert_close(y2, ft.moe(**flat))


def test_torch_opcheck():
    torch = _torch()
    kw = torch_moe_case(torch)
    op = torch.ops.fusedmlp.moe.default
    torch.library.opcheck(op, (kw["x"], kw["w1"], kw["w2"], 2),
                          dict(router_w=kw["router_w"], router_b=kw["router_b"], b1=kw["b1"],
                               b2=kw["b2"], residual=torch.randn(2, 3, 32), activation="gelu",
                               scoring="sigmoid", renormalize=False))
    ids = torch.randint(0, 8, (2, 3, 2))
    torch.library.opcheck(op, (kw["x"], kw["w1"], kw["w2"], 2),
                          dict(topk_ids=ids, topk_weights=torch.rand(2, 3, 2),
                               deterministic=True, backend="ref"))


def test_torch_compile_fullgraph():
    torch = _torch()
    import fusedmlp.torch as ft
    torch._dynamo.reset()
    kw = torch_moe_case(torch)
    m = ft.FusedMoE(kw["w1"], kw["w2"], kw["router_w"], router_b=kw["router_b"], b1=kw["b1"],
                    b2=kw["b2"], top_k=2).eval()

    def f(x, ids, wts):
        y = m(x, x)
        return y + ft.moe(x, m.w1, m.w2, topk_ids=ids, topk_weights=wts, top_k=2)

    x = kw["x"]
    ids, wts = torch.randint(0, 8, (2, 3, 2)), torch.rand(2, 3, 2)
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(x, ids, wts), f(x, ids, wts))
    x2 = torch.randn(5, 32)
    ids2, wts2 = torch.randint(0, 8, (5, 2)), torch.rand(5, 2)
    torch.testing.assert_close(compiled(x2, ids2, wts2), f(x2, ids2, wts2))


def test_fused_moe_errors():
    torch = _torch()
    import fusedmlp.torch as ft
    kw = torch_moe_case(torch)
    with pytest.raises(ValueError, match="top_k"):
        ft.FusedMoE(kw["w1"], kw["w2"], kw["router_w"], top_k=9)
    with pytest.raises(ValueError, match="scoring"):
        ft.FusedMoE(kw["w1"], kw["w2"], kw["router_w"], top_k=2, scoring="relu")
    m = ft.FusedMoE(kw["w1"], kw["w2"], kw["router_w"], top_k=2)
    with pytest.raises(ValueError, match=r"w1 must have shape .*\[8, \*, 31\]"):
        m(torch.randn(3, 31))  # d comes from x
    with pytest.raises(ValueError, match="token 0"):
        ft.moe(kw["x"], kw["w1"], kw["w2"], topk_ids=torch.full((2, 3, 2), 8),
               topk_weights=torch.rand(2, 3, 2), top_k=2)
    with pytest.raises(ValueError, match="topk_weights has shape"):
        ft.moe(kw["x"], kw["w1"], kw["w2"], topk_ids=torch.zeros(2, 3, 2, dtype=torch.int32),
               topk_weights=torch.rand(2, 3, 3), top_k=2)
    with pytest.raises(NotImplementedError, match="not a known sparse-MoE block"):
        ft.FusedMoE.from_module(torch.nn.Linear(4, 4))


# ---- Hugging Face blocks ----

def routing_clear(torch, logits, top_k, margin=1e-4):
    """Rows whose top_k-th and next logits are more than margin * max|logit| apart."""
    logits = logits.double().reshape(-1, logits.shape[-1])
    if top_k == logits.shape[-1]:
        return torch.ones(logits.shape[0], dtype=torch.bool)
    top = logits.topk(top_k + 1, dim=-1).values
    return (top[:, -2] - top[:, -1]) > margin * logits.abs().amax(-1)


def moe_logits_hooks(torch, model, seen):
    """Forward hooks appending each sparse-MoE block's router logits [rows, E] to seen (the
    router returns (logits, ...) in transformers 5, an nn.Linear gives them in 4.x)."""
    return [m.gate.register_forward_hook(
        lambda mod, inp, out: seen.append(out[0] if isinstance(out, tuple) else out))
        for m in model.modules() if type(m).__name__ == "MixtralSparseMoeBlock"]


def clear_prefix(torch, seen, shape, top_k, margin):
    """[batch, seq] bool: positions before the first one whose routing is ambiguous in any
    layer (a causal model carries a routing flip only to later positions)."""
    clear = torch.stack([routing_clear(torch, s, top_k, margin).reshape(shape) for s in seen])
    return clear.all(dim=0).cumprod(dim=-1).bool()


def _spread(torch, block):
    """Weights of unit-scale outputs (HF initialises with std 0.02, which makes the routing and
    the outputs tiny): router rows of std 2 / sqrt(d), experts 1 / sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in block.named_parameters():
            std = (2.0 if name.startswith("gate.") else 1.0) / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _hf_blocks():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    out = []
    mixtral = getattr(transformers.models.mixtral.modeling_mixtral, "MixtralSparseMoeBlock", None)
    if mixtral is not None:
        cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=48,
                                         num_local_experts=8, num_experts_per_tok=2,
                                         router_jitter_noise=0.1)
        out.append(("mixtral", lambda c=cfg: mixtral(c)))
    try:
        from transformers.models.qwen3_moe import modeling_qwen3_moe as q3
        for norm in (False, True):
            cfg = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=48,
                                              num_experts=6, num_experts_per_tok=3,
                                              norm_topk_prob=norm)
            out.append((f"qwen3moe_norm{int(norm)}", lambda c=cfg: q3.Qwen3MoeSparseMoeBlock(c)))
    except (ImportError, AttributeError):
        pass
    return out


def legacy_block(torch, d=32, hidden=48, experts=8, top_k=2):
    """The transformers 4.x MixtralSparseMoeBlock layout and math, written out: gate an
    nn.Linear, experts a ModuleList of w1 (gate) / w3 (up) / w2 (down), (y, router_logits)."""
    nn = torch.nn

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(d, hidden, bias=False)
            self.w3 = nn.Linear(d, hidden, bias=False)
            self.w2 = nn.Linear(hidden, d, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.w2(self.act_fn(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k, self.jitter_noise = top_k, 0.0
            self.gate = nn.Linear(d, experts, bias=False)
            self.experts = nn.ModuleList(Expert() for _ in range(experts))

        def forward(self, h):
            b, s, _ = h.shape
            h = h.reshape(-1, d)
            logits = self.gate(h)
            w = torch.softmax(logits, dim=1, dtype=torch.float)
            w, sel = torch.topk(w, self.top_k, dim=-1)
            w = (w / w.sum(dim=-1, keepdim=True)).to(h.dtype)
            y = torch.zeros_like(h)
            for t in range(h.shape[0]):
                for j in range(self.top_k):
                    y[t] += w[t, j] * self.experts[int(sel[t, j])](h[t])
            return y.reshape(b, s, d), logits

    Block.__name__ = "MixtralSparseMoeBlock"
    return Block()


def test_fused_moe_vs_hf_blocks():
    torch = _torch()
    import fusedmlp.torch as ft
    from test_torch import assert_close as t_close
    cases = _hf_blocks() + [("legacy_mixtral", lambda: legacy_block(torch))]
    for name, make in cases:
        torch.manual_seed(0)
        block = make().eval()
        _spread(torch, block)
        fused = ft.FusedMoE.from_module(block).eval()
        x = torch.randn(3, 11, 32)
        with torch.no_grad():
            ref = block(x.clone())
            got = fused(x)
        if isinstance(ref, tuple):  # 4.x interface: the router logits come back too
            assert isinstance(got, tuple), name
            torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
            ref, got = ref[0], got[0]
        logits = torch.nn.functional.linear(x, fused.router_w)
        keep = routing_clear(torch, logits, fused.top_k)
        assert int(keep.sum()) >= 20, name
        t_close(got.reshape(-1, 32)[keep], ref.reshape(-1, 32)[keep].double(), rtol=1e-4)


def test_fused_moe_jitter_only_in_training():
    torch = _torch()
    import fusedmlp.torch as ft
    blocks = _hf_blocks()
    if not blocks or blocks[0][0] != "mixtral":
        pytest.skip("this transformers has no MixtralSparseMoeBlock")
    torch.manual_seed(0)
    block = blocks[0][1]()
    _spread(torch, block)
    fused = ft.FusedMoE.from_module(block)
    assert fused.jitter_noise == 0.1
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        block.train(), fused.train()
        torch.manual_seed(1)
        ref = block(x.clone())  # the HF block scales its input in place
        torch.manual_seed(1)
        got = fused(x)  # the same draws, out of place
        torch.manual_seed(1)
        noisy = x * torch.empty_like(x).uniform_(0.9, 1.1)
        keep = routing_clear(torch, torch.nn.functional.linear(noisy, fused.router_w), 2)
        torch.testing.assert_close(got.reshape(-1, 32)[keep], ref.reshape(-1, 32)[keep],
                                   rtol=1e-4, atol=1e-5)
        assert not torch.allclose(got, fused.eval()(x))  # the noise acted in training only
        block.eval()
        keep = routing_clear(torch, torch.nn.functional.linear(x, fused.router_w), 2)
        torch.testing.assert_close(fused(x).reshape(-1, 32)[keep],
                                   block(x.clone()).reshape(-1, 32)[keep], rtol=1e-4, atol=1e-5)


def test_round_router_logits_routes_like_a_bf16_router():
    # Logits 1 and 1 + 2^-9 (bf16 x = [1, 2^-9], router rows [1, 0] and [1, 1]): distinct in
    # fp32, one value once rounded to bf16 as a bf16 nn.Linear router stores them. Rounded, the
    # tie goes to expert 0; kept in fp32, expert 1 wins. from_module rounds (HF semantics).
    torch = _torch()
    import fusedmlp.torch as ft
    bf = torch.bfloat16
    torch.manual_seed(3)
    d, hidden = 8, 16
    w1 = (torch.randn(2, 2 * hidden, d) / 3).to(bf)
    w2 = (torch.randn(2, d, hidden) / 4).to(bf)
    router = torch.zeros(2, d, dtype=bf)
    router[0, 0] = router[1, 0] = router[1, 1] = 1.0
    x = torch.zeros(1, d, dtype=bf)
    x[0, 0], x[0, 1] = 1.0, 2.0**-9
    assert float(torch.nn.functional.linear(x, router)[0, 1]) == 1.0  # the bf16 router ties

    def via(expert):
        return ft.moe(x, w1, w2, topk_ids=torch.tensor([[expert]]),
                      topk_weights=torch.ones(1, 1), top_k=1)

    to0, to1 = via(0), via(1)
    assert not torch.equal(to0, to1)
    for rounded, want in ((True, to0), (False, to1)):
        fused = ft.FusedMoE(w1, w2, router, top_k=1, round_router_logits=rounded)
        torch.testing.assert_close(fused(x), want, rtol=0, atol=0)
