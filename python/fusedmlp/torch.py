"""fusedmlp for PyTorch: torch.library ops, the FusedMLP / FusedMoE / FusedLinear modules and
patch(), on the tensor's device and torch's current CUDA stream.

Custom ops (torch.library, each with a fake kernel for torch.compile / export and one kernel for
CPU and CUDA): fusedmlp::mlp (all of mlp's arguments), fusedmlp::mlp_packed (packed weights, the
FusedMLP module's op), fusedmlp::moe (mixture of experts), fusedmlp::linear, fusedmlp::softmax.
They are inference ops: no autograd formula is registered, so backward through them raises.
Their kernels are C++ (fusedmlp._torch_ops, built against the installed torch: at::Tensor in,
the library called directly, a few microseconds of host time per call) or, where that module is
not built or FMLP_TORCH_OPS=python is set, Python custom ops reaching the library through DLPack
(several times the host time); ops_implementation() says which.

CUDA workspaces are allocated with torch.zeros once per (device, size) and reused, as the
contract in fusedmlp.h allows for calls on one stream; calls that run concurrently on several
streams need their own workspaces (use fusedmlp.mlp(..., workspace=...) for that). The moe op's
workspaces are cached apart from the others': they carry its count of out-of-range device
expert ids (moe_device_errors reads it).

FusedMLP is an nn.Module that packs its weights once (again after .to()/.half()); FusedMoE runs
a Mixtral-style sparse MoE block; FusedLinear stands in for an nn.Linear or a transformers Conv1D;
patch() swaps the MLP and MoE blocks (and, with linears=True, the attention projections and the
LM head) of Hugging Face models for them. call_cost() measures what a module costs per call
(host and device time), for choosing between a module and its replacement.
"""

import contextlib
import dataclasses
import statistics
import time
import warnings
import weakref
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from . import _ACTIVATIONS, _BACKENDS, _NORMS, _ext, _fp8, _lookup, _workspace_bytes
from . import knob as _knob

__all__ = ["mlp", "moe", "linear", "softmax", "log_softmax", "moe_device_errors", "FusedMLP",
           "FusedMoE", "FusedLinear", "patch", "PatchReport", "PatchError", "PROBE_RTOL",
           "fusedmlp_experts_forward", "register_experts", "ops_implementation", "call_cost",
           "CallCost"]

_WORKSPACES = {}


def _cached_workspace(device, nbytes, kind="op"):
    """A zero-filled uint8 workspace on device of at least nbytes, cached per (device, size,
    kind). One allocated during CUDA-graph capture is not cached: its zero fill is part of the
    graph and outside the graph its memory is not zeroed."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    size = _workspace_bytes(nbytes)
    ws = _WORKSPACES.get((index, size, kind))
    if ws is None:
        ws = torch.zeros(size, dtype=torch.uint8, device=device)
        if not torch.cuda.is_current_stream_capturing():
            _WORKSPACES[(index, size, kind)] = ws
    return ws


def _workspace_for(x, kind="op"):
    if x.device.type != "cuda":
        return None
    device = x.device
    return lambda nbytes, device_type, device_id: _cached_workspace(
        device, nbytes, kind).__dlpack__(stream=-1)


def moe_device_errors(device: Union[None, int, str, torch.device] = None) -> int:
    """Reads and resets the count of out-of-range device expert ids met by the moe op.

    Counts the given-routing ids outside [0, global experts) on a CUDA device (each such
    token's output row is NaN) since the last read, summed over the workspaces fusedmlp.torch
    caches for ``device``. Synchronises the current stream: call it outside CUDA-graph capture
    (e.g. once per step). Workspaces allocated during a capture are the graph's own and are not
    counted.

    Parameters
    ----------
    device : int, str or torch.device, optional
        The CUDA device (default: the current one).

    Returns
    -------
    int
        The count since the last read (then 0).

    Raises
    ------
    RuntimeError
        CUDA is not available, or a CUDA call failed.
    """
    device = torch.device("cuda" if device is None else device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = 0 if _CPP_OPS is None else torch.ops.fusedmlp._moe_device_errors(index)
    with torch.cuda.device(index):  # the workspaces of fusedmlp.moe() on torch tensors
        stream = torch.cuda.current_stream(index).cuda_stream
        for (i, _, kind), ws in _WORKSPACES.items():
            if i == index and kind == "moe":
                total += _ext.moe_device_errors(ws.__dlpack__(stream=-1), stream)
    return total


def _stream_for(x):
    return torch.cuda.current_stream(x.device).cuda_stream if x.device.type == "cuda" else 0


def _args(device, **tensors):
    """DLPack capsules of the tensors (all on `device`, current when CUDA) and the bits map
    (float8 travels as its uint8 bits). stream=-1 tells torch not to synchronise: the op runs
    on torch's current stream already, and the default-stream wait that __dlpack__() adds
    otherwise breaks CUDA-graph capture."""
    out, bits = {}, {}
    for k, t in tensors.items():
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{k} is on {t.device}; expected {device}, where x is (move it "
                             "with .to())")
        if t.requires_grad:
            t = t.detach()
        if t.dtype == torch.float8_e4m3fn:
            t, bits[k] = t.view(torch.uint8), "f8"
        out[k] = t.__dlpack__(stream=-1)
    return out, bits


def _device_of(x):
    """Context making x's CUDA device current (torch exports only tensors of the current
    device through DLPack)."""
    if x.device.type == "cuda" and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def _rows(t, name):
    """t as [rows, t.shape[-1]] with a contiguous last dim (a view when possible)."""
    if t.dim() == 0:
        raise ValueError(f"{name} is a 0-d tensor; expected [..., features]")
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.shape[-1] <= 1 or t2.stride(-1) == 1 else t2.contiguous()


class _Pack:
    """A packed mlp of the extension, held by the FusedMLP modules that use it. The op names it
    by an integer handle (custom ops take tensors and scalars only: the extension's registry
    for the C++ ops, the weak registry below for the Python ones), so a pack lives exactly as
    long as a module holds it. Packs are immutable: copies of a module (deepcopy) share theirs."""
    __slots__ = ("ext", "__weakref__")

    def __init__(self, ext):
        self.ext = ext

    def __deepcopy__(self, memo):
        return self


_PACKS = weakref.WeakValueDictionary()


# ---- custom ops ----

def _load_cpp_ops():
    """fusedmlp._torch_ops (the ops as C++ kernels) when it can be used here, else None; and
    why not."""
    if _knob("FMLP_TORCH_OPS") == "python":
        return None, "FMLP_TORCH_OPS=python"
    try:
        from ._torch_ops_build import TORCH_VERSION
    except ImportError:
        return None, ("fusedmlp._torch_ops is not built (torch did not import at build time, "
                      "e.g. in pip's isolated build environment, or -DFMLP_TORCH_OPS=OFF); "
                      "pip install --no-build-isolation . builds it against the installed torch")
    if TORCH_VERSION != torch.__version__:
        why = (f"fusedmlp._torch_ops was built against torch {TORCH_VERSION}, this is torch "
               f"{torch.__version__}; reinstall fusedmlp to rebuild it")
        warnings.warn(f"{why}; using the slower Python custom ops meanwhile", stacklevel=3)
        return None, why
    try:
        from . import _torch_ops
    except ImportError as e:
        warnings.warn(f"fusedmlp._torch_ops does not load ({e}); using the slower Python custom "
                      "ops", stacklevel=3)
        return None, str(e)
    return _torch_ops, ""


_CPP_OPS, _CPP_OPS_WHY = _load_cpp_ops()
if _CPP_OPS is None:
    from . import _torch_py_ops  # noqa: F401, E402 (defines the same ops in Python)


def ops_implementation() -> str:
    """Which implementation the torch.ops.fusedmlp.* ops run.

    Returns
    -------
    str
        ``"c++"`` (fusedmlp._torch_ops: a few microseconds of host time per call) or
        ``"python: <why>"`` (torch.library.custom_op over DLPack, several times the host time;
        why: not built, built against another torch, or FMLP_TORCH_OPS=python).
    """
    return "c++" if _CPP_OPS is not None else f"python: {_CPP_OPS_WHY}"


@torch.library.register_fake("fusedmlp::mlp")
def _mlp_fake(x, w1, w2, b1=None, w_up=None, b_up=None, b2=None, residual=None,
              norm_weight=None, norm_bias=None, w1_scale=None, w_up_scale=None, w2_scale=None,
              activation="gelu", gated=False, norm="none", eps=1e-5):
    return x.new_empty((*x.shape[:-1], w2.shape[0]))


@torch.library.register_fake("fusedmlp::mlp_packed")
def _mlp_packed_fake(x, residual, handle, d_out):
    return x.new_empty((*x.shape[:-1], d_out))


@torch.library.register_fake("fusedmlp::moe")
def _moe_fake(x, w1, w2, top_k, router_w=None, router_b=None, topk_ids=None, topk_weights=None,
              b1=None, b2=None, residual=None, activation="silu", gated=True, scoring="softmax",
              renormalize=True, deterministic=False, backend="auto", first_expert=0,
              global_experts=0, round_router_logits=False, w1_scale=None, w2_scale=None):
    return x.new_empty((*x.shape[:-1], w2.shape[1]))


@torch.library.register_fake("fusedmlp::linear")
def _linear_fake(x, w, bias=None, w_scale=None):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.register_fake("fusedmlp::softmax")
def _softmax_fake(x, temperature=1.0, log=False):
    return torch.empty_like(x)


# The overloads themselves: calling one skips the overload packet's Python frame (eager host
# time); torch.compile traces them like the packets.
_mlp_op = torch.ops.fusedmlp.mlp.default
_mlp_packed_op = torch.ops.fusedmlp.mlp_packed.default
_moe_op = torch.ops.fusedmlp.moe.default
_linear_op = torch.ops.fusedmlp.linear.default
_softmax_op = torch.ops.fusedmlp.softmax.default


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, b1: Optional[torch.Tensor] = None,
        w_up: Optional[torch.Tensor] = None, b_up: Optional[torch.Tensor] = None,
        b2: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
        norm_weight: Optional[torch.Tensor] = None, norm_bias: Optional[torch.Tensor] = None,
        w1_scale: Optional[torch.Tensor] = None, w_up_scale: Optional[torch.Tensor] = None,
        w2_scale: Optional[torch.Tensor] = None, activation: str = "gelu", gated: bool = False,
        norm: Optional[str] = None, eps: float = 1e-5) -> torch.Tensor:
    """torch.ops.fusedmlp.mlp: the fused FFN block on torch tensors of any leading dims.

    The math and the weight arguments are fusedmlp.mlp's::

        xn = norm(x_i);  h = act(W1 xn + b1)  or  act(Wg xn + bg) * (Wu xn + bu)
        y_i = [residual_i +] W2 h + b2

    Parameters
    ----------
    x : torch.Tensor
        [..., d_in], float32, float16 or bfloat16, on the CPU or a CUDA device (the op runs on
        torch's current stream).
    w1, w2, b1, w_up, b_up, b2, norm_weight, norm_bias, w1_scale, w_up_scale, w2_scale
        As for fusedmlp.mlp, on x's device (float8 weights: torch.float8_e4m3fn).
    residual : torch.Tensor, optional
        [..., d_out] in x's dtype.
    activation, gated, norm, eps
        As for fusedmlp.mlp.

    Returns
    -------
    torch.Tensor
        y [..., d_out] in x's dtype, a new tensor.

    Raises
    ------
    ValueError
        A bad argument (the message names it), e.g. a tensor on another device.
    NotImplementedError
        No kernel of the tensors' device handles the request.
    RuntimeError
        A CUDA call failed, or backward was asked for (the op is inference-only).
    """
    return _mlp_op(x, w1, w2, b1, w_up, b_up, b2, residual, norm_weight, norm_bias, w1_scale,
                   w_up_scale, w2_scale, activation, gated, "none" if norm is None else norm,
                   eps)


def moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
        router_w: Optional[torch.Tensor] = None, router_b: Optional[torch.Tensor] = None,
        topk_ids: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
        top_k: int, b1: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
        residual: Optional[torch.Tensor] = None, activation: str = "silu", gated: bool = True,
        scoring: str = "softmax", renormalize: bool = True, deterministic: bool = False,
        backend: str = "auto", first_expert: int = 0, global_experts: int = 0,
        round_router_logits: bool = False, w1_scale: Optional[torch.Tensor] = None,
        w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch.ops.fusedmlp.moe: the mixture-of-experts op on torch tensors of any leading dims.

    The math is fusedmlp.moe's: route each token to its top_k experts (or take the given
    routing), y_t = [residual_t +] sum_j w_j mlp_(e_j)(x_t).

    Parameters
    ----------
    x : torch.Tensor
        [..., d], float32, float16 or bfloat16.
    w1, w2, router_w, router_b, b1, b2, top_k, activation, gated, scoring, renormalize, \
deterministic, backend, round_router_logits
        As for fusedmlp.moe.
    topk_ids, topk_weights : torch.Tensor, optional
        Given routing [..., top_k]: any integer dtype (cast to int32) and any float dtype
        (cast to float32).
    residual : torch.Tensor, optional
        [..., d_out] in x's dtype.
    first_expert, global_experts : int
        A local expert range (expert parallelism), as for fusedmlp.moe.
    w1_scale, w2_scale : torch.Tensor, optional
        float32 scales [E], [E, rows] or [E, ceil(rows / 128), ceil(cols / 128)] (128 x 128
        blocks, gated w1: the gate's block rows, then the up's; cpu backend) of
        torch.float8_e4m3fn experts.

    Returns
    -------
    torch.Tensor
        y [..., d_out] in x's dtype.

    Raises
    ------
    ValueError
        A bad argument: top_k, first_expert or global_experts not an int, shapes, dtypes,
        host expert ids out of range (naming the token).
    NotImplementedError
        No kernel of the device handles the request.
    RuntimeError
        A CUDA call failed, or backward was asked for.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k is {top_k!r}; expected an int, the experts per token")
    for name, v in (("first_expert", first_expert), ("global_experts", global_experts)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} is {v!r}; expected an int")
    return _moe_op(x, w1, w2, top_k, router_w, router_b, topk_ids, topk_weights, b1, b2,
                   residual, activation, gated, scoring, renormalize, deterministic, backend,
                   first_expert, global_experts, bool(round_router_logits), w1_scale, w2_scale)


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           w_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch.ops.fusedmlp.linear: y = x w^T + bias over the last dim of x.

    Parameters
    ----------
    x : torch.Tensor
        [..., K], float32, float16 or bfloat16.
    w : torch.Tensor
        [N, K] (nn.Linear layout) in x's dtype, or torch.float8_e4m3fn with ``w_scale``.
    bias : torch.Tensor, optional
        [N].
    w_scale : torch.Tensor, optional
        float32 [1] or [N] scales of a float8 w.

    Returns
    -------
    torch.Tensor
        y [..., N] in x's dtype.

    Raises
    ------
    ValueError
        A bad argument (shape, dtype, device).
    NotImplementedError
        No kernel of the device handles the request.
    """
    return _linear_op(x, w, bias, w_scale)


def softmax(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """torch.ops.fusedmlp.softmax: softmax(x / temperature) over the last dim.

    Parameters
    ----------
    x : torch.Tensor
        [..., n], float32, float16 or bfloat16.
    temperature : float
        Finite, > 0.

    Returns
    -------
    torch.Tensor
        In x's shape and dtype; non-finite inputs as in fusedmlp.softmax.

    Raises
    ------
    ValueError
        A bad argument (dtype, temperature).
    """
    return _softmax_op(x, temperature, False)


def log_softmax(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """torch.ops.fusedmlp.softmax(log=True): log_softmax(x / temperature) over the last dim.

    Parameters
    ----------
    x : torch.Tensor
        [..., n], float32, float16 or bfloat16.
    temperature : float
        Finite, > 0.

    Returns
    -------
    torch.Tensor
        In x's shape and dtype.

    Raises
    ------
    ValueError
        A bad argument (dtype, temperature).
    """
    return _softmax_op(x, temperature, True)


# ---- what a call costs ----

@dataclasses.dataclass(frozen=True)
class CallCost:
    """Microseconds per call of a module (or any callable), from call_cost().

    Attributes
    ----------
    host_us : float
        The calling thread's time per call (the call returns without waiting for the device:
        Python, dispatch, launches).
    wall_us : float
        Per call of back-to-back calls, the device waited for at the end: about
        max(host_us, device time), what a call adds to an eager decode step where the device
        waits on Python.
    device_us : float or None
        Per call replayed from a captured CUDA graph (call_cost(graph=True)): what it adds to a
        graph-replayed step, host time gone; on the host backends the arithmetic is host time,
        so wall_us; None where not measured or not capturable.
    """
    host_us: float
    wall_us: float
    device_us: Optional[float] = None

    def step_us(self, mode: str = "eager") -> float:
        """What a call adds to a model step run in ``mode``.

        Parameters
        ----------
        mode : {"eager", "graph"}
            "eager": wall_us; "graph": device_us (wall_us where that is None).

        Returns
        -------
        float
            Microseconds: the figure to compare between a module and its replacement.

        Raises
        ------
        ValueError
            mode is neither name.
        """
        if mode not in ("eager", "graph"):
            raise ValueError(f"mode is {mode!r}; expected 'eager' or 'graph'")
        return self.wall_us if mode == "eager" or self.device_us is None else self.device_us


def call_cost(fn: Callable[..., Any], *args: Any, calls: int = 50, rounds: int = 5,
              graph: bool = False, **kwargs: Any) -> CallCost:
    """Measures what fn(*args, **kwargs) costs per call, under torch.no_grad().

    Medians over ``rounds`` runs of ``calls`` calls, after a warm-up that makes the workspaces,
    e.g. ``call_cost(module, torch.randn(1, 1, d, dtype=dt, device=dev))``. Keep calls small
    enough that the device's launch queue never fills (some hundred launches), or host_us grows
    by the wait.

    Parameters
    ----------
    fn : callable
        A module or function.
    *args, **kwargs
        Its arguments; the first tensor among args gives the device.
    calls, rounds : int
        Calls per timed run, and runs.
    graph : bool
        Also capture ``calls`` calls in a CUDA graph and time its replays (device_us; a capture
        that fails leaves it None).

    Returns
    -------
    CallCost
    """
    device = next((a.device for a in args if isinstance(a, torch.Tensor)),
                  torch.device("cpu"))
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    host, wall = [], []
    with torch.no_grad():
        for _ in range(3):
            fn(*args, **kwargs)
        sync()
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(*args, **kwargs)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            host.append((t1 - t0) / calls * 1e6)
            wall.append((t2 - t0) / calls * 1e6)
        wall_us = statistics.median(wall)
        device_us = (_graph_us(fn, args, kwargs, calls, rounds, device) if cuda and graph
                     else None if cuda else wall_us)
    return CallCost(statistics.median(host), wall_us, device_us)


def _graph_us(fn, args, kwargs, calls, rounds, device):
    """us per call of `calls` calls captured in one CUDA graph, replayed; None when the capture
    fails (a callable that synchronises, allocates outside the graph pool, ...)."""
    side = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):  # warm-up off the capture: workspaces, lazy state
            fn(*args, **kwargs)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn(*args, **kwargs)
    except RuntimeError:
        torch.cuda.synchronize(device)
        return None
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


# ---- FusedMLP ----

def _param(t):
    return None if t is None else nn.Parameter(t.detach(), requires_grad=False)


class FusedMLP(nn.Module):
    """y = mlp(x) [+ residual] with weights packed once for the weights' device.

    The pack is made again after .to(), .half() and the like; call repack() after editing the
    weights in place. The math and the weight arguments are fusedmlp.mlp's. Inference only:
    no backward.

    Parameters
    ----------
    w1, w2, b1, w_up, b_up, b2, norm_weight, norm_bias : torch.Tensor
        As for fusedmlp.mlp (kept as Parameters without grad).
    w1_scale, w_up_scale, w2_scale : torch.Tensor, optional
        float32 scales of torch.float8_e4m3fn weights, as for fusedmlp.mlp: [1] per tensor,
        [rows] per row or [ceil(rows / 128), ceil(cols / 128)] per 128 x 128 block (kept as
        buffers). The activations stay in x's dtype (weight-only fp8).
    activation, gated, norm, eps, backend
        As for fusedmlp.mlp.
    dropout : nn.Dropout, optional
        Applied to the output in training mode (e.g. GPT-2's resid dropout); with a residual it
        cannot be (it would have to act before the add), so that combination raises.

    Attributes
    ----------
    d_in, hidden, d_out : int
        x [..., d_in] -> y [..., d_out] through h [..., hidden].

    Raises
    ------
    ValueError
        An unknown activation, norm or backend, or weights the library refuses.
    NotImplementedError
        No kernel of the weights' device takes them.
    """

    def __init__(self, w1, w2, *, b1=None, w_up=None, b_up=None, b2=None, activation="gelu",
                 gated=False, norm=None, norm_weight=None, norm_bias=None, eps=1e-5,
                 dropout=None, backend="auto", w1_scale=None, w_up_scale=None, w2_scale=None):
        super().__init__()
        _lookup(_ACTIVATIONS, "activation", activation)
        _lookup(_NORMS, "norm", norm)
        _lookup(_BACKENDS, "backend", backend)
        self.activation, self.gated, self.norm, self.eps = activation, bool(gated), norm, eps
        self.backend = backend
        for name, t in dict(w1=w1, b1=b1, w_up=w_up, b_up=b_up, w2=w2, b2=b2,
                            norm_weight=norm_weight, norm_bias=norm_bias).items():
            self.register_parameter(name, _param(t))
        for name, t in dict(w1_scale=w1_scale, w_up_scale=w_up_scale,
                            w2_scale=w2_scale).items():
            self.register_buffer(name, None if t is None else t.detach())
        self.dropout = dropout
        self.d_in, self.d_out = int(w1.shape[1]), int(w2.shape[0])
        self.hidden = int(w2.shape[1])
        self._handle = 0
        self.repack()

    @classmethod
    def from_module(cls, module: nn.Module, backend: str = "auto") -> "FusedMLP":
        """A FusedMLP computing what a Hugging Face MLP module computes.

        Parameters
        ----------
        module : nn.Module
            GPT-2 style (c_fc, act, c_proj; Conv1D or Linear), gated (gate_proj, up_proj,
            down_proj, act_fn: Llama, Mistral, Qwen2 ...), fc1 / activation_fn / fc2 (CLIP,
            OPT) or nn.Sequential(Linear, act, Linear[, Dropout]).
        backend : {"auto", "ref", "cpu", "cuda"}

        Returns
        -------
        FusedMLP

        Raises
        ------
        NotImplementedError
            The module's layout or activation has no fusedmlp equivalent (the message names
            what does not fit).
        """
        return cls(**_describe(module), backend=backend)

    def repack(self) -> None:
        """Packs the current weights for their device (on the current CUDA stream).

        The previous pack is freed: CUDA graphs captured with it must be captured again.

        Raises
        ------
        ValueError, NotImplementedError
            As for fusedmlp.pack.
        """
        with _device_of(self.w1):
            tensors, bits = _args(self.w1.device, w1=self.w1, b1=self.b1, w_up=self.w_up,
                                  b_up=self.b_up, w2=self.w2, b2=self.b2,
                                  norm_weight=self.norm_weight, norm_bias=self.norm_bias,
                                  w1_scale=self.w1_scale, w_up_scale=self.w_up_scale,
                                  w2_scale=self.w2_scale)
            packed = _ext.PackedMlp(tensors, bits, _ACTIVATIONS[self.activation], self.gated,
                                    _NORMS[self.norm], float(self.eps), False,
                                    _BACKENDS[self.backend], _stream_for(self.w1))
        self._pack = _Pack(packed)
        self._handle = packed.handle
        _PACKS[self._handle] = self._pack

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        self.repack()
        return result

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y = mlp(x) [+ residual] through torch.ops.fusedmlp.mlp_packed.

        Parameters
        ----------
        x : torch.Tensor
            [..., d_in] on the weights' device, float32, float16 or bfloat16.
        residual : torch.Tensor, optional
            [..., d_out] in x's dtype.

        Returns
        -------
        torch.Tensor
            [..., d_out] in x's dtype.

        Raises
        ------
        RuntimeError
            In training mode with a dropout and a residual.
        ValueError
            x or residual do not fit the pack.
        """
        y = _mlp_packed_op(x, residual, self._handle, self.d_out)
        if self.training and self.dropout is not None and self.dropout.p > 0:
            if residual is not None:
                raise RuntimeError("FusedMLP with a residual cannot apply dropout before the "
                                   "add; call model.eval() (fusedmlp is inference-only)")
            y = self.dropout(y)
        return y

    def extra_repr(self):
        kind = "gated " if self.gated else ""
        fp8 = "" if self.w1_scale is None else \
            f", e4m3 weights with {_fp8.scale_kind(self.w1_scale)}"
        return (f"{self.d_in} -> {self.hidden} -> {self.d_out}, {kind}{self.activation}, "
                f"norm={self.norm}{fp8}, packed for {self.w1.device}")


from ._fused_linear import FusedLinear, _is_conv1d, _PaddedCopy  # noqa: E402,F401


def _activation(act):
    """fusedmlp's name for an activation module or function, or NotImplementedError."""
    name = type(act).__name__
    if name in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation"):
        return "gelu_tanh"
    if name == "GELUActivation":
        return "gelu"
    if name in ("SiLUActivation", "SiLU"):
        return "silu"
    if name == "ReLU":
        return "relu"
    if name == "ReLUSquaredActivation":
        return "relu2"
    if name == "GELU":
        return "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    functions = {torch.nn.functional.gelu: "gelu", torch.nn.functional.silu: "silu",
                 torch.nn.functional.relu: "relu", torch.relu: "relu"}
    if act in functions:
        return functions[act]
    raise NotImplementedError(f"activation {name} has no fusedmlp equivalent "
                              "(relu, gelu, gelu_tanh, silu and relu2 are)")


def _linear_weight(layer, name):
    """nn.Linear layout [out, in] of an nn.Linear or a transformers Conv1D ([in, out])."""
    if isinstance(layer, nn.Linear):
        return layer.weight, layer.bias
    if _is_conv1d(layer):
        return layer.weight.t().contiguous(), layer.bias
    raise NotImplementedError(f"{name} is a {type(layer).__name__}; expected nn.Linear or "
                              "Conv1D")


def _describe(m):
    """FusedMLP keyword arguments for a supported MLP module."""
    if all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        wg, bg = _linear_weight(m.gate_proj, "gate_proj")
        wu, bu = _linear_weight(m.up_proj, "up_proj")
        w2, b2 = _linear_weight(m.down_proj, "down_proj")
        if (bg is None) != (bu is None):
            raise NotImplementedError("gate_proj and up_proj disagree on having a bias")
        return dict(w1=wg, b1=bg, w_up=wu, b_up=bu, w2=w2, b2=b2, gated=True,
                    activation=_activation(m.act_fn))
    for fc, act, proj in (("c_fc", "act", "c_proj"), ("fc1", "activation_fn", "fc2")):
        if all(hasattr(m, a) for a in (fc, act, proj)):
            w1, b1 = _linear_weight(getattr(m, fc), fc)
            w2, b2 = _linear_weight(getattr(m, proj), proj)
            dropout = getattr(m, "dropout", None)
            return dict(w1=w1, b1=b1, w2=w2, b2=b2, activation=_activation(getattr(m, act)),
                        dropout=dropout if isinstance(dropout, nn.Dropout) else None)
    if isinstance(m, nn.Sequential) and len(m) in (3, 4) and isinstance(m[0], nn.Linear) \
            and isinstance(m[2], nn.Linear) and (len(m) == 3 or isinstance(m[3], nn.Dropout)):
        return dict(w1=m[0].weight, b1=m[0].bias, w2=m[2].weight, b2=m[2].bias,
                    activation=_activation(m[1]), dropout=m[3] if len(m) == 4 else None)
    raise NotImplementedError(f"{type(m).__name__} is not a known MLP layout (gate/up/down "
                              "projections, c_fc/act/c_proj, fc1/activation_fn/fc2 or "
                              "Sequential(Linear, act, Linear))")


from ._moe import FusedMoE  # noqa: E402
from ._patch import PROBE_RTOL, PatchError, PatchReport, patch  # noqa: E402
from ._experts import fusedmlp_experts_forward, register_experts  # noqa: E402
