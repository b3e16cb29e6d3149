"""fusedmlp.torch on CPU tensors: the custom ops against float64 references and under
torch.library.opcheck and torch.compile(fullgraph=True), and FusedMLP and FusedLinear against the
modules they replace. Skipped when torch is not installed. Tolerance as in test_mlp.py (rtol per
dtype on |ref| + rms of the row): f32 1e-4, bf16 2^-6."""

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed; fusedmlp.torch needs it")

import fusedmlp  # noqa: E402
import fusedmlp.torch as ft  # noqa: E402
from torch import nn  # noqa: E402

RTOL = {torch.float32: 1e-4, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}


def assert_close(y, ref, rtol=None):
    assert y.shape == ref.shape, (y.shape, ref.shape)
    rtol = rtol or RTOL[y.dtype]
    ref = ref.double()
    err = (y.double() - ref).abs()
    rms = ref.pow(2).mean(dim=-1, keepdim=True).sqrt()
    bound = rtol * (ref.abs() + rms)
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g}"


def act_ref(name, v):
    return {"relu": torch.relu, "silu": nn.functional.silu,
            "gelu": nn.functional.gelu,
            "gelu_tanh": lambda t: nn.functional.gelu(t, approximate="tanh")}[name](v)


def mlp_ref(x, w1, w2, b1=None, w_up=None, b_up=None, b2=None, residual=None,
            activation="gelu", gated=False, **_):
    d = {k: None if v is None else v.double()
         for k, v in dict(x=x, w1=w1, w2=w2, b1=b1, w_up=w_up, b_up=b_up, b2=b2,
                          residual=residual).items()}
    g = d["x"] @ d["w1"].T + (0 if d["b1"] is None else d["b1"])
    if gated:
        if d["w_up"] is None:
            g, u = g.chunk(2, dim=-1)
        else:
            u = d["x"] @ d["w_up"].T + (0 if d["b_up"] is None else d["b_up"])
        h = act_ref(activation, g) * u
    else:
        h = act_ref(activation, g)
    y = h @ d["w2"].T + (0 if d["b2"] is None else d["b2"])
    return y if residual is None else y + d["residual"]


def weights(d_in=32, hidden=48, d_out=32, dtype=torch.float32, gated=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    kw = dict(w1=r(hidden, d_in, scale=d_in**-0.5), b1=r(hidden, scale=0.1),
              w2=r(d_out, hidden, scale=hidden**-0.5), b2=r(d_out, scale=0.1))
    if gated:
        kw.update(w_up=r(hidden, d_in, scale=d_in**-0.5), b_up=r(hidden, scale=0.1), gated=True)
    return kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("gated", [False, True], ids=["dense", "gated"])
def test_mlp_op_any_leading_dims(dtype, gated):
    kw = weights(dtype=dtype, gated=gated)
    x = torch.randn(2, 3, 32).to(dtype)
    residual = torch.randn(2, 3, 32).to(dtype)
    y = ft.mlp(x, residual=residual, activation="silu", **kw)
    assert y.shape == (2, 3, 32) and y.dtype == dtype
    assert_close(y, mlp_ref(x, residual=residual, activation="silu", **kw).to(torch.float64))
    # The generic entry point takes torch tensors too (DLPack) and allocates out with torch.
    y2 = fusedmlp.mlp(x.reshape(6, 32), activation="silu", **kw)
    assert isinstance(y2, torch.Tensor)
    assert_close(y2, mlp_ref(x.reshape(6, 32), activation="silu", **kw))


def test_ops_accept_requires_grad_and_strided_inputs():
    kw = weights()
    kw["w1"].requires_grad_(True)
    x = torch.randn(8, 64)[:, :32]  # rows strided (inner dim contiguous)
    assert_close(ft.mlp(x, **kw), mlp_ref(x, **kw))
    xt = torch.randn(32, 5).t()  # inner dim not contiguous: copied by the op
    assert_close(ft.mlp(xt, **kw), mlp_ref(xt, **kw))


def test_linear_and_softmax_ops():
    x = torch.randn(2, 5, 24)
    w = torch.randn(40, 24) / 5
    b = torch.randn(40)
    assert_close(ft.linear(x, w, b), (x.double() @ w.double().T + b.double()))
    z = torch.randn(3, 4, 77) * 3
    assert_close(ft.softmax(z, 0.5), torch.softmax(z.double() / 0.5, -1))
    assert_close(ft.log_softmax(z), torch.log_softmax(z.double(), -1), rtol=1e-4)


def test_linear_fp8_weights():
    w = torch.randn(48, 64) / 8
    q, scale, _ = fusedmlp.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (48,)
    x = torch.randn(3, 64)
    deq = q.double() * scale.double()[:, None]
    assert_close(ft.linear(x, q, w_scale=scale), x.double() @ deq.T, rtol=2.0**-7)



def test_linear_fp8_block_scales_op_and_compile():
    """torch.ops.fusedmlp.linear with [ceil(N / 128), ceil(K / 128)] scales (quantize_fp8(block=
    True)) against the fp64 product of the dequantised weight, eager and under
    torch.compile(fullgraph=True)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(300, 272, generator=g) * 0.1
    x = torch.randn(3, 272, generator=g)
    q, s, _ = fusedmlp.quantize_fp8(w, block=True)
    assert s.shape == (3, 3)
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :272]
    ref = x.double() @ (q.double() * full.double()).T
    y = torch.ops.fusedmlp.linear(x, q, None, s)
    assert_close(y, ref, rtol=2.0**-12)
    compiled = torch.compile(lambda v: torch.ops.fusedmlp.linear(v, q, None, s), fullgraph=True)
    assert torch.equal(compiled(x), y)

def test_mlp_moe_fp8_block_scales_ops_and_compile():
    """torch.ops.fusedmlp.mlp / moe with 128 x 128 block scales (quantize_fp8(block=True,
    gate_up=True) for the stacked w1, hidden 150 not a multiple of 128) against the fp64 math of
    the dequantised weights, eager and under torch.compile(fullgraph=True)."""
    g = torch.Generator().manual_seed(8)
    d, hidden, d_out = 140, 150, 130

    def deq(q, s, halves=1):
        parts = [qp.double() * sp.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
                 [:qp.shape[0], :qp.shape[1]]
                 for qp, sp in zip(q.chunk(halves), s.chunk(halves))]
        return torch.cat(parts)
    w1 = torch.randn(2 * hidden, d, generator=g) * d**-0.5
    w2 = torch.randn(d_out, hidden, generator=g) * hidden**-0.5
    x = torch.randn(5, d, generator=g)
    q1, s1, _ = fusedmlp.quantize_fp8(w1, block=True, gate_up=True)
    q2, s2, _ = fusedmlp.quantize_fp8(w2, block=True)
    assert s1.shape == (4, 2) and s2.shape == (2, 2)
    ref = mlp_ref(x, deq(q1, s1, 2), deq(q2, s2), activation="silu", gated=True)
    y = torch.ops.fusedmlp.mlp(x, q1, q2, w1_scale=s1, w2_scale=s2, activation="silu", gated=True)
    assert_close(y, ref, rtol=2.0**-12)
    compiled = torch.compile(
        lambda v: torch.ops.fusedmlp.mlp(v, q1, q2, w1_scale=s1, w2_scale=s2, activation="silu",
                                         gated=True), fullgraph=True)
    assert torch.equal(compiled(x), y)
    # moe: two experts, the routing given (token t to expert t % 2, weight 1).
    qe1, se1 = torch.stack([q1, q1]), torch.stack([s1, s1 * 0.5])
    qe2, se2 = torch.stack([q2, q2]), torch.stack([s2, s2 * 2])
    ids = (torch.arange(5) % 2).to(torch.int32).reshape(5, 1)
    wts = torch.ones(5, 1)
    ym = torch.ops.fusedmlp.moe(x, qe1, qe2, 1, topk_ids=ids, topk_weights=wts, activation="silu",
                                gated=True, w1_scale=se1, w2_scale=se2)
    for t in range(5):
        e = t % 2
        r = mlp_ref(x[t:t + 1], deq(qe1[e], se1[e], 2), deq(qe2[e], se2[e]), activation="silu",
                    gated=True)
        assert_close(ym[t:t + 1], r, rtol=2.0**-12)


def test_opcheck_all_ops():
    kw = weights(gated=True)
    x = torch.randn(3, 32)
    torch.library.opcheck(torch.ops.fusedmlp.mlp.default, (x, kw["w1"], kw["w2"]),
                          dict(b1=kw["b1"], w_up=kw["w_up"], b_up=kw["b_up"], b2=kw["b2"],
                               residual=torch.randn(3, 32), activation="silu", gated=True))
    torch.library.opcheck(torch.ops.fusedmlp.linear.default,
                          (torch.randn(2, 3, 16), torch.randn(8, 16), torch.randn(8)))
    torch.library.opcheck(torch.ops.fusedmlp.softmax.default, (torch.randn(4, 9), 0.8, True))
    m = ft.FusedMLP(**weights(), activation="gelu_tanh")
    torch.library.opcheck(torch.ops.fusedmlp.mlp_packed.default,
                          (torch.randn(2, 5, 32), None, m._handle, m.d_out))


class SwiGLU(nn.Module):  # the Llama MLP layout, without transformers
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)),
    lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 24),
                          nn.Dropout(0.1)),
    lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)),
    lambda: SwiGLU(32, 80),
], ids=["gelu", "gelu_tanh_dropout", "relu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fused_mlp_matches_module(make, dtype):
    torch.manual_seed(0)
    module = make().eval()
    x = torch.randn(2, 3, 32)
    ref = module.double()(x.double())
    module = module.to(dtype)
    fused = ft.FusedMLP.from_module(module).eval()
    assert_close(fused(x.to(dtype)), ref, rtol=RTOL[dtype] * 2)
    # .to() repacks: the module follows a dtype change like any other.
    fused.float()
    assert fused.w1.dtype == torch.float32
    assert_close(fused(x), ref, rtol=RTOL[dtype] * 2)


def test_fused_mlp_residual_and_errors():
    m = ft.FusedMLP(**weights(), activation="relu")
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    assert_close(m(x, r), mlp_ref(x, residual=r, activation="relu", **weights()))
    with pytest.raises(ValueError, match="x"):
        m(torch.randn(4, 31))
    with pytest.raises(ValueError, match="activation"):
        ft.FusedMLP(**weights(), activation="tanh")
    with pytest.raises(NotImplementedError, match="Tanh"):
        ft.FusedMLP.from_module(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)))
    with pytest.raises(NotImplementedError, match="MLP layout"):
        ft.FusedMLP.from_module(nn.Linear(4, 4))


def test_fused_mlp_copies_share_the_pack():
    import gc
    m = ft.FusedMLP(**weights(), activation="silu")
    twin = copy.deepcopy(m)
    x = torch.randn(3, 32)
    ref = m(x)
    del m
    gc.collect()
    torch.testing.assert_close(twin(x), ref)  # the pack outlives the module it was made for
    handle = twin._handle
    del twin
    gc.collect()
    with pytest.raises(ValueError, match="no live packed mlp"):
        torch.ops.fusedmlp.mlp_packed(x, None, handle, 32)


def test_compile_fullgraph():
    torch._dynamo.reset()
    kw = weights(gated=True)
    m = ft.FusedMLP(**kw, activation="silu").eval()
    w = torch.randn(32, 32) / 6

    def f(x, r):
        y = m(x, r)
        y = ft.linear(y, w)
        return ft.softmax(y) + ft.mlp(x, activation="silu", **kw)

    x, r = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(x, r), f(x, r))
    x2 = torch.randn(5, 32)  # another shape: recompiles or runs dynamic, still fullgraph
    torch.testing.assert_close(compiled(x2, torch.zeros(5, 32)),
                               f(x2, torch.zeros(5, 32)))


def test_zero_rows():
    kw = weights()
    assert ft.mlp(torch.randn(2, 0, 32), **kw).shape == (2, 0, 32)
    assert ft.FusedMLP(**kw)(torch.randn(0, 32)).shape == (0, 32)
    assert ft.linear(torch.randn(0, 32), torch.randn(5, 32)).shape == (0, 5)
    assert ft.softmax(torch.randn(0, 7)).shape == (0, 7)


class Conv1D(nn.Module):  # transformers' Conv1D (GPT-2): weight [in, out], y = x W + b
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.nf)


@pytest.mark.parametrize("make", [
    lambda: nn.Linear(37, 53), lambda: nn.Linear(64, 17, bias=False), lambda: Conv1D(45, 29)],
    ids=["linear", "linear_nobias", "conv1d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fused_linear_matches_module(make, dtype):
    torch.manual_seed(0)
    module = make().to(dtype).eval()
    fused = ft.FusedLinear.from_module(module)
    k = fused.in_features
    if isinstance(module, nn.Linear):  # the same Parameters, not copies
        assert fused.weight is module.weight and fused.bias is module.bias
    else:
        assert fused.weight.shape == (module.nf, k) and fused.weight.is_contiguous()
        assert fused.bias is module.bias
    assert "bias=" in repr(fused)
    xs = [torch.randn(k), torch.randn(5, k), torch.randn(2, 3, k),
          torch.randn(4, 2 * k)[:, ::2],  # inner dim strided: copied by the op
          torch.randn(6, k + 8)[:, :k],  # rows strided, inner dim contiguous
          torch.randn(k, 3).t(), torch.randn(0, k)]
    exact = copy.deepcopy(module).double()
    for x in xs:
        x = x.to(dtype)
        with torch.no_grad():
            y = fused(x)
            ref = exact(x.double())
        assert y.dtype == dtype
        assert_close(y, ref, rtol=RTOL[dtype] * 2)


def test_fused_linear_refuses_what_linear_refuses():
    fused = ft.FusedLinear.from_module(nn.Linear(16, 8))
    with pytest.raises(RuntimeError, match="dtype"):  # nn.Linear raises too: no silent cast
        fused(torch.randn(3, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x"):
        fused(torch.randn(3, 15))
    with pytest.raises(NotImplementedError, match="float64"):
        ft.FusedLinear.from_module(nn.Linear(16, 8).double())

    class Quantized(nn.Linear):
        def forward(self, x):
            return super().forward(x)
    with pytest.raises(NotImplementedError, match="own forward"):
        ft.FusedLinear.from_module(Quantized(16, 8))
    with pytest.raises(NotImplementedError, match="Conv2d"):
        ft.FusedLinear.from_module(nn.Conv2d(3, 3, 1))


def test_fused_linear_compile_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), Conv1D(24, 40)).eval()
    fused = nn.Sequential(*(m if isinstance(m, nn.ReLU) else ft.FusedLinear.from_module(m)
                            for m in module))
    x = torch.randn(2, 3, 24)
    with torch.no_grad():
        compiled = torch.compile(fused, fullgraph=True)
        assert_close(compiled(x), module(x).double())
