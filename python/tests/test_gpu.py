"""CUDA tensors through fusedmlp (run on the GPU machine; skipped without torch, a CUDA device or
the library's CUDA backend): device tensors and streams, workspace caching, CUDA-graph capture,
torch.compile on CUDA, patch() on bf16 models, cupy arrays. Tolerances: against a float64
reference, |y - ref| <= rtol * (|ref| + rms(ref row)) with rtol bf16 2^-6, f16 2^-8, f32 1e-4;
patched against unpatched bf16 models 2^-4 (both sides round their intermediates)."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

import fusedmlp  # noqa: E402
import fusedmlp.torch as ft  # noqa: E402

_ok, _why = fusedmlp.available("cuda")
if not _ok:
    pytest.skip(f"fusedmlp's CUDA backend cannot run here: {_why}", allow_module_level=True)

from test_torch import RTOL, assert_close, mlp_ref, weights  # noqa: E402

RTOL_GPU = {**RTOL, torch.float16: 2.0**-8}
DEV = torch.device("cuda", 0)


def cuda(kw):
    return {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("gated", [False, True], ids=["dense", "gated"])
@pytest.mark.parametrize("m", [1, 7, 300])
def test_mlp_cuda_tensors(dtype, gated, m):
    kw = weights(256, 704, 256, dtype=dtype, gated=gated)
    x = torch.randn(m, 256).to(dtype)
    residual = torch.randn(m, 256).to(dtype)
    ref = mlp_ref(x, residual=residual, activation="silu", **kw)
    y = ft.mlp(x.to(DEV), residual=residual.to(DEV), activation="silu", **cuda(kw))
    assert y.device == DEV and y.dtype == dtype
    assert_close(y.cpu(), ref, rtol=RTOL_GPU[dtype])
    y2 = fusedmlp.mlp(x.to(DEV), residual=residual.to(DEV), activation="silu", **cuda(kw))
    assert_close(y2.cpu(), ref, rtol=RTOL_GPU[dtype])
    report = fusedmlp.explain(x.to(DEV), activation="silu", **cuda(kw))
    assert "cuda" in report


def test_side_stream_and_explicit_workspace():
    kw = cuda(weights(512, 1024, 512, dtype=torch.bfloat16, gated=True))
    x = torch.randn(4, 512, device=DEV, dtype=torch.bfloat16)
    ref = ft.mlp(x, activation="silu", **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = ft.mlp(x, activation="silu", **kw)  # runs on s: torch's current stream
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    size = fusedmlp.mlp_workspace_size(x, activation="silu", **kw)
    ws = torch.zeros(max(size, 1), dtype=torch.uint8, device=DEV)
    out = torch.empty_like(ref)
    fusedmlp.mlp(x, activation="silu", out=out, workspace=ws,
                 stream=torch.cuda.current_stream().cuda_stream, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    if size:
        with pytest.raises(ValueError, match="workspace"):
            fusedmlp.mlp(x, activation="silu", out=out, workspace=ws[: size - 1], **kw)
    torch.cuda.synchronize()
    assert not bool(ws.any()), "the kernels must leave the workspace zero-filled"


def test_device_errors():
    kw = weights()
    x = torch.randn(2, 32, device=DEV)
    with pytest.raises(ValueError, match="cuda|cpu|device"):
        ft.mlp(x, **kw)  # weights on the host, x on the GPU
    with pytest.raises(ValueError, match="backend cuda needs CUDA device memory"):
        fusedmlp.mlp(x.cpu().numpy(), backend="cuda", **{k: v.numpy() if hasattr(v, "numpy")
                                                          else v for k, v in kw.items()})
    assert fusedmlp.devices() and fusedmlp.devices()[0].startswith("cuda:0")


def test_linear_softmax_cuda():
    x = torch.randn(3, 5, 640, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(1000, 640, device=DEV, dtype=torch.bfloat16) / 25
    b = torch.randn(1000, device=DEV, dtype=torch.bfloat16)
    ref = x.double() @ w.double().T + b.double()
    assert_close(ft.linear(x, w, b).cpu(), ref.cpu(), rtol=2.0**-6)
    z = torch.randn(4, 32000, device=DEV) * 4
    assert_close(ft.softmax(z).cpu(), torch.softmax(z.double(), -1).cpu())
    assert_close(ft.log_softmax(z, 0.7).cpu(), torch.log_softmax(z.double() / 0.7, -1).cpu())


def test_packed_module_cuda_graph_capture():
    kw = weights(1024, 2816, 1024, dtype=torch.bfloat16, gated=True)
    m = ft.FusedMLP(**kw, activation="silu").to(DEV).eval()
    static_x = torch.randn(1, 1024, device=DEV, dtype=torch.bfloat16)
    static_r = torch.randn(1, 1024, device=DEV, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture: allocates the cached workspace
        for _ in range(2):
            m(static_x, static_r)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = m(static_x, static_r)
    for _ in range(3):
        x = torch.randn(1, 1024, device=DEV, dtype=torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        ref = mlp_ref(x.cpu(), residual=static_r.cpu(), activation="silu", **kw)
        assert_close(static_y.cpu(), ref, rtol=2.0**-6)


def test_compile_cuda_modes():
    torch._dynamo.reset()
    kw = weights(512, 1536, 512, dtype=torch.bfloat16, gated=True)
    m = ft.FusedMLP(**kw, activation="silu").to(DEV).eval()
    x = torch.randn(2, 512, device=DEV, dtype=torch.bfloat16)
    ref = m(x)
    for mode in (None, "reduce-overhead"):
        compiled = torch.compile(lambda t: m(t) + 0, fullgraph=True, mode=mode)
        for _ in range(3):  # reduce-overhead records a CUDA graph on a later call
            torch.testing.assert_close(compiled(x), ref)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_patch_bf16_models_on_cuda(arch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=512)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=704,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=512)
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(DEV, torch.bfloat16).eval()
    ids = torch.randint(0, 512, (1, 9), device=DEV)
    with torch.no_grad():
        ref = model(ids).logits.float()
    report = fusedmlp.patch(model, strict=True)
    assert len(report.replaced) == 2, str(report)
    with torch.no_grad():
        got = model(ids).logits.float()
    rms = ref.pow(2).mean(-1, keepdim=True).sqrt()
    assert bool(((got - ref).abs() <= 2.0**-4 * (ref.abs() + rms)).all())
    # Static cache: transformers then compiles the decode step with CUDA graphs itself.
    static = {"cache_implementation": "static"} if arch == "llama" else {}
    out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, **static)
    assert out.shape == (1, 17)


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    kw = weights(128, 256, 128, gated=True)
    x = torch.randn(3, 128)
    ckw = {k: cupy.asarray(v.numpy()) if isinstance(v, torch.Tensor) else v
           for k, v in kw.items()}
    y = fusedmlp.mlp(cupy.asarray(x.numpy()), activation="silu", **ckw)
    assert isinstance(y, cupy.ndarray)
    assert_close(torch.from_numpy(cupy.asnumpy(y)), mlp_ref(x, activation="silu", **kw))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_second_device():
    dev = torch.device("cuda", 1)
    kw = weights(128, 256, 128, gated=True)
    m = ft.FusedMLP(**kw, activation="silu").to(dev)
    x = torch.randn(3, 128)
    y = m(x.to(dev))
    assert y.device == dev and torch.cuda.current_device() == 0
    assert_close(y.cpu(), mlp_ref(x, activation="silu", **kw))
