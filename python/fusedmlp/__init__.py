"""fusedmlp: a transformer FFN block as one fused op, on any DLPack tensor (numpy, torch, cupy),
on the host or on a CUDA device.

Math of the mlp op (row i of x, one token):

    xn = norm(x_i)         none | LayerNorm(gamma, beta, eps) | RMSNorm(gamma, eps)
    dense: h = act(W1 xn + b1)                     W1: [hidden, d_in] (nn.Linear: [out, in])
    gated: h = act(Wg xn + bg) * (Wu xn + bu)
    y_i = [residual_i +] W2 h + b2        W2: [d_out, hidden]

act: relu | gelu (erf) | gelu_tanh | silu | relu2 (max(x, 0)^2). Gated with silu is SwiGLU, with
gelu GeGLU.

moe() runs a mixture of experts (router, top-k, stacked expert MLPs, weighted sum); its math
is in its docstring.

Every op runs on its tensors' device; CUDA calls are asynchronous on `stream` (an int
cudaStream_t handle; by default the current stream of the tensors' framework: torch's
current_stream().cuda_stream, cupy's current stream) and capturable in CUDA graphs. CUDA calls
need a workspace (zero-filled once, reused: the contract of fusedmlp.h); by default one is
allocated through the tensors' framework and cached per (device, size), so concurrent calls on
different streams must each pass their own workspace= (size from the *_workspace_size
functions). fusedmlp.torch adds torch.library custom ops, the FusedMLP module and patch().
"""

import contextlib
import warnings
from typing import Any, List, NamedTuple, Optional, Tuple

import numpy as np

from . import _ext

#: What the ops take as a tensor: any object with DLPack (torch, cupy, jax ...) or the buffer
#: protocol (numpy), on the host or on one CUDA device. Outputs are allocated for numpy, torch
#: and cupy inputs.
Array = Any

__all__ = ["mlp", "explain", "mlp_workspace_size", "pack", "PackedMlp", "moe", "moe_explain",
           "moe_workspace_size", "moe_device_errors", "linear", "linear_explain",
           "linear_workspace_size", "softmax", "log_softmax", "softmax_explain",
           "softmax_workspace_size", "quantize_fp8", "available", "build_info", "devices",
           "kernels", "knobs", "knob", "Knob", "info", "patch", "register_experts", "__version__"]
__version__ = _ext.version()

_ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "relu2": 4}
_NORMS = {None: 0, "none": 0, "layernorm": 1, "rmsnorm": 2}
_BACKENDS = {"auto": 0, "ref": 1, "cpu": 2, "cuda": 3}
_SCORINGS = {"softmax": 0, "sigmoid": 1}


def _lookup(table, name, value):
    try:
        return table[value]
    except (KeyError, TypeError):
        choices = ", ".join(repr(k) for k in table)
        raise ValueError(f"{name} is {value!r}; expected one of {choices}") from None


def _library(a):
    """'numpy', 'torch', 'cupy' or the array's top-level module name."""
    return type(a).__module__.split(".")[0]


def _is_cuda(a):
    lib = _library(a)
    if lib == "torch":
        return a.device.type == "cuda"
    return lib == "cupy"


def _prepare(tensors):
    """Arrays whose dtype DLPack cannot carry travel as bit views named in `bits`: numpy's
    ml_dtypes bfloat16 and float8_e4m3fn, torch's float8_e4m3fn. torch tensors that require
    grad are detached (the ops are inference-only). torch and cupy arrays are exported with
    __dlpack__(stream=-1): the op runs on the caller's stream, and the default-stream wait that
    a plain __dlpack__() adds would break CUDA-graph capture."""
    out, bits = {}, {}
    for k, v in tensors.items():
        if v is None:
            continue
        if isinstance(v, np.ndarray):
            if v.dtype.name == "bfloat16":
                v, bits[k] = v.view(np.uint16), "bf16"
            elif v.dtype.name == "float8_e4m3fn":
                v, bits[k] = v.view(np.uint8), "f8"
        elif _library(v) == "torch":
            if v.requires_grad:
                v = v.detach()
            if str(v.dtype) == "torch.float8_e4m3fn":
                import torch
                v, bits[k] = v.view(torch.uint8), "f8"
            v = _export(v, k)
        elif _library(v) == "cupy":
            v = _export(v, k)
        out[k] = v
    return out, bits


def _export(v, name):
    try:
        return v.__dlpack__(stream=-1)
    except BufferError as e:  # e.g. a torch tensor of another CUDA device than the current
        raise ValueError(f"{name} cannot be exported through DLPack: {e}") from None
    except (TypeError, ValueError, AssertionError):  # a producer without stream=-1
        return v


def _current(like):
    """Context making like's CUDA device current (torch and cupy export only arrays of the
    current device)."""
    lib = _library(like)
    if lib == "torch" and like.device.type == "cuda":
        import torch
        if like.device.index != torch.cuda.current_device():
            return torch.cuda.device(like.device)
    elif lib == "cupy":
        return like.device
    return contextlib.nullcontext()


def _empty(like, shape):
    """An uninitialised array of like's dtype on like's device, from like's framework."""
    lib = _library(like)
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=like.dtype)
    if lib == "torch":
        import torch
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if lib == "cupy":
        import cupy
        with like.device:
            return cupy.empty(shape, dtype=like.dtype)
    raise ValueError(
        f"out is None but x is a {type(like).__name__}; fusedmlp allocates outputs for numpy, "
        "torch and cupy arrays only: pass out= (an array of x's dtype on x's device)")


def _stream(like, stream):
    if stream is not None:
        return int(stream)
    if not _is_cuda(like):
        return 0
    if _library(like) == "torch":
        import torch
        return torch.cuda.current_stream(like.device).cuda_stream
    import cupy
    return cupy.cuda.get_current_stream().ptr


_CUPY_WORKSPACES = {}


def _cupy_workspace(nbytes, device_type, device_id, kind="op"):
    import cupy
    size = _workspace_bytes(nbytes)
    key = (device_id, size, kind)
    if key not in _CUPY_WORKSPACES:
        with cupy.cuda.Device(device_id):
            _CUPY_WORKSPACES[key] = cupy.zeros(size, dtype=cupy.uint8)
    return _CUPY_WORKSPACES[key]


def _workspace_bytes(nbytes):
    """Sizes rounded up to a power of two (at least 4 KiB): few distinct cached buffers."""
    return max(4096, 1 << (int(nbytes) - 1).bit_length())


def _workspace(like, workspace, kind="op"):
    """The workspace argument for _ext: the caller's array, or an allocator that gives a cached,
    zero-filled buffer of like's framework (host calls use the extension's own buffer). kind
    "moe" keeps the moe op's buffers apart: they carry its bad-expert-id count, which the other
    ops' kernels would read as dirty scratch."""
    if workspace is not None:
        return _export(workspace, "workspace") if _library(workspace) in ("torch",
                                                                           "cupy") else workspace
    if not _is_cuda(like):
        return None
    if _library(like) == "torch":
        from .torch import _cached_workspace
        return lambda nbytes, device_type, device_id: _export(
            _cached_workspace(like.device, nbytes, kind), "workspace")
    return lambda nbytes, device_type, device_id: _export(
        _cupy_workspace(nbytes, device_type, device_id, kind), "workspace")


def _rows_out(x, w2, out, name):
    if out is not None:
        return out
    shape = getattr(w2, "shape", None)
    if shape is None or len(shape) not in (1, 2):
        raise ValueError(f"{name} has shape {shape}; expected a 2-D array")
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"x has shape {getattr(x, 'shape', None)}; expected [M, d_in]")
    return _empty(x, (x.shape[0], shape[0]))


def _mlp(mode, x, w1, w2, b1, w_up, b_up, b2, residual, norm_weight, norm_bias, w1_scale,
         w_up_scale, w2_scale, activation, gated, norm, eps, out, backend, deterministic,
         workspace, stream):
    config = (_lookup(_ACTIVATIONS, "activation", activation), bool(gated),
              _lookup(_NORMS, "norm", norm), float(eps), bool(deterministic),
              _lookup(_BACKENDS, "backend", backend))
    y = _rows_out(x, w2, out, "w2")
    with _current(x):
        tensors, bits = _prepare(dict(
            out=y, x=x, residual=residual, w1=w1, w1_scale=w1_scale, b1=b1, w_up=w_up,
            w_up_scale=w_up_scale, b_up=b_up, w2=w2, w2_scale=w2_scale, b2=b2,
            norm_weight=norm_weight, norm_bias=norm_bias))
        result = _ext.mlp(mode, tensors, bits, *config, _workspace(x, workspace),
                          _stream(x, stream))
    return y if mode == "run" else result


def mlp(x: Array, w1: Array, w2: Array, *, b1: Optional[Array] = None, w_up: Optional[Array] = None,
        b_up: Optional[Array] = None, b2: Optional[Array] = None, residual: Optional[Array] = None,
        norm_weight: Optional[Array] = None, norm_bias: Optional[Array] = None,
        w1_scale: Optional[Array] = None, w_up_scale: Optional[Array] = None,
        w2_scale: Optional[Array] = None, activation: str = "gelu", gated: bool = False,
        norm: Optional[str] = None, eps: float = 1e-5, out: Optional[Array] = None,
        backend: str = "auto", deterministic: bool = False, workspace: Optional[Array] = None,
        stream: Optional[int] = None) -> Array:
    """Runs the fused FFN block (pre-norm, up/gate projection, activation, down projection,
    residual) on x's device and returns y.

    For each row x_i of x::

        xn = norm(x_i)         none | LayerNorm(gamma, beta, eps) | RMSNorm(gamma, eps)
        dense: h = act(W1 xn + b1)                     W1: [hidden, d_in] (nn.Linear: [out, in])
        gated: h = act(Wg xn + bg) * (Wu xn + bu)
        y_i = [residual_i +] W2 h + b2                 W2: [d_out, hidden]

    Accumulation is float32 or wider.

    Parameters
    ----------
    x : array
        [M, d_in] activations: float32, float16 or bfloat16. Rows may be strided (x[::2]), the
        last dimension must be contiguous. M may be 0.
    w1 : array
        [hidden, d_in] (nn.Linear layout [out, in]); gated without ``w_up``: the stacked
        [2*hidden, d_in], gate rows first, then up rows. float32, float16, bfloat16 or
        float8_e4m3fn (then ``w1_scale`` is required).
    w2 : array
        [d_out, hidden], same dtype rules as w1.
    b1, b_up, b2 : array, optional
        Biases [hidden] (b1 [2*hidden] with a stacked w1), [hidden], [d_out]: float32, float16
        or bfloat16.
    w_up : array, optional
        Gated only: the up projection [hidden, d_in], w1 then holds the gate alone.
    residual : array, optional
        [M, d_out] in x's dtype, added to the output.
    norm_weight, norm_bias : array, optional
        The pre-norm's gamma (absent: 1) and beta (layernorm only; absent: 0), [d_in].
    w1_scale, w_up_scale, w2_scale : array, optional
        float32 dequantisation scales of float8_e4m3fn weights, [1] (per tensor), [rows]
        (per output row) or [ceil(rows / 128), ceil(cols / 128)] (per 128 x 128 block, as
        fine-grained fp8 checkpoints store ``weight_scale_inv``; ref and cpu backends);
        quantize_fp8 makes them. W is read as ``q * scale``. A stacked gated w1 takes block
        scales [2 * ceil(hidden / 128), ceil(d_in / 128)]: the gate's block rows, then the up's
        (``torch.cat`` of gate_proj's and up_proj's scales, or quantize_fp8(w1, block=True,
        gate_up=True)), whatever hidden is; w1_scale and w_up_scale are both block scales or
        neither.
    activation : {"gelu", "gelu_tanh", "relu", "relu2", "silu"}
        gelu is the erf form, gelu_tanh the tanh approximation, relu2 max(x, 0)^2. Gated silu
        is SwiGLU, gated gelu GeGLU.
    gated : bool
        False: dense, h = act(W1 xn + b1); True: h = act(Wg xn + bg) * (Wu xn + bu).
    norm : {None, "layernorm", "rmsnorm"}
        The pre-norm applied to each row of x.
    eps : float
        The norm's epsilon, > 0 when norm is set.
    out : array, optional
        The output, written in place and returned; allocated (x's dtype, on x's device) for
        numpy, torch and cupy x when None. May be ``residual`` itself (in-place residual add).
    backend : {"auto", "ref", "cpu", "cuda"}
        "auto": cuda for device arrays, else cpu where the CPU has AVX2/FMA/F16C, else ref.
    deterministic : bool
        Bitwise-identical results on reruns (on CUDA it may cost speed).
    workspace : array, optional
        CUDA memory of at least mlp_workspace_size() bytes on x's device, zero-filled before
        its first use; every call leaves its counters zero (see the module docstring). By
        default one is allocated through x's framework and cached per (device, size).
    stream : int, optional
        The cudaStream_t to run on; by default the current stream of x's framework. Ignored on
        the host.

    Returns
    -------
    array
        y [M, d_out] in x's dtype: ``out`` when given. On CUDA the call is asynchronous: y is
        ready when ``stream`` reaches it.

    Raises
    ------
    ValueError
        A bad argument: a shape, dtype, stride, alignment, device or value the op does not
        take (the message names the argument, what was expected and what came).
    NotImplementedError
        The backend is not available here (not built, no GPU, no AVX2), or none of its kernels
        handles this valid request.
    RuntimeError
        A CUDA call failed.
    MemoryError
        The workspace or output could not be allocated.

    See Also
    --------
    pack : the same op on weights packed once.
    explain : which kernel would run and why.
    """
    return _mlp("run", x, w1, w2, b1, w_up, b_up, b2, residual, norm_weight, norm_bias,
                w1_scale, w_up_scale, w2_scale, activation, gated, norm, eps, out, backend,
                deterministic, workspace, stream)


def explain(x: Array, w1: Array, w2: Array, *, b1: Optional[Array] = None,
            w_up: Optional[Array] = None, b_up: Optional[Array] = None, b2: Optional[Array] = None,
            residual: Optional[Array] = None, norm_weight: Optional[Array] = None,
            norm_bias: Optional[Array] = None, w1_scale: Optional[Array] = None,
            w_up_scale: Optional[Array] = None, w2_scale: Optional[Array] = None,
            activation: str = "gelu", gated: bool = False, norm: Optional[str] = None,
            eps: float = 1e-5, out: Optional[Array] = None, backend: str = "auto",
            deterministic: bool = False) -> str:
    """The dispatch report of mlp() for these arguments; runs nothing.

    Parameters
    ----------
    x, w1, w2, b1, w_up, b_up, b2, residual, norm_weight, norm_bias, w1_scale, w_up_scale, \
w2_scale, activation, gated, norm, eps, out, backend, deterministic
        As for mlp().

    Returns
    -------
    str
        The kernel that would run and, for every other candidate of the backend, why it was
        passed over.

    Raises
    ------
    ValueError
        A bad argument, as mlp() would raise it.
    NotImplementedError
        The backend is not available here.
    """
    return _mlp("explain", x, w1, w2, b1, w_up, b_up, b2, residual, norm_weight, norm_bias,
                w1_scale, w_up_scale, w2_scale, activation, gated, norm, eps, out, backend,
                deterministic, None, 0)


def mlp_workspace_size(x: Array, w1: Array, w2: Array, *, b1: Optional[Array] = None,
                       w_up: Optional[Array] = None, b_up: Optional[Array] = None,
                       b2: Optional[Array] = None, residual: Optional[Array] = None,
                       norm_weight: Optional[Array] = None, norm_bias: Optional[Array] = None,
                       w1_scale: Optional[Array] = None, w_up_scale: Optional[Array] = None,
                       w2_scale: Optional[Array] = None, activation: str = "gelu",
                       gated: bool = False, norm: Optional[str] = None, eps: float = 1e-5,
                       out: Optional[Array] = None, backend: str = "auto",
                       deterministic: bool = False) -> int:
    """Bytes of workspace mlp() needs for these arguments.

    Parameters
    ----------
    x, w1, w2, b1, w_up, b_up, b2, residual, norm_weight, norm_bias, w1_scale, w_up_scale, \
w2_scale, activation, gated, norm, eps, out, backend, deterministic
        As for mlp().

    Returns
    -------
    int
        The size in bytes (0 on the host backends).

    Raises
    ------
    ValueError
        A bad argument, as mlp() would raise it.
    NotImplementedError
        The backend is not available here, or none of its kernels handles the request.
    """
    return _mlp("workspace_size", x, w1, w2, b1, w_up, b_up, b2, residual, norm_weight,
                norm_bias, w1_scale, w_up_scale, w2_scale, activation, gated, norm, eps, out,
                backend, deterministic, None, 0)


class PackedMlp:
    """mlp weights validated and copied once into the layout the backend reads fastest.

    Made by pack(); calling it runs the mlp op with only x (and a residual) per call. The
    packed copy lives on the weights' device and is independent of the arrays it was made from.

    Attributes
    ----------
    d_in, hidden, d_out : int
        The shapes: x [M, d_in] -> y [M, d_out] through h [M, hidden].
    device : str
        ``"cpu"`` or ``"cuda:N"``.
    activation : str
    gated : bool
    norm : str or None
        The options the pack was made with.
    """

    def __init__(self, handle, activation, gated, norm):
        self._handle = handle
        self.activation, self.gated, self.norm = activation, gated, norm

    d_in = property(lambda self: self._handle.d_in)
    hidden = property(lambda self: self._handle.hidden)
    d_out = property(lambda self: self._handle.d_out)
    device = property(lambda self: self._handle.device, doc="'cpu' or 'cuda:N'")

    def _run(self, mode, x, residual, out, workspace, stream):
        y = out
        if y is None:
            if getattr(x, "ndim", None) != 2:
                raise ValueError(f"x has shape {getattr(x, 'shape', None)}; expected [M, d_in]")
            y = _empty(x, (x.shape[0], self.d_out))
        with _current(x):
            tensors, bits = _prepare(dict(out=y, x=x, residual=residual))
            result = self._handle.run(mode, tensors, bits,
                                      None if mode != "run" else _workspace(x, workspace),
                                      _stream(x, stream) if mode == "run" else 0)
        return y if mode == "run" else result

    def __call__(self, x: Array, residual: Optional[Array] = None, *, out: Optional[Array] = None,
                 workspace: Optional[Array] = None, stream: Optional[int] = None) -> Array:
        """y = mlp(x) [+ residual] with the packed weights.

        Parameters
        ----------
        x : array
            [M, d_in] on the pack's device: float32, float16 or bfloat16 (with float8 weights
            a 16-bit dtype).
        residual : array, optional
            [M, d_out] in x's dtype, added to the output.
        out : array, optional
            [M, d_out] in x's dtype, written and returned (may be residual itself); allocated
            for numpy, torch and cupy x when None.
        workspace, stream
            As for mlp().

        Returns
        -------
        array
            y [M, d_out] in x's dtype (asynchronous on CUDA).

        Raises
        ------
        ValueError
            x, residual or out do not fit the pack (shape, dtype, device, strides).
        NotImplementedError
            None of the backend's kernels handles this call.
        RuntimeError
            A CUDA call failed.
        """
        return self._run("run", x, residual, out, workspace, stream)

    def workspace_size(self, x: Array, out: Optional[Array] = None) -> int:
        """Bytes of workspace a call with this x (and out) needs.

        Parameters
        ----------
        x, out : array
            As for a call.

        Returns
        -------
        int
            The size in bytes (0 on the host backends).

        Raises
        ------
        ValueError
            x or out do not fit the pack.
        """
        return self._run("workspace_size", x, None, out, None, None)

    def explain(self, x: Array, out: Optional[Array] = None) -> str:
        """The dispatch report of a call with this x; runs nothing.

        Parameters
        ----------
        x, out : array
            As for a call.

        Returns
        -------
        str
            The entry that runs and why (on CUDA, the entry timed fastest for this token count
            when the weights were packed, or the fixed rule), every other entry and why it was
            passed over.

        Raises
        ------
        ValueError
            x or out do not fit the pack.
        """
        return self._run("explain", x, None, out, None, None)

    def __repr__(self):
        kind = "gated " if self.gated else ""
        return (f"PackedMlp({self.d_in} -> {self.hidden} -> {self.d_out}, {kind}"
                f"{self.activation}, norm={self.norm}, on {self.device})")


def pack(w1: Array, w2: Array, *, b1: Optional[Array] = None, w_up: Optional[Array] = None,
         b_up: Optional[Array] = None, b2: Optional[Array] = None,
         norm_weight: Optional[Array] = None, norm_bias: Optional[Array] = None,
         w1_scale: Optional[Array] = None, w_up_scale: Optional[Array] = None,
         w2_scale: Optional[Array] = None, activation: str = "gelu", gated: bool = False,
         norm: Optional[str] = None, eps: float = 1e-5, backend: str = "auto",
         deterministic: bool = False, stream: Optional[int] = None) -> "PackedMlp":
    """Validates and packs mlp weights once, for many calls with only x (and a residual).

    The weights are copied into the layout the backend's kernels read fastest, on the weights'
    device; the pack owns that copy. On CUDA, packing also times the kernels that take the packed
    MLP at decode token counts (M = 1 .. 64) once per shape and device in the process, and calls
    then run the fastest for their M (deterministic mode, or FMLP_PLAN_TUNE=0, keeps the fixed
    rules; PackedMlp.explain says which decided). This synchronises the device: packing is not
    capturable in a CUDA graph.

    Parameters
    ----------
    w1, w2, b1, w_up, b_up, b2, norm_weight, norm_bias, w1_scale, w_up_scale, w2_scale
        The weights, as for mlp(); their shapes define d_in, hidden and d_out.
    activation, gated, norm, eps, backend, deterministic
        As for mlp(); fixed for the pack.
    stream : int, optional
        The cudaStream_t the copy is made on (default: the framework's current stream); the
        source arrays must stay alive until that stream reaches it.

    Returns
    -------
    PackedMlp
        The packed weights, callable as ``packed(x, residual)``.

    Raises
    ------
    ValueError
        A bad weight (shape, dtype, stride, scale) or option; the message names it.
    NotImplementedError
        The backend is not available, or none of its kernels takes these weights.
    RuntimeError
        A CUDA call failed.
    MemoryError
        The packed copy could not be allocated.
    """
    with _current(w1):
        tensors, bits = _prepare(dict(w1=w1, w1_scale=w1_scale, b1=b1, w_up=w_up,
                                      w_up_scale=w_up_scale, b_up=b_up, w2=w2,
                                      w2_scale=w2_scale, b2=b2, norm_weight=norm_weight,
                                      norm_bias=norm_bias))
        handle = _ext.PackedMlp(tensors, bits, _lookup(_ACTIVATIONS, "activation", activation),
                                bool(gated), _lookup(_NORMS, "norm", norm), float(eps),
                                bool(deterministic), _lookup(_BACKENDS, "backend", backend),
                                _stream(w1, stream))
    return PackedMlp(handle, activation, bool(gated), norm)


def _shape(a):
    shape = getattr(a, "shape", None)
    return None if shape is None else tuple(int(n) for n in shape)


def _routing_ids(ids, num_experts):
    """topk_ids as the int32 array the op reads. Other integer dtypes (torch.topk gives int64)
    are cast; a value that int32 cannot hold is reported on the host, and on a CUDA device
    (where reading it would synchronise) clamped to [-1, num_experts], which keeps it out of
    range: its token's row becomes NaN and the workspace counts it (moe_device_errors)."""
    lib = _library(ids)
    if isinstance(ids, np.ndarray):
        if ids.dtype == np.int32 or ids.dtype.kind not in "iu":
            return ids  # a non-integer dtype is reported by the extension, naming topk_ids
        if ids.size and (ids.min() < -2**31 or ids.max() >= 2**31):
            bad = ids.max() if ids.max() >= 2**31 else ids.min()
            raise ValueError(f"topk_ids holds {int(bad)}; expert ids must be in [0, "
                             f"{num_experts}) (num_experts = w1.shape[0])")
        return np.ascontiguousarray(ids, dtype=np.int32)
    if lib == "torch":
        import torch
        if ids.dtype == torch.int32 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            return ids
        if ids.device.type == "cuda":
            return ids.clamp(-1, num_experts).to(torch.int32)
        if ids.numel() and (int(ids.min()) < -2**31 or int(ids.max()) >= 2**31):
            bad = int(ids.max()) if int(ids.max()) >= 2**31 else int(ids.min())
            raise ValueError(f"topk_ids holds {bad}; expert ids must be in [0, {num_experts}) "
                             "(num_experts = w1.shape[0])")
        return ids.to(torch.int32)
    if lib == "cupy":
        import cupy
        if ids.dtype == cupy.int32 or ids.dtype.kind not in "iu":
            return ids
        return cupy.clip(ids, -1, num_experts).astype(cupy.int32)
    return ids


def _routing_weights(w):
    """topk_weights as float32 (routers often give them in the model's dtype)."""
    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(w, dtype=np.float32) if w.dtype.kind == "f" else w
    if _library(w) == "torch":
        import torch
        return w.float() if w.dtype.is_floating_point and w.dtype != torch.float32 else w
    if _library(w) == "cupy":
        return w.astype("float32") if w.dtype.kind == "f" and w.dtype.name != "float32" else w
    return w


def _expert_range(first_expert, global_experts):
    for name, v in (("first_expert", first_expert), ("global_experts", global_experts)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name} is {v!r}; expected an int")
    return int(first_expert), int(global_experts)


def _run_moe(mode, x, w1, w2, router_w, router_b, topk_ids, topk_weights, top_k, b1, b2,
             residual, activation, gated, scoring, renormalize, deterministic, out, backend,
             workspace, stream, first_expert=0, global_experts=0, round_router_logits=False,
             w1_scale=None, w2_scale=None):
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise ValueError(f"top_k is {top_k!r}; expected an int, the experts per token")
    top_k = int(top_k)
    first_expert, global_experts = _expert_range(first_expert, global_experts)
    config = (_lookup(_ACTIVATIONS, "activation", activation), bool(gated),
              _lookup(_SCORINGS, "scoring", scoring), bool(renormalize), bool(deterministic),
              first_expert, global_experts, bool(round_router_logits),
              _lookup(_BACKENDS, "backend", backend))
    w1_shape, w2_shape, x_shape = _shape(w1), _shape(w2), _shape(x)
    if w1_shape is None or len(w1_shape) != 3:
        raise ValueError(f"w1 has shape {w1_shape}; expected [num_experts, hidden, d] (gated: "
                         "[num_experts, 2*hidden, d], gate rows then up rows)")
    if w2_shape is None or len(w2_shape) != 3:
        raise ValueError(f"w2 has shape {w2_shape}; expected [num_experts, d_out, hidden]")
    if x_shape is None or len(x_shape) != 2:
        raise ValueError(f"x has shape {x_shape}; expected [T, d] (flatten leading dims)")
    num_experts = global_experts if global_experts > 0 else w1_shape[0]  # routed over; the
    # library reports a negative global_experts
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k is {top_k}; expected 1 <= top_k <= num_experts = {num_experts} "
                         + ("(global_experts)" if global_experts > 0 else "(w1.shape[0])"))
    if (topk_ids is None) != (topk_weights is None):
        given, missing = (("topk_ids", "topk_weights") if topk_weights is None
                          else ("topk_weights", "topk_ids"))
        raise ValueError(f"{given} is given but {missing} is None; pass both to give the "
                         "routing, or neither (and router_w) to run the router")
    if topk_ids is not None and router_w is not None:
        raise ValueError("both router_w and topk_ids are given; pass the router or the routing, "
                         "not both")
    if topk_ids is None and router_w is None:
        raise ValueError("router_w is None and topk_ids is None; pass the router weights "
                         "[num_experts, d] or the routing (topk_ids and topk_weights "
                         "[T, top_k])")
    if topk_ids is not None:
        topk_ids = _routing_ids(topk_ids, num_experts)
        topk_weights = _routing_weights(topk_weights)
    y = out if out is not None else _empty(x, (x_shape[0], w2_shape[1]))
    with _current(x):
        tensors, bits = _prepare(dict(
            out=y, x=x, residual=residual, router_w=router_w, router_b=router_b,
            topk_ids=topk_ids, topk_weights=topk_weights, w1=w1, b1=b1, w2=w2, b2=b2,
            w1_scale=w1_scale, w2_scale=w2_scale))
        result = _ext.moe(mode, tensors, bits, top_k, *config,
                          _workspace(x, workspace, "moe") if mode == "run" else None,
                          _stream(x, stream) if mode == "run" else 0)
    return y if mode == "run" else result


def moe(x: Array, w1: Array, w2: Array, *, router_w: Optional[Array] = None,
        router_b: Optional[Array] = None, topk_ids: Optional[Array] = None,
        topk_weights: Optional[Array] = None, top_k: int, b1: Optional[Array] = None,
        b2: Optional[Array] = None, residual: Optional[Array] = None, activation: str = "silu",
        gated: bool = True, scoring: str = "softmax", renormalize: bool = True,
        deterministic: bool = False, out: Optional[Array] = None, backend: str = "auto",
        workspace: Optional[Array] = None, stream: Optional[int] = None, first_expert: int = 0,
        global_experts: int = 0, round_router_logits: bool = False,
        w1_scale: Optional[Array] = None, w2_scale: Optional[Array] = None) -> Array:
    """Runs the mixture-of-experts op (router, top-k, stacked expert MLPs, weighted sum) on x's
    device and returns y.

    For each token x_t (row of x [T, d])::

        routing, by the router (router_w given):
            logits = Wr x_t + br                     Wr: router_w [E, d], br: router_b [E]
            scores = softmax(logits) | sigmoid(logits)                          (scoring)
            e_1..e_k = the top_k largest scores, ties to the lower expert id; w_j = scores[e_j]
            renormalize: w_j /= sum_j w_j
        or given: e_j = topk_ids[t, j], w_j = topk_weights[t, j] (used as given; scoring and
            renormalize are ignored; an id may repeat, each occurrence counts)
        expert e, the mlp op without norm on stacked weights:
            dense: h = act(W1[e] x_t + b1[e])                   W1: [E, hidden, d]
            gated: h = act(gate) * up, [gate; up] = W1[e] x_t + b1[e]
                                                  W1: [E, 2*hidden, d], gate rows then up rows
            mlp_e(x_t) = W2[e] h + b2[e]                        W2: [E, d_out, hidden]
        y_t = [residual_t +] sum_j w_j mlp_{e_j}(x_t)           (summed in j order)

    A shared expert is an mlp() call whose output is passed as ``residual``. Accumulation is
    float32 or wider.

    Parameters
    ----------
    x : array
        [T, d] tokens: float32, float16 or bfloat16 (T may be 0).
    w1 : array
        [E, hidden, d] (gated: [E, 2*hidden, d], gate rows then up rows): float32, float16,
        bfloat16 or float8_e4m3fn (then ``w1_scale``); the cuda backend takes 16-bit experts.
    w2 : array
        [E, d_out, hidden], w1's dtype.
    router_w, router_b : array, optional
        The router [G, d] and its bias [G] (G: the global expert count, E without a local
        range): float32, float16 or bfloat16. Pass the router or the routing, not both.
    topk_ids, topk_weights : array, optional
        Given routing [T, top_k], contiguous, where x is: ids int32 (other integer dtypes are
        cast), weights float32 (other float dtypes are cast).
    top_k : int
        k, the experts per token, 1 <= top_k <= G.
    b1, b2 : array, optional
        Expert biases [E, hidden or 2*hidden] and [E, d_out].
    residual : array, optional
        [T, d_out] in x's dtype, added to the output.
    activation : {"silu", "gelu", "gelu_tanh", "relu", "relu2"}
        The experts' activation (gated silu: SwiGLU, as in Mixtral).
    gated : bool
        Whether W1 stacks [gate; up].
    scoring : {"softmax", "sigmoid"}
        The router's scores.
    renormalize : bool
        Divide the k router weights by their sum.
    deterministic : bool
        Bitwise-identical results on reruns (the cpu backend always is).
    out : array, optional
        [T, d_out] in x's dtype, written and returned (may be residual itself).
    backend : {"auto", "ref", "cpu", "cuda"}
        As for mlp().
    workspace, stream
        As for mlp(); the moe op's cached workspaces are kept apart from the other ops' (they
        carry its count of bad device expert ids).
    first_expert, global_experts : int
        Expert parallelism: w1/b1/w2/b2 hold the experts [first_expert, first_expert + E) of
        global_experts (0: all experts are local). Routing is over all global experts; slots
        of other experts add nothing, so the outputs of ranges covering every expert sum to the
        whole op (pass residual to one of them; fusedmlp.tp does this over a process group).
    round_router_logits : bool
        Round the logits to x's dtype (float16/bfloat16) before scoring, as a 16-bit nn.Linear
        router produces them (Hugging Face Mixtral, Qwen-MoE), so the routing matches such a
        model's (exact ties of rounded logits aside).
    w1_scale, w2_scale : array, optional
        float32 scales of float8_e4m3fn experts, [E] (one per expert), [E, rows] (one per
        row) or [E, ceil(rows / 128), ceil(cols / 128)] (one per 128 x 128 block; ref and cpu
        backends); W[e][r] is read as ``q * scale[e][r]``. Gated block scales of w1 are
        [E, 2 * ceil(hidden / 128), ceil(d / 128)]: each expert's gate block rows, then its up
        block rows.

    Returns
    -------
    array
        y [T, d_out] in x's dtype: ``out`` when given (asynchronous on CUDA).

    Raises
    ------
    ValueError
        A bad argument (the message names it), among them host expert ids outside [0, G)
        (naming the token and the value). Device ids cannot be read without a
        synchronisation: such a token's row of y is written as NaN and the event is counted in
        the workspace (moe_device_errors reads the count).
    NotImplementedError
        The backend is not available, or none of its kernels handles the request.
    RuntimeError
        A CUDA call failed.
    """
    return _run_moe("run", x, w1, w2, router_w, router_b, topk_ids, topk_weights, top_k, b1,
                    b2, residual, activation, gated, scoring, renormalize, deterministic, out,
                    backend, workspace, stream, first_expert, global_experts,
                    round_router_logits, w1_scale, w2_scale)


def moe_explain(x: Array, w1: Array, w2: Array, *, router_w: Optional[Array] = None,
                router_b: Optional[Array] = None, topk_ids: Optional[Array] = None,
                topk_weights: Optional[Array] = None, top_k: int, b1: Optional[Array] = None,
                b2: Optional[Array] = None, residual: Optional[Array] = None,
                activation: str = "silu", gated: bool = True, scoring: str = "softmax",
                renormalize: bool = True, deterministic: bool = False, out: Optional[Array] = None,
                backend: str = "auto", first_expert: int = 0, global_experts: int = 0,
                round_router_logits: bool = False, w1_scale: Optional[Array] = None,
                w2_scale: Optional[Array] = None) -> str:
    """The dispatch report of moe() for these arguments; runs nothing.

    Parameters
    ----------
    x, w1, w2, router_w, router_b, topk_ids, topk_weights, top_k, b1, b2, residual, \
activation, gated, scoring, renormalize, deterministic, out, backend, first_expert, \
global_experts, round_router_logits, w1_scale, w2_scale
        As for moe().

    Returns
    -------
    str
        The kernel that would run and why the others were passed over.

    Raises
    ------
    ValueError
        A bad argument, as moe() would raise it.
    NotImplementedError
        The backend is not available here.
    """
    return _run_moe("explain", x, w1, w2, router_w, router_b, topk_ids, topk_weights, top_k,
                    b1, b2, residual, activation, gated, scoring, renormalize, deterministic,
                    out, backend, None, None, first_expert, global_experts, round_router_logits,
                    w1_scale, w2_scale)


def moe_workspace_size(x: Array, w1: Array, w2: Array, *, router_w: Optional[Array] = None,
                       router_b: Optional[Array] = None, topk_ids: Optional[Array] = None,
                       topk_weights: Optional[Array] = None, top_k: int, b1: Optional[Array] = None,
                       b2: Optional[Array] = None, residual: Optional[Array] = None,
                       activation: str = "silu", gated: bool = True, scoring: str = "softmax",
                       renormalize: bool = True, deterministic: bool = False,
                       out: Optional[Array] = None, backend: str = "auto", first_expert: int = 0,
                       global_experts: int = 0, round_router_logits: bool = False,
                       w1_scale: Optional[Array] = None, w2_scale: Optional[Array] = None) -> int:
    """Bytes of workspace moe() needs for these arguments.

    Parameters
    ----------
    x, w1, w2, router_w, router_b, topk_ids, topk_weights, top_k, b1, b2, residual, \
activation, gated, scoring, renormalize, deterministic, out, backend, first_expert, \
global_experts, round_router_logits, w1_scale, w2_scale
        As for moe().

    Returns
    -------
    int
        The size in bytes.

    Raises
    ------
    ValueError
        A bad argument, as moe() would raise it.
    NotImplementedError
        The backend is not available, or none of its kernels handles the request.
    """
    return _run_moe("workspace_size", x, w1, w2, router_w, router_b, topk_ids, topk_weights,
                    top_k, b1, b2, residual, activation, gated, scoring, renormalize,
                    deterministic, out, backend, None, None, first_expert, global_experts,
                    round_router_logits, w1_scale, w2_scale)


def moe_device_errors(workspace: Array, *, stream: Optional[int] = None) -> int:
    """Reads and resets the count of out-of-range device expert ids in a moe workspace.

    Counts the ids outside [0, global experts) met by the cuda moe() calls that used this
    workspace since the last read (each such token's row of y was written as NaN).
    Synchronises ``stream``: call it outside CUDA-graph capture. For the workspaces fusedmlp
    caches itself, see fusedmlp.torch.moe_device_errors.

    Parameters
    ----------
    workspace : array
        The device array passed as ``workspace=`` to moe().
    stream : int, optional
        The stream of those calls (default: the framework's current stream).

    Returns
    -------
    int
        The count since the last read (then 0).

    Raises
    ------
    ValueError
        workspace is not device memory, or too small to be a moe workspace.
    RuntimeError
        A CUDA call failed.
    """
    with _current(workspace):
        return _ext.moe_device_errors(_export(workspace, "workspace")
                                      if _library(workspace) in ("torch", "cupy") else workspace,
                                      _stream(workspace, stream))


def _linear(mode, x, w, bias, w_scale, x_scale, out, backend, workspace, stream):
    if out is None and "float8" in str(getattr(x, "dtype", "")):
        raise ValueError(f"x has dtype {x.dtype} (W8A8): pass out= an array of the result dtype "
                         "(float32, float16 or bfloat16) on x's device")
    y = _rows_out(x, w, out, "w")
    with _current(x):
        tensors, bits = _prepare(dict(out=y, x=x, w=w, w_scale=w_scale, x_scale=x_scale,
                                      bias=bias))
        result = _ext.linear(mode, tensors, bits, _lookup(_BACKENDS, "backend", backend),
                             _workspace(x, workspace) if mode == "run" else None,
                             _stream(x, stream) if mode == "run" else 0)
    return y if mode == "run" else result


def linear(x: Array, w: Array, bias: Optional[Array] = None, *, w_scale: Optional[Array] = None,
           x_scale: Optional[Array] = None, out: Optional[Array] = None, backend: str = "auto",
           workspace: Optional[Array] = None, stream: Optional[int] = None) -> Array:
    """y = x w^T + bias on x's device.

    ::

        y[m, n] = sum_k x[m, k] w[n, k] + bias[n]
        W8A8 (torch._scaled_mm semantics), x and w float8_e4m3fn:
        y[m, n] = (x_scale[m] * w_scale[n]) * sum_k x[m, k] w[n, k] + bias[n]

    A float8 w alone is dequantised as ``w * w_scale``. M, N or K may be 0 (K = 0 gives
    y = bias, or 0). Accumulation is float32 or wider.

    Parameters
    ----------
    x : array
        [M, K]: float32, float16 or bfloat16 (y's dtype); W8A8: float8_e4m3fn with
        ``x_scale``.
    w : array
        [N, K] (nn.Linear layout; rows may be strided): float32, float16, bfloat16 or
        float8_e4m3fn (then ``w_scale``).
    bias : array, optional
        [N], float32, float16 or bfloat16.
    w_scale : array, optional
        float32 [1] (per tensor), [N] (per row) or [ceil(N / 128), ceil(K / 128)] (per 128 x 128
        block, as fine-grained fp8 checkpoints store ``weight_scale_inv``; x not float8; ref and
        cpu backends) scales of a float8 w.
    x_scale : array, optional
        float32 [1] or [M] (per token) scales of a float8 x (W8A8).
    out : array, optional
        [M, N], written and returned; required for a float8 x (float32, float16 or bfloat16),
        else allocated in x's dtype when None. May not overlap any input.
    backend : {"auto", "ref", "cpu", "cuda"}
        As for mlp().
    workspace, stream
        As for mlp().

    Returns
    -------
    array
        y [M, N]: ``out`` when given (asynchronous on CUDA).

    Raises
    ------
    ValueError
        A bad argument: a shape, dtype, stride, alignment, device or value the op does not
        take (the message names the argument, what was expected and what came).
    NotImplementedError
        The backend is not available here (not built, no GPU, no AVX2), or none of its kernels
        handles this valid request.
    RuntimeError
        A CUDA call failed.
    MemoryError
        The workspace or output could not be allocated.
    """
    return _linear("run", x, w, bias, w_scale, x_scale, out, backend, workspace, stream)


def linear_explain(x: Array, w: Array, bias: Optional[Array] = None, *,
                   w_scale: Optional[Array] = None, x_scale: Optional[Array] = None,
                   out: Optional[Array] = None, backend: str = "auto") -> str:
    """The dispatch report of linear() for these arguments; runs nothing.

    Parameters
    ----------
    x, w, bias, w_scale, x_scale, out, backend
        As for linear().

    Returns
    -------
    str
        The kernel that would run and why the others were passed over.

    Raises
    ------
    ValueError
        A bad argument, as linear() would raise it.
    NotImplementedError
        The backend is not available here.
    """
    return _linear("explain", x, w, bias, w_scale, x_scale, out, backend, None, None)


def linear_workspace_size(x: Array, w: Array, bias: Optional[Array] = None, *,
                          w_scale: Optional[Array] = None, x_scale: Optional[Array] = None,
                          out: Optional[Array] = None, backend: str = "auto") -> int:
    """Bytes of workspace linear() needs for these arguments.

    Parameters
    ----------
    x, w, bias, w_scale, x_scale, out, backend
        As for linear().

    Returns
    -------
    int
        The size in bytes (0 on the host backends).

    Raises
    ------
    ValueError
        A bad argument, as linear() would raise it.
    NotImplementedError
        The backend is not available, or none of its kernels handles the request.
    """
    return _linear("workspace_size", x, w, bias, w_scale, x_scale, out, backend, None, None)


def _softmax(mode, x, temperature, log, out, backend, workspace, stream):
    y = out if out is not None else _empty(x, tuple(x.shape))
    with _current(x):
        tensors, bits = _prepare(dict(out=y, x=x))
        result = _ext.softmax(mode, tensors, bits, float(temperature), bool(log),
                              _lookup(_BACKENDS, "backend", backend),
                              _workspace(x, workspace) if mode == "run" else None,
                              _stream(x, stream) if mode == "run" else 0)
    return y if mode == "run" else result


def softmax(x: Array, *, temperature: float = 1.0, out: Optional[Array] = None,
            backend: str = "auto", workspace: Optional[Array] = None,
            stream: Optional[int] = None) -> Array:
    """softmax(x / T) over the last dimension: y_i = exp(x_i / T) / sum_j exp(x_j / T).

    Non-finite inputs behave like PyTorch's kernels: a NaN or +Inf anywhere in a row, or a row
    of only -Inf, makes the whole row NaN; -Inf elements of an otherwise finite row give 0
    (log_softmax: -Inf).

    Parameters
    ----------
    x : array
        [rows, n] or [n]: float32, float16 or bfloat16. n = 0 or rows = 0 is a no-op.
    temperature : float
        T, finite and > 0 (1: plain softmax).
    out : array, optional
        x's shape and dtype, written and returned; may be x itself (in place) but may not
        overlap it otherwise. Allocated when None.
    backend : {"auto", "ref", "cpu", "cuda"}
        As for mlp().
    workspace, stream
        As for mlp().

    Returns
    -------
    array
        y in x's shape and dtype: ``out`` when given (asynchronous on CUDA).

    Raises
    ------
    ValueError
        A bad argument: a shape, dtype, stride, alignment, device or value the op does not
        take (the message names the argument, what was expected and what came).
    NotImplementedError
        The backend is not available here (not built, no GPU, no AVX2), or none of its kernels
        handles this valid request.
    RuntimeError
        A CUDA call failed.
    MemoryError
        The workspace or output could not be allocated.
    """
    return _softmax("run", x, temperature, False, out, backend, workspace, stream)


def log_softmax(x: Array, *, temperature: float = 1.0, out: Optional[Array] = None,
                backend: str = "auto", workspace: Optional[Array] = None,
                stream: Optional[int] = None) -> Array:
    """log_softmax(x / T) over the last dimension: y_i = x_i / T - log sum_j exp(x_j / T).

    Non-finite inputs behave like PyTorch's kernels: a NaN or +Inf anywhere in a row, or a row
    of only -Inf, makes the whole row NaN; -Inf elements of an otherwise finite row give 0
    (log_softmax: -Inf).

    Parameters
    ----------
    x : array
        [rows, n] or [n]: float32, float16 or bfloat16. n = 0 or rows = 0 is a no-op.
    temperature : float
        T, finite and > 0 (1: plain softmax).
    out : array, optional
        x's shape and dtype, written and returned; may be x itself (in place) but may not
        overlap it otherwise. Allocated when None.
    backend : {"auto", "ref", "cpu", "cuda"}
        As for mlp().
    workspace, stream
        As for mlp().

    Returns
    -------
    array
        y in x's shape and dtype: ``out`` when given (asynchronous on CUDA).

    Raises
    ------
    ValueError
        A bad argument: a shape, dtype, stride, alignment, device or value the op does not
        take (the message names the argument, what was expected and what came).
    NotImplementedError
        The backend is not available here (not built, no GPU, no AVX2), or none of its kernels
        handles this valid request.
    RuntimeError
        A CUDA call failed.
    MemoryError
        The workspace or output could not be allocated.
    """
    return _softmax("run", x, temperature, True, out, backend, workspace, stream)


def softmax_explain(x: Array, *, temperature: float = 1.0, log: bool = False,
                    out: Optional[Array] = None, backend: str = "auto") -> str:
    """The dispatch report of softmax() (log=False) or log_softmax() (log=True); runs nothing.

    Parameters
    ----------
    x, temperature, out, backend
        As for softmax().
    log : bool
        Report for log_softmax().

    Returns
    -------
    str
        The kernel that would run and why the others were passed over.

    Raises
    ------
    ValueError
        A bad argument, as softmax() would raise it.
    NotImplementedError
        The backend is not available here.
    """
    return _softmax("explain", x, temperature, log, out, backend, None, None)


def softmax_workspace_size(x: Array, *, temperature: float = 1.0, log: bool = False,
                           out: Optional[Array] = None, backend: str = "auto") -> int:
    """Bytes of workspace softmax() (log=False) or log_softmax() (log=True) needs.

    Parameters
    ----------
    x, temperature, out, backend
        As for softmax().
    log : bool
        For log_softmax().

    Returns
    -------
    int
        The size in bytes (0 on the host backends).

    Raises
    ------
    ValueError
        A bad argument, as softmax() would raise it.
    NotImplementedError
        The backend is not available, or none of its kernels handles the request.
    """
    return _softmax("workspace_size", x, temperature, log, out, backend, None, None)


def quantize_fp8(w: Array, *, per_row: bool = True, block: bool = False,
                 gate_up: bool = False) -> Tuple[Array, Array, float]:
    """Quantises host weights to float8_e4m3fn with float32 dequantisation scales,
    w ~= q * scale.

    Per tensor, per row, or per 128 x 128 block::

        amax  = max |w| over the finite values (NaN and +-Inf left out)
        scale = amax / 448 in float32 (448: the largest e4m3 value), or 1 when that is not > 0
        q     = e4m3(w / scale), rounded to nearest even; NaN stays NaN, +-Inf and anything
                past 448 saturate to +-448

    On finite input this is PyTorch's ``(w.float() / scale).clamp(-448, 448).to(float8_e4m3fn)``
    with ``scale = w.abs().amax() / 448``; the round trip q * scale is within half an e4m3 step
    of w. Quantise once at load time, then copy q and scale to the device.

    Parameters
    ----------
    w : array
        [rows, cols] on the host: float32, float16 or bfloat16 (numpy with ml_dtypes, or a CPU
        torch tensor), last dimension contiguous.
    per_row : bool
        One scale per row (output unit: a row's outliers then cost only that row precision),
        else one for the whole tensor.
    block : bool
        One scale per 128 x 128 block (edge blocks smaller): the layout of fine-grained fp8
        checkpoints (DeepSeek-V3, Qwen3 FP8), which linear(), mlp() and moe() take; overrides
        per_row.
    gate_up : bool
        With block: w is a stacked gated w1 [2 * hidden, cols] (gate rows, then up rows); each
        half is quantised apart and the scales stacked, [2 * ceil(hidden / 128),
        ceil(cols / 128)], the layout mlp() takes for a stacked w1 (and moe() per expert). A
        plain block quantisation of the stacked rows differs wherever hidden % 128 != 0, and
        can have the very same shape (hidden 200: [4, ...] either way), which the ops would
        accept and read as the halves' blocks: quantise a stacked w1 with gate_up=True.

    Returns
    -------
    q : array
        [rows, cols]: for numpy an ml_dtypes float8_e4m3fn array (its uint8 bits without
        ml_dtypes), for torch a torch.float8_e4m3fn tensor.
    scale : array
        float32 [rows] (per_row), [1], or [ceil(rows / 128), ceil(cols / 128)] (block; with
        gate_up [2 * ceil(rows / 256), ceil(cols / 128)]).
    amax : float
        The largest amax used.

    Raises
    ------
    ValueError
        w is not 2-D, or its dtype is not a float dtype the op takes; gate_up without block or
        with an odd row count.
    NotImplementedError
        w is device memory (quantise on the host).
    """
    shape = getattr(w, "shape", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"w has shape {shape}; expected [rows, cols]")
    if gate_up:
        if not block or shape[0] % 2:
            raise ValueError(f"gate_up=True takes block=True and a stacked [gate; up] w of even "
                             f"rows; got block={block}, {shape[0]} rows (per-row scales of a "
                             f"stacked w need no split: drop gate_up)")
        half = shape[0] // 2
        qg, sg, ag = quantize_fp8(w[:half], block=True)
        qu, su, au = quantize_fp8(w[half:], block=True)
        if _library(w) == "torch":
            import torch
            return torch.cat([qg, qu]), torch.cat([sg, su]), max(ag, au)
        return np.concatenate([qg, qu]), np.concatenate([sg, su]), max(ag, au)
    rows = shape[0] if per_row else 1
    sshape = ((-(-shape[0] // 128), -(-shape[1] // 128)) if block else (rows,))
    if _library(w) == "torch":
        import torch
        q = torch.empty(tuple(shape), dtype=torch.float8_e4m3fn)
        scale = torch.empty(sshape, dtype=torch.float32)
    else:
        try:
            import ml_dtypes
            q = np.empty(shape, dtype=ml_dtypes.float8_e4m3fn)
        except ImportError:
            q = np.empty(shape, dtype=np.uint8)
        scale = np.empty(sshape, dtype=np.float32)
    tensors, bits = _prepare(dict(w=w, q=q, scale=scale))
    if isinstance(q, np.ndarray) and q.dtype == np.uint8:
        bits["q"] = "f8"
    amax = _ext.quantize_fp8(tensors, bits)
    return q, scale, amax


def available(backend: str) -> Tuple[bool, str]:
    """Whether a backend can run here.

    Parameters
    ----------
    backend : {"auto", "ref", "cpu", "cuda"}

    Returns
    -------
    ok : bool
    reason : str
        Why not ("" when ok): not built, no GPU, the CPU lacks AVX2/FMA/F16C.

    Raises
    ------
    ValueError
        backend is not one of the names.
    """
    return _ext.available(_lookup(_BACKENDS, "backend", backend))


def build_info() -> str:
    """How the library was built.

    Returns
    -------
    str
        The version, CUDA on or off, and the GPU code it carries (nvcc version and -gencode).
    """
    return _ext.build_info()


def devices() -> List[str]:
    """The visible CUDA devices.

    Returns
    -------
    list of str
        One line per device ("cuda:0 NVIDIA H200, sm_90, 132 SMs, 139.8 GiB"); empty without
        CUDA.
    """
    return [line for line in _ext.devices().splitlines() if line]


class Knob(NamedTuple):
    """One FMLP_* environment knob (src/core/knobs.def; docs/tuning.md lists them all).

    Attributes
    ----------
    name : str
        The environment variable, e.g. ``"FMLP_PLAN_TUNE"``.
    kind : str
        ``"bool"`` (0 or 1), ``"int"``, ``"float"`` or ``"string"``.
    scope : str
        What reads it: ``"cuda"``, ``"dist"``, ``"python"``, ``"cli"`` or ``"test"``.
    default : str
        The value when unset, as the environment spells it; ``"auto"`` where the code decides
        per call, ``""`` for unset text.
    range : str
        What is accepted: ``"lo..hi"`` (inclusive), ``"a|b|c"`` or ``""`` (any text).
    purpose : str
        One sentence.
    env : str or None
        The environment's text now, None when unset or empty.
    value : str
        What applies now: ``env`` when accepted, else ``default``.
    error : str
        Why ``env`` is rejected, ``""`` when it is accepted or unset.
    """

    name: str
    kind: str
    scope: str
    default: str
    range: str
    purpose: str
    env: Optional[str]
    value: str
    error: str


def knobs() -> List[Knob]:
    """Every FMLP_* environment knob with the value that applies now.

    The library reads most knobs once, at their first use in the process; this reads the
    environment at the call (so a knob changed after its first use shows its new value here, not
    the one in effect).

    Returns
    -------
    list of Knob
        In the table's order (grouped by scope).
    """
    return [Knob(**k) for k in _ext.knobs()]


def knob(name: str) -> str:
    """The value of the environment knob ``name`` that applies now, validated by the library.

    Parameters
    ----------
    name : str
        An FMLP_* variable of the table (see knobs()).

    Returns
    -------
    str
        The environment's text when the library accepts it, else the knob's default (``"auto"``,
        ``"0"``, ``""`` ...). A rejected value is reported with a RuntimeWarning naming the
        variable, what it accepts and what came.

    Raises
    ------
    KeyError
        When ``name`` is not a knob.
    """
    k = _ext.knob(name)
    if k["error"]:
        warnings.warn(f"fusedmlp: {k['error']}", RuntimeWarning, stacklevel=2)
    return k["value"]


def info() -> str:
    """A report of the library and this machine, as ``fusedmlp info`` prints it in short.

    Returns
    -------
    str
        Lines for the version and build, the CUDA devices, each backend's availability, and
        every environment knob with its value and default (a rejected value with its error).
    """
    lines = [f"fusedmlp {__version__}", f"build:    {build_info()}"]
    found = devices()
    lines.append("gpus:     " + ("none found" if not found else ""))
    lines += [f"  {d}" for d in found]
    lines.append("backends:")
    for b in ("ref", "cpu", "cuda"):
        ok, why = available(b)
        lines.append(f"  {b:<5} {'available' if ok else 'unavailable: ' + why}")
    lines.append("knobs (FMLP_* environment variables; docs/tuning.md):")
    for k in knobs():
        default = k.default or "unset"
        note = k.error or (f"set; default {default}" if k.env is not None else
                           f"default {default}")
        lines.append(f"  {k.scope:<6} {k.name:<28} {k.value or 'unset':<8} ({note})")
    return "\n".join(lines)


def kernels(op: str = "mlp") -> List[Tuple[str, str]]:
    """Every kernel of an op's table, in dispatch order.

    Parameters
    ----------
    op : {"mlp", "moe", "linear", "softmax"}

    Returns
    -------
    list of (str, str)
        (kernel name, backend name) pairs; the names are what explain() reports.

    Raises
    ------
    ValueError
        op is not one of the names.
    """
    return _ext.kernels(op)


def patch(model: Any, strict: bool = False, probe: Any = None, backend: str = "auto",
          fuse_norm: bool = True, tp_group: Any = None, linears: bool = False,
          moe: str = "fused", mode: str = "always") -> Any:
    """Swaps the MLP blocks of a Hugging Face model for fused ones, in place.

    Needs torch; the same as fusedmlp.torch.patch, which documents every argument in full.
    Each replaced block computes what the module did, checked on probe hidden states first:
    y = W2 (act(W1 norm(x) + b1) [* (W_up norm(x) + b_up)]) + b2 [+ x].

    Parameters
    ----------
    model : torch.nn.Module
        The model, changed in place.
    strict : bool
        Raise PatchError, leaving the model unchanged, when any probe fails; otherwise the
        failing blocks are skipped with the reason.
    probe : torch.Tensor, optional
        Hidden states [..., d_model] for the probes (default: 8 random rows, seeded).
    backend : {"auto", "ref", "cpu", "cuda"}
    fuse_norm : bool
        Also fuse the LayerNorm / RMSNorm whose output feeds only the block.
    tp_group : torch.distributed.ProcessGroup, optional
        Replace each block by this rank's tensor-parallel shard (fusedmlp.tp).
    linears : bool
        Also replace the attention projections and the LM head by FusedLinear modules.
    moe : {"fused", "experts"}
        How sparse-MoE blocks are replaced: FusedMoE, or the transformers experts registry.
    mode : {"always", "eager", "graph"}
        "always" replaces every block the probe accepts; "eager" / "graph" time each kind of
        block against the original as the model will run (host time included, or CUDA-graph
        replay) and keep the original where the fused module is not faster.

    Returns
    -------
    fusedmlp.torch.PatchReport
        What was replaced, what was not and why.

    Raises
    ------
    ImportError
        torch is not installed.
    fusedmlp.torch.PatchError
        With ``strict=True``, when a block cannot be replaced or a probe disagrees.
    ValueError
        moe or mode is not one of its names.
    NotImplementedError
        tp_group together with linears=True.
    """
    from .torch import patch as _patch
    return _patch(model, strict=strict, probe=probe, backend=backend, fuse_norm=fuse_norm,
                  tp_group=tp_group, linears=linears, moe=moe, mode=mode)


def register_experts(name: str = "fusedmlp") -> bool:
    """Registers fusedmlp as an experts implementation of transformers 5's experts registry.

    model.set_experts_implementation(name) (or from_pretrained(..., experts_implementation=name))
    then runs MoE experts through fusedmlp. Needs torch; see
    fusedmlp.torch.register_experts.

    Parameters
    ----------
    name : str
        The implementation's name in the registry.

    Returns
    -------
    bool
        True when registered, False when transformers has no experts registry.
    """
    from .torch import register_experts as _register
    return _register(name)
